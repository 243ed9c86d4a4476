"""Train a causal LM with REINFORCE++ / REINFORCE++-baseline (`trl_rpp.RPPTrainer`), TRL-script style.

    accelerate launch examples/rpp.py \
        --model_name_or_path Qwen/Qwen3-0.6B \
        --dataset_name data/gsm8k_prompts.jsonl \
        --reward_funcs exact_answer \
        --advantage_estimator reinforce_plus_plus_baseline --num_generations 8 \
        --output_dir outputs/qwen3-rpp

`--dataset_name` is a local .json/.jsonl/.csv/.parquet file, a local directory (data files or `save_to_disk`),
or a Hub dataset. It needs a `prompt` column; `exact_answer` also needs an `answer` column. On CPU add
`--use_cpu --bf16 False`. Every `RPPConfig`/`GRPOConfig` field is a flag; `--config recipe.yaml` works too.
"""

import re
from dataclasses import dataclass, field
from pathlib import Path

from datasets import Dataset, DatasetDict, load_dataset, load_from_disk
from trl import ModelConfig, ScriptArguments, TrlParser, get_peft_config, get_quantization_config

from trl_rpp import RPPConfig, RPPTrainer
from trl_rpp.testing.tiny import copy_first_char_reward

_FILE_BUILDERS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet"}
_INT = re.compile(r"-?\d+(?:,\d{3})*")


@dataclass
class RPPScriptArguments(ScriptArguments):
    reward_funcs: list[str] = field(
        default_factory=list,
        metadata={"help": "Reward functions by name: copy_first_char, exact_answer, or a TRL reward "
                  "(accuracy_reward, reasoning_accuracy_reward, think_format_reward, get_soft_overlong_punishment, "
                  "get_repetition_penalty_reward)."},
    )


def _first_int(text):
    match = _INT.search(str(text))
    return int(match.group().replace(",", "")) if match else None


def exact_answer(completions, answer, **kwargs):
    """1.0 if the first integer of the completion equals the `answer` (text after a GSM8K `####`, if any)."""
    texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
    golds = [_first_int(str(a).split("####")[-1]) for a in answer]
    return [1.0 if g is not None and _first_int(t) == g else 0.0 for t, g in zip(texts, golds)]


def reward_registry(training_args):
    """Accepted `--reward_funcs` names -> zero-argument factories (TRL's rewards are imported only when chosen)."""
    import trl.rewards as r

    n = training_args.max_completion_length
    return {
        "copy_first_char": lambda: copy_first_char_reward,
        "exact_answer": lambda: exact_answer,
        "accuracy_reward": lambda: r.accuracy_reward,
        "reasoning_accuracy_reward": lambda: r.reasoning_accuracy_reward,
        "think_format_reward": lambda: r.think_format_reward,
        "get_soft_overlong_punishment": lambda: r.get_soft_overlong_punishment(n, max(n // 4, 1)),
        "get_repetition_penalty_reward": lambda: r.get_repetition_penalty_reward(),
    }


def resolve_reward_funcs(names, training_args):
    registry = reward_registry(training_args)
    unknown = [name for name in names if name not in registry]
    if unknown or not names:
        raise ValueError(f"Unknown or missing --reward_funcs {unknown or names}; accepted names: {sorted(registry)}.")
    return [registry[name]() for name in names]


def load_prompt_dataset(name, config=None, split="train"):
    """Load one split of a local file/directory or Hub dataset; fail early unless it has a `prompt` column."""
    path = Path(name).expanduser()
    if path.is_file():
        if path.suffix.lower() not in _FILE_BUILDERS:
            raise ValueError(f"Unsupported file {name!r}: use one of {sorted(_FILE_BUILDERS)}.")
        dataset = load_dataset(_FILE_BUILDERS[path.suffix.lower()], data_files=str(path), split="train")
    elif path.is_dir() and ((path / "state.json").exists() or (path / "dataset_dict.json").exists()):
        dataset = load_from_disk(str(path))
        dataset = dataset[split] if isinstance(dataset, DatasetDict) else dataset
    else:  # a directory of data files (builder chosen by extension) or a Hub dataset
        dataset = load_dataset(str(path) if path.is_dir() else name, name=config, split=split)
    if not isinstance(dataset, Dataset) or "prompt" not in dataset.column_names:
        columns = getattr(dataset, "column_names", None)
        raise ValueError(f"Dataset {name!r} (split {split!r}) has no 'prompt' column; its columns are {columns}. "
                         "Add a 'prompt' column (a string or a list of chat messages) before training.")
    return dataset


def main(script_args, training_args, model_args):
    if not script_args.dataset_name:
        raise ValueError("--dataset_name is required (a local file or directory, or a Hub dataset name).")
    reward_funcs = resolve_reward_funcs(script_args.reward_funcs, training_args)
    train_dataset = load_prompt_dataset(script_args.dataset_name, script_args.dataset_config,
                                        script_args.dataset_train_split)
    if "exact_answer" in script_args.reward_funcs and "answer" not in train_dataset.column_names:
        raise ValueError(f"exact_answer needs an 'answer' column; columns are {train_dataset.column_names}.")
    eval_dataset = None if training_args.eval_strategy == "no" else load_prompt_dataset(
        script_args.dataset_name, script_args.dataset_config, script_args.dataset_test_split)
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
    trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
    trainer.save_model(training_args.output_dir)
    trainer.create_model_card(dataset_name=script_args.dataset_name)
    trainer.accelerator.print(f"Model and model card saved to {training_args.output_dir}.")
    if training_args.push_to_hub:
        trainer.push_to_hub(dataset_name=script_args.dataset_name)
    if hasattr(trainer, "end"):
        trainer.end()


if __name__ == "__main__":
    parser = TrlParser((RPPScriptArguments, RPPConfig, ModelConfig))
    main(*parser.parse_args_and_config())
