"""Graceful preemption: on SIGTERM or SIGUSR1 (what SLURM and Kubernetes send before they stop a job), finish the
optimizer step in progress, save a complete checkpoint, and raise `TrainingPreempted` from `train` (an ordinary
`Exception`; the `trl-rpp` command exits with status `PREEMPTED_EXIT_CODE`, 75).

`RPPTrainer.train` runs GRPO's training loop inside a `Preemption` context, which installs the handlers of the
config's `preemption_signals` (restoring the previous ones after) and a `TrainerCallback`:

- the signal handler only records the signal: no I/O (a write from a handler can collide with the write it
  interrupted) and nothing stops mid-step. A signal during generation, a reward call or the backward pass is acted on
  once the optimizer step is complete;
- at the end of each optimizer step (`on_step_end`) the processes agree on whether any of them received a signal;
  if one did, every process logs that step, saves `checkpoint-<step>` (the generation buffer included, through
  `RPPTrainer._save_checkpoint`) and stops. An evaluation due at that step is skipped: the time before the
  scheduler's SIGKILL is short;
- a signal during a checkpoint's save (or the log or evaluation before it) lets the save finish; the processes then
  agree in `on_save` and stop there, with that checkpoint;
- after the save, every process waits for all others (so that no process exits, and makes a launcher stop the rest,
  while another is still writing), then `train` raises `TrainingPreempted`.

Agreement. With several processes each one may receive the signal at a different moment, or only one may receive
it, and every process must save the same step (the save has collectives). The decision is the maximum over processes
of each one's signal number (0 for none). It costs no collective and no host sync of its own: the flag rides along in
the gather that the loss metrics already make once per micro-batch (`RPPTrainer._log_loss_metrics`, one more float),
and the step's decision reads the value of its last micro-batch. A signal that arrives after that point (during the
last micro-batch's backward pass or the optimizer step) is acted on at the end of the next step. Where a step made no
such gather (a subclass that logs no loss metrics), `on_step_end` all-reduces the flag itself (one int64 all-reduce
and one host read). `on_save` always all-reduces it: a save is far costlier. With one process the local flag decides,
at the step's end, without any collective.

Further signals (a second SIGTERM, or SLURM's SIGTERM after its SIGUSR1, or a launcher forwarding the signal a
scheduler also sent) are recorded and ignored: the save goes on, because cutting it would leave a torn checkpoint
and lose the step, and the scheduler's SIGKILL follows anyway. SIGKILL, or SIGINT (Ctrl-C, not handled here), stop at
once. A signal that no step boundary followed (it came after the last step) is delivered again to the previous
handler once those are restored, so it does what it would have done without `RPPTrainer`.
"""

from __future__ import annotations

import logging
import os
import signal
import threading

import torch
from transformers import TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from ..errors import unsupported

logger = logging.getLogger(__name__)

# EX_TEMPFAIL of sysexits.h, "temporary failure, the user is invited to retry": not 0 (the run is not finished, so a
# scheduler must not record it as done), and distinct from 1 (an error) and 128 + N (killed by signal N), so that a
# wrapper or a Kubernetes podFailurePolicy (`onExitCodes`) can tell "checkpoint saved, run me again" from a crash.
PREEMPTED_EXIT_CODE = 75
PREEMPTION_SIGNALS = ("SIGTERM", "SIGUSR1", "SIGUSR2")  # accepted in `RPPConfig.preemption_signals`
FLAG = "rpp_preemption_signal"  # name of the flag in the loss metrics' gather


def parse_preemption_signals(value) -> tuple[str, ...]:
    """The signal names of `RPPConfig.preemption_signals` (a comma-separated string; empty: handling off).
    `ValueError` naming the field and the accepted values for anything else."""
    names = [n.strip() for n in value.split(",")] if isinstance(value, str) else None
    if names == [""]:
        return ()
    if names is None or any(n not in PREEMPTION_SIGNALS for n in names) or len(set(names)) != len(names):
        raise unsupported("preemption_signals", value, "a comma-separated list of distinct names among "
                          f"{', '.join(repr(n) for n in PREEMPTION_SIGNALS)} (e.g. 'SIGTERM,SIGUSR1'), or '' to leave "
                          "signals alone")
    return tuple(names)


class TrainingPreempted(Exception):
    """Raised by `RPPTrainer.train` after a preemption signal, once `checkpoint` (of optimizer step `step`) is saved on
    every process; resume with `train(resume_from_checkpoint=True)`. An ordinary exception, so that a notebook, a
    sweep driver or a Ray task catches it with `except Exception`; a script that wants a scheduler to requeue it exits
    with `exit_code` (`PREEMPTED_EXIT_CODE`), as the `trl-rpp` command does."""

    exit_code = PREEMPTED_EXIT_CODE

    def __init__(self, signal_name: str, step: int, checkpoint: str | None):
        super().__init__(f"training stopped by {signal_name} after optimizer step {step}; "
                         + (f"{checkpoint} is saved" if checkpoint else "no checkpoint was saved"))
        self.signal_name, self.step, self.checkpoint = signal_name, step, checkpoint


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def max_across_processes(value: int, accelerator) -> int:
    """The maximum of one small integer over all processes: one all-reduce of one int64 and one host read (nothing
    with one process)."""
    if accelerator.num_processes <= 1:
        return value
    flag = torch.full((1,), value, dtype=torch.int64, device=accelerator.device)
    torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
    return int(flag.item())


