"""The numerical contract of REINFORCE++ and REINFORCE++-baseline as pure tensor functions.

Everything here follows the main equations of REINFORCE++ (arXiv:2501.03262 v9), with OpenRLHF's
population-variance normalization; `docs/numerics.md` states each function's equations. The functions take
tensors and plain numbers only: no config, no trainer, no accelerator. `RPPTrainer` is a thin wiring of TRL's
hooks to them.

Shapes: ``B`` responses, ``T`` completion positions, ``K`` = ``num_generations``. A ``mask`` is a bool or
0/1 tensor ``[B, T]`` selecting the response tokens that count (``m_{i,t}`` in `docs/numerics.md`).

Masking contract (`docs/numerics.md`): masked positions are removed by *selection*
(`torch.where`), never by multiplication, so NaN or Inf stored at a masked position can never reach a
valid result, and every returned ``[B, T]`` tensor is exactly zero outside the mask.
"""

from __future__ import annotations

import math
import numbers

import torch
import torch.distributed as dist

# The one private torch member read here (`trl_rpp.patches` lists it): checked when the module loads.
if not callable(getattr(torch, "_assert_async", None)):
    raise ImportError(f"trl_rpp.core reads torch._assert_async, which the installed torch {torch.__version__} lacks "
                      "(torch 2.11 to 2.15 have it): install one of those, or report it with the version.")

__all__ = [
    "kl_k1",
    "kl_k2",
    "reinforce_pp_returns",
    "group_centered_rewards",
    "group_mean_advantages",
    "global_masked_normalize",
    "masked_response_mean",
    "response_mean_ppo_loss",
    "response_mean_k2_loss",
]


def _as_bool_mask(mask: torch.Tensor) -> torch.Tensor:
    return mask if mask.dtype == torch.bool else mask != 0


def _accum_dtype(dtype: torch.dtype) -> torch.dtype:
    # float64 stays float64; everything narrower (bf16, fp16, fp32) is accumulated in float32.
    return torch.float64 if dtype == torch.float64 else torch.float32


