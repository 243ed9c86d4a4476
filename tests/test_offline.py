"""Safe defaults: no remote code, no unrestricted pickle in the library, and runs that work with the network
really unplugged (a fresh network namespace with no interface but loopback)."""

import os
import pathlib
import re
import subprocess
import sys

import pytest

from trl_rpp import RPPConfig

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _can_unplug():
    try:
        return subprocess.run(["unshare", "-n", "true"], capture_output=True).returncode == 0
    except FileNotFoundError:
        return False


def test_no_remote_code_by_default():
    assert RPPConfig(output_dir="/tmp/x", use_cpu=True, bf16=False, report_to="none").trust_remote_code is False


def test_library_never_unpickles():
    for path in (ROOT / "trl_rpp").glob("*.py"):
        src = path.read_text()
        assert not re.search(r"^\s*(import|from) pickle|pickle\.loads?\(|trust_remote_code\s*=\s*True", src, re.M), path.name
        for call in re.findall(r"torch\.load\([^)]*\)", src):
            assert "weights_only=True" in call, (path.name, call)


@pytest.mark.slow
@pytest.mark.skipif(not _can_unplug(), reason="needs `unshare -n` (root or user namespaces) to unplug the network")
def test_demo_and_trainer_tests_pass_with_the_network_unplugged(tmp_path):
    env = dict(os.environ, HF_HUB_OFFLINE="1", WANDB_MODE="offline", TOKENIZERS_PARALLELISM="false")
    demo = subprocess.run(
        ["unshare", "-n", sys.executable, "examples/demo.py", "--tiny", "--output_dir", str(tmp_path / "demo"),
         "--threads", "1", "--max_steps", "20"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )
    assert demo.returncode == 0, demo.stderr[-3000:]
    tests = subprocess.run(
        ["unshare", "-n", sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-m", "not slow",
         "tests/test_trainer.py", "tests/test_score_centering_trainer.py"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=900,
    )
    assert tests.returncode == 0, tests.stdout[-3000:]
    assert "[100%]" in tests.stdout and "F" not in tests.stdout.splitlines()[0]
