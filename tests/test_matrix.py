"""The combination matrix (tests/support/matrix.py): its covering array covers every pair of values of two axes, each cell
trains two optimizer steps (finite loss, trainable weights moved, the documented metrics logged, an importance ratio
of 1 on the first step where a float32 sampler logs one, the lag that `max_staleness` allows against a server) or is
refused when its config or its trainer is built, as `REFUSALS` says, and docs/robustness.md holds its table.

Where the cells run: transformers cells of one process in this process; colocated vLLM cells of one process in one
subprocess that shares a colocated engine between its trainers; the other cells of two processes in one
`accelerate launch` (DDP, gloo); the vLLM server cells against the test run's one real server for the tool model
(`trl-rpp vllm-serve`, float32, on the CPU; tests/conftest.py's `tool_vllm_server_process`), those of one process
in one subprocess and those of two in one `accelerate launch`."""

import math
import os
import time
from pathlib import Path

import pytest

import matrix
from test_engines import launch
from test_metrics_doc import documented_patterns
from servers import ENV, VLLM_ENV
from test_vllm_engine import run_script

HERE = Path(__file__).resolve().parent
ROBUSTNESS = HERE.parent / "docs" / "robustness.md"
SCRIPT = str(HERE / "support" / "matrix.py")
RATIO_TOL = 1e-3  # float32 sampler and trainer: TRL's first importance ratio is 1 within this
RUN_TIMEOUT_S = 900


def indices(where):
    """The cells that train in `where`: "inline" (transformers, one process), "vllm" (colocated, one process), "ddp"
    (two processes, no server), "server" and "server_ddp" (a vLLM server; one process, two)."""
    def place(cell):
        if cell["generation"] == "vllm_server":
            return "server_ddp" if cell["processes"] == 2 else "server"
        if cell["processes"] == 2:
            return "ddp"
        return "vllm" if cell["generation"] == "vllm" else "inline"

    return [i for i, c in enumerate(matrix.CELLS) if matrix.refusal(c) is None and place(c) == where]


REFUSED = [i for i, c in enumerate(matrix.CELLS) if matrix.refusal(c) is not None]


def test_every_pair_of_values_is_covered():
    training, refused = matrix.all_pairs()
    trains = set().union(*(matrix._pairs_of(c) for c in matrix.CELLS if matrix.refusal(c) is None))
    refuses = set().union(*(matrix._pairs_of(c) for c in matrix.CELLS if matrix.refusal(c) is not None))
    assert not training - trains, f"pairs no training cell holds: {sorted(training - trains)}"
    assert not refused - refuses, f"refused pairs no cell holds: {sorted(refused - refuses)}"
    assert all(matrix.applies(c) for c in matrix.CELLS)
    # Every value of every axis is in the matrix, "n/a" included, and the pairs are many more than the cells.
    assert {(n, c[n]) for c in matrix.CELLS for n in matrix.NAMES} == {(n, v) for n in matrix.NAMES for v in matrix.AXES[n]}
    assert len(training) + len(refused) > 10 * len(matrix.CELLS)


def test_the_coverage_check_finds_a_missing_pair():
    """Dropping a cell that alone holds some pair leaves that pair uncovered: the check above can fail."""
    training, _ = matrix.all_pairs()
    cells = [c for c in matrix.CELLS if matrix.refusal(c) is None]
    for i in range(len(cells)):
        rest = set().union(*(matrix._pairs_of(c) for j, c in enumerate(cells) if j != i))
        if training - rest:
            return
    pytest.fail("no cell holds a pair of its own")


def test_robustness_md_holds_the_generated_table():
    text = ROBUSTNESS.read_text()
    assert matrix.table() in text, "docs/robustness.md: regenerate the table with `python tests/support/matrix.py`"


