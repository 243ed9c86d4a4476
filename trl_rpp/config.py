"""`RPPConfig`: `trl.GRPOConfig` plus the REINFORCE++ fields, with the REINFORCE++ recipes as defaults."""

from __future__ import annotations

import dataclasses
import difflib
import math
import numbers
from dataclasses import dataclass, field

from trl import GRPOConfig

from .preemption import parse_preemption_signals

ESTIMATORS = ("reinforce_plus_plus", "reinforce_plus_plus_baseline")
KL_LOSS_TYPES = ("k1", "k2")
VLLM_DTYPES = ("auto", "float32", "bfloat16", "float16")
REWARD_ERRORS = ("raise", "unscorable")

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


def _suggest(value, choices) -> str:
    close = difflib.get_close_matches(str(value), choices, n=1, cutoff=0.5)
    return f" Did you mean {close[0]!r}?" if close else ""


@dataclass
class RPPConfig(GRPOConfig):
    r"""
    Configuration class for the [`RPPTrainer`] (REINFORCE++ and REINFORCE++-baseline).

    It extends [`~trl.GRPOConfig`] with the fields below. Fields left at `None` take the recipe of the chosen
    `advantage_estimator` from the REINFORCE++ recipes (`docs/numerics.md`). Two GRPO defaults change:
    `loss_type="grpo"` (the response-mean reduction the estimators are defined with) and `scale_rewards="none"`
    (the baseline never divides by a group std). Settings that would silently change the estimators are rejected
    when the config is built, with a `ValueError` naming the field and the accepted values.

    Every [`~trl.GRPOConfig`] field is inherited (GRPO's code handles it, as in [`~trl.GRPOTrainer`]), honored (the
    REINFORCE++ code implements it), or rejected; `tests/test_config_fields.py` classifies every one and enforces
    it, for both estimators. Rejected, any value but the one
    shown: `beta` (`0.0`), `loss_type` (`"grpo"`), `scale_rewards` (`"none"`), `multi_objective_aggregation`
    (`"sum_then_normalize"`), `importance_sampling_level` (`"token"`), `delta`, `off_policy_mask_threshold` (`None`),
    `top_entropy_quantile` (`1.0`), `entropy_coef` (`0.0`), `use_adaptive_entropy`, `sync_ref_model` (`False`), and,
    at GRPO's defaults, the settings that only tune those paths: `sapo_temperature_*`, `vespo_*`,
    `ref_model_mixup_alpha`, `ref_model_sync_steps`, `entropy_coef_min`, `entropy_coef_max`, `entropy_coef_delta`,
    `entropy_target` and `use_bias_correction_kl`. Values that cannot work are rejected too: `temperature`,
    `epsilon` and `epsilon_high` must be finite and `> 0`; `router_aux_loss_coef` finite and `>= 0`;
    `reward_weights` finite; `max_completion_length`, `num_generations`, `num_generations_eval`, `num_iterations`,
    `steps_per_generation` and `generation_batch_size` integers `>= 1`; and `generation_kwargs` may not turn
    sampling off (`do_sample=False`, `temperature <= 0`): REINFORCE++ is a sampled policy gradient.

    The fields below that one estimator, or one setting, does not read accept only their neutral value there, so
    that no setting is silently ignored: with `"reinforce_plus_plus_baseline"`, `gamma` (`1.0`), `kl_coef` (`0.0`)
    and `kl_loss_type` (`"k2"`); with `use_kl_loss=False`, `kl_loss_coef` (`0.0`) and, for `"reinforce_plus_plus"`,
    `kl_loss_type` (`"k1"`); with `score_centering=False`, `score_centering_top_k` (`32`).

    Parameters:
        > Parameters that control the advantage estimator

        advantage_estimator (`str`, *optional*, defaults to `"reinforce_plus_plus"`):
            Which estimator to train with. Possible values are:

                - `"reinforce_plus_plus"`: token k1 KL-to-go returns `G_t = sum_{u>=t} gamma^(u-t) r_u` with
                  `r_t = -kl_coef * (log pi_old - log pi_ref) + 1[t = T_i] R_i`, then global normalization.
                - `"reinforce_plus_plus_baseline"`: the inclusive group-mean baseline `R_i - mean_g(R)` broadcast to
                  every valid token, then global normalization, plus a separate k2 KL loss. Needs
                  `num_generations >= 2`.
        normalize_advantages (`bool`, *optional*, defaults to `True`):
            Whether to z-score the raw advantages over every valid token of the whole generation batch on all
            processes (population variance, variance floor `1e-8`). Both estimators are defined with it, so `False`
            is rejected.
        gamma (`float`, *optional*, defaults to `1.0`):
            Discount of the REINFORCE++ returns, in `[0, 1]`. The REINFORCE++ recipe is `1.0`.
            `"reinforce_plus_plus_baseline"` accepts only `1.0`: its advantage is the centered terminal reward,
            broadcast undiscounted to every token, so no other value would take effect.
        kl_coef (`float`, *optional*):
            Coefficient of the k1 reference KL folded into the REINFORCE++ token reward. Defaults to `0.01` for
            `"reinforce_plus_plus"` and `0.0` for `"reinforce_plus_plus_baseline"`, which requires `0.0` (its KL is the
            separate loss). Must be finite and `>= 0`.
        use_kl_loss (`bool`, *optional*):
            Whether to add a separate reference-KL loss `kl_loss_coef * KL` with response-mean reduction. Defaults to
            `False` for `"reinforce_plus_plus"` and `True` for `"reinforce_plus_plus_baseline"`. Cannot be combined
            with k1 reward shaping (`kl_coef > 0`), which would count the KL twice.
        kl_loss_type (`str`, *optional*):
            Estimator of the separate KL loss: `"k1"` (`log pi - log pi_ref`) or `"k2"`
            (`0.5 * (log pi - log pi_ref)^2`). Defaults to the recipes: `"k1"` for `"reinforce_plus_plus"` (the
            estimator of its reward shaping; it only matters if the KL loss is turned on instead, so with
            `use_kl_loss=False` only `"k1"` is accepted) and `"k2"` for `"reinforce_plus_plus_baseline"`, which
            accepts only `"k2"`.
        kl_loss_coef (`float`, *optional*):
            Coefficient of the separate KL loss. Defaults to `0.01` when the KL loss is on (`use_kl_loss`, on by
            default for `"reinforce_plus_plus_baseline"`) and `0.0` when it is off; with `use_kl_loss=False` only
            `0.0` is accepted. Must be finite and `>= 0`.

        nonfinite_rewards (`str`, *optional*, defaults to `"error"`):
            What to do when a reward function or reward model returns NaN or +/-Inf for a completion, or a number
            that is finite in Python but outside float32's range (the trainer holds rewards in float32, so `1e39` is
            Inf there). `"error"` raises a `ValueError` that names the function and the row. `"unscorable"` treats
            the value like `None`: the completion gets zero advantage and leaves its group's baseline and the
            normalization population. A value that is not a number (a string, a list) always raises a `ValueError`
            naming the function, the row and the type.
        reward_timeout (`float`, *optional*):
            Time limit in seconds for one call of a reward function, sync or async, on each process. `None` (the
            default) sets no limit. A call past the limit is a failed call (`reward_errors`). Async functions are
            cancelled on TRL's event loop after the limit. A sync function then runs in a daemon worker thread, one
            per call: after the limit the trainer stops waiting, but the hung call keeps running in the background.
            Must be `None` or a finite float `> 0`.
        reward_errors (`str`, *optional*, defaults to `"raise"`):
            What to do when a call of a reward function raises or runs past `reward_timeout`. `"raise"` (as in GRPO)
            raises a `RewardFunctionError` that names the function, the training step and the exception (chained),
            on every process alike, so no process is left waiting for another. `"unscorable"` treats the call's
            values as missing (`None` for every row of the call) and goes on; `rewards/<name>/errors` and
            `rewards/<name>/timeouts` count the failed calls of each step. See `docs/robustness.md`.

        > Parameters that control score centering

        score_centering (`bool`, *optional*, defaults to `False`):
            Whether to center the score of every valid token with the sampler's top-k distribution (Marek & Ryabinin,
            arXiv:2609.20807), removing the drift that a sampler/trainer mismatch adds to the update. The top-k ids
            and log-probs are recorded during generation. Requires a sampler that draws from the full-vocabulary
            softmax at `temperature`: `top_p < 1`, `top_k > 0`, `min_p > 0`, `repetition_penalty != 1` and other
            distribution-changing generation settings are rejected.
        score_centering_top_k (`int`, *optional*, defaults to `32`):
            Size `k` of the sampler's head recorded per generated token (memory `O(B * T * k)`). The error of the
            top-`k` estimate grows with the sampler's mass outside the head: on SmolLM2-135M-Instruct sampling open
            text at temperature 1, `k = 32` left a 22-24% relative error of the correction's gradient (13% at
            `k = 128`), against the 0.17-0.94% the score-centering paper reports at `k = 32` on Qwen3-0.6B
            (`docs/score_centering.md`). Only `32` is accepted with `score_centering=False`, where nothing reads it.
        vllm_dtype (`str`, *optional*, defaults to `"auto"`):
            Data type of the colocated vLLM engine's weights and compute (`use_vllm=True`, `vllm_mode="colocate"`).
            `"auto"` is vLLM's choice, the checkpoint's dtype, except that vLLM downcasts a float32 checkpoint to
            bfloat16: a float32 run then samples from a bfloat16 copy of its policy. `"float32"` samples at the
            trainer's precision; `"bfloat16"` and `"float16"` set those. In server mode, pass `--dtype` to `vllm serve`
            instead.

        > Parameters that control non-finite gradients

        max_consecutive_skipped_steps (`int`, *optional*, defaults to `5`):
            How many optimizer steps in a row may be skipped because the gradient norm before clipping is NaN or
            +/-Inf. Such a step is skipped on every process, with a `RuntimeWarning` naming it and the `skipped_steps`
            metric: the weights and the optimizer state are left unchanged, and the step still counts toward
            `max_steps` and the learning-rate schedule. One more non-finite step in a row raises
            `trl_rpp.grad_guard.NonFiniteGradientError` before it is applied. `0` skips nothing: the first non-finite
            gradient raises. Must be an integer `>= 0`. Under DeepSpeed or `fp16=True` the engine or the gradient
            scaler skips such steps itself and this field is not read, so only `5` is accepted there.

        > Parameters that control preemption

        preemption_signals (`str`, *optional*, defaults to `"SIGTERM,SIGUSR1"`):
            Comma-separated signals that stop training gracefully (`trl_rpp.preemption`, `docs/robustness.md`): the
            optimizer step in progress finishes, every process saves the same complete checkpoint, and `train` exits
            with status 75. Accepted names: `"SIGTERM"` (sent by SLURM and Kubernetes before they stop a job),
            `"SIGUSR1"` (SLURM's `--signal`), `"SIGUSR2"`. `""` leaves every signal to its previous handler.
    """

    advantage_estimator: str = field(
        default="reinforce_plus_plus",
        metadata={
            "help": "Which estimator to train with.",
            "choices": list(ESTIMATORS),
        },
    )
    normalize_advantages: bool = field(
        default=True,
        metadata={
            "help": "Whether to z-score the raw advantages over every valid token of the whole generation batch on "
            "all processes (population variance, variance floor 1e-8). Both estimators are defined with it, so "
            "False is rejected."
        },
    )
    gamma: float = field(
        default=1.0,
        metadata={
            "help": "Discount of the REINFORCE++ returns, in [0, 1]. The REINFORCE++ recipe is 1.0. "
            "reinforce_plus_plus_baseline accepts only 1.0: its advantage is not discounted."
        },
    )
    kl_coef: float | None = field(
        default=None,
        metadata={
            "help": "Coefficient of the k1 reference KL folded into the REINFORCE++ token reward. Defaults to 0.01 "
            "for reinforce_plus_plus and 0.0 for reinforce_plus_plus_baseline, which requires 0.0 (its KL is the "
            "separate loss). Must be finite and >= 0."
        },
    )
    use_kl_loss: bool | None = field(
        default=None,
        metadata={
            "help": "Whether to add a separate reference-KL loss kl_loss_coef * KL with response-mean reduction. "
            "Defaults to False for reinforce_plus_plus and True for reinforce_plus_plus_baseline. Cannot be combined "
            "with k1 reward shaping (kl_coef > 0), which would count the KL twice."
        },
    )
    kl_loss_type: str | None = field(
        default=None,
        metadata={
            "help": "Estimator of the separate KL loss: k1 (log pi - log pi_ref) or k2 (0.5 * (log pi - log "
            "pi_ref)^2). Defaults to the REINFORCE++ recipes: k1 for reinforce_plus_plus (the estimator of its reward "
            "shaping; it only matters if the KL loss is turned on instead, so only k1 is accepted while use_kl_loss "
            "is false) and k2 for reinforce_plus_plus_baseline, which accepts only k2.",
            "choices": list(KL_LOSS_TYPES),
        },
    )
    kl_loss_coef: float | None = field(
        default=None,
        metadata={
            "help": "Coefficient of the separate KL loss. Defaults to 0.01 when the KL loss is on (use_kl_loss, on by "
            "default for reinforce_plus_plus_baseline) and 0.0 when it is off; only 0.0 is accepted while use_kl_loss "
            "is false. Must be finite and >= 0."
        },
    )

    nonfinite_rewards: str = field(
        default="error",
        metadata={
            "help": "What to do when a reward function or reward model returns NaN or +/-Inf, or a number outside "
            "float32's range (Inf as the trainer holds it): 'error' raises a ValueError naming the function and the "
            "row; 'unscorable' treats the value like None (zero advantage, left out of the group baseline and of the "
            "normalization population). A value that is not a number always raises.",
            "choices": ["error", "unscorable"],
        },
    )
    reward_timeout: float | None = field(
        default=None,
        metadata={
            "help": "Time limit in seconds for one call of a reward function (sync or async), on each process; None "
            "sets no limit. A call past the limit is a failed call (reward_errors). A sync function then runs in a "
            "worker thread: after the limit the trainer stops waiting, but the hung call keeps running in the "
            "background. Must be None or a finite float > 0."
        },
    )
    reward_errors: str = field(
        default="raise",
        metadata={
            "help": "What to do when a reward function call raises or runs past reward_timeout: 'raise' (as in GRPO) "
            "raises a RewardFunctionError naming the function, the step and the exception, on every process alike; "
            "'unscorable' treats that call's values as None and goes on, counted in rewards/<name>/errors|timeouts.",
            "choices": list(REWARD_ERRORS),
        },
    )
    score_centering: bool = field(
        default=False,
        metadata={
            "help": "Whether to center the score of every valid token with the sampler's top-k distribution (Marek & "
            "Ryabinin, arXiv:2609.20807), removing the drift that a sampler/trainer mismatch adds to the update. "
            "Requires a sampler that draws from the full-vocabulary softmax at `temperature`."
        },
    )
    score_centering_top_k: int = field(
        default=_SCORE_CENTERING_TOP_K,
        metadata={
            "help": "Size k of the sampler's head recorded per generated token (memory O(B * T * k)); see "
            "docs/score_centering.md for the error measured at each k. Only 32 is accepted without score_centering."
        },
    )

    vllm_dtype: str = field(
        default="auto",
        metadata={
            "help": "Data type of the colocated vLLM engine (use_vllm=True, vllm_mode='colocate'). 'auto' is vLLM's "
            "choice: the checkpoint's dtype, with float32 checkpoints downcast to bfloat16. 'float32' samples at the "
            "trainer's precision. In server mode, pass --dtype to `vllm serve` instead.",
            "choices": list(VLLM_DTYPES),
        },
    )

    max_consecutive_skipped_steps: int = field(
        default=_MAX_CONSECUTIVE_SKIPPED_STEPS,
        metadata={
            "help": "How many optimizer steps in a row may be skipped because the gradient norm is NaN or +/-Inf (each "
            "skipped on every process, with a warning and the skipped_steps metric; weights and optimizer state "
            "unchanged). One more in a row raises NonFiniteGradientError; 0 raises at the first. Not read under "
            "DeepSpeed or fp16, whose engine or gradient scaler skips such steps itself."
        },
    )

    preemption_signals: str = field(
        default="SIGTERM,SIGUSR1",
        metadata={
            "help": "Comma-separated signals that stop training gracefully: the optimizer step in progress finishes, "
            "every process saves the same complete checkpoint, and train() exits with status 75. Accepted: SIGTERM, "
            "SIGUSR1, SIGUSR2; '' leaves every signal to its previous handler."
        },
    )

    # GRPO fields whose default differs here.
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
        # Everything is checked before GRPOConfig.__post_init__ sets up devices, so a wrong config costs nothing.
        self._resolve_and_validate()
        self._validate_skipped_steps()
        # TRL documents `gradient_checkpointing` (default True); transformers 5 renamed it `activation_checkpointing`
        # and warns (FutureWarning) whenever it resolves the old name itself, so every default run warned. Resolving
        # it here, as transformers would (the new name wins when set), keeps the value and drops the warning.
        if self.activation_checkpointing is None and self.gradient_checkpointing is not None:
            self.activation_checkpointing = self.gradient_checkpointing
        super().__post_init__()
        # After GRPOConfig has parsed `generation_kwargs` from the command line.
        self._validate_sampling()
        if self.score_centering:
            self._validate_score_centering()

    def _validate_skipped_steps(self):
        limit = self.max_consecutive_skipped_steps
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 0:
            raise ValueError(
                f"max_consecutive_skipped_steps={limit!r} is not supported; accepted: an integer >= 0 (0: stop at the "
                "first non-finite gradient instead of skipping it)."
            )
        engine = "fp16=True" if self.fp16 else "deepspeed" if self.deepspeed else None
        if engine and limit != _MAX_CONSECUTIVE_SKIPPED_STEPS:
            raise ValueError(
                f"max_consecutive_skipped_steps={limit!r} is not supported with {engine}; accepted: "
                f"{_MAX_CONSECUTIVE_SKIPPED_STEPS} (its default). There the gradient scaler or the DeepSpeed engine "
                "skips steps with non-finite gradients itself, and nothing reads this field."
            )

    def _validate_sampling(self):
        # `generation_kwargs` override `temperature` and `do_sample=True` in TRL's generation config: greedy decoding
        # there would fail inside transformers or divide by zero in TRL, and is no sample of the policy anyway.
        gen = dict(self.generation_kwargs or {})
        if "do_sample" in gen and not gen["do_sample"]:
            raise ValueError(
                f"generation_kwargs['do_sample']={gen['do_sample']!r} is not supported; accepted: True (or leave it "
                "out). REINFORCE++ is a sampled policy gradient: greedy completions are not samples of the policy."
            )
        if "temperature" in gen and not _positive_finite(gen["temperature"]):
            raise ValueError(
                f"generation_kwargs['temperature']={gen['temperature']!r} is not supported; accepted: a finite float "
                "> 0. A temperature of 0 is greedy decoding, not sampling from the policy."
            )

    def _validate_score_centering(self):
        from .sampling import check_exact_sampling

        if isinstance(self.score_centering_top_k, bool) or not isinstance(self.score_centering_top_k, int) or (
            self.score_centering_top_k < 1
        ):
            raise ValueError(
                f"score_centering_top_k={self.score_centering_top_k!r} is not supported; accepted: an integer >= 1."
            )
        settings = dict(
            top_p=self.top_p, top_k=self.top_k, min_p=self.min_p, repetition_penalty=self.repetition_penalty
        )
        check_exact_sampling(settings, self.temperature, where="")
        check_exact_sampling(dict(self.generation_kwargs or {}), self.temperature, where="generation_kwargs: ")
        if self.use_transformers_continuous_batching:
            raise ValueError(
                "use_transformers_continuous_batching=True is not supported with score_centering=True; accepted: "
                "False. The sampler's top-k log-probs are captured in transformers' `generate` (or vLLM)."
            )
        if self.use_vllm and self.vllm_importance_sampling_correction and self.vllm_importance_sampling_mode not in (
            "token_truncate",
            "token_mask",
        ):
            raise ValueError(
                f"vllm_importance_sampling_mode={self.vllm_importance_sampling_mode!r} is not supported with "
                "score_centering=True; accepted: 'token_truncate', 'token_mask' (or "
                "vllm_importance_sampling_correction=False). A sequence-level weight is shared by all tokens of a "
                "response and has no per-token form to center."
            )

    def _resolve_and_validate(self):
        if self.advantage_estimator not in ESTIMATORS:
            raise ValueError(
                f"advantage_estimator={self.advantage_estimator!r} is not supported; accepted values are "
                f"{', '.join(repr(e) for e in ESTIMATORS)}.{_suggest(self.advantage_estimator, ESTIMATORS)}"
            )
        baseline = self.advantage_estimator == "reinforce_plus_plus_baseline"
        for name, value in _RECIPES[self.advantage_estimator].items():
            if getattr(self, name) is None:
                setattr(self, name, value)
        if self.kl_loss_coef is None:
            self.kl_loss_coef = _KL_LOSS_COEF[bool(self.use_kl_loss)]

        def reject(field_name, accepted, why):
            raise ValueError(
                f"{field_name}={getattr(self, field_name)!r} is not supported with "
                f"advantage_estimator={self.advantage_estimator!r}; accepted: {accepted}. {why}"
            )

        if self.kl_loss_type not in KL_LOSS_TYPES:
            raise ValueError(
                f"kl_loss_type={self.kl_loss_type!r} is not supported; accepted values are 'k1', 'k2'."
                f"{_suggest(self.kl_loss_type, KL_LOSS_TYPES)}"
            )
        if self.nonfinite_rewards not in ("error", "unscorable"):
            raise ValueError(
                f"nonfinite_rewards={self.nonfinite_rewards!r} is not supported; accepted values are 'error', "
                f"'unscorable'.{_suggest(self.nonfinite_rewards, ('error', 'unscorable'))}"
            )
        if self.reward_errors not in REWARD_ERRORS:
            raise ValueError(
                f"reward_errors={self.reward_errors!r} is not supported; accepted values are 'raise', 'unscorable'."
                f"{_suggest(self.reward_errors, REWARD_ERRORS)}"
            )
        if self.reward_timeout is not None and not _positive_finite(self.reward_timeout):
            raise ValueError(f"reward_timeout={self.reward_timeout!r} is not supported; accepted: None (no limit) or "
                             "a finite float > 0, in seconds.")
        if self.vllm_dtype not in VLLM_DTYPES:
            raise ValueError(
                f"vllm_dtype={self.vllm_dtype!r} is not supported; accepted values are "
                f"{', '.join(repr(d) for d in VLLM_DTYPES)}.{_suggest(self.vllm_dtype, VLLM_DTYPES)}"
            )
        if self.vllm_dtype != "auto" and not self.use_vllm:
            raise ValueError(
                f"vllm_dtype={self.vllm_dtype!r} is not supported with use_vllm=False; accepted: 'auto'. It sets the "
                "dtype of the colocated vLLM engine, and there is none."
            )
        if self.vllm_dtype != "auto" and self.vllm_mode != "colocate":
            raise ValueError(
                f"vllm_dtype={self.vllm_dtype!r} is not supported with vllm_mode={self.vllm_mode!r}; accepted: 'auto'. "
                "A vLLM server takes its dtype from `vllm serve --dtype`."
            )
        parse_preemption_signals(self.preemption_signals)  # ValueError naming the field and the accepted names
        if not self.normalize_advantages:
            reject("normalize_advantages", "True", "Both estimators are defined with global advantage normalization.")
        if not _real(self.gamma) or not 0.0 <= self.gamma <= 1.0:
            reject("gamma", "a float in [0, 1]", "It is the discount of the REINFORCE++ returns.")
        for name in ("kl_coef", "kl_loss_coef"):
            if not _nonnegative_finite(getattr(self, name)):
                reject(name, "a finite float >= 0", "A negative coefficient would reward moving away from the "
                       "reference, and a NaN or infinite one turns every weight into NaN at the first step.")
        self._validate_ranges()
        if self.loss_type != "grpo":
            reject(
                "loss_type",
                "'grpo'",
                "The estimators use the response-mean reduction (mean over each response's valid tokens, then over "
                "responses); other reductions change the objective's denominator.",
            )
        if self.beta != 0.0:
            reject(
                "beta",
                "0.0",
                "GRPO's k3 term would count the KL twice: use kl_coef (k1 in the reward) or use_kl_loss/kl_loss_coef.",
            )
        scale = {True: "group", False: "none"}.get(self.scale_rewards, self.scale_rewards)
        if scale != "none":
            reject("scale_rewards", "'none'", "Rewards are normalized globally over tokens, never per group std.")
        if not baseline and self.kl_coef > 0 and self.use_kl_loss:
            reject(
                "use_kl_loss",
                "False while kl_coef > 0 (or set kl_coef=0.0)",
                "k1 shaping in the reward together with a separate KL loss would count the KL twice.",
            )
        if baseline:
            if self.num_generations is None or self.num_generations < 2:
                reject(
                    "num_generations",
                    "an integer >= 2",
                    "The inclusive group mean includes each sample itself, so one sample per prompt gives zero "
                    "advantages.",
                )
            if self.kl_coef != 0.0:
                reject("kl_coef", "0.0", "The baseline keeps KL out of the advantage; use kl_loss_coef.")
            if self.gamma != 1.0:
                reject("gamma", "1.0", "The baseline's advantage is the centered terminal reward broadcast to every "
                       "token, never discounted: gamma only discounts the REINFORCE++ returns.")
            if self.kl_loss_type != "k2":
                reject("kl_loss_type", "'k2'", "The baseline's reference regularization is the k2 loss.")
            if self.num_generations_eval is not None and self.num_generations_eval < 2:
                reject(
                    "num_generations_eval",
                    "None or an integer >= 2",
                    "The inclusive group mean includes each sample itself, so one sample per prompt gives zero "
                    "advantages.",
                )
        if not self.use_kl_loss:
            # Both only configure the separate KL loss: with it off, any other value would be silently ignored.
            if self.kl_loss_coef != 0.0:
                reject("kl_loss_coef", "0.0 while use_kl_loss=False (or set use_kl_loss=True)",
                       "Without the KL loss nothing reads its coefficient.")
            if not baseline and self.kl_loss_type != "k1":
                reject("kl_loss_type", "'k1' while use_kl_loss=False (or set use_kl_loss=True)",
                       "Without the KL loss nothing reads its estimator.")
        if not self.score_centering and self.score_centering_top_k != _SCORE_CENTERING_TOP_K:
            raise ValueError(
                f"score_centering_top_k={self.score_centering_top_k!r} is not supported with score_centering=False; "
                f"accepted: {_SCORE_CENTERING_TOP_K} (its default), or set score_centering=True. Only score "
                "centering reads it."
            )
        if self.multi_objective_aggregation != "sum_then_normalize":
            reject(
                "multi_objective_aggregation",
                "'sum_then_normalize'",
                "Both estimators take the weighted sum of the raw rewards; normalizing each reward per group first "
                "is GRPO's post-processing and would bypass the REINFORCE++ normalization and the group-mean baseline.",
            )
        # GRPO features the REINFORCE++ loss does not implement: rejected rather than silently ignored.
        unsupported = [
            ("importance_sampling_level", "'token'", self.importance_sampling_level != "token",
             "The REINFORCE++ ratio is per token."),
            ("top_entropy_quantile", "1.0", self.top_entropy_quantile != 1.0,
             "Dropping low-entropy tokens would change the token population of the loss."),
            ("off_policy_mask_threshold", "None", self.off_policy_mask_threshold is not None,
             "Sequence masking is not part of the REINFORCE++ loss."),
            ("delta", "None", self.delta is not None, "Two-sided clipping is not part of the REINFORCE++ loss."),
            ("entropy_coef", "0.0", self.entropy_coef != 0.0, "An entropy bonus is not part of the REINFORCE++ loss."),
            ("use_adaptive_entropy", "False", self.use_adaptive_entropy,
             "An entropy bonus is not part of the REINFORCE++ loss."),
            ("sync_ref_model", "False", self.sync_ref_model, "The reference is the frozen initial policy."),
        ]
        for name, accepted, bad, why in unsupported:
            if bad:
                reject(name, accepted, why)
        # Settings that only tune one of the rejected GRPO code paths above: they can never take effect here, so a
        # non-default value is a mistake, not a no-op (`_DEAD_GRPO_SETTINGS`).
        for name, path in _DEAD_GRPO_SETTINGS.items():
            if getattr(self, name) != _GRPO_DEFAULTS[name]:
                reject(name, repr(_GRPO_DEFAULTS[name]), f"It only tunes {path}, which REINFORCE++ does not use.")

    def _validate_ranges(self):
        """Coefficients, temperatures and lengths that cannot work, whatever the estimator."""

        def reject(name, accepted, why):
            raise ValueError(f"{name}={getattr(self, name)!r} is not supported; accepted: {accepted}. {why}")

        if not _positive_finite(self.temperature):
            reject("temperature", "a finite float > 0", "Log-probs are divided by the sampling temperature; 0 is "
                   "greedy decoding, which is not a sample of the policy that the gradient is taken for.")
        if not _positive_finite(self.epsilon):
            reject("epsilon", "a finite float > 0", "It is the lower clip range of the ratio, 1 - epsilon.")
        if self.epsilon_high is not None and not _positive_finite(self.epsilon_high):
            reject("epsilon_high", "None or a finite float > 0",
                   "It is the upper clip range of the ratio, 1 + epsilon_high.")
        if self.reward_weights is not None and not all(_real(w) and math.isfinite(w) for w in self.reward_weights):
            reject("reward_weights", "None or a list of finite floats", "A NaN weight would silently drop its "
                   "reward function from the sum, and an infinite one makes every advantage NaN.")
        if self.router_aux_loss_coef is not None and not _nonnegative_finite(self.router_aux_loss_coef):
            reject("router_aux_loss_coef", "None or a finite float >= 0",
                   "It scales the MoE router's load-balancing loss.")
        counts = [
            ("max_completion_length", self.max_completion_length, "It is the number of tokens sampled per completion."),
            ("num_generations", self.num_generations, "It is the number of completions sampled per prompt."),
            ("num_generations_eval", self.num_generations_eval,
             "It is the number of completions per prompt in evaluation."),
            ("num_iterations", self.num_iterations, "It is the number of optimization passes over a generation batch."),
            ("steps_per_generation", self.steps_per_generation,
             "It is the number of optimizer steps per generation batch."),
            ("generation_batch_size", self.generation_batch_size, "It is the number of completions per generation."),
        ]
        optional = {"num_generations_eval", "steps_per_generation", "generation_batch_size"}
        for name, value, why in counts:
            if value is None and name in optional:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                reject(name, ("None or " if name in optional else "") + "an integer >= 1", why)


