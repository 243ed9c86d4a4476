"""Study 4: score centering where its mechanism can act (docs/evidence.md, "Study 4").

    python benchmarks/studies/mismatch_study.py --jobs 2 --threads 1     # the planned sweep, resumable
    python benchmarks/studies/mismatch_study.py --conditions stale8 --arms uncorrected,sc32 --seeds 0 --steps 4 \
        --out /tmp/m                                                     # a smoke run
    python benchmarks/studies/mismatch_study.py --report                 # tables and figures from the result files

REINFORCE++-baseline (no KL loss: a pure policy gradient) on the tiny random-init model of `trl_rpp.testing.tiny`,
every weight trained, on a task where prefixes differ within a group and later tokens carry reward (`copy_rows`,
`copy_credit_reward`). The sampler that generates differs from the trainer in one of these ways (`Sampler`), each
made inside this script, never through the trainer's public API:

- `stale<N>` (N optimizer steps behind): before each generation the trainer's weights are recorded, and a copy of the
  model is loaded with the weights the trainer had N optimizer steps earlier (the initial weights while fewer than N
  steps have run); that copy generates. `stale0` is the copy of the current weights: no mismatch, the control.
- `bf16`: a bfloat16 copy of the current weights generates (weights and activations in bfloat16, transformers'
  `generate`); the trainer stays float32.
- `int8`, `int4`: a float32 copy of the current weights whose `nn.Linear` weights (every projection and the output
  layer; the embedding is not a linear layer) are rounded per output channel to symmetric integers of that width,
  round to nearest (`quantize_per_channel`), generates.
- `bias<sigma>` (sanity check only): the trainer's logits plus a fixed `N(0, sigma^2)` bias per vocabulary id, drawn
  once from seed 1234 (study 2's sampler). Score centering over the full vocabulary is then exact on-policy learning
  of the biased sampler `q = softmax(z + b)` (tests/test_mismatch_study.py checks the gradient identity); the
  `onpolicy` arm trains that biased model directly, for comparison under the sampler.

The sampler's log-probs reach the trainer as in study 2 (`sampled_trainer`, shared with `compare_estimators.py`):
with score centering, `RPPTrainer`'s own top-k capture (a logits processor inside `generate`, here the copy's
`generate`); without it, a top-1 capture of the sampled token's log-prob. Arms:

- `uncorrected`: the samples are treated as on-policy;
- `token_truncate`: TRL's token-level importance sampling, each token's loss weighted by `min(pi_old/q, 3)` (TRL's
  `vllm_importance_sampling_mode="token_truncate"`, `clip_max=3.0`; TRL applies it only with vLLM, this is the same
  formula on the transformers path with q captured during `generate`);
- `sc32`: score centering, `score_centering_top_k=32` (the tiny vocabulary has 46 ids, so 14 are tail);
- `sc32_token_truncate`: both, the correction's coefficients reweighted as with vLLM (docs/score_centering.md);
- `sc_full`: score centering over the whole vocabulary (`score_centering_top_k` = vocabulary size): no tail model;
- `onpolicy` (only with `bias<sigma>`): the bias is the trainer's own output-layer bias (frozen), so sampler and
  trainer agree. A `bias<sigma>` condition runs only `uncorrected`, `sc_full` and `onpolicy` (`BIAS_ARMS`).

Scores (held-out prompts, exact): `copy_prob`, the teacher-forced probability of each answer character, averaged
over positions and prompts; each scored under the trainer and under the
sampler (the model that would generate next), after training and every `--eval_every` steps (the area under that
curve, `curve_area`). Greedy per-position credit at the end. Statistics (pure functions below): Welch's unpaired 95%
interval of a difference of means and a two-sided permutation test; seeds are not paired (runs that share a seed
diverge within a few steps).

Every (condition, arm, seed) runs in its own process; a run that finished left `summary.json` and is skipped when the
sweep is started again. Per-step metrics are kept in `summary.json` (`series`, 4 significant digits). `--report`
keeps what it reads of every run in `<out>/runs.parquet` (`run_table`) and reads that table where the runs' own files
are absent, as in the repository.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import math
import os
import random
import re
import sys
from types import SimpleNamespace

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # run_table, when imported from elsewhere
import run_table  # noqa: E402
from study_common import (  # noqa: E402
    contrast, fmt_contrast, fmt_interval, mean_ci, pending_runs, process_facts, run_curves, run_jobs, step_clock,
    t_quantile, write_summary,
)

RESULTS = "benchmarks/results/mismatch_study"
ARMS = ("uncorrected", "token_truncate", "sc32", "sc32_token_truncate", "sc_full")
ALL_ARMS = ARMS + ("onpolicy",)
BIAS_ARMS = ("uncorrected", "sc_full", "onpolicy")  # the sanity check: what a fixed bias needs
# The planned sweep, in the order it runs (docs/evidence.md, study 4): cut from the end first.
CONDITIONS = ("stale0", "stale4", "stale8", "stale16", "int4", "bf16", "int8", "bias2")
SOURCE = re.compile(r"^(stale(\d+)|bf16|int(8|4)|bias(\d+(\.\d+)?))$")
IS_CLIP_MAX = 3.0  # TRL's default vllm_importance_sampling_clip_max
BIAS_SEED = 1234
# Chosen from one-seed pilots (docs/evidence.md, study 4).
STEPS, LR, LENGTHS = 300, 3e-3, (1, 2, 3)
SERIES_KEYS = ("reward", "mismatch/abs_log_ratio_mean", "score_centering/coeff_l1", "mismatch/is_truncated_fraction",
               "entropy", "grad_norm", "completions/mean_length")


# ---------------------------------------------------------------------------------------------------------------
# Pure functions: quantization, the task, statistics
# ---------------------------------------------------------------------------------------------------------------


def quantize_per_channel(weight, bits: int):
    """``[out, in]`` weight rounded to symmetric ``bits``-bit integers per output channel, returned dequantized.

    Row ``i`` gets the scale ``s_i = max_j |w_ij| / (2^(bits-1) - 1)`` and becomes ``s_i * round(w_ij / s_i)``
    (round to nearest, ties to even), so every integer lies in ``[-(2^(bits-1) - 1), 2^(bits-1) - 1]``. A row of
    zeros stays zero. Computed in float32 (float64 for float64 input), returned in the input's dtype.
    """
    import torch

    if weight.dim() != 2:
        raise ValueError(f"quantize_per_channel: weight must be [out, in], got shape {tuple(weight.shape)}")
    if bits not in (4, 8):
        raise ValueError(f"quantize_per_channel: bits={bits!r} is not supported; accepted: 4, 8")
    w = weight.to(torch.float64 if weight.dtype == torch.float64 else torch.float32)
    qmax = 2 ** (bits - 1) - 1
    scale = w.abs().amax(dim=1, keepdim=True) / qmax
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(w / safe).clamp(-qmax, qmax)
    return torch.where(scale > 0, q * safe, torch.zeros_like(w)).to(weight.dtype)


def copy_rows(n: int, seed: int, lengths=LENGTHS):
    """``n`` prompts ``"<letters>:"`` of a length drawn uniformly from `lengths` (letters of `TASK_LETTERS`); the
    answer is the letters themselves."""
    from trl_rpp.testing.tiny import TASK_LETTERS

    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        word = "".join(rng.choice(TASK_LETTERS) for _ in range(rng.choice(lengths)))
        rows.append({"prompt": word + ":", "answer": word})
    return rows


def copy_task_data(opts, seed: int):
    """One run's copy-task data: 4000 training rows drawn with ``seed + 1``, ``opts.heldout`` held-out rows (the same
    for every run), at prompt lengths ``opts.lengths``, and the completion length that scores them."""
    lengths = tuple(opts.lengths)
    max_new = max(lengths)  # what follows the answer is not scored
    return copy_rows(4000, seed + 1, lengths), copy_rows(opts.heldout, 10_000, lengths), max_new


def add_copy_task_flags(ap, steps: int, lr: float, lengths=LENGTHS) -> None:
    """The flags of one copy-task run that the studies of it share, with their defaults."""
    ap.add_argument("--steps", type=int, default=steps)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--generations", type=int, default=8)
    ap.add_argument("--lr", type=float, default=lr)
    ap.add_argument("--lengths", default=",".join(map(str, lengths)), help="prompt lengths, drawn uniformly")
    ap.add_argument("--heldout", type=int, default=128)
    ap.add_argument("--eval_every", type=int, default=10)


def copy_credit_reward(completions, answer, **kwargs):
    """Credit per position: the share of the answer's positions ``j`` where the completion has the answer's
    character. Every position carries reward of its own, so after the first character, whose sampled value differs
    within a group, the later ones still decide part of the reward. What follows the answer is not scored."""
    return [sum(a == b for a, b in zip(text, target)) / len(target) for text, target in zip(completions, answer)]


def curve_area(curve) -> float:
    """Area under a learning curve ``[[step, score], ...]`` (steps increasing), by the trapezoid rule, divided by
    the span of steps: the mean score over training."""
    if len(curve) < 2:
        raise ValueError("curve_area: needs at least two points")
    area = sum((s1 - s0) * (y0 + y1) / 2 for (s0, y0), (s1, y1) in zip(curve, curve[1:]))
    return area / (curve[-1][0] - curve[0][0])


# ---------------------------------------------------------------------------------------------------------------
# The sampler: what generates, made from the trainer's weights
# ---------------------------------------------------------------------------------------------------------------


def fixed_bias(vocab_size: int, sigma: float, seed: int = BIAS_SEED):
    """``[V]`` float32 bias ``N(0, sigma^2)`` drawn from `seed` (study 2's draw: the same generator calls)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    return torch.randn(vocab_size, generator=g) * sigma


class Sampler:
    """The model that generates, for one mismatch `source` (see the module docstring). `at(model, step)` returns,
    for the trainer's `model` after `step` optimizer steps, the module that generates and the logit bias it adds."""

    def __init__(self, source: str, in_trainer: bool = False):
        match = SOURCE.match(source)
        if match is None:
            raise ValueError(f"--conditions: unknown mismatch source {source!r}; accepted: stale<N>, bf16, int8, "
                             "int4, bias<sigma>")
        self.source, self.in_trainer = source, in_trainer
        self.stale = int(match.group(2)) if match.group(2) is not None else None
        self.bits = int(match.group(3)) if match.group(3) is not None else None
        self.sigma = float(match.group(4)) if match.group(4) is not None else None
        if in_trainer and self.sigma is None:
            raise ValueError(f"--arms onpolicy needs a bias<sigma> condition, got {source!r}")
        self.copy, self.bias, self.history = None, None, {}

    def attach(self, model):
        """Build the copy that generates (none for a bias) and, with `in_trainer`, make the bias the trainer's own
        output-layer bias (frozen), so that trainer and sampler are one model. Call before the optimizer is built."""
        import torch

        if self.sigma is not None:
            self.bias = fixed_bias(model.config.vocab_size, self.sigma).to(model.device)
            if self.in_trainer:  # a frozen bias of the output layer: TRL's fused log-prob head reads it too
                model.get_output_embeddings().bias = torch.nn.Parameter(self.bias.clone(), requires_grad=False)
            return
        # Built from the config, not deep-copied: the trainer's model carries instance patches (accelerate wraps its
        # `forward`), and a deep copy would call the original's forward.
        self.copy = type(model)(copy.deepcopy(model.config))
        self.copy.load_state_dict(model.state_dict())
        self.copy.generation_config = copy.deepcopy(model.generation_config)
        if self.source == "bf16":
            self.copy.to(torch.bfloat16)
        self.copy.eval()
        for p in self.copy.parameters():
            p.requires_grad_(False)

    @staticmethod
    def _trainable(model):
        return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}

    def at(self, model, step: int):
        """``(module, logit_bias)`` of the sampler the trainer's `model` has after `step` optimizer steps (stale:
        records this step's weights, and loads those of ``max(step - N, 0)``)."""
        import torch

        if self.sigma is not None:
            return model, (None if self.in_trainer else self.bias)
        with torch.no_grad():
            source = dict(model.named_parameters())
            if self.stale is not None:
                self.history.setdefault(step, self._trainable(model))
                for old in [s for s in self.history if s < step - self.stale]:
                    del self.history[old]
                source.update(self.history[max(step - self.stale, 0)])
            for name, p in self.copy.named_parameters():
                p.copy_(source[name])
            if self.bits is not None:
                for module in self.copy.modules():
                    if isinstance(module, torch.nn.Linear):
                        module.weight.copy_(quantize_per_channel(module.weight, self.bits))
        return self.copy, None

    @contextlib.contextmanager
    def generating(self, model, step: int):
        """Within the block, ``model.generate`` generates with the sampler at `step` (nests with the captures of
        `trl_rpp.records.capture`, which wrap it)."""
        from transformers import LogitsProcessor

        from trl_rpp.patches import generate_with_processor

        module, bias = self.at(model, step)
        with contextlib.ExitStack() as stack:
            if module is not model:
                model.generate = module.generate  # the copy generates; the captures wrap this
                stack.callback(lambda: model.__dict__.pop("generate", None))
            if bias is not None:

                class AddBias(LogitsProcessor):
                    def __call__(self, input_ids, scores):
                        return scores + bias.to(scores.dtype)

                stack.enter_context(generate_with_processor(model, AddBias(), first=True))
            yield


