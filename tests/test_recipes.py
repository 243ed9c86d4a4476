"""The GSM8K recipe: data preparation and the final-answer reward on the shipped sample rows
(`examples/data/gsm8k_sample.jsonl`, GSM8K-style rows written for this project), and the one-GPU script
`examples/run_qwen3_0.6b_1xgpu.sh` (its `DRY_RUN=1` output and its refusal to start without a GPU)."""

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from trl_rpp.recipes import gsm8k

REPO = Path(__file__).resolve().parents[1]
SAMPLE = REPO / "examples" / "data" / "gsm8k_sample.jsonl"
RECIPE = "examples/run_qwen3_0.6b_1xgpu.sh"
ESTIMATORS = ["reinforce_plus_plus", "reinforce_plus_plus_baseline"]


def sample_rows():
    return [json.loads(line) for line in SAMPLE.read_text().splitlines()]


def test_prepare_rows_on_the_shipped_sample():
    rows = [gsm8k.prepare_row(r) for r in sample_rows()]
    # The reference is the number after each row's '####' line, commas removed.
    assert [r["answer"] for r in rows] == ["6", "1440", "61", "2.5", "25", "14"]
    for raw, row in zip(sample_rows(), rows):
        (message,) = row["prompt"]
        assert message["role"] == "user" and message["content"].startswith(raw["question"])
        assert message["content"].endswith(gsm8k.INSTRUCTION) and "####" not in message["content"]


def test_reference_answer_rejects_rows_without_a_final_number():
    with pytest.raises(ValueError, match="no '####' line"):
        gsm8k.reference_answer("It is 5.")
    with pytest.raises(ValueError, match="not a number"):
        gsm8k.reference_answer("#### five")


@pytest.mark.parametrize(
    "completion, expected",
    [
        ("First 14 + 9 = 23, then 23 - 17 = 6.\nThe answer is \\boxed{6}.", "6"),
        ("So 312 - 287 = 25 seats. \\boxed{\\text{25 seats}} and 3 more words", "25"),  # boxed wins over later numbers
        ("45 * 32 = 1440\n#### 1,440", "1440"),                                         # GSM8K's own format
        ("Each piece is 7.5 / 3 = 2.50 meters", "2.5"),                                 # the last number
        ("<think>maybe 99</think>He has $61 left.", "61"),                              # reasoning is skipped
        ("<think>it is 14</think>I do not know.", None),
        ("\\boxed{", None),                                                             # unclosed box: no answer
        ("no digits at all", None),
    ],
)
def test_extract_final_answer(completion, expected):
    assert gsm8k.extract_final_answer(completion) == expected


def test_final_answer_reward_on_the_shipped_sample():
    rows = [gsm8k.prepare_row(r) for r in sample_rows()]
    answers = [r["answer"] for r in rows]
    # Right final answers, in the formats a model writes them, standard and conversational.
    right = ["23 - 17 = 6, so \\boxed{6}", [{"role": "assistant", "content": "45 * 32 = 1440. \\boxed{1,440}"}],
             "96 - 35 = 61\n#### 61", "Each piece: \\boxed{2.50}", "312 - 287 = 25", "252 / 18 = 14.0 days"]  # fmt: skip
    assert gsm8k.final_answer_reward(right, answer=answers) == [1.0] * 6
    # The first number of a completion is not its answer (the old exact_answer's mistake), nor a wrong box.
    wrong = ["6 loaves? No: 14 + 9 = 23 and 23 - 16 = 7", "\\boxed{1441}", "61 is wrong, it is 62",
             "\\boxed{}", "", "14 ... then 15"]  # fmt: skip
    assert gsm8k.final_answer_reward(wrong, answer=answers) == [0.0] * 6
    # The raw GSM8K answer field works as the reference too.
    assert gsm8k.final_answer_reward(["\\boxed{1440}"], answer=[sample_rows()[1]["answer"]]) == [1.0]


