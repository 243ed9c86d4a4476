"""Non-finite gradients (`trl_rpp.faults.gradients`): a step whose gradient norm is NaN or Inf is skipped on every process,
bit for bit, with a warning and a metric; too many in a row stop training with `NonFiniteGradientError`.

The fault is real: a forward hook makes the final hidden states infinite in one step's loss forward
(`grad_guard_script.InfHiddenStates`), so the loss, the backward and the gradient norm are NaN as they would be after
a bf16 overflow. Without the guard that step writes NaN into the weights (`test_without_the_guard_...`)."""

import math
import os
import warnings
from collections import defaultdict

import pytest
import torch
from accelerate.utils import DistributedType

from grad_guard_script import InfHiddenStates, Snapshots, identical, varied_reward
from trainer_helpers import make_args
from trl_rpp import RPPConfig, RPPTrainer
from trl_rpp.faults.gradients import (
    GradGuard, NonFiniteGradientError, as_float, consecutive_after, count_skipped, guard_applies,
)  # fmt: skip
from trl_rpp.testing.tiny import copy_task_dataset

HERE = os.path.dirname(os.path.abspath(__file__))
CPU = dict(output_dir="/tmp/trl_rpp_grad_guard_cfg", report_to="none", use_cpu=True, bf16=False)
SKIP_WARNING = "gradient norm before clipping"

# ----------------------------------------------------------------------------------------------------------------
# The decision, the metric and the one-shot skip, on their own
# ----------------------------------------------------------------------------------------------------------------


def test_consecutive_count_resets_on_a_finite_norm():
    counts, c = [], 0
    for norm in [1.0, math.nan, math.inf, -math.inf, 0.5, math.nan, 0.0]:
        c = consecutive_after(norm, c)
        counts.append(c)
    assert counts == [0, 1, 2, 3, 0, 1, 0]


def test_guard_skips_up_to_the_limit_then_raises_naming_the_steps():
    guard = GradGuard(limit=2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert [guard.observe(n, s) for n, s in [(1.0, 1), (math.nan, 2), (math.inf, 3)]] == [False, True, True]
        with pytest.raises(NonFiniteGradientError) as err:
            guard.observe(math.nan, 4)
    assert [str(w.message).split(":")[0] for w in caught] == [f"RPPTrainer (train, step {s})" for s in (2, 3)]
    assert all(w.category is RuntimeWarning for w in caught)
    assert "is inf on some process: the optimizer step was skipped on every process" in str(caught[1].message)
    message = str(err.value)
    assert message.startswith("RPPTrainer (train, step 4): the gradient norm before clipping was non-finite at 3 "
                              "optimizer step(s) in a row (steps 2 to 4; now nan), more than "
                              "max_consecutive_skipped_steps=2 allows.")  # fmt: skip
    assert "weights and optimizer state are those after step 1" in message
    assert guard.skipped == 2 and isinstance(err.value, RuntimeError)


def test_limit_zero_raises_at_the_first_non_finite_norm():
    guard = GradGuard(limit=0)
    assert guard.observe(3.0, 1) is False
    with pytest.raises(NonFiniteGradientError, match=r"\(step 1; now nan\).*those training started from"):
        GradGuard(limit=0).observe(math.nan, 1)


def test_guard_applies_except_under_deepspeed_or_a_grad_scaler():
    assert guard_applies(DistributedType.NO, False) and guard_applies(DistributedType.MULTI_CPU, False)
    assert guard_applies(DistributedType.FSDP, False) and guard_applies(DistributedType.MULTI_GPU, False)
    assert not guard_applies(DistributedType.DEEPSPEED, False)
    assert not guard_applies(DistributedType.MULTI_GPU, True) and not guard_applies(DistributedType.NO, True)


def test_skipped_steps_counts_the_steps_since_the_last_log():
    metrics = defaultdict(list)
    for skipped in [False, True, True]:
        count_skipped(metrics, skipped)
    assert metrics["skipped_steps"] == [2.0]
    metrics.clear()  # what TRL's `log` does after logging the mean of each list
    count_skipped(metrics, False)
    assert metrics["skipped_steps"] == [0.0]


def test_as_float_reads_tensors_and_floats():
    assert as_float(torch.tensor(2.5)) == 2.5 and math.isnan(as_float(torch.tensor(math.nan))) and as_float(1.5) == 1.5


def _adamw_with_state():
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(4))
    opt = torch.optim.AdamW([w], lr=0.1, weight_decay=0.1)
    w.grad = torch.randn(4)
    opt.step()  # moments are non-zero from here on
    return w, opt


