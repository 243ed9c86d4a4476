"""Names that moved when the package took its layered layout: importable from their old modules for one more
release, with a `DeprecationWarning` naming the new place. One table: each old module, and for each name its new module (and new
name, where it was renamed); ``"*"`` forwards every name of a module that moved whole."""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings

_SETTINGS, _CAPTURE, _VLLM, _REPLAY, _HEAD = (f"trl_rpp.records.{m}" for m in ("settings", "capture", "vllm", "replay",
                                                                              "head"))
MOVED: dict[str, dict[str, str | tuple[str, str]]] = {
    "trl_rpp.sampling": {
        **dict.fromkeys(("NEUTRAL_SAMPLING", "INERT_GENERATION", "NEUTRAL_VLLM_SAMPLING", "INERT_VLLM_SAMPLING",
                         "check_exact_sampling", "MODEL_SAMPLING_DEFAULTS", "overridden_model_sampling",
                         "warn_overridden_model_sampling"), _SETTINGS),
        **dict.fromkeys(("SamplerTopKCapture", "capturing_generate", "RecordedTopK"), _CAPTURE),
        **dict.fromkeys(("generation_model", "generate_with_processor"), "trl_rpp.patches"),
        **dict.fromkeys(("SERVER_NEG_INF", "parse_vllm_topk"), _VLLM),
    },
    "trl_rpp.replay": {
        **dict.fromkeys(("MAX_SUPPORT", "REPLAYED", "REPLAYED_VLLM", "record_width", "truncating", "support_bound"),
                        _SETTINGS),
        **dict.fromkeys(("replayed_logps", "head_logps", "completion_logits", "head_is_whole_support",
                         "kept_sets_of_generation", "mask_full_records", "check_tokens_in_support"), _REPLAY),
        **dict.fromkeys(("head_transform", "lora_head", "check_lora_head", "head_lowrank", "install_head_reader"),
                        _HEAD),
    },
    "trl_rpp.truncation": {"SamplerSupportCapture": _CAPTURE},
    "trl_rpp.multi_turn": {"*": "trl_rpp.records.multi_turn"},
    "trl_rpp.rollouts": dict.fromkeys(("check_external_mask", "check_rollout_output", "install_rollout_checks"),
                                      "trl_rpp.records.multi_turn"),
    "trl_rpp.head_lora": {"trl_lm_head_lora_allowed": (_HEAD, "lora_head_allowed"), "use_lora_head": _HEAD,
                          **dict.fromkeys(("TRL_LM_HEAD_REFUSAL", "TRL_CAST_REFUSAL"), "trl_rpp.patches")},
    "trl_rpp.reward_faults": {"*": "trl_rpp.faults.rewards"},
    "trl_rpp.rewards": {
        **dict.fromkeys(("check_prompt_column", "check_dataset_not_empty"), "trl_rpp.faults.inputs"),
        **dict.fromkeys(("guard_reward_func", "guard_reward_funcs", "check_module_rewards"), "trl_rpp.faults.rewards"),
    },
    "trl_rpp.checkpoint": {"*": "trl_rpp.faults.checkpoint"},
    "trl_rpp.preemption": {"*": "trl_rpp.faults.preemption"},
    "trl_rpp.grad_guard": {"*": "trl_rpp.faults.gradients"},
    "trl_rpp.engine_faults": {"*": "trl_rpp.faults.engine"},
    "trl_rpp.vllm_engine": dict.fromkeys(("engine_on_cpu", "use_cpu_weight_sync", "use_weight_sync"),
                                         "trl_rpp.engines.vllm_colocate"),
    "trl_rpp.server_sync": {"*": "trl_rpp.engines.vllm_server"},
    "trl_rpp.trainer_utils": {
        **dict.fromkeys(("FORWARD_KEYS", "token_mask", "PolicyForward"), "trl_rpp.batch"),
        **dict.fromkeys(("borrowed_beta", "vllm_generate"), "trl_rpp.patches"),
        **dict.fromkeys(("reduce_across_processes", "masked_max", "empty_batch_message"), "trl_rpp.metrics"),
        "check_score_centering_support": _SETTINGS,
        "generate_vllm_with_topk": "trl_rpp.faults.engine",
        "sampler_topk_of_generation": "trl_rpp.records.multi_turn",
    },
}


# Old names that are not forwarded, each with what replaced it: dissolved into other helpers, or whose parameters
# changed meaning (a forwarded `without_nccl_group("nccl")` would switch the patch on). Importing one raises.
REMOVED: dict[str, dict[str, str]] = {
    "trl_rpp.server_sync": {"without_nccl_group": "trl_rpp.patches.without_nccl_group(active: bool)"},
    "trl_rpp.vllm_engine": {"vllm_engine_args": "trl_rpp.patches.vllm_engine_args(max_logprobs, dtype), with "
                                                "trl_rpp.patches.without_nccl_group for the server",
                            "sync_weights_by_reload": "trl_rpp.patches.reload_weight_sync"},
    "trl_rpp.rollouts": {"checked_rollout_func": "trl_rpp.records.multi_turn.install_rollout_checks"},
    "trl_rpp.trainer_utils": {"as_list": "`x if isinstance(x, list) else [x]` in your own code"},
}


def moved_name(module: str, name: str):
    """`name` of the old `module` from its new place, with a `DeprecationWarning`; `AttributeError` if it never
    moved from there, or was removed (`REMOVED`, naming what replaced it)."""
    if name in REMOVED.get(module, {}):
        raise AttributeError(f"{module}.{name} was removed when the package took its layered layout; use "
                             f"{REMOVED[module][name]}")
    table = MOVED.get(module, {})
    target = table.get(name, table.get("*") if not name.startswith("__") else None)
    if target is None:
        raise AttributeError(f"module {module!r} has no attribute {name!r}")
    new_module, new_name = target if isinstance(target, tuple) else (target, name)
    value = getattr(importlib.import_module(new_module), new_name)
    warnings.warn(f"{module}.{name} moved to {new_module}.{new_name}; the old name will be removed in the next "
                  "release.", DeprecationWarning, stacklevel=3)
    return value


class _MovedModule(importlib.abc.Loader):
    def create_module(self, spec):
        return None

    def exec_module(self, module):
        module.__dict__.update(
            __doc__=f"Deprecated: the names of {module.__name__} moved (see trl_rpp._moved.MOVED).",
            __getattr__=lambda name: moved_name(module.__name__, name),
        )


class MovedFinder(importlib.abc.MetaPathFinder):
    """Finds the old modules of `MOVED` that have no file any more."""

    def find_spec(self, fullname, path=None, target=None):
        # Consulted after the path finders (appended last): only for the old modules without a file.
        return importlib.util.spec_from_loader(fullname, _MovedModule()) if fullname in MOVED else None


def install() -> None:
    if not any(isinstance(f, MovedFinder) for f in sys.meta_path):
        sys.meta_path.append(MovedFinder())
