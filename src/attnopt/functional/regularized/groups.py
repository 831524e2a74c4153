r"""Candidate-group fast path of α-entmax on CPU (internal leaf; exact, not an approximation).

The router (:mod:`._maps`) runs it for float ``α > 1`` other than 1.5 and 2 (those have C kernels,
:mod:`.cpu`, and the sort-based reference, :mod:`.sort`) on long contiguous rows; the dense search
it falls back to is :mod:`.search`, handed in as ``solve``. :func:`backward_rows` is the map's
closed-form backward on cache-sized row blocks (CPU, float ``1 < α ≤ 2`` where the C backward
does not run).

For ``α > 1`` the map ``p = [(α−1)(s − m) − θ]₊^{1/(α−1)}`` is zero below its threshold, and
the threshold of *any subset* of a row's entries is a lower bound on the row's threshold
(``Σ_{row}[z − θ]₊^{e} ≥ Σ_{subset}[z − θ]₊^{e}``). So, per row of ``n`` entries:

1. split the row into ``G = n/g`` strided groups of ``g = 8`` entries (4 for α < 2;
   ``view(R, g, G)``) and take each group's max (one cheap pass);
2. solve the map on the ``G`` group maxima — a subset — for a lower bound ``θ_lb``;
3. only groups whose max exceeds ``θ_lb`` (minus a safety margin) can hold support entries:
   gather those ``K`` groups (``8K`` entries, typically a few % of the row);
4. solve the map exactly on the gathered entries (the row's max is among them) — its support
   and threshold are the row's — and scatter ``p`` into a zero output.

Every step is a dense PyTorch op on a small tensor; a row block where the candidates are not
few (``K > G/4``, e.g. scores with a small range) returns ``None`` and the caller runs the dense
algorithm. This removes the many full-row passes of the dense threshold search, which is what
made the sparse maps ~2-4x slower than ``torch.softmax`` on (8, 1024, 1024).
"""
from __future__ import annotations

import threading
from collections.abc import Callable

import torch
from torch import Tensor

from attnopt.functional._thresholds import THRESHOLDS

__all__ = ["backward_rows", "group_forward", "group_size", "run_blocks", "usable"]

_GROUP = 8  # entries per group for sparsemax (α ≥ 2); α < 2 has wider supports: groups of 4
_MARGIN = 1e-3  # safety margin on the lower bound (z units; θ ∈ [−1, 0])

_LB_ITERS = 2  # iterations of the lower-bound solve on the group maxima (every iterate is a bound)

#: ``solve(t (R, W), theta0 | None, cap | None) -> (p, θ)``: the dense exact solver, θ in z units
#: (shifted by the row max), started at the lower bound ``theta0``, at most ``cap`` iterations.
Solver = Callable[[Tensor, Tensor | None, int | None], tuple[Tensor, Tensor]]


def group_size(alpha: float) -> int:
    """Entries per group: 8 for ``α ≥ 2`` (small supports), 4 below (wider supports)."""
    return _GROUP if alpha >= 2.0 else _GROUP // 2


def usable(x: Tensor, dim: int) -> bool:
    """CPU, last dim, contiguous, a row length that splits into groups of 8, large enough."""
    n = x.shape[-1] if x.dim() else 0
    return (x.device.type == "cpu" and x.dim() >= 2 and dim % x.dim() == x.dim() - 1 and x.is_contiguous()
            and n >= THRESHOLDS.sparse_groups_min_row and n % _GROUP == 0 and x.numel() >= 4 * n)


