"""The `trl-rpp` CLI (`trl_rpp/cli.py`): flags, datasets and splits, rewards, dry run, and the console script.

The slow tests run the installed `trl-rpp` command end to end on a tiny local model, with this checkout first on
`PYTHONPATH`, and check its exit status: 0 after a finished run, 75 after a preemption, non-zero on an error.
"""

import json
import os
import re
import subprocess
import sys
from importlib.metadata import PathDistribution
from pathlib import Path

import pytest

from trl_rpp import cli

REPO = Path(__file__).resolve().parents[1]


def _env():
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", WANDB_MODE="offline", PYTHONPATH=str(REPO))
    env.pop("CUDA_VISIBLE_DEVICES", None)
    return env


def _args(*extra):
    base = ["--model_name_or_path", "m", "--output_dir", "unused", "--use_cpu", "--bf16", "false",
            "--report_to", "none"]  # fmt: skip
    return cli.make_parser().parse_args_and_config([*base, *extra])


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


ROWS = [{"prompt": "a:", "answer": "1"}, {"prompt": "b:", "answer": "2"}]


# -- flags ---------------------------------------------------------------------------------------------------------


def test_no_offered_negation_always_fails():
    """Every `--no_<field>` the parser offers builds a config (with the setting it needs, where one is named below);
    the one RPPConfig always rejects is not offered."""
    needs = {"--no_replay_sampler_support": ["--top_k", "6"]}  # only a truncating sampler is replayed
    parser = cli.make_parser()
    negations = [a.option_strings[0] for a in parser._actions if a.option_strings and a.option_strings[0].startswith("--no_")]
    assert "--no_normalize_advantages" not in negations and "--no_normalize_advantages" not in parser.format_help()
    assert "--no_shuffle_dataset" in negations  # the removal is targeted, not all negations
    for flag in negations:
        _args(flag, *needs.get(flag, []))  # raises if RPPConfig rejects it
    with pytest.raises(ValueError, match=r"^replay_sampler_support=False is not supported with no truncating"):
        _args("--no_replay_sampler_support")
    with pytest.raises(ValueError, match=r"not used.*--no_normalize_advantages"):
        _args("--no_normalize_advantages")


def test_help_opens_with_a_description_and_two_examples_that_run(capsys):
    """`trl-rpp --help` starts with a one-line usage, what the command does and two examples, before the flags; each
    example builds its configuration as written (a dry run: the GPU one says it needs `--bf16 false` here)."""
    import shlex

    text = cli.make_parser().format_help()
    head = text[: text.index("\noptions:")]
    assert head.startswith("usage: trl-rpp --model_name_or_path MODEL")
    assert "REINFORCE++" in head and "examples:" in head
    examples = [shlex.split(line.strip()) for line in head.replace("\\\n", " ").splitlines()
                if line.strip().startswith("trl-rpp --")]
    assert len(examples) == 2 and ["--bf16", "false"] == examples[1][examples[1].index("--bf16"):][:2]
    for argv in examples:
        assert cli.main([*argv[1:], "--report_to", "none", "--dry_run"]) == 0
        out = capsys.readouterr().out
        config = json.loads(out[out.index("{"):])  # after any line a library prints at import
        assert config["reward_funcs"] == ["final_answer"] and config["dataset_name"] == "data/gsm8k"


def test_help_lists_the_rpp_fields_and_the_script_arguments():
    text = cli.make_parser().format_help()
    for flag in ("--advantage_estimator", "--kl_coef", "--use_kl_loss", "--reward_funcs", "--eval_dataset_name",
                 "--dry_run", "--dataset_test_split", "--reward_model_name_or_path", "--use_peft",
                 "--resume_from_checkpoint", "--push_to_hub"):  # fmt: skip
        assert flag in text, flag


def _help_lines(monkeypatch):
    """`trl-rpp --help` (the same parser) rendered one option per line: flag -> its help text."""
    monkeypatch.setenv("COLUMNS", "100000")  # argparse wraps at the terminal width; unwrapped, one line per flag
    helps, flag = {}, None
    for line in cli.make_parser().format_help().splitlines():
        match = re.match(r"^  (--[\w-]+)(?: \S+)?(?:, --[\w-]+(?: \S+)?)*(?:  +(\S.*))?$", line)
        if match:  # a flag, its help on the same line or (long flags) on the next
            flag = match.group(1)
            helps[flag] = match.group(2) or ""
        elif flag and line.startswith("      "):
            helps[flag] += " " + line.strip()
        else:
            flag = None
    return helps


