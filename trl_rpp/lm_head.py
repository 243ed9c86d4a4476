"""Log-probs read from the final hidden states and the LM head in tiles of positions, never as `[N, V]` logits.

A causal LM's logits at a position are `transform(h W^T + b + u B^T)`, `h` the final hidden state, `W` `[V, H]` the
head's weight, `b` its optional bias, `u B^T` an optional low-rank term (a LoRA adapter on the head: `u = scaling *
lora_A(dropout(h))` `[r]`, computed by the caller with autograd, `B` `[V, r]` its `lora_B` weight) and `transform` the
elementwise steps some models apply after the head (`HeadTransform`:
Cohere's `logit_scale`, Granite's `logits_scaling`, Gemma 2's `final_logit_softcapping`). Being elementwise, they
commute with reading a subset of the head's rows, so

- **replay** (`kept_logps`): `log pi(v | S) = z_v / tau - logsumexp_{s in S} z_s / tau` needs only the head rows of
  the kept ids `S` (`K` per position; of `W`, `b` and `B`): `O(N * K * (H + r))` work and memory, no tensor of the
  vocabulary's size besides the parameters' gradients;
- **score centering without truncation** (`full_logps`): the sampled and head ids' log-probs under the full softmax,
  `logsumexp_V` taken one tile of positions at a time: `O(tile * V)` memory besides the `O(N * n)` outputs.

Both run through `_TiledHead`, which saves only its inputs: its backward recomputes each tile's logits, takes their
gradient through the elementwise part with autograd (so every transform is differentiated exactly as the model's
forward would be), and applies the head's linear map by hand, accumulating the gradients of `h`, `W`, `b`, `u` and
`B` in float32 (float64 for float64 inputs). When replay's gradient of `W` (or `b`) is added into a dense `.grad` the
parameter already holds (gradient accumulation), it is accumulated over the touched rows only and returned as a
sparse COO tensor (`touched_rows`, `sparse_rows_gradient`), which autograd adds in place: no `[V, H]` buffer;
otherwise it is the dense tensor that becomes `.grad`. Rows outside `valid` (and, for replay, rows without any kept
id) read a zero hidden state (and `u`): their outputs are 0 and their gradients exactly 0, whatever NaN or Inf they
hold.

Shapes: `N` flattened positions, `H` hidden size, `V` vocabulary, `K` kept-id slots (`ABSENT`-padded), `n` ids read,
`r` the low-rank term's rank.
The functions here are pure; `trl_rpp.records.replay` and `trl_rpp.records.head` wire them into a model's forward.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .truncation import ABSENT

# The one private torch member read here (`trl_rpp.patches` lists it): checked when the module loads.
if not callable(getattr(torch._C, "_will_engine_execute_node", None)):
    raise ImportError("trl_rpp.lm_head reads torch._C._will_engine_execute_node, which the installed torch "
                      f"{torch.__version__} lacks (torch 2.11 to 2.15 have it): install one of those, or report it "
                      "with the version.")

TILE_ELEMENTS = 1 << 25  # elements of one tile's widest tensor ([tile, V] logits or [tile, n + K, H] head rows)


@dataclass(frozen=True)
class HeadTransform:
    """The elementwise steps between a causal LM's head and its logits, in the models' order: `z * scale` (Cohere's
    `logit_scale`), `z / divisor` (Granite's `logits_scaling`), `softcap * tanh(z / softcap)` (Gemma 2's
    `final_logit_softcapping`). None: the step is absent."""

    scale: float | None = None
    divisor: float | None = None
    softcap: float | None = None

    def __call__(self, z: torch.Tensor) -> torch.Tensor:
        if self.scale is not None:
            z = z * self.scale
        if self.divisor is not None:
            z = z / self.divisor
        if self.softcap is not None:
            z = torch.tanh(z / self.softcap) * self.softcap
        return z


IDENTITY = HeadTransform()


def kept_logps(hidden, weight, bias, ids, support_ids, temperature, transform=IDENTITY, tile=None, lowrank=None):
    """`log pi(v | S)` at `ids`, renormalized over the kept ids, and the entropy of `pi(. | S)`, from the head rows of
    `ids` and `S` only.

    Args:
        hidden: `[N, H]` final hidden states (any float dtype; under autocast the head runs in its dtype).
        weight: `[V, H]` the head's weight; bias: `[V]` or None.
        ids: `[N, n]` int64 ids to read (the sampled token, score centering's head ids); an id outside `S` gives a
            value that is no log-prob of `pi(. | S)`, an `ABSENT` one reads id 0 (callers mask it).
        support_ids: `[N, K]` int64 kept ids, `ABSENT`-padded (`trl_rpp.truncation`).
        temperature: the sampler's temperature, `> 0`.
        transform: the model's post-head steps (`HeadTransform`).
        tile: positions per tile; by default as many as fit `TILE_ELEMENTS` head-row elements.
        lowrank: None, or `(u [N, r], lora_b [V, r])`: the head's output gains `u lora_b^T` (a LoRA adapter's term,
            `u = scaling * lora_A(dropout(hidden))`; several adapters: their `u` and `lora_b` concatenated along `r`).

    Returns:
        `(logps [N, n], entropies [N])`, float32 (float64 for float64 hidden states); `logps` carry the gradient to
        `hidden`, `weight`, `bias` and the low-rank `u` and `lora_b`, the entropies none. Both are 0 at a row without
        any kept id.
    """
    u, lora_b = _check(hidden, weight, bias, ids, support_ids, lowrank)
    width = hidden.size(1) + (0 if u is None else u.size(1))
    tile = tile or max(1, TILE_ELEMENTS // ((ids.size(1) + support_ids.size(1)) * width))
    return _TiledHead.apply(hidden, weight, bias, ids, support_ids, None, float(temperature), transform, int(tile),
                            u, lora_b)


def full_logps(hidden, weight, bias, ids, temperature, transform=IDENTITY, valid=None, tile=None, lowrank=None):
    """`log softmax(transform(h W^T + b [+ u B^T]) / tau)` at `ids` and the full-vocabulary entropy, one tile of
    positions at a time, without the `[N, V]` logits: what `log_softmax(logits / tau).gather(-1, ids)` returns from
    them, the one implementation of score centering's log-probs (tested against that in float64).

    Args:
        hidden: `[N, H]` final hidden states.
        weight: `[V, H]` the head's weight; bias: `[V]` or None.
        ids: `[N, n]` int64 ids to read, in `[0, V)`.
        temperature: the sampling temperature, `> 0`.
        transform: the model's post-head steps (`HeadTransform`).
        valid: `[N]` bool, the positions read (None: all); the others give 0.
        tile: positions per tile; by default as many as fit `TILE_ELEMENTS` logits.
        lowrank: None, or `(u [N, r], lora_b [V, r])` as in `kept_logps`, added to each tile's logits.

    Returns:
        `(logps [N, n], entropies [N])` as `kept_logps`; the entropies (TRL's `entropy_from_logits`) carry no gradient.
        Memory: `O(tile * V)` in the forward and the backward besides the outputs and the parameters' gradients.
    """
    u, lora_b = _check(hidden, weight, bias, ids, None, lowrank)
    tile = tile or max(1, TILE_ELEMENTS // weight.size(0))
    return _TiledHead.apply(hidden, weight, bias, ids, None, valid, float(temperature), transform, int(tile), u, lora_b)


def _check(hidden, weight, bias, ids, support_ids, lowrank=None):
    """Raise on inconsistent shapes; return the low-rank `(u, lora_b)`, or `(None, None)`."""
    N, H = hidden.shape
    if weight.dim() != 2 or weight.size(1) != H or (bias is not None and bias.shape != weight.shape[:1]):
        raise ValueError(f"the head's weight must be [V, {H}] and its bias [V] or None, got "
                         f"{tuple(weight.shape)} and {None if bias is None else tuple(bias.shape)}")
    for name, x in (("ids", ids), ("support_ids", support_ids)):
        if x is not None and (x.dim() != 2 or x.size(0) != N):
            raise ValueError(f"{name} must be [{N}, *] (one row per hidden state), got {tuple(x.shape)}")
    if lowrank is None:
        return None, None
    u, lora_b = lowrank
    if u.dim() != 2 or u.size(0) != N or lora_b.shape != (weight.size(0), u.size(1)):
        raise ValueError(f"lowrank must be (u [{N}, r], lora_b [{weight.size(0)}, r]), got {tuple(u.shape)} and "
                         f"{tuple(lora_b.shape)}")
    return u, lora_b


def touched_rows(ids, support_ids):
    """The head rows replay reads and where each slot's row sits among them.

    Args:
        ids: `[N, n]` int64 ids read; support_ids: `[N, K]` int64 kept ids, `ABSENT`-padded (an `ABSENT` slot reads
            row 0, with a zero gradient).

    Returns:
        `(rows [U], slots [N, n + K])`: the sorted distinct rows of `[ids, support_ids]`, and each slot's index into
        `rows`. `U <= min(V, N * (n + K))`; the work is a sort of the `N * (n + K)` slots, whatever `V`.
    """
    return torch.unique(torch.cat([ids, support_ids], -1).clamp(min=0), sorted=True, return_inverse=True)


def sparse_rows_gradient(rows, values, shape, dtype):
    """A `shape` (`[V, *]`) gradient that is `values.to(dtype)` at `rows` and 0 elsewhere, as a coalesced sparse COO
    tensor storing the `U` rows only.

    Args:
        rows: `[U]` distinct int64 rows, sorted; values: `[U, *]` their gradients (any float dtype).
        shape: the parameter's shape `[V, *]`; dtype: the parameter's dtype.
    """
    return torch.sparse_coo_tensor(rows.unsqueeze(0), values.to(dtype), shape, is_coalesced=True,
                                   check_invariants=False)  # sorted and distinct by construction


def _adds_into_dense_grad(param):
    """Whether this backward adds `param`'s gradient into a dense `.grad` it holds: autograd's AccumulateGrad then
    adds a sparse gradient in place (`grad += new`), so `.grad` stays dense (AdamW refuses a sparse one) and DDP's
    hooks, which run after it, read the sum. A non-leaf (FSDP2's `full_tensor()`), a `.grad` of another layout, shape,
    dtype or device, or `torch.autograd.grad` (which returns the gradient instead) get a dense gradient. So does a
    parameter off the CPU: `torch.unique`'s data-dependent size would make the backward wait for the device."""
    if param.device.type != "cpu":
        return False
    grad = param.grad if param.is_leaf else None
    if (type(grad) is not torch.Tensor or grad.layout != torch.strided or grad.shape != param.shape
            or grad.dtype != param.dtype or grad.device != param.device):
        return False
    try:
        return torch._C._will_engine_execute_node(torch.autograd.graph.get_gradient_edge(param).node)
    except RuntimeError:  # raised for a leaf under torch.autograd.grad: nothing is accumulated there
        return False


def _accum_dtype(hidden):
    return torch.float64 if hidden.dtype == torch.float64 else torch.float32


def _project(h, weight, bias, rows, dtype):
    """The head's output `[n, M]` at the ids `rows` `[n, M]` (replay), or `[n, V]` at every id (`rows` None), in
    `dtype`; also the gathered head rows `[n, M, H]` (None for the full head)."""
    h = h.to(dtype)
    if rows is None:
        return torch.nn.functional.linear(h, weight.to(dtype), None if bias is None else bias.to(dtype)), None
    w = torch.nn.functional.embedding(rows, weight).to(dtype)
    z = torch.bmm(w, h.unsqueeze(-1)).squeeze(-1)
    return (z if bias is None else z + bias[rows].to(dtype)), w


def _read(z, n, present, valid, temperature, transform, acc, entropy):
    """The elementwise part of a tile, differentiable in `z`: `(logps [t, n], entropies [t] or None)`.

    `z` is `[t, n + K]` (the ids', then the kept ids' head outputs; `present` `[t, K]` marks the kept slots) or, with
    `present` None, `[t, V]` with the ids' columns `n` `[t, n]`."""
    s = transform(z).to(acc) / temperature
    if present is None:
        lse = s.logsumexp(-1, keepdim=True)
        out = s.gather(-1, n) - lse
        ent = None
        if entropy:
            from trl.trainer.utils import entropy_from_logits  # loaded at first use: `import trl_rpp` stays TRL-free

            ent = entropy_from_logits(s.detach())
    else:
        kept = s[:, n:].masked_fill(~present, float("-inf"))
        lse = kept.logsumexp(-1, keepdim=True)
        out = s[:, :n] - lse
        ent = None
        if entropy:
            logp = (kept - lse).detach()
            ent = -torch.where(present, logp.exp() * logp, torch.zeros_like(logp)).sum(-1)
    zero = torch.zeros((), dtype=acc, device=z.device)
    out = torch.where(valid.unsqueeze(-1), out, zero)
    return out, None if ent is None else torch.where(valid, ent, zero)


def _tile_inputs(hidden, ids, support_ids, valid, sl):
    """One tile's hidden states (zero outside `valid`), head-row ids, kept-slot mask and validity."""
    if support_ids is None:
        ok = torch.ones(ids[sl].size(0), dtype=torch.bool, device=hidden.device) if valid is None else valid[sl]
        rows, present, cols = None, None, ids[sl]
    else:
        present = support_ids[sl] != ABSENT
        ok = present.any(-1) if valid is None else valid[sl] & present.any(-1)
        # A row without kept ids reads its first slot (masked by `ok`): a finite logsumexp, no NaN in the backward.
        present = present | ~ok.unsqueeze(-1) & (torch.arange(present.size(1), device=present.device) == 0)
        rows, cols = torch.cat([ids[sl], support_ids[sl]], -1).clamp(min=0), ids.size(1)
    h = torch.where(ok.unsqueeze(-1), hidden[sl], torch.zeros((), dtype=hidden.dtype, device=hidden.device))
    return h, rows, present, ok, cols


class _TiledHead(torch.autograd.Function):
    """`kept_logps` (`support_ids` given) or `full_logps`; saves its inputs only, recomputes each tile backward."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, ids, support_ids, valid, temperature, transform, tile, u=None, lora_b=None):
        device = hidden.device.type
        dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else hidden.dtype
        acc = _accum_dtype(hidden)
        outs, ents = [], []
        with torch.autocast(device, enabled=False):  # dtypes set explicitly, the same in the backward
            for start in range(0, hidden.size(0), tile):
                sl = slice(start, start + tile)
                h, rows, present, ok, cols = _tile_inputs(hidden, ids, support_ids, valid, sl)
                z, _ = _project(h, weight, bias, rows, dtype)
                if u is not None:
                    z = z + _project(_masked(u, ok, sl), lora_b, None, rows, dtype)[0]
                out, ent = _read(z, cols, present, ok, temperature, transform, acc, entropy=True)
                outs.append(out)
                ents.append(ent)
        ctx.save_for_backward(hidden, weight, bias, ids, support_ids, valid, u, lora_b)
        ctx.args = (temperature, transform, tile, dtype, acc)
        entropies = torch.cat(ents) if ents else hidden.new_zeros(0, dtype=acc)
        ctx.mark_non_differentiable(entropies)
        return (torch.cat(outs) if outs else hidden.new_zeros(0, ids.size(1), dtype=acc)), entropies

    @staticmethod
    def backward(ctx, grad_out, _grad_entropies):
        from trl.trainer.utils import maybe_gather_lm_head_ctx  # ZeRO-3: the head's partitioned weight, gathered

        hidden, weight, bias, ids, support_ids, valid, u, lora_b = ctx.saved_tensors
        temperature, transform, tile, dtype, acc = ctx.args
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        need_u, need_lb = ctx.needs_input_grad[9:11]
        grad_h = torch.zeros(hidden.shape, dtype=acc, device=hidden.device) if need_h else None
        grad_u = torch.zeros(u.shape, dtype=acc, device=u.device) if need_u else None
        # ZeRO-3 gathers parameters only; several adapters' B is a concatenation, saved whole.
        with maybe_gather_lm_head_ctx(weight, bias, lora_b if isinstance(lora_b, torch.nn.Parameter) else None):
            grad_lb = torch.zeros(lora_b.shape, dtype=acc, device=lora_b.device) if need_lb else None
            b_acc = lora_b.to(acc) if need_u and support_ids is None else None
            # Replay into a held dense `.grad`: the touched rows only, no [V, H] buffer. Into None the dense gradient
            # becomes `.grad`; its rows need no `torch.unique` (a host sync on a GPU).
            sparse_w = need_w and support_ids is not None and _adds_into_dense_grad(weight)
            sparse_b = need_b and support_ids is not None and _adds_into_dense_grad(bias)
            touched, slots = touched_rows(ids, support_ids) if sparse_w or sparse_b else (None, None)
            grad_w = grad_b = None
            if need_w:
                shape = (touched.numel(), weight.size(1)) if sparse_w else weight.shape
                grad_w = torch.zeros(shape, dtype=acc, device=weight.device)
            if need_b:
                grad_b = torch.zeros(touched.shape if sparse_b else bias.shape, dtype=acc, device=bias.device)
            w_acc = weight.to(acc) if need_h and support_ids is None else None
            for start in range(0, hidden.size(0), tile):
                sl = slice(start, start + tile)
                h, rows, present, ok, cols = _tile_inputs(hidden, ids, support_ids, valid, sl)
                with torch.no_grad():
                    z, w = _project(h, weight, bias, rows, dtype)
                    if u is not None:
                        ut = _masked(u, ok, sl)
                        zl, wl = _project(ut, lora_b, None, rows, dtype)
                        z = z + zl
                        ut = ut.to(acc)
                z.requires_grad_()
                with torch.enable_grad():
                    out, _ = _read(z, cols, present, ok, temperature, transform, acc, entropy=False)
                    (g,) = torch.autograd.grad(out, z, grad_out[sl])
                g = g.to(acc)
                h = h.to(acc)
                if u is not None:  # the low-rank term is one more linear map: u -> u B^T
                    _lowrank_grads(g, ut, wl, b_acc, rows, sl, grad_u, grad_lb)
                if rows is None:
                    if need_h:
                        grad_h[sl] = g @ w_acc
                    if need_w:
                        grad_w.addmm_(g.t(), h)
                    if need_b:
                        grad_b += g.sum(0)
                    continue
                if need_h:
                    grad_h[sl] = torch.bmm(g.unsqueeze(1), w.to(acc)).squeeze(1)
                if need_w:
                    at = (slots[sl] if sparse_w else rows).flatten()
                    grad_w.index_add_(0, at, (g.unsqueeze(-1) * h.unsqueeze(1)).flatten(0, 1))
                if need_b:
                    grad_b.index_add_(0, (slots[sl] if sparse_b else rows).flatten(), g.flatten())
            if sparse_w:
                grad_w = sparse_rows_gradient(touched, grad_w, weight.shape, weight.dtype)
            if sparse_b:
                grad_b = sparse_rows_gradient(touched, grad_b, bias.shape, bias.dtype)
        if grad_h is not None:  # rows outside `valid` read a zero state: no gradient reaches what they held
            grad_h = grad_h.to(hidden.dtype)
        return (grad_h, None if grad_w is None else grad_w.to(weight.dtype),
                None if grad_b is None else grad_b.to(bias.dtype), None, None, None, None, None, None,
                None if grad_u is None else grad_u.to(u.dtype), None if grad_lb is None else grad_lb.to(lora_b.dtype))


def _masked(x, ok, sl):
    """`x[sl]` with the rows outside `ok` zeroed (what they hold never reaches a result or a gradient)."""
    return torch.where(ok.unsqueeze(-1), x[sl], torch.zeros((), dtype=x.dtype, device=x.device))


def _lowrank_grads(g, u, b_rows, b_acc, rows, sl, grad_u, grad_lb):
    """Accumulate one tile's gradients of the low-rank term `u B^T` from `g`, the gradient of the head's output
    (`[t, V]`, or `[t, M]` at the ids `rows` `[t, M]` whose `B` rows are `b_rows` `[t, M, r]`); `u` `[t, r]`."""
    if rows is None:
        if grad_u is not None:
            grad_u[sl] = g @ b_acc
        if grad_lb is not None:
            grad_lb.addmm_(g.t(), u)
        return
    if grad_u is not None:
        grad_u[sl] = torch.bmm(g.unsqueeze(1), b_rows.to(g.dtype)).squeeze(1)
    if grad_lb is not None:
        grad_lb.index_add_(0, rows.flatten(), (g.unsqueeze(-1) * u.unsqueeze(1)).flatten(0, 1))
