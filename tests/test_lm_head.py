"""`trl_rpp.lm_head`: log-probs read from the hidden states and the head in tiles, against float64 plain loops and
against today's full-logits functions (`truncation.support_logps`, the full-vocabulary float64 `log_softmax`), values
and the gradients of the hidden states, the head's weight and its bias, and of a low-rank term's `u` and `B` (a LoRA
adapter on the head).

Tolerances: float64 1e-10; float32 1e-5 (test_score_centering's); bfloat16 under autocast, a one-ulp flip of two bfloat16
logits (the read id's and one in the logsumexp) on the log-probs, 4e-2 on the gradients: the head's output is rounded to bfloat16, and a tiled dot product
may round a logit one ulp apart from the full GEMM's (the largest difference is printed with -s)."""

import math

import pytest
import torch

from trl_rpp import lm_head
from trl_rpp.lm_head import HeadTransform, full_logps, kept_logps
from reference import ref_sampled_and_head_logps
from trl_rpp.truncation import ABSENT, support_logps

TRANSFORMS = {
    "none": HeadTransform(),
    "cohere_logit_scale": HeadTransform(scale=0.0625 * 8),
    "granite_logits_scaling": HeadTransform(divisor=2.5),
    "gemma2_softcapping": HeadTransform(softcap=3.0),
    "all": HeadTransform(scale=1.5, divisor=2.0, softcap=4.0),
}
N, H, V, K, TEMP = 9, 4, 23, 6, 0.7


def problem(dtype, bias=True, seed=0):
    """Hidden states, head, kept sets (row 2 partly ABSENT, row 5 empty), ids read (the sampled id, the kept set's
    first two ids, a duplicate), and upstream weights."""
    g = torch.Generator().manual_seed(seed)
    hidden = (2 * torch.randn(N, H, generator=g, dtype=torch.float64)).to(dtype)
    weight = torch.randn(V, H, generator=g, dtype=torch.float64).to(dtype)
    b = torch.randn(V, generator=g, dtype=torch.float64).to(dtype) if bias else None
    support = torch.stack([torch.randperm(V, generator=g)[:K] for _ in range(N)])
    support[2, 3:] = ABSENT
    support[5] = ABSENT
    ids = torch.stack([support[:, 1], support[:, 0], support[:, 1], support[:, 2]], -1).clamp(min=0)
    w_out = torch.randn(N, ids.size(1), generator=g, dtype=torch.float64)
    return hidden, weight, b, ids, support, w_out


R = 3  # the low-rank term's rank


