"""The combination matrix: every pair of user settings trains two optimizer steps, or is refused when the config or
the trainer is built (tests/test_matrix.py runs it; docs/robustness.md shows its table, `python tests/support/matrix.py`).

The axes are declared once, in `AXES`; a new axis joins by one line there (and, if it needs it, one line in
`config_of`). `CELLS` is a pairwise covering array of them (built greedily, `build_cells`), restricted by `applies`
(an axis that does not apply to a cell takes its "n/a" value). Pairs that `RPPConfig`/`RPPTrainer` refuse are
declared in `REFUSALS` with their reason and where they are refused, and get cells of their own.

The `vllm_server` cells train against one real vLLM server (`trl-rpp vllm-serve`, float32, on this machine's CPU,
weights through a directory), whose address the runner reads from `SERVER_URL_ENV`; tests/test_matrix.py starts it.
"""

from __future__ import annotations

import copy
import itertools
import json
import os
import sys
import time
from typing import Callable, NamedTuple

AXES = {
    "estimator": ("reinforce_plus_plus", "reinforce_plus_plus_baseline"),
    "weights": ("full", "lora", "lora_head"),
    "generation_config": ("none", "qwen3"),  # the model's own: none, or sampling defaults like Qwen3's
    "sampler": ("temperature=1", "temperature=0.7", "top_k", "top_p+top_k", "min_p+top_k"),
    "score_centering": ("off", "on"),
    "generation": ("transformers", "vllm", "vllm_server"),  # vllm: colocated; vllm_server: `trl-rpp vllm-serve`
    "vllm_importance_sampling_mode": ("n/a", "token_truncate", "token_mask", "sequence_truncate", "sequence_mask"),
    "rollouts": ("single_turn", "tools", "rollout_func"),
    "steps_per_generation": (1, 2),
    "num_iterations": (1, 2),
    "gradient_accumulation_steps": (1, 2),
    "gradient_checkpointing": ("off", "on"),
    "processes": (1, 2),
    "max_staleness": (0, 1),  # 1: the next batch is sampled on the server while this one trains
}
NAMES = tuple(AXES)
FIRST = {n: AXES[n][0] for n in NAMES}  # every axis at its first value: a cell that trains, for the extra cases
SAMPLERS = {
    "temperature=1": dict(temperature=1.0),
    "temperature=0.7": dict(temperature=0.7),
    "top_k": dict(top_k=6),
    "top_p+top_k": dict(top_p=0.8, top_k=6),
    "min_p+top_k": dict(min_p=0.1, top_k=6),
}
# Qwen3's sampling defaults (its generation_config.json), written into the model's own generation config.
QWEN3_GENERATION = dict(do_sample=True, temperature=0.6, top_k=20, top_p=0.95)


def applies(values: dict) -> bool:
    """Whether a (partial) assignment is a cell: the importance-sampling mode is vLLM's (colocated or server), so it
    is "n/a" exactly on the transformers path; a `rollout_func` samples by itself (here with transformers'
    `generate`), so its cells take the transformers path."""
    gen, mode, rollouts = values.get("generation"), values.get("vllm_importance_sampling_mode"), values.get("rollouts")
    if gen is not None and mode is not None and (gen == "transformers") != (mode == "n/a"):
        return False
    if rollouts == "rollout_func" and gen in ("vllm", "vllm_server"):
        return False
    if rollouts == "rollout_func" and mode not in (None, "n/a"):
        return False
    return True


class Refusal(NamedTuple):
    """A combination refused at construction: `when` (a predicate on a partial assignment) holds; `stage` is where,
    "config" (`RPPConfig`) or "trainer" (`RPPTrainer`, before any model is loaded or server reached); `fields`, what
    the ValueError names; `why`."""

    when: Callable[[dict], bool]
    stage: str
    fields: tuple
    why: str


SEQUENCE_MODES = ("sequence_truncate", "sequence_mask")


def _lag_without_server(v: dict) -> bool:
    """max_staleness=1 where no server samples: transformers (which "n/a" and a `rollout_func` imply) or colocated."""
    return v.get("max_staleness") == 1 and (v.get("generation") in ("transformers", "vllm")
                                            or v.get("vllm_importance_sampling_mode") == "n/a"
                                            or v.get("rollouts") == "rollout_func")


