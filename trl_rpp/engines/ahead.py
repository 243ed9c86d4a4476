"""The next generation batch sampled on a vLLM server while this one trains: `RPPConfig.max_staleness=1`.

At each generation boundary, in this order (the order of verl's one-step-off-policy trainer):

1. **await** batch t, which the server has been sampling since the previous boundary (the first batch of a run, or of
   an epoch, is sampled here, on policy);
2. **sync** the weights of this optimizer step to the server, which is idle: no request is in flight, so no
   completion mixes two policies; the sync drops the server's prefix cache;
3. **launch** batch t+1: its prompts are read ahead from the training dataloader (`Lookahead`), gathered from every
   process, and process 0 sends them to the server from a thread of its own;
4. **score and train** batch t: rewards, pi_old and the reference under the weights of this step, while the server
   samples batch t+1.

So the batch trained at each step was sampled by the weights of one generation batch earlier, its record says by
which (`GenerationRecord.weight_version`, the optimizer step), and `sampling/staleness` logs how many generation
batches old it is. TRL's importance-sampling ratio is then pi_old / mu_stale, with pi_old computed when the batch
is trained, and the PPO ratio pi_theta / pi_old: the decoupled correction.

Only HTTP runs off the main thread. Every collective (the gather of the prompts at the launch, the broadcast of
the completions at the await, the weight sync) runs in the main thread, on every process, in the same order. Any
weight sync first waits for the batch in flight (`drain`), whoever asks for it (an evaluation's generation too).

A checkpoint saved with a batch in flight waits for it and stores its answer with the buffered generation batch
(`state` and `restore`, `trl_rpp.faults.checkpoint`); a failed one stops the run before the checkpoint is written.
The resumed run trains that very batch, then goes on as the uninterrupted run would.
"""

from __future__ import annotations

import collections
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from ..errors import unsupported
from ..faults.engine import EngineFaults
from ..patches import server_generate, wrap_weight_sync
from ..records.generation import GenerationRecord, recording


class Lookahead:
    """The training dataloader's epoch iterator, read ahead: `Trainer.get_batch_samples` takes its items in order
    (`__next__`), and `peek(index)` returns the item at `index` (counted from this iterator's first item) without
    taking it, reading the iterator ahead as far as needed; None past its end."""

    def __init__(self, iterator):
        self.iterator = iterator
        self.ahead = collections.deque()  # items read from `iterator`, not yet taken
        self.taken = 0  # items taken
        self.prepared = 0  # items `_prepare_inputs` has seen (each taken item, once, in order)

    def __iter__(self):
        return self

    def __next__(self):
        item = self.ahead.popleft() if self.ahead else next(self.iterator)
        self.taken += 1
        return item

    def peek(self, index: int):
        if index < self.taken:
            raise IndexError(f"item {index} was already taken ({self.taken} taken)")
        while self.taken + len(self.ahead) <= index:
            try:
                self.ahead.append(next(self.iterator))
            except StopIteration:
                return None
        return self.ahead[index - self.taken]


@dataclass
class Pending:
    """One generation batch launched on the server and not yet trained.

    Attributes:
        prompt_ids: this process's prompts, tokenized (``B_local`` lists of ids), as TRL will tokenize them again
            when the batch is trained.
        num_generations: completions per prompt.
        weight_version: the optimizer step whose weights the server held when the batch was launched.
        faults: the request's failure, on process 0 (`EngineFaults`).
        answer: the server's answer on process 0, ``(prompt_ids, completion_ids, logprobs, logprob_token_ids)`` for
            every process's completions, once the thread has finished (or restored from a checkpoint).
        thread: process 0's request in flight, or None.
        started, seconds: when the request was sent (`time.perf_counter`) and how long it took, on process 0.
    """

    prompt_ids: list
    num_generations: int
    weight_version: int
    faults: EngineFaults = field(default_factory=EngineFaults)
    answer: Any = None
    thread: threading.Thread | None = None
    started: float | None = None
    seconds: float | None = None

    def wait(self) -> None:
        """Process 0: wait for the request's answer (bounded by `vllm_server_request_timeout`)."""
        if self.thread is not None:
            self.thread.join()
            self.thread = None


