"""Every field of `GRPOConfig` is classified here, and the classification is enforced for both estimators.

- inherited: GRPO's own code path handles it, unchanged, exactly as in `GRPOTrainer`.
- honored: REINFORCE++'s code reads it and implements it (advantages, loss, checkpoints).
- rejected: REINFORCE++ does not implement it; any value but the accepted one raises a `ValueError` naming the field.

Honored and inherited fields may list values that cannot work (a zero temperature, a NaN coefficient): those raise a
`ValueError` naming the field too. A field that TRL or transformers adds in a new version fails
`test_every_field_is_classified` until someone decides its group here (and rejects it in `RPPConfig` if REINFORCE++
would silently ignore it).

RPPConfig's own fields are classified per estimator (`RPP_FIELDS`): where an estimator, or a setting such as
`use_kl_loss=False`, never reads a field, its non-neutral values must raise rather than be silently ignored.
"""

import dataclasses
import math

import pytest
from trl import GRPOConfig

from trl_rpp import RPPConfig


CPU = dict(output_dir="/tmp/trl_rpp_cfg_fields", report_to="none", use_cpu=True, bf16=False)
ESTIMATORS = ["reinforce_plus_plus", "reinforce_plus_plus_baseline"]
NAN, INF = math.nan, math.inf


def inherited(bad=(), ok=None):
    return ("inherited", tuple(bad), ok)


def honored(bad=(), ok=None):
    return ("honored", tuple(bad), ok)


def rejected(*bad):
    assert bad, "a rejected field needs at least one non-default value to try"
    return ("rejected", tuple(bad), None)


# `transformers.TrainingArguments` fields: the Trainer's own machinery (optimizer, logging, saving, devices, Hub),
# which GRPOTrainer and RPPTrainer both inherit unchanged. GRPOConfig itself rejects `auto_find_batch_size` and
# context/sequence parallelism.
TRAINING_ARGUMENTS = """
output_dir per_device_train_batch_size num_train_epochs max_steps learning_rate lr_scheduler_type lr_scheduler_kwargs
warmup_steps optim optim_args weight_decay adam_beta1 adam_beta2 adam_epsilon optim_target_modules
gradient_accumulation_steps average_tokens_across_devices max_grad_norm label_smoothing_factor bf16 fp16
bf16_full_eval fp16_full_eval tf32 activation_checkpointing activation_checkpointing_kwargs gradient_checkpointing
gradient_checkpointing_kwargs torch_compile torch_compile_backend torch_compile_mode use_liger_kernel
liger_kernel_config use_cache neftune_noise_alpha torch_empty_cache_steps auto_find_batch_size logging_strategy
logging_steps logging_first_step log_on_each_node logging_nan_inf_filter include_num_input_tokens_seen log_level
log_level_replica disable_tqdm report_to run_name project trackio_space_id trackio_bucket_id trackio_static_space_id
eval_strategy eval_steps eval_delay per_device_eval_batch_size prediction_loss_only eval_on_start
eval_do_concat_batches eval_use_gather_object eval_accumulation_steps include_for_metrics batch_eval_metrics
save_only_model save_strategy save_steps save_on_each_node save_total_limit enable_jit_checkpoint push_to_hub
hub_token hub_private_repo hub_model_id hub_strategy hub_always_push hub_revision load_best_model_at_end
metric_for_best_model greater_is_better ignore_data_skip restore_callback_states_from_checkpoint full_determinism
seed data_seed use_cpu accelerator_config parallelism_config dataloader_drop_last dataloader_num_workers
dataloader_pin_memory dataloader_persistent_workers dataloader_prefetch_factor dataloader_multiprocessing_context
dataloader_in_order remove_unused_columns label_names train_sampling_strategy length_column_name
ddp_find_unused_parameters ddp_bucket_cap_mb ddp_broadcast_buffers ddp_static_graph ddp_backend ddp_timeout fsdp
fsdp_config deepspeed debug skip_memory_metrics do_train do_eval do_predict resume_from_checkpoint local_rank
""".split()

