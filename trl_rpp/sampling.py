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

import itertools
from contextlib import contextmanager

import numpy as np
import torch
from transformers import LogitsProcessor, LogitsProcessorList

from .errors import unsupported

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
    # Decoding methods other than sampling from the processed logits, and assisted (speculative) generation.
    "num_beam_groups": (None, 1),
    "penalty_alpha": (None,),
    "dola_layers": (None,),
    "constraints": (None,),
    "token_healing": (None, False),
    "prompt_lookup_num_tokens": (None,),
    "assistant_early_exit": (None,),
    "use_mtp": (None, False),
    "speculation_type": (None,),
}

# transformers `GenerationConfig` fields that never change the distribution a token is drawn from: lengths, stopping,
# token ids, what is returned, caches and compilation, and settings read only by beam search or assisted generation,
# which `num_beams`, `prompt_lookup_num_tokens` and `assistant_early_exit` above keep off (TRL passes no assistant).
# Every field of the installed `GenerationConfig` is here or in NEUTRAL_SAMPLING, or is `temperature`
# (tests/test_score_centering_trainer.py): a field a new transformers adds fails that test until it is classified.
INERT_GENERATION = frozenset({
    "max_length", "max_new_tokens", "max_time", "stop_strings", "early_stopping", "length_penalty",
    "num_return_sequences", "bos_token_id", "eos_token_id", "pad_token_id", "decoder_start_token_id",
    "output_attentions", "output_hidden_states", "output_logits", "output_scores", "return_dict_in_generate",
    "use_cache", "cache_implementation", "cache_config", "max_cache_len", "compile_config", "disable_compile",
    "low_memory", "prefill_chunk_size", "continuous_batching_config", "remove_invalid_values",
    "num_assistant_tokens", "num_assistant_tokens_schedule", "assistant_confidence_threshold", "assistant_lookbehind",
    "target_lookbehind", "max_matching_ngram_size", "assistant_ensemble_weight", "is_assistant",
    "transformers_version", "_from_model_config",
})

# The same for vLLM's `SamplingParams`, in its own names (what `generation_kwargs` holds when `use_vllm=True`).
NEUTRAL_VLLM_SAMPLING = {
    "top_p": (None, 1.0),
    "top_k": (None, 0, -1),
    "min_p": (None, 0.0),
    "presence_penalty": (None, 0.0),
    "frequency_penalty": (None, 0.0),
    "repetition_penalty": (None, 1.0),
    "min_tokens": (None, 0),
    "logit_bias": (None, {}),
    "allowed_token_ids": (None,),
    "bad_words": (None, []),
    "_bad_words_token_ids": (None, []),
    "structured_outputs": (None,),
    "thinking_token_budget": (None,),
    "extra_args": (None,),  # read by custom samplers and plugins
}
# `watermarking` applies only a watermark configured on the engine, which the trainer's colocated engine never has.
INERT_VLLM_SAMPLING = frozenset({
    "n", "seed", "stop", "stop_token_ids", "ignore_eos", "max_tokens", "logprobs", "prompt_logprobs",
    "logprob_token_ids", "flat_logprobs", "detokenize", "skip_special_tokens", "spaces_between_special_tokens",
    "include_stop_str_in_output", "output_kind", "stream_interval", "skip_clone", "output_text_buffer_length",
    "_eos_token_id", "_all_stop_token_ids", "skip_reading_prefix_cache", "repetition_detection",
    "routed_experts_prompt_start", "trace_decode_token_ids", "watermarking",
})


