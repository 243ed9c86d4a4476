"""Equal-budget comparison: REINFORCE++, REINFORCE++-baseline and trl.GRPOTrainer (docs/evidence.md).

    python benchmarks/studies/compare_estimators.py                       # 5 seeds x 4 arms, resumable
    python benchmarks/studies/compare_estimators.py --seeds 0 --steps 2 --tiny --out /tmp/cmp   # smoke run
    python benchmarks/studies/compare_estimators.py --study noise --tiny  # study 1 (and 3) on the tiny model
    python benchmarks/studies/compare_estimators.py --study drift         # study 2: sampler drift, tiny model
    python benchmarks/studies/compare_estimators.py --report              # every table and figure from the results

Arms (same prompts per step, generations per prompt, steps, learning rate, adapter and seeds):

- `rpp`: `RPPTrainer`, `advantage_estimator="reinforce_plus_plus"` (its recipe: k1 in the reward, kl_coef 0.01);
- `rpp_baseline`: `RPPTrainer`, `"reinforce_plus_plus_baseline"` (its recipe: k2 loss, kl_loss_coef 0.01);
- `grpo`: `trl.GRPOTrainer` with its defaults (loss_type "dapo", scale_rewards "group", beta 0);
- `grpo_noscale`, `grpo_batch`: the same with `scale_rewards="none"` or `"batch"`.

Sampler-mismatch arms (`mismatch_none,mismatch_tis,mismatch_sc,mismatch_both`): REINFORCE++-baseline with a sampler
that adds a fixed `N(0, sigma^2)` bias to every logit, uncorrected, with TRL's importance-sampling correction, with
score centering, or with both (see `mismatch_trainer`).

Studies (`--study`), each a grid of conditions, each condition a directory of `<arm>/seed<k>` runs:

- `noise` (study 1, and study 3's out-of-distribution scores): the correctness reward plus i.i.d. `N(0, sigma^2)`
  noise (`sigma0`, `sigma0.1`, `sigma0.3`) or plus a 0.1 format bonus (`format0.1`); held-out accuracy is always
  scored on the correctness reward alone. Logged per step: the share of the advantage mass on groups whose
  correctness rewards are all equal (`reward_noise/tied_group_adv_share`).
- `drift` (study 2): the tiny model, full fine-tuning, hundreds of steps, the mismatch arms at each `--bias_sigmas`
  (`bias<sigma>`; `bias0` is the run without a bias).

Every (arm, seed) runs in its own process, so each has its own peak RSS, and the sweep visits the arms in turn
for each seed so that machine load hits them alike (`--jobs 2` runs two at once, each on `--threads` threads). A
run that finished left `summary.json` in its directory and is skipped when the sweep is started again, so a long
sweep can run in pieces. Raw per-step metrics (the trainer's log history) are in `metrics.jsonl` next to it.
`--report` writes the 16-step tables' `report.json`/`report.md` and the studies' `studies.json`/`studies.md` that
docs/evidence.md is written from, and `<out>/runs.parquet`, what they read of every run (`run_table`): where the runs'
own files are absent, as in the repository, the report reads that table. The figures (`evidence_*.png`) go to
`--figures` only: docs/figures, where docs/evidence.md links them, for the default `--out`; else `<out>/figures`.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # run_table, study_common, when imported elsewhere
import run_table  # noqa: E402
from study_common import process_facts, run_jobs, step_clock, t_quantile, welch_interval, write_summary  # noqa: E402

ARMS = ("rpp", "rpp_baseline", "grpo", "grpo_noscale")
# Second table: REINFORCE++-baseline under an induced sampler mismatch, with each correction (see `mismatch_trainer`).
MISMATCH_ARMS = ("mismatch_none", "mismatch_tis", "mismatch_sc")
DRIFT_ARMS = MISMATCH_ARMS + ("mismatch_both",)
NOISE_ARMS = ("rpp_baseline", "rpp", "grpo", "grpo_batch")
ALL_ARMS = ARMS + ("grpo_batch",) + DRIFT_ARMS
# Study 1: what is added to the correctness reward in each condition (held-out accuracy never sees it).
NOISE_CONDITIONS = {
    "sigma0": dict(reward_noise=0.0, format_bonus=0.0),
    "sigma0.1": dict(reward_noise=0.1, format_bonus=0.0),
    "sigma0.3": dict(reward_noise=0.3, format_bonus=0.0),
    "format0.1": dict(reward_noise=0.0, format_bonus=0.1),
}
HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))  # the repository: benchmarks/studies/ is two below it
# Chosen from the pilot runs of docs/evidence.md (study 1 on the tiny model; study 2's bias sweep).
STUDY1_TINY_STEPS, STUDY1_TINY_LR = 150, 3e-3
STUDY2_STEPS, STUDY2_LR, STUDY2_SIGMA = 300, 3e-3, 2.0
RESULTS = "benchmarks/results/compare_estimators"


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
    - ``"sc"``: score centering (``score_centering=True`` in the config);
    - ``"both"``: score centering and TRL's token-level correction, ``token_truncate`` with clip_max 3.0 (score
      centering rejects the sequence-level modes: one weight per response has no per-token form to center), with
      the correction's coefficients reweighted as with vLLM (docs/score_centering.md).

    The capture of q and the mismatch metrics are study 4's (`mismatch_study.sampled_trainer`).
    """
    import torch
    from transformers import LogitsProcessor

    from mismatch_study import fixed_bias, sampled_trainer, token_truncate, token_truncate_weight_fn
    from trl_rpp.patches import generate_with_processor

    class AddFixedBias(LogitsProcessor):
        def __init__(self):
            self.bias = None

        def __call__(self, input_ids, scores):
            if self.bias is None:
                self.bias = fixed_bias(scores.size(-1), sigma, bias_seed).to(scores.device, scores.dtype)
            return scores + self.bias

    add_bias = AddFixedBias()
    truncate = token_truncate(3.0)

    def correct(batch, old, diff, mask, metrics):
        metrics["mismatch/seq_log_ratio_mean"].append(diff.sum(-1).mean().item())
        if correction == "tis":
            ratio = torch.exp(diff.sum(-1, keepdim=True))  # [B, 1], TRL's sequence-level ratio
            ratio = torch.where(ratio > 3.0, torch.zeros_like(ratio), ratio)  # sequence_mask, clip_max 3.0
            batch["old_per_token_logps"] = old
            batch["importance_sampling_ratio"] = ratio
            metrics["mismatch/is_masked_fraction"].append((ratio == 0).float().mean().item())
        elif correction == "both":
            truncate(batch, old, diff, mask, metrics)

    return sampled_trainer(
        base, lambda model, step: generate_with_processor(model, add_bias, first=True), correct=correct,
        weight_fn=token_truncate_weight_fn(3.0) if correction == "both" else None,
        name=f"MismatchedSampler{correction.upper()}Trainer",
    )


