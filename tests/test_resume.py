"""Interrupted runs lose nothing: SIGKILL in the middle of a step, resume from the last checkpoint, and the logged
per-step rewards and losses equal those of an uninterrupted run from that checkpoint on (CPU, fixed seed)."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from trl_rpp.tiny import build_tiny_model

HERE = os.path.dirname(os.path.abspath(__file__))
ENV = dict(os.environ, HF_HUB_OFFLINE="1", WANDB_MODE="offline", OMP_NUM_THREADS="1")


def script(*args):
    return [sys.executable, os.path.join(HERE, "resume_script.py"), *args]


def per_step(log_history):
    return {h["step"]: (h["reward"], h["loss"], h["advantages/raw_mean"]) for h in log_history if "loss" in h and "reward" in h}


@pytest.mark.slow
@pytest.mark.parametrize("estimator", ["reinforce_plus_plus", "reinforce_plus_plus_baseline"])
def test_sigkill_mid_step_then_resume_matches_uninterrupted(tmp_path, estimator):
    model = build_tiny_model(tmp_path / "model")
    full, broken = str(tmp_path / "full"), str(tmp_path / "broken")
    os.makedirs(broken)
    subprocess.run(script("--model", model, "--output_dir", full, "--estimator", estimator), env=ENV, check=True,
                   capture_output=True, timeout=600)

    proc = subprocess.Popen(script("--model", model, "--output_dir", broken, "--estimator", estimator, "--hang_at", "5"),
                            env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 300
    while not os.path.exists(os.path.join(broken, "hanging")):
        assert proc.poll() is None, "the run ended before reaching step 5"
        assert time.time() < deadline
        time.sleep(0.2)
    proc.send_signal(signal.SIGKILL)
    assert proc.wait(timeout=60) == -signal.SIGKILL
    assert sorted(d for d in os.listdir(broken) if d.startswith("checkpoint-")) == ["checkpoint-3"]
    assert not os.path.exists(os.path.join(broken, "log_history.json"))

    out = subprocess.run(script("--model", model, "--output_dir", broken, "--estimator", estimator, "--resume"),
                         env=ENV, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    resumed_run = json.load(open(os.path.join(broken, "log_history.json")))
    reference_run = json.load(open(os.path.join(full, "log_history.json")))
    assert resumed_run["steps_run_here"] == [4, 5, 6, 7, 8]  # continued from checkpoint-3 and finished
    assert reference_run["steps_run_here"] == list(range(1, 9))
    resumed, reference = per_step(resumed_run["log_history"]), per_step(reference_run["log_history"])
    assert sorted(resumed) == list(range(1, 9))  # steps 1-3 come back with the checkpoint's trainer state
    for step in resumed:
        assert resumed[step] == reference[step], (step, resumed[step], reference[step])
