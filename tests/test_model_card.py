"""The model card (`trl_rpp/model_card.py`): base model and dataset named without `None` or broken links, the
estimator's settings recorded, the current REINFORCE++ citation, and score centering's when it is on. The card
the demo writes is checked end to end in `tests/test_demo_and_benchmarks.py`."""

import json
import re
from pathlib import Path

import pytest

from trl_rpp import RPPConfig
from trl_rpp.model_card import (
    REINFORCE_PP_PAPER,
    SCORE_CENTERING_PAPER,
    describe_base_model,
    describe_dataset,
    render_model_card,
)

CURRENT_TITLE = "REINFORCE++: Stabilizing Critic-Free Policy Optimization with Global Advantage Normalization"


def _config(**kw):
    return RPPConfig(output_dir="outputs/run-x", use_cpu=True, bf16=False, report_to="none", **kw)


def assert_no_broken_links(card):
    assert "None" not in card.split("## Citations")[0], card
    for url in re.findall(r"\]\((https?://[^)]+)\)", card):
        assert not url.endswith(("/None", "/")) and " " not in url, url


def test_hub_model_and_dataset_are_linked():
    card = render_model_card(args=_config(), base_model="Qwen/Qwen3-0.6B", dataset_name="openai/gsm8k")
    assert "fine-tuned version of [Qwen/Qwen3-0.6B](https://huggingface.co/Qwen/Qwen3-0.6B)" in card
    assert "on the [openai/gsm8k](https://huggingface.co/datasets/openai/gsm8k) dataset" in card
    assert "base_model: Qwen/Qwen3-0.6B" in card and "- openai/gsm8k" in card
    assert 'model="outputs/run-x"' in card  # not pushed: the quick start loads the output folder
    assert_no_broken_links(card)


