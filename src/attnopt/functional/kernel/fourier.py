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
attention). The ``Nq × Nk`` part runs by the blocks of :mod:`.chunked` (whole up to
``THRESHOLDS.kernel_whole_elements`` scores, ``F`` recomputed in the backward above). Feature maps without the
Fourier form (Linear, user kernels) take :mod:`.chunked`'s node directly. Rows whose
denominator is 0 give zeros.

At N = 64, d = 64 the ``N × d`` passes are as large as the ``N × N`` ones and every op costs
5–15 µs of fixed overhead, so the node's elementwise work runs as four C calls
(``_native/fourier_features.c``), the matmuls in PyTorch: forward ``sin``/``cos`` of ``P`` with
the sums over point sets, together with the key weights (magnitude, mask, max, exp and
``[v ⊙ m, m]``); ``O = num/den``; backward ``G = [g, −δ]``; the key gradients (``dv``, ``dm`` and
the magnitude's share of ``dk``) together with ``dP``. float32's sine and cosine there are
polynomials (~1e-7, see the C file), its exponential ``pexp.h``'s; float64 uses libm. The
PyTorch ops remain the path off the CPU, without a compiler, with ``ATTNOPT_NATIVE=0`` and for
strided tensors. Measured (fwd+bwd, 1 thread, thread CPU time, loaded 2-core machine, ratio to
SDPA in the same run): IKAN R = 16, p = 1.5 at B·H = 8, N = 64 2.6–2.7× → 2.0–2.2×, B·H = 64
1.65× → 1.25–1.3×; IKA_S R = 8 2.1× → 1.8×.

At small sizes (``THRESHOLDS.kernel_wholecall_below`` scores in all, ``kernel_wholecall_max_head_scores`` per
head) :func:`fused_fourier_magnitude_attention` takes the *whole-call* path instead
(:class:`_WholeFourier`; ``ffw_*`` in the C file): the forward of every head is one C call and
the backward one, the same passes per head with the products by PyTorch's own BLAS called from C
(:func:`attnopt._native.blas`), MKL held to one thread and flush-to-zero on during the call,
heads split over ``torch.get_num_threads()`` threads; ``F``, the features, ``cos``/``sin`` of
``P``, ``[v ⊙ m, m]`` and the key-weight factors saved per head. It leaves ~20 PyTorch ops and
their Python of the node for two foreign calls. Same math as the node to rounding; the node
remains the path above the crossover, with a given key weight, off the CPU, without a compiler
or BLAS (``blas()`` None) and for q, k, v of different batch shapes. Measured (fwd+bwd, d = 64,
1 thread, thread CPU time, loaded 2-core machine, × SDPA in the same run, node → whole call):
IKAN R = 16, p = 1.5 B·H = 8, N = 64 2.10× → 1.42×; IKA_S R = 8 1.79× → 1.15×; the sampled IKAN /
MIKAN module core 3.75× → 3.0×; B·H = 64, N = 64 IKAN 1.04×, IKA_S 0.84×; B·H = 8, N = 128
IKAN 1.03×.

The whole call is also a pair of ``torch.library`` ops (issue 30 item 2, :mod:`.fourier_cpu`):
``attnopt::ffw_fwd(q, k, v, points, mask, eps, coef, nsets, p, scale, need_k) -> (out, saved)`` and
``attnopt::ffw_bwd``, connected by ``register_autograd``; their bodies (``whole_forward`` /
``whole_backward`` of :mod:`._fourier_whole`) are what :class:`_WholeFourier` calls in plain eager code
(the Python ``custom_op`` path costs a fixed few tens of µs per call, a large share of this path's
~0.4 ms at N = 64: figures in the issue-30 note); the router puts the ops in traced graphs. So is
the per-pass node: ``attnopt::ff_fwd(q, k, v, points, kw, mask, eps, coef, nsets, p, scale, need_k)
-> (out, φ', cos P, sin P, m, vm, 1/den, u, c, F, W)`` (what the backward reads, each output a tensor
of its own: the views the Function saves are rebuilt from them and the inputs; one not needed is
empty) and ``attnopt::ff_bwd`` (``(dq, dk, dv, d points, d kw)``), with ``pass_forward`` /
``pass_backward`` of :mod:`._fourier_pass` as the bodies of both :class:`_FusedFourier` and the ops.

Files: this one holds the two autograd Functions (per pass, whole call) and the public entries;
:mod:`._fourier_pass` the per-pass passes and bodies (``ff_*``), :mod:`._fourier_c` the C plumbing
both paths use (argument types, row checks, the L^p magnitude pass), :mod:`._fourier_whole` the whole
call's checks, layouts and bodies, :mod:`.fourier_cpu` the ops, :mod:`._blocked` the blocked
``Nq × Nk`` passes (shared with :mod:`.chunked`).
"""
from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from attnopt import _native
from attnopt.functional._autograd import double_backward
from attnopt.functional.kernel._fourier_pass import (
    PassState,
    broadcast_batch,
    pass_backward,
    pass_forward,
    weighted_inputs,
)
from attnopt.functional.kernel._fourier_whole import _backward_body, _forward_body, _whole_call, _WholeConfig

__all__ = ["fused_fourier_attention", "fused_fourier_magnitude_attention"]


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

    Layouts: points shared by every head (``W (S·R, d)``) and ``Nq = Nk``: ``[Q; K]`` stacked on a
    new leading axis, ``P`` one ``mm`` (the gradients of ``q`` and ``k`` contiguous); points per
    example and head (``W (…, S·R, d)``, the sampled IKAN / MIKAN): ``[Q; K]`` concatenated along
    the rows of each head, ``P`` one ``bmm`` (no broadcast copy of ``W`` per ``q`` / ``k``).
    Every elementwise pass (features, key weights and ``[v ⊙ m, m]``, ``O = num/den``, ``G``,
    ``dv`` / ``dm`` / the magnitude's key gradient, ``dP``) is one C call where
    ``_native/fourier_features.c`` and ``lp_magnitude.c`` apply, the PyTorch ops otherwise.
    """

    @staticmethod
    @_native.untraced
    def forward(
        ctx: Any, q: Tensor, k: Tensor, v: Tensor, w: Tensor, kw: Tensor | None, mask: Tensor | None,
        eps: float, coef: float, nsets: int, p: float | None, scale: float,
    ) -> Tensor:
        out, st, cs = pass_forward(q, k, v, w, kw, mask, eps, coef, nsets, p, scale, ctx.needs_input_grad[1])
        ctx.cs, ctx.nx = cs, len(st.xs)
        ctx.save_for_backward(*st[:13], *st.xs, *(st.kept or ()))
        return out

    @staticmethod
    @_native.untraced
    def backward(ctx: Any, dout: Tensor) -> tuple[Tensor | None, ...]:
        if double_backward(ctx):  # the closed form uses untracked intermediates
            raise RuntimeError(
                "kernel_attention's fused Fourier-feature node has no double backward (create_graph=True)"
            )
        saved = ctx.saved_tensors
        nx = ctx.nx
        kept = saved[13 + nx :]
        st = PassState._make((*saved[:13], saved[13 : 13 + nx], (kept[0], kept[1]) if kept else None, None))
        need = ctx.needs_input_grad
        dq, dk, dv, dw, dkw = pass_backward(dout, st, ctx.cs, need[0], need[1], need[2], need[3], need[4])
        return (dq, dk, dv, dw, dkw, None, None, None, None, None, None)


class _WholeFourier(torch.autograd.Function):
    r""":class:`_FusedFourier` with the key magnitude / mask computed inside (no given key weight),
    forward and backward each one C call per thread (``ffw_*`` in ``_native/fourier_features.c``:
    the same passes per head, the products by PyTorch's BLAS from C). q ``(…, Nq, d)``, k
    ``(…, Nk, d)``, v ``(…, Nk, dv)`` of one batch shape ``lead``, points ``(…, S·R, d)``
    broadcast to it, ``mask (…, Nk)`` additive without gradient or None."""

    @staticmethod
    @_native.untraced
    def forward(
        ctx: Any, q: Tensor, k: Tensor, v: Tensor, points: Tensor, mask: Tensor | None, eps: float,
        coef: float, nsets: int, p: float | None, scale: float, cfg: _WholeConfig,
    ) -> Tensor:
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        out, save, layout = _forward_body(q, k, v, points, mask, eps, coef, nsets, p, scale,
                                          ctx.needs_input_grad[1], cfg, False)
        ctx.cfg, ctx.args = cfg, (eps, coef, nsets, p is not None)
        ctx.layout = (*layout[1:], layout[0].stride())
        ctx.save_for_backward(q, k, v, points, save, out, layout[0])
        return out if q.shape[:-2] else out.view(*out.shape[-2:])

    @staticmethod
    @_native.untraced
    def backward(ctx: Any, dout: Tensor) -> tuple[Tensor | None, ...]:
        if double_backward(ctx):  # the closed form below uses untracked intermediates
            raise RuntimeError(
                "kernel_attention's whole-call Fourier-feature node has no double backward "
                "(create_graph=True)"
            )
        need = ctx.needs_input_grad
        q, k, v, points, save, out, w = ctx.saved_tensors
        eps, coef, nsets, mag = ctx.args
        wsb, wsh, hi, strides = ctx.layout
        # the forward's points layout, unless a saved-tensor hook gave w back with other strides (a
        # materialized copy of a broadcast view): then the layout is recomputed from the points
        layout = (w, wsb, wsh, hi) if w.stride() == strides else None
        dq, dk, dv, dw = _backward_body(dout, q, k, v, points, save, out, eps, coef, nsets, mag, need[0],
                                        need[1], need[2], need[3], ctx.cfg, layout)
        return dq, dk, dv, dw, None, None, None, None, None, None, None


def fused_fourier_attention(
    q: Tensor, k: Tensor, key_weight: Tensor | None, v: Tensor, eps: float, coef: float, ws: list[Tensor]
) -> Tensor:
    """``O`` with Fourier features from spectral point sets ``ws`` (each (…, R, d), broadcast).

    ``q (…, Nq, d)``, ``k (…, Nk, d)``, ``v (…, Nk, dv)``, ``key_weight (…, 1, Nk)`` or None;
    ``coef`` is the feature normalization (``1/√R`` for one set, ``1/(2√R)`` for two).
    """
    q, k, v, w, kw = weighted_inputs(q, k, key_weight, v, ws)
    out: Tensor = _FusedFourier.apply(q, k, v, w, kw, None, float(eps), float(coef), len(ws), None, 1.0)
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
    q, k, v = broadcast_batch(q, k, v, points, key_mask)
    points = points.to(q.dtype)
    pp = None if p is None else float(p)
    if k.shape[:-2] == v.shape[:-2] == q.shape[:-2]:
        cfg = _whole_call(q, k, v, points, key_mask)
        if cfg is not None:
            whole: Tensor = _WholeFourier.apply(q, k, v, points, key_mask, float(eps), float(coef), nsets, pp,
                                                float(scale), cfg)
            return whole
    out: Tensor = _FusedFourier.apply(q, k, v, points, None, key_mask, float(eps), float(coef),
                                      nsets, pp, float(scale))
    return out
