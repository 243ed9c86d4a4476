"""A tiny, fully local model that calls a real Python tool through TRL's tool loop, for tests and examples.

Nothing here touches the network. The pieces are those of a real tool-calling chat model, built in code:

* **Tokenizer**: a byte-level BPE (GPT-2 style, lossless on any text) trained in a fraction of a second on the
  conversations below, with Qwen's special tokens (``<|im_start|>``, ``<|im_end|>`` as special tokens;
  ``<tool_call>``, ``</tool_call>``, ``<tool_response>``, ``</tool_response>``, ``<think>``, ``</think>`` as plain
  added tokens, so that decoding keeps them for the response parser). EOS is ``<|im_end|>``.
* **Chat template**: TRL's own Qwen3 template (`trl.chat_template_utils.qwen3_chat_template`), which renders the
  tools' JSON schemas in the system prompt. TRL recognizes it: `GRPOTrainer` sets Qwen3's response template
  (`add_response_schema`), so `parse_response` extracts ``<tool_call>{...}</tool_call>`` exactly as for a real
  Qwen3 checkpoint, and swaps in its prefix-preserving training template for the tool loop.
* **Model**: a random-init 2-layer Llama (hidden size 64), then a short supervised warm-up (a few hundred Adam steps
  on ~250-token sequences, about half a minute of one CPU core) on the token sequences TRL's tool loop builds:
  ``prompt + <tool_call>{"name": "multiply", "arguments": {"a": A, "b": B}}</tool_call><|im_end|> + tool suffix +
  "The answer is A*B."<|im_end|>``, with the tool suffix computed by TRL's own `_get_tool_suffix_ids`. It learns to
  copy the two numbers of the question into the call and the tool's result into the answer, and to answer
  "Say hello." without a tool. Sampling at temperature 1 keeps some variety (an occasional malformed call).

`build_tool_model(path)` saves model and tokenizer under `path` (reused when already there), so it loads by path
like any Hub model.
"""

from __future__ import annotations

import os
import random
from types import SimpleNamespace

import torch

#: (a, b) pairs of the warm-up; `tool_dataset` asks about these.
PAIRS = [(3, 4), (2, 5), (6, 7), (8, 9), (4, 6), (7, 3), (5, 8), (9, 2)]
GREETING = "Say hello."
GREETING_ANSWER = "Hello!"
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
PLAIN = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>"]


def multiply(a: int, b: int) -> int:
    """
    Multiply two integers.

    Args:
        a: first
        b: second
    """
    return a * b


class MultiplyEnv:
    """An `environment_factory` environment: its public method `multiply` is the tool (same schema as `multiply`),
    and it records the products it computed."""

    def __init__(self):
        self.products = []

    def reset(self, **kwargs):
        self.products = []
        return None  # nothing appended to the prompt

    def multiply(self, a: int, b: int) -> int:
        """
        Multiply two integers.

        Args:
            a: first
            b: second
        """
        self.products.append(a * b)
        return a * b


def question(a: int, b: int) -> str:
    return f"What is {a} times {b}?"


def tool_call_text(a: int, b: int) -> str:
    """The assistant turn that calls `multiply`, as Qwen3 writes it."""
    return f'<tool_call>\n{{"name": "multiply", "arguments": {{"a": {a}, "b": {b}}}}}\n</tool_call><|im_end|>'


def answer_text(a: int, b: int) -> str:
    return f"The answer is {a * b}.<|im_end|>"


def tool_dataset(n: int, seed: int = 0, greeting_every: int = 0):
    """`datasets.Dataset` of `n` conversational prompts asking for a product of `PAIRS`, with the factors in columns
    ``a`` and ``b`` (for `correct_product_reward`); every ``greeting_every``-th row (when > 0) is "Say hello." with
    ``a = b = 0``."""
    from datasets import Dataset

    rng = random.Random(seed)
    rows = []
    for i in range(n):
        if greeting_every and i % greeting_every == greeting_every - 1:
            rows.append({"prompt": [{"role": "user", "content": GREETING}], "a": 0, "b": 0})
        else:
            a, b = rng.choice(PAIRS)
            rows.append({"prompt": [{"role": "user", "content": question(a, b)}], "a": a, "b": b})
    return Dataset.from_list(rows)


def correct_product_reward(completions, a, b, **kwargs):
    """1.0 when the last assistant message ends with "The answer is {a * b}." (0.0 otherwise; a greeting scores 1.0
    when answered with "Hello!"). "Ends with": a `rollout_func`'s multi-turn completion is parsed as one message."""
    rewards = []
    for messages, x, y in zip(completions, a, b):
        last = next((m.get("content") or "" for m in reversed(messages) if m.get("role") == "assistant"), "")
        want = GREETING_ANSWER if x == y == 0 else f"The answer is {x * y}."
        rewards.append(1.0 if last.strip().endswith(want) else 0.0)
    return rewards


