"""DeepSpeed ZeRO-2, ZeRO-3 and FSDP2 through `accelerate launch` with the shipped config files, 2 CPU processes on
gloo, compared step by step with the same runs under plain DDP (tests/support/engine_script.py runs the cases). FSDP2 needs a
test-only shim on CPU (`engine_script.force_fsdp_on_cpu`); where accelerate's internals differ from what it needs,
it raises, naming the accelerate version.

Tolerances. The advantages are z-scores (|A| < 5): float32 resolves them to ~5e-7, the engines reduce the same
float32 sums in a different order, and from step 2 on the weights they generate and score with differ by ~1e-8.
`ADV_ATOL = 1e-5` is the bound the single- vs multi-process tests already use. The updated parameters come from
SGD (with momentum in rpp_ref), whose update is linear in the gradients, so they differ by lr times the float32
reduction noise of the gradient (~1e-8 measured). `PARAM_ATOL = 1e-6`, while every run moves some parameter by
more than `MIN_MOVE = 1e-4` in one step (asserted): a gradient scaled wrong (say by the accumulation steps twice)
or missing a rank is caught with two orders of magnitude to spare.

Saving. After rpp_ref and the LoRA case each launch calls `trainer.save_model` (what the `trl-rpp` CLI does) and
the test loads the result in this process: `from_pretrained` (the full model), or the initial model plus
`PeftModel.from_pretrained` (the adapter). Every parameter must equal, bit for bit, the full value gathered after
the last optimizer step (`full_tensor` / `GatheredParameters`, not the state-dict route save_model takes), and be
stored as float32: ZeRO-3's "16-bit" save (`zero3_save_16bit_model`) writes the dtype the module's parameters have,
float32 here (bf16 under bf16 training). Both are copies of the same float32 values, so the tolerance is 0.

Run with `-s` to print the largest differences measured.
"""

import importlib.util
import os
import signal
import subprocess
from pathlib import Path

import pytest
import torch

from test_preemption import finish, wait_for
from trainer_helpers import LAUNCH_ENV, assert_launch_finished, launch_command
from trl_rpp.truncation import ABSENT

HERE = os.path.dirname(os.path.abspath(__file__))
CONFIGS = os.path.join(os.path.dirname(HERE), "examples", "accelerate_configs")
CASES = ["rpp_ref", "baseline_sc", "rpp_lora_deferred", "lora_head_replay", "unequal_lengths"]
LORA_CASES = ("rpp_lora_deferred", "lora_head_replay")  # engine_script.CASES with a LoRA adapter, on the head too
REPLAYED = ("rpp_ref", "rpp_ref_resumed", "lora_head_replay")  # the cases with top_k (engine_script.CASES)
REPLAY_TOP_K = 8  # engine_script.REPLAY_TOP_K
ADV_ATOL, PARAM_ATOL, MIN_MOVE = 1e-5, 1e-6, 1e-4
LAUNCH_TIMEOUT_S = 300  # a hung collective fails the test instead of blocking CI


def start_launch(config, script_args, extra_env=None):
    """`accelerate launch --config_file CONFIG` with 2 processes, in a session of its own."""
    env = dict(os.environ, **LAUNCH_ENV, DS_ACCELERATOR="cpu", **(extra_env or {}))
    # The shipped files target GPUs (bf16, 8 processes); only what a CPU machine needs is overridden here.
    cmd = launch_command(*script_args, config_file=os.path.join(CONFIGS, config))
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


def launch(config, script_args, timeout=LAUNCH_TIMEOUT_S, extra_env=None):
    """`start_launch` of `script_args` = [script, OUTDIR, ...], waited for (killed as a whole process group on
    timeout) until both processes have finished the script (`assert_launch_finished`)."""
    proc = start_launch(config, script_args, extra_env)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"{config}: no result after {timeout} s (hang?)\n{out[-3000:]}")
    assert_launch_finished(script_args[1], proc.returncode, out)
    return out


def require_deepspeed():
    if importlib.util.find_spec("deepspeed") is None:
        pytest.fail("deepspeed is not installed; `make install` installs it (see docs/distributed.md).")


CONFIG_FILES = {"ddp": "ddp.yaml", "zero2": "deepspeed_zero2.yaml", "zero3": "deepspeed_zero3.yaml", "fsdp2": "fsdp2.yaml"}


