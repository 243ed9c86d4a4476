"""Multi-turn rollouts: the external-token mask must line up with its completion, token for token.

TRL's `GRPOTrainer` builds multi-turn completions three ways: its tool-calling loop (`tools=[...]`,
`environment_factory`) and a user `rollout_func`, whose optional `env_mask` marks each completion token as the
model's (1) or external (0: environment feedback, tool output). Both reach the batch as `tool_mask`, and `RPPTrainer`
treats its zeros as internal mask holes (docs/numerics.md, "Multi-turn rollouts"). TRL right-pads the rows of that
mask with 1s to the padded completion length, so an `env_mask` row shorter than its completion would silently turn
its last tokens into model tokens, and a longer one would mark other rows' padding or break the batch's shapes. The
check runs where the rollout output arrives, right after the rollout, before any reward or forward pass is spent.
"""

from __future__ import annotations

import functools
import numbers

import torch

__all__ = ["check_external_mask", "check_rollout_output", "checked_rollout_func", "install_rollout_checks"]


def _row(x) -> list:
    return x.tolist() if torch.is_tensor(x) else list(x)


def check_external_mask(mask_rows, completion_ids, field: str, source: str) -> None:
    """Raise a `ValueError` unless `mask_rows` has one row per completion, each as long as its completion's token ids,
    with values 0 (external token) or 1 (model token) only. `field` and `source` name the mask and what produced it
    in the message. Host-side lists only (what a rollout returns), before TRL turns them into tensors."""
    if len(mask_rows) != len(completion_ids):
        raise ValueError(
            f"{source} returned {len(mask_rows)} {field} rows for {len(completion_ids)} completions: {field} needs one "
            "row per row of completion_ids."
        )
    for i, (mask, ids) in enumerate(zip(mask_rows, completion_ids)):
        mask = _row(mask)
        if len(mask) != len(ids):
            raise ValueError(
                f"{source} returned {field} row {i} of length {len(mask)} for completion_ids row {i} of length "
                f"{len(ids)}: each {field} row must have one entry per completion token. TRL pads {field} with 1s, so "
                "a shorter row would silently turn external tokens into model tokens."
            )
        bad = sorted({repr(v) for v in mask if not (isinstance(v, numbers.Real) and v in (0, 1))})
        if bad:
            raise ValueError(
                f"{source} returned {field} row {i} holding {', '.join(bad)}: accepted values are 1 (a token the model "
                "generated) and 0 (an external token: environment feedback or tool output)."
            )


def check_rollout_output(output) -> None:
    """Check a `rollout_func` output's `env_mask` (when present) and `logprobs` rows against `completion_ids`. Missing
    required keys are left to TRL's own error, raised right after."""
    if not isinstance(output, dict) or "completion_ids" not in output:
        return
    completion_ids = output["completion_ids"]
    if output.get("env_mask") is not None:
        check_external_mask(output["env_mask"], completion_ids, "env_mask", "rollout_func")
    logprobs = output.get("logprobs")
    if logprobs is not None:
        if len(logprobs) != len(completion_ids):
            raise ValueError(
                f"rollout_func returned {len(logprobs)} logprobs rows for {len(completion_ids)} completions: logprobs "
                "needs one row per row of completion_ids."
            )
        for i, (lp, ids) in enumerate(zip(logprobs, completion_ids)):
            if len(lp) != len(ids):
                raise ValueError(
                    f"rollout_func returned logprobs row {i} of length {len(lp)} for completion_ids row {i} of "
                    f"length {len(ids)}: one log-prob per completion token (0.0 at external tokens)."
                )


def checked_rollout_func(rollout_func):
    """`rollout_func`, with its output checked by `check_rollout_output` on every call (None stays None)."""
    if rollout_func is None:
        return None

    @functools.wraps(rollout_func)
    def rollout_func_checked(prompts, trainer):
        output = rollout_func(prompts, trainer)
        check_rollout_output(output)
        return output

    return rollout_func_checked


def install_rollout_checks(trainer) -> None:
    """At construction: check every `rollout_func` output, and assert that TRL's tool-calling loop (aligned by
    construction) returns one `tool_mask` entry per completion token."""
    trainer.rollout_func = checked_rollout_func(trainer.rollout_func)
    if not trainer.tools:
        return
    tool_call_loop = trainer._tool_call_loop

    @functools.wraps(tool_call_loop)
    def tool_call_loop_checked(*args, **kwargs):
        out = tool_call_loop(*args, **kwargs)
        tool_mask, _, completion_ids = out[:3]
        check_external_mask(tool_mask, completion_ids, "tool_mask", "TRL's tool-calling loop")
        return out

    trainer._tool_call_loop = tool_call_loop_checked
