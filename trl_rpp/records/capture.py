"""The sampler's record inside transformers' `generate`: score centering's top-k, or a truncating sampler's kept sets.

Score centering needs, at every generated token, the top-k ids and log-probs of the distribution that actually drew
that token: ``q = softmax(logits / temperature)`` over the full vocabulary. `output_scores` or `output_logits`
would keep ``B * T * V`` floats (4.6 GiB at B=8, T=1024, V=152k); `SamplerTopKCapture` keeps ``B * T * k`` of each,
plus the sampled token's log-prob.

Where it sits: transformers runs custom logits processors *before* its sampling warpers (temperature, top-k,
top-p, ...). With score centering every warper but temperature is rejected (`check_exact_sampling`), so the scores
the capture sees are the raw logits (cast to float32 by `generate`) and it applies the temperature itself: exactly
the distribution `generate` samples from. `tests/test_score_centering_trainer.py` checks this against a separate
forward pass. A truncating sampler's kept sets (`SamplerSupportCapture`, for the replay) are recorded after every
warper instead, through the processors `generate` builds (`trl_rpp.patches.generate_with_processor`).

`RecordedTopK` holds the same record when an engine or a `rollout_func` returned it as lists.
"""

from __future__ import annotations

import torch
from transformers import LogitsProcessor

from ..patches import generate_with_processor


class SamplerTopKCapture(LogitsProcessor):
    """Records ``[B, k]`` top-k ids and log-probs of ``log_softmax(scores / temperature)`` at every step, and the
    log-prob of the token each step sampled. Returns the scores unchanged."""

    what = "score centering's top-k record of the sampler"

    def __init__(self, k: int, temperature: float):
        self.k, self.temperature = k, temperature
        self.ids, self.logps, self.sampled = [], [], []
        self._previous = None

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        logq = torch.log_softmax(scores.float() / self.temperature, dim=-1)
        if self._previous is not None:  # the last column of input_ids is what the previous step sampled
            self.sampled.append(self._previous.gather(-1, input_ids[:, -1:]).squeeze(-1))
        top = logq.topk(min(self.k, logq.size(-1)), dim=-1)
        self.ids.append(top.indices)
        self.logps.append(top.values)
        self._previous = logq  # one [B, V] tensor, released at the next step
        return scores

    def finish(self, last_tokens: torch.LongTensor) -> None:
        if self._previous is not None:
            self.sampled.append(self._previous.gather(-1, last_tokens.unsqueeze(-1)).squeeze(-1))
            self._previous = None

    def tensors(self, length: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(ids [B, length, k], logps [B, length, k], sampled_logps [B, length])``, cut or padded to ``length``
        positions; padded entries have id 0 and log-prob ``-inf`` (absent)."""
        if not self.ids:
            raise RuntimeError(f"{type(self).__name__} ({self.what}) recorded no generation step: transformers' "
                               "generate never ran it as a logits processor")
        recorded = RecordedTopK(torch.stack(self.ids, 1), torch.stack(self.logps, 1), torch.stack(self.sampled, 1))
        return recorded.tensors(length)


class SamplerSupportCapture(SamplerTopKCapture):
    """A logits processor that records, at every generation step, the ids the sampler kept and their log-probs under
    the sampler, `log q_S`: the top-`bound` entries of the log-softmax of the scores after every warper
    (temperature, `top_k`, `top_p`, `min_p`, `typical_p`, epsilon and eta cutoffs), which is `-inf` outside the kept
    set. It must run after the warpers (`generate_with_processor(..., last=True)`): transformers applies them after
    the custom logits processors a caller passes. `tensors(length)` gives `SamplerTopKCapture`'s
    `(ids, logps, sampled_logps)`, `bound` wide; `support_of` turns them into kept ids.

    The record bounds the kept set: where the warpers kept more than `bound` ids (`top_k` keeps every tie at its k-th
    score), the capture returns the scores with only the `bound` recorded ones finite, so the token is drawn from
    exactly the recorded set and the replay stays exact. `overflowed` counts such positions (a `[ ]` int64 tensor,
    no host read). Memory is `O(B * T * bound)`."""

    what = "the kept sets of a truncating sampler, for replay"

    def __init__(self, bound: int):
        super().__init__(bound, temperature=1.0)  # the scores it sees are already divided by the temperature
        self.bound, self.overflowed = bound, None

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        top = scores.topk(min(self.bound, scores.size(-1)), dim=-1)
        over = torch.isfinite(scores).sum(-1) > top.values.size(-1)
        self.overflowed = over.sum() if self.overflowed is None else self.overflowed + over.sum()
        # The recorded ids alone stay finite; equal to `scores` wherever the kept set fits the record.
        scores = torch.full_like(scores, float("-inf")).scatter(-1, top.indices, top.values)
        super().__call__(input_ids, scores)
        return scores


def capturing_generate(model, capture: SamplerTopKCapture, last: bool = False):
    """Within the block, ``model.generate`` also runs `capture` as its last custom logits processor, or with
    ``last=True`` after every warper (nests, see `generate_with_processor`)."""
    return generate_with_processor(model, capture, after=lambda sequences: capture.finish(sequences[:, -1]), last=last)


class RecordedTopK:
    """Per-sequence top-k lists already gathered (vLLM), with the same `tensors(length)` as `SamplerTopKCapture`."""

    def __init__(self, ids, logps, sampled):
        self.ids, self.logps, self.sampled = ids, logps, sampled  # [B, T, k], [B, T, k], [B, T]

    def tensors(self, length: int):
        ids, logps, sampled = self.ids[:, :length], self.logps[:, :length], self.sampled[:, :length]
        pad = length - ids.size(1)
        if pad > 0:
            ids = torch.nn.functional.pad(ids, (0, 0, 0, pad), value=0)
            logps = torch.nn.functional.pad(logps, (0, 0, 0, pad), value=float("-inf"))
            sampled = torch.nn.functional.pad(sampled, (0, pad), value=float("-inf"))
        return ids, logps, sampled
