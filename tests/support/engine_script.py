"""Run by tests/test_engines.py under `accelerate launch` with 2 CPU processes (gloo), once per engine (plain DDP,
DeepSpeed ZeRO-2, DeepSpeed ZeRO-3, FSDP2). One launch runs every case in turn, because each launch costs far more in
start-up than the cases cost in training.

Per case and rank it saves: the advantages each loss call received (and the kept sets it replayed), the trainable parameters after each optimizer
step (gathered in full under ZeRO-3 and FSDP2), the log history, and facts about the engine that really ran
(wrapper class, ZeRO stage and optimizer, partitioned parameters or DTensor shards), so that the parent test can compare engines step by step.
After the cases in `SAVED_CASES` it also calls `trainer.save_model(OUTDIR/CASE/final)`, as the `trl-rpp` CLI does,
for the parent test to load with `from_pretrained` and compare with the gathered weights of the last step.

With a fifth argument, a phase of `FAULT_PHASES`, it runs only that phase of the fault chain on rpp_ref instead:
preemption signals and a kill -9 mid-save, each phase resuming what the one before left (`fault_phase`).

    accelerate launch --config_file CONFIG --num_processes 2 --mixed_precision no \
        engine_script.py OUTDIR MODEL EOS_MODEL {ddp,zero2,zero3,fsdp2} [PHASE]
"""

import logging
import os
import signal
import sys
import warnings
from pathlib import Path

import torch

warnings.filterwarnings("ignore")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from torch.distributed.tensor import DTensor  # noqa: E402
from transformers import TrainerCallback  # noqa: E402

from trainer_helpers import LORA_HEAD, CaptureTrainer, finish_launched, length_reward, make_args  # noqa: E402
from trl_rpp.testing.tiny import copy_first_char_reward, copy_task_dataset  # noqa: E402

REPLAY_TOP_K = 8  # the top_k of rpp_ref and lora_head_replay; the other cases sample from the full softmax

# name -> (estimator, RPPConfig overrides, uses LoRA). Together: both estimators, a frozen reference copy (k1
# shaping; k2 loss), LoRA whose reference is the disabled adapter, score centering on and off (without truncation:
# the full-softmax head, `lm_head.full_logps`), a replayed truncating sampler (`lm_head.kept_logps`), returns built at
# generation (steps_per_generation=2 and 4) and deferred into the loss (steps_per_generation=1), gradient accumulation.
# The LoRA cases put an adapter on the head too (`trainer_helpers.LORA_HEAD`): its `lora_B`, partitioned under
# ZeRO-3 and a DTensor under FSDP2, is read through the full-softmax head (rpp_lora_deferred) and the kept ids' rows
# with score centering (lora_head_replay).
CASES = {
    # Momentum gives the optimizer a state that a resume from the step-2 checkpoint must restore (and torch 2.13's
    # full-state-dict optimizer load under FSDP2 fails on a stateless one: no tensor to take the device from).
    # steps_per_generation=4 micro-batches, 2 per optimizer step: steps 1-2 train on one generation batch and step 3
    # on the next, so checkpoints at steps 1 and 3 fall inside one (the fault chain, `FAULT_PHASES`).
    # top_p inside top_k's bound: replay reads the kept ids' head rows in the old-policy, reference and loss forwards
    # of a fully trained head (its gradient by rows, partitioned under ZeRO-3, a DTensor under FSDP2), and the kept
    # sets travel in the generation buffer that the checkpoints inside a generation batch save and resume.
    "rpp_ref": ("reinforce_plus_plus", dict(kl_coef=0.05, gamma=0.9, max_steps=3, optim_args="momentum=0.9",
                                            steps_per_generation=4, top_k=REPLAY_TOP_K, top_p=0.8), False),
    "baseline_sc": ("reinforce_plus_plus_baseline", dict(score_centering=True, score_centering_top_k=8, max_steps=2), False),
    "rpp_lora_deferred": (
        "reinforce_plus_plus",
        dict(kl_coef=0.05, gradient_accumulation_steps=1, steps_per_generation=1, max_steps=2),
        True,
    ),
    "lora_head_replay": (
        "reinforce_plus_plus_baseline",
        dict(top_k=REPLAY_TOP_K, top_p=0.8, score_centering=True, score_centering_top_k=4, gradient_accumulation_steps=1,
             steps_per_generation=1, max_steps=2),
        True,
    ),
    # Rank 0 gets the "b:" prompts, which the EOS model never ends, rank 1 the "a:" prompts, which it ends at once:
    # the ranks generate different numbers of tokens, with ZeRO-3 shards gathered layer by layer (no full gather).
    "unequal_lengths": (
        "reinforce_plus_plus",
        dict(kl_coef=0.05, ds3_gather_for_generation=False, gradient_accumulation_steps=1, steps_per_generation=1, max_steps=2,
             shuffle_dataset=False, max_completion_length=6),
        False,
    ),
}


