"""Multi-turn rollouts through RPPTrainer: what each estimator does at environment tokens (`env_mask` 0, TRL's
`tool_mask`), against the float64 reference (`tests/support/reference.py`).

The rollout is `tests/support/multi_turn_script.py`'s `rollout_func`: two model turns, each sampled by the tiny model's
`generate`, the second conditioned on the prompt, the first turn and 1-3 environment tokens between them, plus one
environment token after the last turn on every other completion. The model-token mask of every check is
rebuilt from the rollout's own `env_mask`, never read from the trainer's batch.
"""


import pytest
import torch

from multi_turn_script import ESTIMATOR_KW, MultiTurnTrainer, RecordedRollout, build
from reference import (
    ref_global_masked_normalize,
    ref_group_mean_advantages,
    ref_reinforce_pp_returns,
    ref_response_mean_k2_loss,
    ref_response_mean_ppo_loss,
)
from trainer_helpers import initial_model_logps, make_args
from trl_rpp.records.multi_turn import check_external_mask

TOL = dict(rtol=1e-5, atol=1e-5)
# Largest |trainer - reference| seen, per check; printed at the end of each test (run with -s).
DEVIATIONS = {}


def note(name, got, want):
    dev = (torch.as_tensor(got, dtype=torch.float64) - torch.as_tensor(want, dtype=torch.float64)).abs().max().item()
    DEVIATIONS[name] = max(DEVIATIONS.get(name, 0.0), dev)
    return dev


def rewards_of(rpf, weights=(1.0, 0.5)):
    return [sum(w * rpf[i, j].item() for j, w in enumerate(weights)) for i in range(rpf.size(0))]


def explicit_returns(rewards, old, ref, env_mask, kl_coef, gamma):
    """The REINFORCE++ return at model token t, written out: the k1 terms of the later *model* tokens u (env_mask 1)
    discounted by gamma^(u - t), u - t counting every position, plus gamma^(T_i - t) R_i, T_i the last model token."""
    out = []
    for i, row in enumerate(env_mask):
        model = [u for u, m in enumerate(row) if m]
        g = [0.0] * len(row)
        for t in model:
            later = [u for u in model if u >= t]
            k1 = sum(gamma ** (u - t) * -kl_coef * (old[i][u] - ref[i][u]) for u in later)
            g[t] = k1 + gamma ** (model[-1] - t) * rewards[i]
        out.append(g)
    return out


