"""The buffered generation batch in a checkpoint: written so that a kill at any point of a checkpoint's write leaves
either a checkpoint that resumes exactly, or one that is refused with the damaged file named.

With `steps_per_generation > 1` or `num_iterations > 1`, several optimizer steps train on one buffered generation
batch, so a checkpoint that falls inside such a batch needs it to continue exactly. `transformers.Trainer` writes a
checkpoint's files straight into `checkpoint-N/` (no temporary folder, no rename), `trainer_state.json` last, and
resuming reads that file. So:

- the buffer is written *before* Trainer's files, to a temporary name and then `os.replace`d into place: a
  checkpoint whose `trainer_state.json` exists has its complete buffer (the buffer never needs repairing);
- before resuming, `check_resumable` refuses a checkpoint whose `trainer_state.json` is missing or unreadable (the
  write was interrupted), and one that falls inside a generation batch but whose buffer is missing or unreadable,
  each time naming the file and saying what to do.
"""

from __future__ import annotations

import json
import os

import torch

BUFFER_FILE = "rpp_generation_buffer_rank{}.pt"
TRAINER_STATE_FILE = "trainer_state.json"  # transformers.trainer.TRAINER_STATE_NAME, written last by Trainer


class DamagedCheckpointError(RuntimeError):
    """A checkpoint that cannot be resumed exactly; the message names the file and what to do."""


def buffer_path(folder: str, rank: int) -> str:
    return os.path.join(folder, BUFFER_FILE.format(rank))


def save_generation_buffer(folder: str, rank: int, step: int, buffered_inputs) -> str:
    """Write this process's buffered generation batch and micro-step counter to `folder`, atomically.

    Tensors and numbers only, so that loading never needs unrestricted pickle (`weights_only=True`). The bytes go to
    a temporary file that is flushed to disk and then renamed over the final name: a kill leaves either no buffer
    file or a complete one, never a partial file under the final name. Returns the final path.
    """
    os.makedirs(folder, exist_ok=True)
    state = {
        "step": step,
        "buffer": [
            {k: v for k, v in batch.items() if torch.is_tensor(v) or isinstance(v, (int, float))}
            for batch in buffered_inputs
        ],
    }
    path = buffer_path(folder, rank)
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return path


def buffer_needed(
    global_step: int, gradient_accumulation_steps: int, steps_per_generation: int, num_iterations: int
) -> bool:
    """True when a checkpoint at optimizer step `global_step` falls inside a generation batch: GRPO's micro-step
    counter (`global_step * gradient_accumulation_steps`) is then not a multiple of
    `steps_per_generation * num_iterations`, and resuming without the buffer would sample a new batch there."""
    return (global_step * gradient_accumulation_steps) % (steps_per_generation * num_iterations) != 0


def _incomplete(folder: str, problem: str) -> DamagedCheckpointError:
    parent = os.path.dirname(os.path.abspath(folder))
    return DamagedCheckpointError(
        f"{os.path.join(folder, TRAINER_STATE_FILE)} {problem}: this checkpoint was not completely written (the "
        f"process stopped while saving it; Trainer writes {TRAINER_STATE_FILE} last). Delete the folder {folder} "
        f"and resume again: resume_from_checkpoint=True then continues from the newest complete checkpoint in "
        f"{parent}, with the same numbers as an uninterrupted run."
    )


def read_global_step(folder: str) -> int:
    """The `global_step` recorded in `folder/trainer_state.json`; `DamagedCheckpointError` when it is missing or
    unreadable."""
    path = os.path.join(folder, TRAINER_STATE_FILE)
    if not os.path.isfile(path):
        raise _incomplete(folder, "is missing")
    try:
        with open(path, encoding="utf-8") as f:
            return int(json.load(f)["global_step"])
    except (ValueError, KeyError, TypeError) as err:  # JSONDecodeError is a ValueError
        raise _incomplete(folder, f"cannot be read ({type(err).__name__}: {err})") from err


def load_generation_buffer(folder: str, rank: int, required: bool, map_location=None):
    """`(buffered_inputs, step)` from `folder`, or None when there is no buffer file and none is `required`.

    Raises `DamagedCheckpointError` naming the file when it is unreadable, or missing although `required` (the
    checkpoint falls inside a generation batch, see `buffer_needed`).
    """
    path = buffer_path(folder, rank)
    if not os.path.exists(path):
        if not required:
            return None
        raise DamagedCheckpointError(
            f"{path} is missing, but {folder} falls inside a generation batch (steps_per_generation or "
            "num_iterations > 1), and resuming there without the buffered batch would sample a new one and "
            "silently change the run. The checkpoint was written without it (by an older version of trl_rpp, or the "
            "file was removed). Resume from an earlier checkpoint that has its buffer, or at a generation boundary."
        )
    # torch.load has no restore rule for an indexed CPU device ("cpu:0"), which is accelerator.device in a
    # multi-process CPU run (MULTI_CPU): the file would be reported damaged. Plain "cpu" is the same device.
    if isinstance(map_location, (str, torch.device)) and torch.device(map_location).type == "cpu":
        map_location = "cpu"
    try:
        state = torch.load(path, map_location=map_location, weights_only=True)
        return state["buffer"], int(state["step"])
    except Exception as err:  # torch raises OSError, RuntimeError, EOFError, UnpicklingError... for a damaged file
        # Only torch's first sentence: the rest can advise weights_only=False, which is not the fix here.
        reason = (str(err).strip().splitlines() or [""])[0].split(". ")[0][:160]
        raise DamagedCheckpointError(
            f"{path} is damaged and cannot be read ({type(err).__name__}: {reason}). Delete the folder {folder} and "
            "resume from the previous checkpoint."
        ) from err


def check_resumable(folder: str, rank: int, gradient_accumulation_steps: int, steps_per_generation: int,
                    num_iterations: int) -> None:
    """Refuse, before anything is loaded, a checkpoint that cannot continue exactly (see the module docstring)."""
    step = read_global_step(folder)
    required = buffer_needed(step, gradient_accumulation_steps, steps_per_generation, num_iterations)
    load_generation_buffer(folder, rank, required, map_location="cpu")
