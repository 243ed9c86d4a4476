"""Non-finite gradients: an optimizer step whose gradient norm is NaN or +/-Inf is skipped, not applied.

Without this, a NaN or Inf gradient (in bf16, for example, from a forward that overflows at one step) reaches the
optimizer: AdamW writes it into its moments and the weights, and the next generation fails on a NaN probability
tensor. With it, such a step is skipped on every process, with a `RuntimeWarning` naming the step and the
`skipped_steps` metric, and more than `RPPConfig.max_consecutive_skipped_steps` in a row raise
`NonFiniteGradientError` before the last one is applied.

Where (transformers' `Trainer._inner_training_loop`, 5.x): once per optimizer step, after the last micro-batch's
backward, Trainer clips the gradients (`_clip_grad_norm`, i.e. `accelerator.clip_grad_norm_`, which returns the norm
*before* clipping) and passes that norm through `_get_grad_norm`; then come `on_pre_optimizer_step`,
`optimizer.step()`, `on_optimizer_step`, the LR scheduler step, `model.zero_grad()` and `global_step += 1`.
`GradGuardMixin._get_grad_norm` decides there, on the norm Trainer already computed:

- **One host sync per optimizer step.** The norm is turned into a Python float there, and that float is what Trainer
  then logs as `grad_norm`, so its own `.item()` at logging time (or, under DeepSpeed, in `_get_grad_norm`) is not
  repeated. Trainer already syncs once per micro-batch anyway (`logging_nan_inf_filter` tests each loss for NaN).
- **Every process decides the same.** Under DDP the gradients are all-reduced during the backward of the last
  micro-batch, so every rank takes the norm of the same gradients: a NaN or Inf from one rank's forward is in every
  rank's norm (`tests/test_grad_guard.py` injects it on one rank of two). Under FSDP the norm is reduced over the
  shards (a DTensor norm is made whole with `full_tensor()` first). No extra collective is needed.
- **The step changes nothing.** The gradients are dropped (`zero_grad(set_to_none=True)`), and torch's and
  transformers' optimizers skip every parameter without a gradient: the optimizer step that Trainer then runs leaves
  the weights and the optimizer state (AdamW's moments and step counts) bit-identical (`tests/test_grad_guard.py`
  checks AdamW, Adam, SGD, RMSprop, Adagrad and Adafactor). Zeroed gradients would not do: AdamW would still move
  the weights with its moments and weight decay, and decay the moments. An optimizer that updates parameters
  without a gradient would not skip the step.
- **The skipped step counts as taken.** `global_step` advances and the LR scheduler steps, as after any step, so
  `max_steps`, the schedule, logging, evaluation, checkpoints and the generation schedule (`steps_per_generation`,
  `num_iterations`) stay the same functions of the step number as in a run without skips; the step's generation
  batch has been used up either way. (fp16's gradient scaler holds the scheduler on the steps it skips instead: its
  skips are routine while it searches for a loss scale, ours are faults, at most a few in a row.)

Not active under DeepSpeed or a gradient scaler (`guard_applies`), which skip non-finite steps themselves: DeepSpeed's
engine has already stepped, inside `accelerator.backward`, when Trainer reads the norm (DeepSpeed 0.19 discards a step
whose global norm is NaN or Inf in ZeRO 1, 2 and 3 and in its bf16 optimizer, and counts it in
`engine.skipped_steps`; not with `bf16.check_grad_overflow` or `zero_optimization.compute_grad_norm` turned off, nor
at ZeRO stage 0 in float32), and fp16's scaler skips overflowing steps while it lowers its scale, which routinely
happens at several steps in a row at the start of a run.
"""

from __future__ import annotations

import math
import warnings

from accelerate.utils import DistributedType

from ..patches import logged_metrics


class NonFiniteGradientError(RuntimeError):
    """The gradient norm was NaN or +/-Inf at more optimizer steps in a row than
    `RPPConfig.max_consecutive_skipped_steps` allows. Raised on every process, before that step is applied."""


def guard_applies(distributed_type, has_grad_scaler: bool) -> bool:
    """Whether the guard decides on non-finite steps: not under DeepSpeed, whose engine has already stepped when
    Trainer reads the norm, nor under a gradient scaler (fp16), which skips overflowing steps itself."""
    return distributed_type != DistributedType.DEEPSPEED and not has_grad_scaler