@pytest.mark.parametrize(
    "estimator,gamma", [("reinforce_plus_plus", 1.0), ("reinforce_plus_plus", 0.9), ("reinforce_plus_plus_baseline", None)]
)
def test_multi_turn_advantages_match_reference(tmp_path, tiny_model, estimator, gamma):
    """Returns, baseline and normalization population over the model tokens only, with advantages/valid_tokens
    their count, on every generation batch (steps_per_generation=2: REINFORCE++ builds its returns at generation)."""
    torch.set_num_threads(1)
    kw = {} if gamma is None else dict(gamma=gamma)
    trainer, rollout = build(tmp_path, tiny_model, estimator, max_steps=2, **kw)
    trainer.train()
    assert len(rollout.calls) == len(trainer.generation_batches) == 2
    k1_at_holes = False
    for batch, rpf, metrics in zip(trainer.generation_batches, trainer.captured_rewards, trainer.norm_metrics):
        model_mask = rollout.model_mask(batch)
        completion = batch["completion_mask"].tolist()
        holes = [[c and not m for c, m in zip(cr, mr)] for cr, mr in zip(completion, model_mask)]
        assert all(any(h) for h in holes), "every completion has environment tokens"
        rewards = rewards_of(rpf)
        if estimator == "reinforce_plus_plus":
            old, ref = batch["old_per_token_logps"].double().tolist(), batch["ref_per_token_logps"].double().tolist()
            raw = ref_reinforce_pp_returns(rewards, old, ref, model_mask, 0.05, gamma)
            explicit = explicit_returns(rewards, old, ref, model_mask, 0.05, gamma)
            torch.testing.assert_close(torch.tensor(raw), torch.tensor(explicit), rtol=1e-12, atol=1e-12)
            # Counting the environment tokens as model tokens would change the answer once k1 is non-zero there.
            k1 = (batch["old_per_token_logps"] - batch["ref_per_token_logps"]).abs()
            k1_at_holes |= bool((k1 > 1e-4)[torch.tensor(holes, dtype=torch.bool)].any())
            leaky = ref_reinforce_pp_returns(rewards, old, ref, completion, 0.05, gamma)
            k1_model = [old[i][t] - ref[i][t] for i, row in enumerate(model_mask) for t, v in enumerate(row) if v]
            assert metrics["ref_kl/k1_mean"] == pytest.approx(sum(k1_model) / len(k1_model), rel=1e-5, abs=1e-7)
        else:
            raw = ref_group_mean_advantages(rewards, model_mask, trainer.args.num_generations)
            leaky = ref_group_mean_advantages(rewards, completion, trainer.args.num_generations)
        want, mean, _, count = ref_global_masked_normalize([raw], [model_mask])
        note(f"{estimator} gamma={gamma} advantages", batch["advantages"], want[0])
        torch.testing.assert_close(batch["advantages"].double(), torch.tensor(want[0], dtype=torch.float64), **TOL)
        assert metrics["advantages/valid_tokens"] == count == sum(map(sum, model_mask))
        assert metrics["advantages/raw_mean"] == pytest.approx(mean, rel=1e-5, abs=1e-6)
        leaky_want, _, _, leaky_count = ref_global_masked_normalize([leaky], [completion])
        assert leaky_count > count
        assert (torch.tensor(leaky_want[0]) - torch.tensor(want[0])).abs().max() > 1e-3
    if estimator == "reinforce_plus_plus":
        assert k1_at_holes, "pi_old never moved away from pi_ref at an environment token: the k1 exclusion was not tested"
    print(f"\nlargest deviation from the float64 reference: {DEVIATIONS}")


@pytest.mark.parametrize("estimator", list(ESTIMATOR_KW))
def test_multi_turn_losses_are_response_means_over_model_tokens(tmp_path, tiny_model, estimator):
    """The policy loss and the k2 KL loss of every micro-batch are response means with L_i the number of model
    tokens; on the first micro-batch (initial weights) also from float64 log-probs of a fresh copy of the model."""
    torch.set_num_threads(1)
    trainer, rollout = build(tmp_path, tiny_model, estimator, max_steps=2)
    trainer.train()
    assert len(trainer.loss_inputs) == len(trainer.loss_records) == 4
    eps = trainer.args.epsilon
    for index, (inputs, rec) in enumerate(zip(trainer.loss_inputs, trainer.loss_records)):
        model_mask = rollout.model_mask(inputs)
        logps = rec["logps"].double()
        if index == 0:
            fresh = initial_model_logps(tiny_model, inputs, trainer.args.temperature)
            m = torch.tensor(model_mask, dtype=torch.bool)
            note(f"{estimator} loss-forward logps", logps[m], fresh[m])
            torch.testing.assert_close(logps[m], fresh[m], **TOL)
            logps = torch.where(m, fresh, logps)
        old = inputs["old_per_token_logps"].double() if "old_per_token_logps" in inputs else logps
        adv = inputs["advantages"].double().tolist()
        want = ref_response_mean_ppo_loss(logps.tolist(), old.tolist(), adv, model_mask, eps, eps)
        note(f"{estimator} policy_loss", rec["policy_loss"], want)
        assert rec["policy_loss"].item() == pytest.approx(want, rel=1e-5, abs=1e-6)
        completion = inputs["completion_mask"].tolist()
        leaky = ref_response_mean_ppo_loss(logps.tolist(), old.tolist(), adv, completion, eps, eps)
        assert abs(leaky - want) > 1e-6, "dividing by the completion length instead of the model tokens must differ"
        if estimator == "reinforce_plus_plus_baseline":
            ref = inputs["ref_per_token_logps"].double().tolist()
            want_kl = ref_response_mean_k2_loss(logps.tolist(), ref, model_mask)
            note(f"{estimator} kl_loss", rec["kl_loss"], want_kl)
            assert rec["kl_loss"].item() == pytest.approx(want_kl, rel=1e-5, abs=1e-9)
            if index >= 2:  # after the first optimizer step the policy has moved: k2 is non-zero at every token
                assert want_kl > 0
                assert abs(ref_response_mean_k2_loss(logps.tolist(), ref, completion) - want_kl) > 1e-9
        else:
            assert "kl_loss" not in rec
    print(f"\nlargest deviation from the float64 reference: {DEVIATIONS}")


