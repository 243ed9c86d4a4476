"""The generation buffer in a checkpoint (`trl_rpp.checkpoint`): atomic write, and errors that name the damaged file.
The real kills at each point of a checkpoint's write are in tests/test_resume.py."""

import json
import os

import pytest
import torch

from trainer_helpers import make_args
from trl_rpp import RPPTrainer
from trl_rpp.checkpoint import (
    DamagedCheckpointError,
    buffer_needed,
    buffer_path,
    check_resumable,
    load_generation_buffer,
    read_global_step,
    save_generation_buffer,
)
from trl_rpp.testing.tiny import copy_first_char_reward, copy_task_dataset


def test_buffer_round_trip_is_atomic_and_keeps_tensors_and_numbers(tmp_path):
    folder = str(tmp_path / "checkpoint-3")
    batches = [{"advantages": torch.randn(2, 3), "num_items_in_batch": 5, "scale": 0.5, "prompts": ["a", "b"]}] * 2
    path = save_generation_buffer(folder, 1, 7, batches)
    assert path == os.path.join(folder, "rpp_generation_buffer_rank1.pt")
    assert os.listdir(folder) == ["rpp_generation_buffer_rank1.pt"]  # the temporary file was renamed away
    buffer, step = load_generation_buffer(folder, 1, required=True)
    assert step == 7 and len(buffer) == 2
    assert set(buffer[0]) == {"advantages", "num_items_in_batch", "scale"}  # no pickled Python objects
    assert torch.equal(buffer[1]["advantages"], batches[1]["advantages"])
    # accelerator.device of a multi-process CPU run, which torch.load alone rejects as a map_location.
    buffer, _ = load_generation_buffer(folder, 1, required=True, map_location=torch.device("cpu", 0))
    assert torch.equal(buffer[1]["advantages"], batches[1]["advantages"])


@pytest.mark.parametrize(
    "global_step,ga,spg,iters,needed",
    [(3, 1, 2, 1, True), (4, 1, 2, 1, False), (4, 1, 3, 1, True), (2, 2, 4, 1, False), (1, 2, 4, 1, True),
     (5, 1, 1, 1, False), (5, 1, 1, 2, True), (6, 1, 1, 2, False), (1, 4, 2, 2, False)],
)
def test_buffer_needed_inside_a_generation_batch(global_step, ga, spg, iters, needed):
    assert buffer_needed(global_step, ga, spg, iters) is needed


def test_missing_buffer_is_an_error_only_inside_a_generation_batch(tmp_path):
    folder = str(tmp_path / "checkpoint-3")
    os.makedirs(folder)
    assert load_generation_buffer(folder, 0, required=False) is None
    with pytest.raises(DamagedCheckpointError, match=rf"^{buffer_path(folder, 0)} is missing, but {folder} falls "
                                                     r"inside a generation batch"):
        load_generation_buffer(folder, 0, required=True)


@pytest.mark.parametrize("damage", ["truncated", "garbage", "empty"])
def test_unreadable_buffer_names_the_file(tmp_path, damage):
    folder = str(tmp_path / "checkpoint-3")
    path = save_generation_buffer(folder, 0, 3, [{"advantages": torch.randn(8, 4)}])
    data = open(path, "rb").read()
    damaged = {"truncated": data[: len(data) // 2], "garbage": b"not a torch file", "empty": b""}[damage]
    open(path, "wb").write(damaged)
    for required in (True, False):  # a damaged file is an error even where the buffer is not needed
        with pytest.raises(DamagedCheckpointError, match=rf"^{path} is damaged and cannot be read \(.*\)\. Delete the "
                                                         rf"folder {folder} and resume from the previous checkpoint"):
            load_generation_buffer(folder, 0, required=required)


def test_missing_or_damaged_trainer_state_names_it(tmp_path):
    folder = str(tmp_path / "checkpoint-4")
    os.makedirs(folder)
    state = os.path.join(folder, "trainer_state.json")
    with pytest.raises(DamagedCheckpointError, match=rf"^{state} is missing: this checkpoint was not completely "
                                                     rf"written .* Delete the folder {folder} and resume again"):
        read_global_step(folder)
    text = json.dumps({"global_step": 4, "log_history": [{"loss": 1.0}]}, indent=2)
    open(state, "w").write(text[: len(text) // 2])
    with pytest.raises(DamagedCheckpointError, match=rf"^{state} cannot be read \(JSONDecodeError"):
        read_global_step(folder)
    open(state, "w").write(text)
    assert read_global_step(folder) == 4
    check_resumable(folder, 0, 1, 2, 1)  # step 4 is a generation boundary for steps_per_generation=2: no buffer needed
    with pytest.raises(DamagedCheckpointError, match="is missing, but"):
        check_resumable(folder, 0, 1, 3, 1)


@pytest.mark.parametrize("damage", ["removed", "truncated"])
def test_trainer_refuses_to_resume_inside_a_batch_without_a_readable_buffer(tmp_path, tiny_model, damage):
    """A checkpoint at step 2 with steps_per_generation=3 falls inside a generation batch. Without its buffer (e.g.
    written by an older version) or with a damaged one, resuming is an error naming the file before any compute,
    not a silently new batch (GRPO's behaviour) nor torch's `OSError: [Errno 22] Invalid argument`."""
    kw = dict(per_device_train_batch_size=8, gradient_accumulation_steps=1, steps_per_generation=3, max_steps=2,
              save_strategy="steps", save_steps=2, reward_weights=None)
    args = make_args(tmp_path, "reinforce_plus_plus", **kw)
    RPPTrainer(model=tiny_model, reward_funcs=copy_first_char_reward, args=args,
               train_dataset=copy_task_dataset(64)).train()
    folder = os.path.join(args.output_dir, "checkpoint-2")
    path = buffer_path(folder, 0)
    if damage == "removed":
        os.remove(path)
        match = rf"^{path} is missing, but {folder} falls inside a generation batch"
    else:
        data = open(path, "rb").read()
        open(path, "wb").write(data[: len(data) // 2])
        match = rf"^{path} is damaged and cannot be read"
    args = make_args(tmp_path, "reinforce_plus_plus", **{**kw, "max_steps": 3})
    trainer = RPPTrainer(model=tiny_model, reward_funcs=copy_first_char_reward, args=args,
                         train_dataset=copy_task_dataset(64))
    with pytest.raises(DamagedCheckpointError, match=match):
        trainer.train(resume_from_checkpoint=True)
    assert trainer.state.global_step == 0  # refused before anything was loaded or trained
