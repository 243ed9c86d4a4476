"""Score centering through multi-turn rollouts: TRL's tool loop (`tools`, `environment_factory`) and a `rollout_func`.

Unit tests of `trl_rpp.records.multi_turn` against a plain simulation of TRL's tool loop; then real RPPTrainer runs on the
tiny tool-calling model (`tests/support/tool_model.py`): the captured heads at the model tokens are the sampler's real
distribution (recomputed in float64 from the initial weights), the centered gradient there is the single-turn
formula of tests/test_score_centering.py with the holes masked, and NaN/Inf at the holes changes nothing.
"""

import math
import random
import sys
from pathlib import Path

import pytest
import torch

from test_score_centering import expected_centered_score
from tool_model import MultiplyEnv, correct_product_reward, multiply, tool_dataset
from trainer_helpers import CaptureTrainer, make_args
from trl_rpp import RPPTrainer
from trl_rpp.records.multi_turn import align_turn_captures, model_segments, rollout_sampler_topk
from reference import ref_sampled_and_head_logps
from trl_rpp.score_centering import score_centered_ppo_loss
from trl_rpp.batch import token_mask

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import multi_turn as example  # noqa: E402

NEG_INF = float("-inf")


# --- trl_rpp.records.multi_turn, against a plain simulation of TRL's tool loop --------------------------------------------


@pytest.mark.parametrize(
    "mask, want",
    [
        ([1, 1, 1], [(0, 3)]),
        ([1, 1, 0, 0, 1, 1, 1], [(0, 2), (4, 3)]),
        ([1, 0, 0], [(0, 1), (3, 0)]),  # a post-tool turn cut to nothing
        ([1, 1, 0, 1, 0, 0, 1], [(0, 2), (3, 1), (6, 1)]),
        ([], [(0, 0)]),
    ],
)
def test_model_segments_hand_cases(mask, want):
    assert model_segments(mask) == want


def simulate_tool_loop(seed, B=7, k=3, max_len=20, iterations=3):
    """TRL's `_tool_call_loop` bookkeeping on made-up lengths: per `generate` call, the rows it generated, their
    capture (values that name call, row and step), and the final tool masks; plus the expected aligned tensors, built
    position by position while the completion grows (independently of `model_segments`)."""
    rng = random.Random(seed)

    def capture(c, n_rows, steps):
        ids = torch.tensor([[[1000 * c + 100 * i + t + j for j in range(k)] for t in range(steps)] for i in range(n_rows)])
        return ids, -ids.double() / 1e4, -(ids[..., 0].double() + 0.5) / 1e4

    lengths = [rng.randint(1, 6) for _ in range(B)]
    turns = [capture(0, B, max(lengths) + rng.randint(0, 2))]
    tool_mask = [[1] * n for n in lengths]
    want = [[(0, b, t) for t in range(n)] for b, n in enumerate(lengths)]  # (call, row in call, step) per position
    active = [b for b in range(B) if rng.random() < 0.7]
    for c in range(1, iterations + 1):
        active = [b for b in active if len(tool_mask[b]) + 3 <= max_len]  # TRL drops overlong tool results first
        if not active:
            break
        tool = {b: rng.randint(1, 3) for b in active}
        post = {b: rng.randint(0, 6) for b in active}
        turns.append(capture(c, len(active), max(post.values()) + 1))
        ended = set()
        for i, b in enumerate(active):
            n = min(post[b], max_len - len(tool_mask[b]) - tool[b])  # the cut to max_completion_length
            want[b] += [None] * tool[b] + [(c, i, t) for t in range(n)]
            tool_mask[b] += [0] * tool[b] + [1] * n
            if n == 0:
                ended.add(b)  # nothing left to parse: no further tool call
        active = [b for b in active if b not in ended and rng.random() < 0.6]
    return turns, tool_mask, want


