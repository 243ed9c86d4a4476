"""The colocated vLLM engine: what `RPPTrainer` passes to it beyond TRL's settings, and its weight sync on CPU.

TRL builds the engine (`trl.generation.vllm_generation.VLLMGeneration`) and pushes the policy's weights into it
before each generation (`sync_weights`). Two things differ here:

- **Engine arguments TRL has no setting for** (`vllm_engine_args`): with score centering the engine must keep
  `k + 1` log-probs per token (vLLM's `max_logprobs` defaults to 20), and `RPPConfig.vllm_dtype` sets the engine's
  dtype (vLLM's "auto" downcasts a float32 checkpoint to bfloat16).
- **Weight sync on vLLM's CPU backend** (`sync_weights_by_reload`). At load, vLLM's CPU backend repacks every
  linear layer's weight into its GEMM kernel's layout (oneDNN, or the AMX kernels) and frees the original
  parameter, so TRL's per-parameter `load_weights` fails on it (`'Parameter' object has no attribute
  'weight_loader'`). vLLM's own `reload_weights` restores the checkpoint layout, loads the new weights and repacks
  them. On GPUs the engine keeps its parameters and TRL's sync is used unchanged.
"""

from __future__ import annotations

from contextlib import contextmanager

from .errors import unsupported


@contextmanager
def vllm_engine_args(max_logprobs: int, dtype: str = "auto", server_weight_sync: str = "nccl"):
    """While TRL builds its colocated `vllm.LLM`, ask it to keep up to `max_logprobs` log-probs per token (when that
    is more than asked already) and, unless `dtype` is "auto", to run in `dtype`; with `server_weight_sync="disk"`,
    TRL's server client opens no NCCL group (`trl_rpp.server_sync`)."""
    import trl.generation.vllm_generation as vllm_generation

    from .server_sync import without_nccl_group

    original = getattr(vllm_generation, "LLM", None)
    if original is None:  # vLLM is not installed: TRL raises its own ImportError when it needs it
        with without_nccl_group(server_weight_sync):
            yield
        return

    def llm_with_args(*args, **kwargs):
        if max_logprobs > (kwargs.get("max_logprobs") or 0):
            kwargs["max_logprobs"] = max_logprobs
        if dtype != "auto":
            kwargs["dtype"] = dtype
        return original(*args, **kwargs)

    vllm_generation.LLM = llm_with_args
    try:
        with without_nccl_group(server_weight_sync):
            yield
    finally:
        vllm_generation.LLM = original


def engine_on_cpu() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def sync_weights_by_reload(vllm_generation) -> None:
    """Push the policy's current weights into a colocated engine on vLLM's CPU backend, through vLLM's
    `reload_weights` (checkpoint layout restored, weights loaded, kernels repacked), then drop the prefix cache
    computed with the old weights. The parameters come from TRL's own iterator, which merges LoRA adapters and
    gathers ZeRO-3 or FSDP shards, so every process takes part as in TRL's sync."""
    runner = vllm_generation.llm.llm_engine.model_executor.driver_worker.model_runner
    runner.reload_weights(weights_iterator=vllm_generation._iter_named_params(), is_checkpoint_format=True)
    vllm_generation.llm.reset_prefix_cache()


def use_cpu_weight_sync(vllm_generation) -> None:
    """Make `vllm_generation.sync_weights` reload the weights when the colocated engine runs on vLLM's CPU backend
    (see the module docstring); leave TRL's sync everywhere else."""
    if vllm_generation.mode != "colocate" or not engine_on_cpu():
        return
    if vllm_generation.enable_sleep_mode:
        raise unsupported("vllm_enable_sleep_mode", True, "False", under="a colocated vLLM engine on CPU",
                          why="Sleep mode frees GPU memory between generations; vLLM's CPU backend has none to free.")
    vllm_generation.sync_weights = lambda: sync_weights_by_reload(vllm_generation)


def use_weight_sync(trainer, disk_sync=None) -> None:
    """The weight sync `trainer`'s engine needs: vLLM's reload for a colocated engine on CPU, the disk transport
    `disk_sync` for a server with `vllm_server_weight_sync="disk"` (`trl_rpp.server_sync.check_at_construction`),
    TRL's everywhere else."""
    from .server_sync import use_disk_weight_sync

    if trainer.args.use_vllm:
        use_cpu_weight_sync(trainer.vllm_generation)
        use_disk_weight_sync(trainer, disk_sync)
