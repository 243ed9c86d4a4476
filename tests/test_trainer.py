"""RPPTrainer end to end on a tiny local model: the advantages the loss receives equal the float64 reference."""

import math
import os

import pytest
import torch

from reference import (
    ref_global_masked_normalize,
    ref_group_mean_advantages,
    ref_reinforce_pp_returns,
)
from trainer_helpers import CaptureTrainer, initial_model_logps, length_reward, make_args, returns_at_generation
from trl_rpp import RPPTrainer
from trl_rpp.testing.tiny import copy_first_char_reward, copy_task_dataset


def rows_key(batch, i):
    return (tuple(batch["prompt_ids"][i].tolist()), tuple(batch["completion_ids"][i].tolist()))


@pytest.mark.parametrize("num_iterations", [1, 2])
@pytest.mark.parametrize("estimator", ["reinforce_plus_plus", "reinforce_plus_plus_baseline"])
def test_loss_receives_reference_advantages(tmp_path, tiny_model, estimator, num_iterations):
    kw = dict(num_iterations=num_iterations, max_steps=2 * num_iterations + 2)
    if estimator == "reinforce_plus_plus":
        kw.update(kl_coef=0.05, gamma=0.9)
    args = make_args(tmp_path, estimator, **kw)
    trainer = CaptureTrainer(
        model=tiny_model,
        reward_funcs=[copy_first_char_reward, length_reward],
        args=args,
        train_dataset=copy_task_dataset(64),
    )
    trainer.train()
    assert len(trainer.generation_batches) >= 2

    for gen_index, (batch, rpf) in enumerate(zip(trainer.generation_batches, trainer.captured_rewards)):
        B = batch["completion_ids"].size(0)
        assert B == 8  # per_device_train_batch_size * steps_per_generation
        rewards = [rpf[i, 0].item() * 1.0 + rpf[i, 1].item() * 0.5 for i in range(B)]
        mask = batch["completion_mask"].tolist()
        ref = batch.get("ref_per_token_logps")
        assert ref is not None, "the reference log-probs are computed for both recipes"
        # The reference is the frozen initial model, also after optimizer steps.
        torch.testing.assert_close(
            torch.where(batch["completion_mask"].bool(), ref.double(), 0.0),
            torch.where(batch["completion_mask"].bool(), initial_model_logps(tiny_model, batch, args.temperature), 0.0),
            rtol=1e-5,
            atol=1e-5,
        )
        if estimator == "reinforce_plus_plus":
            old = batch["old_per_token_logps"]
            if gen_index == 0:  # nothing has been trained yet: pi_old == pi_ref, so k1 == 0
                torch.testing.assert_close(old[batch["completion_mask"].bool()], ref[batch["completion_mask"].bool()])
            raw = ref_reinforce_pp_returns(rewards, old.double().tolist(), ref.double().tolist(), mask, 0.05, 0.9)
        else:
            raw = ref_group_mean_advantages(rewards, mask, 4)
        want, _, _, _ = ref_global_masked_normalize([raw], [mask])
        torch.testing.assert_close(batch["advantages"].double(), torch.tensor(want[0], dtype=torch.float64), rtol=1e-5, atol=1e-5)

    # What the loss receives: micro-batches of 4 rows, each row carrying its generation batch's advantages.
    assert len(trainer.loss_inputs) == args.max_steps * args.gradient_accumulation_steps
    by_key = {}
    for batch in trainer.generation_batches:
        for i in range(batch["completion_ids"].size(0)):
            by_key.setdefault(rows_key(batch, i), []).append(batch["advantages"][i])
    for inputs in trainer.loss_inputs:
        assert inputs["advantages"].shape == inputs["completion_ids"].shape
        for i in range(inputs["completion_ids"].size(0)):
            candidates = by_key[rows_key(inputs, i)]
            assert any(torch.equal(inputs["advantages"][i], c) for c in candidates)

    logs = [h for h in trainer.state.log_history if "advantages/std" in h]
    assert logs and all(math.isfinite(v) for h in logs for v in h.values() if isinstance(v, float))
    assert all(h["advantages/mean"] == pytest.approx(0.0, abs=1e-5) for h in logs)
    if estimator == "reinforce_plus_plus_baseline":
        assert all("kl_loss" in h for h in logs)
    else:
        assert all("returns/mean" in h and "ref_kl/k1_mean" in h for h in logs)


def test_no_reference_forward_when_no_kl(tmp_path, tiny_model):
    """REINFORCE++ with kl_coef=0 needs neither reference nor old log-probs: none are computed."""
    args = make_args(tmp_path, "reinforce_plus_plus", kl_coef=0.0, max_steps=2)
    trainer = CaptureTrainer(
        model=tiny_model, reward_funcs=[copy_first_char_reward, length_reward], args=args, train_dataset=copy_task_dataset(32)
    )
    assert trainer.ref_model is None and trainer.beta == 0.0
    trainer.train()
    for batch in trainer.generation_batches:
        assert "ref_per_token_logps" not in batch and "old_per_token_logps" not in batch


