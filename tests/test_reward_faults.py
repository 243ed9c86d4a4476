"""Reward functions that raise or hang (`reward_errors`, `reward_timeout`; `trl_rpp.faults.rewards`): real exceptions,
real hangs (`time.sleep`, `asyncio.sleep`), in one process here and in two processes in
`test_one_process_failing_never_leaves_the_other_waiting`."""

import asyncio
import math
import os
import signal
import subprocess
import threading
import time

import pytest
import torch

from trainer_helpers import LAUNCH_ENV, CaptureTrainer, assert_launch_finished, launch_command, length_reward, make_args
from trl_rpp import RPPConfig
from trl_rpp.faults.rewards import RewardFunctionError, _TimedOut, call_in_thread
from trl_rpp.testing.tiny import copy_task_dataset

HERE = os.path.dirname(os.path.abspath(__file__))
CPU = dict(output_dir="/tmp/trl_rpp_reward_faults", report_to="none", use_cpu=True, bf16=False)
LIMIT = 0.3  # seconds: the reward_timeout of these tests
HANG = 60.0  # seconds a hung call sleeps: far past the limit, and far longer than a step takes on a loaded machine
# One reward call per optimizer step (one micro-batch per generation batch of 4 completions, one group).
ONE_CALL_PER_STEP = dict(per_device_train_batch_size=4, num_generations=4, gradient_accumulation_steps=1,
                         steps_per_generation=1, reward_weights=None)  # fmt: skip


def build(tmp_path, tiny_model, reward_funcs, **kw):
    kw = {**ONE_CALL_PER_STEP, "max_steps": 3, **kw}
    args = make_args(tmp_path, "reinforce_plus_plus", **kw)
    return CaptureTrainer(model=tiny_model, reward_funcs=reward_funcs, args=args, train_dataset=copy_task_dataset(32))


def judge_failing_on(call, fault):
    """A judge-like reward function that runs `fault()` on its `call`-th call (1-based), else scores the copy task.
    `judge.calls` records when each call started."""

    def judge(prompts, completions, **kw):
        judge.calls.append(time.monotonic())
        if len(judge.calls) == call:
            fault()
        return [float(c[:1] == p[:1]) for p, c in zip(prompts, completions)]

    judge.calls = []
    return judge


def async_judge_failing_on(call, fault):
    """The async form: `await fault()` on its `call`-th call."""

    async def judge(prompts, completions, **kw):
        judge.calls.append(time.monotonic())
        if len(judge.calls) == call:
            await fault()
        return [float(c[:1] == p[:1]) for p, c in zip(prompts, completions)]

    judge.calls = []
    return judge


def per_step(trainer, key):
    return [h.get(key, "absent") for h in trainer.state.log_history if "loss" in h]


# --- reward_errors="raise" (the default) ---------------------------------------------------------------------------


def test_a_raising_function_names_itself_the_step_and_the_exception(tmp_path, tiny_model):
    """A judge whose client times out on its second call: the run stops at step 2 with an error that names the
    function, the step and the exception, chained to the very exception the function raised."""
    raised = TimeoutError("judge server: read timed out")

    def fault():
        raise raised

    judge = judge_failing_on(2, fault)
    trainer = build(tmp_path, tiny_model, judge)
    with pytest.raises(RewardFunctionError) as err:
        trainer.train()
    assert str(err.value).startswith(
        "reward function 'judge' raised TimeoutError('judge server: read timed out') at training step 2. "
        "reward_errors='raise' stops the run"
    ), str(err.value)
    assert err.value.__cause__ is raised
    assert (err.value.func_name, err.value.kind, err.value.step, err.value.mode) == ("judge", "error", 2, "train")
    assert len(judge.calls) == 2 and trainer.state.global_step == 1


@pytest.mark.parametrize("form", ["sync", "async"])
def test_a_hung_function_raises_a_named_timeout_after_the_limit(tmp_path, tiny_model, form):
    if form == "sync":
        judge = judge_failing_on(2, lambda: time.sleep(HANG))
    else:
        judge = async_judge_failing_on(2, lambda: asyncio.sleep(HANG))
    trainer = build(tmp_path, tiny_model, judge, reward_timeout=LIMIT)
    with pytest.raises(RewardFunctionError) as err:
        trainer.train()
    waited = time.monotonic() - judge.calls[1]
    assert str(err.value).startswith(
        f"reward function 'judge' timed out (no result within reward_timeout={LIMIT} s) at training step 2. "
    ), str(err.value)
    assert str(err.value).endswith(", or raise reward_timeout.")
    assert isinstance(err.value.__cause__, TimeoutError) and err.value.kind == "timeout"
    assert LIMIT <= waited < HANG / 2, waited  # stopped waiting at the limit, not when the call returned


