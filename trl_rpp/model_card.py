"""The model card `RPPTrainer.create_model_card` writes: TRL's card plus ours.

TRL's `create_model_card` (`trl.trainer.base_trainer._BaseTrainer`) builds the card: its tags (the trainer's,
`unsloth` for a model Unsloth patched, `hf_jobs` in a Hugging Face Job, `trackio:<url>`, the caller's), the links to
the run (Weights & Biases, Trackio, Comet), the method's paper and citation (`RPPTrainer._paper`), the framework
versions and TRL's citation. `RPPTrainer.create_model_card` lets TRL write that card, then `build_model_card` keeps
all of it and changes only what TRL gets wrong or does not know:

- the metadata's `base_model`, `datasets`, `library_name` and `model_name`, and the opening paragraph. TRL's
  template (`trl/templates/lm_model_card.md`) links `https://huggingface.co/<base_model>` and
  `https://huggingface.co/datasets/<dataset_name>` whatever the names are, so a local checkpoint gives
  "[None](https://huggingface.co/None)" and a local or generated dataset a broken link. Here a name is linked only
  when it is a Hub id; a folder converted by `trl_rpp.testing.assets` from a GGUF file names the Hub model it came
  from (its `trl_rpp_conversion.json`); a LoRA run is a `peft` adapter.
- the quick start: it loads the pushed model or the output folder, and asks the training data's first prompt.
- added: the REINFORCE++ settings table (in "Training procedure", after TRL's run links), `trl_rpp`'s version (in
  "Framework versions"), and score centering's citation when it is on (before TRL's).

A card is meant for the Hub, so it never shows a machine path: a local model, dataset or output folder is named by
its last component (`/home/me/.cache/x/base` is `base`), or as given when the path is relative. A section TRL's card
gains in a later version is kept as it is.
"""

from __future__ import annotations

import json
import re
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

REINFORCE_PP_PAPER = {
    # arXiv:2501.03262 under its current (v9) title; v1 was "REINFORCE++: A Simple and Efficient Approach for
    # Aligning Large Language Models", v2-v8 "REINFORCE++: An Efficient RLHF Algorithm with Robustness to Both
    # Prompt and Reward Models".
    "title": "REINFORCE++: Stabilizing Critic-Free Policy Optimization with Global Advantage Normalization",
    "id": "2501.03262",
    "citation": """@article{hu2025reinforceplusplus,
    title        = {{REINFORCE++: Stabilizing Critic-Free Policy Optimization with Global Advantage Normalization}},
    author       = {Jian Hu and Jason Klein Liu and Haotian Xu and Wei Shen},
    year         = 2025,
    eprint       = {arXiv:2501.03262},
}""",
}

SCORE_CENTERING_PAPER = {
    "title": "Score Centering Stabilizes Off-policy Reinforcement Learning",
    "id": "2609.20807",
    "citation": """@article{marek2026scorecentering,
    title        = {{Score Centering Stabilizes Off-policy Reinforcement Learning}},
    author       = {Martin Marek and Max Ryabinin},
    year         = 2026,
    eprint       = {arXiv:2609.20807},
}""",
}

#: Provenance file that `trl_rpp.testing.assets` writes into a checkpoint it converted from a GGUF file.
CONVERSION_MARKER = "trl_rpp_conversion.json"

_MODEL_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?$")
_DATASET_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*$")  # Hub datasets are namespaced
_ESTIMATOR_NAMES = {"reinforce_plus_plus": "REINFORCE++", "reinforce_plus_plus_baseline": "REINFORCE++-baseline"}


def local_name(path) -> str:
    """How a card names a local path: as given when relative, else only its last component, never a machine path
    (a home directory, a cache, a temporary folder)."""
    text = str(path)
    if Path(text).is_absolute() or text.startswith("~"):
        return Path(text).expanduser().name or text.strip("/~") or "local"
    return text


def _is_path(name: str) -> bool:
    return Path(name).expanduser().exists() or Path(name).is_absolute() or name.startswith(("~", "./", "../"))