def test_local_model_and_generated_dataset_get_no_link(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    card = render_model_card(args=_config(), base_model=str(tmp_path), dataset_name="generated arithmetic prompts")
    assert f"fine-tuned version of the local checkpoint `{tmp_path.name}` on generated arithmetic prompts." in card
    assert "base_model" not in card and "datasets:" not in card
    assert_no_broken_links(card)
    card = render_model_card(args=_config(), base_model=None, dataset_name=None)
    assert "whose name or path was not recorded" in card
    assert_no_broken_links(card)


def test_gguf_conversion_names_the_hub_model(tmp_path):
    (tmp_path / "trl_rpp_conversion.json").write_text(json.dumps(
        {"base_model": "HuggingFaceTB/SmolLM2-135M-Instruct", "source_gguf": "SmolLM2-135M-Instruct.Q4_1.gguf"}))
    hub, text = describe_base_model(str(tmp_path))
    assert hub == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert text.startswith("[HuggingFaceTB/SmolLM2-135M-Instruct](https://huggingface.co/HuggingFaceTB/SmolLM2-135M-Instruct)")
    assert "`SmolLM2-135M-Instruct.Q4_1.gguf`" in text and str(tmp_path) not in text  # no local folder named
    # A conversion marker from before `base_model` was recorded still names the GGUF file, without a link.
    (tmp_path / "trl_rpp_conversion.json").write_text(json.dumps({"source_gguf": "SmolLM2-135M-Instruct.Q4_1.gguf"}))
    assert describe_base_model(str(tmp_path)) == (
        None, "a local checkpoint converted to float32 from the GGUF file `SmolLM2-135M-Instruct.Q4_1.gguf`")


def test_card_never_names_an_absolute_local_path(tmp_path):
    """The card is meant for the Hub: a model converted into a cache under the home directory (the demo's
    SmolLM2), a local dataset and an output folder are named by their Hub id or their last component only."""
    home_cache = Path.home() / ".cache" / "trl_rpp" / "card-test-does-not-exist"  # never created
    converted = tmp_path / "cache" / "smollm2"
    converted.mkdir(parents=True)
    (converted / "trl_rpp_conversion.json").write_text(json.dumps(
        {"base_model": "HuggingFaceTB/SmolLM2-135M-Instruct", "source_gguf": str(tmp_path / "x" / "m.Q4_1.gguf")}))
    data = tmp_path / "train.jsonl"
    data.write_text("{}\n")
    args = RPPConfig(output_dir=str(tmp_path / "outputs" / "demo"), use_cpu=True, bf16=False, report_to="none")
    for base in (str(converted), str(home_cache), str(tmp_path)):
        card = render_model_card(args=args, base_model=base, dataset_name=str(data), peft_type="LoRA")
        assert str(tmp_path) not in card and str(Path.home()) not in card and "/.cache" not in card, card
        assert "`train.jsonl`" in card and 'model="demo"' in card
    card = render_model_card(args=args, base_model=str(converted), dataset_name=str(data))
    assert "fine-tuned version of [HuggingFaceTB/SmolLM2-135M-Instruct](https://huggingface.co/HuggingFaceTB/" in card
    assert "(converted to float32 from the GGUF file `m.Q4_1.gguf`) on the local dataset `train.jsonl`." in card
    assert describe_base_model(str(home_cache)) == (None, "the local checkpoint `card-test-does-not-exist`")
    assert describe_base_model("~/models/base")[1] == "the local checkpoint `base`"


def test_adapter_is_named_and_the_library_is_peft():
    card = render_model_card(args=_config(), base_model="m/x", dataset_name="d/y", peft_type="LoRA")
    assert "fine-tuned version of [m/x](https://huggingface.co/m/x) on the [d/y](https://huggingface.co/datasets/d/y) dataset as a LoRA adapter." in card
    assert "library_name: peft" in card


def test_dataset_descriptions(tmp_path, monkeypatch):
    data = tmp_path / "data" / "train.jsonl"
    data.parent.mkdir()
    data.write_text("{}\n")
    assert describe_dataset(str(data)) == (None, "the local dataset `train.jsonl`")
    monkeypatch.chdir(tmp_path)
    assert describe_dataset("data/train.jsonl") == (None, "the local dataset `data/train.jsonl`")  # relative: as given
    assert describe_dataset("arithmetic") == (None, "arithmetic")  # no namespace: not a Hub dataset id
    assert describe_dataset(None) == (None, None)


@pytest.mark.parametrize("estimator", ["reinforce_plus_plus", "reinforce_plus_plus_baseline"])
def test_card_records_estimator_kl_gamma_and_score_centering(estimator):
    card = render_model_card(args=_config(advantage_estimator=estimator, gamma=0.99 if estimator == "reinforce_plus_plus" else 1.0),
                             base_model="Qwen/Qwen3-0.6B")  # fmt: skip
    rows = dict(re.findall(r"^\| (`[^|]+`) \| (.+) \|$", card, flags=re.M))
    assert rows["`advantage_estimator`"].startswith(f"`{estimator}`")
    if estimator == "reinforce_plus_plus":
        assert "It was trained with REINFORCE++ by" in card
        assert rows["`gamma`"] == "`0.99`" and rows["`kl_coef`"].startswith("`0.01`")
        assert rows["`use_kl_loss`"] == "`False`" and "inactive" in rows["`kl_loss_coef`"]
    else:
        assert "It was trained with REINFORCE++-baseline by" in card
        assert rows["`kl_coef`"].startswith("`0.0`") and rows["`use_kl_loss`"] == "`True`"
        assert rows["`kl_loss_type`"] == "`k2`" and rows["`kl_loss_coef`"] == "`0.01`"
    assert rows["`score_centering`"] == "`False`" and SCORE_CENTERING_PAPER["id"] not in card
    centered = render_model_card(args=_config(advantage_estimator=estimator, score_centering=True), base_model="m/x")
    assert "`True` (top-k `32`)" in centered and SCORE_CENTERING_PAPER["citation"] in centered
    assert "arXiv:2609.20807" in centered and "Martin Marek and Max Ryabinin" in centered


def test_current_reinforce_pp_title_and_authors():
    card = render_model_card(args=_config(), base_model="m/x")
    assert REINFORCE_PP_PAPER["title"] == CURRENT_TITLE
    assert f"[{CURRENT_TITLE}](https://huggingface.co/papers/2501.03262)" in card
    assert "author       = {Jian Hu and Jason Klein Liu and Haotian Xu and Wei Shen}" in card
    assert "others" not in card and "A Simple and Efficient Approach" not in card.split("## Citations")[1]


def _quick_start_prompt(card):
    """The first argument of `generator(...)` in the card's quick start, evaluated as the Python it is."""
    import ast

    code = card.split("## Quick start")[1].split("```python")[1].split("```")[0]
    call = next(node for node in ast.walk(ast.parse(code))
                if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "generator")
    return ast.literal_eval(call.args[0])


def test_quick_start_prompt_comes_from_the_training_data():
    """The quick start asks the first training prompt, whatever its form: a text (the copy task) or a chat (the
    tool task); no constant prompt is left in the card."""
    from trl_rpp.model_card import example_prompt
    from trl_rpp.testing.tiny import copy_task_dataset
    from trl_rpp.testing.tool_model import tool_dataset
    from datasets import Dataset

    texts, chats = copy_task_dataset(8, seed=3), tool_dataset(8, seed=5)
    assert isinstance(texts[0]["prompt"], str) and isinstance(chats[0]["prompt"], list)
    cards = []
    for data in (texts, chats):
        card = render_model_card(args=_config(), base_model="m/x", prompt=example_prompt(data))
        assert _quick_start_prompt(card) == data[0]["prompt"]
        assert "17 + 25" not in card
        cards.append(card)
    assert cards[0] != cards[1]
    # Nothing to read (no dataset, no `prompt` column): a placeholder that says so, never a made-up question.
    assert example_prompt(None) is None and example_prompt(Dataset.from_list([{"text": "x"}])) is None
    card = render_model_card(args=_config(), base_model="m/x", prompt=None)
    assert _quick_start_prompt(card) == "Your prompt here"


def _links(text):
    """Every URL in a card: Markdown links, image sources, the `trackio:<url>` tag."""
    return set(re.findall(r"https?://[^\s)\"'<>]+", text))


def test_every_link_of_trls_card_for_a_run_is_in_ours(tmp_path, tiny_model, monkeypatch):
    """Our card is TRL's plus ours: for a trainer whose run TRL sees on Weights & Biases, Trackio and Comet, in a
    Hugging Face Job, with an Unsloth-patched model, every link (the run links among them) and every tag of the card
    TRL's own `create_model_card` writes is in ours, and ours keeps its own sections.

    W&B is a real run (offline: WANDB_MODE). An offline run has no URL (`Run.url` is None by W&B's design), so TRL's
    card links none: first checked as it is; then `Run.url` gives the URL an online run of the same id would have.
    Trackio and Comet are not installed here: `get_trackio_space_url` and `get_comet_experiment_url`, which TRL's
    `create_model_card` calls for their URLs, give a URL in the form each builds."""
    import trl.trainer.base_trainer as trl_base
    import wandb
    from huggingface_hub import ModelCard
    from trl import GRPOTrainer

    from trl_rpp import RPPTrainer
    from trl_rpp.testing.tiny import copy_first_char_reward, copy_task_dataset

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("JOB_ID", "card-test-job")  # a Hugging Face Job: TRL tags the card `hf_jobs`
    args = RPPConfig(output_dir=str(tmp_path / "out"), use_cpu=True, bf16=False, report_to="none",
                     per_device_train_batch_size=4, num_generations=4, max_completion_length=4)
    trainer = RPPTrainer(model=tiny_model, reward_funcs=copy_first_char_reward, args=args,
                         train_dataset=copy_task_dataset(8))
    readme = tmp_path / "out" / "README.md"

    def cards(**kw):
        GRPOTrainer.create_model_card(trainer, **kw)
        theirs = readme.read_text()
        trainer.create_model_card(**kw)
        return theirs, readme.read_text()

    run = wandb.init(project="trl-rpp-card", dir=str(tmp_path))
    try:
        # The tiny model is a local folder: TRL's card links `https://huggingface.co/None`, ours none, the rest alike.
        assert run.url is None
        theirs, ours = cards(model_name="tiny-rpp", dataset_name="openai/gsm8k", tags=["my-tag"])
        assert "https://huggingface.co/None" in _links(theirs) and "huggingface.co/None" not in ours
        assert _links(theirs) - {"https://huggingface.co/None"} <= _links(ours)
        assert f"fine-tuned version of the local checkpoint `{Path(tiny_model).name}`" in ours

        wandb_url = f"https://wandb.ai/trl-rpp/{run.project}/runs/{run.id}"
        trackio_url = "https://me-trackio.hf.space?project=trl-rpp-card&runs=run-1&sidebar=collapsed"
        comet_url = "https://www.comet.com/me/trl-rpp-card/0123456789abcdef"
        monkeypatch.setattr(type(run), "url", property(lambda r: f"https://wandb.ai/trl-rpp/{r.project}/runs/{r.id}"))
        monkeypatch.setattr(trl_base, "get_trackio_space_url", lambda: trackio_url)
        monkeypatch.setattr(trl_base, "get_comet_experiment_url", lambda: comet_url)
        trainer.model.config.name_or_path = "Qwen/Qwen3-0.6B"  # as loaded from the Hub: TRL links the base model
        trainer.model.config.unsloth_version = "2026.1.1"  # as Unsloth marks a model it patched
        theirs, ours = cards(model_name="tiny-rpp", dataset_name="openai/gsm8k", tags=["my-tag"])
    finally:
        wandb.finish()
        wandb.teardown()  # W&B keeps this run's settings (its dir) process-wide: the next test's run starts afresh
    assert {wandb_url, trackio_url, comet_url} <= _links(theirs)  # TRL saw the three runs
    assert _links(theirs) <= _links(ours), _links(theirs) - _links(ours)
    their_tags, our_tags = ModelCard(theirs).data.tags, ModelCard(ours).data.tags
    assert {"unsloth", "hf_jobs", f"trackio:{trackio_url}", "my-tag", "reinforce-plus-plus"} <= set(their_tags)
    assert set(their_tags) <= set(our_tags)
    # What ours adds to TRL's: the base model and dataset named, the settings, our quick start, trl_rpp's version.
    assert ("fine-tuned version of [Qwen/Qwen3-0.6B](https://huggingface.co/Qwen/Qwen3-0.6B) on the "
            "[openai/gsm8k](https://huggingface.co/datasets/openai/gsm8k) dataset." in ours)
    assert "| `advantage_estimator` | `reinforce_plus_plus`" in ours and "- trl_rpp: " in ours
    assert _quick_start_prompt(ours) == trainer.train_dataset[0]["prompt"] and 'model="out"' in ours
    assert REINFORCE_PP_PAPER["citation"] in ours and ours.count("Cite TRL as:") == 1
    assert str(tmp_path) not in ours
    assert_no_broken_links(ours)
