"""The colocated vLLM engine on vLLM's CPU backend: its weight sync, and which sync each engine gets.

TRL builds the engine (`trl.generation.vllm_generation.VLLMGeneration`) and pushes the policy's weights into it
before each generation (`sync_weights`). On vLLM's CPU backend that sync cannot work: at load the backend repacks
every linear layer's weight into its GEMM kernel's layout (oneDNN, or the AMX kernels) and frees the original
parameter, so TRL's per-parameter `load_weights` fails (`'Parameter' object has no attribute 'weight_loader'`). There
the sync goes through vLLM's own `reload_weights` (`trl_rpp.patches.reload_weight_sync`). On GPUs the engine keeps
its parameters and TRL's sync is used unchanged. The engine arguments TRL has no setting for (`max_logprobs`,
`RPPConfig.vllm_dtype`) are passed by `trl_rpp.patches.vllm_engine_args`.
"""

from __future__ import annotations

from ..errors import unsupported
from ..patches import reload_weight_sync


def engine_on_cpu() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def use_cpu_weight_sync(vllm_generation) -> None:
    """Make `vllm_generation.sync_weights` reload the weights when the colocated engine runs on vLLM's CPU backend
    (see the module docstring); leave TRL's sync everywhere else."""
    if vllm_generation.mode != "colocate" or not engine_on_cpu():
        return
    if vllm_generation.enable_sleep_mode:
        raise unsupported("vllm_enable_sleep_mode", True, "False", under="a colocated vLLM engine on CPU",
                          why="Sleep mode frees GPU memory between generations; vLLM's CPU backend has none to free.")
    reload_weight_sync(vllm_generation)


def use_weight_sync(args, vllm_generation, disk_sync, is_main_process: bool) -> None:
    """The weight sync the engine of a run with `args` needs, set on `vllm_generation` (TRL's `VLLMGeneration`, which
    GRPO built; None without vLLM): vLLM's reload for a colocated engine on CPU, the disk transport `disk_sync` for a
    server with `vllm_server_weight_sync="disk"` (`trl_rpp.engines.vllm_server`), TRL's everywhere else."""
    from .vllm_server import use_disk_weight_sync

    if args.use_vllm:
        use_cpu_weight_sync(vllm_generation)
        use_disk_weight_sync(vllm_generation, disk_sync, is_main_process)