class GenerationAhead:
    """The batch in flight of one `RPPTrainer` (see the module docstring). Made by `generation_ahead`."""

    def __init__(self, max_staleness: int):
        self.max_staleness = max_staleness
        self.pending: Pending | None = None
        self.lookahead: Lookahead | None = None

    # --- The dataloader -------------------------------------------------------------------------------------------

    def reading(self, epoch_iterator) -> Lookahead:
        """The `Lookahead` over Trainer's `epoch_iterator` (a new one for each epoch's iterator)."""
        if self.lookahead is None or self.lookahead.iterator is not epoch_iterator:
            self.lookahead = Lookahead(epoch_iterator)
        return self.lookahead

    def prepared(self) -> None:
        """`_prepare_inputs` saw the next taken item (training only)."""
        if self.lookahead is not None:
            self.lookahead.prepared += 1

    def next_inputs(self, micro_step: int, generate_every: int, micro_now: int, micro_total: int):
        """The local inputs of the next generation batch, or None when there is none to launch: it starts in the next
        epoch (whose iterator does not exist yet) or after the last trained micro-step (`micro_total`).

        Args:
            micro_step: GRPO's micro-step counter `_step` at this generation.
            generate_every: micro-steps per generation batch (`steps_per_generation * num_iterations`).
            micro_now: this micro-step, counted from the start of training (`global_step * GA + _step % GA`).
            micro_total: the micro-steps the run trains (`max_steps * GA`).
        """
        left = generate_every - micro_step % generate_every  # micro-steps from here to the next generation batch
        if self.lookahead is None or micro_now + left >= micro_total:
            return None
        return self.lookahead.peek(self.lookahead.prepared - 1 + left)

    # --- The server -----------------------------------------------------------------------------------------------

    def launch(self, prompt_ids, num_generations: int, weight_version: int, accelerator, vllm_generation,
               eos: int) -> Pending:
        """Every process, once the weights of `weight_version` are on the idle server: send this process's tokenized
        prompts, gathered with every other process's, to the server (`vllm_generation`'s client) from a thread on
        process 0. A failed request is answered with one `eos` per completion (`empty_answer`) and kept in
        `Pending.faults`."""
        from accelerate.utils import gather_object

        if self.pending is not None:
            raise RuntimeError("a generation batch is already in flight: the next one launches after it is taken")
        pending = Pending(prompt_ids, num_generations, weight_version)
        everyone = gather_object(prompt_ids) if accelerator.num_processes > 1 else list(prompt_ids)
        if accelerator.is_main_process:
            unique = everyone[::num_generations]
            request = server_generate(vllm_generation, unique, num_generations)

            def run():
                pending.started = start = time.perf_counter()
                # The server client's guard (`faults.engine.guard_client`) keeps a failure in the current record's
                # faults: this batch's, in this thread's context.
                with recording(GenerationRecord(engine_faults=pending.faults)):
                    try:
                        pending.answer = request()
                    except Exception as err:  # the request itself, not our parsing: reported as the engine's
                        pending.faults.record(err)
                if pending.answer is None:
                    pending.answer = empty_answer(eos, unique, num_generations)
                pending.seconds = time.perf_counter() - start

            pending.thread = threading.Thread(target=run, name="trl_rpp-generation-ahead", daemon=True)
            pending.thread.start()
        self.pending = pending
        return pending

    def take(self, prompt_ids, num_generations: int, record: GenerationRecord, accelerator):
        """Every process, as GRPO's vLLM branch would generate batch t: await the batch launched for these prompts and
        return this process's slice of the answer as `VLLMGeneration.generate` does, ``(prompt_ids, completion_ids,
        logprobs, logprob_token_ids)``. The request's failure joins `record.engine_faults`, and the batch's weight
        version `record.weight_version`."""
        from accelerate.utils import broadcast_object_list

        pending = self.pending
        if pending is None:
            raise RuntimeError("no generation batch is in flight: launch it first")
        if pending.prompt_ids != prompt_ids or pending.num_generations != num_generations:
            raise RuntimeError(
                "the generation batch sampled ahead was launched for other prompts than the batch now trained "
                f"({len(pending.prompt_ids)} prompts x {pending.num_generations} launched, {len(prompt_ids)} x "
                f"{num_generations} now): the training dataloader's order changed between the launch and the "
                "training (a resumed run with another dataset, seed or batch size?)")
        self.pending = None
        payload = [None]
        if accelerator.is_main_process:
            pending.wait()
            payload = [pending.answer]
            record.engine_faults.record(pending.faults.failure)
        if accelerator.num_processes > 1:
            broadcast_object_list(payload, from_process=0)
        record.weight_version = pending.weight_version
        all_prompts, completions, logprobs, token_ids = payload[0]
        n = num_generations
        local = slice(accelerator.process_index * len(prompt_ids), (accelerator.process_index + 1) * len(prompt_ids))
        every_prompt = [ids for ids in all_prompts for _ in range(n)]
        return (every_prompt[local], completions[local], None if logprobs is None else logprobs[local],
                None if token_ids is None else token_ids[local])

    def drain(self) -> None:
        """Process 0: wait for the batch in flight, keeping its answer. Runs before any weight sync."""
        if self.pending is not None:
            self.pending.wait()

    def close(self, wait: bool = True) -> None:
        """After training: drop a batch still in flight, after its answer (`wait`), or at once (the thread is a daemon
        and writes only to the dropped `Pending`): an error or an interrupt does not wait for the server."""
        if wait:
            self.drain()
        self.pending = None

    # --- Checkpoints ----------------------------------------------------------------------------------------------

    def state(self, is_main_process: bool):
        """Every process, at a checkpoint: ``(state, failure)``, what a resumed run needs to train the batch in flight
        (None when nothing is in flight), awaited on process 0, and its request's failure (process 0's, else None),
        for the caller to settle across processes before anything is written."""
        pending = self.pending  # in flight on every process, or on none
        if pending is None:
            return None, None
        answer = None
        if is_main_process:
            pending.wait()
            answer = list(pending.answer)
        return ({"prompt_ids": pending.prompt_ids, "num_generations": pending.num_generations,
                 "weight_version": pending.weight_version, "answer": answer}, pending.faults.failure)

    def restore(self, state: dict | None) -> None:
        """On resume: the batch that was in flight at the checkpoint, already answered."""
        if state is None:
            self.pending = None
            return
        answer = state["answer"]
        self.pending = Pending(state["prompt_ids"], state["num_generations"], state["weight_version"],
                               answer=None if answer is None else tuple(answer))