# In the order `RPPConfig`, then `RPPTrainer`, check them: a cell is refused by the first it meets.
REFUSALS = (
    Refusal(_lag_without_server, "config", ("max_staleness", "use_vllm", "vllm_mode"),
            "a batch is sampled ahead only on a vLLM server, which runs on devices of its own"),
    Refusal(lambda v: v.get("max_staleness") == 1 and v.get("vllm_importance_sampling_mode") in SEQUENCE_MODES,
            "config", ("vllm_importance_sampling_mode", "max_staleness=1"),
            "a sequence-level weight, one batch stale, is the product of many tokens' ratios"),
    Refusal(lambda v: v.get("score_centering") == "on" and v.get("vllm_importance_sampling_mode") in SEQUENCE_MODES,
            "config", ("vllm_importance_sampling_mode", "score_centering=True"),
            "a sequence-level importance weight is shared by all tokens of a response and has no per-token form to "
            "center"),
    Refusal(lambda v: v.get("max_staleness") == 1 and all(k in v for k in (
                "steps_per_generation", "num_iterations", "gradient_accumulation_steps"))
            and v["steps_per_generation"] * v["num_iterations"] % v["gradient_accumulation_steps"] != 0,
            "config", ("max_staleness", "steps_per_generation"),
            "a batch sampled ahead spans whole optimizer steps"),
    Refusal(lambda v: v.get("max_staleness") == 1 and v.get("rollouts") == "tools",
            "trainer", ("tools", "max_staleness=1"),
            "the batch sampled ahead is one request on its prompts alone; TRL's tool loop generates again inside it"),
)


def refusal(values: dict) -> Refusal | None:
    """The first refusal that a (partial) assignment meets, else None."""
    for row in REFUSALS:
        if row.when(values):
            return row
    return None


def _pairs_of(cell: dict):
    return {((a, cell[a]), (b, cell[b])) for a, b in itertools.combinations(NAMES, 2)}


def all_pairs():
    """``(trains, refused)``: the sets of value pairs of two axes that some cell can hold, split by whether a cell
    holding them trains (some does) or every cell holding them is refused."""
    trains, refused = set(), set()
    for a, b in itertools.combinations(NAMES, 2):
        for x in AXES[a]:
            for y in AXES[b]:
                pair = {a: x, b: y}
                if applies(pair):
                    (refused if refusal(pair) else trains).add(((a, x), (b, y)))
    return trains, refused


def _trains(values: dict) -> bool:
    return applies(values) and refusal(values) is None


def _complete(partial: dict, ok, prune=lambda values: False) -> dict | None:
    """A full cell extending `partial` that `ok` accepts, choosing each free axis's values in order (depth first),
    never through a partial assignment that `prune` rejects."""
    free = [n for n in NAMES if n not in partial]

    def extend(values, rest):
        if not rest:
            return values if ok(values) else None
        for v in AXES[rest[0]]:
            trial = {**values, rest[0]: v}
            if applies(trial) and not prune(trial):
                found = extend(trial, rest[1:])
                if found is not None:
                    return found
        return None

    return extend(dict(partial), free)


def _can_train(partial: dict) -> bool:
    """Whether some cell extending `partial` trains (a refusal that a partial assignment meets, every extension
    meets too)."""
    return _trains(partial) and _complete(partial, _trains, prune=lambda v: refusal(v) is not None) is not None


CANDIDATES = 30  # cells tried for each cell kept


