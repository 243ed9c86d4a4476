"""One check of a GPU machine: numerics, score centering's, replay's and the log-prob heads' cost at Qwen3's
vocabulary, and step time vs GRPO.

    python benchmarks/gpu_check.py                           # on cuda: at most 9 minutes on one H200
    python benchmarks/gpu_check.py --parts lm_head           # only the named parts
    python benchmarks/gpu_check.py --parts off_policy        # generation ahead on a vLLM server (needs vLLM)
    python benchmarks/gpu_check.py --device cpu --tiny       # the CPU rehearsal (tests/test_gpu_check.py)

Writes `report.json` and `report.md` under `--out` (default `outputs/gpu_check`) and prints the markdown. Each part
runs in a child process of its own with its own time budget (`BUDGETS_S`), so a slow or hung part is killed and
recorded as `timed_out` while the others still run; a crash in one part is recorded as `failed`. The parts:

numerics: the trainer-level reference cases of tests/test_trainer.py on `--device`, for both estimators, in float32
    and with `bf16=True` (autocast, the float32 tiny Llama of `trl_rpp.testing.tiny`): (1) the advantages of every
    generation batch against the float64 reference of tests/support/reference.py, computed from the rewards and log-probs
    the trainer captured; (2) the gradient the optimizer sees at the first step against the gradient of the spec
    objective (`spec_step_loss` of tests/test_trainer.py) on a float64 copy of the initial weights.
    Tolerances. float32: those of the CPU tests (advantages rtol = atol = 1e-5; gradient rtol = 1e-4, atol = 1e-6).
    bf16: the advantage arithmetic runs on the captured values in float32 in both modes, so the float32 tolerance
    stands. The gradient is compared by its relative L2 error per parameter tensor, `||g - g64|| / ||g64||`.
    Derivation: bf16 keeps 8 significant bits, so one rounding is off by at most u = 2^-9 relative. Autocast rounds
    the two operands of each matmul; the tiny model's loss reaches a weight through at most 2 layers x (q/k/v, o,
    gate/up, down) + lm_head = 9 matmuls, i.e. <= 18 roundings forward, and the backward pass rounds as many again:
    to first order the error is <= 36 u = 0.07, so the bound is 2^-3 = 0.125 (the measured error is reported).
score_centering: a random-init model shaped like Qwen3-0.6B (28 layers, hidden 1024, vocabulary 151,936; `--tiny`:
    1 layer, hidden 64, vocabulary 4096) in bf16, one loss forward + backward (`RPPTrainer._compute_loss`, the batch
    of benchmarks/score_centering_memory.py, B x T = 8 x 2048 completion tokens) with score centering on (k = 32)
    and off, alternating. Reported: the median step time, the step's peak memory above what was allocated before it
    and the process's peak (cuda: `torch.cuda.max_memory_allocated`; cpu: peak RSS as in
    score_centering_memory.py). Targets, on vs off: memory <= 1.10x (on the step's peak above its start), time
    <= 1.05x; reported as pass/fail, they do not change the exit code.
sampling: the same model and loss step, four arms at `top_k=20`: no correction (`replay_sampler_support=False`,
    GRPO's fused log-prob head), the kept set replayed, score centering (no truncation, k = 32), and both (the head
    the whole kept set). Reported: each arm's median step time and step peak, as ratios to no correction; target
    <= 1.03x the time (pass/fail, not the exit code). The capture at generation is not part of this step.
lm_head: the arms of benchmarks/lm_head_memory.py (its `build_arm`) on `--device`: TRL's fused head, replay
    (`top_k` = 20), score centering (k = 32, full softmax in tiles), both; one forward + backward of the head's
    log-probs through a 1-layer Llama of hidden size 128 in bf16, V = 151,936, N = 2,048 to 16,384 positions
    (`--tiny`: V = 512, hidden 16, N = 64 and 128). Per arm and N, after one warm-up step, alternating rounds: the
    median step time (synchronized) and the step's peak above what was allocated before it (`_Memory`; parameter
    gradients are allocated at build). Targets at the largest N, against the fused head: replay <= 0.2x in memory
    and in time, score centering's peak <= 1.10x; reported as pass/fail, they do not change the exit code.
step_time: `RPPTrainer` (reinforce_plus_plus and reinforce_plus_plus_baseline) against `GRPOTrainer(beta=0.04)`
    on that same model, bf16, transformers generation of a fixed length (`min_new_tokens` = max_completion_length,
    so no early EOS), arms alternating in one process as in benchmarks/step_time.py; the first step of each round
    is warm-up. Reported: median step time per arm, ratio to GRPO, mean completion length.
off_policy (only when `--parts` names it; it needs vLLM, which benchmarks/gpu_wheels.sh does not bring, and says
    "skipped" without it): the two arms of benchmarks/off_policy.py, `max_staleness` 0 and 1, REINFORCE++-baseline
    against one vLLM server started with `trl-rpp vllm-serve --model M --port P --weight_sync nccl` (`--dtype
    bfloat16 -- --enforce-eager`: no compilation or CUDA graph capture, so that it starts within the budget), on a
    random-init Qwen3 of Qwen3-0.6B's shape (`--tiny`: 2 layers, hidden 128, vocabulary 4,096), bf16, a batch of 64
    (8 per prompt) of completions of exactly 256 tokens (vLLM's `ignore_eos`), rounds alternating as there. The
    trainer takes the first visible GPU and the server the last; NCCL refuses two ranks on one GPU, so with a single
    GPU the server shares it (`--gpu-memory-utilization 0.3`) and the weights go through a directory
    (`--weight_sync disk`), as on `--device cpu`. One trainer (max_staleness=1) runs both arms, its generation ahead
    detached in the lag-0 rounds: a server keeps one NCCL group, that of the last trainer that joined it. Reported:
    each arm's median step, generation, training and sync time, the ideal `sync + max(generation, training)` and
    lag 1's step against it (target <= 1.15) and against lag 0's (target <= 0.75 where generation and training are
    within 2x); pass/fail, not the exit code.
environment: versions, the device's name, each part's wall time.

Exit code: 0 when every part run (all, or those `--parts` names) finished and every numerics case is within its
tolerance, else 1.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
for p in (ROOT, os.path.join(ROOT, "tests"), os.path.join(ROOT, "tests", "support"), HERE):  # library, tests/ and
    # their helpers (tests/support/), and the other benchmarks, by import
    if p not in sys.path:
        sys.path.insert(0, p)
warnings.filterwarnings("ignore")
os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

# Seconds per part (child process); the sum of the default parts' plus the model build stays under 9 minutes on one
# H200 (off_policy, which starts a vLLM server, runs only when named).
BUDGETS_S = {"numerics": 90, "score_centering": 120, "sampling": 60, "lm_head": 60, "step_time": 180,
             "off_policy": 420}
# The parts a run without --parts runs; off_policy needs vLLM and runs when `--parts` names it.
DEFAULT_PARTS = ("numerics", "score_centering", "sampling", "lm_head", "step_time")
ESTIMATORS = ("reinforce_plus_plus", "reinforce_plus_plus_baseline")
TOL_F32 = {"advantages": dict(rtol=1e-5, atol=1e-5), "gradient": dict(rtol=1e-4, atol=1e-6)}
TOL_BF16_GRAD_REL_L2 = 2.0**-3
MEMORY_TARGET, TIME_TARGET = 1.10, 1.05
SAMPLING_TOP_K, SAMPLING_TIME_TARGET = 20, 1.03  # the truncation of the sampling part, and its target vs no correction
# Part lm_head, at its largest N, against the fused head: replay's memory and time, score centering's memory.
LM_HEAD_TARGETS = {("replay", "memory"): 0.2, ("replay", "time"): 0.2, ("score_centering", "memory"): 1.10}

# Qwen3-0.6B's shape; `--tiny` shrinks it (CPU bf16 matmuls are slow, a vocabulary-sized head most of all).
QWEN3_06B = dict(vocab_size=151_936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                 num_key_value_heads=8, head_dim=128)
QWEN3_TINY = dict(vocab_size=4096, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16)
SIZES = {  # score centering: batch x completion tokens; step time: batch (= prompts x 8) x completion tokens
    False: dict(sc_batch=8, sc_length=2048, st_batch=32, st_length=128, st_rounds=3, st_steps=4, sc_rounds=5,
                lm_vocab=151_936, lm_hidden=128, lm_positions=(2048, 4096, 8192, 16384), lm_rounds=5,
                op_batch=64, op_generations=8, op_length=256, op_rounds=2, op_steps=6, op_warmup=2),
    True: dict(sc_batch=2, sc_length=32, st_batch=8, st_length=8, st_rounds=2, st_steps=2, sc_rounds=2,
               lm_vocab=512, lm_hidden=16, lm_positions=(64, 128), lm_rounds=2,
               op_batch=4, op_generations=2, op_length=16, op_rounds=2, op_steps=4, op_warmup=1),
}
# Part off_policy with --tiny: a small Qwen3 whose head size vLLM's CPU attention has kernels for (64).
QWEN3_OFF_POLICY_TINY = dict(vocab_size=4096, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                             num_attention_heads=2, num_key_value_heads=2, head_dim=64)


def sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


# ---------------------------------------------------------------------------------------------------------------
# The model of parts score_centering and step_time
# ---------------------------------------------------------------------------------------------------------------


def build_qwen3(path, tiny, seed=0, shape=None):
    """Random-init Qwen3 (vocabulary 151,936, tied embeddings as in Qwen3-0.6B) saved in bf16 with the char
    tokenizer (ids past its 46 tokens decode to nothing, which no reward here reads). `shape`: other sizes."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from trl_rpp.testing.tiny import char_tokenizer

    tokenizer = char_tokenizer()
    config = Qwen3Config(
        max_position_embeddings=4096, tie_word_embeddings=True, rope_theta=1e6,
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id,
        **(shape or (QWEN3_TINY if tiny else QWEN3_06B)),
    )
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(config).to(torch.bfloat16)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return sum(p.numel() for p in model.parameters())


