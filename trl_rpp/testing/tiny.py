"""Tiny, fully local models and a built-in task, for tests, `--tiny` demos and benchmarks.

Nothing here touches the network: the tokenizer is a character-level vocabulary built in code, and the model is a
random-init Llama built from a config and saved with `save_pretrained`, so it loads by path like any Hub model.
"""

from __future__ import annotations

import os
import random
import string

import torch

ALPHABET = string.ascii_lowercase + string.digits + " +=?:.,"
SPECIAL = ["<pad>", "<eos>", "<bos>"]


def char_tokenizer():
    """A character-level `PreTrainedTokenizerFast`: one token per character of `ALPHABET`, plus pad/eos/bos."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIAL + list(ALPHABET))}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    # Every character is its own word: split on the empty pattern, keep each char.
    tok.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", bos_token="<bos>", padding_side="left"
    )
    return fast


def build_tiny_model(
    path: str | os.PathLike, hidden_size: int = 64, num_layers: int = 2, seed: int = 0, num_heads: int = 4
) -> str:
    """Build a random-init Llama with the char tokenizer and save both under `path`. Returns `str(path)`.

    vLLM's CPU attention needs a head size it has kernels for (64 is one): `build_tiny_model(path, 128,
    num_heads=2)` builds such a model for the real-engine tests.

    Reuses an existing save at `path` (same config) so tests and demos pay the cost once.
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    path = str(path)
    if os.path.exists(os.path.join(path, "config.json")):
        return path
    tokenizer = char_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_heads,
        max_position_embeddings=128,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
        tie_word_embeddings=False,
    )
    with torch.random.fork_rng(devices=[]):  # seeded here, and the caller's random state left as it was
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return path


# ----------------------------------------------------------------------------------------------------------------
# Built-in task: "copy the first character of the prompt"
# ----------------------------------------------------------------------------------------------------------------

TASK_LETTERS = "abcdefgh"


def copy_task_dataset(n: int, seed: int = 0, length: int = 1):
    """`datasets.Dataset` with a `prompt` column of `n` prompts like `"c:"` (`length` letters of `TASK_LETTERS`).

    With `length=1` a random-init 2-layer model goes from ~0.03 to >0.95 reward in ~150 steps of 8x8 samples.
    """
    from datasets import Dataset

    rng = random.Random(seed)
    rows = [{"prompt": "".join(rng.choice(TASK_LETTERS) for _ in range(length)) + ":"} for _ in range(n)]
    return Dataset.from_list(rows)


def copy_first_char_reward(prompts, completions, **kwargs):
    """1.0 when the completion starts with the prompt's first character, else 0.0."""
    return [1.0 if c[:1] == p[:1] else 0.0 for p, c in zip(prompts, completions)]
