"""Study 5: what replaying a truncating sampler's kept set recovers (issue #35; docs/sampling.md).

    python benchmarks/studies/truncation_study.py --jobs 2 --threads 1   # the main sweep (20 seeds x 6 arms), resumable
    python benchmarks/studies/truncation_study.py --seeds 100,101 \
        --out benchmarks/results/truncation_study/pilot                 # a pilot
    python benchmarks/studies/truncation_study.py --report               # report.md and report.json from the files

The hypotheses, the decision rule and the analysis were committed before any main run:
`benchmarks/results/truncation_study/HYPOTHESES.md`.

Setting: study 4's (benchmarks/studies/mismatch_study.py): REINFORCE++-baseline without a KL loss (a pure policy
gradient) on the tiny random-init model of `trl_rpp.testing.tiny`, every weight trained, on the multi-position copy
task with per-position credit (`copy_rows`, `copy_credit_reward`). Here the sampler *is* the trainer, on policy (one
optimizer step per generation batch), truncated by `top_k` (transformers' `generate`, temperature 1): each token is
drawn from ``q_S = q / q(S)`` over the kept set ``S``. The only thing that differs between arms is how the trainer
reads that sampler:

- `replay_sampler_support=True` (the `replay*` arms, the library's default): every log-prob of a sampled token is
  ``log pi(y | S)``, so TRL's importance-sampling ratio ``pi_old(y | S) / q_S(y)`` is 1 on policy;
- `replay_sampler_support=False` (the `full*` arms, GRPO's behaviour): full-vocabulary log-probs, so that ratio is
  the kept mass ``q(S)``, and the policy gradient carries ``-A grad log pi(S)`` besides.

and which of TRL's token-level importance-sampling corrections the loss applies (TRL applies them only with vLLM;
here the same formula on the transformers path, ``log q_S`` of each sampled token recorded during `generate`, by
`mismatch_study.sampled_trainer`):

- `full`, `replay`: none;
- `full_tis`, `replay_tis`: ``token_truncate``, each token's loss weighted by ``min(ratio, 3)`` (TRL's default
  clip_max);
- `full_mask`, `replay_mask`: ``token_mask`` with ``[clip_min, clip_max] = [0.5, 3]`` (IcePop's lower bound): a
  token whose ratio is outside gets weight 0.

Every arm logs, per step, the weights it applied and the trainer's kept mass ``pi_old(S)`` over the valid tokens
(one no-grad forward, run by every arm so that step times compare): `truncation/is_weight_mean`,
`truncation/is_weight_max_abs_dev` (``max |w - 1|``), `truncation/weight_minus_kept_mass_max`
(``max |w - pi_old(S)|``), `truncation/kept_mass_mean`, `truncation/is_masked_fraction`.

Scores (held-out prompts, exact, study 4's `copy_prob`): the teacher-forced probability of each answer character
under the truncated sampler (``q_S``, 0 outside the top-k; primary) and under the full softmax, after training and
every `--eval_every` steps (the area under that curve); greedy per-position credit at the end (greedy decoding is
the same with or without truncation). Seeds are not paired (runs that share a seed diverge within a few steps):
Welch's unpaired 95% interval and a two-sided permutation p (study 4's functions).

Every (arm, seed) runs in its own process and leaves `summary.json` (written last) in `<out>/<arm>/seed<k>/`; a
sweep started again skips those runs. `--report` keeps what it reads of every run in `<out>/runs.parquet`
(`run_table`) and reads that table where the runs' own files are absent, as in the repository.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # mismatch_study, when imported from elsewhere

from study_common import (  # noqa: E402
    contrast_table, load_arm_runs, mean_ci, pending_runs, process_facts, run_curves, run_jobs, step_clock,
    study_main, write_report, write_summary,
)
from mismatch_study import (  # noqa: E402
    _round, add_copy_task_flags, copy_credit_reward, copy_prob, copy_task_data, curve_area, greedy_credit,
    sampled_trainer,
)

RESULTS = "benchmarks/results/truncation_study"
# arm: (replay_sampler_support, TRL's token-level mode or None)
ARMS = {
    "full": (False, None), "replay": (True, None),
    "full_tis": (False, "token_truncate"), "replay_tis": (True, "token_truncate"),
    "full_mask": (False, "token_mask"), "replay_mask": (True, "token_mask"),
}
CLIP_MIN, CLIP_MAX = 0.5, 3.0  # token_mask's bounds (IcePop's lower one, TRL's default upper one); truncate: max only
# Chosen before the main runs (HYPOTHESES.md; the pilot under results/truncation_study/pilot only timed them).
STEPS, LR, TOP_K, LENGTHS = 300, 3e-3, 6, (1, 2, 3)
SERIES_KEYS = ("reward", "truncation/is_weight_mean", "truncation/kept_mass_mean", "truncation/is_masked_fraction",
               "entropy", "grad_norm")
# The pre-registered contrasts (HYPOTHESES.md): (name, arm, control).
CONTRASTS = (("H1: replay_tis − full_tis", "replay_tis", "full_tis"),
             ("H2: replay_mask − full_mask", "replay_mask", "full_mask"),
             ("H3: replay − full", "replay", "full"),
             ("check: replay_tis − replay", "replay_tis", "replay"))
# The primary metric first.
METRICS = (("sampler_copy_prob_area", "area, sampler"), ("sampler_copy_prob_after", "final, sampler"),
           ("copy_prob_area", "area, full softmax"), ("copy_prob_after", "final, full softmax"),
           ("greedy_credit_after", "greedy credit, final"))
RUN_SETTINGS = ("steps", "prompts", "generations", "lr", "top_k", "heldout", "eval_every", "lengths")


def is_correction(mode, clip_min=CLIP_MIN, clip_max=CLIP_MAX):
    """A `correct` for `sampled_trainer`: TRL's token-level vLLM importance-sampling weight (`GRPOTrainer`'s formula),
    ``min(ratio, clip_max)`` (``token_truncate``) or ``ratio`` zeroed outside ``[clip_min, clip_max]``
    (``token_mask``), ``ratio = exp(log pi_old - log q_S)``; mode None applies none (weights 1). Either way it logs
    what was applied beside the trainer's kept mass (`KeptMass`), so each arm's smoke test can check it."""
    import torch

    def correct(batch, old, diff, mask, metrics):
        ratio = torch.exp(diff)  # [B, T]; 1 at padding (diff is 0 there)
        if mode == "token_truncate":
            weight = ratio.clamp(max=clip_max)
        elif mode == "token_mask":
            weight = ratio.masked_fill((ratio < clip_min) | (ratio > clip_max), 0.0)
        else:
            weight = torch.ones_like(ratio)
        if mode is not None:
            batch["old_per_token_logps"] = old
            batch["importance_sampling_ratio"] = weight
        valid = max(mask.sum().item(), 1)
        metrics["truncation/is_weight_mean"].append((weight * mask).sum().item() / valid)
        metrics["truncation/is_weight_max_abs_dev"].append(((weight - 1).abs() * mask).max().item())
        metrics["truncation/is_masked_fraction"].append(((weight == 0) & mask).sum().item() / valid)
        batch["_applied_weight"] = weight  # read by KeptMass, then dropped

    return correct


def with_kept_mass(base):
    """`base` (a `sampled_trainer` class) that logs the trainer's kept mass ``pi_old(S_t)`` of each valid token, from
    one no-grad full-vocabulary forward over the sampler's kept sets (the replay's own record, or the sampled-token
    capture of `sampled_trainer`), and ``max |w - pi_old(S_t)|`` of the weights the correction applied. Without
    replay, on policy, TRL's ratio is that mass: the check of `full_tis`."""
    import torch

    from trl_rpp.truncation import ABSENT, support_of

    class KeptMass(base):
        def _generate_and_score_completions(self, inputs):
            batch = super()._generate_and_score_completions(inputs)
            weight = batch.pop("_applied_weight")
            mask = batch["completion_mask"].bool()
            T = batch["completion_ids"].size(1)
            if "sampler_support_ids" in batch:
                support = batch["sampler_support_ids"]
            else:
                ids, logps, _ = self._q_capture.tensors(T)
                support = support_of(ids, logps).to(mask.device)
            input_ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
            attention = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
            with torch.no_grad():
                logits = self.model(input_ids=input_ids, attention_mask=attention, logits_to_keep=T + 1).logits
                logits = logits[:, :-1].float() / self.temperature
                logp = torch.log_softmax(logits, -1).gather(-1, support.clamp(min=0))
                mass = logp.masked_fill(support == ABSENT, float("-inf")).logsumexp(-1).exp()
            m = self._metrics["train" if self.model.training else "eval"]
            m["truncation/kept_mass_mean"].append((mass * mask).sum().item() / max(mask.sum().item(), 1))
            m["truncation/weight_minus_kept_mass_max"].append(((weight - mass).abs() * mask).max().item())
            return batch

    KeptMass.__name__ = f"KeptMass{base.__name__}"
    return KeptMass