def describe_base_model(name_or_path: str | None) -> tuple[str | None, str]:
    """`(Hub id or None, Markdown phrase)` for the model a run started from."""
    if not name_or_path:
        return None, "a model passed to the trainer as an object, whose name or path was not recorded"
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        marker = path / CONVERSION_MARKER
        if marker.is_file():
            info = json.loads(marker.read_text())
            gguf = Path(str(info.get("source_gguf", "?"))).name
            converted = f"converted to float32 from the GGUF file `{gguf}`"
            hub = info.get("base_model")
            if hub:
                return hub, f"[{hub}](https://huggingface.co/{hub}) ({converted})"
            return None, f"a local checkpoint {converted}"
        return None, f"the local checkpoint `{local_name(name_or_path)}`"
    if _MODEL_ID.match(name_or_path):
        return name_or_path, f"[{name_or_path}](https://huggingface.co/{name_or_path})"
    if _is_path(name_or_path):
        return None, f"the local checkpoint `{local_name(name_or_path)}`"
    return None, f"`{name_or_path}`"


def describe_dataset(name: str | None) -> tuple[str | None, str | None]:
    """`(Hub id or None, Markdown phrase or None)` for the training data."""
    if not name:
        return None, None
    if _is_path(name):
        return None, f"the local dataset `{local_name(name)}`"
    if _DATASET_ID.match(name):
        return name, f"the [{name}](https://huggingface.co/datasets/{name}) dataset"
    return None, f"{name}"


def training_settings(args) -> list[tuple[str, str]]:
    """The REINFORCE++ settings of an `RPPConfig`, as (setting, value) rows."""
    estimator = args.advantage_estimator
    kl_loss_note = "" if args.use_kl_loss else " (inactive: `use_kl_loss=False`)"
    epsilon_high = args.epsilon if args.epsilon_high is None else args.epsilon_high  # as GRPOTrainer resolves it
    rows = [
        ("`advantage_estimator`", f"`{estimator}` ({_ESTIMATOR_NAMES.get(estimator, estimator)})"),
        ("`normalize_advantages`", f"`{args.normalize_advantages}` (global masked z-score over every valid token of "
                                   "the generation batch, population variance, floor 1e-8)"),
        ("`gamma`", f"`{args.gamma}`" + ("" if estimator == "reinforce_plus_plus" else " (unused by the baseline)")),
        ("`kl_coef`", f"`{args.kl_coef}` (k1 reference KL folded into the token reward)"),
        ("`use_kl_loss`", f"`{args.use_kl_loss}`"),
        ("`kl_loss_type`", f"`{args.kl_loss_type}`{kl_loss_note}"),
        ("`kl_loss_coef`", f"`{args.kl_loss_coef}`{kl_loss_note}"),
        ("`score_centering`", f"`{args.score_centering}`"
                              + (f" (top-k `{args.score_centering_top_k}`)" if args.score_centering else "")),
        ("`num_generations`", f"`{args.num_generations}`"),
        ("`loss_type`, `scale_rewards`, `beta`", f"`{args.loss_type}`, `{args.scale_rewards}`, `{args.beta}`"),
        ("`epsilon`, `epsilon_high`", f"`{args.epsilon}`, `{epsilon_high}`"),
        ("`learning_rate`", f"`{args.learning_rate}`"),
        ("`temperature`, `max_completion_length`", f"`{args.temperature}`, `{args.max_completion_length}`"),
    ]
    return rows


def example_prompt(dataset):
    """The `prompt` of the training data's first row (a string or a list of chat messages), for the card's quick
    start; None when there is no such row to read (no dataset, an iterable dataset, no `prompt` column)."""
    try:
        row = dataset[0]
    except (TypeError, IndexError, KeyError):
        return None
    return row.get("prompt") if isinstance(row, dict) else None


def _quick_start_input(prompt) -> str:
    """The pipeline's input in the quick start: the prompt as a Python literal (a text, or a list of messages: one
    chat), or a placeholder that says no training prompt was recorded."""
    return '"Your prompt here"' if prompt is None else repr(prompt)


def _version(package: str) -> str:
    try:
        return version(package)
    except PackageNotFoundError:
        return "not installed"


