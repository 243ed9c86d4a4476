"""RPPConfig: the REINFORCE++ recipes as defaults, every rejection by message, and docs that agree with the fields."""

import dataclasses
import importlib.util
import re

import pytest

from trl_rpp import RPPConfig


CPU = dict(output_dir="/tmp/trl_rpp_cfg", report_to="none", use_cpu=True, bf16=False)
BASE = "reinforce_plus_plus_baseline"


def make(**kw):
    return RPPConfig(**CPU, **kw)


@pytest.mark.parametrize("given", [{}, {"bf16": True}])
def test_bf16_without_a_bf16_gpu_names_the_fix(monkeypatch, given):
    """GRPOConfig's bf16 default (True) on a machine without a bf16 GPU: the error names bf16=False and its flag, not
    transformers' `use_cpu` (the bf16 GPU check is made to answer no, as on a CPU machine)."""
    from transformers.utils import import_utils

    monkeypatch.setattr(import_utils, "is_torch_bf16_gpu_available", lambda: False)
    monkeypatch.setattr(import_utils, "is_torch_xla_available", lambda *a, **k: False)
    with pytest.raises(ValueError, match=r"bf16=True.* needs a GPU with bfloat16 support.*set bf16=False \(on the "
                                         r"command line: --bf16 false\)"):
        RPPConfig(output_dir="/tmp/trl_rpp_cfg", report_to="none", **given)
    assert RPPConfig(output_dir="/tmp/trl_rpp_cfg", report_to="none", bf16=False).bf16 is False
    # use_cpu=True with bf16 is transformers' CPU autocast, an explicit choice it accepts: left alone.
    assert RPPConfig(output_dir="/tmp/trl_rpp_cfg", report_to="none", use_cpu=True).bf16 is True


def test_reinforce_pp_recipe_defaults():
    c = make()
    assert c.advantage_estimator == "reinforce_plus_plus"
    assert (c.gamma, c.kl_coef, c.use_kl_loss, c.normalize_advantages) == (1.0, 0.01, False, True)
    assert (c.loss_type, c.scale_rewards, c.beta) == ("grpo", "none", 0.0)


def test_baseline_recipe_defaults():
    c = make(advantage_estimator=BASE)
    assert (c.num_generations, c.kl_coef, c.use_kl_loss, c.kl_loss_type, c.kl_loss_coef) == (8, 0.0, True, "k2", 0.01)
    assert (c.loss_type, c.scale_rewards) == ("grpo", "none")


def test_reinforce_pp_with_kl_loss_instead_of_shaping():
    c = make(kl_coef=0.0, use_kl_loss=True)
    assert (c.kl_loss_type, c.kl_loss_coef) == ("k1", 0.01)  # the REINFORCE++ recipe names k1
    c = make(kl_coef=0.0, use_kl_loss=True, kl_loss_type="k2")
    assert (c.kl_loss_type, c.kl_loss_coef) == ("k2", 0.01)


def test_kl_loss_coef_resolves_to_zero_wherever_the_kl_loss_is_off():
    """Left unset, the coefficient follows use_kl_loss, for both estimators: a resolved config never shows a
    coefficient that nothing reads."""
    c = make(advantage_estimator=BASE, use_kl_loss=False)
    assert (c.use_kl_loss, c.kl_loss_type, c.kl_loss_coef) == (False, "k2", 0.0)
    assert make().kl_loss_coef == 0.0 and make(advantage_estimator=BASE).kl_loss_coef == 0.01


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(gamma=1.0, advantage_estimator=BASE),  # the baseline's neutral gamma, set explicitly
        dict(kl_loss_coef=0.0, use_kl_loss=False),  # an inactive KL loss at its neutral coefficient
        dict(kl_loss_type="k1", use_kl_loss=False),  # REINFORCE++'s own recipe value
        dict(score_centering_top_k=32),  # the default, without score centering
        dict(gamma=0.0),  # REINFORCE++ honors any gamma in [0, 1]
    ],
)
def test_neutral_values_of_unread_settings_are_accepted(kwargs):
    c = make(**kwargs)
    assert all(getattr(c, k) == v for k, v in kwargs.items())


