"""Every runnable script is run: the demo (--tiny) and the benchmarks (at toy sizes, so they cannot rot)."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from trainer_helpers import python_command

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = dict(os.environ, HF_HUB_OFFLINE="1", WANDB_MODE="offline", TOKENIZERS_PARALLELISM="false")


def run(args, timeout=300, env=None):
    proc = subprocess.run(python_command(*args), cwd=ROOT, env=dict(ENV, **(env or {})), capture_output=True,
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
    """`make demo`'s own path (the GGUF-converted SmolLM2, LoRA), cut to one step and 16 held-out prompts: the card
    names the Hub model the GGUF file came from, the adapter and the dataset, with no None and no broken link."""
    out = tmp_path / "demo"
    # Threads: the demo's own choice, the cores idle at its start (the suite's other worker may hold one).
    stdout = run(["examples/demo.py", "--max_steps", "1", "--heldout", "16", "--output_dir", str(out)], timeout=1200)
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


BENCHMARKS = Path(ROOT) / "benchmarks"


def _benchmark_scripts():
    """Every script under benchmarks/, in any subfolder, as its path relative to benchmarks/."""
    return sorted(p.relative_to(BENCHMARKS).as_posix() for p in BENCHMARKS.rglob("*")
                  if p.suffix in (".py", ".sh") and p.is_file() and "gpu_wheels" not in p.parts)


def _table_rows(readme):
    """The table rows of a README whose first cell links a file: (the link's target, the row's cells)."""
    rows = []
    for line in readme.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")] if line.startswith("| [") else []
        link = re.match(r"\[`[^`]+`\]\(([^)#\s]+)\)", cells[0]) if cells else None
        if link:
            rows.append((link.group(1), cells))
    return rows


def test_every_benchmark_script_has_one_row_in_the_benchmarks_readme():
    """benchmarks/README.md maps the folder: every script under benchmarks/ (subfolders included) has exactly one table
    row, which links it and whose command, where it has one, runs it from the repository root; every row's script
    exists; benchmarks/studies/README.md names every study script. (Their links resolve: tests/test_readme.py.)"""
    scripts = _benchmark_scripts()
    assert "core_numerics.py" in scripts and "studies/mismatch_study.py" in scripts, scripts
    rows = _table_rows(BENCHMARKS / "README.md")
    linked = sorted(target for target, _ in rows)
    assert linked == scripts, (sorted(set(scripts) - set(linked)), sorted(set(linked) - set(scripts)))
    for target, cells in rows:
        assert len(cells) == 4 and (BENCHMARKS / target).is_file(), cells
        named = re.findall(r"`(?:python|bash) (benchmarks/[^\s`]+)", cells[2])
        assert named in ([], [f"benchmarks/{target}"]), (target, cells[2])
        assert named or target in ("studies/run_table.py", "studies/study_common.py"), f"{target}: no command in its row"
    studies = BENCHMARKS / "studies" / "README.md"
    named = {target for target, _ in _table_rows(studies)} | set(re.findall(r"\]\(([\w.]+\.py)\)", studies.read_text()))
    assert named == {p.name for p in (BENCHMARKS / "studies").glob("*.py")}, named
    assert "Study 4" in studies.read_text() and "mismatch_study.py" in studies.read_text()


def test_no_benchmark_script_shares_a_name_with_a_module_of_trl_rpp():
    """A script named like a module of the package (a `core.py` here beside trl_rpp/core.py) reads as that module's
    benchmark or shadows it on sys.path; and the benchmarks import each other by file name, so no two share one."""
    package = Path(ROOT) / "trl_rpp"
    modules = {p.stem for p in package.rglob("*.py")} | {p.name for p in package.rglob("*") if p.is_dir()}
    stems = [Path(s).stem for s in _benchmark_scripts()]
    assert not set(stems) & modules, sorted(set(stems) & modules)
    assert len(stems) == len(set(stems)), sorted(stems)


def test_core_benchmark_runs_small():
    stdout = run(["benchmarks/core_numerics.py", "--B", "8", "--T", "64", "--repeats", "1"])
    assert "global_masked_normalize" in stdout


@pytest.mark.slow
def test_step_time_benchmark_runs_small():
    arms = "grpo_beta0.04,rpp_baseline,rpp_baseline_top_k,rpp_baseline_top_k_replay_score_centering"
    stdout = run(["benchmarks/step_time.py", "--rounds", "1", "--steps", "2", "--batch", "8", "--hidden", "32", "--arms",
                  arms, "--top_k", "6"])
    rows = {line.split(" | ")[0].strip("| "): line.split(" | ") for line in stdout.splitlines() if line.startswith("| ")}
    for arm in arms.split(","):
        peak_rss, step_peak = float(rows[arm][4]), float(rows[arm][5].strip(" |"))
        assert 0 <= step_peak < peak_rss, (arm, rows[arm])  # the step's own peak, not the process's


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
    args = ["benchmarks/studies/compare_estimators.py", "--tiny", "--seeds", "0", "--steps", "2", "--heldout", "16",
            "--threads", "1", "--jobs", "2", "--out", str(tmp_path)]
    run(args, timeout=600)
    for arm in ("rpp", "rpp_baseline", "grpo", "grpo_noscale"):
        summary = json.loads((tmp_path / arm / "seed0" / "summary.json").read_text())
        assert len(summary["step_seconds"]) == 2 and 0.0 <= summary["heldout_after"] <= 1.0
        assert (tmp_path / arm / "seed0" / "metrics.jsonl").read_text().count("\n") >= 2
    report = json.loads((tmp_path / "report.json").read_text())
    assert set(report["arms"]) == {"rpp", "rpp_baseline", "grpo", "grpo_noscale"}
    assert (tmp_path / "figures" / "evidence_curves.png").stat().st_size > 10_000
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

def _rows(path):
    return [json.loads(line) for line in path.read_text().splitlines() if '"reward"' in line]


def test_lm_head_memory_benchmark_runs_small(tmp_path):
    """Every arm in its own process at a toy size: one table row with a peak and a time per arm, and the JSON."""
    out = run(["benchmarks/lm_head_memory.py", "--vocabs", "256", "--positions", "32", "--hidden", "16",
               "--json", str(tmp_path / "r.json")])
    rows = [line for line in out.splitlines() if line.startswith("| 256 | 32 |")]
    assert len(rows) == 1 and rows[0].count("MiB") == 4, out
    results = json.loads((tmp_path / "r.json").read_text())
    assert sorted(r["arm"] for r in results) == sorted(["fused", "replay", "score_centering", "both"])
    assert all(r["peak_mib"] >= 0 and r["seconds"] > 0 for r in results), results


def test_lm_head_memory_build_arm_names_the_accepted_arms():
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    from lm_head_memory import build_arm

    with pytest.raises(ValueError, match=r"arm='logits' is not an arm .*; accepted: fused, replay, score_centering, both"):
        build_arm("logits", 256, 32, 16)


def test_lm_head_memory_frozen_input_embedding_leaves_only_the_embedding_without_gradient():
    """`--frozen-input-embedding`: the input embedding gets no gradient; every other parameter, the head first, does."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    from lm_head_memory import build_arm

    model, step = build_arm("replay", 256, 32, 16, frozen_input_embedding=True)
    step().sum().backward()
    embedding = model.get_input_embeddings().weight
    assert embedding.grad is None and not embedding.requires_grad
    assert model.get_output_embeddings().weight.grad.abs().sum() > 0
    assert all(p.grad is not None for p in model.parameters() if p is not embedding)


