r"""Blocked pure-PyTorch Sinkhorn/DNAS passes: O(N · block) memory on any device (internal).

The fallback for devices and dtypes without a fused kernel (today: everything that is not
CPU). Each pass walks over blocks of rows; a block's ``block × N`` scores live only inside
:func:`torch.utils.checkpoint.checkpoint`, so the backward recomputes them block by block
(flash style) and never stores an ``Nq × Nk`` matrix. Same notation as :mod:`._flash_cpu`:
potentials and validity masks ``(B, H, N)``, an optional full additive mask ``(B, H, Na, Nb)``,
and a causal rule ``"lower"`` (keep ``j <= i``, SDPA's top-left ``is_causal``) or ``"upper"``
(keep ``j >= i``, the same mask seen from the keys).

A GPU path (Triton or FlexAttention) can be added next to this one in
:func:`attnopt.functional.doubly_normalized._run_passes` without changing the public API.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from attnopt.functional._softmax import safe_softmax

__all__ = ["chunked_lse_pass", "chunked_attn_pass", "DEFAULT_BLOCK"]

DEFAULT_BLOCK = 256


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
    fn: Callable[..., Tensor], a: Tensor, mask: Tensor | None, block: int, *args: Tensor
) -> Tensor:
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
    scale: float, block: int = DEFAULT_BLOCK,
) -> Tensor:
    """(B, H, Na) ``LSE_j(scale <a_i,b_j> + m_ij − pot_j)`` over valid ``j``; ``-inf`` if none."""

    def fn(ablk: Tensor, bb: Tensor, bias: Tensor, m: Tensor | None, s: int) -> Tensor:
        return _lse(_block_scores(ablk, bb, bias, m, s, causal, scale))

    return _blocked(fn, a, mask, block, b, _bias(pot, valid))[..., 0]


def chunked_attn_pass(
    q: Tensor, k: Tensor, v: Tensor, pot: Tensor, valid: Tensor, mask: Tensor | None, causal: str | None,
    scale: float, block: int = DEFAULT_BLOCK,
) -> Tensor:
    """(B, H, Nq, dv) ``Σ_j softmax_j(scale <q_i,k_j> + m_ij − pot_j) v_j``; empty rows are 0."""

    def fn(qblk: Tensor, kk: Tensor, vv: Tensor, bias: Tensor, m: Tensor | None, s: int) -> Tensor:
        return torch.matmul(safe_softmax(_block_scores(qblk, kk, bias, m, s, causal, scale), dim=-1), vv)

    return _blocked(fn, q, mask, block, k, v, _bias(pot, valid))