def lowrank_problem(dtype, seed=1):
    """A low-rank term: `u` `[N, R]` (what `scaling * lora_A(dropout(h))` gives) and `B` `[V, R]`."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(N, R, generator=g, dtype=torch.float64).to(dtype),
            torch.randn(V, R, generator=g, dtype=torch.float64).to(dtype))


def leaves(*xs):
    return [None if x is None else x.clone().requires_grad_() for x in xs]


def grads(out, w_out, params):
    ps = [p for p in params if p is not None]
    got = torch.autograd.grad((out.double() * w_out).sum(), ps)
    return list(got)


def head_output(hidden, weight, bias, i, v, u=None, lora_b=None):
    """Plain loops: sum_j h_ij W_vj + b_v + sum_k u_ik B_vk."""
    s = sum(hidden[i, j] * weight[v, j] for j in range(hidden.size(1)))
    if u is not None:
        s = s + sum(u[i, k] * lora_b[v, k] for k in range(u.size(1)))
    return s + (bias[v] if bias is not None else 0.0)


def ref_kept(hidden, weight, bias, ids, support, transform, u=None, lora_b=None):
    """Plain loops: z_v = transform(sum_j h_j W_vj + b_v [+ sum_k u_k B_vk]) / tau, log pi(v | S) = z_v - log sum_{u in S} exp z_u; rows
    without a kept id give 0. Also the entropies of pi(. | S)."""
    rows, ents = [], []
    for i in range(hidden.size(0)):
        kept = [v for v in support[i].tolist() if v != ABSENT]
        if not kept:
            rows.append(torch.zeros(ids.size(1), dtype=torch.float64))
            ents.append(0.0)
            continue

        def z(v):
            return transform(head_output(hidden, weight, bias, i, v, u, lora_b)) / TEMP

        zs = {v: z(v) for v in set(kept) | set(ids[i].tolist())}
        top = max(zs[v].item() for v in kept)
        lse = top + torch.log(sum(torch.exp(zs[v] - top) for v in kept))
        rows.append(torch.stack([zs[v] - lse for v in ids[i].tolist()]))
        logp = [(zs[v] - lse).item() for v in kept]
        ents.append(-math.fsum(math.exp(lp) * lp for lp in logp))
    return torch.stack(rows), torch.tensor(ents, dtype=torch.float64)


def ref_full(hidden, weight, bias, ids, transform, u=None, lora_b=None):
    """Plain loops over the whole vocabulary: log softmax at `ids`, and the entropy."""
    rows, ents = [], []
    for i in range(hidden.size(0)):
        zs = []
        for v in range(weight.size(0)):
            zs.append(transform(head_output(hidden, weight, bias, i, v, u, lora_b)))
        zs = [x / TEMP for x in zs]
        top = max(x.item() for x in zs)
        lse = top + torch.log(sum(torch.exp(x - top) for x in zs))
        rows.append(torch.stack([zs[v] - lse for v in ids[i].tolist()]))
        ents.append(-math.fsum(math.exp((x - lse).item()) * (x - lse).item() for x in zs))
    return torch.stack(rows), torch.tensor(ents, dtype=torch.float64)


# --- against float64 plain loops -------------------------------------------------------------------------------


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("name", list(TRANSFORMS))
@pytest.mark.parametrize("tile", [1, 4, None])
def test_kept_logps_equal_a_float64_plain_loop_reference(name, bias, tile):
    transform = TRANSFORMS[name]
    hidden, weight, b, ids, support, w_out = problem(torch.float64, bias)
    h, w, bb = leaves(hidden, weight, b)
    out, ent = kept_logps(h, w, bb, ids, support, TEMP, transform, tile=tile)
    assert out.dtype == ent.dtype == torch.float64 and not ent.requires_grad
    got = grads(out, w_out, [h, w, bb])
    h, w, bb = leaves(hidden, weight, b)
    ref, ref_ent = ref_kept(h, w, bb, ids, support, transform)
    want = grads(ref, w_out, [h, w, bb])
    tol = dict(rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(out, ref.detach(), **tol)
    torch.testing.assert_close(ent, ref_ent, **tol)
    for a, c in zip(got, want):
        torch.testing.assert_close(a, c, **tol)
    assert torch.equal(out[5], torch.zeros(4, dtype=torch.float64)) and torch.equal(got[0][5], torch.zeros(H, dtype=torch.float64))


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("name", ["none", "all"])
@pytest.mark.parametrize("tile", [2, None])
def test_full_logps_equal_a_float64_plain_loop_reference(name, bias, tile):
    transform = TRANSFORMS[name]
    hidden, weight, b, ids, _, w_out = problem(torch.float64, bias)
    h, w, bb = leaves(hidden, weight, b)
    out, ent = full_logps(h, w, bb, ids, TEMP, transform, tile=tile)
    got = grads(out, w_out, [h, w, bb])
    h, w, bb = leaves(hidden, weight, b)
    ref, ref_ent = ref_full(h, w, bb, ids, transform)
    want = grads(ref, w_out, [h, w, bb])
    tol = dict(rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(out, ref.detach(), **tol)
    torch.testing.assert_close(ent, ref_ent, **tol)
    for a, c in zip(got, want):
        torch.testing.assert_close(a, c, **tol)


def test_hand_checkable_case():
    """H = 1, head rows 1, 2, 3 (no bias), h = 1, tau = 1, S = {0, 2}: log pi(0 | S) = 1 - log(e + e^3), and its
    gradient in h is w_0 - (p_0 w_0 + p_2 w_2) = 1 - (p_0 + 3 p_2), p_0 = e / (e + e^3), p_2 = 1 - p_0; in W only
    rows 0 and 2 get one: (1 - p_0) h and -p_2 h. Under the full softmax the same id reads 1 - log(e + e^2 + e^3)."""
    h = torch.ones(1, 1, dtype=torch.float64, requires_grad=True)
    w = torch.tensor([[1.0], [2.0], [3.0]], dtype=torch.float64, requires_grad=True)
    out, ent = kept_logps(h, w, None, torch.tensor([[0]]), torch.tensor([[0, 2, ABSENT]]), 1.0)
    e = math.e
    p0 = e / (e + e**3)
    assert out.item() == pytest.approx(1 - math.log(e + e**3), abs=1e-14)
    assert ent.item() == pytest.approx(-(p0 * math.log(p0) + (1 - p0) * math.log(1 - p0)), abs=1e-14)
    out.sum().backward()
    assert h.grad.item() == pytest.approx(1 - (p0 + 3 * (1 - p0)), abs=1e-14)
    assert w.grad[:, 0].tolist() == pytest.approx([1 - p0, 0.0, -(1 - p0)], abs=1e-14)
    full, _ = full_logps(h.detach(), w.detach(), None, torch.tensor([[0]]), 1.0)
    assert full.item() == pytest.approx(1 - math.log(e + e**2 + e**3), abs=1e-14)


@pytest.mark.parametrize("full", [False, True])
@pytest.mark.parametrize("tile", [2, None])
def test_a_lowrank_term_equals_a_float64_plain_loop_reference(full, tile):
    """The head's output `h W^T + b + u B^T`: values and the gradients of h, W, b, u and B."""
    transform = TRANSFORMS["all"]
    hidden, weight, b, ids, support, w_out = problem(torch.float64)
    u, lora_b = lowrank_problem(torch.float64)
    params = leaves(hidden, weight, b, u, lora_b)
    if full:
        out, ent = full_logps(*params[:3], ids, TEMP, transform, tile=tile, lowrank=params[3:])
    else:
        out, ent = kept_logps(*params[:3], ids, support, TEMP, transform, tile=tile, lowrank=params[3:])
    got = grads(out, w_out, params)
    params = leaves(hidden, weight, b, u, lora_b)
    if full:
        ref, ref_ent = ref_full(*params[:3], ids, transform, *params[3:])
    else:
        ref, ref_ent = ref_kept(*params[:3], ids, support, transform, *params[3:])
    want = grads(ref, w_out, params)
    tol = dict(rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(out, ref.detach(), **tol)
    torch.testing.assert_close(ent, ref_ent, **tol)
    assert len(got) == 5
    for a, c in zip(got, want):
        torch.testing.assert_close(a, c, **tol)
    without = (full_logps(hidden, weight, b, ids, TEMP, transform) if full else
               kept_logps(hidden, weight, b, ids, support, TEMP, transform))[0]
    assert (out - without).abs().max() > 1e-2  # the term counts


def test_hand_checkable_lowrank_case():
    """H = r = 1, head rows 1, 2, 3 (no bias), B rows 1, 0, -1, h = u = 1, tau = 1: every logit is 2. Over S = {0, 2}
    log pi(0 | S) = -log 2 (-log 3 under the full softmax); gradients: in u, B_0 - (B_0 + B_2) / 2 = 1; in h,
    W_0 - (W_0 + W_2) / 2 = -1; in B, rows 0 and 2 get (1 - 1/2) u = 1/2 and -1/2, row 1 nothing (W the same, times
    h)."""
    h = torch.ones(1, 1, dtype=torch.float64, requires_grad=True)
    w = torch.tensor([[1.0], [2.0], [3.0]], dtype=torch.float64, requires_grad=True)
    u = torch.ones(1, 1, dtype=torch.float64, requires_grad=True)
    lora_b = torch.tensor([[1.0], [0.0], [-1.0]], dtype=torch.float64, requires_grad=True)
    out, ent = kept_logps(h, w, None, torch.tensor([[0]]), torch.tensor([[0, 2, ABSENT]]), 1.0, lowrank=(u, lora_b))
    assert out.item() == pytest.approx(-math.log(2), abs=1e-14)
    assert ent.item() == pytest.approx(math.log(2), abs=1e-14)
    out.sum().backward()
    assert u.grad.item() == pytest.approx(1.0, abs=1e-14)
    assert h.grad.item() == pytest.approx(-1.0, abs=1e-14)
    assert lora_b.grad[:, 0].tolist() == pytest.approx([0.5, 0.0, -0.5], abs=1e-14)
    assert w.grad[:, 0].tolist() == pytest.approx([0.5, 0.0, -0.5], abs=1e-14)
    full, _ = full_logps(h.detach(), w.detach(), None, torch.tensor([[0]]), 1.0, lowrank=(u.detach(), lora_b.detach()))
    assert full.item() == pytest.approx(-math.log(3), abs=1e-14)


# --- against today's full-logits functions ------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("name", ["none", "all"])
def test_kept_logps_equal_support_logps_on_the_full_logits(dtype, name):
    transform = TRANSFORMS[name]
    hidden, weight, b, ids, support, w_out = problem(dtype)
    h, w, bb = leaves(hidden, weight, b)
    out, _ = kept_logps(h, w, bb, ids, support, TEMP, transform, tile=3)
    got = grads(out, w_out, [h, w, bb])
    h, w, bb = leaves(hidden, weight, b)
    logits = transform(torch.nn.functional.linear(h, w, bb))
    ref = support_logps(logits.unsqueeze(0), ids.unsqueeze(0), support.unsqueeze(0), TEMP)[0]
    ref = torch.where((support != ABSENT).any(-1, keepdim=True), ref, torch.zeros_like(ref))  # replayed_logps' mask
    want = grads(ref, w_out, [h, w, bb])
    tol = dict(rtol=1e-10, atol=1e-10) if dtype == torch.float64 else dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out, ref.detach(), **tol)
    for a, c in zip(got, want):
        torch.testing.assert_close(a, c, **tol)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("name", ["none", "all"])
