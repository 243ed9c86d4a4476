"""`trl_rpp.engines.vllm_server`'s weights file, read back by safetensors' own loader, and what a failed write leaves; a
server that cannot be reached at construction, with one and two processes, and the line that says the trainer waits
for it; the probe, removed once a server (here a stand-in that records what it was asked) has read it; TRL's NCCL
transport refused at construction on a machine without CUDA. The transport against a real vLLM server is
tests/test_vllm_engine.py (`vllm_server_weight_sync="disk"`)."""

import errno
import json
import logging
import os
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch
from safetensors.torch import load_file

from trl_rpp import RPPConfig, RPPTrainer
from trl_rpp.engines.vllm_server import FILE, PARTIAL, DiskWeightSync, ServerWeightSyncError, write_safetensors
from trl_rpp.testing.tiny import copy_first_char_reward, copy_task_dataset

TENSORS = {
    "model.embed_tokens.weight": torch.randn(5, 3),
    "model.norm.weight": torch.randn(3, dtype=torch.float64),
    "lm_head.weight": torch.randn(4, 3).bfloat16(),
    "half": torch.randn(2, 2).half(),
    "scalar": torch.tensor(7.5),
    "empty": torch.zeros(0, 4),
    "ids": torch.arange(6, dtype=torch.int64).reshape(2, 3),
    "flags": torch.tensor([True, False, True]),
    "strided": torch.randn(4, 6)[:, ::2],  # not contiguous
}


def metadata(tensors):
    return [(name, t.dtype, list(t.shape)) for name, t in tensors.items()]


def test_the_streamed_file_is_what_safetensors_reads(tmp_path):
    path = write_safetensors(str(tmp_path), metadata(TENSORS), iter(TENSORS.items()))
    assert path == str(tmp_path / FILE) and os.listdir(tmp_path) == [FILE]
    loaded = load_file(path)
    assert set(loaded) == set(TENSORS)
    for name, tensor in TENSORS.items():
        assert loaded[name].dtype == tensor.dtype and torch.equal(loaded[name], tensor), name
    assert load_file(write_safetensors(str(tmp_path), [], iter([]))) == {}  # the probe: a file without tensors


def previous_file(tmp_path):
    write_safetensors(str(tmp_path), metadata(TENSORS), iter(TENSORS.items()))
    return (tmp_path / FILE).read_bytes()


def test_a_full_disk_leaves_the_previous_file(tmp_path):
    """ENOSPC from the kernel (the temporary file is /dev/full): the error propagates, the temporary name is gone,
    the previous weights are byte for byte what they were."""
    before = previous_file(tmp_path)
    os.symlink("/dev/full", tmp_path / PARTIAL)
    changed = {name: t + 1 if t.is_floating_point() else t for name, t in TENSORS.items()}
    with pytest.raises(OSError) as err:
        write_safetensors(str(tmp_path), metadata(changed), iter(changed.items()))
    assert err.value.errno == errno.ENOSPC
    assert os.listdir(tmp_path) == [FILE] and (tmp_path / FILE).read_bytes() == before


def test_a_parameter_that_changed_shape_is_refused_and_the_previous_file_kept(tmp_path):
    before = previous_file(tmp_path)
    changed = dict(TENSORS, **{"model.norm.weight": torch.randn(4, dtype=torch.float64)})
    with pytest.raises(RuntimeError, match="'model.norm.weight'.*differs from the first sync's"):
        write_safetensors(str(tmp_path), metadata(TENSORS), iter(changed.items()))
    with pytest.raises(ValueError):  # fewer tensors than the header announced
        write_safetensors(str(tmp_path), metadata(TENSORS), iter(list(TENSORS.items())[:-1]))
    assert os.listdir(tmp_path) == [FILE] and (tmp_path / FILE).read_bytes() == before


