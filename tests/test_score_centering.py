"""score_centering_correction: the gradient identity of docs/score_centering.md, checked against full-vocabulary math."""

import math

import pytest
import torch

from trl_rpp import score_centering_correction


def ref_correction(head_logps, sampler_head_logps, mask, min_tail_mass=1e-6):
    """Plain-loop float64 reference of sum_H (q_v - rho p_v) log p_v, rho = (1 - sum_H q) / (1 - sum_H p)."""
    out = []
    for b, row in enumerate(mask):
        out_row = []
        for t, m in enumerate(row):
            if not m:
                out_row.append(0.0)
                continue
            entries = [
                (lp, lq) for lp, lq in zip(head_logps[b][t], sampler_head_logps[b][t]) if lq != -math.inf and lq == lq
            ]
            sq = math.fsum(math.exp(lq) for _, lq in entries)
            sp = math.fsum(math.exp(lp) for lp, _ in entries)
            rho = max(1.0 - sq, 0.0) / max(1.0 - sp, min_tail_mass)
            out_row.append(math.fsum((math.exp(lq) - rho * math.exp(lp)) * lp for lp, lq in entries))
        out.append(out_row)
    return out


def expected_centered_score(p, q, head, y):
    """e_y - q_hat with q_hat = q on the head and rho * p elsewhere, over the full vocabulary."""
    in_head = torch.zeros_like(p, dtype=torch.bool)
    in_head[head] = True
    rho = (1 - q[in_head].sum()) / (1 - p[in_head].sum())
    e_y = torch.zeros_like(p)
    e_y[y] = 1
    return e_y - torch.where(in_head, q, rho * p)


def centered_loss_and_logits_grad(z, zq, y, A, k):
    """-A (log p_y - correction) for one position with trainer logits z [V] and sampler logits zq [V]."""
    z = z.clone().requires_grad_(True)
    logp = torch.log_softmax(z, -1)
    logq = torch.log_softmax(zq, -1)
    head = torch.topk(logq, k).indices
    corr = score_centering_correction(logp[head].view(1, 1, k), logq[head].view(1, 1, k), torch.ones(1, 1))
    loss = -A * (logp[y] - corr[0, 0])
    loss.backward()
    return z.grad, head


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("k", [1, 4, 16])
def test_gradient_is_minus_A_times_e_y_minus_q_hat(seed, k):
    g = torch.Generator().manual_seed(seed)
    V = 40
    z = torch.randn(V, generator=g, dtype=torch.float64) * 2
    zq = z + 0.3 * torch.randn(V, generator=g, dtype=torch.float64)  # a perturbed sampler
    y, A = int(torch.randint(V, (1,), generator=g)), 1.7
    grad, head = centered_loss_and_logits_grad(z, zq, y, A, k)
    p, q = torch.softmax(z, -1), torch.softmax(zq, -1)
    in_head = torch.zeros(V, dtype=torch.bool)
    in_head[head] = True
    rho = (1 - q[in_head].sum()) / (1 - p[in_head].sum())
    q_hat = torch.where(in_head, q, rho * p)
    e_y = torch.zeros(V, dtype=torch.float64)
    e_y[y] = 1.0
    torch.testing.assert_close(grad, -A * (e_y - q_hat), rtol=1e-10, atol=1e-12)
    assert abs(q_hat.sum().item() - 1.0) < 1e-12  # q_hat is a distribution


def test_on_a_tiny_model_in_float64(tmp_path):
    """Same identity through a real (tiny, float64) transformer's logits."""
    from transformers import AutoModelForCausalLM

    from trl_rpp.testing.tiny import build_tiny_model

    model = AutoModelForCausalLM.from_pretrained(build_tiny_model(tmp_path / "m"), dtype=torch.float64)
    ids = torch.tensor([[3, 4, 5, 6, 7]])
    logits = model(input_ids=ids).logits[0, -1]
    logits.retain_grad()
    sampler_logits = (logits.detach() + 0.05 * torch.randn_like(logits)).double()
    logp, logq = torch.log_softmax(logits, -1), torch.log_softmax(sampler_logits, -1)
    k, y, A = 8, 11, -0.6
    head = torch.topk(logq, k).indices
    corr = score_centering_correction(logp[head].view(1, 1, k), logq[head].view(1, 1, k), torch.ones(1, 1))
    (-A * (logp[y] - corr[0, 0])).backward()
    want = -A * expected_centered_score(logp.detach().exp(), logq.exp(), head, y)
    torch.testing.assert_close(logits.grad, want, rtol=1e-9, atol=1e-12)


