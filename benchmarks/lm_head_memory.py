"""Peak memory and time of one forward + backward of the log-prob head: TRL's fused head against `trl_rpp.lm_head`.

    python benchmarks/lm_head_memory.py                                  # V = 49,152 and 151,936; N = 2,048 to 16,384
    python benchmarks/lm_head_memory.py --vocabs 512 --positions 64,128 --hidden 16     # smoke run
    python benchmarks/lm_head_memory.py --arms replay --frozen-input-embedding           # the head's own V-dependence
    python benchmarks/lm_head_memory.py --arms replay --draw-ids per-vocab               # kept ids spread over each V

The model is a random-init Llama with one layer of hidden size `--hidden` (128) and a head of V ids; a batch of 2
sequences of 16 prompt and N / 2 completion tokens. The arms, each in its own process:

- `fused`: TRL's fused head (`add_fused_lm_head`, GRPO's loss forward: log-probs and entropies of the completion);
- `replay`: `log pi(y | S)` over kept sets of `top_k` = 20 ids (40 slots, as the trainer records them);
- `score_centering`: the sampled and k = 32 head ids' log-probs under the full softmax, in tiles;
- `both`: score centering over the kept sets (the head: the kept set's first 32 slots).

The batch (prompts, completions, kept sets, head ids) is drawn uniformly over the smallest vocabulary's ids, the
same batch at every V (`--draw-ids shared`), so that a ratio across V measures V alone. `--draw-ids per-vocab` draws
it over each V instead: the kept sets of the larger vocabulary then touch about twice as many distinct head rows (at
N = 8,192, some 100,000 of 151,936 against 47,000 of 49,152), rows whose gather and gradient replay pays for. That is
a worst case: uniform draws spread over more rows than any model's kept sets (`benchmarks/kept_set_rows.py` counts a
real model's).

Each step's loss is the sum of the log-probs it returns, backpropagated to every parameter (gradients allocated
before the step, so they are not counted). With `--frozen-input-embedding` the input embedding (untied from the head)
gets no gradient in any arm: its backward writes a dense `[V, H]` gradient, a cost of the backbone that grows with V
whatever the head does, so this isolates the head's own dependence on V. Measured quantity: the process's peak resident memory (Linux `VmHWM`,
reset through `/proc/self/clear_refs` right before the step) minus its resident memory just before, and the step's
wall time, one torch thread. Large blocks are returned to the system on free (`mallopt`).
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import re
import statistics
import subprocess
import sys
import time
import warnings

ARMS = ("fused", "replay", "score_centering", "both")
TOP_K, HEAD_K, PROMPT, BATCH = 20, 32, 16, 2


def _status_kib(field):
    with open("/proc/self/status") as f:
        return int(re.search(rf"{field}:\s+(\d+)", f.read()).group(1))


def build_arm(arm, vocab, positions, hidden, device="cpu", dtype=None, seed=0, frozen_input_embedding=False,
              ids_range=None):
    """The model and the step of `arm` (one of `ARMS`) at V = `vocab`, N = `positions` and hidden size `hidden`, on
    `device` in `dtype` (None: float32), with every parameter's gradient allocated (zeros), so that a step allocates
    none (with `frozen_input_embedding`, the input embedding has none and gets none). The batch's ids are drawn
    uniformly over `[0, ids_range)` (None: `[0, vocab)`); for one `seed` and `ids_range` it is the same at every V.
    Returns `(model, step)`:
    `step()` runs the arm's forward and returns its log-probs, `[B, T, n]` or `[B, T]`;
    their sum, backpropagated, is the measured step. Shared with benchmarks/gpu_check.py (part lm_head)."""
    if arm not in ARMS:
        raise ValueError(f"arm={arm!r} is not an arm of benchmarks/lm_head_memory.py; accepted: {', '.join(ARMS)}")
    ids_range = vocab if ids_range is None else ids_range
    if not 0 < ids_range <= vocab:
        raise ValueError(f"ids_range={ids_range} must be in [1, vocab={vocab}]")
    import torch
    import trl.trainer.utils  # noqa: F401  (loaded, as in a trainer, before the measured step: lm_head imports it)
    from transformers import LlamaConfig, LlamaForCausalLM

    from trl_rpp.records.replay import head_logps
    from trl_rpp.records.head import install_head_reader

    T = positions // BATCH
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=PROMPT + T + 1,
                         tie_word_embeddings=False)
    torch.manual_seed(seed)
    with torch.device(device):  # initialized where it runs (filled on a CPU, a 151,936-row head outlasts the steps)
        model = LlamaForCausalLM(config).to(dtype or torch.float32).train()
    g = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(ids_range, (BATCH, PROMPT + T), generator=g)
    attention_mask = torch.ones_like(input_ids)
    # Kept sets of TOP_K ids in 2 * TOP_K slots, the sampled token among them.
    support = torch.randint(ids_range, (BATCH, T, 2 * TOP_K), generator=g)
    support[..., TOP_K:] = -1
    support[..., 0] = input_ids[:, -T:]
    head = torch.randint(ids_range, (BATCH, T, HEAD_K), generator=g)
    ids = torch.cat([input_ids[:, -T:].unsqueeze(-1), support[..., :HEAD_K].clamp(min=0) if arm == "both" else head], -1)
    input_ids, attention_mask, support, ids = (x.to(device) for x in (input_ids, attention_mask, support, ids))
    if frozen_input_embedding:
        model.get_input_embeddings().weight.requires_grad_(False)
    for p in model.parameters():
        if p.requires_grad:
            p.grad = torch.zeros_like(p)
    if arm == "fused":
        from trl.trainer.utils import add_fused_lm_head

        add_fused_lm_head(model, temperature=0.7, outputs=("log_probs", "entropy"))
        labels = input_ids.clone()
        labels[:, :PROMPT] = -100

        def step():
            return model(input_ids=input_ids, attention_mask=attention_mask, labels=labels, fused_lm_head=True).log_probs
    else:
        install_head_reader(model)
        read = dict(replay=(ids[..., :1], support), score_centering=(ids, None), both=(ids, support))[arm]

        def step():
            return head_logps(model, input_ids, attention_mask, read[0], read[1], 0.7)[0]
    return model, step


def child(**arm):
    """One measured step of the arm `build_arm(**arm)` builds, on CPU; returns `{"peak_mib", "seconds"}`."""
    import torch

    ctypes.CDLL("libc.so.6").mallopt(-3, 64 * 1024)  # M_MMAP_THRESHOLD: freed blocks leave the RSS
    torch.set_num_threads(1)
    _, step = build_arm(**arm)
    gc.collect()
    before = _status_kib("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current RSS (Linux >= 4.0)
    start = time.perf_counter()
    step().sum().backward()
    seconds = time.perf_counter() - start
    return {"peak_mib": (_status_kib("VmHWM") - before) / 1024, "seconds": seconds}


def run(**arm):
    """`child(**arm)` in a process of its own."""
    cmd = [sys.executable, os.path.abspath(__file__), "--child", json.dumps(arm)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def ratio(results, a, b, key):
    return results[a][key] / results[b][key] if a in results and b in results else float("nan")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vocabs", default="49152,151936")
    ap.add_argument("--positions", default="2048,4096,8192,16384")
    ap.add_argument("--arms", default=",".join(ARMS))
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=1, help="processes per arm and size; the medians are reported")
    ap.add_argument("--frozen-input-embedding", action="store_true",
                    help="no gradient for the input embedding in any arm: the head's own cost (see above)")
    ap.add_argument("--draw-ids", choices=("shared", "per-vocab"), default="shared",
                    help="shared: one batch over the smallest vocabulary's ids at every V; per-vocab: over each V")
    ap.add_argument("--json", help="also write the results here")
    ap.add_argument("--child", help=argparse.SUPPRESS)  # build_arm's arguments, as JSON
    opts = ap.parse_args()
    vocabs, positions = [int(v) for v in opts.vocabs.split(",")], [int(n) for n in opts.positions.split(",")]
    if opts.child:
        warnings.filterwarnings("ignore")
        print(json.dumps(child(**json.loads(opts.child))))
        return
    arms = opts.arms.split(",")
    ids_range = min(vocabs) if opts.draw_ids == "shared" else None
    results = {}
    print(f"hidden {opts.hidden}, {BATCH} sequences, top_k {TOP_K}, k {HEAD_K}; peak MiB above the pre-step RSS, "
          f"seconds of one forward + backward (one thread); medians of {opts.repeats} process(es) per cell"
          + ("; input embedding frozen" if opts.frozen_input_embedding else "")
          + (f"; one batch over ids < {ids_range:,} at every V" if ids_range else "; ids drawn over each V"))
    print("| V | N | " + " | ".join(arms) + " |")
    print("|---|---|" + "---|" * len(arms))
    for N in positions:  # the vocabularies side by side, alternating, so that a drift of the machine hits both alike
        for arm in arms:
            runs = {V: [] for V in vocabs}
            for _ in range(opts.repeats):
                for V in vocabs:
                    runs[V].append(run(arm=arm, vocab=V, positions=N, hidden=opts.hidden, ids_range=ids_range,
                                       frozen_input_embedding=opts.frozen_input_embedding))
            for V in vocabs:
                results[(arm, V, N)] = {k: statistics.median(x[k] for x in runs[V]) for k in runs[V][0]}
        for V in vocabs:
            cells = [f"{results[(a, V, N)]['peak_mib']:.0f} MiB, {results[(a, V, N)]['seconds']:.2f} s" for a in arms]
            print(f"| {V:,} | {N:,} | " + " | ".join(cells) + " |", flush=True)
    lo, hi, n0, n1 = vocabs[0], vocabs[-1], positions[0], positions[-1]
    for N in positions:
        for key in ("peak_mib", "seconds"):
            print(f"replay {key} at N={N}: V={hi} / V={lo}: {ratio(results, ('replay', hi, N), ('replay', lo, N), key):.2f}; "
                  f"replay / fused at V={hi}: {ratio(results, ('replay', hi, N), ('fused', hi, N), key):.3f}")
    for V in vocabs:
        print(f"score_centering at V={V}: peak N={n1} / N={n0}: "
              f"{ratio(results, ('score_centering', V, n1), ('score_centering', V, n0), 'peak_mib'):.2f}; "
              f"/ fused at N={n1}: peak {ratio(results, ('score_centering', V, n1), ('fused', V, n1), 'peak_mib'):.2f}, "
              f"time {ratio(results, ('score_centering', V, n1), ('fused', V, n1), 'seconds'):.2f}")
    if opts.json:
        with open(opts.json, "w") as f:
            json.dump([{"arm": a, "vocab": V, "positions": N, **r} for (a, V, N), r in results.items()], f, indent=1)


if __name__ == "__main__":
    main()