# --- reward_errors="unscorable" ------------------------------------------------------------------------------------


def test_unscorable_a_raising_call_is_none_for_its_rows_and_is_counted(tmp_path, tiny_model):
    """With a second reward function the rows stay scorable through it; the judge's own TimeoutError (raised in the
    worker thread that `reward_timeout` starts) is an error, not a timeout."""

    def fault():
        raise TimeoutError("judge server: read timed out")

    judge = judge_failing_on(2, fault)
    trainer = build(tmp_path, tiny_model, [judge, length_reward], reward_errors="unscorable", reward_timeout=5.0,
                    reward_weights=[1.0, 0.5])
    with pytest.warns(RuntimeWarning, match=r"reward function 'judge' raised TimeoutError\('judge server: read timed "
                      r"out'\) at training step 2; reward_errors='unscorable': the rows of this call are unscorable"):
        trainer.train()
    assert trainer.state.global_step == 3 and len(judge.calls) == 3
    judged = [r[:, 0] for r in trainer.captured_rewards]
    assert torch.isnan(judged[1]).all() and torch.isfinite(judged[0]).all() and torch.isfinite(judged[2]).all()
    assert all(torch.isfinite(r[:, 1]).all() for r in trainer.captured_rewards)
    assert per_step(trainer, "rewards/judge/errors") == [0.0, 1.0, 0.0]
    assert per_step(trainer, "rewards/judge/timeouts") == [0.0, 0.0, 0.0]
    assert per_step(trainer, "rewards/length_reward/errors") == [0.0, 0.0, 0.0]
    assert per_step(trainer, "rewards/judge/mean")[1] is None  # TRL's mean over no scored row
    for inputs in trainer.loss_inputs:
        assert torch.isfinite(inputs["advantages"]).all()


def test_unscorable_a_hung_sync_call_times_out_and_keeps_running_in_the_background(tmp_path, tiny_model):
    """The only reward function hangs at step 2: that step is a zero-advantage step (every row unscorable), the run
    goes on without waiting for the call, and the hung call is still running, in a daemon thread, afterwards."""
    judge = judge_failing_on(2, lambda: time.sleep(HANG))
    trainer = build(tmp_path, tiny_model, judge, reward_errors="unscorable", reward_timeout=LIMIT)
    with pytest.warns(RuntimeWarning, match=r"reward function 'judge' timed out \(no result within "
                      rf"reward_timeout={LIMIT} s\) at training step 2; reward_errors='unscorable'"):
        trainer.train()
    assert trainer.state.global_step == 3
    assert LIMIT <= judge.calls[2] - judge.calls[1] < HANG / 2  # step 3 did not wait for the hung call
    hung = [t for t in threading.enumerate() if t.name == "trl_rpp-reward-judge"]
    assert hung and all(t.daemon and t.is_alive() for t in hung)
    assert per_step(trainer, "rewards/judge/timeouts") == [0.0, 1.0, 0.0]
    assert per_step(trainer, "rewards/judge/errors") == [0.0, 0.0, 0.0]
    assert per_step(trainer, "advantages/empty_batch") == [0.0, 1.0, 0.0]
    assert torch.isnan(trainer.captured_rewards[1]).all()
    mask = trainer.generation_batches[1]["rpp_mask"]  # REINFORCE++ here builds its returns in the loss
    assert not mask.any()


@pytest.mark.parametrize("hang", ["awaits", "blocks_the_loop"])
def test_unscorable_a_hung_async_call_times_out(tmp_path, tiny_model, hang):
    """An async judge that awaits past the limit is cancelled there; one that blocks TRL's event loop (`time.sleep`
    in `async def`) cannot be interrupted, and its late result counts as timed out when it arrives."""
    cancelled = []

    async def fault():
        if hang == "blocks_the_loop":
            time.sleep(3 * LIMIT)
            return
        try:
            await asyncio.sleep(HANG)
        except asyncio.CancelledError:
            cancelled.append(True)
            raise

    judge = async_judge_failing_on(2, fault)
    trainer = build(tmp_path, tiny_model, judge, reward_errors="unscorable", reward_timeout=LIMIT)
    why = "no result within" if hang == "awaits" else r"returned after \d+\.\d\d s, beyond"
    with pytest.warns(RuntimeWarning, match=rf"reward function 'judge' timed out \({why} reward_timeout={LIMIT} s"):
        trainer.train()
    assert trainer.state.global_step == 3
    assert per_step(trainer, "rewards/judge/timeouts") == [0.0, 1.0, 0.0]
    assert torch.isnan(trainer.captured_rewards[1]).all() and torch.isfinite(trainer.captured_rewards[2]).all()
    if hang == "awaits":
        assert cancelled == [True] and judge.calls[2] - judge.calls[1] < HANG / 2