def on_policy(model, step):
    """`sampled_trainer`'s sampler here: the trainer itself generates, so that the only gap between sampler and
    trainer is the truncation."""
    import contextlib

    return contextlib.nullcontext()


def truncation_trainer(base, arm):
    """`base` (RPPTrainer) sampling from itself, with `arm`'s correction and the kept-mass log."""
    return with_kept_mass(sampled_trainer(base, on_policy, correct=is_correction(ARMS[arm][1]),
                                          name=f"Truncation{arm}Trainer"))


# ---------------------------------------------------------------------------------------------------------------
# One run, the sweep
# ---------------------------------------------------------------------------------------------------------------


def run_one(arm: str, seed: int, opts):
    """Train one (arm, seed) in this process; write `<out>/<arm>/seed<k>/summary.json`."""
    import torch
    from datasets import Dataset
    from transformers import AutoTokenizer

    from trl_rpp import RPPConfig, RPPTrainer
    from trl_rpp.testing.tiny import build_tiny_model

    os.environ.setdefault("WANDB_MODE", "disabled")
    torch.set_num_threads(opts.threads)
    replay, _ = ARMS[arm]
    outdir = os.path.join(opts.out, arm, f"seed{seed}")
    os.makedirs(outdir, exist_ok=True)
    path = build_tiny_model(os.path.join(opts.out, "tiny-model"))  # built by `sweep` before its jobs start
    tokenizer = AutoTokenizer.from_pretrained(path)
    train, heldout, max_new = copy_task_data(opts, seed)
    args = RPPConfig(
        output_dir=outdir, use_cpu=True, bf16=False, report_to="none", save_strategy="no", seed=seed,
        per_device_train_batch_size=opts.prompts * opts.generations, num_generations=opts.generations,
        max_completion_length=max_new, learning_rate=opts.lr, max_steps=opts.steps, logging_steps=1,
        temperature=1.0, top_k=opts.top_k, replay_sampler_support=replay, disable_dropout=True,
        advantage_estimator="reinforce_plus_plus_baseline", use_kl_loss=False,
    )

    def evaluate(model):
        return dict(copy_prob=copy_prob(model, tokenizer, heldout),
                    sampler_copy_prob=copy_prob(model, tokenizer, heldout, top_k=opts.top_k))

    clock = step_clock(lambda step: evaluate(trainer.accelerator.unwrap_model(trainer.model_wrapped)), opts.eval_every)
    trainer = truncation_trainer(RPPTrainer, arm)(
        model=path, reward_funcs=copy_credit_reward, args=args, train_dataset=Dataset.from_list(train),
        processing_class=tokenizer, callbacks=[clock])
    before = evaluate(trainer.accelerator.unwrap_model(trainer.model_wrapped))
    trainer.train()
    model = trainer.accelerator.unwrap_model(trainer.model_wrapped)
    after = evaluate(model)
    after["greedy_credit"] = greedy_credit(model, tokenizer, heldout, max_new)
    curves = run_curves(before, clock.curve, after, opts.steps)
    history = [h for h in trainer.state.log_history if "reward" in h]
    first = history[0] if history else {}
    summary = dict(
        arm=arm, seed=seed, replay_sampler_support=replay, correction=ARMS[arm][1],
        **{f"{k}_before": v for k, v in before.items()}, **{f"{k}_after": v for k, v in after.items()},
        **{f"{k}_area": curve_area(c) for k, c in curves.items()},
        # The first, on-policy step's applied weights and kept mass: what each arm's smoke test checks.
        first_step={k: first.get(k) for k in ("truncation/is_weight_mean", "truncation/is_weight_max_abs_dev",
                                              "truncation/weight_minus_kept_mass_max", "truncation/kept_mass_mean",
                                              "truncation/is_masked_fraction")},
        curves={k: [[s, _round(y)] for s, y in c] for k, c in curves.items()},
        series={k: [_round(h.get(k)) for h in history] for k in SERIES_KEYS if any(k in h for h in history)},
        step_seconds=[_round(t) for t in clock.times], **process_facts(opts.threads),
        settings={k: getattr(opts, k) for k in RUN_SETTINGS},
    )
    return write_summary(outdir, summary)


