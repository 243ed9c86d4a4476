"""Replay of a truncating sampler's kept support: log-probs renormalized over the tokens `top_k`, `top_p` or `min_p`
left at each position.

Such a sampler draws position t's token from `q_S(y) = q(y) / q(S_t)` over its kept set `S_t`, not from the full
softmax `q`. A ratio or a score taken against `q_S` must use the trainer's policy over the same set,

    log pi(y | S_t) = z_y / tau - logsumexp_{v in S_t} z_v / tau,

with `z` the trainer's logits and `tau` the sampling temperature, the set held fixed from the sampler. Only the `K`
logits of the kept ids are read, never a `[B, T, V]` softmax. The functions here are pure: the capture of `S_t` and
the wiring into the losses live elsewhere.
"""

from __future__ import annotations

import torch

ABSENT = -1  # the id of an empty slot of a support row


def support_logsumexp(logits: torch.Tensor, support_ids: torch.Tensor, temperature: float) -> torch.Tensor:
    """`log sum_{v in S_t} exp(z_v / tau)` per position.

    Args:
        logits: `[B, T, V]` the trainer's logits at each completion position (any float dtype; computed in float32).
        support_ids: `[B, T, K]` int64, the kept ids of each position, padded with `ABSENT` (-1); `K` bounds `|S_t|`.
        temperature: the sampler's temperature, `> 0`.

    Returns:
        `[B, T]` float32. A position whose row holds no id gives `-inf` (callers mask such positions).
    """
    present = support_ids != ABSENT
    gathered = logits.float().gather(-1, support_ids.clamp(min=0)) / temperature
    return gathered.masked_fill(~present, float("-inf")).logsumexp(-1)


def truncated_logps(logits: torch.Tensor, token_ids: torch.Tensor, support_ids: torch.Tensor, mask: torch.Tensor,
                    temperature: float) -> torch.Tensor:
    """`log pi(y_t | S_t)` of each completion token under the trainer, renormalized over the sampler's kept set.

    Args:
        logits: `[B, T, V]` the trainer's logits at each completion position.
        token_ids: `[B, T]` int64, the sampled tokens (each in its row of `support_ids` at valid positions: the
            sampler drew it from there; `token_in_support` checks it).
        support_ids: `[B, T, K]` int64, the kept ids, padded with `ABSENT`.
        mask: `[B, T]` bool or 0/1, the valid completion tokens (tool and environment tokens excluded).
        temperature: the sampler's temperature, `> 0`.

    Returns:
        `[B, T]` float32, `<= 0` at valid positions, exactly 0 elsewhere (whatever the logits or ids hold there).
        A full-vocabulary support gives `log_softmax(logits / tau)` at `token_ids`.
    """
    valid = mask.bool()
    scaled = logits.float() / temperature
    sampled = scaled.gather(-1, token_ids.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    out = sampled - support_logsumexp(logits, support_ids, temperature)
    return torch.where(valid, out, torch.zeros_like(out))


def token_in_support(token_ids: torch.Tensor, support_ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """`[B, T]` bool: each valid token is in its position's kept set (True at masked positions). A sampled token
    outside its recorded support means the capture does not describe the sampler."""
    inside = (support_ids == token_ids.unsqueeze(-1)).any(-1)
    return inside | ~mask.bool()
