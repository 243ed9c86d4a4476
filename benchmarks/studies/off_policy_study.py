"""Off-policy study: does REINFORCE++-baseline still learn with one generation batch of staleness
(`RPPConfig.max_staleness=1`) through a real vLLM server, with and without TRL's importance sampling?

    python benchmarks/studies/off_policy_study.py                        # the main sweep (5 seeds x 3 arms), resumable
    python benchmarks/studies/off_policy_study.py --seeds 100 \
        --out benchmarks/results/off_policy_study/pilot                  # the pilot
    python benchmarks/studies/off_policy_study.py --seeds 0 --steps 2 --eval_every 1 --out /tmp/ops   # a smoke run
    python benchmarks/studies/off_policy_study.py --report               # report.md and report.json from the files

The hypotheses, the decision rule and the analysis were committed before any main run:
`benchmarks/results/off_policy_study/HYPOTHESES.md`.

Setting: study 4's task and scores (benchmarks/studies/mismatch_study.py): REINFORCE++-baseline without a KL loss (a
pure policy gradient), every weight of a tiny random-init 2-layer Llama (`trl_rpp.testing.tiny`, 46 ids) trained, on
the multi-position copy task with per-position credit (`copy_rows`, `copy_credit_reward`), temperature 1, no
truncation, one optimizer step per generation batch (`num_iterations=1`), float32. The model is built with hidden
size 128 and 2 heads of 64 (vLLM's CPU attention needs head size 64), not study 4's hidden 64 x 4 heads.

Generation runs on ONE real vLLM server on this machine's CPU, started by the sweep with docs/vllm.md's command
(`trl-rpp vllm-serve --model M --port P --weight_dir DIR`, as `python -m trl_rpp.serve`: dev mode, float32,
processed log-probs), shared by every run and stopped at the end; the trainer sends it its weights through that
directory (`vllm_server_weight_sync="disk"`). Runs are sequential (one server, one set of weights on it). Arms:

- `lag0`: `max_staleness=0`: sync, generate, train, in turn: every batch is sampled by the weights that train on it
  (sampler and trainer differ only by vLLM's and transformers' float32 numerics); TRL's token-level importance
  sampling `token_truncate`, cap 3;
- `lag1_tis`: `max_staleness=1`: batch t+1 is sampled on the server while batch t trains (`trl_rpp.engines.ahead`),
  so every trained batch but the first was sampled by the weights of one optimizer step earlier; TRL's
  `token_truncate` (cap 3) weights each token's loss by ``min(pi_old / mu, 3)``, pi_old the trainer's weights when it
  trains the batch, mu the stale sampler;
- `lag1_none`: `max_staleness=1`, `vllm_importance_sampling_correction=False`: the stale samples trained as if on
  policy.

Between runs the server carries no state that changes a result: each run's trainer syncs its own initial weights to
it before its first generation (`_last_loaded_step` starts at -1), and every sync drops the prefix cache. No
sampling seed is sent (`generation_kwargs` is not set): the server draws from its own generator, whose state carries
from run to run, so a run's samples are not reproducible bit for bit, but their distribution is the run's weights'.
Each run checks the first half of that: its first batch (on policy in every arm) has ``|log pi_old - log mu|`` at
float32 noise (`first_step`).

Logged per step (`series`): TRL's `sampling/importance_sampling_ratio/min|mean|max` (the truncated ratio the loss
applies) and `sampling/sampling_logp_difference/mean|max` (``|log pi_old - log mu|``), which TRL logs only with its
correction on (not in `lag1_none`); `sampling/staleness` (generation batches between the weights that sampled a batch
and those that train on it); and, in every arm, the study's own untruncated ratio statistics over the valid tokens
(`study/...`: mean of ``log pi_old - log mu`` and of its absolute value, min and max of the ratio, share above the
cap 3), from the batch's pi_old (`lag1_none`: one no-grad forward of the trainer, which TRL does not run there).

Scores (held-out prompts, exact, study 4's `copy_prob`): the teacher-forced probability of each answer character
under the trained model, averaged over positions and prompts, after training (`copy_prob_after`) and every
`--eval_every` steps (the area under that curve over the span of steps, `copy_prob_area`, primary); greedy
per-position credit after training. Seeds are not paired (the server's draws differ from run to run): Welch's
unpaired 95% interval and a two-sided permutation p (study 4's functions).

Every (arm, seed) runs in its own process and leaves `summary.json` (written last) in `<out>/<arm>/seed<k>/`; a
sweep started again skips those runs, and starts no server when none is left. `--report` keeps what it reads of every
run in `<out>/runs.parquet` (`run_table`) and reads that table where the runs' own files are absent, as in the
repository.
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import sys
import tempfile
import time

T0 = time.perf_counter()  # the process's start, near enough: a run's wall time counts its imports

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # mismatch_study, when imported from elsewhere

from study_common import (  # noqa: E402
    contrast_table, load_arm_runs, mean_ci, pending_runs, process_facts, run_curves, run_jobs, step_clock,
    study_main, write_report, write_summary,
)
from mismatch_study import (  # noqa: E402
    _round, add_copy_task_flags, copy_credit_reward, copy_prob, copy_task_data, curve_area, greedy_credit,
    IS_CLIP_MAX,
)

from trl_rpp.testing.vllm_server import free_port, server_command, start_server, stop_server  # noqa: E402

RESULTS = "benchmarks/results/off_policy_study"
# arm: (max_staleness, TRL's token-level importance-sampling mode or None: no correction)
ARMS = {"lag0": (0, "token_truncate"), "lag1_tis": (1, "token_truncate"), "lag1_none": (1, None)}
# The tiny model vLLM's CPU attention runs (head size 64), and the server's context (prompt <= 4, completion <= 3).
HIDDEN, HEADS, MAX_MODEL_LEN = 128, 2, 64
# Chosen from one-seed pilots of lag0 (HYPOTHESES.md): at study 4's 3e-3 the entropy collapsed within ~50 steps.
STEPS, LR, LENGTHS = 300, 1e-3, (1, 2, 3)
TRL_IS_KEYS = ("sampling/importance_sampling_ratio/min", "sampling/importance_sampling_ratio/mean",
               "sampling/importance_sampling_ratio/max", "sampling/sampling_logp_difference/mean",
               "sampling/sampling_logp_difference/max")
STUDY_IS_KEYS = ("study/log_ratio_mean", "study/log_ratio_abs_mean", "study/ratio_min", "study/ratio_max",
                 "study/ratio_over_cap_fraction")
SERIES_KEYS = ("reward", "sampling/staleness") + TRL_IS_KEYS + STUDY_IS_KEYS + ("entropy", "grad_norm",
                                                                                 "completions/mean_length")
# How a per-step statistic is summarized over a run's steps (from step 2 on: the first batch is on policy in every
# arm): its extreme for a min or a max, else its mean.
AGGREGATE = {k: (min if k.endswith("/min") or k.endswith("_min") else max if k.endswith("/max") or k.endswith("_max")
                 else "mean") for k in TRL_IS_KEYS + STUDY_IS_KEYS}
# The pre-registered contrasts (HYPOTHESES.md): (name, arm, control).
CONTRASTS = (("lag1_tis − lag0", "lag1_tis", "lag0"),
             ("lag1_none − lag0", "lag1_none", "lag0"),
             ("lag1_tis − lag1_none", "lag1_tis", "lag1_none"))
# The primary metric first.
METRICS = (("copy_prob_area", "area"), ("copy_prob_after", "final"), ("greedy_credit_after", "greedy credit, final"))
RUN_SETTINGS = ("steps", "prompts", "generations", "lr", "heldout", "eval_every", "lengths")


# ---------------------------------------------------------------------------------------------------------------
# The trainer: the study's own ratio statistics
# ---------------------------------------------------------------------------------------------------------------


def ratio_stats(old, q, mask, clip_max: float = IS_CLIP_MAX) -> dict:
    """The untruncated token-level ratio ``pi_old / mu`` over the valid tokens (`mask`, and a finite log mu):
    ``{study/log_ratio_mean, study/log_ratio_abs_mean, study/ratio_min, study/ratio_max,
    study/ratio_over_cap_fraction}``, from ``old = log pi_old`` and ``q = log mu``, both ``[B, T]``. Empty: {}."""
    import torch

    valid = mask.bool() & torch.isfinite(q)
    d = (old - q)[valid].double()
    if d.numel() == 0:
        return {}
    return {"study/log_ratio_mean": d.mean().item(), "study/log_ratio_abs_mean": d.abs().mean().item(),
            "study/ratio_min": d.min().exp().item(), "study/ratio_max": d.max().exp().item(),
            "study/ratio_over_cap_fraction": (d > math.log(clip_max)).double().mean().item()}


def ratio_logged(base):
    """`base` (RPPTrainer) that logs `ratio_stats` of every generation batch, from the batch's pi_old (TRL's, when
    its correction computed one) or one no-grad forward of the trainer (otherwise: `lag1_none`)."""
    import torch

    class RatioLogged(base):
        def _generate_and_score_completions(self, inputs):
            batch = super()._generate_and_score_completions(inputs)
            old = batch.get("old_per_token_logps")
            if old is None:
                with torch.no_grad():
                    old, _, _ = self._forward_logps(self.model, batch, batch_size=self.args.per_device_train_batch_size)
            q = batch.get("sampling_per_token_logps")
            if q is None:
                raise RuntimeError("off_policy_study: the server returned no log-probs (sampling_per_token_logps)")
            m = self._metrics["train" if self.model.training else "eval"]
            for key, value in ratio_stats(old, q, batch["completion_mask"]).items():
                m[key].append(value)
            return batch

    RatioLogged.__name__ = f"RatioLogged{base.__name__}"
    return RatioLogged


def aggregate(series: dict, key: str, first: int = 1):
    """`key`'s per-step values from step ``first + 1`` on (None skipped), summarized by `AGGREGATE`; None if none."""
    values = [v for v in series.get(key, [])[first:] if v is not None]
    if not values:
        return None
    how = AGGREGATE.get(key, "mean")
    return sum(values) / len(values) if how == "mean" else how(values)


