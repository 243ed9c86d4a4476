"""Fixtures and settings shared by the test files. The test files are `test_*.py` here; the helpers they and their
subprocess scripts import, and those scripts, are in tests/support/ (on `sys.path` for the tests).

The suite runs on both cores with pytest-xdist (`make test`): each worker gets its share of the cores' threads,
tests that share a module-scoped fixture (a vLLM engine, a reference run) stay on one worker, the models built for
the whole session are built once for all workers, one vLLM server per model serves every test that trains against
a server (tests/support/servers.py), the training subprocesses start warm, from an interpreter that has already
imported torch, transformers and TRL (tests/support/warm.py), and no Python process of the suite can reach the
network (tests/harness).

vLLM runs with `VLLM_CPU_CI_ENV=1`, the setting of vLLM's own CPU CI: its CPU backend then traces the model once and
runs it eagerly instead of compiling it with inductor, which on a machine without a compile cache costs 25 to 40 s
at every engine start (a server start: 71 to 84 s cold, 47 s warm, 42 to 46 s without the compile), and skips the
warm-up. The engine, its kernels and its sampler are the same; a token costs more (16-token requests: 0.19 s instead
of 0.05 s), which the suite's short runs repay many times. Users' engines compile as usual.

The suite's vLLM servers run with `VLLM_ENABLE_V1_MULTIPROCESSING=0`: the server's engine core then runs the model
itself, instead of spawning a third process (a worker, which imports torch and vLLM cold) that the CPU backend adds
otherwise; a server starts in 19 s instead of 29 to 36 s on an idle machine. The API server and the engine core
stay two processes, and the model, its kernels and its sampler are the same. Colocated engines are unaffected: TRL
builds them with vLLM's `external_launcher`, which runs in the trainer's process either way."""

import importlib.util
import os
import shutil
import sys
import tempfile

import pytest
import torch
from filelock import FileLock

HARNESS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "harness")
SUPPORT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "support")
sys.path.insert(0, SUPPORT)  # `from trainer_helpers import ...` in the test files
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("VLLM_CPU_CI_ENV", "1")  # see the module docstring; every subprocess inherits it
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the module docstring, too


def _run_folder(variable, prefix):
    """Point `variable` at a new, empty folder of this test run, unless the caller set it (an xdist worker inherits
    its controller's); returns whether this process made it, and so removes it at the end (`pytest_unconfigure`)."""
    if variable in os.environ:
        return False
    os.environ[variable] = tempfile.mkdtemp(prefix=prefix)
    return True


# SmolLM2's converted checkpoint (`trl_rpp.testing.assets`): a cache of this test run's own, never the user's
# ~/.cache/trl_rpp. Made empty by the first pytest process, as the warm-start folder below, and shared by the xdist
# workers and the subprocesses they start: the first test that needs SmolLM2 converts it, any other waits for that
# one conversion (`smollm2_path`'s lock), and tests/test_assets.py checks the conversion this run made.
_OWNS_CACHE = _run_folder("TRL_RPP_CACHE", "trl_rpp-cache-")
# tests/harness/sitecustomize.py: the network guard, here and in every Python subprocess the tests start (as
# `sitecustomize`), and vLLM hidden from the subprocesses that do not ask for it.
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (HARNESS, os.environ.get("PYTHONPATH")) if p)
_spec = importlib.util.spec_from_file_location("harness", os.path.join(HARNESS, "sitecustomize.py"))
harness = sys.modules["harness"] = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(harness)  # installs the guard
# tests/support/warm.py: the suite's training subprocesses start from interpreters that have imported torch,
# transformers and TRL (zygotes). Made by the first pytest process (xdist's controller), inherited by its workers;
# its zygotes stop when that process ends (`pytest_unconfigure`), so none outlives the code it imported.
import warm  # noqa: E402  (tests/support, on sys.path above)

_OWNS_WARM_DIR = _run_folder(warm.WARM_DIR, "trl_rpp-warm-")
# The pytest processes keep vLLM: xdist's workers start with the PYTHONPATH above, so their sitecustomize hid it.
if "vllm" in sys.modules and sys.modules["vllm"] is None:
    del sys.modules["vllm"]