@pytest.mark.parametrize("estimator", list(ESTIMATOR_KW))
def test_multi_turn_gradient_is_zero_at_environment_tokens(tmp_path, tiny_model, estimator):
    """Hooks on the real backward of every micro-batch: d loss / d log-prob and d loss / d final hidden state (what
    TRL's fused LM head turns into the logits of the next token) are exactly 0 at every environment position and at
    padding, and non-zero at model tokens."""
    torch.set_num_threads(1)
    trainer, rollout = build(tmp_path, tiny_model, estimator, max_steps=2)
    trainer.train()
    assert len(trainer.logp_grads) == len(trainer.hidden_grads) == len(trainer.loss_inputs) == 4
    for inputs, g_logp, g_hidden in zip(trainer.loss_inputs, trainer.logp_grads, trainer.hidden_grads):
        m = torch.tensor(rollout.model_mask(inputs), dtype=torch.bool)
        P, T = inputs["prompt_ids"].size(1), inputs["completion_ids"].size(1)
        assert g_logp.shape == (m.size(0), T) and g_hidden.shape[:2] == (m.size(0), P + T)
        # The hidden state at sequence position P - 1 + t is projected to the logits of completion token t.
        g_pos = g_hidden[:, P - 1 : P - 1 + T].abs().amax(-1)
        env = (inputs["completion_mask"].bool() & ~m)
        assert env.any()
        assert torch.equal(g_logp[~m], torch.zeros_like(g_logp[~m]))
        assert torch.equal(g_pos[~m], torch.zeros_like(g_pos[~m]))
        assert (g_logp[m] != 0).any() and (g_pos[m] != 0).any()


@pytest.mark.slow
@pytest.mark.parametrize("estimator", list(ESTIMATOR_KW))
def test_multi_turn_masks_truncated_completions(tmp_path, eos_model, estimator):
    """mask_truncated_completions=True: the "b:" completions never reach EOS in their second turn and leave every
    sum (zero advantage, not counted in advantages/valid_tokens); the "a:" ones end each turn with EOS and keep their
    environment holes."""
    from datasets import Dataset

    torch.set_num_threads(1)
    dataset = Dataset.from_list([{"prompt": "b:" if i % 2 == 0 else "a:"} for i in range(64)])
    rollout = RecordedRollout(final_feedback=False)  # a final environment token would make every completion truncated
    trainer, _ = build(tmp_path, eos_model, estimator, rollout=rollout, dataset=dataset, max_steps=2,
                       mask_truncated_completions=True, shuffle_dataset=False, num_generations=4)
    trainer.train()
    eos = trainer.processing_class.eos_token_id
    kept = 0
    for batch, rows, metrics in zip(trainer.generation_batches, rollout.calls, trainer.norm_metrics):
        model_mask = torch.tensor(rollout.model_mask(batch), dtype=torch.bool)
        assert len(rows) == batch["completion_ids"].size(0)
        truncated = [c[-1] != eos for _, c, _ in rows]
        assert any(truncated)
        for i, (_, c, m) in enumerate(rows):
            if truncated[i]:  # every mask is zero, and so is the advantage
                assert not batch["completion_mask"][i].any() and not batch["tool_mask"][i].any()
                assert not model_mask[i].any()
                assert torch.equal(batch["advantages"][i], torch.zeros_like(batch["advantages"][i]))
            else:
                kept += 1
                assert batch["completion_mask"][i].sum() == len(c)
                assert batch["tool_mask"][i, : len(c)].tolist() == m and 0 in m, "a kept completion keeps its holes"
        assert metrics["advantages/valid_tokens"] == model_mask.sum().item() > 0
    assert kept > 0


