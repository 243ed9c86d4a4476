"""The buffered generation batch in a checkpoint: written so that a kill at any point of a checkpoint's write leaves
either a checkpoint that resumes exactly, or one that is refused with the damaged file named.

With `steps_per_generation > 1` or `num_iterations > 1`, several optimizer steps train on one buffered generation
batch, so a checkpoint that falls inside such a batch needs it to continue exactly. `transformers.Trainer` writes a
checkpoint's files straight into `checkpoint-N/` (no temporary folder, no rename), `trainer_state.json` last, and
resuming reads that file. So:

- the buffer is written *before* Trainer's files, to a temporary name and then `os.replace`d into place: a
  checkpoint whose `trainer_state.json` exists has its complete buffer (the buffer never needs repairing);
- before resuming, `resolve_resume_checkpoint` refuses a checkpoint whose `trainer_state.json` is missing or
  unreadable (the write was interrupted), and one that falls inside a generation batch but whose buffer is missing or
  unreadable, each time naming the file and saying what to do;
- a write that fails (a full disk, an I/O error) raises `CheckpointSaveError`, naming the folder, the cause and the
  checkpoint a resume would take.

A checkpoint is *complete* (`checkpoint_problem` returns None) when, in this order: `trainer_state.json` reads (Trainer
writes it last, so a kill during a save leaves none); the generation buffer exists and its zip directory reads, where
the step falls inside a generation batch (it is saved only there, `buffer_needed`); and every file that Trainer would
silently skip when missing exists (`required_files`: `optimizer.pt`, `scheduler.pt`, this process's RNG state, and
`scaler.pt` with a loss scaler), besides the model weights. The formats of transformers' own files are left to
transformers, which fails loudly on a damaged one when it loads it. `newest_complete_checkpoint` is what
`resume_from_checkpoint=True` resumes from: the newest checkpoint complete on every process, skipping newer torn ones.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import pickle
import re
import zipfile
from dataclasses import dataclass

import torch
from accelerate.utils import gather_object
from transformers.trainer import OPTIMIZER_NAME, SCALER_NAME, SCHEDULER_NAME, TRAINER_STATE_NAME
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
from transformers.utils import SAFE_WEIGHTS_INDEX_NAME, SAFE_WEIGHTS_NAME, WEIGHTS_INDEX_NAME, WEIGHTS_NAME
from transformers.utils.peft_utils import ADAPTER_SAFE_WEIGHTS_NAME, ADAPTER_WEIGHTS_NAME

from ..patches import checkpoint_folder_root, generation_buffer

BUFFER_FILE = "rpp_generation_buffer_rank{}.pt"
AHEAD_FILE = "rpp_generation_ahead_rank{}.pt"  # the batch in flight, with max_staleness=1 (`trl_rpp.engines.ahead`)
# The model as `save_pretrained` writes it (one of these is enough): full or sharded weights, or a PEFT adapter.
WEIGHT_FILES = (SAFE_WEIGHTS_NAME, SAFE_WEIGHTS_INDEX_NAME, ADAPTER_SAFE_WEIGHTS_NAME, WEIGHTS_NAME, WEIGHTS_INDEX_NAME,
                ADAPTER_WEIGHTS_NAME)
CHECKPOINT_DIR = re.compile(r"^checkpoint-(\d+)$")  # transformers.trainer_utils._re_checkpoint

logger = logging.getLogger(__name__)


class DamagedCheckpointError(RuntimeError):
    """A checkpoint that cannot be resumed exactly; the message names the file and what to do. `path` is that file
    and `reason` what is wrong with it, in a few words (for the warning of a skipped checkpoint)."""

    def __init__(self, message: str, path: str | None = None, reason: str | None = None):
        super().__init__(message)
        self.path, self.reason = path, reason


class CheckpointSaveError(RuntimeError):
    """A checkpoint's write failed (a full disk, an I/O error): the message names the folder, the cause and the
    checkpoint a resume would start from. `errno` and `filename` are the cause's `OSError`'s, which is chained."""

    def __init__(self, folder: str, cause: OSError, previous: str | None):
        what = cause.strerror or str(cause)
        code = f"{errno.errorcode.get(cause.errno, cause.errno)}: " if cause.errno is not None else ""
        on = f" on {cause.filename}" if cause.filename else ""
        if previous == folder:  # the failure came after its last file (deleting older checkpoints)
            state = f"{folder} itself is complete: resume_from_checkpoint=True resumes from it"
        elif previous:
            state = f"{folder} is incomplete: resume_from_checkpoint=True skips it and resumes from {previous}"
        else:
            state = f"{folder} is incomplete and no complete checkpoint precedes it: a resume starts from the beginning"
        super().__init__(f"Saving the checkpoint {folder} failed ({code}{what}{on}). {state}. Free space or fix the "
                         "storage, then resume.")
        self.errno, self.filename, self.folder, self.previous = cause.errno, cause.filename, folder, previous


def save_error(folder: str, cause: OSError, output_dir: str, layout: ResumeLayout) -> CheckpointSaveError:
    """The `CheckpointSaveError` for a failed write of `folder`, naming the newest complete checkpoint of
    `output_dir` as this process sees it (no other process is asked: they may be past the save, or waiting in it)."""
    previous, _ = newest_complete_checkpoint(output_dir, layout) if os.path.isdir(output_dir) else (None, [])
    return CheckpointSaveError(folder, cause, previous)


def buffer_path(folder: str, rank: int) -> str:
    return os.path.join(folder, BUFFER_FILE.format(rank))


def _storable(value) -> bool:
    """What `torch.load(weights_only=True)` restores: tensors, numbers, strings, None, and lists, tuples and dicts of
    them (e.g. the per-sample `num_images` and `num_tiles` lists of a vision-language batch)."""
    if value is None or torch.is_tensor(value) or type(value) in (bool, int, float, str):  # not NumPy scalars
        return True
    if isinstance(value, (list, tuple)):
        return all(_storable(v) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and _storable(v) for k, v in value.items())
    return False


def save_generation_buffer(folder: str, rank: int, step: int, buffered_inputs) -> str:
    """Write this process's buffered generation batch and micro-step counter to `folder`, atomically.

    Every key is kept, or a `TypeError` names the one that cannot be (loading uses `weights_only=True`, which
    restores no arbitrary Python object): a resumed run must train on the same inputs. The bytes go to a temporary
    file that is flushed to disk and then renamed over the final name: a kill leaves either no buffer file or a
    complete one, never a partial file under the final name. Returns the final path.
    """
    for batch in buffered_inputs:
        for key, value in batch.items():
            if not _storable(value):
                raise TypeError(
                    f"The buffered generation batch's key {key!r} holds a {type(value).__name__}, which a checkpoint "
                    "cannot store (accepted: tensors, numbers, strings, None, and lists, tuples or dicts of them), "
                    "and resuming without it would change the run's inputs."
                )
    return _save_atomically(buffer_path(folder, rank), {"step": step, "buffer": [dict(batch) for batch in buffered_inputs]})


def _save_atomically(path: str, state) -> str:
    """`torch.save(state)` to a temporary file, flushed to disk, then renamed to `path`."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return path