@pytest.mark.parametrize("seed", range(6))
def test_alignment_matches_a_simulated_tool_loop(seed):
    turns, tool_mask, want = simulate_tool_loop(seed)
    got = align_turn_captures(turns, tool_mask)
    T = max(len(m) for m in tool_mask)
    assert got.ids.shape[:2] == (len(tool_mask), T)
    for b, row in enumerate(want):
        for t in range(T):
            source = row[t] if t < len(row) else None
            if source is None:  # tool tokens and padding: absent entries
                assert got.ids[b, t].eq(0).all() and got.logps[b, t].eq(NEG_INF).all() and got.sampled[b, t] == NEG_INF
                continue
            c, i, step = source
            ids, logps, sampled = turns[c]
            assert torch.equal(got.ids[b, t], ids[i, step])
            assert torch.equal(got.logps[b, t], logps[i, step].float())
            assert got.sampled[b, t] == sampled[i, step].float()


def test_alignment_rejects_calls_that_do_not_match_the_mask():
    turns, tool_mask, _ = simulate_tool_loop(0)
    with pytest.raises(ValueError, match="generate call 1 of the tool loop sampled"):
        align_turn_captures([turns[0], tuple(x[:-1] for x in turns[1])] + turns[2:], tool_mask)
    with pytest.raises(ValueError, match="more than the .* steps"):
        align_turn_captures([tuple(x[:, :1] for x in turns[0])] + turns[1:], tool_mask)
    with pytest.raises(ValueError, match=f"generate call {len(turns)} .* but 0 completions"):
        align_turn_captures(turns + [turns[-1]], tool_mask)  # a call no completion has a turn for


def test_rollout_topk_hand_case():
    # k = 2. Row 0: token 5 in the head, then an environment token, then token 9 outside the head (k + 1 entries).
    completion_ids = [[5, 7, 9], [4]]
    logprobs = [[[-0.1, -2.5], [], [-0.3, -1.5, -4.0]], [[-0.2, -0.9]]]
    token_ids = [[[5, 6], [], [2, 3, 9]], [[8, 4]]]
    sampled, rec = rollout_sampler_topk(completion_ids, logprobs, token_ids, [[1, 0, 1], [1]], k=2)
    assert sampled == [[-0.1, 0.0, -4.0], [-0.9]]
    assert rec.ids.tolist() == [[[5, 6], [0, 0], [2, 3]], [[8, 4], [0, 0], [0, 0]]]
    want = torch.tensor([[-0.1, -2.5], [NEG_INF, NEG_INF], [-0.3, -1.5]])  # rounded once to float32
    assert torch.equal(rec.logps[0], want) and rec.logps[1, 1:].eq(NEG_INF).all()
    assert rec.logps[0].dtype == torch.float32 and rec.sampled[0, 1] == NEG_INF and rec.sampled[1, 1] == NEG_INF
    torch.testing.assert_close(rec.sampled[0, [0, 2]], torch.tensor([-0.1, -4.0]))


@pytest.mark.parametrize(
    "logprobs, token_ids, match",
    [
        ([[-0.1, -0.2]], None, "returned no 'logprob_token_ids'"),
        ([[-0.1, -0.2]], [[5, 6]], "token 0 has a float in 'logprobs'"),  # TRL's plain per-token log-probs
        ([[[-0.1], [-0.2, -0.3]]], [[[5], [6, 1]]], "token 0 has 1 entries"),
        ([[[-0.1, -1.0], [-0.2, -0.3]]], [[[5, 1], [6]]], "token 1 has 2 entries in 'logprobs' and 1"),
        ([[[-0.1, -1.0], [-0.2, -0.3]]], [[[5, 1], [2, 1]]], "do not include the sampled token 6"),
    ],
)
def test_rollout_topk_rejections_name_the_contract(logprobs, token_ids, match):
    with pytest.raises(ValueError, match="rollout_func must return the sampler's top-k.*logprob_token_ids") as e:
        rollout_sampler_topk([[5, 6]], logprobs, token_ids, None, k=2)
    assert e.match(match)


# --- Real runs on the tiny tool model -------------------------------------------------------------------------------

TEMPERATURE, K = 1.5, 4


