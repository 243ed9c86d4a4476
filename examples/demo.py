"""The main job: fine-tune SmolLM2-135M-Instruct offline with REINFORCE++-baseline on arithmetic.

    make demo                        # = python examples/demo.py
    python examples/demo.py --tiny   # same pipeline on a tiny random-init model and a copy task (150 steps)

Task: "What is a + b? Answer with just the number." with a in 0..99 and b in 0..20, the assistant turn pre-filled
with "a + b =" (without the pre-fill the model echoes the operands). Reward: 1 if the first integer of the
completion is the sum. A 128-prompt held-out split is scored greedily before and after training. LoRA r=16,
alpha 32 on the attention projections, lr 5e-4, 8 prompts x 4 generations, at most 6 new tokens, 16 steps, no KL
loss and no gradient checkpointing (below). Measured on a fresh clone, 2 idle cores, 2 threads, from an empty
cache: held-out accuracy 0.31 -> 0.77, 8 min 39 s wall clock (498.6 s in the script: 42 s to convert the GGUF
file, 20 s per held-out evaluation, about 25 s per training step).

Where a step went (`python benchmarks/demo_step_time.py`, 2 threads, with the KL loss on): generation 5.4 s, the
KL loss's reference forward 5.6 s, the policy forward 6.8 s, its backward 12.0 s, of 29.8 s. Gradient
checkpointing (TRL's default) changed nothing measurable (29.8 s on, 29.5 s off). So the demo turns both off: the
reference forward buys nothing in 16 LoRA steps, where the adapter stays close to the base model.

Everything lands in --output_dir: the LoRA checkpoint and its model card (README.md), metrics.jsonl (the trainer's
log history), learning_curve.png (reward per step with a moving average), summary.json and the offline wandb run.

Threads: on an idle 2-core machine 2 torch threads were about 1.7x faster than 1 (greedy eval of 128 prompts: 10.9 s
vs 18.1 s). With one other busy process on the same 2 cores, the former every-core default was measured at about
100 s per training step instead of about 16. The default is therefore the cores free when the demo starts
(`default_threads`): the usable cores (`os.sched_getaffinity`) minus those busy over one second of /proc/stat
(`busy_cores`), at least 1. The 1-minute load average, used before, still counted a `make test` that had just
ended and chose 1 thread on an idle machine (88-92 s per step, about 27 minutes in all). Work that starts later is
not seen; `--threads N` overrides the choice.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import re
import time

os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# torch, transformers, TRL and wandb are imported where they are used, after the arguments are parsed, so that
# `--help` answers at once (tests/test_examples.py checks that it imports none of them).

QUESTION = "What is {a} + {b}? Answer with just the number."
HELDOUT = 128  # held-out prompts scored before and after training (--heldout)


def default_threads(usable_cores: int, busy: float) -> int:
    """Torch threads for `usable_cores` cores of which `busy` (in cores) are in use: the free cores, at least 1 and
    at most `usable_cores`."""
    taken = math.floor(max(busy, 0.0) + 0.5)
    return max(1, min(usable_cores, usable_cores - taken))


def busy_cores(stat_before: str, stat_after: str, cpus) -> float:
    """Cores in use among `cpus` (CPU numbers) between two readings of /proc/stat: for each `cpuN` line
    (`cpuN user nice system idle iowait ...`), the non-idle share of its elapsed time, summed."""

    def per_cpu(text):
        rows = (line.split() for line in text.splitlines() if line.startswith("cpu") and line[3:4].isdigit())
        return {int(r[0][3:]): [int(x) for x in r[1:]] for r in rows}

    a, b = per_cpu(stat_before), per_cpu(stat_after)
    busy = 0.0
    for n in cpus:
        if n in a and n in b:
            total = sum(b[n]) - sum(a[n])
            idle = (b[n][3] + b[n][4]) - (a[n][3] + a[n][4])  # idle + iowait
            busy += 1.0 - idle / total if total > 0 else 0.0
    return busy


def _auto_threads(sample_s: float = 1.0) -> tuple[int, str]:
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    if os.path.exists("/proc/stat"):
        # What is busy now, on the cores this process may use. The load average still counts a test run that ended
        # a minute ago (it decays over minutes): it made a fresh `make demo` after `make test` pick 1 thread.
        with open("/proc/stat") as f:
            before = f.read()
        time.sleep(sample_s)
        with open("/proc/stat") as f:
            after = f.read()
        busy = busy_cores(before, after, cpus)
        return default_threads(len(cpus), busy), f"{len(cpus)} usable cores, {busy:.2f} busy over {sample_s:g} s"
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    return default_threads(len(cpus), load), f"{len(cpus)} usable cores, 1-minute load {load:.2f}"


def arithmetic_prompts(tokenizer, n, seed, a_range=(0, 99), b_range=(0, 20)):
    """Chat-formatted prompts whose assistant turn is pre-filled with "a + b =", and their answers (operands drawn
    uniformly from the inclusive ranges)."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b = rng.randint(*a_range), rng.randint(*b_range)
        chat = [{"role": "user", "content": QUESTION.format(a=a, b=b)}]
        text = tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
        rows.append({"prompt": f"{text}{a} + {b} =", "answer": a + b})
    return rows