@pytest.mark.parametrize("settings,message", [
    (dict(vllm_server_weight_sync="disk"),
     "vllm_server_weight_sync='disk' is not supported with use_vllm=False, vllm_mode='colocate'; accepted: 'nccl'."),
    (dict(use_vllm=True, vllm_server_weight_sync="disk"),
     "vllm_server_weight_sync='disk' is not supported with use_vllm=True, vllm_mode='colocate'; accepted: 'nccl'."),
    (dict(use_vllm=True, vllm_mode="server", vllm_server_weight_sync="disk"),
     "vllm_server_weight_dir=None is not supported with vllm_server_weight_sync='disk'; accepted: a directory path"),
    (dict(use_vllm=True, vllm_mode="server", vllm_server_weight_sync="disk", vllm_server_weight_dir=" "),
     "vllm_server_weight_dir=' ' is not supported with vllm_server_weight_sync='disk'"),
    (dict(use_vllm=True, vllm_mode="server", vllm_server_weight_sync="file"),
     "vllm_server_weight_sync='file' is not supported; accepted values are 'nccl', 'disk'."),
])
def test_the_transport_settings_are_checked(settings, message):
    with pytest.raises(ValueError) as err:
        RPPConfig(output_dir="/tmp/trl_rpp_server_sync", report_to="none", use_cpu=True, bf16=False, **settings)
    assert str(err.value).startswith(message), err.value


UNREACHABLE = "cannot be reached: no healthy answer within vllm_server_timeout=1.0 s (GET /health: "


def test_a_server_that_cannot_be_reached_fails_the_construction_before_any_model_is_loaded(tmp_path):
    """Nothing listens at the URL (a bound port that does not accept): after polling for vllm_server_timeout, the
    construction raises the named error, before the model (a path that does not exist) is read and before the weight
    directory is made."""
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{held.getsockname()[1]}"
        args = RPPConfig(output_dir=str(tmp_path / "out"), report_to="none", use_cpu=True, bf16=False,
                         use_vllm=True, vllm_mode="server", vllm_server_base_url=url, vllm_server_timeout=1.0,
                         vllm_server_weight_sync="disk", vllm_server_weight_dir=str(tmp_path / "weights"))
        start = time.monotonic()
        with pytest.raises(ServerWeightSyncError) as err:
            RPPTrainer(model=str(tmp_path / "no-model"), reward_funcs=copy_first_char_reward, args=args,
                       train_dataset=copy_task_dataset(8))
        took = time.monotonic() - start
    assert str(err.value).startswith(f"the vLLM server at {url} {UNREACHABLE}"), err.value
    assert "correct vllm_server_base_url, or vllm_server_host and vllm_server_port" in str(err.value), err.value
    assert 1.0 <= took < 10.0, took
    assert not (tmp_path / "weights").exists()


def test_two_processes_raise_the_same_error_when_the_server_cannot_be_reached(two_process_runs):
    """Two processes (gloo), only process 0 asks the server: both raise the same error from the construction,
    process 1 after waiting for process 0's check (vllm_server_timeout=1 s), instead of waiting at a collective."""
    ranks = [json.loads((two_process_runs / "server_unreachable" / f"rank{r}.json").read_text()) for r in range(2)]
    for r in ranks:
        assert r["processes"] == 2 and r["type"] == "ServerWeightSyncError", r
        assert r["error"].startswith("the vLLM server at http://127.0.0.1:") and UNREACHABLE in r["error"], r
        assert 1.0 <= r["seconds"] < 30.0, r
    assert ranks[0]["error"] == ranks[1]["error"]


WAITING = "trl_rpp: waiting up to {wait} s (vllm_server_timeout) for the vLLM server at {url} to answer GET /health"


def server_args(tmp_path, url, **overrides):
    return RPPConfig(**{**dict(output_dir=str(tmp_path / "out"), report_to="none", use_cpu=True, bf16=False,
                               use_vllm=True, vllm_mode="server", vllm_server_base_url=url), **overrides})


def test_the_wait_for_the_server_is_said_once_naming_the_url_and_the_limit(tmp_path, caplog):
    """Nothing listens at the URL: the trainer polls it every 2 s for vllm_server_timeout (3 s: polls at 0, 2 and
    3 s) and says so once, at the first failed poll, with the URL and the limit, then raises the named error."""
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{held.getsockname()[1]}"
        args = server_args(tmp_path, url, vllm_server_timeout=3.0, vllm_server_weight_sync="disk",
                           vllm_server_weight_dir=str(tmp_path / "weights"))
        with caplog.at_level(logging.WARNING, logger="trl_rpp"), pytest.raises(ServerWeightSyncError):
            RPPTrainer(model=str(tmp_path / "no-model"), reward_funcs=copy_first_char_reward, args=args,
                       train_dataset=copy_task_dataset(8))
    said = [r for r in caplog.records if "waiting up to" in r.getMessage()]
    assert len(said) == 1, [r.getMessage() for r in caplog.records]
    assert said[0].getMessage().startswith(WAITING.format(wait=3, url=url)), said[0].getMessage()
    assert said[0].name == "trl_rpp.engines.vllm_server" and said[0].levelno == logging.WARNING


