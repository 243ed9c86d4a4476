"""Start and stop vLLM's server on localhost for tests, benchmarks and studies: one way to do it for all of them.

`server_command` is docs/vllm.md's CPU command, `trl-rpp vllm-serve`, as ``python -m trl_rpp.serve`` (the same
program). `start_server` runs a command in a session of its own (so that stopping it stops vLLM's engine process
too), sends it SIGTERM when the process that started it dies (a benchmark killed at its time limit, or a test run
cut short, leaves no server behind), and returns once the server's ``/health`` answers. `stop_server` stops the
whole session.

    port = free_port()
    with open("server.log", "w") as log:
        proc = start_server(server_command(model, port, weight_dir="/tmp/w"), f"http://127.0.0.1:{port}", log)
        ...
        stop_server(proc)
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time


class ServerStartError(RuntimeError):
    """The server exited, or did not answer ``/health`` in time; the message names its log."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_command(model: str, port: int, *, max_model_len: int | None = None, weight_dir: str | None = None,
                   weight_sync: str = "disk", dtype: str | None = None, vllm_args=()) -> list[str]:
    """`trl-rpp vllm-serve`'s command line for `model` on `port`, with this interpreter; `vllm_args` go to vLLM."""
    cmd = [sys.executable, "-m", "trl_rpp.serve", "--model", model, "--port", str(port), "--weight_sync", weight_sync]
    if max_model_len is not None:
        cmd += ["--max_model_len", str(max_model_len)]
    if weight_dir is not None:
        cmd += ["--weight_dir", weight_dir]
    if dtype is not None:
        cmd += ["--dtype", dtype]
    return cmd + (["--", *vllm_args] if vllm_args else [])


def _log_name(log) -> str:
    return getattr(log, "name", None) or "not kept"


def start_server(cmd: list[str], url: str, log=None, *, env: dict | None = None, core: int | None = None,
                 timeout_s: float = 900, deadline: float | None = None) -> subprocess.Popen:
    """Run `cmd` (a vLLM server that will answer at `url`) in a session of its own, its output to `log` (an open
    file; None: discarded; a pipe nobody reads would fill up and block the server), pinned to `core` (None: not
    pinned), with SIGTERM sent to it when this process dies. Returns the process once ``{url}/health`` answers 200;
    raises `ServerStartError` naming the log when it exits first or does not answer within `timeout_s` seconds (or
    by the `time.monotonic()` value `deadline`), after stopping it."""
    import requests

    def before_exec():
        import ctypes

        ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG, kept across the exec of vLLM's server
        if core is not None:
            os.sched_setaffinity(0, {core})

    out = subprocess.DEVNULL if log is None else log
    proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=before_exec,
                            env=env)
    start = time.monotonic()
    end = start + timeout_s if deadline is None else min(deadline, start + timeout_s)
    while time.monotonic() < end:
        try:
            if requests.get(f"{url}/health", timeout=5).status_code == 200:
                return proc
        except requests.RequestException:
            pass
        if proc.poll() is not None:
            raise ServerStartError(f"the vLLM server exited with {proc.returncode}; its log: {_log_name(log)}")
        time.sleep(0.5)
    stop_server(proc)
    raise ServerStartError(f"the vLLM server did not come up in {time.monotonic() - start:.0f} s; its log: "
                           f"{_log_name(log)}")


def stop_server(proc: subprocess.Popen, grace_s: float = 60, sig: int = signal.SIGTERM) -> None:
    """Stop the server's whole session: `sig` (SIGTERM: vLLM shuts down; SIGKILL: it dies at once), then SIGKILL
    after `grace_s` seconds. A server that has already exited is left as it is."""
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, sig)
        proc.wait(timeout=grace_s)
    except ProcessLookupError:
        pass
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
