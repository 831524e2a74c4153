"""The C passes of the materialized biased softmax (``_generalized_native``, ``_native/biased_softmax.c``)
and their PyTorch fallback: the T5 bias read through its per-offset values, thread splits of
the bias gradient, float32 against the float64 reference, the C exponential, and the
fallback for tensors without storage."""
from __future__ import annotations

import ctypes

import pytest
import torch

from attnopt import _native
from attnopt.functional import generalized
from attnopt.functional._thresholds import THRESHOLDS
from attnopt.functional.generalized import cpu as native
from attnopt.functional.generalized import generalized_attention
from attnopt.functional.generalized._toeplitz import mark_toeplitz, toeplitz_offsets
from attnopt.nn.preference import T5RelativePreference
from tests._marks import needs_native
from tests.reference.generalized import generalized_attention_ref


def _qkv(b, h, nq, nk, d=4, dv=3, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(b, h, n, e, generator=g, dtype=dtype).requires_grad_()
            for n, e in ((nq, d), (nk, d), (nk, dv))]


@pytest.fixture
def calls(monkeypatch):
    """The ``toeplitz`` flag of every call of the native node."""
    seen: list[bool] = []
    real = native._NativeBiasedSoftmax.apply

    def spy(*args):
        seen.append(args[-1])
        return real(*args)

    monkeypatch.setattr(native._NativeBiasedSoftmax, "apply", spy)
    return seen


@pytest.mark.parametrize("nq,nk,threads,causal,chunk", [
    (6, 9, 1, True, "heads"), (9, 6, 1, True, "heads"), (9, 6, 1, False, "rows"), (40, 48, 2, False, "heads"),
    (40, 48, 2, True, "rows")])
def test_t5_bias_through_its_offsets_matches_reference(
    monkeypatch, native_or_torch, calls, nq, nk, threads, causal, chunk
):
    # chunks of a few heads across batches, or blocks of 7 query rows of one head
    chunk_bytes = nq * nk * 8 * 3 if chunk == "heads" else nk * 8 * 7 // threads
    monkeypatch.setattr(THRESHOLDS, "generalized_cpu_chunk_bytes", chunk_bytes)
    monkeypatch.setattr(THRESHOLDS, "native_parallel_min_entries", 0)  # split rows over threads here
    t5 = T5RelativePreference(3, num_buckets=8, max_distance=16).double()
    q, k, v = _qkv(2, 3, nq, nk, seed=1)
    weight = t5.relative_attention_bias.weight
    torch.set_num_threads(threads)
    try:
        bias = t5(nq, nk)
        out = generalized_attention(q, k, v, log_preference=bias, is_causal=causal, impl="materialized")
        go = torch.randn_like(out)
        grads = torch.autograd.grad(out, (q, k, v, weight), go)
    finally:
        torch.set_num_threads(1)
    assert calls == ([True] if native_or_torch == "native" else [])
    ref_bias = t5(nq, nk).detach().requires_grad_()
    ref = generalized_attention_ref(q, k, v, attn_mask=ref_bias, is_causal=causal)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-12)
    rq, rk, rv, rb = torch.autograd.grad(ref, (q, k, v, ref_bias), go)
    (rw,) = torch.autograd.grad(t5(nq, nk), weight, rb)  # the bias gradient taken to the bucket table
    for a, r in zip(grads, (rq, rk, rv, rw)):
        torch.testing.assert_close(a, r, rtol=1e-9, atol=1e-11)


def test_t5_offsets_gradcheck(native_or_torch, calls):
    t5 = T5RelativePreference(2, num_buckets=8, max_distance=16).double()
    q, k, v = _qkv(2, 2, 3, 5, seed=2)
    assert torch.autograd.gradcheck(
        lambda q, k, v: generalized_attention(q, k, v, log_preference=t5(3, 5), impl="materialized"),
        (q, k, v))
    buckets = t5._buckets(3, 5, q.device)[0]

    def through_table(w):  # the native node takes the offsets, the PyTorch path the bias: one gradient
        offsets = w.index_select(0, buckets).t().contiguous()
        bias = mark_toeplitz(offsets.unfold(-1, 5, 1).flip(-2).contiguous()[None], offsets)
        return generalized_attention(q, k, v, log_preference=bias, impl="materialized")

    w = t5.relative_attention_bias.weight.detach().clone().requires_grad_()
    assert torch.autograd.gradcheck(through_table, (w,))
    assert all(calls) and (native_or_torch == "torch") == (not calls)


