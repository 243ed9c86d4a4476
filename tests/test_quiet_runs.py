"""Quiet runs: a default configuration and a default training run emit no deprecation warning of their own.

transformers 5 renamed `gradient_checkpointing` to `activation_checkpointing` and warns (FutureWarning) whenever it
resolves the old name; TRL's configs default the old name to True, so every run used to begin with that warning.
`RPPConfig` resolves it itself (`trl_rpp/config.py`). TRL 1.16's own generation and no-grad helpers
(`trl/models/utils.py`) still call transformers' deprecated `is_gradient_checkpointing`,
`gradient_checkpointing_disable` and `gradient_checkpointing_enable`; those three come from TRL's code, not ours,
and are the only ones allowed.
"""

import warnings

import pytest

from trl_rpp import RPPConfig

# Deprecated transformers members that TRL 1.16's own helpers call (trl/models/utils.py), by message.
TRL_OWN = r"`(is_gradient_checkpointing|gradient_checkpointing_disable|gradient_checkpointing_enable)` is deprecated"
DEPRECATIONS = (FutureWarning, DeprecationWarning, PendingDeprecationWarning)


def _deprecations(caught):
    return [f"{w.category.__name__}: {w.message} ({w.filename}:{w.lineno})" for w in caught
            if issubclass(w.category, DEPRECATIONS)]


@pytest.mark.parametrize("estimator", ["reinforce_plus_plus", "reinforce_plus_plus_baseline"])
def test_default_config_emits_no_deprecation_warning(estimator):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        config = RPPConfig(output_dir="unused", advantage_estimator=estimator, use_cpu=True, bf16=False,
                           report_to="none")
    assert not _deprecations(caught), _deprecations(caught)
    if not hasattr(config, "activation_checkpointing"):
        return  # transformers < 5.23 (make test-min's floor) has the old name only, which never warned
    # The value is kept under both names, as transformers resolves them: TRL's default, on.
    assert config.gradient_checkpointing is True and config.activation_checkpointing is True
    off = RPPConfig(output_dir="unused", gradient_checkpointing=False, use_cpu=True, bf16=False, report_to="none")
    assert off.gradient_checkpointing is False and off.activation_checkpointing is False
    new_name = RPPConfig(output_dir="unused", activation_checkpointing=False, use_cpu=True, bf16=False,
                         report_to="none")
    assert new_name.gradient_checkpointing is False  # the new name wins, as in transformers


@pytest.mark.slow
def test_default_training_run_emits_no_deprecation_warning_of_its_own(tiny_model, tmp_path):
    """One step of a default run (GRPO's defaults, gradient checkpointing on) on the tiny model: no deprecation
    warning except the three that TRL's own helpers trigger (`TRL_OWN`)."""
    import re

    from trl_rpp import RPPTrainer
    from trl_rpp.testing.tiny import copy_first_char_reward, copy_task_dataset

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        args = RPPConfig(output_dir=str(tmp_path), max_steps=1, per_device_train_batch_size=4, num_generations=4,
                         max_completion_length=2, use_cpu=True, bf16=False, report_to="none", save_strategy="no")
        trainer = RPPTrainer(model=tiny_model, reward_funcs=copy_first_char_reward, args=args,
                             train_dataset=copy_task_dataset(8))
        trainer.train()
    found = [w for w in _deprecations(caught) if not re.search(TRL_OWN, w)]
    assert not found, found
    assert trainer.state.global_step == 1
