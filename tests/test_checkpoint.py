"""The generation buffer in a checkpoint (`trl_rpp.faults.checkpoint`): atomic write, and errors that name the damaged file;
what a complete checkpoint is, file by file, and `resume_from_checkpoint=True` skipping a torn one. The real kills at
each point of a checkpoint's write are in tests/test_resume.py; a write that fails (a full disk, an I/O error) at each
point is here."""

import errno
import json
import logging
import os
import re
import shutil

import numpy as np
import pytest
import torch

from checkpoint_faults import install_kill
from trainer_helpers import make_args
from trl_rpp import RPPTrainer
from trl_rpp.faults.checkpoint import (
    WEIGHT_FILES, CheckpointSaveError, DamagedCheckpointError, ResumeLayout, buffer_needed, buffer_path,
    checkpoint_problem, layout_of, load_generation_buffer, newest_complete_checkpoint, read_global_step,
    required_files, save_generation_buffer,
)
from trl_rpp.testing.tiny import copy_first_char_reward, copy_task_dataset


def refuse(folder, *layout):
    """What `resolve_resume_checkpoint` does with a folder named to resume from: raise its problem, if any."""
    problem = checkpoint_problem(folder, ResumeLayout(*layout))
    if problem is not None:
        raise problem


def test_buffer_round_trip_is_atomic_and_keeps_every_key(tmp_path):
    """Every key comes back, list-valued ones too (a vision-language batch's per-sample `num_images`, `num_tiles`)."""
    folder = str(tmp_path / "checkpoint-3")
    batches = [{"advantages": torch.randn(2, 3), "num_items_in_batch": 5, "scale": 0.5, "prompts": ["a", "b"],
                "num_images": [1, 2], "num_tiles": [[4], [2, 3]], "image_sizes": None}] * 2  # fmt: skip
    path = save_generation_buffer(folder, 1, 7, batches)
    assert path == os.path.join(folder, "rpp_generation_buffer_rank1.pt")
    assert os.listdir(folder) == ["rpp_generation_buffer_rank1.pt"]  # the temporary file was renamed away
    buffer, step = load_generation_buffer(folder, 1, required=True)
    assert step == 7 and len(buffer) == 2
    assert set(buffer[0]) == set(batches[0])
    assert buffer[1]["num_images"] == [1, 2] and buffer[1]["num_tiles"] == [[4], [2, 3]]
    assert torch.equal(buffer[1]["advantages"], batches[1]["advantages"])
    # accelerator.device of a multi-process CPU run, which torch.load alone rejects as a map_location.
    buffer, _ = load_generation_buffer(folder, 1, required=True, map_location=torch.device("cpu", 0))
    assert torch.equal(buffer[1]["advantages"], batches[1]["advantages"])


@pytest.mark.parametrize("value", [object(), [1, object()], np.float32(0.5)], ids=["object", "list", "numpy"])
def test_a_key_the_buffer_cannot_store_is_named(tmp_path, value):
    """`weights_only=True` loading restores no arbitrary object: such a key raises at the save, never goes missing."""
    with pytest.raises(TypeError, match=r"^The buffered generation batch's key 'extra' holds a "):
        save_generation_buffer(str(tmp_path / "checkpoint-3"), 0, 3, [{"advantages": torch.zeros(2), "extra": value}])
    assert not os.path.exists(tmp_path / "checkpoint-3")


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
    with pytest.raises(DamagedCheckpointError, match=rf"^{path} is damaged and cannot be read \(.*\)\. Delete the "
                                                     rf"folder {folder} and resume from the previous checkpoint"):
        load_generation_buffer(folder, 0, required=True)
    assert load_generation_buffer(folder, 0, required=False) is None  # not read where it is not needed


def oom_on_restore(storage, location):  # what restoring a storage onto a full device raises
    raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")