def test_offsets_are_dropped_after_an_inplace_change_or_a_sum(native_or_torch, calls):
    offsets = torch.randn(2, 8, dtype=torch.float64)
    bias = mark_toeplitz(offsets.unfold(-1, 5, 1).flip(-2).contiguous()[None], offsets)
    assert toeplitz_offsets(bias) is offsets
    assert toeplitz_offsets(bias + 0.0) is None
    bias[0, 0, 1, 1] = 5.0  # no longer Toeplitz: the node must read the tensor itself
    assert toeplitz_offsets(bias) is None
    q, k, v = _qkv(1, 2, 4, 5, seed=3)
    out = generalized_attention(q, k, v, log_preference=bias.requires_grad_(), impl="materialized")
    torch.testing.assert_close(out, generalized_attention_ref(q, k, v, attn_mask=bias))
    assert calls == ([False] if native_or_torch == "native" else [])
    with pytest.raises(ValueError, match="offsets"):
        mark_toeplitz(torch.zeros(1, 2, 4, 5), torch.zeros(2, 7))


@pytest.mark.parametrize("bias_shape", [(1, 4, 16, 24), (2, 1, 16, 24), (2, 4, 1, 24)])
def test_bias_gradient_split_over_threads(monkeypatch, native_or_torch, bias_shape):
    monkeypatch.setattr(THRESHOLDS, "native_parallel_min_entries", 0)
    q, k, v = _qkv(2, 4, 16, 24, seed=4)
    bias = torch.randn(bias_shape, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    bias[..., 3] = float("-inf")  # a dropped key
    bias.requires_grad_()
    torch.set_num_threads(2)
    try:
        out = generalized.biased_softmax_attention(q, k, v, bias, 0.5)
        go = torch.randn_like(out)
        grads = torch.autograd.grad(out, (q, k, v, bias), go)
    finally:
        torch.set_num_threads(1)
    ref = generalized_attention_ref(q, k, v, attn_mask=bias, scale=0.5)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-12)
    for a, r in zip(grads, torch.autograd.grad(ref, (q, k, v, bias), go)):
        torch.testing.assert_close(a, r, rtol=1e-9, atol=1e-11)


@pytest.mark.parametrize("save_bytes", [1 << 40, 0], ids=["E-saved", "E-recomputed"])
def test_float32_matches_float64_reference(monkeypatch, native_or_torch, save_bytes):
    monkeypatch.setattr(THRESHOLDS, "generalized_save_bytes", save_bytes)
    q, k, v = _qkv(2, 3, 33, 40, d=8, dv=8, seed=6)
    bias = torch.randn(1, 3, 33, 40, dtype=torch.float64, generator=torch.Generator().manual_seed(7)) * 3
    bias[0, 1, 5] = float("-inf")  # a row with no admissible key: zeros, zero gradients
    bias.requires_grad_()
    leaves = [t.detach().float().requires_grad_() for t in (q, k, v, bias)]
    out = generalized.biased_softmax_attention(*leaves, 0.35)
    ref = generalized_attention_ref(q, k, v, attn_mask=bias, scale=0.35)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-6)
    assert torch.equal(out[:, 1, 5], torch.zeros_like(out[:, 1, 5]))
    go = torch.randn_like(ref)
    got = torch.autograd.grad(out, leaves, go.float())
    for a, r in zip(got, torch.autograd.grad(ref, (q, k, v, bias), go)):
        assert torch.isfinite(a).all()
        torch.testing.assert_close(a.double(), r, rtol=1e-4, atol=1e-5)
    assert torch.equal(got[3][0, 1, 5], torch.zeros_like(got[3][0, 1, 5]))


@needs_native
def test_c_exponential_against_torch():
    lib = _native.library("biased_softmax")
    assert lib is not None
    x = torch.cat([torch.linspace(-86.9, 0.0, 20001), torch.tensor([-87.5, -1e4, float("-inf")])])
    y = x.clone()
    lib.bs_exp_f32(_native.pointer(y), ctypes.c_int64(0), ctypes.c_int64(y.numel()))
    torch.testing.assert_close(y[:-3], torch.exp(x[:-3]), rtol=3e-7, atol=0.0)
    assert torch.all(y[:-3] >= torch.finfo(torch.float32).tiny)  # never subnormal
    assert torch.equal(y[-3:], torch.zeros(3))