def pytest_configure(config):
    # Two workers on two cores: one torch thread each (and each subprocess they start), instead of two each.
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        threads = max(1, (os.cpu_count() or 1) // workers)
        torch.set_num_threads(threads)
        os.environ["OMP_NUM_THREADS"] = str(threads)


def pytest_unconfigure(config):
    if _OWNS_WARM_DIR:
        warm.stop_zygotes(os.environ[warm.WARM_DIR])
    if _OWNS_CACHE:
        shutil.rmtree(os.environ["TRL_RPP_CACHE"], ignore_errors=True)


# Session fixtures that run something big once for tests in several modules: their tests share one xdist worker.
# The shared vLLM servers too: one trainer at a time syncs into a server, and the tests that stop one stop no other's.
SHARED_RUNS = {"two_process_runs", "vllm_server_process", "tool_vllm_server_process"}


def xdist_group_of(item):
    """The xdist group of a test: the SHARED_RUNS fixture it uses, or its module and the module-scoped fixtures it
    uses (tests of one module sharing the same ones stay together, so each such fixture is made once per worker
    that needs it), or None: scheduled on its own."""
    info = getattr(item, "_fixtureinfo", None)
    if info is None:
        return None
    shared = sorted(set(info.names_closure) & SHARED_RUNS)
    if shared:
        return shared[0]
    scoped = sorted(name for name, defs in info.name2fixturedefs.items() if defs[-1].scope == "module")
    return f"{item.module.__name__}:{'+'.join(scoped)}" if scoped else None


@pytest.hookimpl(tryfirst=True)  # before xdist's own, which turns the xdist_group marks into node ids
def pytest_collection_modifyitems(config, items):
    """Tests that share a fixture run once per worker stay on one xdist worker (`--dist loadgroup`), so that the
    fixture (a vLLM engine, a reference run, the two-process launch) is made once; every other test is scheduled on
    its own. The slow tests go first, so that a long one does not start last on one worker while the other idles."""
    for item in items:
        group = xdist_group_of(item)
        if group is not None:
            item.add_marker(pytest.mark.xdist_group(group))
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)


@pytest.fixture(autouse=True)
def _restore_process_state():
    """A test that changes torch's thread count or sys.path leaves them as it found them for the next test."""
    threads, path = torch.get_num_threads(), list(sys.path)
    yield
    torch.set_num_threads(threads)
    sys.path[:] = path