def perturbed_reward(correctness, format_ok, noise, bonus, seed, stash):
    """The training reward of study 1: ``correctness + bonus * format_ok + N(0, noise^2)`` per completion.

    The noise is drawn from its own generator (seeded per run, so the arms of one seed start from the same draws);
    the noise-free correctness rewards of each call are appended to `stash` for `with_tied_group_share`.
    """
    rng = random.Random(10_007 * seed + 1)

    def reward(completions, answer, **kwargs):
        clean = correctness(completions, answer)
        stash.append(clean)
        return [c + bonus * format_ok(text) + (rng.gauss(0.0, noise) if noise else 0.0)
                for c, text in zip(clean, completions)]

    reward.__name__ = correctness.__name__  # the same `rewards/<name>/*` metrics as the unperturbed runs
    return reward


def tied_group_rows(clean_rewards, num_generations):
    """``[B]`` bool: the rows of groups (``num_generations`` consecutive rows) whose rewards are all equal."""
    groups = clean_rewards.view(-1, num_generations)
    return (groups.max(1).values == groups.min(1).values).repeat_interleave(num_generations)


def tied_group_adv_share(advantages, mask, tied):
    """sum |A| over the valid tokens of the `tied` rows / sum |A| over all valid tokens (0 when that is 0).

    advantages: ``[B]`` (one per completion, GRPO) or ``[B, T]`` (per token, RPP); mask: ``[B, T]`` bool, the valid
    completion tokens; tied: ``[B]`` bool. Masked positions never count, whatever they hold (NaN included).
    """
    import torch

    per_token = advantages if advantages.dim() == 2 else advantages.unsqueeze(1).expand_as(mask)
    mass = torch.where(mask, per_token.abs(), torch.zeros((), dtype=per_token.dtype))
    total = mass.sum()
    return torch.where(total > 0, mass[tied].sum() / total.clamp(min=torch.finfo(mass.dtype).tiny), torch.zeros(()))


def with_tied_group_share(base, stash, num_generations):
    """`base` (GRPOTrainer or RPPTrainer) that logs study 1's mechanism metric at every step.

    ``reward_noise/tied_group_adv_share``: sum |A| over the valid tokens of groups whose *noise-free* rewards are
    all equal, divided by sum |A| over all valid tokens, with A the advantages the loss uses (GRPO's ``[B]``
    broadcast over each completion's tokens, RPP's ``[B, T]``). Those groups carry no correctness signal, so the
    share is the part of the update that only the perturbation made. ``reward_noise/clean_reward`` is the
    batch's mean correctness reward. Needs one loss call per generation batch (``steps_per_generation=1``, the
    whole batch in one micro-batch), as every study here runs.
    """
    import torch

    class TiedGroupShare(base):
        def _generate_and_score_completions(self, inputs):
            batch = super()._generate_and_score_completions(inputs)
            clean = torch.tensor(stash.pop(), dtype=torch.float32)
            tied = tied_group_rows(clean, num_generations)
            batch["tied_group"] = tied.to(batch["completion_ids"].device)  # travels with its rows when shuffled
            self._metrics["train"]["reward_noise/clean_reward"].append(clean.mean().item())
            return batch

        def _loss_advantages(self, mode, inputs, logps):  # RPPTrainer: the advantages its loss uses, deferred or not
            advantages, old = super()._loss_advantages(mode, inputs, logps)
            self._seen_advantages = advantages
            return advantages, old

        def _compute_loss(self, model, inputs):
            self._seen_advantages = None
            loss = super()._compute_loss(model, inputs)
            adv = self._seen_advantages if self._seen_advantages is not None else inputs["advantages"]
            share = tied_group_adv_share(adv.detach(), inputs["completion_mask"].bool(), inputs["tied_group"])
            self._metrics["train"]["reward_noise/tied_group_adv_share"].append(share.item())
            return loss

    TiedGroupShare.__name__ = f"TiedGroupShare{base.__name__}"
    return TiedGroupShare


def copy_format_ok(text):
    """The tiny task's format: the completion stops right after its one-character answer."""
    return 1.0 if len(text) == 1 else 0.0


def arithmetic_format_ok(text):
    """The arithmetic task's format ("Answer with just the number"): nothing but one integer."""
    return 1.0 if re.fullmatch(r"\s*-?\d+\s*", text) else 0.0


def answer_probability(model, tokenizer, rows):
    """Mean over `rows` of the trainer's probability (temperature 1) that the first completion token is the answer.

    Exact, where greedy accuracy on 8 distinct prompts moves in steps of about 1/8. It is the expected copy reward of
    sampling from the trainer except for one path: a special token (dropped by decoding) first and the answer second
    also earns the reward and is not counted here (docs/evidence.md, study 1, shows where that matters).
    """
    import torch

    was_training = model.training
    model.eval()
    tokenizer.padding_side = "left"
    with torch.no_grad():
        enc = tokenizer([r["prompt"] for r in rows], return_tensors="pt", padding=True, add_special_tokens=False)
        logits = model(**enc).logits[:, -1].float()
        ids = torch.tensor([tokenizer.convert_tokens_to_ids(r["answer"]) for r in rows])
        prob = torch.softmax(logits, -1).gather(1, ids[:, None]).mean().item()
    model.train(was_training)
    return prob