def run(tool_model, tmp_path, **kwargs):
    """One score-centered step of REINFORCE++-baseline on 4 questions and 4 greetings (4 samples of each)."""
    args = make_args(
        tmp_path, "reinforce_plus_plus_baseline", score_centering=True, score_centering_top_k=K,
        temperature=TEMPERATURE, max_completion_length=41, max_steps=1, per_device_train_batch_size=8,
        gradient_accumulation_steps=1, steps_per_generation=1, reward_weights=None,
    )
    trainer = CaptureTrainer(
        model=tool_model, reward_funcs=correct_product_reward, args=args,
        train_dataset=tool_dataset(8, greeting_every=2), **kwargs,
    )
    trainer.train()
    return trainer


def sampler_logq(model_path, batch, dtype=torch.float64):
    """``[B, T, V]`` log-softmax at the sampling temperature of the initial weights, loaded in `dtype`."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype).eval()
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1)
    attention = torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1)
    T = batch["completion_ids"].size(1)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=attention).logits[:, -T - 1 : -1]
    return torch.log_softmax(logits / TEMPERATURE, -1)


def check_heads_are_the_sampler(model_path, batch):
    """At every model token the recorded head is the initial model's top-k at the sampling temperature, and the
    sampled log-prob its log-prob of the token; the holes and the padding carry no head. Returns the largest
    deviation from the float64 recompute."""
    logq = sampler_logq(model_path, batch)
    model_tokens = token_mask(batch)
    holes = ~model_tokens
    ids, head = batch["sampler_head_ids"], batch["sampler_head_logps"]
    assert ids[holes].eq(0).all() and head[holes].eq(NEG_INF).all()
    assert batch["sampler_per_token_logps"][holes].eq(NEG_INF).all()
    at_ids = logq.gather(-1, ids)[model_tokens]
    top = logq.topk(K, -1).values[model_tokens]
    sampled = logq.gather(-1, batch["completion_ids"].unsqueeze(-1)).squeeze(-1)[model_tokens]
    deviations = [
        (head[model_tokens].double() - at_ids).abs().max(),  # the recorded log-probs are those of the recorded ids
        (head[model_tokens].double() - top).abs().max(),  # and those ids are the top k (up to ties)
        (batch["sampler_per_token_logps"][model_tokens].double() - sampled).abs().max(),
    ]
    worst = max(float(d) for d in deviations)
    assert worst < 1e-4, worst
    return worst


@pytest.fixture(scope="module")
def tool_runs(tool_model, tmp_path_factory):
    runs = {}

    def get(kind):
        if kind not in runs:
            kwargs = {"tools": [multiply]} if kind == "tools" else {"environment_factory": MultiplyEnv}
            runs[kind] = run(tool_model, tmp_path_factory.mktemp(kind), **kwargs)
        return runs[kind]

    return get


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["tools", "environment_factory"])
def test_tool_loop_heads_are_the_sampler_distribution(tool_model, tool_runs, kind):
    trainer = tool_runs(kind)
    batch = trainer.generation_batches[0]
    assert trainer.state.log_history[0]["tools/call_frequency"] > 0
    tool_mask, completion_mask = batch["tool_mask"].bool(), batch["completion_mask"].bool()
    assert (~tool_mask & completion_mask).any(), "no tool result in the completions"
    post_tool = [b for b in range(len(tool_mask)) if (~tool_mask[b] & completion_mask[b]).any()]
    assert any(completion_mask[b].sum() == 41 for b in post_tool), "no post-tool turn was cut"
    assert (tool_mask.all(1) & completion_mask.any(1)).any(), "every row called the tool"
    print(f"{kind}: largest deviation from the float64 recompute {check_heads_are_the_sampler(tool_model, batch):.3g}")
    logs = [h for h in trainer.state.log_history if "score_centering/coeff_l1" in h]
    assert logs and all(math.isfinite(v) for v in logs[0].values() if isinstance(v, float))


@pytest.mark.slow
def test_tool_loop_with_a_replayed_truncation(tool_model, tmp_path):
    """top_k=5 replayed through TRL's tool loop, score centering on: tool tokens carry no kept set (their loss mask
    excludes them), every model token's recorded set is the initial model's 5 most probable tokens, with log q_S the
    float64 recompute renormalized over them, and the step trains."""
    from trl_rpp.truncation import ABSENT

    args = make_args(
        tmp_path, "reinforce_plus_plus_baseline", score_centering=True, score_centering_top_k=5, top_k=5,
        temperature=TEMPERATURE, max_completion_length=41, max_steps=1, per_device_train_batch_size=8,
        gradient_accumulation_steps=1, steps_per_generation=1, reward_weights=None,
    )
    trainer = CaptureTrainer(model=tool_model, reward_funcs=correct_product_reward, args=args,
                             train_dataset=tool_dataset(8, greeting_every=2), tools=[multiply])
    trainer.train()
    batch = trainer.generation_batches[0]
    model_tokens = token_mask(batch)
    assert (~batch["tool_mask"].bool() & batch["completion_mask"].bool()).any(), "no tool result in the completions"
    support = batch["sampler_support_ids"]
    assert support[~model_tokens].eq(ABSENT).all()
    logq = sampler_logq(tool_model, batch)
    top = logq.topk(5, -1)
    kept = support[model_tokens].sort(-1, descending=True).values  # the kept ids first, then the empty slots
    assert kept[:, 5:].eq(ABSENT).all()  # no ties at the 5th score here: 5 of the 10 slots hold ids
    assert torch.equal(kept[:, :5].sort(-1).values, top.indices[model_tokens].sort(-1).values)
    log_q_s = torch.log_softmax(top.values, -1)  # log q renormalized over the kept 5, in rank order
    torch.testing.assert_close(batch["sampler_head_logps"][model_tokens].double(), log_q_s[model_tokens],
                               rtol=0, atol=1e-4)
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert losses and all(math.isfinite(x) for x in losses)


@pytest.mark.slow
def test_rollout_func_heads_are_the_sampler_distribution(tool_model, tmp_path):
    trainer = run(tool_model, tmp_path, rollout_func=example.make_rollout_func(K, TEMPERATURE))
    batch = trainer.generation_batches[0]
    tool_mask, completion_mask = batch["tool_mask"].bool(), batch["completion_mask"].bool()
    assert (~tool_mask & completion_mask).any(), "the environment never replied"
    print(f"rollout_func: largest deviation from the float64 recompute {check_heads_are_the_sampler(tool_model, batch):.3g}")


def fill_holes(batch, seed=0):
    """The capture tensors with NaN, +/-Inf and arbitrary (valid) ids at every hole and padding position."""
    g = torch.Generator().manual_seed(seed)
    holes = ~token_mask(batch)
    out = dict(batch)
    ids, head, sampled = (batch[k].clone() for k in ("sampler_head_ids", "sampler_head_logps", "sampler_per_token_logps"))
    junk = torch.tensor([float("nan"), float("inf"), NEG_INF, 3.0])
    ids[holes] = torch.randint(0, 50, ids[holes].shape, generator=g)
    head[holes] = junk[torch.randint(0, 4, head[holes].shape, generator=g)]
    sampled[holes] = junk[torch.randint(0, 4, sampled[holes].shape, generator=g)]
    out.update(sampler_head_ids=ids, sampler_head_logps=head, sampler_per_token_logps=sampled)
    return out


def centered_logits_grad(model, batch, advantages):
    """The logits' gradient of the score-centered loss, on policy (pi_old = p), through the production functions."""
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1)
    attention = torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1)
    T = batch["completion_ids"].size(1)
    logits = model(input_ids=ids, attention_mask=attention, logits_to_keep=T + 1).logits
    logits.retain_grad()
    logps, head_logps, _ = ref_sampled_and_head_logps(logits, batch["completion_ids"], batch["sampler_head_ids"], TEMPERATURE)
    mask = token_mask(batch)
    loss = score_centered_ppo_loss(
        logps, logps.detach(), advantages, mask, head_logps, batch["sampler_head_logps"].double()
    )
    loss.backward()
    return logits.detach()[:, :-1], logits.grad[:, :-1]


