"""Input checks around reward functions and datasets: errors that name what is wrong, before compute is spent."""

from __future__ import annotations

import functools
import inspect
import math

import torch


def check_prompt_column(dataset, name: str) -> None:
    """Raise `ValueError` if `dataset` (a `Dataset`, or a dict of them) has no `prompt` column."""
    if dataset is None:
        return
    datasets = dataset.items() if isinstance(dataset, dict) else [(None, dataset)]
    for key, ds in datasets:
        columns = getattr(ds, "column_names", None)
        if columns is not None and "prompt" not in columns:
            where = name if key is None else f"{name}[{key!r}]"
            raise ValueError(
                f"{where} has no 'prompt' column; its columns are {list(columns)}. RPPTrainer, like GRPOTrainer, "
                "samples completions for the 'prompt' column: rename your prompt column to 'prompt'."
            )


def _nonfinite(value) -> bool:
    if value is None:
        return False
    try:
        return not math.isfinite(float(value))
    except (TypeError, ValueError):
        return False  # not a number: TRL reports it when it builds the reward tensor


def _reward_name(func) -> str:
    return getattr(func, "__name__", type(func).__name__)


def _checked(name, outputs, completions, policy):
    bad = [i for i, r in enumerate(outputs) if _nonfinite(r)]
    if not bad:
        return outputs
    if policy == "unscorable":
        return [None if i in bad else r for i, r in enumerate(outputs)]
    i = bad[0]
    snippet = repr(completions[i])[:120] if completions is not None and i < len(completions) else "?"
    raise ValueError(
        f"reward function {name!r} returned {outputs[i]!r} for row {i} of this batch (completion {snippet}); "
        f"{len(bad)} row(s) are non-finite. Return a finite number, or None for a completion it cannot score, or "
        "set nonfinite_rewards='unscorable' to treat NaN/Inf as None."
    )


def guard_reward_func(func, policy: str):
    """Wrap a callable reward function so that NaN/Inf rewards raise (policy "error") or become None ("unscorable").

    Reward models (`nn.Module`) and model ids (`str`) are returned unchanged; see `check_module_rewards`. The wrapper
    keeps the function's name (TRL logs rewards under it) and its async-ness.
    """
    if isinstance(func, (str, torch.nn.Module)) or not callable(func):
        return func
    name = _reward_name(func)
    if inspect.iscoroutinefunction(func):

        @functools.wraps(func)
        async def async_guarded(*args, **kwargs):
            return _checked(name, await func(*args, **kwargs), kwargs.get("completions"), policy)

        return async_guarded

    @functools.wraps(func)
    def guarded(*args, **kwargs):
        return _checked(name, func(*args, **kwargs), kwargs.get("completions"), policy)

    return guarded


def check_module_rewards(rewards_per_func: torch.Tensor, columns, names, policy: str) -> torch.Tensor:
    """Reward-model columns of the gathered `[B, F]` rewards: NaN/Inf raise, or become NaN (= unscorable)."""
    sub = rewards_per_func[:, columns]
    bad = ~torch.isfinite(sub)
    if not bad.any():  # one host sync per generation batch, only when reward models are used
        return rewards_per_func
    if policy == "error":
        row, col = bad.nonzero()[0].tolist()
        raise ValueError(
            f"reward model {names[columns[col]]!r} returned {sub[row, col].item()} for row {row} of the gathered "
            "batch. Set nonfinite_rewards='unscorable' to treat NaN/Inf as unscorable."
        )
    out = rewards_per_func.clone()
    out[:, columns] = torch.where(bad, torch.full_like(sub, float("nan")), sub)
    return out
