"""Core numerics against the independent float64 reference (`tests/support/reference.py`, written from the equations only)."""

import inspect
import math

import pytest
import torch

import trl_rpp
from reference import (
    ref_global_masked_normalize,
    ref_group_mean_advantages,
    ref_kl_k1,
    ref_kl_k2,
    ref_reinforce_pp_returns,
    ref_response_mean_k2_loss,
    ref_response_mean_ppo_loss,
    ref_response_mean_ppo_loss_grad,
)
from trl_rpp import (
    global_masked_normalize,
    group_mean_advantages,
    kl_k1,
    kl_k2,
    reinforce_pp_returns,
    response_mean_k2_loss,
    response_mean_ppo_loss,
)

SENTINELS = [float("nan"), float("inf"), float("-inf"), 1e30, -1e30]


def make_batch(seed, B=8, T=12, dtype=torch.float64, sentinel=float("nan"), holes=True, lengths=None):
    """Random batch with right padding, variable lengths, internal holes and sentinels at masked positions.

    Row 0 has a single valid token; with B >= 4, row 3 is fully masked.
    """
    g = torch.Generator().manual_seed(seed)
    if lengths is None:
        lengths = torch.randint(1, T + 1, (B,), generator=g)
        lengths[0] = 1
        if B >= 4:
            lengths[3] = 0
    mask = torch.arange(T).unsqueeze(0) < torch.as_tensor(lengths).unsqueeze(1)
    if holes:
        hole = torch.rand(B, T, generator=g) < 0.2
        hole[:, 0] = False  # keep the first token so short rows stay non-empty
        mask = mask & ~hole
    logps = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3
    old = logps + 0.3 * torch.randn(B, T, generator=g, dtype=torch.float64)
    ref = logps + 0.5 * torch.randn(B, T, generator=g, dtype=torch.float64)
    adv = torch.randn(B, T, generator=g, dtype=torch.float64)
    rewards = torch.randn(B, generator=g, dtype=torch.float64)
    out = {}
    for name, x in dict(logps=logps, old=old, ref=ref, adv=adv).items():
        out[name] = torch.where(mask, x, torch.tensor(sentinel, dtype=torch.float64)).to(dtype)
    out["rewards"] = rewards.to(dtype)
    out["mask"] = mask
    return out


def L(x):
    """Tensor -> nested Python floats for the reference."""
    return x.double().tolist() if x.is_floating_point() else x.tolist()


def assert_close(got, want, dtype):
    want = torch.tensor(want, dtype=torch.float64)
    tol = dict(rtol=1e-12, atol=1e-12) if dtype == torch.float64 else dict(rtol=2e-5, atol=2e-5)
    torch.testing.assert_close(got.double(), want, **tol)


CASES = [(seed, dtype, s) for seed in range(3) for dtype in (torch.float32, torch.float64) for s in SENTINELS[:3]]


@pytest.mark.parametrize("seed,dtype,sentinel", CASES)
def test_kl_estimators_match_reference(seed, dtype, sentinel):
    b = make_batch(seed, dtype=dtype, sentinel=sentinel)
    assert_close(kl_k1(b["logps"], b["ref"], b["mask"]), ref_kl_k1(L(b["logps"]), L(b["ref"]), L(b["mask"])), dtype)
    assert_close(kl_k2(b["logps"], b["ref"], b["mask"]), ref_kl_k2(L(b["logps"]), L(b["ref"]), L(b["mask"])), dtype)


@pytest.mark.parametrize("gamma", [1.0, 0.9, 0.5, 0.0])
@pytest.mark.parametrize("kl_coef", [0.0, 0.01, 0.7])
@pytest.mark.parametrize("seed,dtype,sentinel", CASES)
def test_returns_match_reference(seed, dtype, sentinel, kl_coef, gamma):
    b = make_batch(seed, dtype=dtype, sentinel=sentinel)
    got = reinforce_pp_returns(b["rewards"], b["old"], b["ref"], b["mask"], kl_coef, gamma)
    want = ref_reinforce_pp_returns(L(b["rewards"]), L(b["old"]), L(b["ref"]), L(b["mask"]), kl_coef, gamma)
    assert got.dtype == dtype
    assert_close(got, want, dtype)