# ---------------------------------------------------------------------------------------------------------------
# One run
# ---------------------------------------------------------------------------------------------------------------


def run_one(arm: str, seed: int, opts):
    """Train one (arm, seed) in this process against the server at `opts.server_url`; write
    `<out>/<arm>/seed<k>/summary.json`."""
    import torch
    from datasets import Dataset
    from transformers import AutoTokenizer

    from trl_rpp import RPPConfig, RPPTrainer

    os.environ.setdefault("WANDB_MODE", "disabled")
    torch.set_num_threads(opts.threads)
    if not opts.server_url or not opts.weight_dir:
        raise ValueError("--run needs --server_url and --weight_dir (the sweep starts the server and passes them)")
    lag, mode = ARMS[arm]
    outdir = os.path.join(opts.out, arm, f"seed{seed}")
    os.makedirs(outdir, exist_ok=True)
    path = model_path(opts.out)  # built by `sweep` before the server starts
    tokenizer = AutoTokenizer.from_pretrained(path)
    train, heldout, max_new = copy_task_data(opts, seed)
    args = RPPConfig(
        output_dir=outdir, use_cpu=True, bf16=False, report_to="none", save_strategy="no", seed=seed,
        per_device_train_batch_size=opts.prompts * opts.generations, num_generations=opts.generations,
        max_completion_length=max_new, learning_rate=opts.lr, max_steps=opts.steps, logging_steps=1,
        temperature=1.0, disable_dropout=True, advantage_estimator="reinforce_plus_plus_baseline", use_kl_loss=False,
        use_vllm=True, vllm_mode="server", vllm_server_base_url=opts.server_url, vllm_server_weight_sync="disk",
        vllm_server_weight_dir=opts.weight_dir, max_staleness=lag,
        vllm_importance_sampling_correction=mode is not None,
        vllm_importance_sampling_mode=mode or "token_truncate",  # not read without the correction
        vllm_importance_sampling_clip_max=IS_CLIP_MAX,
    )

    def evaluate():
        return dict(copy_prob=copy_prob(trainer.accelerator.unwrap_model(trainer.model_wrapped), tokenizer, heldout))

    clock = step_clock(lambda step: evaluate(), opts.eval_every)
    trainer = ratio_logged(RPPTrainer)(
        model=path, reward_funcs=copy_credit_reward, args=args, train_dataset=Dataset.from_list(train),
        processing_class=tokenizer, callbacks=[clock])
    before = evaluate()
    trained = time.perf_counter()
    trainer.train()
    train_seconds = time.perf_counter() - trained
    model = trainer.accelerator.unwrap_model(trainer.model_wrapped)
    after = evaluate()
    after["greedy_credit"] = greedy_credit(model, tokenizer, heldout, max_new)
    curves = run_curves(before, clock.curve, after, opts.steps)
    history = [h for h in trainer.state.log_history if "reward" in h]
    series = {k: [h.get(k) for h in history] for k in SERIES_KEYS if any(k in h for h in history)}
    summary = dict(
        arm=arm, seed=seed, max_staleness=lag, correction=mode,
        **{f"{k}_before": v for k, v in before.items()}, **{f"{k}_after": v for k, v in after.items()},
        **{f"{k}_area": curve_area(c) for k, c in curves.items()},
        # Over steps 2.. (the first batch is on policy in every arm): the logged ratio statistics, and the staleness.
        is_stats={k: aggregate(series, k) for k in TRL_IS_KEYS + STUDY_IS_KEYS if k in series},
        staleness_mean=aggregate(series, "sampling/staleness", first=0),
        # The first batch, on policy in every arm: its |log pi_old - log mu| is float32 noise when the server held
        # this run's initial weights.
        first_step={k: series[k][0] for k in ("study/log_ratio_abs_mean", "study/ratio_min", "study/ratio_max",
                                              "sampling/staleness") if k in series},
        curves={k: [[s, _round(y)] for s, y in c] for k, c in curves.items()},
        series={k: [_round(v) for v in vs] for k, vs in series.items()},
        step_seconds=[_round(t) for t in clock.times], **process_facts(opts.threads),
        train_seconds=train_seconds, wall_seconds=time.perf_counter() - T0,
        settings={k: getattr(opts, k) for k in RUN_SETTINGS},
    )
    return write_summary(outdir, summary)


