r"""The per-pass Fourier-feature path (``ff_*`` of ``_native/fourier_features.c``): its passes (features,
key weights, ``O = num/den``, ``G``, the key gradients and ``dP``, each one C call where it applies, the
PyTorch ops otherwise) and the forward and backward bodies built from them, :func:`pass_forward` and
:func:`pass_backward`: ONE implementation of the math, called by the eager autograd Function
:class:`~.fourier._FusedFourier` and by the ops ``attnopt::ff_fwd`` / ``attnopt::ff_bwd`` of
:mod:`.fourier_cpu`. A helper of the leaves, not chosen by itself: the router picks the path.

The bodies take tensor addresses and call C: they run in plain Python frames only (the Function's
methods are :func:`attnopt._native.untraced`; an op's body is opaque to dynamo).
"""
from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch import Tensor

from attnopt._native.checks import require_size, require_view
from attnopt._validation import broadcast_shapes
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

__all__ = ["PassConsts", "PassState", "broadcast_batch", "pass_backward", "pass_consts", "pass_forward",
           "pass_layout", "phi_views", "weighted_inputs"]


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


def broadcast_batch(
    q: Tensor, k: Tensor, v: Tensor, points: Tensor, key_mask: Tensor | None
) -> tuple[Tensor, Tensor, Tensor]:
    """``q``, ``k``, ``v`` expanded to the one batch shape of the Fourier-feature node's inputs (``points
    (…, S·R, d)`` and ``key_mask (…, Nk)`` broadcast with them; no expand where a tensor has it)."""
    batch: tuple[int, ...] = q.shape[:-2]
    same = k.shape[:-2] == batch and v.shape[:-2] == batch and len(points.shape[:-2]) <= len(batch)
    if not (same and (key_mask is None or key_mask.shape[:-1] == batch)):
        shapes = [q.shape[:-2], k.shape[:-2], v.shape[:-2], points.shape[:-2]]
        if key_mask is not None:
            shapes.append(key_mask.shape[:-1])
        batch = broadcast_shapes(*shapes)
        # (an expand of a tensor already of this shape would add a backward node per input)
        q, k, v = (x if x.shape[:-2] == batch else x.expand(*batch, *x.shape[-2:]) for x in (q, k, v))
    return q, k, v


def weighted_inputs(
    q: Tensor, k: Tensor, key_weight: Tensor | None, v: Tensor, ws: list[Tensor]
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor | None]:
    """The node's ``(q, k, v, w, kw)`` for a given key weight ``(…, 1, Nk)`` (or None) and point sets
    ``ws`` (each ``(…, R, d)``): one batch shape, the sets stacked ``(…, S·R, d)`` in ``q``'s dtype,
    ``kw (…, Nk, 1)``."""
    batch = broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2], *(w.shape[:-2] for w in ws),
                             () if key_weight is None else key_weight.shape[:-2])
    q, k, v = (x if x.shape[:-2] == batch else x.expand(*batch, *x.shape[-2:]) for x in (q, k, v))
    kw = None if key_weight is None else key_weight.transpose(-2, -1).to(v.dtype).expand(*v.shape[:-1], 1)
    sets = [w.to(q.dtype) for w in ws]
    if len(sets) == 1:
        return q, k, v, sets[0], kw
    shape = broadcast_shapes(*(w.shape for w in sets))
    return q, k, v, torch.cat([w.expand(shape) for w in sets], dim=-2), kw


class PassConsts(NamedTuple):
    """The per-pass path's constants of a call: ``c4 = coef⁴``, ``Nq``, ``S``, ``R``, whether ``[Q; K]``
    are stacked on a new axis (``Nq = Nk``) and the points shared by every head, ``ε``."""

    c4: float
    nq: int
    nsets: int
    r: int
    stacked: bool
    shared: bool
    eps: float


class PassState(NamedTuple):
    """What :func:`pass_forward` leaves for the backward. ``wm``, ``xs`` are views of ``w``, ``q``,
    ``k`` (:func:`pass_layout`), ``pq``, ``pk`` of ``phi`` (:func:`phi_views`); ``kw`` the key
    weight (given or computed; None without magnitude, mask and given weight), ``u``, ``cm`` the
    magnitude's gradient factors (None unless the key gradient and a magnitude), ``kept`` ``(F, W)``
    of the one-block forward (None above ``kernel_whole_elements``); ``k``, ``v`` as the C passes
    read them (contiguous where they run)."""

    w: Tensor
    wm: Tensor
    cp: Tensor
    sp: Tensor
    pq: Tensor
    pk: Tensor
    kw: Tensor | None
    v: Tensor
    vm: Tensor
    inv: Tensor
    out: Tensor
    u: Tensor | None
    cm: Tensor | None
    xs: tuple[Tensor, ...]
    kept: tuple[Tensor, Tensor] | None
    #: the features buffer ``pq``, ``pk`` view (what the op returns in their place; the eager
    #: Function saves the views and leaves it None)
    phi: Tensor | None