def test_lm_head_memory_shared_draw_is_one_batch_at_every_vocabulary():
    """`ids_range` (`--draw-ids shared`): the same ids at V = 256 and 1,024, all under the range; without it the
    larger vocabulary's draw reaches past it."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    from lm_head_memory import build_arm

    def read(vocab, ids_range):
        model, step = build_arm("replay", vocab, 64, 16, ids_range=ids_range)
        reads = []  # the ids the input embedding reads
        model.get_input_embeddings().register_forward_pre_hook(lambda module, args: reads.append(args[0]))
        step()
        return reads[0]

    small, large = read(256, 256), read(1024, 256)
    assert small.equal(large) and int(large.max()) < 256
    assert int(read(1024, None).max()) >= 256
    with pytest.raises(ValueError, match=r"ids_range=2048 must be in \[1, vocab=1024\]"):
        build_arm("replay", 1024, 64, 16, ids_range=2048)


def test_kept_set_rows_benchmark_runs_small():
    """The real model's kept sets at N = 64 and 128, top_k = 5: one row per N, each count of distinct rows in
    1..N * top_k."""
    out = run(["benchmarks/kept_set_rows.py", "--positions", "64,128", "--top-k", "5"])
    rows = [[int(c.replace(",", "")) for c in line.strip("|\n ").split("|")] for line in out.splitlines()
            if line.startswith("| ") and line[2].isdigit()]
    assert [r[:2] for r in rows] == [[64, 320], [128, 640]], out
    assert all(0 < r[2] <= r[1] and 0 < r[3] <= r[1] for r in rows) and rows[0][2] <= rows[1][2], out


@pytest.mark.slow
def test_compare_estimators_drift_study_arms_run_and_correct_as_documented(tmp_path):
    """Study 2 at 2 steps: the run without a bias and the four mismatch arms (full fine-tuning, tiny model)."""
    args = ["benchmarks/studies/compare_estimators.py", "--study", "drift", "--bias_sigmas", "0,1", "--seeds", "0",
            "--steps", "2", "--eval_every", "1", "--heldout", "16", "--threads", "1", "--jobs", "2", "--out", str(tmp_path)]
    run(args, timeout=900)
    root = tmp_path / "drift-tiny"
    assert sorted(p.name for p in (root / "bias0").iterdir() if p.name != "tiny-model") == ["mismatch_none"]
    arms = ("mismatch_none", "mismatch_tis", "mismatch_sc", "mismatch_both")
    first = {arm: _rows(root / "bias1" / arm / "seed0" / "metrics.jsonl")[0] for arm in arms}
    # Same seed, same fixed bias: the first generation batch is identical across arms, and the bias is really there
    # (without it |log p - log q| is ~1e-6, the kv-cache rounding).
    gaps = {arm: f["mismatch/abs_log_ratio_mean"] for arm, f in first.items()}
    assert min(gaps.values()) > 0.05 and max(gaps.values()) - min(gaps.values()) < 1e-5, gaps
    assert _rows(root / "bias0" / "mismatch_none" / "seed0" / "metrics.jsonl")[0]["mismatch/abs_log_ratio_mean"] < 1e-4
    # Score centering's own metric measures the same gap from its capture; each correction logs what it did.
    for arm in ("mismatch_sc", "mismatch_both"):
        assert abs(first[arm]["score_centering/sampler_logp_abs_diff"] - gaps[arm]) < 1e-5
    assert "mismatch/is_masked_fraction" in first["mismatch_tis"] and "mismatch/is_masked_fraction" not in first["mismatch_none"]
    assert "mismatch/is_truncated_fraction" in first["mismatch_both"] and "score_centering/coeff_l1" not in first["mismatch_tis"]
    summary = json.loads((root / "bias1" / "mismatch_both" / "seed0" / "summary.json").read_text())
    assert [s for s, _ in summary["heldout_prob_curve"]] == [1, 2] and 0 < summary["heldout_prob_after"] < 1
    assert summary["settings"]["full_finetune"] and summary["settings"]["mismatch_sigma"] == 1.0
    studies = json.loads((tmp_path / "studies.json").read_text())
    assert set(studies["drift-tiny"]["sweep"]) == {"0", "1"} and set(studies["drift-tiny"]["tables"]["1"]) == set(arms)
    assert (tmp_path / "figures" / "evidence_drift.png").stat().st_size > 10_000


@pytest.mark.slow
def test_compare_estimators_noise_study_arms_run_and_perturb_only_training(tmp_path):
    """Study 1 at 2 steps: GRPO with batch scaling and REINFORCE++ (deferred returns) under reward noise, and
    REINFORCE++-baseline with the format bonus; the mechanism metric is logged, held-out scores see no noise."""
    base = ["benchmarks/studies/compare_estimators.py", "--study", "noise", "--tiny", "--seeds", "0", "--steps", "2",
            "--heldout", "16", "--threads", "1", "--jobs", "2", "--out", str(tmp_path)]
    run(base + ["--conditions", "sigma0.3", "--arms", "grpo_batch,rpp"], timeout=900)
    run(base + ["--conditions", "format0.1", "--arms", "rpp_baseline"], timeout=900)
    root = tmp_path / "noise-tiny"
    for arm in ("grpo_batch", "rpp"):
        rows = _rows(root / "sigma0.3" / arm / "seed0" / "metrics.jsonl")
        assert all(0.0 <= r["reward_noise/tied_group_adv_share"] <= 1.0 for r in rows)
        # The training reward is the correctness reward plus noise: the two differ, by about sigma / sqrt(64).
        assert all(0 < abs(r["reward"] - r["reward_noise/clean_reward"]) < 0.3 for r in rows), rows
        summary = json.loads((root / "sigma0.3" / arm / "seed0" / "summary.json").read_text())
        for key in ("heldout", "heldout_prob", "heldout_ood", "heldout_ood_prob"):
            assert 0.0 <= summary[f"{key}_after"] <= 1.0, summary
    # The format bonus is deterministic: between 0 and 0.1 above the correctness reward.
    for r in _rows(root / "format0.1" / "rpp_baseline" / "seed0" / "metrics.jsonl"):
        assert -1e-6 <= r["reward"] - r["reward_noise/clean_reward"] <= 0.1 + 1e-6, r
    studies = json.loads((tmp_path / "studies.json").read_text())
    assert set(studies["noise-tiny"]["conditions"]) == {"sigma0.3", "format0.1"}
    assert (tmp_path / "figures" / "evidence_noise_tiny.png").stat().st_size > 10_000


def test_tied_group_adv_share_by_hand():
    import torch

    sys.path.insert(0, os.path.join(ROOT, "benchmarks", "studies"))
    from compare_estimators import perturbed_reward, tied_group_adv_share, tied_group_rows

    tied = tied_group_rows(torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0, 0.0]), 2)
    assert tied.tolist() == [True, True, False, False, True, True]
    mask = torch.tensor([[1, 1], [1, 0], [1, 1], [1, 0], [1, 1], [0, 0]], dtype=torch.bool)
    # GRPO's [B]: |A| counted once per valid token. Tied: 2*1 + 1*2 + 2*0.5 = 5; untied: 2*3 + 1*1 = 7.
    adv = torch.tensor([1.0, -2.0, 3.0, -1.0, 0.5, float("nan")])
    assert abs(tied_group_adv_share(adv, mask, tied).item() - 5 / 12) < 1e-7
    per_token = adv.unsqueeze(1).expand(6, 2).clone()
    per_token[~mask] = float("inf")  # masked positions never count
    assert abs(tied_group_adv_share(per_token, mask, tied).item() - 5 / 12) < 1e-7
    assert tied_group_adv_share(torch.zeros(6), mask, tied).item() == 0.0
    stash = []
    reward = perturbed_reward(lambda c, a: [1.0 if x == y else 0.0 for x, y in zip(c, a)], lambda t: float(len(t) == 1),
                              0.0, 0.1, 0, stash)
    assert reward(["a", "ab", "b"], ["a", "a", "a"]) == [1.1, 0.0, 0.1] and stash == [[1.0, 0.0, 0.0]]


def test_unpaired_interval_is_welch_by_hand():
    sys.path.insert(0, os.path.join(ROOT, "benchmarks", "studies"))
    from compare_estimators import unpaired_interval

    # a = [1, 3]: mean 2, variance 2, so se = sqrt(2/2 + 0/3) = 1; Welch's df = 1^2 / (1^2 / 1) = 1, t = 12.706.
    diff, se, half = unpaired_interval([1.0, 3.0], [0.0, 0.0, 0.0])
    assert diff == 2.0 and abs(se - 1.0) < 1e-12 and abs(half - 12.7062) < 1e-4
    # Equal variances and sizes: df = 2(n - 1) = 6, t(0.975, 6) = 2.4469; se = sqrt(2 * 1 / 4).
    diff, se, half = unpaired_interval([1.0, 2.0, 3.0, 2.0], [0.0, 1.0, 2.0, 1.0])
    var = sum((x - 2.0) ** 2 for x in [1.0, 2.0, 3.0, 2.0]) / 3
    assert diff == 1.0 and abs(se - (2 * var / 4) ** 0.5) < 1e-12 and abs(half / se - 2.4469) < 1e-4
    assert unpaired_interval([1.0], [0.0, 1.0]) is None


def test_t_interval_uses_the_exact_quantile_past_its_table():
    sys.path.insert(0, os.path.join(ROOT, "benchmarks", "studies"))
    from compare_estimators import t_interval

    # 20 values 0, 1, 0, 1, ...: mean 0.5, std sqrt(5/19); t(0.975, 19) = 2.0930 (not 1.96).
    mean, std, half = t_interval([float(i % 2) for i in range(20)])
    assert mean == 0.5 and abs(std - (5 / 19) ** 0.5) < 1e-12 and abs(half / (std / 20**0.5) - 2.0930) < 1e-4
    # Within the table (5 values): t(0.975, 4) = 2.776.
    mean, std, half = t_interval([1.0, 2.0, 3.0, 4.0, 5.0])
    assert mean == 3.0 and abs(half / (std / 5**0.5) - 2.776) < 1e-9


@pytest.mark.slow
def test_vllm_benchmarks_run_small(tmp_path):
    """The real-engine benchmarks at toy sizes on the tiny model (head size 64, as vLLM's CPU attention needs)."""
    from trl_rpp.testing.tiny import build_tiny_model

    model = build_tiny_model(tmp_path / "model", hidden_size=128, num_heads=2)
    env = dict(VLLM_CPU_KVCACHE_SPACE="1", VLLM_NO_USAGE_STATS="1", TRL_RPP_TESTS_VLLM="1")  # tests/harness
    out = run(["benchmarks/vllm_generation.py", "--model", model, "--k", "8", "--prompts", "4", "--max_tokens", "8",
               "--repeats", "2", "--max_model_len", "64"], timeout=600, env=env)
    assert "| logprobs=0 (sampled log-prob) |" in out and "| logprobs=8 + parse_vllm_topk" in out, out
    assert "score centering's generation overhead:" in out


@pytest.mark.slow
def test_step_time_benchmark_with_vllm_runs_small():
    env = dict(VLLM_CPU_KVCACHE_SPACE="1", VLLM_NO_USAGE_STATS="1", TRL_RPP_TESTS_VLLM="1")  # tests/harness
    out = run(["benchmarks/step_time.py", "--vllm", "--arms", "grpo_beta0.04,rpp_baseline_score_centering",
               "--rounds", "1", "--steps", "2", "--batch", "8", "--hidden", "128", "--skip_memory"], timeout=600, env=env)
    assert "generation on a colocated vLLM engine" in out, out
    assert "| grpo_beta0.04 | " in out and "| rpp_baseline_score_centering | " in out, out


@pytest.fixture
def restored_threads():
    import torch

    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.mark.slow
def test_truncation_study_arms_apply_what_they_say(tmp_path, tiny_model, restored_threads, capsys):
    """Study 5 (benchmarks/studies/truncation_study.py) at 2 steps, every arm in this process: on the first, on-policy
    step at top_k=6, the replay makes TRL's token weights 1 (to 1e-5), without it they are the trainer's kept mass
    pi_old(S) < 1, token_mask at [0.5, 3] drops every token (the mass is below 0.5), and the arms without a
    correction apply none. Then the sweep resumes (skips every finished run) and `--report` reads the files."""
    import argparse
    import shutil

    sys.path.insert(0, os.path.join(ROOT, "benchmarks", "studies"))
    import truncation_study as ts

    shutil.copytree(tiny_model, tmp_path / "tiny-model")
    opts = argparse.Namespace(out=str(tmp_path), threads=1, steps=2, prompts=8, generations=8, lr=3e-3, top_k=6,
                              heldout=16, eval_every=1, lengths=[1, 2, 3], jobs=1, seeds=[0], arms=list(ts.ARMS))
    runs = {arm: ts.run_one(arm, 0, opts) for arm in ts.ARMS}
    first = {arm: r["first_step"] for arm, r in runs.items()}
    for arm, f in first.items():
        assert 0.05 < f["truncation/kept_mass_mean"] < 0.5, (arm, f)  # top_k=6 of 46 ids truncates a lot
    for arm in ("replay_tis", "replay_mask"):
        assert first[arm]["truncation/is_weight_max_abs_dev"] <= 1e-5, first[arm]
        assert first[arm]["truncation/is_masked_fraction"] == 0.0
    assert first["full_tis"]["truncation/weight_minus_kept_mass_max"] <= 1e-5, first["full_tis"]
    assert first["full_tis"]["truncation/is_weight_mean"] < 0.5 and first["full_tis"]["truncation/is_masked_fraction"] == 0
    assert first["full_mask"]["truncation/is_masked_fraction"] == 1.0 and first["full_mask"]["truncation/is_weight_mean"] == 0
    assert runs["full_mask"]["series"]["grad_norm"] == [0.0, 0.0]  # nothing left to learn from
    for arm in ("full", "replay"):  # no correction: nothing weighted
        assert first[arm]["truncation/is_weight_max_abs_dev"] == 0.0
    for arm in ("full", "replay", "full_tis", "replay_tis", "replay_mask"):
        assert runs[arm]["series"]["grad_norm"][0] > 0, arm
    for r in runs.values():
        assert [st for st, _ in r["curves"]["sampler_copy_prob"]] == [0, 1, 2]
        assert 0 < r["sampler_copy_prob_after"] < 1 and r["replay_sampler_support"] == r["arm"].startswith("replay")
    # Scored under the truncated sampler, the answer's probability is the renormalized one: higher than the full softmax's.
    assert runs["full"]["sampler_copy_prob_before"] > runs["full"]["copy_prob_before"]
    ts.sweep(opts)
    out = capsys.readouterr().out
    assert out.count("done earlier, skipped") == len(ts.ARMS) and "running" not in out
    run(["benchmarks/studies/truncation_study.py", "--report", "--out", str(tmp_path)])
    report = json.loads((tmp_path / "report.json").read_text())
    assert set(report["arms"]) == set(ts.ARMS)
    assert report["arms"]["full_tis"]["is_weight_step1"] == pytest.approx(report["arms"]["full_tis"]["kept_mass_step1"], abs=1e-5)
    assert set(report["contrasts"]) == {name for name, _, _ in ts.CONTRASTS}
    assert "H1: replay_tis − full_tis" in (tmp_path / "report.md").read_text()