def test_full_logps_equal_the_full_log_softmax_of_the_logits(dtype, name):
    transform = TRANSFORMS[name]
    hidden, weight, b, ids, _, w_out = problem(dtype)
    h, w, bb = leaves(hidden, weight, b)
    out, ent = full_logps(h, w, bb, ids, TEMP, transform, tile=4)
    got = grads(out, w_out, [h, w, bb])
    h, w, bb = leaves(hidden, weight, b)
    logits = transform(torch.nn.functional.linear(h, w, bb))
    pad = torch.zeros(1, V, dtype=dtype)  # one position before (the prompt's last) and one after, as a model returns
    logps, head, ref_ent = ref_sampled_and_head_logps(torch.cat([pad, logits, pad]).unsqueeze(0), ids[:, 0].unsqueeze(0),
                                                  ids[:, 1:].unsqueeze(0), TEMP)
    ref = torch.cat([logps.unsqueeze(-1), head], -1)[0]
    want = grads(ref, w_out, [h, w, bb])
    tol = dict(rtol=1e-10, atol=1e-10) if dtype == torch.float64 else dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out, ref.detach(), **tol)
    torch.testing.assert_close(ent, ref_ent[0], **tol)
    for a, c in zip(got, want):
        torch.testing.assert_close(a, c, **tol)