# ---------------------------------------------------------------------------------------------------------------
# Part numerics
# ---------------------------------------------------------------------------------------------------------------


def _advantage_check(trainer, estimator, args):
    """(max |advantages - float64 reference|, within the float32 tolerance) over every generation batch, with the
    reference built from the captured rewards and log-probs as tests/test_trainer.py builds it."""
    from reference import ref_global_masked_normalize, ref_group_mean_advantages, ref_reinforce_pp_returns

    worst, ok = 0.0, True
    for batch, rpf in zip(trainer.generation_batches, trainer.captured_rewards):
        rewards = (rpf.double().cpu() * torch.tensor(args.reward_weights, dtype=torch.float64)).sum(1).tolist()
        mask = batch["completion_mask"].cpu().tolist()
        if estimator == "reinforce_plus_plus":
            old, ref = batch["old_per_token_logps"].double().cpu(), batch["ref_per_token_logps"].double().cpu()
            raw = ref_reinforce_pp_returns(rewards, old.tolist(), ref.tolist(), mask, args.kl_coef, args.gamma)
        else:
            raw = ref_group_mean_advantages(rewards, mask, args.num_generations)
        want = torch.tensor(ref_global_masked_normalize([raw], [mask])[0][0], dtype=torch.float64)
        got = batch["advantages"].double().cpu()
        worst = max(worst, (got - want).abs().max().item())
        ok = ok and torch.allclose(got, want, **TOL_F32["advantages"])
    return worst, ok


