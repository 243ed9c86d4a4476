"""`trl-rpp --help` without importing torch, transformers or TRL.

The help lists every `RPPConfig`/`GRPOConfig`/`TrainingArguments` and `ModelConfig` field, so building it imports
TRL and transformers (7 s on an idle 2-core machine, 30 s on a busy one). Each field's help depends only on the
installed TRL and transformers and on this package, so `cli_help.json` keeps the parser's options, as TRL's parser
builds them, for the versions it was written with. A bare `--help` (or `-h`) with exactly those versions installed
rebuilds the parser from that file (`cached_parser`), and argparse formats it as it would the live one; with any
other versions, or any other arguments, the live parser answers. `tests/test_cli.py` checks that both print the same
text, so an edit to a field's help that is not written here fails there.

    make cli-help      # after changing a flag or its help, or for other TRL/transformers versions

`trl_rpp.cli` imports this module (lazily, for a bare `--help`); this module never imports it: `write` takes the
live parser it captures.
"""

from __future__ import annotations

import argparse
import json
from importlib import metadata
from pathlib import Path

CACHE = Path(__file__).with_name("cli_help.json")
# What the options depend on: TRL and transformers declare the fields, this package adds and rewrites some.
PACKAGES = ("trl_rpp", "trl", "transformers")


def installed_versions() -> dict[str, str | None]:
    """{package: installed version or None}, read from the installed metadata (nothing is imported)."""
    versions = {}
    for name in PACKAGES:
        try:
            versions[name] = metadata.version(name.replace("_", "-"))
        except metadata.PackageNotFoundError:
            versions[name] = None
    return versions


def capture(parser: argparse.ArgumentParser) -> dict:
    """The parts of `parser` its `--help` is made of, as JSON-able data: each option's flags, `nargs`, metavar,
    choices and whether it is required, and its help as the parser's formatter expands it (defaults included)."""
    if parser._mutually_exclusive_groups or any(not a.option_strings for a in parser._actions):
        raise ValueError("cli_help.capture: positional arguments and mutually exclusive groups are not captured")
    formatter = parser._get_formatter()
    groups = []
    for group in parser._action_groups:
        actions = []
        for action in group._group_actions:
            if isinstance(action, argparse._HelpAction):
                continue  # the rebuilt parser adds its own -h/--help
            shown = action.help and action.help is not argparse.SUPPRESS
            actions.append({
                "option_strings": list(action.option_strings),
                "dest": action.dest,
                "nargs": action.nargs,
                "metavar": action.metavar,
                "choices": None if action.choices is None else [str(c) for c in action.choices],
                "required": action.required,
                "help": formatter._expand_help(action) if shown else action.help,
            })
        groups.append({"title": group.title, "description": group.description, "actions": actions})
    return {"description": parser.description, "epilog": parser.epilog, "usage": parser.usage, "groups": groups}


class _ExpandedHelpFormatter(argparse.HelpFormatter):
    """Prints each option's help as captured: `capture` already expanded it (defaults and `%` escapes)."""

    def _expand_help(self, action):
        return action.help


def rebuild(spec: dict, prog: str | None = None) -> argparse.ArgumentParser:
    """A parser whose `format_help()` is the captured parser's (it is for printing help, not for parsing)."""
    parser = argparse.ArgumentParser(prog=prog, usage=spec["usage"], description=spec["description"],
                                     epilog=spec["epilog"], formatter_class=_ExpandedHelpFormatter)
    defaults = {"positional arguments": parser._positionals, "options": parser._optionals}
    for group in spec["groups"]:
        target = defaults.get(group["title"]) or parser.add_argument_group(group["title"], group["description"])
        for a in group["actions"]:
            metavar = tuple(a["metavar"]) if isinstance(a["metavar"], list) else a["metavar"]
            help_text = argparse.SUPPRESS if a["help"] == argparse.SUPPRESS else a["help"]
            if a["nargs"] == 0:  # a flag without a value (store_true/store_false): only its option strings show
                target.add_argument(*a["option_strings"], dest=a["dest"], action="store_true", required=a["required"],
                                    help=help_text)
            else:
                target.add_argument(*a["option_strings"], dest=a["dest"], nargs=a["nargs"], metavar=metavar,
                                    choices=a["choices"], required=a["required"], help=help_text)
    return parser


def cached_parser(prog: str | None = None) -> argparse.ArgumentParser | None:
    """The help parser written for the installed versions, or None (no entry for them: build the live parser)."""
    try:
        entries = json.loads(CACHE.read_text())
    except (OSError, ValueError):
        return None
    versions = installed_versions()
    for entry in entries:
        if entry["versions"] == versions:
            return rebuild(entry["spec"], prog)
    return None


def write(parser: argparse.ArgumentParser, path: Path = CACHE) -> dict:
    """Capture `parser` (the live `trl-rpp` parser, `trl_rpp.cli.make_parser()`) for the installed versions into
    `path`, replacing their earlier entry and keeping the others."""
    versions = installed_versions()
    try:
        entries = [e for e in json.loads(path.read_text()) if e["versions"] != versions]
    except (OSError, ValueError):
        entries = []
    entry = {"versions": versions, "spec": capture(parser)}
    entries.append(entry)
    entries.sort(key=lambda e: [e["versions"][p] or "" for p in PACKAGES])
    path.write_text(json.dumps(entries, indent=1, ensure_ascii=False) + "\n")
    return entry

