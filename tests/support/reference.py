"""Independent float64 reference for the REINFORCE++ / REINFORCE++-baseline tests.

This module was written from the equations only (the main equations of
REINFORCE++, arXiv:2501.03262 v9, with OpenRLHF's population-variance
normalization; docs/numerics.md states them).  The production code was NOT
consulted while writing it, so that the tests compare two independent
derivations of the same equations.

Conventions
-----------
* Only the Python standard library (``math``) is used; every value is a Python
  ``float`` (IEEE-754 float64) and every loop is an explicit Python loop over
  nested lists (tests convert tensors with ``.tolist()``).
* Masks are nested lists of 0/1 (or bools).  Mask selection is *boolean*
  (``if m:``), never multiplicative: a value stored at a masked position may be
  NaN, +/-Inf or a huge sentinel and is never read into any arithmetic that
  affects a valid result (docs/numerics.md, mask contract).
* Every per-token output is exactly 0.0 at masked positions.

Notation (docs/numerics.md): R_i terminal reward, m_{i,t} mask, T_i last valid position of
row i, L_i = sum_t m_{i,t} valid length.
"""

import math

__all__ = [
    "ref_kl_k1",
    "ref_kl_k2",
    "ref_reinforce_pp_returns",
    "ref_group_mean_advantages",
    "ref_global_masked_normalize",
    "ref_response_mean_ppo_loss",
    "ref_response_mean_ppo_loss_grad",
    "ref_response_mean_k2_loss",
    "ref_sampled_and_head_logps",
]


# ---------------------------------------------------------------------------
# small helpers
# ---------------------------------------------------------------------------

def _zeros_like_mask(mask):
    """[B][T] list of 0.0 with the same (possibly ragged) shape as ``mask``."""
    return [[0.0] * len(row) for row in mask]


def _last_valid(mask_row):
    """T_i: index of the last valid position of a row, or None if none is valid."""
    last = None
    for t, m in enumerate(mask_row):
        if m:
            last = t
    return last


def _valid_len(mask_row):
    """L_i = sum_t m_{i,t} (counted with boolean selection)."""
    n = 0
    for m in mask_row:
        if m:
            n += 1
    return n


def _clip(x, lo, hi):
    return min(max(x, lo), hi)


# ---------------------------------------------------------------------------
# 1./2. token KL estimators
# ---------------------------------------------------------------------------

def ref_kl_k1(logps, ref_logps, mask):
    """Signed k1 estimator (REINFORCE++):

        d_{i,t} = log pi(a_{i,t}) - log pi_ref(a_{i,t})   at valid positions,
        0.0                                              elsewhere.

    (In the REINFORCE++ reward the first argument is log pi_old.)
    """
    out = _zeros_like_mask(mask)
    for i, mrow in enumerate(mask):
        for t, m in enumerate(mrow):
            if m:
                out[i][t] = float(logps[i][t]) - float(ref_logps[i][t])
    return out


def ref_kl_k2(logps, ref_logps, mask):
    """k2 estimator (REINFORCE++-baseline):

        D^{k2}_{i,t} = 1/2 (log pi_theta(a_{i,t}) - log pi_ref(a_{i,t}))^2
    at valid positions, 0.0 elsewhere.
    """
    out = _zeros_like_mask(mask)
    for i, mrow in enumerate(mask):
        for t, m in enumerate(mrow):
            if m:
                d = float(logps[i][t]) - float(ref_logps[i][t])
                out[i][t] = 0.5 * d * d
    return out


# ---------------------------------------------------------------------------
# 3. REINFORCE++ KL-to-go returns
# ---------------------------------------------------------------------------

