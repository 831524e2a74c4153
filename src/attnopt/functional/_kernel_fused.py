r"""Fused kernel attention for Fourier-feature kernels at short sequences (internal).

implicit-kernel-attention eq. (9), (12)–(16), the bounded squared kernels (IKA / IKAN with
Fourier features, ``|f| <= 1``): with ``F = φ(Q) φ(K)ᵀ``, ``W = F² + ε`` and the key weight
``m_j = exp(a_j − max a)`` (magnitude and key mask),

.. math:: O_i = \frac{\sum_j W_{ij} m_j v_j}{\sum_j W_{ij} m_j}

in one autograd node: ``[Σ W m v, Σ W m] = W [v ⊙ m, m]`` (one matmul), and the closed-form
backward with ``A_ij = W_ij m_j``, ``g_i = dO_i / den_i``, ``δ_i = <g_i, O_i>``:

.. math:: dA = g V^\top - \delta,\quad dm_j = \textstyle\sum_i dA_{ij} W_{ij},\quad
          dV = m \odot (W^\top g),\quad dF = 2F \odot dA \odot m,\quad
          d\phi(Q) = dF\,\phi(K),\ d\phi(K) = dF^\top \phi(Q).

:func:`fused_fourier_attention` / :func:`fused_fourier_magnitude_attention` also compute the
feature maps, and the latter the L^p key magnitude and key mask, inside the node, with their
gradients in closed form (the short path of :func:`~attnopt.functional.kernel.kernel_attention`:
at N = 64 the ~20 separate autograd nodes of features and magnitude cost as much as the
attention). The ``Nq × Nk`` part runs by the blocks of :mod:`._kernel_chunked` (whole up to
``WHOLE_ELEMS`` scores, ``F`` recomputed in the backward above). Feature maps without the
Fourier form (Linear, user kernels) take :mod:`._kernel_chunked`'s node directly. Rows whose
denominator is 0 give zeros.
"""
from __future__ import annotations

import ctypes
from typing import Any

import torch
from torch import Tensor

from attnopt import _native
from attnopt._validation import broadcast_shapes
from attnopt.functional._autograd import double_backward
from attnopt.functional._kernel_chunked import blocked_backward, blocked_forward

__all__ = ["fused_fourier_attention", "fused_fourier_magnitude_attention"]


_LP_MODES = {1.0: 1, 1.5: 2, 2.0: 3}
_F64P = ctypes.c_double


def _magnitude_native(
    k: Tensor, p: float, scale: float, grad: bool, cap: float
) -> tuple[Tensor, Tensor | None, Tensor | None] | None:
    """:func:`_magnitude` by ``_native/lp_magnitude.c`` (one pass per row instead of ~11 ops), or
    None where it does not apply (no native library, not a contiguous float32/float64 CPU tensor)."""
    if k.device.type != "cpu" or k.dtype not in (torch.float32, torch.float64) or not k.is_contiguous():
        return None
    lib = _native.library("lp_magnitude")
    if lib is None:
        return None
    d = k.shape[-1]
    rows = k.numel() // d if d else 0
    a = k.new_empty(k.shape[:-1])
    u = torch.empty_like(k) if grad else None
    c = k.new_empty(k.shape[:-1]) if grad else None
    fn = lib.lp_magnitude_f32 if k.dtype == torch.float32 else lib.lp_magnitude_f64
    size = k.element_size()
    mode = ctypes.c_int(_LP_MODES.get(p, 0))

    def at(t: Tensor | None, offset: int) -> ctypes.c_void_p | None:
        return None if t is None else ctypes.c_void_p(t.data_ptr() + offset * size)

    def call(r0: int, r1: int) -> None:  # rows [r0, r1)
        fn(at(k, r0 * d), ctypes.c_int64(r1 - r0), ctypes.c_int64(d), mode, _F64P(p), _F64P(scale),
           _F64P(cap), at(a, r0), at(u, r0 * d), at(c, r0))

    _native.parallel_rows(call, rows, d)
    return a, u, c