def check_exact_sampling(settings: dict, temperature: float, where: str, neutral_values=None, replayed=(),
                         under: str = "score_centering=True") -> None:
    """Raise `ValueError` when a generation setting makes q differ from ``softmax(logits / temperature)``, other
    than the truncations named in `replayed` (`trl_rpp.replay` renormalizes over what they keep). `under` names
    what needs an exact q (score centering, vLLM's importance sampling).
    `neutral_values`: `NEUTRAL_SAMPLING` (transformers' names, the default) or `NEUTRAL_VLLM_SAMPLING`."""
    for name, neutral in (NEUTRAL_SAMPLING if neutral_values is None else neutral_values).items():
        if name in settings and settings[name] not in neutral and name not in replayed:
            accepted = " or ".join(repr(v) for v in neutral)
            raise unsupported(
                f"{where}{name}", settings[name], accepted, under=under,
                why="The trainer's log-probs are those of the softmax at the sampling temperature, renormalized over "
                "the kept tokens when top_k, top_p or min_p truncate it (replay_sampler_support=True); this setting "
                "changes the sampler's distribution otherwise, and nothing can replay it.",
            )
    if settings.get("temperature", temperature) != temperature:
        raise ValueError(
            f"{where}temperature={settings['temperature']!r} differs from the trainer's temperature={temperature!r}; "
            f"with {under} both must be the same so that q and p are taken at one temperature."
        )


# The sampling fields a model's own generation config may set, and the values that leave q as it is.
MODEL_SAMPLING_DEFAULTS = {"temperature": 1.0, "top_k": (None, 0), "top_p": 1.0, "min_p": (None, 0.0),
                           "repetition_penalty": 1.0}


def overridden_model_sampling(model_generation: dict, used: dict) -> dict:
    """The sampling settings of a model's own generation config that the trainer's sampler does not use: TRL passes
    its own `temperature`, `top_p`, `top_k`, `min_p` and `repetition_penalty` to `generate` and to vLLM, which then
    override the model's (transformers 5 applies none of the model's values once a generation config is passed).

    Args:
        model_generation: the model's `generation_config.to_dict()`.
        used: the settings the trainer samples with (TRL's `generation_kwargs`, or the config's fields for vLLM).

    Returns:
        ``{name: (model's value, used value)}`` for each field the model sets to a value that changes sampling and
        that differs from the one used.
    """
    out = {}
    for name, neutral in MODEL_SAMPLING_DEFAULTS.items():
        value = model_generation.get(name)
        neutral = neutral if isinstance(neutral, tuple) else (None, neutral)
        if value not in neutral and value != used.get(name):
            out[name] = (value, used.get(name))
    return out


def warn_overridden_model_sampling(model_generation: dict, used: dict) -> None:
    """A `UserWarning` naming each setting of `overridden_model_sampling`, so that a model's sampling defaults (Qwen3's
    `temperature=0.6, top_k=20, top_p=0.95`, say) are never dropped without a word."""
    ignored = overridden_model_sampling(model_generation, used)
    if ignored:
        import warnings

        given = ", ".join(f"{name}={model!r}" for name, (model, _) in ignored.items())
        taken = ", ".join(f"{name}={value!r}" for name, (_, value) in ignored.items())
        warnings.warn(f"The model's generation config sets {given}; the sampler uses RPPConfig's {taken} instead, as "
                      "GRPOTrainer does. Set them in RPPConfig to sample with the model's defaults.", UserWarning,
                      stacklevel=3)


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


def generation_model(model):
    """The object whose `GenerationMixin.generate` runs when ``model.generate`` is called: the model itself, or the
    transformers model inside a PEFT wrapper (`PeftModel.generate` calls its base model's `generate`, which builds
    the logits processors on that model, not on the wrapper)."""
    from peft import PeftModel

    return model.get_base_model() if isinstance(model, PeftModel) else model