# GRPOConfig's own fields.
GRPO_FIELDS = {
    # Model and reference
    "model_init_kwargs": inherited(),
    "trust_remote_code": inherited(),
    "router_aux_loss_coef": honored(bad=[-0.1, NAN, INF], ok=0.01),  # added to the RPP loss for MoE models
    "disable_dropout": inherited(),
    "cast_lm_head_to_fp32": inherited(),
    # Data and generation
    "num_generations": honored(bad=[0], ok=4),  # the baseline's groups; >= 2 there (test_config.py)
    "num_generations_eval": honored(bad=[0], ok=4),  # the baseline's groups in evaluation
    "max_completion_length": inherited(bad=[0, -1], ok=16),
    "ds3_gather_for_generation": inherited(),
    "shuffle_dataset": inherited(),
    "pad_to_multiple_of": inherited(),
    "generation_batch_size": inherited(bad=[0]),
    "steps_per_generation": honored(bad=[0], ok=2),  # buffered generation batch saved in checkpoints
    "temperature": honored(bad=[0.0, -1.0, NAN, INF], ok=0.7),  # log-probs at the sampling temperature
    # A truncation is replayed (trl_rpp.records.replay); top_k bounds the kept sets (top_p or min_p alone: tests/test_replay.py)
    "top_p": honored(),
    "top_k": honored(bad=[257], ok=6),
    "min_p": honored(),
    "generation_kwargs": inherited(bad=[{"do_sample": False}, {"temperature": 0.0}], ok={"suppress_tokens": [5]}),
    "chat_template_kwargs": inherited(),
    "repetition_penalty": inherited(),  # rejected with score centering or vLLM's importance sampling (test_replay)
    "cache_implementation": inherited(),
    "use_transformers_continuous_batching": inherited(),
    "transformers_continuous_batching_config": inherited(),
    "use_transformers_paged": inherited(),
    "max_tool_calling_iterations": inherited(),
    # vLLM (generation is GRPO's; the importance-sampling ratio weights each token of the RPP loss)
    "use_vllm": inherited(),
    "vllm_mode": inherited(),
    "vllm_model_impl": inherited(),
    "vllm_enable_sleep_mode": inherited(),
    "vllm_structured_outputs_regex": inherited(),
    "vllm_server_base_url": inherited(),
    "vllm_server_host": inherited(),
    "vllm_server_port": inherited(),
    "vllm_server_timeout": inherited(),
    "vllm_group_port": inherited(),
    "vllm_gpu_memory_utilization": inherited(),
    "vllm_max_model_length": inherited(),
    "vllm_tensor_parallel_size": inherited(),
    "vllm_importance_sampling_correction": honored(ok=False),
    "vllm_importance_sampling_mode": honored(ok="token_mask"),
    "vllm_importance_sampling_clip_max": honored(ok=2.0),
    "vllm_importance_sampling_clip_min": honored(ok=0.5),
    "vllm_importance_sampling_cap": honored(),  # GRPO's deprecated alias of vllm_importance_sampling_clip_max
    # Loss
    "beta": rejected(0.04),
    "num_iterations": honored(bad=[0], ok=2),
    "epsilon": honored(bad=[0.0, -0.2, NAN, INF], ok=0.1),
    "epsilon_high": honored(bad=[0.0, -0.2, NAN], ok=0.28),
    "delta": rejected(1.5),
    "importance_sampling_level": rejected("sequence", "sequence_token"),
    "loss_type": rejected("dapo", "bnpo", "dr_grpo", "sapo"),
    "scale_rewards": rejected("group", "batch"),
    "sapo_temperature_neg": rejected(2.0),
    "sapo_temperature_pos": rejected(2.0),
    "vespo_k_pos": rejected(1.0),
    "vespo_lambda_pos": rejected(1.0),
    "vespo_k_neg": rejected(1.0),
    "vespo_lambda_neg": rejected(1.0),
    "use_bias_correction_kl": rejected(False),
    "top_entropy_quantile": rejected(0.2),
    "entropy_coef": rejected(0.01),
    "use_adaptive_entropy": rejected(True),
    "entropy_coef_min": rejected(0.1),
    "entropy_coef_max": rejected(0.5),
    "entropy_coef_delta": rejected(0.01),
    "entropy_target": rejected(0.5),
    "off_policy_mask_threshold": rejected(0.5),
    "mask_truncated_completions": honored(ok=True),  # truncated rows leave the mask, the baseline and the population
    "sync_ref_model": rejected(True),
    "ref_model_mixup_alpha": rejected(0.9),
    "ref_model_sync_steps": rejected(64),
    # Rewards
    "reward_weights": honored(bad=[[NAN], [1.0, INF]], ok=[2.0, -0.5]),  # the weighted sum of raw rewards
    "multi_objective_aggregation": rejected("normalize_then_sum"),
    # Logging
    "log_completions": inherited(),
    "log_multimodal": inherited(),
    "num_completions_to_print": inherited(),
    "log_unique_prompts": inherited(),
    "log_completions_hub_repo": inherited(),
}

