"""The example script `examples/rpp.py` (the `trl-rpp` CLI as a script), run end to end as a real subprocess on a
tiny local model (CPU, offline). The CLI's own tests are in `tests/test_cli.py`; the Qwen3-0.6B GSM8K recipe's in
`tests/test_recipes.py`.
"""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from trainer_helpers import python_command

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "examples" / "rpp.py"
ESTIMATORS = ["reinforce_plus_plus", "reinforce_plus_plus_baseline"]


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
    cmd = python_command(
        str(SCRIPT),
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
        "--reward_funcs", "trl_rpp.testing.tiny.copy_first_char_reward",
    )  # fmt: skip
    proc = subprocess.run(cmd, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert (out / "config.json").is_file()
    assert (out / "model.safetensors").is_file()
    card = (out / "README.md").read_text()
    assert "REINFORCE++" in card and "2501.03262" in card
    first_prompt = json.loads(data.read_text().splitlines()[0])["prompt"]
    assert f"generator({first_prompt!r}," in card  # the quick start asks a prompt of the training data
    # The estimator actually ran: its own metrics were logged.
    assert "advantages/raw_mean" in proc.stdout + proc.stderr
    if estimator == "reinforce_plus_plus_baseline":
        assert "'kl_loss'" in proc.stdout + proc.stderr


@pytest.mark.slow
def test_dataset_without_prompt_column_fails_in_subprocess(tmp_path):
    # Fails before any model is loaded (the model path does not even exist).
    data = tmp_path / "bad.csv"
    data.write_text("question,answer\n1+1?,2\n")
    cmd = [*python_command(str(SCRIPT)), "--model_name_or_path", str(tmp_path / "missing"), "--dataset_name",
           str(data), "--reward_funcs", "trl_rpp.testing.tiny.copy_first_char_reward", "--use_cpu", "--bf16", "False",
           "--report_to", "none",
           "--output_dir", str(tmp_path / "out")]  # fmt: skip
    proc = subprocess.run(cmd, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "ValueError" in proc.stderr and "no 'prompt' column" in proc.stderr and "question" in proc.stderr


# torch, transformers, TRL or wandb take 10-40 s to import on a busy CPU: an example's `--help` must not need them.
HEAVY_MODULES = {"torch", "transformers", "trl", "wandb"}


@pytest.mark.parametrize("script", ["demo.py", "multi_turn.py"])
def test_example_help_imports_no_heavy_library(script):
    """`--help` parses the arguments before anything heavy is imported (`python -X importtime` lists every module
    the process imported; a timing assert would be flaky on a loaded CI machine). `rpp.py --help` lists every
    `RPPConfig` field, so it builds TRL's parser (`test_rpp_example_help_shows_the_cli_flags`)."""
    proc = subprocess.run([sys.executable, "-X", "importtime", str(REPO / "examples" / script), "--help"], cwd=REPO,
                          env=_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.startswith("usage:"), proc.stderr[-3000:]
    imported = {line.rsplit("|", 1)[-1].strip() for line in proc.stderr.splitlines() if line.startswith("import time:")}
    assert "argparse" in imported  # the listing works
    assert not imported & HEAVY_MODULES, sorted(imported & HEAVY_MODULES)


def test_rpp_example_help_shows_the_cli_flags():
    """`examples/rpp.py --help` is the `trl-rpp` CLI's help: it needs TRL's parser (every `RPPConfig`/`GRPOConfig`
    field is a flag), so it imports TRL; it says which GRPO flags are rejected."""
    env = dict(_env(), COLUMNS="100000")  # one line per flag
    proc = subprocess.run([sys.executable, str(SCRIPT), "--help"], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0 and proc.stdout.startswith("usage:"), proc.stderr[-3000:]
    assert "--advantage_estimator" in proc.stdout and "--reward_funcs" in proc.stdout
    assert re.search(r"^  --beta BETA +Not supported by REINFORCE\+\+: only 0\.0 is accepted", proc.stdout, re.M)