def _with_env_mask(edit):
    rollout = RecordedRollout(final_feedback=False)

    def rollout_func(prompts, trainer):
        out = rollout(prompts, trainer)
        edit(out)
        return out

    return rollout_func


def test_env_mask_of_wrong_length_is_an_error_naming_the_row(tmp_path, tiny_model):
    """An env_mask row one entry short (TRL would pad it with a 1) is refused right after the rollout, before any
    reward is computed."""
    seen = {}

    def drop_last(out):
        seen["lengths"] = (len(out["env_mask"][1]) - 1, len(out["completion_ids"][1]))
        out["env_mask"][1] = out["env_mask"][1][:-1]

    trainer, _ = build(tmp_path, tiny_model, "reinforce_plus_plus_baseline", rollout=_with_env_mask(drop_last), max_steps=1)
    with pytest.raises(ValueError) as err:
        trainer.train()
    short, full = seen["lengths"]
    want = f"rollout_func returned env_mask row 1 of length {short} for completion_ids row 1 of length {full}"
    assert want in str(err.value)
    assert trainer.captured_rewards == []  # refused before the reward functions ran


@pytest.mark.parametrize("bad", [2, -1, 0.5, float("nan"), "1"])
def test_env_mask_values_must_be_zero_or_one(tmp_path, tiny_model, bad):
    def set_value(out):
        out["env_mask"][3][0] = bad

    trainer, _ = build(tmp_path, tiny_model, "reinforce_plus_plus_baseline", rollout=_with_env_mask(set_value), max_steps=1)
    with pytest.raises(ValueError, match=r"env_mask row 3 holding .*accepted values are 1 .* and 0"):
        trainer.train()


def test_check_external_mask_rejects_misaligned_rows():
    """The check the trainer runs on every rollout output and on TRL's tool-calling loop (aligned by construction)."""
    ids = [[5, 6, 7], [8, 9]]
    check_external_mask([[1, 0, 1], [True, False]], ids, "tool_mask", "TRL's tool-calling loop")
    check_external_mask([torch.tensor([1, 0, 1]), (1.0, 0.0)], ids, "env_mask", "rollout_func")
    want = r"TRL's tool-calling loop returned tool_mask row 1 of length 3 for completion_ids row 1 of length 2"
    with pytest.raises(ValueError, match=want):
        check_external_mask([[1, 0, 1], [1, 0, 1]], ids, "tool_mask", "TRL's tool-calling loop")
    with pytest.raises(ValueError, match=r"rollout_func returned 1 env_mask rows for 2 completions"):
        check_external_mask([[1, 0, 1]], ids, "env_mask", "rollout_func")
    with pytest.raises(ValueError, match=r"env_mask row 0 holding None"):
        check_external_mask([[1, None, 1], [1, 1]], ids, "env_mask", "rollout_func")


def test_tool_call_loop_returns_what_the_check_reads():
    """`trl_rpp.patches.check_rollouts` wraps GRPO's private `_tool_call_loop` and reads its first three results
    (tool_mask, completions, completion_ids): a TRL that changes them must fail here, not misread the masks."""
    import inspect

    from trl import GRPOTrainer

    params = list(inspect.signature(GRPOTrainer._tool_call_loop).parameters)
    assert params == ["self", "prompts", "prompt_ids", "completion_ids", "completions", "logprobs", "images",
                      "multimodal_fields"]
    # The method's own returns (8 spaces in), not those of the helpers nested in it.
    returns = [line.strip() for line in inspect.getsource(GRPOTrainer._tool_call_loop).splitlines()
               if line.startswith("        return ")]
    assert returns and all(r.startswith("return tool_mask, completions, completion_ids,") for r in returns), returns


