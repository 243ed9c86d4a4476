"""The test harness itself: every multi-process launch takes a port of its own (so the suite can run on both cores),
no Python process of the suite can reach the network (so every run is proven offline), a subprocess sees vLLM
only when it asks for it, and a script started warm (tests/support/warm.py) runs as it runs in a fresh interpreter."""

import ast
import errno
import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest

import trainer_helpers
from trainer_helpers import FIRST_PORT, PORTS_PER_WORKER, assert_launch_finished, free_port, launch_command, with_vllm

HERE = Path(__file__).resolve().parent


# --- ports ------------------------------------------------------------------------------------------------------


def _launch_port(argv):
    assert argv[1:4] == [trainer_helpers.WARM, "-m", "accelerate.commands.launch"], argv
    return int(argv[argv.index("--main_process_port") + 1])


def test_every_launch_takes_a_fresh_port_of_this_worker():
    ports = [_launch_port(launch_command("script.py")) for _ in range(3)]
    ports.append(_launch_port(launch_command("script.py", config_file="deepspeed_zero3.yaml")))
    assert len(set(ports)) == len(ports), ports
    worker = trainer_helpers._worker_index()
    low = FIRST_PORT + PORTS_PER_WORKER * worker
    assert all(low <= p < low + PORTS_PER_WORKER for p in ports), (worker, ports)
    assert 29500 not in ports  # accelerate's default, which every launch used to share


def test_workers_draw_from_disjoint_ranges(monkeypatch):
    seen = {}
    for worker in ("gw0", "gw1", "gw2"):
        monkeypatch.setenv("PYTEST_XDIST_WORKER", worker)
        seen[worker] = {free_port() for _ in range(5)}
    assert not (seen["gw0"] & seen["gw1"]) and not (seen["gw1"] & seen["gw2"]), seen


def test_a_port_in_use_is_skipped(monkeypatch):
    """A port someone listens on is never handed out: the next one that binds is."""
    base = FIRST_PORT + PORTS_PER_WORKER * trainer_helpers._worker_index()
    port = free_port()
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", port))
        busy.listen()
        monkeypatch.setattr(trainer_helpers, "_ports", iter(range(port - base, PORTS_PER_WORKER)))
        assert free_port() > port


def _launch_sites(path):
    """(line, text) of every string constant naming accelerate's or torch's launcher in a Python file."""
    tree = ast.parse(path.read_text())
    return [(node.lineno, node.value) for node in ast.walk(tree) if isinstance(node, ast.Constant)
            and isinstance(node.value, str) and node.value in ("accelerate.commands.launch", "torchrun",
                                                                "torch.distributed.run")]


def test_no_launch_outside_launch_command():
    """A test that built its own `accelerate launch` command would fall back to the fixed default port."""
    sites = {p.name: _launch_sites(p) for p in HERE.rglob("*.py") if p.name not in ("trainer_helpers.py", "test_harness.py")}
    assert {name: s for name, s in sites.items() if s} == {}
    assert _launch_sites(HERE / "support" / "trainer_helpers.py"), "the check reads constants: it finds the one real site"


def test_a_launch_is_judged_by_every_process_reaching_its_end(tmp_path):
    """`assert_launch_finished`: a process that did not write its `finished_rank<r>` fails the test whatever the
    launcher returned; once every process has, a non-zero status (a crash in the interpreter's teardown) warns."""
    with pytest.raises(AssertionError, match=r"process\(es\) \[0, 1\] did not finish; launcher status 0"):
        assert_launch_finished(tmp_path, 0, "")
    (tmp_path / "finished_rank0").touch()
    with pytest.raises(AssertionError, match=r"process\(es\) \[1\] did not finish; launcher status -6"):
        assert_launch_finished(tmp_path, -6, "")
    (tmp_path / "finished_rank1").touch()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert_launch_finished(tmp_path, 0, "")
    with pytest.warns(UserWarning, match="every process finished, then the launcher returned -6"):
        assert_launch_finished(tmp_path, -6, "terminate called without an active exception")


# --- network guard ----------------------------------------------------------------------------------------------

import harness  # noqa: E402  (tests/conftest.py loaded it: tests/harness/sitecustomize.py)


@pytest.mark.parametrize("host,local", [("127.0.0.1", True), ("127.8.0.1", True), ("::1", True), ("localhost", True),
                                        ("0.0.0.0", True), ("8.8.8.8", False), ("10.0.0.1", False),
                                        ("huggingface.co", False), ("2001:db8::1", False)])
def test_guard_tells_local_from_remote(host, local):
    assert harness.is_local(host) is local


