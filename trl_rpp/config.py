"""`RPPConfig`: `trl.GRPOConfig` plus the REINFORCE++ fields, with the REINFORCE++ recipes as defaults.

Each field is documented once, in its `help` metadata (what `trl-rpp --help` prints); the class docstring is rendered
from it in GRPOConfig's format. Each validation rule is written once: a row of `_RULES` here, or a function in the
module whose vocabulary it checks, called wherever its input appears
(`trl_rpp.faults.preemption.parse_preemption_signals`; `trl_rpp.records.settings.check_exact_sampling`, for this
config and again, at trainer construction, for the model's own generation config; `trl_rpp.distributed` and
`trl_rpp.patches.vllm_engine_args` for what only exists once the trainer is built). Every rejection uses one message
format (`trl_rpp.errors.unsupported`)."""

from __future__ import annotations

import dataclasses
import math
import numbers
import textwrap
from dataclasses import dataclass, field
from typing import Any, Callable, NamedTuple

from trl import GRPOConfig

from .errors import unsupported
from .faults.preemption import parse_preemption_signals

ESTIMATORS = ("reinforce_plus_plus", "reinforce_plus_plus_baseline")
KL_LOSS_TYPES = ("k1", "k2")
VLLM_DTYPES = ("auto", "float32", "bfloat16", "float16")
SERVER_WEIGHT_SYNCS = ("nccl", "disk")
REWARD_ERRORS = ("raise", "unscorable")  # the choices of reward_errors and nonfinite_rewards

# Per-estimator defaults of the REINFORCE++ recipes (`docs/numerics.md`) for the fields left at `None`.
# `kl_loss_coef` follows `use_kl_loss` instead (`_KL_LOSS_COEF`): 0.0 wherever the KL loss is off, so that the resolved
# config never shows a coefficient that nothing reads.
_RECIPES = {
    "reinforce_plus_plus": dict(kl_coef=0.01, use_kl_loss=False, kl_loss_type="k1"),
    "reinforce_plus_plus_baseline": dict(kl_coef=0.0, use_kl_loss=True, kl_loss_type="k2"),
}
_KL_LOSS_COEF = {True: 0.01, False: 0.0}
_SCORE_CENTERING_TOP_K = 32
_MAX_CONSECUTIVE_SKIPPED_STEPS = 5

_INTRO = """
    Configuration class for the [`RPPTrainer`] (REINFORCE++ and REINFORCE++-baseline).

    It extends [`~trl.GRPOConfig`] with the fields below. Fields left at `None` take the recipe of the chosen
    `advantage_estimator` from the REINFORCE++ recipes (`docs/numerics.md`). Two GRPO defaults change:
    `loss_type="grpo"` (the response-mean reduction the estimators are defined with) and `scale_rewards="none"`
    (the baseline never divides by a group std). Settings that would silently change the estimators are rejected
    when the config is built, with a `ValueError` naming the field and the accepted values.

    Every [`~trl.GRPOConfig`] field is inherited (GRPO's code handles it, as in [`~trl.GRPOTrainer`]), honored (the
    REINFORCE++ code implements it), or rejected; `tests/test_config_fields.py` classifies every one and enforces
    it, for both estimators. Rejected, any value but the one shown: `beta` (`0.0`), `loss_type` (`"grpo"`),
    `scale_rewards` (`"none"`), `multi_objective_aggregation` (`"sum_then_normalize"`), `importance_sampling_level`
    (`"token"`), `delta`, `off_policy_mask_threshold` (`None`), `top_entropy_quantile` (`1.0`), `entropy_coef`
    (`0.0`), `use_adaptive_entropy`, `sync_ref_model` (`False`), and, at GRPO's defaults, the settings that only tune
    those paths: `sapo_temperature_*`, `vespo_*`, `ref_model_mixup_alpha`, `ref_model_sync_steps`, `entropy_coef_min`,
    `entropy_coef_max`, `entropy_coef_delta`, `entropy_target` and `use_bias_correction_kl`. Values that cannot work
    are rejected too: `temperature`, `epsilon` and `epsilon_high` must be finite and `> 0`; `router_aux_loss_coef`
    finite and `>= 0`; `reward_weights` finite; `max_completion_length`, `num_generations`, `num_generations_eval`,
    `num_iterations`, `steps_per_generation` and `generation_batch_size` integers `>= 1`; and `generation_kwargs` may
    not turn sampling off (`do_sample=False`, `temperature <= 0`): REINFORCE++ is a sampled policy gradient.

    The fields below that one estimator, or one setting, does not read accept only their neutral value there, so
    that no setting is silently ignored.
"""

# The docstring's section headings, each before the field that opens it.
_SECTIONS = {
    "advantage_estimator": "the advantage estimator",
    "nonfinite_rewards": "reward functions",
    "score_centering": "score centering",
    "vllm_dtype": "the vLLM engine",
    "max_consecutive_skipped_steps": "non-finite gradients",
    "preemption_signals": "preemption",
}


