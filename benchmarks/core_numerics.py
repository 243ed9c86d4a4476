"""Benchmark of the trl_rpp core numerics against loop-free alternatives written here (not a test).

Three pairs are timed side by side, alternating within one run (the order flips every repeat):

  (a) ``trl_rpp.reinforce_pp_returns`` with gamma = 1 (one reversed cumsum) vs. a masked lower-triangular
      ``[T, T]`` matrix of ones applied with one matmul: ``G = r @ L`` with ``L[u, t] = 1[u >= t]``.
  (b) ``trl_rpp.reinforce_pp_returns`` with gamma < 1 (its own chunked scan, C = 256) vs. a
      loop-free two-level block scan: inside each block of C positions a ``[C, C]`` discount matrix
      ``D[u, t] = gamma^(u - t) 1[u >= t]``; across the ``T / C`` blocks a second triangular matrix
      ``M[j, k] = gamma^(C (j - k)) 1[j >= k]`` carries the return of the rest of the completion into each block.
      Every exponent is >= 0, so powers only ever shrink (and at worst underflow to a negligible 0). The textbook
      loop-free form ``G_t = gamma^-t * revcumsum(gamma^u r_u)`` is *not* used: ``gamma ** -t`` overflows float32
      for long completions (0.9^-t past t ~ 842, 0.99^-t past t ~ 8,800) and ``gamma ** t`` underflows first.
      A full ``[T, T]`` discount matrix would also be safe and fits at T = 4096 (64 MB), but costs T / C times the
      FLOPs of the block form, so the block form is the "yours" here.
  (c) ``trl_rpp.global_masked_normalize`` (two passes, selection by ``torch.where``, no host sync) vs. a naive
      boolean-indexing version: ``v = x[mask]``, population mean/var of ``v``, scatter back into zeros.

Both sides of every pair build their own token rewards / outputs from the same inputs (float32 by default), and
the construction of the triangular matrices is inside the timed region. The masked storage positions of the
log-prob inputs hold NaN, so both sides must select rather than multiply. For each pair the script prints the
median wall time of ``--repeats`` runs, the ratio ours / yours, the max abs difference between the two outputs,
and each side's max abs error against ``trl_rpp`` run in float64 (which the test suite checks against an
independent float64 reference).

    python benchmarks/core_numerics.py                          # B=512, T=4096, 5 repeats, 1 thread
    python benchmarks/core_numerics.py --B 64 --T 512 --repeats 3
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import trl_rpp


# ---------------------------------------------------------------------------------------------------------------
# Inputs
# ---------------------------------------------------------------------------------------------------------------


def make_inputs(B: int, T: int, hole_frac: float, seed: int, dtype: torch.dtype):
    """Right-padded completions of random length with internal mask holes and NaN at masked storage positions."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    mask = torch.arange(T).unsqueeze(0) < lengths.unsqueeze(1)
    hole = torch.rand(B, T, generator=g) < hole_frac
    hole[:, 0] = False
    mask &= ~hole
    if B > 3:
        mask[3] = False  # one fully masked completion
    logps = -3.0 * torch.rand(B, T, generator=g)
    old = logps + 0.3 * torch.randn(B, T, generator=g)
    ref = logps + 0.5 * torch.randn(B, T, generator=g)
    nan = torch.tensor(float("nan"))
    old = torch.where(mask, old, nan).to(dtype)
    ref = torch.where(mask, ref, nan).to(dtype)
    rewards = torch.randn(B, generator=g).to(dtype)
    advantages = torch.where(mask, 2.0 * torch.randn(B, T, generator=g) + 0.5, nan).to(dtype)
    return rewards, old, ref, mask, advantages


# ---------------------------------------------------------------------------------------------------------------
# "Yours": loop-free alternatives, written for this benchmark
# ---------------------------------------------------------------------------------------------------------------