def test_guard_refuses_remote_connections_before_they_are_made():
    calls = []
    connect = harness.guarded_connect(lambda sock, address: calls.append(address))
    with socket.socket() as sock:
        with pytest.raises(OSError) as err:
            connect(sock, ("192.0.2.1", 443))
        assert err.value.errno == errno.ENETUNREACH
        connect(sock, ("127.0.0.1", 9))
    assert calls == [("127.0.0.1", 9)]  # the remote address never reached the real connect
    lookups = []
    getaddrinfo = harness.guarded_getaddrinfo(lambda host, *a, **k: lookups.append(host))
    with pytest.raises(socket.gaierror):
        getaddrinfo("huggingface.co", 443)
    getaddrinfo("localhost", 443)
    assert lookups == ["localhost"]


def test_guard_is_on_here_and_in_every_subprocess():
    assert getattr(socket.socket.connect, "netguard", False) and getattr(socket.getaddrinfo, "netguard", False)
    probe = ("import socket; print(getattr(socket.socket.connect, 'netguard', False), "
             "getattr(socket.getaddrinfo, 'netguard', False))")
    out = subprocess.run([sys.executable, "-c", probe], env=dict(os.environ), capture_output=True, text=True,
                         check=True)
    assert out.stdout.split() == ["True", "True"], out.stderr
    # A loopback server still answers.
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        with socket.create_connection(server.getsockname(), timeout=5):
            pass


# --- vLLM only where asked ----------------------------------------------------------------------------------------

needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed (make test-min)")


@needs_vllm
def test_subprocesses_see_vllm_only_when_they_ask():
    probe = "import importlib.util; from trl.import_utils import is_vllm_available; print(is_vllm_available())"
    env = {k: v for k, v in os.environ.items() if k != "TRL_RPP_TESTS_VLLM"}
    hidden = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True)
    seen = subprocess.run([sys.executable, "-c", probe], env=with_vllm(env), capture_output=True, text=True, check=True)
    assert (hidden.stdout.strip(), seen.stdout.strip()) == ("False", "True"), (hidden.stderr, seen.stderr)


@needs_vllm
def test_the_pytest_process_keeps_vllm():
    from trl.import_utils import is_vllm_available

    assert sys.modules.get("vllm", "not imported") is not None and is_vllm_available()


# --- grouping ------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def made_once_per_module():
    return object()


def test_tests_sharing_a_module_fixture_stay_on_one_worker(request, made_once_per_module):
    """Under `--dist loadgroup` (make test), xdist schedules by node id: the group that tests/conftest.py gives a test
    using a module-scoped fixture must be in it, or each worker would make the fixture (a vLLM run) again."""
    if not os.environ.get("PYTEST_XDIST_WORKER") or not request.config.getvalue("loadgroup"):
        pytest.skip("runs under make test's pytest-xdist --dist loadgroup")
    assert request.node.nodeid.endswith("@test_harness:made_once_per_module"), (
        request.node.nodeid, [m.args for m in request.node.iter_markers("xdist_group")])


# --- skips and xfails ----------------------------------------------------------------------------------------------
# A test that skips or xfails on some versions checks nothing there: a dependency that moved must fail a test, by
# name. The only xfail allowed is strict, for a named upstream bug, with its link.

_VERSION_WORDS = ("version", "__version__", "version_info")


def _mentions_a_version(node) -> bool:
    for sub in ast.walk(node):
        name = sub.id if isinstance(sub, ast.Name) else sub.attr if isinstance(sub, ast.Attribute) else None
        if name is not None and "version" in name.lower():
            return True
        if isinstance(sub, ast.keyword) and sub.arg == "minversion":
            return True
    return False


def _call_name(call) -> str:
    """'pytest.mark.skipif' for `pytest.mark.skipif(...)`, '' for what is not a dotted name."""
    parts, node = [], call.func
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    return ".".join([node.id, *reversed(parts)]) if isinstance(node, ast.Name) else ""


def skip_and_xfail_problems(source: str, filename: str = "<test>") -> list[str]:
    """Every skip or xfail in `source` that is decided by a version, and every xfail that is not strict with a link
    to an upstream bug. A skip is decided by what it is called under: its own condition (`skipif`, `importorskip`'s
    `minversion`) and the tests of every `if` around a `pytest.skip`."""
    tree = ast.parse(source, filename)
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    problems = []
    for call in (n for n in ast.walk(tree) if isinstance(n, ast.Call)):
        name = _call_name(call).removeprefix("pytest.")
        if name not in ("skip", "xfail", "importorskip", "mark.skip", "mark.skipif", "mark.xfail"):
            continue
        where = f"{filename}:{call.lineno} {name}"
        if name == "xfail":
            problems.append(f"{where}: an imperative xfail is never strict; use @pytest.mark.xfail(strict=True)")
            continue
        if name == "mark.xfail":
            keywords = {k.arg: k.value for k in call.keywords}
            strict = keywords.get("strict")
            reason = ast.unparse(keywords.get("reason", ast.Constant("")))
            if not (isinstance(strict, ast.Constant) and strict.value is True) or "https://" not in reason:
                problems.append(f"{where}: an xfail must be strict=True and link the upstream bug in its reason")
        conditions = [call] if name != "skip" else []
        node = call
        while node in parents:
            node = parents[node]
            if isinstance(node, (ast.If, ast.IfExp, ast.While)):
                conditions.append(node.test)
        if any(_mentions_a_version(c) for c in conditions):
            problems.append(f"{where}: decided by a version")
    return problems