@dataclass
class RPPConfig(GRPOConfig):
    # The docstring is rendered from the `help` metadata below (`_render_docstring`).

    advantage_estimator: str = field(
        default="reinforce_plus_plus",
        metadata={
            "help": "Which estimator to train with. Possible values are:\n"
            '- `"reinforce_plus_plus"`: token k1 KL-to-go returns `G_t = sum_{u>=t} gamma^(u-t) r_u` with '
            "`r_t = -kl_coef * (log pi_old - log pi_ref) + 1[t = T_i] R_i`, then global normalization.\n"
            '- `"reinforce_plus_plus_baseline"`: the inclusive group-mean baseline `R_i - mean_g(R)` broadcast to '
            "every valid token, then global normalization, plus a separate k2 KL loss. Needs `num_generations >= 2`.",
            "choices": list(ESTIMATORS),
        },
    )
    normalize_advantages: bool = field(
        default=True,
        metadata={
            "help": "Whether to z-score the raw advantages over every valid token of the whole generation batch on all "
            "processes (population variance, variance floor `1e-8`). Both estimators are defined with it, so `False` "
            "is rejected."
        },
    )
    gamma: float = field(
        default=1.0,
        metadata={
            "help": "Discount of the REINFORCE++ returns, in `[0, 1]`. The REINFORCE++ recipe is `1.0`. "
            '`"reinforce_plus_plus_baseline"` accepts only `1.0`: its advantage is the centered terminal reward, '
            "broadcast undiscounted to every token, so no other value would take effect."
        },
    )
    kl_coef: float | None = field(
        default=None,
        metadata={
            "help": "Coefficient of the k1 reference KL folded into the REINFORCE++ token reward. Defaults to `0.01` "
            'for `"reinforce_plus_plus"` and `0.0` for `"reinforce_plus_plus_baseline"`, which requires `0.0` (its KL '
            "is the separate loss). Must be finite and `>= 0`."
        },
    )
    use_kl_loss: bool | None = field(
        default=None,
        metadata={
            "help": "Whether to add a separate reference-KL loss `kl_loss_coef * KL` with response-mean reduction. "
            'Defaults to `False` for `"reinforce_plus_plus"` and `True` for `"reinforce_plus_plus_baseline"`. Cannot '
            "be combined with k1 reward shaping (`kl_coef > 0`), which would count the KL twice."
        },
    )
    kl_loss_type: str | None = field(
        default=None,
        metadata={
            "help": 'Estimator of the separate KL loss: `"k1"` (`log pi - log pi_ref`) or `"k2"` '
            '(`0.5 * (log pi - log pi_ref)^2`). Defaults to the recipes: `"k1"` for `"reinforce_plus_plus"` (the '
            "estimator of its reward shaping; it only matters if the KL loss is turned on instead, so with "
            '`use_kl_loss=False` only `"k1"` is accepted) and `"k2"` for `"reinforce_plus_plus_baseline"`, which '
            'accepts only `"k2"`.',
            "choices": list(KL_LOSS_TYPES),
        },
    )
    kl_loss_coef: float | None = field(
        default=None,
        metadata={
            "help": "Coefficient of the separate KL loss. Defaults to `0.01` when the KL loss is on (`use_kl_loss`, on "
            'by default for `"reinforce_plus_plus_baseline"`) and `0.0` when it is off; with `use_kl_loss=False` only '
            "`0.0` is accepted. Must be finite and `>= 0`."
        },
    )

    nonfinite_rewards: str = field(
        default="raise",
        metadata={
            "help": "What to do when a reward function or reward model returns NaN or +/-Inf for a completion, or a "
            "number that is finite in Python but outside float32's range (the trainer holds rewards in float32, so "
            '`1e39` is Inf there). `"raise"` raises a `ValueError` that names the function and the row (`"error"`, '
            "the former name, is accepted with a `FutureWarning`). "
            '`"unscorable"` treats the value like `None`: the completion gets zero advantage and leaves its group\'s '
            "baseline and the normalization population. A value that is not a number (a string, a list) always "
            "raises a `ValueError` naming the function, the row and the type.",
            "choices": list(REWARD_ERRORS),
        },
    )
    reward_timeout: float | None = field(
        default=None,
        metadata={
            "help": "Time limit in seconds for one call of a reward function, sync or async, on each process. `None` "
            "(the default) sets no limit. A call past the limit is a failed call (`reward_errors`). Async functions "
            "are cancelled on TRL's event loop after the limit. Sync functions then run on a fixed pool of worker "
            "threads (`trl_rpp.faults.rewards.REWARD_WORKERS`): after the limit the trainer stops waiting, and the "
            "hung call holds its worker until it returns; while every worker is held, a call fails at once, as a "
            "timeout. Must be `None` or a finite float `> 0`."
        },
    )
    reward_errors: str = field(
        default="raise",
        metadata={
            "help": "What to do when a call of a reward function raises or runs past `reward_timeout`. `\"raise\"` (as "
            "in GRPO) raises a `RewardFunctionError` that names the function, the training step and the exception "
            '(chained), on every process alike, so no process is left waiting for another. `"unscorable"` treats '
            "the call's values as missing (`None` for every row of the call) and goes on; `rewards/<name>/errors` and "
            "`rewards/<name>/timeouts` count the failed calls of each step. See `docs/robustness.md`.",
            "choices": list(REWARD_ERRORS),
        },
    )

    score_centering: bool = field(
        default=False,
        metadata={
            "help": "Whether to center the score of every valid token with the sampler's top-k distribution (Marek & "
            "Ryabinin, arXiv:2609.20807), removing the drift that a sampler/trainer mismatch adds to the update. The "
            "top-k ids and log-probs are recorded during generation. Requires a sampler that draws from the softmax "
            "at `temperature`, or from its truncation by `top_k`, `top_p` or `min_p` replayed "
            "(`replay_sampler_support`): `repetition_penalty != 1` and other distribution-changing generation "
            "settings are rejected."
        },
    )
    score_centering_top_k: int = field(
        default=_SCORE_CENTERING_TOP_K,
        metadata={
            "help": "Size `k` of the sampler's head recorded per generated token (memory `O(B * T * k)`). The error of "
            "the top-`k` estimate grows with the sampler's mass outside the head: on SmolLM2-135M-Instruct sampling "
            "open text at temperature 1, `k = 32` left a 22-24%% relative error of the correction's gradient (13%% at "
            "`k = 128`), against the 0.17-0.94%% the score-centering paper reports at `k = 32` on Qwen3-0.6B "
            "(`docs/score_centering.md`). Only `32` is accepted with `score_centering=False`, where nothing reads it."
        },
    )

    replay_sampler_support: bool = field(
        default=True,
        metadata={
            "help": "Whether, when `top_k`, `top_p` or `min_p` truncate the sampling distribution (or, with "
            "transformers' `generate`, `typical_p`, `epsilon_cutoff`, `eta_cutoff` or `top_h` in "
            "`generation_kwargs`), every log-prob of a sampled token is read over the tokens the sampler kept, "
            "`log pi(y | S_t)`: the importance-sampling and PPO ratios, the KL to the reference and score centering are "
            "then taken for the distribution the tokens were drawn from. The kept tokens are recorded at generation; "
            "`top_k` (1 to 256) must bound them. `False` reads the full-vocabulary log-probs, as GRPO does (the "
            "on-policy importance ratio is then the kept mass, not 1), and is rejected with `score_centering=True`. "
            "See `docs/sampling.md`."
        },
    )

    vllm_dtype: str = field(
        default="auto",
        metadata={
            "help": "Data type of the colocated vLLM engine's weights and compute "
            '(`use_vllm=True`, `vllm_mode="colocate"`). '
            '`"auto"` is vLLM\'s choice, the checkpoint\'s dtype, except that vLLM downcasts a float32 checkpoint to '
            'bfloat16: a float32 run then samples from a bfloat16 copy of its policy. `"float32"` samples at the '
            'trainer\'s precision; `"bfloat16"` and `"float16"` set those. In server mode the server sets it: '
            "`trl-rpp vllm-serve` starts it in float32 unless given `--dtype`.",
            "choices": list(VLLM_DTYPES),
        },
    )

    vllm_server_request_timeout: float | None = field(
        default=1800.0,
        metadata={
            "help": "Time limit in seconds for the answer to one request to the vLLM server "
            '(`use_vllm=True`, `vllm_mode="server"`), weight updates included. TRL\'s client sets none, so a server '
            "that stops answering would hang the run. A request with no answer in time, or that fails mid-answer, is "
            "not sent again: the run stops with `GenerationEngineError` on every process "
            "(`trl_rpp.faults.engine`). `None` sets no limit. Must be `None` or a finite float `> 0`.",
        },
    )

    vllm_server_weight_sync: str = field(
        default="nccl",
        metadata={
            "help": 'How the trainer sends its weights to the vLLM server at each sync (`vllm_mode="server"`). '
            "Possible values are:\n"
            '- `"nccl"`: TRL\'s transport, streamed over NCCL by vLLM\'s weight-transfer engine; needs CUDA.\n'
            '- `"disk"`: process 0 writes the gathered weights as one safetensors file to `vllm_server_weight_dir`, '
            "which the server reads at the same path, asks the server to reload them and drops its prefix cache "
            "(`trl_rpp.engines.vllm_server`). No NCCL: works with vLLM's CPU build, or where trainer and server cannot "
            "open an NCCL group. The server runs with `VLLM_SERVER_DEV_MODE=1`.",
            "choices": list(SERVER_WEIGHT_SYNCS),
        },
    )
    vllm_server_weight_dir: str | None = field(
        default=None,
        metadata={
            "help": 'The directory of `vllm_server_weight_sync="disk"`, which it requires: one set of weights at a '
            "time, each written to a temporary name and renamed. The server must read it at the same path.",
        },
    )

    max_staleness: int = field(
        default=0,
        metadata={
            "help": "How many generation batches old the batch trained at each step may be: the lag between the "
            "weights that sampled it and the weights that train on it (`docs/off_policy.md`). `0` samples each batch "
            "with the current weights, generation and training taking turns. `1` samples batch t+1 on the vLLM server "
            "while batch t trains: at each generation batch the trainer awaits it, syncs its weights to the idle "
            "server, sends the next batch's prompts and trains (`trl_rpp.engines.ahead`). Each trained batch is then "
            "exactly 1 batch old, except the first of a run and of each epoch (0), and `sampling/staleness` logs it. "
            "TRL's importance-sampling ratio corrects toward pi_old, computed by the trainer when it trains the "
            "batch. Accepted values: `0`, and `1` with `use_vllm=True, vllm_mode=\"server\"` on either weight transport.",
        },
    )

    max_consecutive_skipped_steps: int = field(
        default=_MAX_CONSECUTIVE_SKIPPED_STEPS,
        metadata={
            "help": "How many optimizer steps in a row may be skipped because the gradient norm before clipping is "
            "NaN or +/-Inf. Such a step is skipped on every process, with a `RuntimeWarning` naming it and the "
            "`skipped_steps` metric: the weights and the optimizer state are left unchanged, and the step still counts "
            "toward `max_steps` and the learning-rate schedule. One more non-finite step in a row raises "
            "`trl_rpp.faults.gradients.NonFiniteGradientError` before it is applied. `0` skips nothing: the first "
            "non-finite gradient raises. Must be an integer `>= 0`. Under DeepSpeed or `fp16=True` the engine or the "
            "gradient scaler skips such steps itself and this field is not read, so only `5` is accepted there."
        },
    )

    preemption_signals: str = field(
        default="SIGTERM,SIGUSR1",
        metadata={
            "help": "Comma-separated signals that stop training gracefully (`trl_rpp.faults.preemption`, "
            "`docs/robustness.md`): the optimizer step in progress finishes, every process saves the same complete "
            "checkpoint, and `train` raises `TrainingPreempted` (`trl-rpp` exits with status 75). Accepted names: "
            '`"SIGTERM"` (sent by SLURM and Kubernetes before they stop a job), `"SIGUSR1"` (SLURM\'s `--signal`), '
            '`"SIGUSR2"`. `""` leaves every signal to its previous handler.'
        },
    )

    # GRPO fields whose default differs here (documented in the class docstring's prose).
    loss_type: str = field(
        default="grpo",
        metadata={
            "help": "Loss reduction. Only 'grpo' (mean over each response's valid tokens, then over responses) is "
            "accepted: the estimators are defined with this response-mean reduction."
        },
    )
    scale_rewards: str = field(
        default="none",
        metadata={
            "help": "Only 'none' is accepted: REINFORCE++ normalizes globally and the baseline never divides by a "
            "group std."
        },
    )

    def __post_init__(self):
        for name, value in _RECIPES.get(self.advantage_estimator, {}).items():
            if getattr(self, name) is None:
                setattr(self, name, value)
        if self.kl_loss_coef is None:
            self.kl_loss_coef = _KL_LOSS_COEF[bool(self.use_kl_loss)]
        # Everything is checked before GRPOConfig.__post_init__ sets up devices, so a wrong config costs nothing...
        for f in dataclasses.fields(self):
            if "choices" in f.metadata and f.name in RPPConfig.__annotations__:
                value = getattr(self, f.name)
                if value not in f.metadata["choices"]:
                    raise unsupported(f.name, value, tuple(f.metadata["choices"]))
        _check(self, _RULES)
        parse_preemption_signals(self.preemption_signals)  # its rule lives with the signal names
        # TRL documents `gradient_checkpointing` (default True); transformers 5.23 renamed it `activation_checkpointing`
        # and warns (FutureWarning) whenever it resolves the old name itself, so every default run warned. Resolving
        # it here, as transformers would (the new name wins when set), keeps the value and drops the warning. Older
        # transformers (the 5.17 floor) have only the old name, and no warning.
        renamed = getattr(self, "activation_checkpointing", _ABSENT)
        if renamed is None and self.gradient_checkpointing is not None:
            self.activation_checkpointing = self.gradient_checkpointing
        _check_bf16_device(self)
        super().__post_init__()
        # ... except what GRPOConfig parses from the command line first (`generation_kwargs`).
        _check(self, _RULES_AFTER_PARSING)
        # generation_kwargs go to vLLM's SamplingParams with use_vllm, else to transformers' GenerationConfig, and
        # override the fields of the same name.
        from .records.settings import sampler_settings, support_bound, truncating

        given = dict(self.generation_kwargs or {})
        sampler = sampler_settings(self)
        bound = support_bound(sampler, self.use_vllm, self.replay_sampler_support)
        if not self.replay_sampler_support and not truncating(sampler, self.use_vllm):
            raise unsupported("replay_sampler_support", False, "True (its default)", under="no truncating sampler "
                              "setting (top_k, top_p, min_p)", why="Only a truncated sampler is replayed.")
        if bound is not None and not self.use_vllm and getattr(self, "use_transformers_continuous_batching", False):
            raise unsupported("use_transformers_continuous_batching", True, "False",
                              under=f"{', '.join(truncating(sampler, False))} and replay_sampler_support=True",
                              why="The kept tokens are recorded inside transformers' `generate`.")
        # What needs the sampler's q exactly: a truncation is replayed (or, without score centering, explicitly
        # opted out of); any other change of q is rejected.
        needs = [name for name, on in (("score_centering=True", self.score_centering),
                                       ("vllm_importance_sampling_correction=True",
                                        self.use_vllm and self.vllm_importance_sampling_correction)) if on]
        if needs:
            from .records.settings import NEUTRAL_VLLM_SAMPLING, check_exact_sampling

            replayed = truncating(sampler, self.use_vllm) if self.replay_sampler_support or not self.score_centering else ()
            settings = dict(top_p=self.top_p, top_k=self.top_k, min_p=self.min_p,
                            repetition_penalty=self.repetition_penalty)  # fmt: skip
            check_exact_sampling(settings, self.temperature, where="", replayed=replayed, under=" and ".join(needs))
            check_exact_sampling(given, self.temperature, where="generation_kwargs: ", replayed=replayed,
                                 neutral_values=NEUTRAL_VLLM_SAMPLING if self.use_vllm else None,
                                 under=" and ".join(needs))


