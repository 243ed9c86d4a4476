"""Where a step of `make demo` goes, and what gradient checkpointing costs there, side by side in one run.

    python benchmarks/demo_step_time.py                    # SmolLM2 + LoRA as in examples/demo.py, 2 threads
    python benchmarks/demo_step_time.py --threads 1 --rounds 1 --steps 2

Each arm trains with the demo's settings (`examples/demo.py`: `demo_setup`, `demo_trainer_args`), except that the
KL loss is on in both (REINFORCE++-baseline's default, which the demo turns off: its reference forward is one of the
parts measured) and `gradient_checkpointing` is on (TRL's default) in one arm and off in the other. Arms alternate within one process, `--rounds`
x `--steps` optimizer steps each, the first step of every round dropped as warm-up. A step is split by timing the
trainer's own methods:

- generation: `_generate_single_turn` (transformers' `generate`, LoRA adapters on);
- rewards: `_calculate_rewards`;
- reference forward: the rest of `_generate_and_score_completions` (the adapters-off reference log-probs of the
  KL loss, plus TRL's bookkeeping);
- batching: the rest of `_prepare_inputs` (GRPO's buffering and splitting of the generation batch);
- policy forward: `compute_loss`; backward: the rest of `training_step` (the recompute of gradient checkpointing,
  when on, lands here); optimizer: the rest of the step.

Then the demo's two held-out greedy evaluations (128 prompts, 6 new tokens) are timed once: on the base model and
on the trained LoRA model (adapters unmerged, as the demo scores it). Run it alone on the machine: a second busy
process slows torch several-fold.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import tempfile
import time
import warnings
from collections import defaultdict

warnings.filterwarnings("ignore")
os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from transformers import TrainerCallback  # noqa: E402

from trl_rpp import RPPConfig, RPPTrainer  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PARTS = ("generation", "rewards", "reference_forward", "batching", "policy_forward", "backward", "optimizer")


def load_demo():
    spec = importlib.util.spec_from_file_location("demo", os.path.join(ROOT, "examples", "demo.py"))
    demo = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(demo)
    return demo


class Timings(TrainerCallback):
    """Per-step totals of the timed methods, and each step's wall time."""

    def __init__(self):
        self.steps, self._current, self._t0 = [], None, None

    def on_step_begin(self, args, state, control, **kw):
        self._current, self._t0 = defaultdict(float), time.perf_counter()

    def on_step_end(self, args, state, control, **kw):
        self._current["step"] = time.perf_counter() - self._t0
        self.steps.append(dict(self._current))

    def wrap(self, obj, name, key):
        inner = getattr(obj, name)

        def timed(*args, **kwargs):
            t = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                if self._current is not None:
                    self._current[key] += time.perf_counter() - t

        setattr(obj, name, timed)


def split(step: dict) -> dict:
    """The parts of one step, in seconds, from the timed methods' totals (see the module docstring)."""
    return {
        "generation": step["generate"],
        "rewards": step["rewards"],
        "reference_forward": step["generate_and_score"] - step["generate"] - step["rewards"],
        "batching": step["prepare_inputs"] - step["generate_and_score"],
        "policy_forward": step["compute_loss"],
        "backward": step["training_step"] - step["prepare_inputs"] - step["compute_loss"],
        "optimizer": step["step"] - step["training_step"],
        "step": step["step"],
    }


def run_arm(demo, ns, setup, gradient_checkpointing, steps, out):
    model_path, tokenizer, train_rows, _, reward_fn, _, config, peft_config = setup
    from datasets import Dataset

    kw = demo.demo_trainer_args(ns, out, dict(config, max_steps=steps, logging_steps=1), report_to="none",
                                gradient_checkpointing=gradient_checkpointing, use_kl_loss=True)
    timings = Timings()
    trainer = RPPTrainer(model=model_path, reward_funcs=reward_fn, args=RPPConfig(**kw),
                         train_dataset=Dataset.from_list(train_rows), processing_class=tokenizer,
                         peft_config=peft_config, callbacks=[timings])
    for name, key in [("_generate_single_turn", "generate"), ("_calculate_rewards", "rewards"),
                      ("_generate_and_score_completions", "generate_and_score"), ("compute_loss", "compute_loss"),
                      ("training_step", "training_step"), ("_prepare_inputs", "prepare_inputs")]:
        timings.wrap(trainer, name, key)
    trainer.train()
    return [split(s) for s in timings.steps[1:]], trainer  # first step of the round: warm-up


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--steps", type=int, default=3, help="optimizer steps per arm and round (the first is dropped)")
    p.add_argument("--tiny", action="store_true", help="the demo's --tiny set-up (for the smoke test)")
    p.add_argument("--skip_eval", action="store_true", help="do not time the held-out evaluations")
    p.add_argument("--json", default=None, help="write the results here")
    ns = p.parse_args(argv)
    torch.set_num_threads(ns.threads)
    demo = load_demo()
    work = tempfile.mkdtemp(prefix="demo_step_time_")
    demo_ns = argparse.Namespace(tiny=ns.tiny, seed=0, learning_rate=None, max_steps=None, heldout=demo.HELDOUT)
    setup = demo.demo_setup(demo_ns, work)
    arms = {"gradient_checkpointing=True (TRL default)": True, "gradient_checkpointing=False": False}
    parts = {arm: [] for arm in arms}
    trainer = None
    for r in range(ns.rounds):
        for arm, gc in arms.items():
            rows, trainer = run_arm(demo, demo_ns, setup, gc, ns.steps, os.path.join(work, f"r{r}-{gc}"))
            parts[arm] += rows
    result = {"threads": ns.threads, "steps_timed_per_arm": len(next(iter(parts.values()))), "arms": {}}
    print(f"threads {ns.threads}; seconds per optimizer step (mean over {result['steps_timed_per_arm']} steps)")
    print(f"{'arm':42s}" + "".join(f"{k:>18s}" for k in (*PARTS, "step")))
    for arm, rows in parts.items():
        mean = {k: statistics.fmean(r[k] for r in rows) for k in (*PARTS, "step")}
        result["arms"][arm] = mean
        print(f"{arm:42s}" + "".join(f"{mean[k]:18.2f}" for k in (*PARTS, "step")))
    on, off = (result["arms"][a]["step"] for a in arms)
    result["step_ratio_off_vs_on"] = off / on
    print(f"step time with gradient checkpointing off / on: {off / on:.3f}")
    if not ns.skip_eval:
        from transformers import AutoModelForCausalLM

        model_path, tokenizer, _, heldout_rows, reward_fn, max_new, _, _ = setup
        base = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
        t = time.perf_counter()
        demo.greedy_accuracy(base, tokenizer, heldout_rows, reward_fn, max_new)
        result["eval_base_s"] = time.perf_counter() - t
        t = time.perf_counter()
        demo.greedy_accuracy(trainer.model, tokenizer, heldout_rows, reward_fn, max_new)
        result["eval_trained_s"] = time.perf_counter() - t
        print(f"held-out greedy evaluation ({len(heldout_rows)} prompts): base model {result['eval_base_s']:.1f} s, "
              f"trained model {result['eval_trained_s']:.1f} s")
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump(result, f, indent=2)
    return result


if __name__ == "__main__":
    main()
