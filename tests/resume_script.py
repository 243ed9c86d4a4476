"""Run by tests/test_resume.py as a real subprocess: trains, checkpoints every 3 steps, and (with --hang_at N)
stops inside step N's reward computation so that the parent can SIGKILL it mid-step."""

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
from trl_rpp.testing.tiny import copy_task_dataset  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--output_dir", required=True)
    ap.add_argument("--estimator", default="reinforce_plus_plus")
    ap.add_argument("--hang_at", type=int, default=None, help="hang inside the reward function of this step")
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--steps_per_generation", type=int, default=1)
    a = ap.parse_args()
    torch.set_num_threads(1)

    calls = []

    def reward(prompts, completions, trainer_state=None, **kw):
        calls.append(trainer_state.global_step + 1)
        if a.hang_at is not None and trainer_state.global_step + 1 == a.hang_at:
            open(os.path.join(a.output_dir, "hanging"), "w").close()
            time.sleep(600)  # the parent kills us here, in the middle of the step
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
        save_steps=3,
        seed=0,
        data_seed=0,
        disable_dropout=True,
    )
    trainer = RPPTrainer(model=a.model, reward_funcs=reward, args=args, train_dataset=copy_task_dataset(256))
    trainer.train(resume_from_checkpoint=True if a.resume else None)
    with open(os.path.join(a.output_dir, "log_history.json"), "w") as f:
        json.dump(dict(log_history=trainer.state.log_history, steps_run_here=calls), f)


if __name__ == "__main__":
    main()
