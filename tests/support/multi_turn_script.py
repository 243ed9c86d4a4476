"""Multi-turn rollouts through RPPTrainer: shared by tests/test_multi_turn.py and, as a script, run by it under
`accelerate launch --multi_gpu --num_processes 2` (gloo on CPU).

The rollout (`rollout_func` below): two model turns, each sampled with the trainer's own `generate` settings, and a
deterministic environment between them, with two additions: a final feedback token after the model's last turn on
every other completion (a hole after the last model token), and a record of every row it returned, so the tests
rebuild the model-token mask from the rollout's own `env_mask`, not from the trainer's batch.
"""

import copy
import os
import sys
import warnings
from pathlib import Path

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

from trainer_helpers import CaptureTrainer, length_reward, make_args  # noqa: E402
from trl_rpp.testing.tiny import copy_first_char_reward, copy_task_dataset  # noqa: E402


def feedback(prompt_ids, turn_ids):
    """The environment: 1-3 deterministic tokens after the model's first turn (here an echo of the conversation)."""
    return (prompt_ids + turn_ids)[: 1 + sum(turn_ids) % 3]


def generate_turn(model, ids, config):
    """One model turn, sampled with `config`, and the sampled tokens' log-probs under the sampling distribution."""
    out = model.generate(torch.tensor([ids], device=model.device), generation_config=config)
    new = out.sequences[0, len(ids):].tolist()
    logps = torch.stack([torch.log_softmax(s[0].float(), -1)[t] for s, t in zip(out.scores, new)])
    return new, logps.tolist()


def rollout_func(prompts, trainer):
    tokenizer, model = trainer.processing_class, trainer.accelerator.unwrap_model(trainer.model)
    config = copy.deepcopy(trainer.generation_config)  # the trainer's sampling settings, at most 2 tokens a turn
    config.update(max_new_tokens=2, output_scores=True, return_dict_in_generate=True)
    out = {"prompt_ids": [], "completion_ids": [], "logprobs": [], "env_mask": []}
    with torch.no_grad():
        for prompt in prompts:
            prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
            turn1, logps1 = generate_turn(model, prompt_ids, config)
            env = feedback(prompt_ids, turn1)
            turn2, logps2 = generate_turn(model, prompt_ids + turn1 + env, config)  # sees prompt, turn 1, env
            out["prompt_ids"].append(prompt_ids)
            out["completion_ids"].append(turn1 + env + turn2)
            out["logprobs"].append(logps1 + [0.0] * len(env) + logps2)
            out["env_mask"].append([1] * len(turn1) + [0] * len(env) + [1] * len(turn2))
    return out


class RecordedRollout:
    """`rollout_func` plus a final environment token (the prompt's first token) on every other row. Records every
    call's rows in order, `calls[g] = [(prompt_ids, completion_ids, env_mask), ...]` (generation batch g, as built),
    and `rows[(prompt_ids, completion_ids)] = env_mask` to find a row again after TRL shuffled the batch."""

    def __init__(self, final_feedback=True):
        self.inner = rollout_func
        self.final_feedback = final_feedback
        self.rows, self.calls = {}, []

    def __call__(self, prompts, trainer):
        out = self.inner(prompts, trainer)
        self.calls.append([])
        for i, (p, c, m, lp) in enumerate(zip(out["prompt_ids"], out["completion_ids"], out["env_mask"], out["logprobs"])):
            if self.final_feedback and i % 2 == 1:
                c.append(p[0])
                m.append(0)
                lp.append(0.0)
            self.rows[(tuple(p), tuple(c))] = list(m)
            self.calls[-1].append((list(p), list(c), list(m)))
        return out

    def model_mask(self, batch):
        """``[B][T]`` 0/1: the rollout's env_mask for each row of `batch`, 0 on padding and on rows TRL masked out."""
        T = batch["completion_ids"].size(1)
        out = []
        for i in range(batch["completion_ids"].size(0)):
            p = [t for t, a in zip(batch["prompt_ids"][i].tolist(), batch["prompt_mask"][i].tolist()) if a]
            n = int(batch["completion_mask"][i].sum())
            row = self.rows[(tuple(p), tuple(batch["completion_ids"][i, :n].tolist()))] if n else []
            out.append([int(v) for v in row] + [0] * (T - len(row)))
        return out


