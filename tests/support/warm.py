"""Warm starts for the suite's training subprocesses: `python warm.py script.py args...` runs `script.py args...` as
`python script.py args...` does, without paying the ~8 s import of torch, transformers and TRL each time.

Every script the tests start would import the same libraries before doing anything of its own (`trl_rpp` and its
trainer: torch, transformers, accelerate, datasets, TRL). A *zygote* is a Python process of the suite (same
interpreter, same environment, tests/harness's sitecustomize included) that has imported them and waits on a Unix
socket. This file, run as the command, is the *client*: it sends the zygote its argv, working directory and
environment, and its stdin, stdout and stderr. The zygote forks a *monitor*, which forks the process that runs the
script (`runpy`, as `python script.py` runs it, `__name__ == "__main__"`). So the script runs in a process of its
own with the client's streams, directory and environment, from a state that differs from a fresh interpreter's only
in that those libraries are already imported.

What the caller sees is what a fresh interpreter gives: the client exits with the script's exit status, or dies of
the signal that killed the script. SIGTERM, SIGINT, SIGHUP, SIGUSR1 and SIGUSR2 sent to the client are sent on to
the script. The script's own pid is the one it sees (`os.getpid()`), so signals it sends itself, or that tests send
to a pid it wrote down, reach it directly. If the client dies (SIGKILL included), the monitor kills the script.

One zygote per environment: the libraries read some variables when they are imported (HF_HUB_OFFLINE,
TRL_RPP_TESTS_VLLM through tests/harness, the OpenMP settings), so a zygote serves only clients whose environment
equals the one it was started with, apart from the variables that `accelerate launch` and torch's launcher set for
each process and that are read later (`PER_PROCESS`). Zygotes live in `TRL_RPP_WARM_DIR`, a folder of the test
session (tests/conftest.py), which stops them when the session ends (`stop_zygotes`): a zygote never outlives the
code it imported. Without `TRL_RPP_WARM_DIR` the client refuses to run.

tests/test_harness.py checks that a script runs warm exactly as it runs cold: the same output, files and status."""

import hashlib
import json
import os
import signal
import socket
import sys
import time

WARM_DIR = "TRL_RPP_WARM_DIR"
# Set per process by `accelerate launch` and torch's elastic launcher, read when the process group starts, never at
# import: a zygote serves every rank of every launch.
PER_PROCESS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK",
               "ROLE_NAME", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT",
               "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_USE_AGENT_STORE",
               "TORCHELASTIC_ERROR_FILE", "TORCH_NCCL_ASYNC_ERROR_HANDLING", "TORCHELASTIC_ENABLE_FILE_TIMER",
               "TORCHELASTIC_TIMER_FILE", "TORCHELASTIC_SIGNALS_TO_HANDLE", "PYTEST_CURRENT_TEST", "PYTHONUNBUFFERED",
               "_", "PWD", "OLDPWD", "SHLVL")  # the last four: what a shell sets; the directory is sent apart
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)
IDLE_EXIT_S = 120  # a zygote that nobody used for this long exits on its own (each holds ~0.5 GB)
IDLE_VARIABLE = "TRL_RPP_WARM_IDLE_S"  # another idle spell, in seconds (tests/test_harness.py)
PRELOAD_VARIABLE = "TRL_RPP_WARM_PRELOAD"  # another module to import first, or none if empty (tests/test_harness.py)
START_TIMEOUT_S = 300


def environment_key(env):
    """The zygote an environment is served by: a hash of every variable but `PER_PROCESS` and the ACCELERATE_ ones
    (accelerate launch's settings for each process, read when the accelerator is built)."""
    kept = sorted((k, v) for k, v in env.items() if k not in PER_PROCESS and not k.startswith("ACCELERATE_"))
    return hashlib.sha256(json.dumps(kept).encode()).hexdigest()[:16]


# ---------------------------------------------------------------------------------------------------------- zygote

def _send_line(conn, message):
    conn.sendall(json.dumps(message).encode() + b"\n")


def _read_line(conn):
    data = b""
    while not data.endswith(b"\n"):
        chunk = conn.recv(65536)
        if not chunk:
            return None
        data += chunk
    return json.loads(data)