def _blocks(rows: int, n: int, elements: int | None = None) -> list[tuple[int, int]]:
    step = max(1, (THRESHOLDS.sparse_groups_block_entries if elements is None else elements) // n)
    return [(i, min(rows, i + step)) for i in range(0, rows, step)]


def run_blocks(fn: Callable[[int, int], bool], blocks: list[tuple[int, int]]) -> bool:
    """Run ``fn(r0, r1)`` on every row block in order; ``False`` as soon as one returns ``False``.

    The blocks run one after the other, each op using torch's intra-op threads. Spreading the
    blocks over Python threads with ``torch.set_num_threads(1)`` around them was measured
    slower on a quiet 2-core machine (``entmax(x, 1.5)`` fwd+bwd on (8, 1024, 1024), two
    threads: 91–104 ms against 61 ms serially), and toggling the thread count also slowed
    the next ops (the backward about 2x).
    """
    return all(fn(r0, r1) for r0, r1 in blocks)


def group_forward(x: Tensor, alpha: float, solve: Solver) -> tuple[Tensor, Tensor] | None:
    """``(p, θ)`` of the map on ``x (..., n)`` (last dim), or ``None`` if a block is not sparse.

    Args:
        x: scores, contiguous, ``usable``.
        alpha: the map's α > 1 (``z = (α − 1)(x − m)``).
        solve: the dense exact solver, applied to the group maxima and to the gathered entries.
    """
    n = x.shape[-1]
    scale = alpha - 1.0
    g = group_size(alpha)
    groups = n // g
    flat = x.view(-1, n)
    rows = flat.shape[0]
    out = torch.empty_like(flat)  # zeroed block by block, while the block is in cache
    theta = torch.empty((rows, 1), dtype=x.dtype, device=x.device)

    def block(r0: int, r1: int) -> bool:
        r = r1 - r0
        xv = flat[r0:r1].view(r, g, groups)
        gmax = xv.amax(dim=1)  # (R, G): a subset of each row's entries
        _, th_lb = solve(gmax, None, _LB_ITERS)  # a lower bound on the row threshold (z units)
        m = gmax.amax(dim=-1, keepdim=True)
        m = torch.where(torch.isneginf(m), torch.zeros_like(m), m)
        zg = (gmax - m).mul_(scale)
        cand = zg > th_lb - _MARGIN * (1 + th_lb.abs())
        picked = _pick(cand, groups)
        if picked is None:
            return False
        idx, slot_used = picked
        k = idx.shape[-1]
        idx = idx.unsqueeze(1).expand(r, g, k)
        sub = torch.gather(xv, 2, idx).masked_fill_(~slot_used.unsqueeze(1), float("-inf"))
        p_sub, th = solve(sub.view(r, g * k), th_lb, None)
        # unused slots point at a real group but carry p = 0: scatter_add leaves it intact
        out[r0:r1].zero_().view(r, g, groups).scatter_add_(2, idx, p_sub.view(r, g, k))
        theta[r0:r1] = th
        return True

    if not run_blocks(block, _blocks(rows, n)):
        return None
    return out.view(x.shape), theta.view(*x.shape[:-1], 1)


def _pick(cand: Tensor, groups: int) -> tuple[Tensor, Tensor] | None:
    """Column indices ``(R, K)`` of each row's candidate groups (``K`` = the most in a row),
    padded with index 0, and the mask of used slots; ``None`` when ``K > groups/4``."""
    count = cand.sum(dim=-1)
    k = int(count.max())
    if k > groups // 4:
        return None
    k = max(k, 1)
    rc = cand.nonzero()
    rows, cols = rc[:, 0], rc[:, 1]
    slot = torch.arange(rows.shape[0], device=cand.device) - (torch.cumsum(count, 0) - count)[rows]
    idx = torch.zeros(cand.shape[0], k, dtype=torch.long, device=cand.device)
    idx[rows, slot] = cols
    used = torch.arange(k, device=cand.device) < count.unsqueeze(-1)
    return idx, used


def _support_weight(p: Tensor, alpha: float, out: Tensor) -> Tensor:
    """``p^{2−α}`` on the support, 0 elsewhere, written into ``out`` (float ``1 < α ≤ 2``).

    ``sqrt``/``pow`` of exact zeros take a slow path on x86 CPUs (~20x): computed as
    ``p · max(p, 1e-30)^{1−α}`` (``p · rsqrt`` for α = 1.5), exactly 0 off the support.
    """
    if alpha == 2.0:
        return torch.sign(p, out=out)
    torch.clamp_min(p, 1e-30, out=out)
    if alpha == 1.5:
        out.rsqrt_()
    else:
        out.pow_(1.0 - alpha)
    return out.mul_(p)


def backward_rows(p: Tensor, grad: Tensor, alpha: float) -> Tensor:
    """The closed-form backward (:func:`._common.closed_form_backward`) on cache-sized row blocks of
    a contiguous last-dim ``p`` (CPU, float ``1 < α ≤ 2``).

    Five streaming ops per block, all in cache, one reused ``g`` buffer and no full-size
    temporary besides the result: about what ``torch.softmax``'s backward costs.
    """
    n = p.shape[-1]
    pf = p.view(-1, n)
    gf = grad.reshape(-1, n)
    out = torch.empty_like(pf)
    step = max(1, THRESHOLDS.sparse_backward_block_entries // n)
    local = threading.local()  # one cache-sized buffer per worker thread

    def block(i: int, j: int) -> bool:
        buf = getattr(local, "buf", None)
        if buf is None:
            buf = local.buf = torch.empty((step, n), dtype=p.dtype, device=p.device)
        w = _support_weight(pf[i:j], alpha, buf[: j - i])
        wsum = w.sum(dim=-1, keepdim=True)
        o = torch.mul(w, gf[i:j], out=out[i:j])
        q = o.sum(dim=-1, keepdim=True) / torch.where(wsum > 0, wsum, torch.ones_like(wsum))
        o.addcmul_(w, q, value=-1.0)
        return True

    run_blocks(block, [(i, min(pf.shape[0], i + step)) for i in range(0, pf.shape[0], step)])
    return out.view(p.shape)

