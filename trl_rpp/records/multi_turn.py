"""Multi-turn completions: the sampler's record at the model tokens, and the external-token mask checked against
its completion.

A multi-turn completion interleaves model tokens with tokens the model did not sample: tool results in TRL's tool
loop (`tools=` or `environment_factory=`), environment feedback in a `rollout_func` (its `env_mask`). Score centering
needs the sampler's top-k at every model token and nothing at the others, which are mask holes (``tool_mask = 0``)
that the loss removes by selection. Two sources:

* **TRL's tool loop.** `GRPOTrainer._tool_call_loop` calls `_generate_single_turn` once for the first turn and once
  per tool iteration on the rows that made a tool call (``num_generations=1``, prompt + completion + tool suffix as
  the new prompt), then concatenates: completion = turn 1 + tool tokens + post-tool turn (+ tool tokens + ...), the
  last post-tool turn cut to ``max_completion_length``. Each `generate` call's capture is recorded in call order;
  `align_turn_captures` places each call's rows at the model tokens of the final completions (`tool_mask` runs).
* **A `rollout_func`** returns the sampler's lists itself: ``logprobs`` and ``logprob_token_ids`` of ``k`` (or
  ``k + 1``) entries per token, as vLLM reports them with ``logprobs=k`` (`rollout_sampler_topk`).

At the holes the returned tensors hold id 0 and log-prob ``-inf`` (an absent entry, as for padding); the loss and
the metrics never read them (tests/test_multi_turn_score_centering.py puts NaN/Inf there and checks that nothing
changes).

**The external-token mask.** Both sources reach the batch as `tool_mask` (a `rollout_func`'s `env_mask`: 1 for a
model token, 0 for an external one), whose zeros `RPPTrainer` treats as internal mask holes (docs/numerics.md,
"Multi-turn rollouts"). TRL right-pads its rows with 1s to the padded completion length, so an `env_mask` row
shorter than its completion would silently turn its last tokens into model tokens, and a longer one would mark other
rows' padding or break the batch's shapes: `check_rollout_output` and `check_tool_loop_mask` check each row where the rollout output arrives,
before any reward or forward pass is spent.

Shapes: ``B`` final completions, ``T`` positions, ``k`` head entries; a turn's capture covers ``B_c <= B`` rows
and ``T_c`` generation steps.
"""

from __future__ import annotations

import numbers

import numpy as np
import torch

from .capture import RecordedTopK
from .vllm import parse_vllm_topk

__all__ = ["align_turn_captures", "check_external_mask", "check_rollout_output", "check_tool_loop_mask",
           "model_segments", "rollout_sampler_topk", "sampler_topk_of_generation"]


def model_segments(tool_mask_row) -> list[tuple[int, int]]:
    """``[(start, length), ...]`` of the model segments of one completion of TRL's tool loop, in turn order.

    TRL builds a row's mask as ``[1] * len(turn 1)`` then, per tool iteration the row took part in,
    ``[0] * len(tool suffix) + [1] * len(post-tool turn)``: segment 0 starts at 0, and each run of zeros (one tool
    iteration, never empty) is followed by the next segment, which may be empty (a post-tool turn cut to nothing).
    """
    m = np.asarray(tool_mask_row, dtype=np.int8).reshape(-1)
    zero = m == 0
    if not zero.any():
        return [(0, int(m.size))]
    edge = np.diff(np.concatenate([[0], zero.astype(np.int8), [0]]))
    starts, ends = np.flatnonzero(edge == 1), np.flatnonzero(edge == -1)  # each run of zeros is [start, end)
    bounds = [0, *ends.tolist()]
    stops = [*starts.tolist(), int(m.size)]
    return [(s, e - s) for s, e in zip(bounds, stops)]