RPP, BASE = ESTIMATORS
_SERVER = dict(use_vllm=True, vllm_mode="server", vllm_server_weight_sync="disk", vllm_server_weight_dir="/tmp/w")
# RPPConfig's own fields, for each estimator: "honored" (settings, value) where it reads the field, a non-default value
# that takes effect; "ignored" (settings, values) where, under those settings, it never reads the field, so that these
# values must raise instead of being silently ignored. Recipes and range checks are tested in test_config.py.
RPP_FIELDS = {
    "advantage_estimator": dict(honored={RPP: ({}, RPP), BASE: ({}, BASE)}),
    "normalize_advantages": dict(honored={RPP: ({}, True), BASE: ({}, True)}),  # False is rejected for both
    "gamma": dict(honored={RPP: ({}, 0.9)}, ignored={BASE: ({}, [0.9, 0.0])}),  # the baseline never discounts
    "kl_coef": dict(honored={RPP: ({}, 0.05)}, ignored={BASE: ({}, [0.01])}),  # the baseline's KL is the loss
    "use_kl_loss": dict(honored={RPP: ({"kl_coef": 0.0}, True), BASE: ({}, False)}),
    "kl_loss_type": dict(
        honored={RPP: ({"kl_coef": 0.0, "use_kl_loss": True}, "k2"), BASE: ({}, "k2")},
        ignored={RPP: ({"use_kl_loss": False}, ["k2"]), BASE: ({"use_kl_loss": False}, ["k1"])},
    ),
    "kl_loss_coef": dict(
        honored={RPP: ({"kl_coef": 0.0, "use_kl_loss": True}, 0.05), BASE: ({}, 0.05)},
        ignored={RPP: ({"use_kl_loss": False}, [0.01]), BASE: ({"use_kl_loss": False}, [0.01])},
    ),
    "nonfinite_rewards": dict(honored={RPP: ({}, "unscorable"), BASE: ({}, "unscorable")}),
    "reward_timeout": dict(honored={RPP: ({}, 0.5), BASE: ({}, 0.5)}),  # both estimators call reward functions
    "reward_errors": dict(honored={RPP: ({}, "unscorable"), BASE: ({}, "unscorable")}),
    "score_centering": dict(honored={RPP: ({}, True), BASE: ({}, True)}),
    "score_centering_top_k": dict(
        honored={RPP: ({"score_centering": True}, 8), BASE: ({"score_centering": True}, 8)},
        ignored={RPP: ({"score_centering": False}, [8]), BASE: ({"score_centering": False}, [64])},
    ),
    # Read where a setting truncates the sampler (trl_rpp.records.replay); nothing reads it where none does.
    "replay_sampler_support": dict(
        honored={RPP: ({"top_k": 6}, False), BASE: ({"top_p": 0.9, "top_k": 20}, False)},
        ignored={RPP: ({}, [False]), BASE: ({}, [False])},
    ),
    "vllm_dtype": dict(
        honored={RPP: ({"use_vllm": True}, "float32"), BASE: ({"use_vllm": True}, "float32")},
        ignored={RPP: ({"use_vllm": False}, ["float32"]), BASE: ({"use_vllm": False}, ["bfloat16"])},
    ),
    "vllm_server_request_timeout": dict(  # read by the server's client (trl_rpp.faults.engine)
        honored={RPP: ({"use_vllm": True, "vllm_mode": "server"}, 60.0),
                 BASE: ({"use_vllm": True, "vllm_mode": "server"}, None)},
        ignored={RPP: ({"use_vllm": False}, [60.0, None]), BASE: ({"use_vllm": True, "vllm_mode": "colocate"}, [60.0])},
    ),
    "vllm_server_weight_sync": dict(  # the server's weight transport (trl_rpp.engines.vllm_server)
        honored={RPP: (dict(use_vllm=True, vllm_mode="server", vllm_server_weight_dir="/tmp/w"), "disk"),
                 BASE: (dict(use_vllm=True, vllm_mode="server", vllm_server_weight_dir="/tmp/w"), "disk")},
        ignored={RPP: ({"use_vllm": False}, ["disk"]), BASE: ({"use_vllm": True, "vllm_mode": "colocate"}, ["disk"])},
    ),
    "vllm_server_weight_dir": dict(
        honored={RPP: (dict(use_vllm=True, vllm_mode="server", vllm_server_weight_sync="disk"), "/tmp/w"),
                 BASE: (dict(use_vllm=True, vllm_mode="server", vllm_server_weight_sync="disk"), "/tmp/w")},
        ignored={RPP: ({"use_vllm": True, "vllm_mode": "server"}, ["/tmp/w"]), BASE: ({}, ["/tmp/w"])},
    ),
    # Read by the trainer with a vLLM server (trl_rpp.engines.ahead); colocated vLLM and generate refuse it.
    "max_staleness": dict(
        honored={RPP: (dict(_SERVER, vllm_importance_sampling_mode="token_truncate"), 1),
                 BASE: (dict(_SERVER, vllm_importance_sampling_correction=False), 1)},
        ignored={RPP: ({"use_vllm": False}, [1]), BASE: ({"use_vllm": True, "vllm_mode": "colocate"}, [1])},
    ),
    # Read by trl_rpp.faults.gradients, except under fp16's gradient scaler (and DeepSpeed), which skip such steps themselves.
    "max_consecutive_skipped_steps": dict(
        honored={RPP: ({}, 0), BASE: ({}, 2)}, ignored={RPP: ({"fp16": True}, [0]), BASE: ({"fp16": True}, [2])},
    ),
    "preemption_signals": dict(honored={RPP: ({}, "SIGTERM"), BASE: ({}, "")}),  # read by train() (preemption.py)
}


