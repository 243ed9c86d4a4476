"""The tiny tool-calling model of `trl_rpp.testing.tool_model` for tests: `build_tool_model` plus a session fixture.

Import the fixture into a test module (``from tool_model import tool_model  # noqa: F401``); every module that does
shares one build per test session (a fixed folder under pytest's base temp), so the ~30 s warm-up runs once.
"""

import pytest

from trl_rpp.testing.tool_model import (  # noqa: F401  (re-exported for the tests)
    GREETING,
    PAIRS,
    MultiplyEnv,
    build_tool_model,
    correct_product_reward,
    multiply,
    question,
    tool_call_text,
    tool_dataset,
    tool_tokenizer,
)


@pytest.fixture(scope="session")
def tool_model(tmp_path_factory):
    """Path of the warmed-up tool-calling model, built once per session."""
    return build_tool_model(tmp_path_factory.getbasetemp() / "tool_model")
