"""A truncating sampler replayed in `RPPTrainer` (`trl_rpp.records.replay`): the settings that switch it on and their
bound, the on-policy identity on transformers' path (the sampler is the trainer itself, the same float32 weights),
and the loss gradient against a float64 reference written with `log pi(y | S)`.

Tolerances. Sampler and trainer compute the same float32 log-probs by two code paths (`generate` with its KV cache,
and a full forward): they differ by a few float32 ulps (<= 3e-7 measured), so an on-policy ratio is 1 to `1e-5`.
The kept mass of these settings is far below 1 (0.2 to 0.8, printed with -s), so a ratio taken against the full
softmax fails by orders of magnitude."""

import math

import pytest
import torch

from trainer_helpers import CaptureTrainer, length_reward, make_args
from trl_rpp import RPPConfig
from trl_rpp.records.settings import MAX_SUPPORT, support_bound, truncating
from trl_rpp.records.capture import capturing_generate
from trl_rpp.testing.tiny import copy_first_char_reward, copy_task_dataset
from trl_rpp.truncation import ABSENT, support_of
from trl_rpp.records.capture import SamplerSupportCapture

CPU = dict(output_dir="unused", use_cpu=True, bf16=False, report_to="none")
RATIO_ATOL = 1e-5

# The four settings (top_p and min_p with a top_k bound), on the tiny model's 46-token vocabulary.
SETTINGS = {
    "top_k": dict(top_k=5),
    "top_p": dict(top_k=40, top_p=0.8),
    "min_p": dict(top_k=40, min_p=0.1),
    "combined": dict(top_k=12, top_p=0.9, min_p=0.05, temperature=0.7),
}


# --- which settings are replayed, and their bound -----------------------------------------------------------------


def test_truncating_names_the_settings_that_truncate_in_each_engines_vocabulary():
    assert truncating({"top_k": 0, "top_p": 1.0, "min_p": None}, vllm=False) == []
    assert truncating({"top_k": -1, "top_p": 1.0, "min_p": 0.0}, vllm=True) == []
    assert truncating({"top_k": 5, "top_p": 0.9, "typical_p": 0.5, "repetition_penalty": 1.2}, vllm=False) == [
        "top_k", "top_p", "typical_p"]
    assert truncating({"top_k": 5, "typical_p": 0.5}, vllm=True) == ["top_k"]  # vLLM has no typical_p
    assert support_bound({"top_k": 6}, vllm=False, replay=True) == 6
    assert support_bound({"top_k": 6}, vllm=False, replay=False) is None
    assert support_bound({"top_k": 0}, vllm=False, replay=True) is None


@pytest.mark.parametrize("settings", [dict(top_p=0.9), dict(min_p=0.1, top_k=0), dict(top_p=0.5, top_k=MAX_SUPPORT + 1)])
def test_a_truncation_without_a_top_k_bound_is_rejected_naming_top_k(settings):
    with pytest.raises(ValueError, match=rf"^top_k={settings.get('top_k', 0)} is not supported with .*"
                                         rf"replay_sampler_support=True; accepted: an integer from 1 to {MAX_SUPPORT}"):
        RPPConfig(**CPU, **settings)
    RPPConfig(**CPU, **settings, **({} if "top_k" in settings else {"top_k": 0}), replay_sampler_support=False)


def test_score_centering_trains_on_a_replayed_truncation_and_still_rejects_what_cannot_be_replayed():
    RPPConfig(**CPU, top_k=6, score_centering=True)
    RPPConfig(**CPU, top_k=20, top_p=0.5, min_p=0.05, score_centering=True)
    with pytest.raises(ValueError, match=r"^top_k=6 is not supported with score_centering=True"):
        RPPConfig(**CPU, top_k=6, score_centering=True, replay_sampler_support=False)
    with pytest.raises(ValueError, match=r"^repetition_penalty=1.1 is not supported with score_centering=True"):
        RPPConfig(**CPU, top_k=6, score_centering=True, repetition_penalty=1.1)
    with pytest.raises(ValueError, match=r"^generation_kwargs: no_repeat_ngram_size=2 is not supported"):
        RPPConfig(**CPU, top_k=6, score_centering=True, generation_kwargs={"no_repeat_ngram_size": 2})
    with pytest.raises(ValueError, match=r"^generation_kwargs: frequency_penalty=0.5 is not supported"):
        RPPConfig(**CPU, top_k=6, score_centering=True, use_vllm=True, generation_kwargs={"frequency_penalty": 0.5},
                  vllm_importance_sampling_mode="token_truncate")