@pytest.mark.parametrize(
    "kwargs,pattern",
    [
        (dict(advantage_estimator="reinforce_plus_plus_basline"), r"advantage_estimator=.*accepted values are 'reinforce_plus_plus', 'reinforce_plus_plus_baseline'.*Did you mean 'reinforce_plus_plus_baseline'"),
        (dict(advantage_estimator="grpo"), r"advantage_estimator='grpo' is not supported; accepted values"),
        (dict(advantage_estimator=BASE, num_generations=1), r"num_generations=1 .*accepted: an integer >= 2"),
        (dict(loss_type="dapo"), r"loss_type='dapo' .*accepted: 'grpo'"),
        (dict(loss_type="bnpo"), r"loss_type='bnpo' .*accepted: 'grpo'"),
        (dict(beta=0.04), r"beta=0.04 .*accepted: 0.0.*count the KL twice"),
        (dict(scale_rewards="group"), r"scale_rewards='group' .*accepted: 'none'"),
        (dict(scale_rewards="batch"), r"scale_rewards='batch' .*accepted: 'none'"),
        (dict(kl_coef=0.01, use_kl_loss=True), r"use_kl_loss=True .*accepted: False while kl_coef > 0"),
        (dict(advantage_estimator=BASE, kl_coef=0.01), r"kl_coef=0.01 .*reinforce_plus_plus_baseline.*accepted: 0.0"),
        (dict(advantage_estimator=BASE, kl_loss_type="k1"), r"kl_loss_type='k1' .*accepted: 'k2'"),
        # Settings that one estimator, or one setting, never reads: rejected, never silently ignored.
        (dict(advantage_estimator=BASE, gamma=0.9),
         r"^gamma=0.9 is not supported with advantage_estimator='reinforce_plus_plus_baseline'; accepted: 1.0\."),
        (dict(advantage_estimator=BASE, gamma=0.0), r"^gamma=0.0 .*'reinforce_plus_plus_baseline'; accepted: 1.0"),
        (dict(advantage_estimator=BASE, use_kl_loss=False, kl_loss_type="k1"),
         r"^kl_loss_type='k1' .*'reinforce_plus_plus_baseline'; accepted: 'k2'"),
        (dict(advantage_estimator=BASE, use_kl_loss=False, kl_loss_coef=0.01),
         r"^kl_loss_coef=0.01 .*'reinforce_plus_plus_baseline'; accepted: 0.0 while use_kl_loss=False"),
        (dict(kl_loss_coef=0.05), r"^kl_loss_coef=0.05 .*'reinforce_plus_plus'; accepted: 0.0 while use_kl_loss=False"),
        (dict(kl_loss_type="k2"),
         r"^kl_loss_type='k2' .*'reinforce_plus_plus'; accepted: 'k1' while use_kl_loss=False"),
        (dict(score_centering_top_k=8),
         r"^score_centering_top_k=8 is not supported with score_centering=False; accepted: 32"),
        (dict(advantage_estimator=BASE, score_centering_top_k=64), r"^score_centering_top_k=64 .*accepted: 32"),
        (dict(kl_loss_type="k3"), r"kl_loss_type='k3' is not supported; accepted values are 'k1', 'k2'"),
        (dict(kl_loss_type="K2"), r"Did you mean 'k2'"),
        (dict(advantage_estimator=BASE, multi_objective_aggregation="normalize_then_sum"), r"multi_objective_aggregation='normalize_then_sum' .*accepted: 'sum_then_normalize'"),
        (dict(normalize_advantages=False), r"normalize_advantages=False .*accepted: True"),
        (dict(kl_coef=-0.1), r"kl_coef=-0.1 .*accepted: a finite float >= 0"),
        (dict(kl_coef=0.0, use_kl_loss=True, kl_loss_coef=-1.0), r"kl_loss_coef=-1.0 .*accepted: a finite float >= 0"),
        (dict(kl_coef=float("nan")), r"kl_coef=nan .*accepted: a finite float >= 0"),
        (dict(kl_coef=float("inf")), r"kl_coef=inf .*accepted: a finite float >= 0"),
        (dict(kl_coef=0.0, use_kl_loss=True, kl_loss_coef=float("nan")), r"kl_loss_coef=nan .*accepted: a finite float >= 0"),
        (dict(advantage_estimator=BASE, kl_loss_coef=float("nan")), r"kl_loss_coef=nan .*accepted: a finite float >= 0"),
        (dict(gamma=float("nan")), r"gamma=nan .*accepted: a float in \[0, 1\]"),
        (dict(temperature=0.0), r"temperature=0.0 is not supported; accepted: a finite float > 0"),
        (dict(temperature=0.0, generation_kwargs={"do_sample": False}), r"temperature=0.0 is not supported; accepted: a finite float > 0"),
        (dict(generation_kwargs={"do_sample": False}), r"generation_kwargs\['do_sample'\]=False is not supported; accepted: True"),
        (dict(generation_kwargs={"temperature": 0}), r"generation_kwargs\['temperature'\]=0 is not supported; accepted: a finite float > 0"),
        (dict(max_completion_length=0), r"max_completion_length=0 is not supported; accepted: an integer >= 1"),
        (dict(epsilon=float("nan")), r"epsilon=nan is not supported; accepted: a finite float > 0"),
        (dict(multi_objective_aggregation="normalize_then_sum"), r"multi_objective_aggregation='normalize_then_sum' .*accepted: 'sum_then_normalize'"),
        (dict(advantage_estimator=BASE, num_generations_eval=1), r"num_generations_eval=1 .*accepted: None or an integer >= 2"),
        (dict(reward_weights=[1.0, float("nan")]), r"reward_weights=\[1.0, nan\] is not supported; accepted: None or a list of finite floats"),
        (dict(gamma=1.5), r"gamma=1.5 .*accepted: a float in \[0, 1\]"),
        (dict(gamma=-0.1), r"gamma=-0.1 .*accepted: a float in \[0, 1\]"),
        (dict(importance_sampling_level="sequence"), r"importance_sampling_level='sequence' .*accepted: 'token'"),
        (dict(top_entropy_quantile=0.2), r"top_entropy_quantile=0.2 .*accepted: 1.0"),
        (dict(off_policy_mask_threshold=0.5), r"off_policy_mask_threshold=0.5 .*accepted: None"),
        (dict(delta=1.5), r"delta=1.5 .*accepted: None"),
        (dict(entropy_coef=0.01), r"entropy_coef=0.01 .*accepted: 0.0"),
        (dict(sync_ref_model=True), r"sync_ref_model=True .*accepted: False"),
        (dict(use_vllm=True, score_centering=True), r"vllm_importance_sampling_mode='sequence_mask' is not supported with score_centering=True; accepted: 'token_truncate', 'token_mask'"),
        (dict(use_vllm=True, score_centering=True, vllm_importance_sampling_mode="sequence_truncate"), r"vllm_importance_sampling_mode='sequence_truncate' is not supported with score_centering=True; accepted: 'token_truncate', 'token_mask'"),
        (dict(use_vllm=True, vllm_dtype="fp32"), r"vllm_dtype='fp32' is not supported; accepted values are 'auto', 'float32', 'bfloat16', 'float16'"),
        (dict(vllm_dtype="float32"), r"vllm_dtype='float32' is not supported with use_vllm=False; accepted: 'auto'"),
        (dict(use_vllm=True, vllm_mode="server", vllm_dtype="float32"), r"vllm_dtype='float32' is not supported with vllm_mode='server'; accepted: 'auto'.*`trl-rpp vllm-serve --dtype`"),
    ],
)
def test_rejections_name_field_and_accepted_values(kwargs, pattern):
    with pytest.raises(ValueError, match=pattern):
        make(**kwargs)