def token_truncate(clip_max: float = IS_CLIP_MAX):
    """A `correct` for `sampled_trainer`: TRL's ``token_truncate`` importance sampling, each valid token's loss
    weighted by ``min(exp(log p_old - log q), clip_max)``; logs the share of valid tokens that were truncated."""
    import torch

    def correct(batch, old, diff, mask, metrics):
        ratio = torch.exp(diff)  # [B, T], TRL's token-level ratio; 1 at padding (diff is 0 there)
        metrics["mismatch/is_truncated_fraction"].append(((ratio > clip_max) & mask).sum().item() / max(mask.sum().item(), 1))
        batch["old_per_token_logps"] = old
        batch["importance_sampling_ratio"] = ratio.clamp(max=clip_max)

    return correct


def token_truncate_weight_fn(clip_max: float = IS_CLIP_MAX):
    """What `RPPTrainer` sets as ``_rpp_weight_fn`` from the config when score centering meets TRL's
    ``token_truncate`` correction with vLLM: the correction's coefficients reweighted (docs/score_centering.md)."""
    from trl_rpp.score_centering import importance_weight_fn

    return importance_weight_fn(SimpleNamespace(
        use_vllm=True, vllm_importance_sampling_correction=True, vllm_importance_sampling_mode="token_truncate",
        vllm_importance_sampling_clip_min=None, vllm_importance_sampling_clip_max=clip_max,
    ))


