"""Replay of a truncating sampler's kept support in `RPPTrainer` (`replay_sampler_support=True`, the default).

With `top_k`, `top_p` or `min_p` (and, on transformers' path, `typical_p`, `epsilon_cutoff`, `eta_cutoff` or
`top_h`), the sampler draws each token from `q_S = q / q(S_t)` over its kept set `S_t`. The trainer then reads every
log-prob of a sampled token as `log pi(y | S_t)`, renormalized over the same set (`trl_rpp.truncation`):

- the old policy's and the reference's at generation (GRPO's `_get_per_token_logps_and_entropies`, so TRL's vLLM
  importance-sampling ratio `pi_old(y | S) / q_S(y)` is 1 on-policy, in every mode), and the policy's in the loss
  (the PPO ratio);
- the KL to the reference in both forms: k1 in the reward and k2 (or k1) in the loss compare `pi(. | S_t)` with
  `pi_ref(. | S_t)`, both renormalized over the sampler's set. Samples come from `q_S`, so only then is the k1
  mean an estimate of a KL (that of the two truncated distributions) and the k2 gradient that KL's gradient; the
  full-vocabulary form adds `log pi(S_t) - log pi_ref(S_t)`, which samples from `q_S` never average out;
- score centering: the sampler's head is the kept set's first `min(score_centering_top_k, 2 top_k)` ids, and the
  centered score `grad log pi(y | S) - E_{q_S}[grad log pi(. | S)]` is taken under `q_S` (no tail when the head
  holds the whole set).

Where the set comes from: transformers' `generate` records it after every warper (`SamplerSupportCapture`); vLLM
returns it with `logprobs = 2 top_k` and `logprobs_mode="processed_logprobs"` (the colocated engine's mode, and the
one a server must run): the kept ids carry finite log-probs, the others `-inf`. The bound: `top_k` must be set (1 to
`MAX_SUPPORT`) whenever something truncates, as vLLM bounds its own log-probs; the record holds `2 top_k` ids per
position (`record_width`), room for the ties `top_k` keeps at its k-th score, and a larger kept set raises (those
rules: `trl_rpp.records.settings`). Memory is `O(B * T * top_k)` ids and log-probs: the forwards read only the kept
ids' head rows (`trl_rpp.lm_head`), through the head reader (`trl_rpp.records.head`), never the `[B, T, V]` logits.
"""

from __future__ import annotations

import torch

from ..truncation import ABSENT


def replayed_logps(model, input_ids, attention_mask, logits_to_keep, support_ids, temperature, batch_size=None,
                   compute_entropy=False, autocast=None, forward=None):
    """`log pi(y_t | S_t)` of the completion tokens, what GRPO's `_get_per_token_logps_and_entropies` returns but
    renormalized over the kept sets. Chunked over rows as GRPO's; each chunk reads the head rows of the kept ids only
    (`trl_rpp.lm_head.kept_logps`, through the head reader of `trl_rpp.records.head`).

    Args:
        model: the causal LM (policy or reference), its forward patched by `install_head_reader`.
        input_ids, attention_mask: `[B, P + T]` prompt and completion.
        logits_to_keep: `T`, the completion positions.
        support_ids: `[B, T, K]` the kept ids, `ABSENT`-padded (`truncation.support_of`); None: the full softmax
            instead (`lm_head.full_logps`) at the positions `attention_mask` keeps, 0 elsewhere, what GRPO's fused head
            returns (for a LoRA adapter on the head, which that fused head would not read).
        temperature: the sampling temperature.
        batch_size: rows per forward (GRPO's chunking), all at once when None.
        compute_entropy: also return the entropies of `pi(. | S_t)` (no gradient).
        autocast: a context manager factory for the forward (the accelerator's), or None.
        forward: the other model inputs GRPO passes (multimodal ones, refused at construction); all must be None.

    Returns:
        `(logps [B, T], entropies [B, T] or None, None)`; both are 0 where a position holds no kept id (padding,
        tool tokens).
    """
    extra = [name for name, value in (forward or {}).items() if value is not None]
    if extra:  # multimodal inputs are refused at construction (`records.settings.check_sampler_record_support`)
        raise RuntimeError(f"replay_sampler_support: unexpected forward inputs {extra}")
    if support_ids is not None and support_ids.shape[:2] != (input_ids.size(0), logits_to_keep):
        raise RuntimeError(f"the sampler's kept sets cover {tuple(support_ids.shape[:2])} completion positions, the "
                           f"forward {(input_ids.size(0), logits_to_keep)}: they must describe the same batch")
    batch_size = batch_size or input_ids.size(0)
    all_logps, all_entropies = [], []
    token_ids = input_ids[:, -logits_to_keep:]
    for start in range(0, input_ids.size(0), batch_size):
        rows = slice(start, start + batch_size)
        support = None if support_ids is None else support_ids[rows]
        valid = attention_mask[rows, -logits_to_keep:].bool() if support_ids is None else None
        logps, entropies = head_logps(model, input_ids[rows], attention_mask[rows], token_ids[rows].unsqueeze(-1),
                                      support, temperature, autocast, valid)
        all_logps.append(logps.squeeze(-1))
        all_entropies.append(entropies)
    entropies = torch.cat(all_entropies) if compute_entropy else None
    return torch.cat(all_logps), entropies, None