def test_returns_zero_and_equal_rewards_and_no_kl_inputs():
    b = make_batch(5)
    for rewards in (torch.zeros(8, dtype=torch.float64), torch.full((8,), 0.5, dtype=torch.float64)):
        got = reinforce_pp_returns(rewards, None, None, b["mask"], kl_coef=0.0)
        want = ref_reinforce_pp_returns(L(rewards), L(b["old"]), L(b["ref"]), L(b["mask"]), 0.0, 1.0)
        assert_close(got, want, torch.float64)
    with pytest.raises(ValueError, match="required when kl_coef"):
        reinforce_pp_returns(rewards, None, None, b["mask"], kl_coef=0.1)


@pytest.mark.parametrize("num_generations", [2, 4, 8])
@pytest.mark.parametrize("seed,dtype,sentinel", CASES)
def test_group_mean_advantages_match_reference(seed, dtype, sentinel, num_generations):
    b = make_batch(seed, dtype=dtype, sentinel=sentinel)
    got = group_mean_advantages(b["rewards"], b["mask"], num_generations)
    assert_close(got, ref_group_mean_advantages(L(b["rewards"]), L(b["mask"]), num_generations), dtype)


def test_group_mean_advantages_zero_and_all_equal_rewards():
    b = make_batch(1)
    for rewards in (torch.zeros(8), torch.full((8,), 3.0)):
        got = group_mean_advantages(rewards, b["mask"], 4)
        assert_close(got, ref_group_mean_advantages(L(rewards), L(b["mask"]), 4), torch.float32)
        assert torch.equal(got, torch.zeros_like(got))


def test_group_mean_unscorable_rows_leave_the_baseline():
    # Group of 4, row 1 unscorable (its stored reward is NaN): baseline = (1 + 0 + 0) / 3 = 1/3 over the rest.
    rewards = torch.tensor([1.0, float("nan"), 0.0, 0.0])
    scorable = torch.tensor([True, False, True, True])
    got = trl_rpp.group_centered_rewards(rewards, 4, scorable)
    torch.testing.assert_close(got, torch.tensor([2 / 3, 0.0, -1 / 3, -1 / 3]))
    # A group with no scorable member gives zeros, never NaN.
    got = trl_rpp.group_centered_rewards(torch.full((2,), float("nan")), 2, torch.zeros(2, dtype=torch.bool))
    assert torch.equal(got, torch.zeros(2))


@pytest.mark.parametrize("num_generations,B,match", [(1, 4, "integer >= 2"), (0, 4, "integer >= 2"), (3, 8, "8 % 3 = 2")])
def test_group_mean_advantages_rejects_bad_groups(num_generations, B, match):
    with pytest.raises(ValueError, match=match):
        group_mean_advantages(torch.zeros(B), torch.ones(B, 2), num_generations)


@pytest.mark.parametrize("seed,dtype,sentinel", CASES)
def test_normalize_matches_reference(seed, dtype, sentinel):
    b = make_batch(seed, dtype=dtype, sentinel=sentinel)
    got, mean, var, count = global_masked_normalize(b["adv"], b["mask"])
    want, wmean, wvar, wcount = ref_global_masked_normalize([L(b["adv"])], [L(b["mask"])])
    assert_close(got, want[0], dtype)
    assert_close(mean, wmean, dtype)
    assert_close(var, wvar, dtype)
    assert count.item() == wcount and count.dtype == torch.int64 and count.dim() == 0
    assert mean.dim() == 0 and var.dim() == 0
    assert got.dtype == dtype


