"""Global masked normalization across real processes (gloo on CPU), against the single-process global population.

Each case gives every rank its own `[B_r, T_r]` slice. The ranks normalize their slice with the production
`global_masked_normalize` and a real `all_reduce`; the parent then normalizes the concatenation of all slices in
one process (production function and the independent float64 reference) and compares rank by rank.
"""

import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.overrides import TorchFunctionMode

from reference import ref_global_masked_normalize
from trl_rpp import core
from trl_rpp.core import global_masked_normalize


def _slice(case, rank, world):
    """Deterministic per-rank data for a named case: (values [B_r, T_r] with NaN at masked slots, mask)."""
    g = torch.Generator().manual_seed(1000 * world + 17 * rank + len(case))
    if case == "unequal":
        B, T = [(3, 5), (5, 9), (2, 4)][rank]
        lengths = torch.randint(1, T + 1, (B,), generator=g)
        mask = torch.arange(T) < lengths.unsqueeze(1)
        values = torch.randn(B, T, generator=g) * (rank + 1) + rank
    elif case == "one_rank_empty":
        B, T = 4, 6
        mask = torch.rand(B, T, generator=g) < 0.6
        mask[:, 0] = True
        if rank == world - 1:
            mask[:] = False
        values = torch.randn(B, T, generator=g) * 2 + 1
    elif case == "zero_rows":
        B, T = (0, 7) if rank == 0 else (3, 7)
        mask = torch.ones(B, T, dtype=torch.bool)
        values = torch.randn(B, T, generator=g)
    elif case == "single_global_token":
        B, T = 2, 3
        mask = torch.zeros(B, T, dtype=torch.bool)
        if rank == 1:
            mask[1, 1] = True
        values = torch.randn(B, T, generator=g)
    elif case == "zero_variance":
        B, T = 3, 4
        mask = torch.rand(B, T, generator=g) < 0.7
        mask[:, 0] = True
        values = torch.full((B, T), 3.25)
    elif case == "float64":
        B, T = 5, 8
        mask = torch.rand(B, T, generator=g) < 0.5
        values = torch.randn(B, T, generator=g, dtype=torch.float64) * 1e3 + 1e6
    elif case == "globally_empty":
        B, T = 2, 3
        mask = torch.zeros(B, T, dtype=torch.bool)
        values = torch.randn(B, T, generator=g)
    else:
        raise KeyError(case)
    values = torch.where(mask, values, torch.tensor(float("nan"), dtype=values.dtype))
    return values, mask


CASES = ["unequal", "one_rank_empty", "zero_rows", "single_global_token", "zero_variance", "float64", "globally_empty"]


