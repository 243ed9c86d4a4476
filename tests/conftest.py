"""Fixtures shared by the test files (helpers that scripts also import live in tests/trainer_helpers.py)."""

import os
import tempfile

import pytest

os.environ.setdefault("WANDB_MODE", "offline")
# SmolLM2's converted checkpoint (`trl_rpp.testing.assets`): a cache of the tests' own, shared by xdist workers and
# the subprocesses they start, never the user's ~/.cache/trl_rpp.
os.environ.setdefault("TRL_RPP_CACHE", os.path.join(tempfile.gettempdir(), "trl_rpp-test-cache"))


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """Path of the tiny random-init Llama of `trl_rpp.testing.tiny`, built once per session."""
    from trl_rpp.testing.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model")