@contextmanager
def generate_with_processor(model, processor: LogitsProcessor, first: bool = False, after=None, last: bool = False):
    """Within the block, ``model.generate`` also runs `processor`, last among the custom logits processors (or first
    with ``first=True``), and calls ``after(sequences)`` once generation returns. With ``last=True`` it runs after
    every processor and warper `generate` builds (temperature, top-k, top-p, ...), which transformers applies after
    the custom ones: the private ``_get_logits_processor`` of the model that generates (`generation_model`: inside a
    PEFT wrapper, the transformers model) is wrapped for the call. Where it is missing, or a ``generate`` returns
    without having built its processors through it, this raises, naming the versions: the capture never goes missing
    silently.

    Nests: a ``generate`` already wrapped on the instance (by an outer block) is called through and restored on exit.
    """
    inner = generation_model(model)
    if last and not callable(getattr(inner, "_get_logits_processor", None)):
        import transformers

        raise RuntimeError(f"transformers {transformers.__version__} has no GenerationMixin._get_logits_processor: "
                           "the sampler's kept tokens cannot be captured after its warpers")

    def generate(*args, **kwargs):
        if last:
            built = []
            with _shadowed(inner, "_get_logits_processor", _appending(inner._get_logits_processor, processor, built)):
                out = original(*args, **kwargs)
            if not built:
                import peft
                import transformers

                raise RuntimeError(
                    f"{type(processor).__name__}: {type(model).__name__}.generate returned without building its logits "
                    f"processors through {type(inner).__name__}._get_logits_processor, so nothing was captured "
                    f"(transformers {transformers.__version__}, peft {peft.__version__})"
                )
        else:
            given = list(kwargs.pop("logits_processor", None) or [])
            processors = LogitsProcessorList([processor, *given] if first else [*given, processor])
            out = original(*args, logits_processor=processors, **kwargs)
        if after is not None:
            after(out if torch.is_tensor(out) else out.sequences)
        return out

    original = model.generate
    with _shadowed(model, "generate", generate):
        yield processor


def _appending(build, processor, built):
    def build_and_append(*args, **kwargs):
        processors = build(*args, **kwargs)
        processors.append(processor)
        built.append(True)
        return processors

    return build_and_append