def numerics_case(tmpdir, model_path, device, estimator, bf16):
    from transformers import AutoModelForCausalLM, TrainerCallback

    from test_trainer import spec_step_loss
    from trainer_helpers import CaptureTrainer, length_reward, make_args
    from trl_rpp.testing.tiny import copy_first_char_reward, copy_task_dataset

    grads = []

    class GradCapture(TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, model=None, **kw):
            grads.append({n: p.grad.detach().double().cpu() for n, p in model.named_parameters() if p.grad is not None})

    kw = dict(max_steps=1, max_grad_norm=0.0, use_cpu=device == "cpu", bf16=bf16)
    if estimator == "reinforce_plus_plus":
        kw.update(kl_coef=0.05, gamma=0.9)
    from pathlib import Path

    args = make_args(Path(tmpdir) / f"{estimator}-{int(bf16)}", estimator, **kw)
    trainer = CaptureTrainer(model=model_path, reward_funcs=[copy_first_char_reward, length_reward], args=args,
                             train_dataset=copy_task_dataset(32), callbacks=[GradCapture()])
    trainer.train()
    assert len(grads) == 1 and trainer.generation_batches, "the trainer ran no optimizer step"
    adv_err, advantages_ok = _advantage_check(trainer, estimator, args)

    model64 = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float64)
    model64.train()
    cpu_inputs = [{k: (v.cpu() if torch.is_tensor(v) else v) for k, v in mb.items()} for mb in trainer.loss_inputs]
    kl = args.kl_loss_coef if args.use_kl_loss else 0.0
    spec_step_loss(model64, cpu_inputs, args.epsilon, kl, args.temperature).backward()
    want = {n: p.grad for n, p in model64.named_parameters() if p.grad is not None}
    assert set(want) == set(grads[0]), "the trainer and the spec objective disagree on which weights get a gradient"
    rel_l2 = max(((grads[0][n] - want[n]).norm() / want[n].norm().clamp_min(1e-30)).item() for n in want)
    tol = TOL_F32["gradient"]
    elem_ok = all(torch.allclose(grads[0][n], want[n], **tol) for n in want)
    gradient_ok = (rel_l2 <= TOL_BF16_GRAD_REL_L2) if bf16 else elem_ok
    del trainer, model64
    gc.collect()
    return {
        "estimator": estimator, "precision": "bf16" if bf16 else "float32",
        "advantages_max_abs_error": adv_err, "advantages_ok": advantages_ok,
        "gradient_max_rel_l2": rel_l2, "gradient_elementwise_within_f32_tol": elem_ok,
        "gradient_tolerance": f"rel L2 <= {TOL_BF16_GRAD_REL_L2}" if bf16 else "rtol=1e-4, atol=1e-6 elementwise",
        "gradient_ok": gradient_ok, "ok": advantages_ok and gradient_ok,
    }


def part_numerics(opts, deadline):
    from trl_rpp.testing.tiny import build_tiny_model

    if opts.device == "cuda":  # float32 means IEEE float32 here, not TF32
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    tmp = tempfile.mkdtemp()
    model_path = build_tiny_model(os.path.join(tmp, "tiny"))
    cases = []
    for bf16 in (False, True):
        for estimator in ESTIMATORS:
            if time.monotonic() > deadline:
                cases.append({"estimator": estimator, "precision": "bf16" if bf16 else "float32", "ok": False,
                              "skipped": "part budget spent"})
                continue
            cases.append(numerics_case(tmp, model_path, opts.device, estimator, bf16))
    return {"cases": cases, "ok": all(c["ok"] for c in cases),
            "tolerances": {"float32": TOL_F32, "bf16_gradient_rel_l2": TOL_BF16_GRAD_REL_L2}}


# ---------------------------------------------------------------------------------------------------------------
# Part score_centering
# ---------------------------------------------------------------------------------------------------------------


class _Memory:
    """Peak memory of one step above what was allocated (cuda) or resident (cpu) right before it, in MiB."""

    def __init__(self, device):
        self.device = device
        if device == "cpu":
            import ctypes

            ctypes.CDLL("libc.so.6").mallopt(-3, 64 * 1024)  # freed large blocks leave the RSS (M_MMAP_THRESHOLD)

    def start(self):
        if self.device == "cuda":
            torch.cuda.reset_peak_memory_stats()
            self.before = torch.cuda.memory_allocated()
        else:
            from score_centering_memory import _reset_peak, _status_kib

            gc.collect()
            self.before = _status_kib("VmRSS") * 1024
            _reset_peak()

    def stop(self):
        if self.device == "cuda":
            peak = torch.cuda.max_memory_allocated()
        else:
            from score_centering_memory import _status_kib

            peak = _status_kib("VmHWM") * 1024
        return (peak - self.before) / 2**20, peak / 2**20


def score_centering_batch(B, P, T, k, V, generator):
    """The loss inputs of benchmarks/score_centering_memory.py (random ids and advantages, a sampler head of k ids
    holding half the mass), with each position's k distinct head ids a window of one random permutation of the
    vocabulary: its per-position `randperm` would take minutes at B x T = 16k and V = 151,936."""
    perm = torch.randperm(V, generator=generator)
    start = torch.randint(V, (B, T, 1), generator=generator)
    head_logps = torch.full((B, T, k), math.log(0.5 / k))
    return {
        "prompt_ids": torch.randint(V, (B, P), generator=generator),
        "prompt_mask": torch.ones(B, P, dtype=torch.long),
        "completion_ids": torch.randint(V, (B, T), generator=generator),
        "completion_mask": torch.ones(B, T, dtype=torch.long),
        "advantages": torch.randn(B, T, generator=generator),
        "sampler_head_ids": perm[(start + torch.arange(k)) % V],
        "sampler_head_logps": head_logps,
        "sampler_per_token_logps": head_logps[..., 0].clone(),
    }


