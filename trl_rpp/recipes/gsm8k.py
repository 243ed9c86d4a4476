"""GSM8K for `RPPTrainer`: rows -> chat prompts with a reference answer, and a final-answer reward.

GSM8K rows have a `question` and an `answer` whose last line is `#### <number>`. `prepare_row` turns one into
a conversational `prompt` (the question plus an instruction to box the final answer) and the reference
`answer` (the number after `####`, commas removed). `final_answer_reward` scores a completion 1.0 when its
*final* answer equals the reference: the last `\\boxed{...}`, else the text after the last `####`, else the
last number, looked for after any `</think>` so that numbers in a reasoning block never count.

    python -m trl_rpp.recipes.gsm8k --output_dir data/gsm8k                     # openai/gsm8k from the Hub
    python -m trl_rpp.recipes.gsm8k --source rows.jsonl --output_dir data/mini  # local GSM8K-style rows

writes `train.jsonl` and `test.jsonl` with `prompt` and `answer` columns; a local file (one split) is written
to both only with `--test_fraction`, which holds out that fraction of its rows as the test split.
"""

from __future__ import annotations

import argparse
import json
import re
from decimal import Decimal, InvalidOperation
from pathlib import Path

INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."

_NUMBER = re.compile(r"-?\$?\d[\d,]*(?:\.\d+)?|-?\$?\.\d+")
_BOXED = "\\boxed{"


def normalize_number(text) -> str | None:
    """`"1,234.50"` -> `"1234.5"`, `"$18"` -> `"18"`, `"-7."` -> `"-7"`; None when `text` is not a number."""
    cleaned = str(text).strip().replace(",", "").replace("$", "").rstrip(".")
    if cleaned.startswith("\\$"):
        cleaned = cleaned[2:]
    try:
        value = Decimal(cleaned)
    except InvalidOperation:
        return None
    if not value.is_finite():
        return None
    value = value.normalize()
    # Decimal("1E+2").normalize() prints in exponent form; write integers out.
    return str(value.quantize(Decimal(1))) if value == value.to_integral_value() else format(value, "f")


def reference_answer(answer: str) -> str:
    """The normalized number after the last `####` of a GSM8K `answer` field."""
    if "####" not in answer:
        raise ValueError(f"GSM8K answer has no '####' line: {answer[-80:]!r}")
    final = answer.rsplit("####", 1)[1].strip()
    number = normalize_number(final)
    if number is None:
        raise ValueError(f"GSM8K answer after '####' is not a number: {final!r}")
    return number


def prepare_row(row: dict) -> dict:
    """`{"question", "answer"}` -> `{"prompt": [user message], "answer": "<number>"}`."""
    content = f"{row['question'].strip()}\n{INSTRUCTION}"
    return {"prompt": [{"role": "user", "content": content}], "answer": reference_answer(row["answer"])}


def _last_boxed(text: str) -> str | None:
    start = text.rfind(_BOXED)
    if start < 0:
        return None
    depth, i = 1, start + len(_BOXED)
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j]
    return None  # unclosed: no final answer


def extract_final_answer(completion: str) -> str | None:
    """The completion's final answer as a normalized number, or None when it gives none."""
    text = completion.rsplit("</think>", 1)[-1]
    boxed = _last_boxed(text)
    if boxed is not None:
        numbers = _NUMBER.findall(boxed)
        return normalize_number(numbers[-1]) if numbers else None
    if "####" in text:
        numbers = _NUMBER.findall(text.rsplit("####", 1)[1])
        return normalize_number(numbers[0]) if numbers else None
    numbers = _NUMBER.findall(text)
    return normalize_number(numbers[-1]) if numbers else None


def _text(completion) -> str:
    # Conversational completions are lists of messages; the answer is in the last one.
    return completion[-1]["content"] if isinstance(completion, list) else str(completion)


def final_answer_reward(completions, answer, **kwargs) -> list[float]:
    """1.0 when the completion's final answer equals `answer` (numerically), else 0.0. Works on standard (string)
    and conversational (list of messages) completions; `answer` may be a bare number or a GSM8K `####` field."""
    rewards = []
    for completion, gold in zip(completions, answer, strict=True):
        gold = reference_answer(gold) if "####" in str(gold) else normalize_number(gold)
        rewards.append(1.0 if gold is not None and extract_final_answer(_text(completion)) == gold else 0.0)
    return rewards


def prepare(dataset):
    """A `datasets.Dataset` of GSM8K rows -> the same rows as `prompt`/`answer`, other columns dropped."""
    return dataset.map(prepare_row, remove_columns=dataset.column_names)


def _write_jsonl(rows, path: Path) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description="Write GSM8K as train.jsonl/test.jsonl with prompt and answer columns.")
    p.add_argument("--source", default="openai/gsm8k", help="Hub dataset (with train/test splits) or a local .jsonl")
    p.add_argument("--config", default="main", help="Hub dataset config (GSM8K: main)")
    p.add_argument("--output_dir", required=True)
    p.add_argument("--test_fraction", type=float, default=None,
                   help="for a local file: hold out this fraction of its rows as test.jsonl (required for a file)")
    a = p.parse_args(argv)
    from datasets import load_dataset

    out = Path(a.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    if Path(a.source).is_file():
        if a.test_fraction is None or not 0.0 < a.test_fraction < 1.0:
            raise ValueError("A local --source file is one split: pass --test_fraction in (0, 1) to hold out a test "
                             "split, so that evaluation never runs on training rows.")
        rows = prepare(load_dataset("json", data_files=a.source, split="train"))
        splits = rows.train_test_split(test_size=a.test_fraction, seed=0)
        train, test = splits["train"], splits["test"]
    else:
        train = prepare(load_dataset(a.source, a.config, split="train"))
        test = prepare(load_dataset(a.source, a.config, split="test"))
    _write_jsonl(train, out / "train.jsonl")
    _write_jsonl(test, out / "test.jsonl")
    print(f"wrote {len(train)} train and {len(test)} test rows to {out}")


if __name__ == "__main__":
    main()
