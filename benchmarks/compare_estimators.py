"""Equal-budget comparison: REINFORCE++, REINFORCE++-baseline and trl.GRPOTrainer on SmolLM2-135M-Instruct.

    python benchmarks/compare_estimators.py                       # 5 seeds x 4 arms, resumable
    python benchmarks/compare_estimators.py --seeds 0 --steps 2 --tiny --out /tmp/cmp   # smoke run

Arms (same prompts per step, generations per prompt, steps, learning rate, LoRA adapter and seeds):

- `rpp`: `RPPTrainer`, `advantage_estimator="reinforce_plus_plus"` (its recipe: k1 in the reward, kl_coef 0.01);
- `rpp_baseline`: `RPPTrainer`, `"reinforce_plus_plus_baseline"` (its recipe: k2 loss, kl_loss_coef 0.01);
- `grpo`: `trl.GRPOTrainer` with its defaults (loss_type "dapo", scale_rewards "group", beta 0);
- `grpo_noscale`: the same with `scale_rewards="none"`.

Every (arm, seed) runs in its own process, so each has its own peak RSS, and the sweep visits the arms in turn
for each seed so that machine load hits them alike. A run that finished left `summary.json` in
`<out>/<arm>/seed<k>/` and is skipped when the sweep is started again, so a long sweep can run in pieces. Raw
per-step metrics (the trainer's log history) are in `metrics.jsonl` next to it. `--report` (after the runs)
writes the figures and `<out>/report.json` that docs/evidence.md is written from.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import subprocess
import sys
import time

ARMS = ("rpp", "rpp_baseline", "grpo", "grpo_noscale")
HERE = os.path.dirname(os.path.abspath(__file__))


def run_one(arm, seed, opts):
    """Train one arm with one seed in this process and write metrics.jsonl and summary.json."""
    import torch

    os.environ.setdefault("WANDB_MODE", "disabled")
    torch.set_num_threads(opts.threads)
    sys.path.insert(0, os.path.join(os.path.dirname(HERE), "examples"))
    import demo  # the main job's task, reward and greedy evaluation
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from trl_rpp import RPPConfig, RPPTrainer

    outdir = os.path.join(opts.out, arm, f"seed{seed}")
    os.makedirs(outdir, exist_ok=True)
    if opts.tiny:
        from trl_rpp.tiny import build_tiny_model

        path = build_tiny_model(os.path.join(opts.out, "tiny-model"))
        tokenizer = AutoTokenizer.from_pretrained(path)
        train, heldout = demo.copy_rows(2000, seed + 1), demo.copy_rows(opts.heldout, 10_000)
        reward, max_new, target_modules = demo.copy_reward, 2, ["q_proj", "v_proj"]
    else:
        from trl_rpp.assets import smollm2_path

        path = str(smollm2_path())
        tokenizer = AutoTokenizer.from_pretrained(path)
        # The held-out split is the same for every seed and arm; training prompts are drawn per seed.
        train, heldout = demo.arithmetic_prompts(tokenizer, 2000, seed + 1), demo.arithmetic_prompts(tokenizer, opts.heldout, 10_000)
        reward, max_new, target_modules = demo.first_integer_reward, 6, ["q_proj", "k_proj", "v_proj", "o_proj"]

    common = dict(
        output_dir=outdir, use_cpu=True, bf16=False, report_to="none", save_strategy="no", seed=seed,
        per_device_train_batch_size=opts.prompts * opts.generations, num_generations=opts.generations,
        max_completion_length=max_new, learning_rate=opts.lr, max_steps=opts.steps, logging_steps=1,
        temperature=1.0, disable_dropout=True,
    )
    if arm == "rpp":
        trainer_cls, args = RPPTrainer, RPPConfig(advantage_estimator="reinforce_plus_plus", **common)
    elif arm == "rpp_baseline":
        trainer_cls, args = RPPTrainer, RPPConfig(advantage_estimator="reinforce_plus_plus_baseline", **common)
    elif arm == "grpo":
        trainer_cls, args = GRPOTrainer, GRPOConfig(**common)
    elif arm == "grpo_noscale":
        trainer_cls, args = GRPOTrainer, GRPOConfig(scale_rewards="none", **common)
    else:
        raise ValueError(f"unknown arm {arm!r}; accepted: {', '.join(ARMS)}")

    class StepClock(TrainerCallback):
        def __init__(self):
            self.times, self._t = [], None

        def on_step_begin(self, *a, **k):
            self._t = time.perf_counter()

        def on_step_end(self, *a, **k):
            self.times.append(time.perf_counter() - self._t)

    clock = StepClock()
    lora = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules=target_modules, task_type="CAUSAL_LM")
    trainer = trainer_cls(
        model=path, reward_funcs=reward, args=args, train_dataset=Dataset.from_list(train),
        processing_class=tokenizer, peft_config=lora, callbacks=[clock],
    )
    with torch.no_grad(), trainer.model.disable_adapter():
        before = demo.greedy_accuracy(trainer.model, tokenizer, heldout, reward, max_new)
    trainer.train()
    after = demo.greedy_accuracy(trainer.model, tokenizer, heldout, reward, max_new)
    with open(os.path.join(outdir, "metrics.jsonl"), "w") as f:
        for row in trainer.state.log_history:
            f.write(json.dumps(row) + "\n")
    summary = dict(
        arm=arm, seed=seed, heldout_before=before, heldout_after=after, step_seconds=clock.times,
        peak_rss_mib=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, threads=opts.threads,
    )
    with open(os.path.join(outdir, "summary.json"), "w") as f:  # written last: marks the run as done
        json.dump(summary, f, indent=2)
    print(json.dumps({k: v for k, v in summary.items() if k != "step_seconds"}), flush=True)


def sweep(opts):
    for seed in opts.seeds:
        for arm in opts.arms:
            if os.path.exists(os.path.join(opts.out, arm, f"seed{seed}", "summary.json")):
                print(f"[sweep] {arm} seed {seed}: done earlier, skipped", flush=True)
                continue
            print(f"[sweep] {arm} seed {seed}: running", flush=True)
            cmd = [sys.executable, os.path.abspath(__file__), "--run", arm, "--seed", str(seed)] + opts.passthrough
            subprocess.run(cmd, check=True)


def t_interval(values):
    """mean, std (ddof 1), and the half-width of a two-sided 95% t interval."""
    n = len(values)
    mean = sum(values) / n
    if n < 2:
        return mean, None, None
    std = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))
    t975 = {2: 12.706, 3: 4.303, 4: 3.182, 5: 2.776, 6: 2.571, 7: 2.447, 8: 2.365, 9: 2.306, 10: 2.262}.get(n, 1.96)
    return mean, std, t975 * std / math.sqrt(n)


def report(opts):
    runs = {}
    for arm in ARMS:
        for seed in opts.seeds:
            d = os.path.join(opts.out, arm, f"seed{seed}")
            if os.path.exists(os.path.join(d, "summary.json")):
                summary = json.load(open(os.path.join(d, "summary.json")))
                history = [json.loads(line) for line in open(os.path.join(d, "metrics.jsonl"))]
                runs[(arm, seed)] = (summary, [h for h in history if "reward" in h])
    out = dict(arms={}, paired_vs_grpo={})
    for arm in ARMS:
        seeds = [s for s in opts.seeds if (arm, s) in runs]
        if not seeds:
            continue
        after = [runs[(arm, s)][0]["heldout_after"] for s in seeds]
        before = [runs[(arm, s)][0]["heldout_before"] for s in seeds]
        steps = [t for s in seeds for t in runs[(arm, s)][0]["step_seconds"][1:]]
        out["arms"][arm] = dict(
            seeds=seeds, before=t_interval(before), after=t_interval(after),
            median_step_seconds=sorted(steps)[len(steps) // 2] if steps else None,
            peak_rss_mib=max(runs[(arm, s)][0]["peak_rss_mib"] for s in seeds),
        )
        common = [s for s in seeds if ("grpo", s) in runs]
        if arm != "grpo" and common:
            diffs = [runs[(arm, s)][0]["heldout_after"] - runs[("grpo", s)][0]["heldout_after"] for s in common]
            out["paired_vs_grpo"][arm] = dict(seeds=common, diff=t_interval(diffs))
    with open(os.path.join(opts.out, "report.json"), "w") as f:
        json.dump(out, f, indent=2)
    print(json.dumps(out, indent=2))

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [("reward", "training reward"), ("completions/mean_length", "completion length"),
              ("grad_norm", "gradient norm"), ("frac_reward_zero_std", "fraction of zero-variance groups"),
              ("advantages/std", "normalized-advantage std (RPP)"), ("kl_loss", "k2 KL to reference (baseline)")]
    fig, axes = plt.subplots(2, 3, figsize=(13, 6.5))
    for ax, (key, title) in zip(axes.flat, panels):
        for arm in ARMS:
            curves = [[h.get(key) for h in runs[(arm, s)][1]] for s in opts.seeds if (arm, s) in runs]
            curves = [c for c in curves if c and all(v is not None for v in c)]
            if not curves:
                continue
            n = min(len(c) for c in curves)
            cols = [[c[i] for c in curves] for i in range(n)]
            mean = [sum(col) / len(col) for col in cols]
            lo, hi = [min(col) for col in cols], [max(col) for col in cols]
            ax.plot(range(1, n + 1), mean, label=arm)
            ax.fill_between(range(1, n + 1), lo, hi, alpha=0.2)
        ax.set(title=title, xlabel="step")
    axes.flat[0].legend(fontsize=8)
    fig.suptitle("mean over seeds, band = min..max across seeds")
    fig.tight_layout()
    fig.savefig(os.path.join(opts.out, "curves.png"), dpi=110)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks/results/compare_estimators")
    ap.add_argument("--seeds", default="0,1,2,3,4")
    ap.add_argument("--arms", default=",".join(ARMS))
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--generations", type=int, default=4)
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--heldout", type=int, default=128)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--tiny", action="store_true", help="tiny random-init model and the copy task (smoke runs)")
    ap.add_argument("--run", default=None, help="internal: run one arm in this process")
    ap.add_argument("--seed", type=int, default=None, help="internal: with --run")
    ap.add_argument("--report", action="store_true", help="only aggregate finished runs into figures and report.json")
    opts = ap.parse_args()
    opts.seeds = [int(s) for s in str(opts.seeds).split(",")]
    opts.arms = [a for a in opts.arms.split(",")]
    for name in opts.arms:
        if name not in ARMS:
            raise ValueError(f"unknown arm {name!r}; accepted: {', '.join(ARMS)}")
    opts.passthrough = [
        "--out", opts.out, "--steps", str(opts.steps), "--prompts", str(opts.prompts), "--generations",
        str(opts.generations), "--lr", str(opts.lr), "--heldout", str(opts.heldout), "--threads", str(opts.threads),
    ] + (["--tiny"] if opts.tiny else [])
    if opts.run:
        run_one(opts.run, opts.seed, opts)
    elif opts.report:
        report(opts)
    else:
        sweep(opts)
        report(opts)


if __name__ == "__main__":
    main()