def _magnitude(k: Tensor, p: float, scale: float, grad: bool) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """``a = s·(Σ|k|^p)^{2/p}/2`` (clamped below the dtype's max/8) and, with ``grad``, its gradient
    factors: ``∂a_j/∂k_j = c_j·u_j`` with ``u = |k|^{p−1}·sign(k)`` and ``c = s·T^{2/p−1}``
    (``T = Σ|k|^p``; 0 where the clamp is active).

    :func:`attnopt.functional.kernel.log_magnitude`'s ``1 <= p <= 2`` branch, without autograd;
    by the native kernel where it applies (N = 64, d = 64, p = 1.5: ~10 µs instead of ~55).
    """
    cap = torch.finfo(k.dtype).max / 8
    native = _magnitude_native(k, p, scale, grad, cap) if k.numel() else None
    if native is not None:
        return native
    if p == 2.0:
        total = (k * k).sum(-1)
        a = total.mul(0.5 * scale).clamp_(max=cap)
        if not grad:
            return a, None, None
        return a, k, (a < cap).to(k.dtype).mul_(scale)  # (a where of Python scalars would be float32)
    ax = k.abs()
    if p == 1.0:  # |k|^{p−1} = 1
        pw = None
        total = ax.sum(-1)
    else:
        pw = ax.sqrt() if p == 1.5 else ax.pow(p - 1.0)
        total = (ax * pw).sum(-1)
    tp = total.pow(2.0 / p - 1.0)  # T^{2/p−1}: a = s·T·T^{2/p−1}/2 (one pow on the rows, not two)
    a = torch.mul(total, tp).mul_(0.5 * scale).clamp_(max=cap)
    if not grad:
        return a, None, None
    u = k.sign() if pw is None else torch.copysign(pw, k, out=pw)  # |k|^{p−1}·sign(k) (sign(0) = 0: pw = 0)
    c = torch.where(a < cap, tp.mul_(scale), 0.0)
    return a, u, c


def _sum_sets(x: Tensor, nsets: int, r: int) -> Tensor:
    """``Σ_s x[..., sR:(s+1)R]`` (contiguous views added: a strided reduction is ~6× slower)."""
    if nsets == 1:
        return x
    out = x[..., :r] + x[..., r : 2 * r]
    for i in range(2, nsets):
        out.add_(x[..., i * r : (i + 1) * r])
    return out