def ref_reinforce_pp_returns(rewards, old_logps, ref_logps, mask, kl_coef, gamma=1.0):
    """REINFORCE++ return (REINFORCE++):

        d_{i,t} = log pi_old(a_{i,t}) - log pi_ref(a_{i,t})
        r_{i,t} = m_{i,t} [ -beta d_{i,t} + 1(t = T_i) R_i ]
        G_{i,t} = m_{i,t} sum_{u=t}^{T_i} gamma^{u-t} r_{i,u}

    beta = ``kl_coef``.  T_i is the last valid position of row i.  The inner
    sum runs over *every* position u in t..T_i, including internal mask holes
    (which have r = 0, so they neither contribute nor reset the sum, but they
    do advance the discount exponent u - t).  Implemented literally as the
    O(T^2) double sum with an explicit ``gamma ** (u - t)``.  A row without any
    valid token returns all zeros (and its R_i is never read).
    """
    beta = float(kl_coef)
    gamma = float(gamma)
    out = _zeros_like_mask(mask)
    for i, mrow in enumerate(mask):
        T_i = _last_valid(mrow)
        if T_i is None:
            continue  # fully masked row: all zeros
        R_i = float(rewards[i])

        # shaped token reward r_{i,u}; 0.0 at masked positions (boolean select)
        r = [0.0] * len(mrow)
        for u, m in enumerate(mrow):
            if m:
                d = float(old_logps[i][u]) - float(ref_logps[i][u])
                val = -beta * d
                if u == T_i:
                    val = val + R_i
                r[u] = val

        # G_{i,t} = m_{i,t} * sum_{u=t}^{T_i} gamma^{u-t} r_{i,u}
        for t, m in enumerate(mrow):
            if not m:
                continue  # output 0.0 outside the mask
            acc = 0.0
            for u in range(t, T_i + 1):
                acc += (gamma ** (u - t)) * r[u]
            out[i][t] = acc
    return out


# ---------------------------------------------------------------------------
# 4. REINFORCE++-baseline inclusive group-mean advantage
# ---------------------------------------------------------------------------

def ref_group_mean_advantages(rewards, mask, num_generations):
    """REINFORCE++-baseline raw advantage (REINFORCE++-baseline):

        b_g = (1/K) sum_{j in g} R_j      (inclusive mean, NOT leave-one-out)
        C_i = R_i - b_g                   (no group-std division)
        A^{raw}_{i,t} = m_{i,t} C_i

    Groups are contiguous blocks of K = ``num_generations`` rows.  The group
    mean uses all K rewards of the group regardless of the rows' masks.
    K < 2 is rejected (num_generations=1 collapses every advantage
    to zero and is rejected), as is a batch not divisible by K.
    """
    K = int(num_generations)
    B = len(rewards)
    if K < 2:
        raise ValueError("num_generations must be >= 2")
    if B % K != 0:
        raise ValueError("batch size must be divisible by num_generations")
    if len(mask) != B:
        raise ValueError("rewards and mask must have the same batch size")

    out = _zeros_like_mask(mask)
    for g0 in range(0, B, K):
        group = [float(rewards[j]) for j in range(g0, g0 + K)]
        b_g = math.fsum(group) / K
        for j in range(g0, g0 + K):
            C_j = float(rewards[j]) - b_g
            for t, m in enumerate(mask[j]):
                if m:
                    out[j][t] = C_j
    return out


# ---------------------------------------------------------------------------
# 5. global masked normalization across ranks
# ---------------------------------------------------------------------------

