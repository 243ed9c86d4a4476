"""The LM head read from the final hidden states: the head reader every replayed or score-centered forward goes
through, and a LoRA adapter on the head (`lm_head` in `target_modules`), which `RPPTrainer` trains where
`GRPOTrainer` refuses it.

`install_head_reader` has the model's forward hand the final hidden states, the head's weight and bias, the
post-head transform (`head_transform`) and a LoRA adapter's low-rank term (`head_lowrank`, read as PEFT's own
forward reads it) to a reader; the tiled math is `trl_rpp.lm_head`. A model whose head cannot be read this way is
refused, naming its type. `lora_head_allowed` decides, before any model is loaded, whether GRPO's refusal of a LoRA
head is let through (`trl_rpp.patches.lm_head_lora_allowed`) or a setting that cannot train it is refused.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

from ..patches import head_reader_forward, lm_head_lora_allowed, lora_input


def head_transform(config):
    """The `lm_head.HeadTransform` a causal LM of `config` applies after its head, read from the same config fields
    as TRL's fused head: `final_logit_softcapping`; `logit_scale` (Cohere), `output_multiplier`,
    `lm_head_multiplier` (Falcon-H1) or HyperCLOVA X's `logits_scaling` multiply; Granite's `logits_scaling`
    divides."""
    from ..lm_head import HeadTransform

    text = config.get_text_config()
    scale = next((v for v in (getattr(text, a, None) for a in ("logit_scale", "output_multiplier",
                                                                "lm_head_multiplier")) if v is not None), None)
    divisor = getattr(text, "logits_scaling", None) if scale is None else None
    if divisor is not None and text.model_type == "hyperclovax":
        scale, divisor = divisor, None
    return HeadTransform(scale, divisor, getattr(text, "final_logit_softcapping", None))


def lora_head(head) -> bool:
    """True when `head` is PEFT's LoRA `Linear` layer (a LoRA adapter targets the head), False for any other module.
    Asked once, before training wraps the model: FSDP2's `fully_shard` later swaps the head's class for a subclass."""
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


def head_lowrank(head, hidden, kind="", lora=None):
    """The head's `(weight [V, H], bias [V] or None, lowrank)` as PEFT's own forward of a LoRA head reads its state at
    this call: `lowrank` None when the adapters are disabled (the reference model), merged (the base weight holds
    them) or none is active; else `(u [..., r], lora_b [V, r])`, `u = scaling * lora_A(dropout(hidden))` (autograd,
    PEFT's dropout and input cast), the active adapters' terms concatenated along `r` (their sum). A plain linear head
    (not `lora_head`) gives its weight and bias and None. `kind`: the model type, for `check_lora_head`'s error.
    `lora`: whether `head` is a LoRA head, as `install_head_reader` found it (None: `lora_head(head)` now)."""
    if not (lora_head(head) if lora is None else lora):
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
        x = lora_input(head, hidden, lora_a.weight.dtype)
        us.append(lora_a(head.lora_dropout[adapter](x)) * head.scaling[adapter])
        bs.append(head.lora_B[adapter].weight)
    if not us:
        return base.weight, base.bias, None
    lowrank = (us[0], bs[0]) if len(us) == 1 else (torch.cat(us, -1), torch.cat(bs, -1))
    return base.weight, base.bias, lowrank


def install_head_reader(model):
    """Have `model`'s forward (the base model's under PEFT) take `rpp_read_head=read` and return `read(hidden [B, S, H],
    weight [V, H], bias [V] or None, transform, lowrank)` instead of logits (`trl_rpp.patches.head_reader_forward`),
    with `lowrank` None or, for a LoRA adapter on the head, `(u [B, S, r], lora_b [V, r])` (`head_lowrank`).

    Raises `ValueError` naming the model type when the head cannot be read this way: no linear `[V, H]` output
    embedding, no separate backbone, or a PEFT adapter on the head other than plain LoRA (`check_lora_head`)."""
    from accelerate.utils import is_peft_model

    base = model.get_base_model() if is_peft_model(model) else model
    head, kind = base.get_output_embeddings(), base.config.get_text_config().model_type
    lora = lora_head(head)  # decided here, once: FSDP2 swaps the head's class when training starts
    if lora:
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
    head_reader_forward(base, lambda lm_head, hidden: head_lowrank(lm_head, hidden, kind, lora),
                        head_transform(base.config))


def _tied_head(model) -> bool:
    """Whether `model` (a path or a model, PEFT-wrapped or not) ties its head to its input embeddings."""
    if isinstance(model, str):
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(model)
    else:
        config = model.config
    return bool(getattr(config.get_text_config(), "tie_word_embeddings", False))


@contextmanager
def lora_head_allowed(model, args, peft_config):
    """Around `GRPOTrainer.__init__`: let a LoRA adapter on the LM head through TRL's refusal
    (`trl_rpp.patches.lm_head_lora_allowed`) when a LoRA adapter can reach the head: a LoRA `peft_config`, or a PEFT
    model with a LoRA head (`peft_config` may target a head named otherwise). Other adapter types stay refused by TRL.

    Refused here, before any model is loaded, with a `ValueError` naming the field: `cast_lm_head_to_fp32=True` with a
    LoRA head (TRL casts the head's weight, not the adapter; nothing is patched then, TRL's own checks run), and
    `use_vllm=True` with a LoRA head tied to the input embeddings (TRL's sync merges the adapter into the shared
    weight)."""
    try:
        from peft import LoraConfig
        from peft.tuners.tuners_utils import check_target_module_exists
    except ImportError:  # without PEFT there is no adapter to let through
        yield
        return
    from accelerate.utils import is_peft_model

    if not isinstance(model, str) and is_peft_model(model):
        targeted = lora_head(model.get_output_embeddings())
    else:
        targeted = isinstance(peft_config, LoraConfig) and bool(peft_config.target_modules) and bool(
            check_target_module_exists(peft_config, "lm_head"))
    if targeted and args.use_vllm and _tied_head(model):
        # TRL's weight sync merges the adapter into the head's weight, which a tied model shares with its input
        # embeddings: the engine would sample from embeddings the trainer's forward does not use.
        raise ValueError("use_vllm=True is not supported with a LoRA adapter on a head tied to the input embeddings "
                         "(tie_word_embeddings=True): merged for the engine, the adapter would change the embeddings "
                         "too. Remove lm_head from the adapter's target_modules, or set use_vllm=False.")
    if args.cast_lm_head_to_fp32:
        if targeted:
            raise ValueError("cast_lm_head_to_fp32=True is not supported with a LoRA adapter on lm_head (TRL casts the "
                             "head's weight, not the adapter): set cast_lm_head_to_fp32=False (the default), or remove "
                             "lm_head from the adapter's target_modules.")
        yield
        return
    if not (targeted or isinstance(peft_config, LoraConfig)):  # no LoRA adapter can reach the head
        yield
        return
    with lm_head_lora_allowed(lora_head, required=targeted):
        yield


def has_lora_head(model, aux_loss: bool) -> bool:
    """After `GRPOTrainer.__init__`: whether the unwrapped `model` carries a LoRA adapter on its head, whose every
    log-prob forward must then read it (`install_head_reader`). With an MoE router aux loss (`aux_loss`), which the
    head reader does not return, such a head is refused."""
    if not lora_head(model.get_output_embeddings()):
        return False
    if aux_loss:
        raise ValueError("a LoRA adapter on lm_head does not support an MoE router aux loss: set "
                         "router_aux_loss_coef=0.0, or remove lm_head from the adapter's target_modules.")
    return True