class _FusedFourier(torch.autograd.Function):
    r"""Fourier feature maps of ``q`` and ``k``, the key weights and the attention above, one node.

    ``P = [Q; K] Wᵀ`` with ``W = [w_1; …; w_S]`` (S point sets of R points, stacked), features
    ``φ = c·[Σ_s cos P_s, Σ_s sin P_s]`` (S = 1: IKA_S, eq. 13; S = 2: IKA_NS, eq. 15–16),
    kept unscaled (``φ' = φ/c``, ``F = c²F'``, ``W = c⁴F'² + ε``: no pass spent on ``c``).
    The key weight is either given (``kw (…, Nk, 1)``, with a gradient) or computed here:
    ``m_j = exp(a_j − max_l a_l)`` with ``a_j = s‖k_j‖_p²/2 + mask_j`` (``1 <= p <= 2`` or no
    magnitude; the max is a constant shift, as in the unfused path; ``mask`` needs no gradient).
    Backward through the features: ``dP_s = cos P_s ⊙ dφ'_sin − sin P_s ⊙ dφ'_cos``,
    ``d[Q; K] = dP W``, ``dW = dPᵀ [Q; K]`` (summed over the batch dimensions ``W`` broadcast
    over); through the magnitude ``∂a_j/∂k_j = s·T^{2/p−1}·|k_j|^{p−1}·sign(k_j)``, ``T = Σ|k_j|^p``.
    """

    @staticmethod
    def forward(
        ctx: Any, q: Tensor, k: Tensor, v: Tensor, w: Tensor, kw: Tensor | None, mask: Tensor | None,
        eps: float, coef: float, nsets: int, p: float | None, scale: float,
    ) -> Tensor:
        nq, sr = q.shape[-2], w.shape[-2]
        r = sr // nsets
        c4 = coef**4
        # Nq = Nk: [Q; K] stacked on a new leading axis, so that φ(Q), φ(K) and the gradients of
        # q and k are contiguous (a strided gradient is copied by AccumulateGrad)
        stacked = nq == k.shape[-2]
        x = torch.stack([q, k]) if stacked else torch.cat([q, k], dim=-2)
        pr = torch.matmul(x, w.transpose(-2, -1))  # (…, Nq+Nk, S·R)
        cp, sp = pr.cos(), pr.sin()
        phi = torch.cat([_sum_sets(cp, nsets, r), _sum_sets(sp, nsets, r)], dim=-1)  # φ/c
        pq, pk = (phi[0], phi[1]) if stacked else (phi[..., :nq, :], phi[..., nq:, :])
        u = cm = None
        # without a mask every key weight is > 0 with max 1 (or absent): den >= ε > 0 (the callers
        # give ε > 0), no guard
        guard = kw is not None or mask is not None or not eps > 0
        if kw is None:
            a = None
            if p is not None:
                a, u, cm = _magnitude(k, p, scale, ctx.needs_input_grad[1])
            if mask is not None:
                a = mask if a is None else a + mask
            if a is not None:
                c = a.amax(dim=-1, keepdim=True)
                if mask is not None:  # a fully masked row: every weight 0, no NaN
                    c = torch.where(torch.isfinite(c), c, 0.0)
                kw = torch.exp(a - c).unsqueeze(-1).expand(*v.shape[:-1], 1)
        if kw is None:
            vm = torch.cat([v, v.new_ones(()).expand(*v.shape[:-1], 1)], dim=-1)
        else:
            vm = torch.cat([v * kw, kw], dim=-1)
        # W = c⁴F'² + ε (F' = φ'(Q)φ'(K)ᵀ) and W vm, by blocks of heads that stay in the cache
        num, kept = blocked_forward(_flat3(pq), _flat3(pk), _flat3(vm), c4, eps)
        num = num.view(*vm.shape[:-2], nq, vm.shape[-1])
        den = num[..., -1:]
        inv = den.reciprocal()
        if guard:  # a row with no weight gives zeros
            inv = torch.where(den > 0, inv, 0.0)
        out = num[..., :-1] * inv
        ctx.c4, ctx.nq, ctx.nsets, ctx.r, ctx.stacked = c4, nq, nsets, r, stacked
        ctx.eps = eps
        ctx.save_for_backward(x, w, cp, sp, pq, pk, kw, v, vm, inv, out, u, cm, *(kept or ()))
        return out

    @staticmethod
    def backward(ctx: Any, dout: Tensor) -> tuple[Tensor | None, ...]:
        if double_backward(ctx):  # the closed form below uses untracked intermediates
            raise RuntimeError(
                "kernel_attention's fused Fourier-feature node has no double backward (create_graph=True)"
            )
        # With A_ij = W_ij m_j, g = dO/den, δ_i = <g_i, O_i>, dA_ij = <g_i, v_j> − δ_i:
        # dW_ij = <[g_i, −δ_i], [m_j v_j, m_j]> (one matmul), T = Wᵀ[g, −δ] gives
        # dv_j = m_j T_j[:dv] and dm_j = <v_j, T_j[:dv]> + T_j[dv]: one pass over Nq×Nk (dW ⊙ f).
        x, w, cp, sp, pq, pk, kw, v, vm, inv, out, u, cm, *kept = ctx.saved_tensors
        need_q, need_k, need_v, need_w, need_kw = (ctx.needs_input_grad[i] for i in range(5))
        need_mag = need_k and u is not None
        g = dout * inv
        gn = torch.cat([g, (g * out).sum(-1, keepdim=True).neg_()], dim=-1)
        dkw = dv = dmag = None
        need_t, need_f = need_v or need_kw or need_mag, need_q or need_k or need_w
        lead = vm.shape[:-2]
        t, dpq, dpk = blocked_backward(_flat3(pq), _flat3(pk), _flat3(vm), _flat3(gn), ctx.c4, ctx.eps,
                                       (kept[0], kept[1]) if kept else None, need_t, need_f, need_f)
        if t is not None:
            t = t.view(*lead, *t.shape[-2:])
            tv = t[..., :-1]
            if need_v:
                dv = tv if kw is None else tv * kw
            if need_kw or need_mag:
                dm = (tv * v).sum(-1, keepdim=True).add_(t[..., -1:])
                if need_kw:
                    dkw = dm
                if need_mag:  # m = exp(a − c): da = dm·m (c is a constant shift)
                    dmag = (dm * kw).mul_(cm.unsqueeze(-1))  # the factor of u: ∂L/∂k += u ⊙ dmag
        dq = dk = dw = None
        if need_f:
            assert dpq is not None and dpk is not None
            # (a cat: bmm with out= rows of one buffer was slower, 25 vs 15 µs a bmm at N = 64)
            dpq, dpk = dpq.view(*lead, *dpq.shape[-2:]), dpk.view(*lead, *dpk.shape[-2:])
            dphi = torch.stack([dpq, dpk]) if ctx.stacked else torch.cat([dpq, dpk], dim=-2)
            s, r = ctx.nsets, ctx.r
            # every set's cos (sin) gets the same dφ_cos (dφ_sin)
            dc, ds = dphi[..., :r], dphi[..., r:]
            if s > 1:  # tiled by cat: ~4x faster than repeat or a broadcast over a set axis
                dc, ds = torch.cat([dc] * s, dim=-1), torch.cat([ds] * s, dim=-1)
            dp = torch.addcmul(cp * ds, sp, dc, value=-1.0)
            if need_q or need_k:
                dx = torch.matmul(dp, w)
                dq, dk = (dx[0], dx[1]) if ctx.stacked else (dx[..., : ctx.nq, :], dx[..., ctx.nq :, :])
                if dmag is not None:  # in place: dx is this node's own buffer
                    dk = dk.addcmul_(u, dmag)
            if need_w:
                dw = torch.matmul(dp.transpose(-2, -1), x)  # (…, S·R, d)
                dw = dw.sum_to_size(w.shape)
        elif dmag is not None:
            dk = u * dmag
        return (dq, dk, dv, dw, dkw, None, None, None, None, None, None)