def build_cells():
    """The covering array, built greedily (AETG: Cohen et al., IEEE TSE 1997): each cell is the best of
    `CANDIDATES` tries (seeded), each starting from a pair no cell holds yet and giving the other axes, in a random
    order, the value that holds the most uncovered pairs with the values already chosen, among those that leave the
    cell able to train; until every pair that some training cell can hold is held. Then one cell for each refused
    pair, refused for that pair's reason where a cell can be. (A generic pairwise generator, allpairspy, takes 51
    cells for these axes, 28 of them against the server: it gives `max_staleness=1`, which trains only there, to about
    half its rows.)"""
    import random

    rng = random.Random(0)
    training_pairs, refused_pairs = all_pairs()
    uncovered, cells = set(training_pairs), []
    position = {n: i for i, n in enumerate(NAMES)}

    def pair(a, x, b, y):
        return ((a, x), (b, y)) if position[a] < position[b] else ((b, y), (a, x))

    while uncovered:
        best, best_gain = None, -1
        seeds = sorted(uncovered, key=str)
        for _ in range(CANDIDATES):
            values = dict(rng.choice(seeds))
            rest = [n for n in NAMES if n not in values]
            rng.shuffle(rest)
            for name in rest:
                gains = [(sum(pair(name, v, m, values[m]) in uncovered for m in values), -i, v)
                         for i, v in enumerate(AXES[name]) if _can_train({**values, name: v})]
                values[name] = max(gains)[2]  # the most new pairs; on a tie, the axis's first value
            gain = len(_pairs_of(values) & uncovered)
            if gain > best_gain:
                best, best_gain = {n: values[n] for n in NAMES}, gain
        cells.append(best)
        uncovered -= _pairs_of(best)
    covered = set().union(*(_pairs_of(c) for c in cells))
    for refused in sorted(refused_pairs, key=str):
        if refused not in covered:  # a cell refused for this pair's reason where one exists, else for another
            why = refusal(dict(refused))
            cell = _complete(dict(refused), lambda v: refusal(v) == why) or _complete(dict(refused), lambda v: True)
            cells.append(cell)
            covered |= _pairs_of(cell)
    return cells


CELLS = build_cells()


def cell_id(i: int) -> str:
    return f"cell{i:02d}"


# ----------------------------------------------------------------------------------------------------------------
# A cell's run
# ----------------------------------------------------------------------------------------------------------------

MAX_STEPS = 2


def noise_reward(completions, **kwargs):
    """A uniform random reward (Python's `random`, which the trainer's seed seeds), so that groups of identical
    completions (a warmed-up model at a low temperature) still give non-zero advantages and the weights move."""
    import random

    return [random.random() for _ in completions]


def config_of(cell: dict, outdir: str):
    """The `RPPConfig` of a cell (raises where `RPPConfig` refuses it)."""
    from trl_rpp import RPPConfig

    kw = dict(
        output_dir=outdir, advantage_estimator=cell["estimator"], report_to="none", bf16=False, seed=0,
        per_device_train_batch_size=4, num_generations=4, learning_rate=5e-3,
        max_completion_length=24 if cell["rollouts"] == "tools" else 8,  # a tool call takes about 20 tokens
        max_steps=MAX_STEPS, logging_steps=1, save_strategy="no", disable_dropout=True,
        steps_per_generation=cell["steps_per_generation"], num_iterations=cell["num_iterations"],
        gradient_accumulation_steps=cell["gradient_accumulation_steps"],
        gradient_checkpointing=cell["gradient_checkpointing"] == "on",
        score_centering=cell["score_centering"] == "on", use_cpu=True,
        **SAMPLERS[cell["sampler"]],
    )  # fmt: skip
    if cell["score_centering"] == "on":
        kw["score_centering_top_k"] = 4
    if cell["generation"] == "vllm":
        kw.update(use_vllm=True, vllm_mode="colocate", vllm_dtype="float32", vllm_gpu_memory_utilization=0.1,
                  vllm_max_model_length=256, vllm_importance_sampling_mode=cell["vllm_importance_sampling_mode"])
    elif cell["generation"] == "vllm_server":  # float32: the server's own dtype (`trl-rpp vllm-serve`'s default)
        kw.update(use_vllm=True, vllm_mode="server", vllm_server_base_url=server_url(),
                  vllm_server_weight_sync="disk", vllm_server_weight_dir=os.path.join(outdir, "weights"),
                  vllm_importance_sampling_mode=cell["vllm_importance_sampling_mode"])
    return RPPConfig(max_staleness=cell["max_staleness"], **kw)


# The address of the server the `vllm_server` cells train against (tests/test_matrix.py starts it and sets this). A
# refused cell never reaches it: the default is an address that nothing listens on.
SERVER_URL_ENV = "RPP_MATRIX_SERVER_URL"


def server_url() -> str:
    return os.environ.get(SERVER_URL_ENV, "http://127.0.0.1:9")


# The warm-up stops at this mean token loss: the model calls its tool, yet keeps more than one token above `min_p` and
# `top_p` (at the suite's 3e-3 every kept set is one token: log pi(y | S) = 0, no gradient to move the weights).
TOOL_MODEL_LOSS = 0.3


