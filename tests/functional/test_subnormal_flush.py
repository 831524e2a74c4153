"""Subnormal flushing in the DNAS flash passes, regularized attention and ``flushed_sdpa``.

Inputs are chosen so that many weights underflow into float32's subnormal range (peaked
scores, a full mask with large finite negative entries, an ALiBi locality over a long
sequence). The flushed kernels must give the unflushed results to rounding, values and
gradients, and leave the thread's flush mode as they found it, also when a kernel raises.
"""
from __future__ import annotations

from contextlib import nullcontext

import pytest
import torch
import torch.nn.functional as F

from attnopt.functional import _denormal, doubly_normalized_attention, regularized_attention
from attnopt.functional import regularized as reg_mod
from attnopt.functional._denormal import flush_denormal_on, flushed_sdpa
from attnopt.functional.doubly_normalized import flash_cpu as fc
from attnopt.functional.regularized import locality_bias

TINY = torch.finfo(torch.float32).tiny


def _qkv(n: int, scale: float, seed: int = 0, bh: int = 2, d: int = 8) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(1, bh, n, d, generator=g) * scale).requires_grad_() for _ in range(3)]


def _subnormal_share(scores: torch.Tensor) -> float:
    w = torch.softmax(scores.float(), dim=-1)
    return float(((w > 0) & (w < TINY)).float().mean())


def _fwd_bwd(fn, q, k, v):  # type: ignore[no-untyped-def]
    out = fn(q, k, v)
    go = torch.linspace(-1, 1, out.numel()).view_as(out)
    return (out, *torch.autograd.grad(out, (q, k, v), go))


def _close(a, b, rtol=1e-5, atol=1e-6):  # type: ignore[no-untyped-def]
    for x, y in zip(a, b, strict=True):
        torch.testing.assert_close(x, y, rtol=rtol, atol=atol)


