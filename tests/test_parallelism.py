"""`check_normalization_group`: the normalization's population is the world group, so only data-parallel layouts are
accepted. The rejection at RPPTrainer construction, from the args and from a launch's environment, runs with 2
processes in tests/test_engines.py."""

import pytest
from accelerate import ParallelismConfig

from trl_rpp.distributed import check_normalization_group


@pytest.mark.parametrize(
    "config",
    [None, ParallelismConfig(), ParallelismConfig(dp_shard_size=8), ParallelismConfig(dp_replicate_size=2, dp_shard_size=4)],
    ids=["none", "default", "fsdp", "hsdp"],
)
def test_data_parallel_layouts_use_the_world_group(config):
    check_normalization_group(config)


@pytest.mark.parametrize("name", ["tp_size", "cp_size", "sp_size"])
def test_tensor_context_and_sequence_parallelism_are_rejected(name):
    config = ParallelismConfig(dp_shard_size=2, **{name: 2})
    with pytest.raises(ValueError, match=rf"^parallelism_config\.{name}=2 is not supported by RPPTrainer; accepted: 1\.") as e:
        check_normalization_group(config)
    assert "data parallelism" in str(e.value)


def test_reads_only_the_sizes():
    """Any object with the sizes works (accelerate may add fields); missing sizes count as 1."""

    class Sizes:
        tp_size = 1
        cp_size = 3

    with pytest.raises(ValueError, match="cp_size=3"):
        check_normalization_group(Sizes())
    check_normalization_group(object())
