"""Log-probs renormalized over a truncating sampler's kept sets, as pure tensor functions.

`top_k`, `top_p` or `min_p` leave a kept set `S_t` of tokens at each position t, and the sampler draws the token
from `q_S(y) = q(y) / q(S_t)`, not from the full softmax `q`. A ratio or a score taken against `q_S` must use the
trainer's policy over the same set,

    log pi(y | S_t) = z_y / tau - logsumexp_{v in S_t} z_v / tau,

with `z` the trainer's logits and `tau` the sampling temperature, the set held fixed from the sampler. Only the `K`
logits of the kept ids are read, never a `[B, T, V]` softmax. `trl_rpp.records.capture.SamplerSupportCapture`
records `S_t` inside transformers' `generate`; the trainer's replay is `trl_rpp.records.replay`.
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
        `[B, T]` float32 (float64 for float64 logits). A position whose row holds no id gives `-inf` (callers mask
        such positions).
    """
    present = support_ids != ABSENT
    acc = torch.float64 if logits.dtype == torch.float64 else torch.float32
    gathered = logits.gather(-1, support_ids.clamp(min=0)).to(acc) / temperature
    return gathered.masked_fill(~present, float("-inf")).logsumexp(-1)


def support_logps(logits: torch.Tensor, ids: torch.Tensor, support_ids: torch.Tensor,
                  temperature: float) -> torch.Tensor:
    """`log pi(v | S_t)` of the ids `ids` at each position, renormalized over the kept set (with gradient).

    Args:
        logits: `[B, T, V]` the trainer's logits at each completion position.
        ids: `[B, T, n]` int64 ids to read (each should be in its position's kept set; an id outside it gives a value
            that is not a log-prob of `q_S`). Values at `ABSENT` slots are unspecified: callers mask them.
        support_ids: `[B, T, K]` int64, the kept ids, padded with `ABSENT`.
        temperature: the sampler's temperature, `> 0`.

    Returns:
        `[B, T, n]` float32 (float64 for float64 logits). The gradient reaches only the logits of `ids` and `S_t`.
        A position whose row holds no id gives finite values of no meaning (callers mask them).
    """
    acc = torch.float64 if logits.dtype == torch.float64 else torch.float32
    picked = logits.gather(-1, ids.clamp(min=0)).to(acc) / temperature
    # A row without any id (padding, tool tokens) reads its first slot instead: a finite value the caller masks, where
    # a logsumexp of nothing (-inf) would turn a zero upstream gradient into NaN in the backward.
    empty = (support_ids == ABSENT).all(-1, keepdim=True)
    first = torch.zeros_like(support_ids, dtype=torch.bool)
    first[..., 0] = True
    safe = support_ids.masked_fill(empty & first, 0)
    return picked - support_logsumexp(logits, safe, temperature).to(acc).unsqueeze(-1)


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
        `[B, T]` float32 (float64 for float64 logits), `<= 0` at valid positions, exactly 0 elsewhere (whatever the logits or ids hold there).
        A full-vocabulary support gives `log_softmax(logits / tau)` at `token_ids`.
    """
    out = support_logps(logits, token_ids.unsqueeze(-1), support_ids, temperature).squeeze(-1)
    return torch.where(mask.bool(), out, torch.zeros_like(out))


def token_in_support(token_ids: torch.Tensor, support_ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """`[B, T]` bool: each valid token is in its position's kept set (True at masked positions). A sampled token
    outside its recorded support means the capture does not describe the sampler."""
    inside = (support_ids == token_ids.unsqueeze(-1)).any(-1)
    return inside | ~mask.bool()


def support_of(ids: torch.Tensor, logps: torch.Tensor) -> torch.Tensor:
    """`[B, T, K]` kept ids, `ABSENT` where a sampler record (`ids`, `logps` `[B, T, K]`: the ids and processed
    log-probs of `SamplerSupportCapture` or vLLM's `processed_logprobs`) holds no finite log-prob: a token the
    sampler could not draw."""
    return ids.masked_fill(~torch.isfinite(logps), ABSENT)