def test_help_of_each_rejected_grpo_flag_says_what_is_accepted(monkeypatch):
    """Each GRPO flag that RPPConfig accepts at one value only says so in `--help`, with that value; GRPO's own help
    (`--beta`: "use a value of 0.001") is not shown for it."""
    from trl_rpp.config import rejected_grpo_fields

    helps = _help_lines(monkeypatch)
    fields = rejected_grpo_fields()
    assert {"beta", "delta", "sync_ref_model", "loss_type", "scale_rewards"} <= set(fields)
    for name, (value, _) in fields.items():
        shown = value if isinstance(value, str) else repr(value)
        text = helps[f"--{name}"]
        assert re.search(rf"[Oo]nly '?{re.escape(shown)}'? .*is accepted", text), (name, text)
    assert "0.001" not in helps["--beta"] and "kl_coef" in helps["--beta"]
    assert "only 1.0 is accepted" in helps["--top_p"] and "--score_centering" in helps["--top_p"]
    assert "only 0 is accepted" in helps["--top_k"] and "--score_centering" in helps["--top_k"]


def test_rejected_grpo_fields_match_the_validators():
    """The table the help is built from (`rejected_grpo_fields`) is the set that `tests/test_config_fields.py`
    classifies as rejected (where every other value is shown to raise), and each accepted value is the default."""
    from test_config_fields import GRPO_FIELDS

    from trl_rpp import RPPConfig
    from trl_rpp.config import rejected_grpo_fields

    fields = rejected_grpo_fields()
    assert set(fields) == {name for name, (kind, _, _) in GRPO_FIELDS.items() if kind == "rejected"}
    config = RPPConfig(output_dir="unused", use_cpu=True, bf16=False, report_to="none")
    for name, (value, _) in fields.items():
        assert getattr(config, name) == value, name
        bad = GRPO_FIELDS[name][1][0]
        with pytest.raises(ValueError, match=rf"^{name}="):
            RPPConfig(output_dir="unused", use_cpu=True, bf16=False, report_to="none", **{name: bad})


def test_lora_flags_without_use_peft_are_rejected():
    """TRL builds no adapter without --use_peft, so its LoRA flags would be ignored: an error instead."""
    for flag, value in (("--lora_r", "8"), ("--lora_target_modules", "q_proj"), ("--use_dora", "true")):
        _, _, model_args = _args(flag, value)
        with pytest.raises(ValueError, match=rf"^{flag} .* is given without --use_peft.*accepted: add --use_peft"):
            cli.check_model_args(model_args)
        _, _, model_args = _args(flag, value, "--use_peft")
        cli.check_model_args(model_args)  # with --use_peft they configure the adapter


# -- datasets and splits ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["json", "jsonl", "csv", "parquet", "dir", "save_to_disk"])
def test_local_dataset_formats(tmp_path, fmt):
    from datasets import Dataset

    ds = Dataset.from_list(ROWS)
    if fmt in ("json", "jsonl"):
        path = tmp_path / f"d.{fmt}"
        ds.to_json(str(path), lines=fmt == "jsonl")
    elif fmt == "csv":
        path = tmp_path / "d.csv"
        ds.to_csv(str(path), index=False)
    elif fmt == "parquet":
        path = tmp_path / "d.parquet"
        ds.to_parquet(str(path))
    elif fmt == "dir":
        path = tmp_path / "data"
        path.mkdir()
        ds.to_json(str(path / "train.jsonl"))
    else:
        path = tmp_path / "saved"
        ds.save_to_disk(str(path))
    assert cli.load_prompt_dataset(str(path))["prompt"] == ["a:", "b:"]


def test_dataset_without_prompt_column_fails_early(tmp_path):
    data = _write(tmp_path / "bad.jsonl", [{"question": "1+1?", "answer": "2"}])
    with pytest.raises(ValueError, match=r"no 'prompt' column.*(question.*answer|answer.*question)"):
        cli.load_prompt_dataset(str(data))