def head_logps(model, input_ids, attention_mask, ids, support_ids, temperature, autocast=None, valid=None):
    """The log-probs at `ids` `[B, T, n]` of the last `T` tokens' positions, and the entropies `[B, T]`, read from the
    final hidden states and the head in tiles: over the kept sets `support_ids` `[B, T, K]` (`lm_head.kept_logps`),
    or, with `support_ids` None, under the full softmax (`lm_head.full_logps`, at the `valid` `[B, T]` positions).
    No tensor of `[B, T, V]` exists in the forward or the backward."""
    from contextlib import nullcontext

    from ..lm_head import full_logps, kept_logps

    B, T, n = ids.shape

    def read(hidden, weight, bias, transform, lowrank):  # inside the model's forward, on `hidden` [B, P + T, H]
        h = hidden[:, -T - 1 : -1].reshape(B * T, -1)
        if lowrank is not None:  # a LoRA adapter on the head: u [B, P + T, r], read at the same positions
            lowrank = (lowrank[0][:, -T - 1 : -1].reshape(B * T, -1), lowrank[1])
        if support_ids is None:
            out = full_logps(h, weight, bias, ids.reshape(B * T, n), temperature, transform,
                             None if valid is None else valid.reshape(B * T), lowrank=lowrank)
        else:
            out = kept_logps(h, weight, bias, ids.reshape(B * T, n), support_ids.reshape(B * T, -1), temperature,
                             transform, lowrank=lowrank)
        return out[0].view(B, T, n), out[1].view(B, T)

    with (autocast or nullcontext)():
        return model(input_ids=input_ids, attention_mask=attention_mask, rpp_read_head=read)


def head_is_whole_support(support_ids, head_width):
    """`[B, T]` bool: the head (the kept set's first `head_width` ids) holds the whole kept set, so score centering's
    tail is empty there."""
    return (support_ids != ABSENT).sum(-1) <= head_width


def kept_sets_of_generation(generated, capture, captures, engine, vocab_size, device):
    """The kept sets of a generation batch, from its sampler record, for the replay.

    Args:
        generated: GRPO's `_generate` output (its 8-tuple: completion ids at 1, the tool mask at 2).
        capture: the batch's record (`SamplerSupportCapture`, or a `RecordedTopK` of vLLM or a rollout_func).
        captures: the `SamplerSupportCapture` of each transformers `generate` call (none for an engine's record).
        engine: the record came from an engine (vLLM, a rollout_func), which may hide tied kept ids.
        vocab_size: `V`.
        device: where the kept sets go.

    Returns:
        `(generated, support_ids [B, T, K], overflow)`: `generated` with the tool mask of `mask_full_records` for an
        engine's record, the kept ids (`ABSENT`-padded), and the number of positions whose kept set did not fit the
        record (cut to it before sampling, or masked). Raises when a sampled token is outside its kept set.
    """
    from ..truncation import support_of

    completion_ids, tool_mask = generated[1], generated[2]
    ids, logps, _ = capture.tensors(max((len(c) for c in completion_ids), default=0))
    support = support_of(ids, logps).to(device)
    if engine:
        tool_mask, overflow = mask_full_records(completion_ids, tool_mask, support, vocab_size)
        generated = (*generated[:2], tool_mask, *generated[3:])
    else:  # one host read per `generate` call, for the metric
        overflow = sum(int(c.overflowed) for c in captures if getattr(c, "overflowed", None) is not None)
    check_tokens_in_support(completion_ids, tool_mask, support)
    return generated, support, overflow


