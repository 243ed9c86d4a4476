"""A vLLM engine that fails during generation: the same `GenerationEngineError` on every process.

When the colocated engine (or a server's client) raises on one process, the others would go on to the next
collective, TRL's gather of the completion lengths, and wait there until the backend's timeout (30 minutes by
default on gloo and NCCL), or the failing process's traceback would be all a user sees, from deep inside vLLM.
Instead, the failing call returns empty completions (one EOS each) so that this process takes part in TRL's
collectives of the generation batch like the others, and right after TRL's `_generate` every process learns of every
failure (one gather of a flag per generation batch, with several processes) and raises the same error. It names the
engine, the process, the step and the cause, and the checkpoint a resume would start from; nothing is trained on
the empty completions, and no checkpoint is written after the failure.

A server is called by process 0 alone, between TRL's gather of every process's prompts and its broadcast of the
completions, so there the guard sits on the client (`guard_client`): a failed call is answered with the same
empty completions, which TRL broadcasts, and the others reach the broadcast. The client also gets a time limit per
request (`RPPConfig.vllm_server_request_timeout`; TRL's sets none), and a request that timed out or failed
mid-answer is not sent again (TRL's client would send it up to 5 more times, with 60 s of back-off between them).

Only the engine's calls are guarded. With the sampler's top-k lists (score centering, a replayed truncation),
`generate_vllm_with_topk` guards the sync and the generation and parses the answer outside, so a bug in
our parsing propagates as itself; otherwise the guard holds TRL's vLLM branch, which only keeps the sampled log-prob.

Not covered: a failure inside the weight sync under ZeRO-3 or FSDP, after some processes entered its gathers (those
wait for the backend's timeout).
"""

from __future__ import annotations

from ..patches import guard_server_client as patch_client
from ..patches import vllm_generate


class GenerationEngineError(RuntimeError):
    """The generation engine raised on at least one process; raised on every process, chained to the cause."""


class EngineFaults:
    """The failure of this generation batch on this process (`guard`), settled across processes (`settle`)."""

    def __init__(self):
        self.failure = None

    def record(self, err):
        if self.failure is None:
            self.failure = err

    def call(self, engine):
        """`engine()`, or None when it raises; the first failure of the batch is kept for `settle`. `engine` holds the
        engine's calls only, so that an error in what we do with its answer is not reported as the engine's."""
        try:
            return engine()
        except Exception as err:  # not KeyboardInterrupt or SystemExit: those stop the run as they are
            self.record(err)
            return None

    def guard(self, generate, prompt_ids, eos: int):
        """`generate()` (TRL's vLLM branch, which has the engine's calls), or, when it raises, one `eos` per prompt
        so that this process reaches TRL's collectives (`call`)."""
        out = self.call(generate)
        return empty_completions(eos, prompt_ids) if out is None else out

    def settle(self, acc, describe):
        """After TRL's `_generate` on every process: raise the same `GenerationEngineError` everywhere when any
        process's engine failed, naming the first failing process (one gather, one host read, with several, over
        the accelerator `acc`). ``describe(process, cause)`` says what the error says (`failure_message`); it is
        called only on a failure."""
        failure, self.failure = self.failure, None
        if acc.num_processes > 1:
            import torch
            from accelerate.utils import gather_object

            failed = acc.gather(torch.tensor([failure is not None], device=acc.device)).any().item()
            if not failed:
                return
            reports = gather_object([None if failure is None else (acc.process_index, repr(failure))])
        elif failure is None:
            return
        else:
            reports = [(0, repr(failure))]
        process, cause = next(r for r in reports if r is not None)
        raise GenerationEngineError(describe(process, cause)) from failure


def empty_completions(eos: int, prompt_ids):
    """`_generate_single_turn`'s ``(completion_ids, logprobs)`` for a failed engine call: one `eos` per prompt, with a
    log-prob of 0; nothing is trained on them (`EngineFaults.settle` raises first)."""
    return [[eos] for _ in prompt_ids], [[0.0] for _ in prompt_ids]


def first_eos(eos_token_ids) -> int:
    """The first of GRPO's `eos_token_ids` (an id or a list of ids)."""
    return eos_token_ids[0] if isinstance(eos_token_ids, (list, tuple)) else eos_token_ids


def guard_client(client, faults, eos: int, timeout: float | None):
    """In vLLM server mode, on process 0 (TRL's only client): TRL's `VLLMClient` `client` answers a failed `generate`
    with one `eos` per completion (log-prob 0), keeping the failure in `faults()` (the `EngineFaults` of the batch
    being generated) for `EngineFaults.settle`, so that process 0 reaches TRL's broadcast; each request waits at most
    `timeout` seconds (None: no limit), and a read that timed out is not resent
    (`trl_rpp.patches.guard_server_client`)."""

    def failed_answer(err, prompts, n):
        faults().record(err)
        m = len(prompts) * n
        return {"prompt_ids": [list(p) for p in prompts], "completion_ids": [[eos] for _ in range(m)],
                "logprobs": [[[0.0]] for _ in range(m)], "logprob_token_ids": [[[eos]] for _ in range(m)]}

    patch_client(client, failed_answer, timeout)


def generate_vllm_with_topk(trainer, prompt_ids, images, num_generations, k, faults, answer=None):
    """GRPO's vLLM branch of `_generate_single_turn`, keeping the `k`-wide log-prob lists and selecting the sampled
    token's log-prob by id. Returns ``(completion_ids, sampled_logps, recorded)``: the first two as GRPO's branch
    does, and the lists as a `RecordedTopK` (None when the engine failed). It takes TRL's trainer because it calls
    `VLLMGeneration.generate` and GRPO's weight sync through it (`trl_rpp.patches.vllm_generate`), as GRPO's branch
    does.

    Only the engine's calls (`trl_rpp.patches.vllm_generate`: the weight sync and the generation) run under `faults`
    (`EngineFaults.call`): when they raise, one EOS per prompt comes back and the run stops at
    `EngineFaults.settle`. An error in parsing the engine's answer is ours, not the engine's, and propagates as
    itself. `answer`, when given, returns the engine's answer instead (a batch sampled ahead,
    `trl_rpp.engines.ahead`, whose request's failure is already in `faults`)."""
    from ..records.vllm import parse_vllm_topk

    if answer is not None:
        answer = answer()
    else:
        answer = faults.call(lambda: vllm_generate(trainer, prompt_ids, images, num_generations))
    if answer is None:
        return (*empty_completions(first_eos(trainer.eos_token_ids), prompt_ids), None)
    _, completion_ids, logprobs, token_ids = answer
    sampled, recorded = parse_vllm_topk(completion_ids, logprobs, token_ids, k)
    return completion_ids, sampled, recorded


def failure_message(engine: str, process: int, num_processes: int, step: int, mode: str, newest: str | None,
                    cause: str) -> str:
    """What `GenerationEngineError` says: the engine (``"the colocated vLLM engine"``, or a server by its URL), the
    failing process of `num_processes`, the step and mode (``"train"``, ``"eval"``), the cause, and `newest`, the
    newest complete checkpoint a resume would start from (None: none yet; `faults.checkpoint`)."""
    resume = (f"the newest complete checkpoint is {newest!r}: fix the engine, then resume with "
              "resume_from_checkpoint=True" if newest else "no complete checkpoint was saved yet")
    return (f"{engine} failed on process {process} of {num_processes} while generating at step {step} ({mode}): "
            f"{cause}. The run stops on every process; {resume}.")
