"""benchmarks/studies/mismatch_study.py (docs/evidence.md, study 4): its pure functions and the studies' statistics
(benchmarks/studies/study_common.py) by hand and against plain-loop float64 references, the sampler of each mismatch
source, the exactness of full-vocabulary score centering under a fixed bias, and every arm and source for 2 steps on
the tiny model."""

import argparse
import itertools
import json
import math
import os
import random
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks", "studies"))

import mismatch_study as ms  # noqa: E402
import study_common  # noqa: E402


# --- pure functions ---------------------------------------------------------------------------------------------


def test_quantize_per_channel_by_hand():
    w = torch.tensor([[1.0, -0.45, 0.26, 0.0], [0.0, 0.0, 0.0, 0.0], [0.1, 0.21, -0.4, 0.05]])
    # int8: row 0 scale 1/127 (0.26 * 127 = 33.02 -> 33, -0.45 * 127 = -57.15 -> -57); row 2 scale 0.4/127
    # (31.75 -> 32, 66.675 -> 67, -127, 15.875 -> 16); a row of zeros stays zero.
    q8 = ms.quantize_per_channel(w, 8)
    assert torch.allclose(q8[0], torch.tensor([1.0, -57 / 127, 33 / 127, 0.0]))
    assert q8[1].eq(0).all()
    assert torch.allclose(q8[2], torch.tensor([32.0, 67.0, -127.0, 16.0]) * (0.4 / 127))
    # int4: scale 1/7 (1.82 -> 2, -3.15 -> -3); row 2 scale 0.4/7 (1.75 -> 2, 3.675 -> 4, -7, 0.875 -> 1).
    q4 = ms.quantize_per_channel(w, 4)
    assert torch.allclose(q4[0], torch.tensor([1.0, -3 / 7, 2 / 7, 0.0]))
    assert torch.allclose(q4[2], torch.tensor([2.0, 4.0, -7.0, 1.0]) * (0.4 / 7))
    with pytest.raises(ValueError, match="bits=3"):
        ms.quantize_per_channel(w, 3)
    with pytest.raises(ValueError, match=r"\[out, in\]"):
        ms.quantize_per_channel(w[0], 8)


@pytest.mark.parametrize("bits", [4, 8])
def test_quantize_per_channel_matches_a_plain_loop(bits):
    g = torch.Generator().manual_seed(bits)
    w = torch.randn(7, 13, generator=g, dtype=torch.float64)
    qmax = 2 ** (bits - 1) - 1
    got = ms.quantize_per_channel(w, bits)
    for i in range(7):
        scale = max(abs(x) for x in w[i].tolist()) / qmax
        levels = set()
        for j in range(13):
            n = round(w[i, j].item() / scale)  # ties (to even, as torch.round) have probability 0 here
            assert abs(got[i, j].item() - n * scale) < 1e-12
            assert abs(got[i, j].item() - w[i, j].item()) <= scale / 2 + 1e-12
            levels.add(n)
        assert max(abs(n) for n in levels) == qmax  # the largest weight of a row sits on the top level


def test_t_quantile_matches_the_tables():
    # Two-sided 95% critical values of Student's t (any statistics table).
    for df, t in ((1, 12.7062), (2, 4.3027), (5, 2.5706), (10, 2.2281), (19, 2.0930), (30, 2.0423), (1e7, 1.95996)):
        assert abs(study_common.t_quantile(0.975, df) - t) < 1e-4, df
    assert abs(study_common.t_quantile(0.95, 10) - 1.8125) < 1e-4
    with pytest.raises(ValueError, match="0.5 < p < 1"):
        study_common.t_quantile(0.4, 3)