# A full model and a LoRA adapter: what `save_model` writes differs (model weights vs adapter only) and so does
# its route under ZeRO-3 (the frozen base is excluded from the 16-bit gather).
SAVED_CASES = ("rpp_ref", "rpp_lora_deferred")
# The engines that also checkpoint at step 2 of rpp_ref and resume from it: ZeRO-3 and FSDP2 (FULL_STATE_DICT,
# whose checkpoints hold the model gathered on process 0, loaded back with a broadcast from it).
RESUMED_ENGINES = ("zero3", "fsdp2")


def _zero3():
    from transformers.integrations import is_deepspeed_zero3_enabled

    return is_deepspeed_zero3_enabled()


class ParamSnapshots(TrainerCallback):
    """The full value of every trainable parameter when training starts (after any resume) and after every
    optimizer step, keyed by global step (a collective under ZeRO-3)."""

    def __init__(self):
        self.steps = {}

    def _snapshot(self, state, model):
        params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        if _zero3():
            import deepspeed

            with deepspeed.zero.GatheredParameters([p for _, p in params]):
                self.steps[state.global_step] = {n: p.detach().clone() for n, p in params}
        else:  # FSDP2 parameters are sharded DTensors: `full_tensor` all-gathers them
            self.steps[state.global_step] = {
                n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone() for n, p in params
            }

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self._snapshot(state, model)

    def on_step_end(self, args, state, control, model=None, **kwargs):
        self._snapshot(state, model)


def partition_facts(params):
    """How parameters are stored: under ZeRO-3 a parameter holds no data outside a gather (local numel
    0) while `ds_numel` is its full size and `ds_tensor` this rank's shard."""
    params = list(params)
    dtensors = [p for p in params if isinstance(p, DTensor)]
    return dict(
        dtensor=bool(params) and len(dtensors) == len(params),
        dtensor_local_numel=sum(p.to_local().numel() for p in dtensors),
        has_ds_id=bool(params) and all(hasattr(p, "ds_id") and hasattr(p, "ds_status") for p in params),
        local_numel=sum(p.numel() for p in params),
        ds_numel=sum(getattr(p, "ds_numel", 0) for p in params),
        partition_numel=sum(p.ds_tensor.numel() for p in params if hasattr(p, "ds_tensor")),
    )


def engine_facts(trainer):
    """What ran after training: the wrapper of the policy and, under DeepSpeed, its ZeRO stage and optimizer."""
    wrapped = trainer.model_wrapped
    facts = dict(
        wrapper=f"{type(wrapped).__module__}.{type(wrapped).__name__}",
        num_processes=trainer.accelerator.num_processes,
        backend=torch.distributed.get_backend(),
        distributed_type=str(trainer.accelerator.distributed_type),
    )
    if hasattr(wrapped, "zero_optimization_stage"):
        opt = wrapped.optimizer
        facts.update(zero_stage=wrapped.zero_optimization_stage(), optimizer=f"{type(opt).__module__}.{type(opt).__name__}")
    return facts