def run_one(arm, seed, opts):
    """Train one arm with one seed in this process and write metrics.jsonl and summary.json."""
    import contextlib

    import torch

    os.environ.setdefault("WANDB_MODE", "disabled")
    torch.set_num_threads(opts.threads)
    sys.path.insert(0, os.path.join(ROOT, "examples"))
    import demo  # the main job's reward and greedy evaluation
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    from trl_rpp import RPPConfig, RPPTrainer

    outdir = os.path.join(opts.out, arm, f"seed{seed}")
    os.makedirs(outdir, exist_ok=True)
    if opts.tiny:
        from trl_rpp.testing.tiny import build_tiny_model

        path = build_tiny_model(os.path.join(opts.out, "tiny-model"))  # built by `sweep` before its jobs start
        tokenizer = AutoTokenizer.from_pretrained(path)
        # Out of distribution: the letter to copy is 3 characters before the answer instead of 1.
        train, heldout = demo.copy_rows(2000, seed + 1), demo.copy_rows(opts.heldout, 10_000)
        ood = demo.copy_rows(opts.heldout, 20_000, length=3)
        correctness, format_ok, max_new, target_modules = demo.copy_reward, copy_format_ok, 2, ["q_proj", "v_proj"]
    else:
        from trl_rpp.testing.assets import smollm2_path

        path = str(smollm2_path())
        tokenizer = AutoTokenizer.from_pretrained(path)
        # The held-out split is the same for every seed and arm; training prompts are drawn per seed. Out of
        # distribution: a three-digit plus a two-digit number (training: a in 0..99, b in 0..20).
        train, heldout = demo.arithmetic_prompts(tokenizer, 2000, seed + 1), demo.arithmetic_prompts(tokenizer, opts.heldout, 10_000)
        ood = demo.arithmetic_prompts(tokenizer, opts.heldout, 20_000, a_range=(100, 999), b_range=(10, 99))
        correctness, format_ok, max_new = demo.first_integer_reward, arithmetic_format_ok, 6
        target_modules = ["q_proj", "k_proj", "v_proj", "o_proj"]
    stash = []
    perturbed = opts.reward_noise > 0 or opts.format_bonus > 0 or opts.study == "noise"
    reward = perturbed_reward(correctness, format_ok, opts.reward_noise, opts.format_bonus, seed, stash) if perturbed else correctness

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
    elif arm in ("grpo_noscale", "grpo_batch"):
        scale = {"grpo_noscale": "none", "grpo_batch": "batch"}[arm]
        trainer_cls, args = GRPOTrainer, GRPOConfig(scale_rewards=scale, **common)
    elif arm in DRIFT_ARMS:
        correction = arm.split("_", 1)[1]
        trainer_cls = mismatch_trainer(RPPTrainer, correction, opts.mismatch_sigma)
        args = RPPConfig(
            advantage_estimator="reinforce_plus_plus_baseline", score_centering=correction in ("sc", "both"), **common
        )
    else:
        raise ValueError(f"unknown arm {arm!r}; accepted: {', '.join(ALL_ARMS)}")
    if perturbed:
        trainer_cls = with_tied_group_share(trainer_cls, stash, opts.generations)

    def evaluate():
        out = dict(heldout=demo.greedy_accuracy(trainer.model, tokenizer, heldout, correctness, max_new),
                   heldout_ood=demo.greedy_accuracy(trainer.model, tokenizer, ood, correctness, max_new))
        if opts.tiny:
            out.update(heldout_prob=answer_probability(trainer.model, tokenizer, heldout),
                       heldout_ood_prob=answer_probability(trainer.model, tokenizer, ood))
        return out

    clock = step_clock(lambda step: answer_probability(trainer.model, tokenizer, heldout),
                       opts.eval_every if opts.tiny else 0)
    lora = None if opts.full_finetune else LoraConfig(
        r=16, lora_alpha=32, lora_dropout=0.0, target_modules=target_modules, task_type="CAUSAL_LM"
    )
    trainer = trainer_cls(
        model=path, reward_funcs=reward, args=args, train_dataset=Dataset.from_list(train),
        processing_class=tokenizer, peft_config=lora, callbacks=[clock],
    )
    base_weights = trainer.model.disable_adapter() if lora is not None else contextlib.nullcontext()
    with torch.no_grad(), base_weights:
        before = evaluate()
    trainer.train()
    after = evaluate()
    with open(os.path.join(outdir, "metrics.jsonl"), "w") as f:
        for row in trainer.state.log_history:
            f.write(json.dumps(row) + "\n")
    summary = dict(
        arm=arm, seed=seed, heldout_before=before.pop("heldout"), heldout_after=after.pop("heldout"),
        **{f"{k}_before": v for k, v in before.items()}, **{f"{k}_after": v for k, v in after.items()},
        heldout_prob_curve=clock.curve, step_seconds=clock.times, **process_facts(opts.threads),
        settings={k: getattr(opts, k) for k in RUN_SETTINGS},
    )
    write_summary(outdir, summary, long_keys=("step_seconds", "heldout_prob_curve"), indent=2)


def sweep(conditions, jobs):
    """Every (arm, seed) of each condition's `arms` x `seeds` that has no summary.json yet under its `out`, `jobs`
    at a time, seeds in the outer loop within a condition. A failed run stops the sweep (after the runs in flight)
    and raises with its command."""
    todo = []
    for opts in conditions:
        if opts.tiny:
            from trl_rpp.testing.tiny import build_tiny_model

            build_tiny_model(os.path.join(opts.out, "tiny-model"))  # once, before parallel runs would race to build it
        for seed in opts.seeds:
            for arm in opts.arms:
                if os.path.exists(os.path.join(opts.out, arm, f"seed{seed}", "summary.json")):
                    print(f"[sweep] {opts.out}: {arm} seed {seed}: done earlier, skipped", flush=True)
                else:
                    todo.append((opts, arm, seed))
    run_jobs([([sys.executable, os.path.abspath(__file__), "--run", arm, "--seed", str(seed)] + passthrough(opts),
               f"{opts.out}: {arm} seed {seed}") for opts, arm, seed in todo], jobs)


