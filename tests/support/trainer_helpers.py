"""Shared helpers of the trainer tests (imported by them and by tests/support/dist_trainer_script.py; fixtures live in
tests/conftest.py): a recording RPPTrainer, the small default config, the initial model's log-probs, and the one way
the tests start `accelerate launch` (on a port of their own)."""

import gc
import itertools
import os
import socket
import sys
import warnings
import weakref

import torch

from trl_rpp import RPPConfig, RPPTrainer


# TRL's importance-sampling modes, each run for this many generations by the vLLM engine test's cycling run.
# Sequence-level modes first: one weight per completion, so a batch can be all clipped or all masked once the policy
# has moved; the test asks each mode to act on some weights, not all.
IS_MODES = ["sequence_mask", "sequence_truncate", "token_mask", "token_truncate"]
IS_STEPS_PER_MODE = 2
# A LoRA adapter on the head and attention, as the multi-process tests train it (`LoraConfig(**LORA_HEAD)`).
LORA_HEAD = dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "lm_head"], lora_dropout=0.0)


def length_reward(completions, **kwargs):
    """A second, continuous reward so that the weighted sum over reward functions is exercised."""
    return [len(c) / 4.0 for c in completions]


def release_engines():
    """Free the colocated vLLM engines of the trainers this process has deleted; call it only when none of its
    engines is in use. Without it each deleted trainer's engine, a KV cache of `VLLM_CPU_KVCACHE_SPACE` (1 GiB)
    included, stays resident until the process ends, and each further engine allocates its cache under growing
    memory pressure (seconds each past about 8 GiB). Three things keep it:
    - vLLM's `EngineCore` calls `gc.freeze()` when it starts and undoes it only in its `shutdown`, which TRL never
      calls;
    - the weight reload (the CPU engine's sync) records each layer in `vllm.model_executor.model_loader.reload.
      layerwise.LAYERWISE_INFO`, a `WeakKeyDictionary` whose values refer back to their layers, so its keys never die;
    - the model's compile wrapper registers a Dynamo bytecode hook, a bound method, which vLLM's finalizer of the
      engine does not find once the reload has run; the wrapper's own `cleanup` removes it."""
    if "vllm" in sys.modules:
        import vllm
        from torch._dynamo import convert_frame
        from vllm.compilation.wrapper import TorchCompileWithNoGuardsWrapper
        from vllm.model_executor.model_loader.reload import layerwise

        info, hooks = getattr(layerwise, "LAYERWISE_INFO", None), getattr(convert_frame, "_bytecode_hooks", None)
        if not isinstance(info, weakref.WeakKeyDictionary) or not isinstance(hooks, dict):
            raise AssertionError(f"vllm {vllm.__version__}, torch {torch.__version__}: vLLM's LAYERWISE_INFO or "
                                 f"Dynamo's _bytecode_hooks changed; see what keeps a deleted engine alive")
        info.clear()
        for hook in list(hooks.values()):
            if isinstance(getattr(hook, "__self__", None), TorchCompileWithNoGuardsWrapper):
                hook.__self__.cleanup()
    gc.unfreeze()
    gc.collect()


def resident_bytes():
    """This process's resident set, in bytes."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _detached(batch):
    return {k: (v.detach().clone() if torch.is_tensor(v) else v) for k, v in batch.items()}


class CaptureTrainer(RPPTrainer):
    """Records the gathered raw rewards, each generation batch as built, and each micro-batch the loss receives
    together with the advantages and pi_old log-probs it used (read through the `_loss_advantages` hook, so that
    deferred REINFORCE++ returns, built inside the loss, are included)."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.captured_rewards, self.generation_batches, self.loss_inputs = [], [], []

    def _calculate_rewards(self, *a, **kw):
        out = super()._calculate_rewards(*a, **kw)
        self.captured_rewards.append(out.detach().clone())
        return out

    def _generate_and_score_completions(self, inputs):
        batch = super()._generate_and_score_completions(inputs)
        self.generation_batches.append(_detached(batch))
        return batch

    def _loss_advantages(self, mode, inputs, logps):
        advantages, old_logps = super()._loss_advantages(mode, inputs, logps)
        used = {"advantages": advantages} if old_logps is None else {"advantages": advantages, "old_per_token_logps": old_logps}
        self.loss_inputs.append(_detached({**inputs, **used}))
        return advantages, old_logps


def returns_at_generation(trainer):
    """Make `trainer` build REINFORCE++ returns at generation (with an old-policy forward) even where it would defer
    them into the loss, so that a test can compare the two paths."""
    trainer._rpp_defer_returns = lambda mode: False


def make_args(tmp_path, estimator, **kw):
    base = dict(
        output_dir=str(tmp_path / "out"),
        advantage_estimator=estimator,
        report_to="none",
        use_cpu=True,
        bf16=False,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        steps_per_generation=2,
        num_generations=4,
        max_completion_length=4,
        max_steps=4,
        learning_rate=1e-2,
        save_strategy="no",
        logging_steps=1,
        seed=0,
        disable_dropout=True,
        reward_weights=[1.0, 0.5],
    )
    base.update(kw)
    return RPPConfig(**base)