def build_case(outdir, model_path, eos_model_path, engine, name, save_steps=None):
    """The CaptureTrainer of case `name` (checkpointing every `save_steps` steps), its ParamSnapshots, and the
    storage facts of its models as built."""
    estimator, overrides, lora = CASES[name]
    overrides = dict(overrides)
    # SGD (with momentum in rpp_ref): the update is linear in the gradients, so float32 reduction-order noise stays
    # float32-sized. Adam's first step g / (|g| + eps) turns that noise on near-zero gradients into updates of up
    # to 2 * lr.
    kw = dict(optim="sgd", learning_rate=0.5, bf16=False)
    # On CPU, DeepSpeed needs use_cpu=False with gloo (use_cpu=True would silently fall back to DDP); plain DDP
    # and FSDP2 (through `force_fsdp_on_cpu`) need use_cpu=True (use_cpu=False without a GPU runs each rank alone).
    kw.update(dict(use_cpu=False, ddp_backend="gloo") if engine.startswith("zero") else dict(use_cpu=True))
    kw.update(overrides)
    if save_steps:
        kw.update(save_strategy="steps", save_steps=save_steps, save_only_model=False)
    dataset = copy_task_dataset(64)
    model = model_path
    if name == "unequal_lengths":
        from datasets import Dataset

        model = eos_model_path
        # Unshuffled, the sampler takes prompts 0, 1, ... and repeats each num_generations=4 times: the group of
        # prompt 0 ("b:") lands on rank 0, that of prompt 1 ("a:") on rank 1.
        dataset = Dataset.from_list([{"prompt": "b:" if i % 2 == 0 else "a:"} for i in range(64)])
    args = make_args(Path(outdir) / name, estimator, **kw)
    extra = {}
    if lora:
        from peft import LoraConfig

        extra["peft_config"] = LoraConfig(**LORA_HEAD)
    snaps = ParamSnapshots()
    trainer = CaptureTrainer(
        model=model, reward_funcs=[copy_first_char_reward, length_reward], args=args, train_dataset=dataset,
        callbacks=[snaps], **extra,
    )
    # Storage as built, before `train` wraps the policy: the policy, the frozen base model under LoRA, and the
    # reference model when there is one (ZeRO-3 partitions them at load time; FSDP2 shards the policy in `train`).
    frozen = [p for p in trainer.model.parameters() if not p.requires_grad] if lora else None
    facts = dict(
        policy=partition_facts(trainer.model.parameters()),
        base=partition_facts(frozen) if lora else None,
        ref=partition_facts(trainer.ref_model.parameters()) if trainer.ref_model is not None else None,
    )
    return trainer, snaps, facts


def save_record(outdir, tag, trainer, snaps, facts, **more):
    """What the parent test compares, to OUTDIR/<tag>_rank<r>.pt."""
    facts = dict(facts, **engine_facts(trainer), policy_after=partition_facts(trainer.model.parameters()))
    out = dict(
        facts=facts,
        advantages=[x["advantages"].detach().cpu() for x in trainer.loss_inputs],
        completion_masks=[x["completion_mask"].detach().cpu() for x in trainer.loss_inputs],
        # The kept sets each loss call replayed (None: no replay), as its batch carried them.
        support_ids=[x["sampler_support_ids"].cpu() if "sampler_support_ids" in x else None for x in trainer.loss_inputs],
        params=dict(snaps.steps),
        logs=trainer.state.log_history,
        generations=len(trainer.generation_batches),
        **more,
    )
    torch.save(out, os.path.join(outdir, f"{tag}_rank{trainer.accelerator.process_index}.pt"))


def run_case(outdir, model_path, eos_model_path, engine, name, resume_from=None, save=False):
    trainer, snaps, facts = build_case(outdir, model_path, eos_model_path, engine, name, save_steps=2 if save else None)
    trainer.train(resume_from_checkpoint=resume_from)
    if name in SAVED_CASES and not resume_from:
        trainer.save_model(os.path.join(outdir, name, "final"))  # a collective under ZeRO-3 and FSDP2
    save_record(outdir, name + ("_resumed" if resume_from else ""), trainer, snaps, facts)
    trainer.accelerator.wait_for_everyone()
    del trainer