def test_single_file_never_evaluates_on_its_training_rows(tmp_path):
    data = _write(tmp_path / "train.jsonl", ROWS)
    script_args, args, _ = _args("--dataset_name", str(data), "--eval_strategy", "steps", "--eval_steps", "1")
    with pytest.raises(ValueError, match=r"--eval_strategy 'steps' needs evaluation data.*single split.*--eval_dataset_name"):
        cli.load_datasets(script_args, args)
    # Asking a single file for another split is an error too (it has only one).
    with pytest.raises(ValueError, match=r"single split, so split 'validation' does not exist"):
        cli.load_prompt_dataset(str(data), split="validation")
    script_args, args, _ = _args("--dataset_name", str(data), "--dataset_train_split", "validation")
    with pytest.raises(ValueError, match="single split"):
        cli.load_datasets(script_args, args)


def test_eval_file_is_used_for_evaluation(tmp_path):
    train = _write(tmp_path / "train.jsonl", ROWS)
    held_out = _write(tmp_path / "held_out.jsonl", [{"prompt": "z:", "answer": "9"}])
    script_args, args, _ = _args("--dataset_name", str(train), "--eval_strategy", "steps", "--eval_steps", "1",
                                 "--eval_dataset_name", str(held_out))  # fmt: skip
    train_ds, eval_ds = cli.load_datasets(script_args, args)
    assert train_ds["prompt"] == ["a:", "b:"] and eval_ds["prompt"] == ["z:"]
    # Without evaluation, an eval file would be silently unused: rejected.
    script_args, args, _ = _args("--dataset_name", str(train), "--eval_dataset_name", str(held_out))
    with pytest.raises(ValueError, match="--eval_strategy is 'no'"):
        cli.load_datasets(script_args, args)


