r"""Streaming DNAS / Sinkhorn-K: O(N) memory, never an ``Nq × Nk`` matrix (internal).

:func:`attention` prepares the masks (a key-only mask becomes a per-key validity, ``is_causal``
stays a rule, a full mask is kept as given) and runs K log-domain (column, row) passes, then
the attention pass, with potentials ``f`` (rows) and ``g`` (columns) of O(N) size:
``g_j = LSE_i (s_ij − f_i)``, ``f_i = LSE_j (s_ij − g_j)``, ``out_i = Σ_j softmax_j(s_ij − g_j) v_j``.

The passes are the blocked pure-PyTorch passes below (any device) unless the router hands a
kernel's pass runner (``run=``: the CPU flash-kernel passes of :mod:`.flash_cpu`). Each blocked
pass walks over blocks of rows; a block's ``block × N`` scores live only inside
:func:`torch.utils.checkpoint.checkpoint`, so the backward recomputes them block by block
(flash style) and never stores an ``Nq × Nk`` matrix. Same notation as :mod:`.flash_cpu`:
potentials and validity masks ``(B, H, N)``, an optional full additive mask ``(B, H, Na, Nb)``,
and a causal rule ``"lower"`` (keep ``j <= i``, SDPA's top-left ``is_causal``) or ``"upper"``
(keep ``j >= i``, the same mask seen from the keys).

Masks and causality: a key no query may see is left out of every normalization (weight 0);
finite key-only biases cancel in the column normalization. Half precision is computed in
float32 by the blocked passes.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from attnopt._validation import additive_mask, causal_additive_mask, check_attention_inputs, empty_attention
from attnopt.functional._softmax import safe_softmax
from attnopt.functional._thresholds import THRESHOLDS

__all__ = ["attention", "chunked_lse_pass", "chunked_attn_pass", "PassRunner"]

_HALF = (torch.float16, torch.bfloat16)

#: ``run(q, k, v, iterations, full, is_causal, row_valid, col_valid, scale)`` on 4-D tensors: a
#: kernel's Sinkhorn-K passes (see :func:`attention`).
PassRunner = Callable[[Tensor, Tensor, Tensor, int, "Tensor | None", bool, Tensor, Tensor, float], Tensor]


def _block_scores(
    a: Tensor, b: Tensor, bias: Tensor, mask: Tensor | None, start: int, causal: str | None, scale: float
) -> Tensor:
    s = torch.matmul(a, b.transpose(-2, -1)) * scale + bias[..., None, :]
    if mask is not None:
        s = s + mask
    if causal is not None:
        rows = torch.arange(start, start + a.shape[-2], device=a.device)[:, None]
        cols = torch.arange(b.shape[-2], device=a.device)[None, :]
        drop = cols > rows if causal == "lower" else cols < rows
        s = s.masked_fill(drop, float("-inf"))
    return s


def _lse(s: Tensor) -> Tensor:
    """Row log-sum-exp, ``-inf`` for an all ``-inf`` row with a zero (not NaN) gradient."""
    m = s.amax(dim=-1, keepdim=True).detach()
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    tot = torch.exp(s - m).sum(dim=-1, keepdim=True)
    pos = tot > 0
    out = torch.log(torch.where(pos, tot, torch.ones_like(tot))) + m
    return torch.where(pos, out, torch.full_like(out, float("-inf")))


def _bias(pot: Tensor, valid: Tensor) -> Tensor:
    return torch.where(valid, -pot, torch.full_like(pot, float("-inf")))


def _blocked(
    fn: Callable[..., Tensor], a: Tensor, mask: Tensor | None, block: int | None, *args: Tensor
) -> Tensor:
    block = THRESHOLDS.dnas_streaming_block if block is None else block
    outs = []
    for start in range(0, a.shape[-2], block):
        stop = min(start + block, a.shape[-2])
        mblk = None if mask is None else mask[..., start:stop, :]

        def run(*t: Tensor, s: int = start, m: Tensor | None = mblk) -> Tensor:
            return fn(*t, m, s)

        if torch.is_grad_enabled():
            outs.append(checkpoint(run, a[..., start:stop, :], *args, use_reentrant=False))
        else:
            outs.append(run(a[..., start:stop, :], *args))
    return torch.cat(outs, dim=-2)


def chunked_lse_pass(
    a: Tensor, b: Tensor, pot: Tensor, valid: Tensor, mask: Tensor | None, causal: str | None,
    scale: float, block: int | None = None,
) -> Tensor:
    """(B, H, Na) ``LSE_j(scale <a_i,b_j> + m_ij − pot_j)`` over valid ``j``; ``-inf`` if none."""

    def fn(ablk: Tensor, bb: Tensor, bias: Tensor, m: Tensor | None, s: int) -> Tensor:
        return _lse(_block_scores(ablk, bb, bias, m, s, causal, scale))

    return _blocked(fn, a, mask, block, b, _bias(pot, valid))[..., 0]


def chunked_attn_pass(
    q: Tensor, k: Tensor, v: Tensor, pot: Tensor, valid: Tensor, mask: Tensor | None, causal: str | None,
    scale: float, block: int | None = None,
) -> Tensor:
    """(B, H, Nq, dv) ``Σ_j softmax_j(scale <q_i,k_j> + m_ij − pot_j) v_j``; empty rows are 0."""

    def fn(qblk: Tensor, kk: Tensor, vv: Tensor, bias: Tensor, m: Tensor | None, s: int) -> Tensor:
        return torch.matmul(safe_softmax(_block_scores(qblk, kk, bias, m, s, causal, scale), dim=-1), vv)

    return _blocked(fn, q, mask, block, k, v, _bias(pot, valid))


def _blocked_passes(
    q: Tensor, k: Tensor, v: Tensor, iterations: int, full: Tensor | None, is_causal: bool,
    row_valid: Tensor, col_valid: Tensor, scale: float,
) -> Tensor:
    """Sinkhorn-K (K >= 1) on 4-D tensors with the blocked passes above."""
    orig = q.dtype
    if orig in _HALF:
        q, k, v = q.float(), k.float(), v.float()
    full_t = None if full is None else full.transpose(-1, -2)
    lower, upper = ("lower", "upper") if is_causal else (None, None)
    f = torch.zeros(row_valid.shape, dtype=torch.float64 if q.dtype == torch.float64 else torch.float32,
                    device=q.device)
    g = chunked_lse_pass(k, q, f, row_valid, full_t, upper, scale)
    for _ in range(iterations - 1):
        f = chunked_lse_pass(q, k, g, col_valid, full, lower, scale)
        g = chunked_lse_pass(k, q, f, row_valid, full_t, upper, scale)
    return chunked_attn_pass(q, k, v, g, col_valid, full, lower, scale).to(orig)


def _to_bh(x: Tensor, batch: tuple[int, ...]) -> Tensor:
    """Expand ``x (…, N, ·)`` to ``batch`` and view it as 4-D ``(B, H, N, ·)``."""
    x = x.expand(*batch, *x.shape[-2:])
    if len(batch) == 2:
        return x
    g = 1
    for n in batch:
        g *= n
    return x.reshape(g, 1, *x.shape[-2:])


def _prepare_masks(
    attn_mask: Tensor | None, is_causal: bool, batch: tuple[int, ...], bh: tuple[int, int], nq: int, nk: int,
    pot_dtype: torch.dtype, device: torch.device,
) -> tuple[Tensor | None, Tensor, Tensor, bool]:
    """Return ``(full (B,H,Nq,Nk) or None, row_valid (B,H,Nq), col_valid (B,H,Nk), causal)``.

    ``is_causal`` is folded into a full mask when there is one (``causal`` is then False).

    A key-only mask keeps only which keys are excluded: finite key biases cancel exactly in
    every column normalization (``s_ij + m_j − (c_j + m_j)``).
    """
    target = (*batch, nq, nk)
    m = additive_mask(attn_mask, target, pot_dtype)
    full: Tensor | None = None
    if m is None:
        keys = torch.ones(*bh, nk, dtype=torch.bool, device=device)
    elif m.dim() < 2 or m.shape[-2] == 1:
        keys = torch.isfinite(m).expand(*batch, 1, nk).reshape(*bh, nk)
    else:
        full = m.expand(target).reshape(*bh, nq, nk)
        keys = torch.ones(*bh, nk, dtype=torch.bool, device=device)
    if full is not None:
        if is_causal:
            full = full + causal_additive_mask(nq, nk, pot_dtype, device)
        fin = torch.isfinite(full)
        return full.contiguous(), fin.any(-1), fin.any(-2), False
    idx_q = torch.arange(nq, device=device)
    if is_causal:
        seen = torch.cumsum(keys.int(), dim=-1) > 0  # any admissible key j' <= j
        row_valid = seen[..., idx_q.clamp(max=nk - 1)]
        col_valid = keys & (torch.arange(nk, device=device) < nq)
    else:
        row_valid = keys.any(-1, keepdim=True).expand(*bh, nq)
        col_valid = keys
    return None, row_valid, col_valid, is_causal


def attention(
    q: Tensor, k: Tensor, v: Tensor, iterations: int, attn_mask: Tensor | None, scale: float, is_causal: bool,
    run: PassRunner | None = None,
) -> Tensor:
    """DNAS / Sinkhorn-K (K >= 1) output ``(…, Nq, dv)`` in O(N) memory (inputs validated).

    ``run``: a kernel's pass runner (:func:`.flash_cpu.run_passes`); ``None`` = the blocked
    passes. A kernel's runner is used only when ``is_causal`` stays a rule with ``Nq = Nk`` or
    is folded into a full mask (the swapped column pass needs a causal mask the flash kernel
    does not offer for ``Nq != Nk``).
    """
    nq, nk, _ = check_attention_inputs(q, k, v)
    empty = empty_attention(q, k, v)
    if empty is not None:  # the fused kernel crashes the process on empty sizes
        return empty
    batch = tuple(torch.broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2]))
    q4, k4, v4 = _to_bh(q, batch), _to_bh(k, batch), _to_bh(v, batch)
    bh = (q4.shape[0], q4.shape[1])
    pot = torch.float64 if q.dtype == torch.float64 else torch.float32
    full, row_valid, col_valid, causal = _prepare_masks(attn_mask, is_causal, batch, bh, nq, nk, pot,
                                                         q.device)
    if run is None or (causal and nq != nk):
        run = _blocked_passes
    out = run(q4, k4, v4, iterations, full, causal, row_valid, col_valid, scale)
    return out.reshape(*batch, nq, v.shape[-1])
