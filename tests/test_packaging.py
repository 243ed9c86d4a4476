"""The built package carries `py.typed` (PEP 561), so type checkers read trl_rpp's annotations once installed."""

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_py_typed_is_built_into_the_package(tmp_path):
    assert (REPO / "trl_rpp" / "py.typed").is_file()
    proc = subprocess.run([sys.executable, "setup.py", "-q", "build_py", "--build-lib", str(tmp_path)], cwd=REPO,
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert (tmp_path / "trl_rpp" / "py.typed").is_file()
    assert (tmp_path / "trl_rpp" / "core.py").is_file()  # the build did copy the package
