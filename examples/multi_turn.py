"""Multi-turn REINFORCE++ with score centering: a tool loop and an environment loop, offline on a tiny model.

A model that acts in several turns samples some of its completion's tokens and reads the others (a tool's result,
an environment's reply). Those are holes in the loss mask (`tool_mask = 0`). Score centering needs the sampler's
top-k log-probs at every *sampled* token; this script shows the two ways to get them:

1. **Tool loop** (`--loop tools`): pass `tools=[multiply]` (or `environment_factory=`). TRL's own loop parses the
   model's `<tool_call>`, runs the Python function, appends its result and lets the model continue; `RPPTrainer`
   records the sampler's top-k inside every `generate` call of that loop and aligns it to the final completion.
2. **Environment loop** (`--loop rollout`): pass your own `rollout_func`. It samples, talks to the environment
   itself, and returns `env_mask` (1 = sampled, 0 = environment) plus, for score centering, the sampler's top-k at
   each token: `logprobs` and `logprob_token_ids` of k entries per token (k + 1 when the sampled token is not
   among them), exactly what vLLM reports with `logprobs=k`. Here it samples with transformers' `generate`.

The model is a tiny random-init Llama warmed up for about half a minute (`trl_rpp.testing.tool_model`, built on the
first run into `--model_dir` unless `--model_name_or_path` is given) on two answers to "What is a times b?": call
`multiply` and answer with its result, or answer at once with a + b, which is wrong. So it calls the tool for about
half of its samples and the reward (1 for the right product) starts near 0.5. Reinforcement learns to call the tool:
in both loops the reward and the share of tool calls rise within a few steps (`tests/test_multi_turn_example.py`
checks it). Everything runs on CPU, offline:

    python examples/multi_turn.py                       # both loops, 6 steps each
    python examples/multi_turn.py --loop rollout --max_steps 10
"""

from __future__ import annotations

import argparse
import json
import os
import re
import tempfile

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")  # rollout_func and environment_factory are experimental in TRL

# torch, transformers and TRL are imported where they are used, after the arguments are parsed, so that `--help`
# answers at once (tests/test_examples.py checks that it imports none of them).


def sample_turn(model, tokenizer, prompts, k, temperature, max_new_tokens):
    """Sample one turn for each prompt (token id lists) and report the sampler's top-k at every sampled token.

    Returns one ``(token_ids, logprobs, logprob_token_ids)`` per prompt: ``logprobs[t]`` and ``logprob_token_ids[t]``
    are the k most probable tokens of ``softmax(logits / temperature)`` (the distribution ``generate`` samples from)
    by rank, followed by the sampled token when it is not among them.
    """
    import torch

    pad = tokenizer.pad_token_id
    width = max(len(p) for p in prompts)
    input_ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.no_grad():
        out = model.generate(
            input_ids=input_ids.to(model.device), attention_mask=attention_mask.to(model.device), do_sample=True,
            temperature=temperature, top_k=0, top_p=1.0, max_new_tokens=max_new_tokens, output_logits=True,
            return_dict_in_generate=True, pad_token_id=pad, eos_token_id=tokenizer.eos_token_id,
        )
    logq = torch.log_softmax(torch.stack(out.logits, dim=1).float() / temperature, dim=-1)  # [B, steps, V]
    top = logq.topk(k, dim=-1)
    turns = []
    for b, row in enumerate(out.sequences[:, width:].tolist()):
        n = row.index(tokenizer.eos_token_id) + 1 if tokenizer.eos_token_id in row else len(row)
        ids, lps = top.indices[b, :n].tolist(), top.values[b, :n].tolist()
        for t, token in enumerate(row[:n]):
            if token not in ids[t]:  # the sampled token is outside the top-k: vLLM appends it, so do we
                ids[t].append(token)
                lps[t].append(logq[b, t, token].item())
        turns.append((row[:n], lps, ids))
    return turns