def test_vllm_importance_sampling_rejects_what_cannot_be_replayed_and_allows_the_opt_out():
    """TRL's vLLM ratio divides by the engine's processed log-probs: a penalty that changes q biases it silently, so
    it is rejected while the correction is on; a truncation is replayed, or explicitly not (its ratio is then the
    kept mass, docs/sampling.md)."""
    vllm = dict(CPU, use_vllm=True)
    for kw in (dict(repetition_penalty=1.1), dict(generation_kwargs={"presence_penalty": 0.5})):
        with pytest.raises(ValueError, match=r"is not supported with vllm_importance_sampling_correction=True; "):
            RPPConfig(**vllm, **kw)
        RPPConfig(**vllm, **kw, vllm_importance_sampling_correction=False)
        RPPConfig(**CPU, **kw)  # transformers' path has no such ratio
    with pytest.raises(ValueError, match=r"^generation_kwargs: temperature=0.5 differs from the trainer's temperature"):
        RPPConfig(**vllm, generation_kwargs={"temperature": 0.5})
    RPPConfig(**vllm, top_k=6)
    RPPConfig(**vllm, top_k=6, replay_sampler_support=False)


# --- the on-policy identity on transformers' path -------------------------------------------------------------------


class SupportRecordingTrainer(CaptureTrainer):
    """Records, beside the trainer, what `generate` kept and `log q_S` of each sampled token (its own
    `SamplerSupportCapture`, after every warper), and the log-probs of every loss forward."""

    def __init__(self, *a, bound, **kw):
        super().__init__(*a, **kw)
        self.bound, self.recorded, self.loss_logps = bound, [], []

    def _generate_single_turn(self, *a, **kw):
        capture = SamplerSupportCapture(self.bound)
        with capturing_generate(self.accelerator.unwrap_model(self.model), capture, last=True):
            out = super()._generate_single_turn(*a, **kw)
        self.recorded.append(capture)
        return out

    def _policy_forward(self, model, inputs):
        fwd = super()._policy_forward(model, inputs)
        self.loss_logps.append(fwd.logps.detach().clone())
        return fwd


def on_policy_run(tmp_path, tiny_model, settings, replay, score_centering=False):
    """One optimizer step over one generation batch of 8 completions (2 micro-batches, so that pi_old is computed
    at generation), sampled by the initial weights."""
    args = make_args(tmp_path, "reinforce_plus_plus_baseline", max_steps=1, max_completion_length=6, num_iterations=2,
                     replay_sampler_support=replay, score_centering=score_centering,
                     score_centering_top_k=settings["top_k"] if score_centering else 32, **settings)
    trainer = SupportRecordingTrainer(model=tiny_model, reward_funcs=[copy_first_char_reward, length_reward],
                                      args=args, train_dataset=copy_task_dataset(16), bound=2 * settings["top_k"])
    trainer.train()
    batch = trainer.generation_batches[0]
    ids, logps, sampled = trainer.recorded[0].tensors(batch["completion_ids"].size(1))
    return trainer, batch, support_of(ids, logps), sampled


def kept_mass(tiny_model, batch, support, temperature):
    """pi(S_t) `[B, T]` of the initial weights, float64, from a separate forward."""
    from trainer_helpers import initial_model_logp_all

    logp = initial_model_logp_all(tiny_model, batch, temperature)
    present = support != ABSENT
    return torch.where(present, logp.gather(-1, support.clamp(min=0)).exp(), 0.0).sum(-1)


