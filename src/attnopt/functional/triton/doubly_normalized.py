r"""DNAS, Sinkhorn-K and HNAS on the Triton flash primitive (doubly-normalized-attention eq. 6–10, Sec. 6).

With scores ``s_ij = scale <q_i, k_j> + m_ij`` (design.md §3):

* column pass (queries and keys swapped): ``c_j = LSE_i (s_ij − f_i)`` (``f = 0`` first);
* row pass: ``f_i = LSE_j (s_ij − c_j)`` (Sinkhorn-K only, between column passes);
* attention pass: ``out_i = Σ_j softmax_j(s_ij − c_j) v_j``;
* HNAS: ``w·out^DNAS + (1 − w)·out^LNAS``; the LNAS term rides in the attention pass (one score
  tile, two softmax accumulators, :func:`~attnopt.functional.triton._flash.hnas_attention`).

K = 1 is two flash passes, Sinkhorn-K ``2K`` passes, all with O(N) state (``c``, ``f`` and the
row log-sum-exps). The backward is autograd through the chain of
:func:`attnopt.functional.triton._flash.flash`, whose own backward is two Triton kernels; for
K = 1 it is exactly ``dk_j += scale·dc_j·O'_j``, ``dq_i += scale·Σ_j dc_j e^{s_ij − c_j} k_j``
with ``dc_j`` from the key bias (the gradient through ``c`` is kept: treating it as a constant
is wrong). A potential that is ``-inf`` (a key no query may see, a query with no admissible
key) excludes its key or query from the next pass instead of entering it as ``+inf``, so such
keys get weight 0 and every gradient stays finite.

Masks: a key-only mask is the column bias (finite key biases cancel in the column
normalization; only ``-inf`` matters), anything else is read through a stride-0 view, so query
padding ``(B, 1, Nq, 1)`` costs no ``Nq × Nk`` memory; ``is_causal`` is SDPA's top-left mask,
in every pass (the swapped passes read it transposed): the ``causal="plan"`` variant. The
autoregressive ``causal="prefix"`` variant (``c_j`` over the queries up to ``i``, the default of
``is_causal`` alone) has no Triton kernel: the router runs its own path before reaching here.
"""
from __future__ import annotations

import torch
from torch import Tensor

from attnopt.functional.triton import check_device
from attnopt.functional.triton._flash import INTERPRETED, flash, hnas_attention
from attnopt.functional.triton._shapes import prepare

__all__ = ["sinkhorn_attention"]

_NEG_INF = float("-inf")


def _bias(pot: Tensor, keep: Tensor | None = None) -> Tensor:
    """``-pot`` as a bias; ``-inf`` where ``pot`` is ``-inf`` (empty slice) or ``keep`` is False."""
    ok = pot > _NEG_INF
    if keep is not None:
        ok = ok & keep
    return torch.where(ok, -pot, torch.full_like(pot, _NEG_INF))


def sinkhorn_attention(
    q: Tensor, k: Tensor, v: Tensor, *, iterations: int, weight: Tensor | None, attn_mask: Tensor | None,
    scale: float, is_causal: bool,
) -> Tensor:
    """Sinkhorn-K attention (``weight=None``) or HNAS (``weight`` = the mixing weight, shaped to broadcast).

    Args:
        q, k, v: validated (…, N, ·) inputs (non-empty).
        iterations: K >= 1.
        weight: HNAS mixing weight (0-d or (H, 1, 1)), or None for DNAS / Sinkhorn-K.
        attn_mask: SDPA-style mask or None.
        scale: score scale.
        is_causal: top-left causal mask.
    Returns:
        (…, Nq, dv) in ``q``'s dtype.
    Raises:
        RuntimeError: the kernels cannot run on this device (see ``check_device``).
    """
    check_device(q, INTERPRETED)
    p = prepare(q, k, v, attn_mask)
    assert p.v is not None
    fwd, bwd = (1, 2) if is_causal else (0, 0)
    mask_t = None if p.mask is None else p.mask.transpose(-1, -2)
    key_ok = p.key_bias > _NEG_INF
    no_rows = torch.zeros(p.q.shape[:3], dtype=p.pot, device=q.device)
    c = flash(p.k, p.q, None, no_rows, mask_t, bwd, scale)[1]
    for _ in range(iterations - 1):
        f = flash(p.q, p.k, None, _bias(c, key_ok), p.mask, fwd, scale)[1]
        c = flash(p.k, p.q, None, _bias(f), mask_t, bwd, scale)[1]
    if weight is not None:  # HNAS: the attention pass and the LNAS pass share their score tiles
        wg = weight.to(p.pot).expand(*p.batch, 1, 1).reshape(p.q.shape[:2]).contiguous()  # read by index
        return p.restore(hnas_attention(p.q, p.k, p.v, _bias(c, key_ok), p.key_bias, p.mask, wg, fwd, scale))
    return p.restore(flash(p.q, p.k, p.v, _bias(c, key_ok), p.mask, fwd, scale)[0])
