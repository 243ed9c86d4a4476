"""The tiny tool-calling model of `trl_rpp.testing.tool_model`, re-exported for the tests. The model itself comes
from the session fixture `tool_model` (tests/conftest.py): one build (~30 s) for all workers of a test session."""

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
