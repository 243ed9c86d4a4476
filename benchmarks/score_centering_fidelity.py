"""Top-k fidelity of score centering on the real SmolLM2-135M-Instruct (figure for docs/score_centering.md).

    python benchmarks/score_centering_fidelity.py                      # k = 1, 4, 8, 32, 128
    python benchmarks/score_centering_fidelity.py --tiny --prompts 2   # smoke run on a tiny model

The sampler is a perturbed copy of the trainer (Gaussian weight noise of relative size --noise, or --fp16 for a
half-precision copy). It generates completions at temperature 1 from chat prompts; on those completions we compare,
in parameter space, the exact drift direction

    g_exact = grad_theta sum_t sum_v q_t(v) log p_t(v)            (full vocabulary)

with its top-k estimate  g_k = grad_theta sum_t sum_{v in H_k} sg[q_v - rho p_v] log p_v  (`score_centering_correction`).
We report ||g_k - g_exact|| / ||g_exact|| and the sampler's mass outside the head, 1 - sum_{H_k} q, averaged over
tokens. Cosine similarity is deliberately not used: it stays near 1 while the norm error is large.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import time

import torch

from trl_rpp import score_centering_correction

PROMPTS = [
    "Write one sentence about the sea.",
    "What is 17 + 25? Explain briefly.",
    "Name three colors and a fruit for each.",
    "Describe a cat in a short sentence.",
    "Give a tip for learning to cook.",
    "What is the capital of France? Answer and add a fact.",
    "Write a haiku about autumn.",
    "List two uses of a paperclip.",
]


def grads_of(model, loss):
    params = [p for p in model.parameters() if p.requires_grad]
    grads = torch.autograd.grad(loss, params, retain_graph=True, allow_unused=True)
    return torch.cat([(g if g is not None else torch.zeros_like(p)).flatten() for g, p in zip(grads, params)])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ks", default="1,4,8,32,128")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max_new_tokens", type=int, default=48)
    ap.add_argument("--noise", type=float, default=0.02, help="relative std of the sampler's weight noise")
    ap.add_argument("--fp16", action="store_true", help="sampler = float16 copy instead of weight noise")
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--out", default="docs/figures")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    torch.manual_seed(a.seed)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if a.tiny:
        import tempfile

        from trl_rpp.testing.tiny import build_tiny_model

        path = build_tiny_model(os.path.join(tempfile.mkdtemp(), "m"))
    else:
        from trl_rpp.testing.assets import smollm2_path

        path = str(smollm2_path())
    tok = AutoTokenizer.from_pretrained(path)
    tok.padding_side = "left"
    trainer = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    sampler = copy.deepcopy(trainer)
    with torch.no_grad():
        if a.fp16:
            sampler = sampler.half()
        else:
            for p in sampler.parameters():
                p.add_(torch.randn_like(p) * a.noise * p.std())
    V = trainer.config.vocab_size
    ks = [k for k in (int(x) for x in a.ks.split(",")) if k <= V]

    if a.tiny:
        texts = ["abcd:", "efgh:"][: a.prompts]
    else:
        texts = [
            tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True)
            for p in PROMPTS[: a.prompts]
        ]
    enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    t0 = time.time()
    with torch.no_grad():
        out = sampler.generate(**enc, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                               max_new_tokens=a.max_new_tokens, pad_token_id=tok.pad_token_id)
    P = enc["input_ids"].size(1)
    completion = out[:, P:]
    attn = torch.cat([enc["attention_mask"], torch.ones_like(completion)], dim=1)
    # Valid completion tokens: up to and including the first eos.
    eos = completion == tok.eos_token_id
    after_eos = (eos.cumsum(1) - eos.int()) > 0
    mask = ~after_eos
    T = completion.size(1)
    with torch.no_grad():
        q_logits = sampler(input_ids=out, attention_mask=attn).logits[:, P - 1 : P - 1 + T].float()
    logq = torch.log_softmax(q_logits, -1)
    logits = trainer(input_ids=out, attention_mask=attn).logits[:, P - 1 : P - 1 + T]
    logp = torch.log_softmax(logits.float(), -1)

    m = mask.unsqueeze(-1)
    exact_loss = torch.where(m, logq.exp() * logp, torch.zeros(())).sum()
    g_exact = grads_of(trainer, exact_loss)
    rows = []
    for k in ks:
        top = logq.topk(k, dim=-1)
        corr = score_centering_correction(logp.gather(-1, top.indices), top.values, mask)
        g_k = grads_of(trainer, corr.sum())
        rel = ((g_k - g_exact).norm() / g_exact.norm()).item()
        tail = (1 - top.values.exp().sum(-1))[mask].mean().item()
        rows.append(dict(k=k, relative_error=rel, sampler_tail_mass=tail))
        print(f"k={k:4d}  relative error {100 * rel:7.3f} %   sampler mass outside the head {tail:.4f}", flush=True)
    tv = 0.5 * (logq.exp() - logp.detach().exp()).abs().sum(-1)[mask].mean().item()
    info = dict(model=os.path.basename(path.rstrip("/")), sampler=("fp16 copy" if a.fp16 else f"weight noise {a.noise}"),
                tokens=int(mask.sum()), mean_tv_distance=tv, seconds=round(time.time() - t0, 1), rows=rows)
    print(json.dumps(info))
    os.makedirs(a.out, exist_ok=True)
    tag = "tiny" if a.tiny else ("fp16" if a.fp16 else "noise")
    with open(os.path.join(a.out, f"score_centering_fidelity_{tag}.json"), "w") as f:
        json.dump(info, f, indent=2)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.6))
    ax.plot([r["k"] for r in rows], [100 * r["relative_error"] for r in rows], "o-", label="relative error of top-k correction (%)")
    ax.plot([r["k"] for r in rows], [100 * r["sampler_tail_mass"] for r in rows], "s--", label="sampler mass outside the head (%)")
    ax.set(xscale="log", yscale="log", xlabel="k (head size)", ylabel="%",
           title=f"{info['model']}, sampler = {info['sampler']}, {info['tokens']} tokens")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(os.path.join(a.out, f"score_centering_fidelity_{tag}.png"), dpi=120)


if __name__ == "__main__":
    main()