def run_engine(outdir, models, engine):
    config = CONFIG_FILES[engine]
    os.makedirs(outdir, exist_ok=True)
    # A fresh extensions dir proves that nothing is compiled on the way.
    ext = os.path.join(outdir, "torch_extensions")
    launch(config, [os.path.join(HERE, "support", "engine_script.py"), str(outdir), *models, engine],
           extra_env=dict(TORCH_EXTENSIONS_DIR=ext))
    assert not os.path.exists(ext) or not os.listdir(ext)

    def load(tag):
        return [torch.load(os.path.join(outdir, f"{tag}_rank{r}.pt"), weights_only=False) for r in range(2)]

    resumed = ["rpp_ref_resumed"] if engine in ("zero3", "fsdp2") else []
    names = CASES + resumed + (["rejections"] if engine == "zero2" else [])
    runs = {name: load(name) for name in names}
    runs["outdir"] = Path(outdir)
    return runs


SAVED_CASES = ["rpp_ref", "rpp_lora_deferred"]  # engine_script.SAVED_CASES


def check_saved_models(engine, runs, model_path):
    """What `save_model` wrote after each case in SAVED_CASES loads into exactly the trained weights (module
    docstring)."""
    from peft import PeftModel
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    for name in SAVED_CASES:
        saved = runs["outdir"] / name / "final"
        snapshots = runs[name][0]["params"]
        trained, initial = snapshots[max(snapshots)], snapshots[0]
        lora = name in LORA_CASES
        weights = sorted(saved.glob("adapter_model.safetensors" if lora else "model*.safetensors"))
        assert weights, (engine, name, sorted(p.name for p in saved.iterdir()) if saved.is_dir() else "no directory")
        dtypes = set()
        for f in weights:
            with safe_open(str(f), "pt") as st:
                dtypes |= {st.get_slice(k).get_dtype() for k in st.keys()}
        assert dtypes == {"F32"}, (engine, name, dtypes)
        model = AutoModelForCausalLM.from_pretrained(model_path if lora else saved, dtype=torch.float32)
        if lora:
            model = PeftModel.from_pretrained(model, saved)
        loaded = {n: p for n, p in model.named_parameters() if not lora or "lora_" in n}
        assert sorted(loaded) == sorted(trained), (engine, name, sorted(set(loaded) ^ set(trained)))
        diff = max((loaded[n].detach() - t).abs().max().item() for n, t in trained.items())
        moved = max((t - initial[n]).abs().max().item() for n, t in trained.items())
        print(f"{engine} {name}: saved vs trained max |d| = {diff:.3g} (trained vs initial {moved:.3g})")
        assert diff == 0 and moved > MIN_MOVE, (engine, name, diff, moved)


def check_resumed(engine, runs):
    """Resumed from the step-2 checkpoint, step 3 equals the uninterrupted run (and so DDP)."""
    resumed, full = runs["rpp_ref_resumed"], runs["rpp_ref"]
    adv, params, _ = max_diffs(full, resumed, first_step=2)  # the weights loaded, then step 3
    print(f"{engine} resumed vs uninterrupted, steps 2-3: max |dA| = {adv:.3g}, max |dparam| = {params:.3g}")
    assert adv <= ADV_ATOL and params <= PARAM_ATOL, (adv, params)
    step3 = [[h for h in run[0]["logs"] if h.get("step") == 3 and "loss" in h][0] for run in (full, resumed)]
    assert step3[0]["reward"] == step3[1]["reward"], step3
    assert step3[0]["advantages/valid_tokens"] == step3[1]["advantages/valid_tokens"], step3
    assert abs(step3[0]["loss"] - step3[1]["loss"]) <= 1e-6, step3


@pytest.fixture(scope="module")
def models(tiny_model, eos_model):
    return tiny_model, eos_model


@pytest.fixture(scope="module")
def engine_runs(tmp_path_factory, models):
    """engine -> `run_engine`'s runs, launched once per module: an engine's step-by-step test and its fault test
    share its uninterrupted runs."""
    done = {}

    def get(engine):
        if engine not in done:
            done[engine] = run_engine(tmp_path_factory.mktemp(engine), models, engine)
        return done[engine]

    return get


@pytest.fixture(scope="module")
def ddp_runs(engine_runs):
    runs = engine_runs("ddp")
    facts = runs["rpp_ref"][0]["facts"]
    assert facts["wrapper"] == "torch.nn.parallel.distributed.DistributedDataParallel", facts
    assert facts["num_processes"] == 2 and facts["backend"] == "gloo"
    return runs