@contextmanager
def _shadowed(obj, name, value):
    """Set ``obj.name = value`` on the instance for the block, then restore what the instance held (or remove it)."""
    shadowed = obj.__dict__.get(name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        if shadowed is None:
            delattr(obj, name)
        else:
            setattr(obj, name, shadowed)


def capturing_generate(model, capture: SamplerTopKCapture, last: bool = False):
    """Within the block, ``model.generate`` also runs `capture` as its last custom logits processor, or with
    ``last=True`` after every warper (nests, see `generate_with_processor`)."""
    return generate_with_processor(model, capture, after=lambda sequences: capture.finish(sequences[:, -1]), last=last)


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


# vLLM's OpenAI server writes a -inf log-prob (a token outside a truncating sampler's kept set) as -9999.0, since
# JSON has no -inf; no kept token's log-prob comes near it.
SERVER_NEG_INF = -9999.0


def parse_vllm_topk(completion_ids, logprobs, logprob_token_ids, k: int):
    """Split TRL's vLLM log-prob lists into the sampled token's log-prob and the sampler's top-k head.

    With `logprobs=k`, vLLM returns at each position the k most probable tokens plus, when it is not among them,
    the sampled token; TRL sorts each position's entries by rank (`extract_logprobs`), so entry 0 is the most
    probable token, *not* the sampled one. The sampled token's log-prob is therefore selected by id. NaN log-probs
    (`None` in TRL's lists) stay `None` for the sampled token (TRL turns them into NaN and neutralizes them) and
    become absent (`-inf`) entries of the head, as do a server's `-9999.0` (its `-inf`, `SERVER_NEG_INF`).

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
    lengths = [len(c) for c in completion_ids]
    T = max(lengths, default=0)
    ids = torch.zeros(B, T, k, dtype=torch.long)
    head = torch.full((B, T, k), float("-inf"))
    sampled_t = torch.full((B, T), float("-inf"))

    # B * T * (k + 1) entries (67 M at B=512, T=4096, k=32) are too many for a Python loop: the Python work here is
    # per sequence, and every pass over positions or entries runs in C (map, chain, fromiter, numpy). The P valid
    # positions are laid end to end, their N entries too; position p owns entries [start[p], ends[p]).
    id_rows = _valid_positions(logprob_token_ids, lengths, "token ids")
    lp_rows = _valid_positions(logprobs, lengths, "log-probs")
    P = len(id_rows)
    n = np.fromiter(map(len, id_rows), np.int64, count=P)
    differ = n != np.fromiter(map(len, lp_rows), np.int64, count=P)
    if differ.any():  # entries are paired by their place in the flat arrays: one short list shifts all the rest
        b, t = _sequence_position(lengths, int(np.argmax(differ)))
        raise ValueError(f"vLLM's log-probs and token ids for sequence {b}, position {t} differ in length")
    ends = np.cumsum(n)
    start = ends - n
    N = int(ends[-1]) if P else 0
    entry_ids = np.fromiter(itertools.chain.from_iterable(id_rows), np.int64, count=N)
    entry_lps = np.fromiter(itertools.chain.from_iterable(lp_rows), np.float64, count=N)  # None -> NaN
    tokens = np.fromiter(itertools.chain.from_iterable(completion_ids), np.int64, count=P)

    # The sampled token's entry: the first one of its position whose id matches (hits come in entry order, so a
    # position's first hit is the first of its run).
    hit = np.flatnonzero(entry_ids == np.repeat(tokens, n))
    hit_pos = np.searchsorted(ends, hit, side="right")
    first = np.ones(hit.size, dtype=bool)
    first[1:] = hit_pos[1:] != hit_pos[:-1]
    hit = hit[first]
    if hit.size < P:  # name the first position without one, as a loop over (b, t) would
        found = np.zeros(P, dtype=bool)
        found[hit_pos[first]] = True
        b, t = _sequence_position(lengths, int(np.argmin(found)))
        raise ValueError(
            f"vLLM's log-probs for sequence {b}, position {t} do not include the sampled token {completion_ids[b][t]}; "
            "cannot select its log-prob"
        )
    chosen = entry_lps[hit]  # [P], float64: the values TRL holds, exactly

    # Head: each position's first k entries, gathered as a [P, k] block; slots past a position's n are absent.
    slot = np.arange(k)
    present = slot < n[:, None]
    src = np.where(present, start[:, None] + slot, 0)  # absent slots read entry 0, then are overwritten
    head_ids = entry_ids[src]
    head_ids[~present] = 0
    head_lps = entry_lps[src]
    head_lps[~present | np.isnan(head_lps) | (head_lps <= SERVER_NEG_INF)] = -np.inf

    # Rows of the [B * T] position grid that the P valid positions fill (all of them when no sequence is short).
    # Position t of sequence b is valid position p = seq_start[b] + t and grid row b * T + t.
    L = np.asarray(lengths, dtype=np.int64)
    seq_start = np.cumsum(L) - L
    rows = torch.from_numpy(np.arange(P) + np.repeat(np.arange(B) * T - seq_start, L))
    ids.view(B * T, k)[rows] = torch.from_numpy(head_ids)
    head.view(B * T, k)[rows] = torch.from_numpy(head_lps).to(head.dtype)  # one rounding float64 -> float32
    sampled_t.view(B * T)[rows] = torch.from_numpy(np.where(np.isnan(chosen), -np.inf, chosen)).to(sampled_t.dtype)

    # TRL builds a tensor from `sampled`: Python floats, None where vLLM gave NaN. astype(object) makes the floats
    # in C; the split into sequences is one slice per sequence.
    values = chosen.astype(object)
    values[np.isnan(chosen)] = None
    values = values.tolist()
    sampled = [values[s : s + length] for s, length in zip(seq_start.tolist(), lengths)]
    return sampled, RecordedTopK(ids, head, sampled_t)


def _valid_positions(per_sequence, lengths, what):
    """The first ``lengths[b]`` positions of every sequence, end to end, in one list (positions past a sequence's
    sampled tokens are ignored, as is a sequence with none)."""
    rows = []
    for b, length in enumerate(lengths):
        if length:
            positions = per_sequence[b]
            if len(positions) < length:
                raise IndexError(
                    f"vLLM's {what} for sequence {b} cover {len(positions)} positions, fewer than its {length} "
                    "sampled tokens"
                )
            rows.extend(positions if len(positions) == length else positions[:length])
    return rows


def _sequence_position(lengths, p: int):
    """(sequence, position) of the p-th valid position."""
    for b, length in enumerate(lengths):
        if p < length:
            return b, p
        p -= length
    raise IndexError(p)