def test_every_field_is_classified():
    names = [f.name for f in dataclasses.fields(RPPConfig)]
    grpo = {f.name for f in dataclasses.fields(GRPOConfig)}
    unclassified = [n for n in names if n not in GRPO_FIELDS and n not in TRAINING_ARGUMENTS and n not in RPP_FIELDS]
    assert not unclassified, (
        f"RPPConfig/GRPOConfig fields not classified in tests/test_config_fields.py: {unclassified}. Decide for each "
        "whether REINFORCE++ inherits it from GRPO, honors it, or must reject it (then reject it in RPPConfig), and "
        "add it to GRPO_FIELDS."
    )
    # transformers 5.23 added these; the floor (5.17, `make test-min`) lacks them and nothing here reads them.
    newer = {"activation_checkpointing", "activation_checkpointing_kwargs"}
    stale = sorted((set(GRPO_FIELDS) | set(TRAINING_ARGUMENTS)) - grpo - newer)
    assert not stale, f"fields classified here that GRPOConfig no longer has: {stale}"
    assert not set(RPP_FIELDS) & grpo, "an RPP field shadows a GRPOConfig field: classify it in GRPO_FIELDS instead"


CASES = [(name, value) for name, (_, bad, _) in GRPO_FIELDS.items() for value in bad]