def max_diffs(ref_ranks, got_ranks, first_step=0, last_step=None):
    """Largest |difference| of the advantages each loss call received and of the parameters after each optimizer
    step (step 0: as training starts), from `first_step` to `last_step` (default: the reference's last); and the
    largest change of any parameter over one step in the reference run. The kept sets each loss call replayed must
    be the reference's, id for id (or absent in both)."""
    adv, params, move = 0.0, 0.0, 0.0
    for r in range(2):
        ref_p, got_p = ref_ranks[r]["params"], got_ranks[r]["params"]
        last = max(ref_p) if last_step is None else last_step
        assert sorted(got_p) == list(range(first_step, last + 1)), (sorted(got_p), first_step, last)
        per_step = len(ref_ranks[r]["advantages"]) // max(ref_p)  # loss calls per optimizer step
        calls = slice(first_step * per_step, last * per_step)
        ref_adv = ref_ranks[r]["advantages"][calls]
        assert len(ref_adv) == len(got_ranks[r]["advantages"])
        for a, b in zip(ref_adv, got_ranks[r]["advantages"]):
            assert a.shape == b.shape
            adv = max(adv, (a.double() - b.double()).abs().max().item())
        for i, (a, b) in enumerate(zip(ref_ranks[r]["support_ids"][calls], got_ranks[r]["support_ids"], strict=True)):
            assert (a is None) == (b is None) and (a is None or torch.equal(a, b)), ("kept sets differ", r, i)
        for step, named in got_p.items():
            assert sorted(named) == sorted(ref_p[step]), "the same trainable parameters"
            before = ref_p.get(step - 1)
            for n, p in named.items():
                params = max(params, (ref_p[step][n].double() - p.double()).abs().max().item())
                if before is not None:
                    move = max(move, (ref_p[step][n] - before[n]).abs().max().item())
    return adv, params, move


def check_equal_to_ddp(engine, runs, ddp_runs):
    check_replay("ddp", ddp_runs)
    check_replay(engine, runs)
    for name in CASES:
        adv, params, move = max_diffs(ddp_runs[name], runs[name])
        print(f"\n{engine} vs ddp, {name}: max |dA| = {adv:.3g}, max |dparam| = {params:.3g} (largest step {move:.3g})")
        assert adv <= ADV_ATOL, (name, adv)
        assert params <= PARAM_ATOL, (name, params)
        assert move > MIN_MOVE, (name, move)
    # Unequal completion lengths across ranks (under ZeRO-3: shards gathered layer by layer in generation) neither
    # hang (the launch would time out) nor differ (compared above).
    lengths = [sum(m.sum().item() for m in runs["unequal_lengths"][r]["completion_masks"]) for r in range(2)]
    assert lengths[0] > 4 * lengths[1], lengths
    # The head's own adapter trained in both LoRA cases (its lora_B starts at 0), equal to DDP's above.
    for name in LORA_CASES:
        snapshots = runs[name][0]["params"]
        head_b = [n for n in snapshots[0] if "lm_head.lora_B" in n]
        assert len(head_b) == 1, (engine, name, sorted(snapshots[0]))
        moved = (snapshots[max(snapshots)][head_b[0]] - snapshots[0][head_b[0]]).abs().max().item()
        assert moved > MIN_MOVE, (engine, name, moved)


def check_replay(engine, runs):
    """Replay ran in the REPLAYED cases (top_k=REPLAY_TOP_K, top_p=0.8; engine_script.CASES) and in no other: every loss
    call of both ranks read its micro-batch's kept sets, `[B, T, 2 top_k]` ids holding 1 to top_k kept ids at each
    completion token, and fewer than top_k at some (top_p cut inside top_k's bound). `max_diffs` checks that they
    are DDP's sets, id for id."""
    for name in CASES + (["rpp_ref_resumed"] if "rpp_ref_resumed" in runs else []):
        for rank in range(2):
            sets, masks = runs[name][rank]["support_ids"], runs[name][rank]["completion_masks"]
            assert sets and len(sets) == len(masks), (engine, name, rank, len(sets), len(masks))
            if name not in REPLAYED:
                assert all(s is None for s in sets), (engine, name, "replayed without truncation")
                continue
            kept = []
            for s, m in zip(sets, masks, strict=True):
                assert s is not None and s.shape == (*m.shape, 2 * REPLAY_TOP_K), (engine, name, rank, m.shape)
                kept.append((s != ABSENT).sum(-1)[m.bool()])
            kept = torch.cat(kept)
            assert kept.numel() > 0 and 1 <= kept.min() and kept.max() <= REPLAY_TOP_K, (engine, name, rank, kept)
            assert kept.min() < REPLAY_TOP_K, (engine, name, rank, "top_p never cut inside top_k")
    sampled = [h["sampling/tie_overflow"] for h in runs["rpp_ref"][0]["logs"] if "sampling/tie_overflow" in h]
    assert sampled and all(v == 0 for v in sampled), (engine, sampled)  # logged only with a replayed truncation


