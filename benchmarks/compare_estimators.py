"""Equal-budget comparison: REINFORCE++, REINFORCE++-baseline and trl.GRPOTrainer on SmolLM2-135M-Instruct.

    python benchmarks/compare_estimators.py                       # 5 seeds x 4 arms, resumable
    python benchmarks/compare_estimators.py --seeds 0 --steps 2 --tiny --out /tmp/cmp   # smoke run

Arms (same prompts per step, generations per prompt, steps, learning rate, LoRA adapter and seeds):

- `rpp`: `RPPTrainer`, `advantage_estimator="reinforce_plus_plus"` (its recipe: k1 in the reward, kl_coef 0.01);
- `rpp_baseline`: `RPPTrainer`, `"reinforce_plus_plus_baseline"` (its recipe: k2 loss, kl_loss_coef 0.01);
- `grpo`: `trl.GRPOTrainer` with its defaults (loss_type "dapo", scale_rewards "group", beta 0);
- `grpo_noscale`: the same with `scale_rewards="none"`.

Second table (`--arms mismatch_none,mismatch_tis,mismatch_sc`): REINFORCE++-baseline with a sampler that adds a fixed
`N(0, sigma^2)` bias to every logit, uncorrected, with TRL's importance-sampling correction, or with score
centering (see `mismatch_trainer`).

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
# Second table: REINFORCE++-baseline under an induced sampler mismatch, with each correction (see `mismatch_trainer`).
MISMATCH_ARMS = ("mismatch_none", "mismatch_tis", "mismatch_sc")
HERE = os.path.dirname(os.path.abspath(__file__))


def mismatch_trainer(base, correction, sigma, bias_seed=1234):
    """`base` (RPPTrainer) whose sampler is the trainer plus a fixed logit bias, with one of three corrections.

    The induced mismatch: every logit the sampler sees gets ``+ b[v]``, ``b ~ N(0, sigma^2)`` drawn once per vocabulary
    id from `bias_seed` (the same for every arm and seed), inside transformers' `generate`, before score centering's
    capture. The sampler is re-synced to the trainer at every step (it *is* the trainer plus `b`), so a bias the
    trainer absorbs is copied back: the drift of docs/score_centering.md. Corrections:

    - ``"none"``: the samples are treated as on-policy;
    - ``"tis"``: TRL's vLLM importance-sampling correction with its defaults (``sequence_mask``, clip_max 3.0): each
      sequence's loss is weighted by ``exp(sum_t log p_old - log q)``, or by 0 where that exceeds 3. TRL applies it
      only with vLLM; this is the same formula on the transformers path, with q recorded during `generate`;
    - ``"sc"``: score centering (``score_centering=True`` in the config).

    Every arm also runs one no-grad forward per generation batch for the mismatch metrics (``"tis"`` needs it for
    the ratio anyway), so their step times stay comparable.
    """
    import torch
    from transformers import LogitsProcessor

    from trl_rpp.sampling import SamplerTopKCapture, capturing_generate, generate_with_processor

    class AddFixedBias(LogitsProcessor):
        def __init__(self):
            self.bias = None

        def __call__(self, input_ids, scores):
            if self.bias is None:
                g = torch.Generator().manual_seed(bias_seed)
                self.bias = (torch.randn(scores.size(-1), generator=g) * sigma).to(scores.device, scores.dtype)
            return scores + self.bias

    class MismatchedSamplerTrainer(base):
        _bias = AddFixedBias()

        def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, *args, **kwargs):
            model = self.accelerator.unwrap_model(self.model_wrapped)
            with generate_with_processor(model, self._bias, first=True):
                if self.args.score_centering:  # RPPTrainer's own capture nests inside and sees the biased logits
                    self._q_capture = None
                    return super()._generate_single_turn(prompt_ids, images, multimodal_fields, num_generations, *args, **kwargs)
                self._q_capture = SamplerTopKCapture(1, self.temperature)
                with capturing_generate(model, self._q_capture):
                    return super()._generate_single_turn(prompt_ids, images, multimodal_fields, num_generations, *args, **kwargs)

        def _generate_and_score_completions(self, inputs):
            batch = super()._generate_and_score_completions(inputs)
            mask = batch["completion_mask"].bool()
            T = batch["completion_ids"].size(1)
            if self._q_capture is not None:
                q_logps = self._q_capture.tensors(T)[2].to(mask.device)
            else:
                q_logps = batch["sampler_per_token_logps"]
            with torch.no_grad():
                old, _, _ = self._forward_logps(self.model, batch, batch_size=self.args.per_device_train_batch_size)
            diff = torch.where(mask, old - q_logps, torch.zeros_like(old))  # log p_old - log q per token
            mode = "train" if self.model.training else "eval"
            m = self._metrics[mode]
            m["mismatch/abs_log_ratio_mean"].append((diff.abs().sum() / mask.sum().clamp(min=1)).item())
            m["mismatch/seq_log_ratio_mean"].append(diff.sum(-1).mean().item())
            if correction == "tis":
                ratio = torch.exp(diff.sum(-1, keepdim=True))  # [B, 1], TRL's sequence-level ratio
                ratio = torch.where(ratio > 3.0, torch.zeros_like(ratio), ratio)  # sequence_mask, clip_max 3.0
                batch["old_per_token_logps"] = old
                batch["importance_sampling_ratio"] = ratio
                m["mismatch/is_masked_fraction"].append((ratio == 0).float().mean().item())
            return batch

    MismatchedSamplerTrainer.__name__ = f"MismatchedSampler{correction.upper()}Trainer"
    return MismatchedSamplerTrainer


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
        from trl_rpp.testing.tiny import build_tiny_model

        path = build_tiny_model(os.path.join(opts.out, "tiny-model"))
        tokenizer = AutoTokenizer.from_pretrained(path)
        train, heldout = demo.copy_rows(2000, seed + 1), demo.copy_rows(opts.heldout, 10_000)
        reward, max_new, target_modules = demo.copy_reward, 2, ["q_proj", "v_proj"]
    else:
        from trl_rpp.testing.assets import smollm2_path

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
    elif arm in MISMATCH_ARMS:
        correction = arm.split("_", 1)[1]
        trainer_cls = mismatch_trainer(RPPTrainer, correction, opts.mismatch_sigma)
        args = RPPConfig(
            advantage_estimator="reinforce_plus_plus_baseline", score_centering=correction == "sc", **common
        )
    else:
        raise ValueError(f"unknown arm {arm!r}; accepted: {', '.join(ARMS + MISMATCH_ARMS)}")

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


def _load_runs(opts, arms):
    runs = {}
    for arm in arms:
        for seed in opts.seeds:
            d = os.path.join(opts.out, arm, f"seed{seed}")
            if os.path.exists(os.path.join(d, "summary.json")):
                summary = json.load(open(os.path.join(d, "summary.json")))
                history = [json.loads(line) for line in open(os.path.join(d, "metrics.jsonl"))]
                runs[(arm, seed)] = (summary, [h for h in history if "reward" in h])
    return runs


def _median(values):
    values = sorted(values)
    return values[len(values) // 2] if values else None


def _series(runs, arm, seed, key):
    return [h[key] for h in runs[(arm, seed)][1] if h.get(key) is not None]


def _aggregate(runs, arms, seeds, control, extra_keys):
    """Per arm: held-out before/after (mean, std, 95% half-width), step time and memory, stability indicators;
    and the paired held-out difference against `control` over the seeds both finished."""
    table, paired = {}, {}
    for arm in arms:
        done = [s for s in seeds if (arm, s) in runs]
        if not done:
            continue
        summaries = {s: runs[(arm, s)][0] for s in done}
        # Step time: first step excluded (warm-up). The ratio to the control is taken per seed, between runs made
        # back to back on the same machine, then the median over seeds.
        step = {s: _median(summaries[s]["step_seconds"][1:]) for s in done}
        ratios = [step[s] / _median(runs[(control, s)][0]["step_seconds"][1:]) for s in done if (control, s) in runs]
        row = dict(
            seeds=done,
            before=t_interval([summaries[s]["heldout_before"] for s in done]),
            after=t_interval([summaries[s]["heldout_after"] for s in done]),
            median_step_seconds=_median(list(step.values())),
            step_time_ratio_to_control=_median(ratios) if ratios else None,
            step_time_ratio_range=[min(ratios), max(ratios)] if ratios else None,
            peak_rss_mib=max(summaries[s]["peak_rss_mib"] for s in done),
        )
        for key in ("reward", "advantages/std", "frac_reward_zero_std", "grad_norm", "ref_kl/k1_mean", "kl_loss",
                    "completions/mean_length", *extra_keys):
            per_seed = [_series(runs, arm, s, key) for s in done]
            if all(per_seed):
                flat = [v for series in per_seed for v in series]
                row[key] = dict(
                    mean=sum(flat) / len(flat), min=min(flat), max=max(flat),
                    last_mean=sum(series[-1] for series in per_seed) / len(per_seed),
                )
        table[arm] = row
        common = [s for s in done if (control, s) in runs]
        if arm != control and common:
            diffs = [summaries[s]["heldout_after"] - runs[(control, s)][0]["heldout_after"] for s in common]
            paired[arm] = dict(seeds=common, diff=t_interval(diffs), per_seed=diffs)
    return table, paired


def _plot(runs, arms, seeds, panels, path, title):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cols = 3
    rows = (len(panels) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(13, 3.3 * rows), squeeze=False)
    for ax in axes.flat[len(panels):]:
        ax.axis("off")
    for ax, (key, name) in zip(axes.flat, panels):
        for arm in arms:
            curves = [[h.get(key) for h in runs[(arm, s)][1]] for s in seeds if (arm, s) in runs]
            curves = [c for c in curves if c and all(v is not None for v in c)]
            if not curves:
                continue
            n = min(len(c) for c in curves)
            columns = [[c[i] for c in curves] for i in range(n)]
            mean = [sum(col) / len(col) for col in columns]
            color = f"C{arms.index(arm)}"  # one colour per arm in every panel
            ax.plot(range(1, n + 1), mean, color=color, label=f"{arm} ({len(curves)} seeds)")
            ax.fill_between(range(1, n + 1), [min(c) for c in columns], [max(c) for c in columns], color=color, alpha=0.2)
        ax.set(title=name, xlabel="step")
    axes.flat[0].legend(fontsize=8)
    fig.suptitle(f"{title}: mean over seeds, band = min..max across seeds")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _fmt_interval(iv, digits=3):
    mean, std, half = iv
    if std is None:
        return f"{mean:.{digits}f}"
    return f"{mean:.{digits}f} ± {std:.{digits}f} [{mean - half:.{digits}f}, {mean + half:.{digits}f}]"


def _markdown(out):
    """The report's tables as markdown: docs/evidence.md copies them verbatim."""
    lines = []

    def table(title, arms, paired, control):
        lines.extend([
            f"### {title}", "",
            "Held-out accuracy: mean ± std [95% t interval] over seeds. Paired difference: arm minus "
            f"`{control}`, same seed.", "",
            f"| arm | seeds | held-out before | held-out after | after − {control} (paired) |",
            "|---|---|---|---|---|",
        ])
        for arm, row in arms.items():
            diff = _fmt_interval(paired[arm]["diff"]) if arm in paired else "—"
            lines.append(f"| `{arm}` | {len(row['seeds'])} | {_fmt_interval(row['before'])} | "
                         f"{_fmt_interval(row['after'])} | {diff} |")
        lines.append("")

    def stability(arms, keys):
        lines.extend([
            "Per-step indicators: mean over all steps and seeds (min..max over steps and seeds).", "",
            "| arm | " + " | ".join(name for _, name in keys) + " |",
            "|---|" + "---|" * len(keys),
        ])
        for arm, row in arms.items():
            cells = []
            for key, _ in keys:
                v = row.get(key)
                fmt = ".6f" if key == "advantages/std" else ".3g"  # how close to 1 it stays is the point
                cells.append(f"{v['mean']:{fmt}} ({v['min']:{fmt}}..{v['max']:{fmt}})" if v else "—")
            lines.append(f"| `{arm}` | " + " | ".join(cells) + " |")
        lines.append("")

    def cost(arms, control):
        lines.extend([
            f"| arm | median s/step | s/step ÷ `{control}` (median over seeds, range) | peak RSS MiB |",
            "|---|---|---|---|",
        ])
        for arm, row in arms.items():
            r, rng = row["step_time_ratio_to_control"], row["step_time_ratio_range"]
            ratio = f"{r:.2f} ({rng[0]:.2f}..{rng[1]:.2f})" if r is not None else "—"
            lines.append(f"| `{arm}` | {row['median_step_seconds']:.1f} | {ratio} | {row['peak_rss_mib']:.0f} |")
        lines.append("")

    if out["arms"]:
        table("Equal-budget comparison", out["arms"], out["paired_vs_grpo"], "grpo")
        stability(out["arms"], [
            ("reward", "training reward"), ("advantages/std", "normalized-advantage std"),
            ("frac_reward_zero_std", "zero-variance groups"), ("grad_norm", "grad norm"),
            ("ref_kl/k1_mean", "k1 KL to ref"), ("kl_loss", "k2 KL loss"),
            ("completions/mean_length", "completion length"),
        ])
        cost(out["arms"], "grpo")
    mm = out["mismatch"]
    if mm["arms"]:
        table(f"Sampler mismatch (fixed logit bias, sigma = {mm['sigma']}; `rpp_baseline`: the same run, no bias)",
              mm["arms"], mm["paired_vs_none"],
              "mismatch_none")
        stability(mm["arms"], [
            ("reward", "training reward"), ("mismatch/abs_log_ratio_mean", "mean abs log p_old − log q"),
            ("mismatch/is_masked_fraction", "TIS masked sequences"), ("score_centering/coeff_l1", "SC coefficient L1"),
            ("entropy", "entropy"), ("kl_loss", "k2 KL loss"), ("grad_norm", "grad norm"),
            ("completions/mean_length", "completion length"),
        ])
        # Not the reference row: it ran in the other sweep, not back to back with these.
        cost({a: r for a, r in mm["arms"].items() if a in MISMATCH_ARMS}, "mismatch_none")
    return "\n".join(lines)