def check_trains(cell, result):
    assert result["outcome"] == "trains", result
    assert result["steps"] == matrix.MAX_STEPS
    assert result["losses"] and all(math.isfinite(x) for x in result["losses"]), result["losses"]
    assert result["trainable"] > 0 and result["moved"] > 0, result["moved"]
    keys = set(result["keys"])
    missing = matrix.expected_keys(cell) - keys
    assert not missing, f"documented for this setting but not logged: {sorted(missing)}"
    patterns = documented_patterns()
    undocumented = sorted(k for k in keys if not any(p.fullmatch(k) for p in patterns))
    assert not undocumented, f"logged but not in docs/rpp_trainer.md: {undocumented}"
    first = result["first"]
    if cell["generation"] in ("vllm", "vllm_server"):
        # A float32 copy of the trainer samples the first batch (a server, after the sync of this trainer's weights:
        # the cell before left its own there): on-policy, the ratio is 1.
        assert abs(first["sampling/importance_sampling_ratio/mean"] - 1) <= RATIO_TOL, first
    elif cell["score_centering"] == "on":  # the trainer's own float32 sampler: log q = log p
        assert first["score_centering/sampler_logp_abs_diff"] <= RATIO_TOL, first
    if cell["rollouts"] == "tools":  # the tool loop ran
        assert any(row["tools/call_frequency"] > 0 for row in result["all"])
    if cell["generation"] == "vllm_server":  # the first batch on policy; at max_staleness=0 every one
        staleness = [row["sampling/staleness"] for row in result["all"] if "sampling/staleness" in row]
        assert staleness[0] == 0 and all(0 <= x <= cell["max_staleness"] for x in staleness), staleness
        steps_per_batch = cell["steps_per_generation"] * cell["num_iterations"] / cell["gradient_accumulation_steps"]
        if cell["max_staleness"] == 1 and steps_per_batch == 1:  # step 2 trains the batch sampled during step 1
            assert staleness == [0, 1], staleness


def check_refused(cell, result):
    refusal = matrix.refusal(cell)
    assert result["outcome"] == "refused" and result["stage"] == refusal.stage, result
    for field in refusal.fields:
        assert field.split("=")[0] in result["message"], (field, result["message"])


# Model folders that do not exist, and (`matrix.server_url`) a server address nobody listens on: a refused cell is
# refused before any model is loaded or any server reached.
NO_MODELS = {"none": "/nonexistent/matrix-model", "qwen3": "/nonexistent/matrix-model"}


@pytest.mark.parametrize("i", REFUSED, ids=matrix.cell_id)
def test_refused_cell(tmp_path, monkeypatch, i):
    """Refused when `RPPConfig` or `RPPTrainer` is built, as `matrix.REFUSALS` says, before any model, engine or
    server is used (whatever the cell's process count)."""
    monkeypatch.delenv(matrix.SERVER_URL_ENV, raising=False)
    check_refused(matrix.CELLS[i], matrix.run_cell(matrix.CELLS[i], str(tmp_path), paths=NO_MODELS))


@pytest.mark.slow
@pytest.mark.parametrize("i", indices("inline"), ids=matrix.cell_id)
def test_transformers_cell(tmp_path, matrix_models, i):
    result = matrix.run_cell(matrix.CELLS[i], str(tmp_path), matrix.model_paths(matrix_models))
    check_trains(matrix.CELLS[i], result)


def load(outdir, i, rank=0):
    import json

    with open(os.path.join(outdir, f"{matrix.cell_id(i)}_rank{rank}.json")) as f:
        return json.load(f)


@pytest.fixture(scope="module")
def vllm_cells(tmp_path_factory, matrix_models):
    outdir = tmp_path_factory.mktemp("matrix_vllm")
    which = ",".join(map(str, indices("vllm")))
    run_script([SCRIPT, str(outdir), matrix_models, which, "ties"], dict(os.environ, **ENV), timeout=RUN_TIMEOUT_S)
    return str(outdir)


@pytest.mark.slow
@pytest.mark.parametrize("i", indices("vllm"), ids=matrix.cell_id)
def test_vllm_cell(vllm_cells, i):
    check_trains(matrix.CELLS[i], load(vllm_cells, i))


