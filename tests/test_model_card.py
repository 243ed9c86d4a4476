"""The model card (`trl_rpp/model_card.py`): base model and dataset named without `None` or broken links, the
estimator's settings recorded, the current REINFORCE++ citation, and score centering's when it is on. The card
the demo writes is checked end to end in `tests/test_demo_and_benchmarks.py`."""

import json
import re

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
    assert f"fine-tuned version of the local checkpoint `{tmp_path}` on generated arithmetic prompts." in card
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
    assert "`SmolLM2-135M-Instruct.Q4_1.gguf`" in text and str(tmp_path) in text
    # A conversion marker from before `base_model` was recorded still names the GGUF file, without a link.
    (tmp_path / "trl_rpp_conversion.json").write_text(json.dumps({"source_gguf": "SmolLM2-135M-Instruct.Q4_1.gguf"}))
    assert describe_base_model(str(tmp_path)) == (
        None, f"a local checkpoint converted to float32 from the GGUF file `SmolLM2-135M-Instruct.Q4_1.gguf` (`{tmp_path}`)")


def test_adapter_is_named_and_the_library_is_peft():
    card = render_model_card(args=_config(), base_model="m/x", dataset_name="d/y", peft_type="LoRA")
    assert "fine-tuned version of [m/x](https://huggingface.co/m/x) on the [d/y](https://huggingface.co/datasets/d/y) dataset as a LoRA adapter." in card
    assert "library_name: peft" in card


def test_dataset_descriptions(tmp_path):
    data = tmp_path / "train.jsonl"
    data.write_text("{}\n")
    assert describe_dataset(str(data)) == (None, f"the local dataset `{data}`")
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
