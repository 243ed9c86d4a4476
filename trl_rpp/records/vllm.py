"""vLLM's log-prob lists as the sampler's record: the sampled token's log-prob and the top-k (or kept set) entries.

With `logprobs=k`, vLLM returns the processed log-probs (after temperature, and with a truncating sampler `-inf`
outside the kept set) of the `k` most probable tokens at each position, plus the sampled token when it is not among
them. `parse_vllm_topk` splits TRL's lists into the two things the trainer reads, in numpy, without a Python loop
over positions.
"""

from __future__ import annotations

import itertools

import numpy as np
import torch

from .capture import RecordedTopK

# vLLM's OpenAI server writes a -inf log-prob (a token outside a truncating sampler's kept set) as -9999.0, since
# JSON has no -inf; no kept token's log-prob comes near it.
SERVER_NEG_INF = -9999.0


def parse_vllm_topk(completion_ids, logprobs, logprob_token_ids, k: int):
    """Split TRL's vLLM log-prob lists into the sampled token's log-prob and the sampler's top-k head.

    With `logprobs=k`, vLLM returns at each position the k most probable tokens plus, when it is not among them,
    the sampled token; TRL sorts each position's entries by rank (`extract_logprobs`), so entry 0 is the most
    probable token, *not* the sampled one. The sampled token's log-prob is therefore selected by id. NaN log-probs
    (`None` in TRL's lists) stay `None` for the sampled token (TRL turns them into NaN and neutralizes them) and
    become absent (`-inf`) entries of the head, as do a server's `-9999.0` (its `-inf`, `SERVER_NEG_INF`).

    Args:
        completion_ids: ``B`` lists of sampled token ids.
        logprobs: ``B x T_i x n`` lists (``n`` = k or k+1), sorted by rank.
        logprob_token_ids: the token ids of those entries, same shape.
        k: head size.

    Returns:
        ``(sampled, recorded)``: ``B`` lists of the sampled tokens' log-probs (float or `None`), and a
        `RecordedTopK` with ``[B, T_max, k]`` head ids and log-probs and ``[B, T_max]`` sampled log-probs.
    """
    if logprobs is None or logprob_token_ids is None:
        raise ValueError("score centering with vLLM needs the engine's log-probs; vLLM returned none")
    B = len(completion_ids)
    lengths = [len(c) for c in completion_ids]
    T = max(lengths, default=0)
    ids = torch.zeros(B, T, k, dtype=torch.long)
    head = torch.full((B, T, k), float("-inf"))
    sampled_t = torch.full((B, T), float("-inf"))

    # B * T * (k + 1) entries (67 M at B=512, T=4096, k=32) are too many for a Python loop: the Python work here is
    # per sequence, and every pass over positions or entries runs in C (map, chain, fromiter, numpy). The P valid
    # positions are laid end to end, their N entries too; position p owns entries [start[p], ends[p]).
    id_rows = _valid_positions(logprob_token_ids, lengths, "token ids")
    lp_rows = _valid_positions(logprobs, lengths, "log-probs")
    P = len(id_rows)
    n = np.fromiter(map(len, id_rows), np.int64, count=P)
    differ = n != np.fromiter(map(len, lp_rows), np.int64, count=P)
    if differ.any():  # entries are paired by their place in the flat arrays: one short list shifts all the rest
        b, t = _sequence_position(lengths, int(np.argmax(differ)))
        raise ValueError(f"vLLM's log-probs and token ids for sequence {b}, position {t} differ in length")
    ends = np.cumsum(n)
    start = ends - n
    N = int(ends[-1]) if P else 0
    entry_ids = np.fromiter(itertools.chain.from_iterable(id_rows), np.int64, count=N)
    entry_lps = np.fromiter(itertools.chain.from_iterable(lp_rows), np.float64, count=N)  # None -> NaN
    tokens = np.fromiter(itertools.chain.from_iterable(completion_ids), np.int64, count=P)

    # The sampled token's entry: the first one of its position whose id matches (hits come in entry order, so a
    # position's first hit is the first of its run).
    hit = np.flatnonzero(entry_ids == np.repeat(tokens, n))
    hit_pos = np.searchsorted(ends, hit, side="right")
    first = np.ones(hit.size, dtype=bool)
    first[1:] = hit_pos[1:] != hit_pos[:-1]
    hit = hit[first]
    if hit.size < P:  # name the first position without one, as a loop over (b, t) would
        found = np.zeros(P, dtype=bool)
        found[hit_pos[first]] = True
        b, t = _sequence_position(lengths, int(np.argmin(found)))
        raise ValueError(
            f"vLLM's log-probs for sequence {b}, position {t} do not include the sampled token {completion_ids[b][t]}; "
            "cannot select its log-prob"
        )
    chosen = entry_lps[hit]  # [P], float64: the values TRL holds, exactly

    # Head: each position's first k entries, gathered as a [P, k] block; slots past a position's n are absent.
    slot = np.arange(k)
    present = slot < n[:, None]
    src = np.where(present, start[:, None] + slot, 0)  # absent slots read entry 0, then are overwritten
    head_ids = entry_ids[src]
    head_ids[~present] = 0
    head_lps = entry_lps[src]
    head_lps[~present | np.isnan(head_lps) | (head_lps <= SERVER_NEG_INF)] = -np.inf

    # Rows of the [B * T] position grid that the P valid positions fill (all of them when no sequence is short).
    # Position t of sequence b is valid position p = seq_start[b] + t and grid row b * T + t.
    L = np.asarray(lengths, dtype=np.int64)
    seq_start = np.cumsum(L) - L
    rows = torch.from_numpy(np.arange(P) + np.repeat(np.arange(B) * T - seq_start, L))
    ids.view(B * T, k)[rows] = torch.from_numpy(head_ids)
    head.view(B * T, k)[rows] = torch.from_numpy(head_lps).to(head.dtype)  # one rounding float64 -> float32
    sampled_t.view(B * T)[rows] = torch.from_numpy(np.where(np.isnan(chosen), -np.inf, chosen)).to(sampled_t.dtype)

    # TRL builds a tensor from `sampled`: Python floats, None where vLLM gave NaN. astype(object) makes the floats
    # in C; the split into sequences is one slice per sequence.
    values = chosen.astype(object)
    values[np.isnan(chosen)] = None
    values = values.tolist()
    sampled = [values[s : s + length] for s, length in zip(seq_start.tolist(), lengths)]
    return sampled, RecordedTopK(ids, head, sampled_t)


def _valid_positions(per_sequence, lengths, what):
    """The first ``lengths[b]`` positions of every sequence, end to end, in one list (positions past a sequence's
    sampled tokens are ignored, as is a sequence with none)."""
    rows = []
    for b, length in enumerate(lengths):
        if length:
            positions = per_sequence[b]
            if len(positions) < length:
                raise IndexError(
                    f"vLLM's {what} for sequence {b} cover {len(positions)} positions, fewer than its {length} "
                    "sampled tokens"
                )
            rows.extend(positions if len(positions) == length else positions[:length])
    return rows


def _sequence_position(lengths, p: int):
    """(sequence, position) of the p-th valid position."""
    for b, length in enumerate(lengths):
        if p < length:
            return b, p
        p -= length
    raise IndexError(p)
