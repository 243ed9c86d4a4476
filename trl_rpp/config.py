"""`RPPConfig`: `trl.GRPOConfig` plus the REINFORCE++ fields, with the REINFORCE++ recipes as defaults."""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field

from trl import GRPOConfig

ESTIMATORS = ("reinforce_plus_plus", "reinforce_plus_plus_baseline")
KL_LOSS_TYPES = ("k1", "k2")

# Per-estimator defaults of the REINFORCE++ recipes (`docs/numerics.md`) for the fields left at `None`.
_RECIPES = {
    "reinforce_plus_plus": dict(kl_coef=0.01, use_kl_loss=False, kl_loss_type="k1", kl_loss_coef=0.0),
    "reinforce_plus_plus_baseline": dict(kl_coef=0.0, use_kl_loss=True, kl_loss_type="k2", kl_loss_coef=0.01),
}


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
            Discount of the REINFORCE++ returns, in `[0, 1]`. The REINFORCE++ recipe is `1.0`. Unused by the baseline.
        kl_coef (`float`, *optional*):
            Coefficient of the k1 reference KL folded into the REINFORCE++ token reward. Defaults to `0.01` for
            `"reinforce_plus_plus"` and `0.0` for `"reinforce_plus_plus_baseline"`, which requires `0.0` (its KL is the
            separate loss). Must be `>= 0`.
        use_kl_loss (`bool`, *optional*):
            Whether to add a separate reference-KL loss `kl_loss_coef * KL` with response-mean reduction. Defaults to
            `False` for `"reinforce_plus_plus"` and `True` for `"reinforce_plus_plus_baseline"`. Cannot be combined
            with k1 reward shaping (`kl_coef > 0`), which would count the KL twice.
        kl_loss_type (`str`, *optional*):
            Estimator of the separate KL loss: `"k1"` (`log pi - log pi_ref`) or `"k2"`
            (`0.5 * (log pi - log pi_ref)^2`). Defaults to the recipes: `"k1"` for `"reinforce_plus_plus"` (the
            estimator of its reward shaping; it only matters if the KL loss is turned on instead) and `"k2"` for
            `"reinforce_plus_plus_baseline"`, which accepts only `"k2"`.
        kl_loss_coef (`float`, *optional*):
            Coefficient of the separate KL loss. Defaults to `0.01` for `"reinforce_plus_plus_baseline"` and `0.0`
            for `"reinforce_plus_plus"`, or `0.01` there too when `use_kl_loss=True`. Must be `>= 0`.

        nonfinite_rewards (`str`, *optional*, defaults to `"error"`):
            What to do when a reward function returns NaN or +/-Inf for a completion. `"error"` raises a `ValueError`
            that names the function and the row. `"unscorable"` treats the value like `None`: the completion gets zero
            advantage and leaves its group's baseline and the normalization population.

        > Parameters that control score centering

        score_centering (`bool`, *optional*, defaults to `False`):
            Whether to center the score of every valid token with the sampler's top-k distribution (Marek & Ryabinin,
            arXiv:2609.20807), removing the drift that a sampler/trainer mismatch adds to the update. The top-k ids
            and log-probs are recorded during generation. Requires a sampler that draws from the full-vocabulary
            softmax at `temperature`: `top_p < 1`, `top_k > 0`, `min_p > 0`, `repetition_penalty != 1` and other
            distribution-changing generation settings are rejected.
        score_centering_top_k (`int`, *optional*, defaults to `32`):
            Size `k` of the sampler's head recorded per generated token (memory `O(B * T * k)`). `k = 32` matches the
            exact correction in the published measurements.
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
        metadata={"help": "Discount of the REINFORCE++ returns, in [0, 1]. The REINFORCE++ recipe is 1.0. Unused by the baseline."},
    )
    kl_coef: float | None = field(
        default=None,
        metadata={
            "help": "Coefficient of the k1 reference KL folded into the REINFORCE++ token reward. Defaults to 0.01 "
            "for reinforce_plus_plus and 0.0 for reinforce_plus_plus_baseline, which requires 0.0 (its KL is the "
            "separate loss). Must be >= 0."
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
            "shaping; it only matters if the KL loss is turned on instead) and k2 for reinforce_plus_plus_baseline, "
            "which accepts only k2.",
            "choices": list(KL_LOSS_TYPES),
        },
    )
    kl_loss_coef: float | None = field(
        default=None,
        metadata={
            "help": "Coefficient of the separate KL loss. Defaults to 0.01 for reinforce_plus_plus_baseline and 0.0 "
            "for reinforce_plus_plus, or 0.01 there too when use_kl_loss=True. Must be >= 0."
        },
    )

    nonfinite_rewards: str = field(
        default="error",
        metadata={
            "help": "What to do when a reward function returns NaN or +/-Inf: 'error' raises a ValueError naming the "
            "function and the row; 'unscorable' treats the value like None (zero advantage, left out of the group "
            "baseline and of the normalization population).",
            "choices": ["error", "unscorable"],
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
        default=32,
        metadata={"help": "Size k of the sampler's head recorded per generated token (memory O(B * T * k))."},
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
        metadata={"help": "Must be 'none': REINFORCE++ normalizes globally and the baseline never divides by a group std."},
    )

    def __post_init__(self):
        # Everything is checked before GRPOConfig.__post_init__ sets up devices, so a wrong config costs nothing.
        self._resolve_and_validate()
        super().__post_init__()
        if self.score_centering:  # after GRPOConfig has parsed `generation_kwargs` from the command line
            self._validate_score_centering()

    def _validate_score_centering(self):
        from .sampling import check_exact_sampling

        if isinstance(self.score_centering_top_k, bool) or not isinstance(self.score_centering_top_k, int) or (
            self.score_centering_top_k < 1
        ):
            raise ValueError(f"score_centering_top_k={self.score_centering_top_k!r} is not supported; accepted: an integer >= 1.")
        settings = dict(top_p=self.top_p, top_k=self.top_k, min_p=self.min_p, repetition_penalty=self.repetition_penalty)
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
        recipe = dict(_RECIPES[self.advantage_estimator])
        if self.use_kl_loss and not baseline:
            recipe["kl_loss_coef"] = 0.01
        for name, value in recipe.items():
            if getattr(self, name) is None:
                setattr(self, name, value)

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
        if not self.normalize_advantages:
            reject("normalize_advantages", "True", "Both estimators are defined with global advantage normalization.")
        if not 0.0 <= self.gamma <= 1.0:
            reject("gamma", "a float in [0, 1]", "It is the discount of the REINFORCE++ returns.")
        if self.kl_coef < 0:
            reject("kl_coef", "a float >= 0", "A negative coefficient would reward moving away from the reference.")
        if self.kl_loss_coef < 0:
            reject("kl_loss_coef", "a float >= 0", "A negative coefficient would reward moving away from the reference.")
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
                    "The inclusive group mean includes each sample itself, so one sample per prompt gives zero advantages.",
                )
            if self.kl_coef != 0.0:
                reject("kl_coef", "0.0", "The baseline keeps KL out of the advantage; use kl_loss_coef.")
            if self.use_kl_loss and self.kl_loss_type != "k2":
                reject("kl_loss_type", "'k2'", "The baseline's reference regularization is the k2 loss.")
            if self.multi_objective_aggregation == "normalize_then_sum":
                reject(
                    "multi_objective_aggregation",
                    "'sum_then_normalize'",
                    "Custom reward post-processing would bypass the inclusive group-mean baseline.",
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