def test_welch_interval_by_hand():
    # mean 2, var 1 (n 3) against mean 6, var 2.5 (n 5): se^2 = 1/3 + 1/2, df = se^4 / ((1/3)^2/2 + (1/2)^2/4).
    w = study_common.welch_interval([1.0, 2.0, 3.0], [4.0, 5.0, 6.0, 7.0, 8.0])
    se = math.sqrt(1 / 3 + 1 / 2)
    df = (5 / 6) ** 2 / ((1 / 9) / 2 + (1 / 4) / 4)
    assert w["diff"] == -4.0 and abs(w["df"] - df) < 1e-12 and abs(df - 5.88235) < 1e-5
    assert abs(w["se"] - se) < 1e-12 and abs(w["half"] - study_common.t_quantile(0.975, df) * se) < 1e-12
    assert 2.447 < w["half"] / se < 2.571  # between the t quantiles at 6 and 5 degrees of freedom
    assert w["low"] == w["diff"] - w["half"] and w["high"] == w["diff"] + w["half"]
    # Equal sizes and variances: df = 2 (n - 1), the pooled t interval.
    w = study_common.welch_interval([0.0, 1.0, 2.0, 3.0], [10.0, 11.0, 12.0, 13.0])
    assert abs(w["df"] - 6.0) < 1e-12 and abs(w["half"] - 2.4469 * math.sqrt(2 * (5 / 3) / 4)) < 1e-3
    assert study_common.welch_interval([1.0, 1.0], [2.0, 2.0])["half"] == 0.0
    with pytest.raises(ValueError, match=">= 2 values"):
        study_common.welch_interval([1.0], [1.0, 2.0])


def test_permutation_p_value_by_hand_and_by_sampling():
    # 6 ways to pick 2 of {0, 0, 1, 1}: only {0, 0} and {1, 1} reach |difference| = 1.
    assert study_common.permutation_p_value([0.0, 0.0], [1.0, 1.0]) == pytest.approx(2 / 6)
    # 20 ways to pick 3 of 1..6: {1,2,3} and {4,5,6} reach |difference| = 3.
    assert study_common.permutation_p_value([1.0, 2.0, 3.0], [4.0, 5.0, 6.0]) == pytest.approx(2 / 20)
    assert study_common.permutation_p_value([1.0, 2.0], [1.0, 2.0]) == 1.0
    # Against a plain enumeration, and the sampled test against the exact one.
    rng = random.Random(0)
    a, b = [rng.gauss(0, 1) for _ in range(6)], [rng.gauss(0.8, 1) for _ in range(7)]
    pooled, obs = a + b, abs(sum(a) / 6 - sum(b) / 7)
    exact = [abs(sum(pooled[i] for i in c) / 6 - (sum(pooled) - sum(pooled[i] for i in c)) / 7) >= obs - 1e-12
             for c in itertools.combinations(range(13), 6)]
    p = sum(exact) / len(exact)
    assert study_common.permutation_p_value(a, b) == pytest.approx(p)
    assert abs(study_common.permutation_p_value(a, b, exact_limit=0, n_resamples=20_000) - p) < 0.01


def test_curve_area_and_copy_reward_by_hand():
    assert ms.curve_area([[0, 0.0], [10, 1.0], [20, 1.0]]) == 0.75  # (5 + 10) / 20
    assert ms.curve_area([[0, 0.2], [300, 0.2]]) == pytest.approx(0.2)
    assert ms.copy_credit_reward(["abc", "ab", "abcd", "xbc", "", "b", "a9"], ["abc"] * 5 + ["a", "a"]) == [
        1.0, 2 / 3, 1.0, 2 / 3, 0.0, 0.0, 1.0]
    rows = ms.copy_rows(200, 0, lengths=(1, 3))
    assert {len(r["answer"]) for r in rows} == {1, 3} and all(r["prompt"] == r["answer"] + ":" for r in rows)


@pytest.mark.parametrize("seed", range(3))
def test_full_vocabulary_centering_is_on_policy_learning_of_the_biased_sampler(seed):
    """With q = softmax(z + b) and the head = the whole vocabulary, the centered score's gradient with respect to the
    trainer's logits z is grad log q_y (the identity of the issue), to float64 rounding; with a top-k head it is not."""
    from reference import ref_sampled_and_head_logps
    from trl_rpp.score_centering import score_centering_correction

    g = torch.Generator().manual_seed(seed)
    B, T, V = 3, 4, 46
    z = (torch.randn(B, T + 1, V, generator=g, dtype=torch.float64) * 2).requires_grad_(True)
    bias = torch.randn(V, generator=g, dtype=torch.float64) * 2
    logq = torch.log_softmax(z.detach()[:, :T] + bias, -1)
    y = torch.distributions.Categorical(logits=logq).sample()
    A = torch.randn(B, T, generator=g, dtype=torch.float64)
    mask = torch.ones(B, T, dtype=torch.bool)

    def centered_grad(k):
        head = logq.topk(k, -1).indices
        logps, head_logps, _ = ref_sampled_and_head_logps(z, y, head)
        corr = score_centering_correction(head_logps, logq.gather(-1, head), mask)
        (grad,) = torch.autograd.grad(-(A * (logps - corr)).sum(), z)
        return grad

    zb = z.detach().clone().requires_grad_(True)
    onpolicy = -(A * torch.log_softmax(zb[:, :T] + bias, -1).gather(-1, y.unsqueeze(-1)).squeeze(-1)).sum()
    (expected,) = torch.autograd.grad(onpolicy, zb)
    assert (centered_grad(V) - expected).abs().max() < 1e-12
    assert (centered_grad(32) - expected).abs().max() > 1e-6


