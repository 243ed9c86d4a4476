"""The test harness itself: every multi-process launch takes a port of its own (so the suite can run on both cores),
no Python process of the suite can reach the network (so every run is proven offline), and a subprocess sees vLLM
only when it asks for it."""

import ast
import errno
import importlib.util
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

import trainer_helpers
from trainer_helpers import FIRST_PORT, PORTS_PER_WORKER, free_port, launch_command, with_vllm

HERE = Path(__file__).resolve().parent


# --- ports ------------------------------------------------------------------------------------------------------


def _launch_port(argv):
    assert argv[1:3] == ["-m", "accelerate.commands.launch"], argv
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
    sites = {p.name: _launch_sites(p) for p in HERE.glob("*.py") if p.name not in ("trainer_helpers.py", "test_harness.py")}
    assert {name: s for name, s in sites.items() if s} == {}
    assert _launch_sites(HERE / "trainer_helpers.py"), "the check reads constants: it finds the one real site"


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
