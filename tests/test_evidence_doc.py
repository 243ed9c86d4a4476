"""docs/evidence.md against the result files the sweeps wrote: every `mean [low, high]` on the page is one of the
results in `benchmarks/results/compare_estimators/report.json` or `studies.json` (mean, and mean -/+ the interval's
half-width), or in study 4's `benchmarks/results/mismatch_study/report.json` or study 5's
`benchmarks/results/truncation_study/report.json` (a t interval over an arm's seeds, or a contrast's Welch interval),
so a number edited by hand, or left behind by a new sweep, fails here. And each of those reports regenerates from its
study's `runs.parquet` alone, the raw per-run logs not being in the repository."""

import json
import math
import re
import shutil
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results" / "compare_estimators"
STUDY4 = REPO / "benchmarks" / "results" / "mismatch_study" / "report.json"
STUDY5 = REPO / "benchmarks" / "results" / "truncation_study" / "report.json"  # one condition, study 4's layout
sys.path.insert(0, str(REPO / "benchmarks" / "studies"))

import mismatch_study  # noqa: E402
NUMBER = r"[−+-]?\d+\.\d+"


def page_intervals():
    text = (REPO / "docs" / "evidence.md").read_text().replace("−", "-")
    found = re.findall(rf"({NUMBER}) \[({NUMBER}), ({NUMBER})\]", text)
    return [tuple(float(x) for x in triple) for triple in found]


def result_intervals(node, out):
    """Every [mean, std, half-width] triple in the JSON, as (mean, mean - half-width, mean + half-width)."""
    if isinstance(node, dict):
        for value in node.values():
            result_intervals(value, out)
    elif isinstance(node, list):
        if len(node) == 3 and all(isinstance(x, (int, float)) for x in node):
            mean, _, half = node
            out.append((mean, mean - half, mean + half))
        else:
            for value in node:
                result_intervals(value, out)
    return out


def study4_intervals(report, out):
    """Study 4's report: each arm's metric values as (mean, t interval), each contrast as (diff, low, high)."""
    for condition in report.values():
        for row in condition.get("arms", {}).values():
            for key, _ in mismatch_study.METRICS:
                values = row[key]
                n, mean = len(values), sum(values) / len(values)
                if n > 1:
                    half = mismatch_study.t_quantile(0.975, n - 1) * math.sqrt(
                        sum((v - mean) ** 2 for v in values) / (n - 1) / n)
                    out.append((mean, mean - half, mean + half))
        for contrast in condition.get("contrasts", {}).values():
            out.extend((c["diff"], c["low"], c["high"]) for c in contrast.values() if c)
    return out


def test_every_interval_on_the_page_is_a_result():
    results = []
    for name in ("report.json", "studies.json"):
        result_intervals(json.loads((RESULTS / name).read_text()), results)
    if STUDY4.exists():
        study4_intervals(json.loads(STUDY4.read_text()), results)
    if STUDY5.exists():
        study4_intervals({"top_k6": json.loads(STUDY5.read_text())}, results)
    shown = page_intervals()
    assert len(shown) > 40  # the parser found the tables and the text
    missing = [t for t in shown if not any(all(abs(a - b) <= 0.0011 for a, b in zip(t, r)) for r in results)]
    assert not missing, f"on docs/evidence.md but in no result file: {missing}"


def test_the_check_can_fail():
    results = result_intervals({"a": [0.5, 0.1, 0.2]}, [])
    assert results == [(0.5, 0.3, 0.7)]
    assert not any(all(abs(a - b) <= 0.0011 for a, b in zip((0.5, 0.3, 0.71), r)) for r in results)
    study4 = {"stale8": {"arms": {"sc32": {k: [0.1, 0.3] for k, _ in mismatch_study.METRICS}},
                         "contrasts": {"x": {"copy_prob_area": {"diff": 0.2, "low": 0.1, "high": 0.3}}}}}
    found = study4_intervals(study4, [])
    half = 12.706 * 0.1  # t(0.975, 1) x the standard error of [0.1, 0.3]
    assert any(all(abs(a - b) < 1e-3 for a, b in zip((0.2, 0.2 - half, 0.2 + half), r)) for r in found)
    assert (0.2, 0.1, 0.3) in found