# --- the samplers -----------------------------------------------------------------------------------------------


@pytest.fixture()
def tiny(tiny_model):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model)


def test_stale_sampler_holds_the_weights_of_n_steps_ago(tiny):
    sampler = ms.Sampler("stale2")
    sampler.attach(tiny)
    seen = []
    for step in range(5):
        module, bias = sampler.at(tiny, step)
        assert module is not tiny and bias is None
        seen.append(module.lm_head.weight[0, 0].item())
        with torch.no_grad():
            for p in tiny.parameters():
                p.add_(1.0)  # "an optimizer step"
    w0 = seen[0]
    assert seen == pytest.approx([w0, w0, w0, w0 + 1, w0 + 2], abs=1e-6)  # max(step - 2, 0) steps of +1
    assert set(sampler.history) == {2, 3, 4}  # what a later step can still ask for


def test_precision_and_quantization_samplers(tiny):
    for source in ("bf16", "int8", "int4", "stale0"):
        sampler = ms.Sampler(source)
        sampler.attach(tiny)
        module, _ = sampler.at(tiny, 0)
        q, t = module.model.layers[0].self_attn.q_proj.weight, tiny.model.layers[0].self_attn.q_proj.weight
        if source == "bf16":
            assert q.dtype == torch.bfloat16 and torch.equal(q, t.to(torch.bfloat16))
        elif source == "stale0":
            assert torch.equal(q, t)
        else:
            bits = int(source[3:])
            assert torch.equal(q, ms.quantize_per_channel(t, bits))
            assert torch.equal(module.lm_head.weight, ms.quantize_per_channel(tiny.lm_head.weight, bits))
            assert torch.equal(module.model.embed_tokens.weight, tiny.model.embed_tokens.weight)  # not a linear layer
    sampler = ms.Sampler("bias2")
    sampler.attach(tiny)
    module, bias = sampler.at(tiny, 0)
    g = torch.Generator().manual_seed(1234)  # study 2's draw
    assert module is tiny and torch.equal(bias, torch.randn(tiny.config.vocab_size, generator=g) * 2.0)
    for bad in ("stale", "fp8", "int2", "bias"):
        with pytest.raises(ValueError, match="unknown mismatch source"):
            ms.Sampler(bad)
    with pytest.raises(ValueError, match="onpolicy needs a bias"):
        ms.Sampler("int4", in_trainer=True)


# --- every arm and source, 2 steps ------------------------------------------------------------------------------


