"""benchmarks/gpu_check.py rehearsed on CPU (`--device cpu --tiny`), so that the GPU check cannot rot before a GPU
comes: every part runs (lm_head in this process), and the report says what it must."""

import importlib.metadata as md
import json
import os
import subprocess
import sys
import time

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = dict(os.environ, HF_HUB_OFFLINE="1", WANDB_MODE="offline", TOKENIZERS_PARALLELISM="false")
ESTIMATORS = {"reinforce_plus_plus", "reinforce_plus_plus_baseline"}
REHEARSED = ["numerics", "score_centering", "sampling", "step_time"]  # every part but lm_head


@pytest.fixture(scope="module")
def rehearsal(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu_check")
    t = time.monotonic()
    # The budgets fit one H200; a shared CI CPU gets 3x their time (the parts' wall times are in the report). Part
    # lm_head runs in the test process instead (`test_lm_head_part_...`): its child would spend ~20 s on start-up.
    proc = subprocess.run([sys.executable, "benchmarks/gpu_check.py", "--device", "cpu", "--tiny", "--out", str(out),
                           "--budget_scale", "3", "--parts", ",".join(REHEARSED)], cwd=ROOT, env=ENV,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    report = json.loads((out / "report.json").read_text())
    return report, (out / "report.md").read_text(), proc.stdout, time.monotonic() - t


@pytest.mark.slow
def test_every_part_runs_and_the_environment_is_recorded(rehearsal):
    report, md_text, stdout, wall = rehearsal
    parts = report["parts"]
    assert list(parts) == ["build_model", *REHEARSED]  # --parts: those named, in that order
    assert all(p["status"] == "ok" and p["wall_s"] > 0 for p in parts.values()), parts
    assert report["ok"] is True and 0 < report["wall_s"] <= wall
    env = report["environment"]
    assert env["device"] == "cpu" and env["python"] == ".".join(map(str, sys.version_info[:3]))
    for pkg in ("torch", "transformers", "trl", "accelerate", "datasets"):
        assert env[pkg] == md.version(pkg), pkg
    assert md_text in stdout  # the markdown report is also printed
    assert "| numerics | ok |" in md_text and "| step_time | ok |" in md_text


@pytest.mark.slow
def test_numerics_cover_both_estimators_in_both_precisions(rehearsal):
    cases = rehearsal[0]["parts"]["numerics"]["result"]["cases"]
    assert {(c["estimator"], c["precision"]) for c in cases} == {(e, p) for e in ESTIMATORS for p in ("float32", "bf16")}
    assert all(c["ok"] and c["advantages_max_abs_error"] <= 1e-5 for c in cases), cases
    f32 = {c["estimator"]: c for c in cases if c["precision"] == "float32"}
    bf16 = {c["estimator"]: c for c in cases if c["precision"] == "bf16"}
    for e in ESTIMATORS:
        assert f32[e]["gradient_elementwise_within_f32_tol"] and f32[e]["gradient_max_rel_l2"] < 1e-4
        # bf16 really ran: its gradient is off by far more than float32's, and still within the stated bound.
        assert 1e-3 < bf16[e]["gradient_max_rel_l2"] <= 2.0**-3, bf16[e]
    md_rows = [line for line in rehearsal[1].splitlines() if line.startswith("| reinforce_plus_plus")]
    assert len(md_rows) == 4 and all(line.endswith("| yes |") for line in md_rows)


@pytest.mark.slow
def test_score_centering_part_reports_consistent_ratios(rehearsal):
    sc = rehearsal[0]["parts"]["score_centering"]["result"]
    assert sc["tokens"] == sc["batch"] * sc["completion_length"] and sc["top_k"] == 32 and sc["rounds"] >= 1
    for key in ("step_time_s", "step_peak_mib", "process_peak_mib"):
        assert sc[key]["off"] > 0 and sc[key]["on"] > 0, (key, sc[key])
    assert sc["time_ratio"] == pytest.approx(sc["step_time_s"]["on"] / sc["step_time_s"]["off"])
    assert sc["memory_ratio"] == pytest.approx(sc["step_peak_mib"]["on"] / sc["step_peak_mib"]["off"])
    assert sc["memory_pass"] == (sc["memory_ratio"] <= 1.10) and sc["time_pass"] == (sc["time_ratio"] <= 1.05)
    assert f"| {sc['memory_ratio']:.3f} | <= 1.1 |" in rehearsal[1]


@pytest.mark.slow
def test_sampling_part_times_the_four_arms_against_no_correction(rehearsal):
    sa = rehearsal[0]["parts"]["sampling"]["result"]
    arms = sa["arms"]
    assert list(arms) == ["none", "replay", "score_centering", "both"] and sa["top_k"] == 20 and sa["rounds"] >= 1
    for name, a in arms.items():
        assert a["step_time_s"] > 0 and a["process_peak_mib"] > 0, (name, a)
        assert a["time_ratio"] == pytest.approx(a["step_time_s"] / arms["none"]["step_time_s"])
        assert a["time_pass"] == (a["time_ratio"] <= 1.03)
        assert f"| {name} | {a['step_time_s']:.4f} | {a['time_ratio']:.3f} |" in rehearsal[1]


def check_lm_head(lm, md_text, positions):
    """Part lm_head's result: every arm of benchmarks/lm_head_memory.py at each N of `positions`, as ratios to the
    fused head, and the targets judged at the largest N of the part's sizes (n/a where it did not run)."""
    assert lm["top_k"] == 20 and lm["head_k"] == 32 and lm["batch"] == 2 and (lm["vocab"], lm["hidden"]) == (512, 16)
    assert list(lm["rows"]) == [str(n) for n in positions], lm["rows"]
    assert lm["not_run"] == [n for n in lm["positions"] if n not in positions]
    for n, row in lm["rows"].items():
        assert list(row) == ["fused", "replay", "score_centering", "both"], row
        for arm, a in row.items():
            assert a["step_time_s"] > 0 and a["step_peak_mib"] >= 0 and a["rounds"] >= 1, (n, arm, a)
            assert a["time_ratio"] == pytest.approx(a["step_time_s"] / row["fused"]["step_time_s"])
            assert a["memory_ratio"] == pytest.approx(a["step_peak_mib"] / max(row["fused"]["step_peak_mib"], 1e-9))
            assert f"| {a['step_peak_mib']:.0f} MiB ({a['memory_ratio']:.3f}), {a['step_time_s']:.4f} s" in md_text
    at = max(lm["positions"])
    want = {("replay", "memory"): 0.2, ("replay", "time"): 0.2, ("score_centering", "memory"): 1.10}
    assert {(t["arm"], t["measure"]): t["target"] for t in lm["targets"]} == want
    for t in lm["targets"]:
        ratio = lm["rows"][str(at)][t["arm"]][f"{t['measure']}_ratio"] if at in positions else None
        assert t["positions"] == at and t["ratio"] == ratio, t
        assert t["pass"] == (None if ratio is None else ratio <= t["target"]), t
        shown, verdict = ("n/a", "n/a") if ratio is None else (f"{ratio:.3f}", "yes" if t["pass"] else "no")
        assert f"| {t['arm']} {t['measure']} at N = {at} | {shown} | <= {t['target']} | {verdict} |" in md_text


def test_lm_head_part_measures_the_four_heads_and_stops_at_its_deadline():
    """Part lm_head called in this process on CPU (bf16, the arms of benchmarks/lm_head_memory.py at V = 512): with
    time to spare it measures both sizes, and its report survives JSON; with its deadline already past, N = 64 runs
    one round, N = 128 is named as not run, and the targets are n/a."""
    import gc

    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import gpu_check

    opts = gpu_check.argparse.Namespace(device="cpu", tiny=True)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as gpu_check's CPU children run: more threads only contend at this size
    gc.freeze()  # the CPU memory probe collects garbage before every step: skip this process's long-lived heap
    try:
        full = json.loads(json.dumps(gpu_check.part_lm_head(opts, time.monotonic() + 120)))
        late = gpu_check.part_lm_head(opts, time.monotonic())
    finally:
        gc.unfreeze()
        torch.set_num_threads(threads)
    for lm, positions in ((full, [64, 128]), (late, [64])):
        report = {"tiny": True, "wall_s": 1.0, "environment": gpu_check.environment("cpu"),
                  "parts": {"lm_head": {"status": "ok", "wall_s": 1.0, "budget_s": 60, "result": lm}}}
        md_text = gpu_check.markdown(report)
        check_lm_head(lm, md_text, positions)
        assert ("Not run (part budget spent): N = 128." in md_text) == (positions == [64]), md_text
    assert all(a["rounds"] == 2 for row in full["rows"].values() for a in row.values()), full["rows"]
    assert all(a["rounds"] == 1 for a in late["rows"]["64"].values()), late["rows"]


def test_parts_option_selects_parts_and_rejects_unknown_or_repeated_names(capsys):
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import gpu_check

    assert gpu_check.parse_args([]).parts == ["numerics", "score_centering", "sampling", "lm_head", "step_time"]
    assert gpu_check.parse_args(["--parts", "lm_head,numerics"]).parts == ["lm_head", "numerics"]
    for bad in ("lm_head,heads", "lm_head,lm_head", ""):
        with pytest.raises(SystemExit) as exit_:
            gpu_check.parse_args(["--parts", bad])
        assert exit_.value.code == 2
        err = capsys.readouterr().err
        assert f"--parts {bad!r}: accepted: one or more of numerics, score_centering, sampling, lm_head, step_time" in err


@pytest.mark.slow
def test_step_time_part_times_every_arm_at_fixed_length(rehearsal):
    st = rehearsal[0]["parts"]["step_time"]["result"]
    arms = st["arms"]
    assert set(arms) == {"grpo_beta0.04", "rpp_reinforce_plus_plus", "rpp_baseline"}
    assert st["timed_steps_per_arm"] >= 1 and arms["grpo_beta0.04"]["ratio_vs_grpo"] == 1.0
    for name, a in arms.items():
        assert a["median_step_s"] > 0
        assert a["ratio_vs_grpo"] == pytest.approx(a["median_step_s"] / arms["grpo_beta0.04"]["median_step_s"])
        # min_new_tokens = max_completion_length: every completion has the full length, in every arm.
        assert a["min_completion_length"] == a["mean_completion_length"] == st["completion_length"], (name, a)
        assert f"| {name} | {a['median_step_s']:.4f} |" in rehearsal[1]


def test_a_part_over_its_budget_is_killed_and_reported(tmp_path):
    """The budget holds: a child still running at its budget is killed and recorded, and the report says so."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import gpu_check

    opts = gpu_check.argparse.Namespace(device="cpu", tiny=True)
    t = time.monotonic()
    status, result, wall, _ = gpu_check.run_part("numerics", opts, str(tmp_path / "none"), str(tmp_path), 0.5)
    assert status == "timed_out" and result is None and 0.5 <= wall < 30 and time.monotonic() - t < 30
    report = {"tiny": True, "wall_s": wall, "environment": gpu_check.environment("cpu"),
              "parts": {"numerics": {"status": status, "wall_s": wall, "budget_s": 0.5, "result": None, "log": ""},
                        "score_centering": {"status": "ok", "wall_s": 1.0, "result": None},
                        "sampling": {"status": "ok", "wall_s": 1.0, "result": None},
                        "lm_head": {"status": "ok", "wall_s": 1.0, "result": None},
                        "step_time": {"status": "ok", "wall_s": 1.0, "result": None}}}
    md_text = gpu_check.markdown(report)
    assert "| numerics | timed_out |" in md_text and "## numerics: timed_out" in md_text
