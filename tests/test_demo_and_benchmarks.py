"""Every runnable script is run: the demo (--tiny) and the benchmarks (at toy sizes, so they cannot rot)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = dict(os.environ, HF_HUB_OFFLINE="1", WANDB_MODE="offline", TOKENIZERS_PARALLELISM="false")


def run(args, timeout=300, env=None):
    proc = subprocess.run([sys.executable, *args], cwd=ROOT, env=dict(ENV, **(env or {})), capture_output=True,
                          text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


@pytest.mark.slow
def test_demo_tiny_learns_and_leaves_every_artifact(tmp_path):
    out = tmp_path / "demo"
    stdout = run(["examples/demo.py", "--tiny", "--output_dir", str(out), "--threads", "1"])
    assert "held-out greedy accuracy before training" in stdout and "after training" in stdout
    summary = json.loads((out / "summary.json").read_text())
    assert summary["heldout_before"] < 0.2 and summary["heldout_after"] > 0.8, summary
    card = (out / "README.md").read_text()
    # The card names the real base model (a local folder: no link, no None) and the settings that trained it.
    body = card.split("## Citations")[0]
    assert "None" not in body and "huggingface.co/None" not in card and "huggingface.co/datasets/" not in card
    assert "fine-tuned version of the local checkpoint `tiny-base-model`" in card and str(tmp_path) not in card
    assert "on the generated copy task (trl_rpp.testing.tiny)." in card and "trained with REINFORCE++-baseline" in card
    assert "| `advantage_estimator` | `reinforce_plus_plus_baseline`" in card and "| `kl_loss_type` | `k2` |" in card
    assert "Stabilizing Critic-Free Policy Optimization with Global Advantage Normalization" in card
    assert 'model="demo"' in card  # the output folder by name: the card names no machine path
    assert (out / "model.safetensors").exists() and (out / "learning_curve.png").stat().st_size > 10_000
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert any("advantages/std" in r for r in rows) and any("kl_loss" in r for r in rows)
    assert any(d.startswith("offline-run-") for d in os.listdir(out / "wandb"))


@pytest.mark.slow
def test_demo_on_smollm2_writes_a_card_naming_the_hub_model(tmp_path):
    """`make demo`'s own path (the GGUF-converted SmolLM2, LoRA), cut to one step: the card names the Hub model the
    GGUF file came from, the adapter and the dataset, with no None and no broken link."""
    out = tmp_path / "demo"
    stdout = run(["examples/demo.py", "--max_steps", "1", "--output_dir", str(out), "--threads", "2"], timeout=1200)
    assert "held-out greedy accuracy after training" in stdout
    card = (out / "README.md").read_text()
    body = card.split("## Citations")[0]
    assert "None" not in body and "huggingface.co/datasets/" not in card
    assert ("fine-tuned version of [HuggingFaceTB/SmolLM2-135M-Instruct](https://huggingface.co/HuggingFaceTB/"
            "SmolLM2-135M-Instruct) (converted to float32 from the GGUF file `SmolLM2-135M-Instruct") in card
    assert "base_model: HuggingFaceTB/SmolLM2-135M-Instruct" in card and "library_name: peft" in card
    assert "on generated arithmetic prompts (examples/demo.py) as a LoRA adapter." in card
    assert str(Path.home()) not in card and "/.cache" not in card and str(tmp_path) not in card  # no machine path
    assert (out / "adapter_config.json").is_file()


def _demo_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("demo", os.path.join(ROOT, "examples", "demo.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(
    "cores, load, threads",
    [(2, 0.05, 2), (2, 0.4, 2), (2, 1.02, 1), (2, 0.6, 1), (2, 2.5, 1), (2, 7.0, 1), (8, 2.9, 5), (8, 0.0, 8),
     (1, 0.0, 1), (4, -1.0, 4)],
)
def test_demo_threads_are_the_free_cores(cores, load, threads):
    assert _demo_module().default_threads(cores, load) == threads


def test_demo_busy_cores_reads_per_cpu_idle_time():
    """/proc/stat counts: cpu0 fully busy, cpu1 idle, cpu2 half busy (iowait counts as idle) between the readings;
    the aggregate `cpu` line and cores outside the affinity mask are not counted."""
    before = "cpu  9 9 9 9 9\ncpu0 10 0 5 100 0 0\ncpu1 10 0 0 100 0 0\ncpu2 0 0 0 0 0 0\nintr 5\n"
    after = "cpu  0 0 0 0 0\ncpu0 90 0 25 100 0 0\ncpu1 10 0 0 200 0 0\ncpu2 30 10 10 30 20 0\nintr 9\n"
    busy = _demo_module().busy_cores
    assert busy(before, after, [0, 1, 2]) == pytest.approx(1.5)
    assert busy(before, after, [1]) == 0.0 and busy(before, after, [0, 7]) == 1.0
    assert _demo_module().default_threads(2, busy(before, after, [0, 1])) == 1


def test_core_benchmark_runs_small():
    stdout = run(["benchmarks/core.py", "--B", "8", "--T", "64", "--repeats", "1"])
    assert "global_masked_normalize" in stdout


@pytest.mark.slow
def test_step_time_benchmark_runs_small():
    stdout = run(["benchmarks/step_time.py", "--rounds", "1", "--steps", "2", "--batch", "8", "--hidden", "32"])
    assert "| rpp_baseline |" in stdout and "| grpo_beta0.04 |" in stdout


@pytest.mark.slow
def test_demo_step_time_benchmark_runs_small(tmp_path):
    """The demo's step breakdown, on the demo's --tiny set-up: every part is timed and they add up to the step."""
    out = tmp_path / "r.json"
    run(["benchmarks/demo_step_time.py", "--tiny", "--rounds", "1", "--steps", "2", "--threads", "1", "--json", str(out)])
    result = json.loads(out.read_text())
    assert set(result["arms"]) == {"gradient_checkpointing=True (TRL default)", "gradient_checkpointing=False"}
    for parts in result["arms"].values():
        assert all(parts[k] >= 0 for k in parts), parts
        total = sum(v for k, v in parts.items() if k != "step")
        assert abs(total - parts["step"]) < 1e-6 * max(parts["step"], 1.0), parts
    assert result["eval_base_s"] > 0 and result["eval_trained_s"] > 0


@pytest.mark.slow
def test_compare_estimators_sweep_runs_and_resumes(tmp_path):
    args = ["benchmarks/compare_estimators.py", "--tiny", "--seeds", "0", "--steps", "2", "--heldout", "16",
            "--threads", "1", "--out", str(tmp_path)]
    run(args, timeout=600)
    for arm in ("rpp", "rpp_baseline", "grpo", "grpo_noscale"):
        summary = json.loads((tmp_path / arm / "seed0" / "summary.json").read_text())
        assert len(summary["step_seconds"]) == 2 and 0.0 <= summary["heldout_after"] <= 1.0
        assert (tmp_path / arm / "seed0" / "metrics.jsonl").read_text().count("\n") >= 2
    report = json.loads((tmp_path / "report.json").read_text())
    assert set(report["arms"]) == {"rpp", "rpp_baseline", "grpo", "grpo_noscale"}
    assert (tmp_path / "curves.png").stat().st_size > 10_000
    again = run(args, timeout=600)  # a second start resumes: every finished run is skipped
    assert again.count("done earlier, skipped") == 4


def test_score_centering_benchmarks_run_small(tmp_path):
    out = run(["benchmarks/score_centering_drift.py", "--steps", "3", "--out", str(tmp_path)])
    assert "score_centered" in out and (tmp_path / "score_centering_drift.png").stat().st_size > 10_000
    drift = json.loads((tmp_path / "score_centering_drift.json").read_text())
    assert len(drift["history"]["uncorrected"]) == 4
    out = run(["benchmarks/score_centering_fidelity.py", "--tiny", "--prompts", "2", "--ks", "1,4",
               "--max_new_tokens", "8", "--threads", "1", "--out", str(tmp_path)])
    assert "relative error" in out and (tmp_path / "score_centering_fidelity_tiny.png").stat().st_size > 10_000



def test_parse_vllm_topk_benchmark_runs_small():
    out = run(["benchmarks/parse_vllm_topk.py", "--B", "0,3", "--T", "0,4,8", "--k", "3", "--repeats", "1"])
    rows = [line for line in out.splitlines() if line.startswith("| ") and line.split("|")[1].strip().isdigit()]
    assert len(rows) == 6 and all(row.endswith("| yes |") for row in rows), out  # the loops agree with the new one
    assert "time ~ positions^" in out and "over 2 sizes (12 to 24 positions)" in out, out


def test_score_centering_memory_benchmark_runs_small():
    out = run(["benchmarks/score_centering_memory.py", "--vocab", "512", "--hidden", "16", "--batch", "2",
               "--completion_length", "8", "--top_k", "4"])
    rows = [line for line in out.splitlines() if line.startswith(("| off |", "| on |"))]
    assert len(rows) == 2, out
    ratio = float(out.split("ratio on/off (process peak RSS):")[1].split()[0])
    assert 0.5 < ratio < 2.0, out  # at this size both peaks are the Python and torch runtime

@pytest.mark.slow
def test_compare_estimators_mismatch_arms_run_and_correct_as_documented(tmp_path):
    args = ["benchmarks/compare_estimators.py", "--tiny", "--seeds", "0", "--steps", "2", "--heldout", "16",
            "--threads", "1", "--out", str(tmp_path), "--arms", "mismatch_none,mismatch_tis,mismatch_sc"]
    run(args, timeout=600)
    rows = {
        arm: [json.loads(line) for line in (tmp_path / arm / "seed0" / "metrics.jsonl").read_text().splitlines()]
        for arm in ("mismatch_none", "mismatch_tis", "mismatch_sc")
    }
    first = {arm: r[0] for arm, r in rows.items()}
    # Same seed, same fixed bias: the first generation batch is identical across arms, and the bias is really there
    # (no bias gives |log p - log q| ~ 1e-6, the kv-cache rounding).
    gaps = {arm: f["mismatch/abs_log_ratio_mean"] for arm, f in first.items()}
    assert min(gaps.values()) > 0.05 and max(gaps.values()) - min(gaps.values()) < 1e-5
    # Score centering's own metric measures the same gap from its capture.
    assert abs(first["mismatch_sc"]["score_centering/sampler_logp_abs_diff"] - gaps["mismatch_sc"]) < 1e-5
    assert "mismatch/is_masked_fraction" in first["mismatch_tis"] and "mismatch/is_masked_fraction" not in first["mismatch_none"]
    report = json.loads((tmp_path / "report.json").read_text())
    assert set(report["mismatch"]["arms"]) == {"mismatch_none", "mismatch_tis", "mismatch_sc"}
    assert (tmp_path / "mismatch_curves.png").stat().st_size > 10_000


@pytest.mark.slow
def test_vllm_benchmarks_run_small(tmp_path):
    """The real-engine benchmarks at toy sizes on the tiny model (head size 64, as vLLM's CPU attention needs)."""
    from trl_rpp.testing.tiny import build_tiny_model

    model = build_tiny_model(tmp_path / "model", hidden_size=128, num_heads=2)
    env = dict(VLLM_CPU_KVCACHE_SPACE="1", VLLM_NO_USAGE_STATS="1")
    out = run(["benchmarks/vllm_generation.py", "--model", model, "--k", "8", "--prompts", "4", "--max_tokens", "8",
               "--repeats", "2", "--max_model_len", "64"], timeout=600, env=env)
    assert "| logprobs=0 (sampled log-prob) |" in out and "| logprobs=8 + parse_vllm_topk" in out, out
    assert "score centering's generation overhead:" in out
    out = run(["benchmarks/step_time.py", "--vllm", "--arms", "grpo_beta0.04,rpp_baseline_score_centering",
               "--rounds", "1", "--steps", "2", "--batch", "8", "--hidden", "128"], timeout=600, env=env)
    assert "generation on a colocated vLLM engine" in out and "| rpp_baseline_score_centering |" in out, out