def sampled_trainer(base, generating, correct=None, weight_fn=None, setup=None, name=None):
    """`base` (RPPTrainer) whose completions come from a sampler that is not the trainer (studies 2 and 4).

    - ``generating(model, step)``: a context manager within which ``model.generate`` samples from the sampler that
      goes with the trainer's `model` after `step` optimizer steps;
    - ``setup(model)``: called once with the trainer's model after the trainer is built (before its optimizer);
    - ``correct(batch, old, diff, mask, metrics)``: an importance-sampling correction applied to the batch, from the
      trainer's log-probs at generation ``old`` ``[B, T]`` and ``diff = log p_old - log q`` ``[B, T]`` (0 at padding);
    - ``weight_fn``: replaces ``RPPTrainer._rpp_weight_fn`` (score centering's coefficient reweighting).

    The sampler's log q per token reaches the trainer by the trainer's own record when it keeps one (score
    centering's top-k capture, or the replay's kept sets with `replay_sampler_support`: ``log q_S``), else by a
    capture of the sampled token's log-prob inside the sampler's ``generate``: after every warper when the sampler
    truncates (`SamplerSupportCapture`, the trainer's record width `2 top_k`: ``log q_S``, what vLLM's processed
    log-probs give TRL),
    else a top-1 capture of the full softmax.
    Every arm runs one no-grad trainer forward per generation batch for ``mismatch/abs_log_ratio_mean`` (the
    corrections need it for the ratio anyway), so step times stay comparable across arms.
    """
    import torch

    from trl_rpp.records.settings import record_width, support_bound
    from trl_rpp.records.capture import SamplerTopKCapture, capturing_generate, SamplerSupportCapture

    class SampledTrainer(base):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            if setup is not None:
                setup(self.accelerator.unwrap_model(self.model_wrapped))
            if weight_fn is not None:
                self._rpp_weight_fn = weight_fn

        def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, *args, **kwargs):
            model = self.accelerator.unwrap_model(self.model_wrapped)
            with generating(model, self.state.global_step):
                if self._rpp_width:  # RPPTrainer's own capture (score centering, replay) wraps the sampler's generate
                    self._q_capture = None
                    return super()._generate_single_turn(prompt_ids, images, multimodal_fields, num_generations, *args, **kwargs)
                a = self.args
                settings = dict(top_k=a.top_k, top_p=a.top_p, min_p=a.min_p, **(a.generation_kwargs or {}))
                bound = support_bound(settings, vllm=False, replay=True)  # top_k when something truncates, else None
                self._q_capture = (SamplerTopKCapture(1, self.temperature) if bound is None
                                   else SamplerSupportCapture(record_width(bound)))  # the trainer's own width
                with capturing_generate(model, self._q_capture, last=bound is not None):
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
            m = self._metrics["train" if self.model.training else "eval"]
            m["mismatch/abs_log_ratio_mean"].append((diff.abs().sum() / mask.sum().clamp(min=1)).item())
            if correct is not None:
                correct(batch, old, diff, mask, m)
            return batch

    SampledTrainer.__name__ = name or f"Sampled{base.__name__}"
    return SampledTrainer