def model_paths(root: str) -> dict:
    """The matrix's model (the tiny tool-calling chat model, with 2 heads of 32 so that vLLM's CPU attention runs
    it, warmed up to `TOOL_MODEL_LOSS`) with no generation config of its own, and a copy with Qwen3's sampling
    defaults."""
    from transformers import GenerationConfig

    from trl_rpp.testing.tool_model import build_tool_model

    plain = os.path.join(root, "none")
    build_tool_model(plain, num_attention_heads=2, target_loss=TOOL_MODEL_LOSS)
    qwen3 = os.path.join(root, "qwen3")
    if not os.path.exists(os.path.join(qwen3, "generation_config.json")):
        import shutil

        shutil.copytree(plain, qwen3 + ".tmp", dirs_exist_ok=True)
        gen = GenerationConfig.from_pretrained(plain) if os.path.exists(os.path.join(plain, "generation_config.json")) \
            else GenerationConfig()
        gen.update(**QWEN3_GENERATION)
        gen.save_pretrained(qwen3 + ".tmp")
        os.replace(qwen3 + ".tmp", qwen3)
    return {"none": plain, "qwen3": qwen3}


def rollout_func(prompts, trainer):
    """A two-turn rollout with an environment token between the turns, sampled with the trainer's own `generate`
    settings, returning what the trainer's record needs: the sampled tokens' log-probs, and with score centering or a
    replayed truncation the record's lists (`logprob_token_ids`), as vLLM reports them."""
    import torch

    from trl_rpp.records.capture import SamplerTopKCapture, capturing_generate, SamplerSupportCapture

    tokenizer = trainer.processing_class
    model = trainer.accelerator.unwrap_model(trainer.model)
    config = copy.deepcopy(trainer.generation_config)
    config.update(max_new_tokens=8)
    width, bound = trainer._rpp_width, trainer._rpp_bound
    out = {"prompt_ids": [], "completion_ids": [], "logprobs": [], "logprob_token_ids": [], "env_mask": []}

    def turn(ids):
        capture = (SamplerSupportCapture(width) if bound else
                   SamplerTopKCapture(max(width, 1), trainer.temperature))
        with torch.no_grad(), capturing_generate(model, capture, last=bound is not None):
            seq = model.generate(torch.tensor([ids], device=model.device), generation_config=config)
        new = seq[0, len(ids):].tolist()
        rec_ids, rec_logps, sampled = capture.tensors(len(new))
        lists_lp, lists_id = [], []
        for t, token in enumerate(new):
            lp = rec_logps[0, t].tolist() if width else [float(sampled[0, t])]
            tid = rec_ids[0, t].tolist() if width else [token]
            if token not in tid:  # vLLM's form: the sampled token appended when it is not among the k
                lp, tid = lp + [float(sampled[0, t])], tid + [token]
            lists_lp.append(lp)
            lists_id.append(tid)
        return new, lists_lp, lists_id

    for prompt in prompts:
        prompt_ids = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True,
                                                   return_dict=True)["input_ids"]
        t1, lp1, id1 = turn(prompt_ids)
        env = [tokenizer.eos_token_id]
        t2, lp2, id2 = turn(prompt_ids + t1 + env)
        out["prompt_ids"].append(prompt_ids)
        out["completion_ids"].append(t1 + env + t2)
        pad = [[0.0]] if not width else [[0.0] * width]
        out["logprobs"].append(lp1 + pad + lp2)
        out["logprob_token_ids"].append(id1 + [[0] * len(pad[0])] + id2)
        out["env_mask"].append([1] * len(t1) + [0] + [1] * len(t2))
    if not width:  # without a record TRL takes one log-prob per token
        out["logprobs"] = [[lp[0] for lp in row] for row in out["logprobs"]]
        del out["logprob_token_ids"]
    return out


def trainer_of(cell: dict, args, paths: dict):
    """The cell's `RPPTrainer` (raises where `RPPTrainer` refuses it)."""
    from peft import LoraConfig

    from trl_rpp import RPPTrainer
    from trl_rpp.testing.tool_model import correct_product_reward, multiply, tool_dataset

    kw = {}
    if cell["weights"] == "lora":
        kw["peft_config"] = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    elif cell["weights"] == "lora_head":  # the head's adapter, read by every log-prob path (trl_rpp.lm_head)
        kw["peft_config"] = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "lm_head"])
    if cell["rollouts"] == "tools":
        kw["tools"] = [multiply]
    elif cell["rollouts"] == "rollout_func":
        kw["rollout_func"] = rollout_func
    return RPPTrainer(model=paths[cell["generation_config"]], reward_funcs=[correct_product_reward, noise_reward],
                      args=args, train_dataset=tool_dataset(64, seed=1), **kw)


