"""Graceful preemption (`trl_rpp.faults.preemption`): real signals to a running training process, with one process and with
two (`accelerate launch`, gloo on CPU). The process finishes its optimizer step, saves a complete checkpoint and exits
with status 75; resuming from that checkpoint gives the uninterrupted run's per-step numbers exactly."""

import json
import os
import signal
import subprocess
import time

import pytest

from trainer_helpers import assert_launch_finished, make_args, resume_command, script_env
from trl_rpp import RPPConfig, RPPTrainer
from trl_rpp.faults.checkpoint import ResumeLayout, checkpoint_problem, required_files
from trl_rpp.faults.preemption import PREEMPTED_EXIT_CODE, TrainingPreempted, parse_preemption_signals
from trl_rpp.testing.tiny import copy_first_char_reward, copy_task_dataset

ENV = script_env()
# steps_per_generation=2: generations at steps 1, 3, 5, 7, so a stop at step 3 or 5 falls inside a generation batch
# and its checkpoint must carry the buffered batch; a regular checkpoint every 3 steps.
SPG = ("--steps_per_generation", "2")


def ended(run, out_dir, processes):
    """The run trained to its end: one process exits 0 (the script's own status); under `accelerate launch` both
    processes reach the script's end (the launcher's status is torch elastic's: `assert_launch_finished`)."""
    if processes == 1:
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    else:
        assert_launch_finished(out_dir, run.returncode, run.stdout[-3000:] + run.stderr)


def per_step(log_history):
    """step -> every logged loss, reward and advantage statistic of that step (what test_resume.py compares, and
    the rest of the `advantages/*` and `rewards/*` keys)."""
    keep = ("loss", "reward", "reward_std", "advantages/", "rewards/", "returns/", "policy_loss", "ppo_kl")
    return {h["step"]: {k: v for k, v in h.items() if k.startswith(keep)} for h in log_history if "loss" in h}


def assert_same_numbers(resumed_run, reference_run):
    resumed, reference = per_step(resumed_run["log_history"]), per_step(reference_run["log_history"])
    assert sorted(resumed) == list(range(1, 9)), sorted(resumed)
    for step in resumed:
        assert resumed[step] == reference[step], (step, resumed[step], reference[step])
    assert any("advantages/mean" in v for v in resumed.values())


def wait_for(path, proc, timeout=300):
    deadline = time.time() + timeout
    while not os.path.exists(path):
        if proc.poll() is not None:
            pytest.fail(f"the run ended (status {proc.returncode}) before writing {path}\n{proc.stdout.read()[-4000:]}")
        assert time.time() < deadline, f"no {path} after {timeout} s"
        time.sleep(0.1)
    with open(path) as f:
        return int(f.read())


def finish(proc, timeout=300, workers=()):
    """Status and output of `proc`; on a hang, SIGKILL it and its `workers` (torch elastic starts each worker in a
    session of its own, and an orphan would hold the output pipe open) and fail."""
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        for pid in workers:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"no exit after {timeout} s\n{out[-4000:]}")
    return proc.returncode, out


def start(*args, processes=1):
    """The run to signal. One process starts cold, so that the process the test started is the one that trains
    and gets the signal, as under a scheduler; under `accelerate launch` each rank writes its pid."""
    return subprocess.Popen(resume_command(*args, processes=processes, warm=processes > 1), env=ENV,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)


def complete(folder, processes=1):
    """Every process's view of `folder` is complete (its buffer and RNG state included)."""
    for rank in range(processes):
        layout = ResumeLayout(rank, 1, 2, 1, required_files(rank, processes))
        assert checkpoint_problem(folder, layout) is None, (rank, checkpoint_problem(folder, layout))
    return True


def checkpoints(out_dir):
    return sorted(d for d in os.listdir(out_dir) if d.startswith("checkpoint-"))


def resume(model, out_dir, processes=1):
    run = subprocess.run(resume_command("--model", model, "--output_dir", out_dir, "--resume", *SPG,
                                        processes=processes), env=ENV, capture_output=True, text=True, timeout=900)
    ended(run, out_dir, processes)
    with open(os.path.join(out_dir, "log_history.json")) as f:
        return json.load(f)


@pytest.fixture(scope="session")
def model(tiny_model):
    return tiny_model


