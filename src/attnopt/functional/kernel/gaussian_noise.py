r"""Standard-normal base noise for the sampled spectral points (internal).

implicit-kernel-attention eq. 6 draws ``z = μ + σ ⊙ e`` with ``e ~ N(0, I)``, fresh on every
training call: ``(S, B, H, R/2, d)`` values (8192 at B·H = 8, R = 16, two sets). torch's CPU
``randn`` (mt19937, one value at a time) takes ~30 µs for those, 7% of a forward and backward
at N = 64. Here one int64 seed is drawn from the module's ``torch.Generator`` and the values come
from a counter-based generator (SplitMix64 of the pair index, Box–Muller), in C
(``_native/normal.c``, ~1.2 ns a value) or, where the C kernel cannot run (no compiler,
``ATTNOPT_NATIVE=0``, a seed wrapped by a ``torch.func`` transform), by :func:`_mirror`: the same
float32 steps in PyTorch ops, bit for bit the same values (tested).

The generator's state advances by one draw per call, so ``manual_seed`` / ``get_state`` /
``set_state`` on the module's generator reproduce the noise; under ``torch.func.vmap`` the seed
follows ``randomness`` (``"same"``: the plain call's noise, ``"different"``: a seed per example,
``"error"``: torch's error, which the module rewords).
"""
from __future__ import annotations

import math
import struct

import torch
from torch import Tensor

from attnopt import _native
from attnopt._native.checks import require
from attnopt.functional.kernel._normal_c import _SUFFIX, seeded_fill

__all__ = ["draw_seed", "gaussian_noise", "noise_from_seed", "seeded_fill"]

_WRAPPED = torch._C._functorch.is_functorch_wrapped_tensor


def _i64(x: int) -> int:
    """The unsigned 64-bit constant ``x`` as the int64 with the same bits (torch multiplies and
    adds int64 modulo 2^64, as C does uint64)."""
    return x - (1 << 64) if x >= 1 << 63 else x


def _f32(x: float) -> float:
    """``x`` rounded to float32 (as C's float constant)."""
    value: float = struct.unpack("f", struct.pack("f", x))[0]
    return value


_GAMMA, _MIX1, _MIX2 = _i64(0x9E3779B97F4A7C15), _i64(0xBF58476D1CE4E5B9), _i64(0x94D049BB133111EB)
_LOG_P = tuple(_f32(c) for c in (
    7.0376836292e-2, -1.1514610310e-1, 1.1676998740e-1, -1.2420140846e-1, 1.4249322787e-1,
    -1.6668057665e-1, 2.0000714765e-1, -2.4999993993e-1, 3.3333331174e-1))
_SQRTHF, _LOG_E_LO, _LOG_E_HI = _f32(0.707106781186547524), _f32(-2.12194440e-4), _f32(0.693359375)
_SIN_P = tuple(_f32(c) for c in (-1.9515295891e-4, 8.3321608736e-3, -1.6666654611e-1))
_COS_P = tuple(_f32(c) for c in (2.443315711809948e-5, -1.388731625493765e-3, 4.166664568298827e-2))
_ANGLE = _f32(1.5707963267948966 * 2.384185791015625e-7)  # (π/2)·2^-22


def gaussian_noise(shape: tuple[int, ...], generator: torch.Generator | None) -> Tensor:
    """``N(0, 1)`` float32 values of ``shape`` on the CPU, from one int64 seed drawn from
    ``generator`` (torch's default CPU generator when None): ``noise_from_seed(draw_seed(g), shape)``.

    Raises:
        RuntimeError: under ``torch.func.vmap`` with ``randomness="error"`` (torch's message).
    """
    return noise_from_seed(draw_seed(generator), shape)


def draw_seed(generator: torch.Generator | None) -> Tensor:
    """One int64 seed (0-d) from ``generator``: one step of its stream per draw."""
    return torch.randint(-(1 << 63), (1 << 63) - 1, (), dtype=torch.int64, generator=generator)


def noise_from_seed(seed: Tensor, shape: tuple[int, ...], dtype: torch.dtype = torch.float32) -> Tensor:
    """The draw of ``seed`` (:func:`draw_seed`) as a CPU tensor of ``shape``: float32 values, stored as
    ``dtype`` (float32 or float64). The C fill where it runs (a plain CPU seed, eager), else the
    PyTorch mirror (same bits). Traced (``torch.compile``, ``torch.export``) with a CPU seed: the op
    ``attnopt::normal_fill`` (the C fill at run time, or the mirror without the library), one node of
    the graph; on other devices the mirror's ops."""
    if torch.compiler.is_compiling():
        if seed.device.type == "cpu" and dtype in _SUFFIX:
            out: Tensor = torch.ops.attnopt.normal_fill(seed, list(shape), dtype)
            return out
        return _mirror(seed, shape).to(dtype)
    if seed.is_cpu and not _WRAPPED(seed):
        native = _native_noise(seed, shape, dtype)
        if native is not None:
            return native
    return _mirror(seed, shape).to(dtype)