def run_cell(cell: dict, outdir: str, paths: dict) -> dict:
    """Build and train a cell; what the tests check, as plain data. ``outcome`` is "refused" (with ``stage``,
    "config" or "trainer", and the message) when construction raised a ValueError, else "trains"."""
    try:
        args = config_of(cell, outdir)
    except ValueError as err:
        return {"outcome": "refused", "stage": "config", "message": str(err)}
    try:
        trainer = trainer_of(cell, args, paths)
    except ValueError as err:
        return {"outcome": "refused", "stage": "trainer", "message": str(err)}
    trainable = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    start = time.perf_counter()
    trainer.train()
    seconds = time.perf_counter() - start
    after = dict(trainer.model.named_parameters())
    moved = max(float((after[n].detach() - p).abs().max()) for n, p in trainable.items())
    history = [row for row in trainer.state.log_history if "loss" in row]
    return {
        "outcome": "trains", "steps": trainer.state.global_step, "moved": moved, "trainable": len(trainable),
        "seconds": seconds,
        "losses": [row["loss"] for row in history],
        "keys": sorted({k for row in trainer.state.log_history for k in row}),
        "first": {k: v for k, v in history[0].items() if isinstance(v, (int, float))} if history else {},
        "all": [{k: v for k, v in row.items() if isinstance(v, (int, float))} for row in history],
    }


def run_vllm_tie(outdir: str, paths: dict) -> dict:
    """One step on a colocated engine whose model ties every token (all head rows equal): at `top_k=2` the engine
    keeps the whole vocabulary, so every record of `2 * top_k = 4` ids is full. The run trains; every model token
    leaves the loss (`sampling/tie_overflow` counts them)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = os.path.join(outdir, "tied")
    model = AutoModelForCausalLM.from_pretrained(paths["none"], dtype=torch.float32)
    with torch.no_grad():
        head = model.get_output_embeddings().weight
        head.copy_(head[:1].expand_as(head))
    model.save_pretrained(path)
    AutoTokenizer.from_pretrained(paths["none"]).save_pretrained(path)
    cell = dict(FIRST, sampler="top_k", generation="vllm", vllm_importance_sampling_mode="token_truncate")
    args = config_of(cell, os.path.join(outdir, "run"))
    args.top_k, args.max_steps = 2, 1
    trainer = trainer_of(cell, args, {"none": path})
    trainer.train()
    row = next(r for r in trainer.state.log_history if "loss" in r)
    return {"steps": trainer.state.global_step, "row": {k: v for k, v in row.items() if isinstance(v, (int, float))}}


def expected_keys(cell: dict) -> set:
    """The metrics docs/rpp_trainer.md ("Logged metrics") lists for a cell's settings."""
    keys = {"advantages/raw_mean", "advantages/raw_std", "advantages/mean", "advantages/std",
            "advantages/valid_tokens", "advantages/zero_variance", "advantages/empty_batch", "policy_loss", "ppo_kl",
            "entropy", "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean", "reward",
            "reward_std", "loss", "grad_norm", "learning_rate", "completions/mean_length", "skipped_steps"}
    if cell["estimator"] == "reinforce_plus_plus":
        keys |= {"returns/mean", "returns/std", "returns/max", "returns/min", "ref_kl/k1_mean"}
    else:
        keys |= {"kl_loss"}
    if cell["score_centering"] == "on":
        keys |= {"score_centering/sampler_head_mass", "score_centering/trainer_head_mass", "score_centering/coeff_l1",
                 "score_centering/sampler_logp_abs_diff"}
    if cell["generation"] == "vllm_server":
        keys |= {"sampling/staleness"}
    if cell["generation"] in ("vllm", "vllm_server"):
        keys |= {"sampling/sampling_logp_difference/mean", "sampling/sampling_logp_difference/max",
                 "sampling/importance_sampling_ratio/min", "sampling/importance_sampling_ratio/mean",
                 "sampling/importance_sampling_ratio/max"}
    # The model's own sampling defaults never apply: TRL's generation settings override them on both paths.
    if cell["sampler"] not in ("temperature=1", "temperature=0.7"):
        keys |= {"sampling/tie_overflow"}
    if cell["rollouts"] == "tools":
        keys |= {"tools/call_frequency", "tools/failure_frequency"}
    return keys