def _sections(text: str) -> list[tuple[str | None, list[str]]]:
    """A Markdown text cut at its `## ` headings (outside code blocks): `(heading, lines)` pairs, the first one
    `(None, lines before any heading)`."""
    sections, heading, lines, fenced = [], None, [], False
    for line in text.splitlines():
        if line.startswith("```"):
            fenced = not fenced
        if not fenced and line.startswith("## "):
            sections.append((heading, lines))
            heading, lines = line[3:].strip(), []
        else:
            lines.append(line)
    sections.append((heading, lines))
    return sections


def _tidy(lines: list[str]) -> list[str]:
    """`lines` without trailing spaces, without runs of blank lines (what TRL's template leaves where a run link is
    absent) and without blank lines at either end; code blocks are kept as they are."""
    out, fenced = [], False
    for line in lines:
        if line.startswith("```"):
            fenced = not fenced
        line = line if fenced else line.rstrip()
        if fenced or line or (out and out[-1]):
            out.append(line)
    while out and not out[-1]:
        out.pop()
    return out


def _insert_before(lines: list[str], prefix: str, new: list[str]) -> list[str]:
    """`new` inserted before the first line that starts with `prefix`, or appended when there is none."""
    at = next((i for i, line in enumerate(lines) if line.startswith(prefix)), len(lines))
    return lines[:at] + new + lines[at:]


def _training_procedure(lines: list[str], settings: list[str], versions: str) -> list[str]:
    """TRL's "Training procedure" (its run links, the method's paper, "Framework versions") with the settings table
    before "Framework versions" and `versions` first in its list."""
    lines = _tidy(lines)
    if "### Framework versions" not in lines:
        lines += ["", "### Framework versions", ""]
    at = lines.index("### Framework versions")
    return _tidy([*lines[:at], "", *settings, *_insert_before(lines[at:], "- ", [versions])])


def _trl_card(*, base_model, model_name, hub_model_id, dataset_name, tags, wandb_url, trackio_url, comet_url):
    """TRL's card for these inputs, from TRL's own builder (`trl.trainer.utils.generate_model_card`), with the
    paper and name `RPPTrainer` gives TRL (`_paper`, `_name`)."""
    from trl.trainer.utils import generate_model_card

    paper = REINFORCE_PP_PAPER
    return generate_model_card(
        base_model=base_model, model_name=model_name, hub_model_id=hub_model_id, dataset_name=dataset_name,
        tags=list(tags or []), wandb_url=wandb_url, trackio_url=trackio_url, comet_url=comet_url,
        trainer_name="REINFORCE++", trainer_citation=paper["citation"], paper_title=paper["title"],
        paper_id=paper["id"],
    )