def study_runs(opts):
    """The (out directory, settings) of each condition of `opts.study`, in the order the sweep runs them."""
    root = os.path.join(opts.root, f"{opts.study}-{'tiny' if opts.tiny else 'smollm2'}")
    if opts.study == "noise":
        return [(os.path.join(root, name), NOISE_CONDITIONS[name]) for name in opts.conditions]
    return [(os.path.join(root, f"bias{sigma:g}"), dict(mismatch_sigma=sigma)) for sigma in opts.bias_sigmas]


RUN_SETTINGS = ("study", "tiny", "full_finetune", "steps", "prompts", "generations", "lr", "heldout", "eval_every",
                "reward_noise", "format_bonus", "mismatch_sigma")


def passthrough(opts):
    """The command-line flags that fix one run's settings, for its subprocess."""
    flags = ["--out", opts.out, "--threads", str(opts.threads)]
    for key in RUN_SETTINGS:
        value = getattr(opts, key)
        if isinstance(value, bool):
            flags += [f"--{key}"] if value else []
        elif value is not None:
            flags += [f"--{key}", str(value)]
    return flags


def t_interval(values):
    """mean, std (ddof 1), and the half-width of a two-sided 95% t interval."""
    n = len(values)
    mean = sum(values) / n
    if n < 2:
        return mean, None, None
    std = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))
    t975 = {2: 12.706, 3: 4.303, 4: 3.182, 5: 2.776, 6: 2.571, 7: 2.447, 8: 2.365, 9: 2.306, 10: 2.262}.get(n)
    if t975 is None:  # the table is what the committed reports used; past 10 seeds, the exact quantile
        t975 = t_quantile(0.975, n - 1)
    return mean, std, t975 * std / math.sqrt(n)


def unpaired_interval(a, b):
    """Welch's unpaired difference ``mean(a) - mean(b)`` as (diff, standard error, 95% half-width), or None with
    fewer than 2 values on a side. Runs that share a seed diverge within a few steps, so seeds are not pairs."""
    if len(a) < 2 or len(b) < 2:
        return None
    w = welch_interval(a, b)
    return w["diff"], w["se"], w["half"]


# Every per-step key the report reads from a run's log history (tables and figures), kept in the table.
HISTORY_KEYS = ("reward", "advantages/std", "frac_reward_zero_std", "grad_norm", "ref_kl/k1_mean", "kl_loss",
                "completions/mean_length", "entropy", "mismatch/abs_log_ratio_mean", "mismatch/seq_log_ratio_mean",
                "mismatch/is_masked_fraction", "mismatch/is_truncated_fraction", "score_centering/coeff_l1",
                "reward_noise/tied_group_adv_share", "reward_noise/clean_reward")


def read_run(where):
    """What the report reads of one run (kept in the results' table, `run_table`): its summary.json but the
    settings, and of its training steps' log rows (metrics.jsonl) the `HISTORY_KEYS`, one list per key."""
    summary = json.load(open(os.path.join(where, "summary.json")))
    history = [json.loads(line) for line in open(os.path.join(where, "metrics.jsonl"))]
    history = [h for h in history if "reward" in h]
    return dict({k: v for k, v in summary.items() if k != "settings"}, steps=len(history), history={
        key: [h.get(key) for h in history] for key in HISTORY_KEYS if any(h.get(key) is not None for h in history)})


def load_study(root):
    """Every run under `root` (the 16-step tables' `<arm>/seed<k>`, the studies' `<study>/<condition>/<arm>/seed<k>`):
    from the runs' own files when there are any (also written to `<root>/runs.parquet`), else from that table."""
    return run_table.Runs(run_table.load(root, run_table.raw_runs(root, read_run, depths=(2, 4))))


def _load_runs(study, where, arms, seeds):
    """`{(arm, seed): (summary, the training steps' log rows)}` of the runs in directory `where` (parts under the
    study's root), as `run_one` wrote them but with only the `HISTORY_KEYS` in each row."""
    runs = {}
    for arm in arms:
        for seed in seeds:
            record = study.get(*where, arm, f"seed{seed}")
            if record is not None:
                history = record.get("history", {})
                rows = [{k: v[i] for k, v in history.items() if v[i] is not None} for i in range(record["steps"])]
                runs[(arm, seed)] = ({k: v for k, v in record.items() if k not in ("run", "steps", "history")}, rows)
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
            control_done = [s for s in seeds if (control, s) in runs]
            paired[arm] = dict(seeds=common, diff=t_interval(diffs), per_seed=diffs, unpaired=unpaired_interval(
                [summaries[s]["heldout_after"] for s in done],
                [runs[(control, s)][0]["heldout_after"] for s in control_done]))
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
            "Held-out accuracy: mean ± std [95% t interval] over seeds. Differences: arm minus "
            f"`{control}`, unpaired (Welch: difference ± standard error [95% interval]), and paired by seed.", "",
            f"| arm | seeds | held-out before | held-out after | after − {control} (unpaired) | (paired) |",
            "|---|---|---|---|---|---|",
        ])
        for arm, row in arms.items():
            diff = _fmt_interval(paired[arm]["diff"]) if arm in paired else "—"
            unpaired = paired[arm].get("unpaired") if arm in paired else None
            lines.append(f"| `{arm}` | {len(row['seeds'])} | {_fmt_interval(row['before'])} | "
                         f"{_fmt_interval(row['after'])} | {_fmt_interval(unpaired) if unpaired else '—'} | {diff} |")
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