def test_model_as_a_path_loads_as_its_string_does(tmp_path, tiny_model):
    """`RPPTrainer(model=Path(...))` takes a local folder as an `os.PathLike`, as `from_pretrained` does (the offline
    model's `smollm2_path()` returns one), and trains as with the folder's name as a string."""
    from pathlib import Path

    args = make_args(tmp_path, "reinforce_plus_plus", kl_coef=0.0, max_steps=1)
    trainer = RPPTrainer(model=Path(tiny_model), reward_funcs=[copy_first_char_reward, length_reward], args=args,
                         train_dataset=copy_task_dataset(8))
    assert trainer.model.config._name_or_path == str(tiny_model)
    trainer.train()
    assert trainer.state.global_step == 1


def test_trainer_rejects_plain_grpo_config(tiny_model):
    from trl import GRPOConfig

    with pytest.raises(TypeError, match="RPPConfig"):
        RPPTrainer(
            model=tiny_model,
            reward_funcs=copy_first_char_reward,
            args=GRPOConfig(output_dir="/tmp/x", use_cpu=True, bf16=False, report_to="none"),
        )


@pytest.mark.slow
def test_tiny_model_learns_copy_task(tmp_path, tiny_model):
    """REINFORCE++ learns: 200 optimizer steps of 8 prompts x 8 samples (about 20 s). Reward must go from < 0.2 to
    > 0.8. REINFORCE++-baseline's learning run is `make demo-tiny`'s, checked by
    tests/test_demo_and_benchmarks.py::test_demo_tiny_learns_and_leaves_every_artifact (held-out accuracy > 0.8)."""
    args = make_args(
        tmp_path,
        "reinforce_plus_plus",
        per_device_train_batch_size=64,
        gradient_accumulation_steps=1,
        steps_per_generation=1,
        num_generations=8,
        max_completion_length=2,
        max_steps=200,
        learning_rate=3e-3,
        logging_steps=10,
        reward_weights=None,
    )
    trainer = RPPTrainer(
        model=tiny_model, reward_funcs=copy_first_char_reward, args=args, train_dataset=copy_task_dataset(20000)
    )
    trainer.train()
    rewards = [h["reward"] for h in trainer.state.log_history if "reward" in h]
    assert rewards[0] < 0.2, rewards
    assert sum(rewards[-3:]) / 3 > 0.8, rewards


def test_peft_lora_reference_is_disabled_adapter_and_card_and_wandb(tmp_path, tiny_model, monkeypatch):
    """LoRA for a few steps: the reference is the model with adapters disabled, a model card is written, and
    an offline wandb run directory is created."""
    from peft import LoraConfig

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    args = make_args(tmp_path, "reinforce_plus_plus_baseline", report_to="wandb", max_steps=2, learning_rate=5e-2)
    trainer = CaptureTrainer(
        model=tiny_model,
        reward_funcs=[copy_first_char_reward, length_reward],
        args=args,
        train_dataset=copy_task_dataset(32),
        peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0),
    )
    assert trainer.ref_model is None  # PEFT: no second copy, adapters are disabled instead
    trainer.train()
    import wandb

    wandb.finish()
    # LoRA B starts at zero, then moves: the trained policy differs from the base, the reference does not.
    last = trainer.generation_batches[-1]
    base = initial_model_logps(tiny_model, last, args.temperature)
    m = last["completion_mask"].bool()
    torch.testing.assert_close(last["ref_per_token_logps"][m].double(), base[m], rtol=1e-5, atol=1e-5)
    lora_b = [p for n, p in trainer.model.named_parameters() if "lora_B" in n]
    assert lora_b and any(p.abs().sum() > 0 for p in lora_b)

    trainer.create_model_card(model_name="tiny-rpp", dataset_name="copy-task")
    card = open(os.path.join(args.output_dir, "README.md")).read()
    assert "REINFORCE++" in card and "2501.03262" in card and "reinforce-plus-plus" in card
    runs = [d for d in os.listdir(tmp_path / "wandb") if d.startswith("offline-run-")]
    assert runs, os.listdir(tmp_path / "wandb")