def test_logprobs_row_of_wrong_length_is_an_error(tmp_path, tiny_model):
    def drop_logprob(out):
        out["logprobs"][0] = out["logprobs"][0][:-1]

    trainer, _ = build(tmp_path, tiny_model, "reinforce_plus_plus", rollout=_with_env_mask(drop_logprob), max_steps=1)
    with pytest.raises(ValueError, match=r"logprobs row 0 of length \d+ for completion_ids row 0 of length \d+"):
        trainer.train()


@pytest.mark.slow
def test_two_process_multi_turn_matches_global_reference(two_process_runs):
    """2 gloo processes, one group of 8 spanning both: each rank's advantages equal the float64 reference on the
    concatenation of both ranks' rows (model tokens only), advantages/valid_tokens is the global model-token count,
    and normalizing one rank alone would differ. REINFORCE++ builds its returns in the loss (steps_per_generation=1)."""
    outdir = two_process_runs / "multi_turn"
    for estimator in ESTIMATOR_KW:
        ranks = [torch.load(outdir / f"{estimator}-rank{r}.pt", weights_only=False) for r in range(2)]
        assert ranks[0]["backend"] == "gloo"
        differs = []
        for step in range(2):
            rpf = ranks[0]["rewards"][step]
            assert torch.equal(rpf, ranks[1]["rewards"][step]) and rpf.shape[0] == 8
            if estimator == "reinforce_plus_plus":
                # Returns built in the loss: its inputs (one micro-batch per generation batch, rows shuffled by TRL)
                # carry the rewards, pi_old and the advantages it used.
                inputs = [r["loss_inputs"][step] for r in ranks]
                masks = [r["loss_masks"][step] for r in ranks]
                raws = [
                    ref_reinforce_pp_returns(x["rpp_rewards"].double().tolist(), x["old_per_token_logps"].double().tolist(),
                                             x["ref_per_token_logps"].double().tolist(), m, 0.05, 0.9)
                    for x, m in zip(inputs, masks)
                ]
                rewards = rewards_of(rpf)
                for r, x in enumerate(inputs):  # this rank's slice of the gathered rewards
                    assert sorted(x["rpp_rewards"].tolist()) == pytest.approx(sorted(rewards[4 * r : 4 * r + 4]), rel=1e-6)
            else:
                # One group of 8 spans both ranks: the baseline needs all 8 rewards, in generation order.
                inputs = [r["batches"][step] for r in ranks]
                masks = [r["gen_masks"][step] for r in ranks]
                T = max(len(m[0]) for m in masks)
                padded = [row + [0] * (T - len(row)) for m in masks for row in m]
                full = ref_group_mean_advantages(rewards_of(rpf), padded, 8)
                raws = [[row[: len(masks[r][0])] for row in full[4 * r : 4 * r + 4]] for r in range(2)]
            want, _, _, count = ref_global_masked_normalize(raws, masks)
            for r, x in enumerate(inputs):
                note(f"{estimator} 2-process advantages", x["advantages"], want[r])
                torch.testing.assert_close(x["advantages"].double(), torch.tensor(want[r], dtype=torch.float64), **TOL)
                assert ranks[r]["norm_metrics"][step]["advantages/valid_tokens"] == count
            assert count < sum(int(x["completion_mask"].sum()) for x in inputs)  # the holes are not counted
            local, _, _, _ = ref_global_masked_normalize([raws[0]], [masks[0]])
            differs.append((torch.tensor(local[0]) - torch.tensor(want[0])).abs().max().item() > 1e-4)
        assert any(differs), "normalizing rank 0 alone gives the same answer: the global check is vacuous"
    print(f"\nlargest deviation from the float64 reference: {DEVIATIONS}")


TOOL_TURN = r"\n<\|im_start\|>user\n<tool_response>\n[^<]*\n</tool_response><\|im_end\|>\n<\|im_start\|>assistant\n"