@pytest.mark.parametrize("map_location, error", [
    ("cuda:1000000", RuntimeError),  # a device this machine lacks (no CUDA, or no such ordinal): a device error
    (oom_on_restore, torch.OutOfMemoryError),
])
def test_an_error_that_is_not_damage_propagates_as_itself_naming_the_file(tmp_path, caplog, map_location, error):
    """A device error or out of memory while loading an intact buffer is not reported as damage (which says "delete
    the folder"): it keeps its type, with the file and its checkpoint named (a note, or a log before Python 3.11)."""
    folder = str(tmp_path / "checkpoint-3")
    path = save_generation_buffer(folder, 0, 3, [{"advantages": torch.randn(8, 4)}])
    with caplog.at_level(logging.ERROR, logger="trl_rpp.faults.checkpoint"), pytest.raises(error) as info:
        load_generation_buffer(folder, 0, required=True, map_location=map_location)
    assert not isinstance(info.value, DamagedCheckpointError)
    named = " ".join(getattr(info.value, "__notes__", [])) + caplog.text
    assert f"while loading {path}, the generation buffer of the checkpoint {folder}" in named, named


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
    refuse(folder, 0, 1, 2, 1)  # step 4 is a generation boundary for steps_per_generation=2: no buffer needed
    with pytest.raises(DamagedCheckpointError, match="is missing, but"):
        refuse(folder, 0, 1, 3, 1)


@pytest.mark.parametrize("how", ["named", "True"])
@pytest.mark.parametrize("damage", ["removed", "truncated"])
def test_trainer_refuses_to_resume_inside_a_batch_without_a_readable_buffer(tmp_path, tiny_model, damage, how):
    """A checkpoint at step 2 with steps_per_generation=3 falls inside a generation batch. Without its buffer (e.g.
    written by an older version) or with a damaged one, resuming is an error naming the file before any compute,
    not a silently new batch (GRPO's behaviour) nor torch's `OSError: [Errno 22] Invalid argument`. Named, that is
    the error; with `resume_from_checkpoint=True`, which skips torn checkpoints, it is the only one, so Trainer's
    "No valid checkpoint found" names it."""
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
    if how == "named":
        with pytest.raises(DamagedCheckpointError, match=match):
            trainer.train(resume_from_checkpoint=folder)
    else:
        with pytest.raises(ValueError, match=rf"^No valid checkpoint found in output directory "
                                             rf"\({re.escape(args.output_dir)}\): no checkpoint there is complete "
                                             rf"\({re.escape(path)} is"):
            trainer.train(resume_from_checkpoint=True)
    assert trainer.state.global_step == 0  # refused before anything was loaded or trained


# ----------------------------------------------------------------------------------------------------------------
# Torn checkpoints, file by file: what "complete" means, and resume_from_checkpoint=True skipping a torn one
# ----------------------------------------------------------------------------------------------------------------


def test_required_files_follow_the_engine_and_the_process():
    assert required_files(0, 1) == (WEIGHT_FILES, ("optimizer.pt",), ("scheduler.pt",), ("rng_state.pth",))
    assert required_files(1, 2)[-1] == ("rng_state_1.pth",)
    assert required_files(0, 1, scaler=True)[-1] == ("scaler.pt",)
    assert required_files(0, 2, engine="deepspeed") == (("rng_state_0.pth",),)
    assert required_files(0, 2, engine="fsdp") == (("scheduler.pt",), ("rng_state_0.pth",))
    assert required_files(0, 1, save_only_model=True) == (WEIGHT_FILES,)