def ahead_path(folder: str, rank: int) -> str:
    return os.path.join(folder, AHEAD_FILE.format(rank))


def save_ahead(folder: str, rank: int, pending: dict | None) -> str:
    """Write this process's batch in flight (`GenerationAhead.state`: its prompt ids, weight version and, on process
    0, the server's answer; None when nothing was in flight) to `folder`, atomically."""
    if not _storable(pending):
        raise TypeError("the batch in flight holds a value a checkpoint cannot store")
    return _save_atomically(ahead_path(folder, rank), {"pending": pending})


def load_ahead(folder: str, rank: int):
    """The batch in flight saved in `folder` (a dict, or None when nothing was in flight). Raises
    `DamagedCheckpointError` naming the file when it is missing or damaged."""
    path = ahead_path(folder, rank)
    problem = _ahead_problem(folder, rank)
    if problem is not None:
        raise problem
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:
        damage = _load_damage(path, err)
        if damage is None:
            raise
        raise _damaged(folder, path, damage) from err
    if not (isinstance(state, dict) and "pending" in state):
        raise _damaged(folder, path, "it holds no 'pending'")
    return state["pending"]


def _ahead_problem(folder: str, rank: int) -> DamagedCheckpointError | None:
    path = ahead_path(folder, rank)
    if not os.path.exists(path):
        return DamagedCheckpointError(
            f"{path} is missing, so {folder} cannot be resumed with max_staleness=1: such a run saves the batch in "
            "flight there with every checkpoint, and resuming without it would lose that batch or sample it again "
            "from other weights. If the checkpoint was saved at max_staleness=0, resume it with max_staleness=0; "
            "otherwise delete the folder and resume from the previous checkpoint (resume_from_checkpoint=True skips "
            "it).",
            path, "is missing, and the run samples a batch ahead")
    try:
        with zipfile.ZipFile(path) as z:
            z.infolist()
    except (zipfile.BadZipFile, OSError, EOFError, ValueError) as err:
        return _damaged(folder, path, f"{type(err).__name__}: {err}")
    return None