def ref_global_masked_normalize(values_per_rank, mask_per_rank, var_floor=1e-8):
    """Global masked population normalization (docs/numerics.md):

        S = {(r,i,t) | m_{r,i,t} = 1},  N = |S|
        mu      = (1/N) sum_S A
        sigma^2 = (1/N) sum_S (A - mu)^2                (ddof = 0, two passes)
        A_hat   = m (A - mu) [max(sigma^2, 1e-8)]^{-1/2}

    ``values_per_rank`` / ``mask_per_rank``: lists over ranks of [B_r][T_r]
    nested lists; ranks may have different shapes, zero valid tokens, or
    B_r == 0.  Returns ``(normalized_per_rank, mean, var, count)`` where
    ``var`` is the raw (unfloored) population variance and ``count`` = N.
    Raises ``ValueError("empty population")`` when N == 0.
    """
    if len(values_per_rank) != len(mask_per_rank):
        raise ValueError("values_per_rank and mask_per_rank differ in rank count")

    # pass 0: gather the population (boolean selection only)
    pop = []
    for vals, mask in zip(values_per_rank, mask_per_rank):
        for i, mrow in enumerate(mask):
            for t, m in enumerate(mrow):
                if m:
                    pop.append(float(vals[i][t]))
    N = len(pop)
    if N == 0:
        raise ValueError("empty population")

    # pass 1: mean; pass 2: population variance around that mean
    mean = math.fsum(pop) / N
    var = math.fsum((a - mean) * (a - mean) for a in pop) / N
    denom = math.sqrt(max(var, float(var_floor)))

    normalized = []
    for vals, mask in zip(values_per_rank, mask_per_rank):
        out = _zeros_like_mask(mask)
        for i, mrow in enumerate(mask):
            for t, m in enumerate(mrow):
                if m:
                    out[i][t] = (float(vals[i][t]) - mean) / denom
        normalized.append(out)
    return normalized, mean, var, N


# ---------------------------------------------------------------------------
# 6./7. response-mean clipped PPO surrogate and its analytic gradient
# ---------------------------------------------------------------------------

def _ppo_token(logp, old_logp, adv, eps_low, eps_high):
    """One valid token: returns (rho, unclipped, clipped) with
    unclipped = -rho A, clipped = -clip(rho, 1-eps_low, 1+eps_high) A."""
    rho = math.exp(logp - old_logp)
    unclipped = -rho * adv
    clipped = -_clip(rho, 1.0 - eps_low, 1.0 + eps_high) * adv
    return rho, unclipped, clipped


def ref_response_mean_ppo_loss(logps, old_logps, advantages, mask,
                               epsilon_low=0.2, epsilon_high=0.2):
    """Response-mean clipped PPO loss (docs/numerics.md):

        rho_{i,t} = exp(log pi_theta - log pi_old)
        L_PG = (1/B) sum_i (1/L_i) sum_t m_{i,t}
                   max(-rho A_hat, -clip(rho, 1-eps_low, 1+eps_high) A_hat)

    The paper writes a single epsilon; ``epsilon_low``/``epsilon_high`` give the
    lower/upper clip bounds 1-eps_low and 1+eps_high.  The denominator is
    max(L_i, 1), so a response with no valid token contributes 0 but still
    counts in B (all B responses are averaged).
    """
    B = len(mask)
    if B == 0:
        raise ValueError("empty batch")
    eps_low = float(epsilon_low)
    eps_high = float(epsilon_high)
    per_response = []
    for i, mrow in enumerate(mask):
        toks = []
        for t, m in enumerate(mrow):
            if m:
                _, unclipped, clipped = _ppo_token(
                    float(logps[i][t]), float(old_logps[i][t]),
                    float(advantages[i][t]), eps_low, eps_high)
                toks.append(max(unclipped, clipped))
        L_i = len(toks)
        per_response.append(math.fsum(toks) / max(L_i, 1))
    return math.fsum(per_response) / B