def mask_full_records(completion_ids, tool_mask, support_ids, vocab_size):
    """Mask holes where an engine's record (vLLM's log-probs, a `rollout_func`'s lists) may not hold the whole kept
    set: every slot of the position's record holds a kept id, and the record is narrower than the vocabulary. Only
    ties at `top_k`'s k-th score fill a `2 top_k` record, and the engine may have kept more of them than it reported;
    `log pi(y | S)` cannot be replayed there, so such a token leaves the loss (``tool_mask = 0``, as a tool output
    token does) instead of ending the run. transformers' `generate` never needs this: its capture cuts the kept set to
    the record before sampling (`SamplerSupportCapture`). One host read per generation batch.

    Args:
        completion_ids: `B` lists of sampled ids (TRL's `_generate` output).
        tool_mask: `B` lists of 0/1, or None (every token is a model token).
        support_ids: `[B, T, K]` the kept ids, `ABSENT`-padded, `T >= max(len)`.
        vocab_size: `V`; a record `K >= V` wide holds every id.

    Returns:
        `(tool_mask, masked)`: the mask with 0 at such positions (unchanged, None included, when there are none) and
        their number among the model tokens.
    """
    K = support_ids.size(-1)
    if K >= vocab_size:
        return tool_mask, 0
    full = (support_ids != ABSENT).all(-1).cpu()
    masked = 0
    rows = []
    for b, ids in enumerate(completion_ids):
        row = [1] * len(ids) if tool_mask is None else list(tool_mask[b])
        for t in torch.nonzero(full[b, : len(ids)]).flatten().tolist():
            masked += row[t]
            row[t] = 0
        rows.append(row)
    return (rows if masked else tool_mask), masked


def check_tokens_in_support(completion_ids, tool_mask, support_ids):
    """Raise `RuntimeError` when a sampled model token is not in its recorded kept set: the record would then not
    describe the sampler (a misaligned capture, or a server that returns raw log-probs). One host read per
    generation batch.

    Args:
        completion_ids: `B` lists of sampled ids (TRL's `_generate` output).
        tool_mask: `B` lists of 0/1 (tool output tokens are 0), or None.
        support_ids: `[B, T, K]` the kept ids, `ABSENT`-padded, `T >= max(len)`.
    """
    from ..truncation import token_in_support

    B, T = support_ids.shape[:2]
    tokens = torch.zeros(B, T, dtype=torch.long)
    valid = torch.zeros(B, T, dtype=torch.bool)
    for b, ids in enumerate(completion_ids):
        tokens[b, : len(ids)] = torch.as_tensor(list(ids), dtype=torch.long)
        valid[b, : len(ids)] = True if tool_mask is None else torch.as_tensor(list(tool_mask[b]), dtype=torch.bool)
    inside = token_in_support(tokens.to(support_ids.device), support_ids, valid.to(support_ids.device)).cpu()
    if not bool(inside.all()):
        b, t = (int(i) for i in torch.nonzero(~inside)[0])
        raise RuntimeError(
            f"the sampled token {int(tokens[b, t])} of completion {b}, position {t} is not among the {support_ids.size(-1)} "
            "kept ids recorded for it: the record does not describe the sampler (a vLLM server must run "
            "`--logprobs-mode processed_logprobs`)"
        )
