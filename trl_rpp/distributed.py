"""Which processes share the advantage normalization's population.

REINFORCE++ normalizes advantages over every valid token of the generation batch on every data-parallel rank
(`trl_rpp.core.global_masked_normalize` reduces over the default, world, process group). That is right exactly when
every process holds different samples: DDP, DeepSpeed ZeRO-1/2/3 and FSDP/HSDP (`dp_replicate_size`,
`dp_shard_size`) shard the batch over all processes. Tensor, context and sequence parallelism instead make several
processes hold the same samples, or slices of the same sequences, and TRL's generation, reward gathering and the
per-process slicing of the gathered rewards all assume one distinct slice of the batch per process. Those settings are
rejected here, the one place that decides the group, before any training step.
"""

from __future__ import annotations

from .errors import unsupported

# accelerate `ParallelismConfig` attribute -> what it splits, for the error message.
_NON_DATA_DIMENSIONS = {
    "tp_size": "tensor parallelism: the processes of one tensor-parallel group hold the same samples",
    "cp_size": "context parallelism: each process holds a slice of every sequence",
    "sp_size": "sequence parallelism: each process holds a slice of every sequence",
}


def check_normalization_group(parallelism_config) -> None:
    """Raise a `ValueError` unless the world process group is the normalization's population.

    Args:
        parallelism_config: accelerate's resolved `ParallelismConfig` (`accelerator.parallelism_config`: from
            `RPPConfig.parallelism_config`, from a YAML launch or its `PARALLELISM_CONFIG_*` environment, or set by
            transformers for a model loaded with tensor parallelism), or `None` (plain data parallelism). Only its
            `tp_size`, `cp_size` and `sp_size` attributes are read; missing ones count as 1.
    """
    if parallelism_config is None:
        return
    for name, what in _NON_DATA_DIMENSIONS.items():
        size = getattr(parallelism_config, name, None) or 1
        if size > 1:
            raise unsupported(
                f"parallelism_config.{name}", size, "1", by="RPPTrainer",
                why=f"Under {what}, while the advantage normalization counts every valid token of every process once "
                "(it reduces over all processes). Scale out with data parallelism instead (DDP, DeepSpeed ZeRO-1/2/3, "
                "or FSDP/HSDP through dp_shard_size/dp_replicate_size); see docs/distributed.md.",
            )