def test_a_zero_gradient_adamw_step_moves_the_weights_so_the_gradients_must_be_none():
    """Why the guard drops the gradients (None) rather than zeroing them."""
    w, opt = _adamw_with_state()
    before = w.detach().clone()
    w.grad = torch.zeros(4)
    opt.step()
    assert not torch.equal(w.detach(), before)


OPTIMIZERS = {
    "AdamW": lambda p: torch.optim.AdamW(p, lr=0.1, weight_decay=0.1),
    "AdamW-foreach": lambda p: torch.optim.AdamW(p, lr=0.1, weight_decay=0.1, foreach=True),
    "Adam": lambda p: torch.optim.Adam(p, lr=0.1, weight_decay=0.1),
    "SGD": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, weight_decay=0.1),
    "RMSprop": lambda p: torch.optim.RMSprop(p, lr=0.1, momentum=0.9, weight_decay=0.1),
    "Adagrad": lambda p: torch.optim.Adagrad(p, lr=0.1, weight_decay=0.1),
    "Adafactor": lambda p: __import__("transformers").optimization.Adafactor(
        p, lr=0.1, relative_step=False, scale_parameter=False, weight_decay=0.1),
}


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_a_step_on_none_gradients_changes_nothing(name):
    """Why the guard needs no patch of `optimizer.step`: after `zero_grad(set_to_none=True)` the step Trainer runs
    leaves the weights and the optimizer state (moments, step counts) bit-identical."""
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(4, 3)), torch.nn.Parameter(torch.randn(3))]
    opt = OPTIMIZERS[name](params)
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()  # state is non-empty from here on
    before, state = [p.detach().clone() for p in params], _state(opt)
    assert state
    opt.zero_grad(set_to_none=True)
    opt.step()
    assert all(torch.equal(p.detach(), b) for p, b in zip(params, before)) and identical(_state(opt), state)


def _state(opt):
    return {k: {n: t.clone() if torch.is_tensor(t) else t for n, t in v.items()}
            for k, v in opt.state_dict()["state"].items()}


# ----------------------------------------------------------------------------------------------------------------
# The config field
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("value", [-1, 1.5, True, "3", None])
def test_bad_limits_are_rejected_naming_the_field(value):
    with pytest.raises(ValueError, match=rf"^max_consecutive_skipped_steps={value!r} is not supported; accepted: an "
                                         r"integer >= 0 \(0: stop at the first non-finite gradient"):  # fmt: skip
        RPPConfig(**CPU, max_consecutive_skipped_steps=value)


def test_limit_is_not_read_under_deepspeed_so_only_the_default_is_accepted():
    with pytest.raises(ValueError, match=r"^max_consecutive_skipped_steps=2 is not supported with deepspeed; "
                                         r"accepted: 5 \(its default\)"):  # fmt: skip
        RPPConfig(**CPU, deepspeed={"zero_optimization": {"stage": 2}}, max_consecutive_skipped_steps=2)
    assert RPPConfig(**CPU).max_consecutive_skipped_steps == 5
    assert RPPConfig(**CPU, max_consecutive_skipped_steps=0).max_consecutive_skipped_steps == 0


# ----------------------------------------------------------------------------------------------------------------
# One process: real training steps with the fault injected
# ----------------------------------------------------------------------------------------------------------------


def train_with_fault(tmp_path, tiny_model, steps, max_steps=5, guard=None, **kw):
    """Train the tiny model with infinite hidden states in the loss forward of `steps`; returns the trainer, the
    fault, the snapshots, the skip warnings and the error raised (or None)."""
    args = make_args(tmp_path, "reinforce_plus_plus_baseline", max_steps=max_steps, reward_weights=None, **kw)
    trainer = RPPTrainer(model=tiny_model, reward_funcs=varied_reward, args=args,
                         train_dataset=copy_task_dataset(64))  # fmt: skip
    if guard is not None:
        trainer._rpp_grad_guard = guard
    fault, snaps = InfHiddenStates(trainer, steps), Snapshots(trainer)
    trainer.add_callback(snaps)
    error = None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            trainer.train()
        except NonFiniteGradientError as e:
            error = e
    skips = [str(w.message) for w in caught if SKIP_WARNING in str(w.message)]
    lr_order = [str(w.message) for w in caught if "lr_scheduler.step()" in str(w.message)]
    assert not lr_order, lr_order  # torch's scheduler-order warning never fires, even when step 1 is skipped
    return trainer, fault, snaps, skips, error