def align_turn_captures(turns, tool_mask) -> RecordedTopK:
    """Place each `generate` call's top-k at the model tokens of the final completions of TRL's tool loop.

    Args:
        turns: one ``(head_ids [B_c, T_c, k], head_logps [B_c, T_c, k], sampled_logps [B_c, T_c])`` per `generate`
            call, in call order: call 0 generated every row's first turn; call ``c >= 1`` (tool iteration ``c``)
            generated, in row order, the rows whose completion has at least ``c`` tool results (a row leaves the loop
            for good, so those are exactly the rows TRL regenerated in that iteration).
        tool_mask: ``B`` lists of 0/1, TRL's tool mask of the final completions (before any truncation masking).

    Returns:
        `RecordedTopK` with ``[B, T, k]`` ids and log-probs and ``[B, T]`` sampled log-probs, ``T`` the longest
        completion: model segment ``c`` of row ``b`` holds its call's first ``length`` steps (TRL's cut of a
        post-tool turn keeps its first tokens); tool positions and padding hold id 0 and ``-inf``.

    Raises:
        ValueError: when the calls' rows or lengths do not match the tool mask (a loop this function does not
            model), instead of pairing heads with the wrong tokens.
    """
    if not turns:
        raise ValueError("score centering: no `generate` call was recorded for the tool loop's completions")
    B = len(tool_mask)
    T = max((len(row) for row in tool_mask), default=0)
    k = turns[0][0].size(-1)
    ids = torch.zeros(B, T, k, dtype=torch.long)
    logps = torch.full((B, T, k), float("-inf"))
    sampled = torch.full((B, T), float("-inf"))
    segments = [model_segments(row) for row in tool_mask]
    for c, (turn_ids, turn_logps, turn_sampled) in enumerate(turns):
        rows = [b for b in range(B) if len(segments[b]) > c]  # the rows this call generated, in order
        if turn_ids.size(0) != len(rows):
            raise ValueError(
                f"score centering: generate call {c} of the tool loop sampled {turn_ids.size(0)} rows, but {len(rows)} "
                f"completions have a model segment {c} in their tool_mask"
            )
        for i, b in enumerate(rows):
            start, n = segments[b][c]
            if n > turn_ids.size(1):
                raise ValueError(
                    f"score centering: completion {b} has {n} model tokens in turn {c}, more than the {turn_ids.size(1)} "
                    "steps its generate call recorded"
                )
            ids[b, start : start + n] = turn_ids[i, :n]
            logps[b, start : start + n] = turn_logps[i, :n].to(logps.dtype)
            sampled[b, start : start + n] = turn_sampled[i, :n].to(sampled.dtype)
    return RecordedTopK(ids, logps, sampled)