def report(opts):
    runs = _load_runs(opts, ARMS + MISMATCH_ARMS)
    arms, paired = _aggregate(runs, ARMS, opts.seeds, "grpo", ())
    # The main table's rpp_baseline is the same run without the bias: shown, on the same seeds, as the reference.
    mm_seeds = [s for s in opts.seeds if ("mismatch_none", s) in runs]
    mm_arms = ("rpp_baseline",) + MISMATCH_ARMS
    mismatch, mismatch_paired = _aggregate(
        runs, mm_arms, mm_seeds, "mismatch_none",
        ("mismatch/abs_log_ratio_mean", "mismatch/seq_log_ratio_mean", "mismatch/is_masked_fraction", "entropy",
         "score_centering/coeff_l1"),
    )
    out = dict(
        arms=arms, paired_vs_grpo=paired, mismatch=dict(sigma=opts.mismatch_sigma, arms=mismatch,
                                                      paired_vs_none=mismatch_paired),
    )
    with open(os.path.join(opts.out, "report.json"), "w") as f:
        json.dump(out, f, indent=2)
    with open(os.path.join(opts.out, "report.md"), "w") as f:
        f.write(_markdown(out))
    print(_markdown(out))
    if arms:
        _plot(runs, ARMS, opts.seeds, [
            ("reward", "training reward"), ("completions/mean_length", "completion length"),
            ("grad_norm", "gradient norm"), ("frac_reward_zero_std", "fraction of zero-variance groups"),
            ("advantages/std", "normalized-advantage std (RPP arms)"), ("ref_kl/k1_mean", "k1 KL to reference (rpp)"),
            ("kl_loss", "k2 KL loss to reference (rpp_baseline)"),
        ], os.path.join(opts.out, "curves.png"), "equal-budget comparison")
    if mismatch:
        _plot(runs, mm_arms, mm_seeds, [
            ("reward", "training reward"), ("mismatch/abs_log_ratio_mean", "mean |log p_old - log q| per token"),
            ("kl_loss", "k2 KL loss to reference"), ("grad_norm", "gradient norm"),
            ("completions/mean_length", "completion length"), ("mismatch/is_masked_fraction", "TIS: masked sequences"),
        ], os.path.join(opts.out, "mismatch_curves.png"), f"sampler = trainer + fixed logit bias (sigma={opts.mismatch_sigma})")


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
    ap.add_argument("--mismatch_sigma", type=float, default=1.0, help="std of the fixed logit bias (mismatch arms)")
    ap.add_argument("--tiny", action="store_true", help="tiny random-init model and the copy task (smoke runs)")
    ap.add_argument("--run", default=None, help="internal: run one arm in this process")
    ap.add_argument("--seed", type=int, default=None, help="internal: with --run")
    ap.add_argument("--report", action="store_true", help="only aggregate finished runs into figures and report.json")
    opts = ap.parse_args()
    opts.seeds = [int(s) for s in str(opts.seeds).split(",")]
    opts.arms = [a for a in opts.arms.split(",")]
    for name in opts.arms:
        if name not in ARMS + MISMATCH_ARMS:
            raise ValueError(f"--arms: unknown arm {name!r}; accepted: {', '.join(ARMS + MISMATCH_ARMS)}")
    opts.passthrough = [
        "--out", opts.out, "--steps", str(opts.steps), "--prompts", str(opts.prompts), "--generations",
        str(opts.generations), "--lr", str(opts.lr), "--heldout", str(opts.heldout), "--threads", str(opts.threads),
        "--mismatch_sigma", str(opts.mismatch_sigma),
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