def test_full_vocabulary_head_gives_the_exact_expected_score():
    # k = V: rho = 0 and the correction's gradient is E_q[grad log p] = sum_v q_v (e_v - p) = q - p exactly.
    g = torch.Generator().manual_seed(0)
    V = 30
    z = torch.randn(V, generator=g, dtype=torch.float64).requires_grad_(True)
    zq = torch.randn(V, generator=g, dtype=torch.float64)
    logp, logq = torch.log_softmax(z, -1), torch.log_softmax(zq, -1)
    ids = torch.arange(V)
    score_centering_correction(logp[ids].view(1, 1, V), logq[ids].view(1, 1, V), torch.ones(1, 1)).sum().backward()
    torch.testing.assert_close(z.grad, torch.softmax(zq, -1) - torch.softmax(z.detach(), -1), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("k", [1, 5, 30])
def test_q_equal_p_gives_zero_correction_gradient(k):
    # On policy: q = p, so rho = 1 and every coefficient q_v - p_v is 0: the loss is plain REINFORCE.
    g = torch.Generator().manual_seed(1)
    z = torch.randn(30, generator=g, dtype=torch.float64)
    grad, _ = centered_loss_and_logits_grad(z, z.clone(), y=3, A=2.0, k=k)
    e_y = torch.zeros(30, dtype=torch.float64)
    e_y[3] = 1
    torch.testing.assert_close(grad, -2.0 * (e_y - torch.softmax(z, -1)), rtol=1e-10, atol=1e-12)


def test_absent_entries_change_nothing_and_masked_positions_are_ignored():
    g = torch.Generator().manual_seed(2)
    B, T, k, V = 3, 5, 4, 20
    z = torch.randn(B, T, V, generator=g, dtype=torch.float64)
    zq = z + 0.2 * torch.randn(B, T, V, generator=g, dtype=torch.float64)
    logp, logq = torch.log_softmax(z, -1), torch.log_softmax(zq, -1)
    head = torch.topk(logq, k).indices
    lp, lq = logp.gather(-1, head), logq.gather(-1, head)
    mask = torch.tensor([[1, 1, 0, 1, 0], [1, 1, 1, 1, 1], [0, 0, 0, 0, 0]])
    base = score_centering_correction(lp, lq, mask)
    # Two extra absent entries (-inf) with arbitrary trainer log-probs: nothing changes.
    lp2 = torch.cat([lp, torch.full((B, T, 2), -3.0, dtype=torch.float64)], -1)
    lq2 = torch.cat([lq, torch.full((B, T, 2), -math.inf, dtype=torch.float64)], -1)
    assert torch.equal(score_centering_correction(lp2, lq2, mask), base)
    # NaN / Inf stored at masked positions: same result, zero there, finite gradients.
    lp3, lq3 = lp.clone(), lq.clone()
    lp3[~mask.bool()] = float("nan")
    lq3[~mask.bool()] = float("inf")
    lp3.requires_grad_(True)
    out = score_centering_correction(lp3, lq3, mask)
    assert torch.equal(out.detach(), base)
    assert torch.equal(out[~mask.bool()], torch.zeros_like(out[~mask.bool()]))
    out.sum().backward()
    assert torch.isfinite(lp3.grad).all()
    want = ref_correction(lp.tolist(), lq.tolist(), mask.tolist())
    torch.testing.assert_close(base, torch.tensor(want, dtype=torch.float64), rtol=1e-12, atol=1e-12)


def test_near_zero_tail_stays_finite():
    # The head holds all but 1e-13 of the trainer's mass: 1 - sum_H p is clamped, nothing is NaN or Inf.
    V = 10
    z = torch.full((V,), -40.0, dtype=torch.float64)
    z[0] = 0.0
    logp = torch.log_softmax(z, -1).requires_grad_(True)
    logq = torch.log_softmax(z + torch.linspace(0, 1, V, dtype=torch.float64), -1)
    out = score_centering_correction(logp[:1].view(1, 1, 1), logq[:1].view(1, 1, 1), torch.ones(1, 1))
    out.sum().backward()
    assert torch.isfinite(out).all() and torch.isfinite(logp.grad).all()
    f32 = score_centering_correction(logp[:1].float().view(1, 1, 1), logq[:1].float().view(1, 1, 1), torch.ones(1, 1))
    assert torch.isfinite(f32).all() and f32.dtype == torch.float32


def test_shape_errors():
    with pytest.raises(ValueError, match=r"\[B, T, k\]"):
        score_centering_correction(torch.zeros(2, 3), torch.zeros(2, 3), torch.ones(2, 3))


def _ppo_centered_logits_grad(z, zq, old_logp_y, y, A, k, eps=0.2):
    from trl_rpp import score_centered_ppo_loss

    z = z.clone().requires_grad_(True)
    logp, logq = torch.log_softmax(z, -1), torch.log_softmax(zq, -1)
    head = torch.topk(logq, k).indices
    loss = score_centered_ppo_loss(
        logp[y].view(1, 1), torch.tensor([[old_logp_y]], dtype=torch.float64), torch.tensor([[A]], dtype=torch.float64),
        torch.ones(1, 1), logp[head].view(1, 1, k), logq[head].view(1, 1, k), eps, eps,
    )
    loss.backward()
    centered = expected_centered_score(torch.softmax(z.detach(), -1), torch.softmax(zq, -1), head, y)
    return z.grad, centered, torch.exp(torch.log_softmax(z.detach(), -1)[y] - old_logp_y)


@pytest.mark.parametrize("shift,A,clipped", [(0.1, 1.0, False), (-0.1, -1.0, False), (0.5, 1.0, True), (-0.5, -1.0, True)])
def test_ppo_weight_multiplies_the_centered_score(shift, A, clipped):
    """Unclipped token: grad = -A * ratio * (e_y - q_hat). Clipped token: no gradient at all, correction included."""
    g = torch.Generator().manual_seed(3)
    z = torch.randn(25, generator=g, dtype=torch.float64)
    zq = z + 0.2 * torch.randn(25, generator=g, dtype=torch.float64)
    y = 4
    old = (torch.log_softmax(z, -1)[y] - shift).item()  # ratio = exp(shift)
    grad, centered_score, ratio = _ppo_centered_logits_grad(z, zq, old, y, A, k=6)
    if clipped:
        assert torch.equal(grad, torch.zeros_like(grad))
    else:
        torch.testing.assert_close(grad, -A * ratio * centered_score, rtol=1e-10, atol=1e-12)


def test_centered_ppo_equals_plain_ppo_on_policy():
    from trl_rpp import response_mean_ppo_loss, score_centered_ppo_loss

    g = torch.Generator().manual_seed(4)
    B, T, V, k = 4, 6, 30, 5
    z = torch.randn(B, T, V, generator=g, dtype=torch.float64, requires_grad=True)
    ids = torch.randint(V, (B, T), generator=g)
    mask = torch.rand(B, T, generator=g) < 0.8
    adv = torch.randn(B, T, generator=g, dtype=torch.float64)
    logp_all = torch.log_softmax(z, -1)
    logp = logp_all.gather(-1, ids.unsqueeze(-1)).squeeze(-1)
    old = logp.detach() + 0.05 * torch.randn(B, T, generator=g, dtype=torch.float64)
    head = torch.topk(logp_all.detach(), k).indices
    centered = score_centered_ppo_loss(logp, old, adv, mask, logp_all.gather(-1, head), logp_all.detach().gather(-1, head))
    (gc,) = torch.autograd.grad(centered, z, retain_graph=True)
    (gp,) = torch.autograd.grad(response_mean_ppo_loss(logp, old, adv, mask), z)
    torch.testing.assert_close(gc, gp, rtol=1e-10, atol=1e-13)


def trainer_and_sampler(seed, V, k, noise):
    """Trainer logits ``z`` (float64, with grad) over ``V`` tokens, log p, a sampler log q = log_softmax(z + noise *
    N(0, 1)), and the sampler's top-``k`` head ids."""
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(V, generator=g, dtype=torch.float64, requires_grad=True)
    zq = z.detach() + noise * torch.randn(V, generator=g, dtype=torch.float64)
    logp, logq = torch.log_softmax(z, -1), torch.log_softmax(zq, -1)
    return z, logp, logq, torch.topk(logq, k).indices


def modelled_sampler(logp, logq, head):
    """q_hat over the full vocabulary: q on the head, the trainer's tail rescaled by rho elsewhere."""
    p, q = logp.detach().exp(), logq.exp()
    in_head = torch.zeros(p.numel(), dtype=torch.bool)
    in_head[head] = True
    rho = (1 - q[in_head].sum()) / (1 - p[in_head].sum())
    return torch.where(in_head, q, rho * p)


TRUNCATE = lambda x: x.clamp(max=1.5)  # noqa: E731  (TRL's token_truncate with clip_max=1.5)
MASK = lambda x: torch.where(x <= 1.5, x, torch.zeros_like(x))  # noqa: E731  (token_mask with clip_max=1.5)


@pytest.mark.parametrize("f", [TRUNCATE, MASK], ids=["truncate", "mask"])
@pytest.mark.parametrize("k", [3, 10, 40])
def test_weighted_correction_is_the_expected_weighted_score_under_q_hat(f, k):
    """With an importance weight f on the sampled token's score, the correction's gradient w.r.t. the logits is
    E_q_hat[f(p/q_hat) (e_v - p)], computed here explicitly over the full vocabulary (k = V = 40 is exact q)."""
    z, logp, logq, head = trainer_and_sampler(seed=7, V=40, k=k, noise=0.5)
    corr = score_centering_correction(logp[head].view(1, 1, k), logq[head].view(1, 1, k), torch.ones(1, 1), weight_fn=f)
    corr.sum().backward()
    p, q_hat = logp.detach().exp(), modelled_sampler(logp, logq, head)
    weights = q_hat * f(p / q_hat)
    want = weights - weights.sum() * p  # sum_v q_hat_v f(p_v/q_hat_v) (e_v - p)
    torch.testing.assert_close(z.grad, want, rtol=1e-9, atol=1e-12)


def test_importance_weight_scales_the_surrogate_but_not_the_correction():
    from trl_rpp import score_centered_ppo_loss

    V, k, y, A = 30, 6, 2, 1.3
    z, logp, logq, head = trainer_and_sampler(seed=8, V=V, k=k, noise=0.3)
    w_is = TRUNCATE(torch.exp(logp.detach()[y] - logq[y])).view(1, 1)
    loss = score_centered_ppo_loss(
        logp[y].view(1, 1), logp.detach()[y].view(1, 1), torch.tensor([[A]], dtype=torch.float64), torch.ones(1, 1),
        logp[head].view(1, 1, k), logq[head].view(1, 1, k), importance_weights=w_is, weight_fn=TRUNCATE,
    )
    loss.backward()
    p, q_hat = logp.detach().exp(), modelled_sampler(logp, logq, head)
    weights = q_hat * TRUNCATE(p / q_hat)
    e_y = torch.zeros(V, dtype=torch.float64)
    e_y[y] = 1
    # ratio to pi_old is 1 here: grad = -A * (f(r_y) (e_y - p) - E_q_hat[f (e_v - p)])
    want = -A * (w_is[0, 0] * (e_y - p) - (weights - weights.sum() * p))
    torch.testing.assert_close(z.grad, want, rtol=1e-9, atol=1e-12)
    with pytest.raises(ValueError, match="go together"):
        score_centered_ppo_loss(logp[y].view(1, 1), logp.detach()[y].view(1, 1), torch.ones(1, 1), torch.ones(1, 1),
                                logp[head].view(1, 1, k), logq[head].view(1, 1, k), importance_weights=w_is)


def test_metric_sums_against_plain_loops():
    """`score_centering_metric_sums`: the head masses, the coefficients' L1 norm and |log q_y - log p_y| summed over
    valid tokens by plain float64 loops; NaN/Inf at masked positions and unreported sampled log-probs are skipped."""
    from trl_rpp.score_centering import score_centering_metric_sums

    g = torch.Generator().manual_seed(0)
    B, T, k = 2, 3, 2
    head = torch.log_softmax(torch.randn(B, T, 5, generator=g), -1)[..., :k]
    sampler_head = torch.log_softmax(torch.randn(B, T, 5, generator=g), -1)[..., :k]
    logps = torch.log(torch.rand(B, T, generator=g))
    sampler_logps = torch.log(torch.rand(B, T, generator=g))
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]], dtype=torch.bool)
    sampler_logps[0, 1] = float("-inf")  # the sampler did not report this sampled token
    for x in (head, sampler_head):
        x[0, 2] = float("nan")  # masked: never read
    logps[1, 2] = float("inf")
    per_token, sampled = score_centering_metric_sums(logps, head, sampler_head, sampler_logps, mask)

    q_mass = p_mass = l1 = diff = 0.0
    count = 0
    for b in range(B):
        for t in range(T):
            if not mask[b, t]:
                continue
            q = [math.exp(float(v)) for v in sampler_head[b, t]]
            p = [math.exp(float(v)) for v in head[b, t]]
            rho = max(1 - sum(q), 0.0) / max(1 - sum(p), 1e-6)
            q_mass, p_mass = q_mass + sum(q), p_mass + sum(p)
            l1 += sum(abs(qv - rho * pv) for qv, pv in zip(q, p))
            if math.isfinite(float(sampler_logps[b, t])):
                diff += abs(float(sampler_logps[b, t]) - float(logps[b, t]))
                count += 1
    assert per_token["score_centering/sampler_head_mass"].item() == pytest.approx(q_mass, rel=1e-6)
    assert per_token["score_centering/trainer_head_mass"].item() == pytest.approx(p_mass, rel=1e-6)
    assert per_token["score_centering/coeff_l1"].item() == pytest.approx(l1, rel=1e-6)
    assert sampled["sampler_logp_abs_diff"].item() == pytest.approx(diff, rel=1e-6)
    assert sampled["sampled"].item() == count == 2