def buffer_needed(
    global_step: int, gradient_accumulation_steps: int, steps_per_generation: int, num_iterations: int
) -> bool:
    """True when a checkpoint at optimizer step `global_step` falls inside a generation batch: GRPO's micro-step
    counter (`global_step * gradient_accumulation_steps`) is then not a multiple of
    `steps_per_generation * num_iterations`, and resuming without the buffer would sample a new batch there."""
    return (global_step * gradient_accumulation_steps) % (steps_per_generation * num_iterations) != 0


def _incomplete(folder: str, problem: str) -> DamagedCheckpointError:
    parent = os.path.dirname(os.path.abspath(folder))
    path = os.path.join(folder, TRAINER_STATE_NAME)
    return DamagedCheckpointError(
        f"{path} {problem}: this checkpoint was not completely written (the "
        f"process stopped while saving it; Trainer writes {TRAINER_STATE_NAME} last). Delete the folder {folder} "
        f"and resume again: resume_from_checkpoint=True then continues from the newest complete checkpoint in "
        f"{parent}, with the same numbers as an uninterrupted run.", path, problem
    )


def read_global_step(folder: str) -> int:
    """The `global_step` recorded in `folder/trainer_state.json`; `DamagedCheckpointError` when it is missing or
    unreadable."""
    path = os.path.join(folder, TRAINER_STATE_NAME)
    if not os.path.isfile(path):
        raise _incomplete(folder, "is missing")
    try:
        with open(path, encoding="utf-8") as f:
            return int(json.load(f)["global_step"])
    except (ValueError, KeyError, TypeError) as err:  # JSONDecodeError is a ValueError
        raise _incomplete(folder, f"cannot be read ({type(err).__name__}: {err})") from err


def _missing_buffer(folder: str, path: str) -> DamagedCheckpointError:
    return DamagedCheckpointError(
        f"{path} is missing, but {folder} falls inside a generation batch (steps_per_generation or "
        "num_iterations > 1), and resuming there without the buffered batch would sample a new one and "
        "silently change the run. The checkpoint was written without it (by an older version of trl_rpp, or the "
        "file was removed). Resume from an earlier checkpoint that has its buffer, or at a generation boundary.",
        path, "is missing, and the checkpoint falls inside a generation batch",
    )