def ref_response_mean_ppo_loss_grad(logps, old_logps, advantages, mask,
                                    epsilon_low=0.2, epsilon_high=0.2):
    """Analytic d L_PG / d logps (derived by hand), [B][T], 0.0 when masked.

    For a valid token, d rho / d logp = rho, hence
      d/dlogp (-rho A)         = -rho A
      d/dlogp (-clip(rho) A)   = -rho A  if 1-eps_low < rho < 1+eps_high,
                                 0       if rho is outside the clip range.
    The max selects the branch with the larger value; the token gradient is
    scaled by 1 / (B * max(L_i, 1)).

    Tie convention: when the two branch values are equal (unclipped ==
    clipped) we use the unclipped gradient -rho A; the clipped branch only
    wins when it is STRICTLY larger.  Verification of when ties occur, with
    c = clip(rho) and A finite:
      * lo < rho < hi: c == rho exactly, both values are -rho A and both
        gradients are -rho A -> the convention is irrelevant.
      * A == 0: both values are 0 and both gradients are 0 (-rho*0 == 0) ->
        irrelevant.
      * rho outside [lo, hi] and A != 0: c != rho, so -c A != -rho A (up to
        float underflow for subnormal A), i.e. no tie.
      * rho EXACTLY on a bound (rho == 1-eps_low or rho == 1+eps_high) with
        A != 0: this is a tie the brief's claim omits.  c == rho, the values
        are equal, but the one-sided derivatives of clip differ.  Choosing the
        unclipped branch gives -rho A, which is also what autograd gives
        (torch.clamp passes gradient on the closed interval min <= x <= max,
        so both branches' autograd grads are -rho A there).  Tests should
        avoid rho landing exactly on a bound anyway.
    Consequently, when the clipped branch is strictly larger, rho is outside
    the closed range and the gradient is 0.
    """
    B = len(mask)
    if B == 0:
        raise ValueError("empty batch")
    eps_low = float(epsilon_low)
    eps_high = float(epsilon_high)
    out = _zeros_like_mask(mask)
    for i, mrow in enumerate(mask):
        L_i = _valid_len(mrow)
        scale = 1.0 / (B * max(L_i, 1))
        for t, m in enumerate(mrow):
            if not m:
                continue
            adv = float(advantages[i][t])
            rho, unclipped, clipped = _ppo_token(
                float(logps[i][t]), float(old_logps[i][t]), adv, eps_low, eps_high)
            if clipped > unclipped:
                # clipped branch strictly larger => rho outside [lo, hi] => flat
                g = 0.0
            else:
                # unclipped branch selected (or tie): d(-rho A)/dlogp = -rho A
                g = -rho * adv
            out[i][t] = g * scale
    return out


# ---------------------------------------------------------------------------
# 8. response-mean k2 loss
# ---------------------------------------------------------------------------

def ref_response_mean_k2_loss(logps, ref_logps, mask):
    """Response-mean k2 loss (the same response-mean reduction as the PPO loss):

        L_k2 = (1/B) sum_i (1/max(L_i,1)) sum_t m_{i,t} 1/2 (logp - ref_logp)^2
    """
    B = len(mask)
    if B == 0:
        raise ValueError("empty batch")
    per_token = ref_kl_k2(logps, ref_logps, mask)
    per_response = []
    for i, mrow in enumerate(mask):
        toks = [per_token[i][t] for t, m in enumerate(mrow) if m]
        per_response.append(math.fsum(toks) / max(len(toks), 1))
    return math.fsum(per_response) / B


# ---------------------------------------------------------------------------
# hand-worked self check
# ---------------------------------------------------------------------------

def ref_sampled_and_head_logps(logits, completion_ids, head_ids, temperature=1.0):
    """Log-probs at temperature ``t`` of the sampled tokens ``[B, T]`` and of the head ids ``[B, T, k]``, and the
    entropies ``[B, T]``, from ``logits`` ``[B, S, V]`` whose position ``S - T - 1 + t`` predicts completion token
    ``t``: the full-vocabulary ``log_softmax(z / t)`` in float64, gathered (differentiable), and ``-sum p log p`` with
    plain loops. In float64 for float64 logits, else in float32, as the trainer's readers return them. (The one
    reference here that needs torch: the gradient flows to ``logits``.)"""
    import torch

    T = completion_ids.size(1)
    logp_all = torch.log_softmax(logits[:, -T - 1 : -1].double() / temperature, dim=-1)
    out = torch.float64 if logits.dtype == torch.float64 else torch.float32
    logps = logp_all.gather(-1, completion_ids.unsqueeze(-1)).squeeze(-1).to(out)
    head = logp_all.gather(-1, head_ids).to(out)
    ent = [[-math.fsum(math.exp(v) * v for v in row) for row in seq] for seq in logp_all.tolist()]
    return logps, head, torch.tensor(ent, dtype=out)


def _close(a, b, tol=1e-12):
    return abs(a - b) <= tol * max(1.0, abs(a), abs(b))