@pytest.fixture(scope="module")
def reference(uninterrupted_run):
    """resume_script.py's run with `SPG` (and its default estimator), which test_resume.py resumes to as well."""
    run = uninterrupted_run("reinforce_plus_plus", 2)
    assert run["steps_run_here"] == [1, 3, 5, 7]
    return run


# ----------------------------------------------------------------------------------------------------------------
# One process
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGUSR1], ids=["SIGTERM", "SIGUSR1"])
def test_signal_mid_step_finishes_the_step_saves_and_exits_75(tmp_path, model, reference, sig):
    """The signal lands inside step 5's reward computation (generation done, loss not yet computed): step 5 is
    finished, checkpoint-5 (inside the generation batch of steps 5-6, so with its buffer) is saved, the process
    exits with 75, and resuming trains step 6 on the saved batch and generates only at step 7."""
    out_dir = str(tmp_path / "run")
    os.makedirs(out_dir)
    proc = start("--model", model, "--output_dir", out_dir, "--wait_at", "5", *SPG)
    pid = wait_for(os.path.join(out_dir, "waiting_rank0"), proc)
    assert pid == proc.pid
    os.kill(pid, sig)
    status, out = finish(proc)
    assert status == PREEMPTED_EXIT_CODE, out[-4000:]
    assert checkpoints(out_dir) == ["checkpoint-3", "checkpoint-5"], out[-3000:]
    assert complete(os.path.join(out_dir, "checkpoint-5"))
    assert os.path.exists(os.path.join(out_dir, "checkpoint-5", "rpp_generation_buffer_rank0.pt"))
    assert not os.path.exists(os.path.join(out_dir, "log_history.json"))  # train() did not return
    name = sig.name
    assert f"trl_rpp: preemption: {name} received; optimizer step 5 is complete. Saving " in out, out[-3000:]
    assert f"{os.path.join(out_dir, 'checkpoint-5')} is saved; raising TrainingPreempted" in out, out[-3000:]
    with open(os.path.join(out_dir, "checkpoint-5", "trainer_state.json")) as f:
        state = json.load(f)
    assert state["global_step"] == 5 and state["log_history"][-1]["step"] == 5  # step 5 was logged before the save

    resumed = resume(model, out_dir)
    assert resumed["steps_run_here"] == [7]  # step 6 trained on checkpoint-5's buffered batch
    assert_same_numbers(resumed, reference)


@pytest.mark.slow
def test_a_second_signal_during_the_save_is_ignored(tmp_path, model, reference):
    """SLURM's order: SIGUSR1 ahead of the limit, then SIGTERM. The SIGTERM arrives while checkpoint-5 is being
    written (model and optimizer on disk, RNG state and trainer_state.json not yet): it is logged and ignored, and
    the checkpoint is completed."""
    out_dir = str(tmp_path / "run")
    os.makedirs(out_dir)
    proc = start("--model", model, "--output_dir", out_dir, "--wait_at", "5", "--pause_at", "rng_start",
                 "--pause_step", "5", "--wait_signals", "2", *SPG)
    os.kill(wait_for(os.path.join(out_dir, "waiting_rank0"), proc), signal.SIGUSR1)
    pid = wait_for(os.path.join(out_dir, "paused_rank0"), proc)
    files = sorted(os.listdir(os.path.join(out_dir, "checkpoint-5")))
    assert "model.safetensors" in files and "trainer_state.json" not in files, files  # the kill lands mid-save
    os.kill(pid, signal.SIGTERM)
    status, out = finish(proc)
    assert status == PREEMPTED_EXIT_CODE, out[-4000:]
    assert "preemption: SIGUSR1 received; optimizer step 5 is complete" in out, out[-3000:]
    assert "process 0 ignored SIGTERM, received while stopping for preemption" in out, out[-3000:]
    assert checkpoints(out_dir) == ["checkpoint-3", "checkpoint-5"] and complete(os.path.join(out_dir, "checkpoint-5"))
    assert_same_numbers(resume(model, out_dir), reference)