def test_vllm_is_accepted_and_with_score_centering_needs_token_level_correction():
    assert make(use_vllm=True).use_vllm
    c = make(use_vllm=True, score_centering=True, vllm_importance_sampling_mode="token_truncate")
    assert c.score_centering and c.vllm_importance_sampling_mode == "token_truncate"
    assert make(use_vllm=True, score_centering=True, vllm_importance_sampling_correction=False).score_centering
    assert make(use_vllm=True, vllm_dtype="float32").vllm_dtype == "float32"
    assert make(use_vllm=True).vllm_dtype == "auto"


def test_context_parallelism_is_rejected():
    from accelerate.parallelism_config import ParallelismConfig

    with pytest.raises(ValueError, match="cp_size"):
        make(parallelism_config=ParallelismConfig(cp_size=2))


def test_docstring_and_field_metadata_agree():
    """Every RPP field is documented in the class docstring, and the docstring's default matches the field's."""
    own = [f for f in dataclasses.fields(RPPConfig) if f.name in RPPConfig.__annotations__]
    doc = RPPConfig.__doc__
    assert {f.name for f in own} >= {
        "advantage_estimator",
        "normalize_advantages",
        "gamma",
        "kl_coef",
        "use_kl_loss",
        "kl_loss_type",
        "kl_loss_coef",
    }
    for f in own:
        assert f.metadata.get("help"), f"{f.name} has no help metadata"
        if f.name in ("loss_type", "scale_rewards"):
            continue  # GRPO fields whose default changes here; documented in the class docstring prose.
        m = re.search(rf"^\s+{f.name} \(`([^`]+)`, \*optional\*(?:, defaults to `([^`]+)`)?\):", doc, re.M)
        assert m, f"{f.name} is not documented in RPPConfig's docstring"
        if f.default is None:
            assert m.group(2) is None, f"{f.name}: docstring states a fixed default but the field resolves per estimator"
        else:
            assert m.group(2) == repr(f.default).replace("'", '"'), (f.name, m.group(2), f.default)
        if "choices" in f.metadata:
            for choice in f.metadata["choices"]:
                assert f'"{choice}"' in doc, (f.name, choice)