@pytest.mark.parametrize("estimator", ESTIMATORS)
@pytest.mark.parametrize("name,value", CASES, ids=[f"{n}={v!r}" for n, v in CASES])
def test_values_that_cannot_work_are_rejected_naming_the_field(estimator, name, value):
    with pytest.raises(ValueError) as err:
        RPPConfig(**CPU, advantage_estimator=estimator, **{name: value})
    message = str(err.value)
    assert message.startswith(f"{name}=") or message.startswith(f"{name}["), message
    assert "accepted" in message, message


def test_every_rpp_field_is_classified_for_both_estimators():
    own = [f.name for f in dataclasses.fields(RPPConfig) if f.name in RPPConfig.__annotations__]
    own = [n for n in own if n not in GRPO_FIELDS]  # loss_type, scale_rewards: GRPO fields with another default
    assert sorted(own) == sorted(RPP_FIELDS)
    for name, groups in RPP_FIELDS.items():
        for estimator in ESTIMATORS:
            assert estimator in groups["honored"] or estimator in groups.get("ignored", {}), (name, estimator)


IGNORED = [(name, est, settings, value) for name, groups in RPP_FIELDS.items()
           for est, (settings, values) in groups.get("ignored", {}).items() for value in values]  # fmt: skip


@pytest.mark.parametrize("name,estimator,settings,value", IGNORED,
                         ids=[f"{n}={v!r}-{e}" for n, e, _, v in IGNORED])  # fmt: skip
def test_rpp_settings_an_estimator_never_reads_are_rejected(name, estimator, settings, value):
    with pytest.raises(ValueError) as err:
        RPPConfig(**CPU, advantage_estimator=estimator, **settings, **{name: value})
    message = str(err.value)
    assert message.startswith(f"{name}={value!r} is not supported with "), message
    # The message names the estimator, or the setting, under which the field is not read, and what is accepted.
    context = {"score_centering_top_k": "score_centering=False", "vllm_dtype": "use_vllm=False",
               "replay_sampler_support": "no truncating sampler setting",
               "max_consecutive_skipped_steps": "fp16=True",
               "vllm_server_request_timeout": f"vllm_mode={settings.get('vllm_mode')!r}" if settings.get("use_vllm")
               else "use_vllm=False",
               "vllm_server_weight_sync": f"use_vllm={settings.get('use_vllm', False)!r}, vllm_mode="
               f"{settings.get('vllm_mode', 'colocate')!r}", "vllm_server_weight_dir": "vllm_server_weight_sync='nccl'",
               "max_staleness": f"use_vllm={settings.get('use_vllm', False)!r}, vllm_mode="
               f"{settings.get('vllm_mode', 'colocate')!r}",
               }.get(name, f"advantage_estimator={estimator!r}")
    assert context in message and "accepted: " in message, message


HONORED = [(name, est, settings, value) for name, groups in RPP_FIELDS.items()
           for est, (settings, value) in groups["honored"].items()]  # fmt: skip


@pytest.mark.parametrize("name,estimator,settings,value", HONORED,
                         ids=[f"{n}={v!r}-{e}" for n, e, _, v in HONORED])  # fmt: skip
def test_rpp_settings_an_estimator_reads_are_accepted(name, estimator, settings, value):
    config = RPPConfig(**CPU, **{"advantage_estimator": estimator, **settings, name: value})
    assert getattr(config, name) == value


OK = [(name, ok) for name, (_, _, ok) in GRPO_FIELDS.items() if ok is not None]


@pytest.mark.parametrize("estimator", ESTIMATORS)
@pytest.mark.parametrize("name,value", OK, ids=[f"{n}={v!r}" for n, v in OK])
def test_honored_and_inherited_values_are_accepted(estimator, name, value):
    config = RPPConfig(**CPU, advantage_estimator=estimator, **{name: value})
    assert getattr(config, name) == value