def make_rollout_func(k, temperature, max_turn_tokens=40):
    """A `rollout_func` with its own environment: a calculator that answers the model's `multiply` calls.

    Turn 1 is sampled; if it is a well-formed tool call, the environment appends its result (``env_mask = 0``) and
    turn 2 is sampled; the completion is cut to ``max_completion_length``.
    """

    from trl_rpp.testing.tool_model import multiply

    def rollout_func(prompts, trainer):
        tokenizer = trainer.processing_class
        model = trainer.accelerator.unwrap_model(trainer.model)
        prompt_ids = [
            tokenizer.apply_chat_template(p, tools=[multiply], add_generation_prompt=True, tokenize=True, return_dict=True)[
                "input_ids"
            ]
            for p in prompts
        ]
        completions = [[[], [], [], []] for _ in prompts]  # ids, logprobs, logprob_token_ids, env_mask
        for b, turn in enumerate(sample_turn(model, tokenizer, prompt_ids, k, temperature, max_turn_tokens)):
            for field, values in zip(completions[b], (*turn, [1] * len(turn[0]))):
                field.extend(values)
        # The environment: run the call, reply in the chat template's tool-response format.
        calling = []
        for b, (ids, *_rest) in enumerate(completions):
            call = re.search(r"<tool_call>\s*(\{.*\})\s*</tool_call>", tokenizer.decode(ids), re.DOTALL)
            try:
                result = multiply(**json.loads(call.group(1))["arguments"]) if call else None
            except (ValueError, TypeError, KeyError):
                result = None  # a malformed call: the episode ends
            if result is not None:
                reply = f"\n<|im_start|>user\n<tool_response>\n{result}\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
                env = tokenizer(reply, add_special_tokens=False)["input_ids"]
                for field, values in zip(completions[b], (env, [[0.0]] * len(env), [[t] for t in env], [0] * len(env))):
                    field.extend(values)  # no sampler at environment tokens: any entries do, env_mask = 0
                calling.append(b)
        if calling:
            turns = sample_turn(model, tokenizer, [prompt_ids[b] + completions[b][0] for b in calling], k, temperature,
                                max_turn_tokens)
            for b, turn in zip(calling, turns):
                for field, values in zip(completions[b], (*turn, [1] * len(turn[0]))):
                    field.extend(values)
        cut = trainer.max_completion_length
        ids, logprobs, token_ids, env_mask = (list(x) for x in zip(*[[f[:cut] for f in c] for c in completions]))
        return {"prompt_ids": prompt_ids, "completion_ids": ids, "logprobs": logprobs, "logprob_token_ids": token_ids,
                "env_mask": env_mask}

    return rollout_func


def train(loop, model, output_dir, a):
    from trl_rpp import RPPConfig, RPPTrainer
    from trl_rpp.testing.tool_model import correct_product_reward, multiply, tool_dataset

    config = RPPConfig(
        output_dir=output_dir, advantage_estimator="reinforce_plus_plus_baseline", score_centering=True,
        score_centering_top_k=a.top_k, temperature=a.temperature, max_steps=a.max_steps, learning_rate=a.learning_rate,
        per_device_train_batch_size=a.per_device_train_batch_size, num_generations=4,
        max_completion_length=a.max_completion_length,
        logging_steps=1, save_strategy="no", report_to="none", use_cpu=True, bf16=False, seed=a.seed,
        gradient_checkpointing=False,  # a tiny model: recomputing activations would only cost time
    )
    kwargs = {"tools": [multiply]} if loop == "tools" else {"rollout_func": make_rollout_func(a.top_k, a.temperature)}
    trainer = RPPTrainer(
        model=model, reward_funcs=correct_product_reward, args=config, train_dataset=tool_dataset(64, seed=a.seed),
        **kwargs,
    )
    trainer.train()
    keys = ["reward", "frac_reward_zero_std", "tools/call_frequency", "score_centering/sampler_head_mass",
            "score_centering/coeff_l1"]
    rewards = []
    for log in trainer.state.log_history:
        if "reward" in log:
            rewards.append(log["reward"])
            print(f"[{loop}] step {log['step']}: " + ", ".join(f"{k}={log[k]:.4g}" for k in keys if k in log))
    if rewards:
        print(f"[{loop}] reward: {rewards[0]:.3f} at the first step, {rewards[-1]:.3f} at the last")
    return trainer


def build_half_tool_model(path):
    """The example's model: the tiny tool model warmed up with `direct_answers`, so that it calls `multiply` for
    about half of its samples (the loss cannot fall below the coin flip at the first answer token, hence the higher
    target loss)."""
    from trl_rpp.testing.tool_model import build_tool_model

    return build_tool_model(path, direct_answers=True, target_loss=0.05)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--loop", choices=["tools", "rollout", "both"], default="both")
    p.add_argument("--model_name_or_path", default=None, help="a tool-calling model; default: the tiny one, built")
    p.add_argument("--model_dir", default=os.path.join(tempfile.gettempdir(), "trl_rpp_tiny_tool_model_half"),
                   help="where the tiny tool model is built (reused when already there)")
    p.add_argument("--output_dir", default=os.path.join(tempfile.gettempdir(), "trl_rpp_multi_turn"))
    p.add_argument("--max_steps", type=int, default=6)
    p.add_argument("--top_k", type=int, default=8, help="score_centering_top_k")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--learning_rate", type=float, default=3e-4)
    p.add_argument("--max_completion_length", type=int, default=64)
    p.add_argument("--per_device_train_batch_size", type=int, default=32, help="completions per step (4 per prompt)")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    model = a.model_name_or_path or build_half_tool_model(a.model_dir)
    loops = ["tools", "rollout"] if a.loop == "both" else [a.loop]
    return {loop: train(loop, model, os.path.join(a.output_dir, loop), a) for loop in loops}


if __name__ == "__main__":
    main()
