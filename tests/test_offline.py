"""Safe defaults: no remote code and no unrestricted pickle in the library. That every run works offline is checked by
the whole suite, which runs behind the network guard of tests/netguard (tests/test_harness.py tests the guard)."""

import pathlib
import re

from trl_rpp import RPPConfig

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_no_remote_code_by_default():
    assert RPPConfig(output_dir="/tmp/x", use_cpu=True, bf16=False, report_to="none").trust_remote_code is False


def test_library_never_unpickles():
    for path in (ROOT / "trl_rpp").glob("*.py"):
        src = path.read_text()
        # pickle may be imported for its exception class (checkpoint.py); nothing may unpickle with it
        unpickles = r"pickle\.(loads?|Unpickler)\b|^\s*from pickle import .*\b(loads?|Unpickler)\b"
        assert not re.search(unpickles + r"|trust_remote_code\s*=\s*True", src, re.M), path.name
        for call in re.findall(r"torch\.load\([^)]*\)", src):
            assert "weights_only=True" in call, (path.name, call)
