"""The cases of tests/test_trainer_distributed.py, run under `accelerate launch --multi_gpu --num_processes 2` (gloo on
CPU) by tests/support/two_process_script.py, or alone:

    dist_trainer_script.py OUTDIR MODEL EOS_MODEL ESTIMATOR:MODE [ESTIMATOR:MODE ...]

Each case trains RPPTrainer for two steps on a tiny model (EOS_MODEL for "mask_truncated") and saves, per rank,
each generation batch as built and the gathered raw rewards to OUTDIR/ESTIMATOR-MODE-rank<r>.pt, so the parent test
can rebuild the global population and compare. All cases run in one launch: one start of both processes.
"""

import os
import sys
import warnings
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from trainer_helpers import LORA_HEAD, CaptureTrainer, length_reward, make_args  # noqa: E402
from trainer_helpers import returns_at_generation  # noqa: E402
from trl_rpp.testing.tiny import copy_first_char_reward, copy_task_dataset  # noqa: E402


ESTIMATORS = ["reinforce_plus_plus", "reinforce_plus_plus_baseline"]
CASES = ["reinforce_plus_plus:deferred", *(f"{e}:{mode}" for mode in ("groups", "mask_truncated") for e in ESTIMATORS),
         "reinforce_plus_plus_baseline:replay", "reinforce_plus_plus_baseline:lora_head"]
# A truncating sampler replayed, with score centering and the k2 loss (tests/test_replay.py's single-process case).
REPLAY = dict(top_k=6, top_p=0.9, temperature=0.8, score_centering=True, score_centering_top_k=6, max_grad_norm=0.0,
              num_iterations=2, kl_loss_coef=0.1)
# The replay case with a LoRA adapter on the head (and attention, `LORA_HEAD`): DDP reduces the adapter's gradient
# read in tiles.


def run_case(outdir, model_path, estimator, mode):
    extra = dict(kl_coef=0.05, gamma=0.9) if estimator == "reinforce_plus_plus" else {}
    dataset = copy_task_dataset(64)
    if mode == "mask_truncated":
        # Rank 0 gets the "b:" groups, which the model never ends: every completion there is truncated and masked.
        from datasets import Dataset

        dataset = Dataset.from_list([{"prompt": "b:" if i % 2 == 0 else "a:"} for i in range(64)])
        extra.update(mask_truncated_completions=True, shuffle_dataset=False, num_generations=4)
    kwargs = {}
    if mode in ("replay", "lora_head"):
        extra.update(REPLAY)
    if mode == "lora_head":
        from peft import LoraConfig

        kwargs["peft_config"] = LoraConfig(**LORA_HEAD)
    args = make_args(
        Path(outdir) / f"{estimator}-{mode}", estimator, gradient_accumulation_steps=1, steps_per_generation=1,
        max_steps=1 if mode in ("replay", "lora_head") else 2,
        num_generations=extra.pop("num_generations", 8),  # by default one group of 8 straddles the two processes
        **extra,
    )
    from transformers import TrainerCallback

    grads, head_grad_layouts = [], []

    class GradCapture(TrainerCallback):  # after DDP's all-reduce, before the optimizer step
        def on_step_begin(self, args, state, control, model=None, **kw):
            # Replay: rank 0 starts the step holding dense zero gradients, as after a micro-batch of gradient
            # accumulation, so its head gradient arrives sparse (added in place under DDP's hooks); rank 1's arrives
            # dense into None. The hook records which arrived.
            if mode != "replay" or state.global_step > 0:
                return
            head = model.get_output_embeddings().weight
            head.register_hook(lambda g: head_grad_layouts.append(g.layout))
            if args.process_index == 0:
                for p in model.parameters():
                    p.grad = torch.zeros_like(p) if p.requires_grad else None

        def on_pre_optimizer_step(self, args, state, control, model=None, **kw):
            grads.append({n.removeprefix("module."): p.grad.detach().clone() for n, p in model.named_parameters()
                          if p.grad is not None})

    trainer = CaptureTrainer(
        model=model_path,
        reward_funcs=[copy_first_char_reward, length_reward],
        args=args,
        train_dataset=dataset,
        callbacks=[GradCapture()],
        **kwargs,
    )
    # The adapter's initial weights (DDP starts every rank from rank 0's).
    init = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    # "groups": REINFORCE++ returns built at generation (with an old-policy forward); "deferred": built in the loss.
    if mode == "groups":
        returns_at_generation(trainer)
    trainer.train()
    rank = trainer.accelerator.process_index
    assert trainer.accelerator.num_processes == 2, trainer.accelerator.num_processes
    torch.save(
        dict(
            batches=trainer.generation_batches,
            rewards=trainer.captured_rewards,
            loss_inputs=trainer.loss_inputs,
            logs=trainer.state.log_history,
            backend=torch.distributed.get_backend(),
            args=trainer.args,
            grads=grads,
            head_grad_layouts=head_grad_layouts,
            init=init,
        ),
        os.path.join(outdir, f"{estimator}-{mode}-rank{rank}.pt"),
    )
    del trainer


def main(outdir, model_path, eos_model_path, *cases):
    warnings.filterwarnings("ignore")
    for case in cases:
        estimator, mode = case.split(":")
        run_case(outdir, eos_model_path if mode == "mask_truncated" else model_path, estimator, mode)


if __name__ == "__main__":
    main(*sys.argv[1:])