def _check_bf16_device(config) -> None:
    """GRPOConfig turns bf16 on unless fp16 is set, and transformers then refuses a machine without a bf16 GPU with
    "You need to assign use_cpu", which points away from the usual fix. Raised here under exactly transformers'
    condition, so that this message replaces that one and nothing else changes."""
    from transformers.utils import import_utils

    bf16 = (not config.fp16) if config.bf16 is None else config.bf16
    if not (bf16 or config.bf16_full_eval) or config.use_cpu:
        return
    if import_utils.is_torch_bf16_gpu_available() or import_utils.is_torch_xla_available():
        return
    field_name = "bf16" if bf16 else "bf16_full_eval"
    default = " (GRPOConfig's default when fp16 is not set)" if config.bf16 is None else ""
    raise ValueError(
        f"{field_name}=True{default} needs a GPU with bfloat16 support, and this machine has none. To train in "
        f"float32 here, set {field_name}=False (on the command line: --{field_name} false).")


def _real(x) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def _positive_finite(x) -> bool:
    return _real(x) and 0.0 < x < math.inf


def _nonnegative_finite(x) -> bool:
    return _real(x) and 0.0 <= x < math.inf


def _integer(low: int) -> Callable[[Any], bool]:
    """An integer `>= low`; `True`/`False` are not counts."""
    return lambda x: isinstance(x, int) and not isinstance(x, bool) and x >= low