def rejections(outdir, model_path):
    """Construct RPPTrainer under tensor parallelism from the args and context parallelism from the environment a
    YAML launch sets (which GRPOConfig never sees); record each error. Run last: it rebuilds accelerate's state."""
    from accelerate import ParallelismConfig
    from accelerate.state import AcceleratorState

    errors = {}
    routes = {
        "args_tp": (dict(parallelism_config=ParallelismConfig(tp_size=2)), {}),
        "env_cp": ({}, dict(ACCELERATE_USE_PARALLELISM_CONFIG="true", PARALLELISM_CONFIG_CP_SIZE="2")),
    }
    for route, (kw, env) in routes.items():
        AcceleratorState._reset_state()  # the next Accelerator reads its parallelism config afresh
        os.environ.update(env)
        try:
            args = make_args(Path(outdir) / route, "reinforce_plus_plus", use_cpu=False, ddp_backend="gloo", **kw)
            CaptureTrainer(model=model_path, reward_funcs=[copy_first_char_reward, length_reward], args=args,
                           train_dataset=copy_task_dataset(16))
            errors[route] = None
        except ValueError as e:
            errors[route] = str(e)
        finally:
            for k in env:
                del os.environ[k]
    return errors


def force_fsdp_on_cpu():
    """Test-only shim: accelerate keeps the FSDP plugin only for accelerator devices and silently runs plain DDP on
    CPU. After accelerate builds its state, turn a multi-CPU state launched with FSDP into an FSDP one, so that
    `Accelerator.prepare` applies `fully_shard` (gloo). Nothing in transformers, TRL or trl_rpp is changed.

    It rests on accelerate internals (`AcceleratorState.__init__` taking `fsdp_plugin`, a launched CPU state being
    `MULTI_CPU`); where they differ it raises, naming the accelerate version, instead of running DDP under an FSDP
    name. The parent test then also checks that the policy really is sharded with `fully_shard`."""
    import inspect

    import accelerate
    from accelerate.state import AcceleratorState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    original = AcceleratorState.__init__
    if "fsdp_plugin" not in inspect.signature(original).parameters:
        raise RuntimeError(f"tests/support/engine_script.py's CPU FSDP shim needs AcceleratorState.__init__(fsdp_plugin=...), "
                           f"which accelerate {accelerate.__version__} does not have: update the shim")

    def __init__(self, *args, fsdp_plugin=None, **kwargs):
        original(self, *args, fsdp_plugin=fsdp_plugin, **kwargs)
        if os.environ.get("ACCELERATE_USE_FSDP") != "true" or self.distributed_type == DistributedType.FSDP:
            return
        if self.distributed_type != DistributedType.MULTI_CPU:
            raise RuntimeError(f"tests/support/engine_script.py's CPU FSDP shim expected accelerate {accelerate.__version__} "
                               f"to build a MULTI_CPU state for an FSDP launch on CPU, got {self.distributed_type}: "
                               f"update the shim")
        self.distributed_type = DistributedType.FSDP
        if getattr(self, "fsdp_plugin", None) is None:
            self.fsdp_plugin = fsdp_plugin or FullyShardedDataParallelPlugin()

    AcceleratorState.__init__ = __init__


# The fault chain of tests/test_engines.py::test_preempted_killed_and_resumed_equal_the_uninterrupted_run, on case
# rpp_ref (3 steps, generations at steps 1 and 3: checkpoint-1 falls inside a generation batch). Two launches in one
# output folder; phase -> its runs in turn, each (record tag, the step in whose middle it waits for a preemption
# signal, the checkpoint whose save SIGKILLs every process, resume_from_checkpoint).
FAULT_PHASES = {
    # The parent SIGTERMs `accelerate launch` in step 1 and lets it wait for its workers, which then resume from
    # checkpoint-1 in the same processes and are killed saving checkpoint-3.
    "start": [("stopped_at_1", 1, None, None), ("killed_saving_3", None, 3, True)],
    # A fresh launch resumes past the torn checkpoint-3, from checkpoint-1; the parent SIGTERMs rank 1 only in step 2;
    # then a new trainer resumes from checkpoint-2.
    "restart": [("resumed_past_torn", 2, None, True), ("resumed_at_2", None, None, True)],
}
# No regular checkpoint before the last step (which Trainer saves under save_strategy="steps"): the preemption saves
# are the only others.
FAULT_SAVE_STEPS = 10