def load_generation_buffer(folder: str, rank: int, required: bool, map_location=None):
    """`(buffered_inputs, step)` from `folder` where the checkpoint falls inside a generation batch (`required`, see
    `buffer_needed`); None elsewhere, without reading anything.

    Raises `DamagedCheckpointError` naming the file when it is missing, or cut short or garbled (`_load_damage`);
    any other error of `torch.load` (a device error, out of memory) propagates as it is, with a note naming the file.
    """
    if not required:
        return None
    path = buffer_path(folder, rank)
    if not os.path.exists(path):
        raise _missing_buffer(folder, path)
    # torch.load has no restore rule for an indexed CPU device ("cpu:0"), which is accelerator.device in a
    # multi-process CPU run (MULTI_CPU): the file would be reported damaged. Plain "cpu" is the same device.
    if isinstance(map_location, (str, torch.device)) and torch.device(map_location).type == "cpu":
        map_location = "cpu"
    try:
        state = torch.load(path, map_location=map_location, weights_only=True)
    except Exception as err:
        damage = _load_damage(path, err)
        if damage is None:  # a device error, out of memory, an I/O error: the file may be intact, so not "delete it"
            _add_note(err, f"(while loading {path}, the generation buffer of the checkpoint {folder}; the file itself "
                           "shows no damage, so the checkpoint is not reported damaged)")
            raise
        raise _damaged(folder, path, damage) from err
    if not (isinstance(state, dict) and "buffer" in state and "step" in state):
        raise _damaged(folder, path, "it holds no 'buffer' and 'step'")
    return state["buffer"], int(state["step"])


# What torch 2.13's `torch.load` raises for a truncated, garbled or empty file (measured on every truncation of a
# buffer, random bytes and single flipped bytes). The first three come only from parsing the bytes; the others also
# mean a device error (CUDA errors and `torch.OutOfMemoryError` are RuntimeErrors), an I/O error or a bug, so for
# those the file's own zip structure decides.
_PARSE_ERRORS = (EOFError, pickle.UnpicklingError, UnicodeDecodeError)
_AMBIGUOUS_ERRORS = (OSError, RuntimeError, IndexError, KeyError)


def _load_damage(path: str, err: Exception) -> str | None:
    """Why loading the buffer at `path`, which raised `err`, failed because the file is damaged, in a few words;
    None when the damage is not shown (the error propagates as it is). The buffer is always a zip (torch.save's
    format) whose members carry CRC-32s, so an ambiguous error is damage only when Python's `zipfile` finds the file
    broken."""
    if isinstance(err, _PARSE_ERRORS):
        # Only torch's first sentence: the rest can advise weights_only=False, which is not the fix here.
        reason = (str(err).strip().splitlines() or [""])[0].split(". ")[0][:160]
        return f"{type(err).__name__}: {reason}"
    if not isinstance(err, _AMBIGUOUS_ERRORS):
        return None
    try:
        with zipfile.ZipFile(path) as z:
            bad = z.testzip()  # reads every member and checks its CRC-32
    except OSError:  # the zip check could not read the file either: no proof of damage
        return None
    except Exception as zip_err:  # BadZipFile, and the ValueError, EOFError... zipfile raises on a garbled header
        return f"{type(err).__name__}, not a readable zip ({type(zip_err).__name__}: {zip_err})"
    return None if bad is None else f"{type(err).__name__}, {bad} fails its CRC-32 check"


def _add_note(err: BaseException, note: str) -> None:
    if hasattr(err, "add_note"):  # Python 3.11+: shown under the traceback
        err.add_note(note)
    else:
        logger.error(note)


def _damaged(folder: str, path: str, reason: str) -> DamagedCheckpointError:
    return DamagedCheckpointError(
        f"{path} is damaged and cannot be read ({reason}). Delete the folder {folder} and resume from the previous "
        "checkpoint.", path, f"is damaged and cannot be read ({reason})"
    )


