"""Reward functions behave exactly as in GRPO (names, async forms, reward models), and their values are checked as the
trainer holds them (float32): a non-number is an error naming the function, the row and the type, and a value beyond
float32's range is non-finite."""

import asyncio
import functools
import math

import numpy as np
import pytest
import torch
from trl import GRPOConfig, GRPOTrainer

from trainer_helpers import CaptureTrainer, make_args
from trl_rpp import RPPTrainer
from trl_rpp.faults.rewards import guard_reward_func
from trl_rpp.testing.tiny import copy_first_char_reward, copy_task_dataset



# One reward per form that TRL names: a plain function, a partial, a callable instance, and their async versions.
def match_first(prompts, completions, scale=1.0, **kw):
    return [scale * float(c[:1] == p[:1]) for p, c in zip(prompts, completions)]


def length_bonus(prompts, completions, scale=1.0, **kw):
    return [scale * len(c) for c in completions]


class VowelCount:
    def __call__(self, prompts, completions, **kw):
        return [float(sum(ch in "aeiou" for ch in c)) for c in completions]


async def async_match(prompts, completions, **kw):
    await asyncio.sleep(0)
    return [float(c[:1] == p[:1]) for p, c in zip(prompts, completions)]


async def async_length(prompts, completions, scale=1.0, **kw):
    await asyncio.sleep(0)
    return [scale * len(c) for c in completions]


class AsyncJudge:
    """An LLM-judge-like reward: an instance whose `__call__` is async (`inspect.iscoroutinefunction` misses it)."""

    async def __call__(self, prompts, completions, **kw):
        await asyncio.sleep(0)
        return [float(c[-1:] == p[:1]) if c else 0.0 for p, c in zip(prompts, completions)]


def all_forms():
    return [
        match_first,
        functools.partial(length_bonus, scale=0.1),
        VowelCount(),
        async_match,
        functools.partial(async_length, scale=0.1),
        AsyncJudge(),
    ]


NAMES = ["match_first", "length_bonus", "VowelCount", "async_match", "async_length", "AsyncJudge"]


def grpo_args(tmp_path, **kw):
    base = dict(
        output_dir=str(tmp_path / "grpo"), report_to="none", use_cpu=True, bf16=False, per_device_train_batch_size=4,
        gradient_accumulation_steps=2, steps_per_generation=2, num_generations=4, max_completion_length=4,
        max_steps=1, learning_rate=1e-2, save_strategy="no", logging_steps=1, seed=0, disable_dropout=True,
    )
    base.update(kw)
    return GRPOConfig(**base)


FAULT_KEYS = ("/errors", "/timeouts")  # RPPTrainer's counts of failed calls (trl_rpp.faults.rewards); GRPO has none


def reward_keys(trainer, faults=False):
    """The `rewards/*` keys a run logged: TRL's (`mean`, `std`), or with `faults` RPPTrainer's failed-call counts."""
    keys = {k for h in trainer.state.log_history for k in h if k.startswith("rewards/")}
    return sorted(k for k in keys if k.endswith(FAULT_KEYS) == faults)


def fault_keys(names):
    return sorted(f"rewards/{n}{suffix}" for n in names for suffix in FAULT_KEYS)


@pytest.mark.parametrize("estimator", ["reinforce_plus_plus", "reinforce_plus_plus_baseline"])
def test_every_reward_form_is_named_and_logged_as_grpo_does(tmp_path, tiny_model, estimator):
    grpo = GRPOTrainer(model=tiny_model, reward_funcs=all_forms(), args=grpo_args(tmp_path),
                       train_dataset=copy_task_dataset(16))
    grpo.train()
    rpp = CaptureTrainer(model=tiny_model, reward_funcs=all_forms(),
                         args=make_args(tmp_path, estimator, reward_weights=None, max_steps=1),
                         train_dataset=copy_task_dataset(16))
    rpp.train()
    assert grpo.reward_func_names == NAMES
    assert rpp.reward_func_names == grpo.reward_func_names
    assert reward_keys(rpp) == reward_keys(grpo)
    assert len(reward_keys(rpp)) == 2 * len(NAMES)  # mean and std for each, none merged
    assert reward_keys(rpp, faults=True) == fault_keys(NAMES) and not reward_keys(grpo, faults=True)
    # The async forms really ran (an un-awaited coroutine would have crashed or given no number).
    rewards = rpp.captured_rewards[0]
    assert torch.isfinite(rewards).all()
    completions = rpp.processing_class.batch_decode(rpp.generation_batches[0]["completion_ids"], skip_special_tokens=True)
    lengths = torch.tensor([0.1 * len(c) for c in completions])
    torch.testing.assert_close(rewards[:, 4], lengths)  # the async partial's own values