def test_tensors_without_storage_take_the_pytorch_path():
    seen = []

    def f(b):
        seen.append(native.library(b, b))
        return b.sum()

    torch.func.grad(f)(torch.randn(1, 2, 3, 3))  # functorch-wrapped: no data pointer for C
    assert seen == [None]


def test_learned_bias_leaves_sdpa_earlier_on_the_c_path(native_or_torch):
    from attnopt.functional import dispatch

    q, k, v = _qkv(1, 2, 100, 100, dtype=torch.float32)  # 2·10^4 scores: between 2^14 and 2^17
    t5 = T5RelativePreference(2)
    generalized_attention(q, k, v, log_preference=t5(100, 100)).sum().backward()
    expected = "materialized" if native_or_torch == "native" else "streaming"
    assert dispatch.last_dispatch["generalized"] == expected


@pytest.mark.parametrize("causal", [False, True])
def test_alibi_bias_through_its_offsets_matches_reference(native_or_torch, calls, causal):
    from attnopt.nn.preference import ALiBiPreference

    alibi = ALiBiPreference(2, slopes=torch.tensor([40.0, 0.5]))  # steep: weights far below the normal range
    q, k, v = _qkv(2, 2, 7, 9, seed=9)
    log_u = alibi.log_preference(q, k)
    out = generalized_attention(q, k, v, log_preference=log_u, is_causal=causal, impl="materialized")
    ref = generalized_attention_ref(q, k, v, attn_mask=log_u, is_causal=causal)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-12)
    go = torch.randn_like(out)
    for a, r in zip(torch.autograd.grad(out, (q, k, v), go), torch.autograd.grad(ref, (q, k, v), go)):
        torch.testing.assert_close(a, r, rtol=1e-9, atol=1e-11)
    assert calls == ([True] if native_or_torch == "native" else [])


def test_constant_bias_takes_the_node_up_to_the_native_crossover(monkeypatch, native_or_torch):
    from attnopt.functional import dispatch

    monkeypatch.setattr(THRESHOLDS, "generalized_sdpa_below", 0)
    monkeypatch.setattr(THRESHOLDS, "generalized_native_min_head_scores", 36)
    monkeypatch.setitem(dispatch.CROSSOVERS, "generalized", {"float32": 1, "float64": 1, "half": 1})
    q, k, v = _qkv(1, 2, 6, 6)
    bias = torch.randn(1, 2, 6, 6, dtype=torch.float64)
    for limit, on_c in ((72, "materialized"), (71, "streaming")):
        monkeypatch.setattr(THRESHOLDS, "generalized_native_crossover", limit)
        out = generalized_attention(q, k, v, log_preference=bias)
        out.sum().backward()
        assert dispatch.last_dispatch["generalized"] == (on_c if native_or_torch == "native" else "streaming")
        torch.testing.assert_close(out, generalized_attention_ref(q, k, v, attn_mask=bias))
    # heads too small: the flash kernel
    monkeypatch.setattr(THRESHOLDS, "generalized_native_min_head_scores", 37)
    generalized_attention(q, k, v, log_preference=bias).sum().backward()
    assert dispatch.last_dispatch["generalized"] == "streaming"


def test_forward_only_calls_take_the_node_from_the_native_head_size(monkeypatch, native_or_torch, calls):
    from attnopt.functional import dispatch

    q, k, v = (x.detach() for x in _qkv(2, 2, 6, 7))
    bias = torch.randn(1, 2, 6, 7, dtype=torch.float64)
    bias[0, 1, 2] = float("-inf")  # a row with no key
    for limit, on_c in ((42, "materialized"), (43, "streaming")):
        monkeypatch.setattr(THRESHOLDS, "generalized_native_forward_min_head_scores", limit)
        with torch.no_grad():
            out = generalized_attention(q, k, v, log_preference=bias)
        assert dispatch.last_dispatch["generalized"] == (on_c if native_or_torch == "native" else "streaming")
        ref = generalized_attention_ref(q, k, v, attn_mask=bias)
        torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-12)
    assert calls == ([False] if native_or_torch == "native" else [])