def test_without_cuda_the_nccl_transport_is_refused_at_construction_naming_the_disk_transport(tmp_path):
    """TRL's NCCL transport (the default) on this machine without CUDA: refused before any model is loaded and
    before any wait for the server (vllm_server_timeout is 30 s, nothing listens), naming both settings of the disk
    transport. tests/test_vllm_engine.py checks the same against a real server without a weight-transfer engine."""
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        args = server_args(tmp_path, f"http://127.0.0.1:{held.getsockname()[1]}", vllm_server_timeout=30.0)
        assert args.vllm_server_weight_sync == "nccl"
        start = time.monotonic()
        with pytest.raises(ServerWeightSyncError) as err:
            RPPTrainer(model=str(tmp_path / "no-model"), reward_funcs=copy_first_char_reward, args=args,
                       train_dataset=copy_task_dataset(8))
        took = time.monotonic() - start
    message = str(err.value)
    assert message.startswith('vllm_server_weight_sync="nccl" (the default) cannot send the weights to the vLLM '
                              "server from this trainer, which runs on cpu: vLLM's NCCL weight-transfer engine needs "
                              "CUDA on both sides."), message
    assert 'Set vllm_server_weight_sync="disk" and vllm_server_weight_dir to a directory' in message, message
    assert "`trl-rpp vllm-serve --model MODEL --weight_dir DIR`" in message, message
    assert took < 5.0, took


def test_trls_nccl_transport_needs_a_cuda_device():
    """Why the construction refuses the NCCL transport without CUDA: TRL 1.16's client refuses any other device after
    loading the model, or, against a server without NCCL's weight-transfer engine, first asks to restart it with
    `--weight-transfer-config` (which cannot help a trainer without CUDA)."""
    import inspect

    from trl.generation.vllm_client import VLLMClient

    source = inspect.getsource(VLLMClient.init_communicator)
    assert 'if device.type != "cuda":' in source and "raise NotImplementedError(" in source
    assert "has no weight-transfer engine. Restart it with" in source


class StandIn(BaseHTTPRequestHandler):
    """A stand-in for vLLM's dev-mode server: healthy, and answers `/collective_rpc` with `status`, recording each
    request and what its `weights_path` held at that moment."""

    status, seen = 200, []

    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        path = body["kwargs"]["weights_path"]
        StandIn.seen.append((body, sorted(os.listdir(path)) if os.path.isdir(path) else None))
        self.send_response(StandIn.status)
        self.end_headers()
        self.wfile.write(b"{}")

    def log_message(self, *args):
        pass


@pytest.fixture
def stand_in():
    server = ThreadingHTTPServer(("127.0.0.1", 0), StandIn)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    StandIn.status, StandIn.seen = 200, []
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        thread.join()


def test_the_probe_is_removed_once_the_server_has_read_it(tmp_path, stand_in, caplog):
    """Each check writes a new probe, asks the server to read it, and removes it, whether the server read it or
    not: the weights directory keeps only `weights/` (and a probe left by a killed run goes at the first check).
    A server that answers at once is not waited for: no waiting line."""
    root = tmp_path / "w"
    (root / "probe-0123456789abcdef0123456789abcdef").mkdir(parents=True)  # left by a killed run
    args = server_args(tmp_path, stand_in, vllm_server_weight_sync="disk", vllm_server_weight_dir=str(root))
    from trl_rpp.engines.vllm_server import check_at_construction

    with caplog.at_level(logging.WARNING, logger="trl_rpp"):
        sync = check_at_construction(args)
    assert not [r for r in caplog.records if "waiting up to" in r.getMessage()]
    sync.check()
    StandIn.status = 500  # the server cannot read it (as when the directory is not shared)
    with pytest.raises(ServerWeightSyncError, match="the directory is not shared with the server at the same path"):
        sync.check()
    probes = [body["kwargs"]["weights_path"] for body, _ in StandIn.seen]
    assert len(set(probes)) == 3 and all(os.path.dirname(p) == str(root) for p in probes), probes
    assert [held for _, held in StandIn.seen] == [[FILE]] * 3  # each probe was there, whole, when the server read it
    assert all(body["kwargs"]["is_checkpoint_format"] is False for body, _ in StandIn.seen)
    assert os.listdir(root) == ["weights"]