# What resuming without each required file would do (Trainer skips a missing optimizer, scheduler, scaler or RNG file
# with at most an info log, and fails on missing weights).
_WITHOUT = {
    WEIGHT_FILES: "fail: there are no model weights to load",
    (OPTIMIZER_NAME,): "silently start the optimizer state afresh (Trainer skips a missing file)",
    (SCHEDULER_NAME,): "silently restart the learning-rate schedule (Trainer skips a missing file)",
    (SCALER_NAME,): "silently restart the loss scale (Trainer skips a missing file)",
}


def required_files(rank: int, world_size: int, engine: str = "plain", save_only_model: bool = False,
                   scaler: bool = False) -> tuple[tuple[str, ...], ...]:
    """The files that resuming reads from a checkpoint, each as a tuple of alternatives (any one is enough), besides
    `trainer_state.json` and the generation buffer. `engine` is "plain" (one process or DDP), "deepspeed" or "fsdp":
    DeepSpeed and FSDP keep the model and optimizer in their own formats and folders, not checked here."""
    files = [WEIGHT_FILES] if engine == "plain" else []
    if not save_only_model:  # such a checkpoint holds the model only (and Trainer cannot resume it exactly anyway)
        if engine == "plain":
            files.append((OPTIMIZER_NAME,))
        if engine != "deepspeed":  # DeepSpeed keeps the scheduler with its engine's state
            files.append((SCHEDULER_NAME,))
        files.append(("rng_state.pth",) if world_size <= 1 else (f"rng_state_{rank}.pth",))
        if scaler:
            files.append((SCALER_NAME,))
    return tuple(files)


@dataclass(frozen=True)
class ResumeLayout:
    """What a checkpoint of this run needs to resume it exactly on process `rank` (see `checkpoint_problem`)."""

    rank: int = 0
    gradient_accumulation_steps: int = 1
    steps_per_generation: int = 1
    num_iterations: int = 1
    required: tuple[tuple[str, ...], ...] = ()  # `required_files`
    ahead: bool = False  # max_staleness > 0: every checkpoint holds the batch in flight (`AHEAD_FILE`)


def layout_of(args, accelerator) -> ResumeLayout:
    """The `ResumeLayout` of an `RPPTrainer`'s run with `args`, on this process of `accelerator`: its engine
    (DeepSpeed or FSDP, as Trainer's `is_deepspeed_enabled` and `is_fsdp_enabled` read them off the accelerator's
    state), its gradient scaler, and the arguments."""
    state = accelerator.state
    engine = ("deepspeed" if getattr(state, "deepspeed_plugin", None) is not None
              else "fsdp" if getattr(state, "fsdp_plugin", None) is not None else "plain")
    scaler = getattr(accelerator, "scaler", None) is not None
    rank = accelerator.process_index
    return ResumeLayout(rank, args.gradient_accumulation_steps, args.steps_per_generation, args.num_iterations,
                        required_files(rank, args.world_size, engine, args.save_only_model, scaler),
                        bool(getattr(args, "max_staleness", 0)))


def newest_checkpoint_name(args, accelerator) -> str | None:
    """The newest complete `checkpoint-N` folder of `args.output_dir` on this process (None: none, or no folder
    yet), which an error names as the one a resume would start from."""
    out = args.output_dir
    return newest_complete_checkpoint(out, layout_of(args, accelerator))[0] if os.path.isdir(out) else None


def _buffer_problem(folder: str, rank: int, needed: bool) -> DamagedCheckpointError | None:
    """Where the checkpoint falls inside a generation batch: its buffer is missing, or cut short or garbled (its zip
    directory, at the end of the file, does not read). Nothing is loaded here: `load_generation_buffer` reads the
    buffer once, when the run resumes."""
    path = buffer_path(folder, rank)
    if not needed:
        return None
    if not os.path.exists(path):
        return _missing_buffer(folder, path)
    try:
        with zipfile.ZipFile(path) as z:
            z.infolist()
    except (zipfile.BadZipFile, OSError, EOFError, ValueError) as err:
        return _damaged(folder, path, f"{type(err).__name__}: {err}")
    return None