@pytest.mark.parametrize("name", list(SETTINGS))
def test_on_policy_ratio_is_one_with_replay_and_the_kept_mass_without(tmp_path, tiny_model, name):
    settings = SETTINGS[name]
    temperature = settings.get("temperature", 1.0)

    trainer, batch, support, sampled = on_policy_run(tmp_path / "replay", tiny_model, settings, replay=True)
    mask = batch["completion_mask"].bool()
    # The trainer's own record is the sampler's kept set and log q_S.
    assert torch.equal(batch["sampler_support_ids"], support)
    torch.testing.assert_close(batch["sampler_per_token_logps"][mask], sampled[mask], rtol=0, atol=0)
    ratio = torch.exp(batch["old_per_token_logps"].double() - sampled.double())[mask]
    assert abs(ratio.mean().item() - 1) <= RATIO_ATOL and (ratio - 1).abs().max().item() <= RATIO_ATOL
    first_ppo_ratio = torch.exp(trainer.loss_logps[0].double() - trainer.loss_inputs[0]["old_per_token_logps"].double())
    first_mask = trainer.loss_inputs[0]["completion_mask"].bool()
    assert (first_ppo_ratio[first_mask] - 1).abs().max().item() <= RATIO_ATOL
    print(f"\n{name}: with replay, mean ratio {ratio.mean().item():.7f}, largest |ratio - 1| "
          f"{(ratio - 1).abs().max().item():.1e}, largest |first PPO ratio - 1| "
          f"{(first_ppo_ratio[first_mask] - 1).abs().max().item():.1e}")

    trainer, batch, support, sampled = on_policy_run(tmp_path / "full", tiny_model, settings, replay=False)
    mask = batch["completion_mask"].bool()
    assert "sampler_support_ids" not in batch
    ratio = torch.exp(batch["old_per_token_logps"].double() - sampled.double())[mask]
    mass = kept_mass(tiny_model, batch, support, temperature)[mask]
    torch.testing.assert_close(ratio, mass, rtol=0, atol=RATIO_ATOL)
    print(f"\n{name}: mean ratio without replay {ratio.mean().item():.4f} = mean kept mass {mass.mean().item():.4f}")
    assert mass.max().item() < 1 - 1e-3  # every position truncated something: the check above has teeth


def test_score_centering_coeff_l1_is_zero_on_policy_with_a_truncating_sampler(tmp_path, tiny_model):
    """With `top_k` replayed, score centering's head is the whole kept set and the loss's coefficients are ``q``, of
    L1 norm 1 whatever the drift: the logged `score_centering/coeff_l1` is the correction's size instead, 0 at the one
    step that trains on-policy samples (`tests/test_score_centering_trainer.py` checks it without truncation)."""
    trainer, batch, _, _ = on_policy_run(tmp_path, tiny_model, SETTINGS["top_k"], replay=True, score_centering=True)
    logs = [h for h in trainer.state.log_history if "score_centering/coeff_l1" in h]
    assert logs and logs[0]["score_centering/sampler_logp_abs_diff"] < 1e-4
    assert logs[0]["score_centering/coeff_l1"] < 1e-4, logs[0]
    assert logs[0]["score_centering/sampler_head_mass"] == pytest.approx(1.0, abs=1e-5)  # the head is the kept set


# --- the loss gradient against a float64 reference with log pi(y | S) -----------------------------------------------


def replayed_logp(logits, support_row):
    """log pi(. | S) of one position: float64 `[V]` logits (already divided by the temperature), the kept ids."""
    kept = [v for v in support_row if v != ABSENT]
    top = max(logits[v].item() for v in kept)
    lse = top + torch.log(sum(torch.exp(logits[v] - top) for v in kept))
    return {v: logits[v] - lse for v in kept}


def ref_step_loss(model, micro_batches, args):
    """The step's loss, explicit per-response loops, every log-prob `log pi(. | S_t)` over the recorded kept set:
    (1/B) sum_i (1/L_i) sum_t [ max(-rho A, -clip(rho) A) + sg(A w) sum_{v in S} q_S(v) log pi(v | S)   (centering)
                                + kl_loss_coef * KL_t ]
    with w = rho where the unclipped branch is active (else 0) and KL_t = 0.5 (log pi - log pi_ref)^2 (k2) or
    log pi - log pi_ref (k1), pi_ref's log-prob the batch's. The centering term is present with score centering (the
    head is the whole kept set here, so it has no tail)."""
    terms = []
    eps_low, eps_high = args.epsilon, args.epsilon_high or args.epsilon
    kl_coef = args.kl_loss_coef if args.use_kl_loss else 0.0
    for mb in micro_batches:
        ids = torch.cat([mb["prompt_ids"], mb["completion_ids"]], dim=1)
        attn = torch.cat([mb["prompt_mask"], mb["completion_mask"]], dim=1)
        T = mb["completion_ids"].size(1)
        logits = model(input_ids=ids, attention_mask=attn).logits[:, -T - 1 : -1] / args.temperature
        for i in range(ids.size(0)):
            total, n = 0.0, 0
            for t in range(T):
                if not mb["completion_mask"][i, t]:
                    continue
                logp = replayed_logp(logits[i, t], mb["sampler_support_ids"][i, t].tolist())
                y = int(mb["completion_ids"][i, t])
                lp, old = logp[y], mb["old_per_token_logps"][i, t].double()
                A = mb["advantages"][i, t].double()
                rho = torch.exp(lp - old)
                unclipped, clipped = -rho * A, -torch.clamp(rho, 1 - eps_low, 1 + eps_high) * A
                total = total + torch.maximum(unclipped, clipped)
                if args.score_centering:
                    w = rho.detach() if unclipped.item() >= clipped.item() else 0.0
                    head = mb["sampler_head_ids"][i, t].tolist()
                    q = mb["sampler_head_logps"][i, t].double().exp().tolist()
                    total = total + (A * w) * sum(qv * logp[v] for v, qv in zip(head, q) if qv > 0)
                if kl_coef:
                    d = lp - mb["ref_per_token_logps"][i, t].double()
                    total = total + kl_coef * (0.5 * d * d if args.kl_loss_type == "k2" else d)
                n += 1
            terms.append(total / max(n, 1))
    return sum(terms) / len(terms)


