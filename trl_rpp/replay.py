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
position (`record_width`), room for the ties `top_k` keeps at its k-th score, and a larger kept set raises. Memory is
`O(B * T * top_k)` ids and log-probs: the forwards read only the kept ids' head rows (`trl_rpp.lm_head`), through
the model's forward patched by `install_head_reader`, never the `[B, T, V]` logits.
"""

from __future__ import annotations

import torch

from .errors import unsupported
from .sampling import NEUTRAL_SAMPLING, NEUTRAL_VLLM_SAMPLING
from .truncation import ABSENT

MAX_SUPPORT = 256  # the largest top_k: the record holds twice as many ids per position (`record_width`)
# The settings whose effect on q is a truncation to a kept set, which the replay reproduces exactly.
REPLAYED = ("top_k", "top_p", "min_p", "typical_p", "epsilon_cutoff", "eta_cutoff", "top_h")
REPLAYED_VLLM = ("top_k", "top_p", "min_p")


def record_width(bound: int | None) -> int:
    """Ids recorded per position for a kept-set bound `top_k`: twice as many (0 without a bound). `top_k` keeps every
    token whose score ties the k-th, so a kept set can exceed `top_k`, often with a bfloat16 engine (measured: a
    SmolLM2 vLLM engine in bf16 at top_k=20); the record has room for such ties, and a larger set raises."""
    return 2 * bound if bound else 0


def truncating(settings: dict, vllm: bool) -> list[str]:
    """The names of the replayed settings in `settings` (transformers' or, with `vllm`, vLLM's names) that truncate."""
    neutral = NEUTRAL_VLLM_SAMPLING if vllm else NEUTRAL_SAMPLING
    return [n for n in (REPLAYED_VLLM if vllm else REPLAYED) if n in settings and settings[n] not in neutral[n]]


def support_bound(settings: dict, vllm: bool, replay: bool, where: str = "") -> int | None:
    """The bound `K` of the kept sets (`top_k`) when `settings` truncate and `replay` is on, else None.

    Raises `ValueError` naming `top_k` when something truncates without a `top_k` in 1..`MAX_SUPPORT`."""
    names = truncating(settings, vllm)
    if not (replay and names):
        return None
    top_k = settings.get("top_k")
    if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= MAX_SUPPORT:
        raise unsupported(
            f"{where}top_k", top_k, f"an integer from 1 to {MAX_SUPPORT}",
            under=f"{', '.join(names)} and replay_sampler_support=True",
            why="The replay reads every kept set, and top_k bounds its size (and the memory it takes); set "
            "replay_sampler_support=False to train on the full-vocabulary log-probs instead (biased).",
        )
    return top_k


def replayed_logps(model, input_ids, attention_mask, logits_to_keep, support_ids, temperature, batch_size=None,
                   compute_entropy=False, autocast=None):
    """`log pi(y_t | S_t)` of the completion tokens, what GRPO's `_get_per_token_logps_and_entropies` returns but
    renormalized over the kept sets. Chunked over rows as GRPO's; each chunk reads the head rows of the kept ids only
    (`trl_rpp.lm_head.kept_logps`, through `install_head_reader`'s forward).

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

    Returns:
        `(logps [B, T], entropies [B, T] or None, None)`; both are 0 where a position holds no kept id (padding,
        tool tokens).
    """
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

    from .lm_head import full_logps, kept_logps

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


def completion_logits(model, input_ids, attention_mask, logits_to_keep, autocast=None):
    """`[B, T, V]` logits predicting the last `logits_to_keep` tokens of `input_ids` (the truncation study's)."""
    from contextlib import nullcontext

    with (autocast or nullcontext)():
        logits = model(input_ids=input_ids, attention_mask=attention_mask, logits_to_keep=logits_to_keep + 1).logits
    return logits[:, :-1]


def head_transform(config):
    """The `lm_head.HeadTransform` a causal LM of `config` applies after its head, read from the same config fields
    as TRL's fused head: `final_logit_softcapping`; `logit_scale` (Cohere), `output_multiplier`,
    `lm_head_multiplier` (Falcon-H1) or HyperCLOVA X's `logits_scaling` multiply; Granite's `logits_scaling`
    divides."""
    from .lm_head import HeadTransform

    text = config.get_text_config()
    scale = next((v for v in (getattr(text, a, None) for a in ("logit_scale", "output_multiplier",
                                                                "lm_head_multiplier")) if v is not None), None)
    divisor = getattr(text, "logits_scaling", None) if scale is None else None
    if divisor is not None and text.model_type == "hyperclovax":
        scale, divisor = divisor, None
    return HeadTransform(scale, divisor, getattr(text, "final_logit_softcapping", None))


def lora_head(head) -> bool:
    """True when `head` is PEFT's LoRA `Linear` layer (a LoRA adapter targets the head), False for any other module."""
    try:
        from peft.tuners.lora import Linear
    except ImportError:  # without PEFT no head carries an adapter
        return False
    return type(head) is Linear


def check_lora_head(head, kind):
    """Raise `ValueError` naming the setting and the model type `kind` when a LoRA head (`lora_head`) has an adapter
    that is not plain LoRA (DoRA, any other LoRA variant, `lora_bias`) or a base layer other than a plain linear map:
    only `h W^T + b + scaling * lora_B(lora_A(dropout(h)))` is read from the head's rows (`head_lowrank`)."""
    for adapter in head.lora_A:
        variant = head.lora_variant.get(adapter)
        settings = [" and ".join(k) for k, cls in head.lora_variants.items()
                    if cls is not None and type(variant) is cls]
        setting = (settings or [type(variant).__name__])[0] if variant is not None else None
        if setting is None and head.lora_bias.get(adapter):
            setting = "lora_bias=True"
        if setting is not None:
            raise ValueError(f"model type {kind!r} is not supported with a LoRA adapter on its head set with {setting} "
                             f"(adapter {adapter!r}): only plain LoRA (LoraConfig without a LoRA variant or lora_bias) "
                             "can be read from the head's rows; remove the head from target_modules or that setting")
    base = head.base_layer
    if type(base) is not torch.nn.Linear:
        raise ValueError(f"model type {kind!r} is not supported with a LoRA adapter on its head: the adapter wraps a "
                         f"{type(base).__name__}, not a plain linear head")


def head_lowrank(head, hidden, kind=""):
    """The head's `(weight [V, H], bias [V] or None, lowrank)` as PEFT's own forward of a LoRA head reads its state at
    this call: `lowrank` None when the adapters are disabled (the reference model), merged (the base weight holds
    them) or none is active; else `(u [..., r], lora_b [V, r])`, `u = scaling * lora_A(dropout(hidden))` (autograd,
    PEFT's dropout and input cast), the active adapters' terms concatenated along `r` (their sum). A plain linear head
    (not `lora_head`) gives its weight and bias and None. `kind`: the model type, for `check_lora_head`'s error."""
    if not lora_head(head):
        return head.weight, head.bias, None
    base = head.base_layer
    if head.disable_adapters:
        if head.merged:  # PEFT's forward unmerges here too
            head.unmerge()
        return base.weight, base.bias, None
    if head.merged:
        return base.weight, base.bias, None
    us, bs = [], []
    for adapter in head.active_adapters:
        if adapter not in head.lora_A:  # PEFT skips an active adapter this layer does not hold
            continue
        if adapter in head.lora_variant or head.lora_bias.get(adapter):  # added after construction
            check_lora_head(head, kind)
        lora_a = head.lora_A[adapter]
        x = head._cast_input_dtype(hidden, lora_a.weight.dtype)
        us.append(lora_a(head.lora_dropout[adapter](x)) * head.scaling[adapter])
        bs.append(head.lora_B[adapter].weight)
    if not us:
        return base.weight, base.bias, None
    lowrank = (us[0], bs[0]) if len(us) == 1 else (torch.cat(us, -1), torch.cat(bs, -1))
    return base.weight, base.bias, lowrank


def install_head_reader(model):
    """Patch `model`'s forward (the base model under PEFT) so that `model(..., rpp_read_head=read)` runs the backbone
    and returns `read(hidden [B, S, H], weight [V, H], bias [V] or None, transform, lowrank)` instead of logits, with
    `lowrank` None or, for a LoRA adapter on the head, `(u [B, S, r], lora_b [V, r])` (`head_lowrank`); without
    `rpp_read_head` it is the forward it was. The backbone and head are looked up at each call (FSDP and PEFT replace
    them), inside the forward, so DDP, FSDP and ZeRO-3 hooks fire as for the logits.

    Raises `ValueError` naming the model type when the head cannot be read this way: no linear `[V, H]` output
    embedding, no separate backbone, or a PEFT adapter on the head other than plain LoRA (`check_lora_head`)."""
    import functools
    import types

    from accelerate.utils import is_peft_model

    base = model.get_base_model() if is_peft_model(model) else model
    head, kind = base.get_output_embeddings(), base.config.get_text_config().model_type
    if lora_head(head):
        check_lora_head(head, kind)
        head = head.base_layer
    why = None
    if base.config.get_text_config() is not base.config:
        why = "a multimodal model"
    elif not isinstance(head, torch.nn.Linear) or type(head).forward is not torch.nn.Linear.forward:
        why = f"its output embeddings are a {type(head).__name__}, not a plain linear head"
    elif getattr(base, "base_model", base) is base:
        why = "it has no backbone module apart from its head"
    if why:
        raise ValueError(f"model type {kind!r} is not supported with a replayed truncating sampler or score centering: "
                         f"{why}, so its log-probs cannot be read from the final hidden states and the head's rows")
    transform, forward = head_transform(base.config), base.forward

    @functools.wraps(type(base).forward)  # `generate` validates its model kwargs against this signature
    def read_forward(self, *args, rpp_read_head=None, **kwargs):
        if rpp_read_head is None:
            return forward(*args, **kwargs)
        for name in ("labels", "logits_to_keep", "num_items_in_batch", "return_dict"):
            kwargs.pop(name, None)
        hidden = self.base_model(*args, **{**kwargs, "use_cache": False}).last_hidden_state
        lm_head = self.get_output_embeddings()
        weight, bias, lowrank = head_lowrank(lm_head, hidden.to(lm_head.weight.device), kind)
        if hasattr(weight, "full_tensor"):  # FSDP2: the head is a DTensor, the hidden states a plain tensor
            weight, bias = weight.full_tensor(), None if bias is None else bias.full_tensor()
        if lowrank is not None and hasattr(lowrank[1], "full_tensor"):
            lowrank = (lowrank[0], lowrank[1].full_tensor())
        from trl.trainer.utils import maybe_gather_lm_head_ctx

        lora_b = None if lowrank is None or not isinstance(lowrank[1], torch.nn.Parameter) else lowrank[1]
        with maybe_gather_lm_head_ctx(weight, bias, lora_b):  # ZeRO-3: the partitioned head, gathered for the read
            return rpp_read_head(hidden.to(weight.device), weight, bias, transform, lowrank)

    base.forward = types.MethodType(read_forward, base)


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
    from .truncation import support_of

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
    from .truncation import token_in_support

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
