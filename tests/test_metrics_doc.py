"""The "Logged metrics" section of `docs/rpp_trainer.md` against the keys a short run really logs: every logged key
is documented, and every REINFORCE++ key the section promises for these configurations is logged."""

import os
import re
import warnings
from pathlib import Path

import pytest
from datasets import Dataset

from trl_rpp import RPPConfig, RPPTrainer
from trl_rpp.testing.tiny import copy_first_char_reward, copy_task_dataset

warnings.filterwarnings("ignore", category=FutureWarning)
os.environ.setdefault("WANDB_MODE", "offline")
DOC = Path(__file__).resolve().parents[1] / "docs" / "rpp_trainer.md"
SECTION = "\n## Logged metrics\n"


def metrics_section():
    """The page's "Logged metrics" section, up to the next `## ` heading (its subsections included)."""
    text = DOC.read_text()
    start = text.index(SECTION)
    end = text.find("\n## ", start + len(SECTION))
    return text[start:] if end < 0 else text[start:end]


def documented_patterns():
    """One regex per key named in the first column of a table of the section: `<func>` stands for a reward
    function's name, `a/b|c` for `a/b` and `a/c`; `eval_` may prefix any key."""
    patterns = []
    for line in metrics_section().splitlines():
        if not line.startswith("| `"):
            continue
        for key in re.findall(r"`([^`]+)`", line.split(" | ")[0]):
            stem, _, last = key.rpartition("/")
            alternatives = last.split("|")
            for alt in alternatives:
                full = f"{stem}/{alt}" if stem else alt
                patterns.append(re.escape(full).replace(re.escape("<func>"), "[^/]+"))
    return [re.compile(rf"(eval_)?{p}") for p in patterns]


def run_keys(tmp_path, model, estimator, **kw):
    args = RPPConfig(
        output_dir=str(tmp_path / estimator), advantage_estimator=estimator, report_to="none", use_cpu=True,
        bf16=False, per_device_train_batch_size=4, per_device_eval_batch_size=4, num_generations=4,
        max_completion_length=3, max_steps=2, logging_steps=1, save_strategy="no", eval_strategy="steps",
        eval_steps=2, seed=0, **kw,
    )  # fmt: skip
    trainer = RPPTrainer(model=model, reward_funcs=copy_first_char_reward, args=args,
                         train_dataset=Dataset.from_list(copy_task_dataset(32)),
                         eval_dataset=Dataset.from_list(copy_task_dataset(8, seed=3)))  # fmt: skip
    trainer.train()
    return {k for row in trainer.state.log_history for k in row}


@pytest.mark.slow
def test_every_logged_key_is_documented(tmp_path, tiny_model):
    patterns = documented_patterns()
    assert len(patterns) > 40  # the parser found the tables
    rpp = run_keys(tmp_path, tiny_model, "reinforce_plus_plus", steps_per_generation=2, gradient_accumulation_steps=2)
    baseline = run_keys(tmp_path, tiny_model, "reinforce_plus_plus_baseline", score_centering=True)
    undocumented = sorted(k for k in rpp | baseline if not any(p.fullmatch(k) for p in patterns))
    assert not undocumented, f"logged but not in docs/rpp_trainer.md#logged-metrics: {undocumented}"
    # What the page says these configurations log, they log (training and evaluation).
    for key in ["advantages/raw_mean", "advantages/raw_std", "advantages/mean", "advantages/std",
                "advantages/valid_tokens", "advantages/zero_variance", "policy_loss", "ppo_kl", "entropy",
                "clip_ratio/region_mean"]:  # fmt: skip
        assert {key, f"eval_{key}"} <= rpp & baseline, key
    assert {"returns/mean", "returns/std", "returns/max", "returns/min", "ref_kl/k1_mean"} <= rpp - baseline
    assert "kl_loss" in baseline - rpp
    assert {"score_centering/sampler_head_mass", "score_centering/trainer_head_mass", "score_centering/coeff_l1",
            "score_centering/sampler_logp_abs_diff"} <= baseline - rpp  # fmt: skip
    # GRPO keys the page says RPPTrainer does not log.
    assert not {"kl", "clip_ratio/low_min", "clip_ratio/high_max", "entropy_coef"} & (rpp | baseline)