def _assert_rows_close(got, want, tol=1e-12):
    assert len(got) == len(want), (got, want)
    for gr, wr in zip(got, want):
        assert len(gr) == len(wr), (got, want)
        for g, w in zip(gr, wr):
            assert _close(g, w, tol), (got, want)


def _self_check():
    nan, inf = float("nan"), float("inf")

    # (a) REINFORCE++ return with an internal mask hole and gamma = 0.9.
    #     mask = [1,0,0,1]; old - ref = 1 at valid positions (masked storage
    #     holds NaN/Inf and must not be read); kl_coef = 1; R = 0.
    #     T_0 = 3.  r = [-1*1, 0, 0, -1*1 + 0] = [-1, 0, 0, -1].
    #     G_3 = r_3 = -1.
    #     G_0 = r_0 + 0.9 r_1 + 0.9^2 r_2 + 0.9^3 r_3
    #         = -1 + 0 + 0 + 0.729 * (-1) = -1.729.
    #     G_1 = G_2 = 0 (masked output).
    #     A second, fully masked row returns zeros and its NaN reward is unread.
    old = [[1.0, nan, inf, 1.0], [nan, nan, nan, nan]]
    ref = [[0.0, 0.0, -inf, 0.0], [0.0, 0.0, 0.0, 0.0]]
    mask = [[1, 0, 0, 1], [0, 0, 0, 0]]
    G = ref_reinforce_pp_returns([0.0, nan], old, ref, mask, kl_coef=1.0, gamma=0.9)
    _assert_rows_close(G, [[-1.729, 0.0, 0.0, -1.0], [0.0, 0.0, 0.0, 0.0]])
    _assert_rows_close(ref_kl_k1(old, ref, mask),
                       [[1.0, 0.0, 0.0, 1.0], [0.0, 0.0, 0.0, 0.0]])
    #     Same row with gamma = 1, kl_coef = 0.5, R = 2:
    #     r = [-0.5, 0, 0, -0.5 + 2] = [-0.5, 0, 0, 1.5]; G_3 = 1.5; G_0 = 1.0.
    G = ref_reinforce_pp_returns([2.0, 0.0], old, ref, mask, kl_coef=0.5)
    _assert_rows_close(G, [[1.0, 0.0, 0.0, 1.5], [0.0, 0.0, 0.0, 0.0]])

    # (b) Inclusive group mean, K = 4, rewards [1,0,0,0]:
    #     b = (1+0+0+0)/4 = 0.25; C = [0.75, -0.25, -0.25, -0.25].
    #     Global normalization of those 4 single-token values (split over two
    #     "ranks", plus an empty rank with B_r = 0 and a fully masked rank):
    #     mean = (0.75 - 3*0.25)/4 = 0
    #     var  = (0.75^2 + 3*0.25^2)/4 = (0.5625 + 0.1875)/4 = 0.1875
    #     sqrt(0.1875) = 0.4330127018922193
    #     0.75/0.4330127... = 1.7320508075688772 (= sqrt(3))
    #    -0.25/0.4330127... = -0.5773502691896258 (= -1/sqrt(3))
    C = ref_group_mean_advantages([1.0, 0.0, 0.0, 0.0], [[1], [1], [1], [1]], 4)
    _assert_rows_close(C, [[0.75], [-0.25], [-0.25], [-0.25]])
    norm, mu, var, n = ref_global_masked_normalize(
        [C[:2], C[2:], [], [[nan, inf]]],
        [[[1], [1]], [[1], [1]], [], [[0, 0]]])
    assert n == 4 and _close(mu, 0.0) and _close(var, 0.1875), (mu, var, n)
    s3 = math.sqrt(3.0)
    _assert_rows_close(norm[0], [[s3], [-1.0 / s3]])
    _assert_rows_close(norm[1], [[-1.0 / s3], [-1.0 / s3]])
    assert norm[2] == [] and norm[3] == [[0.0, 0.0]]
    #     Single valid token: var = 0 -> floor 1e-8 -> (x - x)/1e-4 = 0, finite.
    norm, mu, var, n = ref_global_masked_normalize([[[5.0, nan]]], [[[1, 0]]])
    assert norm == [[[0.0, 0.0]]] and mu == 5.0 and var == 0.0 and n == 1
    try:
        ref_global_masked_normalize([[[1.0]]], [[[0]]])
    except ValueError:
        pass
    else:
        raise AssertionError("empty population must raise")
    for bad_k, bad_b in ((1, 4), (3, 4)):
        try:
            ref_group_mean_advantages([0.0] * bad_b, [[1]] * bad_b, bad_k)
        except ValueError:
            pass
        else:
            raise AssertionError("invalid num_generations must raise")

    # (c) Response-mean PPO loss and gradient, eps = 0.2 (range [0.8, 1.2]),
    #     B = 3 responses.
    #     row 0 (L=2): tok0 logp-old = ln 1.5, A = 1:
    #                    unclipped -1.5, clipped -1.2 -> max -1.2 (clipped,
    #                    rho outside range) -> grad 0.
    #                  tok1 logp-old = 0, A = -2: rho = 1, both 2 -> loss 2,
    #                    grad -rho A = 2.
    #                  response loss = (-1.2 + 2)/2 = 0.4
    #     row 1 (L=1): tok0 logp-old = ln 0.5, A = 1: unclipped -0.5,
    #                    clipped -0.8 -> max -0.5 (unclipped although rho is
    #                    outside range) -> grad -0.5. tok1 masked (NaN).
    #                  response loss = -0.5
    #     row 2 (L=0): fully masked, contributes 0 but counts in B.
    #     L_PG = (0.4 - 0.5 + 0)/3 = -0.1/3 = -0.0333333...
    #     grad row0 = [0, 2/(3*2)] = [0, 1/3]; row1 = [-0.5/(3*1), 0] = [-1/6, 0]
    lp = [[math.log(1.5), 0.0], [math.log(0.5), nan], [inf, nan]]
    olp = [[0.0, 0.0], [0.0, 0.0], [0.0, -inf]]
    adv = [[1.0, -2.0], [1.0, inf], [nan, 1e300]]
    pm = [[1, 1], [1, 0], [0, 0]]
    loss = ref_response_mean_ppo_loss(lp, olp, adv, pm)
    assert _close(loss, -0.1 / 3.0), loss
    grad = ref_response_mean_ppo_loss_grad(lp, olp, adv, pm)
    _assert_rows_close(grad, [[0.0, 1.0 / 3.0], [-1.0 / 6.0, 0.0], [0.0, 0.0]])
    #     Central finite difference agrees with the analytic gradient away
    #     from the clip kinks (h small enough not to cross a bound).
    h = 1e-6
    for i, mrow in enumerate(pm):
        for t, m in enumerate(mrow):
            if not m:
                continue
            up = [row[:] for row in lp]
            dn = [row[:] for row in lp]
            up[i][t] += h
            dn[i][t] -= h
            fd = (ref_response_mean_ppo_loss(up, olp, adv, pm)
                  - ref_response_mean_ppo_loss(dn, olp, adv, pm)) / (2 * h)
            assert abs(fd - grad[i][t]) < 1e-7, (i, t, fd, grad[i][t])

    # (d) Response-mean k2 loss, same mask as (c):
    #     row 0: logp-ref = [1, 2] -> 0.5*[1, 4] = [0.5, 2] -> mean 1.25
    #     row 1: logp-ref = 3 -> 4.5 (masked tok NaN ignored) -> mean 4.5
    #     row 2: fully masked -> 0
    #     L_k2 = (1.25 + 4.5 + 0)/3 = 5.75/3 = 1.9166666...
    lp = [[1.0, 2.0], [3.0, nan], [nan, inf]]
    rl = [[0.0, 0.0], [0.0, 0.0], [0.0, 0.0]]
    assert _close(ref_response_mean_k2_loss(lp, rl, pm), 5.75 / 3.0)
    _assert_rows_close(ref_kl_k2(lp, rl, pm), [[0.5, 2.0], [4.5, 0.0], [0.0, 0.0]])