class Preemption:
    """Signal handling around one `train` call of `trainer` (see the module docstring). Built once per trainer;
    `with preemption:` installs it for the duration of a training run. It takes TRL's trainer because it calls
    `Trainer.add_callback` (and `Trainer.remove_callback`): its callback steers the trainer's loop (`TrainerControl`)
    to finish the step and save."""

    def __init__(self, trainer, signal_names: tuple[str, ...] | str):
        self.trainer = trainer
        self.signal_names = parse_preemption_signals(signal_names) if isinstance(signal_names, str) else signal_names
        self.callback = PreemptionCallback(self)
        self._reset()

    def _reset(self):
        self.received = []  # signal numbers in arrival order; only the handler appends
        self.stop_step = None  # the optimizer step whose checkpoint ends the run, once the processes agreed
        self.stop_signal = 0
        self.saved = None  # that checkpoint's folder, once saved
        self._agreed = 0  # the flag as last gathered with the loss metrics (several processes)
        self._gathered = False  # whether the loss metrics gathered it since the last step end
        self._previous = {}

    # --- the signal handler and its context ---------------------------------------------------------------------

    def _handler(self, signum, frame):
        self.received.append(signum)  # nothing else: see the module docstring

    def __enter__(self):
        self._reset()
        self.trainer.add_callback(self.callback)
        if self.signal_names and threading.current_thread() is not threading.main_thread():
            logger.warning("trl_rpp: train() runs outside the main thread, where Python cannot install signal "
                           "handlers: %s keep their previous behaviour.", ", ".join(self.signal_names))
            return self
        for name in self.signal_names:
            signum = getattr(signal, name)
            self._previous[signum] = signal.signal(signum, self._handler)
        return self

    def __exit__(self, exc_type, exc, tb):
        self.trainer.remove_callback(self.callback)
        if exc_type is None and self.stop_step is not None:
            # No process exits (a launcher then stops the others) while another is still writing the checkpoint.
            self.trainer.accelerator.wait_for_everyone()
        for signum, previous in self._previous.items():
            # `None`: a handler installed outside Python, which Python cannot reinstall; the default is the nearest.
            signal.signal(signum, signal.SIG_DFL if previous is None else previous)
        if exc_type is not None:
            return False
        if self.stop_step is None:
            if self.received and self._previous:
                # Training ended before a step boundary could act on it: do what it would have done without us.
                signal.raise_signal(self.received[0])
            return False
        rank = self.trainer.accelerator.process_index
        if self.received[1:]:
            logger.warning("trl_rpp: process %d ignored %s, received while stopping for preemption.", rank,
                           ", ".join(signal_name(s) for s in self.received[1:]))
        name = signal_name(self.stop_signal)
        if self.saved is None:
            logger.warning("trl_rpp: preemption (%s): no checkpoint was saved at step %d (a callback cancelled the "
                           "save); raising TrainingPreempted.", name, self.stop_step)
        elif self.trainer.accelerator.is_main_process:
            logger.warning("trl_rpp: preemption (%s): %s is saved; raising TrainingPreempted. Resume with "
                           "trainer.train(resume_from_checkpoint=True).", name, self.saved)
        raise TrainingPreempted(name, self.stop_step, self.saved)

    # --- agreement ----------------------------------------------------------------------------------------------

    def flag(self, like: torch.Tensor) -> dict:
        """`{FLAG: 0-dim tensor}` for the `maxima` of the loss metrics' gather: this process's first signal number, or
        0. Filled on the device (no host-to-device copy, which would synchronize)."""
        return {FLAG: torch.full((), self.received[0] if self.received else 0, dtype=torch.float32, device=like.device)}

    def gathered(self, values: dict) -> None:
        """Record the flag's maximum over processes from the loss metrics' gather."""
        self._agreed = int(values[FLAG])
        self._gathered = True

    def _decide(self, at_step_end: bool) -> int:
        """The maximum signal number over processes (0: none), the same on every process."""
        local = self.received[0] if self.received else 0
        if self.trainer.accelerator.num_processes <= 1:
            return local
        if at_step_end and self._gathered:
            self._gathered = False
            return self._agreed
        self._gathered = False
        return max_across_processes(local, self.trainer.accelerator)

    def _stop(self, step: int, signum: int, saved: bool):
        self.stop_step, self.stop_signal = step, signum
        if self.trainer.accelerator.is_main_process:
            folder = self._checkpoint(step)
            logger.warning("trl_rpp: preemption: %s received; optimizer step %d is complete. %s and stopping.",
                           signal_name(signum), step, f"{folder} was just saved" if saved else f"Saving {folder}")

    def _checkpoint(self, step: int) -> str:
        return os.path.join(self.trainer.args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{step}")


class PreemptionCallback(TrainerCallback):
    """Turns an agreed preemption signal into a save and a stop, at a step boundary (see the module docstring)."""

    def __init__(self, preemption: Preemption):
        self.preemption = preemption

    def on_step_end(self, args, state, control, **kwargs):
        p = self.preemption
        if p.stop_step is None and (signum := p._decide(at_step_end=True)):
            p._stop(state.global_step, signum, saved=False)
            # Logged first, so that the metrics of the steps since the last log are not lost with the process.
            control.should_log = control.should_save = control.should_training_stop = True
            control.should_evaluate = False
        return control

    def on_save(self, args, state, control, **kwargs):
        p = self.preemption
        if p.stop_step is None and (signum := p._decide(at_step_end=False)):
            p._stop(state.global_step, signum, saved=True)  # a signal during this step's log, evaluation or save
            control.should_training_stop = True
        if p.stop_step == state.global_step:
            p.saved = p._checkpoint(state.global_step)
        return control

    def on_epoch_end(self, args, state, control, **kwargs):
        if self.preemption.stop_step is not None:
            control.should_save = control.should_evaluate = False  # saved at the stop step already
        return control