def rows(trainer):
    return {h["step"]: h for h in trainer.state.log_history if "loss" in h}


def all_finite(trainer):
    return all(torch.isfinite(p).all() for p in trainer.model.parameters())


def test_without_the_guard_the_fault_makes_the_weights_nan(tmp_path, tiny_model):
    """The control: the guard switched off (as it is under DeepSpeed), the same fault reaches the optimizer."""
    trainer, fault, _, skips, _ = train_with_fault(tmp_path, tiny_model, [2], max_steps=2,
                                                   guard=GradGuard(limit=5, active=False))  # fmt: skip
    assert fault.fired == [2, 2] and not skips  # two micro-batches (gradient accumulation 2) at step 2
    assert math.isnan(rows(trainer)[2]["grad_norm"]) and not all_finite(trainer)
    assert "skipped_steps" not in rows(trainer)[2]


def test_a_non_finite_step_is_skipped_bit_for_bit_and_training_goes_on(tmp_path, tiny_model):
    trainer, fault, snaps, skips, error = train_with_fault(tmp_path, tiny_model, [3], max_steps=5)
    assert error is None and fault.fired == [3, 3]
    log = rows(trainer)
    assert sorted(log) == [1, 2, 3, 4, 5] and trainer.state.global_step == 5
    assert math.isnan(log[3]["grad_norm"]) and all(math.isfinite(log[s]["grad_norm"]) for s in (1, 2, 4, 5))
    # Skipped: the weights and the optimizer state (AdamW's moments and step counts) are bit-identical across step 3,
    # its gradients were dropped before the optimizer ran; every other step moved the weights.
    assert snaps.unchanged(3) == (True, True) and snaps.grads_dropped[3]
    for step in (1, 2, 4, 5):
        assert snaps.unchanged(step) == (False, False) and not snaps.grads_dropped[step], step
    assert snaps.before[3][1], "AdamW has moments before step 3: the comparison is not of empty states"
    # Warned once, naming the step; logged as skipped_steps at that step only.
    assert len(skips) == 1 and skips[0].startswith("RPPTrainer (train, step 3): the gradient norm before clipping "
                                                   "is nan on some process: the optimizer step was skipped")
    assert "1 step(s) in a row skipped; more than max_consecutive_skipped_steps=5" in skips[0]
    assert [log[s]["skipped_steps"] for s in range(1, 6)] == [0.0, 0.0, 1.0, 0.0, 0.0]
    # The skipped step counts as taken: the linear schedule decays through step 3 as through any other step.
    lr = trainer.args.learning_rate
    assert [log[s]["learning_rate"] for s in range(1, 6)] == pytest.approx([lr * (5 - k) / 5 for k in range(5)])
    assert all_finite(trainer)


def test_non_consecutive_skips_reset_the_count(tmp_path, tiny_model):
    """With a limit of 1, steps 1 and 3 are each one skip in a row. Step 1 is skipped before AdamW has any state (and
    before the scheduler's first step); without clipping (`max_grad_norm=0`) Trainer computes the norm itself."""
    trainer, _, snaps, skips, error = train_with_fault(tmp_path, tiny_model, [1, 3], max_steps=4,
                                                       max_consecutive_skipped_steps=1, max_grad_norm=0.0)  # fmt: skip
    assert error is None and trainer.state.global_step == 4
    assert [s.split(":")[0] for s in skips] == ["RPPTrainer (train, step 1)", "RPPTrainer (train, step 3)"]
    assert snaps.unchanged(1) == (True, True) and not snaps.after[1][1]  # still no AdamW state
    assert snaps.unchanged(3) == (True, True)
    assert snaps.unchanged(2) == (False, False) and snaps.unchanged(4) == (False, False)
    assert [rows(trainer)[s]["skipped_steps"] for s in range(1, 5)] == [1.0, 0.0, 1.0, 0.0]
    assert all_finite(trainer)