# Every file of checkpoint-4 of the run below, and whether resume_from_checkpoint=True still resumes from it when the
# file is deleted or cut to half its length ("skip": it resumes from checkpoint-2). What decides complete or torn:
# trainer_state.json (Trainer writes it last), the buffer (written atomically, before Trainer's files), and the files
# Trainer would silently skip when missing. A cut file of transformers' own is left to transformers, which fails
# loudly when it loads it (`test_auto_resume_skips_the_torn_checkpoint_with_the_same_numbers[optimizer.pt-cut]`).
# A file that a new transformers version adds fails `test_a_real_checkpoint_lists_them`.
TORN = {
    "rpp_generation_buffer_rank0.pt": ("skip", "skip"),  # checkpoint-4 falls inside a generation batch
    "model.safetensors": ("skip", "resume"),
    "optimizer.pt": ("skip", "resume"),
    "scheduler.pt": ("skip", "resume"),
    "rng_state.pth": ("skip", "resume"),
    "trainer_state.json": ("skip", "skip"),
    "config.json": ("resume", "resume"),
    "generation_config.json": ("resume", "resume"),
    "training_args.bin": ("resume", "resume"),
    "tokenizer.json": ("resume", "resume"),
    "tokenizer_config.json": ("resume", "resume"),
}
TORN_KW = dict(per_device_train_batch_size=8, gradient_accumulation_steps=1, steps_per_generation=3, max_steps=6,
               save_strategy="steps", save_steps=2, reward_weights=None)


@pytest.fixture(scope="module")
def torn_run(tmp_path_factory, tiny_model):
    """An uninterrupted 6-step run with checkpoints at steps 2, 4 and 6 (generations at 1 and 4: checkpoints 2 and 4
    fall inside a generation batch)."""
    root = tmp_path_factory.mktemp("torn")
    args = make_args(root, "reinforce_plus_plus", **TORN_KW)
    trainer = RPPTrainer(model=tiny_model, reward_funcs=copy_first_char_reward, args=args,
                         train_dataset=copy_task_dataset(64))
    trainer.train()
    assert layout_of(trainer.args, trainer.accelerator) == ResumeLayout(0, 1, 3, 1, required_files(0, 1))
    return args.output_dir, trainer.state.log_history


