"""Interrupted runs lose nothing: SIGKILL in the middle of a step, resume from the last checkpoint, and the logged
per-step rewards and losses equal those of an uninterrupted run from that checkpoint on (CPU, fixed seed)."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from trl_rpp.testing.tiny import build_tiny_model

HERE = os.path.dirname(os.path.abspath(__file__))
ENV = dict(os.environ, HF_HUB_OFFLINE="1", WANDB_MODE="offline", OMP_NUM_THREADS="1")


def script(*args):
    return [sys.executable, os.path.join(HERE, "resume_script.py"), *args]


def per_step(log_history):
    """step -> (loss, reward, raw advantage mean); the last two are logged only on steps that generate."""
    return {h["step"]: (h["loss"], h.get("reward"), h.get("advantages/raw_mean")) for h in log_history if "loss" in h}


@pytest.mark.slow
@pytest.mark.parametrize(
    "estimator,steps_per_generation",
    [("reinforce_plus_plus", 1), ("reinforce_plus_plus_baseline", 1), ("reinforce_plus_plus", 2)],
)
def test_sigkill_mid_step_then_resume_matches_uninterrupted(tmp_path, estimator, steps_per_generation):
    """With steps_per_generation=2 the checkpoint at step 3 falls inside a generation batch (steps 3-4 share one):
    the batch is saved with the checkpoint and step 4 trains on it after the resume, as it would have."""
    model = build_tiny_model(tmp_path / "model")
    full, broken = str(tmp_path / "full"), str(tmp_path / "broken")
    spg = ("--steps_per_generation", str(steps_per_generation))
    os.makedirs(broken)
    subprocess.run(script("--model", model, "--output_dir", full, "--estimator", estimator, *spg), env=ENV, check=True,
                   capture_output=True, timeout=600)

    proc = subprocess.Popen(script("--model", model, "--output_dir", broken, "--estimator", estimator, "--hang_at", "5", *spg),
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

    out = subprocess.run(script("--model", model, "--output_dir", broken, "--estimator", estimator, "--resume", *spg),
                         env=ENV, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    resumed_run = json.load(open(os.path.join(broken, "log_history.json")))
    reference_run = json.load(open(os.path.join(full, "log_history.json")))
    # Reward calls happen once per generation: every step, or steps 1, 3, 5, 7 with steps_per_generation=2.
    generated = list(range(1, 9, steps_per_generation))
    assert reference_run["steps_run_here"] == generated
    # Continued from checkpoint-3 and finished; with a saved buffer, step 4 reuses it instead of generating.
    assert resumed_run["steps_run_here"] == [s for s in generated if s >= 4]
    resumed, reference = per_step(resumed_run["log_history"]), per_step(reference_run["log_history"])
    assert sorted(resumed) == list(range(1, 9))  # steps 1-3 come back with the checkpoint's trainer state
    for step in resumed:
        assert resumed[step] == reference[step], (step, resumed[step], reference[step])
