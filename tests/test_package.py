"""Packaging: the math imports without TRL or transformers, and every TRL member the package overrides, calls, reads
or replaces is still there, with the signature it was written against and, where the package unpacks its result, the
same return order (a TRL upgrade that changes them fails here, naming the member, instead of deep inside a training
run or, worse, silently: a reordered tuple would misalign `tool_mask`)."""

import ast
import inspect
import textwrap
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
    "_get_grad_norm": "self, model, grad_norm=None",  # Trainer's; `GradGuardMixin` (trl_rpp.faults.gradients) overrides it
    "_generate": "self, prompts",
    "train": "self, resume_from_checkpoint=None, trial=None, ignore_keys_for_eval=None",  # Trainer's
    "create_model_card": "self, model_name=None, dataset_name=None, tags=None",
    # called, or wrapped (`_tool_call_loop`, trl_rpp.records.multi_turn)
    "_get_per_token_logps_and_entropies": (
        "self, model, input_ids, attention_mask, logits_to_keep, batch_size=None, compute_entropy=False, "
        "compute_aux_loss=False, pixel_values=None, image_grid_thw=None, num_images=None, pixel_attention_mask=None, "
        "spatial_shapes=None, num_tiles=None, image_sizes=None, token_type_ids=None, mm_token_type_ids=None, "
        "image_position_ids=None"
    ),
    "_get_output_dir": "self, trial",
    "_tool_call_loop": "self, prompts, prompt_ids, completion_ids, completions, logprobs, images, multimodal_fields",
    "_get_tool_suffix_ids": "self, tool_messages",  # trl_rpp.testing.tool_model, on a stand-in `self`
    # buffers the generation batch that `_save_checkpoint` saves and `_load_optimizer_and_scheduler` restores
    "_prepare_inputs": "self, generation_batch",
    # max_staleness=1: Trainer's epoch iterator is read ahead, and a batch's prompts tokenized as GRPO does
    "get_batch_samples": "self, epoch_iterator, num_batches, device",
    "_tokenize_prompts": "self, prompts",
}

