"""Faults at given points of a checkpoint's write, for tests/support/resume_script.py (a real SIGKILL, or a pause for a
signal) and for in-process tests (an OSError such as a full disk). Importing it changes nothing."""

import io
import os
import signal
import sys

import torch

KILL_POINTS = {
    "buffer_start": "torch.save of the generation buffer entered, nothing of it written",
    "buffer_half": "half of the generation buffer's bytes written",
    "model_start": "Trainer.save_model entered (checkpoint model not written)",
    "rng_start": "Trainer._save_rng_state entered (model and optimizer written, no RNG state or trainer_state.json)",
    "state_half": "half of trainer_state.json written",
    "rotate_start": "rotate_checkpoints entered (trainer_state.json written: the checkpoint is complete)",
}



def install_kill(point, step, trainer, action=None, patch=setattr):
    """SIGKILL this process at `point` of the write of checkpoint-`step` (or call `action` there instead: a pause, or
    a raised OSError). The real code runs up to that point: the bytes on disk are a real prefix of what would have been
    written. `patch(owner, name, value)` installs each wrapper (in-process tests pass `monkeypatch.setattr`, which
    undoes them)."""
    import transformers.trainer as hf_trainer
    from transformers import Trainer, TrainerState

    def due():
        return trainer.state.global_step == step

    def die():
        sys.stderr.flush()
        if action is not None:
            return action()
        os.kill(os.getpid(), signal.SIGKILL)

    real_save = torch.save

    def save(obj, f, *args, **kwargs):
        name = str(f if isinstance(f, (str, os.PathLike)) else getattr(f, "name", ""))
        if due() and "rpp_generation_buffer" in name and point in ("buffer_start", "buffer_half"):
            if point == "buffer_half":
                data = io.BytesIO()
                real_save(obj, data, *args, **kwargs)
                data = data.getvalue()
                out = open(f, "wb") if isinstance(f, (str, os.PathLike)) else f
                out.write(data[: len(data) // 2])
                out.flush()
            die()
        return real_save(obj, f, *args, **kwargs)

    patch(torch, "save", save)

    def entering(cls_or_module, attr, name):
        real = getattr(cls_or_module, attr)

        def wrapped(*args, **kwargs):
            if due() and point == name:
                die()
            return real(*args, **kwargs)

        patch(cls_or_module, attr, wrapped)

    entering(Trainer, "save_model", "model_start")
    entering(Trainer, "_save_rng_state", "rng_start")
    entering(hf_trainer, "rotate_checkpoints", "rotate_start")

    real_state_save = TrainerState.save_to_json

    def state_save(self, json_path):
        if due() and point == "state_half":
            real_state_save(self, json_path)
            text = open(json_path).read()
            with open(json_path, "w") as f:
                f.write(text[: len(text) // 2])
            die()
        return real_state_save(self, json_path)

    patch(TrainerState, "save_to_json", state_save)
