"""Fixtures shared by the test files (helpers that scripts also import live in tests/trainer_helpers.py)."""

import os

import pytest

os.environ.setdefault("WANDB_MODE", "offline")


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """Path of the tiny random-init Llama of `trl_rpp.testing.tiny`, built once per session."""
    from trl_rpp.testing.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model")