@pytest.mark.slow
def test_centered_gradient_at_model_tokens_is_the_single_turn_formula_and_holes_change_nothing(tool_model, tool_runs):
    from transformers import AutoModelForCausalLM

    batch = tool_runs("tools").generation_batches[0]
    model = AutoModelForCausalLM.from_pretrained(tool_model, dtype=torch.float64)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():  # a trainer that has drifted from the sampler: p != q
        for param in model.parameters():
            param.add_(0.05 * torch.randn(param.shape, generator=g, dtype=param.dtype))
    mask = token_mask(batch)
    B, T = mask.shape
    advantages = torch.randn(B, T, generator=g, dtype=torch.float64)
    z, grad = centered_logits_grad(model, batch, advantages)

    # The single-turn formula at each model token, the holes simply absent: -A (e_y - q_hat) / (t * B * L_b).
    want = torch.zeros_like(grad)
    for b in range(B):
        n = int(mask[b].sum())
        for t in range(T):
            if not mask[b, t]:
                continue
            p = torch.softmax(z[b, t] / TEMPERATURE, -1)
            head = batch["sampler_head_ids"][b, t]
            q = torch.zeros_like(p)
            q[head] = batch["sampler_head_logps"][b, t].double().exp()
            y = int(batch["completion_ids"][b, t])
            want[b, t] = -advantages[b, t] * expected_centered_score(p, q, head, y) / (TEMPERATURE * B * n)
    assert (~mask).any() and (grad[~mask] == 0).all()
    deviation = (grad - want).abs().max().item()
    print(f"centered gradient: largest deviation {deviation:.3g} (largest entry {want.abs().max().item():.3g})")
    assert deviation < 1e-12 * max(want.abs().max().item(), 1.0), deviation

    # NaN/Inf and arbitrary ids at the holes: the same gradient, bit for bit.
    model.zero_grad()
    _, grad_filled = centered_logits_grad(model, fill_holes(batch), advantages)
    assert torch.equal(grad_filled, grad)


