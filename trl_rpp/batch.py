"""The generation batch between GRPO's generation and `RPPTrainer`'s loss: the keys written at generation and read by
the loss (`trl_rpp.trainer`'s hook map lists them), and the mask every loss term and metric shares."""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Optional per-batch model inputs (multimodal models) that TRL forwards to `_get_per_token_logps_and_entropies`.
FORWARD_KEYS = (
    "pixel_values", "image_grid_thw", "num_images", "pixel_attention_mask", "spatial_shapes", "num_tiles", "image_sizes",
    "token_type_ids", "mm_token_type_ids", "image_position_ids",
)


def token_mask(batch) -> torch.Tensor:
    """Bool ``[B, T]``: TRL's completion mask times its tool mask (tool output tokens are internal mask holes)."""
    mask = batch["completion_mask"].bool()
    return mask & batch["tool_mask"].bool() if "tool_mask" in batch else mask


@dataclass
class PolicyForward:
    """What the loss forward returns: ``[B, T]`` log-probs (with gradient) and entropies at the sampling
    temperature, the MoE router loss when enabled, and with score centering ``[B, T, k]`` log-probs at the sampler's
    head ids."""

    logps: torch.Tensor
    entropies: torch.Tensor
    aux_loss: torch.Tensor | None = None
    head_logps: torch.Tensor | None = None


def sampler_batch_keys(capture, support, T: int, device, head_width: int) -> dict[str, torch.Tensor]:
    """The batch keys of the sampler's record ``capture`` (its ``tensors(T)``) at ``T`` completion positions:
    ``sampler_per_token_logps`` ``[B, T]`` (log q, or log q_S when truncated), with replay (``support`` ``[B, T, K]``)
    ``sampler_support_ids``, and with score centering (``head_width`` > 0) ``sampler_head_ids`` and
    ``sampler_head_logps`` ``[B, T, k]``: the top-k, or the kept set's first k ids."""
    ids, logps, sampled = capture.tensors(T)
    keys = {"sampler_per_token_logps": sampled.to(device)}
    if support is not None:
        if support.size(1) != T:
            raise RuntimeError(f"replay_sampler_support: the kept sets cover {support.size(1)} positions, the batch's "
                               f"completions {T}")
        keys["sampler_support_ids"] = support
    if head_width:
        keys["sampler_head_ids"] = ids[..., :head_width].to(device)
        keys["sampler_head_logps"] = logps[..., :head_width].to(device)
    return keys
