"""`trl_rpp.engines.vllm_server`'s weights file, read back by safetensors' own loader, and what a failed write leaves; a server
that cannot be reached at construction, with one and two processes. The transport against a real vLLM server is
tests/test_vllm_engine.py (`vllm_server_weight_sync="disk"`)."""

import errno
import json
import os
import socket
import time

import pytest
import torch
from safetensors.torch import load_file

from trl_rpp import RPPConfig, RPPTrainer
from trl_rpp.engines.vllm_server import FILE, PARTIAL, ServerWeightSyncError, write_safetensors
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