def alternate_loss_steps(trainers, batches, rounds, deadline, device):
    """One loss forward + backward per arm per round, the arms' order reversed every other round, after one warm-up
    step each (parameter gradients and kernels are allocated there, not in a measured step); stops early rather than
    be killed. Returns the median step time, the largest step peak above its start and the process peak (MiB) per
    arm, and the rounds run. `trainers` and `batches`: by arm."""
    from score_centering_memory import one_step

    arms, batch = list(trainers), batches
    memory = _Memory(device)
    times, peaks = {arm: [] for arm in arms}, {arm: [] for arm in arms}
    for arm in arms:
        one_step(trainers[arm], batch[arm])
        trainers[arm].model.zero_grad(set_to_none=False)
    start = time.monotonic()
    for r in range(rounds):
        for arm in (arms if r % 2 == 0 else arms[::-1]):
            sync(device)
            memory.start()
            t = time.perf_counter()
            one_step(trainers[arm], batch[arm])
            sync(device)
            times[arm].append(time.perf_counter() - t)
            peaks[arm].append(memory.stop())
            trainers[arm].model.zero_grad(set_to_none=False)
        if time.monotonic() + (time.monotonic() - start) / (r + 1) > deadline:  # room for one more round?
            break
    return ({arm: statistics.median(times[arm]) for arm in arms}, {arm: max(p[0] for p in peaks[arm]) for arm in arms},
            {arm: max(p[1] for p in peaks[arm]) for arm in arms}, len(times[arms[0]]))


def part_score_centering(opts, deadline):
    from trl_rpp import RPPConfig, RPPTrainer
    from trl_rpp.testing.tiny import copy_task_dataset

    s = SIZES[opts.tiny]
    shape = argparse.Namespace(batch=s["sc_batch"], prompt_length=16, completion_length=s["sc_length"], top_k=32,
                               vocab=(QWEN3_TINY if opts.tiny else QWEN3_06B)["vocab_size"])
    batch = score_centering_batch(shape.batch, shape.prompt_length, shape.completion_length, shape.top_k, shape.vocab,
                                  torch.Generator().manual_seed(0))
    inputs = {k: v.to(opts.device) for k, v in batch.items()}
    trainers = {}
    for on in (False, True):
        args = RPPConfig(
            output_dir=tempfile.mkdtemp(), advantage_estimator="reinforce_plus_plus", kl_coef=0.0,
            use_cpu=opts.device == "cpu", bf16=True, report_to="none", per_device_train_batch_size=shape.batch,
            num_generations=shape.batch, max_completion_length=shape.completion_length, temperature=0.7,
            score_centering=on, score_centering_top_k=32, disable_dropout=True,
        )
        trainer = RPPTrainer(model=opts.model, reward_funcs=lambda completions, **kw: [0.0] * len(completions),
                             args=args, train_dataset=copy_task_dataset(shape.batch))
        trainer.model.to(opts.device).train()  # Trainer places the model itself; this states it (a no-op then)
        trainer.current_gradient_accumulation_steps = 1  # set by Trainer.train(), which is not run here
        trainers[on] = trainer
    med, step_peak, proc_peak, rounds = alternate_loss_steps(trainers, {arm: inputs for arm in trainers}, s["sc_rounds"],
                                                             deadline, opts.device)
    mem_ratio = step_peak[True] / step_peak[False]
    time_ratio = med[True] / med[False]
    return {
        "batch": shape.batch, "completion_length": shape.completion_length, "tokens": shape.batch * shape.completion_length,
        "vocab": shape.vocab, "top_k": 32, "rounds": rounds,
        "step_time_s": {"off": med[False], "on": med[True]},
        "step_peak_mib": {"off": step_peak[False], "on": step_peak[True]},
        "process_peak_mib": {"off": proc_peak[False], "on": proc_peak[True]},
        "memory_ratio": mem_ratio, "process_memory_ratio": proc_peak[True] / proc_peak[False], "time_ratio": time_ratio,
        "memory_target": MEMORY_TARGET, "time_target": TIME_TARGET,
        "memory_pass": mem_ratio <= MEMORY_TARGET, "time_pass": time_ratio <= TIME_TARGET,
        "memory_measure": "torch.cuda.max_memory_allocated" if opts.device == "cuda" else "peak RSS (VmHWM)",
    }


SAMPLING_ARMS = {
    "none": dict(top_k=SAMPLING_TOP_K, replay_sampler_support=False),
    "replay": dict(top_k=SAMPLING_TOP_K),
    "score_centering": dict(score_centering=True, score_centering_top_k=32),
    "both": dict(top_k=SAMPLING_TOP_K, score_centering=True, score_centering_top_k=32),
}


def sampling_batches(base, k):
    """Each arm's loss inputs from one score-centering batch: a kept set of `k` ids per position holding the sampled
    token (the replay arms), and for `both` that set as the head, `log q_S` uniform over it."""
    support = base["sampler_head_ids"][..., :k].clone()
    batch = dict(base, completion_ids=support[..., 0].clone())
    both = dict(batch, sampler_support_ids=support, sampler_head_ids=support,
                sampler_head_logps=torch.full(support.shape, -math.log(k)),
                sampler_per_token_logps=torch.full(support.shape[:2], -math.log(k)))
    return {"none": batch, "replay": dict(batch, sampler_support_ids=support), "score_centering": batch, "both": both}


