"""Reward functions that fail: values that are not finite numbers, calls that raise or hang. A time limit per call,
a policy per failed call, and one agreement across processes, so that a failed call on one process never leaves
another waiting in TRL's rewards gather.

Values. Every callable reward function is wrapped (`guard_reward_func`): a value that is not a number raises a
`ValueError` naming the function, the row and the type; NaN/Inf (also after the float32 conversion the trainer
holds) raise, or become None with `nonfinite_rewards="unscorable"`. Reward models' outputs are checked after TRL's
gather (`check_module_rewards`).

How a failure travels. A guarded reward function (`guard_reward_func`) never raises out of TRL's
`GRPOTrainer._calculate_rewards`: a call that raises, runs past `reward_timeout`, or returns values that fail the
reward checks is recorded in the trainer's `RewardFaults` and returns `None` for each of its rows. TRL then gathers
the rewards table on every process as usual. Right after it, `RewardFaults.settled` gathers each process's failure
counts (one small all-gather and one host read per generation batch; neither with a single process), so every
process holds the same counts: they are logged as `rewards/<name>/errors` and `rewards/<name>/timeouts`. If a failed
call must stop the run (`reward_errors="raise"`, or values that fail the checks, which always raise), every process
raises the same error, built from the first failure in process order, after one more all-gather of its description
(on this path only). Every process thus takes part in the same collectives: none is left waiting in one.

Timeouts. An async function is awaited on TRL's event loop through `asyncio.wait` with the limit, then cancelled; one
that blocks the loop itself (a `time.sleep` inside `async def`) cannot be interrupted there, and its result counts as
timed out when it arrives after the limit. A sync function cannot be stopped from inside its own thread, so with a
limit it runs on one of `REWARD_WORKERS` daemon worker threads; after the limit the trainer stops waiting, and the hung
call keeps its worker until it returns (its result is then dropped). While every worker holds such a call, the next
call fails at once, as a timeout that says so: the threads a hung judge can take are bounded. Without a limit, sync
functions run in the calling thread, exactly as in `GRPOTrainer`.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import math
import numbers
import queue
import threading
import time
import warnings
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from trl.trainer.utils import get_callable_name, is_async_callable


# Failure kinds. "invalid": values that fail the reward checks (`guard_reward_func`); they raise under either policy.
ERROR, TIMEOUT, INVALID = "error", "timeout", "invalid"


class RewardFunctionError(RuntimeError):
    """A reward function raised or timed out under `reward_errors="raise"`. Raised on every process alike; on the
    process where the call failed it is chained (`__cause__`) to the original exception, or to a `TimeoutError`.

    Attributes: `func_name` (TRL's name of the function), `kind` (`"error"` or `"timeout"`), `step` (the training
    step, numbered as in the logs), `mode` (`"train"` or `"eval"`), `process_index` (where the call failed)."""

    def __init__(self, message, func_name, kind, step, mode, process_index):
        super().__init__(message)
        self.func_name, self.kind, self.step, self.mode, self.process_index = func_name, kind, step, mode, process_index


@dataclass
class Failure:
    """One failed call on this process: which guarded function (`key`, its wrapper), how, and the exception."""

    key: object
    kind: str
    exception: BaseException


def detail(failure: Failure) -> str:
    """The exception that a call raised, as `Name('message')`; a timeout's or a check's message as it is."""
    e = failure.exception
    if failure.kind != ERROR:
        return str(e)
    return f"{type(e).__name__}({str(e)!r})" if str(e) else type(e).__name__


def where(mode: str, global_step: int) -> str:
    """The step a failed call belongs to, numbered as the logs number it: a training generation batch is scored
    while `global_step` optimizer steps are done, for step `global_step + 1`."""
    return f"training step {global_step + 1}" if mode == "train" else f"evaluation after step {global_step}"


def failure_message(name: str, kind: str, detail: str, at: str, process: int, num_processes: int) -> str:
    """What a failed call is called in errors and warnings, the same text on every process."""
    on = f" on process {process} of {num_processes}" if num_processes > 1 else ""
    did = f"raised {detail}" if kind == ERROR else f"timed out ({detail})"
    return f"reward function {name!r} {did} at {at}{on}"


def fault_counts(failures, keys, policy: str):
    """Per guarded column (`keys`, in column order): ``[errors, timeouts, must_raise]`` counts of this process's
    failed calls. A call must raise under `policy == "raise"`, and always when its values failed the checks."""
    counts = [[0] * len(keys) for _ in range(3)]
    for f in failures:
        c = next(i for i, k in enumerate(keys) if k is f.key)
        if f.kind in (ERROR, TIMEOUT):
            counts[0 if f.kind == ERROR else 1][c] += 1
        if f.kind == INVALID or policy == "raise":
            counts[2][c] += 1
    return counts


class _TimedOut(Exception):
    pass


# The process's reward worker threads: at most this many, shared by every trainer and reward function. A call past
# `reward_timeout` holds its worker until it returns, so the number of hung calls, and of threads, stays bounded.
REWARD_WORKERS = 8


class _Workers:
    """A fixed-size pool of daemon threads (`concurrent.futures` joins its workers at exit, so one hung call would
    keep the process alive). `submit` refuses, rather than queues, when every worker is busy: a queued call would
    wait behind a call that may never return."""

    def __init__(self, size: int):
        self.size, self.busy = size, 0
        self._threads, self._tasks, self._lock = [], queue.SimpleQueue(), threading.Lock()

    def submit(self, task) -> bool:
        with self._lock:
            if self.busy == self.size:
                return False
            self.busy += 1
            if len(self._threads) < self.busy:  # one thread per submitted, unfinished task at most
                thread = threading.Thread(target=self._work, name="trl_rpp-reward-idle", daemon=True)
                thread.start()
                self._threads.append(thread)
        self._tasks.put(task)
        return True

    def _work(self):
        while True:
            task = self._tasks.get()
            try:
                task()
            finally:
                with self._lock:
                    self.busy -= 1


_WORKERS = _Workers(REWARD_WORKERS)


class _AllWorkersBusy(Exception):
    pass


def call_in_thread(func, args, kwargs, timeout: float, name: str):
    """`func(*args, **kwargs)` on a reward worker thread (named `trl_rpp-reward-<name>` while it runs the call); its
    value, or its exception re-raised here, or `_TimedOut` after `timeout` seconds, leaving the call running on its
    worker. `_AllWorkersBusy` at once when every worker still runs a call. The caller's grad mode and CUDA device
    (both per thread in torch) are carried over, so the function sees what it would see in the caller's thread."""
    grad = torch.is_grad_enabled()
    device = torch.cuda.current_device() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    box, done = {}, threading.Event()

    def run():
        thread = threading.current_thread()
        thread.name = f"trl_rpp-reward-{name}"
        try:
            if device is not None:
                torch.cuda.set_device(device)
            with torch.set_grad_enabled(grad):
                box["value"] = func(*args, **kwargs)
        except BaseException as e:  # handed to the caller, which decides
            box["error"] = e
        finally:
            thread.name = "trl_rpp-reward-idle"
            done.set()

    if not _WORKERS.submit(run):
        raise _AllWorkersBusy
    if not done.wait(timeout):
        raise _TimedOut
    if "error" in box:
        raise box["error"]
    return box["value"]