def tool_tokenizer():
    """The byte-level BPE tokenizer with Qwen's special tokens and TRL's Qwen3 chat template (see the module doc)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    from trl.chat_template_utils import qwen3_chat_template

    renderer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.BPE()))  # renders text only
    renderer.chat_template = qwen3_chat_template
    corpus = [
        renderer.apply_chat_template(_conversation(a, b), tools=[multiply], tokenize=False) for a, b in PAIRS
    ] + [str(i) for i in range(100)] + [GREETING, GREETING_ANSWER]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in SPECIAL])
    tok.add_tokens([AddedToken(s, special=False, normalized=False) for s in PLAIN])
    trainer = trainers.BpeTrainer(
        vocab_size=1000, special_tokens=SPECIAL, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>", padding_side="left"
    )
    fast.chat_template = qwen3_chat_template
    return fast


def _conversation(a, b):
    call = {"type": "function", "function": {"name": "multiply", "arguments": {"a": a, "b": b}}}
    return [
        {"role": "user", "content": question(a, b)},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "name": "multiply", "content": str(a * b)},
        {"role": "assistant", "content": answer_text(a, b).removesuffix("<|im_end|>")},
    ]


def direct_answer_text(a: int, b: int) -> str:
    """A wrong answer given without the tool: the sum instead of the product (never equal for `PAIRS`)."""
    return f"The answer is {a + b}.<|im_end|>"


def warmup_sequences(tokenizer, direct_answers: bool = False):
    """``[(input_ids, labels)]``: the token sequences TRL's tool loop builds for `PAIRS` (prompt as
    `GRPOTrainer._tokenize_prompts` renders it, the call, TRL's own tool suffix, the answer), labels on the model's
    tokens only; and the greeting. With ``direct_answers``, each question is also answered at once, without the tool
    and wrongly (`direct_answer_text`), so the warmed-up model calls the tool for about half of its samples."""
    from trl.chat_template_utils import get_training_chat_template, is_chat_template_prefix_preserving

    from ..patches import tool_suffix_ids

    # As GRPOTrainer with tools: its training template when the tokenizer's is not prefix-preserving.
    template = None if is_chat_template_prefix_preserving(tokenizer) else get_training_chat_template(tokenizer)
    trl_view = SimpleNamespace(
        processing_class=tokenizer, chat_template=template, chat_template_kwargs={}, _is_vlm=False, _tokenizer=tokenizer
    )

    def prompt_ids(content):
        return tokenizer.apply_chat_template(
            [{"role": "user", "content": content}], tools=[multiply], chat_template=template,
            add_generation_prompt=True, tokenize=True, return_dict=True,
        )["input_ids"]

    def encode(text):
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    sequences = []
    for a, b in PAIRS:
        prompt, call, answer = prompt_ids(question(a, b)), encode(tool_call_text(a, b)), encode(answer_text(a, b))
        suffix = tool_suffix_ids(trl_view, [{"role": "tool", "name": "multiply", "content": str(a * b)}])
        ids = prompt + call + suffix + answer
        labels = [-100] * len(prompt) + call + [-100] * len(suffix) + answer
        sequences.append((ids, labels))
        if direct_answers:
            direct = encode(direct_answer_text(a, b))
            sequences.append((prompt + direct, [-100] * len(prompt) + direct))
    prompt, answer = prompt_ids(GREETING), encode(GREETING_ANSWER + "<|im_end|>")
    sequences.append((prompt + answer, [-100] * len(prompt) + answer))
    return sequences


def build_tool_model(
    path: str | os.PathLike, seed: int = 0, max_steps: int = 700, target_loss: float = 3e-3, threads: int | None = 1,
    direct_answers: bool = False, num_attention_heads: int = 4,
) -> str:
    """Build, warm up and save the tiny tool-calling model and its tokenizer under `path`. Returns `str(path)`.

    The warm-up stops at ``max_steps`` or once the mean token loss is below ``target_loss`` (checked every 25 steps;
    about 400 steps). It runs with ``threads`` torch threads (restored afterwards). Reuses an existing save.
    ``direct_answers``: see `warmup_sequences` (the first answer token is then a coin flip, so the loss floor is
    higher: ``target_loss`` should be raised accordingly). ``num_attention_heads``: of the hidden size 64 (2 heads of 32
    for vLLM's CPU attention, which takes head sizes from 32).
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    path = str(path)
    if os.path.exists(os.path.join(path, "config.json")):
        return path
    tokenizer = tool_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=num_attention_heads, num_key_value_heads=num_attention_heads, max_position_embeddings=512, pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id, bos_token_id=None, tie_word_embeddings=False,
    )
    sequences = warmup_sequences(tokenizer, direct_answers)
    L = max(len(ids) for ids, _ in sequences)
    x = torch.tensor([ids + [tokenizer.pad_token_id] * (L - len(ids)) for ids, _ in sequences])
    y = torch.tensor([labels + [-100] * (L - len(labels)) for _, labels in sequences])
    attention = torch.tensor([[1] * len(ids) + [0] * (L - len(ids)) for ids, _ in sequences])
    previous_threads = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        with torch.random.fork_rng(devices=[]):  # seeded here, and the caller's random state left as it was
            torch.manual_seed(seed)
            model = LlamaForCausalLM(config)
            optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
            for step in range(max_steps):
                loss = model(input_ids=x, attention_mask=attention, labels=y).loss
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                if step % 25 == 24 and loss.item() < target_loss:
                    break
    finally:
        torch.set_num_threads(previous_threads)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.bos_token_id = None
    tmp = f"{path}.tmp-{os.getpid()}"
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    os.replace(tmp, path)  # whole or absent: a concurrent or interrupted build never leaves half a model
    return path
