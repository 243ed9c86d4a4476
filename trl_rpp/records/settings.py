"""Which generation settings the sampler's record describes: the rules that config validation and the trainer read.

Score centering needs the sampler's distribution to be ``q = softmax(logits / temperature)``; a truncation (`top_k`,
`top_p`, `min_p`, and on transformers' path `typical_p`, `epsilon_cutoff`, `eta_cutoff`, `top_h`) is replayed
exactly over its kept sets (`trl_rpp.records.replay`), bounded by `top_k` (`support_bound`). Every other setting that
changes q is named here with its neutral values, for transformers' `generate` and for vLLM's `SamplingParams`.
Imports nothing heavy: `RPPConfig` and the command line read it.
"""

from __future__ import annotations

from ..errors import unsupported

MAX_SUPPORT = 256  # the largest top_k: the record holds twice as many ids per position (`record_width`)
# The settings whose effect on q is a truncation to a kept set, which the replay reproduces exactly.
REPLAYED = ("top_k", "top_p", "min_p", "typical_p", "epsilon_cutoff", "eta_cutoff", "top_h")
REPLAYED_VLLM = ("top_k", "top_p", "min_p")

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
    than the truncations named in `replayed` (`trl_rpp.records.replay` renormalizes over what they keep). `under` names
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


def record_width(bound: int | None) -> int:
    """Ids recorded per position for a kept-set bound `top_k`: twice as many (0 without a bound). `top_k` keeps every
    token whose score ties the k-th, so a kept set can exceed `top_k`, often with a bfloat16 engine (measured: a
    SmolLM2 vLLM engine in bf16 at top_k=20); the record has room for such ties, and a larger set raises."""
    return 2 * bound if bound else 0


def truncating(settings: dict, vllm: bool) -> list[str]:
    """The names of the replayed settings in `settings` (transformers' or, with `vllm`, vLLM's names) that truncate."""
    neutral = NEUTRAL_VLLM_SAMPLING if vllm else NEUTRAL_SAMPLING
    return [n for n in (REPLAYED_VLLM if vllm else REPLAYED) if n in settings and settings[n] not in neutral[n]]


def support_bound(settings: dict, vllm: bool, replay: bool, where: str = "") -> int | None:
    """The bound `K` of the kept sets (`top_k`) when `settings` truncate and `replay` is on, else None.

    Raises `ValueError` naming `top_k` when something truncates without a `top_k` in 1..`MAX_SUPPORT`."""
    names = truncating(settings, vllm)
    if not (replay and names):
        return None
    top_k = settings.get("top_k")
    if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= MAX_SUPPORT:
        raise unsupported(
            f"{where}top_k", top_k, f"an integer from 1 to {MAX_SUPPORT}",
            under=f"{', '.join(names)} and replay_sampler_support=True",
            why="The replay reads every kept set, and top_k bounds its size (and the memory it takes); set "
            "replay_sampler_support=False to train on the full-vocabulary log-probs instead (biased).",
        )
    return top_k


def sampler_record(args, model_generation=None, generation_kwargs=None) -> tuple[int | None, int]:
    """What the sampler's record holds for an `RPPConfig` `args`: ``(bound, width)``, the bound `top_k` of a replayed
    truncation's kept sets (None: no replay, `support_bound`) and the ids recorded per position (`record_width`, else
    score centering's `k`; 0: nothing is recorded). With `model_generation` (transformers' path, once the model is
    loaded), the settings `generate` will use: the model's generation config under `generation_kwargs`."""
    if model_generation is None:
        bound = support_bound(sampler_settings(args), args.use_vllm, args.replay_sampler_support)
    else:
        bound = support_bound({**model_generation, **generation_kwargs}, False, args.replay_sampler_support,
                              where="the model's generation config: ")
    return bound, record_width(bound) or (args.score_centering_top_k if args.score_centering else 0)


def sampler_settings(args) -> dict:
    """The sampling settings an `RPPConfig` sets, as `generation_kwargs` would carry them."""
    return {"top_p": args.top_p, "top_k": args.top_k, "min_p": args.min_p, **(args.generation_kwargs or {})}


def check_sampler_record_support(users: list[str], rollout_func_with_tools: bool, multimodal: bool,
                                 aux_loss: bool) -> None:
    """Reject, at construction, the GRPO features whose sampling the sampler record cannot see. `users`: what needs
    the record (`"score_centering=True"`, `"a replayed truncating sampler"`); then whether the trainer has a
    `rollout_func` together with `tools` (its first turn would come with its own lists and the tool loop's turns from
    `generate`), a multimodal processing class, and an MoE router aux loss (the head reader does not return it)."""
    unsupported = [("rollout_func together with tools", rollout_func_with_tools),
                   ("a multimodal processing_class", multimodal), ("an MoE router aux loss", aux_loss)]
    for name, present in unsupported:
        if present:
            raise ValueError(
                f"{' and '.join(users)} does not support {name}: the sampler's log-probs are captured "
                "token by token inside text `generate` calls (or returned by a rollout_func without tools)."
            )


def check_model_sampling(model_generation: dict, generation_kwargs: dict, temperature: float, replay: bool) -> None:
    """With score centering on transformers' `generate`: the model's own generation config (`model_generation`, its
    `to_dict()`) also shapes q, overridden by the trainer's `generation_kwargs`; reject what changes q other than a
    replayed truncation (`replay`: the kept sets are replayed)."""
    merged = {**model_generation, **generation_kwargs}
    replayed = truncating(merged, False) if replay else ()
    check_exact_sampling(merged, temperature, where="the model's generation config: ", replayed=replayed)
