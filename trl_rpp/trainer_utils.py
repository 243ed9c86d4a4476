"""Wiring helpers of `RPPTrainer` (trl_rpp/trainer.py): they touch a trainer or a process group, never the math."""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch

from .multi_turn import align_turn_captures, rollout_sampler_topk
from .sampling import check_exact_sampling, parse_vllm_topk

# Optional per-batch model inputs (multimodal models) that TRL forwards to `_get_per_token_logps_and_entropies`.
FORWARD_KEYS = (
    "pixel_values", "image_grid_thw", "num_images", "pixel_attention_mask", "spatial_shapes", "num_tiles", "image_sizes",
    "token_type_ids", "mm_token_type_ids", "image_position_ids",
)


@contextmanager
def borrowed_beta(obj, needs_reference: bool):
    """Set ``obj.beta`` non-zero for the block when a reference is needed, and back to 0.0 after it.

    GRPO builds its reference (a frozen copy, or the disabled/"ref" adapter under PEFT) and computes reference
    log-probs exactly when ``beta != 0``. REINFORCE++ needs them for its KL (``kl_coef > 0`` or ``use_kl_loss``), but
    never GRPO's k3 term: beta is borrowed for construction and generation only, and is 0.0 whenever the loss runs.
    """
    obj.beta = 1.0 if needs_reference else 0.0
    try:
        yield
    finally:
        obj.beta = 0.0


def reduce_across_processes(gather, sums=None, means=None, maxima=None, replicated=None) -> dict[str, float]:
    """Reduce named 0-dim tensors over processes with one `gather` and one host transfer, for logging (as GRPO logs).

    `sums` are summed, `means` averaged with equal weight per process (equal local batch sizes make that the global
    mean), `maxima` maxed; `replicated` values are already equal on every process and are only transferred.
    Returns ``{name: float}``.
    """
    groups = [sums or {}, means or {}, maxima or {}]
    names = [name for group in groups for name in group]
    local = torch.stack([v.detach().float().reshape(()) for group in groups for v in group.values()])
    stats = gather(local.unsqueeze(0)).view(-1, len(names)).split([len(g) for g in groups], dim=1)
    reduced = [stats[0].sum(dim=0), stats[1].mean(dim=0), stats[2].amax(dim=0)]
    extra = [v.detach().float().reshape(()) for v in (replicated or {}).values()]
    values = torch.cat(reduced + ([torch.stack(extra)] if extra else [])).tolist()
    return dict(zip(names + list(replicated or {}), values))


def token_mask(batch) -> torch.Tensor:
    """Bool ``[B, T]``: TRL's completion mask times its tool mask (tool output tokens are internal mask holes)."""
    mask = batch["completion_mask"].bool()
    return mask & batch["tool_mask"].bool() if "tool_mask" in batch else mask


def masked_max(x, mask):
    """Max of ``x`` over ``mask``; the lowest float32 when nothing is selected."""
    lowest = torch.full((1,), torch.finfo(torch.float32).min, device=x.device)
    return torch.cat([torch.where(mask, x, lowest).flatten(), lowest]).max()


@dataclass
class PolicyForward:
    """What the loss forward returns: ``[B, T]`` log-probs (with gradient) and entropies at the sampling
    temperature, the MoE router loss when enabled, and with score centering ``[B, T, k]`` log-probs at the sampler's
    head ids."""

    logps: torch.Tensor
    entropies: torch.Tensor
    aux_loss: torch.Tensor | None = None
    head_logps: torch.Tensor | None = None


def empty_batch_message(mode: str, step: int, any_token: bool) -> str:
    """The warning for a generation batch with no valid token on any process. ``any_token``: some completion has a
    valid token (then no reward function could score any of them), else every completion is masked."""
    if any_token:
        cause = (
            "no completion that has a valid token could be scored: every reward function returned None for each of "
            "them (an unavailable judge or reward server?)"
        )
    else:
        cause = "every completion is masked (with mask_truncated_completions=True: none ended within max_completion_length)"
    return (
        f"RPPTrainer ({mode}, step {step}): the generation batch has no valid token: {cause}. It is trained on as a "
        "zero-advantage step (no policy-gradient signal; a KL loss still applies) and logged with "
        "advantages/empty_batch = 1."
    )


def as_list(x):
    return list(x) if isinstance(x, (list, tuple)) else [x]