def test_too_many_consecutive_skips_stop_training_with_the_named_error(tmp_path, tiny_model):
    trainer, _, snaps, skips, error = train_with_fault(tmp_path, tiny_model, [2, 3, 4], max_steps=6,
                                                       max_consecutive_skipped_steps=2)  # fmt: skip
    assert [s.split(":")[0] for s in skips] == ["RPPTrainer (train, step 2)", "RPPTrainer (train, step 3)"]
    assert error is not None and str(error).startswith(
        "RPPTrainer (train, step 4): the gradient norm before clipping was non-finite at 3 optimizer step(s) in a row "
        "(steps 2 to 4; now nan), more than max_consecutive_skipped_steps=2 allows. Training stopped before step 4 "
        "was applied: the weights and optimizer state are those after step 1."
    )
    assert trainer.state.global_step == 3  # steps 2 and 3 were taken (skipped); step 4 never finished
    # The weights in memory are those after step 1: finite, and untouched by steps 2 to 4.
    params_after_1 = snaps.after[1][0]
    assert all(identical(p.detach(), params_after_1[n]) for n, p in trainer.model.named_parameters())
    assert all_finite(trainer)


def test_limit_zero_stops_at_the_first_non_finite_step(tmp_path, tiny_model):
    trainer, _, snaps, skips, error = train_with_fault(tmp_path, tiny_model, [2], max_steps=3,
                                                       max_consecutive_skipped_steps=0)  # fmt: skip
    assert not skips and error is not None
    assert str(error).startswith("RPPTrainer (train, step 2): the gradient norm before clipping was non-finite at 1 "
                                 "optimizer step(s) in a row (step 2; now nan), more than "
                                 "max_consecutive_skipped_steps=0 allows.")
    assert trainer.state.global_step == 1 and all_finite(trainer)


# ----------------------------------------------------------------------------------------------------------------
# Two processes (gloo), the fault on rank 0 only
# ----------------------------------------------------------------------------------------------------------------


def ranks_of(two_process_runs, mode):
    """Both ranks' records of tests/support/grad_guard_script.py in `mode`, from the suite's two-process launch."""
    return [torch.load(two_process_runs / f"grad_guard_{mode}" / f"rank{r}.pt", weights_only=False) for r in range(2)]


def test_two_processes_skip_the_step_that_one_process_broke(two_process_runs):
    ranks = ranks_of(two_process_runs, "skip")
    assert ranks[0]["fired"] == [2] and ranks[1]["fired"] == []  # the fault was on rank 0 only
    for r, run in enumerate(ranks):
        assert run["error"] is None and run["global_step"] == 4, r
        # DDP all-reduced rank 0's NaN gradients: every rank's norm is NaN at step 2 and finite elsewhere.
        log = {h["step"]: h for h in run["logs"] if "loss" in h}
        assert math.isnan(log[2]["grad_norm"]) and all(math.isfinite(log[s]["grad_norm"]) for s in (1, 3, 4)), r
        assert run["unchanged"][2] == (True, True) and run["grads_dropped"][2], r
        assert all(run["unchanged"][s] == (False, False) for s in (1, 3, 4)), r
        assert len(run["warnings"]) == 1, r
        assert run["warnings"][0].startswith("RPPTrainer (train, step 2): the gradient norm before clipping is nan"), r
        assert [log[s]["skipped_steps"] for s in range(1, 5)] == [0.0, 1.0, 0.0, 0.0], r
        assert all(torch.isfinite(p).all() for p in run["params"].values()), r
    # Both replicas took the same steps: their weights are identical at the end.
    assert all(identical(ranks[0]["params"][n], ranks[1]["params"][n]) for n in ranks[0]["params"])
    assert [h["grad_norm"] for h in ranks[0]["logs"] if "loss" in h and h["step"] != 2] == [
        h["grad_norm"] for h in ranks[1]["logs"] if "loss" in h and h["step"] != 2]


def test_two_processes_stop_together_after_too_many_skips(two_process_runs):
    """Limit 1, the fault at steps 2 and 3 on rank 0: both ranks skip step 2 and raise at step 3 (no hang)."""
    ranks = ranks_of(two_process_runs, "stop")
    for r, run in enumerate(ranks):
        assert run["error"] is not None and run["error"].startswith(
            "NonFiniteGradientError: RPPTrainer (train, step 3): the gradient norm before clipping was non-finite at 2 "
            "optimizer step(s) in a row (steps 2 to 3; now nan), more than max_consecutive_skipped_steps=1 allows."), r
        assert len(run["warnings"]) == 1 and "step 2)" in run["warnings"][0], r
        assert run["unchanged"][2] == (True, True) and run["global_step"] == 2, r
        assert all(torch.isfinite(p).all() for p in run["params"].values()), r