# ----------------------------------------------------------------------------------------------------------------
# The table of docs/robustness.md
# ----------------------------------------------------------------------------------------------------------------

TABLE_START = "<!-- combination matrix: generated by `python tests/support/matrix.py`, checked by tests/test_matrix.py -->"
TABLE_END = "<!-- end of the combination matrix -->"
SHORT = {"reinforce_plus_plus": "rpp", "reinforce_plus_plus_baseline": "baseline"}


STAGES = {"config": "RPPConfig", "trainer": "RPPTrainer"}


def outcome_of(cell: dict) -> str:
    found = refusal(cell)
    return "trains" if found is None else f"refused by {STAGES[found.stage]}: {', '.join(found.fields)} ({found.why})"


def table() -> str:
    """The markdown table of every cell and its outcome, between the markers docs/robustness.md holds it in."""
    head = "| # | " + " | ".join(n.replace("_", " ") for n in NAMES) + " | outcome |"
    rows = [head, "|" + " --- |" * (len(NAMES) + 2)]
    for i, cell in enumerate(CELLS):
        values = [SHORT.get(str(cell[n]), str(cell[n])) for n in NAMES]
        rows.append(f"| {i} | " + " | ".join(values) + f" | {outcome_of(cell)} |")
    training, refused = all_pairs()
    server = sum(c["generation"] == "vllm_server" for c in CELLS)
    summary = (f"{len(CELLS)} cells ({server} of them against a vLLM server) cover all {len(training) + len(refused)} "
               f"pairs of values of two axes ({len(refused)} of them refused at construction).")
    return "\n".join([TABLE_START, summary, "", *rows, TABLE_END])


def share_engines(min_logprobs: int = 64):
    """One colocated vLLM engine per model folder for every trainer of this process, instead of one per trainer (a
    further engine costs about 10 s). Each trainer pushes its own weights at its first generation (TRL syncs before
    it), and each cell checks that its first importance ratio is 1, which a stale engine would fail."""
    import trl.generation.vllm_generation as vllm_generation

    real, built = vllm_generation.LLM, {}

    def shared_llm(*args, **kwargs):
        kwargs["max_logprobs"] = max(kwargs.get("max_logprobs") or 0, min_logprobs)
        key = (kwargs["model"], str(kwargs.get("dtype")))
        if key not in built:
            built[key] = real(*args, **kwargs)
        return built[key]

    vllm_generation.LLM = shared_llm


def main(argv):
    """``python tests/support/matrix.py``: print the table. ``python tests/support/matrix.py OUTDIR ROOT i,j,...``: run those cells
    (one process, or each process of an `accelerate launch`), writing ``cell<i>_rank<r>.json`` into OUTDIR."""
    if not argv:
        print(table())
        return
    outdir, root, which = argv[0], argv[1], [int(i) for i in argv[2].split(",")]
    if "ties" in argv[3:] or any(CELLS[i]["generation"] == "vllm" for i in which):
        share_engines()
    rank = int(os.environ.get("RANK", "0"))
    paths = model_paths(root) if rank == 0 else None
    if os.environ.get("WORLD_SIZE", "1") != "1":
        import torch.distributed as dist
        from accelerate import PartialState

        PartialState()  # the process group, before the first trainer (rank 0 built the models first)
        dist.barrier()
        paths = model_paths(root)
    if "ties" in argv[3:]:  # `python tests/support/matrix.py OUTDIR ROOT i,j,... ties`
        with open(os.path.join(outdir, "ties.json"), "w") as f:
            json.dump(run_vllm_tie(outdir, paths), f)
    for i in which:
        result = run_cell(CELLS[i], os.path.join(outdir, cell_id(i)), paths)
        with open(os.path.join(outdir, f"{cell_id(i)}_rank{rank}.json"), "w") as f:
            json.dump(result, f)
        print(f"{cell_id(i)} {result['outcome']}", flush=True)


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    main(sys.argv[1:])
    if len(sys.argv) > 1:
        from trainer_helpers import finish_launched

        finish_launched(sys.argv[1])
