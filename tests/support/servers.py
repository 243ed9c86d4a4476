"""The suite's vLLM servers: one per model for the whole test run, started by docs/vllm.md's CPU command (`trl-rpp
vllm-serve`: dev mode, float32, processed log-probs, no cap on their number, a KV cache of 1 GiB) in an environment
that sets none of that itself, and shared by every test that trains against it (tests/conftest.py's `vllm_server`
and `tool_vllm_server_process`).

A server's weights are global: a test's trainer syncs its own into it, and a test that asked the server directly would
otherwise read whatever the test before left there. So every test takes the server at its base weights:
`SharedServer.reset` reloads the checkpoint it was started from (vLLM's `reload_weights`, the call the trainer's disk
sync makes) and drops the prefix cache. `fresh` holds what the server answered before any test touched it, for the test
that shows a reset server answers exactly as a fresh one (tests/test_vllm_engine.py).

Tests that use a server share one xdist worker (tests/conftest.py's `SHARED_RUNS`): two trainers syncing into one
server at once would each sample from the other's weights, and the tests that stop or kill it must not stop another's.
"""

from __future__ import annotations

import os
import shlex
import sys
import time
from pathlib import Path

import requests

from trl_rpp.testing.vllm_server import ServerStartError, free_port, start_server, stop_server

REPO = Path(__file__).resolve().parents[2]
# What the suite's vLLM processes (servers, and trainers with an engine) add to their environment: a KV cache of
# 1 GiB, no usage report leaving the machine, and TRL_RPP_TESTS_VLLM (the suite's subprocesses see vLLM only when
# asked: tests/harness). `ENV` adds what CI's environment sets (.ci/run).
VLLM_ENV = dict(VLLM_CPU_KVCACHE_SPACE="1", VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1", TRL_RPP_TESTS_VLLM="1")
ENV = dict(HF_HUB_OFFLINE="1", WANDB_MODE="offline", TOKENIZERS_PARALLELISM="false", **VLLM_ENV)
# A prompt and a sequence whose answers `answers` reads: prompt log-probs (no sampling), and a seeded sample.
PROBE_IDS = [3, 4, 5, 6, 7, 8, 9, 10]


def documented_server_command(model, port):
    """docs/vllm.md's CPU server command, its one `trl-rpp vllm-serve` (tests/test_distributed_docs.py parses it), as
    written but for the model and the port; `trl-rpp` is the console script of this environment."""
    from test_distributed_docs import doc_commands

    (command,) = [c for c in doc_commands((REPO / "docs" / "vllm.md",)) if "trl-rpp vllm-serve" in c]
    argv = shlex.split(command)
    assert argv[:2] == ["trl-rpp", "vllm-serve"], command
    for flag, value in (("--model", model), ("--port", str(port))):
        argv[argv.index(flag) + 1] = value
    script = Path(sys.executable).with_name("trl-rpp")
    assert script.is_file(), f"{script}: the console script of `pip install -e .`"
    return [str(script), *argv[1:]]


def complete(url: str, ids, **params) -> dict:
    """The server's one choice for the prompt `ids` at temperature 1 (`params`: more of /v1/completions' fields),
    with its prompt log-probs."""
    model = requests.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]
    answer = requests.post(f"{url}/v1/completions", timeout=60, json={
        "model": model, "prompt": [ids], "temperature": 1.0, "prompt_logprobs": 0, **params})
    answer.raise_for_status()
    return answer.json()["choices"][0]


def server_logps(url: str, ids) -> list[float]:
    """The server's log-probs of ``ids[1:]``, each after the ids before it (its prompt log-probs at temperature 1)."""
    return prompt_logps(complete(url, ids, max_tokens=1), ids)


def prompt_logps(choice: dict, ids) -> list[float]:
    return [choice["prompt_logprobs"][i][str(ids[i])]["logprob"] for i in range(1, len(ids))]


def answers(url: str, ids=PROBE_IDS) -> dict:
    """What the server answers now for a fixed input: `server_logps` of `ids`, and 8 tokens sampled after ``ids``
    with seed 0 at temperature 1, with their log-probs and each position's 5 most probable tokens."""
    choice = complete(url, ids, max_tokens=8, seed=0, logprobs=5, ignore_eos=True)
    lp = choice["logprobs"]
    return {"prompt_logprobs": prompt_logps(choice, ids), "tokens": lp["tokens"],
            "token_logprobs": lp["token_logprobs"], "top_logprobs": lp["top_logprobs"]}


class SharedServer:
    """One vLLM server for `model`, its output in `log_path`. `base_url`, `server_process` (its session leader),
    `server_command` (the vLLM command `trl-rpp vllm-serve` runs, which tests/support/vllm_server_script.py's restart
    case starts again), `server_log`, `start_seconds`, and `fresh`: `answers` before any test used it."""

    def __init__(self, model: str, log_path):
        from trl_rpp.serve import parse, server

        self.model, self.server_log = str(model), str(log_path)
        port = free_port()
        cmd = documented_server_command(self.model, port)
        opts, extra = parse(cmd[2:], cuda=False)
        self.server_command = server(opts, extra, cuda=False).argv
        self.base_url = f"http://127.0.0.1:{port}"
        env = {k: v for k, v in dict(os.environ, **ENV).items()
               if k not in ("VLLM_SERVER_DEV_MODE", "VLLM_CPU_KVCACHE_SPACE")}  # `trl-rpp vllm-serve` sets them
        start = time.perf_counter()
        self._log = open(self.server_log, "w")
        self.server_process = start_server(cmd, self.base_url, self._log, env=env, timeout_s=600)
        self.start_seconds = time.perf_counter() - start
        self.fresh = answers(self.base_url)

    def load(self, weights_path) -> None:
        """The weights of the checkpoint at `weights_path` (the disk sync's call), prefix cache dropped."""
        rpc = requests.post(f"{self.base_url}/collective_rpc", timeout=120,
                            json={"method": "reload_weights", "kwargs": {"weights_path": str(weights_path)}})
        rpc.raise_for_status()
        dropped = requests.post(f"{self.base_url}/reset_prefix_cache", timeout=60)
        dropped.raise_for_status()

    def reset(self) -> None:
        """Back to the checkpoint's weights, prefix cache dropped: what a fresh server holds."""
        self.load(self.model)

    def client(self):
        """TRL's client of this server, `reset` first; `server_process`, `server_command`, `server_log` and `shared`
        (this object) are set on it. Fails the test if an earlier test stopped the server."""
        import pytest
        from trl.generation.vllm_client import VLLMClient

        if not self.alive():
            pytest.fail(f"the shared vLLM server for {self.model} was stopped by an earlier test (only the restart "
                        f"test may stop it, and it runs last); its log:\n{self.log_tail()}")
        self.reset()
        client = VLLMClient(base_url=self.base_url, connection_timeout=60)
        client.server_process, client.server_command, client.server_log = (
            self.server_process, self.server_command, self.server_log)
        client.shared = self
        return client

    def alive(self) -> bool:
        return self.server_process.poll() is None

    def stop(self) -> None:
        stop_server(self.server_process, grace_s=30)
        self._log.close()

    def log_tail(self, chars=3000) -> str:
        with open(self.server_log) as f:
            return f.read()[-chars:]


__all__ = ["ENV", "VLLM_ENV", "SharedServer", "ServerStartError", "answers", "complete", "documented_server_command",
           "server_logps"]
