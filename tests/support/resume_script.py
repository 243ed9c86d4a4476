"""Run by tests/test_resume.py and tests/test_preemption.py as a real subprocess (also under `accelerate launch` with
2 processes): trains, checkpoints every 3 steps (--save_steps), and (with --hang_at N) stops inside step N's reward
computation so that the parent can SIGKILL it mid-step, or (with --kill_at POINT --kill_step N) SIGKILLs itself at
POINT of the write of checkpoint-N (see `install_kill`).

For the preemption tests, --wait_at N waits inside step N's reward computation, and --pause_at POINT --pause_step N
at POINT of the write of checkpoint-N, until this process has received --wait_signals preemption signals from the
parent (or the parent creates `release` in the output folder). Each writes `waiting_rank<r>` / `paused_rank<r>`
there first, holding its pid, so that the parent knows when and where to send the signal."""

import argparse
import json
import os
import sys
import time
import warnings

warnings.filterwarnings("ignore")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

from trl_rpp import RPPConfig, RPPTrainer  # noqa: E402
from trl_rpp.faults.preemption import TrainingPreempted  # noqa: E402
from trl_rpp.testing.tiny import copy_task_dataset  # noqa: E402

from checkpoint_faults import KILL_POINTS, install_kill  # noqa: E402
from trainer_helpers import finish_launched  # noqa: E402


def wait_for_signals(trainer, marker, count):
    """Write `<marker>_rank<r>` (this pid) to the output folder, then wait until this process has received `count`
    preemption signals, or the parent writes `release`."""
    out = trainer.args.output_dir
    path = os.path.join(out, f"{marker}_rank{trainer.accelerator.process_index}")
    with open(path + ".tmp", "w") as f:
        f.write(str(os.getpid()))
    os.replace(path + ".tmp", path)  # the parent never reads a partial pid
    deadline = time.time() + 180
    while len(trainer._rpp_preemption.received) < count and not os.path.exists(os.path.join(out, "release")):
        if time.time() > deadline:
            raise RuntimeError(f"{marker}: no signal came")
        time.sleep(0.05)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--output_dir", required=True)
    ap.add_argument("--estimator", default="reinforce_plus_plus")
    ap.add_argument("--hang_at", type=int, default=None, help="hang inside the reward function of this step")
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--steps_per_generation", type=int, default=1)
    ap.add_argument("--save_steps", type=int, default=3)
    ap.add_argument("--kill_at", choices=sorted(KILL_POINTS), default=None)
    ap.add_argument("--kill_step", type=int, default=None, help="the checkpoint whose write --kill_at interrupts")
    ap.add_argument("--resume_from", default=None, help="resume from this checkpoint folder (--resume: True)")
    ap.add_argument("--wait_at", type=int, default=None, help="wait for a signal inside this step's reward")
    ap.add_argument("--pause_at", choices=["model_start", "rng_start", "rotate_start"], default=None,
                    help="wait for signals at this point of a checkpoint's write")
    ap.add_argument("--pause_step", type=int, default=None, help="the checkpoint whose write --pause_at pauses")
    ap.add_argument("--wait_signals", type=int, default=1, help="how many signals --pause_at waits for")
    a = ap.parse_args()
    torch.set_num_threads(1)

    calls = []
    trainer = None

    def reward(prompts, completions, trainer_state=None, **kw):
        calls.append(trainer_state.global_step + 1)
        if a.hang_at is not None and trainer_state.global_step + 1 == a.hang_at:
            open(os.path.join(a.output_dir, "hanging"), "w").close()
            time.sleep(600)  # the parent kills us here, in the middle of the step
        if a.wait_at is not None and trainer_state.global_step + 1 == a.wait_at:
            wait_for_signals(trainer, "waiting", 1)  # the parent signals us here, in the middle of the step
        return [float(c[:1] == p[:1]) + 0.1 * len(c) for p, c in zip(prompts, completions)]

    args = RPPConfig(
        output_dir=a.output_dir,
        advantage_estimator=a.estimator,
        report_to="none",
        use_cpu=True,
        bf16=False,
        per_device_train_batch_size=8,
        steps_per_generation=a.steps_per_generation,
        num_generations=4,
        max_completion_length=4,
        max_steps=8,
        learning_rate=5e-3,
        logging_steps=1,
        save_strategy="steps",
        save_steps=a.save_steps,
        seed=0,
        data_seed=0,
        disable_dropout=True,
    )
    trainer = RPPTrainer(model=a.model, reward_funcs=reward, args=args, train_dataset=copy_task_dataset(256))
    if a.kill_at is not None:
        install_kill(a.kill_at, a.kill_step, trainer)
    if a.pause_at is not None:
        install_kill(a.pause_at, a.pause_step, trainer, lambda: wait_for_signals(trainer, "paused", a.wait_signals))
    try:
        trainer.train(resume_from_checkpoint=a.resume_from or (True if a.resume else None))
    except TrainingPreempted as stop:  # as `trl-rpp` does: status 75, "checkpoint saved, run me again"
        # What this process saw, for the parent: under `accelerate launch` the launcher's own status and log are
        # torch elastic's, not ours.
        with open(os.path.join(a.output_dir, f"preempted_rank{trainer.accelerator.process_index}.json"), "w") as f:
            json.dump(dict(signal=stop.signal_name, step=stop.step, checkpoint=stop.checkpoint,
                           global_step=trainer.state.global_step), f)
        finish_launched(a.output_dir)
        sys.exit(stop.exit_code)
    if trainer.accelerator.is_main_process:
        with open(os.path.join(a.output_dir, "log_history.json"), "w") as f:
            json.dump(dict(log_history=trainer.state.log_history, steps_run_here=calls), f)
    finish_launched(a.output_dir)


if __name__ == "__main__":
    main()
