"""docs/evidence.md against the result files the sweeps wrote: every `mean [low, high]` on the page is one of the
results in `benchmarks/results/compare_estimators/report.json` or `studies.json` (mean, and mean -/+ the t
interval's half-width), so a number edited by hand, or left behind by a new sweep, fails here."""

import json
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results" / "compare_estimators"
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


def test_every_interval_on_the_page_is_a_result():
    results = []
    for name in ("report.json", "studies.json"):
        result_intervals(json.loads((RESULTS / name).read_text()), results)
    shown = page_intervals()
    assert len(shown) > 40  # the parser found the tables and the text
    missing = [t for t in shown if not any(all(abs(a - b) <= 0.0011 for a, b in zip(t, r)) for r in results)]
    assert not missing, f"on docs/evidence.md but in no result file: {missing}"


def test_the_check_can_fail():
    results = result_intervals({"a": [0.5, 0.1, 0.2]}, [])
    assert results == [(0.5, 0.3, 0.7)]
    assert not any(all(abs(a - b) <= 0.0011 for a, b in zip((0.5, 0.3, 0.71), r)) for r in results)