def checkpoint_problem(folder: str, layout: ResumeLayout) -> DamagedCheckpointError | None:
    """Why `folder` cannot be resumed exactly by the run `layout` describes, or None when it is complete (see the
    module docstring for what that means and in which order it is checked)."""
    try:
        step = read_global_step(folder)
    except DamagedCheckpointError as err:
        return err
    needed = buffer_needed(step, layout.gradient_accumulation_steps, layout.steps_per_generation,
                           layout.num_iterations)
    problem = _buffer_problem(folder, layout.rank, needed)
    if problem is None and layout.ahead:
        problem = _ahead_problem(folder, layout.rank)
    if problem is not None:
        return problem
    for alternatives in layout.required:
        if not any(os.path.exists(os.path.join(folder, name)) for name in alternatives):
            path = os.path.join(folder, alternatives[0])
            others = f" (nor {', '.join(alternatives[1:])})" if len(alternatives) > 1 else ""
            without = _WITHOUT.get(alternatives, "silently change the random numbers from there on (Trainer skips a "
                                   "missing RNG file)")
            return DamagedCheckpointError(
                f"{path} is missing{others}, so {folder} is incomplete: resuming from it would {without}. Delete the "
                "folder and resume from the previous checkpoint (resume_from_checkpoint=True skips it).",
                path, f"is missing{others}",
            )
    return None


def newest_complete_checkpoint(output_dir: str, layout: ResumeLayout, gather=lambda obj: [obj]):
    """`(folder, skipped)`: the newest `checkpoint-N` of `output_dir` complete on every process (None if there is
    none), and `[(folder, DamagedCheckpointError)]` for each newer one skipped, newest first.

    `gather(obj)` returns every process's `obj` (`accelerate.utils.gather_object` under several processes): the
    processes agree on one step, each checking its own files (its buffer, its RNG state), even where their listings
    differ. Each round, every process finds its newest complete checkpoint at or below the candidate, and the
    candidate becomes the oldest of those; usually one round, one gather.
    """
    folders = {}
    for name in os.listdir(output_dir):
        m = CHECKPOINT_DIR.match(name)
        if m and os.path.isdir(os.path.join(output_dir, name)):
            folders[int(m.group(1))] = os.path.join(output_dir, name)
    problems = {}  # step -> DamagedCheckpointError or None, as this process found it

    def newest_at_or_below(limit):
        for step in sorted((s for s in folders if s <= limit), reverse=True):
            if step not in problems:
                problems[step] = checkpoint_problem(folders[step], layout)
            if problems[step] is None:
                return step
        return -1

    candidate = max(folders, default=-1)
    while True:
        found = gather(newest_at_or_below(candidate))
        if all(f == found[0] for f in found):
            break
        candidate = min(found)
    chosen = found[0]
    reported = {}
    for view in gather({s: (str(p), p.path, p.reason) for s, p in problems.items() if p is not None and s > chosen}):
        for step, problem in view.items():
            reported.setdefault(step, problem)  # the first process's account of each skipped checkpoint
    skipped = []
    for step in sorted(reported, reverse=True):
        message, path, reason = reported[step]
        skipped.append((os.path.join(output_dir, f"checkpoint-{step}"), DamagedCheckpointError(message, path, reason)))
    return (folders.get(chosen) if chosen >= 0 else None), skipped


