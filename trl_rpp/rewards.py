"""Input checks around reward functions and datasets: errors that name what is wrong, before compute is spent.
Failed and hung reward calls: `trl_rpp.reward_faults`."""

from __future__ import annotations

import functools
import math
import numbers
from collections.abc import Iterable

import torch
from trl.trainer.utils import get_callable_name, is_async_callable

from .reward_faults import RewardFaults
from .trainer_utils import as_list


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


def check_dataset_not_empty(dataset, name: str) -> None:
    """Raise `ValueError` if `dataset` (a `Dataset`, or a dict of them) has no rows.

    An empty training set would otherwise make `train()` return after 0 steps without a word. Datasets without a
    length (`IterableDataset`) are not checked.
    """
    if dataset is None:
        return
    datasets = dataset.items() if isinstance(dataset, dict) else [(None, dataset)]
    for key, ds in datasets:
        try:
            n = len(ds)
        except TypeError:
            continue
        if n == 0:
            where = name if key is None else f"{name}[{key!r}]"
            raise ValueError(f"{where} is empty; accepted: a dataset with at least one row (a 'prompt' per row).")


# Rewards are held as float32 by the trainer (TRL builds the `[B, F]` table with `dtype=torch.float32`).
_ACCEPTED = (
    "a real number (bool, int, float, a NumPy scalar or a one-element tensor), or None for a completion it cannot score"
)


def _as_float(value):
    """`value` as the Python float TRL will convert to float32, None for None; `TypeError` if it is not a number."""
    if value is None:
        return None
    if isinstance(value, (bool, numbers.Real)):
        try:
            return float(value)
        except OverflowError:  # an int beyond float64: outside float32's range too
            return math.inf if value > 0 else -math.inf
    dtype = getattr(value, "dtype", None)
    kind = getattr(dtype, "kind", None)  # NumPy scalars and arrays
    real = kind in ("b", "i", "u", "f") or (torch.is_tensor(value) and not value.is_complex())
    size = value.numel() if torch.is_tensor(value) else getattr(value, "size", None)
    if real and size == 1:
        return float(value)
    raise TypeError(type(value).__name__)


def _row(completions, i) -> str:
    return repr(completions[i])[:120] if completions is not None and i < len(completions) else "?"


def _checked(name, outputs, completions, policy):
    if isinstance(outputs, (str, bytes)) or not isinstance(outputs, Iterable):
        raise ValueError(
            f"reward function {name!r} returned {type(outputs).__name__} {outputs!r:.80}; accepted: a list with one "
            f"reward per completion, each {_ACCEPTED}."
        )
    outputs = list(outputs)
    values = []
    for i, r in enumerate(outputs):
        try:
            values.append(_as_float(r))
        except TypeError:
            raise ValueError(
                f"reward function {name!r} returned {r!r:.80} of type {type(r).__name__} for row {i} of this batch "
                f"(completion {_row(completions, i)}); accepted: {_ACCEPTED}."
            ) from None
    # Checked in float32, as the trainer holds them: 1e39 is finite here and inf there.
    held = torch.tensor([math.nan if v is None else v for v in values], dtype=torch.float32)
    finite = torch.isfinite(held).tolist()
    bad = [i for i, v in enumerate(values) if v is not None and not finite[i]]
    if not bad:
        return values
    if policy == "unscorable":
        unscorable = set(bad)
        return [None if i in unscorable else v for i, v in enumerate(values)]
    i = bad[0]
    why = "" if not math.isfinite(values[i]) else " (outside float32's range, in which the trainer holds rewards)"
    raise ValueError(
        f"reward function {name!r} returned {outputs[i]!r:.80} for row {i} of this batch{why} (completion "
        f"{_row(completions, i)}); {len(bad)} row(s) are not finite in float32. Return a finite number, or None for "
        "a completion it cannot score, or set nonfinite_rewards='unscorable' to treat NaN/Inf as None."
    )


def guard_reward_func(func, policy: str, faults: RewardFaults | None = None):
    """Wrap a callable reward function so that its rewards are checked as the trainer will hold them (float32):
    a value that is not a number raises a `ValueError` naming the function, the row and the type; NaN/Inf (also
    after the float32 conversion) raise (policy `"raise"`) or become None (`"unscorable"`).

    With `faults` (the trainer's `RewardFaults`), a call that raises, runs past the time limit, or fails these checks
    returns None for each row instead of raising, and is recorded there: `RewardFaults.settled` then logs it, or
    raises on every process alike (`trl_rpp.reward_faults`). Without it, errors propagate from the call.

    Reward models (`nn.Module`) and model ids (`str`) are returned unchanged; see `check_module_rewards`. The wrapper
    carries the name TRL gives the original (`get_callable_name`: a partial's function, a callable instance's class),
    under which `GRPOTrainer` logs `rewards/<name>/*`, and it is async exactly when the original is
    (`is_async_callable`: also an instance whose `__call__` is async).
    """
    if isinstance(func, (str, torch.nn.Module)) or not callable(func):
        return func
    name = get_callable_name(func)

    def check(kwargs):
        return lambda outputs: _checked(name, outputs, kwargs.get("completions"), policy)

    if is_async_callable(func):

        async def guarded(*args, **kwargs):
            if faults is not None:
                return await faults.acall(guarded, name, func, args, kwargs, check(kwargs))
            return check(kwargs)(await func(*args, **kwargs))

    else:

        def guarded(*args, **kwargs):
            if faults is not None:
                return faults.call(guarded, name, func, args, kwargs, check(kwargs))
            return check(kwargs)(func(*args, **kwargs))

    # `updated=()`: a callable instance's attributes stay on the instance, reachable through `__wrapped__`.
    functools.update_wrapper(guarded, func, updated=())
    guarded.__name__ = guarded.__qualname__ = name
    if faults is not None:
        faults.register(guarded)
    return guarded


def guard_reward_funcs(reward_funcs, args):
    """`RPPTrainer`'s reward functions, each guarded (`guard_reward_func`) with the config's `nonfinite_rewards`,
    `reward_timeout` and `reward_errors`, and the `RewardFaults` that records their failed calls."""
    faults = RewardFaults(args.reward_timeout, args.reward_errors)
    if reward_funcs is None:
        return None, faults
    return [guard_reward_func(f, args.nonfinite_rewards, faults) for f in as_list(reward_funcs)], faults


def check_module_rewards(rewards_per_func: torch.Tensor, columns, names, policy: str) -> torch.Tensor:
    """Reward-model columns of the gathered `[B, F]` rewards: NaN/Inf raise, or become NaN (= unscorable).

    The table is float32, as TRL builds it, so a score beyond float32's range (a float64 reward model) is already
    inf here and is treated as non-finite. A reward model's output is a tensor: it cannot be a non-number.
    """
    sub = rewards_per_func[:, columns]
    bad = ~torch.isfinite(sub)
    if not bad.any():  # one host sync per generation batch, only when reward models are used
        return rewards_per_func
    if policy == "raise":
        row, col = bad.nonzero()[0].tolist()
        raise ValueError(
            f"reward model {names[columns[col]]!r} returned {sub[row, col].item()} for row {row} of the gathered "
            "batch (as held in float32: a larger score from a float64 model reads inf). Set "
            "nonfinite_rewards='unscorable' to treat NaN/Inf as unscorable."
        )
    out = rewards_per_func.clone()
    out[:, columns] = torch.where(bad, torch.full_like(sub, float("nan")), sub)
    return out