class WaitInStep(TrainerCallback):
    """Between the two micro-batches of optimizer step `step` (generated, one backward pass done), write
    `waiting_step<step>_rank<r>` (this pid) to the output folder and wait for a preemption signal or the parent's
    `release` (tests/support/resume_script.py's `wait_for_signals`)."""

    def __init__(self, trainer, step):
        self.trainer, self.step, self.done = trainer, step, False

    def on_substep_end(self, args, state, control, **kwargs):
        if state.global_step + 1 == self.step and not self.done:
            from resume_script import wait_for_signals

            self.done = True
            wait_for_signals(self.trainer, f"waiting_step{self.step}", 1)


class Warnings(logging.Handler):
    """trl_rpp's warnings on this process (the skipped torn checkpoint)."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def fault_phase(outdir, model_path, engine, phase):
    """Run the runs of FAULT_PHASES[phase] on case rpp_ref in turn; save each one's record with what it raised
    (`preempted`) and trl_rpp's warnings. A run whose checkpoint save is killed saves its record first."""
    from checkpoint_faults import install_kill
    from trl_rpp.faults.preemption import TrainingPreempted

    for tag, wait_step, kill_step, resume in FAULT_PHASES[phase]:
        trainer, snaps, facts = build_case(outdir, model_path, None, engine, "rpp_ref", save_steps=FAULT_SAVE_STEPS)
        seen = Warnings()
        logging.getLogger("trl_rpp").addHandler(seen)

        def record(trainer=trainer, snaps=snaps, facts=facts, tag=tag, seen=seen, **more):
            save_record(outdir, tag, trainer, snaps, facts, warnings=list(seen.messages), **more)

        if wait_step is not None:
            trainer.add_callback(WaitInStep(trainer, wait_step))
        if kill_step is not None:
            def kill(record=record):
                record(preempted=None, killed=True)
                os.kill(os.getpid(), signal.SIGKILL)  # a real kill -9: nothing after it runs

            # Every process dies once the model and optimizer of the checkpoint are written, before its RNG states
            # and trainer_state.json (tests/support/checkpoint_faults.py).
            install_kill("rng_start", kill_step, trainer, kill)
        try:
            trainer.train(resume_from_checkpoint=resume)
            preempted = None
        except TrainingPreempted as stop:
            preempted = dict(signal=stop.signal_name, step=stop.step, checkpoint=stop.checkpoint,
                             global_step=trainer.state.global_step)
        record(preempted=preempted, killed=False)
        logging.getLogger("trl_rpp").removeHandler(seen)
        del trainer


def main(outdir, model_path, eos_model_path, engine, phase=None):
    torch.set_num_threads(1)
    if engine == "fsdp2":
        force_fsdp_on_cpu()
    if engine.startswith("zero"):
        # DeepSpeed's CPU accelerator would JIT-compile a shared-memory all-reduce kernel (minutes, and a C++
        # toolchain) on first use. Marking it unavailable sends DeepSpeed's collectives through torch.distributed
        # (gloo here), the path they take with NCCL on GPUs. Nothing else in DeepSpeed changes.
        import deepspeed.ops

        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    if phase is not None:
        return fault_phase(outdir, model_path, engine, phase)
    for name in CASES:
        checkpointed = engine in RESUMED_ENGINES and name == "rpp_ref"
        run_case(outdir, model_path, eos_model_path, engine, name, save=checkpointed)
    if engine == "zero2":  # accelerate accepts a parallelism_config with DeepSpeed or FSDP2, not with CPU DDP
        errors = rejections(outdir, model_path)
        torch.save(errors, os.path.join(outdir, f"rejections_rank{torch.distributed.get_rank()}.pt"))
    if engine in RESUMED_ENGINES:
        # A new trainer resumes from the step-2 checkpoint and runs step 3 again.
        ckpt = os.path.join(outdir, "rpp_ref", "out", "checkpoint-2")
        run_case(outdir, model_path, eos_model_path, engine, "rpp_ref", resume_from=ckpt)


if __name__ == "__main__":
    main(*sys.argv[1:])
    finish_launched(sys.argv[1])