@pytest.mark.slow
def test_a_vllm_tie_wider_than_the_record_leaves_the_loss_and_the_run_trains(vllm_cells):
    import json

    with open(os.path.join(vllm_cells, "ties.json")) as f:
        result = json.load(f)
    row = result["row"]
    assert result["steps"] == 1
    tokens = row["completions/mean_length"] * 4  # 4 completions, every token a model token
    assert row["sampling/tie_overflow"] == tokens > 0
    assert row["advantages/valid_tokens"] == 0 and row["advantages/empty_batch"] == 1


@pytest.fixture(scope="module")
def ddp_cells(tmp_path_factory, matrix_models):
    outdir = tmp_path_factory.mktemp("matrix_ddp")
    which = ",".join(map(str, indices("ddp")))
    launch("ddp.yaml", [SCRIPT, str(outdir), matrix_models, which], timeout=RUN_TIMEOUT_S, extra_env=VLLM_ENV)
    return str(outdir)


@pytest.mark.slow
@pytest.mark.parametrize("i", indices("ddp"), ids=matrix.cell_id)
def test_ddp_cell(ddp_cells, i):
    for rank in (0, 1):
        check_trains(matrix.CELLS[i], load(ddp_cells, i, rank))


@pytest.fixture(scope="module")
def server_cells(tmp_path_factory, matrix_models, tool_vllm_server_process):
    """Every vLLM server cell, against the test run's server for the tool model (tests/conftest.py's
    `tool_vllm_server_process`, taken at its base weights): those of one process in one subprocess, those of two in one
    `accelerate launch`. Each cell trains its own trainer, whose first sync replaces the weights that the cell before
    left on the server."""
    outdir = tmp_path_factory.mktemp("matrix_server")
    tool_vllm_server = tool_vllm_server_process.client()
    env = {matrix.SERVER_URL_ENV: tool_vllm_server.base_url}
    single, ddp = ",".join(map(str, indices("server"))), ",".join(map(str, indices("server_ddp")))
    timings = {"server start (shared)": tool_vllm_server_process.start_seconds}
    start = time.perf_counter()
    if single:
        began = time.perf_counter()
        run_script([SCRIPT, str(outdir), matrix_models, single], dict(os.environ, **ENV, **env), timeout=RUN_TIMEOUT_S)
        timings["one process"] = time.perf_counter() - began
    if ddp:
        began = time.perf_counter()
        launch("ddp.yaml", [SCRIPT, str(outdir), matrix_models, ddp], timeout=RUN_TIMEOUT_S,
               extra_env=dict(VLLM_ENV, **env))
        timings["two processes"] = time.perf_counter() - began
    timings["cells in all"] = time.perf_counter() - start
    print(f"\nvLLM server cells: {', '.join(f'{k} {v:.0f} s' for k, v in timings.items())}")
    return str(outdir)


@pytest.mark.slow
@pytest.mark.parametrize("i", indices("server"), ids=matrix.cell_id)
def test_server_cell(server_cells, i):
    check_trains(matrix.CELLS[i], load(server_cells, i))


@pytest.mark.slow
@pytest.mark.parametrize("i", indices("server_ddp"), ids=matrix.cell_id)
def test_server_ddp_cell(server_cells, i):
    for rank in (0, 1):
        check_trains(matrix.CELLS[i], load(server_cells, i, rank))


# The issue's own cases, each on the transformers path: LoRA with each truncating sampler, both estimators, with and
# without score centering.
LORA_TRUNCATING = [(sampler, estimator, sc) for sampler in ("top_k", "top_p+top_k", "min_p+top_k")
                   for estimator in matrix.AXES["estimator"] for sc in ("off", "on")]


@pytest.mark.slow
@pytest.mark.parametrize("sampler,estimator,score_centering", LORA_TRUNCATING)
def test_lora_with_a_truncating_sampler_trains(tmp_path, matrix_models, sampler, estimator, score_centering):
    cell = dict(matrix.FIRST, weights="lora", sampler=sampler, estimator=estimator, score_centering=score_centering)
    result = matrix.run_cell(cell, str(tmp_path), matrix.model_paths(matrix_models))
    check_trains(cell, result)
