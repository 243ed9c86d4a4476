"""A LoRA adapter on the LM head (`lm_head` in `target_modules`), trained by `RPPTrainer` where `GRPOTrainer` refuses
it: TRL's refusal let through around `GRPOTrainer.__init__` for plain LoRA (`trl_lm_head_lora_allowed`), and every
log-prob read from the head's rows with the adapter's low-rank term (`use_lora_head`; the reading is
`trl_rpp.replay.head_lowrank`, the math `trl_rpp.lm_head`)."""

from __future__ import annotations

from contextlib import contextmanager

# TRL 1.16's two checks that `trl_lm_head_lora_allowed` lets through (it verifies they are there).
TRL_LM_HEAD_REFUSAL = "isinstance(model.get_output_embeddings(), BaseTunerLayer)"
TRL_CAST_REFUSAL = "isinstance(target_model.lm_head, BaseTunerLayer)"


def _tied_head(model) -> bool:
    """Whether `model` (a path or a model, PEFT-wrapped or not) ties its head to its input embeddings."""
    if isinstance(model, str):
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(model)
    else:
        config = model.config
    return bool(getattr(config.get_text_config(), "tie_word_embeddings", False))


@contextmanager
def trl_lm_head_lora_allowed(model, args, peft_config):
    """Around `GRPOTrainer.__init__`: let a LoRA adapter on the LM head through TRL's refusal, which `RPPTrainer`
    replaces by training it exactly (`replay.head_lowrank`, read on every log-prob path).

    What it replaces: TRL 1.16's `GRPOTrainer.__init__` raises "Applying a PEFT adapter to `lm_head` is not
    supported" when `isinstance(model.get_output_embeddings(), BaseTunerLayer)`, because its fused head reads
    `lm_head.weight` only and would never train the adapter. For the duration of the call, the module global
    `trl.trainer.grpo_trainer.BaseTunerLayer` becomes a class that every PEFT layer but PEFT's LoRA `Linear` is an
    instance of; TRL's refusal stands for any other adapter type. Written against TRL 1.16: the module must use
    `BaseTunerLayer` in exactly those two checks of `__init__` (the one above and `cast_lm_head_to_fp32`'s); on another
    TRL nothing is patched, and a LoRA config targeting `lm_head` raises `RuntimeError` naming its version. Patched
    only for a LoRA `peft_config` or a PEFT model with a LoRA head (`peft_config` may target a head named otherwise).

    `cast_lm_head_to_fp32=True` with a LoRA head stays refused, here before any model is loaded (`ValueError` naming
    the field), and nothing is patched then: TRL's own checks run unchanged. So is `use_vllm=True` with a LoRA head
    tied to the input embeddings (TRL's sync merges the adapter into the shared weight)."""
    from .replay import lora_head

    try:
        from peft import LoraConfig
        from peft.tuners.tuners_utils import BaseTunerLayer, check_target_module_exists
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
    import inspect

    import trl
    from trl.trainer import grpo_trainer

    source = inspect.getsource(grpo_trainer)
    init = inspect.getsource(grpo_trainer.GRPOTrainer.__init__)
    if (getattr(grpo_trainer, "BaseTunerLayer", None) is not BaseTunerLayer or TRL_LM_HEAD_REFUSAL not in init
            or TRL_CAST_REFUSAL not in init or source.count("BaseTunerLayer") != 3):
        if not targeted:  # TRL's own check, whatever it is, decides about a head we did not see targeted
            yield
            return
        raise RuntimeError(
            f"RPPTrainer lets a LoRA adapter on lm_head through GRPOTrainer's refusal as written in TRL 1.16; TRL "
            f"{trl.__version__} no longer checks it the same way (`{TRL_LM_HEAD_REFUSAL}` in `GRPOTrainer.__init__`): "
            "install TRL 1.16.x, or remove lm_head from the adapter's target_modules.")

    class _AnyLayerButLoraLinear(type):
        def __instancecheck__(cls, obj):
            return isinstance(obj, BaseTunerLayer) and not lora_head(obj)

    class NotLoraLinear(metaclass=_AnyLayerButLoraLinear):
        pass

    grpo_trainer.BaseTunerLayer = NotLoraLinear
    try:
        yield
    finally:
        grpo_trainer.BaseTunerLayer = BaseTunerLayer


def use_lora_head(trainer, reader_installed: bool) -> bool:
    """After `GRPOTrainer.__init__`: whether `trainer`'s model carries a LoRA adapter on its head; if so, every
    log-prob forward reads it (the head reader is installed unless `reader_installed`). An MoE router aux loss, which
    the head reader does not return, is refused."""
    from .replay import install_head_reader, lora_head

    model = trainer.accelerator.unwrap_model(trainer.model)
    if not lora_head(model.get_output_embeddings()):
        return False
    if trainer.aux_loss_enabled:
        raise ValueError("a LoRA adapter on lm_head does not support an MoE router aux loss: set "
                         "router_aux_loss_coef=0.0, or remove lm_head from the adapter's target_modules.")
    if not reader_installed:
        install_head_reader(model)
    return True