@pytest.mark.parametrize("full", [False, True])
def test_a_lowrank_term_in_float32_equals_the_full_logits_in_float64(full):
    """float32 inputs against the float64 full-logits functions on the logits `h W^T + b + u B^T`, to 1e-5."""
    hidden, weight, b, ids, support, w_out = problem(torch.float32)
    u, lora_b = lowrank_problem(torch.float32)
    params = leaves(hidden, weight, b, u, lora_b)
    if full:
        out, _ = full_logps(*params[:3], ids, TEMP, tile=4, lowrank=params[3:])
    else:
        out, _ = kept_logps(*params[:3], ids, support, TEMP, tile=4, lowrank=params[3:])
    assert out.dtype == torch.float32
    got = grads(out, w_out, params)
    params = leaves(*(x.double() for x in (hidden, weight, b, u, lora_b)))
    logits = torch.nn.functional.linear(params[0], params[1], params[2]) + params[3] @ params[4].t()
    if full:
        ref = torch.log_softmax(logits / TEMP, -1).gather(-1, ids)
    else:
        ref = support_logps(logits.unsqueeze(0), ids.unsqueeze(0), support.unsqueeze(0), TEMP)[0]
        ref = torch.where((support != ABSENT).any(-1, keepdim=True), ref, torch.zeros_like(ref))
    want = grads(ref, w_out, params)
    torch.testing.assert_close(out.double(), ref.detach(), rtol=1e-5, atol=1e-5)
    for a, c in zip(got, want):
        torch.testing.assert_close(a.double(), c, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("full", [False, True])
def test_bfloat16_autocast_matches_the_full_logits_under_the_same_autocast(full):
    hidden, weight, b, ids, support, w_out = problem(torch.float32, seed=1)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        h, w, bb = leaves(hidden, weight, b)
        out = (full_logps(h, w, bb, ids, TEMP, tile=4) if full else kept_logps(h, w, bb, ids, support, TEMP, tile=4))[0]
        got = grads(out, w_out, [h, w, bb])
        h, w, bb = leaves(hidden, weight, b)
        logits = torch.nn.functional.linear(h, w, bb)
        assert logits.dtype == torch.bfloat16
        if full:
            ref = torch.log_softmax(logits.float() / TEMP, -1).gather(-1, ids)
        else:
            ref = support_logps(logits.unsqueeze(0), ids.unsqueeze(0), support.unsqueeze(0), TEMP)[0]
            ref = torch.where((support != ABSENT).any(-1, keepdim=True), ref, torch.zeros_like(ref))
        want = grads(ref, w_out, [h, w, bb])
    assert out.dtype == torch.float32
    worst = (out - ref).abs().max().item()
    ulp = 2.0 ** (math.floor(math.log2(logits.float().abs().max().item())) - 7)  # of the largest bf16 logit
    torch.testing.assert_close(out, ref.detach(), rtol=0, atol=2 * ulp / TEMP)  # the id's and one kept logit flip
    for a, c in zip(got, want):
        torch.testing.assert_close(a.float(), c.float(), rtol=4e-2, atol=4e-2)
    print(f"\nbf16 {'full' if full else 'kept'}: largest |log-prob difference| {worst:.1e}")


# --- masked values never change a result --------------------------------------------------------------------------


@pytest.mark.parametrize("lowrank", [False, True])
@pytest.mark.parametrize("sentinel", [float("nan"), float("inf"), -float("inf"), 1e30])
def test_masked_rows_and_absent_slots_holding_nan_or_inf_change_nothing(sentinel, lowrank):
    """Replay: a row without a kept id (5); score centering: a row outside `valid` (5, 7). Their hidden states (and,
    with a low-rank term, their `u`) hold the sentinel; every other output and every gradient is that of a clean run,
    and theirs are 0."""
    hidden, weight, b, ids, support, w_out = problem(torch.float64)
    u, lora_b = lowrank_problem(torch.float64)
    valid = torch.ones(N, dtype=torch.bool)
    valid[[5, 7]] = False
    results = []
    for value in (0.0, sentinel):
        for full in (False, True):
            keep = valid if full else (support != ABSENT).any(-1)
            dirty, dirty_u = hidden.clone(), u.clone()
            dirty[~keep] = value
            dirty_u[~keep] = value
            dirty_w_out = w_out.clone()
            dirty_w_out[5] = value if math.isfinite(value) else 0.0  # an upstream gradient at a masked row
            h, w, bb, uu, lb = leaves(dirty, weight, b, dirty_u, lora_b)
            extra = dict(lowrank=(uu, lb)) if lowrank else {}
            if full:
                out, ent = full_logps(h, w, bb, ids, TEMP, valid=valid, tile=4, **extra)
            else:
                out, ent = kept_logps(h, w, bb, ids, support, TEMP, tile=4, **extra)
            g = grads(out, dirty_w_out, [h, w, bb, *((uu, lb) if lowrank else ())])
            results.append((full, out[keep], ent[keep], out[~keep], ent[~keep], g))
    for clean, dirty in zip(results[:2], results[2:]):
        assert clean[0] == dirty[0]
        for a, c in zip(clean[1:3], dirty[1:3]):
            assert torch.equal(a, c)
        assert (dirty[3] == 0).all() and (dirty[4] == 0).all()
        for a, c in zip(clean[5], dirty[5]):
            assert torch.isfinite(c).all() and torch.equal(a, c)


def test_shapes_are_checked():
    with pytest.raises(ValueError, match=r"the head's weight must be \[V, 4\]"):
        kept_logps(torch.zeros(3, 4), torch.zeros(5, 3), None, torch.zeros(3, 1, dtype=torch.long),
                   torch.zeros(3, 2, dtype=torch.long), 1.0)
    with pytest.raises(ValueError, match=r"lowrank must be \(u \[3, r\], lora_b \[5, r\]\), got \(3, 2\) and \(5, 3\)"):
        kept_logps(torch.zeros(3, 4), torch.zeros(5, 4), None, torch.zeros(3, 1, dtype=torch.long),
                   torch.zeros(3, 2, dtype=torch.long), 1.0, lowrank=(torch.zeros(3, 2), torch.zeros(5, 3)))
    with pytest.raises(ValueError, match=r"support_ids must be \[3, \*\]"):
        kept_logps(torch.zeros(3, 4), torch.zeros(5, 4), None, torch.zeros(3, 1, dtype=torch.long),
                   torch.zeros(2, 2, dtype=torch.long), 1.0)


# --- replay's head gradient: only the touched rows, added into a held `.grad` ------------------------------------


def test_touched_rows_hand_checkable_case():
    """Rows 2, 0, 5 read (an ABSENT slot reads row 0): sorted distinct rows [0, 2, 5], each slot's index into them;
    the gradient is `values` at those rows, 0 elsewhere, three rows stored."""
    ids = torch.tensor([[2], [0]])
    support = torch.tensor([[2, 5, ABSENT], [0, 2, ABSENT]])
    rows, slots = lm_head.touched_rows(ids, support)
    assert rows.tolist() == [0, 2, 5] and slots.tolist() == [[1, 1, 2, 0], [0, 0, 1, 0]]
    values = torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]], dtype=torch.float64)
    sparse = lm_head.sparse_rows_gradient(rows, values, (7, 2), torch.float32)
    want = [[1.0, 2.0], [0.0, 0.0], [3.0, 4.0], [0.0, 0.0], [0.0, 0.0], [5.0, 6.0], [0.0, 0.0]]
    assert sparse.layout == torch.sparse_coo and sparse.is_coalesced() and sparse._nnz() == 3
    assert sparse.dtype == torch.float32 and sparse.to_dense().tolist() == want


