"""`max_staleness=1` without a server: the dataloader read ahead, which batch is launched, what is refused, and the batch
in flight in a checkpoint (`trl_rpp.engines.ahead`, `trl_rpp.faults.checkpoint`). The runs against vLLM's server are
in tests/test_vllm_engine.py ("Generation ahead")."""

import os

import pytest
import torch

from trl_rpp.engines.ahead import GenerationAhead, Lookahead, check_generation_ahead, empty_answer
from trl_rpp.faults.checkpoint import (
    DamagedCheckpointError, ResumeLayout, checkpoint_problem, load_ahead, required_files, save_ahead,
)

SERVER = dict(use_vllm=True, vllm_mode="server", vllm_server_weight_sync="disk", vllm_server_weight_dir="/tmp/w",
              vllm_importance_sampling_mode="token_truncate", max_staleness=1)


def test_lookahead_hands_out_every_item_in_order_whatever_it_peeked():
    items = Lookahead(iter(range(10)))
    assert items.peek(3) == 3 and list(items.ahead) == [0, 1, 2, 3]
    assert [next(items), next(items)] == [0, 1]
    assert items.peek(6) == 6 and items.peek(2) == 2
    with pytest.raises(IndexError, match="item 1 was already taken"):
        items.peek(1)
    assert list(items) == [2, 3, 4, 5, 6, 7, 8, 9]  # taken in order, none lost or repeated
    assert items.peek(10) is None  # past the end of the epoch


def advance(ahead, iterator, micro_steps):
    """What Trainer and GRPO do for `micro_steps` micro-steps: take an item, then prepare it."""
    for _ in range(micro_steps):
        next(ahead.reading(iterator))
        ahead.prepared()


@pytest.mark.parametrize("generate_every", [1, 2, 3])
def test_the_next_batch_is_the_item_one_generation_batch_ahead(generate_every):
    """GRPO's dataloader repeats each generation batch `generate_every` times (`RepeatSampler`): at each generation
    the batch launched is the next distinct one, at any micro-step of the current batch; none is launched past the
    epoch or past the last trained micro-step."""
    data = [f"batch{i // generate_every}" for i in range(4 * generate_every)]
    ahead, iterator = GenerationAhead(1), iter(data)
    total = 3 * generate_every  # the run trains three generation batches of this four-batch epoch
    for step in range(4 * generate_every):
        advance(ahead, iterator, 1)
        got = ahead.next_inputs(step, generate_every, step, total)
        batch = step // generate_every
        assert got == (f"batch{batch + 1}" if batch + 1 < 3 else None), (step, got)
        assert ahead.next_inputs(step, generate_every, step, 10 ** 6) == (
            f"batch{batch + 1}" if batch + 1 < 4 else None)  # the epoch ends after batch 3


def test_a_new_epoch_is_read_from_its_own_iterator():
    ahead = GenerationAhead(1)
    first, second = iter(["a", "b"]), iter(["c", "d"])
    advance(ahead, first, 2)
    assert ahead.next_inputs(1, 1, 1, 10) is None  # the next batch is in an epoch not yet started
    advance(ahead, second, 1)
    assert ahead.lookahead.iterator is second and ahead.next_inputs(0, 1, 2, 10) == "d"


@pytest.mark.parametrize("field,value", [("tools", [print]), ("rollout_func", print),
                                         ("environment_factory", print)])
def test_what_samples_inside_a_batch_is_refused(field, value):
    from trl_rpp import RPPConfig

    args = RPPConfig("/tmp/o", bf16=False, use_cpu=True, **SERVER)
    with pytest.raises(ValueError, match=rf"^{field}='given' is not supported with max_staleness=1; accepted: None\."):
        check_generation_ahead(args, **{field: value})
    with pytest.raises(ValueError, match=r"^model='a vision-language model' is not supported with max_staleness=1"):
        check_generation_ahead(args, is_vlm=True)
    check_generation_ahead(RPPConfig("/tmp/o", bf16=False, use_cpu=True), **{field: value})  # max_staleness=0