def shared_build(tmp_path_factory, name, build):
    """`build(path)` once per test session, for all xdist workers: under a lock, in the folder the workers share.
    `build` reuses a complete save at `path` (both builders below do)."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent
    path = root / name
    with FileLock(str(path) + ".lock"):
        return build(path)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """Path of the tiny random-init Llama of `trl_rpp.testing.tiny`, built once per session."""
    from trl_rpp.testing.tiny import build_tiny_model

    return shared_build(tmp_path_factory, "tiny_model", build_tiny_model)


@pytest.fixture(scope="session")
def uninterrupted_run(tmp_path_factory, tiny_model):
    """``uninterrupted_run(estimator, steps_per_generation)``: the log_history.json of tests/support/resume_script.py
    trained on `tiny_model` to its end with nothing stopping it, run once per session for all workers: the reference
    that test_resume.py's killed runs and test_preemption.py's stopped runs (estimator reinforce_plus_plus,
    steps_per_generation=2: the same run) each resume to."""
    import json
    import subprocess

    from trainer_helpers import resume_command, script_env

    def run(estimator, steps_per_generation):
        def build(path):
            history = path / "log_history.json"
            if not history.exists():
                subprocess.run(resume_command("--model", tiny_model, "--output_dir", str(path), "--estimator",
                                              estimator, "--steps_per_generation", str(steps_per_generation)),
                               env=script_env(), check=True, capture_output=True, timeout=900)
            with open(history) as f:
                return json.load(f)

        return shared_build(tmp_path_factory, f"uninterrupted_{estimator}_spg{steps_per_generation}", build)

    return run


def _build_eos_model(path):
    from trainer_helpers import train_eos_after_a
    from trl_rpp.testing.tiny import build_tiny_model

    if not (path / "eos_trained").exists():
        build_tiny_model(path)
        train_eos_after_a(str(path))
        (path / "eos_trained").touch()
    return str(path)


@pytest.fixture(scope="session")
def eos_model(tmp_path_factory):
    """The tiny model trained to end "a:" at once and never end "b:" (`train_eos_after_a`), built once per session."""
    return shared_build(tmp_path_factory, "eos_model", _build_eos_model)


@pytest.fixture(scope="session")
def tool_model(tmp_path_factory):
    """Path of the warmed-up tool-calling model of `trl_rpp.testing.tool_model`, built once per session."""
    from trl_rpp.testing.tool_model import build_tool_model

    return shared_build(tmp_path_factory, "tool_model", build_tool_model)


@pytest.fixture(scope="session")
def two_process_runs(tmp_path_factory, tiny_model, eos_model):
    """The folder of the suite's one `accelerate launch` of two CPU processes (tests/support/two_process_script.py), which
    runs the two-process trainer cases of several test files in turn: one start of both processes for all."""
    import subprocess

    from trainer_helpers import LAUNCH_ENV, assert_launch_finished, launch_command

    outdir = tmp_path_factory.mktemp("two_process_runs")
    script = os.path.join(SUPPORT, "two_process_script.py")
    proc = subprocess.run(launch_command(script, str(outdir), tiny_model, eos_model), env=dict(os.environ, **LAUNCH_ENV),
                          capture_output=True, text=True, timeout=540)  # a hung collective fails instead of blocking
    assert_launch_finished(outdir, proc.returncode, proc.stdout[-3000:] + proc.stderr)
    return outdir


@pytest.fixture(scope="session")
def vllm_model(tmp_path_factory):
    """The tiny random-init Llama with 2 heads of 64 (vLLM's CPU attention has kernels for that head size), built
    once per session at one path, so that every engine started for it finds the same compile cache."""
    from trl_rpp.testing.tiny import build_tiny_model

    return shared_build(tmp_path_factory, "vllm_model",
                        lambda path: build_tiny_model(path, hidden_size=128, num_heads=2))


@pytest.fixture(scope="session")
def matrix_models(tmp_path_factory):
    """The folder of the combination matrix's models (tests/support/matrix.py, `model_paths`), built once."""
    import matrix

    return shared_build(tmp_path_factory, "matrix_models", lambda path: (matrix.model_paths(str(path)), str(path))[1])


def _shared_server(tmp_path_factory, model, name):
    from servers import ServerStartError, SharedServer

    log = tmp_path_factory.mktemp(name) / "server.log"
    try:
        server = SharedServer(model, log)
    except ServerStartError as err:
        with open(log) as f:
            pytest.fail(f"trl-rpp vllm-serve did not come up: {err}\n{f.read()[-3000:]}")
    print(f"\n{name}: started in {server.start_seconds:.0f} s for {model}")
    yield server
    server.stop()


@pytest.fixture(scope="session")
def vllm_server_process(tmp_path_factory, vllm_model):
    """The test run's server for `vllm_model` (tests/support/servers.py's `SharedServer`)."""
    yield from _shared_server(tmp_path_factory, vllm_model, "vllm_server")


@pytest.fixture(scope="session")
def tool_vllm_server_process(tmp_path_factory, matrix_models):
    """The test run's server for the matrix's tool-calling model (`matrix.model_paths(...)["none"]`)."""
    import matrix

    yield from _shared_server(tmp_path_factory, matrix.model_paths(matrix_models)["none"], "tool_vllm_server")


@pytest.fixture
def vllm_server(vllm_server_process):
    """TRL's client of the shared server for `vllm_model`, the server at the checkpoint's weights with an empty
    prefix cache (`SharedServer.reset`), whatever the test before synced into it; `server_process`,
    `server_command`, `server_log` and `shared` (the `SharedServer`) are set on it."""
    return vllm_server_process.client()