@pytest.mark.slow
@pytest.mark.parametrize("estimator", list(ESTIMATOR_KW))
def test_environment_factory_tool_results_are_holes(tmp_path, tool_model, estimator):
    """`environment_factory` through TRL's real tool loop: the tokens with tool_mask 0 are exactly the rendered tool
    turns (checked on the decoded text), the tool loop's output passed the alignment check, and advantages,
    advantages/valid_tokens and the gradient treat those tokens as holes, against the float64 reference."""
    import random
    import re

    from trl_rpp.testing.tool_model import MultiplyEnv, correct_product_reward, tool_dataset

    torch.set_num_threads(1)
    # A small learning rate: pi_old moves off pi_ref (k1 non-zero at the tool tokens) and the model still calls tools.
    args = make_args(tmp_path, estimator, max_steps=2, max_completion_length=64,
                     learning_rate=1e-3, **ESTIMATOR_KW[estimator])
    # The warmed-up model samples nearly the same completion four times per prompt: a seeded noisy judge (second
    # reward function) gives the group mean something to center.
    rng = random.Random(0)

    def noisy_judge(completions, **kwargs):
        return [rng.random() for _ in completions]

    trainer = MultiTurnTrainer(model=tool_model, reward_funcs=[correct_product_reward, noisy_judge], args=args,
                               train_dataset=tool_dataset(32, greeting_every=4), environment_factory=MultiplyEnv)
    assert hasattr(trainer._tool_call_loop, "__wrapped__"), "the tool loop's tool_mask is checked"
    trainer.train()
    tok = trainer.processing_class
    tool_batches, k1_at_holes = 0, False
    for batch, rpf, metrics in zip(trainer.generation_batches, trainer.captured_rewards, trainer.norm_metrics):
        completion, tool = batch["completion_mask"].bool(), batch["tool_mask"].bool()
        for i in range(completion.size(0)):
            ids = batch["completion_ids"][i][completion[i]].tolist()
            holes = [t for t, m in zip(ids, tool[i][completion[i]].tolist()) if not m]
            model = [t for t, m in zip(ids, tool[i][completion[i]].tolist()) if m]
            assert "<tool_response>" not in tok.decode(model)
            if holes:
                assert re.fullmatch(f"({TOOL_TURN})+", tok.decode(holes)), tok.decode(holes)
        mask = (completion & tool).int().tolist()
        rewards = rewards_of(rpf)
        if estimator == "reinforce_plus_plus":
            old, ref = batch["old_per_token_logps"].double().tolist(), batch["ref_per_token_logps"].double().tolist()
            raw = ref_reinforce_pp_returns(rewards, old, ref, mask, 0.05, 0.9)
            k1 = batch["old_per_token_logps"] - batch["ref_per_token_logps"]
            k1_at_holes |= bool((k1.abs() > 1e-4)[completion & ~tool].any())
        else:
            raw = ref_group_mean_advantages(rewards, mask, trainer.args.num_generations)
        want, _, _, count = ref_global_masked_normalize([raw], [mask])
        note(f"{estimator} environment_factory advantages", batch["advantages"], want[0])
        torch.testing.assert_close(batch["advantages"].double(), torch.tensor(want[0], dtype=torch.float64), **TOL)
        assert metrics["advantages/valid_tokens"] == count == (completion & tool).sum().item()
        tool_batches += bool((completion & ~tool).any())
    assert tool_batches == len(trainer.generation_batches) == 2, "a batch without any tool call: the set-up failed"
    if estimator == "reinforce_plus_plus":
        assert k1_at_holes
    for inputs, g_logp in zip(trainer.loss_inputs, trainer.logp_grads):
        holes = inputs["completion_mask"].bool() & ~inputs["tool_mask"].bool()
        assert torch.equal(g_logp[holes], torch.zeros_like(g_logp[holes]))
    print(f"\nlargest deviation from the float64 reference: {DEVIATIONS}")