def _real(x) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def _positive_finite(x) -> bool:
    return _real(x) and 0.0 < x < math.inf


def _nonnegative_finite(x) -> bool:
    return _real(x) and 0.0 <= x < math.inf


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


def rejected_grpo_fields() -> dict[str, tuple[object, str]]:
    """GRPO fields that `RPPConfig` accepts at one value only (any other raises a `ValueError` naming the field):
    field -> (that value, what the field only tunes, or ""). `trl-rpp --help` says so for each
    (`trl_rpp.cli.make_parser`); `tests/test_cli.py` checks this table against the validators above and against the
    classification of `tests/test_config_fields.py`."""
    fixed = dict(
        beta=0.0, loss_type="grpo", scale_rewards="none", multi_objective_aggregation="sum_then_normalize",
        importance_sampling_level="token", top_entropy_quantile=1.0, off_policy_mask_threshold=None, delta=None,
        entropy_coef=0.0, use_adaptive_entropy=False, sync_ref_model=False,
    )
    notes = {"beta": "the KL terms here are kl_coef and use_kl_loss/kl_loss_coef"}
    dead = {name: (_GRPO_DEFAULTS[name], f"it only tunes {path}") for name, path in _DEAD_GRPO_SETTINGS.items()}
    return {**{name: (value, notes.get(name, "")) for name, value in fixed.items()}, **dead}