@pytest.mark.parametrize("source, found", [
    # Each case is split so that no line of this file holds both the skip call and the version it reads.
    ("import accelerate, pytest\n"
     "if not accelerate.__version__.startswith('1.15.'):\n"
     "    pytest.skip('old')\n", 1),
    ("import pytest, sys\n@pytest.mark.skipif("
     "sys.version_info < (3, 12), reason='x')\ndef test(): pass\n", 1),
    ("import pytest\nfrom importlib.metadata import version\n"
     "def test():\n    if version('torch') > '2':\n"
     "        for _ in range(2):\n            pytest.skip('new')\n", 1),
    ("import pytest\npytest.importorskip('vllm', "
     "minversion='0.31')\n", 1),
    ("import pytest\n@pytest.mark.xfail(strict=False, reason='flaky here')\ndef test(): pass\n", 1),
    ("import pytest\n@pytest.mark.xfail(strict=True, reason='no link')\ndef test(): pass\n", 1),
    ("import pytest\ndef test():\n    pytest.xfail('later')\n", 1),
    # Allowed: a skip that does not depend on a version, and a strict xfail for a linked upstream bug.
    ("import pytest, torch\ndef test():\n    if torch.cuda.is_available():\n        pytest.skip('a GPU')\n", 0),
    ("import pytest\n@pytest.mark.xfail(strict=True, reason='https://github.com/o/r/issues/1')\ndef test(): pass\n", 0),
])
def test_the_skip_check_finds_what_it_must(source, found):
    assert len(skip_and_xfail_problems(source)) == found, skip_and_xfail_problems(source)


def test_no_test_skips_or_xfails_by_version():
    files = sorted(HERE.rglob("*.py"))
    assert HERE / "test_engines.py" in files and len(files) > 30
    problems = [p for f in files for p in skip_and_xfail_problems(f.read_text(), str(f.relative_to(HERE)))]
    assert problems == [], "\n".join(problems)


# --- warm starts (tests/support/warm.py) --------------------------------------------------------------------------

import warm  # noqa: E402

PROBE = """import os, sys
print("name", __name__, "argv", sys.argv, "cwd", os.getcwd(), "path0", sys.path[0], "env", os.environ.get("PROBE"))
print("stdin", sys.stdin.read())
print("to stderr", file=sys.stderr)
with open("written", "w") as f:
    f.write(str(os.getpid()))
sys.exit(int(sys.argv[1]))
"""