def head_step(hidden, weight, b, ids, support, w_out, held, tokens=None):
    """One replayed loss's backward into fresh leaves `weight` and `b`, each starting with `held`'s `.grad` (None or a
    dense tensor). `tokens`: ids whose rows of `weight` are added to the hidden states, as a tied embedding does.
    Returns the leaves, the `.grad` tensors they started with, and the layout of what autograd accumulated into each
    (hooks on the leaves see it)."""
    w, bb = leaves(weight, b)
    layouts = {}
    for name, p, g in (("weight", w, held[0]), ("bias", bb, held[1])):
        p.grad = None if g is None else g.clone()
        p.register_hook(lambda grad, name=name: layouts.__setitem__(name, grad.layout))
    started = [w.grad, bb.grad]
    h = hidden if tokens is None else hidden + torch.nn.functional.embedding(tokens, w)
    out, _ = kept_logps(h, w, bb, ids, support, TEMP, tile=3)
    (out.double() * w_out).sum().backward()
    return (w, bb), started, layouts


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_replayed_head_gradient_added_into_a_held_grad_is_sparse_exact_and_leaves_grad_dense(dtype, tied):
    """With `.grad` None the head's gradient arrives dense and becomes `.grad`, equal to the full logits' (float64
    1e-10, float32 1e-5). With a dense `.grad` held (a later micro-batch of gradient accumulation) it arrives sparse
    over the touched rows and is added in place: `.grad` stays the same dense tensor, bitwise `held + the dense
    gradient`; tied, autograd first sums it with the embedding's dense gradient. AdamW then steps as on that sum."""
    hidden, weight, b, ids, support, w_out = problem(dtype)
    tokens = torch.arange(N) % V if tied else None
    g = torch.Generator().manual_seed(3)
    held = [torch.randn(x.shape, generator=g, dtype=torch.float64).to(dtype) for x in (weight, b)]

    (w, bb), _, layouts = head_step(hidden, weight, b, ids, support, w_out, (None, None), tokens)
    assert layouts == {"weight": torch.strided, "bias": torch.strided}
    dense = [w.grad, bb.grad]
    assert all(x.layout == torch.strided and x.dtype == dtype for x in dense)
    if dtype != torch.bfloat16:  # against the full logits through autograd
        w, bb = leaves(weight, b)
        h = hidden if tokens is None else hidden + torch.nn.functional.embedding(tokens, w)
        ref = support_logps(torch.nn.functional.linear(h, w, bb).unsqueeze(0), ids.unsqueeze(0),
                            support.unsqueeze(0), TEMP)[0]
        ref = torch.where((support != ABSENT).any(-1, keepdim=True), ref, torch.zeros_like(ref))
        (ref.double() * w_out).sum().backward()
        tol = dict(rtol=1e-10, atol=1e-10) if dtype == torch.float64 else dict(rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(dense[0], w.grad, **tol)
        torch.testing.assert_close(dense[1], bb.grad, **tol)

    params, started, layouts = head_step(hidden, weight, b, ids, support, w_out, held, tokens)
    assert layouts == {"weight": torch.strided if tied else torch.sparse_coo, "bias": torch.sparse_coo}
    for p, start, d, kept in zip(params, held, dense, started):
        assert p.grad is kept and p.grad.layout == torch.strided
        assert torch.equal(p.grad, start + d)
    for p, start, d in zip(params, held, dense):
        q = torch.nn.Parameter(p.detach().clone())
        q.grad = start + d
        for x in (p, q):
            torch.optim.AdamW([x], lr=0.1).step()
        assert torch.equal(p.detach(), q.detach())


def test_torch_autograd_grad_gets_a_dense_head_gradient_even_with_a_held_grad():
    """`torch.autograd.grad` returns the gradient instead of accumulating it: dense, whatever `.grad` holds."""
    hidden, weight, b, ids, support, w_out = problem(torch.float64)
    w, bb = leaves(weight, b)
    w.grad, bb.grad = torch.zeros_like(w), torch.zeros_like(bb)
    out, _ = kept_logps(hidden, w, bb, ids, support, TEMP)
    got = torch.autograd.grad((out * w_out).sum(), [w, bb])
    assert [x.layout for x in got] == [torch.strided] * 2