def test_reward_model_is_named_as_grpo_names_it(tmp_path, tiny_model):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    def reward_model():
        m = AutoModelForSequenceClassification.from_pretrained(tiny_model, num_labels=1)
        m.config.pad_token_id = 0
        return m

    tok = AutoTokenizer.from_pretrained(tiny_model)
    grpo = GRPOTrainer(model=tiny_model, reward_funcs=[reward_model(), functools.partial(length_bonus, scale=0.1)],
                       reward_processing_classes=[tok, None], args=grpo_args(tmp_path, max_steps=1),
                       train_dataset=copy_task_dataset(16))
    rpp = RPPTrainer(model=tiny_model, reward_funcs=[reward_model(), functools.partial(length_bonus, scale=0.1)],
                     reward_processing_classes=[tok, None],
                     args=make_args(tmp_path, "reinforce_plus_plus", reward_weights=None, max_steps=1),
                     train_dataset=copy_task_dataset(16))
    assert rpp.reward_func_names == grpo.reward_func_names == [grpo.reward_func_names[0], "length_bonus"]
    grpo.train()
    rpp.train()
    assert reward_keys(rpp) == reward_keys(grpo)
    assert reward_keys(rpp, faults=True) == fault_keys(["length_bonus"])  # reward models are called by TRL directly


# ---------------------------------------------------------------------------------------------------------------
# Values checked as the trainer holds them
# ---------------------------------------------------------------------------------------------------------------


def string_reward(prompts, completions, **kw):
    return [0.5 if i != 3 else "0.5" for i in range(len(completions))]


def test_a_string_reward_names_the_function_the_row_and_the_type(tmp_path, tiny_model):
    trainer = CaptureTrainer(model=tiny_model, reward_funcs=[copy_first_char_reward, string_reward],
                             args=make_args(tmp_path, "reinforce_plus_plus", max_steps=1),
                             train_dataset=copy_task_dataset(16))
    with pytest.raises(ValueError, match=r"reward function 'string_reward' returned '0.5' of type str for row 3 "):
        trainer.train()


class StringJudge:
    async def __call__(self, prompts, completions, **kw):
        return [{"score": 1.0}] * len(completions)


def test_a_non_number_from_an_async_callable_class_is_named_too(tmp_path, tiny_model):
    trainer = CaptureTrainer(model=tiny_model, reward_funcs=StringJudge(),
                             args=make_args(tmp_path, "reinforce_plus_plus", reward_weights=None, max_steps=1),
                             train_dataset=copy_task_dataset(16))
    with pytest.raises(ValueError, match=r"reward function 'StringJudge' returned \{'score': 1.0\} of type dict for row 0"):
        trainer.train()


def float32_overflow(prompts, completions, **kw):
    # 1e39 and 10**40 are finite in Python (float64, int) and inf in float32.
    return [1e39 if i == 1 else (10**40 if i == 2 else float(c[:1] == p[:1]))
            for i, (p, c) in enumerate(zip(prompts, completions))]


def test_a_reward_beyond_float32_is_non_finite_under_error(tmp_path, tiny_model):
    trainer = CaptureTrainer(model=tiny_model, reward_funcs=float32_overflow,
                             args=make_args(tmp_path, "reinforce_plus_plus", reward_weights=None, max_steps=1),
                             train_dataset=copy_task_dataset(16))
    with pytest.raises(ValueError, match=r"'float32_overflow' returned 1e\+39 for row 1 of this batch \(outside float32's range"):
        trainer.train()


