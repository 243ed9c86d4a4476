"""`trl-rpp`: train a causal LM with REINFORCE++ / REINFORCE++-baseline from the command line, TRL-script style.

    trl-rpp --model_name_or_path Qwen/Qwen3-0.6B --dataset_name data/gsm8k --reward_funcs final_answer \
        --advantage_estimator reinforce_plus_plus_baseline --output_dir outputs/qwen3-rpp
    accelerate launch -m trl_rpp.cli ...        # several processes or GPUs; `python -m trl_rpp.cli` also works
    trl-rpp ... --dry_run                       # print the resolved configuration as JSON and exit

Datasets (`--dataset_name`) need a `prompt` column (a string or a list of chat messages); other columns are
passed to the reward functions as keyword arguments.

- A Hub dataset or a local directory (data files named by split, e.g. `train.jsonl` and `test.jsonl`, or a
  `save_to_disk` DatasetDict): `--dataset_train_split` (default `train`) trains, `--dataset_test_split`
  (default `test`) evaluates. A missing split is an error, never a fallback.
- A single local .json/.jsonl/.csv/.parquet file, or a `save_to_disk` Dataset, is one split: it trains, and
  evaluation (`--eval_strategy` other than `no`) needs `--eval_dataset_name` (another file, directory or Hub
  dataset). Naming another train split for such a file is rejected.

Rewards (`--reward_funcs`, `--reward_model_name_or_path`) are resolved as `trl grpo` resolves them: a built-in
name, or a dotted import path `my_lib.rewards.custom_reward` importable from the current directory or PYTHONPATH;
the reward model comes first, then the functions in their order (the order of `--reward_weights`).

On a machine without a GPU add `--bf16 false` (GRPOConfig's bf16 defaults to True). Every `RPPConfig`/`GRPOConfig`
field is a flag, and so is every TRL `ModelConfig` field (`--use_peft --lora_r 16 ...`); `--config recipe.yaml`
works as in TRL. `examples/rpp.py` is this same program.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import importlib
import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

_FILE_BUILDERS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet"}
# `--no_<field>` complements that HfArgumentParser adds for boolean fields defaulting to True, but whose False is
# always rejected by RPPConfig: offering them would only produce an error (tests/test_cli.py checks the rest build).
_REJECTED_NEGATIONS = ("--no_normalize_advantages", "--no_use_bias_correction_kl")


@functools.cache
def script_arguments_class():
    """`RPPScriptArguments`: TRL's `ScriptArguments` plus this command's own flags. Defined on first use, so
    that importing this module does not import TRL."""
    from trl import ScriptArguments

    @dataclass
    class RPPScriptArguments(ScriptArguments):
        reward_model_name_or_path: str | None = field(
            default=None,
            metadata={"help": "Reward model, as in `trl grpo`: a Hub model id or a local directory saved with "
                      "`save_pretrained`, loaded as a sequence classifier with one label. It is the first reward, "
                      "before --reward_funcs (the order of --reward_weights)."},
        )
        reward_funcs: list[str] = field(
            default_factory=list,
            metadata={"help": "Reward functions: final_answer (the last number, \\boxed{} or #### answer equals the "
                      "`answer` column), exact_answer (the first integer equals `answer`), a TRL reward "
                      "(accuracy_reward, reasoning_accuracy_reward, think_format_reward, get_soft_overlong_punishment "
                      "with max_completion_len=--max_completion_length and a quarter of it as soft_punish_cache, "
                      "get_repetition_penalty_reward), or, as in `trl grpo`, a dotted import path to a function "
                      "(`my_lib.rewards.custom_reward`), importable from the current directory or PYTHONPATH."},
        )
        eval_dataset_name: str | None = field(
            default=None,
            metadata={"help": "Evaluation data, when --dataset_name is a single file: a local file or directory, or "
                      "a Hub dataset (then its --dataset_test_split)."},
        )
        dry_run: bool = field(
            default=False,
            metadata={"help": "Print the resolved configuration as JSON and exit without loading a model or data."},
        )

    return RPPScriptArguments


def __getattr__(name):
    if name == "RPPScriptArguments":
        return script_arguments_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _flag(value) -> str:
    """A value as it is typed on the command line (`None`, `True` and numbers as Python writes them)."""
    return value if isinstance(value, str) else repr(value)


def rejected_flag_help(own_fields) -> tuple[dict[str, str], dict[str, str]]:
    """`--help` text of the GRPO flags that `RPPConfig` rejects or restricts, as two dicts: field -> help replacing
    GRPO's (from `rejected_grpo_fields`: GRPO's help describes a feature REINFORCE++ does not have), and field -> the
    values accepted with score centering (from `trl_rpp.records.settings.NEUTRAL_SAMPLING`). Fields that `RPPConfig`
    declares itself (`own_fields`) keep their help, which already says what is accepted."""
    from trl_rpp.config import rejected_grpo_fields
    from trl_rpp.records.settings import NEUTRAL_SAMPLING

    helps = {}
    for name, (value, note) in rejected_grpo_fields().items():
        if name not in own_fields:
            helps[name] = (f"Not supported by REINFORCE++: only {_flag(value)} is accepted (its default); any other "
                           f"value raises a ValueError{f': {note}' if note else ''}.")
    accepted = {name: " or ".join(_flag(v) for v in neutral if v is not None)
                for name, neutral in NEUTRAL_SAMPLING.items()}
    return helps, {name: values or "None" for name, values in accepted.items()}


USAGE = "trl-rpp --model_name_or_path MODEL --dataset_name DATA --reward_funcs REWARD [--FIELD VALUE ...]"
DESCRIPTION = """\
Train a causal language model with REINFORCE++ or REINFORCE++-baseline: TRL's GRPOTrainer with the REINFORCE++
advantage and loss. Every RPPConfig, GRPOConfig and TRL ModelConfig field is a flag, listed below; `--config
recipe.yaml` reads them from a file, and `--dry_run` prints the resolved configuration without loading anything.

