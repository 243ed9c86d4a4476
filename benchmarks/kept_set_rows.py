"""How many distinct head rows a real model's kept sets touch, against uniform draws over its vocabulary.

    python benchmarks/kept_set_rows.py                          # SmolLM2-135M-Instruct, top_k = 20, N = 2,048 to 16,384
    python benchmarks/kept_set_rows.py --positions 256 --top-k 5   # smoke run

Replay reads, and writes the gradient of, the head rows of the kept ids (`trl_rpp.lm_head.touched_rows`): its cost is
`O(N * K * H)` plus `O(U * H)` for the `U` distinct rows, `U <= min(V, N * K)`. `benchmarks/lm_head_memory.py` draws
kept ids uniformly, which spreads them over as many rows as the draw allows. This script reads the offline
SmolLM2-135M-Instruct (V = 49,152) over text (the repository's README, then its docs, then its Python sources, in
that order, teacher-forced in windows of 1,024 tokens, no gradient), takes the `top_k` ids at each position (the
kept set of `top_k` truncation at any temperature), and prints, at each N, the distinct rows of the first N
positions' kept sets beside those of `N * top_k` uniform draws (the memory benchmark's).
"""

from __future__ import annotations

import argparse
import glob
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WINDOW = 1024


def corpus():
    """The repository's own text: README, docs, Python sources, in that order."""
    files = ["README.md"] + sorted(glob.glob("docs/*.md", root_dir=ROOT)) + sorted(
        glob.glob("trl_rpp/**/*.py", root_dir=ROOT, recursive=True))
    parts = []
    for name in files:
        with open(os.path.join(ROOT, name), encoding="utf-8") as f:
            parts.append(f.read())
    return "\n\n".join(parts)


def model_kept_sets(model, ids, top_k):
    """`[N, top_k]` the model's `top_k` ids at each of the `N` positions of `ids` `[N]`, windows of `WINDOW`."""
    import torch

    out = []
    with torch.no_grad():
        for start in range(0, ids.numel(), WINDOW):
            logits = model(input_ids=ids[start:start + WINDOW].unsqueeze(0)).logits[0]
            out.append(logits.topk(top_k, dim=-1).indices)
    return torch.cat(out)


def uniform_kept_sets(vocab, positions, top_k, seed=0):
    """`[N, top_k]` ids drawn uniformly over `[0, vocab)`, as `benchmarks/lm_head_memory.py` draws its kept sets."""
    import torch

    return torch.randint(vocab, (positions, top_k), generator=torch.Generator().manual_seed(seed))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--positions", default="2048,4096,8192,16384")
    ap.add_argument("--top-k", type=int, default=20)
    opts = ap.parse_args()
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging

    from trl_rpp.testing.assets import smollm2_path

    positions = [int(n) for n in opts.positions.split(",")]
    path = smollm2_path()
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    logging.set_verbosity_error()  # the corpus is tokenized whole, longer than the model's context: read in windows
    ids = tokenizer(corpus(), return_tensors="pt").input_ids[0]
    if ids.numel() < max(positions):
        raise SystemExit(f"the corpus has {ids.numel():,} tokens, fewer than --positions' {max(positions):,}")
    kept = model_kept_sets(model, ids[:max(positions)], opts.top_k)
    vocab = model.config.vocab_size
    drawn = uniform_kept_sets(vocab, max(positions), opts.top_k)
    print(f"SmolLM2-135M-Instruct (V = {vocab:,}), top_k = {opts.top_k}: distinct head rows of the first N positions' "
          "kept sets")
    print("| N | kept ids (N * top_k) | model's kept sets | uniform draws |")
    print("|---|---|---|---|")
    for n in positions:
        print(f"| {n:,} | {n * opts.top_k:,} | {kept[:n].unique().numel():,} | {drawn[:n].unique().numel():,} |")


if __name__ == "__main__":
    main()