@pytest.mark.parametrize("estimator,kl,score_centering", [
    ("reinforce_plus_plus", "reward_k1", False), ("reinforce_plus_plus", "k1", True),
    ("reinforce_plus_plus_baseline", "k2", False), ("reinforce_plus_plus_baseline", "k2", True),
])
def test_accumulated_gradient_equals_the_replayed_float64_reference(tmp_path, tiny_model, estimator, kl,
                                                                   score_centering):
    """top_k=6, top_p=0.9 at temperature 0.8, gradient accumulation 2 x steps_per_generation 2, two iterations
    (pi_old is computed at generation): the gradient the optimizer sees at the first step is the float64
    reference's. The KL is k1 in REINFORCE++'s reward (`reward_k1`) or a k1/k2 loss; the reference log-probs and
    pi_old the batch carries (k1 shaping reads both) are checked against `log pi_init(. | S)` first."""
    from transformers import AutoModelForCausalLM, TrainerCallback

    from trainer_helpers import initial_model_logp_all

    grads = []

    class GradCapture(TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, model=None, **kw):
            grads.append({n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None})

    kw = dict(top_k=6, top_p=0.9, temperature=0.8, num_iterations=2, max_steps=1, max_grad_norm=0.0,
              score_centering=score_centering, score_centering_top_k=6 if score_centering else 32)
    if kl == "reward_k1":
        kw.update(kl_coef=0.05, use_kl_loss=False)
    else:
        kw.update(kl_coef=0.0, use_kl_loss=True, kl_loss_type=kl, kl_loss_coef=0.1)
    args = make_args(tmp_path, estimator, max_completion_length=6, **kw)
    trainer = CaptureTrainer(model=tiny_model, reward_funcs=[copy_first_char_reward, length_reward], args=args,
                             train_dataset=copy_task_dataset(32), callbacks=[GradCapture()])
    trainer.train()
    assert len(grads) == 1 and len(trainer.loss_inputs) == 2

    # pi_old and pi_ref at generation are the initial weights' log pi(y | S) (k1 shaping reads both).
    batch = trainer.generation_batches[0]
    mask = batch["completion_mask"].bool()
    logp_all = initial_model_logp_all(tiny_model, batch, args.temperature)
    support = batch["sampler_support_ids"]
    lse = torch.where(support != ABSENT, logp_all.gather(-1, support.clamp(min=0)), -math.inf).logsumexp(-1)
    want = logp_all.gather(-1, batch["completion_ids"].unsqueeze(-1)).squeeze(-1) - lse
    for key in ("old_per_token_logps", "ref_per_token_logps"):
        torch.testing.assert_close(batch[key][mask].double(), want[mask], rtol=0, atol=1e-5, msg=key)

    model64 = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float64)
    model64.train()
    ref_step_loss(model64, trainer.loss_inputs, trainer.args).backward()
    want = {n: p.grad for n, p in model64.named_parameters() if p.grad is not None}
    assert set(want) == set(grads[0])
    for name, g in grads[0].items():
        torch.testing.assert_close(g.double(), want[name], rtol=1e-4, atol=1e-6, msg=name)
    worst = max(((g.double() - want[n]).norm() / want[n].norm()).item() for n, g in grads[0].items())
    print(f"\n{estimator}, KL {kl}, score centering {score_centering}: largest relative L2 gradient error {worst:.1e}")