def resolve_resume_checkpoint(args, accelerator, resume_from_checkpoint):
    """What `RPPTrainer.train` hands on to Trainer's `train`, decided before anything is loaded.

    - `True`: the newest checkpoint complete on every process (`newest_complete_checkpoint`). Each newer, torn one is
      skipped with a warning that names it and its damaged file. Checkpoints but none complete: Trainer's `ValueError`
      ("No valid checkpoint found"), naming each. No checkpoint at all: `True`, for Trainer's own error.
    - a folder: itself if complete; otherwise `DamagedCheckpointError`, naming the file and what to do."""
    layout, output_dir = layout_of(args, accelerator), args.output_dir
    if resume_from_checkpoint is True and os.path.isdir(output_dir):
        many = accelerator.num_processes > 1
        chosen, skipped = newest_complete_checkpoint(output_dir, layout, (lambda obj: gather_object([obj])) if many
                                                     else (lambda obj: [obj]))
        if chosen is None and skipped:
            raise ValueError(
                f"No valid checkpoint found in output directory ({output_dir}): no checkpoint there is complete ("
                f"{'; '.join(f'{p.path} {p.reason}' for _, p in skipped)}). Delete them to train from the start."
            )
        for folder, problem in skipped if accelerator.is_main_process else ():
            logger.warning("trl_rpp: resume_from_checkpoint=True skips %s, which is incomplete: %s %s. Resuming from "
                           "%s instead.", folder, problem.path, problem.reason, chosen)
        return True if chosen is None else chosen
    if isinstance(resume_from_checkpoint, (str, os.PathLike)):
        problem = checkpoint_problem(os.fspath(resume_from_checkpoint), layout)
        if problem is not None:
            raise problem
    return resume_from_checkpoint


def buffer_needed_at(args, step: int) -> bool:
    """`buffer_needed` at optimizer step `step` of a run with `args`."""
    return buffer_needed(step, args.gradient_accumulation_steps, args.steps_per_generation, args.num_iterations)


NOTHING_AHEAD = object()  # `save_checkpoint`'s `ahead` when the run samples no batch ahead (max_staleness=0)


def save_checkpoint(trainer, trial, save, ahead=NOTHING_AHEAD) -> None:
    """`RPPTrainer._save_checkpoint`: the buffered generation batch when a resume needs it (`buffer_needed`), before
    Trainer's files, so that a checkpoint with a `trainer_state.json` always has its buffer; then ``save()``, which is
    Trainer's `_save_checkpoint` (GRPO's). A failed write (`OSError`: a full disk, an I/O error) raises a
    `CheckpointSaveError` naming the folder and the checkpoint a resume would take. It takes TRL's trainer because it
    wraps `Trainer._save_checkpoint`, into the folder `Trainer._get_output_dir` names, and saves GRPO's buffered
    batch. With max_staleness=1, `ahead` is the batch in flight as `GenerationAhead.state` returns it (None: none
    in flight), awaited and settled by the caller, and saved too, before Trainer's files."""
    output_dir = checkpoint_folder_root(trainer, trial)
    args, acc = trainer.args, trainer.accelerator
    folder = os.path.join(output_dir, f"{PREFIX_CHECKPOINT_DIR}-{trainer.state.global_step}")
    needed = buffer_needed_at(args, trainer.state.global_step)
    buffered_inputs, position = generation_buffer(trainer)
    try:
        rank = acc.process_index
        if buffered_inputs is not None and needed:  # at a generation boundary a resume samples a new batch
            save_generation_buffer(folder, rank, position, buffered_inputs)
        if ahead is not NOTHING_AHEAD:
            save_ahead(folder, rank, ahead)
        if ahead is not NOTHING_AHEAD or (buffered_inputs is not None and needed):
            acc.wait_for_everyone()  # every buffer lands before rank 0 writes trainer_state.json
        save()
    except OSError as err:
        raise save_error(folder, err, output_dir, layout_of(args, acc)) from err


def resume_state(checkpoint: str, args, step: int, rank: int, device, ahead: bool):
    """On resume from `checkpoint`, at optimizer step `step`, on process `rank`: ``(buffer, in_flight)``, the saved
    generation batch ``(buffered_inputs, position)`` that a resumed run trains on where GRPO would sample a new one
    (None when the checkpoint is at a generation boundary), and with max_staleness=1 (`ahead`) the batch that was in
    flight, answered (`GenerationAhead.restore`; None otherwise)."""
    buffer = load_generation_buffer(checkpoint, rank, buffer_needed_at(args, step), device)
    return buffer, load_ahead(checkpoint, rank) if ahead else None