def pass_consts(q: Tensor, k: Tensor, w: Tensor, eps: float, coef: float, nsets: int) -> PassConsts:
    """The :class:`PassConsts` of a call (shapes and options only)."""
    nq = q.shape[-2]
    return PassConsts(coef**4, nq, nsets, w.shape[-2] // nsets, nq == k.shape[-2],
                      all(s == 1 for s in w.shape[:-2]), eps)


def pass_layout(
    q: Tensor, k: Tensor, w: Tensor, lead: tuple[int, ...], cs: PassConsts
) -> tuple[Tensor, tuple[Tensor, ...]]:
    """``(wm, xs)``: the points as one matrix ``(S·R, d)`` (shared) or ``(G, S·R, d)``, and ``[Q; K]``
    as the products read them: ``(q, k)`` flattened (stacked) or their concatenation along the rows
    of a head (``Nq != Nk``)."""
    sr, d = w.shape[-2], w.shape[-1]
    if cs.shared:
        wm = w.reshape(sr, d)
    else:
        wm = (w if w.shape[:-2] == lead else w.expand(*lead, sr, d)).reshape(-1, sr, d)
    if not cs.stacked:
        return wm, (torch.cat([q, k], dim=-2),)
    if cs.shared:
        return wm, (q.reshape(-1, d), k.reshape(-1, d))
    return wm, (q.reshape(-1, cs.nq, d), k.reshape(-1, k.shape[-2], d))


def phi_views(phi: Tensor, cs: PassConsts) -> tuple[Tensor, Tensor]:
    """``(φ'(Q), φ'(K))`` as ``(G, N, 2R)`` views of the features buffer (laid out as ``P``)."""
    r2, nq = 2 * cs.r, cs.nq
    if cs.stacked:
        return phi[0].view(-1, nq, r2), phi[1].view(-1, nq, r2)
    rows = phi.view(-1, phi.shape[-2], r2)
    return rows[:, :nq], rows[:, nq:]


def pass_forward(
    q: Tensor, k: Tensor, v: Tensor, w: Tensor, kw: Tensor | None, mask: Tensor | None, eps: float,
    coef: float, nsets: int, p: float | None, scale: float, need_k: bool,
) -> tuple[Tensor, PassState, PassConsts]:
    """The forward of :class:`~.fourier._FusedFourier` (its docstring has the math): ``(O, state,
    constants)``. q ``(…, Nq, d)``, k ``(…, Nk, d)``, v ``(…, Nk, dv)`` of one batch shape, ``w (…,
    S·R, d)`` broadcast to it, ``kw (…, Nk, 1)`` or None (then computed from ``p``, ``scale``,
    ``mask (…, Nk)``); ``need_k``: keep the magnitude's gradient factors."""
    cs = pass_consts(q, k, w, eps, coef, nsets)
    nq, nk, sr, d = cs.nq, k.shape[-2], w.shape[-2], w.shape[-1]
    r = cs.r
    fns = _fns(q)
    if fns is not None:  # the C passes read k and v by rows (a (B, N, H, d) view's heads are not)
        k, v = k.contiguous(), v.contiguous()
    lead = v.shape[:-2]
    # Nq = Nk: P of [Q; K] stacked on a new leading axis, so that φ(Q), φ(K) and the gradients
    # of q and k are contiguous (a strided gradient is copied by AccumulateGrad), by one (b)mm
    # per side into the halves of P (no copy of [Q; K], no broadcast copy of per-example
    # points); Nq != Nk: [Q; K] concatenated along the rows of a head
    wm, xs = pass_layout(q, k, w, lead, cs)
    if cs.stacked:
        pr = q.new_empty(2, *lead, nq, sr)
        wt = wm.transpose(-2, -1)
        if cs.shared:
            torch.mm(xs[0], wt, out=pr[0].view(-1, sr))
            torch.mm(xs[1], wt, out=pr[1].view(-1, sr))
        else:
            torch.bmm(xs[0], wt, out=pr[0].view(-1, nq, sr))
            torch.bmm(xs[1], wt, out=pr[1].view(-1, nk, sr))
    else:
        x = xs[0]
        if cs.shared:
            pr = torch.mm(x.view(-1, d), wm.t()).view(*x.shape[:-1], sr)  # (…, Nq+Nk, S·R)
        else:
            pr = torch.bmm(x.view(-1, nq + nk, d), wm.transpose(-2, -1)).view(*lead, nq + nk, sr)
    u = cm = None
    # without a mask every key weight is > 0 with max 1 (or absent): den >= ε > 0 (the callers
    # give ε > 0), no guard
    guard = kw is not None or mask is not None or not eps > 0
    if kw is None:  # features and key weights (one C call)
        phi, cp, sp, vm, kw, u, cm = _prepare(fns, pr, nsets, r, k, v, mask, p, scale, need_k)
    else:
        phi, cp, sp = _features(fns, pr, nsets, r)
        vm = torch.cat([v * kw, kw], dim=-1)
    # (G, N, ·) views, as the blocked passes take them (and the backward again)
    pq, pk = phi_views(phi, cs)
    vm = vm.view(-1, nk, vm.shape[-1])
    # W = c⁴F'² + ε (F' = φ'(Q)φ'(K)ᵀ) and W vm, by blocks of heads that stay in the cache
    num, kept = blocked_forward(pq, pk, vm, cs.c4, eps)
    out, inv = _finish(fns, num.view(*lead, nq, vm.shape[-1]), guard)
    return out, PassState(w, wm, cp, sp, pq, pk, kw, v, vm, inv, out, u, cm, xs, kept, phi), cs