def assert_engine(engine, name, facts):
    """`facts` (one rank's, engine_script.engine_facts and partition_facts) show that `engine` really ran case
    `name`, not a silent DDP fallback."""
    if engine.startswith("zero"):
        stage = int(engine[-1])
        assert facts["wrapper"] == "deepspeed.runtime.engine.DeepSpeedEngine", facts
        assert facts["zero_stage"] == stage and facts["num_processes"] == 2 and facts["backend"] == "gloo"
        if stage == 2:
            assert facts["optimizer"] == "deepspeed.runtime.zero.stage_1_and_2.DeepSpeedZeroOptimizer", facts
        else:
            assert facts["optimizer"] == "deepspeed.runtime.zero.stage3.DeepSpeedZeroOptimizer_Stage3", facts
            # Built partitioned: each rank holds half of every weight and no full copy (policy, base model under
            # LoRA, and the frozen reference model alike).
            for part in ("base",) if name in LORA_CASES else ("policy", "ref"):
                p = facts[part]
                if p is None:
                    continue
                assert p["has_ds_id"] and p["local_numel"] == 0, (name, part, p)
                assert p["ds_numel"] > 0 and p["partition_numel"] == p["ds_numel"] // 2, (name, part, p)
    else:
        assert engine == "fsdp2"
        # Really FSDP2: the policy (sharded when training starts) is a fully_shard module whose parameters are
        # DTensors, about half on each rank; so is the frozen reference model, sharded at construction.
        assert facts["distributed_type"] == "DistributedType.FSDP" and facts["num_processes"] == 2, facts
        assert facts["wrapper"].startswith("torch.distributed.fsdp._fully_shard."), facts
        for p in (facts["policy_after"], facts["ref"]):
            if p is not None:
                assert p["dtensor"] and 0 < p["dtensor_local_numel"] < p["local_numel"], (name, p)


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["zero2", "zero3"])
def test_deepspeed_equals_ddp_step_by_step(models, ddp_runs, engine_runs, engine):
    require_deepspeed()
    runs = engine_runs(engine)
    for name in CASES:
        for rank in range(2):
            assert_engine(engine, name, runs[name][rank]["facts"])
        assert (runs[name][0]["facts"]["ref"] is not None) == (name not in LORA_CASES)
    check_equal_to_ddp(engine, runs, ddp_runs)

    if engine == "zero2":
        # The parallelism rejection: tensor parallelism from RPPConfig.parallelism_config, context parallelism from
        # the environment a YAML launch sets (GRPOConfig never sees it), each at trainer construction.
        for rank in range(2):
            errors = runs["rejections"][rank]
            assert errors["args_tp"] and errors["args_tp"].startswith("parallelism_config.tp_size=2 is not supported")
            assert errors["env_cp"] and errors["env_cp"].startswith("parallelism_config.cp_size=2 is not supported")

    if engine == "zero3":
        check_resumed(engine, runs)
    check_saved_models(engine, runs, models[0])


@pytest.mark.slow
def test_fsdp2_equals_ddp_step_by_step(models, ddp_runs, engine_runs):
    runs = engine_runs("fsdp2")
    for name in CASES:
        for rank in range(2):
            assert_engine("fsdp2", name, runs[name][rank]["facts"])
        assert (runs[name][0]["facts"]["ref"] is not None) == (name not in LORA_CASES)
    check_equal_to_ddp("fsdp2", runs, ddp_runs)
    check_resumed("fsdp2", runs)
    check_saved_models("fsdp2", runs, models[0])


@pytest.mark.slow
def test_ddp_saves_a_loadable_model(models, ddp_runs):
    check_saved_models("ddp", ddp_runs, models[0])


# ----------------------------------------------------------------------------------------------------------------
# Faults under ZeRO-3 and FSDP2: preemption signals, a kill -9 during a save, resumes (inside a generation batch)
# ----------------------------------------------------------------------------------------------------------------