def _retrieve(task):
    # A cancelled call that ignores the cancellation and fails later: no "exception was never retrieved" log.
    if not task.cancelled():
        task.exception()


def _rows(kwargs) -> int:
    rows = kwargs.get("completions", kwargs.get("prompts"))
    return len(rows) if rows is not None else 0


class RewardFaults:
    """The trainer's record of failed reward calls, and the policy for them (`RPPConfig.reward_timeout`,
    `RPPConfig.reward_errors`). `call`/`acall` run one guarded call; `settled` wraps TRL's `_calculate_rewards`."""

    def __init__(self, timeout: float | None, policy: str):
        self.timeout, self.policy = timeout, policy
        self._guarded, self._failures = [], []
        self._lock = threading.Lock()  # async calls record from TRL's event-loop thread

    def register(self, key) -> None:
        self._guarded.append(key)

    def _failed(self, key, kind, exception, rows):
        with self._lock:
            self._failures.append(Failure(key, kind, exception))
        return [None] * rows

    def _timeout_error(self, seconds=None):
        if seconds is None:
            return TimeoutError(f"no result within reward_timeout={self.timeout} s")
        return TimeoutError(f"returned after {seconds:.2f} s, beyond reward_timeout={self.timeout} s: it blocked the "
                            "event loop, so it could not be interrupted")

    def call(self, key, name, func, args, kwargs, check):
        """One sync call: `check(values)` on success, else `None` per row and the failure recorded."""
        try:
            if self.timeout is None:
                out = func(*args, **kwargs)  # in the calling thread, exactly as GRPOTrainer calls it
            else:
                out = call_in_thread(func, args, kwargs, self.timeout, name)
        except _TimedOut:
            return self._failed(key, TIMEOUT, self._timeout_error(), _rows(kwargs))
        except _AllWorkersBusy:
            error = TimeoutError(f"not called: all {_WORKERS.size} reward worker threads still run calls that passed "
                                 f"reward_timeout={self.timeout} s")
            return self._failed(key, TIMEOUT, error, _rows(kwargs))
        except Exception as e:
            return self._failed(key, ERROR, e, _rows(kwargs))
        return self._check(key, name, check, out, kwargs)

    async def acall(self, key, name, func, args, kwargs, check):
        """One async call on TRL's event loop, cancelled after the limit; as `call` otherwise."""
        start = time.monotonic()
        try:
            if self.timeout is None:
                out = await func(*args, **kwargs)
            else:
                task = asyncio.ensure_future(func(*args, **kwargs))
                done, _ = await asyncio.wait({task}, timeout=self.timeout)
                if not done:
                    task.cancel()
                    task.add_done_callback(_retrieve)
                    return self._failed(key, TIMEOUT, self._timeout_error(), _rows(kwargs))
                out = task.result()  # the function's own exception (its own TimeoutError too) is an error
                elapsed = time.monotonic() - start
                if elapsed > self.timeout:  # it blocked the event loop past the limit: too late all the same
                    return self._failed(key, TIMEOUT, self._timeout_error(elapsed), _rows(kwargs))
        except Exception as e:
            return self._failed(key, ERROR, e, _rows(kwargs))
        return self._check(key, name, check, out, kwargs)

    def _check(self, key, name, check, out, kwargs):
        try:
            values = check(out)
            if len(values) != _rows(kwargs):  # TRL's own check, here so that it too raises on every process alike
                raise ValueError(
                    f"The reward function '{name}' returned {len(values)} rewards, but {_rows(kwargs)} were expected "
                    "(one per prompt-completion pair). Make sure the reward function returns exactly one reward per "
                    "completion."
                )
            return values
        except ValueError as e:  # values that fail the reward checks: raised on every process in `settled`
            return self._failed(key, INVALID, e, _rows(kwargs))

    @contextlib.contextmanager
    def settled(self, acc, reward_funcs, reward_func_names, mode: str, step: int, metrics):
        """Around TRL's `_calculate_rewards` (which ends in the rewards gather): afterwards, every process learns of
        every failed call (over the accelerator `acc`), logs the counts into `metrics` (GRPO's metric lists of
        `mode`, ``"train"`` or ``"eval"``), and either warns about its own failures or raises the same error, naming
        the function by its name in `reward_func_names` and the optimizer step `step`."""
        with self._lock:
            self._failures = []  # left over if TRL raised in the previous call
        yield
        with self._lock:
            failures, self._failures = self._failures, []
        guarded = [(f, n) for f, n in zip(reward_funcs, reward_func_names) if any(f is g for g in self._guarded)]
        if not guarded:
            return
        keys, names = [f for f, _ in guarded], [n for _, n in guarded]
        counts = fault_counts(failures, keys, self.policy)
        if acc.num_processes > 1:
            local = torch.tensor([counts], dtype=torch.long, device=acc.device)
            counts_per_process = acc.gather(local).tolist()  # [P][3][F]: the same on every process
        else:
            counts_per_process = [counts]
        at = where(mode, step)
        p, n = acc.process_index, acc.num_processes
        if any(sum(c[2]) for c in counts_per_process):
            self._raise(step, failures, keys, names, at, mode, p, n)
        for c, name in enumerate(names):
            metrics[f"rewards/{name}/errors"].append(float(sum(x[0][c] for x in counts_per_process)))
            metrics[f"rewards/{name}/timeouts"].append(float(sum(x[1][c] for x in counts_per_process)))
        for f in failures:
            name = names[next(i for i, k in enumerate(keys) if k is f.key)]
            text = failure_message(name, f.kind, detail(f), at, p, n)
            warnings.warn(f"{text}; reward_errors='unscorable': the rows of this call are unscorable (None), as if "
                          "it had returned None for each.", RuntimeWarning, stacklevel=2)

    def _raise(self, step, failures, keys, names, at, mode, process, num_processes):
        """Every process raises the same error: that of the first failure that must raise, in process order; `step`
        is the optimizer step of the batch being scored."""
        must = [f for f in failures if f.kind == INVALID or self.policy == "raise"]
        mine = None
        if must:
            f = must[0]
            column = next(i for i, k in enumerate(keys) if k is f.key)
            mine = (process, column, f.kind, detail(f))
        if num_processes > 1:
            from accelerate.utils import gather_object

            first = next(d for d in gather_object([mine]) if d is not None)
        else:
            first = mine
        origin, column, kind, text = first
        cause = must[0].exception if origin == process else None
        if kind == INVALID:  # the check's own message, which names the function and the row
            if cause is not None:
                raise cause
            raise ValueError(text)
        message = failure_message(names[column], kind, text, at, origin, num_processes) + (
            ". reward_errors='raise' stops the run at a failed call; set reward_errors='unscorable' to treat the rows "
            "of a failed call as unscorable (None) and go on"
        ) + (", or raise reward_timeout." if kind == TIMEOUT else ".")
        error = RewardFunctionError(message, names[column], kind, step + (mode == "train"), mode,
                                    origin)
        raise error from cause


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
    raises on every process alike (see the module docstring). Without it, errors propagate from the call.

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
    return [guard_reward_func(f, args.nonfinite_rewards, faults)
            for f in (reward_funcs if isinstance(reward_funcs, (list, tuple)) else [reward_funcs])], faults


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
