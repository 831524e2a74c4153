"""Random calls of every public entry that can reach a C kernel, for the native fuzz tests.

A case is built from a hypothesis ``draw`` and returns ``(fn, inputs)``: ``fn(*inputs)`` is a
tensor computed by attnopt; the fuzz test runs it with the C kernels on and off
(``ATTNOPT_NATIVE=0``: the PyTorch path) and compares values and gradients.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from hypothesis import strategies as st

import attnopt
from attnopt import kernels

Fn = Callable[..., torch.Tensor]

#: lengths: 1, odd sizes, and sizes just below / above the kernels' blocks (8, 16, 32, 64)
LENGTHS = st.sampled_from([1, 2, 3, 7, 8, 9, 15, 16, 17, 31, 33, 63, 65, 100])
DIMS = st.sampled_from([1, 3, 4, 8, 16, 17])


def _layout(draw: Any, shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """A tensor of ``shape`` as a contiguous, transposed (seq <-> heads) or sliced view."""
    kind = draw(st.sampled_from(["contiguous", "transposed", "sliced"]))
    b, h, n, d = shape
    if kind == "transposed":
        return torch.randn(b, n, h, d, generator=gen, dtype=dtype).transpose(1, 2)
    if kind == "sliced":
        return torch.randn(b, h, n, d + 3, generator=gen, dtype=dtype)[..., 1 : d + 1]
    return torch.randn(shape, generator=gen, dtype=dtype)


def _qkv(
    draw: Any, dtype: torch.dtype, gen: torch.Generator, same_len: bool = False
) -> tuple[torch.Tensor, ...]:
    b, h = draw(st.integers(1, 3)), draw(st.integers(1, 3))
    nq = draw(LENGTHS)
    nk = nq if same_len else draw(LENGTHS)
    d, dv = draw(DIMS), draw(DIMS)
    return (_layout(draw, (b, h, nq, d), dtype, gen), _layout(draw, (b, h, nk, d), dtype, gen),
            _layout(draw, (b, h, nk, dv), dtype, gen))


def _key_padding(draw: Any, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor | None:
    """None, or a (B, 1, 1, Nk) additive mask with some keys -inf (never all of a row's keys)."""
    if not draw(st.booleans()):
        return None
    b, nk = k.shape[0], k.shape[-2]
    keep = torch.ones(b, nk, dtype=torch.bool)
    for i in range(b):
        cut = draw(st.integers(1, nk))
        keep[i, cut:] = False
    mask = torch.zeros(b, 1, 1, nk, dtype=q.dtype).masked_fill(~keep[:, None, None, :], float("-inf"))
    return mask


def dnas(draw: Any, dtype: torch.dtype, gen: torch.Generator) -> tuple[Fn, tuple[torch.Tensor, ...]]:
    causal = draw(st.booleans())
    q, k, v = _qkv(draw, dtype, gen, same_len=causal)
    mask = None if causal else _key_padding(draw, q, k)
    iterations = draw(st.sampled_from([1, 1, 2, 3]))
    hybrid = draw(st.booleans())
    # the masked plan reaches the C passes; the autoregressive prefix variant has no streaming path
    mode = draw(st.sampled_from(["plan", "prefix"]))
    impls = ["auto", "materialized"] + (["streaming"] if mode == "plan" else [])
    impl = draw(st.sampled_from(impls))
    w = torch.rand((), dtype=dtype, generator=gen)

    def fn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        if hybrid:
            return attnopt.hybrid_normalized_attention(q, k, v, w, iterations=iterations, attn_mask=mask,
                                                       is_causal=causal, causal=mode, impl=impl)
        return attnopt.doubly_normalized_attention(q, k, v, iterations=iterations, attn_mask=mask,
                                                   is_causal=causal, causal=mode, impl=impl)

    return fn, (q, k, v, w)


def sparse_attention(
    draw: Any, dtype: torch.dtype, gen: torch.Generator
) -> tuple[Fn, tuple[torch.Tensor, ...]]:
    causal = draw(st.booleans())
    q, k, v = _qkv(draw, dtype, gen, same_len=causal)
    mask = None if causal else _key_padding(draw, q, k)
    reg = draw(st.sampled_from([attnopt.SquaredL2(), attnopt.Tsallis(1.5)]))
    impl = draw(st.sampled_from(["auto", "materialized", "streaming"]))

    def fn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return attnopt.regularized_attention(q, k, v, regularizer=reg, attn_mask=mask, is_causal=causal,
                                             impl=impl)

    return fn, (q, k, v)


def sparse_map(draw: Any, dtype: torch.dtype, gen: torch.Generator) -> tuple[Fn, tuple[torch.Tensor, ...]]:
    rows, n = draw(st.integers(1, 40)), draw(LENGTHS)
    x = torch.randn(rows, n, generator=gen, dtype=dtype) * draw(st.sampled_from([0.1, 1.0, 10.0]))
    if draw(st.booleans()):
        x = x.t().contiguous().t()  # column-major storage
    alpha = draw(st.sampled_from([1.5, 2.0]))

    def fn(x: torch.Tensor) -> torch.Tensor:
        return attnopt.sparsemax(x) if alpha == 2.0 else attnopt.entmax(x, alpha)

    return fn, (x,)


def generalized(draw: Any, dtype: torch.dtype, gen: torch.Generator) -> tuple[Fn, tuple[torch.Tensor, ...]]:
    q, k, v = _qkv(draw, dtype, gen)
    nq, nk = q.shape[-2], k.shape[-2]
    heads_bias = draw(st.booleans())
    bias = torch.randn(q.shape[1] if heads_bias else 1, nq, nk, generator=gen, dtype=dtype)
    impl = draw(st.sampled_from(["auto", "materialized", "streaming"]))

    def fn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        return attnopt.generalized_attention(q, k, v, log_preference=bias, impl=impl)

    return fn, (q, k, v, bias)


def kernel(draw: Any, dtype: torch.dtype, gen: torch.Generator) -> tuple[Fn, tuple[torch.Tensor, ...]]:
    q, k, v = _qkv(draw, dtype, gen)
    d = q.shape[-1]
    which = draw(st.sampled_from(["fourier", "fourier-heads", "periodic", "rbf"]))
    p = draw(st.sampled_from([None, 1.0, 1.5, 2.0]))
    mask = _key_padding(draw, q, k)
    r = draw(st.sampled_from([1, 4, 8, 16]))
    if which == "fourier":
        points = torch.randn(r, d, generator=gen, dtype=dtype)
    elif which == "fourier-heads":
        points = torch.randn(q.shape[1], r, d, generator=gen, dtype=dtype)
    else:
        points = torch.zeros(1, dtype=dtype)

    def fn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, points: torch.Tensor) -> torch.Tensor:
        if which.startswith("fourier"):
            kern: kernels.Kernel = kernels.RandomFourier(points)
        elif which == "periodic":
            kern = kernels.Periodic(period=2.0)
        else:
            kern = kernels.RBF()
        return attnopt.kernel_attention(q, k, v, kernel=kern, magnitude_p=p, attn_mask=mask)

    return fn, (q, k, v, points)