def test_the_trainer_refuses_tools_before_it_loads_anything(tmp_path):
    """No model, no server: the refusal comes first."""
    from datasets import Dataset

    from trl_rpp import RPPConfig, RPPTrainer

    args = RPPConfig(str(tmp_path), bf16=False, use_cpu=True, report_to="none", **SERVER)
    with pytest.raises(ValueError, match=r"^tools='given' is not supported with max_staleness=1"):
        RPPTrainer(model=str(tmp_path / "no-model-here"), reward_funcs=[lambda completions, **kw: [0.0]], args=args,
                   train_dataset=Dataset.from_list([{"prompt": "a"}]), tools=[print])


def test_the_batch_in_flight_round_trips_through_a_checkpoint(tmp_path):
    """Saved on every process (the answer on process 0 only), required by every checkpoint of a run with
    max_staleness=1, refused by name when missing or cut short."""
    folder = str(tmp_path / "checkpoint-3")
    os.makedirs(folder)
    with open(os.path.join(folder, "trainer_state.json"), "w") as f:
        f.write('{"global_step": 3}')
    for name in ("model.safetensors", "optimizer.pt", "scheduler.pt", "rng_state.pth"):  # Trainer's, present
        open(os.path.join(folder, name), "w").close()
    state = {"prompt_ids": [[1, 2]] * 4, "num_generations": 4, "weight_version": 2,
             "answer": [[[1, 2]], [[5, 6]] * 4, [[[-0.5, -float("inf")]]] * 4, [[[5, 7]]] * 4]}
    layout = ResumeLayout(0, required=required_files(0, 1), ahead=True)
    problem = checkpoint_problem(folder, layout)
    assert isinstance(problem, DamagedCheckpointError) and problem.path.endswith("rpp_generation_ahead_rank0.pt")
    assert "cannot be resumed with max_staleness=1" in str(problem) and "resume it with max_staleness=0" in str(problem)
    assert checkpoint_problem(folder, ResumeLayout(0, required=required_files(0, 1))) is None  # max_staleness=0
    path = save_ahead(folder, 0, state)
    assert checkpoint_problem(folder, layout) is None
    assert load_ahead(folder, 0) == state
    ahead = GenerationAhead(1)
    ahead.restore(load_ahead(folder, 0))
    assert (ahead.pending.weight_version, ahead.pending.answer, ahead.pending.thread) == (2, tuple(state["answer"]), None)
    save_ahead(folder, 0, None)  # nothing in flight (the end of an epoch) is saved too
    assert load_ahead(folder, 0) is None
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)
    assert "damaged" in str(checkpoint_problem(folder, layout)) or "cut short" in str(checkpoint_problem(folder, layout))
    with pytest.raises(DamagedCheckpointError):
        load_ahead(folder, 0)


def test_a_failed_request_answers_one_eos_per_completion():
    prompts, completions, logprobs, ids = empty_answer(7, [[1, 2], [3]], 2)
    assert prompts == [[1, 2], [3]] and completions == [[7]] * 4 and logprobs == [[[0.0]]] * 4 and ids == [[[7]]] * 4
    assert torch.tensor(logprobs).shape == (4, 1, 1)


def test_a_generation_batch_that_ends_inside_an_optimizer_step_is_refused():
    """Trainer takes an optimizer step's micro-batches at once: a batch sampled ahead must start at an optimizer
    step, so `steps_per_generation * num_iterations` is a multiple of `gradient_accumulation_steps`."""
    from trl_rpp import RPPConfig

    cpu = dict(output_dir="/tmp/o", bf16=False, use_cpu=True)
    with pytest.raises(ValueError, match=r"^max_staleness=1 is not supported with steps_per_generation=1, "
                                         r"num_iterations=1, gradient_accumulation_steps=2; accepted: 0\."):
        RPPConfig(**cpu, gradient_accumulation_steps=2, steps_per_generation=1, **SERVER)
    with pytest.raises(ValueError, match=r"^max_staleness=1 is not supported with steps_per_generation=3"):
        RPPConfig(**cpu, gradient_accumulation_steps=2, steps_per_generation=3, **SERVER)
    for spg, iterations, ga in ((None, 1, 2), (2, 1, 2), (1, 2, 2), (4, 1, 2), (1, 1, 1)):
        config = RPPConfig(**cpu, steps_per_generation=spg, num_iterations=iterations, gradient_accumulation_steps=ga,
                           **SERVER)
        assert config.max_staleness == 1
    RPPConfig(**cpu, gradient_accumulation_steps=2, steps_per_generation=1)  # max_staleness=0: any
