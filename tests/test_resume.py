"""Interrupted runs lose nothing: SIGKILL in the middle of a step, resume from the last checkpoint, and the logged
per-step rewards and losses equal those of an uninterrupted run from that checkpoint on (CPU, fixed seed)."""

import json
import os
import signal
import subprocess
import time

import pytest

from trainer_helpers import resume_command, script_env
from trl_rpp.faults.checkpoint import (
    DamagedCheckpointError, ResumeLayout, checkpoint_problem, newest_complete_checkpoint, required_files,
)

ENV = script_env()


def per_step(log_history):
    """step -> (loss, reward, raw advantage mean); the last two are logged only on steps that generate."""
    return {h["step"]: (h["loss"], h.get("reward"), h.get("advantages/raw_mean")) for h in log_history if "loss" in h}


@pytest.mark.slow
@pytest.mark.parametrize(
    "estimator,steps_per_generation",
    [("reinforce_plus_plus", 1), ("reinforce_plus_plus_baseline", 1), ("reinforce_plus_plus", 2)],
)
def test_sigkill_mid_step_then_resume_matches_uninterrupted(tmp_path, tiny_model, uninterrupted_run, estimator,
                                                           steps_per_generation):
    """With steps_per_generation=2 the checkpoint at step 3 falls inside a generation batch (steps 3-4 share one):
    the batch is saved with the checkpoint and step 4 trains on it after the resume, as it would have. The
    uninterrupted run is tests/conftest.py's `uninterrupted_run`, shared with test_preemption.py."""
    model = tiny_model
    broken = str(tmp_path / "broken")
    spg = ("--steps_per_generation", str(steps_per_generation))
    os.makedirs(broken)

    proc = subprocess.Popen(resume_command("--model", model, "--output_dir", broken, "--estimator", estimator,
                                           "--hang_at", "5", *spg),
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

    out = subprocess.run(resume_command("--model", model, "--output_dir", broken, "--estimator", estimator, "--resume",
                                        *spg), env=ENV, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    resumed_run = json.load(open(os.path.join(broken, "log_history.json")))
    reference_run = uninterrupted_run(estimator, steps_per_generation)
    # Reward calls happen once per generation: every step, or steps 1, 3, 5, 7 with steps_per_generation=2.
    generated = list(range(1, 9, steps_per_generation))
    assert reference_run["steps_run_here"] == generated
    # Continued from checkpoint-3 and finished; with a saved buffer, step 4 reuses it instead of generating.
    assert resumed_run["steps_run_here"] == [s for s in generated if s >= 4]
    resumed, reference = per_step(resumed_run["log_history"]), per_step(reference_run["log_history"])
    assert sorted(resumed) == list(range(1, 9))  # steps 1-3 come back with the checkpoint's trainer state
    for step in resumed:
        assert resumed[step] == reference[step], (step, resumed[step], reference[step])


# ----------------------------------------------------------------------------------------------------------------
# A kill at any point of a checkpoint's write: resumed exactly, from the torn checkpoint's predecessor when it is
# incomplete (resume_from_checkpoint=True skips it, naming it), or refused with the damaged file named when it is
# named explicitly
# ----------------------------------------------------------------------------------------------------------------

# steps_per_generation=3, a checkpoint every 2 steps: generations at steps 1, 4, 7; checkpoint-2 and checkpoint-4 both
# fall inside a generation batch, so both need their buffered batch. The kill interrupts the write of checkpoint-4.
KILL_ARGS = ("--steps_per_generation", "3", "--save_steps", "2")
# point -> what resuming with resume_from_checkpoint=True gives right after the kill. Every point is killed for real and
# its folder judged in this process; a resume runs for one point of each outcome (RESUMED_POINTS): what follows the
# decision is the same run from the same checkpoint for every point with that outcome.
RESUMED_POINTS = ("buffer_half", "rotate_start")
KILL_CASES = {
    "buffer_start": "skipped",  # checkpoint-4/ holds only an empty temporary buffer file
    "buffer_half": "skipped",  # ... a half-written temporary buffer file
    "model_start": "skipped",  # ... only the complete buffer
    "rng_start": "skipped",  # ... buffer, model and optimizer, no trainer_state.json
    "state_half": "skipped",  # ... everything, with a half-written trainer_state.json
    "rotate_start": "resumed",  # ... everything: a complete checkpoint, resumed from step 4 with its buffer
}


@pytest.fixture(scope="module")
def kill_reference(tmp_path_factory, tiny_model):
    root = tmp_path_factory.mktemp("kill")
    model = tiny_model
    full = str(root / "full")
    subprocess.run(resume_command("--model", model, "--output_dir", full, *KILL_ARGS), env=ENV, check=True,
                   capture_output=True, timeout=600)
    reference = json.load(open(os.path.join(full, "log_history.json")))
    assert reference["steps_run_here"] == [1, 4, 7]
    return model, reference


@pytest.mark.slow
@pytest.mark.parametrize("point", list(KILL_CASES))
def test_sigkill_during_checkpoint_write(tmp_path, kill_reference, point):
    """A real SIGKILL at `point` of the write of checkpoint-4 (the process kills itself there, see
    tests/support/resume_script.py). Resuming with resume_from_checkpoint=True reproduces the uninterrupted run's per-step
    numbers exactly: from checkpoint-4 when it is complete, else from checkpoint-2, with a warning naming the torn
    checkpoint-4 and its file (so that a scheduler's automatic restart goes on instead of failing in a loop). Named
    explicitly, a torn checkpoint-4 is refused with a message that names the file and says what to do."""
    model, reference = kill_reference
    out_dir = str(tmp_path / "run")
    os.makedirs(out_dir)
    killed = subprocess.run(resume_command("--model", model, "--output_dir", out_dir, *KILL_ARGS, "--kill_at", point,
                                   "--kill_step", "4"), env=ENV, capture_output=True, text=True, timeout=600)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    checkpoint4 = os.path.join(out_dir, "checkpoint-4")
    files = sorted(os.listdir(checkpoint4))
    buffer = "rpp_generation_buffer_rank0.pt"
    if point in ("buffer_start", "buffer_half"):  # the kill hit where it was meant to
        assert files == [buffer + ".tmp"] and (os.path.getsize(os.path.join(checkpoint4, files[0])) > 0) == (
            point == "buffer_half"), files
    else:
        assert buffer in files and ("trainer_state.json" in files) == (point in ("state_half", "rotate_start")), files

    # The decision, made here on the killed folder as RPPTrainer.train makes it (resolve_resume_checkpoint) for a run
    # of KILL_ARGS on one process: skip the torn checkpoint-4, naming it, or resume it; named explicitly, refuse it
    # with a message that names the file and says what to do.
    layout = ResumeLayout(0, 1, 3, 1, required_files(0, 1))
    chosen, skipped = newest_complete_checkpoint(out_dir, layout)
    named = checkpoint_problem(checkpoint4, layout)
    if KILL_CASES[point] == "skipped":
        assert chosen == os.path.join(out_dir, "checkpoint-2"), chosen
        assert [(folder, problem.path) for folder, problem in skipped] == [
            (checkpoint4, os.path.join(checkpoint4, "trainer_state.json"))]
        assert isinstance(named, DamagedCheckpointError) and named.path == os.path.join(checkpoint4, "trainer_state.json")
        assert f"Delete the folder {checkpoint4} and resume again" in str(named), str(named)
    else:
        assert chosen == checkpoint4 and skipped == [] and named is None
    if point not in RESUMED_POINTS:
        return
    # The run itself: a named torn checkpoint-4 is refused, and resume_from_checkpoint=True resumes exactly.
    if KILL_CASES[point] == "skipped":
        refused = subprocess.run(resume_command("--model", model, "--output_dir", out_dir, *KILL_ARGS, "--resume_from",
                                        checkpoint4), env=ENV, capture_output=True, text=True, timeout=600)
        assert refused.returncode != 0
        error = refused.stderr.strip().splitlines()[-1]
        assert error.startswith("trl_rpp.faults.checkpoint.DamagedCheckpointError: "), refused.stderr[-3000:]
        assert os.path.join(checkpoint4, "trainer_state.json") in error, error
        assert f"Delete the folder {checkpoint4} and resume again" in error, error
    resume = resume_command("--model", model, "--output_dir", out_dir, *KILL_ARGS, "--resume")
    out = subprocess.run(resume, env=ENV, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    skipped = f"trl_rpp: resume_from_checkpoint=True skips {checkpoint4}, which is incomplete: " + os.path.join(
        checkpoint4, "trainer_state.json")
    if KILL_CASES[point] == "skipped":
        assert skipped in out.stderr, out.stderr[-3000:]
        assert f"Resuming from {os.path.join(out_dir, 'checkpoint-2')} instead." in out.stderr, out.stderr[-3000:]
        resumed_from, generated = 2, [4, 7]  # step 3 trains on checkpoint-2's buffered batch
    else:
        assert "skips" not in out.stderr, out.stderr[-3000:]
        resumed_from, generated = 4, [7]  # steps 5 and 6 train on checkpoint-4's buffered batch
    resumed_run = json.load(open(os.path.join(out_dir, "log_history.json")))
    assert resumed_run["steps_run_here"] == generated, resumed_from
    resumed, expected = per_step(resumed_run["log_history"]), per_step(reference["log_history"])
    assert sorted(resumed) == list(range(1, 9))
    for step in resumed:
        assert resumed[step] == expected[step], (step, resumed[step], expected[step])