def torn_copy(run_dir, dest, name, damage):
    """checkpoint-2 and checkpoint-4 of the run (so that 4 is the newest, as when a kill cut its write), with `name`
    of checkpoint-4 deleted or cut to half its length."""
    for c in ("checkpoint-2", "checkpoint-4"):
        shutil.copytree(os.path.join(run_dir, c), os.path.join(dest, c))
    path = os.path.join(dest, "checkpoint-4", name)
    if damage == "deleted":
        os.remove(path)
    else:
        data = open(path, "rb").read()
        open(path, "wb").write(data[: len(data) // 2])
    return path


def test_a_real_checkpoint_lists_them(torn_run):
    run_dir, _ = torn_run
    assert sorted(os.listdir(os.path.join(run_dir, "checkpoint-4"))) == sorted(TORN)
    # At a generation boundary (step 6 of steps_per_generation=3) the resumed run samples anew: no buffer is saved.
    assert sorted(os.listdir(os.path.join(run_dir, "checkpoint-6"))) == sorted(set(TORN) - {buffer_path("", 0)})
    for c in ("checkpoint-2", "checkpoint-4", "checkpoint-6"):
        assert checkpoint_problem(os.path.join(run_dir, c), ResumeLayout(0, 1, 3, 1, required_files(0, 1))) is None


CASES = [(name, damage) for name in TORN for damage in ("deleted", "cut")]


@pytest.mark.parametrize("name,damage", CASES, ids=[f"{n}-{d}" for n, d in CASES])
def test_each_torn_file_is_skipped_or_resumed(tmp_path, torn_run, name, damage):
    run_dir, _ = torn_run
    path = torn_copy(run_dir, str(tmp_path), name, damage)
    layout = ResumeLayout(0, 1, 3, 1, required_files(0, 1))
    chosen, skipped = newest_complete_checkpoint(str(tmp_path), layout)
    if TORN[name][damage == "cut"] == "resume":
        assert chosen == os.path.join(tmp_path, "checkpoint-4") and skipped == []
        return
    assert chosen == os.path.join(tmp_path, "checkpoint-2")
    [(folder, problem)] = skipped
    assert folder == os.path.join(tmp_path, "checkpoint-4")
    if name == "trainer_state.json" or damage == "cut" or name.startswith("rpp_"):
        assert problem.path == path, (problem.path, str(problem))
    else:  # a required file: its name, and what resuming without it would do
        assert problem.path == path and str(problem).startswith(f"{path} is missing"), str(problem)
        assert "resume_from_checkpoint=True skips it" in str(problem)
    # Named explicitly, the same checkpoint is refused with that message.
    with pytest.raises(DamagedCheckpointError) as err:
        refuse(folder, 0, 1, 3, 1, required_files(0, 1))
    assert str(err.value) == str(problem)


RESUMED = [("optimizer.pt", "cut"), ("rng_state.pth", "deleted"), ("model.safetensors", "deleted"),
           ("trainer_state.json", "cut"), ("rpp_generation_buffer_rank0.pt", "deleted"),
           ("tokenizer_config.json", "deleted")]


@pytest.mark.slow
@pytest.mark.parametrize("name,damage", RESUMED, ids=[f"{n}-{d}" for n, d in RESUMED])
def test_auto_resume_skips_the_torn_checkpoint_with_the_same_numbers(tmp_path, tiny_model, torn_run, caplog, name,
                                                                    damage):
    """resume_from_checkpoint=True after the newest checkpoint was torn: a warning names it and its file, training
    resumes from checkpoint-2, and every logged step equals the uninterrupted run's (==, CPU, fixed seed). The same
    checkpoint named explicitly is refused."""
    run_dir, reference = torn_run
    args = make_args(tmp_path, "reinforce_plus_plus", **TORN_KW)
    path = torn_copy(run_dir, args.output_dir, name, damage)
    checkpoint4 = os.path.join(args.output_dir, "checkpoint-4")
    trainer = RPPTrainer(model=tiny_model, reward_funcs=copy_first_char_reward, args=args,
                         train_dataset=copy_task_dataset(64))
    skip = TORN[name][damage == "cut"] == "skip"
    if not skip and name in ("optimizer.pt", "model.safetensors"):  # a cut file of transformers' own: loud at load
        with pytest.raises(Exception, match="PytorchStreamReader|zip|Safetensor|header"):
            trainer.train(resume_from_checkpoint=True)
        return
    if skip:
        with pytest.raises(DamagedCheckpointError, match=f"^{re.escape(path)} "):
            trainer.train(resume_from_checkpoint=checkpoint4)
    with caplog.at_level(logging.WARNING, logger="trl_rpp"):
        trainer.train(resume_from_checkpoint=True)
    warned = [r.getMessage() for r in caplog.records if "skips" in r.getMessage()]
    if skip:
        assert len(warned) == 1 and warned[0].startswith(
            f"trl_rpp: resume_from_checkpoint=True skips {checkpoint4}, which is incomplete: {path} "), warned
        assert warned[0].endswith(f"Resuming from {os.path.join(args.output_dir, 'checkpoint-2')} instead."), warned
    else:
        assert warned == []
    steps = {h["step"]: h for h in trainer.state.log_history if "loss" in h}
    expected = {h["step"]: h for h in reference if "loss" in h}
    assert sorted(steps) == list(range(1, 7))
    for step, entry in steps.items():
        for key in ("loss", "reward", "advantages/raw_mean", "advantages/mean", "advantages/std", "grad_norm"):
            assert entry.get(key) == expected[step].get(key), (step, key, entry.get(key), expected[step].get(key))


def test_resuming_inside_a_generation_batch_reads_the_buffer_once(tmp_path, tiny_model, torn_run, monkeypatch):
    """The completeness check looks at the buffer's zip directory only; the resumed run loads it once."""
    run_dir, _ = torn_run
    args = make_args(tmp_path, "reinforce_plus_plus", **{**TORN_KW, "max_steps": 5, "save_strategy": "no"})
    shutil.copytree(os.path.join(run_dir, "checkpoint-4"), os.path.join(args.output_dir, "checkpoint-4"))
    loads, real_load = [], torch.load

    def counting_load(f, *a, **kw):
        loads.append(os.path.basename(os.fspath(f)) if isinstance(f, (str, os.PathLike)) else None)
        return real_load(f, *a, **kw)

    monkeypatch.setattr(torch, "load", counting_load)
    trainer = RPPTrainer(model=tiny_model, reward_funcs=copy_first_char_reward, args=args,
                         train_dataset=copy_task_dataset(64))
    trainer.train(resume_from_checkpoint=True)
    assert trainer.state.global_step == 5
    assert loads.count("rpp_generation_buffer_rank0.pt") == 1, loads


# A save that fails: a full disk (ENOSPC) or an I/O error (EIO) at each point of checkpoint-4's write, in process.
FAIL_POINTS = ["buffer_start", "buffer_half", "model_start", "rng_start", "state_half", "rotate_start"]
FAILURES = [(point, code) for point in FAIL_POINTS for code in (errno.ENOSPC, errno.EIO)]


@pytest.mark.slow
@pytest.mark.parametrize("point,code", FAILURES, ids=[f"{p}-{errno.errorcode[c]}" for p, c in FAILURES])
def test_a_failed_save_names_the_folder_and_the_cause_and_keeps_the_previous_checkpoint(
        tmp_path, tiny_model, torn_run, monkeypatch, point, code):
    """The write of checkpoint-4 (inside a generation batch: its buffer is saved too) raises OSError at `point`. The
    run stops with a CheckpointSaveError naming the folder, the cause and the checkpoint a resume takes; checkpoint-2
    is still complete, and resume_from_checkpoint=True never takes the torn folder for complete: it resumes from
    checkpoint-2 (or from checkpoint-4 where only the rotation after it failed) with the uninterrupted run's numbers."""
    run_dir, reference = torn_run
    args = make_args(tmp_path, "reinforce_plus_plus", **TORN_KW)
    trainer = RPPTrainer(model=tiny_model, reward_funcs=copy_first_char_reward, args=args,
                         train_dataset=copy_task_dataset(64))
    full = os.path.join(args.output_dir, "full-disk-marker")

    def fail():
        raise OSError(code, os.strerror(code), full)

    install_kill(point, 4, trainer, action=fail, patch=monkeypatch.setattr)
    checkpoint2, checkpoint4 = (os.path.join(args.output_dir, f"checkpoint-{s}") for s in (2, 4))
    with pytest.raises(CheckpointSaveError) as err:
        trainer.train()
    complete_already = point == "rotate_start"
    resumed_from = checkpoint4 if complete_already else checkpoint2
    assert isinstance(err.value.__cause__, OSError) and err.value.errno == code and err.value.filename == full
    assert str(err.value).startswith(
        f"Saving the checkpoint {checkpoint4} failed ({errno.errorcode[code]}: {os.strerror(code)} on {full}). "), err
    said = (f"{checkpoint4} itself is complete: resume_from_checkpoint=True resumes from it" if complete_already else
            f"{checkpoint4} is incomplete: resume_from_checkpoint=True skips it and resumes from {checkpoint2}")
    assert said in str(err.value) and err.value.previous == resumed_from, err
    assert trainer.state.global_step == 4 and not os.path.exists(os.path.join(args.output_dir, "checkpoint-6"))
    layout = ResumeLayout(0, 1, 3, 1, required_files(0, 1))
    assert checkpoint_problem(checkpoint2, layout) is None
    assert (checkpoint_problem(checkpoint4, layout) is None) == complete_already
    monkeypatch.undo()  # the disk has room again
    again = RPPTrainer(model=tiny_model, reward_funcs=copy_first_char_reward,
                       args=make_args(tmp_path, "reinforce_plus_plus", **TORN_KW), train_dataset=copy_task_dataset(64))
    again.train(resume_from_checkpoint=True)
    steps = {h["step"]: h for h in again.state.log_history if "loss" in h}
    expected = {h["step"]: h for h in reference if "loss" in h}
    assert sorted(steps) == list(range(1, 7))
    for step in steps:
        assert steps[step]["loss"] == expected[step]["loss"], (step, steps[step], expected[step])
    assert all(checkpoint_problem(os.path.join(args.output_dir, f"checkpoint-{s}"), layout) is None for s in (2, 4, 6))