def test_a_closed_head_drops_the_tail_term_whose_gradient_is_zero_anyway():
    """Head = the whole kept set, p and q renormalized over it: `closed` makes the coefficients q_v exactly (q_v f(r_v)
    with a weight), and the correction's gradient is the same as without it, since the dropped rho * p term's
    gradient is rho * grad sum_S p = 0 (float64, by hand: q = (0.5, 0.3, 0.2 - 1e-7), a tail of 1e-7 from rounding)."""
    from trl_rpp.score_centering import score_centering_coefficients, score_centering_correction

    z = torch.tensor([[[1.0, 0.2, -0.5]]], dtype=torch.float64, requires_grad=True)
    head_logps = torch.log_softmax(z, -1)  # p over the kept set
    q = torch.tensor([[[0.5, 0.3, 0.2 - 1e-7]]], dtype=torch.float64)
    mask, closed = torch.ones(1, 1, dtype=torch.bool), torch.ones(1, 1, dtype=torch.bool)
    coeff, _, _ = score_centering_coefficients(head_logps, q.log(), mask, closed=closed)
    torch.testing.assert_close(coeff, q, rtol=0, atol=0)
    open_coeff, _, _ = score_centering_coefficients(head_logps, q.log(), mask)
    assert (open_coeff - q).abs().max() > 1e-3  # 1e-7 / min_tail_mass = 0.1 of p subtracted without `closed`
    grads = []
    for c in (closed, None):
        correction = score_centering_correction(torch.log_softmax(z, -1), q.log(), mask, closed=c)
        (g,) = torch.autograd.grad(correction.sum(), z)
        grads.append(g)
    torch.testing.assert_close(grads[0], grads[1], rtol=0, atol=1e-12)
    torch.testing.assert_close(grads[0][0, 0], q[0, 0] - torch.softmax(z.detach(), -1)[0, 0] * q.sum(), rtol=0, atol=1e-12)


def test_full_engine_records_become_mask_holes():
    """A position whose record is full (no absent slot, narrower than the vocabulary) may hide tied kept ids: it
    becomes a mask hole. Others, tool tokens and padding past a completion are left as they are."""
    from trl_rpp.records.replay import mask_full_records
    from trl_rpp.truncation import ABSENT

    A = ABSENT
    support = torch.tensor([[[1, 2], [3, A], [4, 5]], [[6, 7], [8, 9], [1, 2]]])
    completion_ids = [[1, 3, 4], [6, 8]]  # row 1 has 2 tokens: its position 2 is padding
    assert mask_full_records(completion_ids, None, support, vocab_size=10) == ([[0, 1, 0], [0, 0]], 4)
    # a tool token (0) that is full is not counted again
    assert mask_full_records(completion_ids, [[1, 1, 0], [1, 1]], support, 10) == ([[0, 1, 0], [0, 0]], 3)
    # a record as wide as the vocabulary holds every id: nothing hidden
    assert mask_full_records(completion_ids, None, support, vocab_size=2) == (None, 0)
    none_full = torch.tensor([[[1, A]], [[2, A]]])
    mask = [[1], [1]]
    assert mask_full_records([[1], [2]], mask, none_full, 10) == (mask, 0)


def test_a_tie_wider_than_the_record_is_trained_on_exactly(tmp_path, tiny_model):
    """Every head row the same: every token ties at every position, so `top_k=2` keeps the whole vocabulary, far
    more than the 4-id record. The run trains; each position's set is cut to the 4 recorded ids before sampling, so
    the sampler's and the trainer's log-probs are both log(1/4) and the on-policy ratio is exactly 1; every position
    of the batch is counted in `sampling/tie_overflow`."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    with torch.no_grad():
        head = model.get_output_embeddings().weight
        head.copy_(head[:1].expand_as(head))
    path = tmp_path / "tied"
    model.save_pretrained(path)
    from transformers import AutoTokenizer

    AutoTokenizer.from_pretrained(tiny_model).save_pretrained(path)
    trainer, batch, support, sampled = on_policy_run(tmp_path, str(path), dict(top_k=2), replay=True)
    mask = batch["completion_mask"].bool()
    assert ((batch["sampler_support_ids"] != ABSENT).sum(-1)[mask] == 4).all()
    quarter = torch.full_like(sampled[mask].double(), math.log(1 / 4))
    torch.testing.assert_close(batch["sampler_per_token_logps"][mask].double(), quarter, rtol=0, atol=1e-6)
    torch.testing.assert_close(batch["old_per_token_logps"][mask].double(), quarter, rtol=0, atol=1e-6)
    overflow = [row["sampling/tie_overflow"] for row in trainer.state.log_history if "sampling/tie_overflow" in row]
    B, T = batch["completion_ids"].shape
    assert overflow and B * int(mask.sum(1).max()) <= overflow[0] <= B * T
