"""Peak memory of one loss forward + backward with score centering on vs off, at Qwen3's vocabulary size.

    python benchmarks/score_centering_memory.py                         # V = 151,936, B = 2, T = 512
    python benchmarks/score_centering_memory.py --vocab 4096 --batch 2 --completion_length 8   # smoke run
    python benchmarks/score_centering_memory.py --vocab 49152 --batch 8 --completion_length 2048 --replay_top_k 20

With `--replay_top_k`, four arms: neither, score centering, replay (kept sets of that many ids, as the trainer
records them) and both (the head: the kept set's first `--top_k` ids).

The model is a random-init Llama with a tiny body (hidden 64, one layer) and a head of `--vocab` ids, so the
vocabulary-sized tensors dominate, which is where score centering can cost memory. Both arms are `RPPTrainer`s on the
same weights and the same batch (REINFORCE++, `kl_coef=0`, so no reference model); the only difference is
`score_centering`. Each arm runs `_compute_loss` and `backward()` once to warm up (parameter gradients allocated),
then once measured.

Measured quantity: the process's peak resident memory (Linux `VmHWM`, reset through `/proc/self/clear_refs` right
before the step) minus its resident memory just before the step, so that the Python interpreter, torch, the model,
its gradients and the batch are not counted. Large blocks are returned to the system on free (`mallopt`), so a block
freed by one arm is never silently reused by the other. Both arms run in this one process, off first.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import os
import re
import tempfile
import warnings

import torch

warnings.filterwarnings("ignore")
os.environ.setdefault("WANDB_MODE", "disabled")


def _status_kib(field):
    return int(re.search(rf"{field}:\s+(\d+)", open("/proc/self/status").read()).group(1))


def _reset_peak():
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current RSS (Linux >= 4.0)


def build_model(path, vocab, hidden, positions=4096, seed=0):
    from transformers import LlamaConfig, LlamaForCausalLM

    from trl_rpp.testing.tiny import char_tokenizer

    tokenizer = char_tokenizer()
    config = LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=positions, tie_word_embeddings=False,
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id,
    )
    torch.manual_seed(seed)
    LlamaForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def make_batch(opts, generator, replay=False):
    B, P, T, k, V = opts.batch, opts.prompt_length, opts.completion_length, opts.top_k, opts.vocab
    completion_ids = torch.randint(V, (B, T), generator=generator)
    if replay:  # kept sets of replay_top_k ids in twice as many slots, the sampled token first; the head is their start
        support = torch.randint(V, (B, T, 2 * opts.replay_top_k), generator=generator)
        support[..., opts.replay_top_k :] = -1
        support[..., 0] = completion_ids
        head_ids = support[..., :k].clamp(min=0)
    else:
        head_ids = torch.randint(V, (B, T, k), generator=generator)
    # A valid sampler head: k entries of mass 0.5 / k each (the tail holds the other half).
    head_logps = torch.full((B, T, k), torch.log(torch.tensor(0.5 / k)).item())
    return {
        **({"sampler_support_ids": support} if replay else {}),
        "prompt_ids": torch.randint(V, (B, P), generator=generator),
        "prompt_mask": torch.ones(B, P, dtype=torch.long),
        "completion_ids": completion_ids,
        "completion_mask": torch.ones(B, T, dtype=torch.long),
        "advantages": torch.randn(B, T, generator=generator),
        "sampler_head_ids": head_ids,
        "sampler_head_logps": head_logps,
        "sampler_per_token_logps": head_logps[..., 0].clone(),
    }


def one_step(trainer, inputs):
    loss = trainer._compute_loss(trainer.model, inputs)
    loss.backward()
    return loss.detach()


def measure(trainer, inputs):
    one_step(trainer, inputs)  # warm-up: parameter gradients are allocated here, not in the measured step
    gc.collect()
    before = _status_kib("VmRSS")
    _reset_peak()
    one_step(trainer, inputs)
    peak = _status_kib("VmHWM")
    trainer.model.zero_grad(set_to_none=False)
    return (peak - before) / 1024, peak / 1024


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sizes = dict(vocab=151_936, hidden=64, batch=2, prompt_length=16, completion_length=512, top_k=32)
    for name, default in sizes.items():
        ap.add_argument(f"--{name}", type=int, default=default)
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--replay_top_k", type=int, default=0, help="also the replay arms, at this top_k (see above)")
    opts = ap.parse_args()
    # Blocks above 64 KiB are mmap'ed and unmapped on free, so the RSS follows the live tensors.
    ctypes.CDLL("libc.so.6").mallopt(-3, 64 * 1024)  # M_MMAP_THRESHOLD
    torch.set_num_threads(1)

    from trl_rpp import RPPConfig, RPPTrainer
    from trl_rpp.testing.tiny import copy_task_dataset

    path = build_model(os.path.join(tempfile.mkdtemp(), "m"), opts.vocab, opts.hidden, max(4096, opts.completion_length
                                                                                          + opts.prompt_length))
    arms = {"off": (False, 0), "on": (True, 0)}
    if opts.replay_top_k:
        arms = {"off": (False, 0), "score centering": (True, 0), "replay": (False, opts.replay_top_k),
                "both": (True, opts.replay_top_k)}
    results = {}
    for name, (on, top_k) in arms.items():
        inputs = make_batch(opts, torch.Generator().manual_seed(0), replay=bool(top_k))
        args = RPPConfig(
            output_dir=tempfile.mkdtemp(), advantage_estimator="reinforce_plus_plus", kl_coef=0.0, use_cpu=True,
            bf16=False, report_to="none", per_device_train_batch_size=opts.batch, num_generations=opts.batch,
            max_completion_length=opts.completion_length, temperature=opts.temperature, score_centering=on,
            score_centering_top_k=opts.top_k if on else 32, disable_dropout=True,  # only score centering reads k
            top_k=top_k,
        )
        trainer = RPPTrainer(model=path, reward_funcs=lambda completions, **kw: [0.0] * len(completions), args=args,
                             train_dataset=copy_task_dataset(opts.batch))
        trainer.model.train()
        trainer.current_gradient_accumulation_steps = 1  # set by Trainer.train(), which is not run here
        results[name] = measure(trainer, inputs)
        del trainer
        gc.collect()

    B, T, V = opts.batch, opts.completion_length, opts.vocab
    full = B * T * V * 4 / 2**20
    print(f"V = {V}, B = {B}, T = {T} completion (+{opts.prompt_length} prompt) tokens, hidden {opts.hidden}, "
          f"k = {opts.top_k}; one float32 [B, T, V] tensor = {full:.0f} MiB")
    print("| score centering | peak above pre-step RSS (MiB) | process peak RSS (MiB) |")
    print("|---|---|---|")
    for name in arms:
        print(f"| {name} | {results[name][0]:.0f} | {results[name][1]:.0f} |")
    for name in list(arms)[1:]:
        label = "on" if name == "on" else name
        print(f"ratio {label}/off (peak above pre-step RSS): {results[name][0] / max(results['off'][0], 1e-9):.2f}")
        print(f"ratio {label}/off (process peak RSS): {results[name][1] / results['off'][1]:.2f}")


if __name__ == "__main__":
    main()