def first_integer_reward(completions, answer, **kwargs):
    """1.0 if the first integer in the completion equals the answer, else 0.0."""
    out = []
    for completion, target in zip(completions, answer):
        match = re.search(r"-?\d+", completion)
        out.append(1.0 if match and int(match.group()) == int(target) else 0.0)
    return out


def copy_rows(n, seed, length=1):
    """Copy-task prompts of `length` letters; the answer is the first one."""
    from trl_rpp.testing.tiny import copy_task_dataset

    return [dict(r, answer=r["prompt"][0]) for r in copy_task_dataset(n, seed=seed, length=length)]


def copy_reward(completions, answer, **kwargs):
    return [1.0 if c[:1] == a else 0.0 for c, a in zip(completions, answer)]


def greedy_accuracy(model, tokenizer, rows, reward_fn, max_new_tokens, batch_size=64):
    import torch

    model.eval()
    tokenizer.padding_side = "left"
    hits = 0.0
    for start in range(0, len(rows), batch_size):
        chunk = rows[start : start + batch_size]
        enc = tokenizer([r["prompt"] for r in chunk], return_tensors="pt", padding=True, add_special_tokens=False)
        with torch.no_grad():
            out = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False,
                                 pad_token_id=tokenizer.pad_token_id)
        texts = tokenizer.batch_decode(out[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)
        hits += sum(reward_fn(texts, [r["answer"] for r in chunk]))
    model.train()
    return hits / len(rows)


def plot_curve(steps, rewards, path, title):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    window = max(1, min(5, len(rewards)))
    smooth = [sum(rewards[max(0, i - window + 1) : i + 1]) / len(rewards[max(0, i - window + 1) : i + 1]) for i in range(len(rewards))]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(steps, rewards, "o", alpha=0.4, label="reward (mean over the generation batch)")
    ax.plot(steps, smooth, "-", label=f"moving average ({window} steps)")
    ax.set(xlabel="optimizer step", ylabel="training reward", title=title, ylim=(-0.02, 1.02))
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def demo_setup(a, output_dir):
    """The demo's model, tokenizer, prompts, reward and trainer settings (shared with benchmarks/demo_step_time.py):
    (model_path, tokenizer, train_rows, heldout_rows, reward_fn, max_new_tokens, config, peft_config)."""
    from peft import LoraConfig
    from transformers import AutoTokenizer

    if a.tiny:
        from trl_rpp.testing.tiny import build_tiny_model

        model_path = build_tiny_model(os.path.join(output_dir, "tiny-base-model"))
        tokenizer = AutoTokenizer.from_pretrained(model_path)
        train_rows, heldout_rows = copy_rows(4000, a.seed + 1), copy_rows(a.heldout, a.seed + 2)
        reward_fn, max_new = copy_reward, 2
        config = dict(
            per_device_train_batch_size=64, num_generations=8, max_completion_length=2, learning_rate=a.learning_rate or 3e-3,
            max_steps=a.max_steps or 150, logging_steps=10,
        )
        peft_config = None
    else:
        from trl_rpp.testing.assets import smollm2_path

        print("[demo] locating SmolLM2-135M-Instruct (the first run converts the GGUF file, ~20-45 s)", flush=True)
        model_path = str(smollm2_path())
        tokenizer = AutoTokenizer.from_pretrained(model_path)
        train_rows = arithmetic_prompts(tokenizer, 2000, a.seed + 1)
        heldout_rows = arithmetic_prompts(tokenizer, a.heldout, a.seed + 2)
        reward_fn, max_new = first_integer_reward, 6
        # What buys nothing in 16 LoRA steps on CPU is off (benchmarks/demo_step_time.py, 2 threads, s per step):
        # the KL loss's reference forward (5.6 of 29.8: adapters off, the whole batch again) and TRL's default
        # gradient checkpointing (no measurable gain either way: 29.8 on, 29.5 off).
        config = dict(
            per_device_train_batch_size=32, num_generations=4, max_completion_length=6, learning_rate=a.learning_rate or 5e-4,
            max_steps=a.max_steps or 16, logging_steps=1, use_kl_loss=False, gradient_checkpointing=False,
        )
        peft_config = LoraConfig(
            r=16, lora_alpha=32, lora_dropout=0.0, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
            task_type="CAUSAL_LM",
        )
    return model_path, tokenizer, train_rows, heldout_rows, reward_fn, max_new, config, peft_config


def demo_trainer_args(a, output_dir, config, **overrides):
    """The demo's `RPPConfig` keyword arguments (`overrides` for the benchmark's arms)."""
    kwargs = dict(
        output_dir=output_dir,
        advantage_estimator="reinforce_plus_plus_baseline",
        use_cpu=True,
        bf16=False,
        temperature=1.0,
        report_to="wandb",
        run_name=os.path.basename(os.path.abspath(output_dir)),
        save_strategy="no",
        seed=a.seed,
        disable_dropout=True,
        **config,
    )
    return {**kwargs, **overrides}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tiny", action="store_true",
                   help="tiny random-init model and a copy task: the pipeline's smoke run")
    p.add_argument("--output_dir", default=None, help="default: outputs/demo or outputs/demo-tiny")
    p.add_argument("--max_steps", type=int, default=None, help="default: 16 (SmolLM2) or 150 (--tiny)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads (default: the cores idle at start, from /proc/stat; see above)")
    p.add_argument("--heldout", type=int, default=HELDOUT, help="held-out prompts scored before and after training")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--learning_rate", type=float, default=None, help="default: 5e-4 (SmolLM2, LoRA) or 3e-3 (--tiny)")
    a = p.parse_args(argv)
    import torch

    from trl_rpp import RPPConfig, RPPTrainer

    if a.threads is None:
        a.threads, why = _auto_threads()
        print(f"[demo] torch threads: {a.threads} ({why}; --threads overrides)", flush=True)
    torch.set_num_threads(a.threads)
    t0 = time.time()
    output_dir = a.output_dir or ("outputs/demo-tiny" if a.tiny else "outputs/demo")
    os.makedirs(output_dir, exist_ok=True)
    os.environ.setdefault("WANDB_DIR", os.path.abspath(output_dir))
    os.environ.setdefault("WANDB_PROJECT", "trl_rpp-demo")

    from datasets import Dataset
    from transformers import AutoModelForCausalLM

    model_path, tokenizer, train_rows, heldout_rows, reward_fn, max_new, config, peft_config = demo_setup(a, output_dir)
    print(f"[demo] model ready at {model_path} ({time.time() - t0:.0f} s)", flush=True)

    base = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    before = greedy_accuracy(base, tokenizer, heldout_rows, reward_fn, max_new)
    del base
    print(f"[demo] held-out greedy accuracy before training: {before:.3f} ({time.time() - t0:.0f} s)", flush=True)

    args = RPPConfig(**demo_trainer_args(a, output_dir, config))
    trainer = RPPTrainer(
        model=model_path,
        reward_funcs=reward_fn,
        args=args,
        train_dataset=Dataset.from_list(train_rows),
        processing_class=tokenizer,
        peft_config=peft_config,
    )
    trainer.train()
    trainer.save_model(output_dir)
    trainer.create_model_card(model_name=os.path.basename(os.path.abspath(output_dir)), dataset_name="generated arithmetic prompts (examples/demo.py)" if not a.tiny else "the generated copy task (trl_rpp.testing.tiny)")
    after = greedy_accuracy(trainer.model, tokenizer, heldout_rows, reward_fn, max_new)
    print(f"[demo] held-out greedy accuracy after training: {after:.3f}", flush=True)

    history = trainer.state.log_history
    with open(os.path.join(output_dir, "metrics.jsonl"), "w") as f:
        for row in history:
            f.write(json.dumps(row) + "\n")
    points = [(h["step"], h["reward"]) for h in history if "reward" in h]
    plot_curve(
        [s for s, _ in points], [r for _, r in points], os.path.join(output_dir, "learning_curve.png"),
        f"REINFORCE++-baseline: held-out {before:.2f} -> {after:.2f}",
    )
    import wandb

    if wandb.run is not None:
        wandb.run.summary.update({"heldout_accuracy/before": before, "heldout_accuracy/after": after})
        wandb.finish()
    summary = dict(
        model=model_path, heldout_before=before, heldout_after=after, steps=args.max_steps,
        first_reward=points[0][1] if points else None, last_reward=points[-1][1] if points else None,
        seconds=round(time.time() - t0, 1), threads=a.threads,
    )
    with open(os.path.join(output_dir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
    print(f"[demo] done in {summary['seconds']} s: {json.dumps(summary)}", flush=True)
    return summary


if __name__ == "__main__":
    main()