def test_one_word_per_choice():
    """`nonfinite_rewards` and `reward_errors` share their choices ("raise", "unscorable"); any other word is refused,
    naming the accepted ones."""
    fields = {f.name: f for f in dataclasses.fields(RPPConfig)}
    assert fields["nonfinite_rewards"].metadata["choices"] == fields["reward_errors"].metadata["choices"]
    assert RPPConfig(**CPU).nonfinite_rewards == "raise"
    with pytest.raises(ValueError, match=r"^nonfinite_rewards='error' is not supported; accepted values are 'raise', "
                                         r"'unscorable'\."):
        RPPConfig(**CPU, nonfinite_rewards="error")
    with pytest.raises(ValueError, match=r"^nonfinite_rewards='errors' is not supported; accepted values are 'raise', "
                                         r"'unscorable'\."):
        RPPConfig(**CPU, nonfinite_rewards="errors")


# --- exact sampling: every generation field is classified ---------------------------------------------------------


def test_every_generation_config_field_is_classified():
    """Each field of the installed transformers' `GenerationConfig` either changes the sampler's distribution (then
    score centering accepts only its neutral values, `NEUTRAL_SAMPLING`), or never does (`INERT_GENERATION`), or is
    the temperature. A field a new transformers adds fails here until it is classified; each default is neutral."""
    from transformers import GenerationConfig

    from trl_rpp.records.settings import INERT_GENERATION, NEUTRAL_SAMPLING

    defaults = GenerationConfig().to_dict()
    assert not set(NEUTRAL_SAMPLING) & INERT_GENERATION
    assert sorted(set(defaults) - set(NEUTRAL_SAMPLING) - INERT_GENERATION - {"temperature"}) == []
    # do_sample's default is greedy decoding; TRL passes do_sample=True to every generate call.
    assert [k for k, v in NEUTRAL_SAMPLING.items() if k in defaults and defaults[k] not in v] == ["do_sample"]


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed (make test-min)")
def test_every_vllm_sampling_params_field_is_classified():
    """The same for vLLM's `SamplingParams`, in its own names (`NEUTRAL_VLLM_SAMPLING`, `INERT_VLLM_SAMPLING`)."""
    from vllm import SamplingParams

    from trl_rpp.records.settings import INERT_VLLM_SAMPLING, NEUTRAL_VLLM_SAMPLING

    fields = set(SamplingParams.__struct_fields__)
    assert not set(NEUTRAL_VLLM_SAMPLING) & INERT_VLLM_SAMPLING
    assert sorted(fields - set(NEUTRAL_VLLM_SAMPLING) - INERT_VLLM_SAMPLING - {"temperature"}) == []
    default = SamplingParams()
    assert [k for k, v in NEUTRAL_VLLM_SAMPLING.items() if getattr(default, k) not in v] == []


@pytest.mark.parametrize("use_vllm, kwargs", [
    (False, {"dola_layers": "high"}), (False, {"penalty_alpha": 0.6}), (False, {"token_healing": True}),
    (True, {"presence_penalty": 0.5}), (True, {"logit_bias": {3: 1.0}}), (True, {"frequency_penalty": 0.5}),
])
def test_score_centering_rejects_a_distribution_changing_generation_kwarg_in_its_engines_names(use_vllm, kwargs):
    [(name, value)] = kwargs.items()
    with pytest.raises(ValueError, match=rf"^generation_kwargs: {name}={re.escape(repr(value))} is not supported with "
                                         r"score_centering=True( and vllm_importance_sampling_correction=True)?; "
                                         r"accepted: "):
        RPPConfig(**CPU, score_centering=True, use_vllm=use_vllm, generation_kwargs=kwargs,
                  **(dict(vllm_importance_sampling_mode="token_truncate") if use_vllm else {}))
    # Inert settings pass: a stop string, and the number of tokens.
    inert = {"max_tokens": 8} if use_vllm else {"stop_strings": ["\n"]}
    RPPConfig(**CPU, score_centering=True, use_vllm=use_vllm, generation_kwargs=inert,
              **(dict(vllm_importance_sampling_mode="token_truncate") if use_vllm else {}))