def part_sampling(opts, deadline):
    from trl_rpp import RPPConfig, RPPTrainer
    from trl_rpp.testing.tiny import copy_task_dataset

    s = SIZES[opts.tiny]
    B, T, V = s["sc_batch"], s["sc_length"], (QWEN3_TINY if opts.tiny else QWEN3_06B)["vocab_size"]
    base = score_centering_batch(B, 16, T, 32, V, torch.Generator().manual_seed(0))
    batches = {arm: {k: v.to(opts.device) for k, v in b.items()} for arm, b in sampling_batches(base, SAMPLING_TOP_K).items()}
    trainers = {}
    for arm, extra in SAMPLING_ARMS.items():
        args = RPPConfig(
            output_dir=tempfile.mkdtemp(), advantage_estimator="reinforce_plus_plus", kl_coef=0.0,
            use_cpu=opts.device == "cpu", bf16=True, report_to="none", per_device_train_batch_size=B,
            num_generations=B, max_completion_length=T, temperature=0.7, disable_dropout=True, **extra,
        )
        trainer = RPPTrainer(model=opts.model, reward_funcs=lambda completions, **kw: [0.0] * len(completions),
                             args=args, train_dataset=copy_task_dataset(B))
        trainer.model.to(opts.device).train()
        trainer.current_gradient_accumulation_steps = 1
        trainers[arm] = trainer
    med, step_peak, proc_peak, rounds = alternate_loss_steps(trainers, batches, s["sc_rounds"], deadline, opts.device)
    return {
        "batch": B, "completion_length": T, "vocab": V, "top_k": SAMPLING_TOP_K, "rounds": rounds,
        "time_target": SAMPLING_TIME_TARGET,
        "arms": {arm: {"step_time_s": med[arm], "step_peak_mib": step_peak[arm], "process_peak_mib": proc_peak[arm],
                       "time_ratio": med[arm] / med["none"], "memory_ratio": step_peak[arm] / max(step_peak["none"], 1e-9),
                       "time_pass": med[arm] / med["none"] <= SAMPLING_TIME_TARGET} for arm in trainers},
    }


# ---------------------------------------------------------------------------------------------------------------
# Part lm_head
# ---------------------------------------------------------------------------------------------------------------


def part_lm_head(opts, deadline):
    from lm_head_memory import ARMS, BATCH, HEAD_K, TOP_K, build_arm

    s = SIZES[opts.tiny]
    memory = _Memory(opts.device)
    rows = {}
    for N in s["lm_positions"]:
        if rows and time.monotonic() > deadline:  # the larger N are not run; the report names them
            break
        steps = {arm: build_arm(arm, s["lm_vocab"], N, s["lm_hidden"], opts.device, torch.bfloat16)[1] for arm in ARMS}
        times, peaks = {arm: [] for arm in ARMS}, {arm: [] for arm in ARMS}
        for arm in ARMS:  # warm-up: kernels and workspaces, not measured
            steps[arm]().sum().backward()
        start = time.monotonic()
        for r in range(s["lm_rounds"]):
            for arm in (ARMS if r % 2 == 0 else ARMS[::-1]):
                sync(opts.device)
                memory.start()
                t = time.perf_counter()
                steps[arm]().sum().backward()
                sync(opts.device)
                times[arm].append(time.perf_counter() - t)
                peaks[arm].append(memory.stop()[0])
            if time.monotonic() + (time.monotonic() - start) / (r + 1) > deadline:
                break
        med, peak = {a: statistics.median(times[a]) for a in ARMS}, {a: max(peaks[a]) for a in ARMS}
        rows[N] = {arm: {"step_time_s": med[arm], "step_peak_mib": peak[arm], "rounds": len(times[arm]),
                         "time_ratio": med[arm] / med["fused"], "memory_ratio": peak[arm] / max(peak["fused"], 1e-9)}
                   for arm in ARMS}
        del steps
        gc.collect()
        if opts.device == "cuda":
            torch.cuda.empty_cache()
    at = max(s["lm_positions"])
    targets = []
    for (arm, what), target in LM_HEAD_TARGETS.items():
        ratio = rows[at][arm][f"{what}_ratio"] if at in rows else None
        targets.append({"arm": arm, "measure": what, "positions": at, "ratio": ratio, "target": target,
                        "pass": None if ratio is None else ratio <= target})
    return {
        "vocab": s["lm_vocab"], "hidden": s["lm_hidden"], "batch": BATCH, "top_k": TOP_K, "head_k": HEAD_K,
        "positions": list(s["lm_positions"]), "not_run": [N for N in s["lm_positions"] if N not in rows],
        "rows": {str(N): r for N, r in rows.items()}, "targets": targets,
        "memory_measure": "torch.cuda.max_memory_allocated" if opts.device == "cuda" else "peak RSS (VmHWM)",
    }


# ---------------------------------------------------------------------------------------------------------------
# Part step_time
# ---------------------------------------------------------------------------------------------------------------


def part_step_time(opts, deadline):
    from step_time import ARMS, StepTimer

    from trl_rpp.testing.tiny import copy_first_char_reward, copy_task_dataset

    s = SIZES[opts.tiny]
    arms = ["grpo_beta0.04", "rpp_reinforce_plus_plus", "rpp_baseline"]
    trainers = {}
    for arm in arms:
        trainer_cls, config_cls, extra = ARMS[arm]
        args = config_cls(
            output_dir=tempfile.mkdtemp(), report_to="none", use_cpu=opts.device == "cpu", bf16=True,
            per_device_train_batch_size=s["st_batch"], num_generations=8, max_completion_length=s["st_length"],
            generation_kwargs={"min_new_tokens": s["st_length"]},  # fixed length: EOS is suppressed until the end
            max_steps=s["st_steps"], learning_rate=1e-7, save_strategy="no", logging_steps=1, disable_dropout=True,
            seed=0, **extra,
        )
        timer = StepTimer()
        trainer = trainer_cls(model=opts.model, reward_funcs=copy_first_char_reward, args=args,
                              train_dataset=copy_task_dataset(100_000), callbacks=[timer])
        trainers[arm] = (trainer, timer)
    start, rounds = time.monotonic(), 0
    for r in range(s["st_rounds"]):
        for arm in arms:
            trainer, timer = trainers[arm]
            before = len(timer.times)
            sync(opts.device)
            trainer.train()
            del timer.times[before]  # warm-up step of this round
        rounds += 1
        if time.monotonic() + (time.monotonic() - start) / rounds > deadline:
            break
    out = {"batch": s["st_batch"], "num_generations": 8, "completion_length": s["st_length"], "rounds": rounds,
           "timed_steps_per_arm": rounds * (s["st_steps"] - 1), "arms": {}}
    base = statistics.median(trainers["grpo_beta0.04"][1].times)
    for arm in arms:
        trainer, timer = trainers[arm]
        lengths = [h["completions/mean_length"] for h in trainer.state.log_history if "completions/mean_length" in h]
        med = statistics.median(timer.times)
        out["arms"][arm] = {"median_step_s": med, "ratio_vs_grpo": med / base, "mean_completion_length":
                            sum(lengths) / len(lengths), "min_completion_length": min(lengths)}
    return out


