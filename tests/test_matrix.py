"""The combination matrix (tests/support/matrix.py): its covering array covers every pair of values of two axes, each cell
trains two optimizer steps (finite loss, trainable weights moved, the documented metrics logged, an importance ratio
of 1 on the first step where a float32 sampler logs one) or is refused when its config is built, and
docs/robustness.md holds its table.

Where the cells run: transformers cells of one process in this process; vLLM cells of one process in one
subprocess that shares a colocated engine between its trainers; every cell of two processes in one
`accelerate launch` (DDP, gloo)."""

import math
import os
from pathlib import Path

import pytest

import matrix
from test_engines import launch
from test_metrics_doc import documented_patterns
from test_vllm_engine import ENV, VLLM_ENV, run_script

HERE = Path(__file__).resolve().parent
ROBUSTNESS = HERE.parent / "docs" / "robustness.md"
SCRIPT = str(HERE / "support" / "matrix.py")
RATIO_TOL = 1e-3  # float32 sampler and trainer: TRL's first importance ratio is 1 within this
RUN_TIMEOUT_S = 900


def indices(where):
    """The cells that train in `where`: "inline" (transformers, one process), "vllm" (one process), "ddp"."""
    def place(cell):
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
    if cell["generation"] == "vllm":  # a float32 copy of the trainer samples: on-policy, the ratio is 1
        assert abs(first["sampling/importance_sampling_ratio/mean"] - 1) <= RATIO_TOL, first
    elif cell["score_centering"] == "on":  # the trainer's own float32 sampler: log q = log p
        assert first["score_centering/sampler_logp_abs_diff"] <= RATIO_TOL, first
    if cell["rollouts"] == "tools":  # the tool loop ran
        assert any(row["tools/call_frequency"] > 0 for row in result["all"])


def check_refused(cell, result):
    fields, _ = matrix.refusal(cell)
    assert result["outcome"] == "refused" and result["stage"] == "config", result
    for field in fields:
        assert field.split("=")[0] in result["message"], (field, result["message"])


@pytest.fixture(scope="session")
def matrix_models(tmp_path_factory):
    from conftest import shared_build

    return shared_build(tmp_path_factory, "matrix_models", lambda path: (matrix.model_paths(str(path)), str(path))[1])


@pytest.mark.parametrize("i", REFUSED, ids=matrix.cell_id)
def test_refused_cell(tmp_path, i):
    """Refused when `RPPConfig` is built, before any model or engine exists (whatever the cell's process count)."""
    check_refused(matrix.CELLS[i], matrix.run_cell(matrix.CELLS[i], str(tmp_path), paths=None))


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


# The issue's own cases, each on the transformers path: LoRA with each truncating sampler, both estimators, with and
# without score centering.
LORA_TRUNCATING = [(sampler, estimator, sc) for sampler in ("top_k", "top_p+top_k", "min_p+top_k")
                   for estimator in matrix.AXES["estimator"] for sc in ("off", "on")]


@pytest.mark.slow
@pytest.mark.parametrize("sampler,estimator,score_centering", LORA_TRUNCATING)
def test_lora_with_a_truncating_sampler_trains(tmp_path, matrix_models, sampler, estimator, score_centering):
    cell = dict(matrix.CELLS[0], weights="lora", sampler=sampler, estimator=estimator, score_centering=score_centering,
                generation="transformers", vllm_importance_sampling_mode="n/a", rollouts="single_turn", processes=1)
    result = matrix.run_cell(cell, str(tmp_path), matrix.model_paths(matrix_models))
    check_trains(cell, result)