@pytest.mark.parametrize("case", ["peaked", "full_mask", "causal"])
@pytest.mark.parametrize("iterations", [1, 2])
def test_dnas_flash_passes_flush_and_match_unflushed(case: str, iterations: int,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    n = 48
    q, k, v = _qkv(n, 5.0 if case != "full_mask" else 1.0)
    mask = None
    if case == "full_mask":
        mask = -torch.rand(1, 1, n, n, generator=torch.Generator().manual_seed(1)) * 120
    causal = case == "causal"
    scores = q.detach() @ k.detach().transpose(-1, -2) / 8**0.5 + (0 if mask is None else mask)
    assert _subnormal_share(scores) > 0.01  # the inputs do produce subnormal weights

    def run(q, k, v):  # type: ignore[no-untyped-def]
        return doubly_normalized_attention(q, k, v, iterations=iterations, attn_mask=mask,
                                           causal="plan", is_causal=causal,
                                           impl="streaming")

    seen: list[bool] = []
    real_fwd = fc._fwd

    def spy(*a, **kw):  # type: ignore[no-untyped-def]
        seen.append(flush_denormal_on())
        return real_fwd(*a, **kw)

    monkeypatch.setattr(fc, "_fwd", spy)
    flushed = _fwd_bwd(run, q, k, v)
    assert seen and all(seen)  # every kernel call ran flushed
    assert not flush_denormal_on()  # and the mode is back after forward and backward
    monkeypatch.setattr(fc, "flush_denormal", nullcontext)
    plain = _fwd_bwd(run, q, k, v)
    _close(flushed, plain)
    # against float64: flushing adds no error beyond float32's own (peaked scores are ill-conditioned)
    ref = _fwd_bwd(lambda *t: run(*(x.double() for x in t)), q, k, v)
    for f, p, r in zip((x.double() for x in flushed), (x.double() for x in plain), ref, strict=True):
        assert float((f - r).detach().abs().max()) <= 1.5 * float((p - r).detach().abs().max()) + 1e-6


def test_dnas_flash_restores_the_mode_when_the_kernel_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    def boom(*_a, **_kw):  # type: ignore[no-untyped-def]
        assert flush_denormal_on()
        raise RuntimeError("kernel failed")

    monkeypatch.setattr(fc, "_fwd", boom)
    q, k, v = _qkv(8, 1.0)
    with pytest.raises(RuntimeError, match="kernel failed"):
        doubly_normalized_attention(q, k, v, impl="streaming")
    assert not flush_denormal_on()


@pytest.mark.parametrize("learn", [False, True])
def test_regularized_locality_flushes_and_matches_sdpa(learn: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    from attnopt.functional.generalized import streaming as gf

    seen: list[bool] = []
    real_bmm = torch.bmm

    def spy_bmm(*a, **kw):  # type: ignore[no-untyped-def]  # the materialized path (β needs a gradient)
        seen.append(flush_denormal_on())
        return real_bmm(*a, **kw)

    def spy_fwd(*a, **kw):  # type: ignore[no-untyped-def]  # the flash path
        seen.append(flush_denormal_on())
        return real_fwd(*a, **kw)

    real_fwd = gf._fwd
    monkeypatch.setattr(gf, "_fwd", spy_fwd)
    monkeypatch.setattr(torch, "bmm", spy_bmm)
    n = 160
    q, k, v = _qkv(n, 1.0)
    beta = torch.tensor([0.6, 0.9], requires_grad=learn)
    bias = locality_bias(n, n, beta, dtype=torch.float32, device="cpu")
    scores = q.detach() @ k.detach().transpose(-1, -2) / 8**0.5 + bias.detach()
    assert _subnormal_share(scores) > 0.01
    out = regularized_attention(q, k, v, locality=beta)
    assert seen and all(seen)
    assert not flush_denormal_on()
    monkeypatch.undo()
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
    go = torch.randn_like(out)
    wrt = (q, k, v, beta) if learn else (q, k, v)
    _close((out, *torch.autograd.grad(out, wrt, go)), (ref, *torch.autograd.grad(ref, wrt, go)), atol=1e-5)
    assert not flush_denormal_on()


def test_regularized_locality_restores_the_mode_on_error(monkeypatch: pytest.MonkeyPatch) -> None:
    from attnopt.functional.generalized import streaming as gf

    def boom(*_a, **_kw):  # type: ignore[no-untyped-def]
        assert flush_denormal_on()
        raise RuntimeError("kernel failed")

    monkeypatch.setattr(gf, "_fwd", boom)
    q, k, v = _qkv(8, 1.0)
    with pytest.raises(RuntimeError, match="kernel failed"):
        regularized_attention(q, k, v, locality=0.5)
    assert not flush_denormal_on()


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_flushed_sdpa_matches_sdpa_on_peaked_scores(causal: bool, dtype: torch.dtype) -> None:
    q, k, v = (x.detach().to(dtype).requires_grad_() for x in _qkv(64, 5.0))
    if dtype == torch.float32:
        assert _subnormal_share(q.detach() @ k.detach().transpose(-1, -2) * 0.3) > 0.01
    tol = {"rtol": 1e-5, "atol": 1e-6} if dtype == torch.float32 else {"rtol": 1e-12, "atol": 1e-13}
    sdpa = F.scaled_dot_product_attention
    _close(_fwd_bwd(lambda *t: flushed_sdpa(*t, is_causal=causal, scale=0.3), q, k, v),
           _fwd_bwd(lambda *t: sdpa(*t, is_causal=causal, scale=0.3), q, k, v), **tol)
    assert not flush_denormal_on()


def test_flushed_sdpa_falls_back_and_restores_the_mode(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    real = _denormal._fwd

    def spy(*a, **kw):  # type: ignore[no-untyped-def]
        calls.append(1)
        return real(*a, **kw)

    monkeypatch.setattr(_denormal, "_fwd", spy)
    q, k, v = (x.detach() for x in _qkv(6, 1.0))
    half = [x.half() for x in (q, k, v)]
    torch.testing.assert_close(flushed_sdpa(*half), F.scaled_dot_product_attention(*half))
    kk = torch.randn(1, 2, 9, 8)  # Nq != Nk with is_causal: SDPA's own handling
    torch.testing.assert_close(flushed_sdpa(q, kk, kk, is_causal=True),
                               F.scaled_dot_product_attention(q, kk, kk, is_causal=True))
    assert calls == []
    flushed_sdpa(q, k, v.transpose(-1, -2).contiguous().transpose(-1, -2))  # strided last dim: copied
    assert calls == [1]

    def boom(*_a, **_kw):  # type: ignore[no-untyped-def]
        raise RuntimeError("kernel failed")

    monkeypatch.setattr(_denormal, "_fwd", boom)
    with pytest.raises(RuntimeError, match="kernel failed"):
        flushed_sdpa(q, k, v)
    assert not flush_denormal_on()


def test_regularized_shannon_without_bias_uses_flushed_sdpa(monkeypatch: pytest.MonkeyPatch) -> None:
    used: list[int] = []
    real = reg_mod.flushed_sdpa

    def spy(*a, **kw):  # type: ignore[no-untyped-def]
        used.append(1)
        return real(*a, **kw)

    monkeypatch.setattr(reg_mod, "flushed_sdpa", spy)
    q, k, v = (x.detach() for x in _qkv(16, 1.0))
    torch.testing.assert_close(regularized_attention(q, k, v, is_causal=True),
                               F.scaled_dot_product_attention(q, k, v, is_causal=True))
    assert used == [1]


@pytest.mark.parametrize("is_causal", [False, True])
def test_flushed_sdpa_double_backward_is_exact(is_causal):
    from attnopt.functional._denormal import flushed_sdpa

    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 2, 5, 3, dtype=torch.float64, generator=g, requires_grad=True)
               for _ in range(3))
    torch.autograd.gradgradcheck(lambda a, b, c: flushed_sdpa(a, b, c, is_causal=is_causal), (q, k, v))
