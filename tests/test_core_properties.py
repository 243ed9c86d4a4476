"""Property-based tests of the core functions (hypothesis): random shapes, masks, sentinels and dtypes."""

import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from trl_rpp import (
    global_masked_normalize,
    group_mean_advantages,
    reinforce_pp_returns,
    response_mean_k2_loss,
    response_mean_ppo_loss,
    score_centering_correction,
)

SENTINELS = [float("nan"), float("inf"), float("-inf"), 1e30, -1e30, 0.0]


@st.composite
def batches(draw):
    groups = draw(st.integers(1, 4))
    num_generations = draw(st.integers(2, 4))
    B, T = groups * num_generations, draw(st.integers(1, 9))
    seed = draw(st.integers(0, 2**31 - 1))
    dtype = draw(st.sampled_from([torch.float32, torch.float64]))
    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(B, T, generator=g) < draw(st.floats(0.05, 1.0))
    mask[draw(st.integers(0, B - 1)), draw(st.integers(0, T - 1))] = True  # never globally empty
    scale = draw(st.sampled_from([1e-9, 1.0, 1e3]))
    values = {name: (torch.randn(B, T, generator=g, dtype=torch.float64) * scale).to(dtype) for name in ("a", "old", "ref", "lp")}
    values["lp"] = -values["lp"].abs() - 0.01
    values["old"] = values["lp"] + 0.1 * torch.randn(B, T, generator=g, dtype=torch.float64).to(dtype)
    rewards = (torch.randn(B, generator=g, dtype=torch.float64) * scale).to(dtype)
    if draw(st.booleans()):
        rewards = torch.full_like(rewards, draw(st.sampled_from([0.0, 1.0, 0.1])))
    return dict(mask=mask, rewards=rewards, G=num_generations, gamma=draw(st.sampled_from([1.0, 0.9, 0.0])),
                sentinel=draw(st.sampled_from(SENTINELS)), **values)


def with_sentinel(x, mask, sentinel):
    return torch.where(mask, x, torch.tensor(sentinel, dtype=x.dtype))


def outputs(b, sentinel):
    m = b["mask"]
    a, old, ref, lp = (with_sentinel(b[k], m, sentinel) for k in ("a", "old", "ref", "lp"))
    returns = reinforce_pp_returns(b["rewards"], old, ref, m, 0.05, b["gamma"])
    baseline = group_mean_advantages(b["rewards"], m, b["G"])
    normalized, mean, var, count = global_masked_normalize(a, m)
    norm_returns = global_masked_normalize(returns, m)[0]
    k = 3
    head = torch.stack([lp, lp - 1, lp - 2], -1)
    sampler = torch.where(m.unsqueeze(-1), head + 0.05, torch.tensor(sentinel, dtype=lp.dtype))
    return dict(
        returns=returns,
        baseline=baseline,
        normalized=normalized,
        norm_returns=norm_returns,
        ppo=response_mean_ppo_loss(lp, old, normalized, m).reshape(1),
        k2=response_mean_k2_loss(lp, ref, m).reshape(1),
        centering=score_centering_correction(head[..., :k], sampler[..., :k], m),
    ), (mean, var, count)


@settings(max_examples=150, deadline=None)
@given(batches())
def test_finite_zero_outside_mask_and_invariant_to_masked_values(b):
    m = b["mask"]
    reference, _ = outputs(b, 0.0)
    got, (mean, var, count) = outputs(b, b["sentinel"])
    for name, x in got.items():
        assert torch.isfinite(x).all(), name
        assert torch.equal(x, reference[name]), name  # masked storage never changes a result
        if x.dim() == 2:
            assert torch.equal(x[~m], torch.zeros_like(x[~m])), name

    # A non-empty normalized population has mean 0 and variance 1, or is all zeros at zero variance.
    for name, raw in (("normalized", b["a"]), ("norm_returns", got["returns"])):
        vals = got[name][m].double()
        if vals.abs().max() == 0:
            continue
        n = vals.numel()
        mu = vals.mean().item()
        pop_var = ((vals - mu) ** 2).mean().item()
        # Centering in the input dtype loses about eps * max|x| / std of relative accuracy (float32 cancellation).
        r = raw[m].double()
        slack = torch.finfo(raw.dtype).eps * (r.abs().max() / r.std(unbiased=False).clamp(min=1e-300)).item()
        assert abs(mu) < 1e-4 + 16 * slack, (name, mu, slack)
        if name == "normalized" and var.item() > 1e-8 * 10:
            assert math.isclose(pop_var, 1.0, rel_tol=1e-3), (name, pop_var, n)
    assert count.item() == int(m.sum())
