"""`examples/multi_turn.py` run end to end as a real subprocess (CPU, offline), as a user runs it: it builds its tiny
tool model (warmed up to call `multiply` for about half of its samples), then the tool loop and the environment
(`rollout_func`) loop each train with score centering, and each learns: the reward starts below its ceiling, with
groups whose rewards differ, and rises as the model learns to call the tool."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from trainer_helpers import python_command

REPO = Path(__file__).resolve().parents[1]
STEP = re.compile(r"^\[(tools|rollout)\] step (\d+): (.*)$", re.M)


def _steps(stdout, loop):
    """The logged metrics of `loop`, one dict per step, in order."""
    rows = []
    for name, _step, metrics in STEP.findall(stdout):
        if name == loop:
            rows.append({k: float(v) for k, v in (item.split("=") for item in metrics.split(", "))})
    return rows


@pytest.mark.slow
def test_multi_turn_example_learns_in_both_loops(tmp_path):
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", WANDB_MODE="offline")
    env.pop("CUDA_VISIBLE_DEVICES", None)
    cmd = python_command(str(REPO / "examples" / "multi_turn.py"), "--model_dir", str(tmp_path / "model"),
                         "--output_dir", str(tmp_path / "out"))  # the defaults: both loops, 6 steps each
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    for loop in ("tools", "rollout"):
        steps = _steps(proc.stdout, loop)
        assert len(steps) == 6, proc.stdout[-3000:]
        rewards = [s["reward"] for s in steps]
        # Below the ceiling at the start, with signal: some groups have differing rewards (non-zero advantages).
        assert rewards[0] < 0.8 and steps[0]["frac_reward_zero_std"] < 1, (loop, steps[0])
        # And it learns: the last two steps beat the first two by a margin (about 0.25-0.3 when measured).
        assert sum(rewards[-2:]) / 2 >= sum(rewards[:2]) / 2 + 0.15, (loop, rewards)
        assert "score_centering/sampler_head_mass" in steps[0], steps[0]
    calls = [s["tools/call_frequency"] for s in _steps(proc.stdout, "tools")]
    assert calls[-1] > calls[0], calls  # TRL's tool loop ran the tool, more often as it learned


def test_multi_turn_example_help_runs_as_in_the_readme():
    """The README's `python examples/multi_turn.py --help`, as written."""
    readme = (REPO / "README.md").read_text()
    assert "`python examples/multi_turn.py --help`" in readme
    proc = subprocess.run([sys.executable, "examples/multi_turn.py", "--help"], cwd=REPO, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0 and "--model_name_or_path" in proc.stdout, proc.stderr[-2000:]