def _l1_by_loops(head, sampler_head, mask, closed):
    """Float64 loops: the summed ``sum_H |q_v - rho p_v|`` over valid positions, ``rho = 1`` on closed heads."""
    total = 0.0
    for b in range(head.size(0)):
        for t in range(head.size(1)):
            if not mask[b, t]:
                continue
            q = [math.exp(float(v)) for v in sampler_head[b, t]]
            p = [math.exp(float(v)) for v in head[b, t]]
            rho = 1.0 if closed[b, t] else max(1 - sum(q), 0.0) / max(1 - sum(p), 1e-6)
            total += sum(abs(qv - rho * pv) for qv, pv in zip(q, p))
    return total


def test_coeff_l1_is_the_size_of_the_correction_zero_on_policy_and_growing_with_drift():
    """`score_centering/coeff_l1` measures the correction: 0 when sampler and trainer agree, over a head that holds the
    whole (replayed) support (where the loss's coefficients are ``q``, of L1 norm 1) as over a top-k head with a tail,
    and growing with the drift between them; equal to float64 loops on mixed closed and open heads."""
    from trl_rpp.score_centering import score_centering_metric_sums

    g = torch.Generator().manual_seed(1)
    B, T, k = 2, 4, 3
    base = torch.randn(B, T, 6, generator=g, dtype=torch.float64)
    direction = torch.randn(B, T, 6, generator=g, dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]], dtype=torch.bool)
    logps, sampler_logps = torch.zeros(B, T), torch.zeros(B, T)
    for closed_value in (True, False):
        closed = torch.full((B, T), closed_value)
        sizes = []
        for drift in (0.0, 0.05, 0.2, 0.8):
            if closed_value:  # the head is the whole kept set: both renormalized over it
                q = torch.log_softmax(base[..., :k], -1)
                p = torch.log_softmax(base[..., :k] + drift * direction[..., :k], -1)
            else:  # a top-k head of a 6-token vocabulary: both keep a tail
                q = torch.log_softmax(base, -1)[..., :k]
                p = torch.log_softmax(base + drift * direction, -1)[..., :k]
            q, p = q.float(), p.float()
            p[1, 3] = float("nan")  # masked: never read
            per_token, _ = score_centering_metric_sums(logps, p, q, sampler_logps, mask, closed)
            sizes.append(per_token["score_centering/coeff_l1"].item() / mask.sum().item())
            assert per_token["score_centering/coeff_l1"].item() == pytest.approx(
                _l1_by_loops(p, q, mask, closed), rel=1e-6, abs=1e-7)
        assert sizes[0] < 1e-6, (closed_value, sizes)
        assert sizes[1] > 1e-3 and sizes[1] < sizes[2] < sizes[3], (closed_value, sizes)
    # Mixed heads in one batch, against the loops.
    closed = torch.tensor([[True, False, True, False], [False, True, False, True]])
    q = torch.log_softmax(base, -1)[..., :k].float()
    p = torch.log_softmax(base + 0.3 * direction, -1)[..., :k].float()
    per_token, _ = score_centering_metric_sums(logps, p, q, sampler_logps, mask, closed)
    assert per_token["score_centering/coeff_l1"].item() == pytest.approx(_l1_by_loops(p, q, mask, closed), rel=1e-6)
