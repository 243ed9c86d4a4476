"""The functional API refuses malformed arguments with a ValueError naming the argument, instead of broadcasting
silently or returning NaN."""

import math
import re

import pytest
import torch

from trl_rpp.core import global_masked_normalize, reinforce_pp_returns


def _batch():
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]], dtype=torch.bool)
    old = torch.tensor([[-1.0, -2.0, -0.5, 0.0], [-0.3, -0.2, 0.0, 0.0]])
    return torch.tensor([1.0, -1.0]), old, torch.zeros_like(old), mask


@pytest.mark.parametrize("which", ["old_logps", "ref_logps"])
@pytest.mark.parametrize("shape", [(2, 1), (4,), (1, 4), (2, 5), (2, 4, 1)])
def test_returns_reject_logps_whose_shape_differs_from_the_mask(which, shape):
    rewards, old, ref, mask = _batch()
    bad = torch.zeros(shape)
    kw = dict(old_logps=old, ref_logps=ref)
    kw[which] = bad
    with pytest.raises(ValueError, match=re.escape(f"{which} must have the mask's shape (2, 4), got {tuple(shape)}")):
        reinforce_pp_returns(rewards, kw["old_logps"], kw["ref_logps"], mask, kl_coef=0.1)


def test_a_column_mask_no_longer_adds_the_reward_once_per_column():
    """The issue's case: a [B, 1] mask with [B, T] log-probs used to broadcast to [B, T] and add R once per column."""
    rewards, old, ref, _ = _batch()
    with pytest.raises(ValueError, match=r"old_logps must have the mask's shape \(2, 1\), got \(2, 4\)"):
        reinforce_pp_returns(rewards, old, ref, torch.ones(2, 1, dtype=torch.bool), kl_coef=0.1)


@pytest.mark.parametrize("kl_coef", [math.nan, math.inf, -0.1])
def test_returns_reject_a_kl_coef_that_cannot_work(kl_coef):
    rewards, old, ref, mask = _batch()
    with pytest.raises(ValueError, match=r"kl_coef must be a finite float >= 0"):
        reinforce_pp_returns(rewards, old, ref, mask, kl_coef=kl_coef)


@pytest.mark.parametrize("var_floor", [0.0, -1e-8, math.nan, math.inf, torch.tensor(1e-8), True])
def test_normalize_rejects_a_var_floor_that_cannot_work(var_floor):
    values = torch.full((2, 3), 0.25)  # a constant population: with a zero floor this was 0 * rsqrt(0) = NaN
    with pytest.raises(ValueError, match=r"var_floor must be a finite float > 0"):
        global_masked_normalize(values, torch.ones(2, 3, dtype=torch.bool), var_floor=var_floor)


def test_valid_arguments_still_pass():
    rewards, old, ref, mask = _batch()
    G = reinforce_pp_returns(rewards, old, ref, mask, kl_coef=0.0)
    assert G.shape == mask.shape
    assert torch.equal(G, reinforce_pp_returns(rewards, None, None, mask, kl_coef=0.0))
    out, _, var, count = global_masked_normalize(torch.full((2, 3), 0.25), torch.ones(2, 3), var_floor=1)
    assert torch.equal(out, torch.zeros(2, 3)) and var.item() == 0.0 and count.item() == 6