def report_main(opts, study=None):
    study = load_study(opts.out) if study is None else study
    runs = _load_runs(study, (), ARMS + MISMATCH_ARMS, opts.seeds)
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
    if getattr(opts, "no_figures", False):
        return
    os.makedirs(opts.figures, exist_ok=True)  # docs/figures, where the pages link them, for the committed results
    if arms:
        _plot(runs, ARMS, opts.seeds, [
            ("reward", "training reward"), ("completions/mean_length", "completion length"),
            ("grad_norm", "gradient norm"), ("frac_reward_zero_std", "fraction of zero-variance groups"),
            ("advantages/std", "normalized-advantage std (RPP arms)"), ("ref_kl/k1_mean", "k1 KL to reference (rpp)"),
            ("kl_loss", "k2 KL loss to reference (rpp_baseline)"),
        ], os.path.join(opts.figures, "evidence_curves.png"), "equal-budget comparison")
    if mismatch:
        _plot(runs, mm_arms, mm_seeds, [
            ("reward", "training reward"), ("mismatch/abs_log_ratio_mean", "mean |log p_old - log q| per token"),
            ("kl_loss", "k2 KL loss to reference"), ("grad_norm", "gradient norm"),
            ("completions/mean_length", "completion length"), ("mismatch/is_masked_fraction", "TIS: masked sequences"),
        ], os.path.join(opts.figures, "evidence_mismatch_curves.png"),
            f"sampler = trainer + fixed logit bias (sigma={opts.mismatch_sigma})")


def _paired(runs, arm, control, seeds, key):
    common = [s for s in seeds if (arm, s) in runs and (control, s) in runs]
    if arm == control or not common:
        return None
    return t_interval([runs[(arm, s)][0][key] - runs[(control, s)][0][key] for s in common])


def _unpaired(runs, arm, control, seeds, key):
    if arm == control:
        return None
    return unpaired_interval([runs[(arm, s)][0][key] for s in seeds if (arm, s) in runs],
                             [runs[(control, s)][0][key] for s in seeds if (control, s) in runs])


def _study_rows(runs, arms, seeds, control, metrics, keys):
    """Per arm: the held-out `metrics` after training (interval over seeds, paired difference to `control`), the
    per-step `keys` (mean over steps and seeds), median s/step and the CPU seconds of every run."""
    rows = {}
    for arm in arms:
        done = [s for s in seeds if (arm, s) in runs]
        if not done:
            continue
        row = dict(seeds=done, cpu_seconds=sum(runs[(arm, s)][0].get("cpu_seconds", 0.0) for s in done),
                   median_step_seconds=_median([_median(runs[(arm, s)][0]["step_seconds"][1:]) for s in done]))
        for m in metrics:
            if any(f"{m}_after" not in runs[(arm, s)][0] for s in done):
                continue  # e.g. the 16-step table's runs, made before the out-of-distribution score existed
            row[m] = dict(before=t_interval([runs[(arm, s)][0][f"{m}_before"] for s in done]),
                          after=t_interval([runs[(arm, s)][0][f"{m}_after"] for s in done]),
                          paired=_paired(runs, arm, control, seeds, f"{m}_after"),
                          unpaired=_unpaired(runs, arm, control, seeds, f"{m}_after"))
        for key in keys:
            per_seed = [_series(runs, arm, s, key) for s in done]
            if all(per_seed):
                flat = [v for series in per_seed for v in series]
                row[key] = sum(flat) / len(flat)
        rows[arm] = row
    return rows


def _cell(row, metric, part):
    iv = row.get(metric, {}).get(part)
    return "—" if iv is None else _fmt_interval(iv)


def _study_table(lines, rows, control, columns, keys):
    """`columns`: (metric, part, title) cells from `_study_rows`; `keys`: (log key, title) per-step means."""
    lines.append("| arm | seeds | " + " | ".join([t for *_, t in columns] + [t for _, t in keys]) + " |")
    lines.append("|---|---|" + "---|" * (len(columns) + len(keys)))
    for arm, row in rows.items():
        cells = [_cell(row, m, part) for m, part, _ in columns]
        cells += [f"{row[k]:.3g}" if k in row else "—" for k, _ in keys]
        lines.append(f"| `{arm}` | {len(row['seeds'])} | " + " | ".join(cells) + " |")
    lines.append("")


def _cost_line(lines, studies):
    if not any(studies):
        return
    cpu = sum(r["cpu_seconds"] for rows in studies for r in rows.values())
    runs = sum(len(r["seeds"]) for rows in studies for r in rows.values())
    steps = sorted(r["median_step_seconds"] for rows in studies for r in rows.values())
    lines.append(f"Cost: {runs} runs, {cpu / 3600:.2f} CPU-hours in all (the runs' own process time); median "
                 f"s/step per arm from {steps[0]:.3f} to {steps[-1]:.3f}.")
    lines.append("")