def _optional(ok: Callable[[Any], bool]) -> Callable[[Any], bool]:
    return lambda x: x is None or ok(x)


def _equals(expected) -> Callable[[Any], bool]:
    return lambda x: x == expected


class _Rule(NamedTuple):
    """`field` must satisfy `ok` whenever `when(config)` holds. The message names the field, `under` (formatted with
    the config's fields, e.g. the estimator), `accepted` and `why` (`errors.unsupported`). A field like
    `generation_kwargs['do_sample']` names one key of a dict field (absent: `_ABSENT`, always accepted)."""

    field: str
    ok: Callable[[Any], bool]
    accepted: str
    why: str = ""
    when: Callable[[RPPConfig], bool] | None = None
    under: str = ""


_ABSENT = object()


def _value(config, name):
    if "[" not in name:
        return getattr(config, name)
    base, key = name[:-2].split("['")
    return dict(getattr(config, base) or {}).get(key, _ABSENT)


def _check(config, rules) -> None:
    for rule in rules:
        if rule.when is not None and not rule.when(config):
            continue
        value = _value(config, rule.field)
        if value is not _ABSENT and not rule.ok(value):
            raise unsupported(rule.field, value, rule.accepted, rule.why, rule.under.format_map(vars(config)))


_EST = "advantage_estimator={advantage_estimator!r}"  # the setting most rules depend on, named in their messages


