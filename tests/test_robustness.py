"""Bad rewards, degenerate batches and misuse: each handled explicitly, each error clear."""

import math
import warnings

import pytest
import torch
from transformers import TrainerCallback

from trainer_helpers import CaptureTrainer, make_args
from trl_rpp import RPPConfig, RPPTrainer
from trl_rpp.faults.rewards import RewardFunctionError
from trl_rpp.testing.tiny import copy_first_char_reward, copy_task_dataset

EST = ["reinforce_plus_plus", "reinforce_plus_plus_baseline"]


def build(tmp_path, tiny_model, reward_funcs, estimator="reinforce_plus_plus_baseline", **kw):
    kw.setdefault("reward_weights", None)
    kw.setdefault("max_steps", 2)
    return CaptureTrainer(
        model=tiny_model, reward_funcs=reward_funcs, args=make_args(tmp_path, estimator, **kw),
        train_dataset=copy_task_dataset(64),
    )


def none_for_some(prompts, completions, **kw):
    """Unscorable (None) for completions that start with one of 13 of the 46 tokens (about 28% of a random
    model's samples), else 1 for a copy of the prompt's first letter, 0 otherwise."""
    return [None if c[:1] in "nopqrstuvwxyz" else float(c[:1] == p[:1]) for p, c in zip(prompts, completions)]


@pytest.mark.parametrize("estimator", EST)
def test_none_rewards_are_unscorable_and_leave_the_baseline(tmp_path, tiny_model, estimator):
    # None as the only reward function: rows that it cannot score are unscorable.
    seen_unscorable = False
    trainer = build(tmp_path, tiny_model, none_for_some, estimator, max_steps=6)
    trainer.train()
    for batch, rpf in zip(trainer.generation_batches, trainer.captured_rewards):
        unscorable = torch.isnan(rpf[:, 0])
        seen_unscorable |= bool(unscorable.any())
        assert torch.equal(batch["advantages"][unscorable], torch.zeros_like(batch["advantages"][unscorable]))
        assert torch.isfinite(batch["advantages"]).all()
        if estimator == "reinforce_plus_plus_baseline":
            # Raw advantage of a scorable row = R_i - mean of the scorable rewards of its group (not counting None).
            R = rpf[:, 0].view(-1, 4)
            ok = ~torch.isnan(R)
            base = torch.where(ok, R, 0).sum(1, keepdim=True) / ok.sum(1, keepdim=True).clamp(min=1)
            raw = torch.where(ok, R - base, 0).view(-1)
            m = batch["completion_mask"].bool() & ~unscorable.unsqueeze(1)
            if m.any() and raw[m.any(1)].std() > 0:
                vals = raw.unsqueeze(1).expand_as(m)[m].double()
                want = (vals - vals.mean()) / vals.var(unbiased=False).clamp(min=1e-8).sqrt()
                torch.testing.assert_close(batch["advantages"][m].double(), want, rtol=1e-5, atol=1e-5)
    assert seen_unscorable, "the draw produced no unscorable completion; the test would be vacuous"


def nan_reward(prompts, completions, **kw):
    return [float("nan") if i == 2 else 1.0 for i in range(len(completions))]


def test_nan_reward_is_rejected_with_function_and_row(tmp_path, tiny_model):
    trainer = build(tmp_path, tiny_model, nan_reward)
    with pytest.raises(ValueError, match=r"reward function 'nan_reward' returned nan for row 2"):
        trainer.train()


def test_inf_reward_can_be_treated_as_unscorable(tmp_path, tiny_model):
    def inf_reward(prompts, completions, **kw):
        return [math.inf if i % 4 == 0 else float(c[:1] == p[:1]) for i, (p, c) in enumerate(zip(prompts, completions))]

    trainer = build(tmp_path, tiny_model, inf_reward, nonfinite_rewards="unscorable")
    trainer.train()
    for batch in trainer.generation_batches:
        assert torch.isfinite(batch["advantages"]).all()
    assert torch.isnan(trainer.captured_rewards[0][::4, 0]).all()  # became None -> NaN in TRL's table