def shaped_rewards(rewards, old, ref, mask, kl_coef):
    """Token rewards ``m * (-kl_coef * (old - ref) + 1[t = T_i] R_i)``, with T_i found from the flipped mask."""
    B, T = mask.shape
    zero = torch.zeros((), dtype=rewards.dtype)
    # Last valid position: T - 1 - (index of the first True in the flipped row). Empty rows get no reward.
    last = (T - 1) - mask.flip(1).to(torch.uint8).argmax(dim=1)
    terminal = torch.zeros(B, T, dtype=rewards.dtype)
    terminal.scatter_(1, last.unsqueeze(1), torch.where(mask.any(dim=1), rewards, zero).unsqueeze(1))
    return torch.where(mask, terminal - kl_coef * (old - ref), zero)


def returns_triangular(rewards, old, ref, mask, kl_coef):
    """gamma = 1: ``G = r @ L`` with the lower-triangular ones matrix ``L[u, t] = 1[u >= t]``."""
    T = mask.shape[1]
    r = shaped_rewards(rewards, old, ref, mask, kl_coef)
    lower = torch.ones(T, T, dtype=r.dtype).tril_()
    return torch.where(mask, r @ lower, torch.zeros((), dtype=r.dtype))


def _discount_matrix(n: int, base: float, step: int, dtype: torch.dtype) -> torch.Tensor:
    """``[n, n]`` matrix ``base^(step * (u - t))`` for ``u >= t``, else 0. Powers computed in float64."""
    idx = torch.arange(n, dtype=torch.float64)
    diff = idx.unsqueeze(1) - idx.unsqueeze(0)  # u - t
    powers = torch.pow(torch.tensor(base, dtype=torch.float64), step * diff.clamp(min=0))
    return torch.where(diff >= 0, powers, torch.zeros((), dtype=torch.float64)).to(dtype)