# ---------------------------------------------------------------------------------------------------------------
# Part off_policy
# ---------------------------------------------------------------------------------------------------------------


def off_policy_placement(device):
    """(transport, the server's CUDA_VISIBLE_DEVICES or None, why). The trainer takes the first visible GPU. NCCL
    refuses two ranks on one GPU ("Duplicate GPU detected"), so the server takes the last visible GPU and the weights
    go over NCCL when there are two or more; with one, the server shares it and the weights go through a directory."""
    if device != "cuda":
        return "disk", None, "no CUDA: the disk transport (NCCL needs CUDA)"
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    count = torch.cuda.device_count()
    ids = [x for x in visible.split(",") if x.strip()] if visible else [str(i) for i in range(count)]
    if len(ids) >= 2:
        return "nccl", ids[-1], f"{len(ids)} GPUs: the trainer on GPU {ids[0]}, the server on GPU {ids[-1]}"
    return "disk", ids[0], ("one GPU, shared by the server and the trainer: NCCL refuses two ranks on one GPU "
                            "(\"Duplicate GPU detected\"), so the weights go through a directory")


def part_off_policy(opts, deadline):
    """The two arms of benchmarks/off_policy.py (max_staleness 0 and 1, REINFORCE++-baseline, alternating rounds)
    against one vLLM server started with `trl-rpp vllm-serve`, on a random-init Qwen3 of its own."""
    import importlib.util
    import shutil

    if importlib.util.find_spec("vllm") is None:
        return {"skipped": "vLLM is not installed here (the server and TRL's client need it)"}
    from off_policy import Phases, make_trainer, run_rounds, summarize

    from trl_rpp.testing.vllm_server import free_port, server_command, start_server, stop_server

    s, cuda = SIZES[opts.tiny], opts.device == "cuda"
    transport, server_gpu, why = off_policy_placement(opts.device)
    shape = QWEN3_OFF_POLICY_TINY if opts.tiny else QWEN3_06B
    tmp = tempfile.mkdtemp()
    log = open(os.path.join(tmp, "server.log"), "w")
    server = None
    try:
        model = os.path.join(tmp, "qwen3")
        build_qwen3(model, opts.tiny, shape=shape)
        port, weight_dir = free_port(), os.path.join(tmp, "weights")
        vllm_args = ["--enforce-eager"] if cuda else []  # no compilation or CUDA graph capture: a start in budget
        if cuda and transport == "disk":  # one GPU, shared: the server leaves the trainer most of its memory
            vllm_args += ["--gpu-memory-utilization", "0.3"]
        cmd = server_command(model, port, max_model_len=64 + s["op_length"],
                             weight_dir=weight_dir if transport == "disk" else None, weight_sync=transport,
                             dtype="bfloat16" if cuda else None, vllm_args=vllm_args)
        env = dict(os.environ, **({"CUDA_VISIBLE_DEVICES": server_gpu} if server_gpu is not None else {}))
        t = time.monotonic()
        server = start_server(cmd, f"http://127.0.0.1:{port}", log, env=env, deadline=deadline)
        server_start_s = time.monotonic() - t
        sizes = argparse.Namespace(batch=s["op_batch"], num_generations=s["op_generations"], free_length=False,
                                   completion_length=s["op_length"], steps=s["op_steps"])
        phases = Phases()
        overrides = dict(use_cpu=not cuda, bf16=cuda, vllm_server_weight_sync=transport)
        # One trainer (max_staleness=1) for both arms: a server keeps one NCCL group, that of the last trainer that
        # joined it. Its generation ahead is detached in the lag-0 rounds, where it then trains as max_staleness=0.
        trainer = make_trainer("lag1", model, sizes, tmp, f"http://127.0.0.1:{port}", phases, **overrides)
        ahead = trainer._rpp_ahead

        def before_round(arm):
            sync(opts.device)
            trainer._rpp_ahead = ahead if arm == "lag1" else None

        rounds = run_rounds({"lag0": trainer, "lag1": trainer}, phases, s["op_rounds"], deadline, before_round)
    except BaseException:
        log.flush()
        print(f"the server's log, its end:\n{open(log.name).read()[-3000:]}", file=sys.stderr)
        raise
    finally:
        if server is not None:
            stop_server(server)
        log.close()
        shutil.rmtree(tmp, ignore_errors=True)
    arms, summary = summarize(phases, s["op_warmup"])
    return {"transport": transport, "placement": why, "arms_by": "one trainer, max_staleness=1, its generation ahead "
            "detached in the lag-0 rounds", "server_command": " ".join(cmd), "server_start_s": server_start_s,
            "model_shape": shape, "precision": "bf16" if cuda else "float32", "batch": s["op_batch"],
            "num_generations": s["op_generations"], "completion_length": s["op_length"],
            "steps_per_round": s["op_steps"], "warmup": s["op_warmup"], "rounds": rounds, "summary": summary,
            "arms": {arm: {k: a[k] for k in ("max_staleness", "timed_steps", "dropped_steps", "median", "phases")}
                     for arm, a in arms.items()}}


# ---------------------------------------------------------------------------------------------------------------
# Environment, driver, report
# ---------------------------------------------------------------------------------------------------------------


