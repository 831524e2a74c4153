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
~0.4 ms at N = 64: figures in the issue-30 note); the router puts the ops in traced graphs. The
per-pass entries of :class:`_FusedFourier` (``ff_*``) are not ops yet.

Files: this one holds the two autograd Functions (per pass, whole call) and their per-pass plans;
:mod:`._fourier_c` the C plumbing both use (argument types, row checks, the L^p magnitude pass),
:mod:`._fourier_whole` the whole call's checks, layouts and bodies, :mod:`.fourier_cpu` the ops,
:mod:`._blocked` the blocked ``Nq × Nk`` passes (shared with :mod:`.chunked`).
"""
from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from attnopt import _native
from attnopt._native.checks import require_size, require_view
from attnopt._validation import broadcast_shapes
from attnopt.functional._autograd import double_backward
from attnopt.functional.kernel._blocked import blocked_backward, blocked_forward
from attnopt.functional.kernel._fourier_c import (
    _LP_MODES,
    _base,
    _check_rows,
    _dense,
    _Fns,
    _fns,
    _KeyWeights,
    _magnitude,
    _off,
    _Plan,
    _run,
    _run2,
    _Three,
)
from attnopt.functional.kernel._fourier_whole import _backward_body, _forward_body, _whole_call, _WholeConfig

__all__ = ["fused_fourier_attention", "fused_fourier_magnitude_attention"]


def _sum_sets(x: Tensor, nsets: int, r: int) -> Tensor:
    """``Σ_s x[..., sR:(s+1)R]`` (contiguous views added: a strided reduction is ~6× slower)."""
    if nsets == 1:
        return x
    out = x[..., :r] + x[..., r : 2 * r]
    for i in range(2, nsets):
        out.add_(x[..., i * r : (i + 1) * r])
    return out


def _features_plan(fns: dict[str, Any], pr: Tensor, nsets: int, r: int) -> tuple[_Three, _Plan]:
    phi = pr.new_empty(*pr.shape[:-1], 2 * r)
    cp, sp = torch.empty_like(pr), torch.empty_like(pr)
    sr = pr.shape[-1]

    rows = pr.numel() // max(sr, 1)
    require_size("ff_features", "S·R", sr, at_least=nsets * r, at_most=nsets * r)
    _check_rows("ff_features", rows, (("P", pr, sr), ("phi", phi, 2 * r), ("cos", cp, sr), ("sin", sp, sr)))
    es, a, f, c, s = pr.element_size(), pr.data_ptr(), phi.data_ptr(), cp.data_ptr(), sp.data_ptr()

    def args(r0: int, r1: int, _keep: Any = (pr, phi, cp, sp)) -> tuple[Any, ...]:
        o = r0 * sr * es
        return a + o, r1 - r0, r, nsets, f + r0 * 2 * r * es, c + o, s + o

    return (phi, cp, sp), (fns["ff_features"], args, pr.numel() // max(sr, 1), sr)


def _features(fns: _Fns, pr: Tensor, nsets: int, r: int) -> _Three:
    """``(φ', cos P, sin P)``: ``φ' = [Σ_s cos P_s, Σ_s sin P_s]`` (…, 2R) for ``P`` (…, S·R);
    one C pass (sin and cos together, the set sums while the row is in L1) or four ops."""
    fns = _dense(fns, pr)
    if fns is None:
        cp, sp = pr.cos(), pr.sin()
        return torch.cat([_sum_sets(cp, nsets, r), _sum_sets(sp, nsets, r)], dim=-1), cp, sp
    outs, plan = _features_plan(fns, pr, nsets, r)
    _run(plan)
    return outs


def _key_weights_plan(
    fns: dict[str, Any], k: Tensor, v: Tensor, mask: Tensor | None, p: float | None, scale: float, grad: bool
) -> tuple[_KeyWeights, _Plan]:
    nk, d, dv = k.shape[-2], k.shape[-1], v.shape[-1]
    heads = v.numel() // max(nk * dv, 1)
    mk = None if mask is None else mask.expand(*v.shape[:-2], nk).contiguous()
    vm = v.new_empty(*v.shape[:-1], dv + 1)
    kw = v.new_empty(*v.shape[:-1], 1)
    need = grad and p is not None
    u = torch.empty_like(k) if need else None
    cm = k.new_empty(k.shape[:-1]) if need else None
    mode = -1 if p is None else _LP_MODES.get(p, 0)
    cap, pp = torch.finfo(k.dtype).max / 8, 1.0 if p is None else p

    rows = heads * nk
    _check_rows("ff_key_weights", rows, (("k", k, d), ("v", v, dv), ("mask", mk, 1), ("vm", vm, dv + 1),
                                         ("kw", kw, 1), ("u", u, d), ("c", cm, 1)))
    es, a_k, a_v, a_m = k.element_size(), k.data_ptr(), v.data_ptr(), _base(mk)
    a_vm, a_kw, a_u, a_c = vm.data_ptr(), kw.data_ptr(), _base(u), _base(cm)

    def args(h0: int, h1: int, _keep: Any = (k, v, mk, vm, kw, u, cm)) -> tuple[Any, ...]:
        n0 = h0 * nk * es
        return (a_k + n0 * d, a_v + n0 * dv, _off(a_m, n0), h1 - h0, nk, d, dv, mode, pp, scale, cap,
                a_vm + n0 * (dv + 1), a_kw + n0, _off(a_u, n0 * d), _off(a_c, n0))

    m = kw if p is not None or mask is not None else None
    return (vm, m, u, cm), (fns["ff_key_weights"], args, heads, nk * (d + dv))


def _key_weights_torch(
    k: Tensor, v: Tensor, mask: Tensor | None, p: float | None, scale: float, grad: bool
) -> _KeyWeights:
    kw = u = cm = None
    a = None
    if p is not None:
        a, u, cm = _magnitude(k, p, scale, grad)
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
    return vm, kw, u, cm


def _prepare(
    fns: _Fns, pr: Tensor, nsets: int, r: int, k: Tensor, v: Tensor, mask: Tensor | None, p: float | None,
    scale: float, grad: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor | None, Tensor | None, Tensor | None]:
    """:func:`_features` of ``P`` and the key weights (one C call where both apply):
    ``(φ', cos P, sin P, vm, m, u, c)`` with ``vm = [v ⊙ m, m]`` (…, Nk, dv + 1),
    ``m_j = exp(a_j − max a)``, ``a_j = s‖k_j‖_p²/2 + mask_j`` (``m`` (…, Nk, 1), None without
    magnitude and mask) and the magnitude's gradient factors ``u``, ``c`` (:func:`_magnitude`)
    with ``grad``. In C: magnitude, mask, max, exp and ``vm`` in one pass per head; else about
    ten ops."""
    kfns = _dense(fns, k, v) if mask is None or mask.dtype == k.dtype else None
    ffns = _dense(fns, pr)
    if ffns is not None and kfns is not None:
        f_outs, f_plan = _features_plan(ffns, pr, nsets, r)
        k_outs, k_plan = _key_weights_plan(kfns, k, v, mask, p, scale, grad)
        _run2(ffns["ff_prepare"], f_plan, k_plan)
        return (*f_outs, *k_outs)
    if kfns is not None:
        k_outs, k_plan = _key_weights_plan(kfns, k, v, mask, p, scale, grad)
        _run(k_plan)
    else:
        k_outs = _key_weights_torch(k, v, mask, p, scale, grad)
    return (*_features(ffns, pr, nsets, r), *k_outs)


def _finish(fns: _Fns, num: Tensor, guard: bool) -> tuple[Tensor, Tensor]:
    """``(O, 1/den)`` from ``num = [Σ W m v, Σ W m]`` (…, Nq, dv + 1); with ``guard`` rows whose
    denominator is 0 give zeros (the C pass always guards: without ``guard`` den >= ε > 0)."""
    fns = _dense(fns, num)
    if fns is None:
        den = num[..., -1:]
        inv = den.reciprocal()
        if guard:
            inv = torch.where(den > 0, inv, 0.0)
        return num[..., :-1] * inv, inv
    e = num.shape[-1]
    out = num.new_empty(*num.shape[:-1], e - 1)
    inv = num.new_empty(*num.shape[:-1], 1)

    _check_rows("ff_finish", num.numel() // e, (("num", num, e), ("out", out, e - 1), ("inv", inv, 1)))
    es, a, o, i = num.element_size(), num.data_ptr(), out.data_ptr(), inv.data_ptr()

    def args(r0: int, r1: int, _keep: Any = (num, out, inv)) -> tuple[Any, ...]:
        return a + r0 * e * es, r1 - r0, e, o + r0 * (e - 1) * es, i + r0 * es

    _run((fns["ff_finish"], args, num.numel() // e, e))
    return out, inv


def _out_grad(fns: _Fns, dout: Tensor, inv: Tensor, out: Tensor) -> Tensor:
    """``G = [g, −<g, O>]`` with ``g = dO / den`` (…, Nq, dv + 1)."""
    dv = out.shape[-1]
    fns = _dense(fns, out, inv) if dout.dtype == out.dtype and dout.device == out.device else None
    if fns is None:
        g = dout * inv
        return torch.cat([g, (g * out).sum(-1, keepdim=True).neg_()], dim=-1)
    d2 = dout.reshape(-1, dv)  # (the gradient of a sum is an expanded scalar: strides 0, no copy)
    gn = out.new_empty(*out.shape[:-1], dv + 1)
    rs, cs = d2.stride()
    require_view("ff_gn", "dout", d2, dtype=out.dtype, sizes=tuple(d2.shape), strides=(rs, cs))
    _check_rows("ff_gn", d2.shape[0], (("inv", inv, 1), ("out", out, dv), ("gn", gn, dv + 1)))
    es, a, i, o, a_g = out.element_size(), d2.data_ptr(), inv.data_ptr(), out.data_ptr(), gn.data_ptr()

    def args(r0: int, r1: int, _keep: Any = (d2, inv, out, gn)) -> tuple[Any, ...]:
        return a + r0 * rs * es, rs, cs, i + r0 * es, o + r0 * dv * es, r1 - r0, dv, a_g + r0 * (dv + 1) * es

    _run((fns["ff_gn"], args, d2.shape[0], dv))
    return gn


def _tail(
    fns: _Fns, t: Tensor | None, v: Tensor, kw: Tensor | None, cm: Tensor | None, u: Tensor | None,
    need_v: bool, need_kw: bool, need_mag: bool, dphi: Tensor | None, cp: Tensor, sp: Tensor, nsets: int,
    r: int,
) -> tuple[Tensor | None, ...]:
    """``(dv, dm, dk_mag, dP)``: from ``T = Wᵀ G`` (…, Nk, dv + 1) (None: not needed)
    ``dv = m ⊙ T_{:dv}``, ``dm = <v, T_{:dv}> + T_{dv}`` and the magnitude's share of the key
    gradient ``dk = u ⊙ (dm·m·c)`` (``m = exp(a − const)``: ``da = dm·m``); from ``dφ'`` (None:
    not needed) ``dP_s = cos P_s ⊙ dφ'_sin − sin P_s ⊙ dφ'_cos`` (every set gets the same ``dφ'``).
    One C call where both apply."""
    kfns = None if t is None else _dense(fns, t, v, kw, cm, u)
    ffns = None if dphi is None else _dense(fns, dphi, cp, sp)
    dv = dm = dk = dp = None
    k_plan = f_plan = None
    if t is not None:
        dvn = v.shape[-1]
        if kfns is None:
            tv = t[..., :-1]
            if need_v:
                dv = tv if kw is None else tv * kw
            if need_kw or need_mag:
                dm = (tv * v).sum(-1, keepdim=True).add_(t[..., -1:])
                if need_mag:
                    assert kw is not None and cm is not None and u is not None
                    dk = u * (dm * kw).mul_(cm.unsqueeze(-1))
                if not need_kw:
                    dm = None
        else:
            rows = v.numel() // max(dvn, 1)
            d = 0 if u is None else u.shape[-1]
            dv = torch.empty_like(v) if need_v else None
            dm = v.new_empty(*v.shape[:-1], 1) if need_kw else None
            dk = torch.empty_like(u) if need_mag and u is not None else None
            es = v.element_size()
            _check_rows("ff_key_grads", rows, (("t", t, dvn + 1), ("v", v, dvn), ("kw", kw, 1), ("c", cm, 1),
                                               ("u", u, d), ("dv", dv, dvn), ("dm", dm, 1), ("dk", dk, d)))
            a_t, a_v, a_kw, a_c, a_u = t.data_ptr(), v.data_ptr(), _base(kw), _base(cm), _base(u)
            a_dv, a_dm, a_dk = _base(dv), _base(dm), _base(dk)

            def k_args(r0: int, r1: int, _keep: Any = (t, v, kw, cm, u, dv, dm, dk)) -> tuple[Any, ...]:
                o = r0 * es
                return (a_t + o * (dvn + 1), a_v + o * dvn, _off(a_kw, o), _off(a_c, o), _off(a_u, o * d),
                        r1 - r0, dvn, d, _off(a_dv, o * dvn), _off(a_dm, o), _off(a_dk, o * d))

            k_plan = (kfns["ff_key_grads"], k_args, rows, dvn + d)
    if dphi is not None:
        if ffns is None:
            dc, ds = dphi[..., :r], dphi[..., r:]
            if nsets > 1:  # tiled by cat: ~4x faster than repeat or a broadcast over a set axis
                dc, ds = torch.cat([dc] * nsets, dim=-1), torch.cat([ds] * nsets, dim=-1)
            dp = torch.addcmul(cp * ds, sp, dc, value=-1.0)
        else:
            dp = torch.empty_like(cp)
            sr, es2 = cp.shape[-1], cp.element_size()
            require_size("ff_dp", "S·R", sr, at_least=nsets * r, at_most=nsets * r)
            _check_rows("ff_dp", cp.numel() // max(sr, 1), (("dphi", dphi, 2 * r), ("cos", cp, sr), ("sin",
                                                                                                     sp, sr),
                                                            ("dp", dp, sr)))
            g, c, s, o2 = dphi.data_ptr(), cp.data_ptr(), sp.data_ptr(), dp.data_ptr()

            def f_args(r0: int, r1: int, _keep: Any = (dphi, cp, sp, dp)) -> tuple[Any, ...]:
                x = r0 * sr * es2
                return g + r0 * 2 * r * es2, c + x, s + x, r1 - r0, r, nsets, o2 + x

            f_plan = (ffns["ff_dp"], f_args, cp.numel() // max(sr, 1), sr)
    if k_plan is not None and f_plan is not None:
        assert kfns is not None
        _run2(kfns["ff_tail"], k_plan, f_plan)
    elif k_plan is not None:
        _run(k_plan)
    elif f_plan is not None:
        _run(f_plan)
    return dv, dm, dk, dp


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
        nq, nk, sr, d = q.shape[-2], k.shape[-2], w.shape[-2], w.shape[-1]
        r = sr // nsets
        c4 = coef**4
        fns = _fns(q)
        if fns is not None:  # the C passes read k and v by rows (a (B, N, H, d) view's heads are not)
            k, v = k.contiguous(), v.contiguous()
        lead = v.shape[:-2]
        shared = all(s == 1 for s in w.shape[:-2])
        # Nq = Nk: P of [Q; K] stacked on a new leading axis, so that φ(Q), φ(K) and the gradients
        # of q and k are contiguous (a strided gradient is copied by AccumulateGrad), by one (b)mm
        # per side into the halves of P (no copy of [Q; K], no broadcast copy of per-example
        # points); Nq != Nk: [Q; K] concatenated along the rows of a head
        stacked = nq == nk
        if shared:
            wm = w.reshape(sr, d)
        else:
            wm = (w if w.shape[:-2] == lead else w.expand(*lead, sr, d)).reshape(-1, sr, d)
        xs: tuple[Tensor, ...]
        if stacked:
            pr = q.new_empty(2, *lead, nq, sr)
            wt = wm.transpose(-2, -1)
            if shared:
                xs = (q.reshape(-1, d), k.reshape(-1, d))
                torch.mm(xs[0], wt, out=pr[0].view(-1, sr))
                torch.mm(xs[1], wt, out=pr[1].view(-1, sr))
            else:
                xs = (q.reshape(-1, nq, d), k.reshape(-1, nk, d))
                torch.bmm(xs[0], wt, out=pr[0].view(-1, nq, sr))
                torch.bmm(xs[1], wt, out=pr[1].view(-1, nk, sr))
        else:
            x = torch.cat([q, k], dim=-2)
            xs = (x,)
            if shared:
                pr = torch.mm(x.view(-1, d), wm.t()).view(*x.shape[:-1], sr)  # (…, Nq+Nk, S·R)
            else:
                pr = torch.bmm(x.view(-1, nq + nk, d), wm.transpose(-2, -1)).view(*lead, nq + nk, sr)
        u = cm = None
        # without a mask every key weight is > 0 with max 1 (or absent): den >= ε > 0 (the callers
        # give ε > 0), no guard
        guard = kw is not None or mask is not None or not eps > 0
        if kw is None:  # features and key weights (one C call)
            grad_k = ctx.needs_input_grad[1]
            phi, cp, sp, vm, kw, u, cm = _prepare(fns, pr, nsets, r, k, v, mask, p, scale, grad_k)
        else:
            phi, cp, sp = _features(fns, pr, nsets, r)
            vm = torch.cat([v * kw, kw], dim=-1)
        # (G, N, ·) views, as the blocked passes take them (and the backward again)
        r2, e = 2 * r, vm.shape[-1]
        if stacked:
            pq, pk = phi[0].view(-1, nq, r2), phi[1].view(-1, nk, r2)
        else:
            rows = phi.view(-1, nq + nk, r2)
            pq, pk = rows[:, :nq], rows[:, nq:]
        vm = vm.view(-1, nk, e)
        # W = c⁴F'² + ε (F' = φ'(Q)φ'(K)ᵀ) and W vm, by blocks of heads that stay in the cache
        num, kept = blocked_forward(pq, pk, vm, c4, eps)
        out, inv = _finish(fns, num.view(*lead, nq, e), guard)
        ctx.c4, ctx.nq, ctx.nsets, ctx.r, ctx.stacked, ctx.shared = c4, nq, nsets, r, stacked, shared
        ctx.eps = eps
        ctx.nx = len(xs)
        ctx.save_for_backward(w, wm, cp, sp, pq, pk, kw, v, vm, inv, out, u, cm, *xs, *(kept or ()))
        return out

    @staticmethod
    @_native.untraced
    def backward(ctx: Any, dout: Tensor) -> tuple[Tensor | None, ...]:
        if double_backward(ctx):  # the closed form below uses untracked intermediates
            raise RuntimeError(
                "kernel_attention's fused Fourier-feature node has no double backward (create_graph=True)"
            )
        # With A_ij = W_ij m_j, g = dO/den, δ_i = <g_i, O_i>, dA_ij = <g_i, v_j> − δ_i:
        # dW_ij = <[g_i, −δ_i], [m_j v_j, m_j]> (one matmul), T = Wᵀ[g, −δ] gives
        # dv_j = m_j T_j[:dv] and dm_j = <v_j, T_j[:dv]> + T_j[dv]: one pass over Nq×Nk (dW ⊙ f).
        w, wm, cp, sp, pq, pk, kw, v, vm, inv, out, u, cm, *rest = ctx.saved_tensors
        xs, kept = rest[: ctx.nx], rest[ctx.nx :]
        need_q, need_k, need_v, need_w, need_kw = (ctx.needs_input_grad[i] for i in range(5))
        need_mag = need_k and u is not None
        fns = _fns(out)
        gn = _out_grad(fns, dout, inv, out)
        need_t, need_f = need_v or need_kw or need_mag, need_q or need_k or need_w
        lead, nq, g = out.shape[:-2], ctx.nq, pq.shape[0]
        # dφ'(Q), dφ'(K) straight into one buffer laid out as P (φ), for the dP pass
        dphi = cp.new_empty(*cp.shape[:-1], 2 * ctx.r) if need_f else None
        outs = None
        if dphi is not None:  # views (G, N, 2R) of the buffer, never copies
            r2 = 2 * ctx.r
            if ctx.stacked:
                outs = (dphi[0].view(g, nq, r2), dphi[1].view(g, nq, r2))
            else:
                rows = dphi.view(g, -1, r2)
                outs = (rows[:, :nq], rows[:, nq:])
        t, _, _ = blocked_backward(pq, pk, vm, gn.view(g, nq, -1), ctx.c4, ctx.eps,
                                   (kept[0], kept[1]) if kept else None, need_t, need_f, need_f, outs)
        tt = None if t is None else t.view(*lead, *t.shape[-2:])
        dv, dkw, dkm, dp = _tail(fns, tt, v, kw, cm, u, need_v, need_kw, need_mag, dphi, cp, sp, ctx.nsets,
                                 ctx.r)
        dq = dk = dw = None
        if need_f:
            assert dp is not None
            sr, d = dp.shape[-1], wm.shape[-1]
            if ctx.stacked:  # one (b)mm per side: dk = dk_mag + dP_K W in place
                shape = (*lead, nq, d)
                if ctx.shared:
                    dpq, dpk = dp[0].view(-1, sr), dp[1].view(-1, sr)
                else:
                    dpq, dpk = dp[0].view(g, nq, sr), dp[1].view(g, nq, sr)
                mul, acc = (torch.mm, "addmm_") if ctx.shared else (torch.bmm, "baddbmm_")
                if need_q:
                    dq = mul(dpq, wm).view(shape)
                if need_k:
                    if dkm is not None and dkm.is_contiguous():
                        dk = getattr(dkm.view(dpk.shape[:-1] + (d,)), acc)(dpk, wm).view(shape)
                    else:
                        dk = mul(dpk, wm).view(shape)
                        if dkm is not None:
                            dk = dk.add_(dkm)
                if need_w:
                    if ctx.shared:
                        dw = torch.mm(dpq.t(), xs[0]).addmm_(dpk.t(), xs[1]).view(w.shape)
                    else:
                        dw = torch.bmm(dpq.transpose(-2, -1), xs[0]).baddbmm_(dpk.transpose(-2, -1), xs[1])
                        dw = dw.view(*lead, sr, d).sum_to_size(w.shape)
            else:
                x = xs[0]
                if need_q or need_k:
                    if ctx.shared:
                        dx = torch.mm(dp.view(-1, sr), wm).view(x.shape)
                    else:
                        dx = torch.bmm(dp.view(-1, *dp.shape[-2:]), wm).view(x.shape)
                    dq, dk = dx[..., :nq, :], dx[..., nq:, :]
                    if dkm is not None:  # in place: dx is this node's own buffer
                        dk = dk.add_(dkm)
                if need_w:
                    if ctx.shared:
                        dw = torch.mm(dp.view(-1, sr).t(), x.view(-1, d)).view(w.shape)
                    else:
                        dpt = dp.view(-1, *dp.shape[-2:]).transpose(-2, -1)
                        dw = torch.bmm(dpt, x.view(-1, *x.shape[-2:]))
                        dw = dw.view(*lead, sr, d).sum_to_size(w.shape)
        elif dkm is not None:
            dk = dkm
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
    batch = broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2], *(w.shape[:-2] for w in ws),
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
    same = k.shape[:-2] == batch and v.shape[:-2] == batch and len(points.shape[:-2]) <= len(batch)
    if not (same and (key_mask is None or key_mask.shape[:-1] == batch)):
        shapes = [q.shape[:-2], k.shape[:-2], v.shape[:-2], points.shape[:-2]]
        if key_mask is not None:
            shapes.append(key_mask.shape[:-1])
        batch = broadcast_shapes(*shapes)
        # (an expand of a tensor already of this shape would add a backward node per input)
        q, k, v = (x if x.shape[:-2] == batch else x.expand(*batch, *x.shape[-2:]) for x in (q, k, v))
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