@pytest.mark.parametrize("estimator", ["reinforce_plus_plus", "reinforce_plus_plus_baseline"])
def test_a_reward_beyond_float32_is_unscorable_under_unscorable(tmp_path, tiny_model, estimator):
    trainer = CaptureTrainer(model=tiny_model, reward_funcs=float32_overflow,
                             args=make_args(tmp_path, estimator, reward_weights=None, max_steps=2,
                                            nonfinite_rewards="unscorable"),
                             train_dataset=copy_task_dataset(16))
    trainer.train()
    for rewards, batch in zip(trainer.captured_rewards, trainer.generation_batches):
        assert torch.isnan(rewards[1:3, 0]).all()  # became None -> NaN (unscorable) in TRL's table, not inf
        assert not torch.isinf(rewards).any()
        assert torch.isfinite(batch["advantages"]).all() and (batch["advantages"][1:3] == 0).all()
    for p in trainer.model.parameters():
        assert torch.isfinite(p).all()


def test_a_float64_reward_model_beyond_float32_is_non_finite(tmp_path, tiny_model):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    reward_model = AutoModelForSequenceClassification.from_pretrained(tiny_model, num_labels=1, dtype=torch.float64)
    reward_model.config.pad_token_id = 0
    # A real float64 score head that outputs 1e39 for every input: finite in float64, inf in float32.
    reward_model.score = torch.nn.Linear(reward_model.config.hidden_size, 1, bias=True, dtype=torch.float64)
    with torch.no_grad():
        reward_model.score.weight.zero_()
        reward_model.score.bias.fill_(1e39)
    tok = AutoTokenizer.from_pretrained(tiny_model)
    trainer = CaptureTrainer(model=tiny_model, reward_funcs=reward_model, reward_processing_classes=tok,
                             args=make_args(tmp_path, "reinforce_plus_plus", reward_weights=None, max_steps=1),
                             train_dataset=copy_task_dataset(16))
    with pytest.raises(ValueError, match=r"reward model '.*' returned inf for row 0 .*as held in float32"):
        trainer.train()


def test_guard_accepts_numbers_in_every_form_torch_accepts_and_rejects_the_rest():
    def returns(values):
        def reward(prompts, completions, **kw):
            return values
        return guard_reward_func(reward, "raise")

    ok = [1, 2.5, True, None, np.float32(0.25), np.int64(3), np.array(1.5), torch.tensor(0.5), torch.tensor([2.0])]
    out = returns(ok)(prompts=["a"] * len(ok), completions=["b"] * len(ok))
    assert out == [1.0, 2.5, 1.0, None, 0.25, 3.0, 1.5, 0.5, 2.0]
    assert torch.tensor([math.nan if v is None else v for v in out], dtype=torch.float32).shape == (len(ok),)
    for bad, type_name in [("1", "str"), ([1.0, 2.0], "list"), (1 + 2j, "complex"), (torch.tensor([1.0, 2.0]), "Tensor"),
                           (np.array(["x"]), "ndarray"), (object(), "object")]:
        with pytest.raises(ValueError, match=rf"returned .* of type {type_name} for row 1 of this batch"):
            returns([0.0, bad])(prompts=["a", "a"], completions=["b", "c"])
    with pytest.raises(ValueError, match=r"reward function 'reward' returned float 0.5; accepted: a list"):
        returns(0.5)(prompts=["a"], completions=["b"])
    # float32's edge: the largest float32 is finite, the next float64 that rounds to inf is not.
    f32_max = float(torch.finfo(torch.float32).max)
    assert returns([f32_max, -f32_max])(prompts=["a"] * 2, completions=["b"] * 2) == [f32_max, -f32_max]
    with pytest.raises(ValueError, match=r"row 0 of this batch \(outside float32's range"):
        returns([f32_max * 1.0001])(prompts=["a"], completions=["b"])
    unscorable = guard_reward_func(lambda prompts, completions, **kw: [1e39, -(10**400), math.nan, 1.0], "unscorable")
    assert unscorable(prompts=["a"] * 4, completions=["b"] * 4) == [None, None, None, 1.0]


def test_empty_training_dataset_is_rejected_before_the_model_is_loaded(tmp_path):
    from datasets import Dataset

    empty = Dataset.from_dict({"prompt": []})
    # The model path does not exist: if the trainer loaded it first, the error would be an OSError instead.
    with pytest.raises(ValueError, match=r"train_dataset is empty; accepted: a dataset with at least one row"):
        RPPTrainer(model=str(tmp_path / "does-not-exist"), reward_funcs=copy_first_char_reward,
                   args=make_args(tmp_path, "reinforce_plus_plus"), train_dataset=empty)