CASES: dict[str, Callable[[Any, torch.dtype, torch.Generator], tuple[Fn, tuple[torch.Tensor, ...]]]] = {
    "dnas": dnas, "sparse_attention": sparse_attention, "sparse_map": sparse_map, "generalized": generalized,
    "kernel": kernel,
}


def module(draw: Any, dtype: torch.dtype, gen: torch.Generator) -> tuple[Fn, tuple[torch.Tensor, ...]]:
    """A registry module (sampled spectral points, seeded noise, T5 / ALiBi biases) in train or eval."""
    import attnopt.nn as ann

    name = draw(st.sampled_from(["ikan", "mikan", "ika-ns", "ika-s", "ikan-direct", "t5", "alibi", "dnas",
                                 "sparsemax", "expsin"]))
    heads = draw(st.sampled_from([1, 2, 4]))
    embed = heads * draw(st.sampled_from([1, 4, 8, 16]))
    b, n = draw(st.integers(1, 3)), draw(LENGTHS)
    x = torch.randn(b, n, embed, generator=gen, dtype=dtype)
    pad = torch.zeros(b, n, dtype=torch.bool)
    if draw(st.booleans()):
        for i in range(b):
            pad[i, draw(st.integers(1, n)):] = True
    train = draw(st.booleans())
    seed = draw(st.integers(0, 2**31 - 1))

    def fn(x: torch.Tensor) -> torch.Tensor:
        torch.manual_seed(seed)  # the same parameters and noise stream on every run
        mod = ann.make_attention(name, embed, heads).to(dtype).train(train)
        out = mod(x, key_padding_mask=pad)
        return out[0] if isinstance(out, tuple) else out

    return fn, (x,)


CASES["module"] = module