def report_noise(opts, model, study):
    """Study 1 (each condition) and study 3 (out-of-distribution prompts, at sigma = 0) for one model."""
    root = (f"noise-{model}",)
    if not study.has(*root):
        return None
    tiny = model == "tiny"
    metrics = ("heldout_prob", "heldout", "heldout_ood_prob", "heldout_ood") if tiny else ("heldout", "heldout_ood")
    primary, ood = metrics[0], metrics[len(metrics) // 2]
    keys = ("reward_noise/tied_group_adv_share", "reward_noise/clean_reward", "frac_reward_zero_std", "grad_norm")
    out, runs_by = {}, {}
    for name in NOISE_CONDITIONS:
        where = root + (name,)
        if name == "sigma0" and not tiny and not study.has(*where):
            where = ()  # SmolLM2 at sigma = 0: the 16-step table's runs, the same set-up without noise
        if study.has(*where):
            runs_by[name] = _load_runs(study, where, NOISE_ARMS, opts.seeds)
            rows = _study_rows(runs_by[name], NOISE_ARMS, opts.seeds, "rpp_baseline", metrics, keys)
            if rows:
                out[name] = rows
    from_main = "sigma0" in out and not tiny and not study.has(*root, "sigma0")
    lines = [f"### Study 1: reward noise and shaping ({model})", "",
             f"Held-out {LABELS[primary]} after training, "
             "mean ± std [95% t interval] over seeds; differences: arm minus `rpp_baseline`, unpaired (Welch: "
             "difference ± standard error [95% interval]) and paired by seed. Per-step means "
             "over all steps and seeds.", ""]
    for name, rows in out.items():
        source = "; the 16-step table's runs" if name == "sigma0" and from_main else ""
        lines += [f"**{name}** ({', '.join(f'{k} = {v:g}' for k, v in NOISE_CONDITIONS[name].items())}{source})", ""]
        cols = [(primary, "after", "held-out after"), (primary, "unpaired", "− rpp_baseline (unpaired)"),
                (primary, "paired", "(paired)")]
        if tiny:
            cols.append(("heldout", "after", "greedy accuracy after"))
        _study_table(lines, rows, "rpp_baseline", cols, [
            ("reward_noise/tied_group_adv_share", "share of Σ abs(A) on tied groups"),
            ("reward_noise/clean_reward", "training correctness reward"), ("grad_norm", "grad norm")])
    if "sigma0" in out and any(ood in r for r in out["sigma0"].values()):
        lines += [f"### Study 3: out-of-distribution prompts ({model}, sigma = 0)", "",
                  f"Held-out out-of-distribution {LABELS[ood]}, before and after training; arm minus "
                  "`rpp_baseline`, unpaired (Welch: difference ± standard error [95% interval]) and paired by "
                  "seed.", ""]
        cols = [(ood, "before", "OOD before"), (ood, "after", "OOD after"),
                (ood, "unpaired", "− rpp_baseline (unpaired)"), (ood, "paired", "(paired)"),
                (primary, "after", "in-distribution after")]
        if tiny:
            cols.append(("heldout_ood", "after", "OOD greedy accuracy after"))
        _study_table(lines, out["sigma0"], "rpp_baseline", cols, [])
    _cost_line(lines, [rows for name, rows in out.items() if not (from_main and name == "sigma0")])
    if not getattr(opts, "no_figures", False):
        _plot_noise(runs_by, out, primary, ood, os.path.join(opts.figures, f"evidence_noise_{model}.png"), model)
    return dict(conditions=out, markdown="\n".join(lines))


LABELS = {"heldout_prob": "p(first token = answer)", "heldout": "greedy accuracy",
          "heldout_ood_prob": "p(first token = answer)", "heldout_ood": "greedy accuracy"}


def _plot_noise(runs_by, out, primary, ood, path, model):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(out)
    # Out of distribution at sigma = 0 where it was scored (tiny model), else at the last condition that has it.
    ood_at = next((n for n in ["sigma0"] + names[::-1] if any(ood in r for r in out.get(n, {}).values())), None)
    fig, axes = plt.subplots(1, 4, figsize=(18, 3.8))
    for i, arm in enumerate(NOISE_ARMS):
        xs = [j + (i - 1.5) * 0.08 for j, n in enumerate(names) if arm in out[n]]
        for ax, key in ((axes[0], primary), (axes[1], "reward_noise/tied_group_adv_share")):
            if key == primary:
                ys = [out[n][arm][key]["after"] for n in names if arm in out[n]]
                ax.errorbar(xs, [y[0] for y in ys], yerr=[y[2] or 0 for y in ys], fmt="o", color=f"C{i}", label=arm, capsize=3)
            else:
                ax.plot(xs, [out[n][arm].get(key, float("nan")) for n in names if arm in out[n]], "o", color=f"C{i}")
        if ood_at and ood in out[ood_at].get(arm, {}):
            iv = out[ood_at][arm][ood]["after"]
            axes[2].errorbar([i], [iv[0]], yerr=[iv[2] or 0], fmt="o", color=f"C{i}", capsize=3)
        curve_at = "format0.1" if "format0.1" in runs_by else names[-1]
        curves = [runs_by[curve_at][(arm, s)][0].get("heldout_prob_curve") for a, s in runs_by[curve_at] if a == arm]
        curves = [c for c in curves if c]
        if curves:
            n = min(len(c) for c in curves)
            axes[3].plot([c[0] for c in curves[0][:n]], [sum(c[j][1] for c in curves) / len(curves) for j in range(n)],
                         color=f"C{i}", label=arm)
            axes[3].set(title=f"{curve_at}: held-out {LABELS[primary]} during training", xlabel="step")
        else:  # no held-out curve (SmolLM2): the training correctness reward, from the logs
            series = [_series(runs_by[curve_at], arm, s, "reward_noise/clean_reward") for a, s in runs_by[curve_at] if a == arm]
            series = [c for c in series if c]
            if series:
                n = min(len(c) for c in series)
                axes[3].plot(range(1, n + 1), [sum(c[j] for c in series) / len(series) for j in range(n)], color=f"C{i}")
                axes[3].set(title=f"{curve_at}: training correctness reward", xlabel="step")
    for ax in axes[:2]:
        ax.set_xticks(range(len(names)), names)
    axes[0].set(title=f"held-out {LABELS[primary]} after training (95% t)", xlabel="condition")
    axes[0].legend(fontsize=8)
    axes[1].set(title="share of sum |A| on groups with tied correctness", xlabel="condition", ylim=(0, 1))
    axes[2].set_xticks(range(len(NOISE_ARMS)), NOISE_ARMS, fontsize=8)
    axes[2].set(title=f"out of distribution, {ood_at}: {LABELS[ood]}")
    fig.suptitle(f"Study 1 and 3 ({model}): mean over seeds")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def report_drift(opts, study):
    """Study 2: the bias sweep (uncorrected against no bias) and, at each bias with more arms, every correction."""
    root = ("drift-tiny",)
    if not study.has(*root):
        return None
    sigmas = sorted(float(d[4:]) for d in study.children(*root) if d.startswith("bias"))
    metrics = ("heldout_prob", "heldout", "heldout_ood_prob")
    keys = ("mismatch/abs_log_ratio_mean", "score_centering/coeff_l1", "mismatch/is_masked_fraction",
            "mismatch/is_truncated_fraction", "entropy", "kl_loss", "reward")
    runs_by = {sg: _load_runs(study, root + (f"bias{sg:g}",), DRIFT_ARMS, opts.seeds) for sg in sigmas}
    nobias = runs_by.get(0.0, {})
    lines = ["### Study 2: sampler drift over a long horizon (tiny model)", "",
             "Held-out p(first token = answer) under the trainer (exact, temperature 1) after training, mean ± std "
             "[95% t interval] over seeds.", "", "**The bias sweep**: uncorrected runs against the run without a "
             "bias (`bias0`), unpaired (Welch: difference ± standard error [95% interval]) and paired by "
             "seed.", "",
             "| bias sigma | seeds | held-out after | − no bias (unpaired) | (paired) | greedy accuracy after | "
             "mean abs log p − log q |", "|---|---|---|---|---|---|---|"]
    sweep_rows, tables = {}, {}
    for sg in sigmas:
        runs = runs_by[sg]
        merged = {**runs, **{("nobias", s): v for (a, s), v in nobias.items() if a == "mismatch_none"}}
        rows = _study_rows(merged, ("mismatch_none",), opts.seeds, "nobias", metrics, keys)
        if "mismatch_none" not in rows:
            continue
        row = sweep_rows[sg] = rows["mismatch_none"]
        lines.append(f"| {sg:g} | {len(row['seeds'])} | {_cell(row, 'heldout_prob', 'after')} | "
                     f"{_cell(row, 'heldout_prob', 'unpaired') if sg else '—'} | "
                     f"{_cell(row, 'heldout_prob', 'paired') if sg else '—'} | {_cell(row, 'heldout', 'after')} | "
                     f"{row.get('mismatch/abs_log_ratio_mean', float('nan')):.3g} |")
        if sg and len({a for a, _ in runs}) > 1:
            tables[sg] = _study_rows(runs, DRIFT_ARMS, opts.seeds, "mismatch_none", metrics, keys)
            for arm, r in tables[sg].items():
                r["vs_nobias"] = t_interval([runs[(arm, s)][0]["heldout_prob_after"] - nobias[("mismatch_none", s)][0]["heldout_prob_after"]
                                             for s in r["seeds"] if ("mismatch_none", s) in nobias]) if nobias else None
                r["vs_nobias_unpaired"] = unpaired_interval(
                    [runs[(arm, s)][0]["heldout_prob_after"] for s in r["seeds"]],
                    [v[0]["heldout_prob_after"] for (a, _), v in nobias.items() if a == "mismatch_none"])
    lines.append("")
    for sg, rows in tables.items():
        lines += [f"**Every correction at bias sigma = {sg:g}**: arm minus `mismatch_none` (the uncorrected "
                  "run), and arm minus the run without a bias, unpaired (Welch: difference ± standard error [95% "
                  "interval]) and paired by seed.", ""]
        for r in rows.values():
            r["heldout_prob"]["vs_nobias"] = r.pop("vs_nobias")
            r["heldout_prob"]["vs_nobias_unpaired"] = r.pop("vs_nobias_unpaired")
        _study_table(lines, rows, "mismatch_none", [
            ("heldout_prob", "after", "held-out after"), ("heldout_prob", "unpaired", "− mismatch_none (unpaired)"),
            ("heldout_prob", "paired", "(paired)"), ("heldout_prob", "vs_nobias_unpaired", "− no bias (unpaired)"),
            ("heldout_prob", "vs_nobias", "(paired)"), ("heldout", "after", "greedy accuracy after")],
            [("mismatch/abs_log_ratio_mean", "mean abs log p − log q"), ("score_centering/coeff_l1", "SC coefficient L1"),
             ("mismatch/is_masked_fraction", "TIS masked sequences"), ("mismatch/is_truncated_fraction", "TIS truncated tokens"),
             ("entropy", "entropy"), ("kl_loss", "k2 KL loss")])
    _cost_line(lines, [{f"s{k}": v for k, v in sweep_rows.items()}] + [
        {a: r for a, r in rows.items() if a != "mismatch_none"} for rows in tables.values()])
    if not getattr(opts, "no_figures", False):
        _plot_drift(runs_by, sweep_rows, tables, os.path.join(opts.figures, "evidence_drift.png"))
    return dict(sweep={f"{k:g}": v for k, v in sweep_rows.items()}, tables={f"{k:g}": v for k, v in tables.items()},
                markdown="\n".join(lines))


def _plot_drift(runs_by, sweep_rows, tables, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(14, 3.8))
    sg = sorted(sweep_rows)
    ys = [sweep_rows[x]["heldout_prob"]["after"] for x in sg]
    axes[0].errorbar(sg, [y[0] for y in ys], yerr=[y[2] or 0 for y in ys], fmt="o-", capsize=3, color="C1")
    axes[0].set(title="uncorrected: held-out p(first token = answer), 95% t", xlabel="logit-bias sigma (0: no bias)")
    for sigma, rows in tables.items():
        runs = {**runs_by[sigma], **{("nobias", s): v for (a, s), v in runs_by.get(0.0, {}).items()}}
        for i, arm in enumerate(("nobias",) + DRIFT_ARMS):
            curves = [runs[(arm, s)][0]["heldout_prob_curve"] for a, s in runs if a == arm]
            if not curves:
                continue
            n = min(len(c) for c in curves)
            steps = [c[0] for c in curves[0][:n]]
            cols = [[c[j][1] for c in curves] for j in range(n)]
            axes[1].plot(steps, [sum(c) / len(c) for c in cols], color=f"C{i}", label=f"{arm} ({len(curves)} seeds)")
            gaps = [_series(runs, arm, s, "mismatch/abs_log_ratio_mean") for a, s in runs if a == arm]
            m = min(len(g) for g in gaps)
            axes[2].plot(range(1, m + 1), [sum(g[j] for g in gaps) / len(gaps) for j in range(m)], color=f"C{i}")
        axes[1].set(title=f"held-out p(first token = answer), sigma = {sigma:g}", xlabel="step")
        axes[1].legend(fontsize=8)
        axes[2].set(title=f"mean |log p_old - log q| per token, sigma = {sigma:g}", xlabel="step")
        break  # one bias level is the study's main table
    fig.suptitle("Study 2: sampler = trainer + fixed logit bias, re-synced every step (tiny model); mean over seeds")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def report(opts):
    """Every table and figure: the main 16-step tables under `--root`, then each study found under it. Writes
    `<root>/studies.json` and `<root>/studies.md` (what docs/evidence.md copies) and the figures to `--figures`."""
    study = load_study(opts.root)
    report_main(opts, study)  # also makes the figures' directory, which the studies' figures go to as well
    studies = {f"noise-{m}": report_noise(opts, m, study) for m in ("tiny", "smollm2")}
    studies["drift-tiny"] = report_drift(opts, study)
    studies = {k: v for k, v in studies.items() if v is not None}
    markdown = "\n".join(v.pop("markdown") for v in studies.values())
    with open(os.path.join(opts.root, "studies.json"), "w") as f:
        json.dump(studies, f, indent=2)
    with open(os.path.join(opts.root, "studies.md"), "w") as f:
        f.write(markdown)
    print(markdown)


# Per study, the settings a flag left unset takes. Tiny studies fine-tune every weight (the 2-layer model has no
# pretrained part to keep, and the drift of study 2 goes through the shared output layer).
STUDY_DEFAULTS = {
    "main": dict(steps=16, prompts=8, generations=4, lr=5e-4, eval_every=0),
    "noise": dict(steps=16, prompts=8, generations=4, lr=5e-4, eval_every=0),
    "noise-tiny": dict(steps=STUDY1_TINY_STEPS, prompts=8, generations=8, lr=STUDY1_TINY_LR, eval_every=10,
                       full_finetune=True),
    "drift-tiny": dict(steps=STUDY2_STEPS, prompts=8, generations=8, lr=STUDY2_LR, eval_every=10, full_finetune=True),
}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--study", default="main", choices=("main", "noise", "drift"),
                    help="main: the 16-step tables; noise: study 1 (and 3); drift: study 2 (tiny model only)")
    ap.add_argument("--out", default=RESULTS, help="the result directory; the studies' conditions go under it")
    ap.add_argument("--figures", default=None,
                    help="--report: where the figures go (default: docs/figures for the default --out, else <out>/figures)")
    ap.add_argument("--conditions", default=",".join(NOISE_CONDITIONS), help="noise study: which conditions")
    ap.add_argument("--bias_sigmas", default=f"0,{STUDY2_SIGMA:g}", help="drift study: the logit-bias stds")
    ap.add_argument("--seeds", default="0,1,2,3,4")
    ap.add_argument("--arms", default=None, help="default: the study's arms")
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--prompts", type=int, default=None)
    ap.add_argument("--generations", type=int, default=None)
    ap.add_argument("--lr", type=float, default=None)
    ap.add_argument("--heldout", type=int, default=128)
    ap.add_argument("--eval_every", type=int, default=None, help="tiny model: held-out probability every N steps")
    ap.add_argument("--full_finetune", action="store_true", default=None, help="train every weight (no LoRA)")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--jobs", type=int, default=1, help="runs at once, each on --threads threads")
    ap.add_argument("--reward_noise", type=float, default=0.0, help="internal: std of the reward noise")
    ap.add_argument("--format_bonus", type=float, default=0.0, help="internal: the format bonus")
    ap.add_argument("--mismatch_sigma", type=float, default=1.0, help="std of the fixed logit bias (mismatch arms)")
    ap.add_argument("--tiny", action="store_true", help="tiny random-init model and the copy task")
    ap.add_argument("--run", default=None, help="internal: run one arm in this process")
    ap.add_argument("--seed", type=int, default=None, help="internal: with --run")
    ap.add_argument("--report", action="store_true", help="only aggregate finished runs into figures and reports")
    ap.add_argument("--no_figures", action="store_true", help="--report: the tables only, without drawing the figures")
    opts = ap.parse_args()
    if opts.study == "drift" and not opts.tiny:
        opts.tiny = True  # hundreds of steps fit only on the tiny model
    key = opts.study if opts.study == "main" or not opts.tiny else f"{opts.study}-tiny"
    for name, value in STUDY_DEFAULTS[key].items():
        if getattr(opts, name, None) is None:
            setattr(opts, name, value)
    opts.full_finetune = bool(opts.full_finetune)
    opts.seeds = [int(x) for x in str(opts.seeds).split(",")]
    default_arms = {"main": ARMS, "noise": NOISE_ARMS, "drift": DRIFT_ARMS}[opts.study]
    opts.arms = list(default_arms) if opts.arms is None else opts.arms.split(",")
    for name in opts.arms:
        if name not in ALL_ARMS:
            raise ValueError(f"--arms: unknown arm {name!r}; accepted: {', '.join(ALL_ARMS)}")
    opts.conditions = opts.conditions.split(",")
    for name in opts.conditions:
        if name not in NOISE_CONDITIONS:
            raise ValueError(f"--conditions: unknown condition {name!r}; accepted: {', '.join(NOISE_CONDITIONS)}")
    opts.bias_sigmas = [float(x) for x in opts.bias_sigmas.split(",")]
    opts.root = opts.out  # a run's own --out is its condition's directory; the sweep passes it down
    if opts.figures is None:
        opts.figures = "docs/figures" if os.path.normpath(opts.out) == RESULTS else os.path.join(opts.out, "figures")
    if opts.run:
        run_one(opts.run, opts.seed, opts)
    elif opts.report:
        report(opts)
    elif opts.study == "main":
        sweep([opts], opts.jobs)
        report(opts)
    else:
        conditions = []
        for out, settings in study_runs(opts):
            condition = argparse.Namespace(**{**vars(opts), **settings, "out": out})
            if opts.study == "drift" and settings["mismatch_sigma"] == 0:
                condition.arms = ["mismatch_none"]  # without a bias there is nothing to correct
            conditions.append(condition)
        sweep(conditions, opts.jobs)
        report(opts)


if __name__ == "__main__":
    main()
