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

The whole call is also a pair of ``torch.library`` ops (issue 30 item 2): ``attnopt::ffw_fwd(q, k, v,
points, mask, eps, coef, nsets, p, scale, need_k) -> (out, saved)`` (:func:`whole_forward`) and
``attnopt::ffw_bwd`` (:func:`whole_backward`), connected by ``register_autograd``; its fake
implementation writes out ``ffw_save_size``. Plain eager code (:func:`fused_fourier_magnitude_attention`)
calls the same functions through :class:`_WholeFourier`: the Python ``custom_op`` path costs a
fixed few tens of µs per call, a large share of this path's ~0.4 ms at N = 64 (figures in the
issue-30 note). The per-pass entries of :class:`_FusedFourier` (``ff_*``) are not ops yet.
"""
from __future__ import annotations

import ctypes
import math
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from attnopt import _native
from attnopt._native.checks import fail, require, require_dense, require_size, require_view
from attnopt._validation import broadcast_shapes
from attnopt.functional._autograd import double_backward
from attnopt.functional._thresholds import THRESHOLDS
from attnopt.functional.kernel.chunked import blocked_backward, blocked_forward

__all__ = ["fused_fourier_attention", "fused_fourier_magnitude_attention"]


_LP_MODES = {1.0: 1, 1.5: 2, 2.0: 3}
_F64P = ctypes.c_double
_I64 = ctypes.c_int64


@_native.untraced
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
    _check_rows("lp_magnitude", rows, (("k", k, d), ("a", a, 1), ("u", u, d), ("c", c, 1)))
    size = k.element_size()
    mode = ctypes.c_int(_LP_MODES.get(p, 0))

    def at(t: Tensor | None, offset: int) -> ctypes.c_void_p | None:
        return None if t is None else ctypes.c_void_p(t.data_ptr() + offset * size)

    def call(r0: int, r1: int) -> None:  # rows [r0, r1)
        fn(at(k, r0 * d), ctypes.c_int64(r1 - r0), ctypes.c_int64(d), mode, _F64P(p), _F64P(scale),
           _F64P(cap), at(a, r0), at(u, r0 * d), at(c, r0))

    _native.parallel_rows(call, rows, d)
    return a, u, c


@torch.library.custom_op("attnopt::lp_magnitude", mutates_args=(), device_types="cpu")
def lp_magnitude(k: Tensor, p: float, scale: float, grad: bool) -> tuple[Tensor, Tensor, Tensor]:
    """``(a, u, c)`` of :func:`_magnitude` by ``lp_magnitude_*`` as one op (issue 30 item 2; ``u``,
    ``c`` empty unless ``grad``): the gradient *factors*, no autograd of its own (its consumers apply
    the chain rule). Eager code calls :func:`_magnitude_native` directly."""
    k = k.contiguous()
    out = _magnitude_native(k, p, scale, grad, torch.finfo(k.dtype).max / 8) if k.numel() else None
    if out is None:
        out = _magnitude(k, p, scale, grad)
    a, u, c = out
    return a, k.new_empty(0) if u is None else u.clone() if u is k else u, k.new_empty(0) if c is None else c


@lp_magnitude.register_fake
def _(k: Tensor, p: float, scale: float, grad: bool) -> tuple[Tensor, Tensor, Tensor]:  # noqa: ARG001
    return (k.new_empty(k.shape[:-1]), k.new_empty(k.shape if grad else (0,)),
            k.new_empty(k.shape[:-1] if grad else (0,)))


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


_VP = ctypes.c_void_p
_FEATURES = (_VP, _I64, _I64, _I64, _VP, _VP, _VP)
_KEY_WEIGHTS = (_VP, _VP, _VP, _I64, _I64, _I64, _I64, ctypes.c_int, _F64P, _F64P, _F64P, _VP, _VP, _VP, _VP)
_KEY_GRADS = (_VP, _VP, _VP, _VP, _VP, _I64, _I64, _I64, _VP, _VP, _VP)
_DP = (_VP, _VP, _VP, _I64, _I64, _I64, _VP)
_SIGS: dict[str, tuple[Any, ...]] = {
    "ff_features": _FEATURES,
    "ff_key_weights": _KEY_WEIGHTS,
    "ff_prepare": _FEATURES + _KEY_WEIGHTS,
    "ff_finish": (_VP, _I64, _I64, _VP, _VP),
    "ff_gn": (_VP, _I64, _I64, _VP, _VP, _I64, _I64, _VP),
    "ff_key_grads": _KEY_GRADS,
    "ff_dp": _DP,
    "ff_tail": _KEY_GRADS + _DP,
}
#: the C functions of a build per (build, float32?), argument types set once: Python ints and
#: None are passed without building ctypes objects (a call's overhead ~2 µs instead of ~8)
_FNS: dict[tuple[int, bool], dict[str, Any]] = {}
_Fns = dict[str, Any] | None
#: ``(C function, args(r0, r1) for rows [r0, r1), rows, entries a row)``: one C pass, ready to run
_Plan = tuple[Any, Callable[[int, int], tuple[Any, ...]], int, int]
_Three = tuple[Tensor, Tensor, Tensor]
#: ``(vm, m, u, c)`` of the key weights
_KeyWeights = tuple[Tensor, Tensor | None, Tensor | None, Tensor | None]


def _fns(x: Tensor) -> _Fns:
    """The native functions for ``x``'s dtype (float32/float64 CPU tensors with storage), or None
    where they do not apply (then the PyTorch ops run). Looked up once per forward / backward."""
    if x.device.type != "cpu" or x.dtype not in (torch.float32, torch.float64) or not _native.has_storage(x):
        return None
    ff = _native.library("fourier_features")
    if ff is None:
        return None
    f32 = x.dtype == torch.float32
    key = (id(ff), f32)
    fns = _FNS.get(key)
    if fns is None:
        fns = {}
        for name, sig in _SIGS.items():
            fn = getattr(ff, name + ("_f32" if f32 else "_f64"))
            fn.argtypes, fn.restype = sig, None
            fns[name] = fn
        _FNS[key] = fns
    return fns


def _dense(fns: _Fns, *ts: Tensor | None) -> _Fns:
    """``fns`` if every tensor of ``ts`` (``None`` skipped) is contiguous, else None."""
    if fns is None or not all(t is None or t.is_contiguous() for t in ts):
        return None
    return fns


def _check_rows(kernel: str, rows: int, args: tuple[tuple[str, Tensor | None, int], ...]) -> None:
    """What a per-pass kernel (``ff_*``, ``lp_magnitude``) reads and writes: for each ``(name, tensor,
    per_row)`` (``None`` skipped: NULL) ``rows × per_row`` dense entries of one dtype, the first tensor's.
    A thread's ``[r0, r1)`` is an address offset by ``r0 × per_row`` entries and ``r1 − r0`` rows, so
    the whole-range check covers every split."""
    dtype = args[0][1].dtype if args[0][1] is not None else None
    for name, t, per_row in args:
        if t is not None:
            require(kernel, name, t, dtype=t.dtype if dtype is None else dtype, numel=rows * per_row)


def _run(plan: _Plan) -> None:
    fn, args, rows, row_len = plan
    _native.parallel_rows(lambda r0, r1: fn(*args(r0, r1)), rows, row_len)


def _run2(fn: Any, a: _Plan, b: _Plan) -> None:
    """Two passes by one C call ``fn`` (their arguments one after the other): one call's overhead
    at small sizes; with threads, each thread takes the same fraction of both passes' rows."""
    na, nb = a[2], b[2]
    v = max(na, nb, 1)

    def call(v0: int, v1: int) -> None:
        fn(*a[1](v0 * na // v, v1 * na // v), *b[1](v0 * nb // v, v1 * nb // v))

    _native.parallel_rows(call, v, (na * a[3] + nb * b[3]) // v)


def _base(t: Tensor | None) -> int | None:
    """``t``'s address (None for None). The closures that offset it hold ``t`` itself too (a
    default argument): a buffer only referenced by address would be freed before the C call."""
    return None if t is None else t.data_ptr()


def _off(base: int | None, offset: int) -> int | None:
    return None if base is None else base + offset


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


# --- whole-call path for small sizes: the forward in one C call, the backward in one -------------

_FWD_SIG = ([_VP] * 6 + [_I64] * 3 + [_VP] + [_I64] * 8 + [ctypes.c_int] + [_F64P] * 5 + [ctypes.c_int]
            + [_VP] * 3)
_BWD_SIG = ([_VP] * 6 + [_I64] * 3 + [_VP] + [_I64] * 3 + [_VP] + [_I64] * 8 + [ctypes.c_int] + [_F64P] * 2
            + [_VP] * 6 + [_I64] * 2 + [ctypes.c_int])
#: ``(fwd, bwd, save_size, work_size)`` per (build, float32?), argument types declared once
_WHOLE: dict[tuple[int, bool], tuple[Any, Any, Any, Any]] = {}


def _whole_fns(lib: ctypes.CDLL, f32: bool) -> tuple[Any, Any, Any, Any]:
    key = (id(lib), f32)
    hit = _WHOLE.get(key)
    if hit is not None:
        return hit
    suffix = "f32" if f32 else "f64"
    fwd, bwd = getattr(lib, "ffw_fwd_" + suffix), getattr(lib, "ffw_bwd_" + suffix)
    fwd.argtypes, fwd.restype = _FWD_SIG, None
    bwd.argtypes, bwd.restype = _BWD_SIG, None
    sizes = lib.ffw_save_size, lib.ffw_work_size
    for fn in sizes:
        fn.argtypes, fn.restype = [_I64] * 6, _I64
    _WHOLE[key] = (fwd, bwd, *sizes)
    return _WHOLE[key]


def _points_layout(points: Tensor, lead: tuple[int, ...]) -> tuple[Tensor, int, int, int]:
    """``(w, wsb, wsh, hi)``: head ``g``'s points at ``w + (g // hi)·wsb + (g % hi)·wsh`` (elements),
    rows of each head contiguous. Shared points: one ``(S·R, d)`` matrix, strides 0."""
    sr, d = points.shape[-2:]
    if all(s == 1 for s in points.shape[:-2]):
        return points.reshape(sr, d).contiguous(), 0, 0, 1
    if points.shape[:-2] == lead and len(lead) >= 2 and points.is_contiguous():  # per example and head
        return points, lead[-1] * sr * d, sr * d, lead[-1]
    if points.stride(-1) != 1 or points.stride(-2) != d:
        points = points.contiguous()
    inner = lead[-1]
    try:
        w4 = points.expand(*lead, sr, d).view(-1, inner, sr, d)  # no copy of broadcast points
        return w4, w4.stride(0), w4.stride(1), inner
    except RuntimeError:
        w3 = points.expand(*lead, sr, d).reshape(-1, sr, d)
        return w3, sr * d, 0, 1


#: ``(fwd, bwd, save_size, work_size, gemm address, MKL thread setter address)``
_WholeConfig = tuple[Any, Any, Any, Any, int, int]


#: ``torch.finfo(dtype).max / 8`` (the key weights' cap) per dtype
_CAP = {torch.float32: torch.finfo(torch.float32).max / 8, torch.float64: torch.finfo(torch.float64).max / 8}
_SIZES: dict[tuple[int, tuple[int, ...]], int] = {}


def _size(fn: Any, sizes: tuple[int, ...]) -> int:
    """``fn(*sizes)`` (``ffw_save_size`` / ``ffw_work_size`` of a library :data:`_WHOLE` keeps
    alive, a C call) once per sizes."""
    key = (id(fn), sizes)
    hit = _SIZES.get(key)
    if hit is None:
        hit = _SIZES[key] = int(fn(*sizes))
    return hit


_CHECKED_SIZES: dict[tuple[int, int, tuple[int, ...]], tuple[int, int]] = {}


def _kernel_sizes(fns: tuple[Any, Any], sizes: tuple[int, ...]) -> tuple[int, int]:
    """``(save_size(*sizes), work_size(*sizes))`` for :func:`check_whole`, from a cache of its own (not
    :func:`_size`'s: a size the caller got wrong is not the size the check compares with)."""
    key = (id(fns[0]), id(fns[1]), sizes)
    hit = _CHECKED_SIZES.get(key)
    if hit is None:
        if len(_CHECKED_SIZES) > 1024:
            _CHECKED_SIZES.clear()
        hit = _CHECKED_SIZES[key] = int(fns[0](*sizes)), int(fns[1](*sizes))
    return hit


def _heads_split(g: int, work: int) -> int:
    """Threads for ``g`` heads of ``work`` scores each (one below ``_native._MIN_PARALLEL`` entries)."""
    return min(torch.get_num_threads(), g) if g * work >= _native._MIN_PARALLEL else 1


def _each(threads: int, g: int, call: Callable[[int, int, int], None]) -> None:
    """``call(t, g0, g1)`` for thread ``t``'s heads ``[g0, g1)``, the threads in parallel."""
    if threads <= 1:
        call(0, 0, g)
        return
    bounds = [g * i // threads for i in range(threads + 1)]
    pool = _native._pool(threads)
    futures = [pool.submit(call, t, bounds[t], bounds[t + 1]) for t in range(1, threads)]
    call(0, bounds[0], bounds[1])
    for fut in futures:
        fut.result()


def check_whole(
    kernel: str, size_fns: tuple[Any, Any], sizes: tuple[int, ...], g: int, q: Tensor, k: Tensor, v: Tensor,
    w: Dense, wsb: int, wsh: int, hi: int, save: Dense, out: Tensor, work: Dense, threads: int, *,
    step: int | None = None,
    mask: Tensor | None = None, dout: Tensor | None = None, dstrides: tuple[int, ...] = (),
    grads: tuple[Tensor | None, ...] = (), dw: list[Tensor] | Dense | None = None, dsb: int = 0, dsh: int = 0,
    shared: bool = False,
) -> None:
    """What ``ffw_fwd`` / ``ffw_bwd`` (``_native/fourier_features.c``) read and write for heads ``[0, g)``,
    ``sizes = (Nq, Nk, d, Dv, R, S)``: ``q (g, Nq, d)``, ``k (g, Nk, d)``, ``v (g, Nk, Dv)``, ``out (g, Nq,
    Dv)`` dense; head ``j``'s points ``S·R × d`` dense at ``w + (j // hi)·wsb + (j % hi)·wsh``, inside ``w``'s
    storage for every head; ``mask (g, Nk)`` dense; ``ffw_save_size`` entries of ``save`` per head and
    ``ffw_work_size`` of ``work`` per thread (``size_fns``: those two C functions; rows of ``step``
    entries: a 2-D ``work``'s row length by
    default); the backward's ``dout`` element ``(j, i, c)`` at ``j·ds₀ + i·ds₁ + c·ds₂``, the gradients
    dense like their inputs, ``dw``: one ``(S·R, d)`` buffer per thread (``shared``) or head ``j``'s at
    ``(j // hi)·dsb + (j % hi)·dsh``. The save and work sizes are the C functions' own
    (:func:`_size`). A dense buffer is a tensor or ``(scratch, offset)`` (:func:`require_dense`)."""
    nq, nk, d, dv, r, nsets = sizes
    dtype, sr = q.dtype, r * nsets
    # (the checks of :func:`require` on q, k, v, out in one expression; the loop names a failure)
    if not (k.dtype is dtype and v.dtype is dtype and out.dtype is dtype and q.is_cpu and k.is_cpu
            and v.is_cpu and out.is_cpu and q.is_contiguous() and k.is_contiguous() and v.is_contiguous()
            and out.is_contiguous() and q.numel() == g * nq * d and k.numel() == g * nk * d
            and v.numel() == g * nk * dv and out.numel() == g * nq * dv):
        for name, t, rows, cols in (("q", q, nq, d), ("k", k, nk, d), ("v", v, nk, dv), ("out", out, nq, dv)):
            require(kernel, name, t, dtype=dtype, numel=g * rows * cols)
    for name, grad, like in zip(("dq", "dk", "dv"), grads, (q, k, v)):
        if grad is not None and not (grad.dtype is dtype and grad.is_cpu and grad.is_contiguous()
                                     and grad.numel() == like.numel()):
            require(kernel, name, grad, dtype=dtype, numel=like.numel())
    if mask is not None:
        require(kernel, "mask", mask, dtype=dtype, numel=g * nk)
    heads = ((g - 1) // hi + 1, min(hi, g), sr * d)
    wt, w_at, w_end = (w[0], w[1], w[2] if len(w) > 2 else None) if isinstance(w, tuple) else (w, 0, None)
    if not isinstance(w, tuple) and (w.stride(-1) != 1 or (w.shape[-2] > 1 and w.stride(-2) != d)
                                     or w.shape[-2:] != (sr, d)):
        raise fail(kernel, "w", f"shape "
                   f"{tuple(w.shape)}, strides {w.stride()}: expected dense ({sr}, {d}) rows")
    require_view(kernel, "w", wt, dtype=dtype, sizes=heads, strides=(wsb, wsh, 1), offset=w_at, limit=w_end)
    per_save, per_work = _kernel_sizes(size_fns, sizes)
    if isinstance(save, tuple) or not (save.dtype is dtype and save.is_cpu and save.is_contiguous()
                                       and save.numel() == g * per_save):
        require_dense(kernel, "save", save, dtype=dtype, numel=g * per_save)
    if isinstance(work, tuple):
        row = per_work if step is None else step
        require_size(kernel, "work step", row, at_least=per_work)
        require_dense(kernel, "work", work, dtype=dtype, numel=(threads - 1) * row + per_work)
    elif not (work.dtype is dtype and work.is_cpu and work.is_contiguous()
              and work.numel() >= threads * per_work
              and work.shape[0] >= threads and work.shape[1] >= per_work):
        require(kernel, "work", work, dtype=dtype, min_numel=threads * per_work)
        require_size(kernel, "work rows", work.shape[0], at_least=threads)
        require_size(kernel, "work row", work.shape[1], at_least=per_work)
    if dout is not None:
        require_view(kernel, "dout", dout, dtype=dtype, sizes=(g, nq, dv), strides=dstrides)
    if isinstance(dw, list):
        for t in dw:
            if shared:
                require(kernel, "dw", t, dtype=dtype, numel=sr * d)
            else:
                require_view(kernel, "dw", t, dtype=dtype, sizes=heads, strides=(dsb, dsh, 1))
    elif isinstance(dw, tuple):
        require_view(kernel, "dw", dw[0], dtype=dtype, sizes=heads, strides=(dsb, dsh, 1), offset=dw[1],
                     limit=dw[2] if len(dw) > 2 else None)


#: a dense buffer handed to C: a tensor, or ``(scratch, offset)`` (a region of a plan's scratch)
Dense = Tensor | tuple[Tensor, int] | tuple[Tensor, int, int]


#: ``(w, wsb, wsh, hi)`` of :func:`_points_layout`
_Layout = tuple[Tensor, int, int, int]


def _forward_body(
    q: Tensor, k: Tensor, v: Tensor, points: Tensor, mask: Tensor | None, eps: float, coef: float, nsets: int,
    p: float | None, scale: float, need_k: bool, cfg: _WholeConfig, zeroed: bool,
) -> tuple[Tensor, Tensor, _Layout]:
    """:func:`whole_forward` on contiguous ``q, k, v``, with the points' layout it computed (the
    eager Function keeps it for the backward: one layout per call, not two). Called untraced."""
    fwd, _, save_size, work_size, gemm, set_threads = cfg
    lead = q.shape[:-2] or (1,)
    nq, nk, d, dv = q.shape[-2], k.shape[-2], q.shape[-1], v.shape[-1]
    sr = points.shape[-2]
    r = sr // nsets
    g = math.prod(lead)
    layout = w, wsb, wsh, hi = _points_layout(points, lead)
    mk = None if mask is None else mask.expand(*lead, nk).contiguous()
    sizes = (nq, nk, d, dv, r, nsets)
    save = (q.new_zeros if zeroed else q.new_empty)(g, _size(save_size, sizes))
    out = q.new_empty(*lead, nq, dv)
    threads = _heads_split(g, nq * nk)
    work = q.new_empty(threads, _size(work_size, sizes))
    mode = -1 if p is None else _LP_MODES.get(p, 0)
    cap = _CAP[q.dtype]
    grad = int(p is not None and need_k)
    c4 = coef**4
    args = (q.data_ptr(), k.data_ptr(), v.data_ptr(), w.data_ptr(), wsb, wsh, hi, _base(mk))
    tail = (nq, nk, d, dv, r, nsets, mode, 1.0 if p is None else p, scale, cap, c4, eps, grad,
            save.data_ptr(), out.data_ptr())
    pw, step = work.data_ptr(), work.shape[1] * work.element_size()
    check_whole("ffw_fwd", (save_size, work_size), sizes, g, q, k, v, w, wsb, wsh, hi, save, out, work,
                threads, mask=mk)

    if threads == 1:
        fwd(gemm, set_threads, *args, 0, g, *tail, pw)
    else:

        def heads(t: int, g0: int, g1: int) -> None:
            fwd(gemm, set_threads, *args, g0, g1, *tail, pw + t * step)

        _each(threads, g, heads)
    return out, save, layout


@_native.untraced
def whole_forward(
    q: Tensor, k: Tensor, v: Tensor, points: Tensor, mask: Tensor | None, eps: float, coef: float, nsets: int,
    p: float | None, scale: float, need_k: bool, cfg: _WholeConfig | None = None, zeroed: bool = False,
) -> tuple[Tensor, Tensor]:
    """``(out (*lead, Nq, dv), saved)``: the forward C call(s) (``ffw_fwd``) of :class:`_WholeFourier`;
    ``need_k``: keep what the magnitude's key gradient needs. ``cfg``: the C functions and BLAS
    addresses (:func:`_whole_call`; looked up when None). ``zeroed``: the saved buffer starts at zeros
    (the op's output: entries a configuration does not use are then defined). The body of
    ``attnopt::ffw_fwd``; :class:`_WholeFourier` calls :func:`_forward_body` itself."""
    cfg = _whole_config(q.dtype) if cfg is None else cfg
    out, save, _ = _forward_body(q.contiguous(), k.contiguous(), v.contiguous(), points, mask, eps, coef,
                                 nsets, p, scale, need_k, cfg, zeroed)
    return out, save


def _backward_body(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, points: Tensor, save: Tensor, out: Tensor, eps: float,
    coef: float, nsets: int, magnitude: bool, need_q: bool, need_k: bool, need_v: bool, need_w: bool,
    cfg: _WholeConfig, layout: _Layout | None,
) -> tuple[Tensor | None, Tensor | None, Tensor | None, Tensor | None]:
    """:func:`whole_backward` on contiguous ``q, k, v`` with the forward's points ``layout`` (None:
    computed here), a gradient not asked for None. Called untraced."""
    _, bwd, save_size, work_size, gemm, set_threads = cfg
    lead = q.shape[:-2] or (1,)
    w, wsb, wsh, hi = _points_layout(points, lead) if layout is None else layout
    r = points.shape[-2] // nsets
    c4 = coef**4
    nq, nk, d, dv = q.shape[-2], k.shape[-2], q.shape[-1], v.shape[-1]
    sr = w.shape[-2]
    g = math.prod(lead)
    if dout.dtype != out.dtype:
        dout = dout.to(out.dtype)
    # as (g, nq, dv) with its strides (an expanded scalar stays a view with strides 0)
    d3 = dout.reshape(g, nq, dv) if not dout.is_contiguous() else dout
    dstrides = (nq * dv, dv, 1) if d3 is dout else (d3.stride(0), d3.stride(1), d3.stride(2))
    dq = torch.empty_like(q) if need_q else None
    dk = torch.empty_like(k) if need_k else None
    dvv = torch.empty_like(v) if need_v else None
    threads = _heads_split(g, nq * nk)
    work = q.new_empty(threads, _size(work_size, (nq, nk, d, dv, r, nsets)))
    shared = wsb == 0 and wsh == 0
    dwb: list[Tensor] = []
    dsb = dsh = 0
    if need_w:
        if shared:
            dwb = [q.new_zeros(sr, d) for _ in range(threads)]
        else:
            dwb = [q.new_empty(g, sr, d)]
            dsb, dsh = (hi * sr * d, sr * d) if hi > 1 or wsb != sr * d else (sr * d, 0)
    args = (q.data_ptr(), k.data_ptr(), v.data_ptr(), w.data_ptr(), wsb, wsh, hi, d3.data_ptr(),
            *dstrides, out.data_ptr())
    tail = (nq, nk, d, dv, r, nsets, int(magnitude), c4, eps, save.data_ptr())
    outs = (_base(dq), _base(dk), _base(dvv))
    pw, step = work.data_ptr(), work.shape[1] * work.element_size()
    check_whole("ffw_bwd", (save_size, work_size), (nq, nk, d, dv, r, nsets), g, q, k, v, w, wsb, wsh, hi,
                save,
                out, work,
                threads, dout=d3, dstrides=dstrides, grads=(dq, dk, dvv), dw=dwb, dsb=dsb, dsh=dsh,
                shared=shared)

    if threads == 1:
        pdw = None if not dwb else dwb[0].data_ptr()
        bwd(gemm, set_threads, *args, 0, g, *tail, pw, *outs, pdw, dsb, dsh, int(shared))
    else:

        def heads(t: int, g0: int, g1: int) -> None:
            pdw = None if not dwb else dwb[t if shared else 0].data_ptr()
            bwd(gemm, set_threads, *args, g0, g1, *tail, pw + t * step, *outs, pdw, dsb, dsh, int(shared))

        _each(threads, g, heads)
    dw = None
    if need_w:
        if shared:
            dw = dwb[0]
            for extra in dwb[1:]:
                dw += extra
            dw = dw.view(points.shape)
        else:
            dw = dwb[0].view(*lead, sr, d)
            if dw.shape != points.shape:
                dw = dw.sum_to_size(points.shape)
    return dq, dk, dvv, dw


@_native.untraced
def whole_backward(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, points: Tensor, save: Tensor, out: Tensor, eps: float,
    coef: float, nsets: int, magnitude: bool, need_q: bool, need_k: bool, need_v: bool, need_w: bool,
    cfg: _WholeConfig | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(dQ, dK, dV, d points)`` of :func:`whole_forward` (``ffw_bwd``; a gradient not asked for is
    empty). The body of ``attnopt::ffw_bwd``; :class:`_WholeFourier` calls :func:`_backward_body`."""
    cfg = _whole_config(q.dtype) if cfg is None else cfg
    dq, dk, dv, dw = _backward_body(dout, q.contiguous(), k.contiguous(), v.contiguous(), points, save, out,
                                    eps, coef, nsets, magnitude, need_q, need_k, need_v, need_w, cfg, None)
    return (q.new_empty(0) if dq is None else dq, k.new_empty(0) if dk is None else dk,
            v.new_empty(0) if dv is None else dv, q.new_empty(0) if dw is None else dw)


#: ``[True]`` once an eager call found the whole call's C library and BLAS (:func:`_whole_call`): the
#: traced routers read it (a plain module constant to dynamo; the ctypes lookups themselves would
#: break the graph), so a compiled graph holds ``attnopt::ffw_*`` where an eager call could have run it
WHOLE_READY = [False]


def _whole_config(dtype: torch.dtype) -> _WholeConfig:
    """The C functions and BLAS addresses of the whole call for ``dtype`` (the op bodies' lookup)."""
    found = _native.blas()
    lib = _native.library("fourier_features")
    assert found is not None and lib is not None
    f32 = dtype == torch.float32
    return (*_whole_fns(lib, f32), found.sgemm if f32 else found.dgemm, found.set_threads)


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
        ctx.cfg, ctx.args, ctx.layout = cfg, (eps, coef, nsets, p is not None), layout[1:]
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
        dq, dk, dv, dw = _backward_body(dout, q, k, v, points, save, out, eps, coef, nsets, mag, need[0],
                                        need[1], need[2], need[3], ctx.cfg, (w, *ctx.layout))
        return dq, dk, dv, dw, None, None, None, None, None, None, None


def _whole_call(
    q: Tensor, k: Tensor, v: Tensor, points: Tensor, key_mask: Tensor | None
) -> _WholeConfig | None:
    """The whole-call configuration where :class:`_WholeFourier` applies, else None: CPU
    float32/64 tensors of one dtype with storage, no dispatch mode active (a FLOP counter sees the
    node's products), q, k, v of one batch shape, ``0 < B·H·Nq·Nk <=
    kernel_wholecall_below``, ``Nq·Nk <= kernel_wholecall_max_head_scores``, the C kernels and
    :func:`attnopt._native.blas` there."""
    dtype = q.dtype
    if dtype not in (torch.float32, torch.float64) or q.device.type != "cpu":
        return None
    nq, nk = q.shape[-2], k.shape[-2]
    size = math.prod(q.shape[:-2]) * nq * nk
    t = THRESHOLDS
    if not 0 < size <= t.kernel_wholecall_below or nq * nk > t.kernel_wholecall_max_head_scores:
        return None
    if q.shape[-1] == 0 or v.shape[-1] == 0 or points.shape[-2] == 0:
        return None
    # (explicit tests, no generators: this runs on every call at N = 64, where a call is ~0.4 ms)
    if k.dtype != dtype or v.dtype != dtype or points.dtype != dtype:
        return None
    if not (k.is_cpu and v.is_cpu and points.is_cpu):
        return None
    if key_mask is not None and (key_mask.dtype != dtype or not key_mask.is_cpu):
        return None
    if not (_native.has_storage(q, k, v) and _native.has_storage(points, key_mask)):
        return None
    # under a dispatch mode (FlopCounterMode, the claims' PeakMemory) the node's aten ops are seen;
    # the products inside the C call would not be
    if torch._C._len_torch_dispatch_stack():
        return None
    found = _native.blas()
    lib = _native.library("fourier_features") if found is not None else None
    if lib is None or found is None:
        return None
    f32 = dtype == torch.float32
    WHOLE_READY[0] = True
    return (*_whole_fns(lib, f32), found.sgemm if f32 else found.dgemm, found.set_threads)


def whole_applies(q: Tensor, k: Tensor, v: Tensor, points: Tensor) -> bool:
    """The size and shape rules of :func:`_whole_call` alone (no storage, library or dispatch-mode
    test): what a traced router asks before it puts ``attnopt::ffw_fwd`` in the graph, so that the
    compiled and the eager call take the same path."""
    nq, nk = q.shape[-2], k.shape[-2]
    size = math.prod(q.shape[:-2]) * nq * nk
    t = THRESHOLDS
    return (0 < size <= t.kernel_wholecall_below and nq * nk <= t.kernel_wholecall_max_head_scores
            and q.shape[-1] > 0 and v.shape[-1] > 0 and points.shape[-2] > 0
            and q.shape[:-2] == k.shape[:-2] == v.shape[:-2] and len(points.shape) - 2 <= len(q.shape) - 2
            and k.dtype == q.dtype and v.dtype == q.dtype and q.dtype in (torch.float32, torch.float64))


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


# --- the whole call as torch.library ops (issue 30 item 2) ------------------------------------------


@torch.library.custom_op("attnopt::ffw_fwd", mutates_args=(), device_types="cpu")
def ffw_fwd(
    q: Tensor, k: Tensor, v: Tensor, points: Tensor, mask: Tensor | None, eps: float, coef: float, nsets: int,
    p: float | None, scale: float, need_k: bool,
) -> tuple[Tensor, Tensor]:
    """``(out (*lead, Nq, dv), saved)`` of Fourier-feature kernel attention, one C call per thread
    (:func:`whole_forward`)."""
    return whole_forward(q, k, v, points, mask, eps, coef, nsets, p, scale, need_k, zeroed=True)


@ffw_fwd.register_fake
def _(q: Tensor, k: Tensor, v: Tensor, points: Tensor, mask: Tensor | None, eps: float,  # noqa: ARG001
      coef: float, nsets: int, p: float | None, scale: float, need_k: bool) -> tuple[Tensor, Tensor]:  # noqa: ARG001
    lead = q.shape[:-2] or (1,)
    nq, nk, d, dv = q.shape[-2], k.shape[-2], q.shape[-1], v.shape[-1]
    # ffw_save_size of fourier_features.c, written out (symbolic sizes; opcheck compares it with the C)
    sr = points.shape[-2]
    r = sr // nsets
    save = nq * nk + (nq + nk) * 2 * r + 2 * (nq + nk) * sr + nk + nk * d + nk + nq
    return q.new_empty(*lead, nq, dv), q.new_empty(math.prod(lead), save)


@torch.library.custom_op("attnopt::ffw_bwd", mutates_args=(), device_types="cpu")
def ffw_bwd(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, points: Tensor, save: Tensor, out: Tensor, eps: float,
    coef: float, nsets: int, magnitude: bool, need_q: bool, need_k: bool, need_v: bool, need_w: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(dQ, dK, dV, d points)`` of :func:`ffw_fwd` (:func:`whole_backward`)."""
    return whole_backward(dout, q, k, v, points, save, out, eps, coef, nsets, magnitude, need_q, need_k,
                          need_v, need_w)


@ffw_bwd.register_fake
def _(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, points: Tensor, save: Tensor, out: Tensor,  # noqa: ARG001
      eps: float, coef: float, nsets: int, magnitude: bool, need_q: bool, need_k: bool,  # noqa: ARG001
      need_v: bool, need_w: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    return (q.new_empty(q.shape if need_q else (0,)), k.new_empty(k.shape if need_k else (0,)),
            v.new_empty(v.shape if need_v else (0,)), points.new_empty(points.shape if need_w else (0,)))


def _ffw_setup(ctx: Any, inputs: tuple, output: tuple) -> None:
    q, k, v, points, _, eps, coef, nsets, p, _, _ = inputs
    out, save = output
    ctx.args = eps, coef, nsets, p is not None
    ctx.save_for_backward(q, k, v, points, save, out)


def _ffw_backward(ctx: Any, dout: Tensor, *_unused: Tensor | None) -> tuple[Tensor | None, ...]:
    need = ctx.needs_input_grad[:4]
    dq, dk, dv, dw = torch.ops.attnopt.ffw_bwd(dout, *ctx.saved_tensors, *ctx.args, *need)
    return (dq if need[0] else None, dk if need[1] else None, dv if need[2] else None,
            dw if need[3] else None, None, None, None, None, None, None, None)


ffw_fwd.register_autograd(_ffw_backward, setup_context=_ffw_setup)
