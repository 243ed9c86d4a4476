"""What every Python process of the test suite runs first: the network guard, and vLLM only where a test asks.

tests/conftest.py loads this file in the pytest processes and puts this folder first on PYTHONPATH, so that Python
loads it as `sitecustomize` in each subprocess too: examples, the CLI, `accelerate launch` ranks, vLLM.

- The network guard. A connection or name look-up for anything but this machine fails as it would with the network
  unplugged (ENETUNREACH, or a failed look-up), before any packet leaves. The library must work offline, so the
  whole suite runs this way. Connections made below Python (gloo, ZeroMQ, NCCL) are not seen; they only ever use
  loopback in the tests.
- vLLM. TRL imports vLLM with its GRPO trainer whenever vLLM is installed, about 5 CPU-seconds per process, in each
  of the suite's ~100 subprocesses. A subprocess sees vLLM only when its environment has `TRL_RPP_TESTS_VLLM=1`
  (`with_vllm` in tests/support/trainer_helpers.py); the others run as on a machine without vLLM, the common install.
  The pytest processes themselves, where most trainer tests run, keep vLLM (tests/conftest.py).
"""

import errno
import ipaddress
import os
import socket
import sys

VLLM_OPT_IN = "TRL_RPP_TESTS_VLLM"

LOCAL_NAMES = {"localhost", "localhost.localdomain", "", "0.0.0.0", "::"}


def is_local(host):
    """True for this machine: loopback (127.0.0.0/8, ::1), the unspecified address, or the name localhost."""
    if isinstance(host, bytes):
        host = host.decode()
    if host is None or host in LOCAL_NAMES:
        return True
    try:
        address = ipaddress.ip_address(host.split("%")[0])
    except ValueError:
        return False
    return address.is_loopback or address.is_unspecified


def _refuse(what):
    return OSError(errno.ENETUNREACH, f"network blocked by the test suite's guard (tests/netguard): {what}")


def guarded_connect(real_connect):
    """`socket.connect`/`connect_ex` that calls `real_connect` only for a local address."""

    def connect(sock, address):
        if sock.family in (socket.AF_INET, socket.AF_INET6) and not is_local(address[0]):
            raise _refuse(f"connect to {address!r}")
        return real_connect(sock, address)

    connect.netguard = True
    return connect


def guarded_getaddrinfo(real_getaddrinfo):
    """`socket.getaddrinfo` that looks up only local names and addresses (no DNS query leaves the machine)."""

    def getaddrinfo(host, *args, **kwargs):
        if not is_local(host):
            raise socket.gaierror(socket.EAI_NONAME, f"name look-up blocked by tests/netguard: {host!r}")
        return real_getaddrinfo(host, *args, **kwargs)

    getaddrinfo.netguard = True
    return getaddrinfo


def install():
    if getattr(socket.socket.connect, "netguard", False):
        return
    socket.socket.connect = guarded_connect(socket.socket.connect)
    socket.socket.connect_ex = guarded_connect(socket.socket.connect_ex)
    socket.getaddrinfo = guarded_getaddrinfo(socket.getaddrinfo)


def hide_vllm_unless_asked():
    """`import vllm` fails and `importlib.util.find_spec("vllm")` (TRL's `is_vllm_available`) is None, unless the
    environment opts in."""
    if os.environ.get(VLLM_OPT_IN) != "1":
        sys.modules.setdefault("vllm", None)


install()
hide_vllm_unless_asked()