def sweep(opts):
    """Every (arm, seed) without a summary.json (`pending_runs`), `--jobs` at a time."""
    from trl_rpp.testing.tiny import build_tiny_model

    build_tiny_model(os.path.join(opts.out, "tiny-model"))  # once, before parallel runs would race to build it
    todo = pending_runs(__file__, opts, RUN_SETTINGS)
    run_jobs(todo, opts.jobs)


# ---------------------------------------------------------------------------------------------------------------
# The report
# ---------------------------------------------------------------------------------------------------------------


# What the report reads of each run's summary.json, kept in the study's table (`run_table`).
KEPT = ("arm", "seed", *(k for k, _ in METRICS), "first_step", "cpu_seconds", "step_seconds")


def report(opts):
    """`<out>/report.md` and `report.json`: per arm, each metric's mean [95% t]; per pre-registered contrast, Welch's
    unpaired 95% interval and a permutation p."""
    runs = load_arm_runs(opts.out, KEPT, ARMS)
    rows = {}
    lines = ["### Study 5: replay of a truncating sampler's kept set", "",
             "Held-out copy probability (teacher-forced, per position, exact), mean [95% t interval] over seeds; "
             "contrasts: unpaired difference of means, Welch 95% interval, two-sided permutation p. Hypotheses: "
             "HYPOTHESES.md.", "",
             "| arm | seeds | " + " | ".join(name for _, name in METRICS) + " | kept mass, step 1 | IS weight, step 1 | s/run |",
             "|---|---|" + "---|" * (len(METRICS) + 3)]
    for arm in ARMS:
        if arm not in runs:
            continue
        rs = runs[arm]
        firsts = [r["first_step"] for r in rs]
        rows[arm] = dict(seeds=[r["seed"] for r in rs], **{k: [r[k] for r in rs] for k, _ in METRICS},
                         kept_mass_step1=sum(f["truncation/kept_mass_mean"] for f in firsts) / len(firsts),
                         is_weight_step1=sum(f["truncation/is_weight_mean"] for f in firsts) / len(firsts),
                         cpu_seconds=sum(r["cpu_seconds"] for r in rs) / len(rs),
                         wall_step_seconds=sum(sum(r["step_seconds"]) for r in rs) / len(rs))
        lines.append(f"| `{arm}` | {len(rs)} | " + " | ".join(mean_ci(rows[arm][k]) for k, _ in METRICS)
                     + f" | {rows[arm]['kept_mass_step1']:.3f} | {rows[arm]['is_weight_step1']:.3f}"
                     + f" | {rows[arm]['cpu_seconds']:.0f} |")
    contrasts = contrast_table(lines, rows, CONTRASTS, METRICS)
    lines.append("")
    return write_report(opts.out, lines, dict(arms=rows, contrasts=contrasts))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=RESULTS)
    ap.add_argument("--arms", default=",".join(ARMS), help=f"accepted: {', '.join(ARMS)}")
    ap.add_argument("--seeds", default=",".join(map(str, range(20))))
    add_copy_task_flags(ap, STEPS, LR, LENGTHS)
    ap.add_argument("--top_k", type=int, default=TOP_K)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--jobs", type=int, default=1)
    study_main(ap, ARMS, run_one, sweep, report)


if __name__ == "__main__":
    main()
