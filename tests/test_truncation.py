"""`trl_rpp.truncation`: log-probs renormalized over a sampler's kept support, against a float64 plain-loop
reference, by hand, and with values at masked positions and absent slots that must not matter."""

import math

import pytest
import torch

from trl_rpp.truncation import ABSENT, support_logsumexp, token_in_support, truncated_logps


def ref_truncated_logps(logits, token_ids, support_ids, mask, temperature):
    """log pi(y | S) = z_y / tau - log sum_{v in S} exp(z_v / tau), float64, plain loops; 0.0 at masked positions."""
    out = []
    for b, row in enumerate(mask):
        out_row = []
        for t, m in enumerate(row):
            if not m:
                out_row.append(0.0)
                continue
            kept = [v for v in support_ids[b][t] if v != ABSENT]
            top = max(logits[b][t][v] / temperature for v in kept)
            lse = top + math.log(math.fsum(math.exp(logits[b][t][v] / temperature - top) for v in kept))
            out_row.append(logits[b][t][token_ids[b][t]] / temperature - lse)
        out.append(out_row)
    return out


def random_case(seed, B=3, T=5, V=11, K=4):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, T, V, generator=g, dtype=torch.float64) * 3
    support = torch.full((B, T, K), ABSENT, dtype=torch.long)
    tokens = torch.zeros(B, T, dtype=torch.long)
    for b in range(B):
        for t in range(T):
            size = int(torch.randint(1, K + 1, (1,), generator=g))
            ids = torch.randperm(V, generator=g)[:size]
            slots = torch.randperm(K, generator=g)[:size]  # kept ids in any slots, holes anywhere
            support[b, t, slots] = ids
            tokens[b, t] = ids[int(torch.randint(0, size, (1,), generator=g))]
    mask = torch.rand(B, T, generator=g) > 0.3
    return logits, tokens, support, mask


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_matches_the_float64_reference(seed, temperature):
    logits, tokens, support, mask = random_case(seed)
    got = truncated_logps(logits, tokens, support, mask, temperature)
    want = ref_truncated_logps(logits.tolist(), tokens.tolist(), support.tolist(), mask.tolist(), temperature)
    assert got.dtype == torch.float32 and got.shape == mask.shape
    torch.testing.assert_close(got.double(), torch.tensor(want, dtype=torch.float64), rtol=1e-6, atol=1e-6)
    assert bool(token_in_support(tokens, support, mask).all())


def test_by_hand():
    """Logits (0, ln 2, ln 3, 5): the kept set {0, 1, 2} holds mass 1 + 2 + 3 = 6, so token 2 has log(3/6); a kept
    set of the token alone gives 0; the whole vocabulary gives log_softmax."""
    logits = torch.tensor([[[0.0, math.log(2), math.log(3), 5.0]] * 3])
    tokens = torch.tensor([[2, 2, 2]])
    support = torch.tensor([[[0, 1, 2, ABSENT], [ABSENT, ABSENT, 2, ABSENT], [0, 1, 2, 3]]])
    got = truncated_logps(logits, tokens, support, torch.ones(1, 3, dtype=torch.bool), 1.0)
    want = torch.tensor([[math.log(0.5), 0.0, float(torch.log_softmax(logits[0, 0], -1)[2])]])
    torch.testing.assert_close(got, want)
    # The temperature divides the logits before the renormalization: at tau = 0.5 the masses are 1, 4, 9.
    got = truncated_logps(logits[:, :1], tokens[:, :1], support[:, :1], torch.ones(1, 1), 0.5)
    torch.testing.assert_close(got, torch.tensor([[math.log(9 / 14)]]))


def test_values_at_masked_positions_and_absent_slots_never_change_a_result():
    logits, tokens, support, mask = random_case(7)
    clean = truncated_logps(logits, tokens, support, mask, 1.0)
    dirty_logits = logits.clone()
    dirty_logits[~mask] = float("nan")  # anything at a masked position
    other = torch.arange(logits.size(-1))
    for b, t in zip(*torch.nonzero(mask, as_tuple=True)):  # and at every id outside the kept set of a valid one
        outside = ~torch.isin(other, support[b, t])
        junk = torch.tensor([float("inf"), float("-inf"), float("nan")], dtype=logits.dtype).repeat(11)
        dirty_logits[b, t, outside] = junk[: int(outside.sum())]
    dirty_tokens = tokens.masked_fill(~mask, 10**6)  # out of range where masked: never read
    got = truncated_logps(dirty_logits, dirty_tokens.clamp(max=logits.size(-1) - 1), support, mask, 1.0)
    assert torch.equal(got, clean) and bool((got[~mask] == 0).all())


def test_support_logsumexp_of_an_empty_row_is_minus_inf_and_membership_is_checked():
    logits = torch.zeros(1, 2, 3)
    support = torch.tensor([[[0, 1], [ABSENT, ABSENT]]])
    lse = support_logsumexp(logits, support, 1.0)
    assert lse[0, 0] == pytest.approx(math.log(2)) and lse[0, 1] == float("-inf")
    inside = token_in_support(torch.tensor([[2, 0]]), support, torch.tensor([[True, False]]))
    assert inside.tolist() == [[False, True]]  # token 2 was not kept; the masked position is not checked


def test_gradient_flows_to_the_kept_logits_only():
    logits = torch.randn(1, 1, 6, requires_grad=True)
    support = torch.tensor([[[1, 4, ABSENT]]])
    truncated_logps(logits, torch.tensor([[4]]), support, torch.ones(1, 1), 1.0).sum().backward()
    grad = logits.grad[0, 0]
    assert grad[[0, 2, 3, 5]].abs().sum() == 0 and grad[[1, 4]].abs().sum() > 0
    q = torch.softmax(logits.detach()[0, 0, [1, 4]], -1)  # d/dz of z_4 - lse(z_1, z_4) = e_4 - q
    torch.testing.assert_close(grad[[1, 4]], torch.tensor([0.0, 1.0]) - q)
