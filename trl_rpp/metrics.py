"""The metrics `RPPTrainer` logs next to GRPO's: what each process contributes, reduced across processes with one
gather and one host transfer per call, as GRPO logs (the names and their meaning: docs/rpp_trainer.md)."""

from __future__ import annotations

import torch

from .core import kl_k1, masked_response_mean
from .score_centering import score_centering_metric_sums


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


def masked_max(x, mask):
    """Max of ``x`` over ``mask``; the lowest float32 when nothing is selected."""
    lowest = torch.full((1,), torch.finfo(torch.float32).min, device=x.device)
    return torch.cat([torch.where(mask, x, lowest).flatten(), lowest]).max()


def advantage_statistics(raw, advantages, mask, old_logps, ref_logps, raw_mean, raw_var, count) -> dict:
    """This process's part of the advantage metrics, as `reduce_across_processes`' keyword arguments: ``raw`` ``[B, T]``
    the raw advantages (REINFORCE++'s returns), ``advantages`` ``[B, T]`` normalized, ``mask`` ``[B, T]``, the
    log-probs ``[B, T]`` (or None) for the k1 estimate, and `global_masked_normalize`'s replicated statistics."""
    zero = torch.zeros((), dtype=torch.float32, device=raw.device)
    adv = torch.where(mask, advantages.float(), zero)
    has_kl = old_logps is not None and ref_logps is not None
    return dict(
        sums={"adv": adv.sum(), "adv_sq": (adv * adv).sum(),
              "k1": kl_k1(old_logps, ref_logps, mask).float().sum() if has_kl else zero},
        maxima={"raw_max": masked_max(raw.float(), mask), "neg_raw_min": masked_max(-raw.float(), mask)},
        replicated={"mean": raw_mean, "var": raw_var, "count": count},
    )


def advantage_metrics(v: dict, returns: bool, has_kl: bool) -> dict[str, float]:
    """The `advantages/*` metrics from the reduced `advantage_statistics` `v`; with `returns` (REINFORCE++, whose raw
    advantages are the k1-shaped returns G) the `returns/*`, and with `has_kl` `ref_kl/k1_mean`."""
    n = max(v["count"], 1.0)
    adv_mean = v["adv"] / n
    out = {
        "advantages/raw_mean": v["mean"], "advantages/raw_std": v["var"] ** 0.5, "advantages/mean": adv_mean,
        "advantages/std": max(v["adv_sq"] / n - adv_mean**2, 0.0) ** 0.5, "advantages/valid_tokens": v["count"],
        "advantages/zero_variance": float(v["var"] <= 1e-8), "advantages/empty_batch": float(v["count"] == 0),
    }
    if returns:
        empty = v["count"] == 0  # no return to report (not the -/+float32-max sentinels)
        out.update({"returns/mean": v["mean"], "returns/std": v["var"] ** 0.5,
                    "returns/max": 0.0 if empty else v["raw_max"], "returns/min": 0.0 if empty else -v["neg_raw_min"]})
    if has_kl:
        out["ref_kl/k1_mean"] = v["k1"] / n
    return out


def loss_statistics(logps, old_logps, entropies, advantages, mask, epsilon_low, epsilon_high, scalars,
                    sampler=None) -> tuple[dict, dict, list[str]]:
    """This process's part of the loss metrics: ``(sums, means, per_token)`` for `reduce_across_processes`, where
    the sums named in ``per_token`` are divided by the valid-token count (`loss_metrics`). ``logps``, ``old_logps``,
    ``entropies``, ``advantages`` and ``mask`` are ``[B, T]``; ``scalars`` the 0-dim losses logged as they are
    (`policy_loss`, `kl_loss`, `aux_loss`); ``sampler``, with score centering, ``(head_logps [B, T, k],
    sampler_head_logps [B, T, k], sampler_per_token_logps [B, T], closed [B, T] or None)``."""
    zero = torch.zeros((), dtype=logps.dtype, device=logps.device)
    ratio = torch.exp(torch.where(mask, logps - old_logps, zero))
    low = mask & (ratio < 1 - epsilon_low) & (advantages < 0)
    high = mask & (ratio > 1 + epsilon_high) & (advantages > 0)
    per_token = {"entropy": torch.where(mask, entropies, zero).sum(), "clip_ratio/low_mean": low.sum(),
                 "clip_ratio/high_mean": high.sum(), "clip_ratio/region_mean": (low | high).sum()}
    means = {"ppo_kl": masked_response_mean(old_logps - logps, mask), **scalars}
    sc_sums = {}
    if sampler is not None:
        head_logps, sampler_head_logps, sampler_logps, closed = sampler
        sc_per_token, sc_sums = score_centering_metric_sums(logps, head_logps, sampler_head_logps, sampler_logps, mask,
                                                            closed)
        per_token.update(sc_per_token)
    return {"tokens": mask.sum(), **per_token, **sc_sums}, means, list(per_token)


def loss_metrics(v: dict, per_token: list[str], means: list[str]) -> dict[str, float]:
    """The loss metrics from the reduced `loss_statistics` `v`: per-token sums over the valid tokens, means as they
    are, and with score centering `score_centering/sampler_logp_abs_diff` over the tokens whose sampled log-prob the
    sampler reported."""
    out = {name: v[name] / max(v["tokens"], 1.0) for name in per_token}
    out.update({name: v[name] for name in means})
    if "sampled" in v:
        out["score_centering/sampler_logp_abs_diff"] = v["sampler_logp_abs_diff"] / max(v["sampled"], 1.0)
    return out


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


def warn_empty_batch(gather, mask, mode: str, step: int) -> None:
    """Warn (`RuntimeWarning`, `empty_batch_message`) about a generation batch with no valid token on any process,
    naming its cause from the local token `mask` ``[B, T]`` gathered across processes. Called only after the metrics'
    host transfer showed a global count of 0, so this gather never runs on the normal path."""
    import warnings

    any_token = gather(mask.any().float().reshape(1)).sum().item() > 0
    warnings.warn(empty_batch_message(mode, step, any_token), RuntimeWarning, stacklevel=2)
