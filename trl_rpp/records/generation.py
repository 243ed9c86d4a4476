"""One generation batch's record: everything the sampler recorded for the batch, made at generation and carried with it.

`RPPTrainer` makes a `GenerationRecord` each time it samples a generation batch (`RPPTrainer._sample`, TRL's
`_generate`) and fills it as the sampler runs: one capture per `generate` call or engine answer, then the record
aligned to the completions' model tokens, the kept sets of a replayed truncation, the tie overflow, the engine's
failure and, once TRL has scored the completions, the raw rewards. TRL's hooks do not pass a batch to each other
(`_get_per_token_logps_and_entropies` and `_calculate_rewards` see tensors or prompts, not the batch), so the record
of the batch being generated or scored is found through a context variable (`recording`, `use_record`,
`current_record`), never through an attribute of the trainer: two batches alive at once, one scored while the next
is sampled, each see their own. Once scored, the record's tensors are batch keys (`trl_rpp.batch.sampler_batch_keys`)
that reach the loss, and the checkpoint with the buffered batch.
"""

from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass, field
from typing import Any

import torch

_CURRENT: contextvars.ContextVar[GenerationRecord | None] = contextvars.ContextVar("trl_rpp_generation_record",
                                                                                 default=None)


@dataclass
class GenerationRecord:
    """What the sampler recorded for one generation batch (``B`` local completions, ``T`` positions, ``k`` the record's
    width), and what TRL's scoring adds to it.

    Attributes:
        captures: one record per `generate` call or engine answer, in order (`trl_rpp.records.capture`): the first
            turn, then each iteration of TRL's tool loop.
        topk: the record at the completions' model tokens (a `SamplerTopKCapture`, `SamplerSupportCapture` or
            `RecordedTopK`; its ``tensors(T)`` gives ``[B, T, k]`` ids and log-probs and ``[B, T]`` sampled log-probs),
            or None without a record.
        support: ``[B, T, K]`` kept ids of a replayed truncating sampler (`trl_rpp.truncation.ABSENT`-padded), read by
            the old-policy and reference forwards, or None.
        tie_overflow: this process's positions whose kept set did not fit the record (`sampling/tie_overflow`).
        engine_faults: the vLLM engine's failures while sampling this batch (`trl_rpp.faults.engine.EngineFaults`),
            or None without vLLM.
        rewards_per_func: ``[B_global, n_reward_funcs]`` raw rewards, gathered, once TRL has scored the batch.
        weight_version: the optimizer step whose weights sampled the batch, or None where it was not recorded.
    """

    captures: list = field(default_factory=list)
    topk: Any = None
    support: torch.Tensor | None = None
    tie_overflow: int = 0
    engine_faults: Any = None
    rewards_per_func: torch.Tensor | None = None
    weight_version: int | None = None


@dataclass
class Generation:
    """One sampled generation batch, not yet scored: TRL's `_generate` output (its 8-tuple) and its record."""

    output: tuple
    record: GenerationRecord


@contextlib.contextmanager
def recording(record: GenerationRecord | None = None):
    """Make `record` (a new one by default) the current record for the duration of the block, and yield it; the
    record current before is current again afterwards, also when the block raises."""
    token = _CURRENT.set(GenerationRecord() if record is None else record)
    try:
        yield _CURRENT.get()
    finally:
        _CURRENT.reset(token)


def use_record(record: GenerationRecord) -> None:
    """Make `record` the current record for the rest of the enclosing `recording` block (a batch being scored takes
    the record its sampling made)."""
    if _CURRENT.get() is None:
        raise RuntimeError("use_record outside a recording block: nothing would carry the record")
    _CURRENT.set(record)


def current_record(what: str) -> GenerationRecord:
    """The record of the generation batch being sampled or scored; a `RuntimeError` naming `what` needs it outside
    one."""
    record = _CURRENT.get()
    if record is None:
        raise RuntimeError(f"{what} runs outside a generation batch: there is no sampler record to read or write")
    return record
