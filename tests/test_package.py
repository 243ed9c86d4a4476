"""Packaging: the math imports without TRL or transformers, and the GRPOTrainer internals that RPPTrainer overrides
or reads are still there, with the signatures it was written against (a TRL upgrade that changes them fails here,
naming the member, instead of deep inside a training run)."""

import inspect
import subprocess
import sys

import pytest


def _heavy_modules_after(statement):
    code = f"import sys; {statement}; print(sorted(m for m in ('trl', 'transformers') if m in sys.modules))"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()


@pytest.mark.parametrize("statement", ["import trl_rpp.core", "import trl_rpp", "import trl_rpp.score_centering"])
def test_math_imports_without_trl_or_transformers(statement):
    assert _heavy_modules_after(statement) == "[]"


def test_config_and_trainer_load_on_first_access():
    assert _heavy_modules_after("import trl_rpp; trl_rpp.RPPConfig") == "['transformers', 'trl']"
    import trl_rpp
    from trl_rpp.trainer import RPPTrainer

    assert trl_rpp.RPPTrainer is RPPTrainer and "RPPTrainer" in dir(trl_rpp)
    with pytest.raises(AttributeError, match="no attribute 'RPPTrainerr'"):
        trl_rpp.RPPTrainerr


# Parameters (name, or name=default) of each private GRPOTrainer method RPPTrainer overrides or calls, as in the
# TRL versions setup.py allows. Annotations are not compared: they do not change a call.
GRPO_METHODS = {
    # overridden
    "_calculate_rewards": "self, inputs, prompts, completions, completion_ids_list",
    "_generate_single_turn": "self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False",
    "_generate_and_score_completions": "self, inputs",
    "_compute_loss": "self, model, inputs",
    "_save_checkpoint": "self, model, trial",
    "_load_optimizer_and_scheduler": "self, checkpoint",
    "_get_grad_norm": "self, model, grad_norm=None",  # Trainer's; `GradGuardMixin` (trl_rpp.grad_guard) overrides it
    # called
    "_get_per_token_logps_and_entropies": (
        "self, model, input_ids, attention_mask, logits_to_keep, batch_size=None, compute_entropy=False, "
        "compute_aux_loss=False, pixel_values=None, image_grid_thw=None, num_images=None, pixel_attention_mask=None, "
        "spatial_shapes=None, num_tiles=None, image_sizes=None, token_type_ids=None, mm_token_type_ids=None, "
        "image_position_ids=None"
    ),
    "_get_output_dir": "self, trial",
    # buffers the generation batch that `_save_checkpoint` saves and `_load_optimizer_and_scheduler` restores
    "_prepare_inputs": "self, generation_batch",
}

# Attributes GRPOTrainer sets in __init__ that RPPTrainer reads or writes (private ones first).
GRPO_ATTRIBUTES = [
    "_buffered_inputs", "_step", "_metrics", "_is_vlm", "aux_loss_enabled", "router_aux_loss_coef", "beta",
    "ref_model", "environment_factories", "rollout_func", "tools", "use_vllm", "temperature", "epsilon_low",
    "epsilon_high", "num_iterations", "num_generations", "num_generations_eval", "reward_weights", "reward_func_names",
    "generation_kwargs", "vllm_importance_sampling_correction", "vllm_importance_sampling_mode",
    "vllm_importance_sampling_clip_min", "vllm_importance_sampling_clip_max",
]


def _params(fn):
    return ", ".join(
        p.name if p.default is inspect.Parameter.empty else f"{p.name}={p.default!r}"
        for p in inspect.signature(fn).parameters.values()
    )


@pytest.mark.parametrize("name", sorted(GRPO_METHODS))
def test_grpo_private_methods_keep_their_signatures(name):
    import trl
    from trl import GRPOTrainer

    where = f"trl {trl.__version__}: GRPOTrainer.{name}"
    assert hasattr(GRPOTrainer, name), f"{where} is gone; RPPTrainer overrides or calls it (see trl_rpp/trainer.py)."
    got = _params(getattr(GRPOTrainer, name))
    assert got == GRPO_METHODS[name], (
        f"{where} changed signature: ({got}), RPPTrainer was written against ({GRPO_METHODS[name]}). "
        "Check the override in trl_rpp/trainer.py, then update this record and the trl pin in setup.py."
    )


def test_grpo_helpers_the_trainer_imports_keep_their_signatures():
    from trl.extras.profiling import profiling_context
    from trl.models.utils import disable_gradient_checkpointing
    from trl.trainer.utils import entropy_from_logits

    assert _params(profiling_context) == "trainer, name"
    assert _params(disable_gradient_checkpointing) == "model, gradient_checkpointing_kwargs=None"
    assert _params(entropy_from_logits) == "logits, chunk_size=128"


def test_grpo_attributes_the_trainer_reads_are_set(tmp_path, tiny_model):
    from trl_rpp import RPPConfig, RPPTrainer
    from trl_rpp.testing.tiny import copy_first_char_reward, copy_task_dataset

    args = RPPConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, report_to="none", per_device_train_batch_size=4,
                     num_generations=4)
    trainer = RPPTrainer(tiny_model, copy_first_char_reward, args=args, train_dataset=copy_task_dataset(4))
    missing = [name for name in GRPO_ATTRIBUTES if not hasattr(trainer, name)]
    assert not missing, f"GRPOTrainer no longer sets {missing}, which RPPTrainer reads (see trl_rpp/trainer.py)."
    # The reference that `borrowed_beta` makes GRPO build exists, and beta is back to 0 for the loss.
    assert trainer.ref_model is not None and trainer.beta == 0.0 and trainer.args.beta == 0.0
