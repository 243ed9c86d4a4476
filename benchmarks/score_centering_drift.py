"""Drift with and without score centering (figure for docs/score_centering.md).

    python benchmarks/score_centering_drift.py                # tiny local model, 80 steps per arm
    python benchmarks/score_centering_drift.py --steps 5      # smoke run

Set-up, as in docs/score_centering.md: the sampler is the trainer plus a fixed bias (+`--bias` on the logits of a few
token ids), re-synced to the trainer's current weights at every step. Every sampled token gets the same positive
advantage A = 1, so the only systematic force in the update is the drift E_q[R] * E_q[grad log p], which fits the
trainer to the sampler's bias. Each arm starts from the same weights and seed; the uncorrected arm uses the loss
-A log p_y, the centered arm -A (log p_y - correction) with the sampler's top-k head captured during `generate`
(`trl_rpp.records.capture`) and `trl_rpp.score_centering_correction`. We track the trainer's probability mass on the
biased ids, averaged over the sampled positions of a fixed evaluation batch.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LogitsProcessor, LogitsProcessorList

from trl_rpp import score_centering_correction
from trl_rpp.records.capture import SamplerTopKCapture
from trl_rpp.testing.tiny import build_tiny_model


class AddBias(LogitsProcessor):
    def __init__(self, ids, value):
        self.ids, self.value = ids, value

    def __call__(self, input_ids, scores):
        scores = scores.clone()
        scores[:, self.ids] += self.value
        return scores


def biased_mass(model, eval_ids, eval_mask, biased_ids):
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=eval_ids).logits[:, :-1].float(), -1)
    mass = logp[..., biased_ids].exp().sum(-1)
    return mass[eval_mask].mean().item()


def run_arm(path, centered, opts, biased_ids, eval_ids, eval_mask):
    torch.manual_seed(opts.seed)
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    optim = torch.optim.SGD(model.parameters(), lr=opts.lr)
    prompts = tok(["abcd:"] * opts.batch, return_tensors="pt", add_special_tokens=False)
    P = prompts["input_ids"].size(1)
    history = [biased_mass(model, eval_ids, eval_mask, biased_ids)]
    for _ in range(opts.steps):
        capture = SamplerTopKCapture(opts.k, 1.0)
        model.eval()
        with torch.no_grad():
            # The sampler = current trainer weights + the fixed bias; the capture runs after the bias.
            out = model.generate(
                **prompts, do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=opts.length,
                min_new_tokens=opts.length, pad_token_id=tok.pad_token_id,
                logits_processor=LogitsProcessorList([AddBias(biased_ids, opts.bias), capture]),
            )
        capture.finish(out[:, -1])
        model.train()
        completion = out[:, P:]
        T = completion.size(1)
        mask = torch.ones_like(completion, dtype=torch.bool)
        logp_all = torch.log_softmax(model(input_ids=out).logits[:, P - 1 : P - 1 + T].float(), -1)
        logp = logp_all.gather(-1, completion.unsqueeze(-1)).squeeze(-1)
        token_loss = -logp  # A = 1 for every token
        if centered:
            ids, head_q, _ = capture.tensors(T)
            token_loss = token_loss + score_centering_correction(logp_all.gather(-1, ids), head_q, mask)
        optim.zero_grad()
        token_loss.mean().backward()
        optim.step()
        history.append(biased_mass(model, eval_ids, eval_mask, biased_ids))
    return history


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=80)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--length", type=int, default=8)
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--bias", type=float, default=0.5)
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default="docs/figures")
    opts = ap.parse_args()
    torch.set_num_threads(opts.threads)
    path = build_tiny_model(os.path.join(tempfile.mkdtemp(), "m"))
    tok = AutoTokenizer.from_pretrained(path)
    biased_ids = tok.convert_tokens_to_ids(list("xyz"))
    g = torch.Generator().manual_seed(123)
    eval_ids = torch.randint(3, len(tok), (16, 12), generator=g)
    eval_mask = torch.ones(16, 11, dtype=torch.bool)

    results = {}
    for name, centered in (("uncorrected", False), ("score_centered", True)):
        results[name] = run_arm(path, centered, opts, biased_ids, eval_ids, eval_mask)
        print(f"{name:15s} mass on biased ids: start {results[name][0]:.4f} -> end {results[name][-1]:.4f}", flush=True)
    os.makedirs(opts.out, exist_ok=True)
    with open(os.path.join(opts.out, "score_centering_drift.json"), "w") as f:
        json.dump(dict(options=vars(opts), biased_tokens="xyz", history=results), f, indent=2)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.6))
    for name, hist in results.items():
        ax.plot(range(len(hist)), hist, label=name.replace("_", " "))
    ax.set(xlabel="update step (sampler re-synced each step)", ylabel="trainer mass on biased tokens")
    ax.set_title(f"sampler = trainer + {opts.bias} logit bias on 3 tokens; A = 1", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(os.path.join(opts.out, "score_centering_drift.png"), dpi=120)


if __name__ == "__main__":
    main()
