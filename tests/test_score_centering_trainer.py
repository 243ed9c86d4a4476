"""Score centering through the real RPPTrainer: the capture records exactly the sampling distribution, and a few
training steps run with the correction and its metrics, for both estimators."""

import math
import warnings

import pytest
import torch

from test_trainer import CaptureTrainer, length_reward, make_args, tiny_model  # noqa: F401 (fixture)
from trl_rpp import RPPTrainer
from trl_rpp.tiny import copy_first_char_reward, copy_task_dataset

warnings.filterwarnings("ignore", category=FutureWarning)


def forward_logp_all(model_path, batch, temperature):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
    attn = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
    T = batch["completion_ids"].size(1)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=attn).logits[:, -T - 1 : -1]
    return torch.log_softmax(logits.float() / temperature, -1)


@pytest.mark.parametrize("estimator", ["reinforce_plus_plus", "reinforce_plus_plus_baseline"])
def test_capture_matches_a_separate_forward_and_training_runs(tmp_path, tiny_model, estimator):
    k = 8
    args = make_args(
        tmp_path, estimator, score_centering=True, score_centering_top_k=k, temperature=0.7, max_steps=3,
        max_completion_length=6,
    )
    trainer = CaptureTrainer(
        model=tiny_model, reward_funcs=[copy_first_char_reward, length_reward], args=args, train_dataset=copy_task_dataset(32)
    )
    trainer.train()

    # The first generation batch was sampled by the initial weights: recompute q at temperature 0.7 separately.
    batch = trainer.generation_batches[0]
    mask = batch["completion_mask"].bool()
    logq = forward_logp_all(tiny_model, batch, 0.7)
    B, T = mask.shape
    assert batch["sampler_head_ids"].shape == (B, T, k) and batch["sampler_head_logps"].shape == (B, T, k)
    want_top = logq.topk(k, dim=-1)
    torch.testing.assert_close(batch["sampler_head_logps"][mask], want_top.values[mask], rtol=1e-4, atol=1e-4)
    # Ids agree (up to ties) and the recorded log-probs are those of the recorded ids.
    torch.testing.assert_close(
        logq.gather(-1, batch["sampler_head_ids"])[mask], batch["sampler_head_logps"][mask], rtol=1e-4, atol=1e-4
    )
    sampled = logq.gather(-1, batch["completion_ids"].unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(batch["sampler_per_token_logps"][mask], sampled[mask], rtol=1e-4, atol=1e-4)
    # Memory is O(B * T * k): nothing of vocabulary size is kept.
    assert all(v.shape[-1] != 46 for v in batch.values() if torch.is_tensor(v) and v.dim() > 0)

    logs = [h for h in trainer.state.log_history if "score_centering/coeff_l1" in h]
    assert logs
    for h in logs:
        assert all(math.isfinite(v) for v in h.values() if isinstance(v, float))
        assert 0.0 < h["score_centering/sampler_head_mass"] <= 1.0 + 1e-6
        assert 0.0 < h["score_centering/trainer_head_mass"] <= 1.0 + 1e-6
    # Step 1 trains on its own samples with unchanged weights: the sampler and trainer agree to float precision.
    assert logs[0]["score_centering/sampler_logp_abs_diff"] < 1e-4
    assert logs[0]["score_centering/coeff_l1"] < 1e-4


def test_model_generation_config_that_changes_q_is_rejected(tmp_path, tiny_model):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model)
    model.generation_config.no_repeat_ngram_size = 2
    with pytest.raises(ValueError, match="model's generation config: no_repeat_ngram_size=2 .*accepted: None or 0"):
        RPPTrainer(
            model=model,
            reward_funcs=copy_first_char_reward,
            args=make_args(tmp_path, "reinforce_plus_plus_baseline", score_centering=True, reward_weights=None),
            train_dataset=copy_task_dataset(8),
        )
