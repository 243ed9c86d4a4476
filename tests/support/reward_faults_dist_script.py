"""Run by tests/test_reward_faults.py under `accelerate launch --multi_gpu --num_processes 2` (gloo on CPU).

Four short runs in the same pair of processes, each with one rank's reward function failing on one call only:
"raise", "hang" and "invalid" must stop both ranks with the same error; "unscorable" must finish on both. Each
rank saves what it saw (the error, or the logged counts, the gathered rewards and the advantages) to rank{r}.pt.
"""

import math
import os
import sys
import time
import warnings
from pathlib import Path

import torch

warnings.filterwarnings("ignore")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from trainer_helpers import CaptureTrainer, finish_launched, make_args  # noqa: E402
from trl_rpp.faults.rewards import RewardFunctionError  # noqa: E402
from trl_rpp.testing.tiny import copy_task_dataset  # noqa: E402

RANK = int(os.environ["RANK"])
HANG = 15.0


def unreachable(completions):
    raise ConnectionError("judge unreachable")


def hang(completions):
    time.sleep(HANG)


def nan(completions):
    return [math.nan] * len(completions)


def judge_with(faults):
    """A reward function that, on this rank, runs `faults[(rank, call)]` on that call (1-based) instead of scoring."""

    def judge(prompts, completions, **kw):
        judge.calls += 1
        fault = faults.get((RANK, judge.calls))
        if fault is not None:
            judge.fault_started = time.time()
            return fault(completions)
        return [float(c[:1] == p[:1]) for p, c in zip(prompts, completions)]

    judge.calls, judge.fault_started = 0, None
    return judge


RUNS = {
    "raise": (dict(max_steps=3), {(0, 2): unreachable}),
    "hang": (dict(max_steps=2, reward_timeout=1.0), {(1, 1): hang}),
    "invalid": (dict(max_steps=2), {(1, 1): nan}),
    "unscorable": (dict(max_steps=3, reward_timeout=1.0, reward_errors="unscorable"),
                   {(0, 2): unreachable, (1, 3): hang}),
}


def run(outdir, model_path, name):
    settings, faults = RUNS[name]
    judge = judge_with(faults)
    args = make_args(Path(outdir) / name, "reinforce_plus_plus", per_device_train_batch_size=4, num_generations=4,
                     gradient_accumulation_steps=1, steps_per_generation=1, reward_weights=None, **settings)
    trainer = CaptureTrainer(model=model_path, reward_funcs=judge, args=args, train_dataset=copy_task_dataset(32))
    assert trainer.accelerator.num_processes == 2
    try:
        trainer.train()
    except (RewardFunctionError, ValueError) as e:
        attrs = (e.func_name, e.kind, e.step, e.process_index) if isinstance(e, RewardFunctionError) else None
        return dict(type=type(e).__name__, message=str(e), attrs=attrs, raised_at=time.time(),
                    cause=type(e.__cause__).__name__ if e.__cause__ is not None else None,
                    global_step=trainer.state.global_step, fault_started=judge.fault_started)
    logs = [h for h in trainer.state.log_history if "loss" in h]
    return dict(global_step=trainer.state.global_step, errors=[h["rewards/judge/errors"] for h in logs],
                timeouts=[h["rewards/judge/timeouts"] for h in logs], rewards=trainer.captured_rewards,
                advantages=[x["advantages"] for x in trainer.loss_inputs])


def main(outdir, model_path):
    results = {name: run(outdir, model_path, name) for name in RUNS}  # in this order: "unscorable" last
    torch.save(results, os.path.join(outdir, f"rank{RANK}.pt"))


if __name__ == "__main__":
    main(*sys.argv[1:])
    finish_launched(sys.argv[1])
