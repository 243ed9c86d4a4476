"""`examples/multi_turn.py` run end to end as a real subprocess (CPU, offline): the tool loop and the environment
(`rollout_func`) loop each train with score centering on the tiny tool model; its default of building that model is
what the session fixture `tool_model` (tests/conftest.py) builds, so the test passes that copy instead."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest


REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_multi_turn_example_runs_both_loops(tool_model, tmp_path):
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", WANDB_MODE="offline")
    env.pop("CUDA_VISIBLE_DEVICES", None)
    cmd = [sys.executable, str(REPO / "examples" / "multi_turn.py"), "--model_name_or_path", tool_model,
           "--output_dir", str(tmp_path / "out"), "--max_steps", "1"]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    tools = re.search(r"\[tools\] step 1: reward=\S+, tools/call_frequency=([0-9.e+-]+), score_centering/", proc.stdout)
    assert tools and float(tools.group(1)) > 0, proc.stdout[-3000:]
    assert re.search(r"\[rollout\] step 1: reward=\S+, score_centering/sampler_head_mass=", proc.stdout), proc.stdout


def test_multi_turn_example_help_runs_as_in_the_readme():
    """The README's `python examples/multi_turn.py --help`, as written."""
    readme = (REPO / "README.md").read_text()
    assert "`python examples/multi_turn.py --help`" in readme
    proc = subprocess.run([sys.executable, "examples/multi_turn.py", "--help"], cwd=REPO, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0 and "--model_name_or_path" in proc.stdout, proc.stderr[-2000:]