# ---------------------------------------------------------------------------------------------------------------
# The server, the sweep
# ---------------------------------------------------------------------------------------------------------------


def model_path(out):
    return os.path.join(out, "tiny-model")


def sweep(opts):
    """Every (arm, seed) without a summary.json (`pending_runs`), one at a time against one server started here (and
    stopped at the end). The server's log and weight directory lie in a temporary directory, removed after a sweep
    without failure (kept, and named, after one that failed)."""
    from trl_rpp.testing.tiny import build_tiny_model

    build_tiny_model(model_path(opts.out), hidden_size=HIDDEN, num_heads=HEADS)
    port = free_port()
    work = tempfile.mkdtemp(prefix="off_policy_study-")
    opts.server_url, opts.weight_dir = f"http://127.0.0.1:{port}", os.path.join(work, "weights")
    todo = pending_runs(__file__, opts, RUN_SETTINGS, extra=("server_url", "weight_dir"))
    if not todo:
        shutil.rmtree(work)
        return
    log = open(os.path.join(work, "server.log"), "w")
    server, ok, began = None, False, time.perf_counter()
    try:
        cmd = server_command(os.path.abspath(model_path(opts.out)), port, max_model_len=MAX_MODEL_LEN,
                             weight_dir=opts.weight_dir)
        print(f"[sweep] starting the server: {' '.join(cmd)} (log: {log.name})", flush=True)
        server = start_server(cmd, opts.server_url, log,
                              env=dict(os.environ, VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1"))
        print(f"[sweep] the server is up after {time.perf_counter() - began:.0f} s", flush=True)
        run_jobs(todo, 1)
        ok = True
        print(f"[sweep] {len(todo)} runs done in {time.perf_counter() - began:.0f} s, the server's start included",
              flush=True)
    finally:
        if server is not None:
            stop_server(server)
        log.close()
        if ok:
            shutil.rmtree(work, ignore_errors=True)
        else:
            print(f"[sweep] failed; the server's log: {log.name}", flush=True)


# ---------------------------------------------------------------------------------------------------------------
# The report
# ---------------------------------------------------------------------------------------------------------------


# What the report reads of each run's summary.json, kept in the study's table (`run_table`).
KEPT = ("arm", "seed", *(k for k, _ in METRICS), "is_stats", "staleness_mean", "first_step", "cpu_seconds",
        "wall_seconds")
# The ratio statistics' rows of the report: (key, what it is).
IS_ROWS = (("sampling/staleness", "staleness, generation batches (mean over all steps)"),
           ("study/log_ratio_abs_mean", "study: mean abs(log pi_old − log mu)"),
           ("study/log_ratio_mean", "study: mean (log pi_old − log mu)"),
           ("study/ratio_min", "study: min pi_old / mu"),
           ("study/ratio_max", "study: max pi_old / mu"),
           ("study/ratio_over_cap_fraction", "study: share of tokens with pi_old / mu > 3"),
           ("sampling/importance_sampling_ratio/min", "TRL: importance_sampling_ratio/min (truncated)"),
           ("sampling/importance_sampling_ratio/mean", "TRL: importance_sampling_ratio/mean (truncated)"),
           ("sampling/importance_sampling_ratio/max", "TRL: importance_sampling_ratio/max (truncated)"),
           ("sampling/sampling_logp_difference/mean", "TRL: sampling_logp_difference/mean"),
           ("sampling/sampling_logp_difference/max", "TRL: sampling_logp_difference/max"))


def _stat_of(run, key):
    return run.get("staleness_mean") if key == "sampling/staleness" else run.get("is_stats", {}).get(key)


def _fmt_stat(values):
    """Mean over runs, and the range over runs; — when no run logged it."""
    if not values:
        return "—"
    m = sum(values) / len(values)
    return f"{m:.3g} ({min(values):.3g} to {max(values):.3g})"


def report(opts):
    """`<out>/report.md` and `report.json`: per arm, each metric's mean [95% t] and the ratio statistics; per
    pre-registered contrast, Welch's unpaired 95% interval and a permutation p."""
    runs = load_arm_runs(opts.out, KEPT, ARMS)
    rows = {}
    lines = ["### Off-policy study: one generation batch of staleness through a vLLM server", "",
             "Held-out copy probability (teacher-forced, per position, exact) of the trained model, mean [95% t "
             "interval] over seeds; contrasts: unpaired difference of means, Welch 95% interval, two-sided "
             "permutation p. Hypotheses: HYPOTHESES.md.", "",
             "| arm | seeds | " + " | ".join(name for _, name in METRICS) + " | first batch: max abs log ratio "
             "| s/run (wall) |", "|---|---|" + "---|" * (len(METRICS) + 2)]
    for arm in ARMS:
        if arm not in runs:
            continue
        rs = runs[arm]
        rows[arm] = dict(seeds=[r["seed"] for r in rs], **{k: [r[k] for r in rs] for k, _ in METRICS},
                         is_stats={key: [v for v in (_stat_of(r, key) for r in rs) if v is not None]
                                   for key, _ in IS_ROWS},
                         first_step_log_ratio_abs_max=max(r["first_step"].get("study/log_ratio_abs_mean", math.nan)
                                                          for r in rs),
                         cpu_seconds=sum(r["cpu_seconds"] for r in rs) / len(rs),
                         wall_seconds=sum(r["wall_seconds"] for r in rs) / len(rs))
        lines.append(f"| `{arm}` | {len(rs)} | " + " | ".join(mean_ci(rows[arm][k]) for k, _ in METRICS)
                     + f" | {rows[arm]['first_step_log_ratio_abs_max']:.2g} | {rows[arm]['wall_seconds']:.0f} |")
    contrasts = contrast_table(lines, rows, CONTRASTS, METRICS)
    arms = [a for a in ARMS if a in rows]
    lines += ["", "Ratio statistics, per run over steps 2 to the last (the first batch is on policy in every arm): "
              "a mean statistic averaged over the steps, a min or max the extreme over the steps; each cell the mean "
              "over runs (the range over runs). TRL logs its statistics only with its correction on.", "",
              "| statistic | " + " | ".join(f"`{a}`" for a in arms) + " |", "|---|" + "---|" * len(arms)]
    for key, what in IS_ROWS:
        lines.append(f"| {what} | " + " | ".join(_fmt_stat(rows[a]["is_stats"][key]) for a in arms) + " |")
    lines.append("")
    return write_report(opts.out, lines, dict(arms=rows, contrasts=contrasts))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=RESULTS)
    ap.add_argument("--arms", default=",".join(ARMS), help=f"accepted: {', '.join(ARMS)}")
    ap.add_argument("--seeds", default=",".join(map(str, range(5))))
    add_copy_task_flags(ap, STEPS, LR, LENGTHS)
    ap.add_argument("--threads", type=int, default=1, help="the trainer's torch threads (the server has its own)")
    ap.add_argument("--server_url", default=None, help="internal (--run): the server the sweep started")
    ap.add_argument("--weight_dir", default=None, help="internal (--run): the server's weight directory")
    study_main(ap, ARMS, run_one, sweep, report)


if __name__ == "__main__":
    main()
