"""RPPTrainer under `accelerate launch` with 2 CPU processes (gloo): groups straddle processes and the
normalization covers the global population. Each rank's advantages are compared with the float64 reference
computed on the concatenation of both ranks' data. Every case runs in the suite's one two-process launch
(`two_process_runs`, tests/conftest.py)."""

import pytest
import torch

from dist_trainer_script import CASES, ESTIMATORS
from reference import ref_global_masked_normalize, ref_group_mean_advantages, ref_reinforce_pp_returns


@pytest.fixture
def runs(two_process_runs):
    """(estimator, mode) -> both ranks' records of that case (tests/support/dist_trainer_script.py)."""
    outdir = two_process_runs / "trainer"
    return {tuple(case.split(":")): [torch.load(outdir / f"{case.replace(':', '-')}-rank{r}.pt", weights_only=False)
                                     for r in range(2)] for case in CASES}


def test_two_process_deferred_returns_match_global_reference(runs):
    """REINFORCE++ with steps_per_generation=1 builds its returns inside the loss: still normalized over both ranks."""
    ranks = runs["reinforce_plus_plus", "deferred"]
    assert len(ranks[0]["loss_inputs"]) == len(ranks[1]["loss_inputs"]) == 2
    for step in range(2):
        inputs = [r["loss_inputs"][step] for r in ranks]
        assert all("rpp_rewards" in x for x in inputs)
        raws = [
            ref_reinforce_pp_returns(
                x["rpp_rewards"].double().tolist(), x["old_per_token_logps"].double().tolist(),
                x["ref_per_token_logps"].double().tolist(), x["rpp_mask"].tolist(), 0.05, 0.9,
            )
            for x in inputs
        ]
        want, _, _, _ = ref_global_masked_normalize(raws, [x["rpp_mask"].tolist() for x in inputs])
        for r, x in enumerate(inputs):
            torch.testing.assert_close(x["advantages"].double(), torch.tensor(want[r], dtype=torch.float64),
                                       rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("estimator", ESTIMATORS)
def test_two_process_advantages_match_global_reference(runs, estimator):
    ranks = runs[estimator, "groups"]
    assert ranks[0]["backend"] == "gloo"

    differs = []
    for g in range(len(ranks[0]["batches"])):
        batches = [r["batches"][g] for r in ranks]
        rpf = ranks[0]["rewards"][g]
        assert torch.equal(rpf, ranks[1]["rewards"][g]), "both ranks see the same gathered rewards"
        assert rpf.shape[0] == 8
        rewards = [rpf[i, 0].item() + 0.5 * rpf[i, 1].item() for i in range(8)]
        masks = [b["completion_mask"].tolist() for b in batches]
        if estimator == "reinforce_plus_plus":
            raws = [
                ref_reinforce_pp_returns(
                    rewards[4 * r : 4 * r + 4],
                    b["old_per_token_logps"].double().tolist(),
                    b["ref_per_token_logps"].double().tolist(),
                    masks[r],
                    0.05,
                    0.9,
                )
                for r, b in enumerate(batches)
            ]
        else:
            # One group of 8 spans both ranks: the baseline needs all 8 rewards.
            T = max(len(m[0]) for m in masks)
            padded = [row + [0] * (T - len(row)) for m in masks for row in m]
            full = ref_group_mean_advantages(rewards, padded, 8)
            raws = [[row[: len(masks[r][0])] for row in full[4 * r : 4 * r + 4]] for r in range(2)]
        want, _, _, count = ref_global_masked_normalize(raws, masks)
        assert count == sum(sum(sum(row) for row in m) for m in masks)
        for r, b in enumerate(batches):
            torch.testing.assert_close(
                b["advantages"].double(), torch.tensor(want[r], dtype=torch.float64), rtol=1e-5, atol=1e-5
            )
        # Normalizing rank 0 on its own gives a different answer, so the check above is not vacuous.
        local, _, _, _ = ref_global_masked_normalize([raws[0]], [masks[0]])
        differs.append(any(abs(a - c) > 1e-4 for ra, rc in zip(local[0], want[0]) for a, c in zip(ra, rc)))
    assert any(differs)
    # Metrics are reduced across processes: both ranks log the same numbers.
    logs = [[h for h in r["logs"] if "advantages/valid_tokens" in h] for r in ranks]
    assert logs[0] and [h["advantages/valid_tokens"] for h in logs[0]] == [h["advantages/valid_tokens"] for h in logs[1]]


@pytest.mark.parametrize("estimator", ESTIMATORS)
def test_fully_masked_process_joins_the_collective_and_trains_on_zeros(runs, estimator):
    """mask_truncated_completions=True and every completion of rank 0 truncated: rank 0 gets zero advantages,
    rank 1 the normalization of its own tokens (the whole global population), and training completes."""
    ranks = runs[estimator, "mask_truncated"]
    empty_seen = False
    # One micro-batch per generation: the loss inputs carry the advantages the loss used (both code paths).
    for b0, b1 in zip(ranks[0]["loss_inputs"], ranks[1]["loss_inputs"]):
        if not b0["completion_mask"].any():
            empty_seen = True
            assert torch.equal(b0["advantages"], torch.zeros_like(b0["advantages"]))
            m1 = b1["completion_mask"].bool()
            assert m1.any() and torch.isfinite(b1["advantages"]).all()
    assert empty_seen, "rank 0 never had an all-masked batch; the set-up did not do its job"


def test_two_process_replayed_gradient_equals_the_float64_reference(runs, tiny_model):
    """top_k=6, top_p=0.9 replayed, with score centering and the k2 loss, one group of 8 across both processes: the
    gradient each rank steps with (after DDP's all-reduce) is the float64 reference's over all 8 responses, every
    log-prob read over each token's recorded kept set (tests/test_replay.py). Rank 0 starts the step holding dense
    zero gradients, so its head gradient arrives sparse and is added into `.grad` in place, under DDP's hooks; rank
    1's arrives dense (tests/support/dist_trainer_script.py); every `.grad` DDP reduced is dense."""
    from transformers import AutoModelForCausalLM

    from test_replay import ref_step_loss

    ranks = runs["reinforce_plus_plus_baseline", "replay"]
    assert [len(r["grads"]) for r in ranks] == [1, 1] and all(len(r["loss_inputs"]) == 1 for r in ranks)
    assert [r["head_grad_layouts"] for r in ranks] == [[torch.sparse_coo], [torch.strided]]
    assert all(g.layout == torch.strided for r in ranks for g in r["grads"][0].values())
    for name, g in ranks[0]["grads"][0].items():
        assert torch.equal(g, ranks[1]["grads"][0][name]), name  # all-reduced: the same on both ranks
    args = ranks[0]["args"]
    model64 = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float64)
    model64.train()
    ref_step_loss(model64, [r["loss_inputs"][0] for r in ranks], args).backward()
    want = {n: p.grad for n, p in model64.named_parameters() if p.grad is not None}
    assert set(want) == set(ranks[0]["grads"][0])
    for name, g in ranks[0]["grads"][0].items():
        torch.testing.assert_close(g.double(), want[name], rtol=1e-4, atol=1e-6, msg=name)
    # Each rank alone is not the reference: the check above needs both ranks' responses.
    alone = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float64)
    ref_step_loss(alone, [ranks[0]["loss_inputs"][0]], args).backward()
    assert any(not torch.allclose(p.grad, want[n], rtol=1e-3, atol=1e-5) for n, p in alone.named_parameters())