def spec_step_loss(model, micro_batches, epsilon, kl_loss_coef, temperature):
    """The REINFORCE++ objective for one optimizer step, written out with explicit per-response loops:
    (1/B) sum_i (1/L_i) sum_t max(-rho A, -clip(rho) A)  +  kl_loss_coef * (1/B) sum_i (1/L_i) sum_t 0.5 (logp - ref)^2,
    with B every response of every micro-batch of the step (float64 model)."""
    terms_pg, terms_kl = [], []
    for mb in micro_batches:
        ids = torch.cat([mb["prompt_ids"], mb["completion_ids"]], dim=1)
        attn = torch.cat([mb["prompt_mask"], mb["completion_mask"]], dim=1)
        T = mb["completion_ids"].size(1)
        logits = model(input_ids=ids, attention_mask=attn).logits[:, -T - 1 : -1] / temperature
        logp = torch.log_softmax(logits, -1).gather(-1, mb["completion_ids"].unsqueeze(-1)).squeeze(-1)
        old = mb.get("old_per_token_logps")
        for i in range(ids.size(0)):
            pg, kl, n = 0.0, 0.0, 0
            for t in range(T):
                if not mb["completion_mask"][i, t]:
                    continue
                lp = logp[i, t]
                o = lp.detach() if old is None else old[i, t].double()
                rho = torch.exp(lp - o)
                A = mb["advantages"][i, t].double()
                pg = pg + torch.maximum(-rho * A, -torch.clamp(rho, 1 - epsilon, 1 + epsilon) * A)
                if kl_loss_coef:
                    kl = kl + 0.5 * (lp - mb["ref_per_token_logps"][i, t].double()) ** 2
                n += 1
            terms_pg.append(pg / max(n, 1))
            terms_kl.append(kl / max(n, 1))
    B = len(terms_pg)
    return sum(terms_pg) / B + kl_loss_coef * sum(terms_kl) / B


@pytest.mark.parametrize(
    "estimator,num_iterations",
    [("reinforce_plus_plus", 2), ("reinforce_plus_plus_baseline", 1), ("reinforce_plus_plus_baseline", 2)],
)
def test_accumulated_gradient_equals_spec_objective(tmp_path, tiny_model, estimator, num_iterations):
    """Gradient accumulation 2 x steps_per_generation 2: the gradient the optimizer sees at the first step is the
    gradient of the response-mean objective over all 8 responses of the step."""
    from transformers import AutoModelForCausalLM, TrainerCallback

    grads = []

    class GradCapture(TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, model=None, **kw):
            grads.append({n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None})

    kw = dict(num_iterations=num_iterations, max_steps=1, max_grad_norm=0.0)
    trainer = CaptureTrainer(
        model=tiny_model,
        reward_funcs=[copy_first_char_reward, length_reward],
        args=make_args(tmp_path, estimator, **kw),
        train_dataset=copy_task_dataset(32),
        callbacks=[GradCapture()],
    )
    trainer.train()
    assert len(grads) == 1 and len(trainer.loss_inputs) == 2

    model64 = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float64)
    model64.train()  # dropout is disabled in the config, and the tiny model has none
    loss = spec_step_loss(
        model64, trainer.loss_inputs, trainer.args.epsilon, trainer.args.kl_loss_coef if trainer.args.use_kl_loss else 0.0,
        trainer.args.temperature,
    )
    loss.backward()
    want = {n: p.grad for n, p in model64.named_parameters() if p.grad is not None}
    assert set(want) == set(grads[0])
    for name, g in grads[0].items():
        torch.testing.assert_close(g.double(), want[name], rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("score_centering", [False, True])
def test_deferred_returns_equal_generation_time_returns_and_save_a_forward(tmp_path, tiny_model, score_centering):
    """REINFORCE++ with steps_per_generation=1: pi_old is the loss forward's own log-probs, so the returns are built
    in the loss. Same numbers as building them at generation with an extra forward, one forward fewer per batch."""
    runs = {}
    for deferred in (True, False):
        args = make_args(
            tmp_path / str(deferred), "reinforce_plus_plus", kl_coef=0.05, gamma=0.9, steps_per_generation=1,
            gradient_accumulation_steps=2, max_steps=3, score_centering=score_centering,
            score_centering_top_k=8 if score_centering else 32,  # only score centering reads it
        )
        trainer = CaptureTrainer(
            model=tiny_model, reward_funcs=[copy_first_char_reward, length_reward], args=args,
            train_dataset=copy_task_dataset(64),
        )
        if not deferred:
            returns_at_generation(trainer)
        calls = []
        original = trainer._get_per_token_logps_and_entropies

        def counting(*a, **kw):
            calls.append(torch.is_grad_enabled())
            return original(*a, **kw)

        trainer._get_per_token_logps_and_entropies = counting
        trainer.train()
        runs[deferred] = (trainer.state.log_history, calls, trainer.generation_batches)
    logs_d, calls_d, batches_d = runs[True]
    logs_g, calls_g, batches_g = runs[False]
    assert all("rpp_rewards" in b and "advantages" not in b for b in batches_d)
    assert all("advantages" in b for b in batches_g)
    # 6 micro-batches: the generation-time path runs one extra no-grad forward (pi_old) for each.
    assert calls_g.count(False) - calls_d.count(False) == 6
    keys = ["loss", "reward", "advantages/raw_mean", "advantages/raw_std", "advantages/std", "returns/max", "ref_kl/k1_mean"]
    rows_d = [[h[k] for k in keys] for h in logs_d if "loss" in h]
    rows_g = [[h[k] for k in keys] for h in logs_g if "loss" in h]
    assert len(rows_d) == 3
    torch.testing.assert_close(torch.tensor(rows_d), torch.tensor(rows_g), rtol=1e-5, atol=1e-6)