@pytest.fixture()
def one_thread():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.mark.slow
def test_every_arm_and_source_runs_and_the_report_reads_them(tmp_path, tiny_model, one_thread, capsys, monkeypatch):
    import shutil

    shutil.copytree(tiny_model, tmp_path / "tiny-model")
    opts = argparse.Namespace(out=str(tmp_path), threads=1, steps=2, prompts=8, generations=8, lr=3e-3, heldout=16,
                              eval_every=1, lengths=[1, 2, 3], jobs=1, seeds=[0])
    cells = [("stale4", "uncorrected"), ("bf16", "token_truncate"), ("int8", "sc32"), ("int4", "sc32_token_truncate"),
             ("bias2", "sc_full"), ("bias2", "onpolicy")]
    s = {cell: ms.run_one(*cell, 0, opts) for cell in cells}
    gap = {cell: r["series"]["mismatch/abs_log_ratio_mean"] for cell, r in s.items()}
    # Stale: the first generation is at the current weights, the second at the initial ones (one step behind).
    assert s[("stale4", "uncorrected")]["series"]["grad_norm"][0] > 0, "precondition: the first step updates"
    assert gap[("stale4", "uncorrected")][0] < 1e-5 < 1e-2 < gap[("stale4", "uncorrected")][1]
    assert 1e-5 < gap[("bf16", "token_truncate")][0] < gap[("int4", "sc32_token_truncate")][0]
    assert 1e-5 < gap[("int8", "sc32")][0] < gap[("int4", "sc32_token_truncate")][0]
    assert gap[("bias2", "sc_full")][0] > 0.5 and gap[("bias2", "onpolicy")][0] < 1e-5
    assert "mismatch/is_truncated_fraction" in s[("bf16", "token_truncate")]["series"]
    assert "score_centering/coeff_l1" in s[("int8", "sc32")]["series"]
    # The sanity check at run level: scored under the sampler, full-vocabulary centering of the biased sampler and
    # on-policy training of the biased model are one run, to float rounding.
    full, onpolicy = s[("bias2", "sc_full")], s[("bias2", "onpolicy")]
    assert full["series"]["grad_norm"][0] > 0
    assert full["series"]["grad_norm"] == pytest.approx(onpolicy["series"]["grad_norm"], rel=1e-3)
    assert abs(full["sampler_copy_prob_after"] - onpolicy["sampler_copy_prob_after"]) < 1e-5
    assert abs(full["sampler_copy_prob_after"] - full["copy_prob_after"]) > 1e-3  # and the trainer is another model
    for r in s.values():
        assert [st for st, _ in r["curves"]["copy_prob"]] == [0, 1, 2] and 0 < r["copy_prob_after"] < 1
        assert r["sampler_copy_prob_area"] == pytest.approx(ms.curve_area(r["curves"]["sampler_copy_prob"]), abs=1e-4)
    # Resumable: a sweep over finished cells starts nothing.
    opts.conditions, opts.arms = ["int8", "bias2"], ["sc32", "onpolicy"]  # onpolicy only with a bias, sc32 never
    ms.sweep(opts)
    out = capsys.readouterr().out
    assert out.count("done earlier, skipped") == 2 and "running" not in out
    # The report, from the files alone, through the command line.
    monkeypatch.setattr(sys, "argv", ["mismatch_study.py", "--report", "--out", str(tmp_path)])
    ms.main()
    report = json.loads((tmp_path / "report.json").read_text())
    assert set(report) == {"stale4", "bf16", "int8", "int4", "bias2"}
    assert report["bias2"]["arms"]["onpolicy"]["sampler_copy_prob_after"] == [onpolicy["sampler_copy_prob_after"]]
    assert [(r["seed"], r["steps"]) for r in report["bias2"]["sanity"]] == [(0, 2)]
    assert (tmp_path / "figures" / "evidence_mismatch_study.png").stat().st_size > 10_000


def _summary(condition, arm, seed, score, gap=0.1):
    keys = {f"{p}copy_prob_{w}": score for p in ("", "sampler_") for w in ("after", "area")}
    return dict(condition=condition, arm=arm, seed=seed, cpu_seconds=40.0, **keys,
                series={"mismatch/abs_log_ratio_mean": [gap, gap]}, curves={"sampler_copy_prob": [[0, 0.0], [10, score]]})