def test_normalize_bfloat16_accumulates_in_float32():
    b = make_batch(0, dtype=torch.float64, sentinel=0.0)
    x = b["adv"].to(torch.bfloat16)
    got, mean, var, _ = global_masked_normalize(x, b["mask"])
    want, wmean, wvar, _ = ref_global_masked_normalize([L(x)], [L(b["mask"])])
    assert got.dtype == torch.bfloat16 and mean.dtype == torch.float32
    torch.testing.assert_close(mean.double(), torch.tensor(wmean, dtype=torch.float64), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(var.double(), torch.tensor(wvar, dtype=torch.float64), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got.double(), torch.tensor(want[0], dtype=torch.float64), rtol=1e-2, atol=1e-2)


def test_normalize_is_two_pass_for_large_offsets():
    # A one-pass E[x^2] - E[x]^2 in float32 loses everything at offset 1e4 with spread 1e-1; two passes do not.
    g = torch.Generator().manual_seed(0)
    x64 = 1e4 + 0.1 * torch.randn(64, 64, generator=g, dtype=torch.float64)
    mask = torch.ones(64, 64, dtype=torch.bool)
    _, _, var32, _ = global_masked_normalize(x64.float(), mask)
    _, _, wvar, _ = ref_global_masked_normalize([L(x64.float())], [L(mask)])
    assert abs(var32.item() - wvar) / wvar < 1e-2


@pytest.mark.parametrize("seed,dtype,sentinel", CASES)
@pytest.mark.parametrize("eps", [(0.2, 0.2), (0.1, 0.3)])
def test_ppo_loss_and_gradient_match_reference(seed, dtype, sentinel, eps):
    b = make_batch(seed, dtype=dtype, sentinel=sentinel)
    logps = b["logps"].clone().requires_grad_(True)
    loss = response_mean_ppo_loss(logps, b["old"], b["adv"], b["mask"], *eps)
    loss.backward()
    args = (L(b["logps"]), L(b["old"]), L(b["adv"]), L(b["mask"]), *eps)
    assert_close(loss.detach(), ref_response_mean_ppo_loss(*args), dtype)
    assert_close(logps.grad, ref_response_mean_ppo_loss_grad(*args), dtype)
    assert torch.isfinite(logps.grad).all()


@pytest.mark.parametrize("seed,dtype,sentinel", CASES)
def test_k2_loss_matches_reference(seed, dtype, sentinel):
    b = make_batch(seed, dtype=dtype, sentinel=sentinel)
    logps = b["logps"].clone().requires_grad_(True)
    loss = response_mean_k2_loss(logps, b["ref"], b["mask"])
    loss.backward()
    assert_close(loss.detach(), ref_response_mean_k2_loss(L(b["logps"]), L(b["ref"]), L(b["mask"])), dtype)
    assert torch.isfinite(logps.grad).all()
    assert torch.equal(logps.grad[~b["mask"]], torch.zeros_like(logps.grad[~b["mask"]]))


# ---------------------------------------------------------------------------------------------------------------
# Hand-checkable cases
# ---------------------------------------------------------------------------------------------------------------


def test_hand_returns_mask_hole_gamma_0_9():
    # mask [1,0,0,1], k1 = old - ref = 1 everywhere, kl_coef = 1, R = 0, gamma = 0.9.
    # r = [-1, 0, 0, -1] (masked positions contribute nothing); T_i = 3.
    # G_3 = -1; G_0 = -1 + 0.9**3 * (-1) = -1.729 (the hole does not reset the return); G_1 = G_2 = 0 (masked).
    mask = torch.tensor([[1, 0, 0, 1]])
    old = torch.ones(1, 4, dtype=torch.float64)
    got = reinforce_pp_returns(torch.zeros(1, dtype=torch.float64), old, torch.zeros_like(old), mask, 1.0, 0.9)
    torch.testing.assert_close(got, torch.tensor([[-1.729, 0.0, 0.0, -1.0]], dtype=torch.float64))


def test_hand_returns_terminal_reward_on_last_valid_token():
    # mask [1,1,0,0] (right padding), R = 2, kl_coef = 0.5, k1 = [1, 1, *, *], gamma = 1:
    # r = [-0.5, -0.5 + 2] = [-0.5, 1.5]; G = [1.0, 1.5, 0, 0]. The reward lands on t = 1, not on column 3.
    mask = torch.tensor([[1, 1, 0, 0]])
    old = torch.tensor([[1.0, 1.0, float("nan"), float("inf")]])
    got = reinforce_pp_returns(torch.tensor([2.0]), old, torch.zeros(1, 4), mask, 0.5)
    torch.testing.assert_close(got, torch.tensor([[1.0, 1.5, 0.0, 0.0]]))


def test_hand_group_of_four_then_normalize():
    # rewards [1,0,0,0], K = 4: mean 0.25, C = [0.75, -0.25, -0.25, -0.25].
    # One token each: mu = 0, var = (0.75^2 + 3 * 0.25^2) / 4 = 0.1875,
    # normalized = C / sqrt(0.1875) = [sqrt(3), -1/sqrt(3), -1/sqrt(3), -1/sqrt(3)].
    adv = group_mean_advantages(torch.tensor([1.0, 0.0, 0.0, 0.0], dtype=torch.float64), torch.ones(4, 1), 4)
    torch.testing.assert_close(adv[:, 0], torch.tensor([0.75, -0.25, -0.25, -0.25], dtype=torch.float64))
    out, mean, var, count = global_masked_normalize(adv, torch.ones(4, 1))
    s = math.sqrt(3.0)
    torch.testing.assert_close(out[:, 0], torch.tensor([s, -1 / s, -1 / s, -1 / s], dtype=torch.float64))
    assert mean.item() == 0.0 and var.item() == pytest.approx(0.1875) and count.item() == 4


def test_hand_ppo_clip_branches():
    # eps = 0.2, one token per response, A = +1 or -1, loss = mean over the 3 responses.
    # rho = 1.1, A = +1 (inside):        max(-1.1, -1.1) = -1.1,  d/dlogp = -rho*A = -1.1
    # rho = 1.5, A = +1 (above 1+eps):   max(-1.5, -1.2) = -1.2,  clipped branch is constant -> grad 0
    # rho = 0.5, A = -1 (below 1-eps):   max(0.5, 0.8)   =  0.8,  clipped branch -> grad 0
    # loss = (-1.1 - 1.2 + 0.8) / 3 = -0.5; grads = [-1.1/3, 0, 0].
    rho = torch.tensor([[1.1], [1.5], [0.5]], dtype=torch.float64)
    logps = torch.log(rho).requires_grad_(True)
    adv = torch.tensor([[1.0], [1.0], [-1.0]], dtype=torch.float64)
    loss = response_mean_ppo_loss(logps, torch.zeros_like(rho), adv, torch.ones(3, 1))
    loss.backward()
    torch.testing.assert_close(loss.detach(), torch.tensor(-0.5, dtype=torch.float64))
    torch.testing.assert_close(logps.grad[:, 0], torch.tensor([-1.1 / 3, 0.0, 0.0], dtype=torch.float64))
    # The same three cases through the independent reference.
    want = ref_response_mean_ppo_loss_grad(L(logps.detach()), [[0.0]] * 3, L(adv), [[1]] * 3)
    torch.testing.assert_close(logps.grad, torch.tensor(want, dtype=torch.float64))


def test_hand_response_mean_reduction():
    # Two responses: lengths 1 and 3, k2 per token = 0.5 * d^2 with d = [2 | 1, 1, 1]:
    # response 0: 2.0 / 1 = 2.0, response 1: 1.5 / 3 = 0.5 -> loss = (2.0 + 0.5) / 2 = 1.25.
    logps = torch.tensor([[2.0, 0.0, 0.0], [1.0, 1.0, 1.0]])
    mask = torch.tensor([[1, 0, 0], [1, 1, 1]])
    assert response_mean_k2_loss(logps, torch.zeros_like(logps), mask).item() == pytest.approx(1.25)


# ---------------------------------------------------------------------------------------------------------------
# The edge behaviours of docs/numerics.md
# ---------------------------------------------------------------------------------------------------------------


def test_edge_zero_variance_and_single_token_give_finite_zeros():
    out, _, var, _ = global_masked_normalize(torch.full((3, 4), 7.0), torch.ones(3, 4))
    assert var.item() == 0.0 and torch.equal(out, torch.zeros(3, 4))
    mask = torch.zeros(3, 4, dtype=torch.bool)
    mask[1, 2] = True
    out, _, _, count = global_masked_normalize(torch.randn(3, 4), mask)
    assert count.item() == 1 and torch.equal(out, torch.zeros(3, 4))


@pytest.mark.parametrize("value", [0.1, 1 / 3, -2.7, 1e-9, 1e6])
def test_edge_constant_population_gives_exact_zeros(value):
    # A float32 sum of N copies of 0.1 is an ulp off N * 0.1; the floor 1e-8 would scale that up to ~1e-4.
    for n in (7, 10, 1000):
        out, _, var, _ = global_masked_normalize(torch.full((n, 3), value), torch.ones(n, 3))
        assert torch.equal(out, torch.zeros(n, 3)) and var.item() == 0.0
    assert torch.equal(trl_rpp.group_centered_rewards(torch.full((16,), value), 8), torch.zeros(16))


def test_edge_all_zero_baseline_group_gives_zeros():
    adv = group_mean_advantages(torch.zeros(8), torch.ones(8, 5), 8)
    out, _, _, _ = global_masked_normalize(adv, torch.ones(8, 5))
    assert torch.equal(out, torch.zeros(8, 5))


def test_edge_zero_reward_nonzero_kl_gives_finite_nonzero_returns():
    b = make_batch(2)
    returns = reinforce_pp_returns(torch.zeros(8, dtype=torch.float64), b["old"], b["ref"], b["mask"], 0.01)
    out, _, _, _ = global_masked_normalize(returns, b["mask"])
    assert torch.isfinite(out).all() and (out[b["mask"]] != 0).any()


def test_edge_globally_empty_mask_fails():
    with pytest.raises(RuntimeError):
        global_masked_normalize(torch.full((2, 3), float("nan")), torch.zeros(2, 3))
    with pytest.raises(RuntimeError):
        global_masked_normalize(torch.zeros(0, 5), torch.zeros(0, 5))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_edge_globally_empty_mask_allowed_gives_zeros(dtype):
    """allow_empty=True (the trainer's zero-advantage step): exact zeros, count 0, whatever is stored."""
    values = torch.tensor([[float("nan"), float("inf"), 1e30], [-float("inf"), 3.0, -2.0]]).to(dtype)
    for v, m in ((values, torch.zeros(2, 3)), (torch.zeros(0, 5, dtype=dtype), torch.zeros(0, 5))):
        normalized, mean, var, count = global_masked_normalize(v, m, allow_empty=True)
        assert normalized.dtype == dtype and torch.equal(normalized, torch.zeros_like(v))
        assert mean.item() == 0.0 and var.item() == 0.0 and count.item() == 0
    # A non-empty population is normalized exactly as without the flag.
    m = torch.tensor([[0, 0, 0], [0, 1, 1]])
    for a, b in zip(global_masked_normalize(values, m, allow_empty=True), global_masked_normalize(values, m)):
        assert torch.equal(a, b) and torch.isfinite(a).all()


# ---------------------------------------------------------------------------------------------------------------
# Masked positions never change a result
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_masked_values_never_change_results(dtype):
    results = []
    for sentinel in SENTINELS + [0.0]:
        b = make_batch(11, dtype=dtype, sentinel=sentinel)
        logps = b["logps"].clone().requires_grad_(True)
        loss = response_mean_ppo_loss(logps, b["old"], b["adv"], b["mask"]) + response_mean_k2_loss(
            logps, b["ref"], b["mask"]
        )
        loss.backward()
        results.append(
            [
                reinforce_pp_returns(b["rewards"], b["old"], b["ref"], b["mask"], 0.05, 0.95),
                reinforce_pp_returns(b["rewards"], b["old"], b["ref"], b["mask"], 0.05, 1.0),
                group_mean_advantages(b["rewards"], b["mask"], 4),
                global_masked_normalize(b["adv"], b["mask"])[0],
                kl_k1(b["logps"], b["ref"], b["mask"]),
                kl_k2(b["logps"], b["ref"], b["mask"]),
                loss.detach(),
                logps.grad,
            ]
        )
    for other in results[1:]:
        for a, c in zip(results[0], other):
            assert torch.equal(a, c)
            assert torch.isfinite(a).all()


def test_public_api_is_exported_and_documented():
    for name in trl_rpp.core.__all__ + trl_rpp.score_centering.__all__:
        fn = getattr(trl_rpp, name)
        assert fn.__doc__ and ("[B" in fn.__doc__ or "[]" in fn.__doc__), name
        assert "self" not in inspect.signature(fn).parameters


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_returns_across_chunk_boundaries_and_long_completions(dtype):
    # T = 600 spans three 256-position chunks of the loop-free discounted scan (the last one partial).
    b = make_batch(21, B=2, T=600, dtype=dtype, lengths=[600, 431])
    for gamma in (0.9, 0.999):
        got = reinforce_pp_returns(b["rewards"], b["old"], b["ref"], b["mask"], 0.02, gamma)
        want = ref_reinforce_pp_returns(L(b["rewards"]), L(b["old"]), L(b["ref"]), L(b["mask"]), 0.02, gamma)
        assert_close(got, want, dtype)
    # 20k tokens in float32: gamma ** -t would overflow long before; the scan stays finite.
    mask = torch.ones(1, 20000, dtype=torch.bool)
    long = reinforce_pp_returns(torch.ones(1), torch.zeros(1, 20000), torch.zeros(1, 20000), mask, 0.0, 0.9)
    assert torch.isfinite(long).all() and long[0, -1].item() == 1.0
    assert long[0, -3].item() == pytest.approx(0.81)  # the terminal reward, two positions later: 0.9 ** 2


def test_the_float64_references_pass_their_hand_checked_cases():
    """`tests/support/reference.py`'s plain-loop references against values worked out by hand (its `_self_check`), so that a
    reference every numerical test leans on is itself checked in the suite."""
    import reference

    reference._self_check()
