"""Non-finite gradients injected into real training steps, for tests/test_grad_guard.py: the fault (a forward hook
that makes the final hidden states infinite at chosen steps' loss forward), a callback that snapshots the weights and
the optimizer state around every optimizer step, and, run as a script under `accelerate launch --num_processes 2`
(gloo on CPU), a two-process run that injects the fault on rank 0 only and saves what each rank saw.

    python -m accelerate.commands.launch --multi_gpu --num_processes 2 tests/support/grad_guard_script.py OUT MODEL MODE
"""

import os
import sys
import warnings
from pathlib import Path

import torch
from transformers import TrainerCallback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from trainer_helpers import make_args  # noqa: E402
from trl_rpp import RPPTrainer  # noqa: E402
from trl_rpp.testing.tiny import copy_task_dataset  # noqa: E402


def varied_reward(completions, **kwargs):
    """A reward that differs within almost every group of a random model's samples (a function of the first
    character), so that every step that is not skipped has a non-zero gradient and visibly moves the weights."""
    return [float(ord(c[:1] or " ") % 5) for c in completions]


class InfHiddenStates:
    """A forward hook on the model's final norm that adds +inf to its output (the hidden states the LM head reads)
    in the loss forward of the given optimizer steps (numbered as the log history numbers them, from 1). Only the
    loss forward runs with gradients enabled: generation and the old/reference log-prob forwards run under no_grad
    and are left alone. `fired` lists the steps at which it changed a forward."""

    def __init__(self, trainer, steps):
        self.trainer, self.steps, self.fired = trainer, set(steps), []
        self.handle = trainer.model.model.norm.register_forward_hook(self)

    def __call__(self, module, args, output):
        step = self.trainer.state.global_step + 1
        if torch.is_grad_enabled() and step in self.steps:
            self.fired.append(step)
            return output + float("inf")  # still part of the graph: the backward carries the NaN to every weight
        return output


def _clone(x):
    if torch.is_tensor(x):
        return x.detach().clone()
    if isinstance(x, dict):
        return {k: _clone(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(_clone(v) for v in x)
    return x


_SAME_SIZE_INT = {torch.float64: torch.int64, torch.float32: torch.int32, torch.float16: torch.int16,
                  torch.bfloat16: torch.int16}  # fmt: skip


def _bits(t):
    t = t.detach().reshape(-1)
    return t.view(_SAME_SIZE_INT[t.dtype]) if t.dtype in _SAME_SIZE_INT else t


def identical(a, b) -> bool:
    """Bit-identical nested tensors and values: floats compared as their bits (so -0.0 differs from 0.0, and a NaN
    equals the same NaN)."""
    if torch.is_tensor(a):
        return torch.is_tensor(b) and a.shape == b.shape and a.dtype == b.dtype and torch.equal(_bits(a), _bits(b))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(identical(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(identical(x, y) for x, y in zip(a, b))
    return a == b


class Snapshots(TrainerCallback):
    """Weights and optimizer state (a copy of `optimizer.state_dict()["state"]`: AdamW's moments and step counts; the
    learning rate in its param groups is the scheduler's, which steps after a skipped step too) before each optimizer
    step (`before[k]`) and after it (`after[k]`), and at `on_pre_optimizer_step` whether every gradient was dropped
    (`grads_dropped[k]`)."""

    def __init__(self, trainer):
        self.trainer, self.before, self.after, self.grads_dropped = trainer, {}, {}, {}

    def _snapshot(self):
        params = {n: p.detach().clone() for n, p in self.trainer.model.named_parameters()}
        return params, _clone(self.trainer.optimizer.state_dict()["state"])

    def on_step_begin(self, args, state, control, **kwargs):
        self.before[state.global_step + 1] = self._snapshot()

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        grads = [p.grad for p in self.trainer.model.parameters() if p.requires_grad]
        self.grads_dropped[state.global_step + 1] = all(g is None for g in grads)

    def on_step_end(self, args, state, control, **kwargs):
        self.after[state.global_step] = self._snapshot()  # global_step already counts this step

    def unchanged(self, step) -> tuple[bool, bool]:
        """(weights, optimizer state) bit-identical across optimizer step `step`."""
        (p0, o0), (p1, o1) = self.before[step], self.after[step]
        return identical(p0, p1), identical(o0, o1)


def main(outdir, model_path, mode):
    outdir = Path(outdir)
    skip_at = {"skip": [2], "stop": [2, 3]}[mode]
    limit = {"skip": 5, "stop": 1}[mode]
    args = make_args(outdir, "reinforce_plus_plus_baseline", gradient_accumulation_steps=1, steps_per_generation=1,
                     max_steps=4, reward_weights=None, max_consecutive_skipped_steps=limit)  # fmt: skip
    trainer = RPPTrainer(model=model_path, reward_funcs=varied_reward, args=args,
                         train_dataset=copy_task_dataset(64))  # fmt: skip
    rank = trainer.accelerator.process_index
    assert trainer.accelerator.num_processes == 2 and torch.distributed.get_backend() == "gloo"
    inject = InfHiddenStates(trainer, skip_at if rank == 0 else [])  # the fault on one process only
    snaps = Snapshots(trainer)
    trainer.add_callback(snaps)
    error = None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            trainer.train()
        except RuntimeError as e:  # NonFiniteGradientError: saved, so that the parent test sees every rank's
            error = f"{type(e).__name__}: {e}"
    steps = sorted(snaps.after)
    torch.save(
        dict(
            error=error,
            fired=inject.fired,
            warnings=[str(w.message) for w in caught if "gradient norm before clipping" in str(w.message)],
            logs=trainer.state.log_history,
            unchanged={k: snaps.unchanged(k) for k in steps},
            grads_dropped=snaps.grads_dropped,
            global_step=trainer.state.global_step,
            params={n: p.detach().clone() for n, p in trainer.model.named_parameters()},
        ),
        outdir / f"rank{rank}.pt",
    )


if __name__ == "__main__":
    main(*sys.argv[1:])