def test_wrong_length_and_raising_reward_functions(tmp_path, tiny_model):
    def short_reward(prompts, completions, **kw):
        return [1.0] * (len(completions) - 1)

    with pytest.raises(ValueError, match=r"'short_reward' returned 7 rewards, but 8 were expected"):
        build(tmp_path, tiny_model, short_reward).train()

    class Boom(RuntimeError):
        pass

    def broken_reward(prompts, completions, **kw):
        raise Boom("grader crashed on purpose")

    # Never swallowed: named, with the step, and chained (`reward_errors="raise"`; tests/test_reward_faults.py).
    with pytest.raises(RewardFunctionError, match=r"^reward function 'broken_reward' raised Boom\('grader crashed on "
                       r"purpose'\) at training step 1\. ") as err:
        build(tmp_path, tiny_model, broken_reward).train()
    assert isinstance(err.value.__cause__, Boom)


class NaNWatch(TrainerCallback):
    """After every optimizer step: every parameter finite; at every log: every metric finite."""

    def __init__(self):
        self.steps = 0

    def on_step_end(self, args, state, control, model=None, **kw):
        self.steps += 1
        for name, p in model.named_parameters():
            assert torch.isfinite(p).all(), name

    def on_log(self, args, state, control, logs=None, **kw):
        for k, v in (logs or {}).items():
            if isinstance(v, float):
                assert math.isfinite(v), (k, v)


ADVERSARIAL = {
    "all_equal": lambda prompts, completions, **kw: [0.7] * len(completions),
    "huge": lambda prompts, completions, **kw: [1e6 * (c[:1] == p[:1]) + 1e6 for p, c in zip(prompts, completions)],
    "tiny": lambda prompts, completions, **kw: [1e-9 * (i % 3) for i in range(len(completions))],
    "alternating": lambda prompts, completions, **kw: [(-1.0) ** i * 5 for i in range(len(completions))],
}


@pytest.mark.parametrize("estimator", EST)
@pytest.mark.parametrize("kind", list(ADVERSARIAL))
def test_nothing_is_nan_under_adversarial_rewards(tmp_path, tiny_model, estimator, kind):
    watch = NaNWatch()
    trainer = build(tmp_path, tiny_model, ADVERSARIAL[kind], estimator, max_steps=3)
    trainer.add_callback(watch)
    trainer.train()
    assert watch.steps == 3
    for batch in trainer.generation_batches:
        assert torch.isfinite(batch["advantages"]).all()
    logs = [h for h in trainer.state.log_history if "advantages/zero_variance" in h]
    if kind == "all_equal" and estimator == "reinforce_plus_plus_baseline":
        # Every group has equal rewards: exact zero advantages, and the zero-variance indicator is set.
        for batch in trainer.generation_batches:
            assert torch.equal(batch["advantages"], torch.zeros_like(batch["advantages"]))
        assert all(h["advantages/zero_variance"] == 1.0 for h in logs)


@pytest.mark.parametrize("estimator", EST)
def test_length_one_and_truncated_completions(tmp_path, tiny_model, estimator):
    watch = NaNWatch()
    trainer = build(tmp_path, tiny_model, copy_first_char_reward, estimator, max_completion_length=1)
    trainer.add_callback(watch)
    trainer.train()
    for batch in trainer.generation_batches:
        assert batch["completion_ids"].shape[1] == 1 and batch["completion_mask"].all()
    # With masking of truncated completions, a batch where some rows are masked still trains (a batch where all
    # are masked is a zero-advantage step: test_every_completion_masked_is_a_zero_advantage_step).
    trainer = build(tmp_path, tiny_model, copy_first_char_reward, estimator, max_completion_length=8,
                    mask_truncated_completions=True, max_steps=6)
    trainer.train()
    for batch in trainer.generation_batches:
        m = batch["completion_mask"].bool()
        assert torch.equal(batch["advantages"][~m], torch.zeros_like(batch["advantages"][~m]))