def test_values_that_fail_the_checks_still_raise_under_unscorable(tmp_path, tiny_model):
    """`reward_errors` is about calls that raise or hang: a non-number is the function's bug and always raises."""
    def judge(prompts, completions, **kw):
        return ["0.5"] * len(completions)

    trainer = build(tmp_path, tiny_model, judge, reward_errors="unscorable", max_steps=1)
    with pytest.raises(ValueError, match=r"reward function 'judge' returned '0.5' of type str for row 0"):
        trainer.train()


# --- the worker thread and the config ------------------------------------------------------------------------------


def test_call_in_thread_returns_re_raises_or_stops_waiting():
    assert call_in_thread(lambda a, b=0: a + b, (1,), {"b": 2}, 5.0, "f") == 3
    boom = KeyError("k")

    def raises():
        raise boom

    with pytest.raises(KeyError) as err:
        call_in_thread(raises, (), {}, 5.0, "f")
    assert err.value is boom
    with torch.no_grad():  # grad mode is per thread in torch: the worker gets the caller's
        assert call_in_thread(torch.is_grad_enabled, (), {}, 5.0, "f") is False
    assert call_in_thread(torch.is_grad_enabled, (), {}, 5.0, "f") is True
    release = threading.Event()
    start = time.monotonic()
    with pytest.raises(_TimedOut):
        call_in_thread(release.wait, (), {}, LIMIT, "hung")
    assert LIMIT <= time.monotonic() - start < 3.0
    hung = [t for t in threading.enumerate() if t.name == "trl_rpp-reward-hung"]
    assert len(hung) == 1 and hung[0].daemon and hung[0].is_alive()
    release.set()
    deadline = time.monotonic() + 5.0
    while hung[0].name == "trl_rpp-reward-hung" and time.monotonic() < deadline:
        time.sleep(0.01)
    assert hung[0].name == "trl_rpp-reward-idle" and hung[0].is_alive()  # the worker is free for the next call


def test_a_judge_that_never_returns_takes_a_bounded_number_of_threads():
    """Many steps of a judge that never returns (released at the end): each call holds a worker until it returns, the
    threads never exceed `REWARD_WORKERS`, and once every worker is held the next call fails at once, saying so."""
    from trl_rpp.faults import rewards as reward_faults
    from trl_rpp.faults.rewards import REWARD_WORKERS, RewardFaults

    release = threading.Event()

    def judge(prompts, completions, **kw):
        release.wait()
        return [1.0] * len(completions)

    faults = RewardFaults(timeout=0.05, policy="unscorable")
    kwargs = dict(prompts=["a"], completions=["b"])
    free = REWARD_WORKERS - reward_faults._WORKERS.busy  # other tests' hung calls may still hold some
    try:
        times = []
        for _ in range(free + 3 * REWARD_WORKERS):
            start = time.monotonic()
            assert faults.call(judge, "judge", judge, (), kwargs, list) == [None]
            times.append(time.monotonic() - start)
            assert sum(t.name.startswith("trl_rpp-reward-") for t in threading.enumerate()) <= REWARD_WORKERS
        assert min(times[:free]) >= 0.05 and max(times[free:]) < 0.05  # waited the limit, then refused at once
        assert [f.kind for f in faults._failures] == ["timeout"] * len(times)
        assert str(faults._failures[-1].exception) == (
            f"not called: all {REWARD_WORKERS} reward worker threads still run calls that passed reward_timeout=0.05 s")
    finally:
        release.set()
    deadline = time.monotonic() + 5.0
    while reward_faults._WORKERS.busy > REWARD_WORKERS - free and time.monotonic() < deadline:
        time.sleep(0.01)
    assert faults.call(judge, "judge", judge, (), kwargs, list) == [1.0]  # released workers take calls again


def test_without_a_timeout_sync_functions_run_in_the_calling_thread(tmp_path, tiny_model):
    threads, names = [], []

    def judge(prompts, completions, **kw):
        threads.append(threading.current_thread())
        names.append(threading.current_thread().name)  # a worker is named after the call it runs, while it runs it
        return [0.0] * len(completions)

    build(tmp_path, tiny_model, judge, max_steps=1).train()
    build(tmp_path, tiny_model, judge, max_steps=1, reward_timeout=5.0).train()
    assert threads[0] is threading.current_thread() and names[1] == "trl_rpp-reward-judge"