def consecutive_after(norm: float, consecutive: int) -> int:
    """The number of non-finite gradient norms in a row after a step whose norm is `norm`."""
    return 0 if math.isfinite(norm) else consecutive + 1


def skip_message(step: int, norm: float, consecutive: int, limit: int) -> str:
    return (
        f"RPPTrainer (train, step {step}): the gradient norm before clipping is {norm} on some process: the optimizer "
        "step was skipped on every process (gradients dropped; weights and optimizer state unchanged; the step "
        "still counts toward max_steps and the learning-rate schedule) and logged as skipped_steps. "
        f"{consecutive} step(s) in a row skipped; more than max_consecutive_skipped_steps={limit} in a row stop "
        "training. Common causes: a forward that overflows (bf16/fp16), a learning rate that is too high."
    )


def stop_message(step: int, norm: float, consecutive: int, limit: int) -> str:
    steps = f"step {step}" if consecutive == 1 else f"steps {step - consecutive + 1} to {step}"
    last = step - consecutive  # the last step that was applied
    state = f"those after step {last}" if last > 0 else "those training started from"
    return (
        f"RPPTrainer (train, step {step}): the gradient norm before clipping was non-finite at {consecutive} "
        f"optimizer step(s) in a row ({steps}; now {norm}), more than max_consecutive_skipped_steps={limit} allows. "
        f"Training stopped before step {step} was applied: the weights and optimizer state are {state}. Lower the "
        "learning rate, look for a forward that overflows (bf16/fp16) or for bad data, or raise "
        "max_consecutive_skipped_steps."
    )


class GradGuard:
    """The state of the decision: non-finite norms in a row (`consecutive`) and skipped steps in all (`skipped`)."""

    def __init__(self, limit: int, active: bool = True):
        self.limit, self.active = limit, active
        self.consecutive = self.skipped = 0

    def observe(self, norm: float, step: int) -> bool:
        """True when the step with this norm is to be skipped (after a `RuntimeWarning` naming `step`); raises
        `NonFiniteGradientError` when it is one non-finite step in a row more than `limit`."""
        self.consecutive = consecutive_after(norm, self.consecutive)
        if self.consecutive == 0:
            return False
        if self.consecutive > self.limit:
            raise NonFiniteGradientError(stop_message(step, norm, self.consecutive, self.limit))
        self.skipped += 1
        warnings.warn(skip_message(step, norm, self.consecutive, self.limit), RuntimeWarning, stacklevel=3)
        return True


def count_skipped(metrics, skipped: bool) -> None:
    """Log `skipped_steps` as the number of steps skipped since the last log. TRL logs the mean of each metric's list
    and then clears it, so the count is kept as a one-element list that every optimizer step updates."""
    previous = metrics["skipped_steps"][0] if metrics.get("skipped_steps") else 0.0
    metrics["skipped_steps"] = [previous + float(skipped)]


def as_float(grad_norm) -> float:
    """The norm as a Python float: the one host sync per optimizer step. A DTensor norm (FSDP2) is made whole first,
    so that every shard reads the global value."""
    if hasattr(grad_norm, "full_tensor"):
        grad_norm = grad_norm.full_tensor()
    return float(grad_norm.item()) if hasattr(grad_norm, "item") else float(grad_norm)


class GradGuardMixin:
    """Mixed into `RPPTrainer` (before `GRPOTrainer`): `Trainer._get_grad_norm`, once per optimizer step, with the
    non-finite check above. Its state lives in `self._rpp_grad_guard`, built at the first step, when the accelerator's
    engine and scaler are known."""

    def _get_grad_norm(self, model, grad_norm=None):
        grad_norm = super()._get_grad_norm(model, grad_norm=grad_norm)
        guard = self.__dict__.get("_rpp_grad_guard")
        if guard is None:
            active = guard_applies(self.accelerator.distributed_type, self.accelerator.scaler is not None)
            guard = self._rpp_grad_guard = GradGuard(self.args.max_consecutive_skipped_steps, active)
        if not guard.active or grad_norm is None:
            return grad_norm
        norm = as_float(grad_norm)
        skip = guard.observe(norm, self.state.global_step + 1)  # the step as the log history numbers it
        count_skipped(logged_metrics(self, "train"), skip)
        if skip:
            model.zero_grad(set_to_none=True)  # the optimizer skips parameters without a gradient
        return norm