def test_prepare_command_writes_train_and_test_without_overlap(tmp_path):
    gsm8k.main(["--source", str(SAMPLE), "--output_dir", str(tmp_path), "--test_fraction", "0.34"])
    train = [json.loads(line) for line in (tmp_path / "train.jsonl").read_text().splitlines()]
    test = [json.loads(line) for line in (tmp_path / "test.jsonl").read_text().splitlines()]
    assert len(train) + len(test) == 6 and len(test) == 3
    assert not {r["prompt"][0]["content"] for r in train} & {r["prompt"][0]["content"] for r in test}
    assert all(set(r) == {"prompt", "answer"} for r in train + test)
    # The prepared directory is what the CLI trains and evaluates on.
    from trl_rpp import cli

    assert len(cli.load_prompt_dataset(str(tmp_path), split="test")) == 3
    with pytest.raises(ValueError, match="--test_fraction"):
        gsm8k.main(["--source", str(SAMPLE), "--output_dir", str(tmp_path / "x")])


# -- the one-GPU script ---------------------------------------------------------------------------------------------


def _recipe(env_extra, *args):
    env = dict(os.environ, PYTHON=sys.executable, PYTHONPATH=str(REPO), HF_HUB_OFFLINE="1", **env_extra)
    return subprocess.run(["bash", RECIPE, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)


def _dry_run(**env_extra):
    proc = _recipe(dict(DRY_RUN="1", **env_extra))
    assert proc.returncode == 0, proc.stderr[-3000:]
    prepare, train, rest = proc.stdout.split("\n", 2)
    return shlex.split(prepare), shlex.split(train), json.loads(rest[rest.index("{\n"):])  # after any import's print


@pytest.mark.parametrize("estimator", ESTIMATORS)
def test_recipe_dry_run_prints_commands_and_resolved_configuration(estimator):
    prepare, train, config = _dry_run(ESTIMATOR=estimator)
    assert prepare[1:] == ["-m", "trl_rpp.recipes.gsm8k", "--source", "openai/gsm8k", "--output_dir", "data/gsm8k"]
    assert train[:5] == ["accelerate", "launch", "--num_processes", "1", "-m"] and train[5] == "trl_rpp.cli"
    assert config["model_name_or_path"] == "Qwen/Qwen3-0.6B" and config["dataset_name"] == "data/gsm8k"
    assert config["reward_funcs"] == ["final_answer"]
    assert config["chat_template_kwargs"] == {"enable_thinking": False}  # thinking mode set explicitly
    assert (config["loss_type"], config["scale_rewards"], config["beta"]) == ("grpo", "none", 0.0)
    assert config["num_generations"] == 8 and config["generation_batch_size"] == 32  # 4 prompts x 8 per step
    assert config["max_completion_length"] == 1024 and config["bf16"] is True and config["use_cpu"] is False
    if estimator == "reinforce_plus_plus":
        assert (config["gamma"], config["kl_coef"], config["use_kl_loss"]) == (1.0, 0.01, False)
    else:
        assert (config["kl_coef"], config["use_kl_loss"], config["kl_loss_type"], config["kl_loss_coef"]) == (0.0, True, "k2", 0.01)
    # The printed training command parses to the same configuration.
    from trl_rpp import cli

    script_args, args, model_args = cli.make_parser().parse_args_and_config(train[6:] + ["--use_cpu", "true"])
    resolved = cli.resolved_configuration(script_args, args, model_args)
    assert {k: v for k, v in resolved.items() if k != "use_cpu"} == {k: v for k, v in config.items() if k not in ("use_cpu", "note")}


def test_recipe_thinking_mode_and_bad_settings():
    _, _, config = _dry_run(THINKING="1")
    assert config["chat_template_kwargs"] == {"enable_thinking": True} and config["max_completion_length"] == 4096
    for env, message in [({"ESTIMATOR": "grpo"}, "ESTIMATOR must be"), ({"THINKING": "yes"}, "THINKING must be 0 or 1")]:
        proc = _recipe(dict(DRY_RUN="1", **env))
        assert proc.returncode == 2 and message in proc.stderr


def test_recipe_refuses_to_start_without_a_gpu(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is visible: the recipe would start training")
    proc = _recipe({"DATA_DIR": str(tmp_path / "data")})
    assert proc.returncode == 1 and "needs a CUDA GPU" in proc.stderr
    assert not (tmp_path / "data").exists()  # it stopped before preparing anything