def _baseline(c) -> bool:
    return c.advantage_estimator == "reinforce_plus_plus_baseline"


_ONE_SAMPLE = "The inclusive group mean includes each sample itself, so one sample per prompt gives zero advantages."
_NO_ENTROPY = "An entropy bonus is not part of the REINFORCE++ loss."
_KL_RANGE = ("A negative coefficient would reward moving away from the reference, and a NaN or infinite one turns "
             "every weight into NaN at the first step.")
_COUNT = "an integer >= 1"

# GRPO settings of code paths that `RPPConfig` rejects (SAPO/VESPO losses, the synced reference, the adaptive entropy
# bonus, GRPO's beta KL term): field -> the path it tunes. The only accepted value is GRPOConfig's default.
_DEAD_GRPO_SETTINGS = {
    "sapo_temperature_neg": "GRPO's loss_type='sapo'",
    "sapo_temperature_pos": "GRPO's loss_type='sapo'",
    "vespo_k_pos": "GRPO's loss_type='vespo'",
    "vespo_lambda_pos": "GRPO's loss_type='vespo'",
    "vespo_k_neg": "GRPO's loss_type='vespo'",
    "vespo_lambda_neg": "GRPO's loss_type='vespo'",
    "ref_model_mixup_alpha": "the reference sync of sync_ref_model=True",
    "ref_model_sync_steps": "the reference sync of sync_ref_model=True",
    "entropy_coef_min": "the adaptive entropy bonus of use_adaptive_entropy=True",
    "entropy_coef_max": "the adaptive entropy bonus of use_adaptive_entropy=True",
    "entropy_coef_delta": "the adaptive entropy bonus of use_adaptive_entropy=True",
    "entropy_target": "the adaptive entropy bonus of use_adaptive_entropy=True",
    "use_bias_correction_kl": "GRPO's beta KL term (beta must be 0.0; the KL terms here are kl_coef and kl_loss_coef)",
}
_GRPO_DEFAULTS = {f.name: f.default for f in dataclasses.fields(GRPOConfig)}