def _run_script(request):
    """In the forked process: become `python <argv>` with the client's directory, environment and streams, run the
    script, and end as the interpreter would (non-daemon threads joined, atexit handlers run, streams flushed)."""
    import io
    import runpy
    import threading
    import traceback

    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    unbuffered = request["unbuffered"] or bool(os.environ.get("PYTHONUNBUFFERED"))
    sys.stdin = io.TextIOWrapper(io.BufferedReader(io.FileIO(0, "r", closefd=False)))
    out, err = (io.FileIO(fd, "w", closefd=False) for fd in (1, 2))
    sys.stdout = io.TextIOWrapper(out if unbuffered else io.BufferedWriter(out), write_through=unbuffered,
                                  line_buffering=False)
    sys.stderr = io.TextIOWrapper(err, write_through=True, line_buffering=True, errors="backslashreplace")
    if os.environ.get("PYTHONFAULTHANDLER"):
        import faulthandler

        faulthandler.enable()
    args = request["argv"]
    code = 0
    try:
        if args[0] == "-c":
            sys.argv = ["-c", *args[2:]]
            sys.path[0] = ""
            module = type(sys)("__main__")
            sys.modules["__main__"] = module
            exec(compile(args[1], "<string>", "exec"), module.__dict__)
        elif args[0] == "-m":
            sys.argv = [args[1], *args[2:]]
            sys.path[0] = os.getcwd()
            runpy.run_module(args[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = list(args)
            sys.path[0] = os.path.dirname(os.path.abspath(args[0]))
            runpy.run_path(args[0], run_name="__main__")
    except SystemExit as exit_:
        if exit_.code is None:
            code = 0
        elif isinstance(exit_.code, int):
            code = exit_.code
        else:
            print(exit_.code, file=sys.stderr)
            code = 1
    except BaseException:
        traceback.print_exc()
        code = 1
    try:
        threading._shutdown()  # what the interpreter does at exit: wait for non-daemon threads
    finally:
        import atexit

        atexit._run_exitfuncs()
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        os._exit(code & 0xFF)


def _monitor(conn):
    """In a process forked per request: fork the script's process, tell the client its pid, wait for it (or kill it
    if the client goes away), then send its wait status."""
    import array
    import select

    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    fds = array.array("i")
    message, ancillary, _, _ = conn.recvmsg(1 << 20, socket.CMSG_LEN(3 * fds.itemsize))
    for level, kind, data in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(data[:len(data) - len(data) % fds.itemsize])
    while not message.endswith(b"\n"):
        message += conn.recv(1 << 20)
    request = json.loads(message)
    pid = os.fork()
    if pid == 0:
        conn.close()
        for target, fd in zip((0, 1, 2), fds):
            os.dup2(fd, target)
            os.close(fd)
        _run_script(request)
    for fd in fds:
        os.close(fd)
    _send_line(conn, {"pid": pid})
    pidfd = os.pidfd_open(pid)
    ready, _, _ = select.select([conn, pidfd], [], [])
    if pidfd not in ready:  # the client closed its end: it was killed, so is the script
        os.kill(pid, signal.SIGKILL)
    _, status = os.waitpid(pid, 0)
    try:
        _send_line(conn, {"status": status})
    except OSError:
        pass
    os._exit(0)


def serve(path):
    """The zygote: import what every training script imports (the trainer: torch, transformers, TRL), then fork a
    monitor per connection on `path`."""
    import importlib

    preload = os.environ.get(PRELOAD_VARIABLE, "trl_rpp.trainer")
    if preload:
        importlib.import_module(preload)

    sys.stdout.flush()
    sys.stderr.flush()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    if os.path.exists(path + ".new"):  # left by a zygote that died starting
        os.unlink(path + ".new")
    listener.bind(path + ".new")
    listener.listen(64)
    os.rename(path + ".new", path)  # clients connect only once it listens
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # monitors are reaped by the kernel
    idle_s = float(os.environ.get(IDLE_VARIABLE, IDLE_EXIT_S))
    listener.settimeout(min(10.0, idle_s))
    last = time.monotonic()
    while os.path.exists(path):
        try:
            conn, _ = listener.accept()
        except socket.timeout:
            if time.monotonic() - last > idle_s:
                _retire(path, listener)
                return
            continue
        last = time.monotonic()
        _serve_one(listener, conn)
    try:
        os.unlink(path)
    except OSError:
        pass


def _serve_one(listener, conn, lock=None):
    if os.fork() == 0:
        listener.close()
        if lock is not None:  # the parent's start lock stays the parent's: the script must not hold it
            lock.close()
        conn.settimeout(None)
        _monitor(conn)
    conn.close()


def _retire(path, listener):
    """Leave after an idle spell without stranding a client: under the clients' start lock, unlink the socket (a
    later client finds none and starts a new zygote once the lock is free), serve the clients already waiting in the
    backlog, then remove the pid file, so that no client waits for a zygote that is leaving."""
    import fcntl

    with open(path + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            os.unlink(path)
        except OSError:
            pass
        listener.setblocking(False)
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:  # BlockingIOError: the backlog is empty
                break
            conn.setblocking(True)
            _serve_one(listener, conn, lock)
        listener.close()
        try:
            os.unlink(path + ".pid")
        except OSError:
            pass


# ---------------------------------------------------------------------------------------------------------- client

def _connect(path):
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.connect(path)
    return conn


def _signal_pid_file(pid_file, sig):
    """Send `sig` to the process whose pid `pid_file` holds; False if there is none."""
    try:
        with open(pid_file) as f:
            os.kill(int(f.read()), sig)
        return True
    except (OSError, ValueError):
        return False


def _alive(pid_file):
    return _signal_pid_file(pid_file, 0)


def stop_zygotes(directory):
    """SIGTERM every zygote started in `directory`, then remove it (the end of a test session)."""
    import glob
    import shutil

    for pid_file in glob.glob(os.path.join(directory, "*.pid")):
        _signal_pid_file(pid_file, signal.SIGTERM)
    shutil.rmtree(directory, ignore_errors=True)


def _zygote(directory, env):
    """A connection to the zygote of `env`, started first if there is none: under a lock, and only if no other
    client started one that is still importing."""
    import fcntl
    import subprocess

    path = os.path.join(directory, environment_key(env) + ".sock")
    try:
        return _connect(path)
    except OSError:
        pass
    with open(path + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not _alive(path + ".pid"):
            log = open(path + ".log", "a")
            zygote = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--serve", path], env=env,
                                      stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True)
            with open(path + ".pid", "w") as f:
                f.write(str(zygote.pid))
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        try:
            return _connect(path)
        except OSError:
            if not _alive(path + ".pid") or time.monotonic() > deadline:
                raise RuntimeError(f"the warm-start zygote for this environment did not start; see {path}.log")
            time.sleep(0.05)


def main(argv):
    directory = os.environ.get(WARM_DIR)
    if not directory:
        sys.exit(f"warm.py: {WARM_DIR} is not set: it names the folder of the test session's zygotes "
                 "(tests/conftest.py sets it); run the script with `python` instead")
    import array

    env = dict(os.environ)
    conn = _zygote(directory, env)
    request = json.dumps({"argv": argv, "cwd": os.getcwd(), "env": env,
                          "unbuffered": bool(getattr(sys.stdout, "write_through", False))}).encode() + b"\n"
    conn.sendmsg([request], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [0, 1, 2]))])
    pid = _read_line(conn)["pid"]
    for sig in FORWARDED:
        signal.signal(sig, lambda sig, frame: os.kill(pid, sig))
    reply = _read_line(conn)
    if reply is None:
        raise RuntimeError("the warm-start zygote's monitor went away before the script ended")
    status = reply["status"]
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        if sig not in (signal.SIGKILL, signal.SIGSTOP):
            signal.signal(sig, signal.SIG_DFL)
        os.kill(os.getpid(), sig)
    os._exit(os.waitstatus_to_exitcode(status))


if __name__ == "__main__":
    if sys.argv[1:2] == ["--serve"]:
        serve(sys.argv[2])
    else:
        main(sys.argv[1:])