def environment(device):
    import importlib.metadata as md

    env = {"python": platform.python_version(), "device": device, "torch_cuda": torch.version.cuda}
    for pkg in ("torch", "transformers", "trl", "accelerate", "peft", "datasets", "numpy", "pyarrow", "pandas"):
        try:
            env[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            env[pkg] = None
    if device == "cuda":
        env["gpu"] = torch.cuda.get_device_name(0)
        env["gpu_count"] = torch.cuda.device_count()
        env["gpu_memory_gib"] = round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1)
    else:
        env["cpu"] = platform.processor() or platform.machine()
    return env


PARTS = {"numerics": part_numerics, "score_centering": part_score_centering, "sampling": part_sampling,
         "lm_head": part_lm_head, "step_time": part_step_time, "off_policy": part_off_policy}
QWEN3_PARTS = ("score_centering", "sampling", "step_time")  # the parts that train the model `build_qwen3` saves


def _text(x):
    return x.decode(errors="replace") if isinstance(x, bytes) else (x or "")


def run_part(part, opts, model_path, out_dir, budget_s):
    """Runs one part in a fresh child process, killed after `budget_s` seconds; returns (status, result or None,
    wall seconds, log tail). The child learns its budget, so that it can stop adding rounds before it is killed."""
    result_path = os.path.join(out_dir, f"{part}.json")
    if os.path.exists(result_path):  # never report a previous run's result
        os.remove(result_path)
    cmd = [sys.executable, os.path.abspath(__file__), "--device", opts.device, "--part", part, "--model", model_path,
           "--result", result_path, "--budget_s", str(budget_s)] + (["--tiny"] if opts.tiny else [])
    t = time.monotonic()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=budget_s)
        status = "ok" if proc.returncode == 0 and os.path.exists(result_path) else "failed"
        log = (proc.stdout + proc.stderr)[-3000:]
    except subprocess.TimeoutExpired as e:  # subprocess.run has killed the child
        status, log = "timed_out", (_text(e.stdout) + _text(e.stderr))[-3000:]
    wall = time.monotonic() - t
    result = json.load(open(result_path)) if status == "ok" else None
    return status, result, wall, log


def _f(x, nd=3):
    return "n/a" if x is None else f"{x:.{nd}f}"