def _worker(rank, world, outdir):
    dist.init_process_group("gloo", init_method=f"file://{outdir}/rendezvous", rank=rank, world_size=world)
    try:
        results = {}
        for case in CASES:
            values, mask = _slice(case, rank, world)
            try:
                out, mean, var, count = global_masked_normalize(values, mask)
                results[case] = dict(out=out, mean=mean, var=var, count=count)
            except RuntimeError as err:
                results[case] = dict(error=str(err))
        # An explicit group argument gives the same numbers as the default group.
        values, mask = _slice("unequal", rank, world)
        results["explicit_group"] = global_masked_normalize(values, mask, group=dist.group.WORLD)[0]
        torch.save(results, os.path.join(outdir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def _concat(slices):
    """Concatenate per-rank [B_r, T_r] slices along B, padded on T with masked NaN."""
    T = max(v.shape[1] for v, _ in slices)
    vals, masks = [], []
    for v, m in slices:
        pad = T - v.shape[1]
        vals.append(torch.nn.functional.pad(v, (0, pad), value=float("nan")))
        masks.append(torch.nn.functional.pad(m, (0, pad), value=False))
    return torch.cat(vals), torch.cat(masks)


@pytest.mark.parametrize("world", [2, 3])
def test_global_normalize_matches_single_process_population(world):
    with tempfile.TemporaryDirectory() as outdir:
        mp.start_processes(_worker, args=(world, outdir), nprocs=world, join=True, start_method="spawn")
        results = [torch.load(os.path.join(outdir, f"rank{r}.pt")) for r in range(world)]

    for case in CASES:
        slices = [_slice(case, r, world) for r in range(world)]
        if case == "globally_empty":
            # Every rank fails through the device-side assertion, none hangs.
            for r in range(world):
                assert "no valid token" in results[r][case].get("error", ""), (case, r)
            continue
        full_values, full_mask = _concat(slices)
        want_out, want_mean, want_var, want_count = global_masked_normalize(full_values, full_mask)
        ref_out, ref_mean, ref_var, ref_count = ref_global_masked_normalize(
            [v.double().tolist() for v, _ in slices], [m.tolist() for _, m in slices]
        )
        tol = dict(rtol=1e-12, atol=1e-12) if full_values.dtype == torch.float64 else dict(rtol=1e-5, atol=1e-5)
        row = 0
        for r, (v, m) in enumerate(slices):
            got = results[r][case]
            assert "error" not in got, (case, r, got)
            B, T = v.shape
            torch.testing.assert_close(got["out"], want_out[row : row + B, :T], **tol)
            torch.testing.assert_close(got["out"].double(), torch.tensor(ref_out[r], dtype=torch.float64).view(B, T), **tol)
            assert torch.equal(got["out"][~m], torch.zeros_like(got["out"][~m]))
            torch.testing.assert_close(got["mean"], want_mean, **tol)
            torch.testing.assert_close(got["var"], want_var, **tol)
            assert got["count"].item() == want_count.item() == ref_count
            assert got["mean"].item() == pytest.approx(ref_mean, rel=1e-6, abs=1e-6)
            assert got["var"].item() == pytest.approx(ref_var, rel=1e-5, abs=1e-6)
            row += B
        if case == "one_rank_empty":
            assert torch.equal(results[world - 1][case]["out"], torch.zeros(4, 6))
        if case in ("single_global_token", "zero_variance"):
            for r in range(world):
                assert torch.equal(results[r][case]["out"], torch.zeros_like(results[r][case]["out"]))
    for r in range(world):
        assert torch.equal(results[r]["explicit_group"], results[r]["unequal"]["out"])


class _HostSyncRecorder(TorchFunctionMode):
    """Records every tensor operation that would move a value to the host."""

    HOST_SYNCS = {"item", "tolist", "__bool__", "__float__", "__int__", "__index__", "cpu", "numpy", "__format__"}

    def __init__(self):
        super().__init__()
        self.syncs = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", str(func))
        if name in self.HOST_SYNCS:
            self.syncs.append(name)
        return func(*args, **(kwargs or {}))


def test_recorder_catches_host_syncs():
    # The recorder must be able to fail: an .item() and a bool() are both seen.
    x = torch.randn(3)
    with _HostSyncRecorder() as rec:
        x.sum().item()
        bool(x.sum() > 0)
    assert rec.syncs == ["item", "__bool__"]


def test_core_functions_perform_no_host_sync():
    values, mask = _slice("one_rank_empty", 0, 2)
    rewards = torch.randn(4)
    with _HostSyncRecorder() as rec:
        global_masked_normalize(values, mask)
        core.reinforce_pp_returns(rewards, values, values * 0.5, mask, 0.01, 1.0)
        core.reinforce_pp_returns(rewards, values, values * 0.5, mask, 0.01, 0.9)
        core.group_mean_advantages(rewards, mask, 2)
        core.response_mean_ppo_loss(values, values, values, mask)
        core.response_mean_k2_loss(values, values, mask)
    assert rec.syncs == []
    # And by source: no host extraction is written in the normalizer.
    import inspect

    src = inspect.getsource(global_masked_normalize)
    for token in (".item(", ".tolist(", ".cpu(", "print(", "float(", "bool("):
        assert token not in src, token
