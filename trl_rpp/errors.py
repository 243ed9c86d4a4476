"""The one message of every rejected setting, wherever the rule lives (`trl_rpp.config`, `trl_rpp.distributed`,
`trl_rpp.faults.preemption`, `trl_rpp.records.settings`, `trl_rpp.engines.vllm_colocate`): the field and its value,
the setting it conflicts with, what is accepted, and why. Light on purpose: it imports nothing, so any module can
use it."""

from __future__ import annotations

import difflib


def _suggest(value, choices) -> str:
    close = difflib.get_close_matches(str(value), choices, n=1, cutoff=0.5)
    return f" Did you mean {close[0]!r}?" if close else ""


def unsupported(name: str, value, accepted, why: str = "", under: str = "", by: str = "") -> ValueError:
    """`ValueError("<name>=<value!r> is not supported[ with <under>| by <by>]; accepted: <accepted>. <why>")`.
    `accepted` as a tuple of choices reads "accepted values are 'a', 'b'", with a suggestion for a near miss."""
    if isinstance(accepted, tuple):
        accepted, why = f" values are {', '.join(map(repr, accepted))}", _suggest(value, accepted).strip()
    else:
        accepted = f": {accepted}"
    context = f" with {under}" if under else f" by {by}" if by else ""
    return ValueError(f"{name}={value!r} is not supported{context}; accepted{accepted}." + (f" {why}" if why else ""))
