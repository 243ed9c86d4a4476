"""`trl_rpp.testing`'s model builders seed their own work and leave the caller's random state as they found it."""

import pytest
import torch
from safetensors.torch import load_file

from trl_rpp.testing.tiny import build_tiny_model
from trl_rpp.testing.tool_model import build_tool_model


@pytest.mark.parametrize("build", [lambda path: build_tiny_model(path, seed=3),
                                   lambda path: build_tool_model(path, seed=3, max_steps=2)], ids=["tiny", "tool"])
def test_builders_keep_the_global_random_state_and_their_own_seed(tmp_path, build):
    torch.manual_seed(123)
    before = torch.random.get_rng_state()
    first = load_file(f"{build(tmp_path / 'a')}/model.safetensors")
    assert torch.equal(torch.random.get_rng_state(), before)  # the caller's stream goes on where it was
    torch.rand(5)  # another global state: the same weights all the same
    second = load_file(f"{build(tmp_path / 'b')}/model.safetensors")
    assert first.keys() == second.keys() and all(torch.equal(first[k], second[k]) for k in first)