@_native.untraced
def _native_noise(seed: Tensor, shape: tuple[int, ...], dtype: torch.dtype) -> Tensor | None:
    """:func:`noise_from_seed` by ``normal_fill_at`` in C, or None where the library is not built."""
    fill = seeded_fill(dtype)
    if fill is None:
        return None
    out = torch.empty(shape, dtype=dtype)
    _check_normal_fill(seed, out, dtype)
    fill(seed.data_ptr(), out.data_ptr(), out.numel())
    return out


@torch.library.custom_op("attnopt::normal_fill", mutates_args=(), device_types="cpu")
def normal_fill(seed: Tensor, shape: list[int], dtype: torch.dtype) -> Tensor:
    """The draw of ``seed`` as a new CPU tensor of ``shape`` (``normal_fill_at_*``, issue 30 item 2:
    the C fill as one op for graphs; plain eager code calls :func:`noise_from_seed` directly, which
    saves the ``custom_op`` path's fixed per-call cost). Not differentiable (noise)."""
    out = _native_noise(seed, tuple(shape), dtype)
    if out is None:  # no compiler / ATTNOPT_NATIVE=0: the PyTorch mirror, the same values
        return _mirror(seed, tuple(shape)).to(dtype)
    return out


@normal_fill.register_fake
def _(seed: Tensor, shape: list[int], dtype: torch.dtype) -> Tensor:
    return seed.new_empty(shape, dtype=dtype)


def _check_normal_fill(seed: Tensor, out: Tensor, dtype: torch.dtype) -> None:
    """What ``normal_fill_at_*`` reads and writes: one int64 seed, ``out.numel()`` dense ``dtype`` entries."""
    require("normal_fill_at", "seed", seed, dtype=torch.int64, numel=1)
    require("normal_fill_at", "out", out, dtype=dtype)


def _lsr(z: Tensor, s: int) -> Tensor:
    """The logical right shift of int64 ``z`` (torch's ``>>`` is arithmetic)."""
    return (z >> s) & ((1 << (64 - s)) - 1)


def _log(u: Tensor) -> Tensor:
    """Cephes' logf of float32 ``u`` in ``[2^-24, 1]``, the steps of ``nm_log``."""
    b = u.view(torch.int32)
    m = ((b & 0x7FFFFF) | 0x3F000000).view(torch.float32)
    low = m < _SQRTHF
    fe = ((b >> 23) - 126 - low.to(torch.int32)).to(torch.float32)
    x = torch.where(low, (m + m) - 1.0, m - 1.0)
    z = x * x
    y = torch.full_like(x, _LOG_P[0])
    for c in _LOG_P[1:]:
        y = y * x + c
    y = (y * x) * z
    y = y + fe * _LOG_E_LO
    y = y + z * -0.5
    return (x + y) + fe * _LOG_E_HI


def _mirror(seed: Tensor, shape: tuple[int, ...]) -> Tensor:
    """:func:`gaussian_noise`'s values from ``seed`` (int64, 0-d; batched under ``vmap``) in
    PyTorch ops: ``normal_fill_f32``'s steps, float32, no fused multiply-add."""
    n = math.prod(shape)
    pairs, half = n // 2, n - n // 2
    z = seed + torch.arange(1, half + 1, dtype=torch.int64) * _GAMMA
    z = (z ^ _lsr(z, 30)) * _MIX1
    z = (z ^ _lsr(z, 27)) * _MIX2
    z = z ^ _lsr(z, 31)
    u = (_lsr(z, 40) + 1).to(torch.float32) * 2.0**-24
    # the correctly rounded float32 square root (as C's): torch's float32 sqrt is not, on every CPU
    # build (AVX-512: 1 ulp off for ~0.6% of entries); float64's, rounded to float32, is
    rho = torch.sqrt((_log(u) * -2.0).to(torch.float64)).to(torch.float32)
    j = (z >> 16) & 0xFFFFFF
    q = j >> 22
    t = (((j & 0x3FFFFF) - 2097152).to(torch.float32) + 0.5) * _ANGLE
    zz = t * t
    sp = torch.full_like(t, _SIN_P[0])
    for c in _SIN_P[1:]:
        sp = sp * zz + c
    sp = (sp * zz) * t + t
    cp = torch.full_like(t, _COS_P[0])
    for c in _COS_P[1:]:
        cp = cp * zz + c
    cp = ((cp * zz) * zz - zz * 0.5) + 1.0
    odd = (q & 1) == 1
    c0, s0 = torch.where(odd, sp, cp), torch.where(odd, cp, sp)
    first = rho * torch.where(((q + 1) & 2) != 0, -c0, c0)
    second = rho * torch.where((q & 2) != 0, -s0, s0)
    return torch.cat([first, second[..., :pairs]], dim=-1).reshape(*seed.shape, *shape)
