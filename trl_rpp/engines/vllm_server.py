"""Weights to a vLLM server through a shared directory: `RPPConfig.vllm_server_weight_sync="disk"`.

TRL 1.16 streams the weights to a server over NCCL (vLLM's weight-transfer engine), which needs CUDA on both sides
and an NCCL group between them. This transport needs neither. At each of TRL's syncs:

1. every process walks TRL's own parameter iterator (`VLLMGeneration._iter_named_params`: LoRA merged, ZeRO-3 and
   FSDP shards gathered, so every process takes part), and process 0 streams each tensor into one safetensors file,
   `<vllm_server_weight_dir>/weights/model.safetensors`, written under a temporary name and renamed, so that the
   server never reads a half-written file and the directory holds one set of weights;
2. process 0 asks the server, in vLLM's dev mode, to reload them (`POST /collective_rpc`, vLLM's
   `Worker.reload_weights(weights_path=...)`, which also repacks the CPU backend's kernels) and to drop its prefix
   cache (`POST /reset_prefix_cache`).

Generation stays TRL's: its client, its requests, the server's processed log-probs.

Failures. A reload from a path the server cannot read leaves vLLM 0.30's model half restored (its next generation
fails), so before each reload process 0 asks the server to "reload" a probe: a new directory `probe-<random hex>` in
`vllm_server_weight_dir` holding a safetensors file without tensors, loaded in vLLM's kernel format, which copies
nothing, and removed once the server has answered. The server answers it only if it reads `vllm_server_weight_dir`
at the same path: a new name cannot be a stale copy on the server's side.
Before anything is trained, the same `ServerWeightSyncError` then reaches every process (one broadcast per sync,
with several), and `trl_rpp.faults.engine` stops the run with `GenerationEngineError`, naming it:

- the server refuses (no dev mode: `/collective_rpc` is not served), or does not answer within
  `vllm_server_request_timeout`, or cannot be reached;
- the directory is not shared (the probe is not found);
- the disk is full, or any other `OSError` on the write: the temporary file is removed and the previous weights stay.

At construction, before TRL loads anything (`check_at_construction`), process 0 waits for the server's health up
to `vllm_server_timeout` (as TRL's client does, but saying so once when the server does not answer at once), then
makes the directory and checks the probe. The outcome is broadcast: a server that cannot be reached, one without
dev mode, or a directory it cannot read raises the same `ServerWeightSyncError` on every process (raised on process
0 alone, as TRL's own checks are, it would leave the others waiting at TRL's first collective). A server lost between
this check and TRL's client, which only process 0 builds, still fails there alone. With TRL's NCCL transport
(`vllm_server_weight_sync="nccl"`) the same wait runs, after a check that needs no server: a trainer without CUDA
cannot use NCCL (TRL's `VLLMClient.init_communicator` refuses any other device after loading the model, or first
asks to restart the server with NCCL's `--weight-transfer-config`, which cannot help), so it is refused at once,
naming the disk transport.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import re
import shutil
import struct
import time
import uuid
from urllib.parse import urlparse

import torch

from ..patches import disk_weight_sync, synced_params

logger = logging.getLogger(__name__)

WEIGHTS, FILE, PARTIAL = "weights", "model.safetensors", ".model.safetensors.partial"
_PROBE = re.compile(r"probe-[0-9a-f]{32}")
# safetensors' dtype names
_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
           torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
           torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2"}


class ServerWeightSyncError(RuntimeError):
    """The weights could not reach the vLLM server through `vllm_server_weight_dir` (see the module docstring);
    `status`: the server's HTTP status, when it answered."""

    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        self.status = status


# --- The file -------------------------------------------------------------------------------------------------