def engine_files(folder, engine, rank):
    """The engine's own model and optimizer files of process `rank` in checkpoint `folder`, which trl_rpp's
    `checkpoint_problem` does not check: DeepSpeed's shards under global_step<N>/, FSDP's model and optimizer
    (FULL_STATE_DICT: gathered, written by process 0)."""
    folder = Path(folder)
    if engine == "zero3":
        step = folder.name.split("-")[-1]
        return [folder / f"global_step{step}" / f"zero_pp_rank_{rank}_mp_rank_00_{kind}_states.pt"
                for kind in ("model", "optim")]
    return [folder / "pytorch_model_fsdp.bin", folder / "optimizer.bin"]


def engine_checkpoint_problem(folder, engine, rank):
    """Why `folder` cannot be resumed by process `rank` of rpp_ref's run under `engine`, or None: trl_rpp's own
    judgement (`checkpoint_problem`: trainer_state.json, the generation buffer, the RNG state, the scheduler), then
    the engine's own files (`engine_files`)."""
    from trl_rpp.faults.checkpoint import ResumeLayout, checkpoint_problem, required_files

    layout = ResumeLayout(rank, 2, 2, 1, required_files(rank, 2, "deepspeed" if engine == "zero3" else "fsdp"))
    problem = checkpoint_problem(str(folder), layout)
    if problem is not None:
        return problem.path, problem.reason
    missing = [str(f) for f in engine_files(folder, engine, rank) if not f.exists()]
    return missing or None


def load_ranks(outdir, tag):
    return [torch.load(Path(outdir) / f"{tag}_rank{r}.pt", weights_only=False) for r in range(2)]