def _zero(like: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    return torch.zeros((), dtype=dtype or like.dtype, device=like.device)


def kl_k1(logps: torch.Tensor, ref_logps: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Signed k1 estimator ``d = log pi - log pi_ref``.

    Args:
        logps: ``[B, T]`` log-probs of the sampled tokens under the policy.
        ref_logps: ``[B, T]`` log-probs of the same tokens under the reference.
        mask: optional ``[B, T]``; when given, the result is exactly 0 outside it.

    Returns:
        ``[B, T]`` tensor ``logps - ref_logps``.
    """
    d = logps - ref_logps
    if mask is None:
        return d
    return torch.where(_as_bool_mask(mask), d, _zero(d))


def kl_k2(logps: torch.Tensor, ref_logps: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """k2 estimator ``0.5 * (log pi - log pi_ref) ** 2`` (``D^{k2}`` in `docs/numerics.md`).

    Args:
        logps: ``[B, T]``; ref_logps: ``[B, T]``; mask: optional ``[B, T]`` (zeros outside it).

    Returns:
        ``[B, T]`` tensor.
    """
    return 0.5 * kl_k1(logps, ref_logps, mask) ** 2


def reinforce_pp_returns(
    rewards: torch.Tensor,
    old_logps: torch.Tensor | None,
    ref_logps: torch.Tensor | None,
    mask: torch.Tensor,
    kl_coef: float,
    gamma: float = 1.0,
) -> torch.Tensor:
    """REINFORCE++ k1-shaped token returns (arXiv:2501.03262 v9).

    ``r_{i,t} = m_{i,t} * (-kl_coef * (old - ref) + 1[t = T_i] * R_i)`` with ``T_i`` the last valid position
    of row ``i``, and ``G_{i,t} = m_{i,t} * sum_{u >= t} gamma^(u - t) r_{i,u}``. The exponent counts
    positions, so an internal mask hole adds nothing and does not reset the return. Rows without a valid
    token are all zeros.

    With ``gamma == 1`` this is one reversed cumulative sum. With ``gamma < 1`` it is a chunked, loop-free scan
    (`_discounted_returns`) that only forms non-negative powers of ``gamma``: never ``gamma ** -t``, which
    overflows for long completions.

    Args:
        rewards: ``[B]`` terminal rewards ``R_i``.
        old_logps: ``[B, T]`` log-probs of the sampling (old) policy, or ``None`` when ``kl_coef == 0``. Exactly the
            mask's shape: anything else (a ``[B, 1]`` tensor, say) is a ``ValueError``, never broadcast.
        ref_logps: ``[B, T]`` reference log-probs, or ``None`` when ``kl_coef == 0``. Same shape rule.
        mask: ``[B, T]`` bool or 0/1.
        kl_coef: ``beta`` of the paper, the k1 shaping coefficient (finite, ``>= 0``).
        gamma: discount in ``[0, 1]``.

    Returns:
        ``[B, T]`` returns in at least float32 (float64 for float64 rewards or log-probs), zero outside the mask.
    """
    if mask.dim() != 2:
        raise ValueError(f"mask must be [B, T], got shape {tuple(mask.shape)}")
    if rewards.shape != mask.shape[:1]:
        raise ValueError(f"rewards must be [B] = [{mask.shape[0]}], got shape {tuple(rewards.shape)}")
    if not 0.0 <= gamma <= 1.0:
        raise ValueError(f"gamma must be in [0, 1], got {gamma}")
    if not 0.0 <= kl_coef < math.inf:
        raise ValueError(f"kl_coef must be a finite float >= 0, got {kl_coef}")
    # Shapes are host metadata: checking them costs no sync, and it stops a [B, 1] or [T] tensor from broadcasting.
    for name, x in (("old_logps", old_logps), ("ref_logps", ref_logps)):
        if x is not None and x.shape != mask.shape:
            raise ValueError(f"{name} must have the mask's shape {tuple(mask.shape)}, got {tuple(x.shape)}")
    m = _as_bool_mask(mask)
    B, T = m.shape
    dtypes = [rewards.dtype] + [x.dtype for x in (old_logps, ref_logps) if x is not None]
    acc = torch.float64 if torch.float64 in dtypes else torch.float32
    zero = torch.zeros((), dtype=acc, device=m.device)

    if kl_coef != 0.0:
        if old_logps is None or ref_logps is None:
            raise ValueError("old_logps and ref_logps are required when kl_coef != 0")
        token_reward = -kl_coef * torch.where(m, old_logps.to(acc) - ref_logps.to(acc), zero)
    else:
        token_reward = torch.zeros((B, T), dtype=acc, device=m.device)

    if T > 0:
        # The terminal reward sits on the last *valid* position T_i, not on the last column.
        positions = torch.arange(T, device=m.device)
        last_valid = torch.where(m, positions, -1).amax(dim=1, keepdim=True)
        is_last = m & (positions == last_valid)
        token_reward = token_reward + torch.where(is_last, rewards.to(acc).unsqueeze(1), zero)

    if gamma == 1.0:
        returns = token_reward.flip(-1).cumsum(-1).flip(-1)
    else:
        returns = _discounted_returns(token_reward, gamma)
    return torch.where(m, returns, zero)


def _discounted_returns(rewards: torch.Tensor, gamma: float, chunk: int = 256) -> torch.Tensor:
    """``G_t = sum_{u >= t} gamma^(u - t) r_u`` for ``[B, T]`` rewards, loop-free, with non-negative exponents only.

    Within chunks of ``C`` positions a ``[C, C]`` upper-triangular discount matrix gives the chunk-local returns;
    the return at the start of each chunk is then carried backwards with a ``[n, n]`` matrix of ``gamma^(C j)``,
    and position ``t`` of a chunk adds ``gamma^(C - t)`` times the next chunk's start. Powers of ``gamma`` only
    shrink (``gamma ** -t`` rescaling would overflow for long completions), and underflow to 0 is harmless.
    """
    B, T = rewards.shape
    if T == 0:
        return rewards.clone()
    C = min(chunk, T)
    n = -(-T // C)
    x = torch.nn.functional.pad(rewards, (0, n * C - T)).view(B, n, C)
    dtype, device = rewards.dtype, rewards.device
    pos = torch.arange(C, device=device)
    lag = pos.unsqueeze(0) - pos.unsqueeze(1)  # lag[t, u] = u - t
    discount = torch.where(lag >= 0, torch.tensor(gamma, dtype=dtype, device=device) ** lag.clamp(min=0), 0.0)
    local = x @ discount.T  # [B, n, C]: sum over the chunk's u >= t
    chunks = torch.arange(n, device=device)
    chunk_lag = chunks.unsqueeze(0) - chunks.unsqueeze(1)
    carry = torch.where(
        chunk_lag >= 0, torch.tensor(gamma, dtype=dtype, device=device) ** (C * chunk_lag.clamp(min=0)), 0.0
    )
    starts = local[:, :, 0] @ carry.T  # [B, n]: full return at each chunk's first position
    following = torch.nn.functional.pad(starts[:, 1:], (0, 1))  # the next chunk's start, 0 after the last
    to_next = torch.tensor(gamma, dtype=dtype, device=device) ** (C - pos)  # gamma^(C - t)
    return (local + following.unsqueeze(-1) * to_next).reshape(B, n * C)[:, :T]


def group_centered_rewards(
    rewards: torch.Tensor, num_generations: int, scorable: torch.Tensor | None = None
) -> torch.Tensor:
    """Inclusive group-mean baseline ``C_i = R_i - mean_{j in g} R_j`` (REINFORCE++-baseline).

    Groups are contiguous blocks of ``num_generations`` rows. The mean includes ``R_i`` itself (not leave-one-out)
    and ``C_i`` is not divided by a group std.

    Args:
        rewards: ``[B]`` scalar rewards.
        num_generations: ``K >= 2``; must divide ``B``.
        scorable: optional ``[B]`` bool. Unscorable rows (for example a reward function returned ``None``) are
            left out of their group's mean and get ``C_i = 0``; their stored reward is never read. A group with no
            scorable member gives zeros.

    Returns:
        ``[B]`` centered rewards in at least float32.
    """
    if isinstance(num_generations, bool) or not isinstance(num_generations, int) or num_generations < 2:
        raise ValueError(
            f"num_generations must be an integer >= 2 for the inclusive group-mean baseline, got {num_generations!r}: "
            "with one sample per prompt every centered reward R_i - mean(R_g) is zero."
        )
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be [B], got shape {tuple(rewards.shape)}")
    B = rewards.shape[0]
    if B % num_generations != 0:
        raise ValueError(
            f"the batch of {B} rewards does not split into whole groups of num_generations={num_generations} "
            f"({B} % {num_generations} = {B % num_generations}); groups are contiguous blocks of num_generations rows."
        )
    acc = _accum_dtype(rewards.dtype)
    grouped = rewards.to(acc).view(-1, num_generations)
    if scorable is None:
        ok = torch.ones_like(grouped, dtype=torch.bool)
    else:
        ok = scorable.to(torch.bool).view(-1, num_generations)
    zero = torch.zeros((), dtype=acc, device=rewards.device)
    safe = torch.where(ok, grouped, zero)
    # Mean in float64: a group of equal rewards then has a baseline equal to that reward and C_i == 0 exactly.
    count = ok.sum(dim=1, keepdim=True).clamp(min=1).to(torch.float64)
    baseline = (safe.to(torch.float64).sum(dim=1, keepdim=True) / count).to(acc)
    return torch.where(ok, safe - baseline, zero).view(B)


def group_mean_advantages(
    rewards: torch.Tensor, mask: torch.Tensor, num_generations: int, scorable: torch.Tensor | None = None
) -> torch.Tensor:
    """Raw REINFORCE++-baseline token advantages ``A^raw_{i,t} = m_{i,t} * C_i``.

    Args:
        rewards: ``[B]`` scalar rewards.
        mask: ``[B, T]`` bool or 0/1.
        num_generations: ``K >= 2`` dividing ``B``; groups are contiguous blocks of ``K`` rows.
        scorable: optional ``[B]`` bool, see `group_centered_rewards`.

    Returns:
        ``[B, T]`` with ``C_i`` broadcast to the valid tokens of row ``i`` and zeros elsewhere.
    """
    if mask.dim() != 2 or mask.shape[0] != rewards.shape[0]:
        raise ValueError(f"mask must be [B, T] with B = {rewards.shape[0]}, got shape {tuple(mask.shape)}")
    centered = group_centered_rewards(rewards, num_generations, scorable)
    return torch.where(_as_bool_mask(mask), centered.unsqueeze(1), _zero(centered))


def _resolve_group(group):
    """The process group to reduce over, or None for a purely local computation."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    if group is not None:
        return group if dist.get_world_size(group) > 1 else None
    return dist.group.WORLD if dist.get_world_size() > 1 else None


def global_masked_normalize(
    values: torch.Tensor, mask: torch.Tensor, var_floor: float = 1e-8, group=None, *, allow_empty: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Global masked z-score over every valid token of every process (`docs/numerics.md`).

    ``mu = (1/N) sum_S A``, ``sigma^2 = (1/N) sum_S (A - mu)^2`` (population variance, two passes: the mean is
    all-reduced first, then the centered squares), and the output is
    ``where(mask, (A - mu) * rsqrt(max(sigma^2, var_floor)), 0)``. The floor is on the variance, as in OpenRLHF.

    Every process joins both all-reduces, also one whose mask is empty (it contributes zeros and gets zeros).
    Nothing is moved to the host: an empty global population fails through ``torch._assert_async`` on every
    process (a ``RuntimeError`` on CPU, a device-side assert on CUDA). With ``allow_empty=True`` it is not an
    error: every output is then zero (``count == 0``), which the trainer uses to turn a generation batch with no
    valid token into a zero-advantage step without a host sync. Nothing changes for a non-empty population.

    Values are centered in at least float32 (float64 for float64 input); both sums, the all-reduce and the token
    count are in float64, so the count is exact far past 2**24 tokens and a constant population gives exact zeros.

    Args:
        values: ``[B, T]`` raw advantages (any float dtype; ``B`` may be 0).
        mask: ``[B, T]`` bool or 0/1.
        var_floor: lower bound applied to the variance before the reciprocal square root: a finite Python float
            ``> 0`` (``0`` would turn a constant population into NaN).
        group: ``torch.distributed`` process group. Default: the world group when ``torch.distributed`` is
            initialized with more than one process, otherwise the computation is local.
        allow_empty: return zeros for a globally empty mask instead of failing.

    Returns:
        ``(normalized [B, T] in values.dtype, mean [], var [], count [])``: mean and var in the accumulation
        dtype, count as int64, all 0-dim on ``values.device``.
    """
    if values.shape != mask.shape:
        raise ValueError(f"values and mask must have the same shape, got {tuple(values.shape)} and {tuple(mask.shape)}")
    # A zero floor turns a constant population into 0 * rsqrt(0) = NaN; a tensor floor would need a host sync.
    if isinstance(var_floor, bool) or not isinstance(var_floor, numbers.Real) or not 0.0 < var_floor < math.inf:
        raise ValueError(f"var_floor must be a finite float > 0, got {var_floor!r}")
    m = _as_bool_mask(mask)
    acc = _accum_dtype(values.dtype)
    zero = torch.zeros((), dtype=acc, device=values.device)
    pg = _resolve_group(group)

    x = torch.where(m, values.to(acc), zero)
    # The sum is taken in float64 so that a constant population has a mean equal to that constant, bit for bit,
    # and zero variance then gives exact zeros (a float32 sum of N copies of 0.1 is off by an ulp).
    first = torch.stack([x.to(torch.float64).sum(), m.sum().to(torch.float64)])
    if pg is not None:
        dist.all_reduce(first, op=dist.ReduceOp.SUM, group=pg)
    count = first[1]
    if not allow_empty:
        torch._assert_async(count > 0, "global_masked_normalize: the mask selects no valid token on any process")
    # An empty population selects nothing below: x, mean, centered and var are all exactly 0, so are the outputs.
    mean = (first[0] / count.clamp(min=1)).to(acc)

    centered = torch.where(m, x - mean, zero)
    second = centered.to(torch.float64).square().sum().reshape(1)
    if pg is not None:
        dist.all_reduce(second, op=dist.ReduceOp.SUM, group=pg)
    var = (second[0] / count.clamp(min=1)).to(acc)

    rstd = torch.rsqrt(torch.clamp(var, min=var_floor))
    normalized = torch.where(m, centered * rstd, zero).to(values.dtype)
    return normalized, mean, var, count.to(torch.int64)


def masked_response_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The response-mean reducer ``(1/B) sum_i (1/max(L_i, 1)) sum_t m_{i,t} x_{i,t}``.

    Args:
        values: ``[B, T]`` per-token values.
        mask: ``[B, T]`` bool or 0/1; ``L_i`` is the number of valid tokens of row ``i``.

    Returns:
        0-dim tensor. A row with no valid token contributes 0 but still counts in ``B``.
    """
    m = _as_bool_mask(mask)
    picked = torch.where(m, values, _zero(values))
    lengths = m.sum(dim=-1).clamp(min=1).to(picked.dtype)
    return (picked.sum(dim=-1) / lengths).mean()


def response_mean_ppo_loss(
    logps: torch.Tensor,
    old_logps: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    epsilon_low: float = 0.2,
    epsilon_high: float = 0.2,
    importance_weights: torch.Tensor | None = None,
) -> torch.Tensor:
    """Token PPO clipped surrogate with response-mean reduction (`docs/numerics.md`).

    ``rho = exp(logps - old_logps)`` and the token loss is ``max(-rho * A, -clip(rho, 1 - eps_low, 1 + eps_high) * A)``,
    reduced by `masked_response_mean`.

    Args:
        logps: ``[B, T]`` current-policy log-probs (carry the gradient).
        old_logps: ``[B, T]`` log-probs of the policy that sampled.
        advantages: ``[B, T]`` (normalized) advantages.
        mask: ``[B, T]`` bool or 0/1.
        epsilon_low, epsilon_high: clip range ``[1 - epsilon_low, 1 + epsilon_high]``.
        importance_weights: optional ``[B, T]`` or ``[B, 1]`` sampler-correction weights (TRL's vLLM importance
            sampling ratio) multiplying each token's loss; read only at valid positions.

    Returns:
        0-dim loss.
    """
    m = _as_bool_mask(mask)
    token_loss, _ = _clipped_surrogate(logps, old_logps, advantages, m, epsilon_low, epsilon_high)
    return masked_response_mean(_weighted(token_loss, importance_weights, m), m)


def _weighted(token_loss, importance_weights, m):
    if importance_weights is None:
        return token_loss
    w = torch.where(m, importance_weights.expand_as(token_loss).to(token_loss.dtype), _zero(token_loss))
    return token_loss * w.detach()


def _clipped_surrogate(logps, old_logps, advantages, m, epsilon_low, epsilon_high):
    """Token loss ``max(-rho A, -clip(rho) A)`` ``[B, T]`` and the weight its gradient puts on ``grad log p``:
    ``rho`` where the unclipped branch is active, 0 where the clipped one is (detached). Zero outside ``m``."""
    zero = _zero(logps)
    # Select before exp: a NaN or Inf at a masked position never enters exp() or the product.
    log_ratio = torch.where(m, logps - old_logps, zero)
    adv = torch.where(m, advantages.to(logps.dtype), zero)
    ratio = torch.exp(log_ratio)
    unclipped = -ratio * adv
    clipped = -torch.clamp(ratio, 1.0 - epsilon_low, 1.0 + epsilon_high) * adv
    token_loss = torch.where(m, torch.maximum(unclipped, clipped), zero)
    weight = torch.where(m & (unclipped >= clipped), ratio, zero).detach()
    return token_loss, weight


def response_mean_k2_loss(logps: torch.Tensor, ref_logps: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Separate k2 reference penalty of REINFORCE++-baseline, response-mean reduced.

    Args:
        logps: ``[B, T]`` current-policy log-probs (carry the gradient); ref_logps: ``[B, T]``; mask: ``[B, T]``.

    Returns:
        0-dim ``(1/B) sum_i (1/max(L_i,1)) sum_t m 0.5 (logps - ref)^2``.
    """
    return masked_response_mean(kl_k2(logps, ref_logps, mask), mask)