def pass_backward(
    dout: Tensor, st: PassState, cs: PassConsts, need_q: bool, need_k: bool, need_v: bool, need_w: bool,
    need_kw: bool,
) -> tuple[Tensor | None, Tensor | None, Tensor | None, Tensor | None, Tensor | None]:
    """``(dq, dk, dv, dw, dkw)`` of :func:`pass_forward` (None where not asked for): the closed form
    of :class:`~.fourier._FusedFourier`'s docstring."""
    # With A_ij = W_ij m_j, g = dO/den, δ_i = <g_i, O_i>, dA_ij = <g_i, v_j> − δ_i:
    # dW_ij = <[g_i, −δ_i], [m_j v_j, m_j]> (one matmul), T = Wᵀ[g, −δ] gives
    # dv_j = m_j T_j[:dv] and dm_j = <v_j, T_j[:dv]> + T_j[dv]: one pass over Nq×Nk (dW ⊙ f).
    w, wm, cp, sp, pq, pk, kw, v, vm, inv, out, u, cm, xs, kept, _ = st
    need_mag = need_k and u is not None
    fns = _fns(out)
    gn = _out_grad(fns, dout, inv, out)
    need_t, need_f = need_v or need_kw or need_mag, need_q or need_k or need_w
    lead, nq, g = out.shape[:-2], cs.nq, pq.shape[0]
    # dφ'(Q), dφ'(K) straight into one buffer laid out as P (φ), for the dP pass
    dphi = cp.new_empty(*cp.shape[:-1], 2 * cs.r) if need_f else None
    outs = None if dphi is None else phi_views(dphi, cs)  # views (G, N, 2R) of the buffer, never copies
    t, _, _ = blocked_backward(pq, pk, vm, gn.view(g, nq, -1), cs.c4, cs.eps, kept, need_t, need_f, need_f,
                               outs)
    tt = None if t is None else t.view(*lead, *t.shape[-2:])
    dv, dkw, dkm, dp = _tail(fns, tt, v, kw, cm, u, need_v, need_kw, need_mag, dphi, cp, sp, cs.nsets, cs.r)
    dq = dk = dw = None
    if need_f:
        assert dp is not None
        sr, d = dp.shape[-1], wm.shape[-1]
        if cs.stacked:  # one (b)mm per side: dk = dk_mag + dP_K W in place
            shape = (*lead, nq, d)
            if cs.shared:
                dpq, dpk = dp[0].view(-1, sr), dp[1].view(-1, sr)
            else:
                dpq, dpk = dp[0].view(g, nq, sr), dp[1].view(g, nq, sr)
            mul, acc = (torch.mm, "addmm_") if cs.shared else (torch.bmm, "baddbmm_")
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
                if cs.shared:
                    dw = torch.mm(dpq.t(), xs[0]).addmm_(dpk.t(), xs[1]).view(w.shape)
                else:
                    dw = torch.bmm(dpq.transpose(-2, -1), xs[0]).baddbmm_(dpk.transpose(-2, -1), xs[1])
                    dw = dw.view(*lead, sr, d).sum_to_size(w.shape)
        else:
            x = xs[0]
            if need_q or need_k:
                if cs.shared:
                    dx = torch.mm(dp.view(-1, sr), wm).view(x.shape)
                else:
                    dx = torch.bmm(dp.view(-1, *dp.shape[-2:]), wm).view(x.shape)
                dq, dk = dx[..., :nq, :], dx[..., nq:, :]
                if dkm is not None:  # in place: dx is this node's own buffer
                    dk = dk.add_(dkm)
            if need_w:
                if cs.shared:
                    dw = torch.mm(dp.view(-1, sr).t(), x.view(-1, d)).view(w.shape)
                else:
                    dpt = dp.view(-1, *dp.shape[-2:]).transpose(-2, -1)
                    dw = torch.bmm(dpt, x.view(-1, *x.shape[-2:]))
                    dw = dw.view(*lead, sr, d).sum_to_size(w.shape)
    elif dkm is not None:
        dk = dkm
    return dq, dk, dv, dw, dkw