def rollout_sampler_topk(completion_ids, logprobs, logprob_token_ids, env_mask, k: int):
    """The sampled tokens' log-probs and the sampler's head from a `rollout_func`'s top-k lists.

    The contract (docs/score_centering.md, "Multi-turn rollouts"): at every model token (``env_mask = 1``, or every
    token without an ``env_mask``) ``logprobs[b][t]`` and ``logprob_token_ids[b][t]`` are lists of ``k`` entries
    (``k = score_centering_top_k``), or ``k + 1`` when the sampled token is not among the ``k`` most probable, sorted
    by rank, as TRL's vLLM generation returns them with ``logprobs=k``; the sampled token's own entry must be there
    (its log-prob is selected by id). At environment tokens (``env_mask = 0``) the lists are ignored: any content,
    ``[]`` included.

    Args:
        completion_ids: ``B`` lists of token ids.
        logprobs: ``B x T_b x n`` log-probs (``None`` for NaN, as TRL's vLLM lists).
        logprob_token_ids: ``B x T_b x n`` token ids, or ``None`` (rejected).
        env_mask: ``B`` lists of 0/1, or ``None`` (every token is a model token).
        k: the head size.

    Returns:
        ``(sampled, recorded)``: ``B`` lists of the sampled tokens' log-probs (0.0 at environment tokens, as TRL's tool
        loop writes there; `None` for NaN), which replace the rollout's ``logprobs`` for TRL; and a `RecordedTopK`
        (``[B, T, k]``, ``[B, T]``) whose environment positions hold id 0 and ``-inf``.

    Raises:
        ValueError: naming `rollout_func` and `logprob_token_ids`, when the lists are missing or not ``k`` wide at a
            model token.
    """
    needed = (
        f"with score_centering=True, rollout_func must return the sampler's top-k per token: 'logprob_token_ids' next "
        f"to 'logprobs', both B x T x n lists with n = score_centering_top_k = {k} entries per model token (or {k + 1} "
        "with the sampled token when it is not among them), sorted by rank, as vLLM returns them with logprobs=k"
    )
    if logprob_token_ids is None:
        raise ValueError(f"{needed}; it returned no 'logprob_token_ids'.")
    if len(logprobs) != len(completion_ids) or len(logprob_token_ids) != len(completion_ids):
        raise ValueError(
            f"{needed}; it returned {len(completion_ids)} completions but {len(logprobs)} 'logprobs' and "
            f"{len(logprob_token_ids)} 'logprob_token_ids' rows."
        )
    lp_rows, id_rows = [], []
    for b, tokens in enumerate(completion_ids):
        n = len(tokens)
        lps, tids = logprobs[b][:n], logprob_token_ids[b][:n]
        if len(lps) < n or len(tids) < n:
            raise ValueError(f"{needed}; completion {b} has {n} tokens but shorter per-token lists.")
        if env_mask is not None:  # environment tokens: no sampler there, a placeholder that the head then drops
            lps = [lp if m else [0.0] for lp, m in zip(lps, env_mask[b])]
            tids = [tid if m else [token] for tid, m, token in zip(tids, env_mask[b], tokens)]
        model = np.ones(n, dtype=bool) if env_mask is None else np.asarray(env_mask[b][:n], dtype=bool)
        width = np.fromiter(map(_width, lps), np.int64, count=n)
        id_width = np.fromiter(map(_width, tids), np.int64, count=n)
        bad = model & (((width != k) & (width != k + 1)) | (id_width != width))
        if bad.any():
            t = int(np.argmax(bad))
            got = f"{width[t]} entries" if width[t] >= 0 else f"a {type(lps[t]).__name__}"
            raise ValueError(
                f"{needed}; completion {b}, token {t} has {got} in 'logprobs' and "
                f"{id_width[t] if id_width[t] >= 0 else 'no list'} in 'logprob_token_ids'."
            )
        lp_rows.append(lps)
        id_rows.append(tids)
    try:
        sampled, recorded = parse_vllm_topk(completion_ids, lp_rows, id_rows, k)
    except ValueError as e:  # e.g. the sampled token is missing from its position's entries
        raise ValueError(f"{needed}; {e}") from e
    if env_mask is not None:
        T = recorded.ids.size(1)
        hole = torch.tensor([list(row[:T]) + [1] * (T - len(row[:T])) for row in env_mask], dtype=torch.long) == 0
        recorded.ids[hole] = 0
        recorded.logps[hole] = float("-inf")
        recorded.sampled[hole] = float("-inf")
        sampled = [[0.0 if not m else v for v, m in zip(row, mask)] for row, mask in zip(sampled, env_mask)]
    return sampled, recorded


def _width(entries) -> int:
    """Entries at one position; -1 for a non-list (e.g. a single float, TRL's plain `logprobs`)."""
    return len(entries) if isinstance(entries, (list, tuple)) else -1


def sampler_topk_of_generation(generated, captures, k, rollout_func: bool, tools: bool):
    """The sampler's `k`-wide record (top-k or kept set) at the model tokens of GRPO's `_generate` output
    ``generated`` (its 8-tuple), from ``captures``, the record of each `generate` call or engine answer in order.

    Returns ``(generated, capture)``: with a `rollout_func` (``rollout_func`` True), its ``logprobs`` (top-k lists,
    `rollout_sampler_topk`) replaced by the sampled tokens' log-probs that TRL expects, and a `RecordedTopK`;
    otherwise ``generated`` unchanged and the one call's capture, or, after TRL's tool loop (``tools`` True), the
    calls' captures aligned to the final completions (`align_turn_captures`). ``capture.tensors(T)`` gives the batch
    tensors.
    """
    prompt_ids, completion_ids, tool_mask, completions, logprobs, extra_fields, images, tool_images = generated
    if rollout_func:
        sampled, recorded = rollout_sampler_topk(
            completion_ids, logprobs, extra_fields.get("logprob_token_ids"), tool_mask, k
        )
        return (prompt_ids, completion_ids, tool_mask, completions, sampled, extra_fields, images, tool_images), recorded
    if not tools:
        return generated, captures[0]
    turns = [c.tensors(len(c.ids) if isinstance(c.ids, list) else c.ids.size(1)) for c in captures]
    return generated, align_turn_captures(turns, tool_mask)


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


def check_tool_loop_mask(tool_mask, completion_ids) -> None:
    """What TRL's tool-calling loop returns, checked where it arrives (`trl_rpp.patches.check_rollouts`): one
    `tool_mask` entry per completion token. The loop aligns them by construction; this asserts it."""
    check_external_mask(tool_mask, completion_ids, "tool_mask", "TRL's tool-calling loop")