examples:
  # Qwen3-0.6B on GSM8K, on a GPU (data from `python -m trl_rpp.recipes.gsm8k --output_dir data/gsm8k`)
  trl-rpp --model_name_or_path Qwen/Qwen3-0.6B --dataset_name data/gsm8k --reward_funcs final_answer \\
      --advantage_estimator reinforce_plus_plus_baseline --output_dir outputs/qwen3-rpp

  # the same on a machine without a GPU: float32 (bf16 needs a GPU), a small model, a few steps
  trl-rpp --model_name_or_path HuggingFaceTB/SmolLM2-135M-Instruct --dataset_name data/gsm8k \\
      --reward_funcs final_answer --bf16 false --max_steps 8 --output_dir outputs/smollm2-rpp

A vLLM server for --use_vllm true --vllm_mode server: `trl-rpp vllm-serve --help`. Exit status: 0 after a finished
run, 75 when preempted (checkpoint saved: run the command again to resume), another non-zero status on an error.
"""


class _HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """The description and examples as written; each flag's default after its help, as TRL's parser shows it."""


def make_parser():
    """TRL's parser over (script arguments, `RPPConfig`, `ModelConfig`), without flags that always fail, and with
    the help of rejected GRPO flags saying what is accepted. Its help opens with a description and two examples."""
    from trl import ModelConfig, TrlParser

    from trl_rpp import RPPConfig

    parser = TrlParser((script_arguments_class(), RPPConfig, ModelConfig), prog="trl-rpp", usage=USAGE,
                       description=DESCRIPTION, formatter_class=_HelpFormatter)
    replaced, score_centering_only = rejected_flag_help(set(RPPConfig.__annotations__))
    for action in parser._actions:
        if action.dest in replaced:
            action.help = replaced[action.dest]
        elif action.dest in score_centering_only and action.help:
            action.help += (f" With --score_centering, only {score_centering_only[action.dest]} is accepted: score "
                            "centering needs the full-vocabulary softmax at --temperature.")
    for action in list(parser._actions):
        if set(action.option_strings) & set(_REJECTED_NEGATIONS):
            parser._remove_action(action)
            for option in action.option_strings:
                parser._option_string_actions.pop(option, None)
            for group in parser._action_groups:
                if action in group._group_actions:
                    group._group_actions.remove(action)
    return parser


# ----------------------------------------------------------------------------------------------------------------
# Rewards
# ----------------------------------------------------------------------------------------------------------------


def _first_int(text):
    import re

    match = re.search(r"-?\d+(?:,\d{3})*", str(text))
    return int(match.group().replace(",", "")) if match else None


def exact_answer(completions, answer, **kwargs):
    """1.0 if the *first* integer of the completion equals `answer` (text after a `####`, if any). For prompts
    whose completion is the answer itself; reasoning completions want `final_answer`."""
    texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
    golds = [_first_int(str(a).split("####")[-1]) for a in answer]
    return [1.0 if g is not None and _first_int(t) == g else 0.0 for t, g in zip(texts, golds)]


def reward_registry(training_args):
    """Accepted `--reward_funcs` names -> zero-argument factories (TRL's rewards are imported only when chosen)."""

    def trl_reward(name, *args):
        def make():
            import trl.rewards as r

            f = getattr(r, name)
            return f(*args) if args or name.startswith("get_") else f

        return make

    def final_answer():
        from trl_rpp.recipes.gsm8k import final_answer_reward

        return final_answer_reward

    n = training_args.max_completion_length
    return {
        "final_answer": final_answer,
        "exact_answer": lambda: exact_answer,
        "accuracy_reward": trl_reward("accuracy_reward"),
        "reasoning_accuracy_reward": trl_reward("reasoning_accuracy_reward"),
        "think_format_reward": trl_reward("think_format_reward"),
        "get_soft_overlong_punishment": trl_reward("get_soft_overlong_punishment", n, max(n // 4, 1)),
        "get_repetition_penalty_reward": trl_reward("get_repetition_penalty_reward"),
    }


def _expected(registry) -> str:
    return (f"Expected one of {sorted(registry)} or a dotted import path to a function (e.g. "
            "'my_lib.rewards.custom_reward'), importable from the current directory or PYTHONPATH.")


def import_reward_func(path, registry):
    """The function a dotted `--reward_funcs` path names, imported as `trl grpo` imports it (the current directory
    first on `sys.path`, but only during this import: a stray `json.py` there must not shadow the standard module for
    the rest of the run); a `ValueError` naming the flag and the entry when it cannot be loaded."""
    module_path, _, name = path.rpartition(".")
    cwd = os.getcwd()
    added = cwd not in sys.path
    if added:
        sys.path.insert(0, cwd)  # a rewards.py next to the command imports, with what it imports at load time
    try:
        module = importlib.import_module(module_path)
    except ImportError as err:
        raise ValueError(f"Could not load reward function {path!r} given to --reward_funcs: importing module "
                         f"{module_path!r} failed ({type(err).__name__}: {err}). {_expected(registry)}") from err
    finally:
        if added and cwd in sys.path:
            sys.path.remove(cwd)
    func = getattr(module, name, None)
    if func is None:
        raise ValueError(f"Could not load reward function {path!r} given to --reward_funcs: module {module_path!r} "
                         f"has no attribute {name!r}. {_expected(registry)}")
    if not callable(func):
        raise ValueError(f"Could not load reward function {path!r} given to --reward_funcs: it is a "
                         f"{type(func).__name__}, not a function. {_expected(registry)}")
    return func


def resolve_reward_funcs(names, training_args, reward_model_name_or_path=None):
    """The trainer's `reward_funcs`, in `trl grpo`'s order: the reward model (its id or path; the trainer loads it),
    then each `--reward_funcs` entry, a built-in name or a dotted import path."""
    registry = reward_registry(training_args)
    if not names and not reward_model_name_or_path:
        raise ValueError(f"No reward: pass --reward_funcs and/or --reward_model_name_or_path. {_expected(registry)}")
    rewards = [reward_model_name_or_path] if reward_model_name_or_path else []
    for name in names:
        if name in registry:
            rewards.append(registry[name]())
        elif "." in name.strip("."):
            rewards.append(import_reward_func(name, registry))
        else:
            raise ValueError(f"Could not load reward function {name!r} given to --reward_funcs. {_expected(registry)}")
    return rewards


# ModelConfig's LoRA flags: read only by `get_peft_config`, which returns None without --use_peft.
_PEFT_FIELDS = ("lora_r", "lora_alpha", "lora_dropout", "lora_target_modules", "lora_target_parameters",
                "lora_modules_to_save", "lora_task_type", "use_rslora", "use_dora")


def check_model_args(model_args):
    """Reject LoRA flags given without --use_peft: TRL would build no adapter and ignore them."""
    if model_args.use_peft:
        return
    defaults = {f.name: f.default for f in dataclasses.fields(model_args)}
    for name in _PEFT_FIELDS:
        if getattr(model_args, name) != defaults[name]:
            raise ValueError(f"--{name} {getattr(model_args, name)!r} is given without --use_peft, so no LoRA adapter "
                             "is built and it would be ignored; accepted: add --use_peft (or drop the flag).")


# ----------------------------------------------------------------------------------------------------------------
# Datasets
# ----------------------------------------------------------------------------------------------------------------


def _is_single_split(name) -> bool:
    """True for a local data file or a `save_to_disk` Dataset (one split, no names); False for a Hub dataset, a
    directory of data files or a saved DatasetDict."""
    path = Path(name).expanduser()
    return path.is_file() or (path.is_dir() and (path / "state.json").exists())


def load_prompt_dataset(name, config=None, split="train"):
    """Load one split of a local file/directory or Hub dataset; fail early unless it has a `prompt` column.

    A single file (or saved Dataset) has exactly one split, which only answers to `split="train"`: any other
    split name is an error, so that no evaluation silently runs on the training rows.
    """
    from datasets import Dataset, DatasetDict, load_dataset, load_from_disk

    path = Path(name).expanduser()
    if _is_single_split(name):
        if split != "train":
            raise ValueError(f"{name!r} is a single split, so split {split!r} does not exist. Use a dataset with "
                             "named splits (a directory such as train.jsonl + test.jsonl, or a Hub dataset), or pass "
                             "the evaluation data with --eval_dataset_name.")
        if path.is_dir():
            dataset = load_from_disk(str(path))
        elif path.suffix.lower() not in _FILE_BUILDERS:
            raise ValueError(f"Unsupported file {name!r}: use one of {sorted(_FILE_BUILDERS)}.")
        else:
            dataset = load_dataset(_FILE_BUILDERS[path.suffix.lower()], data_files=str(path), split="train")
    elif path.is_dir() and (path / "dataset_dict.json").exists():
        saved = load_from_disk(str(path))
        if split not in saved:
            raise ValueError(f"{name!r} has no split {split!r}; its splits are {sorted(saved)}.")
        dataset = saved[split]
    else:  # a directory of data files (splits from the file names) or a Hub dataset; a missing split raises
        dataset = load_dataset(str(path) if path.is_dir() else name, name=config, split=split)
    if isinstance(dataset, DatasetDict) or not isinstance(dataset, Dataset) or "prompt" not in dataset.column_names:
        columns = getattr(dataset, "column_names", None)
        raise ValueError(f"Dataset {name!r} (split {split!r}) has no 'prompt' column; its columns are {columns}. "
                         "Add a 'prompt' column (a string or a list of chat messages) before training.")
    return dataset


def load_datasets(script_args, training_args):
    """(train, eval or None) as the flags describe them; see the module docstring for the rules."""
    train = load_prompt_dataset(script_args.dataset_name, script_args.dataset_config, script_args.dataset_train_split)
    strategy = getattr(training_args.eval_strategy, "value", training_args.eval_strategy)
    if strategy == "no":
        if script_args.eval_dataset_name:
            raise ValueError("--eval_dataset_name is given but --eval_strategy is 'no': nothing would evaluate on it. "
                             "Set --eval_strategy steps (or epoch), or drop --eval_dataset_name.")
        return train, None
    if script_args.eval_dataset_name:
        name = script_args.eval_dataset_name
        split = "train" if _is_single_split(name) else script_args.dataset_test_split
        return train, load_prompt_dataset(name, script_args.dataset_config, split)
    if _is_single_split(script_args.dataset_name):
        raise ValueError(f"--eval_strategy {strategy!r} needs evaluation data, and "
                         f"{script_args.dataset_name!r} is a single split (the training data). Pass "
                         "--eval_dataset_name, or use a dataset with a test split.")
    return train, load_prompt_dataset(script_args.dataset_name, script_args.dataset_config,
                                      script_args.dataset_test_split)


# ----------------------------------------------------------------------------------------------------------------
# Entry point
# ----------------------------------------------------------------------------------------------------------------

_SHOWN_FIELDS = (
    "advantage_estimator", "normalize_advantages", "gamma", "kl_coef", "use_kl_loss", "kl_loss_type", "kl_loss_coef",
    "score_centering", "score_centering_top_k", "num_generations", "generation_batch_size",
    "per_device_train_batch_size", "gradient_accumulation_steps", "steps_per_generation", "num_iterations",
    "loss_type", "scale_rewards", "beta", "epsilon", "epsilon_high", "learning_rate", "max_steps",
    "max_completion_length", "temperature", "chat_template_kwargs", "bf16", "use_cpu", "gradient_checkpointing",
    "eval_strategy", "output_dir", "resume_from_checkpoint", "push_to_hub", "hub_model_id", "report_to", "seed",
)


def resolved_configuration(script_args, training_args, model_args) -> dict:
    """The settings a run would use, after `RPPConfig` resolved its per-estimator defaults."""
    return {
        "model_name_or_path": model_args.model_name_or_path,
        "dataset_name": script_args.dataset_name,
        "dataset_config": script_args.dataset_config,
        "dataset_train_split": script_args.dataset_train_split,
        "dataset_test_split": script_args.dataset_test_split,
        "eval_dataset_name": script_args.eval_dataset_name,
        "reward_model_name_or_path": script_args.reward_model_name_or_path,
        "reward_funcs": list(script_args.reward_funcs),
        **{name: getattr(training_args, name) for name in _SHOWN_FIELDS},
        # The adapter get_peft_config builds from the ModelConfig flags, or None without --use_peft.
        "peft": {name: getattr(model_args, name) for name in _PEFT_FIELDS} if model_args.use_peft else None,
    }


def weight_files(output_dir) -> dict:
    """{name: (size, mtime_ns)} of the weight files present in `output_dir`."""
    from trl_rpp.faults.checkpoint import WEIGHT_FILES  # what `save_pretrained` writes: weights, shards' index or adapter

    stats = {name: (Path(output_dir) / name).stat() for name in WEIGHT_FILES if (Path(output_dir) / name).is_file()}
    return {name: (st.st_size, st.st_mtime_ns) for name, st in stats.items()}


def save_report(output_dir, before=None) -> tuple[bool, str]:
    """(whether weights were written to `output_dir`, the line to print), from the files that are new or changed
    since `before` (`weight_files` taken ahead of the save). `Trainer.save_model` can return without writing any:
    under FSDP with SHARDED_STATE_DICT, and under ZeRO-3 without a 16-bit gather (a DeepSpeed checkpoint instead).
    So the CLI looks at the files, and a stale file of an earlier run into the same directory does not count."""
    before = before or {}
    found = [name for name, stat in weight_files(output_dir).items() if before.get(name) != stat]
    if found:
        return True, f"Model and model card saved to {output_dir} ({', '.join(found)})."
    return False, (
        f"WARNING: training finished, but no model weights were written to {output_dir} (only the model card and "
        "checkpoints, if any). Under FSDP, transformers saves them only with fsdp_state_dict_type FULL_STATE_DICT "
        "(examples/accelerate_configs/fsdp2.yaml); a SHARDED_STATE_DICT checkpoint can be merged with `accelerate "
        "merge-weights`. Under DeepSpeed ZeRO-3 they need zero3_save_16bit_model: true; without it a DeepSpeed "
        "checkpoint is written there instead, whose zero_to_fp32.py recovers them."
    )


def train(script_args, training_args, model_args):
    from trl import get_peft_config, get_quantization_config

    from trl_rpp import RPPTrainer

    if not script_args.dataset_name:
        raise ValueError("--dataset_name is required (a local file or directory, or a Hub dataset name).")
    reward_funcs = resolve_reward_funcs(script_args.reward_funcs, training_args, script_args.reward_model_name_or_path)
    train_dataset, eval_dataset = load_datasets(script_args, training_args)
    for name in ("exact_answer", "final_answer"):
        if name in script_args.reward_funcs and "answer" not in train_dataset.column_names:
            raise ValueError(f"{name} needs an 'answer' column; columns are {train_dataset.column_names}.")
    model_init_kwargs = dict(revision=model_args.model_revision, trust_remote_code=training_args.trust_remote_code,
                             attn_implementation=model_args.attn_implementation, dtype=model_args.dtype)
    training_args.model_init_kwargs = {**model_init_kwargs, **(training_args.model_init_kwargs or {})}

    trainer = RPPTrainer(
        model=model_args.model_name_or_path,
        reward_funcs=reward_funcs,
        args=training_args,
        train_dataset=train_dataset,
        eval_dataset=eval_dataset,
        quantization_config=get_quantization_config(model_args),
        peft_config=get_peft_config(model_args),
    )
    from trl_rpp.faults.preemption import TrainingPreempted

    try:
        trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
    except TrainingPreempted:
        # Every process stops at the same step, so the group ends here as after a finished run: left to interpreter
        # shutdown, gloo's threads can abort the process (SIGABRT) in place of status 75.
        trainer.accelerator.end_training()
        raise
    before = weight_files(training_args.output_dir)
    trainer.save_model(training_args.output_dir)
    trainer.create_model_card(dataset_name=script_args.dataset_name)
    if trainer.args.should_save:  # the process(es) that wrote the files
        saved, line = save_report(training_args.output_dir, before)
        print(line, file=sys.stdout if saved else sys.stderr, flush=True)
    if training_args.push_to_hub:
        trainer.push_to_hub(dataset_name=script_args.dataset_name)
    trainer.accelerator.end_training()  # the trackers finished and the process group destroyed, last
    return trainer


def main(argv=None) -> int:
    """Run the `trl-rpp` command on `argv` (default: the command line) and return its exit status: 0 after a finished
    run or a dry run. A preempted run raises `SystemExit(75)` once its checkpoint is saved, and any error propagates
    as an exception, so that the console script (`sys.exit(main())`) exits non-zero with the traceback."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["vllm-serve"]:  # `trl-rpp vllm-serve ...`: start a vLLM server for server mode (trl_rpp.serve)
        from trl_rpp.serve import main as serve

        return serve(argv[1:])
    parser = make_parser()
    without_gpu = False
    try:
        script_args, training_args, model_args = parser.parse_args_and_config(argv)
    except ValueError as err:
        # A GPU recipe (bf16) cannot build its config on a machine without a GPU; a dry run still shows it, resolved
        # with use_cpu added, and says so. That is the case when the same arguments build with use_cpu and ask for
        # bf16; any other error is raised as it was.
        if not any(a.split("=")[0] == "--dry_run" for a in argv):
            raise
        try:
            script_args, training_args, model_args = parser.parse_args_and_config([*argv, "--use_cpu", "true"])
        except ValueError:
            training_args = None
        if training_args is None or not training_args.bf16:
            raise err
        without_gpu = True
    check_model_args(model_args)
    if script_args.dry_run:
        # Rewards are resolved (a dotted path imported) so that a bad one fails here too; nothing is loaded.
        resolve_reward_funcs(script_args.reward_funcs, training_args, script_args.reward_model_name_or_path)
        config = resolved_configuration(script_args, training_args, model_args)
        if without_gpu:
            config["use_cpu"] = False
            config["note"] = ("resolved on a machine without a GPU: use_cpu=True was added only to build this "
                              "configuration (bf16 needs a GPU); to run here, add --bf16 false")
            print(f"Note: {config['note']}.", file=sys.stderr, flush=True)  # first, not only as the JSON's last key
        json.dump(config, sys.stdout, indent=2, default=str)
        sys.stdout.write("\n")
        return 0
    from trl_rpp.faults.preemption import TrainingPreempted

    try:
        train(script_args, training_args, model_args)
    except TrainingPreempted as stop:  # checkpoint saved: status 75 tells a scheduler to run the command again
        raise SystemExit(stop.exit_code) from stop
    return 0


if __name__ == "__main__":
    sys.exit(main())