# Attributes GRPOTrainer sets in __init__ that RPPTrainer reads or writes (private ones first).
GRPO_ATTRIBUTES = [
    "_buffered_inputs", "_step", "_metrics", "_is_vlm", "aux_loss_enabled", "router_aux_loss_coef", "beta",
    "ref_model", "environment_factories", "rollout_func", "tools", "use_vllm", "temperature", "epsilon_low",
    "epsilon_high", "num_iterations", "num_generations", "num_generations_eval", "reward_weights", "reward_func_names",
    "generation_kwargs", "vllm_importance_sampling_correction", "vllm_importance_sampling_mode",
    "vllm_importance_sampling_clip_min", "vllm_importance_sampling_clip_max", "_tag_names", "rollout_func", "vllm_mode",
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


# What the package unpacks from each call, element by element: the source of every `return` of the member, as TRL
# writes it (trl_rpp/trainer.py, trainer_utils.py, rollouts.py and multi_turn.py index these tuples by position).
GRPO_RETURNS = {
    "_generate": ["(prompt_ids, completion_ids, tool_mask, completions, logprobs, extra_fields, images, tool_images)"],
    "_tool_call_loop": [
        "(tool_mask, completions, completion_ids, logprobs, tool_call_count, tool_failure_count, tool_images)"
    ],
    "_generate_single_turn": ["(completion_ids, logprobs)"],
    "_get_per_token_logps_and_entropies": ["(logps, entropies, aux_loss)"],
    "_calculate_rewards": ["rewards_per_func"],
    "_generate_and_score_completions": ["output"],
}


def _function_node(fn):
    return ast.parse(textwrap.dedent(inspect.getsource(fn))).body[0]


def _own_nodes(node):
    """The nodes of a function's body, not those of the functions or classes defined inside it."""
    for child in ast.iter_child_nodes(node):
        if not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
            yield child
            yield from _own_nodes(child)


def _returns(fn):
    return [ast.unparse(n.value) for n in _own_nodes(_function_node(fn)) if isinstance(n, ast.Return) and n.value]


def _calls_of(fn, dotted):
    """The calls in `fn` whose callee reads as `dotted` (e.g. "self.vllm_generation.generate")."""
    return [n for n in _own_nodes(_function_node(fn)) if isinstance(n, ast.Call) and ast.unparse(n.func) == dotted]


@pytest.mark.parametrize("name", sorted(GRPO_RETURNS))
def test_grpo_methods_the_package_unpacks_keep_their_return_order(name):
    import trl
    from trl import GRPOTrainer

    got = _returns(getattr(GRPOTrainer, name))
    assert got == GRPO_RETURNS[name], (
        f"trl {trl.__version__}: GRPOTrainer.{name} now returns {got}; trl_rpp was written against "
        f"{GRPO_RETURNS[name]} and indexes the result by position. Check its callers in trl_rpp, then update this."
    )


def test_vllm_generation_members_the_package_uses():
    """`VLLMGeneration.generate`'s tuple (`trainer_utils.generate_vllm_with_topk`), and the members that
    `trl_rpp.engines.vllm_colocate` reads or replaces on the instance."""
    from trl.generation.vllm_generation import VLLMGeneration

    assert _params(VLLMGeneration.generate) == "self, prompts, images, num_generations, profiler=None"
    assert _returns(VLLMGeneration.generate) == ["(prompt_ids, completion_ids, logprobs, logprob_token_ids)"]
    assert _params(VLLMGeneration.sync_weights) == "self" and _params(VLLMGeneration._iter_named_params) == "self"
    source = inspect.getsource(VLLMGeneration)
    for attribute in ("mode", "enable_sleep_mode", "logprobs", "llm"):
        assert f"self.{attribute} =" in source, f"VLLMGeneration no longer sets {attribute}, which trl_rpp uses"
    init = inspect.getsource(__import__("trl").GRPOTrainer.__init__)
    assert "self.vllm_generation = VLLMGeneration(" in init and "self._last_loaded_step" in init


def test_the_server_url_checked_at_construction_is_the_one_trls_client_uses():
    """`trl_rpp.engines.vllm_server.server_url` repeats how TRL makes the server's URL (`VLLMGeneration._init_vllm`,
    `VLLMClient.__init__`): the construction check must ask the server TRL's client will use."""
    from trl.generation.vllm_client import VLLMClient
    from trl.generation.vllm_generation import VLLMGeneration

    assert 'base_url = f"http://{self.server_host}:{self.server_port}"' in inspect.getsource(VLLMGeneration._init_vllm)
    client = inspect.getsource(VLLMClient.__init__)
    assert 'scheme = parsed_url.scheme or "http"' in client
    assert 'self.base_url = f"{scheme}://{parsed_url.netloc}{parsed_url.path}"' in client


def test_the_vllm_branch_that_patches_vllm_generate_copies_is_unchanged():
    """`vllm_generate` (under `generate_vllm_with_topk`) is GRPO's vLLM branch of `_generate_single_turn` up to the
    engine's answer: a keyword TRL adds to its `generate` call (a new multimodal input, say) must be added there too,
    not silently dropped."""
    from trl import GRPOTrainer

    from trl_rpp.patches import sync_engine_weights, vllm_generate

    [theirs] = _calls_of(GRPOTrainer._generate_single_turn, "self.vllm_generation.generate")
    [ours] = _calls_of(vllm_generate, "trainer.vllm_generation.generate")
    assert sorted(k.arg for k in theirs.keywords) == sorted(k.arg for k in ours.keywords) == [
        "images", "num_generations", "profiler", "prompts"]  # fmt: skip
    assert not theirs.args and not ours.args
    [sync] = _calls_of(GRPOTrainer._generate_single_turn, "self.vllm_generation.sync_weights")
    assert _calls_of(sync_engine_weights, "trainer.vllm_generation.sync_weights")
    assert _calls_of(vllm_generate, "sync_engine_weights")


def test_the_server_request_that_patches_server_generate_copies_is_unchanged():
    """`server_generate` (the batch sampled ahead, `trl_rpp.engines.ahead`) sends GRPO's server request: the same
    sampling parameters as the server branch of `VLLMGeneration.generate`, and the same call of the client. A
    parameter TRL adds must be added there too, not silently dropped."""
    from trl.generation.vllm_generation import VLLMGeneration

    from trl_rpp.patches import SERVER_SAMPLING, server_generate

    tree = _function_node(VLLMGeneration.generate)
    dicts = [n for n in ast.walk(tree) if isinstance(n, ast.Assign) and ast.unparse(n.targets[0]) == "sampling_params"
             and isinstance(n.value, ast.Dict)]
    server = [d for d in dicts if "max_tokens" in {k.value for k in d.value.keys}
              and "structured_outputs_regex" in {k.value for k in d.value.keys}]
    assert len(server) == 1, "VLLMGeneration.generate's server branch no longer builds one `sampling_params` dict"
    assert sorted(k.value for k in server[0].value.keys) == sorted(SERVER_SAMPLING)
    [theirs] = _calls_of(VLLMGeneration.generate, "self.vllm_client.generate")
    [ours] = [n for n in ast.walk(_function_node(server_generate))  # inside the request it returns
              if isinstance(n, ast.Call) and ast.unparse(n.func) == "g.vllm_client.generate"]
    assert sorted(str(k.arg) for k in theirs.keywords) == sorted(str(k.arg) for k in ours.keywords) == [
        "None", "features", "prompts"]  # prompts=, features=, **sampling_params
    source = inspect.getsource(server_generate)
    for name in SERVER_SAMPLING:
        assert f"{name}=" in source, name


def test_tool_suffix_reads_only_what_the_tool_model_stand_in_has():
    """`trl_rpp.testing.tool_model` calls `GRPOTrainer._get_tool_suffix_ids` on a stand-in `self`."""
    from trl import GRPOTrainer

    read = {n.attr for n in _own_nodes(_function_node(GRPOTrainer._get_tool_suffix_ids))
            if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == "self"}  # fmt: skip
    assert read <= {"processing_class", "chat_template", "chat_template_kwargs", "_is_vlm", "_tokenizer"}, read


def test_trl_module_attributes_the_package_imports():
    import trl
    import trl.chat_template_utils as templates
    import trl.rewards
    import trl.trainer.utils as utils

    assert _params(utils.get_callable_name) == "func" and _params(utils.is_async_callable) == "func"
    assert _params(templates.get_training_chat_template) == "processing_class=None, tokenizer=None"
    assert _params(templates.is_chat_template_prefix_preserving) == "processing_class"
    assert isinstance(templates.qwen3_chat_template, str)
    for name in ("GRPOConfig", "GRPOTrainer", "ScriptArguments", "ModelConfig", "TrlParser", "get_peft_config",
                 "get_quantization_config"):  # fmt: skip
        assert hasattr(trl, name), name
    assert _params(trl.get_peft_config) == "model_args" and _params(trl.get_quantization_config) == "model_args"
    for name in ("accuracy_reward", "reasoning_accuracy_reward", "think_format_reward",
                 "get_soft_overlong_punishment", "get_repetition_penalty_reward"):  # the CLI's built-in names
        assert callable(getattr(trl.rewards, name, None)), name


def test_vllm_engine_args_reach_the_engine_trl_builds(monkeypatch):
    """TRL has no setting for vLLM engine arguments, so `vllm_engine_args` swaps the module global `LLM` of
    `trl.generation.vllm_generation` while `GRPOTrainer.__init__` builds the engine. The swap takes effect only
    while TRL looks `LLM` up there at call time: checked on TRL's source, then the swap itself, on a recorder."""
    import trl.generation.vllm_generation as vllm_generation

    from trl_rpp.patches import vllm_engine_args

    module = ast.parse(inspect.getsource(vllm_generation))
    calls = [n for n in ast.walk(module) if isinstance(n, ast.Call) and ast.unparse(n.func) == "LLM"]
    assert calls, "TRL no longer builds vllm.LLM in trl.generation.vllm_generation: vllm_dtype would be ignored"
    functions = [n for n in ast.walk(module) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    local = [f.name for f in functions for n in ast.walk(f)
             if isinstance(n, (ast.Import, ast.ImportFrom)) and any((a.asname or a.name) == "LLM" for a in n.names)
             or isinstance(n, ast.Name) and n.id == "LLM" and isinstance(n.ctx, ast.Store)]  # fmt: skip
    assert not local, f"TRL binds LLM locally in {local}: the module-level swap of vllm_engine_args would not apply"
    assert not {k.arg for c in calls for k in c.keywords} & {"dtype", "max_logprobs"}

    received = []
    recorder = lambda *args, **kwargs: received.append(kwargs)  # noqa: E731
    monkeypatch.setattr(vllm_generation, "LLM", recorder, raising=False)
    with vllm_engine_args(33, "float32"):
        vllm_generation.LLM(model="m", max_logprobs=None)
    with vllm_engine_args(0, "auto"):
        vllm_generation.LLM(model="m")
    assert received == [dict(model="m", max_logprobs=33, dtype="float32"), dict(model="m")]
    assert vllm_generation.LLM is recorder  # put back


# The batch keys GRPOTrainer writes at generation and trl_rpp/trainer.py reads in its loss (`inputs.get(...)` there:
# a key that TRL renamed would silently read None, and the sampler correction would be dropped).
GRPO_BATCH_KEYS_READ = ("importance_sampling_ratio",)


@pytest.mark.parametrize("key", GRPO_BATCH_KEYS_READ)
def test_batch_keys_the_loss_reads_are_written_by_grpo(key):
    import trl
    from trl import GRPOTrainer

    body = _own_nodes(_function_node(GRPOTrainer._generate_and_score_completions))
    written = [ast.unparse(n.targets[0].slice) for n in body if isinstance(n, ast.Assign)
               and isinstance(n.targets[0], ast.Subscript) and ast.unparse(n.targets[0].value) == "output"]
    assert repr(key) in written, (
        f"trl {trl.__version__}: GRPOTrainer._generate_and_score_completions no longer writes output[{key!r}], which "
        f"trl_rpp/trainer.py reads in its loss (it writes {sorted(set(written))})."
    )
    from trl_rpp.trainer import RPPTrainer

    assert f'inputs.get("{key}")' in inspect.getsource(RPPTrainer._policy_loss)  # the reader this guards