def initial_model_logp_all(model_path, batch, temperature, dtype=torch.float64):
    """``[B, T, V]`` log-softmax of the initial weights (fresh load) at the completion positions, at `temperature`."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
    attn = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
    T = batch["completion_ids"].size(1)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=attn).logits[:, -T - 1 : -1].to(dtype)
    return torch.log_softmax(logits / temperature, -1)


def initial_model_logps(model_path, batch, temperature):
    """log pi_init(token) ``[B, T]`` at the completion positions, in float64."""
    logp_all = initial_model_logp_all(model_path, batch, temperature)
    return logp_all.gather(-1, batch["completion_ids"].unsqueeze(-1)).squeeze(-1)


def train_eos_after_a(path):
    """Fine-tune the tiny model so that it ends "a:" at once and never ends "b:" (a few seconds of SGD)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path)
    a = tok("a:", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    b = tok("b:bbbbbbbb", add_special_tokens=False)["input_ids"]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(150):
        for ids in (a, b):
            x = torch.tensor([ids])
            loss = model(input_ids=x, labels=x).loss
            opt.zero_grad()
            loss.backward()
            opt.step()
    model.save_pretrained(path)


# ----------------------------------------------------------------------------------------------------------------
# `accelerate launch` on a free port
# ----------------------------------------------------------------------------------------------------------------

PORTS_PER_WORKER = 1000
FIRST_PORT = 21000  # below Linux's ephemeral range (32768+), so no client socket takes these, and clear of 29500


def _worker_index():
    """0 for `gw0` (pytest-xdist's first worker) or a run without xdist, 1 for `gw1`, ..."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    return int(worker[2:]) if worker.startswith("gw") and worker[2:].isdigit() else 0


_ports = itertools.count()


def free_port():
    """A TCP port on 127.0.0.1 that no one listens on, from a range of this pytest-xdist worker's own.

    Two workers never draw from the same range, and within a worker each call takes the next port that binds, so
    two launches (or a launch and a socket still in TIME_WAIT) never share one. `accelerate launch` would otherwise
    take its default 29500 for every multi-process run, and no two of them could run at once."""
    base = FIRST_PORT + PORTS_PER_WORKER * _worker_index()
    for _ in range(PORTS_PER_WORKER):
        port = base + next(_ports) % PORTS_PER_WORKER
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port
    raise RuntimeError(f"no free port in {base}..{base + PORTS_PER_WORKER - 1}")


WARM = os.path.join(os.path.dirname(os.path.abspath(__file__)), "warm.py")


def python_command(*argv):
    """argv of `python argv...` started warm (tests/support/warm.py): the script runs as in a fresh interpreter, from
    one that has already imported torch, transformers and TRL. For the suite's own scripts and the runs of examples
    and benchmarks; a test of a command as the docs write it, or of what happens at import, runs it cold."""
    return [sys.executable, WARM, *argv]


def launch_command(*script_and_args, config_file=None, processes=2):
    """argv of `accelerate launch` with `processes` CPU processes on a port of this worker's own: the shipped
    `config_file` (examples/accelerate_configs) with what a CPU machine needs overridden, or plain multi-process
    (gloo) without one. The launcher and each process start warm (`python_command`; `--no_python` makes torch's
    launcher run `python warm.py script...` as the process). Every multi-process launch of the tests goes through
    here (tests/test_harness.py checks it)."""
    if config_file is None:
        engine = ["--multi_gpu", "--num_machines", "1", "--dynamo_backend", "no"]
    else:
        engine = ["--config_file", config_file]
    return python_command("-m", "accelerate.commands.launch", *engine, "--num_processes", str(processes),
                          "--mixed_precision", "no", "--main_process_port", str(free_port()), "--no_python",
                          *python_command(*script_and_args))


# PYTHONFAULTHANDLER: a process that dies of a signal prints where its Python code was.
LAUNCH_ENV = dict(HF_HUB_OFFLINE="1", WANDB_MODE="offline", OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false",
                  PYTHONFAULTHANDLER="1")


def finish_launched(outdir):
    """The last statement of a test script run under `accelerate launch`, once everything it records is written:
    `finished_rank<r>` written in `outdir` for `assert_launch_finished`, then the process group destroyed, as
    `trl-rpp` ends a run (`accelerator.end_training()`)."""
    initialized = torch.distributed.is_available() and torch.distributed.is_initialized()
    rank = torch.distributed.get_rank() if initialized else 0
    open(os.path.join(outdir, f"finished_rank{rank}"), "w").close()
    if initialized:
        torch.distributed.destroy_process_group()


def assert_launch_finished(outdir, returncode, output, processes=2):
    """Every process of a launch ran its script to the end (`finish_launched`). What the launcher returns is torch
    elastic's status, not the script's: a process that has written all it had to can still die in the teardown of
    its process group or interpreter (SIGABRT, "terminate called without an active exception", from a thread of
    torch's; seen twice on 2-core machines, once in CI). Such a status changes no result, so it is reported as a
    warning; a process that did not reach its end fails the test."""
    missing = [r for r in range(processes) if not os.path.exists(os.path.join(outdir, f"finished_rank{r}"))]
    assert not missing, f"process(es) {missing} did not finish; launcher status {returncode}\n{output[-5000:]}"
    if returncode != 0:
        warnings.warn(f"every process finished, then the launcher returned {returncode}:\n{output[-1500:]}")


def script_env():
    """The environment of the suite's training subprocesses: this process's, offline, with one torch thread
    (`LAUNCH_ENV`)."""
    return dict(os.environ, **LAUNCH_ENV)


RESUME_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "resume_script.py")


def resume_command(*args, processes=1, warm=True):
    """argv of tests/support/resume_script.py with `args`: one process (started warm, or cold: `python_command`), or
    `processes` under `accelerate launch`. test_resume.py, test_preemption.py and tests/conftest.py's
    `uninterrupted_run` all run it through here."""
    if processes > 1:
        return launch_command(RESUME_SCRIPT, *args, processes=processes)
    return python_command(RESUME_SCRIPT, *args) if warm else [sys.executable, RESUME_SCRIPT, *args]


def with_vllm(env):
    """`env` for a subprocess that uses vLLM: the suite's subprocesses see it only when asked (tests/harness)."""
    return dict(env, TRL_RPP_TESTS_VLLM="1")
