"""A study's per-run results as one compact table: `runs.parquet` in its result directory, one row per run.

Each run of a sweep writes its raw logs (`summary.json`, and `metrics.jsonl` for `compare_estimators.py`); a report
keeps of each run only what its analysis reads (final scores, learning-curve points, the per-step series it
averages) and writes that here, so a clone that has the table but not the raw logs reproduces the report exactly.
Values are stored as they were read (float64; ints as ints, but as floats in a column where another run has a
float), so the report's numbers do not depend on which of the two it was computed from (tests/test_evidence_doc.py
checks every committed report). `datasets` reads the table: ``Dataset.from_parquet("<dir>/runs.parquet")``.

A row is a run's record flattened: a nested dict's keys are joined with ``::``; a list of ``[step, value]`` pairs
(a curve) becomes one list column per place, ``<name>::#0`` and ``<name>::#1``, so that steps stay ints.
"""

from __future__ import annotations

import os

TABLE = "runs.parquet"
SEP = "::"
PAIR = "#"


def _flatten(record: dict, prefix: str = "") -> dict:
    flat = {}
    for key, value in record.items():
        name = f"{prefix}{key}"
        if SEP in str(key):
            raise ValueError(f"run_table: the key {key!r} holds {SEP!r}, which separates nested keys")
        if isinstance(value, dict):
            flat.update(_flatten(value, name + SEP))
        elif isinstance(value, list) and value and all(isinstance(v, list) for v in value):
            width = {len(v) for v in value}
            if len(width) != 1:
                raise ValueError(f"run_table: {name} mixes lists of lengths {sorted(width)}")
            for place in range(width.pop()):
                flat[f"{name}{SEP}{PAIR}{place}"] = [v[place] for v in value]
        else:
            flat[name] = value
    return flat


def _unflatten(row: dict) -> dict:
    record, pairs = {}, {}
    for name, value in row.items():
        if value is None:  # a column another run has: absent from this run's record
            continue
        *parents, key = name.split(SEP)
        if key.startswith(PAIR):
            pairs.setdefault(SEP.join(parents), {})[int(key[len(PAIR):])] = value
            continue
        node = record
        for parent in parents:
            node = node.setdefault(parent, {})
        node[key] = value
    for name, places in pairs.items():
        *parents, key = name.split(SEP)
        node = record
        for parent in parents:
            node = node.setdefault(parent, {})
        node[key] = [list(point) for point in zip(*(places[i] for i in range(len(places))))]
    return record


def write(root: str, records: list[dict]) -> str:
    """`records` (one dict per run, in the order the analysis reads them) as `<root>/runs.parquet`; its path."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [_flatten(r) for r in records]
    names = dict.fromkeys(name for row in rows for name in row)  # every run's columns (from_pylist: the first's)
    table = pa.table({name: [row.get(name) for row in rows] for name in names})
    path = os.path.join(root, TABLE)
    os.makedirs(root, exist_ok=True)
    pq.write_table(table, path + ".tmp", compression="zstd", compression_level=19)
    os.replace(path + ".tmp", path)
    return path


def read(root: str) -> list[dict]:
    """The records `write` stored under `root`, in order; [] when there is no table."""
    path = os.path.join(root, TABLE)
    if not os.path.exists(path):
        return []
    import pyarrow.parquet as pq

    return [_unflatten(row) for row in pq.read_table(path).to_pylist()]


def load(root: str, raw: list[dict]) -> list[dict]:
    """The records of the runs under `root`: the table's, each replaced by the record `raw` holds for the same run
    (read from the run's own logs), and `raw`'s other runs added, in order; written back when `raw` has any, so that
    runs swept in a clone without the others' logs join the table instead of replacing it."""
    kept = read(root)
    if not raw:
        return kept
    merged = {r["run"]: r for r in kept}
    merged.update((r["run"], r) for r in raw)
    records = sorted(merged.values(), key=lambda r: r["run"].split("/"))
    write(root, records)
    return records


def raw_runs(root: str, read_run, depths=(2,)) -> list[dict]:
    """`read_run(directory)` (a record, or None for a run that has not finished) for every directory `depths` levels
    under `root` (another study's runs lie deeper, a pilot's say) holding a `summary.json`, in the order of a nested
    sorted `os.listdir`; each record gets `run`, the directory relative to `root` (with `/`)."""
    found = []
    for where, dirs, files in os.walk(root):
        dirs.sort()
        relative = os.path.relpath(where, root)
        if "summary.json" in files and relative != "." and len(relative.split(os.sep)) in depths:
            record = read_run(where)
            if record is not None:
                found.append(dict(run=os.path.relpath(where, root).replace(os.sep, "/"), **record))
    return sorted(found, key=lambda r: r["run"].split("/"))


class Runs:
    """The records of one study by their `run` directory, standing in for the directories themselves."""

    def __init__(self, records: list[dict]):
        self.records = records
        self.by_run = {r["run"]: r for r in records}

    def get(self, *parts):
        """The record of the run in directory `parts` (joined with `/`), or None."""
        return self.by_run.get("/".join(parts))

    def has(self, *parts) -> bool:
        """Whether any run lies under the directory `parts` (`os.path.isdir` of a directory holding runs)."""
        return any(r["run"].split("/")[:len(parts)] == list(parts) for r in self.records)

    def children(self, *parts) -> list[str]:
        """The sorted names of the directories right under `parts` that hold runs (`os.listdir`)."""
        depth = len(parts)
        return sorted({r["run"].split("/")[depth] for r in self.records
                       if r["run"].split("/")[:depth] == list(parts) and len(r["run"].split("/")) > depth})
