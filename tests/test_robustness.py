"""Bad rewards, degenerate batches and misuse: each handled explicitly, each error clear."""

import math

import pytest
import torch
from transformers import TrainerCallback

from trainer_helpers import CaptureTrainer, make_args
from trl_rpp import RPPConfig, RPPTrainer
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

    with pytest.raises(Boom, match="grader crashed on purpose"):  # never swallowed
        build(tmp_path, tiny_model, broken_reward).train()


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
    # With masking of truncated completions, a batch where some rows are masked still trains.
    trainer = build(tmp_path, tiny_model, copy_first_char_reward, estimator, max_completion_length=8,
                    mask_truncated_completions=True, max_steps=6)
    try:
        trainer.train()
    except RuntimeError as err:  # every completion of a generation batch truncated: the spec's empty population
        assert "no valid token on any process" in str(err)
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