def test_incomplete_groups_are_rejected_at_construction():
    with pytest.raises(ValueError, match=r"generation_batch_size \(6\) must be divisible by num_generations \(4\)"):
        RPPConfig(output_dir="/tmp/x", use_cpu=True, bf16=False, report_to="none", per_device_train_batch_size=6,
                  num_generations=4)


def test_dataset_without_prompt_column_fails_before_the_model_is_loaded(tmp_path):
    from datasets import Dataset

    ds = Dataset.from_list([{"question": "a:"}, {"question": "b:"}])
    # The model path does not exist: if the trainer loaded it first, the error would be an OSError instead.
    with pytest.raises(ValueError, match=r"train_dataset has no 'prompt' column; its columns are \['question'\]"):
        RPPTrainer(model=str(tmp_path / "does-not-exist"), reward_funcs=copy_first_char_reward,
                   args=make_args(tmp_path, "reinforce_plus_plus"), train_dataset=ds)


def test_nonfinite_reward_model_scores_are_rejected(tmp_path, tiny_model):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    reward_model = AutoModelForSequenceClassification.from_pretrained(tiny_model, num_labels=1)
    reward_model.config.pad_token_id = 0
    with torch.no_grad():
        reward_model.score.weight.fill_(float("nan"))
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    trainer = CaptureTrainer(
        model=tiny_model, reward_funcs=reward_model, reward_processing_classes=tokenizer,
        args=make_args(tmp_path, "reinforce_plus_plus_baseline", reward_weights=None, max_steps=1),
        train_dataset=copy_task_dataset(16),
    )
    with pytest.raises(ValueError, match=r"reward model '.*' returned nan for row 0"):
        trainer.train()


# ----------------------------------------------------------------------------------------------------------------
# Empty generation batch: no valid token anywhere -> a zero-advantage step, a metric and a warning with the cause
# ----------------------------------------------------------------------------------------------------------------

# (estimator, path): REINFORCE++ builds its returns at generation (steps_per_generation=2) or in the loss
# ("deferred": one micro-batch per generation batch); the baseline always builds them at generation.
EMPTY_CASES = [
    ("reinforce_plus_plus", "deferred"),
    ("reinforce_plus_plus", "generation"),
    ("reinforce_plus_plus_baseline", "generation"),
]
ONE_MICRO_BATCH = dict(per_device_train_batch_size=8, gradient_accumulation_steps=1, steps_per_generation=1)


def all_unscorable(prompts, completions, **kw):
    return [None] * len(completions)


def initial_parameters(path):
    from transformers import AutoModelForCausalLM

    return dict(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).named_parameters())


def run_empty(tmp_path, tiny_model, estimator, path, reward, match, **kw):
    """Two steps on generation batches with no valid token. No KL loss: the policy loss is the only loss, so the
    parameters must come out bit-identical (zero gradients; AdamW's moments stay 0, no weight decay)."""
    if path == "deferred":
        kw.update(ONE_MICRO_BATCH)
    trainer = build(tmp_path, tiny_model, reward, estimator, use_kl_loss=False, **kw)
    watch = NaNWatch()
    trainer.add_callback(watch)
    with pytest.warns(RuntimeWarning, match=match):
        trainer.train()
    assert watch.steps == 2
    assert ("rpp_rewards" in trainer.loss_inputs[0]) == (path == "deferred")  # the intended path was taken
    for inputs in trainer.loss_inputs:
        assert torch.equal(inputs["advantages"], torch.zeros_like(inputs["advantages"]))
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logs) == 2
    for h in logs:
        assert h["advantages/empty_batch"] == 1.0 and h["advantages/valid_tokens"] == 0.0
        assert h["policy_loss"] == 0.0 and h["grad_norm"] == 0.0
        if estimator == "reinforce_plus_plus":
            assert h["returns/max"] == 0.0 and h["returns/min"] == 0.0
    before = initial_parameters(tiny_model)
    for name, p in trainer.model.named_parameters():
        assert torch.equal(p.detach(), before[name]), name
    return trainer


