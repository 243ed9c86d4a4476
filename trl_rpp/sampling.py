"""Capture of the sampler's top-k log-probs during transformers `generate`, for score centering.

Score centering needs, at every generated token, the top-k ids and log-probs of the distribution that actually drew
that token: ``q = softmax(logits / temperature)`` over the full vocabulary. `output_scores` or `output_logits`
would keep ``B * T * V`` floats (4.6 GiB at B=8, T=1024, V=152k); `SamplerTopKCapture` keeps ``B * T * k`` of each,
plus the sampled token's log-prob.

Where it sits: transformers runs custom logits processors *before* its sampling warpers (temperature, top-k,
top-p, ...). With score centering every warper but temperature is rejected (`check_exact_sampling`), so the scores
the capture sees are the raw logits (cast to float32 by `generate`) and it applies the temperature itself: exactly
the distribution `generate` samples from. `tests/test_score_centering_trainer.py` checks this against a separate
forward pass.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from transformers import LogitsProcessor, LogitsProcessorList

# Generation settings that change q away from softmax(logits / temperature), with their neutral values.
NEUTRAL_SAMPLING = {
    "top_p": (None, 1.0),
    "top_k": (None, 0),
    "min_p": (None, 0.0),
    "typical_p": (None, 1.0),
    "epsilon_cutoff": (None, 0.0),
    "eta_cutoff": (None, 0.0),
    "top_h": (None,),
    "repetition_penalty": (None, 1.0),
    "encoder_repetition_penalty": (None, 1.0),
    "no_repeat_ngram_size": (None, 0),
    "encoder_no_repeat_ngram_size": (None, 0),
    "bad_words_ids": (None,),
    "force_words_ids": (None,),
    "sequence_bias": (None,),
    "suppress_tokens": (None,),
    "begin_suppress_tokens": (None,),
    "min_length": (None, 0),
    "min_new_tokens": (None, 0),
    "forced_bos_token_id": (None,),
    "forced_eos_token_id": (None,),
    "exponential_decay_length_penalty": (None,),
    "guidance_scale": (None, 1.0),
    "watermarking_config": (None,),
    "renormalize_logits": (None, False),
    "num_beams": (None, 1),
    "diversity_penalty": (None, 0.0),
    "do_sample": (True,),
}


def check_exact_sampling(settings: dict, temperature: float, where: str) -> None:
    """Raise `ValueError` when a generation setting makes q differ from ``softmax(logits / temperature)``."""
    for name, neutral in NEUTRAL_SAMPLING.items():
        if name in settings and settings[name] not in neutral:
            accepted = " or ".join(repr(v) for v in neutral)
            raise ValueError(
                f"{where}{name}={settings[name]!r} is not supported with score_centering=True; accepted: {accepted}. "
                "Score centering assumes the sampler draws from the full-vocabulary softmax at the sampling "
                "temperature, and this setting changes that distribution."
            )
    if settings.get("temperature", temperature) != temperature:
        raise ValueError(
            f"{where}temperature={settings['temperature']!r} differs from the trainer's temperature={temperature!r}; "
            "with score_centering=True both must be the same so that q and p are taken at one temperature."
        )


class SamplerTopKCapture(LogitsProcessor):
    """Records ``[B, k]`` top-k ids and log-probs of ``log_softmax(scores / temperature)`` at every step, and the
    log-prob of the token each step sampled. Returns the scores unchanged."""

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
            raise RuntimeError("score centering: the sampler capture recorded no generation step")
        recorded = RecordedTopK(torch.stack(self.ids, 1), torch.stack(self.logps, 1), torch.stack(self.sampled, 1))
        return recorded.tensors(length)


@contextmanager
def generate_with_processor(model, processor: LogitsProcessor, first: bool = False, after=None):
    """Within the block, ``model.generate`` also runs `processor`, last among the custom logits processors (or first
    with ``first=True``), and calls ``after(sequences)`` once generation returns.

    Nests: a ``generate`` already wrapped on the instance (by an outer block) is called through and restored on exit.
    """
    original = model.generate
    shadowed = model.__dict__.get("generate")

    def generate(*args, **kwargs):
        given = list(kwargs.pop("logits_processor", None) or [])
        processors = LogitsProcessorList([processor, *given] if first else [*given, processor])
        out = original(*args, logits_processor=processors, **kwargs)
        if after is not None:
            after(out if torch.is_tensor(out) else out.sequences)
        return out

    model.generate = generate
    try:
        yield processor
    finally:
        if shadowed is None:
            del model.generate
        else:
            model.generate = shadowed


def capturing_generate(model, capture: SamplerTopKCapture):
    """Within the block, ``model.generate`` also runs `capture` as its last custom logits processor (nests, see
    `generate_with_processor`)."""
    return generate_with_processor(model, capture, after=lambda sequences: capture.finish(sequences[:, -1]))


# ----------------------------------------------------------------------------------------------------------------
# vLLM: top-k log-probs requested with `logprobs=k` (processed log-probs, i.e. after temperature)
# ----------------------------------------------------------------------------------------------------------------


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


def parse_vllm_topk(completion_ids, logprobs, logprob_token_ids, k: int):
    """Split TRL's vLLM log-prob lists into the sampled token's log-prob and the sampler's top-k head.

    With `logprobs=k`, vLLM returns at each position the k most probable tokens plus, when it is not among them,
    the sampled token; TRL sorts each position's entries by rank (`extract_logprobs`), so entry 0 is the most
    probable token, *not* the sampled one. The sampled token's log-prob is therefore selected by id. NaN log-probs
    (`None` in TRL's lists) stay `None` for the sampled token (TRL turns them into NaN and neutralizes them) and
    become absent (`-inf`) entries of the head.

    Args:
        completion_ids: ``B`` lists of sampled token ids.
        logprobs: ``B x T_i x n`` lists (``n`` = k or k+1), sorted by rank.
        logprob_token_ids: the token ids of those entries, same shape.
        k: head size.

    Returns:
        ``(sampled, recorded)``: ``B`` lists of the sampled tokens' log-probs (float or `None`), and a
        `RecordedTopK` with ``[B, T_max, k]`` head ids and log-probs and ``[B, T_max]`` sampled log-probs.
    """
    if logprobs is None or logprob_token_ids is None:
        raise ValueError("score centering with vLLM needs the engine's log-probs; vLLM returned none")
    B = len(completion_ids)
    T = max((len(c) for c in completion_ids), default=0)
    ids = torch.zeros(B, T, k, dtype=torch.long)
    head = torch.full((B, T, k), float("-inf"))
    sampled_t = torch.full((B, T), float("-inf"))
    sampled = []
    for b, tokens in enumerate(completion_ids):
        row = []
        for t, token in enumerate(tokens):
            entry_ids, entry_lps = logprob_token_ids[b][t], logprobs[b][t]
            try:
                j = entry_ids.index(token)
            except ValueError:
                raise ValueError(
                    f"vLLM's log-probs for sequence {b}, position {t} do not include the sampled token {token}; "
                    "cannot select its log-prob"
                ) from None
            row.append(entry_lps[j])
            if entry_lps[j] is not None:
                sampled_t[b, t] = entry_lps[j]
            for i, (tid, lp) in enumerate(zip(entry_ids[:k], entry_lps[:k])):
                ids[b, t, i] = tid
                if lp is not None:
                    head[b, t, i] = lp
        sampled.append(row)
    return sampled, RecordedTopK(ids, head, sampled_t)
