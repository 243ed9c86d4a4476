"""The example script `examples/rpp.py` and the Qwen3-0.6B recipe `examples/run_qwen3_0.6b_1xgpu.sh`.

The slow tests run the script end to end as a real subprocess on a tiny local model (CPU, offline); the fast ones
check its dataset/reward plumbing in-process and the recipe's printed command (`DRY_RUN=1`).
"""

import importlib.util
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "examples" / "rpp.py"
RECIPE = "examples/run_qwen3_0.6b_1xgpu.sh"  # relative to REPO, as a user runs it
ESTIMATORS = ["reinforce_plus_plus", "reinforce_plus_plus_baseline"]


@pytest.fixture(scope="module")
def rpp():
    spec = importlib.util.spec_from_file_location("examples_rpp", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def tiny_setup(tmp_path_factory):
    from trl_rpp.testing.tiny import build_tiny_model, copy_task_dataset

    root = tmp_path_factory.mktemp("rpp_example")
    model = build_tiny_model(root / "m")
    data = root / "copy.jsonl"
    with open(data, "w") as f:
        for row in copy_task_dataset(64):
            f.write(json.dumps(row) + "\n")
    return model, data


def _env():
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", WANDB_MODE="offline")
    env.pop("CUDA_VISIBLE_DEVICES", None)
    return env


@pytest.mark.slow
@pytest.mark.parametrize("estimator", ESTIMATORS)
def test_script_trains_saves_and_writes_model_card(tiny_setup, tmp_path, estimator):
    model, data = tiny_setup
    out = tmp_path / "out"
    cmd = [
        sys.executable, str(SCRIPT),
        "--model_name_or_path", model,
        "--dataset_name", str(data),
        "--advantage_estimator", estimator,
        "--max_steps", "2",
        "--per_device_train_batch_size", "8",
        "--num_generations", "4",
        "--max_completion_length", "2",
        "--use_cpu", "--bf16", "False",
        "--report_to", "none",
        "--output_dir", str(out),
        "--reward_funcs", "copy_first_char",
    ]  # fmt: skip
    proc = subprocess.run(cmd, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert (out / "config.json").is_file()
    assert (out / "model.safetensors").is_file()
    card = (out / "README.md").read_text()
    assert "REINFORCE++" in card and "2501.03262" in card
    # The estimator actually ran: its own metrics were logged.
    assert "advantages/raw_mean" in proc.stdout + proc.stderr
    if estimator == "reinforce_plus_plus_baseline":
        assert "'kl_loss'" in proc.stdout + proc.stderr


def test_dataset_without_prompt_column_fails_early(rpp, tmp_path):
    data = tmp_path / "bad.jsonl"
    data.write_text('{"question": "1+1?", "answer": "2"}\n{"question": "2+2?", "answer": "4"}\n')
    with pytest.raises(ValueError, match=r"no 'prompt' column.*'question'.*'answer'|no 'prompt' column.*'answer'.*'question'"):
        rpp.load_prompt_dataset(str(data))


@pytest.mark.slow
def test_dataset_without_prompt_column_fails_in_subprocess(tmp_path):
    # Fails before any model is loaded (the model path does not even exist).
    data = tmp_path / "bad.csv"
    data.write_text("question,answer\n1+1?,2\n")
    cmd = [sys.executable, str(SCRIPT), "--model_name_or_path", str(tmp_path / "missing"), "--dataset_name",
           str(data), "--reward_funcs", "copy_first_char", "--use_cpu", "--bf16", "False", "--report_to", "none",
           "--output_dir", str(tmp_path / "out")]  # fmt: skip
    proc = subprocess.run(cmd, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "ValueError" in proc.stderr and "no 'prompt' column" in proc.stderr and "question" in proc.stderr


@pytest.mark.parametrize("fmt", ["json", "jsonl", "csv", "parquet", "dir", "save_to_disk"])
def test_local_dataset_formats(rpp, tmp_path, fmt):
    from datasets import Dataset

    ds = Dataset.from_list([{"prompt": "a:", "answer": "1"}, {"prompt": "b:", "answer": "2"}])
    if fmt in ("json", "jsonl"):
        path = tmp_path / f"d.{fmt}"
        ds.to_json(str(path), lines=fmt == "jsonl")
    elif fmt == "csv":
        path = tmp_path / "d.csv"
        ds.to_csv(str(path), index=False)
    elif fmt == "parquet":
        path = tmp_path / "d.parquet"
        ds.to_parquet(str(path))
    elif fmt == "dir":
        path = tmp_path / "data"
        path.mkdir()
        ds.to_json(str(path / "train.jsonl"))
    else:
        path = tmp_path / "saved"
        ds.save_to_disk(str(path))
    loaded = rpp.load_prompt_dataset(str(path))
    assert loaded["prompt"] == ["a:", "b:"]


def test_reward_registry(rpp):
    from trl_rpp import RPPConfig

    args = RPPConfig(output_dir="unused", use_cpu=True, bf16=False, max_completion_length=16, report_to="none")
    funcs = rpp.resolve_reward_funcs(["copy_first_char", "exact_answer", "get_soft_overlong_punishment"], args)
    assert len(funcs) == 3 and all(callable(f) for f in funcs)
    with pytest.raises(ValueError, match=r"'nope'.*accepted names:.*copy_first_char.*exact_answer"):
        rpp.resolve_reward_funcs(["copy_first_char", "nope"], args)
    with pytest.raises(ValueError, match="accepted names"):
        rpp.resolve_reward_funcs([], args)


def test_exact_answer(rpp):
    completions = ["The answer is 1,234.", [{"role": "assistant", "content": "-7 apples"}], "no number", "12 then 3"]
    answers = ["step 1... #### 1234", "-7", "3", "3"]
    assert rpp.exact_answer(completions, answers) == [1.0, 1.0, 0.0, 0.0]


def _dry_run(estimator, **extra_env):
    env = dict(os.environ, DRY_RUN="1", ESTIMATOR=estimator, **extra_env)
    proc = subprocess.run(["bash", RECIPE], cwd=REPO, env=env, capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip()


@pytest.mark.parametrize("estimator", ESTIMATORS)
def test_recipe_dry_run_prints_spec_flags(rpp, estimator):
    cmd = _dry_run(estimator)
    assert cmd.startswith("accelerate launch --num_processes 1 examples/rpp.py ")
    for flag in ["--model_name_or_path Qwen/Qwen3-0.6B", "--dataset_name openai/gsm8k", f"--advantage_estimator {estimator}",
                 "--normalize_advantages true", "--loss_type grpo", "--scale_rewards none", "--beta 0.0",
                 "--num_generations 8", "--bf16 true", "--max_completion_length 1024"]:  # fmt: skip
        assert flag in cmd, flag
    if estimator == "reinforce_plus_plus":
        for flag in ["--gamma 1.0", "--kl_coef 0.01", "--use_kl_loss false"]:
            assert flag in cmd, flag
    else:
        for flag in ["--kl_coef 0.0", "--use_kl_loss true", "--kl_loss_type k2", "--kl_loss_coef 0.01"]:
            assert flag in cmd, flag

    # The printed flags parse into the spec's resolved config (CPU overrides appended so no GPU is needed).
    from trl import ModelConfig, TrlParser

    argv = shlex.split(cmd)[5:] + ["--use_cpu", "--bf16", "false"]
    parser = TrlParser((rpp.RPPScriptArguments, rpp.RPPConfig, ModelConfig))
    script_args, args, _ = parser.parse_args_and_config(argv)
    assert script_args.reward_funcs == ["exact_answer"]
    assert args.advantage_estimator == estimator and args.normalize_advantages
    assert (args.loss_type, args.scale_rewards, args.beta) == ("grpo", "none", 0.0)
    assert args.num_generations == 8 and args.generation_batch_size == 32  # 4 prompts x 8 generations per step
    assert args.max_completion_length == 1024
    if estimator == "reinforce_plus_plus":
        assert (args.gamma, args.kl_coef, args.use_kl_loss) == (1.0, 0.01, False)
    else:
        assert (args.kl_coef, args.use_kl_loss, args.kl_loss_type, args.kl_loss_coef) == (0.0, True, "k2", 0.01)


def test_recipe_local_dataset_and_bad_estimator(tmp_path):
    data = tmp_path / "gsm8k.jsonl"
    data.write_text('{"prompt": "1+1=", "answer": "2"}\n')
    cmd = _dry_run("reinforce_plus_plus", DATASET=str(data))
    assert f"--dataset_name {data}" in cmd and "--dataset_config" not in cmd
    proc = subprocess.run(["bash", RECIPE], cwd=REPO, env=dict(os.environ, DRY_RUN="1", ESTIMATOR="grpo"),
                          capture_output=True, text=True, timeout=30)  # fmt: skip
    assert proc.returncode != 0 and "ESTIMATOR must be" in proc.stderr