def test_report_contrasts_are_welch_and_permutation_of_the_files(tmp_path):
    """The report's contrasts from hand-made result files: unpaired, whatever the seeds."""
    values = {"uncorrected": [0.1, 0.2, 0.3], "sc32": [0.5, 0.6, 0.7, 0.8], "token_truncate": [0.2, 0.2, 0.5],
              "sc32_token_truncate": [0.4, 0.1, 0.3]}
    for arm, scores in values.items():
        for seed, v in enumerate(scores):
            d = tmp_path / "int4" / arm / f"seed{seed + 3 * (arm == 'sc32')}"  # seeds need not match across arms
            d.mkdir(parents=True)
            (d / "summary.json").write_text(json.dumps(_summary("int4", arm, seed, v)))
    opts = argparse.Namespace(out=str(tmp_path), figures=str(tmp_path / "figures"))
    out = ms.report(opts)
    c = out["int4"]["contrasts"]
    for name, arm, control in (("sc32 − uncorrected", "sc32", "uncorrected"),
                               ("(sc32 + IS) − IS", "sc32_token_truncate", "token_truncate")):
        for key in ("sampler_copy_prob_area", "copy_prob_after"):
            got, w = c[name][key], study_common.welch_interval(values[arm], values[control])
            assert got["diff"] == pytest.approx(w["diff"]) and got["half"] == pytest.approx(w["half"])
            assert got["p"] == pytest.approx(study_common.permutation_p_value(values[arm], values[control]))
    # 0.65 - 0.2 = 0.45. Of the 35 ways to pick 4 of the 7 values only the observed one reaches it (the four smallest
    # against the three largest: 0.275 - 0.7 = -0.425).
    assert c["sc32 − uncorrected"]["copy_prob_after"]["diff"] == pytest.approx(0.45)
    assert c["sc32 − uncorrected"]["copy_prob_after"]["p"] == pytest.approx(1 / 35)
    assert "sc_full − sc32" not in c  # no sc_full runs: no contrast
    assert out["int4"]["arms"]["sc32"]["mean_sampler_curve"] == [[0, 0.0], [10, pytest.approx(0.65)]]
    assert (tmp_path / "figures" / "evidence_mismatch_study.png").stat().st_size > 10_000
    md = (tmp_path / "report.md").read_text()
    assert "| `sc32` | 4 | 0.650 [" in md and "| sc32 − uncorrected | +0.450 [" in md
    # The summary table: the primary metric (the same values in every metric here), seeds 3 and 4.
    assert "| `int4` | 3/4 | 0.1 | 0.200 [" in md and "| +0.450 [" in md and "| sc32 − uncorrected | +0.450 [+" in md


def test_bias_sanity_by_hand():
    def run(seed, rewards, final):
        return dict(seed=seed, series={"reward": rewards}, sampler_copy_prob_after=final)

    sc_full = [run(1, [0.1, 0.2], 0.4), run(0, [0.1, 0.2, 0.3], 0.5), run(2, [0.3], 0.1)]
    onpolicy = [run(0, [0.1, 0.25, 0.3], 0.45), run(1, [0.1, 0.2], 0.4)]
    rows = ms.bias_sanity(sc_full, onpolicy)
    assert [(r["seed"], r["first_different_step"], r["steps"]) for r in rows] == [(0, 2, 3), (1, None, 2)]
    assert rows[0]["final_abs_diff"] == pytest.approx(0.05) and rows[1]["final_abs_diff"] == 0.0


def test_run_jobs_runs_in_order_and_stops_launching_after_a_failure(tmp_path):
    """The sweeps' job pool (study 4 and `compare_estimators.py`): every command runs, as ``python script *argv``
    would run it, in a process forked from one that has imported `PRELOAD` (so the script finds them imported) and
    holds nothing of an earlier run; a failure stops new launches and is raised with its command once the commands in
    flight have ended."""
    import subprocess

    from study_common import PRELOAD

    script = tmp_path / "touch.py"
    script.write_text(
        "import json, sys\n"
        "import study_common\n"
        "earlier = getattr(study_common, 'ran_here', None)\n"
        "study_common.ran_here = sys.argv[1]\n"
        "facts = dict(name=__name__, argv=sys.argv[1:],\n"
        "             preloaded=[m for m in study_common.PRELOAD if m in sys.modules],\n"
        "             earlier=earlier)\n"
        "json.dump(facts, open(sys.argv[1] + '.json', 'w'))\n"
        "raise SystemExit(int(sys.argv[2]))\n")

    def touch(name, code=0):
        return [sys.executable, str(script), str(tmp_path / name), str(code)]

    ms.run_jobs([(touch("a"), "a"), (touch("b"), "b"), (touch("c"), "c")], jobs=2)
    assert sorted(p.name for p in tmp_path.glob("*.json")) == ["a.json", "b.json", "c.json"]
    for name in "abc":
        facts = json.loads((tmp_path / f"{name}.json").read_text())
        assert facts == dict(name="__main__", argv=[str(tmp_path / name), "0"], preloaded=list(PRELOAD),
                             earlier=None)
    failing = touch("d", code=3)
    with pytest.raises(subprocess.CalledProcessError) as err:
        ms.run_jobs([(failing, "d"), (touch("e"), "e")], jobs=1)
    assert err.value.cmd == failing and (tmp_path / "d.json").exists() and not (tmp_path / "e.json").exists()
    with pytest.raises(ValueError, match="start_run runs"):
        ms.run_jobs([([sys.executable, "-c", "pass"], "f")], jobs=1)