class MultiTurnTrainer(CaptureTrainer):
    """CaptureTrainer that also records, per loss micro-batch, the loss forward's log-probs, the policy and KL losses,
    the gradient w.r.t. those log-probs and w.r.t. the final hidden states (hooks on the real backward), and, per
    generation batch, the normalization metrics as logged."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.loss_records, self.logp_grads, self.hidden_grads, self.norm_metrics = [], [], [], []
        norm = self.accelerator.unwrap_model(self.model).model.norm  # the final norm: its output feeds the LM head only

        def on_forward(module, args, output):
            if output.requires_grad:
                output.register_hook(lambda g: self.hidden_grads.append(g.detach().clone()))

        norm.register_forward_hook(on_forward)

    def _normalized_advantages(self, mode, raw, mask, old_logps, ref_logps, batch):
        out = super()._normalized_advantages(mode, raw, mask, old_logps, ref_logps, batch)
        m = self._metrics[mode]
        keys = ("advantages/valid_tokens", "advantages/raw_mean", "ref_kl/k1_mean")
        self.norm_metrics.append({k: m[k][-1] for k in keys if m.get(k)})
        return out

    def _policy_forward(self, model, inputs):
        fwd = super()._policy_forward(model, inputs)
        if fwd.logps.requires_grad:
            fwd.logps.register_hook(lambda g: self.logp_grads.append(g.detach().clone()))
        self.loss_records.append({"logps": fwd.logps.detach().clone()})
        return fwd

    def _policy_loss(self, *a, **kw):
        loss = super()._policy_loss(*a, **kw)
        self.loss_records[-1]["policy_loss"] = loss.detach().clone()
        return loss

    def _kl_loss(self, *a, **kw):
        loss = super()._kl_loss(*a, **kw)
        self.loss_records[-1]["kl_loss"] = loss.detach().clone()
        return loss


ESTIMATOR_KW = {"reinforce_plus_plus": dict(kl_coef=0.05, gamma=0.9), "reinforce_plus_plus_baseline": {}}


def build(tmp_path, model_path, estimator, rollout=None, dataset=None, **kw):
    """A MultiTurnTrainer on the recorded docs rollout: 4 rows a micro-batch, groups of 4, a lr that moves pi_old away
    from pi_ref after one step (so k1 is non-zero at external tokens in the next generation batch)."""
    rollout = rollout or RecordedRollout()
    args = make_args(Path(tmp_path), estimator, max_completion_length=8, **{**ESTIMATOR_KW[estimator], **kw})
    trainer = MultiTurnTrainer(
        model=model_path, reward_funcs=[copy_first_char_reward, length_reward], args=args,
        train_dataset=dataset if dataset is not None else copy_task_dataset(64), rollout_func=rollout,
    )
    return trainer, rollout


def main(outdir, model_path):
    """Both estimators, 2 steps each, one generation batch of 8 rows per step (4 per process, one group of 8 spanning
    both processes); REINFORCE++ builds its returns in the loss (steps_per_generation=1)."""
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    for estimator in ESTIMATOR_KW:
        out = Path(outdir) / estimator
        trainer, rollout = build(out, model_path, estimator, gradient_accumulation_steps=1, steps_per_generation=1,
                                 max_steps=2, num_generations=8)
        trainer.train()
        assert trainer.accelerator.num_processes == 2, trainer.accelerator.num_processes
        rank = trainer.accelerator.process_index
        torch.save(
            dict(batches=trainer.generation_batches, rewards=trainer.captured_rewards, loss_inputs=trainer.loss_inputs,
                 norm_metrics=trainer.norm_metrics, gen_masks=[rollout.model_mask(b) for b in trainer.generation_batches],
                 loss_masks=[rollout.model_mask(b) for b in trainer.loss_inputs],
                 backend=torch.distributed.get_backend()),
            Path(outdir) / f"{estimator}-rank{rank}.pt",
        )


if __name__ == "__main__":
    main(*sys.argv[1:])