def empty_answer(eos: int, prompts, n: int):
    """A failed request's answer, shaped as `VLLMGeneration.generate`'s for every process: one `eos` per completion,
    log-prob 0. Nothing is trained on it (`EngineFaults.settle` raises first)."""
    m = len(prompts) * n
    return ([list(p) for p in prompts], [[eos] for _ in range(m)], [[[0.0]] for _ in range(m)],
            [[[eos]] for _ in range(m)])


def check_generation_ahead(args, tools=None, rollout_func=None, environment_factory=None, is_vlm=False) -> None:
    """At trainer construction: what the batch sampled ahead cannot carry, refused with a `ValueError` naming it.
    The config's own rules (`RPPConfig`) already require a vLLM server."""
    if not args.max_staleness:
        return
    under = f"max_staleness={args.max_staleness}"
    why = ("The batch sampled ahead is one request per batch on its prompts alone: TRL's tool loop, a rollout_func "
           "and an environment generate again inside the batch, from the trainer's current state.")
    for name, given in (("tools", tools), ("rollout_func", rollout_func), ("environment_factory", environment_factory)):
        if given:
            raise unsupported(name, "given", "None", why, under)
    if is_vlm:
        raise unsupported("model", "a vision-language model", "a text-only model",
                          "Images are not sent with the batch sampled ahead.", under)


def generation_ahead(max_staleness: int, vllm_generation) -> GenerationAhead | None:
    """The `GenerationAhead` of a trainer with `max_staleness > 0` (else None), with every weight sync of its engine
    (`vllm_generation`, TRL's) made to wait for the batch in flight first (`trl_rpp.patches.wrap_weight_sync`)."""
    if not max_staleness:
        return None
    ahead = GenerationAhead(max_staleness)
    wrap_weight_sync(vllm_generation, ahead.drain)
    return ahead