@pytest.mark.parametrize("estimator,path", EMPTY_CASES)
def test_every_reward_unscorable_is_a_zero_advantage_step(tmp_path, tiny_model, estimator, path):
    """A reward server that is down for a step (None for every row): GRPOTrainer warns and takes a zero-gradient
    step; so does RPPTrainer, instead of the normalization's empty-population assertion."""
    run_empty(tmp_path, tiny_model, estimator, path, all_unscorable, r"every reward function returned None")


@pytest.mark.parametrize("estimator,path", EMPTY_CASES)
def test_every_completion_masked_is_a_zero_advantage_step(tmp_path, tiny_model, estimator, path):
    """Every completion truncated under mask_truncated_completions=True (EOS and pad suppressed, so none ends)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model)
    trainer = run_empty(
        tmp_path, tiny_model, estimator, path, copy_first_char_reward, r"every completion is masked",
        mask_truncated_completions=True, max_completion_length=2, generation_kwargs={"suppress_tokens": [tok.eos_token_id, tok.pad_token_id]},
    )
    for batch in trainer.generation_batches:
        assert not batch["completion_mask"].any()


def test_empty_batch_with_kl_loss_moves_only_through_the_kl_loss(tmp_path, tiny_model):
    """With the baseline recipe's k2 KL loss on, an empty batch still has a zero policy loss and the step stays
    finite; the KL loss may move the parameters (it is the only term with a gradient)."""
    trainer = build(tmp_path, tiny_model, all_unscorable, "reinforce_plus_plus_baseline", max_steps=2)
    watch = NaNWatch()
    trainer.add_callback(watch)
    with pytest.warns(RuntimeWarning, match=r"every reward function returned None"):
        trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert [h["advantages/empty_batch"] for h in logs] == [1.0, 1.0]
    assert all(h["policy_loss"] == 0.0 and math.isfinite(h["kl_loss"]) for h in logs)


def test_empty_batch_metric_is_zero_on_normal_batches(tmp_path, tiny_model):
    trainer = build(tmp_path, tiny_model, copy_first_char_reward, "reinforce_plus_plus", max_steps=1)
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert [h["advantages/empty_batch"] for h in logs] == [0.0]


# ----------------------------------------------------------------------------------------------------------------
# Random reward vectors through the whole trainer (hypothesis): finite parameters and metrics, or the named error
# ----------------------------------------------------------------------------------------------------------------

from hypothesis import HealthCheck, Phase, example, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

F32_MAX = float(torch.finfo(torch.float32).max)
OVERFLOW = [1e39, -1e39]  # finite in Python, +-inf as float32
GRPO_REWARD_KEYS = ("reward", "reward_std", "rewards/")  # TRL's own nanmean/nanstd: NaN when nothing was scored


def reward_values(special):
    value = st.one_of(st.floats(-10, 10), st.sampled_from([None, None, *special]))
    group = st.one_of(st.lists(value, min_size=4, max_size=4), st.just([None] * 4))  # an all-unscorable group
    call = st.one_of(st.lists(group, min_size=2, max_size=2).map(lambda g: g[0] + g[1]), st.just([None] * 8))
    return st.lists(call, min_size=2, max_size=2)  # two generation batches of 8 completions (2 groups of 4)


def cases(special):
    return st.fixed_dictionaries(dict(
        calls=reward_values(special),
        estimator=st.sampled_from(EST),
        path=st.sampled_from(["deferred", "generation"]),
        policy=st.sampled_from(["raise", "unscorable"]),
        kl_loss=st.booleans(),
    ))


def bad(v):
    """Non-finite as the trainer holds rewards (float32): NaN, +-Inf, and Python floats beyond float32's range."""
    return v is not None and (math.isnan(v) or abs(v) > F32_MAX)


