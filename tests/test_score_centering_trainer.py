"""Score centering through the real RPPTrainer: the capture records exactly the sampling distribution, and a few
training steps run with the correction and its metrics, for both estimators."""

import math

import pytest
import torch

from trainer_helpers import CaptureTrainer, initial_model_logp_all, length_reward, make_args
from trl_rpp import RPPTrainer
from trl_rpp.testing.tiny import copy_first_char_reward, copy_task_dataset


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
    logq = initial_model_logp_all(tiny_model, batch, 0.7, dtype=torch.float32)
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


def test_capture_nests_under_an_outer_generate_wrapper_and_sees_its_processor(tiny_model):
    """An outer wrapper (here: a logit bias, as the mismatch benchmark induces) runs before the capture, and each
    block restores exactly the `generate` it found."""
    from transformers import AutoModelForCausalLM, LogitsProcessor, LogitsProcessorList

    from trl_rpp.records.capture import SamplerTopKCapture, capturing_generate

    class Bias(LogitsProcessor):
        def __call__(self, input_ids, scores):
            return scores + torch.arange(scores.size(-1), dtype=scores.dtype)  # favours high ids

    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    plain = model.generate

    def biased(*a, logits_processor=None, **kw):
        return plain(*a, logits_processor=LogitsProcessorList([Bias(), *(logits_processor or [])]), **kw)

    model.generate = biased
    capture = SamplerTopKCapture(2, 1.0)
    ids = torch.tensor([[3, 4, 5]])
    with capturing_generate(model, capture):
        out = model.generate(input_ids=ids, max_new_tokens=3, do_sample=True, top_k=0, top_p=1.0, pad_token_id=0)
        assert model.__dict__["generate"] is not biased
    assert model.__dict__["generate"] is biased  # the outer wrapper is back, not deleted
    del model.generate
    assert "generate" not in model.__dict__
    head_ids, head_logps, sampled = capture.tensors(3)
    with torch.no_grad():
        logits = model(input_ids=out).logits[:, 2:-1].float()
    q = torch.log_softmax(logits + torch.arange(logits.size(-1), dtype=logits.dtype), -1)
    torch.testing.assert_close(head_logps, q.topk(2, -1).values, atol=1e-5, rtol=1e-5)  # the biased q, not p
    torch.testing.assert_close(sampled, q.gather(-1, out[:, 3:].unsqueeze(-1)).squeeze(-1), atol=1e-5, rtol=1e-5)
