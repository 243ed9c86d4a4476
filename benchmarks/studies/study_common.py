"""What the studies share: the statistics of their reports (Student's t quantile, Welch's unpaired interval, a
permutation p), the sweep that runs each (arm, seed) in a process of its own, what each run records (its step
clock, its curves, its summary.json), and the parts every report writes (the per-arm rows, the contrast table,
report.md and report.json).

The studies import it from this folder (each puts benchmarks/studies/ on `sys.path`)."""

from __future__ import annotations

import functools
import itertools
import json
import math
import os
import random
import subprocess
import sys
import time

# ---------------------------------------------------------------------------------------------------------------
# Statistics
# ---------------------------------------------------------------------------------------------------------------


def t_quantile(p: float, df: float) -> float:
    """The ``p`` quantile of Student's t with ``df > 0`` degrees of freedom (``0.5 < p < 1``), by bisection on the
    CDF ``1 - I_x(df/2, 1/2) / 2``, ``x = df / (df + t^2)``, to 1e-10."""
    if not 0.5 < p < 1 or not df > 0:
        raise ValueError(f"t_quantile: need 0.5 < p < 1 and df > 0, got p={p!r}, df={df!r}")
    lo, hi = 0.0, 1.0
    while 1.0 - 0.5 * _betainc(df / 2, 0.5, df / (df + hi * hi)) < p:
        hi *= 2.0
    while hi - lo > 1e-10 * max(1.0, hi):
        mid = (lo + hi) / 2
        if 1.0 - 0.5 * _betainc(df / 2, 0.5, df / (df + mid * mid)) < p:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def _betainc(a: float, b: float, x: float) -> float:
    """Regularized incomplete beta ``I_x(a, b)`` (continued fraction, modified Lentz)."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    front = math.exp(math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x))
    if x > (a + 1) / (a + b + 2):
        return 1.0 - _betainc(b, a, 1.0 - x)
    tiny = 1e-300
    c, d = 1.0, 1.0 - (a + b) * x / (a + 1)
    d = 1.0 / (d if abs(d) > tiny else tiny)
    f = d
    for m in range(1, 500):
        for numerator in (m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),
                          -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1))):
            d = 1.0 + numerator * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + numerator / c
            c = c if abs(c) > tiny else tiny
            f *= c * d
        if abs(c * d - 1.0) < 1e-15:
            break
    return front * f / a


def welch_interval(a, b, level: float = 0.95):
    """Unpaired difference ``mean(a) - mean(b)`` with Welch's ``level`` interval.

    Returns ``dict(diff, se, half, low, high, df, n_a, n_b)``: ``se = sqrt(var_a/n_a + var_b/n_b)`` with sample
    variances (ddof 1), ``half = t_q(df) * se`` with the Welch-Satterthwaite ``df``. Needs 2 or more values in each
    group. When both variances are 0 the interval is the point itself (``df`` is then reported as infinite).
    """
    if len(a) < 2 or len(b) < 2:
        raise ValueError(f"welch_interval: needs >= 2 values per group, got {len(a)} and {len(b)}")
    ma, mb = sum(a) / len(a), sum(b) / len(b)
    va = sum((x - ma) ** 2 for x in a) / (len(a) - 1) / len(a)
    vb = sum((x - mb) ** 2 for x in b) / (len(b) - 1) / len(b)
    se = math.sqrt(va + vb)
    if se == 0:
        half, df = 0.0, math.inf
    else:
        df = (va + vb) ** 2 / (va**2 / (len(a) - 1) + vb**2 / (len(b) - 1))
        half = t_quantile(0.5 + level / 2, df) * se
    diff = ma - mb
    return dict(diff=diff, se=se, half=half, low=diff - half, high=diff + half, df=df, n_a=len(a), n_b=len(b))


def permutation_p_value(a, b, n_resamples: int = 20_000, seed: int = 0, exact_limit: int = 100_000) -> float:
    """Two-sided permutation test of ``mean(a) - mean(b)``: the share of relabelings of the pooled values whose
    absolute difference of means is at least the observed one (within 1e-12).

    Every relabeling is enumerated when there are at most `exact_limit` of them; otherwise `n_resamples` random
    ones (from `seed`) are drawn and the p-value is ``(hits + 1) / (n_resamples + 1)``.
    """
    pooled, na = list(a) + list(b), len(a)
    n, total = len(pooled), sum(pooled)
    if na == 0 or na == n:
        raise ValueError("permutation_p_value: both groups need at least one value")

    def stat(sum_a):
        return abs(sum_a / na - (total - sum_a) / (n - na))

    observed = stat(sum(a)) - 1e-12
    if math.comb(n, na) <= exact_limit:
        sums = [sum(pooled[i] for i in idx) for idx in itertools.combinations(range(n), na)]
        return sum(stat(s) >= observed for s in sums) / len(sums)
    import numpy as np

    # The relabelings `random.Random(seed).sample(pooled, na)` draws (they depend on n and na only), summed in the
    # order it returns them, as Python's `sum` would: the same floats, so the same p-value, at numpy's speed.
    picked = np.asarray(pooled, dtype=np.float64)[_resampled_indices(n, na, n_resamples, seed)]
    sums = picked[:, 0].copy()
    for j in range(1, na):
        sums += picked[:, j]
    hits = int((np.abs(sums / na - (total - sums) / (n - na)) >= observed).sum())
    return (hits + 1) / (n_resamples + 1)


@functools.lru_cache(maxsize=16)
def _resampled_indices(n: int, na: int, n_resamples: int, seed: int):
    """``[n_resamples, na]``: the positions `random.Random(seed).sample(range(n), na)` draws, resample by resample."""
    import numpy as np

    rng = random.Random(seed)
    return np.array([rng.sample(range(n), na) for _ in range(n_resamples)], dtype=np.int64)


def mean_ci(values) -> str:
    """``mean [low, high]``: the mean of `values` and its two-sided 95% t interval (the mean alone for one value)."""
    n = len(values)
    m = sum(values) / n
    if n < 2:
        return f"{m:.3f}"
    half = t_quantile(0.975, n - 1) * math.sqrt(sum((v - m) ** 2 for v in values) / (n - 1) / n)
    return f"{m:.3f} [{m - half:.3f}, {m + half:.3f}]"


def contrast(a, b):
    """Welch's interval of ``mean(a) - mean(b)`` (`welch_interval`) with its permutation p as ``p``, or None with
    fewer than 2 values on a side."""
    if len(a) < 2 or len(b) < 2:
        return None
    w = welch_interval(a, b)
    return dict(w, p=permutation_p_value(a, b))


def fmt_interval(c) -> str:
    return "—" if c is None else f"{c['diff']:+.3f} [{c['low']:+.3f}, {c['high']:+.3f}]"


def fmt_contrast(c) -> str:
    if c is None:
        return "—"
    return fmt_interval(c) + (" (p < 0.001)" if c["p"] < 0.001 else f" (p = {c['p']:.3f})")


# ---------------------------------------------------------------------------------------------------------------
# The sweep: one subprocess per run
# ---------------------------------------------------------------------------------------------------------------


def passthrough(opts, keys, extra=()) -> list[str]:
    """The flags that give a run's subprocess the sweep's settings: ``--out``, ``--threads``, then each of `keys`
    (a list as comma-separated values), then each of `extra` that is set."""
    flags = ["--out", opts.out, "--threads", str(opts.threads)]
    for key in keys:
        value = getattr(opts, key)
        flags += [f"--{key}", ",".join(map(str, value)) if isinstance(value, (list, tuple)) else str(value)]
    for key in extra:
        if getattr(opts, key) is not None:
            flags += [f"--{key}", str(getattr(opts, key))]
    return flags


def pending_runs(script, opts, keys, extra=(), cells=None):
    """The ``(command, label)`` of each run without a summary.json yet: for each seed of ``opts.seeds`` (outermost,
    so that a sweep cut short has the same seeds in every cell), each ``(parents, arms)`` of `cells` (default: the
    one cell ``((), opts.arms)``), each arm in turn (so that machine load hits the arms alike), the run at
    ``opts.out/*parents/arm/seed<k>``. The command runs `script` with ``--run *parents arm seed``."""
    todo = []
    for seed in opts.seeds:
        for parents, arms in cells or [((), opts.arms)]:
            for arm in arms:
                label = "/".join((*parents, arm)) + f" seed {seed}"
                if os.path.exists(os.path.join(opts.out, *parents, arm, f"seed{seed}", "summary.json")):
                    print(f"[sweep] {label}: done earlier, skipped", flush=True)
                else:
                    todo.append(([sys.executable, os.path.abspath(script), "--run", *parents, arm, str(seed)]
                                 + passthrough(opts, keys, extra), label))
    return todo


# What every run imports. A run's process forks from one server process that has imported these once (Python's
# "forkserver"), instead of importing them anew: that costs about 9 s of CPU per run on a 2-core machine. The server
# runs nothing else, so each run still starts from a process of its own with nothing of another run in it.
PRELOAD = ("torch", "transformers", "datasets", "peft", "trl", "trl_rpp.trainer")


def _run_script(script: str, argv: list[str]) -> None:
    """In a run's process: `script` as ``python script *argv`` would run it (its folder first on `sys.path`)."""
    import runpy

    sys.argv = [script, *argv]
    sys.path.insert(0, os.path.dirname(script))
    runpy.run_path(script, run_name="__main__")


def start_run(cmd: list[str]):
    """Start the command ``[sys.executable, script, *argv]`` of `pending_runs` in a process forked from the preloaded
    server (`PRELOAD`); its output goes where this process's does. Returns the `multiprocessing.Process`."""
    import multiprocessing

    if cmd[0] != sys.executable or not cmd[1].endswith(".py"):
        raise ValueError(f"start_run runs [sys.executable, script.py, *argv], got {cmd[:2]}")
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(list(PRELOAD))
    proc = context.Process(target=_run_script, args=(cmd[1], cmd[2:]), daemon=False)
    proc.start()
    return proc


def run_jobs(todo, jobs: int):
    """Run the ``(command, label)`` of `todo` in order, `jobs` processes at a time (`start_run`). A failed command
    stops the launches; once the commands in flight have ended, raises `CalledProcessError` with the first that
    failed."""
    running, failed = [], []
    while todo or running:
        while todo and len(running) < jobs and not failed:
            cmd, label = todo.pop(0)
            print(f"[sweep] {label}: running ({len(todo)} left)", flush=True)
            running.append((cmd, start_run(cmd)))
        if failed and not running:
            break
        time.sleep(0.5)
        for item in list(running):
            if item[1].exitcode is not None:
                running.remove(item)
                if item[1].exitcode != 0:
                    failed.append(item[0])
    if failed:
        raise subprocess.CalledProcessError(1, failed[0])


# ---------------------------------------------------------------------------------------------------------------
# One run
# ---------------------------------------------------------------------------------------------------------------


def step_clock(evaluate=None, eval_every: int = 0):
    """A `TrainerCallback` that keeps each optimizer step's wall seconds in ``.times`` and, every `eval_every` steps
    (0: never), ``[step, evaluate(step)]`` in ``.curve``."""
    from transformers import TrainerCallback

    class StepClock(TrainerCallback):
        def __init__(self):
            self.times, self._t, self.curve = [], None, []

        def on_step_begin(self, *a, **k):
            self._t = time.perf_counter()

        def on_step_end(self, args, state, *a, **k):
            self.times.append(time.perf_counter() - self._t)
            if eval_every and state.global_step % eval_every == 0:
                self.curve.append([state.global_step, evaluate(state.global_step)])

    return StepClock()


def run_curves(before: dict, curve, after: dict, steps: int) -> dict:
    """``{key: [[step, value], ...]}`` of each key of `before`: step 0's value, those of `curve` (a `step_clock`'s,
    whose values are dicts like `before`), and `after` at step `steps` unless the curve ends there."""
    curves = {key: [[0, before[key]]] + [[s, e[key]] for s, e in curve] for key in before}
    for key, points in curves.items():
        if points[-1][0] != steps:
            points.append([steps, after[key]])
    return curves


def process_facts(threads: int) -> dict:
    """What a run's summary says of its process: its torch threads, CPU seconds and peak resident memory (MiB). The
    process forked from the sweep's preloaded server (`start_run`), so its CPU seconds do not count the imports."""
    import resource

    return dict(threads=threads, cpu_seconds=time.process_time(),
                peak_rss_mib=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)


def write_summary(outdir: str, summary: dict, long_keys=("curves", "series", "step_seconds"), indent=None) -> dict:
    """``<outdir>/summary.json``, written last (it marks the run as done), and one printed line of its short
    entries (all but `long_keys`)."""
    with open(os.path.join(outdir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=indent)
    print(json.dumps({k: v for k, v in summary.items() if k not in long_keys}), flush=True)
    return summary


# ---------------------------------------------------------------------------------------------------------------
# The report
# ---------------------------------------------------------------------------------------------------------------


def load_arm_runs(root: str, kept, arms) -> dict:
    """Per arm of `arms`, the records (the `kept` entries of each summary.json) of the runs ``<root>/<arm>/seed<k>``:
    from the runs' summary.json files when there are any (also written to ``<root>/runs.parquet``), else from that
    table (`run_table`)."""
    import run_table

    def read_run(where):
        with open(os.path.join(where, "summary.json")) as f:
            summary = json.load(f)
        return {k: summary[k] for k in kept}

    return runs_by_arm(run_table.Runs(run_table.load(root, run_table.raw_runs(root, read_run))), arms)


def runs_by_arm(records, arms) -> dict:
    """``{arm: [record, ...]}`` of a `run_table.Runs` whose runs are ``<arm>/seed<k>``, in `arms`' order."""
    runs = {}
    for arm in arms:
        for d in records.children(arm):
            if records.get(arm, d) is not None:
                runs.setdefault(arm, []).append(records.get(arm, d))
    return runs


def contrast_table(lines, rows, contrasts_spec, metrics) -> dict:
    """Append the table of each ``(name, arm, control)`` of `contrasts_spec` whose two arms have `rows` (Welch's
    interval and the permutation p of each metric) to `lines`; return ``{name: {metric: contrast}}``."""
    contrasts = {}
    lines += ["", "| contrast | " + " | ".join(name for _, name in metrics) + " |", "|---|" + "---|" * len(metrics)]
    for name, arm, control in contrasts_spec:
        if arm in rows and control in rows:
            contrasts[name] = {k: contrast(rows[arm][k], rows[control][k]) for k, _ in metrics}
            lines.append(f"| {name} | " + " | ".join(fmt_contrast(contrasts[name][k]) for k, _ in metrics) + " |")
    return contrasts


def write_report(out, lines, result: dict) -> dict:
    """``<out>/report.json`` (`result`) and ``<out>/report.md`` (`lines`), and print the Markdown."""
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "report.json"), "w") as f:
        json.dump(result, f, indent=1)
    with open(os.path.join(out, "report.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    return result


def split_lists(opts, arms) -> None:
    """The comma-separated ``--lengths``, ``--seeds`` and ``--arms`` as lists; an arm outside `arms` (``--arms``, or
    the arm of ``--run ARM SEED``) raises, naming the accepted ones."""
    opts.lengths = [int(x) for x in str(opts.lengths).split(",")]
    opts.seeds = [int(x) for x in opts.seeds.split(",")]
    opts.arms = opts.arms.split(",")
    for arm in opts.arms + ([opts.run[0]] if opts.run else []):
        if arm not in arms:
            raise ValueError(f"--arms: unknown arm {arm!r}; accepted: {', '.join(arms)}")


def study_main(ap, arms, run_one, sweep, report) -> None:
    """Add ``--run ARM SEED`` and ``--report`` to the study's parser `ap`, parse the command line (`split_lists`,
    with the study's `arms`) and `dispatch`."""
    ap.add_argument("--run", nargs=2, metavar=("ARM", "SEED"), default=None, help="internal: one run")
    ap.add_argument("--report", action="store_true")
    opts = ap.parse_args()
    split_lists(opts, arms)
    dispatch(opts, run_one, sweep, report)


def dispatch(opts, run_one, sweep, report) -> None:
    """``--run ARM SEED``: that one run; ``--report``: the report from the runs there are; else the sweep, then the
    report."""
    if opts.run:
        run_one(opts.run[0], int(opts.run[1]), opts)
    elif opts.report:
        report(opts)
    else:
        sweep(opts)
        report(opts)