def check_score_centering_support(trainer) -> None:
    """Reject, at construction, the GRPO features whose sampling the sampler record (score centering's top-k, or a
    replayed truncating sampler's kept sets) cannot see, and, with score centering, a model generation config that
    changes the sampling distribution q other than by a replayed truncation. Then has the policy's and the reference's
    forwards read the head in tiles (`replay.install_head_reader`, which refuses a head it cannot read)."""
    from .replay import install_head_reader, truncating

    users = [name for name, on in (("score_centering=True", trainer.args.score_centering),
                                   ("a replayed truncating sampler", trainer._rpp_bound is not None)) if on]
    unsupported = [
        # The rollout's first turn would come with its own lists and the tool loop's turns from `generate`.
        ("rollout_func together with tools", trainer.rollout_func is not None and bool(trainer.tools)),
        ("a multimodal processing_class", trainer._is_vlm),
        ("an MoE router aux loss", trainer.aux_loss_enabled),
    ]
    for name, present in unsupported:
        if present:
            raise ValueError(
                f"{' and '.join(users)} does not support {name}: the sampler's log-probs are captured "
                "token by token inside text `generate` calls (or returned by a rollout_func without tools)."
            )
    for model in (trainer.model, trainer.ref_model):
        if model is not None:
            install_head_reader(trainer.accelerator.unwrap_model(model))
    if trainer.use_vllm or not trainer.args.score_centering:
        return  # vLLM samples with the config's settings, already checked by RPPConfig
    # The model's own generation config also shapes q: check what `generate` will actually use.
    model = trainer.accelerator.unwrap_model(trainer.model)
    merged = {**model.generation_config.to_dict(), **trainer.generation_kwargs}
    replayed = truncating(merged, False) if trainer._rpp_bound is not None else ()
    check_exact_sampling(merged, trainer.temperature, where="the model's generation config: ", replayed=replayed)


def generate_vllm_with_topk(trainer, prompt_ids, images, num_generations, k, faults):
    """GRPO's vLLM branch of `_generate_single_turn`, keeping the `k`-wide log-prob lists (appended to
    ``trainer._rpp_captures``) and selecting the sampled token's log-prob by id. Returns ``(completion_ids,
    sampled_logps)`` as GRPO's branch does.

    Only the engine's calls (`vllm_generate`) run under `faults` (`EngineFaults.call`): when they raise, one EOS per
    prompt comes back and the run stops at `EngineFaults.settle`. An error in parsing the engine's answer is ours,
    not the engine's, and propagates as itself."""
    from .engine_faults import empty_completions

    answer = faults.call(lambda: vllm_generate(trainer, prompt_ids, images, num_generations))
    if answer is None:
        return empty_completions(trainer, prompt_ids)
    _, completion_ids, logprobs, token_ids = answer
    sampled, recorded = parse_vllm_topk(completion_ids, logprobs, token_ids, k)
    trainer._rpp_captures.append(recorded)
    return completion_ids, sampled


def vllm_generate(trainer, prompt_ids, images, num_generations):
    """GRPO's vLLM branch of `_generate_single_turn` up to the engine's answer: the weight sync when the step
    changed, then `VLLMGeneration.generate`'s ``(prompt_ids, completion_ids, logprobs, logprob_token_ids)``."""
    from trl.extras.profiling import profiling_context

    if trainer.state.global_step != trainer._last_loaded_step:
        with profiling_context(trainer, "sync_weights"):
            trainer.vllm_generation.sync_weights()
        trainer._last_loaded_step = trainer.state.global_step
    return trainer.vllm_generation.generate(
        prompts=prompt_ids, images=images, num_generations=num_generations,
        profiler=profiling_context(trainer, "vLLM.generate"),
    )


def sampler_topk_of_generation(trainer, generated, k):
    """The sampler's `k`-wide record (top-k or kept set) at the model tokens of GRPO's `_generate` output
    ``generated`` (its 8-tuple).

    Returns ``(generated, capture)``: with a `rollout_func`, its ``logprobs`` (top-k lists, `rollout_sampler_topk`)
    replaced by the sampled tokens' log-probs that TRL expects, and a `RecordedTopK`; otherwise ``generated``
    unchanged and the one `generate` call's capture, or, after TRL's tool loop, the calls' captures aligned to the
    final completions (`align_turn_captures`). ``capture.tensors(T)`` gives the batch tensors.
    """
    captures, trainer._rpp_captures = trainer._rpp_captures, []
    prompt_ids, completion_ids, tool_mask, completions, logprobs, extra_fields, images, tool_images = generated
    if trainer.rollout_func is not None:
        sampled, recorded = rollout_sampler_topk(
            completion_ids, logprobs, extra_fields.get("logprob_token_ids"), tool_mask, k
        )
        return (prompt_ids, completion_ids, tool_mask, completions, sampled, extra_fields, images, tool_images), recorded
    if not trainer.tools:
        return generated, captures[0]
    turns = [c.tensors(len(c.ids) if isinstance(c.ids, list) else c.ids.size(1)) for c in captures]
    return generated, align_turn_captures(turns, tool_mask)