def check_fault_run(engine, label, full, run, first_step, last_step, generations):
    """`run` (both ranks) really ran under `engine`, resumed at `first_step` (the parameters when training starts,
    after the checkpoint's load), generated `generations` times, and equals the uninterrupted run `full` from there to
    `last_step`. Returns the largest differences."""
    for rank in range(2):
        assert_engine(engine, "rpp_ref", run[rank]["facts"])
        assert run[rank]["generations"] == generations, (label, rank, run[rank]["generations"])
    adv, params, _ = max_diffs(full, run, first_step=first_step, last_step=last_step)
    print(f"\n{engine} {label}: steps {first_step}-{last_step} vs uninterrupted: max |dA| = {adv:.3g}, "
          f"max |dparam| = {params:.3g}")
    assert adv <= ADV_ATOL and params <= PARAM_ATOL, (label, adv, params)
    return adv, params


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["zero3", "fsdp2"])
def test_preempted_killed_and_resumed_equal_the_uninterrupted_run(tmp_path, models, ddp_runs, engine_runs, engine):
    """The promises of tests/test_preemption.py and tests/test_resume.py, under ZeRO-3 and FSDP2 (2 processes), on
    case rpp_ref (3 steps; generations at steps 1 and 3). Two launches in one output folder (engine_script's
    `FAULT_PHASES`):

    1. SIGTERM to `accelerate launch`, which forwards it to both workers, in the middle of step 1: every process
       saves checkpoint-1, which falls inside a generation batch, and raises TrainingPreempted. While the launcher
       waits for them (TORCH_ELASTIC_SHUTDOWN_TIMEOUT), the same processes resume from checkpoint-1 with a new
       trainer, train steps 2-3, and are SIGKILLed saving checkpoint-3, once its model and optimizer are written.
    2. A fresh launch resumes with resume_from_checkpoint=True: it skips the torn checkpoint-3 with a warning naming
       it, and resumes from checkpoint-1, inside its generation batch (step 2 trains on the saved batch, without
       generating). SIGTERM to rank 1 only, in the middle of step 2: both processes save checkpoint-2 and raise
       TrainingPreempted; a new trainer resumes from it and trains step 3.

    Each run equals the engine's uninterrupted rpp_ref (`engine_runs`) step by step, advantages and parameters, to
    the engine-vs-DDP tolerances (module docstring); measured, they are equal bit for bit: the same engine repeats
    its reductions in the same order, and the checkpoint restores all the state the next steps read (each rank's
    ZeRO-3 partition of the weights and momentum, or FSDP2's full state broadcast from process 0; RNG states;
    dataloader position; generation batch). What each process raised is its own record, not the launcher's status
    or log."""
    # ddp_runs is not compared here: using it keeps this test in the xdist group of the module's other tests, on the
    # worker that holds engine_runs (tests/conftest.py groups tests by the module fixtures they use).
    if engine == "zero3":
        require_deepspeed()
    full = engine_runs(engine)["rpp_ref"]
    out = tmp_path / "rpp_ref" / "out"
    script = [os.path.join(HERE, "support", "engine_script.py"), str(tmp_path), *models, engine]
    config = CONFIG_FILES[engine]
    checkpoint = {n: str(out / f"checkpoint-{n}") for n in (1, 2, 3)}
    diffs = []

    def stopped(run, step):
        assert [run[r]["preempted"] for r in range(2)] == [
            dict(signal="SIGTERM", step=step, checkpoint=checkpoint[step], global_step=step)] * 2, (
            [run[r]["preempted"] for r in range(2)])
        for rank in range(2):
            assert engine_checkpoint_problem(checkpoint[step], engine, rank) is None, (
                step, rank, engine_checkpoint_problem(checkpoint[step], engine, rank))

    def skipped_torn_3(run, resumed_from):
        skips = [m for m in run[0]["warnings"] if "skips" in m]
        assert len(skips) == 1 and skips[0].startswith(
            f"trl_rpp: resume_from_checkpoint=True skips {checkpoint[3]}, which is incomplete: "
            f"{os.path.join(checkpoint[3], 'trainer_state.json')} is missing. Resuming from {checkpoint[resumed_from]} "
            "instead."), run[0]["warnings"]

    # 1. SIGTERM to the launcher in step 1; resumed in the same processes, killed saving checkpoint-3.
    grace = dict(TORCH_ELASTIC_SHUTDOWN_TIMEOUT=str(LAUNCH_TIMEOUT_S))  # the launcher waits for its workers that long
    proc = start_launch(config, [*script, "start"], extra_env=grace)
    pids = [wait_for(str(out / f"waiting_step1_rank{r}"), proc) for r in range(2)]
    os.kill(proc.pid, signal.SIGTERM)
    _, log = finish(proc, timeout=LAUNCH_TIMEOUT_S, workers=pids)
    assert (tmp_path / "killed_saving_3_rank1.pt").exists(), log[-4000:]
    start = load_ranks(tmp_path, "stopped_at_1")
    stopped(start, 1)
    diffs.append(check_fault_run(engine, "from scratch, stopped at 1", full, start, 0, 1, generations=1))
    killed = load_ranks(tmp_path, "killed_saving_3")
    assert [killed[r]["killed"] for r in range(2)] == [True, True]
    diffs.append(check_fault_run(engine, "resumed at 1 in-process (saved batch), killed saving 3", full, killed, 1, 3,
                                 generations=1))
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-1", "checkpoint-3"]
    torn = [engine_checkpoint_problem(checkpoint[3], engine, r) for r in range(2)]
    assert torn == [(os.path.join(checkpoint[3], "trainer_state.json"), "is missing")] * 2, torn
    # The kill landed mid-save: the engine's model and optimizer are written, no RNG state.
    assert all(f.exists() for r in range(2) for f in engine_files(checkpoint[3], engine, r))
    assert not list(Path(checkpoint[3]).glob("rng_state*")), sorted(os.listdir(checkpoint[3]))

    # 2. A fresh launch: auto-resume past the torn checkpoint-3 from checkpoint-1; SIGTERM to rank 1 in step 2; resumed
    # from checkpoint-2.
    proc = start_launch(config, [*script, "restart"])
    pids = [wait_for(str(out / f"waiting_step2_rank{r}"), proc) for r in range(2)]
    os.kill(pids[1], signal.SIGTERM)
    (out / "release").touch()  # rank 0 goes on without a signal of its own
    _, log = finish(proc, timeout=LAUNCH_TIMEOUT_S, workers=pids)
    assert (tmp_path / "resumed_at_2_rank1.pt").exists(), log[-4000:]
    past_torn = load_ranks(tmp_path, "resumed_past_torn")
    skipped_torn_3(past_torn, resumed_from=1)
    stopped(past_torn, 2)
    diffs.append(check_fault_run(engine, "resumed past torn 3 at 1 (saved batch), stopped at 2", full, past_torn, 1, 2,
                                 generations=0))
    at_2 = load_ranks(tmp_path, "resumed_at_2")
    skipped_torn_3(at_2, resumed_from=2)
    assert [at_2[r]["preempted"] for r in range(2)] == [None, None]
    diffs.append(check_fault_run(engine, "resumed at 2", full, at_2, 2, 3, generations=1))
    adv, params = max(d[0] for d in diffs), max(d[1] for d in diffs)
    print(f"{engine} faults, resumed vs uninterrupted, all runs: max |dA| = {adv:.3g}, max |dparam| = {params:.3g}")