@pytest.mark.slow
def test_a_signal_during_a_regular_save_stops_right_after_it(tmp_path, model, reference):
    """The signal arrives while the regular checkpoint-3 is being written: the save finishes, and the run stops
    there with that checkpoint instead of training one more step."""
    out_dir = str(tmp_path / "run")
    os.makedirs(out_dir)
    proc = start("--model", model, "--output_dir", out_dir, "--pause_at", "rng_start", "--pause_step", "3", *SPG)
    os.kill(wait_for(os.path.join(out_dir, "paused_rank0"), proc), signal.SIGTERM)
    status, out = finish(proc)
    assert status == PREEMPTED_EXIT_CODE, out[-4000:]
    checkpoint3 = os.path.join(out_dir, "checkpoint-3")
    assert f"SIGTERM received; optimizer step 3 is complete. {checkpoint3} was just saved and stopping" in out, out
    assert checkpoints(out_dir) == ["checkpoint-3"] and complete(checkpoint3)
    resumed = resume(model, out_dir)
    assert resumed["steps_run_here"] == [5, 7]  # step 4 trained on checkpoint-3's buffered batch
    assert_same_numbers(resumed, reference)


# ----------------------------------------------------------------------------------------------------------------
# Two processes (accelerate launch, gloo on CPU)
# ----------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def reference_2proc(model, tmp_path_factory):
    full = str(tmp_path_factory.mktemp("preempt_full_2proc"))
    run = subprocess.run(resume_command("--model", model, "--output_dir", full, *SPG, processes=2), env=ENV,
                         capture_output=True, text=True, timeout=900)
    ended(run, full, 2)
    with open(os.path.join(full, "log_history.json")) as f:
        history = json.load(f)
    assert history["steps_run_here"] == [1, 3, 5, 7]
    return history


@pytest.mark.slow
@pytest.mark.parametrize("target", ["one_rank", "launcher"])
def test_two_processes_agree_on_the_step_and_resume_exactly(tmp_path, model, reference_2proc, target):
    """`one_rank`: only rank 1 gets SIGTERM (as when a scheduler signals one task, or one node is preempted). Rank 0
    never sees a signal, yet both finish step 5 and save the same checkpoint-5: the decision is the maximum of the
    processes' flags, taken with the loss metrics' gather. `launcher`: SIGTERM to the `accelerate launch` process
    (as Kubernetes sends it to a container's first process), which forwards it to every worker. What is asserted is
    what trl_rpp promises, from each worker's own record: every rank stopped after the same step with the same saved
    checkpoint, and the resume is exact. The launcher's exit status and log lines are torch elastic's and change
    between accelerate releases (1 under accelerate 1.15, 143 under 1.16), so they are not asserted."""
    out_dir = str(tmp_path / "run")
    os.makedirs(out_dir)
    proc = start("--model", model, "--output_dir", out_dir, "--wait_at", "5", *SPG, processes=2)
    pids = [wait_for(os.path.join(out_dir, f"waiting_rank{r}"), proc) for r in range(2)]
    if target == "one_rank":
        os.kill(pids[1], signal.SIGTERM)
        open(os.path.join(out_dir, "release"), "w").close()  # rank 0 goes on without a signal of its own
    else:
        os.kill(proc.pid, signal.SIGTERM)
    _, out = finish(proc, workers=pids)
    checkpoint5 = os.path.join(out_dir, "checkpoint-5")
    stops = []
    for rank in range(2):
        record = os.path.join(out_dir, f"preempted_rank{rank}.json")
        assert os.path.exists(record), (rank, out[-4000:])  # the rank raised TrainingPreempted, nothing else
        with open(record) as f:
            stops.append(json.load(f))
    assert stops == [dict(signal="SIGTERM", step=5, checkpoint=checkpoint5, global_step=5)] * 2, stops
    assert checkpoints(out_dir) == ["checkpoint-3", "checkpoint-5"], out[-4000:]
    assert complete(checkpoint5, processes=2)
    assert not os.path.exists(os.path.join(out_dir, "log_history.json"))  # train() returned on no rank
    assert "trl_rpp: preemption: SIGTERM received; optimizer step 5 is complete" in out, out[-4000:]
    assert f"{checkpoint5} is saved; raising TrainingPreempted" in out, out[-4000:]
    resumed = resume(model, out_dir, processes=2)
    assert resumed["steps_run_here"] == [7]
    assert_same_numbers(resumed, reference_2proc)


# ----------------------------------------------------------------------------------------------------------------
# In-process: handlers installed only while training, previous ones restored, and the config field
# ----------------------------------------------------------------------------------------------------------------