def test_two_process_lora_head_gradient_equals_the_float64_reference(runs, tiny_model):
    """The replay case with a LoRA adapter on lm_head (and attention): the adapter's gradient each rank steps with
    (after DDP's all-reduce) is that of the float64 reference on PEFT's own full logits over both ranks' responses."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from dist_trainer_script import LORA_HEAD
    from test_replay import ref_step_loss

    ranks = runs["reinforce_plus_plus_baseline", "lora_head"]
    assert [len(r["grads"]) for r in ranks] == [1, 1]
    grads = ranks[0]["grads"][0]
    assert {n for n in grads if "lm_head" in n} == {"base_model.model.lm_head.lora_A.default.weight",
                                                    "base_model.model.lm_head.lora_B.default.weight"}
    for name, g in grads.items():
        assert torch.equal(g, ranks[1]["grads"][0][name]), name  # all-reduced: the same on both ranks
    model64 = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float64),
                             LoraConfig(**LORA_HEAD))
    with torch.no_grad():
        for name, p in model64.named_parameters():
            if p.requires_grad:
                p.copy_(ranks[0]["init"][name])
    model64.train()
    ref_step_loss(model64, [r["loss_inputs"][0] for r in ranks], ranks[0]["args"]).backward()
    want = {n: p.grad for n, p in model64.named_parameters() if p.grad is not None}
    assert set(want) == set(grads)
    assert grads["base_model.model.lm_head.lora_B.default.weight"].abs().max() > 0
    for name, g in grads.items():
        torch.testing.assert_close(g.double(), want[name], rtol=1e-4, atol=1e-6, msg=name)