# Every rule, once, in the order they are checked: ranges first, so that the rules after them compare numbers.
_RULES = [
    _Rule("reward_timeout", _optional(_positive_finite), "None (no limit) or a finite float > 0, in seconds"),
    _Rule("vllm_dtype", _equals("auto"), "'auto'", "It sets the dtype of the colocated vLLM engine, and there is none.",
          when=lambda c: not c.use_vllm, under="use_vllm={use_vllm!r}"),
    _Rule("vllm_dtype", _equals("auto"), "'auto'", "A vLLM server takes its dtype from its own command (`trl-rpp vllm-serve --dtype`, float32 by default).",
          when=lambda c: c.vllm_mode != "colocate", under="vllm_mode={vllm_mode!r}"),
    _Rule("vllm_server_request_timeout", _optional(_positive_finite), "None (no limit) or a finite float > 0, in seconds"),
    _Rule("vllm_server_request_timeout", _equals(1800.0), "1800.0 (its default)", "Only a vLLM server's client reads it.",
          when=lambda c: not c.use_vllm, under="use_vllm={use_vllm!r}"),
    _Rule("vllm_server_request_timeout", _equals(1800.0), "1800.0 (its default)", "Only a vLLM server's client reads "
          "it.", when=lambda c: c.use_vllm and c.vllm_mode != "server", under="vllm_mode={vllm_mode!r}"),
    _Rule("vllm_server_weight_sync", _equals("nccl"), "'nccl'", "Only a vLLM server takes weights over a transport.",
          when=lambda c: not (c.use_vllm and c.vllm_mode == "server"), under="use_vllm={use_vllm!r}, "
          "vllm_mode={vllm_mode!r}"),
    _Rule("vllm_server_weight_dir", lambda x: isinstance(x, str) and x.strip() != "", "a directory path that the "
          "server reads at the same path", when=lambda c: c.vllm_server_weight_sync == "disk",
          under="vllm_server_weight_sync='disk'"),
    _Rule("vllm_server_weight_dir", _equals(None), "None", "Only the disk transport reads it.",
          when=lambda c: c.vllm_server_weight_sync != "disk", under="vllm_server_weight_sync={vllm_server_weight_sync!r}"),
    _Rule("max_staleness", lambda x: x in (0, 1) and not isinstance(x, bool), "0 or 1",
          "One generation batch is in flight at a time, so a batch is at most one batch old."),
    _Rule("max_staleness", _equals(0), "0", "A batch is generated ahead on a vLLM server, which runs on devices of its "
          "own; colocated vLLM and transformers' generate run on the trainer's, so generation and training could not "
          "overlap.", when=lambda c: not (c.use_vllm and c.vllm_mode == "server"),
          under="use_vllm={use_vllm!r}, vllm_mode={vllm_mode!r}"),
    _Rule("max_staleness", _equals(0), "0", "A batch sampled ahead must span whole optimizer steps "
          "(steps_per_generation * num_iterations a multiple of gradient_accumulation_steps): then it is sampled by "
          "the weights of exactly one generation batch earlier, and its prompts are read before Trainer takes them.",
          when=lambda c: ((c.steps_per_generation or c.gradient_accumulation_steps) * c.num_iterations)
          % c.gradient_accumulation_steps != 0,
          under="steps_per_generation={steps_per_generation!r}, num_iterations={num_iterations!r}, "
          "gradient_accumulation_steps={gradient_accumulation_steps!r}"),
    _Rule("vllm_importance_sampling_mode", lambda x: x in ("token_truncate", "token_mask"),
          "'token_truncate', 'token_mask' (or vllm_importance_sampling_correction=False)",
          "A sequence-level weight is the product of its tokens' ratios: one batch stale, a mean log-ratio of 0.005 "
          "over 300 tokens gives exp(1.5) = 4.5, past the default cap of 3, and sequence_mask drops the whole "
          "response.", when=lambda c: c.max_staleness and c.use_vllm and c.vllm_importance_sampling_correction,
          under="max_staleness={max_staleness!r}"),
    _Rule("normalize_advantages", bool, "True", "Both estimators are defined with global advantage normalization.",
          under=_EST),
    _Rule("gamma", lambda x: _real(x) and 0.0 <= x <= 1.0, "a float in [0, 1]",
          "It is the discount of the REINFORCE++ returns.", under=_EST),
    _Rule("kl_coef", _nonnegative_finite, "a finite float >= 0", _KL_RANGE, under=_EST),
    _Rule("kl_loss_coef", _nonnegative_finite, "a finite float >= 0", _KL_RANGE, under=_EST),
    _Rule("temperature", _positive_finite, "a finite float > 0", "Log-probs are divided by the sampling temperature; "
          "0 is greedy decoding, which is not a sample of the policy that the gradient is taken for."),
    _Rule("epsilon", _positive_finite, "a finite float > 0", "It is the lower clip range of the ratio, 1 - epsilon."),
    _Rule("epsilon_high", _optional(_positive_finite), "None or a finite float > 0",
          "It is the upper clip range of the ratio, 1 + epsilon_high."),
    _Rule("reward_weights", _optional(lambda ws: all(_real(w) and math.isfinite(w) for w in ws)),
          "None or a list of finite floats", "A NaN weight would silently drop its reward function from the sum, and "
          "an infinite one makes every advantage NaN."),
    _Rule("router_aux_loss_coef", _optional(_nonnegative_finite), "None or a finite float >= 0",
          "It scales the MoE router's load-balancing loss."),
    _Rule("max_completion_length", _integer(1), _COUNT, "It is the number of tokens sampled per completion."),
    _Rule("num_generations", _integer(1), _COUNT, "It is the number of completions sampled per prompt."),
    _Rule("num_generations_eval", _optional(_integer(1)), "None or " + _COUNT,
          "It is the number of completions per prompt in evaluation."),
    _Rule("num_iterations", _integer(1), _COUNT, "It is the number of optimization passes over a generation batch."),
    _Rule("steps_per_generation", _optional(_integer(1)), "None or " + _COUNT,
          "It is the number of optimizer steps per generation batch."),
    _Rule("generation_batch_size", _optional(_integer(1)), "None or " + _COUNT,
          "It is the number of completions per generation."),
    _Rule("loss_type", _equals("grpo"), "'grpo'", "The estimators use the response-mean reduction (mean over each "
          "response's valid tokens, then over responses); other reductions change the objective's denominator.",
          under=_EST),
    _Rule("beta", _equals(0.0), "0.0", "GRPO's k3 term would count the KL twice: use kl_coef (k1 in the reward) or "
          "use_kl_loss/kl_loss_coef.", under=_EST),
    _Rule("scale_rewards", lambda x: x in ("none", False), "'none'",
          "Rewards are normalized globally over tokens, never per group std.", under=_EST),
    _Rule("use_kl_loss", lambda x: not x, "False while kl_coef > 0 (or set kl_coef=0.0)",
          "k1 shaping in the reward together with a separate KL loss would count the KL twice.",
          when=lambda c: not _baseline(c) and c.kl_coef > 0, under=_EST),
    _Rule("num_generations", _integer(2), "an integer >= 2", _ONE_SAMPLE, when=_baseline, under=_EST),
    _Rule("kl_coef", _equals(0.0), "0.0", "The baseline keeps KL out of the advantage; use kl_loss_coef.",
          when=_baseline, under=_EST),
    _Rule("gamma", _equals(1.0), "1.0", "The baseline's advantage is the centered terminal reward broadcast to every "
          "token, never discounted: gamma only discounts the REINFORCE++ returns.", when=_baseline, under=_EST),
    _Rule("kl_loss_type", _equals("k2"), "'k2'", "The baseline's reference regularization is the k2 loss.",
          when=_baseline, under=_EST),
    _Rule("num_generations_eval", _optional(_integer(2)), "None or an integer >= 2", _ONE_SAMPLE, when=_baseline,
          under=_EST),
    # Both only configure the separate KL loss: with it off, any other value would be silently ignored.
    _Rule("kl_loss_coef", _equals(0.0), "0.0 while use_kl_loss=False (or set use_kl_loss=True)",
          "Without the KL loss nothing reads its coefficient.", when=lambda c: not c.use_kl_loss, under=_EST),
    _Rule("kl_loss_type", _equals("k1"), "'k1' while use_kl_loss=False (or set use_kl_loss=True)",
          "Without the KL loss nothing reads its estimator.", when=lambda c: not c.use_kl_loss and not _baseline(c),
          under=_EST),
    _Rule("score_centering_top_k", _equals(_SCORE_CENTERING_TOP_K),
          f"{_SCORE_CENTERING_TOP_K} (its default), or set score_centering=True", "Only score centering reads it.",
          when=lambda c: not c.score_centering, under="score_centering=False"),
    _Rule("multi_objective_aggregation", _equals("sum_then_normalize"), "'sum_then_normalize'",
          "Both estimators take the weighted sum of the raw rewards; normalizing each reward per group first is "
          "GRPO's post-processing and would bypass the REINFORCE++ normalization and the group-mean baseline.",
          under=_EST),
    # GRPO features the REINFORCE++ loss does not implement: rejected rather than silently ignored.
    _Rule("importance_sampling_level", _equals("token"), "'token'", "The REINFORCE++ ratio is per token.", under=_EST),
    _Rule("top_entropy_quantile", _equals(1.0), "1.0",
          "Dropping low-entropy tokens would change the token population of the loss.", under=_EST),
    _Rule("off_policy_mask_threshold", _equals(None), "None",
          "Sequence masking is not part of the REINFORCE++ loss.", under=_EST),
    _Rule("delta", _equals(None), "None", "Two-sided clipping is not part of the REINFORCE++ loss.", under=_EST),
    _Rule("entropy_coef", _equals(0.0), "0.0", _NO_ENTROPY, under=_EST),
    _Rule("use_adaptive_entropy", lambda x: not x, "False", _NO_ENTROPY, under=_EST),
    _Rule("sync_ref_model", lambda x: not x, "False", "The reference is the frozen initial policy.", under=_EST),
    # Settings that only tune one of the rejected GRPO code paths above: they can never take effect here, so a
    # non-default value is a mistake, not a no-op.
    *(_Rule(name, _equals(_GRPO_DEFAULTS[name]), repr(_GRPO_DEFAULTS[name]),
            f"It only tunes {path}, which REINFORCE++ does not use.", under=_EST)
      for name, path in _DEAD_GRPO_SETTINGS.items()),
    _Rule("max_consecutive_skipped_steps", _integer(0),
          "an integer >= 0 (0: stop at the first non-finite gradient instead of skipping it)"),
    *(_Rule("max_consecutive_skipped_steps", _equals(_MAX_CONSECUTIVE_SKIPPED_STEPS),
            f"{_MAX_CONSECUTIVE_SKIPPED_STEPS} (its default)", "There the gradient scaler or the DeepSpeed engine "
            "skips steps with non-finite gradients itself, and nothing reads this field.", when=when, under=under)
      for when, under in ((lambda c: c.fp16, "fp16=True"), (lambda c: c.deepspeed, "deepspeed"))),
]

