"""Benchmark of `trl_rpp.records.vllm.parse_vllm_topk` against its former per-entry Python loops (not a test).

The input is what TRL's `extract_logprobs` returns for a vLLM batch with `logprobs=k`: per position, k entries in rank
order, plus the sampled token as a (k+1)-th entry when it is not among them (here 30% of positions); 1% of log-probs
are None (vLLM's NaN). Every sequence has T positions. The lists are built here directly (through numpy, faster than
`extract_logprobs` on vLLM-shaped objects); how long that takes is printed too, since in training the same lists are
first built by TRL.

Both implementations run in one process on the same lists, each size in turn: `parse_vllm_topk_loops` (a copy of the
former code, below, walking B x T x k entries in Python) once, `parse_vllm_topk` `--repeats` times (the fastest run
is reported). Their outputs are compared (ids, log-probs bitwise, None at the same places). Sizes above
`--loops-max-positions` positions skip the loops (two torch element writes per entry: 10 to 30 us per entry on
this project's 2-core machine). The last line is the slope of log(time) against log(positions) of the new
function over the sizes run: 1 is linear growth.

    python benchmarks/parse_vllm_topk.py                          # B=16, T=128..8192 (2^11..2^17 positions), k=32
    python benchmarks/parse_vllm_topk.py --B 64,512 --T 64 --k 8  # lists of sizes run every B x T pair
"""

from __future__ import annotations

import argparse
import gc
import time

import numpy as np
import torch

from trl_rpp.records.capture import RecordedTopK
from trl_rpp.records.vllm import parse_vllm_topk


def parse_vllm_topk_loops(completion_ids, logprobs, logprob_token_ids, k: int):
    """The former `parse_vllm_topk` (per-entry Python loops), kept here for comparison only."""
    if logprobs is None or logprob_token_ids is None:
        raise ValueError("score centering with vLLM needs the engine's log-probs; vLLM returned none")
    B = len(completion_ids)
    T = max((len(c) for c in completion_ids), default=0)
    ids = torch.zeros(B, T, k, dtype=torch.long)
    head = torch.full((B, T, k), float("-inf"))
    sampled_t = torch.full((B, T), float("-inf"))
    sampled = []
    for b, tokens in enumerate(completion_ids):
        row = []
        for t, token in enumerate(tokens):
            entry_ids, entry_lps = logprob_token_ids[b][t], logprobs[b][t]
            try:
                j = entry_ids.index(token)
            except ValueError:
                raise ValueError(
                    f"vLLM's log-probs for sequence {b}, position {t} do not include the sampled token {token}; "
                    "cannot select its log-prob"
                ) from None
            row.append(entry_lps[j])
            if entry_lps[j] is not None:
                sampled_t[b, t] = entry_lps[j]
            for i, (tid, lp) in enumerate(zip(entry_ids[:k], entry_lps[:k])):
                ids[b, t, i] = tid
                if lp is not None:
                    head[b, t, i] = lp
        sampled.append(row)
    return sampled, RecordedTopK(ids, head, sampled_t)


def make_lists(B: int, T: int, k: int, seed: int, vocab: int = 151_936, outside: float = 0.3, none: float = 0.01):
    """``(completion_ids, logprobs, logprob_token_ids)`` in TRL's format, ``B x T`` positions of k or k+1 entries."""
    rng = np.random.default_rng(seed)
    # k distinct head ids per position, log-probs decreasing with rank; an out-of-head sampled token gets an id
    # no head holds (>= vocab) and the lowest log-prob.
    ids = (rng.integers(0, vocab, (B, T, 1)) + np.arange(k + 1)) % vocab
    lps = -np.cumsum(rng.exponential(0.5, (B, T, k + 1)), axis=-1)
    out = rng.random((B, T)) < outside
    ids[..., k] = np.where(out, vocab + rng.integers(0, vocab, (B, T)), 0)
    tokens = np.where(out, ids[..., k], np.take_along_axis(ids, rng.integers(0, k, (B, T, 1)), -1)[..., 0])
    lps_obj = lps.astype(object)
    lps_obj[rng.random(lps.shape) < none] = None
    logprobs, token_ids = lps_obj.tolist(), ids.tolist()
    for b, t in zip(*np.nonzero(~out)):  # the sampled token is in the head: k entries, not k+1
        logprobs[b][t].pop()
        token_ids[b][t].pop()
    return tokens.tolist(), logprobs, token_ids


def same_outputs(a, b) -> bool:
    (sa, ra), (sb, rb) = a, b
    T = ra.ids.size(1)
    ta, tb = ra.tensors(T), rb.tensors(T)
    return (
        sa == sb  # floats compare equal; None only equals None
        and torch.equal(ta[0], tb[0])
        and all(torch.equal(x.view(torch.int32), y.view(torch.int32)) for x, y in zip(ta[1:], tb[1:]))
    )


def timed(fn, *args):
    gc.collect()
    start = time.perf_counter()
    out = fn(*args)
    return time.perf_counter() - start, out


def sizes(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--B", type=sizes, default=[16], help="sequences; a comma-separated list runs each")
    p.add_argument("--T", type=sizes, default=[128, 256, 512, 1024, 2048, 4096, 8192],
                   help="positions per sequence; a list too")
    p.add_argument("--k", type=int, default=32, help="head size (logprobs=k)")
    p.add_argument("--repeats", type=int, default=3, help="runs of the new function; the fastest is reported")
    p.add_argument("--loops-max-positions", type=int, default=2**14, help="run the former loops up to B*T positions")
    p.add_argument("--threads", type=int, default=1, help="torch.set_num_threads")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    k = args.k

    print(f"k={k}, 30% of positions with k+1 entries, 1% None, threads={torch.get_num_threads()}, "
          f"numpy {np.__version__}, torch {torch.__version__}\n")
    print("| B | T | positions | entries | build lists (s) | loops (s) | parse_vllm_topk (s) | speed-up "
          "| new ns / position | same outputs |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |")
    points = []
    for B in args.B:
        for T in args.T:
            t_build, (completion_ids, logprobs, token_ids) = timed(make_lists, B, T, k, args.seed)
            entries = sum(len(e) for seq in token_ids for e in seq)
            inputs = (completion_ids, logprobs, token_ids, k)
            runs = [timed(parse_vllm_topk, *inputs) for _ in range(max(1, args.repeats))]
            t_new, new = min(runs, key=lambda r: r[0])[0], runs[0][1]
            if B * T <= args.loops_max_positions:
                t_old, old = timed(parse_vllm_topk_loops, *inputs)
                loops, speedup = f"{t_old:.3f}", f"{t_old / t_new:.3g}x"
                same = "yes" if same_outputs(old, new) else "NO"
            else:
                loops = speedup = same = "-"
            per_position = f"{1e9 * t_new / (B * T):.0f}" if B * T else "-"
            print(f"| {B} | {T} | {B * T} | {entries} | {t_build:.3f} | {loops} | {t_new:.4f} | {speedup} "
                  f"| {per_position} | {same} |", flush=True)
            points.append((B * T, t_new))
            del completion_ids, logprobs, token_ids, inputs, runs, new
    points = [(n, t) for n, t in points if n > 0]
    if len({n for n, _ in points}) > 1:
        slope = np.polyfit(np.log([n for n, _ in points]), np.log([t for _, t in points]), 1)[0]
        print(f"\nparse_vllm_topk: time ~ positions^{slope:.2f} over {len(points)} sizes "
              f"({min(points)[0]} to {max(points)[0]} positions)")


if __name__ == "__main__":
    main()