def mismatch_trainer(base, sampler: Sampler, correction: str):
    """`base` (RPPTrainer) whose completions come from `sampler`, with one correction (see the module docstring)."""
    truncate = correction in ("token_truncate", "sc32_token_truncate")
    return sampled_trainer(
        base, sampler.generating, correct=token_truncate() if truncate else None,
        weight_fn=token_truncate_weight_fn() if correction == "sc32_token_truncate" else None,
        setup=sampler.attach, name=f"Mismatched{sampler.source}{correction}Trainer",
    )


# ---------------------------------------------------------------------------------------------------------------
# One run
# ---------------------------------------------------------------------------------------------------------------


def copy_prob(model, tokenizer, rows, logit_bias=None, batch_size: int = 128, top_k: int | None = None) -> float:
    """Mean over `rows` of the teacher-forced probability (temperature 1) of each answer character given the prompt
    and the answer's previous characters, averaged over the answer's positions: the expected per-position credit of
    sampling one position on the right prefix. ``logit_bias`` ``[V]`` is added to the logits (a biased sampler);
    with `top_k` the probability is the truncated sampler's, ``q_S`` over the top-k ids (transformers' top-k rule,
    ties kept), 0 for an answer outside them (study 5)."""
    import torch

    was_training = model.training
    model.eval()
    total = 0.0
    with torch.no_grad():
        for start in range(0, len(rows), batch_size):
            chunk = rows[start : start + batch_size]
            seqs, spans = [], []
            for r in chunk:
                prompt = tokenizer(r["prompt"], add_special_tokens=False).input_ids
                answer = tokenizer(r["answer"], add_special_tokens=False).input_ids
                seqs.append(prompt + answer)
                spans.append((len(prompt), len(answer)))
            width = max(map(len, seqs))
            ids = torch.full((len(seqs), width), tokenizer.pad_token_id)
            attention = torch.zeros(len(seqs), width, dtype=torch.long)
            for i, s in enumerate(seqs):  # right padding: no real token attends to a pad
                ids[i, : len(s)], attention[i, : len(s)] = torch.tensor(s), 1
            logits = model(input_ids=ids.to(model.device), attention_mask=attention.to(model.device)).logits.float()
            if logit_bias is not None:
                logits = logits + logit_bias.to(logits.device)
            if top_k is not None:
                kth = logits.topk(top_k, dim=-1).values[..., -1:]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            logp = torch.log_softmax(logits, -1)
            for i, (p0, n) in enumerate(spans):
                pos = torch.arange(p0 - 1, p0 - 1 + n, device=logp.device)
                targets = ids[i, p0 : p0 + n].to(logp.device)
                total += logp[i, pos, targets].exp().mean().item()
    model.train(was_training)
    return total / len(rows)