def markdown(report):
    env, parts = report["environment"], report["parts"]
    lines = [f"# GPU check ({'tiny, ' if report['tiny'] else ''}{env['device']})", "",
             f"{env.get('gpu') or env.get('cpu')}; Python {env['python']}, torch {env['torch']} (CUDA "
             f"{env['torch_cuda']}), transformers {env['transformers']}, trl {env['trl']}, accelerate "
             f"{env['accelerate']}, peft {env['peft']}, datasets {env['datasets']}. Total wall time "
             f"{report['wall_s']:.1f} s.", "", "| part | status | wall (s) | budget (s) |", "|---|---|---|---|"]
    for name, p in parts.items():
        budget = f"{p['budget_s']:.0f}" if "budget_s" in p else "-"
        lines.append(f"| {name} | {p['status']} | {p['wall_s']:.1f} | {budget} |")
    num = parts.get("numerics", {}).get("result")
    if num:
        lines += ["", "## Numerics against the float64 reference", "",
                  "| estimator | precision | advantages max abs error | gradient max rel. L2 | gradient tolerance | ok |",
                  "|---|---|---|---|---|---|"]
        for c in num["cases"]:
            if "skipped" in c:
                lines.append(f"| {c['estimator']} | {c['precision']} | skipped: {c['skipped']} | | | no |")
                continue
            lines.append(f"| {c['estimator']} | {c['precision']} | {c['advantages_max_abs_error']:.1e} | "
                         f"{c['gradient_max_rel_l2']:.2e} | {c['gradient_tolerance']} | {'yes' if c['ok'] else 'NO'} |")
    sc = parts.get("score_centering", {}).get("result")
    if sc:
        lines += ["", f"## Score centering (k = {sc['top_k']}) on vs off: B x T = {sc['batch']} x "
                  f"{sc['completion_length']}, V = {sc['vocab']}, bf16, {sc['rounds']} rounds", "",
                  "| | off | on | on / off | target | pass |", "|---|---|---|---|---|---|",
                  f"| loss step time (s, median) | {_f(sc['step_time_s']['off'], 4)} | {_f(sc['step_time_s']['on'], 4)} "
                  f"| {sc['time_ratio']:.3f} | <= {sc['time_target']} | {'yes' if sc['time_pass'] else 'no'} |",
                  f"| step peak above start (MiB) | {_f(sc['step_peak_mib']['off'], 0)} | {_f(sc['step_peak_mib']['on'], 0)} "
                  f"| {sc['memory_ratio']:.3f} | <= {sc['memory_target']} | {'yes' if sc['memory_pass'] else 'no'} |",
                  f"| process peak (MiB) | {_f(sc['process_peak_mib']['off'], 0)} | {_f(sc['process_peak_mib']['on'], 0)} "
                  f"| {sc['process_memory_ratio']:.3f} | | |", "", f"Memory: {sc['memory_measure']}."]
    sa = parts.get("sampling", {}).get("result")
    if sa:
        lines += ["", f"## Truncated sampling (top_k = {sa['top_k']}): B x T = {sa['batch']} x {sa['completion_length']}, "
                  f"V = {sa['vocab']}, bf16, {sa['rounds']} rounds", "",
                  "| arm | loss step time (s, median) | / none | step peak (MiB) | / none | time <= target |",
                  "|---|---|---|---|---|---|"]
        for arm, a in sa["arms"].items():
            lines.append(f"| {arm} | {a['step_time_s']:.4f} | {a['time_ratio']:.3f} | {_f(a['step_peak_mib'], 0)} | "
                         f"{a['memory_ratio']:.3f} | {'yes' if a['time_pass'] else 'no'} (<= {sa['time_target']}) |")
    lm = parts.get("lm_head", {}).get("result")
    if lm:
        arms = list(next(iter(lm["rows"].values()))) if lm["rows"] else []
        lines += ["", f"## Log-prob heads: V = {lm['vocab']}, hidden {lm['hidden']}, 1 layer, bf16, {lm['batch']} "
                  f"sequences, top_k = {lm['top_k']}, k = {lm['head_k']}; step peak above start (MiB), median step "
                  "time (s), ratio to fused", "", "| N | " + " | ".join(arms) + " |", "|---|" + "---|" * len(arms)]
        for N, row in lm["rows"].items():
            lines.append(f"| {N} | " + " | ".join(
                f"{a['step_peak_mib']:.0f} MiB ({a['memory_ratio']:.3f}), {a['step_time_s']:.4f} s ({a['time_ratio']:.3f})"
                for a in row.values()) + " |")
        if lm["not_run"]:
            lines.append(f"\nNot run (part budget spent): N = {', '.join(map(str, lm['not_run']))}.")
        lines += ["", "| target | ratio to fused | target | pass |", "|---|---|---|---|"]
        for t in lm["targets"]:
            verdict = "n/a" if t["pass"] is None else ("yes" if t["pass"] else "no")
            lines.append(f"| {t['arm']} {t['measure']} at N = {t['positions']} | {_f(t['ratio'])} | <= {t['target']} "
                         f"| {verdict} |")
        lines += ["", f"Memory: {lm['memory_measure']}."]
    st = parts.get("step_time", {}).get("result")
    if st:
        lines += ["", f"## Step time vs GRPOTrainer(beta=0.04): batch {st['batch']} ({st['num_generations']} per "
                  f"prompt), {st['completion_length']} completion tokens, bf16, {st['timed_steps_per_arm']} timed steps "
                  f"per arm", "", "| arm | median step (s) | ratio vs GRPO | mean completion length |", "|---|---|---|---|"]
        for arm, a in st["arms"].items():
            lines.append(f"| {arm} | {a['median_step_s']:.4f} | {a['ratio_vs_grpo']:.3f} | {a['mean_completion_length']:.1f} |")
    op = parts.get("off_policy", {}).get("result")
    if op and "skipped" in op:
        lines += ["", f"## Generation ahead (max_staleness 1 vs 0): skipped: {op['skipped']}"]
    elif op:
        from off_policy import table

        v = op["summary"]
        lines += ["", f"## Generation ahead (max_staleness 1 vs 0): weights over {op['transport']}, batch "
                  f"{op['batch']} ({op['num_generations']} per prompt), {op['completion_length']} completion tokens, "
                  f"{op['precision']}",
                  "", f"{op['placement']}; the server up in {op['server_start_s']:.0f} s.", "", table(op["arms"], v)]
    for name, p in parts.items():
        if p["status"] != "ok":
            lines += ["", f"## {name}: {p['status']}", "", "```", p.get("log", "")[-1500:], "```"]
    return "\n".join(lines) + "\n"


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--tiny", action="store_true", help="tiny models and batches (the CPU rehearsal)")
    ap.add_argument("--out", default=os.path.join("outputs", "gpu_check"))
    ap.add_argument("--part", choices=list(PARTS), help=argparse.SUPPRESS)  # child mode
    ap.add_argument("--model", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    ap.add_argument("--budget_s", type=float, help=argparse.SUPPRESS)
    ap.add_argument("--budget_scale", type=float, default=1.0,
                    help="multiplies every part's time budget (for a slow or shared CPU; the budgets fit one H200)")
    ap.add_argument("--parts", default=",".join(DEFAULT_PARTS), help=f"the parts to run, comma-separated, of "
                    f"{', '.join(PARTS)} (default: {','.join(DEFAULT_PARTS)})")
    opts = ap.parse_args(argv)
    parts = opts.parts.split(",")
    if any(p not in PARTS for p in parts) or len(set(parts)) < len(parts):
        ap.error(f"--parts {opts.parts!r}: accepted: one or more of {', '.join(PARTS)}, comma-separated, each once")
    opts.parts = parts
    return opts


def main():
    opts = parse_args()
    if opts.device == "cuda" and not torch.cuda.is_available():
        sys.exit("--device cuda: torch sees no CUDA device (torch.cuda.is_available() is False); "
                 "use --device cpu --tiny for the CPU rehearsal")
    if opts.device == "cpu":
        torch.set_num_threads(1)  # tiny models: more threads only add overhead

    if opts.part:  # child: one part, its result as JSON
        deadline = time.monotonic() + 0.8 * opts.budget_s
        result = PARTS[opts.part](opts, deadline)
        with open(opts.result, "w") as f:
            json.dump(result, f)
        return

    t0 = time.monotonic()
    os.makedirs(opts.out, exist_ok=True)
    env = environment(opts.device)
    parts = {}
    with tempfile.TemporaryDirectory() as tmp:
        t = time.monotonic()
        model_path = os.path.join(tmp, "qwen3")
        if set(opts.parts) & set(QWEN3_PARTS):
            n_params = build_qwen3(model_path, opts.tiny)
            parts["build_model"] = {"status": "ok", "wall_s": time.monotonic() - t, "parameters": n_params}
        for part in opts.parts:
            budget = BUDGETS_S[part] * opts.budget_scale
            status, result, wall, log = run_part(part, opts, model_path, opts.out, budget)
            parts[part] = {"status": status, "wall_s": wall, "budget_s": budget, "result": result}
            if status != "ok":
                parts[part]["log"] = log
    report = {"device": opts.device, "tiny": opts.tiny, "budget_scale": opts.budget_scale, "environment": env, "parts": parts,
              "wall_s": time.monotonic() - t0}
    numerics = parts.get("numerics")
    ok = all(p["status"] == "ok" for p in parts.values()) and (numerics is None or numerics["result"]["ok"])
    report["ok"] = ok
    with open(os.path.join(opts.out, "report.json"), "w") as f:
        json.dump(report, f, indent=1)
    md = markdown(report)
    with open(os.path.join(opts.out, "report.md"), "w") as f:
        f.write(md)
    print(md)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