_GREEDY = "REINFORCE++ is a sampled policy gradient: greedy completions are not samples of the policy."
_RULES_AFTER_PARSING = [
    # `generation_kwargs` override `temperature` and `do_sample=True` in TRL's generation config.
    _Rule("generation_kwargs['do_sample']", bool, "True (or leave it out)", _GREEDY),
    _Rule("generation_kwargs['temperature']", _positive_finite, "a finite float > 0", _GREEDY),
    _Rule("score_centering_top_k", _integer(1), _COUNT, when=lambda c: c.score_centering),
    _Rule("use_transformers_continuous_batching", lambda x: not x, "False",
          "The sampler's top-k log-probs are captured in transformers' `generate` (or vLLM).",
          when=lambda c: c.score_centering, under="score_centering=True"),
    _Rule("vllm_importance_sampling_mode", lambda x: x in ("token_truncate", "token_mask"),
          "'token_truncate', 'token_mask' (or vllm_importance_sampling_correction=False)",
          "A sequence-level weight is shared by all tokens of a response and has no per-token form to center.",
          when=lambda c: c.score_centering and c.use_vllm and c.vllm_importance_sampling_correction,
          under="score_centering=True"),
]


def rejected_grpo_fields() -> dict[str, tuple[object, str]]:
    """GRPO fields that `RPPConfig` accepts at one value only, read from `_RULES` (a rule on a field GRPOConfig
    declares, under the estimator alone): field -> (that value, `RPPConfig`'s default; the rule's reason). Any other
    value raises a `ValueError` naming the field; `trl-rpp --help` says so for each (`trl_rpp.cli.make_parser`)."""
    grpo = {f.name for f in dataclasses.fields(GRPOConfig)}
    defaults = {f.name: f.default for f in dataclasses.fields(RPPConfig)}
    return {rule.field: (defaults[rule.field], rule.why.rstrip("."))
            for rule in _RULES if rule.under == _EST and rule.when is None and rule.field in grpo}


def _render_docstring() -> str:
    """GRPOConfig's docstring format, from each field's `help` (argparse's `%%` unescaped)."""
    lines = [_INTRO.rstrip(), "", "    Parameters:"]
    wrap = dict(width=120, break_long_words=False, break_on_hyphens=False)
    for f in dataclasses.fields(RPPConfig):
        if f.name not in RPPConfig.__annotations__ or f.name in ("loss_type", "scale_rewards"):
            continue
        if f.name in _SECTIONS:
            lines += [""] * (lines[-1] != "    Parameters:")
            lines += [f"        > Parameters that control {_SECTIONS[f.name]}", ""]
        default = "" if f.default is None else f", defaults to `{repr(f.default)}`".replace("'", '"')
        lines.append(f"        {f.name} (`{f.type.split(' |')[0]}`, *optional*{default}):")
        for paragraph in f.metadata["help"].replace("%%", "%").split("\n"):
            indent = " " * (16 if paragraph.startswith("- ") else 12)
            lines += textwrap.wrap(paragraph, initial_indent=indent, subsequent_indent=indent + "  " * (
                paragraph.startswith("- ")), **wrap)
    return "\n".join(lines) + "\n    "


RPPConfig.__doc__ = _render_docstring()
