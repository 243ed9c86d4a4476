"""One generation batch, one record (`trl_rpp.records.generation`): a batch sampled while another is being scored
leaves the first batch's record, its scoring and its loss exactly as they are when the first batch is made alone.

Training with a lag samples batch t + 1 while batch t is scored and trained. Here the trainer samples a second batch
right after GRPO's `_generate` returned the first, before GRPO's old-policy forward reads the first batch's kept sets
and before its rewards are computed: with the sampler's records on the trainer, the second batch's would replace the
first's. The colocated vLLM engine's case is in tests/test_vllm_engine.py (`test_a_batch_sampled_ahead_...`).
"""

import pytest
import torch

from trainer_helpers import CaptureTrainer, length_reward, make_args
from trl_rpp.records.generation import GenerationRecord, current_record, recording, use_record
from trl_rpp.testing.tiny import copy_first_char_reward, copy_task_dataset

# A replayed truncation (top_k) with score centering; REINFORCE++'s k1 shaping and two micro-batches per generation
# batch, so that GRPO computes pi_old at generation, through the kept sets of the record.
SETTINGS = dict(top_k=6, temperature=0.8, score_centering=True, score_centering_top_k=6, max_steps=1,
                max_completion_length=6)


class SampleAheadTrainer(CaptureTrainer):
    """Samples one more generation batch (`_sample`) inside GRPO's generation of each batch, once the batch's own
    record is current (with `ahead`), and records every micro-batch loss."""

    def __init__(self, *a, ahead=False, **kw):
        super().__init__(*a, **kw)
        self.ahead, self.sampled_ahead, self.losses = ahead, [], []

    def _generate(self, prompts):
        out = super()._generate(prompts)
        if self.ahead:
            # The random state is put back afterwards: GRPO shuffles the batch into micro-batches with it, and the
            # losses compared below must see the same micro-batches.
            state = torch.get_rng_state()
            self.sampled_ahead.append(self._sample(prompts))
            torch.set_rng_state(state)
        return out

    def _compute_loss(self, model, inputs):
        loss = super()._compute_loss(model, inputs)
        self.losses.append(loss.detach().clone())
        return loss


def run(tmp_path, tiny_model, ahead):
    args = make_args(tmp_path, "reinforce_plus_plus", **SETTINGS)
    trainer = SampleAheadTrainer(model=tiny_model, reward_funcs=[copy_first_char_reward, length_reward], args=args,
                                 train_dataset=copy_task_dataset(16), ahead=ahead)
    trainer.train()
    return trainer


def test_a_batch_sampled_while_another_is_scored_leaves_its_record_scoring_and_loss_unchanged(tmp_path, tiny_model):
    alone = run(tmp_path / "alone", tiny_model, ahead=False)
    ahead = run(tmp_path / "ahead", tiny_model, ahead=True)
    (first,), (made_alone,) = ahead.generation_batches, alone.generation_batches
    (second,) = ahead.sampled_ahead
    # The second batch is another batch: other completions, another record (else the test could not fail).
    assert not torch.equal(second.record.support, first["sampler_support_ids"][:, : second.record.support.size(1)]) \
        or second.output[1] != first["completion_ids"].tolist()
    assert set(first) == set(made_alone)
    for key in first:  # the record's keys, pi_old through its kept sets, the advantages: to the bit
        if torch.is_tensor(first[key]):
            assert torch.equal(first[key], made_alone[key]), key
    assert {"sampler_support_ids", "sampler_head_ids", "old_per_token_logps", "advantages"} <= set(first)
    assert len(ahead.losses) == len(alone.losses) == 2
    for got, want in zip(ahead.losses, alone.losses):
        assert torch.equal(got, want), (got, want)


def test_the_current_record_is_scoped_to_its_block():
    """`recording` makes a record current for its block only, `use_record` replaces it for the rest of the enclosing
    block, and nothing outside a block can read or write one."""
    with pytest.raises(RuntimeError, match="^a log-prob forward runs outside a generation batch"):
        current_record("a log-prob forward")
    with pytest.raises(RuntimeError, match="use_record outside a recording block"):
        use_record(GenerationRecord())
    sampled = GenerationRecord(tie_overflow=3)
    with recording() as outer:
        assert current_record("x") is outer
        with recording() as inner:
            assert current_record("x") is inner and inner is not outer
        assert current_record("x") is outer
        use_record(sampled)
        assert current_record("x") is sampled
    with pytest.raises(RuntimeError):
        current_record("x")