def greedy_credit(model, tokenizer, rows, max_new: int) -> float:
    """Mean `copy_credit_reward` of greedy completions."""
    import torch

    was_training = model.training
    model.eval()
    tokenizer.padding_side = "left"
    with torch.no_grad():
        enc = tokenizer([r["prompt"] for r in rows], return_tensors="pt", padding=True, add_special_tokens=False)
        out = model.generate(**enc.to(model.device), max_new_tokens=max_new, do_sample=False,
                             pad_token_id=tokenizer.pad_token_id)
        texts = tokenizer.batch_decode(out[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)
    model.train(was_training)
    return sum(copy_credit_reward(texts, [r["answer"] for r in rows])) / len(rows)


def _round(x, digits=4):
    return float(f"{x:.{digits}g}") if x is not None and math.isfinite(x) else x


def run_one(condition: str, arm: str, seed: int, opts):
    """Train one (condition, arm, seed) in this process; write `<out>/<condition>/<arm>/seed<k>/summary.json`."""
    import torch
    from datasets import Dataset
    from transformers import AutoTokenizer

    from trl_rpp import RPPConfig, RPPTrainer
    from trl_rpp.testing.tiny import build_tiny_model

    os.environ.setdefault("WANDB_MODE", "disabled")
    torch.set_num_threads(opts.threads)
    if arm not in ALL_ARMS:
        raise ValueError(f"--arms: unknown arm {arm!r}; accepted: {', '.join(ALL_ARMS)}")
    outdir = os.path.join(opts.out, condition, arm, f"seed{seed}")
    os.makedirs(outdir, exist_ok=True)
    path = build_tiny_model(os.path.join(opts.out, "tiny-model"))  # built by `sweep` before its jobs start
    tokenizer = AutoTokenizer.from_pretrained(path)
    train, heldout, max_new = copy_task_data(opts, seed)
    sampler = Sampler(condition, in_trainer=arm == "onpolicy")
    sc = arm.startswith("sc")
    args = RPPConfig(
        output_dir=outdir, use_cpu=True, bf16=False, report_to="none", save_strategy="no", seed=seed,
        per_device_train_batch_size=opts.prompts * opts.generations, num_generations=opts.generations,
        max_completion_length=max_new, learning_rate=opts.lr, max_steps=opts.steps, logging_steps=1,
        temperature=1.0, disable_dropout=True, advantage_estimator="reinforce_plus_plus_baseline", use_kl_loss=False,
        score_centering=sc, score_centering_top_k=len(tokenizer) if arm == "sc_full" else 32,
    )
    correction = "uncorrected" if arm == "onpolicy" else arm
    trainer_cls = mismatch_trainer(RPPTrainer, sampler, correction)

    def evaluate(step):
        model = trainer.accelerator.unwrap_model(trainer.model_wrapped)
        module, bias = sampler.at(model, step)
        # With `onpolicy` the trainer's own output layer adds the bias, and `module` is the trainer.
        return dict(copy_prob=copy_prob(model, tokenizer, heldout), sampler_copy_prob=copy_prob(module, tokenizer, heldout, bias))

    clock = step_clock(evaluate, opts.eval_every)
    trainer = trainer_cls(model=path, reward_funcs=copy_credit_reward, args=args, train_dataset=Dataset.from_list(train),
                          processing_class=tokenizer, callbacks=[clock])
    before = evaluate(0)
    trainer.train()
    after = evaluate(opts.steps)
    model = trainer.accelerator.unwrap_model(trainer.model_wrapped)
    after["greedy_credit"] = greedy_credit(model, tokenizer, heldout, max_new)
    curves = run_curves(before, clock.curve, after, opts.steps)
    history = [h for h in trainer.state.log_history if "reward" in h]
    summary = dict(
        condition=condition, arm=arm, seed=seed,
        **{f"{k}_before": v for k, v in before.items()}, **{f"{k}_after": v for k, v in after.items()},
        **{f"{k}_area": curve_area(c) for k, c in curves.items()},
        curves={k: [[s, _round(y)] for s, y in c] for k, c in curves.items()},
        series={k: [_round(h.get(k)) for h in history] for k in SERIES_KEYS if any(k in h for h in history)},
        step_seconds=[_round(t) for t in clock.times], **process_facts(opts.threads),
        settings={k: getattr(opts, k) for k in RUN_SETTINGS},
    )
    return write_summary(outdir, summary)  # one line: about 18 kB per run (300 steps)


# ---------------------------------------------------------------------------------------------------------------
# The sweep
# ---------------------------------------------------------------------------------------------------------------

RUN_SETTINGS = ("steps", "prompts", "generations", "lr", "heldout", "eval_every", "lengths")


def arms_of(condition, arms):
    """The arms of `arms` a condition runs: with a bias (the sanity check) only `BIAS_ARMS`, elsewhere all but
    `onpolicy`."""
    if condition.startswith("bias"):
        return [a for a in arms if a in BIAS_ARMS]
    return [a for a in arms if a != "onpolicy"]


def sweep(opts):
    """Every (condition, arm, seed) without a summary.json, `--jobs` at a time: seeds outermost, so that a sweep
    cut short has the same seeds in every cell; then conditions, then arms. A failed run stops the sweep (after the
    runs in flight) and raises with its command."""
    from trl_rpp.testing.tiny import build_tiny_model

    build_tiny_model(os.path.join(opts.out, "tiny-model"))  # once, before parallel runs would race to build it
    todo = pending_runs(__file__, opts, RUN_SETTINGS,
                        cells=[((c,), arms_of(c, opts.arms)) for c in opts.conditions])
    run_jobs(todo, opts.jobs)


# ---------------------------------------------------------------------------------------------------------------
# The report
# ---------------------------------------------------------------------------------------------------------------

# The contrasts of the decision rule (docs/evidence.md, study 4): (name, arm, control).
CONTRASTS = (("sc32 − uncorrected", "sc32", "uncorrected"),
             ("(sc32 + IS) − IS", "sc32_token_truncate", "token_truncate"),
             ("sc_full − sc32", "sc_full", "sc32"),
             ("IS − uncorrected", "token_truncate", "uncorrected"),
             ("sc32 − IS", "sc32", "token_truncate"))  # H2
# The primary metric first: the area under the learning curve scored under the sampler.
METRICS = (("sampler_copy_prob_area", "area, sampler"), ("sampler_copy_prob_after", "final, sampler"),
           ("copy_prob_area", "area, trainer"), ("copy_prob_after", "final, trainer"))


def read_run(where):
    """What the report reads of one run's summary.json (kept in the study's table, `run_table`): the scores, the
    CPU time, the sampler's learning curve, the per-step gap, and the training reward where the bias sanity check
    compares runs step by step."""
    summary = json.load(open(os.path.join(where, "summary.json")))
    series = summary["series"]
    keep = ["mismatch/abs_log_ratio_mean"] + (["reward"] if summary["condition"].startswith("bias") else [])
    return dict({k: summary[k] for k in ("condition", "arm", "seed", *(k for k, _ in METRICS), "cpu_seconds")},
                series={k: series[k] for k in keep if k in series},
                curves={"sampler_copy_prob": summary["curves"]["sampler_copy_prob"]})


def load_study(root):
    """Every run's record: from the runs' summary.json files when there are any (also written to
    `<root>/runs.parquet`), else from that table."""
    return run_table.Runs(run_table.load(root, run_table.raw_runs(root, read_run, depths=(3,))))


def load_runs(root, condition, study=None):
    """Per arm, the records of the runs of `condition` (of `study`, `load_study(root)` by default)."""
    study = load_study(root) if study is None else study
    runs = {}
    for arm in study.children(condition):
        for d in study.children(condition, arm):
            runs.setdefault(arm, []).append({"series": {}, **study.get(condition, arm, d)})
    return runs


def report(opts):
    """`<out>/report.md` and `report.json` (docs/evidence.md copies the summary table) and the figure, from every
    run under `--out` (`load_study`)."""
    study = load_study(opts.out)
    conditions = [c for c in CONDITIONS if study.has(c)]
    conditions += [c for c in study.children() if SOURCE.match(c) and c not in conditions]
    out, lines = {}, ["### Study 4: results", "",
                      "Held-out copy probability (teacher-forced, per position, exact), mean [95% t interval] over "
                      "seeds, final and area under the learning curve, each under the sampler and under the trainer. "
                      "Contrasts: unpaired difference of means, Welch 95% interval, two-sided permutation p.", ""]
    for condition in conditions:
        runs = load_runs(opts.out, condition, study)
        if not runs:
            continue
        rows = {}
        lines += [f"**{condition}**", "",
                  "| arm | seeds | " + " | ".join(name for _, name in METRICS) + " | mean abs log p − log q | s/run |",
                  "|---|---|" + "---|" * (len(METRICS) + 2)]
        for arm in ALL_ARMS:
            if arm not in runs:
                continue
            rs = runs[arm]
            gap = [v for r in rs for v in r["series"].get("mismatch/abs_log_ratio_mean", []) if v is not None]
            curves = [r["curves"]["sampler_copy_prob"] for r in rs]
            n = min(map(len, curves))
            rows[arm] = dict(seeds=[r["seed"] for r in rs], **{k: [r[k] for r in rs] for k, _ in METRICS},
                             gap=sum(gap) / len(gap) if gap else None,
                             cpu_seconds=sum(r["cpu_seconds"] for r in rs) / len(rs),
                             mean_sampler_curve=[[curves[0][j][0], sum(c[j][1] for c in curves) / len(curves)]
                                                 for j in range(n)])
            cells = [mean_ci(rows[arm][k]) for k, _ in METRICS]
            lines.append(f"| `{arm}` | {len(rs)} | " + " | ".join(cells) +
                         f" | {rows[arm]['gap']:.3g} | {rows[arm]['cpu_seconds']:.0f} |")
        lines += ["", "| contrast | " + " | ".join(name for _, name in METRICS) + " |", "|---|" + "---|" * len(METRICS)]
        contrasts = {}
        for name, arm, control in CONTRASTS:
            if arm in rows and control in rows:
                contrasts[name] = {k: contrast(rows[arm][k], rows[control][k]) for k, _ in METRICS}
                lines.append(f"| {name} | " + " | ".join(fmt_contrast(contrasts[name][k]) for k, _ in METRICS) + " |")
        sanity = None
        if "onpolicy" in rows and "sc_full" in rows:
            contrasts["sc_full − onpolicy"] = {k: contrast(rows["sc_full"][k], rows["onpolicy"][k]) for k, _ in METRICS}
            lines.append("| sc_full − onpolicy | " + " | ".join(
                fmt_contrast(contrasts["sc_full − onpolicy"][k]) for k, _ in METRICS) + " |")
            sanity = bias_sanity(runs["sc_full"], runs["onpolicy"])
            lines += ["", "`sc_full` against `onpolicy`, per seed: the first step whose training reward differs "
                      "(4 significant digits), and the final score's difference under the sampler.", ""]
            lines += [f"- seed {r['seed']}: " + (f"first different step {r['first_different_step']} of {r['steps']}"
                                                 if r["first_different_step"] else f"the same at all {r['steps']} steps")
                      + f"; final |difference| {r['final_abs_diff']:.2g}" for r in sanity]
        lines.append("")
        out[condition] = dict(arms=rows, contrasts=contrasts, **({"sanity": sanity} if sanity is not None else {}))
    lines[4:4] = _summary_lines(out, conditions)  # after the introduction
    os.makedirs(opts.out, exist_ok=True)
    with open(os.path.join(opts.out, "report.json"), "w") as f:
        json.dump(out, f, indent=1)
    with open(os.path.join(opts.out, "report.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    if any(c in out for c in conditions):
        if not getattr(opts, "no_figures", False):
            plot(opts, out, conditions)
    print("\n".join(lines))
    return out


def bias_sanity(sc_full, onpolicy):
    """Per seed run in both arms: the first step whose logged training reward differs (None: none differs) and the
    absolute difference of the final score under the sampler. Before a sampled token flips the two are one run."""
    by_seed = {r["seed"]: r for r in onpolicy}
    rows = []
    for r in sorted(sc_full, key=lambda r: r["seed"]):
        other = by_seed.get(r["seed"])
        if other is None:
            continue
        a, b = r["series"]["reward"], other["series"]["reward"]
        first = next((i + 1 for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
        rows.append(dict(seed=r["seed"], first_different_step=first, steps=min(len(a), len(b)),
                         final_abs_diff=abs(r["sampler_copy_prob_after"] - other["sampler_copy_prob_after"])))
    return rows


def _summary_lines(out, conditions):
    """The page's table (docs/evidence.md, study 4): per condition, the primary metric's contrasts."""
    key = METRICS[0][0]
    lines = [f"**Summary** ({METRICS[0][1]}): `uncorrected`, mean [95% t]; contrasts, Welch 95% interval "
             "(permutation p below).", "",
             "| condition | seeds | abs log p − log q | `uncorrected` | " + " | ".join(n for n, _, _ in CONTRASTS) + " |",
             "|---|---|---|---|" + "---|" * len(CONTRASTS)]
    for condition in conditions:
        if condition not in out or condition.startswith("bias") or "uncorrected" not in out[condition]["arms"]:
            continue
        arms, contrasts = out[condition]["arms"], out[condition]["contrasts"]
        seeds = "/".join(str(n) for n in sorted({len(r["seeds"]) for r in arms.values()}))
        cells = [fmt_interval(contrasts.get(name, {}).get(key)) for name, _, _ in CONTRASTS]
        gap = arms["uncorrected"]["gap"]  # nats per token, mean over the uncorrected runs' steps
        mantissa, exponent = f"{gap:.1e}".split("e")
        gap = f"{gap:.2g}" if gap >= 1e-3 else f"{mantissa}e{int(exponent)}"
        lines.append(f"| `{condition}` | {seeds} | {gap} | {mean_ci(arms['uncorrected'][key])} | "
                     + " | ".join(cells) + " |")
    return lines + [""]


def plot(opts, out, conditions):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    conditions = [c for c in conditions if c in out]
    fig, axes = plt.subplots(1, 4, figsize=(21, 4))
    # Learning curves at the condition with the largest mismatch that is not the bias sanity check.
    gap_of = {c: max((r["gap"] or 0.0) for r in out[c]["arms"].values()) for c in conditions if not c.startswith("bias")}
    curve_at = max(gap_of, key=gap_of.get) if gap_of else conditions[0]
    for i, arm in enumerate(ALL_ARMS):
        for ax, key in ((axes[0], "sampler_copy_prob_area"), (axes[1], "sampler_copy_prob_after")):
            xs, ys, es = [], [], []
            for j, c in enumerate(conditions):
                values = out[c]["arms"].get(arm, {}).get(key)
                if values:
                    n, m = len(values), sum(values) / len(values)
                    half = t_quantile(0.975, n - 1) * math.sqrt(sum((v - m) ** 2 for v in values) / (n - 1) / n) if n > 1 else 0
                    xs.append(j + (i - 2.5) * 0.08)
                    ys.append(m)
                    es.append(half)
            if xs:
                ax.errorbar(xs, ys, yerr=es, fmt="o", color=f"C{i}", label=arm, capsize=3)
        gaps = [(j, out[c]["arms"][arm]["gap"]) for j, c in enumerate(conditions)
                if arm in out[c]["arms"] and out[c]["arms"][arm]["gap"] is not None]
        if gaps:
            axes[2].plot([g[0] for g in gaps], [g[1] for g in gaps], "o", color=f"C{i}")
        row = out[curve_at]["arms"].get(arm)
        if row:
            axes[3].plot([p[0] for p in row["mean_sampler_curve"]], [p[1] for p in row["mean_sampler_curve"]],
                         color=f"C{i}", label=f"{arm} ({len(row['seeds'])} seeds)")
    for ax, title in zip(axes, ("area under the learning curve, under the sampler (95% t)",
                                "final copy probability under the sampler (95% t)", "mean |log p − log q| per token")):
        ax.set_xticks(range(len(conditions)), conditions)
        ax.set(title=title, xlabel="mismatch source")
    axes[2].set_yscale("log")
    axes[3].set(title=f"{curve_at}: under the sampler, mean over seeds", xlabel="step")
    axes[0].legend(fontsize=8)
    fig.suptitle("Study 4: score centering against sampler–trainer mismatch (tiny model, multi-position copy)")
    fig.tight_layout()
    os.makedirs(opts.figures, exist_ok=True)
    fig.savefig(os.path.join(opts.figures, "evidence_mismatch_study.png"), dpi=110)
    plt.close(fig)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=RESULTS)
    ap.add_argument("--figures", default=None, help="--report: default docs/figures for the default --out, else <out>/figures")
    ap.add_argument("--conditions", default=",".join(CONDITIONS), help="mismatch sources: stale<N>, bf16, int8, int4, bias<sigma>")
    ap.add_argument("--arms", default=",".join(ALL_ARMS),
                    help=f"accepted: {', '.join(ALL_ARMS)}; a bias condition runs only {', '.join(BIAS_ARMS)}")
    ap.add_argument("--seeds", default=",".join(map(str, range(20))))
    add_copy_task_flags(ap, STEPS, LR, LENGTHS)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--jobs", type=int, default=1)
    ap.add_argument("--run", nargs=3, metavar=("CONDITION", "ARM", "SEED"), default=None, help="internal: one run")
    ap.add_argument("--report", action="store_true")
    ap.add_argument("--no_figures", action="store_true", help="--report: the tables only")
    opts = ap.parse_args()
    opts.lengths = [int(x) for x in str(opts.lengths).split(",")]
    opts.seeds = [int(x) for x in opts.seeds.split(",")]
    opts.arms = opts.arms.split(",")
    opts.conditions = opts.conditions.split(",")
    for arm in opts.arms:
        if arm not in ALL_ARMS:
            raise ValueError(f"--arms: unknown arm {arm!r}; accepted: {', '.join(ALL_ARMS)}")
    for c in opts.conditions:
        Sampler(c)  # raises on an unknown source
    if opts.figures is None:
        opts.figures = "docs/figures" if os.path.normpath(opts.out) == RESULTS else os.path.join(opts.out, "figures")
    if opts.run:
        condition, arm, seed = opts.run
        run_one(condition, arm, int(seed), opts)
    elif opts.report:
        report(opts)
    else:
        sweep(opts)
        report(opts)


if __name__ == "__main__":
    main()