@pytest.mark.parametrize("value", [0, 0.0, -1.0, math.nan, math.inf, True, "1"])
def test_bad_reward_timeout_is_rejected_naming_the_field(value):
    with pytest.raises(ValueError) as err:
        RPPConfig(**CPU, reward_timeout=value)
    assert str(err.value) == (
        f"reward_timeout={value!r} is not supported; accepted: None (no limit) or a finite float > 0, in seconds."
    )


def test_bad_reward_errors_is_rejected_naming_the_field():
    with pytest.raises(ValueError, match=r"^reward_errors='Raise' is not supported; accepted values are 'raise', "
                       r"'unscorable'\. Did you mean 'raise'\?$"):
        RPPConfig(**CPU, reward_errors="Raise")
    assert RPPConfig(**CPU).reward_errors == "raise" and RPPConfig(**CPU).reward_timeout is None
    assert RPPConfig(**CPU, reward_timeout=2).reward_timeout == 2


# --- two processes -------------------------------------------------------------------------------------------------


def test_one_process_failing_never_leaves_the_other_waiting(tmp_path, tiny_model):
    """Two CPU processes (gloo), one rank's reward function failing on one step only, in four runs in the same pair
    of processes (`tests/support/reward_faults_dist_script.py`): "raise" (rank 0 raises at step 2), "hang" (rank 1 hangs at
    step 1, reward_errors="raise"), "invalid" (rank 1 returns NaN at step 1), then "unscorable" (rank 0 raises at
    step 2, rank 1 hangs at step 3). Each of the first three stops both ranks with the same error; the last finishes
    on both, with the same counts logged. The later runs only work if no rank was left inside a collective. A
    deadlock fails the test at the time limit instead of hanging it."""
    env = dict(os.environ, **LAUNCH_ENV)
    cmd = launch_command(os.path.join(HERE, "support", "reward_faults_dist_script.py"), str(tmp_path), tiny_model)
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)  # fmt: skip
    try:
        out, _ = proc.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the launcher and both ranks it started
        out, _ = proc.communicate()
        pytest.fail("a rank was left waiting: the run did not end within 240 s\n" + out[-3000:])
    assert_launch_finished(tmp_path, proc.returncode, out)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]

    for run, (origin, step, kind) in {"raise": (0, 2, "error"), "hang": (1, 1, "timeout")}.items():
        errors = [r[run] for r in ranks]
        assert errors[0]["message"] == errors[1]["message"], errors
        assert errors[0]["type"] == errors[1]["type"] == "RewardFunctionError"
        assert [e["attrs"] for e in errors] == [("judge", kind, step, origin)] * 2
        assert f"at training step {step} on process {origin} of 2" in errors[0]["message"]
        assert [e["global_step"] for e in errors] == [step - 1] * 2
        # Chained on the rank where the call failed; the other rank has only the message.
        assert [e["cause"] for e in errors] == [
            ("ConnectionError" if kind == "error" else "TimeoutError") if r == origin else None for r in range(2)
        ]
    assert ranks[0]["raise"]["message"].startswith(
        "reward function 'judge' raised ConnectionError('judge unreachable') at training step 2 on process 0 of 2. ")
    assert ranks[0]["hang"]["message"].startswith(
        "reward function 'judge' timed out (no result within reward_timeout=1.0 s) at training step 1 on process 1")
    # The hung call sleeps 15 s: both ranks stopped at the limit, not when it returned.
    assert max(r["hang"]["raised_at"] for r in ranks) - ranks[1]["hang"]["fault_started"] < 7.5

    invalid = [r["invalid"] for r in ranks]
    assert invalid[0]["type"] == invalid[1]["type"] == "ValueError"
    assert invalid[0]["message"] == invalid[1]["message"]
    assert invalid[0]["message"].startswith("reward function 'judge' returned nan for row 0 of this batch")

    runs = [r["unscorable"] for r in ranks]
    for r in runs:
        assert r["global_step"] == 3
        assert r["errors"] == [0.0, 1.0, 0.0] and r["timeouts"] == [0.0, 0.0, 1.0]  # both ranks log the global counts
        assert torch.isnan(r["rewards"][1][:4]).all() and torch.isfinite(r["rewards"][1][4:]).all()  # rank 0's rows
        assert torch.isnan(r["rewards"][2][4:]).all() and torch.isfinite(r["rewards"][2][:4]).all()  # rank 1's rows
    assert torch.equal(runs[0]["advantages"][1], torch.zeros_like(runs[0]["advantages"][1]))
    assert torch.equal(runs[1]["advantages"][2], torch.zeros_like(runs[1]["advantages"][2]))