def _flat3(x: Tensor) -> Tensor:
    """``(…, N, D)`` as ``(G, N, D)`` (a view where the batch dimensions allow it)."""
    return x.reshape(-1, *x.shape[-2:])


def _stack_sets(ws: list[Tensor], dtype: torch.dtype) -> Tensor:
    ws = [w.to(dtype) for w in ws]
    if len(ws) == 1:
        return ws[0]
    shape = broadcast_shapes(*(w.shape for w in ws))
    return torch.cat([w.expand(shape) for w in ws], dim=-2)


def fused_fourier_attention(
    q: Tensor, k: Tensor, key_weight: Tensor | None, v: Tensor, eps: float, coef: float, ws: list[Tensor]
) -> Tensor:
    """``O`` with Fourier features from spectral point sets ``ws`` (each (…, R, d), broadcast).

    ``q (…, Nq, d)``, ``k (…, Nk, d)``, ``v (…, Nk, dv)``, ``key_weight (…, 1, Nk)`` or None;
    ``coef`` is the feature normalization (``1/√R`` for one set, ``1/(2√R)`` for two).
    """
    batch = broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2],
                             () if key_weight is None else key_weight.shape[:-2])
    q, k, v = (x if x.shape[:-2] == batch else x.expand(*batch, *x.shape[-2:]) for x in (q, k, v))
    kw = None if key_weight is None else key_weight.transpose(-2, -1).to(v.dtype).expand(*v.shape[:-1], 1)
    out: Tensor = _FusedFourier.apply(q, k, v, _stack_sets(ws, q.dtype), kw, None, float(eps), float(coef),
                                      len(ws), None, 1.0)
    return out


def fused_fourier_magnitude_attention(
    q: Tensor, k: Tensor, v: Tensor, points: Tensor, nsets: int, coef: float, eps: float,
    p: float | None, scale: float, key_mask: Tensor | None,
) -> Tensor:
    """``O`` with the L^p key magnitude and an additive key mask computed inside the node.

    ``points (…, S·R, d)``: the ``nsets`` point sets stacked (set ``s`` is rows
    ``[sR, (s+1)R)``); ``p`` in ``[1, 2]`` or None (no magnitude); ``scale`` the ``s`` of the
    magnitude; ``key_mask (…, Nk)`` additive, no gradient, or None. Batch dimensions broadcast.
    """
    batch: tuple[int, ...] = q.shape[:-2]
    same = k.shape[:-2] == batch and v.shape[:-2] == batch
    if not (same and (key_mask is None or key_mask.shape[:-1] == batch)):
        shapes = [q.shape[:-2], k.shape[:-2], v.shape[:-2]]
        if key_mask is not None:
            shapes.append(key_mask.shape[:-1])
        batch = broadcast_shapes(*shapes)
        # (an expand of a tensor already of this shape would add a backward node per input)
        q, k, v = (x if x.shape[:-2] == batch else x.expand(*batch, *x.shape[-2:]) for x in (q, k, v))
    out: Tensor = _FusedFourier.apply(q, k, v, points.to(q.dtype), None, key_mask, float(eps), float(coef),
                                      nsets, None if p is None else float(p), float(scale))
    return out