def test_directory_splits_train_and_test(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    _write(data / "train.jsonl", ROWS)
    _write(data / "test.jsonl", [{"prompt": "t:", "answer": "3"}])
    script_args, args, _ = _args("--dataset_name", str(data), "--eval_strategy", "steps", "--eval_steps", "1")
    train_ds, eval_ds = cli.load_datasets(script_args, args)
    assert train_ds["prompt"] == ["a:", "b:"] and eval_ds["prompt"] == ["t:"]
    # A split the directory does not have is an error, not a fallback to another split.
    script_args, args, _ = _args("--dataset_name", str(data), "--eval_strategy", "steps", "--eval_steps", "1",
                                 "--dataset_test_split", "validation")  # fmt: skip
    with pytest.raises(ValueError, match="validation"):
        cli.load_datasets(script_args, args)


def test_saved_dataset_dict_splits(tmp_path):
    from datasets import Dataset, DatasetDict

    path = tmp_path / "dd"
    DatasetDict(train=Dataset.from_list(ROWS), test=Dataset.from_list([{"prompt": "t:", "answer": "3"}])).save_to_disk(str(path))
    assert cli.load_prompt_dataset(str(path), split="test")["prompt"] == ["t:"]
    with pytest.raises(ValueError, match=r"no split 'validation'; its splits are \['test', 'train'\]"):
        cli.load_prompt_dataset(str(path), split="validation")


# -- rewards -------------------------------------------------------------------------------------------------------


def _config():
    from trl_rpp import RPPConfig

    return RPPConfig(output_dir="unused", use_cpu=True, bf16=False, max_completion_length=16, report_to="none")


def test_reward_registry():
    args = _config()
    names = ["final_answer", "exact_answer", "get_soft_overlong_punishment", "think_format_reward"]
    funcs = cli.resolve_reward_funcs(names, args)
    assert len(funcs) == 4 and all(callable(f) for f in funcs)
    assert funcs[0](["so \\boxed{12}"], answer=["12"]) == [1.0]
    expected = r"Expected one of \['accuracy_reward', 'exact_answer', 'final_answer', .*or a dotted import path"
    with pytest.raises(ValueError, match=r"reward function 'nope' given to --reward_funcs\. " + expected):
        cli.resolve_reward_funcs(["final_answer", "nope"], args)
    with pytest.raises(ValueError, match=r"No reward: pass --reward_funcs and/or --reward_model_name_or_path"):
        cli.resolve_reward_funcs([], args)


def test_test_only_reward_is_not_offered():
    """The tiny copy task's reward is reachable from tests by its import path only, not as a built-in name."""
    assert "copy_first_char" not in cli.make_parser().format_help()
    assert "copy_first_char" not in cli.reward_registry(_config())
    (func,) = cli.resolve_reward_funcs(["trl_rpp.testing.tiny.copy_first_char_reward"], _config())
    assert func(["a:", "b:"], ["a", "c"]) == [1.0, 0.0]


REWARD_MODULE = """
def ends_with_bang(completions, **kwargs):
    return [1.0 if c.endswith("!") else 0.0 for c in completions]

NOT_A_FUNCTION = 3
"""


def test_dotted_reward_path_is_imported_from_the_working_directory(tmp_path, monkeypatch, capsys):
    """As `trl grpo` does: `module.function`, the module found in the current directory; the reward model first."""
    (tmp_path / "my_rewards.py").write_text(REWARD_MODULE)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    monkeypatch.delitem(sys.modules, "my_rewards", raising=False)
    funcs = cli.resolve_reward_funcs(["exact_answer", "my_rewards.ends_with_bang"], _config(), "org/reward-model")
    assert funcs[0] == "org/reward-model" and funcs[1] is cli.exact_answer
    assert funcs[2].__module__ == "my_rewards" and funcs[2](["yes!", "no"]) == [1.0, 0.0]
    # Through the command line: the dry run resolves the rewards (a bad one fails there) and shows both flags.
    cli.main(["--model_name_or_path", "m", "--dataset_name", "d", "--reward_model_name_or_path", "org/reward-model",
              "--reward_funcs", "my_rewards.ends_with_bang", "--use_cpu", "--bf16", "false", "--output_dir", "o",
              "--report_to", "none", "--dry_run"])  # fmt: skip
    config = json.loads(capsys.readouterr().out)
    assert config["reward_model_name_or_path"] == "org/reward-model"
    assert config["reward_funcs"] == ["my_rewards.ends_with_bang"]


def test_the_working_directory_is_on_sys_path_only_while_the_reward_imports(tmp_path, monkeypatch):
    """A stray `json.py` next to the command cannot replace the standard module after the reward is imported."""
    (tmp_path / "my_rewards.py").write_text(REWARD_MODULE)
    (tmp_path / "json.py").write_text("SHADOW = True\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    monkeypatch.delitem(sys.modules, "my_rewards", raising=False)
    monkeypatch.delitem(sys.modules, "json")  # as if not imported yet; restored afterwards
    assert cli.import_reward_func("my_rewards.ends_with_bang", {})(["a!"]) == [1.0]
    assert str(tmp_path) not in sys.path
    import json as imported_later

    assert not hasattr(imported_later, "SHADOW") and imported_later.__file__ != str(tmp_path / "json.py")


PREEMPTING_REWARD = """import os
import signal


def copies(prompts, completions, **kwargs):
    os.kill(os.getpid(), signal.SIGTERM)  # as a scheduler would, in the middle of step 1
    return [float(c[:1] == p[:1]) for p, c in zip(prompts, completions)]
"""


@pytest.mark.slow
def test_console_script_exits_75_when_preempted_after_saving(tmp_path, tiny_model):
    """`train()` raises `TrainingPreempted`, an ordinary exception; the installed command turns it into exit status 75,
    with the checkpoint saved and no final model."""
    from trl_rpp.testing.tiny import copy_task_dataset

    (tmp_path / "preempting_reward.py").write_text(PREEMPTING_REWARD)
    data = _write(tmp_path / "train.jsonl", copy_task_dataset(16, seed=1))
    out = tmp_path / "out"
    proc = subprocess.run([console_script(), "--model_name_or_path", tiny_model, "--dataset_name", str(data),
                           "--reward_funcs", "preempting_reward.copies", "--max_steps", "3",
                           "--per_device_train_batch_size", "4", "--num_generations", "4", "--max_completion_length",
                           "2", "--save_strategy", "no", "--use_cpu", "--bf16", "false", "--report_to", "none",
                           "--output_dir", str(out)], cwd=tmp_path, env=_env(), capture_output=True, text=True,
                          timeout=300)  # fmt: skip
    assert proc.returncode == 75, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert "TrainingPreempted" in proc.stderr  # the reason is printed, not only the status
    assert os.path.isdir(out / "checkpoint-1") and not (out / "model.safetensors").exists()  # no final save


def test_console_script_exits_non_zero_on_an_error(tmp_path):
    """An error ends the installed command with a non-zero status and its message, before anything loads."""
    proc = subprocess.run([console_script(), "--model_name_or_path", "m", "--dataset_name", "d", "--reward_funcs",
                           "no_such_module.reward", "--use_cpu", "--bf16", "false", "--report_to", "none",
                           "--output_dir", str(tmp_path / "o")], cwd=tmp_path, env=_env(), capture_output=True,
                          text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert "Could not load reward function 'no_such_module.reward' given to --reward_funcs" in proc.stderr


@pytest.mark.parametrize(
    "entry,pattern",
    [
        ("no_such_module.reward", r"importing module 'no_such_module' failed \(ModuleNotFoundError"),
        ("my_rewards.missing", r"module 'my_rewards' has no attribute 'missing'"),
        ("my_rewards.NOT_A_FUNCTION", r"it is a int, not a function"),
    ],
)
def test_bad_reward_path_names_the_flag_before_anything_loads(tmp_path, monkeypatch, entry, pattern):
    (tmp_path / "my_rewards.py").write_text(REWARD_MODULE)
    monkeypatch.chdir(tmp_path)
    monkeypatch.delitem(sys.modules, "my_rewards", raising=False)
    argv = ["--model_name_or_path", "m", "--dataset_name", "d", "--reward_funcs", entry, "--use_cpu", "--bf16",
            "false", "--output_dir", "o", "--report_to", "none"]  # fmt: skip
    message = rf"reward function '{re.escape(entry)}' given to --reward_funcs: {pattern}"
    for extra in (["--dry_run"], []):  # the dry run, and training, which fails before the (absent) data is read
        with pytest.raises(ValueError, match=message):
            cli.main([*argv, *extra])


def test_exact_answer_scores_the_first_integer():
    completions = ["The answer is 1,234.", [{"role": "assistant", "content": "-7 apples"}], "no number", "12 then 3"]
    assert cli.exact_answer(completions, ["step 1... #### 1234", "-7", "3", "3"]) == [1.0, 1.0, 0.0, 0.0]


# -- save report ---------------------------------------------------------------------------------------------------


def test_save_report_claims_only_weights_this_save_wrote(tmp_path):
    """`save_model` writes no weights under FSDP with SHARDED_STATE_DICT (and under ZeRO-3 without the 16-bit
    gather): the CLI then warns instead of claiming a save, also when an earlier run left weights there."""
    saved, line = cli.save_report(tmp_path, cli.weight_files(tmp_path))
    assert not saved and line.startswith(f"WARNING: training finished, but no model weights were written to {tmp_path}")
    assert "FULL_STATE_DICT" in line and "zero3_save_16bit_model" in line
    (tmp_path / "model.safetensors").write_bytes(b"x" * 8)  # written by this save
    assert cli.save_report(tmp_path, {}) == (True, f"Model and model card saved to {tmp_path} (model.safetensors).")
    before = cli.weight_files(tmp_path)
    assert not cli.save_report(tmp_path, before)[0]  # an earlier run's file, untouched by this save
    (tmp_path / "adapter_model.safetensors").write_bytes(b"x")
    assert cli.save_report(tmp_path, before) == (True, f"Model and model card saved to {tmp_path} "
                                                       "(adapter_model.safetensors).")
    (tmp_path / "model.safetensors").write_bytes(b"x" * 9)  # rewritten: its size (and mtime) changed
    assert cli.save_report(tmp_path, before)[1].endswith("(model.safetensors, adapter_model.safetensors).")


# -- dry run -------------------------------------------------------------------------------------------------------


def test_dry_run_prints_the_resolved_configuration(capsys):
    cli.main(["--model_name_or_path", "m", "--dataset_name", "d", "--reward_funcs", "final_answer", "--use_cpu",
              "--bf16", "false", "--advantage_estimator", "reinforce_plus_plus_baseline", "--output_dir", "o",
              "--report_to", "none", "--dry_run"])  # fmt: skip
    config = json.loads(capsys.readouterr().out)
    # Per-estimator defaults resolved by RPPConfig, not the None the flags left.
    assert (config["kl_coef"], config["use_kl_loss"], config["kl_loss_type"], config["kl_loss_coef"]) == (0.0, True, "k2", 0.01)
    assert (config["loss_type"], config["scale_rewards"], config["beta"]) == ("grpo", "none", 0.0)
    assert config["reward_funcs"] == ["final_answer"] and config["model_name_or_path"] == "m"
    assert config["peft"] is None and config["reward_model_name_or_path"] is None
    assert "note" not in config


# -- console script ------------------------------------------------------------------------------------------------


def console_script() -> str:
    """The `trl-rpp` command that `pip install -e .` (`make install`) wrote next to this Python. The tests run it with
    this checkout first on `PYTHONPATH` (`_env`), so it runs the code under test whichever checkout installed it."""
    path = Path(sys.executable).parent / "trl-rpp"
    assert path.is_file(), f"no installed trl-rpp command next to {sys.executable}: run `make install`"
    return str(path)



def test_console_script_is_declared_and_resolves_to_the_cli(tmp_path):
    """setup.py's metadata (as `pip install` would write it) declares `trl-rpp`, and it loads `trl_rpp.cli.main`."""
    proc = subprocess.run([sys.executable, "setup.py", "-q", "egg_info", "--egg-base", str(tmp_path)], cwd=REPO,
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    (egg_info,) = tmp_path.glob("*.egg-info")
    scripts = [ep for ep in PathDistribution(egg_info).entry_points if ep.group == "console_scripts"]
    assert [(ep.name, ep.value) for ep in scripts] == [("trl-rpp", "trl_rpp.cli:main")]
    assert scripts[0].load() is cli.main


@pytest.mark.slow
def test_cli_trains_with_train_and_test_splits_and_writes_the_card(tmp_path):
    """With a reward function from a module in the working directory (a dotted path) and a reward model, as
    `trl grpo` takes them: both are logged under their names, so both rewarded the completions."""
    from trl_rpp.testing.tiny import build_tiny_model, copy_task_dataset

    model = build_tiny_model(tmp_path / "m")  # also the reward model: its folder's name is its metric's, rewards/m
    data = tmp_path / "data"
    data.mkdir()
    _write(data / "train.jsonl", copy_task_dataset(32, seed=1))
    _write(data / "test.jsonl", copy_task_dataset(8, seed=2))
    (tmp_path / "my_rewards.py").write_text(
        "from trl_rpp.testing.tiny import copy_first_char_reward\n\n\n"
        "def copies(prompts, completions, **kwargs):\n    return copy_first_char_reward(prompts, completions)\n"
    )
    out = tmp_path / "out"
    cmd = [console_script(), "--model_name_or_path", model, "--dataset_name", str(data),
           "--reward_model_name_or_path", model, "--reward_funcs", "my_rewards.copies",
           "--max_steps", "2", "--per_device_train_batch_size", "8",
           "--per_device_eval_batch_size", "8", "--num_generations", "4", "--max_completion_length", "2",
           "--eval_strategy", "steps", "--eval_steps", "2", "--logging_steps", "1", "--use_cpu", "--bf16", "false",
           "--report_to", "none",
           "--output_dir", str(out)]  # fmt: skip
    proc = subprocess.run(cmd, cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]  # the installed command's status
    assert "RPPTrainer object" not in proc.stdout + proc.stderr  # nothing but a status reaches sys.exit
    assert (out / "model.safetensors").is_file()
    assert f"Model and model card saved to {out} (model.safetensors)." in proc.stdout
    log = proc.stdout + proc.stderr
    assert "'eval_reward'" in log and "'advantages/raw_mean'" in log  # it evaluated on the test split
    assert "'rewards/copies/mean'" in log and "'rewards/m/mean'" in log  # the function and the reward model
    card = (out / "README.md").read_text()
    assert "REINFORCE++" in card and "None" not in card