def check_random_rewards(root, tiny_model, case):
    calls, policy = case["calls"], case["policy"]
    served = []

    def random_reward(prompts, completions, **kw):
        served.append(len(served))
        return list(calls[len(served) - 1])

    kw = dict(ONE_MICRO_BATCH) if case["path"] == "deferred" else {}
    if case["kl_loss"] and case["estimator"] == "reinforce_plus_plus":
        kw["kl_coef"] = 0.0  # the KL loss replaces the k1 shaping (RPPConfig refuses both)
    trainer = build(root, tiny_model, random_reward, case["estimator"], nonfinite_rewards=policy,
                    use_kl_loss=case["kl_loss"], **kw)
    seen = []

    class Watch(TrainerCallback):
        def on_step_end(self, args, state, control, model=None, **k):
            for name, p in model.named_parameters():
                assert torch.isfinite(p).all(), name

        def on_log(self, args, state, control, logs=None, **k):
            seen.append(dict(logs))
            for key, v in logs.items():
                if isinstance(v, float) and not key.startswith(GRPO_REWARD_KEYS):
                    assert math.isfinite(v), (key, v)

    trainer.add_callback(Watch())
    first_bad = next((c for c in range(2) if any(bad(v) for v in calls[c])), None)
    if policy == "raise" and first_bad is not None:
        row = next(i for i, v in enumerate(calls[first_bad]) if bad(v))
        with pytest.raises(ValueError, match=rf"reward function 'random_reward' returned .* for row {row} "):
            trainer.train()
        assert len(served) == first_bad + 1 and trainer.state.global_step == first_bad
        return
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the empty-batch warning: its cause is tested above
        trainer.train()
    steps = [h for h in seen if "loss" in h]
    assert len(served) == 2 and len(steps) == 2
    empty = [all(v is None or bad(v) for v in c) for c in calls]
    assert [h["advantages/empty_batch"] for h in steps] == [float(e) for e in empty]
    for inputs in trainer.loss_inputs:
        assert torch.isfinite(inputs["advantages"]).all()
    if all(empty) and not case["kl_loss"]:
        before = initial_parameters(tiny_model)
        for name, p in trainer.model.named_parameters():
            assert torch.equal(p.detach(), before[name]), name


FAST = dict(max_examples=10, deadline=None, derandomize=True, database=None, phases=[Phase.explicit, Phase.generate],
            suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


@pytest.mark.slow
@settings(**FAST)
@given(cases([float("nan"), float("inf"), -float("inf")]))
@example(dict(calls=[[None] * 8, [None] * 8], estimator="reinforce_plus_plus", path="deferred", policy="raise",
              kl_loss=False))
@example(dict(calls=[[1.0, None, None, None, None, None, None, None], [float("nan")] * 8],
              estimator="reinforce_plus_plus_baseline", path="generation", policy="unscorable", kl_loss=True))
def test_random_rewards_give_finite_training_or_the_named_error(tmp_path_factory, tiny_model, case):
    """Random reward vectors with None, NaN, +-Inf and all-unscorable groups and batches, both estimators, both
    REINFORCE++ paths, both `nonfinite_rewards` policies, with and without a KL loss: two steps with finite
    parameters and metrics (GRPO's own reward statistics excepted: NaN when nothing was scored), exactly zero
    movement when every batch is unscorable and there is no KL loss, or the `ValueError` naming the function and
    the row."""
    check_random_rewards(tmp_path_factory.mktemp("hyp"), tiny_model, case)


@pytest.mark.slow
@settings(**{**FAST, "max_examples": 6})
@given(cases(OVERFLOW + [float("nan")]))
@example(dict(calls=[[1e39] + [0.5] * 7, [1.0] * 8], estimator="reinforce_plus_plus", path="deferred",
              policy="raise", kl_loss=False))
@example(dict(calls=[[-1e39, 1.0, 0.0, 2.0] * 2, [1.0] * 8], estimator="reinforce_plus_plus_baseline",
              path="generation", policy="unscorable", kl_loss=True))
def test_random_rewards_with_float32_overflow(tmp_path_factory, tiny_model, case):
    """As above, with rewards that are finite in Python but overflow float32 (1e39): under `nonfinite_rewards` they
    count as non-finite, so the named error, or unscorable rows."""
    check_random_rewards(tmp_path_factory.mktemp("hyp"), tiny_model, case)