def returns_block_scan(rewards, old, ref, mask, kl_coef, gamma, block):
    """gamma < 1, loop-free: an in-block discount matmul, then a block-level discount matmul for the carry."""
    B, T = mask.shape
    r = shaped_rewards(rewards, old, ref, mask, kl_coef)
    C = min(block, T)
    nb = -(-T // C)
    pad = nb * C - T
    if pad:
        r = torch.nn.functional.pad(r, (0, pad))  # zero rewards after the end change nothing
    r = r.view(B, nb, C)
    local = r @ _discount_matrix(C, gamma, 1, r.dtype)  # [B, nb, C]: return of the block's own rewards
    # Return at each block start, carried over every later block: H_k = sum_{j >= k} gamma^(C (j - k)) local_j[0].
    starts = local[:, :, 0] @ _discount_matrix(nb, gamma, C, r.dtype)  # [B, nb]
    carry = torch.nn.functional.pad(starts[:, 1:], (0, 1))  # H_{k+1}, and 0 after the last block
    # Position i of a block is C - i steps before the next block start: add gamma^(C - i) * H_{k+1}.
    tail = torch.pow(torch.tensor(gamma, dtype=torch.float64), torch.arange(C, 0, -1, dtype=torch.float64))
    out = local + carry.unsqueeze(-1) * tail.to(r.dtype)
    out = out.reshape(B, nb * C)[:, :T]
    return torch.where(mask, out, torch.zeros((), dtype=out.dtype))


def normalize_boolean_indexing(values, mask, var_floor=1e-8):
    """Naive global masked z-score: gather the valid tokens, population moments, scatter back into zeros."""
    v = values[mask]
    mean = v.mean()
    var = v.var(unbiased=False)
    out = torch.zeros_like(values)
    out[mask] = (v - mean) * torch.rsqrt(torch.clamp(var, min=var_floor))
    return out


# ---------------------------------------------------------------------------------------------------------------
# Timing
# ---------------------------------------------------------------------------------------------------------------


def time_pair(ours, yours, repeats: int):
    """Median seconds of each callable; one untimed warm-up each, then alternate, flipping the order every repeat."""
    ours()
    yours()
    t_ours, t_yours = [], []
    for i in range(repeats):
        order = [(ours, t_ours), (yours, t_yours)]
        if i % 2:
            order.reverse()
        for fn, sink in order:
            start = time.perf_counter()
            fn()
            sink.append(time.perf_counter() - start)
    return statistics.median(t_ours), statistics.median(t_yours)


def max_abs(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).abs().max().item() if a.numel() else 0.0


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--B", type=int, default=512, help="completions (rows)")
    p.add_argument("--T", type=int, default=4096, help="completion positions (columns)")
    p.add_argument("--repeats", type=int, default=5, help="timed runs per implementation; the median is reported")
    p.add_argument("--threads", type=int, default=1, help="torch.set_num_threads")
    p.add_argument("--gamma", type=float, default=0.99, help="discount of case (b), in [0, 1)")
    p.add_argument("--kl-coef", type=float, default=0.01)
    p.add_argument("--block", type=int, default=256, help="block size C of the block scan in case (b)")
    p.add_argument("--hole-frac", type=float, default=0.02, help="probability of an internal mask hole")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    if not 0.0 <= args.gamma < 1.0:
        p.error("--gamma must be in [0, 1) (gamma = 1 is case (a))")

    torch.set_num_threads(args.threads)
    B, T, kl = args.B, args.T, args.kl_coef
    rewards, old, ref, mask, adv = make_inputs(B, T, args.hole_frac, args.seed, torch.float32)
    f64 = [x.double() for x in (rewards, old, ref)]

    cases = [
        (
            "(a) returns, gamma=1",
            "revcumsum",
            "tril-ones matmul",
            lambda: trl_rpp.reinforce_pp_returns(rewards, old, ref, mask, kl, 1.0),
            lambda: returns_triangular(rewards, old, ref, mask, kl),
            lambda: trl_rpp.reinforce_pp_returns(*f64, mask, kl, 1.0),
        ),
        (
            f"(b) returns, gamma={args.gamma:g}",
            "chunked scan",
            f"block scan C={min(args.block, T)}",
            lambda: trl_rpp.reinforce_pp_returns(rewards, old, ref, mask, kl, args.gamma),
            lambda: returns_block_scan(rewards, old, ref, mask, kl, args.gamma, args.block),
            lambda: trl_rpp.reinforce_pp_returns(*f64, mask, kl, args.gamma),
        ),
        (
            "(c) global_masked_normalize",
            "two-pass where",
            "boolean indexing",
            lambda: trl_rpp.global_masked_normalize(adv, mask)[0],
            lambda: normalize_boolean_indexing(adv, mask),
            lambda: trl_rpp.global_masked_normalize(adv.double(), mask)[0],
        ),
    ]

    print(
        f"B={B} T={T} float32 CPU, threads={torch.get_num_threads()}, repeats={args.repeats}, "
        f"valid tokens={int(mask.sum())}, torch {torch.__version__}\n"
    )
    print("| case | ours | yours | ours median (ms) | yours median (ms) | ratio ours/yours "
          "| max abs diff ours-yours | ours err vs fp64 | yours err vs fp64 |")
    print("| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name, ours_name, yours_name, ours, yours, ref64 in cases:
        a, b, want = ours(), yours(), ref64()
        for label, out in (("ours", a), ("yours", b)):
            if not torch.isfinite(out).all():
                raise SystemExit(f"{name}: {label} produced a non-finite value")
            if (out[~mask] != 0).any():
                raise SystemExit(f"{name}: {label} is not zero outside the mask")
        t_a, t_b = time_pair(ours, yours, args.repeats)
        print(
            f"| {name} | {ours_name} | {yours_name} | {1e3 * t_a:.3f} | {1e3 * t_b:.3f} | {t_a / t_b:.2f} "
            f"| {max_abs(a, b):.2e} | {max_abs(a, want):.2e} | {max_abs(b, want):.2e} |"
        )


if __name__ == "__main__":
    main()