@pytest.mark.slow
def test_nan_and_inf_at_holes_change_nothing_in_the_trainer_loss(tool_runs):
    trainer = tool_runs("tools")
    inputs = trainer.loss_inputs[0]
    assert (~token_mask(inputs)).any()

    def loss_and_grads(batch):
        trainer.model.zero_grad()
        loss = trainer._compute_loss(trainer.model, batch)
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in trainer.model.parameters() if p.grad is not None]

    clean_loss, clean_grads = loss_and_grads(inputs)
    filled_loss, filled_grads = loss_and_grads(fill_holes(inputs, seed=1))
    assert torch.equal(clean_loss, filled_loss) and torch.isfinite(clean_loss)
    assert len(clean_grads) == len(filled_grads) and all(map(torch.equal, clean_grads, filled_grads))
    metrics = trainer._metrics["train"]
    for name in ("score_centering/coeff_l1", "score_centering/sampler_logp_abs_diff"):
        assert all(math.isfinite(v) for v in metrics[name][-2:]), name


# --- Rejections -----------------------------------------------------------------------------------------------------


def test_rollout_func_without_top_k_lists_is_rejected_before_any_forward(tiny_model, tmp_path):
    from trl_rpp.testing.tiny import copy_first_char_reward, copy_task_dataset

    def rollout_func(prompts, trainer):  # TRL's plain format: one log-prob per token, no logprob_token_ids
        return {"prompt_ids": [[3, 4]] * len(prompts), "completion_ids": [[5, 1]] * len(prompts),
                "logprobs": [[-0.5, -0.1]] * len(prompts)}

    args = make_args(tmp_path, "reinforce_plus_plus_baseline", score_centering=True, reward_weights=None, max_steps=1)
    trainer = RPPTrainer(model=tiny_model, reward_funcs=copy_first_char_reward, args=args,
                         train_dataset=copy_task_dataset(8), rollout_func=rollout_func)
    forwards = []
    trainer.model.register_forward_hook(lambda *a: forwards.append(1))
    with pytest.raises(ValueError, match=r"rollout_func must return .*'logprob_token_ids'.*score_centering_top_k = 32"):
        trainer.train()
    assert not forwards


def test_rollout_func_together_with_tools_is_rejected(tool_model, tmp_path):
    args = make_args(tmp_path, "reinforce_plus_plus_baseline", score_centering=True, reward_weights=None)
    with pytest.raises(ValueError, match="does not support rollout_func together with tools"):
        RPPTrainer(model=tool_model, reward_funcs=correct_product_reward, args=args, train_dataset=tool_dataset(8),
                   tools=[multiply], rollout_func=example.make_rollout_func(K, 1.0))