def render_model_card(
    *,
    args,
    base_model: str | None,
    model_name: str | None = None,
    dataset_name: str | None = None,
    hub_model_id: str | None = None,
    tags: list[str] | None = None,
    wandb_url: str | None = None,
    trackio_url: str | None = None,
    comet_url: str | None = None,
    peft_type: str | None = None,
    prompt=None,
    trl_card=None,
) -> str:
    """The card's full text (YAML metadata and Markdown) for a run with `args` (an `RPPConfig`): `trl_card` (TRL's
    `ModelCard` for the run, as its `create_model_card` wrote it; when None, TRL's `generate_model_card` builds it
    from `tags` and the run links given here) with our changes (see the module's docstring). Its quick start asks
    `prompt` (a string or a list of chat messages: `example_prompt` of the training data)."""
    from huggingface_hub import ModelCardData

    base_id, base_text = describe_base_model(base_model)
    dataset_id, dataset_text = describe_dataset(dataset_name)
    model_name = model_name or Path(str(args.output_dir)).name
    load_from = hub_model_id or local_name(args.output_dir)
    if trl_card is None:
        trl_card = _trl_card(base_model=base_id, model_name=model_name, hub_model_id=load_from,
                             dataset_name=dataset_id, tags=tags, wandb_url=wandb_url, trackio_url=trackio_url,
                             comet_url=comet_url)
    trl_data = trl_card.data.to_dict()
    card_data = ModelCardData(**{
        **trl_data,  # TRL's tags (run links, unsloth, hf_jobs) and whatever else TRL records
        # TRL's tags come from a set: in a fixed order here, so that the card of each save differs only where it must
        "tags": sorted(trl_data.get("tags") or [], key=lambda tag: (tag != "generated_from_trainer", tag)) or None,
        "base_model": base_id,
        "datasets": [dataset_id] if dataset_id else None,
        "library_name": "peft" if peft_type else trl_data.get("library_name", "transformers"),
        "model_name": model_name,
    })

    estimator = _ESTIMATOR_NAMES.get(args.advantage_estimator, args.advantage_estimator)
    adapter = f" as a {peft_type} adapter" if peft_type else ""
    trained_on = f" on {dataset_text}" if dataset_text else ""
    paper = REINFORCE_PP_PAPER
    method = f"[{paper['title']}](https://huggingface.co/papers/{paper['id']}) (arXiv:{paper['id']})"
    if args.score_centering:
        sc = SCORE_CENTERING_PAPER
        method += (f", with the score-centering correction of [{sc['title']}](https://huggingface.co/papers/{sc['id']}) "
                   f"(arXiv:{sc['id']})")
    opening = f"""# Model Card for {model_name}

This model is a fine-tuned version of {base_text}{trained_on}{adapter}.
It was trained with {estimator} by `trl_rpp`'s `RPPTrainer`, a subclass of
[TRL](https://github.com/huggingface/trl)'s `GRPOTrainer`; {estimator} is the method of {method}."""
    quick_start = f"""```python
from transformers import pipeline

generator = pipeline("text-generation", model="{load_from}", device_map="auto")
output = generator({_quick_start_input(prompt)}, max_new_tokens=64, return_full_text=False)[0]
print(output["generated_text"])
```"""
    settings = ["| setting | value |", "| --- | --- |", *(f"| {k} | {v} |" for k, v in training_settings(args)), ""]
    versions = f"- trl_rpp: {_version('trl_rpp')}"
    citation = ([*f"Cite score centering as:\n\n```bibtex\n{SCORE_CENTERING_PAPER['citation']}\n```".splitlines(), ""]
                if args.score_centering else [])

    # TRL's sections in TRL's order: its opening and quick start replaced by ours, its training procedure (the run
    # links, the method's paper, the framework versions) and citations kept with ours added, any other kept as is.
    ours = {
        None: lambda lines: opening.splitlines(),
        "Quick start": lambda lines: quick_start.splitlines(),
        "Training procedure": lambda lines: _training_procedure(lines, settings, versions),
        "Citations": lambda lines: _tidy(_insert_before(_tidy(lines), "Cite TRL as", citation)),
    }
    body = []
    for heading, lines in _sections(trl_card.text):
        new = ours.pop(heading, _tidy)(lines)
        body += ([] if heading is None else [f"## {heading}", ""]) + new + [""]
    for heading, make in ours.items():  # a section TRL's card no longer has
        body += ([] if heading is None else [f"## {heading}", ""]) + make([]) + [""]
    return "---\n" + card_data.to_yaml() + "\n---\n\n" + "\n".join(body)


def build_model_card(model, args, hub_model_id, train_dataset, trl_card, model_name=None, dataset_name=None):
    """The `huggingface_hub.ModelCard` of an `RPPTrainer` run: `trl_card` (the card TRL's `create_model_card` wrote
    for the same `model_name`, `dataset_name` and tags) with our changes. As TRL's card does, it describes the
    trainer's `model` (its base model and adapter), its `args`, its `hub_model_id` and the first prompt of its
    `train_dataset`."""
    from huggingface_hub import ModelCard
    from trl.trainer.utils import get_config_model_id  # what TRL's card reads the base model with

    config = getattr(model, "config", None)
    base_model = get_config_model_id(config) if config is not None else None
    peft_config = getattr(model, "peft_config", None)
    peft_type = None
    if peft_config:
        first = next(iter(peft_config.values()))
        peft_type = str(getattr(first.peft_type, "value", first.peft_type))
        peft_type = {"LORA": "LoRA"}.get(peft_type, peft_type)
    text = render_model_card(
        args=args, base_model=base_model or None, model_name=model_name, dataset_name=dataset_name,
        hub_model_id=hub_model_id, peft_type=peft_type, prompt=example_prompt(train_dataset),
        trl_card=trl_card,
    )
    return ModelCard(text)
