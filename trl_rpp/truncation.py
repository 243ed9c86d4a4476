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


class SamplerSupportCapture:
    """A logits processor that records, at every generation step, the ids the sampler kept: the finite scores after
    every warper (`top_k`, `top_p`, `min_p`, `typical_p`, epsilon and eta cutoffs), as `[B, K]` rows padded with
    `ABSENT`, `K = bound`. It must run last (`last_in_generate`): transformers applies its warpers after the custom
    logits processors a caller passes. Returns the scores unchanged.

    Memory is `O(B * T * bound)`; a step that kept more than `bound` ids fails `tensors`, naming the bound (a
    `top_p` or `min_p` without a `top_k` can keep most of the vocabulary)."""

    def __init__(self, bound: int):
        self.bound = bound
        self.ids, self.kept = [], []

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        finite = torch.isfinite(scores)
        self.kept.append(finite.sum(-1))
        values, ids = scores.topk(min(self.bound, scores.size(-1)), dim=-1)
        self.ids.append(ids.masked_fill(~torch.isfinite(values), ABSENT))
        return scores

    def tensors(self, length: int) -> torch.Tensor:
        """`[B, length, bound]` kept ids per generated position, cut or padded (with `ABSENT`) to `length`."""
        if not self.ids:
            raise RuntimeError("the support capture recorded no generation step")
        most = int(torch.stack(self.kept).max())  # one host read per generation, after it
        if most > self.bound:
            raise ValueError(f"the sampler kept {most} tokens at one step, more than the support bound "
                             f"{self.bound}; set top_k <= {self.bound} so that every kept set fits")
        ids = torch.stack(self.ids, 1)[:, :length]
        return torch.nn.functional.pad(ids, (0, 0, 0, length - ids.size(1)), value=ABSENT)


def last_in_generate(model, processor):
    """A context manager: within it, `model.generate` runs `processor` after every logits processor and warper it
    builds (transformers' private `_get_logits_processor` is wrapped on the instance; where it is missing, this
    raises, naming the transformers version)."""
    from contextlib import contextmanager

    import transformers

    if not callable(getattr(model, "_get_logits_processor", None)):
        raise RuntimeError(f"transformers {transformers.__version__} has no GenerationMixin._get_logits_processor: "
                           "the sampler's support cannot be captured after its warpers")

    @contextmanager
    def block():
        original, shadowed = model._get_logits_processor, model.__dict__.get("_get_logits_processor")

        def with_processor_last(*args, **kwargs):
            processors = original(*args, **kwargs)
            processors.append(processor)
            return processors

        model._get_logits_processor = with_processor_last
        try:
            yield processor
        finally:
            if shadowed is None:
                del model._get_logits_processor
            else:
                model._get_logits_processor = shadowed

    return block()