def _trainer(tmp_path, tiny_model, **kw):
    args = make_args(tmp_path, "reinforce_plus_plus", gradient_accumulation_steps=1, steps_per_generation=1,
                     reward_weights=None, max_steps=3, **kw)
    return RPPTrainer(model=tiny_model, reward_funcs=copy_first_char_reward, args=args,
                      train_dataset=copy_task_dataset(64))


def _send_at_step(step, sig, when="on_step_begin"):
    from transformers import TrainerCallback

    class Send(TrainerCallback):
        def __init__(self):
            self.sent = False

        def _maybe(self, state):
            if state.global_step + (1 if when == "on_step_begin" else 0) == step and not self.sent:
                self.sent = True
                os.kill(os.getpid(), sig)

        def on_step_begin(self, args, state, control, **kw):
            if when == "on_step_begin":
                self._maybe(state)

        def on_train_end(self, args, state, control, **kw):
            if when == "on_train_end":
                self._maybe(state)

    return Send()


def test_in_process_sigterm_raises_training_preempted_and_restores_the_handler(tmp_path, tiny_model):
    seen = []

    def mine(signum, frame):
        seen.append(signum)

    previous = signal.signal(signal.SIGTERM, mine)
    try:
        trainer = _trainer(tmp_path, tiny_model)
        trainer.add_callback(_send_at_step(2, signal.SIGTERM))
        try:
            trainer.train()
        except Exception as caught:  # what a notebook, a sweep driver or a Ray task catches: not a SystemExit
            err = caught
        assert isinstance(err, TrainingPreempted) and not isinstance(err, SystemExit)
        assert err.exit_code == PREEMPTED_EXIT_CODE and str(err).endswith("checkpoint-2 is saved")
        assert err.step == 2 and err.signal_name == "SIGTERM"
        assert err.checkpoint == os.path.join(trainer.args.output_dir, "checkpoint-2")
        assert checkpoints(trainer.args.output_dir) == ["checkpoint-2"]  # save_strategy="no": the preemption's only
        assert trainer.state.global_step == 2 and seen == []  # our handler had it, not the previous one
        assert signal.getsignal(signal.SIGTERM) is mine  # restored
        os.kill(os.getpid(), signal.SIGTERM)
        assert seen == [signal.SIGTERM]
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_a_signal_after_the_last_step_goes_to_the_previous_handler(tmp_path, tiny_model):
    """Nothing is left to save once the last step is done: the signal is delivered again to the handler that was
    there before train(), once it is restored, and train() returns normally."""
    seen = []
    previous = signal.signal(signal.SIGUSR1, lambda s, f: seen.append(s))
    try:
        trainer = _trainer(tmp_path, tiny_model)
        trainer.add_callback(_send_at_step(3, signal.SIGUSR1, when="on_train_end"))
        trainer.train()
        assert trainer.state.global_step == 3 and seen == [signal.SIGUSR1]
        assert not os.path.exists(trainer.args.output_dir) or not checkpoints(trainer.args.output_dir)
    finally:
        signal.signal(signal.SIGUSR1, previous)


def test_empty_preemption_signals_leave_signals_alone(tmp_path, tiny_model):
    seen = []
    previous = signal.signal(signal.SIGUSR1, lambda s, f: seen.append(s))
    try:
        trainer = _trainer(tmp_path, tiny_model, preemption_signals="")
        trainer.add_callback(_send_at_step(2, signal.SIGUSR1))
        trainer.train()
        assert trainer.state.global_step == 3 and seen == [signal.SIGUSR1]
    finally:
        signal.signal(signal.SIGUSR1, previous)


@pytest.mark.parametrize("value,names", [("SIGTERM,SIGUSR1", ("SIGTERM", "SIGUSR1")), (" SIGUSR2 ", ("SIGUSR2",)),
                                         ("", ())])
def test_preemption_signals_parse(value, names):
    assert parse_preemption_signals(value) == names


@pytest.mark.parametrize("value", ["SIGKILL", "SIGTERM,SIGTERM", "sigterm", "SIGTERM,", ["SIGTERM"], None, "SIGINT"])
def test_preemption_signals_reject_naming_the_field(value):
    with pytest.raises(ValueError, match=r"^preemption_signals=.* is not supported; accepted: a comma-separated"):
        RPPConfig(output_dir="unused", use_cpu=True, bf16=False, report_to="none", preemption_signals=value)