# Each study's documented report command (docs/evidence.md), run where only the study's runs table is: the raw per-run
# logs are not in the repository. Figures are not drawn here (their drawing is tested on real runs in
# tests/test_demo_and_benchmarks.py and tests/test_mismatch_study.py).
REPORTS = [
    ("compare_estimators", ["--seeds", "0,1,2,3,4,5,6,7,8,9", "--no_figures"],
     ("report.json", "report.md", "studies.json", "studies.md")),
    ("mismatch_study", ["--no_figures"], ("report.json", "report.md")),
    ("truncation_study", [], ("report.json", "report.md")),
    ("truncation_study/pilot", [], ("report.json", "report.md")),
    ("off_policy_study", [], ("report.json", "report.md")),
    ("off_policy_study/pilot", [], ("report.json", "report.md")),
]


def same_numbers(a, b, path="", rel=1e-15):
    """`a` and `b` (parsed JSON) hold the same keys, strings and numbers, numbers to `rel`; the first difference."""
    if isinstance(a, dict) and isinstance(b, dict):
        if set(a) != set(b):
            return f"{path}: keys {sorted(set(a) ^ set(b))}"
        return next((d for k in a if (d := same_numbers(a[k], b[k], f"{path}/{k}", rel))), None)
    if isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            return f"{path}: {len(a)} != {len(b)} items"
        return next((d for i, (x, y) in enumerate(zip(a, b)) if (d := same_numbers(x, y, f"{path}/{i}", rel))), None)
    numbers = all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in (a, b))
    if numbers and abs(a - b) <= rel * max(abs(a), abs(b)):
        return None
    return None if a == b else f"{path}: {a!r} != {b!r}"


def test_every_report_reproduces_from_its_runs_table(tmp_path, monkeypatch, capsys):
    """Each study's report, regenerated from its committed `runs.parquet` alone, is the committed one: Markdown byte
    for byte, JSON to the last bit (studies.json: to 1e-15, as six standard errors of the committed file differ from
    any regeneration, raw logs included, in their last bit)."""
    from datasets import Dataset

    import compare_estimators
    import off_policy_study
    import truncation_study

    scripts = {"compare_estimators": compare_estimators, "mismatch_study": mismatch_study,
               "truncation_study": truncation_study, "off_policy_study": off_policy_study}
    for study, flags, files in REPORTS:
        committed = REPO / "benchmarks" / "results" / study
        out = tmp_path / study
        out.mkdir(parents=True)
        shutil.copy(committed / "runs.parquet", out)
        script = scripts[study.split("/")[0]]
        monkeypatch.setattr(sys, "argv", [script.__file__, "--report", "--out", str(out), *flags])
        script.main()
        for name in files:
            got, want = (out / name).read_text(), (committed / name).read_text()
            if name == "studies.json":
                difference = same_numbers(json.loads(got), json.loads(want))
                assert difference is None, f"{study}/{name}: {difference}"
            else:
                assert got == want, f"{study}/{name} differs when regenerated from runs.parquet"
    capsys.readouterr()  # the reports' own printout
    runs = Dataset.from_parquet(str(REPO / "benchmarks" / "results" / "mismatch_study" / "runs.parquet"),
                                cache_dir=str(tmp_path / "cache"))
    assert runs.num_rows == 715 and "sampler_copy_prob_area" in runs.column_names


def test_runs_table_round_trip(tmp_path):
    """`run_table` gives back each run's record as written: nested dicts, curves with int steps, None inside a
    series, ints as ints (as floats where another run has a float there); a column only another run has is absent,
    not None. The runs' own logs replace their rows and add new ones; the others stay."""
    import run_table

    a = dict(run="x/seed0", seed=0, score=0.25, first={"w": 1.0, "m": None},
             curves={"p": [[0, 0.5], [10, 0.75]]}, series={"reward": [0.5, None, 1.0]}, empty=[])
    b = dict(run="x/seed1", seed=1, score=1, only_here="yes")
    run_table.write(str(tmp_path), [a, b])
    got = run_table.read(str(tmp_path))
    assert got[0] == {k: v for k, v in a.items() if k != "first"} | {"first": {"w": 1.0}}  # None: absent
    assert got[1] == b and type(got[1]["seed"]) is int and type(got[0]["curves"]["p"][1][0]) is int
    assert type(got[1]["score"]) is float  # 1 beside run a's 0.25: one float64 column
    merged = run_table.load(str(tmp_path), [dict(b, score=2), dict(run="x/seed10", seed=10, score=3)])
    assert [r["run"] for r in merged] == ["x/seed0", "x/seed1", "x/seed10"] and merged[1]["score"] == 2
    assert run_table.read(str(tmp_path)) == merged