def _probe_run(command, folder, env):
    os.makedirs(folder)
    (folder / "probe.py").write_text(PROBE)
    proc = subprocess.Popen([*command, "probe.py", "3", "--flag"], cwd=folder, env=env, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, err = proc.communicate("from the caller", timeout=120)
    return proc, out.replace(str(folder), "<folder>"), err, int((folder / "written").read_text())


def test_a_script_runs_warm_as_it_runs_cold(tmp_path):
    """Warm or cold, the script sees the same `__name__`, argv, directory, `sys.path[0]`, environment and stdin, and
    the caller gets the same stdout, stderr, files and exit status. Only the warm one is not the process the caller
    started (it is forked by the zygote): proof that it did not fall back to a fresh interpreter."""
    env = dict(os.environ, PROBE="probe value")
    cold, cold_out, cold_err, cold_pid = _probe_run([sys.executable], tmp_path / "cold", env)
    warm_, warm_out, warm_err, warm_pid = _probe_run(trainer_helpers.python_command(), tmp_path / "warm", env)
    assert cold_out == ("name __main__ argv ['probe.py', '3', '--flag'] cwd <folder> path0 <folder> env probe value\n"
                        "stdin from the caller\n")
    assert (warm_out, warm_err, warm_.returncode) == (cold_out, cold_err, cold.returncode) == (
        cold_out, "to stderr\n", 3)
    assert cold_pid == cold.pid and warm_pid != warm_.pid
    assert os.path.exists(os.path.join(os.environ[warm.WARM_DIR], warm.environment_key(env) + ".sock"))


@pytest.mark.slow
def test_a_retiring_zygote_strands_no_client(tmp_path):
    """A zygote left idle retires: its socket and pid file go, then its process. Clients that come while it retires
    or after it left are served, by it or by a new zygote, never told that the zygote did not start: clients spaced
    around the idle spell (1 s here) all run the script. These zygotes import nothing first, so that each start costs
    well under a second instead of TRL's import."""
    env = dict(os.environ, **{warm.IDLE_VARIABLE: "1", warm.PRELOAD_VARIABLE: ""})
    base = os.path.join(os.environ[warm.WARM_DIR], warm.environment_key(env) + ".sock")
    (tmp_path / "probe.py").write_text("print('ran')\n")

    def run():
        done = subprocess.run(trainer_helpers.python_command("probe.py"), cwd=tmp_path, env=env, capture_output=True,
                              text=True, timeout=180)
        assert (done.returncode, done.stdout) == (0, "ran\n"), done.stderr[-3000:]

    run()
    with open(base + ".pid") as f:
        pid = int(f.read())
    def running():  # a zombie has ended
        try:
            with open(f"/proc/{pid}/stat") as f:
                return f.read().rsplit(")", 1)[1].split()[0] != "Z"
        except FileNotFoundError:
            return False

    deadline = time.time() + 60
    while os.path.exists(base + ".pid") or os.path.exists(base) or running():
        assert time.time() < deadline, "the idle zygote did not retire"
        time.sleep(0.05)
    for pause in (0.0, 0.9, 1.0, 1.1, 1.3):
        time.sleep(pause)
        run()


def _started(tmp_path, code):
    (tmp_path / "probe.py").write_text("import os, signal, sys, time\n" + code)
    return subprocess.Popen(trainer_helpers.python_command("probe.py"), cwd=tmp_path, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def _pid_written(tmp_path, proc):
    deadline = time.time() + 120
    while not (tmp_path / "pid").exists():
        assert proc.poll() is None and time.time() < deadline, proc.communicate()[0]
        time.sleep(0.05)
    return int((tmp_path / "pid").read_text())


WAITS = ("signal.signal(signal.SIGTERM, lambda *_: (print('handled', flush=True), sys.exit(75)))\n"
         "open('pid.tmp', 'w').write(str(os.getpid())); os.replace('pid.tmp', 'pid')\n"
         "time.sleep(120)\n")


def test_signals_reach_a_warm_script_and_its_end_reaches_the_caller(tmp_path):
    """SIGTERM to the process the caller started runs the script's handler (exit 75, as a scheduler's signal would);
    a script killed by a signal is reported as killed by it; a caller killed with SIGKILL takes the script with it."""
    for name in "abc":
        (tmp_path / name).mkdir()
    proc = _started(tmp_path / "a", WAITS)
    _pid_written(tmp_path / "a", proc)
    proc.send_signal(signal.SIGTERM)
    assert (proc.wait(60), proc.communicate()[0]) == (75, "handled\n")

    proc = _started(tmp_path / "b", "os.kill(os.getpid(), signal.SIGKILL)\n")
    assert proc.wait(60) == -signal.SIGKILL

    proc = _started(tmp_path / "c", WAITS)
    script = _pid_written(tmp_path / "c", proc)
    proc.kill()
    proc.wait(60)
    deadline = time.time() + 10
    while os.path.exists(f"/proc/{script}") and open(f"/proc/{script}/stat").read().split()[2] != "Z":
        assert time.time() < deadline, "the script outlived its caller"
        time.sleep(0.05)


@pytest.mark.slow
def test_a_warm_training_run_equals_a_cold_one(tmp_path, tiny_model, uninterrupted_run):
    """resume_script.py's uninterrupted run, warm (the session's shared `uninterrupted_run`) and cold: the same
    log history to the last bit, timings aside."""
    warm_history = uninterrupted_run("reinforce_plus_plus", 1)
    out = tmp_path / "cold"
    subprocess.run(trainer_helpers.resume_command("--model", tiny_model, "--output_dir", str(out), "--estimator",
                                                  "reinforce_plus_plus", "--steps_per_generation", "1", warm=False),
                   env=trainer_helpers.script_env(), check=True, capture_output=True, timeout=600)
    cold_history = json.loads((out / "log_history.json").read_text())

    def untimed(history):
        timed = ("runtime", "per_second", "step_time")
        return [{k: v for k, v in h.items() if not any(t in k for t in timed)} for h in history]

    assert warm_history["steps_run_here"] == cold_history["steps_run_here"] == [1, 2, 3, 4, 5, 6, 7, 8]
    for warm_step, cold_step in zip(untimed(warm_history["log_history"]), untimed(cold_history["log_history"])):
        assert warm_step == cold_step, {k: (warm_step.get(k), cold_step.get(k)) for k in warm_step | cold_step
                                        if warm_step.get(k) != cold_step.get(k)}
    assert len(warm_history["log_history"]) == len(cold_history["log_history"])
    assert any("loss" in h for h in warm_history["log_history"])
