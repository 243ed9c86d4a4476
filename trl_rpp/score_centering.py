"""Top-k score centering (`score_centering=True`) as pure tensor functions.

The sampler (transformers' `generate` or vLLM) reports, at every completion position, its top-k token ids ``H`` and
their log-probs ``log q``. The trainer reads its own log-probs ``log p`` at those ids, and the loss centers the
sampled token's score ``grad log p_y`` by ``E_q_hat[grad log p]``, where ``q_hat = q`` on ``H`` and ``rho * p`` on the
tail with ``rho = (1 - sum_H q) / (1 - sum_H p)``. This removes the drift ``E_q[R] * E_q[grad log p]`` that a
sampler differing from the trainer adds to the policy gradient (see docs/score_centering.md).

Shapes: ``B`` responses, ``T`` completion positions, ``k`` head entries per position, ``V`` the vocabulary. A
``mask`` is a bool or 0/1 ``[B, T]``. Masked positions are removed by selection, as in `trl_rpp.core`.
"""

from __future__ import annotations

import torch

from .core import _accum_dtype, _as_bool_mask, _clipped_surrogate, _weighted, _zero, masked_response_mean

__all__ = [
    "score_centering_coefficients",
    "score_centering_correction",
    "score_centered_ppo_loss",
]


def score_centering_coefficients(
    head_logps: torch.Tensor,
    sampler_head_logps: torch.Tensor,
    mask: torch.Tensor,
    min_tail_mass: float = 1e-6,
    weight_fn=None,
    closed: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Coefficients ``q_v - rho p_v`` of the top-k score-centering correction, and the two head masses.

    With an importance weight ``f`` applied to the sampled token's score (``weight_fn``, elementwise on the ratio
    ``p/q``), the centered quantity is ``E_q_hat[f(p/q_hat) grad log p]`` and the coefficients become
    ``q_v f(p_v/q_v) - alpha p_v`` with ``alpha = rho f(1/rho)`` (the tail's ratio is ``1/rho`` everywhere).
    ``weight_fn=None`` means ``f = 1``.

    ``rho = (1 - sum_H q) / (1 - sum_H p)``. Everything is computed in float64 from detached inputs. Tail-mass clamp:
    the sampler's tail ``1 - sum_H q`` is clamped at 0 (rounding can push it slightly negative) and the trainer's at
    ``min_tail_mass``, so a head that holds (nearly) all of the trainer's mass gives a finite ``rho``, never NaN or
    Inf.

    Args:
        head_logps: ``[B, T, k]`` trainer log-probs at the sampler's head ids.
        sampler_head_logps: ``[B, T, k]`` the sampler's log-probs of those ids; ``-inf`` marks an absent entry.
        mask: ``[B, T]`` bool or 0/1.
        min_tail_mass: lower bound of the trainer's tail mass ``1 - sum_H p``.
        weight_fn: see above.
        closed: optional ``[B, T]`` bool, the positions whose head holds the sampler's whole support (a truncating
            sampler replayed, ``p`` and ``q`` renormalized over that support). Both tails are empty there, and the
            ``rho p`` (``alpha p``) term's gradient ``rho grad sum_H p`` is 0 for any ``rho``: it is dropped, where
            rounding would leave ``1 - sum_H q`` of order 1e-7 to divide by the clamped ``min_tail_mass``.

    Returns:
        ``(coeff [B, T, k], sampler_head_mass [B, T], trainer_head_mass [B, T])``, float64, zero where masked or absent.
    """
    if head_logps.shape != sampler_head_logps.shape or head_logps.dim() != 3:
        raise ValueError(
            f"head_logps and sampler_head_logps must both be [B, T, k], got {tuple(head_logps.shape)} and "
            f"{tuple(sampler_head_logps.shape)}"
        )
    m = _as_bool_mask(mask)
    # An entry counts when its token position is valid and the sampler reported it (-inf = absent).
    present = m.unsqueeze(-1) & (sampler_head_logps > float("-inf")) & ~torch.isnan(sampler_head_logps)
    zero64 = torch.zeros((), dtype=torch.float64, device=head_logps.device)
    q = torch.where(present, sampler_head_logps.detach().to(torch.float64), -torch.inf).exp()
    p = torch.where(present, head_logps.detach().to(torch.float64), -torch.inf).exp()
    q_mass, p_mass = q.sum(-1), p.sum(-1)
    rho = ((1.0 - q_mass).clamp(min=0.0) / (1.0 - p_mass).clamp(min=min_tail_mass)).unsqueeze(-1)
    open_tail = torch.ones_like(rho) if closed is None else (~closed.bool()).unsqueeze(-1).to(rho.dtype)
    if weight_fn is None:
        coeff = q - open_tail * rho * p
    else:
        # rho -> 0 (no sampler tail): alpha -> lim f(x)/x, which rho_c * f(1/rho_c) reaches without dividing by 0.
        rho_c = rho.clamp(min=1e-300)
        alpha = open_tail * rho_c * weight_fn(1.0 / rho_c)
        coeff = q * weight_fn(p / torch.where(present, q, 1.0)) - alpha * p
    coeff = torch.where(present, coeff, zero64)
    return coeff, torch.where(m, q_mass, zero64), torch.where(m, p_mass, zero64)


def score_centering_correction(
    head_logps: torch.Tensor,
    sampler_head_logps: torch.Tensor,
    mask: torch.Tensor,
    min_tail_mass: float = 1e-6,
    weight_fn=None,
    closed: torch.Tensor | None = None,
) -> torch.Tensor:
    """Top-k score-centering term ``sum_{v in H} sg[q_v - rho p_v] log p_v`` (arXiv:2609.20807).

    Marek & Ryabinin's correction for sampler/trainer mismatch, with the top-k estimate of `docs/score_centering.md`.

    ``H`` is the sampler's head (its top-k token ids at a position), ``q`` the sampler's probabilities and ``p``
    the trainer's, and ``rho = (1 - sum_H q) / (1 - sum_H p)`` rescales the trainer's tail to the sampler's tail
    mass. Subtracting this term's gradient from the sampled token's score removes the drift
    ``E_q[R] * E_q[grad log p]``: the gradient of ``-A * (log p_y - correction)`` with respect to the logits is
    ``-A * (e_y - q_hat)`` with ``q_hat = q`` on ``H`` and ``rho * p`` elsewhere.

    The coefficients come from `score_centering_coefficients` (float64, no gradient, documented tail clamp); only
    ``head_logps`` carries the gradient.

    Args:
        head_logps: ``[B, T, k]`` trainer log-probs at the sampler's head ids (same temperature); carry the gradient.
        sampler_head_logps: ``[B, T, k]`` the sampler's log-probs of those ids; ``-inf`` marks an absent entry.
        mask: ``[B, T]`` bool or 0/1.
        min_tail_mass: lower bound of the trainer's tail mass ``1 - sum_H p``.
        weight_fn: optional importance weight ``f`` of the sampled token's score, see `score_centering_coefficients`.
        closed: optional ``[B, T]`` bool, heads that hold the whole (replayed) support, see
            `score_centering_coefficients`.

    Returns:
        ``[B, T]`` correction, zero outside the mask (in ``head_logps``' dtype, at least float32).
    """
    coeff, _, _ = score_centering_coefficients(head_logps, sampler_head_logps, mask, min_tail_mass, weight_fn, closed)
    acc = _accum_dtype(head_logps.dtype)
    zero = torch.zeros((), dtype=acc, device=head_logps.device)
    present = coeff != 0
    logp = torch.where(present, head_logps.to(acc), zero)
    correction = (coeff.to(acc) * logp).sum(-1)
    return torch.where(_as_bool_mask(mask), correction, zero)


def score_centered_ppo_loss(
    logps: torch.Tensor,
    old_logps: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    head_logps: torch.Tensor,
    sampler_head_logps: torch.Tensor,
    epsilon_low: float = 0.2,
    epsilon_high: float = 0.2,
    min_tail_mass: float = 1e-6,
    importance_weights: torch.Tensor | None = None,
    weight_fn=None,
    closed: torch.Tensor | None = None,
) -> torch.Tensor:
    """`response_mean_ppo_loss` with the score of every valid token centered (`docs/score_centering.md`).

    The clipped surrogate's gradient at a token is ``-A * w * grad log p_y`` with ``w = rho_t`` when the unclipped
    branch is active and ``w = 0`` when the clipped one is. The centered loss adds ``sg[A * w] * correction``, so the
    gradient becomes ``-A * w * (grad log p_y - sum_H (q_v - rho p_v) grad log p_v)``: the weight that is actually
    applied to the token multiplies the centered score, and a clipped token stays without gradient.

    With a sampler-correction weight ``w_is = f(pi_old/q)`` on each token (TRL's vLLM importance sampling), only the
    surrogate is multiplied by ``w_is``; the correction is not, and centers ``f`` instead: its coefficients become
    ``q_v f(p_v/q_v) - rho f(1/rho) p_v`` (``weight_fn = f``), so the gradient is
    ``-A * w * (f(r_y) grad log p_y - E_q_hat[f(p/q_hat) grad log p])``.

    Args:
        logps, old_logps, advantages, mask: as in `response_mean_ppo_loss` (``[B, T]``).
        head_logps: ``[B, T, k]`` current-policy log-probs at the sampler's head ids (carry the gradient).
        sampler_head_logps: ``[B, T, k]`` the sampler's log-probs of those ids, ``-inf`` for absent entries.
        epsilon_low, epsilon_high, min_tail_mass: see `response_mean_ppo_loss` and `score_centering_correction`.
        importance_weights: optional ``[B, T]`` per-token ``f(pi_old/q)``; it must come with its ``weight_fn``.
        weight_fn: ``f`` as an elementwise function of the ratio, see `score_centering_coefficients`.
        closed: optional ``[B, T]`` bool, heads that hold the whole (replayed) support, see
            `score_centering_coefficients`. With a replayed truncating sampler, every log-prob here is
            ``log p(. | S_t)`` and every sampler log-prob ``log q_S``.

    Returns:
        0-dim loss.
    """
    if (importance_weights is None) != (weight_fn is None):
        raise ValueError("importance_weights and weight_fn go together: pass both or neither")
    m = _as_bool_mask(mask)
    token_loss, weight = _clipped_surrogate(logps, old_logps, advantages, m, epsilon_low, epsilon_high)
    adv = torch.where(m, advantages.to(logps.dtype), _zero(logps))
    correction = score_centering_correction(head_logps, sampler_head_logps, m, min_tail_mass, weight_fn, closed)
    token_loss = _weighted(token_loss, importance_weights, m)
    return masked_response_mean(token_loss + (adv * weight) * correction.to(logps.dtype), m)


@torch.no_grad()
def score_centering_metric_sums(
    logps: torch.Tensor,
    head_logps: torch.Tensor,
    sampler_head_logps: torch.Tensor,
    sampler_logps: torch.Tensor,
    mask: torch.Tensor,
    closed: torch.Tensor | None = None,
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Local sums behind the `score_centering/*` metrics (docs/rpp_trainer.md#logged-metrics), for one reduction across processes.

    A logging helper of `RPPTrainer`, not part of the public API (`__all__`).

    Args:
        logps: ``[B, T]`` trainer log-probs of the sampled tokens.
        head_logps, sampler_head_logps: ``[B, T, k]`` trainer and sampler log-probs at the sampler's head ids.
        sampler_logps: ``[B, T]`` the sampler's log-prob of the sampled token; non-finite where it did not report it.
        mask: ``[B, T]`` bool or 0/1.
        closed: optional ``[B, T]`` bool, heads that hold the whole (replayed) support, see
            `score_centering_coefficients`.

    Returns:
        ``(per_token, sampled)``: 0-dim sums over valid tokens of the sampler's and the trainer's head masses and of
        the size of the correction, ``sum_H |q_v - rho p_v|`` (keyed by metric name, to be divided by the valid-token
        count), and the sum of ``|log q_y - log p_y|`` with the count of tokens it covers (``sampler_logp_abs_diff``,
        ``sampled``). Where the head holds the whole support (``closed``), the loss's coefficients are ``q`` and
        the metric takes ``rho = 1``: as ``sum_S p_v grad log p_v = 0`` there, ``q - p`` gives the same gradient, and
        it is 0 on policy, where ``|q|_1 = 1`` whatever the drift.
    """
    m = _as_bool_mask(mask)
    coeff, q_mass, p_mass = score_centering_coefficients(head_logps, sampler_head_logps, m, closed=closed)
    if closed is not None:
        present = coeff != 0
        p = torch.where(present, head_logps.detach().to(torch.float64), -torch.inf).exp()
        coeff = coeff - torch.where(closed.bool().unsqueeze(-1), p, torch.zeros_like(p))
    has = m & torch.isfinite(sampler_logps)
    diff = torch.where(has, (sampler_logps - logps.detach()).abs(), _zero(logps))
    per_token = {
        "score_centering/sampler_head_mass": q_mass.sum(),
        "score_centering/trainer_head_mass": p_mass.sum(),
        "score_centering/coeff_l1": coeff.abs().sum(),
    }
    return per_token, {"sampler_logp_abs_diff": diff.sum(), "sampled": has.sum()}


def importance_weight_fn(settings):
    """TRL's token-level vLLM sampler correction as a function of the ratio, from `settings` (the trainer or any
    object with its `use_vllm` and `vllm_importance_sampling_*` attributes); None when the correction is off."""
    if not (settings.use_vllm and settings.vllm_importance_sampling_correction):
        return None
    lo, hi = settings.vllm_importance_sampling_clip_min, settings.vllm_importance_sampling_clip_max
    lo, hi = -float("inf") if lo is None else lo, float("inf") if hi is None else hi
    if settings.vllm_importance_sampling_mode == "token_truncate":
        return lambda x: x.clamp(min=lo, max=hi)
    return lambda x: torch.where((x >= lo) & (x <= hi), x, torch.zeros_like(x))  # token_mask