def safetensors_header(metadata) -> bytes:
    """The header of a safetensors file holding tensors ``(name, dtype, shape)`` in `metadata`'s order, back to back:
    its 8-byte little-endian length, then the JSON, padded with spaces to a multiple of 8 bytes."""
    header, offset = {}, 0
    for name, dtype, shape in metadata:
        size = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        header[name] = {"dtype": _DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw


def write_safetensors(folder: str, metadata, named_tensors) -> str:
    """Stream `named_tensors` (in `metadata`'s order, as it describes them) into `folder/model.safetensors`, one tensor
    in host memory at a time: written to a temporary name in `folder`, flushed to disk, then renamed over the previous
    file. On any failure the temporary file is removed and the previous file is left as it was."""
    partial, final = os.path.join(folder, PARTIAL), os.path.join(folder, FILE)
    try:
        with open(partial, "wb") as f:
            f.write(safetensors_header(metadata))
            for (name, dtype, shape), (got, tensor) in zip(metadata, named_tensors, strict=True):
                if got != name or tensor.dtype != dtype or list(tensor.shape) != list(shape):
                    raise RuntimeError(f"parameter {got!r} {tensor.dtype} {list(tensor.shape)} differs from the "
                                       f"first sync's {name!r} {dtype} {list(shape)}")
                f.write(tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy().data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(partial, final)
    except BaseException:
        if os.path.lexists(partial):
            os.remove(partial)
        raise
    dir_fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(dir_fd)  # the rename itself
    finally:
        os.close(dir_fd)
    return final


# --- The server -----------------------------------------------------------------------------------------------


class DiskWeightSync:
    """`vllm_generation.sync_weights` for `vllm_server_weight_sync="disk"` (see the module docstring). Made and
    checked by `check_at_construction`; `use_disk_weight_sync` gives it TRL's generation backend."""

    def __init__(self, weight_dir: str, timeout: float | None, base_url: str):
        self.timeout, self.base_url = timeout, base_url
        self.root = os.path.abspath(weight_dir)
        self.folder = os.path.join(self.root, WEIGHTS)
        self.vllm_generation = None  # TRL's VLLMGeneration, once GRPOTrainer has built it
        self.metadata = None  # (name, dtype, shape) of every tensor, from the first sync

    @property
    def accelerator(self):
        return self.vllm_generation.accelerator

    def check(self) -> None:
        """Process 0, once: make the directories, and ask the server to read a probe (`_probe`)."""
        try:
            os.makedirs(self.folder, exist_ok=True)
            for name in os.listdir(self.root):  # probes left by a run killed while the server read them
                if _PROBE.fullmatch(name):
                    shutil.rmtree(os.path.join(self.root, name), ignore_errors=True)
        except OSError as err:
            raise ServerWeightSyncError(self._os_error(err)) from err
        self._probe()

    def __call__(self) -> None:
        acc = self.accelerator
        main = acc.is_main_process
        if self.metadata is None:  # one pass for the header, as TRL's NCCL sync does for its metadata
            self.metadata = [(name, p.dtype, list(p.shape)) for name, p in synced_params(self.vllm_generation)]
        failure = None
        params = synced_params(self.vllm_generation)
        if main:
            try:
                self._probe()
                write_safetensors(self.folder, self.metadata, params)
            except ServerWeightSyncError as err:
                failure = err
            except OSError as err:
                failure = ServerWeightSyncError(self._os_error(err))
                failure.__cause__ = err
            except Exception as err:  # raised on process 0 alone, it would leave the others at the broadcast
                failure = ServerWeightSyncError(f"cannot write the weights to {self.folder!r}: {err!r}")
                failure.__cause__ = err
        for _ in params:  # the gathers (and TRL's LoRA unmerge) run to the end on every process
            pass
        if main and failure is None:
            try:
                try:
                    self._rpc({"weights_path": self.folder}, "reload the weights from")
                except ServerWeightSyncError as err:
                    note = f"{err}; its weights may be half loaded: restart it"
                    raise ServerWeightSyncError(note, err.status) from err
                if self._post("/reset_prefix_cache", None, "drop its prefix cache").json().get("success") is False:
                    raise ServerWeightSyncError(f"{self._server()} did not drop its prefix cache (requests running)")
            except ServerWeightSyncError as err:
                failure = err
        raise_on_every_process(failure, acc.num_processes)

    # process 0 only, below

    def _server(self) -> str:
        return f"the vLLM server at {self.base_url}"

    def _os_error(self, err: OSError) -> str:
        what = "the disk is full" if err.errno in (errno.ENOSPC, errno.EDQUOT) else "the write failed"
        return (f"cannot write the weights to vllm_server_weight_dir={self.root!r}: {what} ({err}); the previous "
                f"weights in {self.folder!r} are intact")

    def _probe(self) -> None:
        """Write a new probe directory, ask the server to read it, and remove it (a folder per check would pile up in
        the user's directory; a new name each time is what a stale copy on the server's side cannot match)."""
        probe = os.path.join(self.root, f"probe-{uuid.uuid4().hex}")
        try:
            try:
                os.makedirs(probe)
                write_safetensors(probe, [], [])
            except OSError as err:
                raise ServerWeightSyncError(self._os_error(err)) from err
            # kernel format: an empty file copies nothing, so a failure leaves the server's weights as they were
            self._rpc({"weights_path": probe, "is_checkpoint_format": False}, "read the probe")
        except ServerWeightSyncError as err:
            if err.status != 500:  # no answer, no dev mode, or our own write failed
                raise
            raise ServerWeightSyncError(
                f"{self._server()} cannot read {probe!r}, written by the trainer in vllm_server_weight_dir: "
                f"the directory is not shared with the server at the same path ({err})") from err
        finally:
            shutil.rmtree(probe, ignore_errors=True)

    def _rpc(self, kwargs: dict, what: str):
        return self._post("/collective_rpc", {"method": "reload_weights", "kwargs": kwargs}, f"{what} {kwargs}")

    def _post(self, path: str, body, what: str):
        import requests

        try:
            answer = requests.post(self.base_url + path, json=body, timeout=self.timeout)
        except requests.Timeout as err:
            raise ServerWeightSyncError(f"{self._server()} did not answer within vllm_server_request_timeout="
                                        f"{self.timeout} s when asked to {what}") from err
        except requests.RequestException as err:
            raise ServerWeightSyncError(f"{self._server()} cannot be reached to {what}: {err}") from err
        if answer.status_code == 404:
            raise ServerWeightSyncError(f"{self._server()} refuses {path} (404 not found): start it in dev mode, with "
                                        "VLLM_SERVER_DEV_MODE=1 in its environment", status=404)
        if answer.status_code != 200:
            raise ServerWeightSyncError(f"{self._server()} failed to {what}: HTTP {answer.status_code}, "
                                        f"{answer.text[:500]}", status=answer.status_code)
        return answer


def raise_on_every_process(failure: ServerWeightSyncError | None, num_processes: int) -> None:
    """Every process: process 0's `failure` (None elsewhere), broadcast, so that every process raises the same
    `ServerWeightSyncError` (message and status), or none does."""
    if num_processes > 1:
        from accelerate.utils import broadcast_object_list

        message = [None if failure is None else (str(failure), failure.status)]
        broadcast_object_list(message, from_process=0)
        if failure is None and message[0] is not None:
            failure = ServerWeightSyncError(*message[0])
    if failure is not None:
        raise failure


def wait_for_server(base_url: str, wait: float, interval: float = 2.0) -> None:
    """Process 0: poll the server's `/health` every `interval` seconds until it answers 200, for at most `wait`
    seconds (TRL's `VLLMClient.check_server`, which also polls every 2 s). When the first poll gets no healthy
    answer, say once that it waits, for how long, and for which server: a server that is still loading (minutes on a
    CPU) or was never started would otherwise look like a hung trainer."""
    import requests

    deadline = time.monotonic() + wait
    said = False
    while True:
        try:
            # bounded, unlike TRL's: a server that accepts the connection and never answers must not hang here
            answer = requests.get(base_url + "/health", timeout=max(deadline - time.monotonic(), 1.0))
            if answer.status_code == 200:
                return
            last = f"HTTP {answer.status_code}"
        except requests.RequestException as err:
            last = str(err)
        left = deadline - time.monotonic()
        if left <= 0:
            raise ServerWeightSyncError(
                f"the vLLM server at {base_url} cannot be reached: no healthy answer within vllm_server_timeout={wait} "
                f"s (GET /health: {last}); start it (`trl-rpp vllm-serve`, docs/vllm.md#server), or correct "
                "vllm_server_base_url, or vllm_server_host and vllm_server_port")
        if not said:
            logger.warning("trl_rpp: waiting up to %g s (vllm_server_timeout) for the vLLM server at %s to answer "
                           "GET /health; if it is not starting, start it with `trl-rpp vllm-serve` "
                           "(docs/vllm.md#server).", wait, base_url)
            said = True
        time.sleep(min(interval, left))


def nccl_needs_cuda(device) -> str:
    """The error of `vllm_server_weight_sync="nccl"` on a trainer whose device is not CUDA."""
    return (f'vllm_server_weight_sync="nccl" (the default) cannot send the weights to the vLLM server from this '
            f"trainer, which runs on {device}: vLLM's NCCL weight-transfer engine needs CUDA on both sides. Set "
            'vllm_server_weight_sync="disk" and vllm_server_weight_dir to a directory the server reads at the same '
            "path (flags: --vllm_server_weight_sync disk --vllm_server_weight_dir DIR), and start the server without "
            "--weight-transfer-config: `trl-rpp vllm-serve --model MODEL --weight_dir DIR` does, and prints these "
            "settings (docs/vllm.md#server).")


def server_url(args) -> str:
    """The server's base URL as TRL 1.16 makes it (`VLLMGeneration._init_vllm`, `VLLMClient.__init__`)."""
    if args.vllm_server_base_url is None:
        return f"http://{args.vllm_server_host}:{args.vllm_server_port}"
    parsed = urlparse(args.vllm_server_base_url)
    return f"{parsed.scheme or 'http'}://{parsed.netloc}{parsed.path}"


def engine_name(args) -> str:
    """The engine an error names, from the config: a server by the URL TRL's client is built with (`server_url`),
    else the colocated engine."""
    if args.vllm_mode == "server":
        return f"the vLLM server at {server_url(args)}"
    return "the colocated vLLM engine"


def check_at_construction(args) -> DiskWeightSync | None:
    """Every process, before `GRPOTrainer.__init__` loads anything (the process group exists: `TrainingArguments`
    made accelerate's `PartialState`), in vLLM server mode: with `vllm_server_weight_sync="nccl"` on a device that
    is not CUDA, raise `ServerWeightSyncError` naming the disk transport (`nccl_needs_cuda`); then process 0 waits for
    the server (`wait_for_server`, `vllm_server_timeout`) and, with `"disk"`, checks the probe
    (`DiskWeightSync.check`). Every process raises the same `ServerWeightSyncError` on a failure. Returns the disk
    transport for `use_disk_weight_sync`, else None."""
    if not (args.use_vllm and args.vllm_mode == "server"):
        return None
    from accelerate import PartialState

    state = PartialState()
    disk = args.vllm_server_weight_sync == "disk"
    if not disk and state.device.type != "cuda":  # the same on every process: no broadcast needed
        raise ServerWeightSyncError(nccl_needs_cuda(state.device))
    url = server_url(args)
    sync = DiskWeightSync(args.vllm_server_weight_dir, args.vllm_server_request_timeout, url) if disk else None
    failure = None
    if state.is_main_process:
        try:
            wait_for_server(url, args.vllm_server_timeout)
            if sync is not None:
                sync.check()
        except ServerWeightSyncError as err:
            failure = err
        except Exception as err:  # raised on process 0 alone, it would leave the others at the broadcast
            where = f" and vllm_server_weight_dir={sync.root!r}" if sync is not None else ""
            failure = ServerWeightSyncError(f"cannot check the vLLM server at {url}{where}: {err!r}")
            failure.__cause__ = err
    raise_on_every_process(failure, state.num_processes)
    return sync


def use_disk_weight_sync(vllm_generation, sync: DiskWeightSync | None, is_main_process: bool) -> None:
    """Make `vllm_generation.sync_weights` (TRL's `VLLMGeneration`, which GRPO built) the disk transport `sync`, made
    and checked by `check_at_construction` (None: not this transport)."""
    if sync is None:
        return
    sync.vllm_generation = vllm_generation
    if is_main_process:  # the URL TRL's client generates from (the same as `server_url`'s)
        sync.base_url = vllm_generation.vllm_client.base_url
    disk_weight_sync(vllm_generation, sync)
