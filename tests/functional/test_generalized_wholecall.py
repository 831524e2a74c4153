"""The whole-call C path of generalized attention (``_generalized_native.fused_attention``): a T5
or ALiBi bias at small sizes, the forward one C call and the backward one, the matrix products by
PyTorch's own BLAS (``attnopt._native.blas``) — against the float64 reference, gradcheck, both
sides of its crossover, the fallback without BLAS, input checks and the double-backward policy."""
from __future__ import annotations

import pytest
import torch

from attnopt import _native
from attnopt.functional import dispatch
from attnopt.functional._thresholds import THRESHOLDS
from attnopt.functional.generalized import generalized_attention
from attnopt.functional.generalized._toeplitz import mark_toeplitz_table
from attnopt.nn.preference import ALiBiPreference, T5RelativePreference, _T5Bias
from tests.reference.generalized import generalized_attention_ref

pytestmark = pytest.mark.skipif(_native.compiler() is None or _native.blas() is None,
                                reason="no C compiler or no BLAS in PyTorch's library")


def _qkv(b, h, nq, nk, d=4, dv=3, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(b, h, n, e, generator=g, dtype=dtype).requires_grad_()
            for n, e in ((nq, d), (nk, d), (nk, dv))]


def _module(kind, heads=3, dtype=torch.float64):
    if kind == "t5":
        return T5RelativePreference(heads, num_buckets=8, max_distance=16).to(dtype)
    slopes = torch.tensor([40.0, 0.5, 0.1][:heads])  # 40: weights far below the normal range
    return ALiBiPreference(heads, slopes=slopes).to(dtype)


def _check(mod, q, k, v, causal, fused=True, rtol=1e-10, atol=1e-12):
    """Output and gradients (q, k, v, T5's table) against the float64 reference on a copy of the bias."""
    bias = mod(q.shape[-2], k.shape[-2])
    out = generalized_attention(q, k, v, log_preference=bias, is_causal=causal)
    assert (dispatch.last_dispatch["generalized_kernel"] == "fused") == fused
    assert dispatch.last_dispatch["generalized"] == "materialized" or not fused
    copy = mod(q.shape[-2], k.shape[-2]).clone()  # a graph of its own to the table
    ref = generalized_attention_ref(q, k, v, attn_mask=copy, is_causal=causal)
    torch.testing.assert_close(out.double(), ref, rtol=rtol, atol=atol)
    leaves = (q, k, v, *mod.parameters())
    go = torch.randn_like(out)
    for a, r in zip(torch.autograd.grad(out, leaves, go), torch.autograd.grad(ref, leaves, go.double())):
        torch.testing.assert_close(a.double(), r.double(), rtol=100 * rtol, atol=100 * atol)


@pytest.mark.parametrize("kind", ["t5", "alibi"])
@pytest.mark.parametrize("nq,nk,causal", [(6, 9, False), (9, 6, True), (7, 7, True), (5, 5, False)])
def test_matches_reference(kind, nq, nk, causal):
    _check(_module(kind), *_qkv(2, 3, nq, nk, seed=nq), causal)


def test_without_blas_the_node_runs_and_agrees(monkeypatch):
    monkeypatch.setattr(_native, "_BLAS", [None])
    _check(_module("t5"), *_qkv(2, 3, 6, 9, seed=3), True, fused=False)


@pytest.mark.parametrize("kind", ["t5", "alibi"])
def test_threads_split_heads_and_sum_the_table_gradient(monkeypatch, kind):
    monkeypatch.setattr(THRESHOLDS, "native_parallel_min_entries", 0)
    torch.set_num_threads(2)
    try:
        _check(_module(kind), *_qkv(3, 3, 5, 7, seed=4), False)
    finally:
        torch.set_num_threads(1)


def test_float32_against_float64_and_strided_inputs():
    t5 = _module("t5", dtype=torch.float32)
    g = torch.Generator().manual_seed(5)
    # merged-head layout: (B, N, H, d) viewed as (B, H, N, d) (row stride H·d); dv != d
    q, k = (torch.randn(2, 12, 3, 8, generator=g).transpose(1, 2).requires_grad_() for _ in range(2))
    v = torch.randn(2, 12, 3, 5, generator=g).transpose(1, 2).requires_grad_()
    _check(t5, q, k, v, False, rtol=2e-5, atol=2e-6)


def test_fully_masked_rows_are_zero_with_zero_gradients():
    t5 = _module("t5")
    with torch.no_grad():
        t5.relative_attention_bias.weight[:, 1] = float("-inf")  # head 1: no admissible key anywhere
    q, k, v = _qkv(2, 3, 5, 6, seed=6)
    out = generalized_attention(q, k, v, log_preference=t5(5, 6))
    assert dispatch.last_dispatch["generalized_kernel"] == "fused"
    assert torch.equal(out[:, 1], torch.zeros_like(out[:, 1]))
    out.square().sum().backward()
    assert torch.equal(q.grad[:, 1], torch.zeros_like(q.grad[:, 1]))
    grad = t5.relative_attention_bias.weight.grad
    assert torch.equal(grad[:, 1], torch.zeros_like(grad[:, 1])) and torch.isfinite(grad).all()
    ref = generalized_attention_ref(q, k, v, attn_mask=t5(5, 6).detach())
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-12)


def test_gradcheck():
    t5 = _module("t5", heads=2)
    q, k, v = _qkv(1, 2, 4, 5, d=3, dv=2, seed=7)
    weight = t5.relative_attention_bias.weight.detach().clone().requires_grad_()
    buckets, index = t5._buckets(4, 5, weight.device)

    def f(q_, k_, v_, w_):  # T5's forward on the table w_
        bias = mark_toeplitz_table(_T5Bias.apply(w_, buckets, index, 4, 5), w_, buckets)
        out = generalized_attention(q_, k_, v_, log_preference=bias, is_causal=True)
        assert dispatch.last_dispatch["generalized_kernel"] == "fused"
        return out

    assert torch.autograd.gradcheck(f, (q, k, v, weight))


def test_crossover_both_sides(monkeypatch):
    q, k, v = _qkv(2, 3, 6, 6)
    t5 = _module("t5")
    size = 2 * 3 * 6 * 6
    for limit, head_limit, expected in ((size, 36, "fused"), (size - 1, 36, "node"), (size, 35, "node")):
        monkeypatch.setattr(THRESHOLDS, "generalized_wholecall_below", limit)
        monkeypatch.setattr(THRESHOLDS, "generalized_wholecall_max_head_scores", head_limit)
        monkeypatch.setattr(THRESHOLDS, "generalized_sdpa_below_learned_native", 0)
        out = generalized_attention(q, k, v, log_preference=t5(6, 6))
        assert dispatch.last_dispatch["generalized_kernel"] == expected
        torch.testing.assert_close(out, generalized_attention_ref(q, k, v, attn_mask=t5(6, 6).detach()))


def test_only_auto_under_autograd_with_a_marked_bias_takes_it():
    q, k, v = _qkv(1, 3, 5, 5)
    t5 = _module("t5")
    generalized_attention(q, k, v, log_preference=t5(5, 5), impl="materialized")
    assert dispatch.last_dispatch["generalized_kernel"] == "node"
    generalized_attention(q, k, v, log_preference=t5(5, 5).clone())  # a copy: no table
    assert dispatch.last_dispatch["generalized_kernel"] != "fused"
    with torch.no_grad():
        generalized_attention(q, k, v, log_preference=t5(5, 5))
    assert dispatch.last_dispatch["generalized_kernel"] != "fused"
    bias = t5(5, 5)
    with torch.no_grad():
        t5.relative_attention_bias.weight.add_(1.0)  # the table changed after the bias was built
    out = generalized_attention(q, k, v, log_preference=bias)
    assert dispatch.last_dispatch["generalized_kernel"] != "fused"
    torch.testing.assert_close(out, generalized_attention_ref(q, k, v, attn_mask=bias.detach()))


def test_a_bias_built_without_grad_gives_the_table_none():
    q, k, v = _qkv(1, 3, 5, 5)
    t5 = _module("t5")
    with torch.no_grad():
        bias = t5(5, 5)
    out = generalized_attention(q, k, v, log_preference=bias)
    assert dispatch.last_dispatch["generalized_kernel"] == "fused"
    out.sum().backward()
    assert t5.relative_attention_bias.weight.grad is None and q.grad is not None


@pytest.mark.parametrize("name", ["q", "k", "v"])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_inputs_raise_naming_them(name, value):
    qkv = dict(zip("qkv", _qkv(1, 3, 5, 5)))
    with torch.no_grad():
        qkv[name][0, 1, 2, 0] = value
    with pytest.raises(ValueError, match=f"^{name} contains NaN"):
        generalized_attention(qkv["q"], qkv["k"], qkv["v"], log_preference=_module("t5")(5, 5))


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_nan_or_plus_inf_in_the_table_raises(value):
    t5 = _module("t5")
    with torch.no_grad():
        t5.relative_attention_bias.weight[0, 0] = value  # bucket 0: offset 0, on every row
    with pytest.raises(ValueError, match="log_preference"):
        generalized_attention(*_qkv(1, 3, 5, 5), log_preference=t5(5, 5))


def test_double_backward_is_refused():
    q, k, v = _qkv(1, 3, 5, 5)
    out = generalized_attention(q, k, v, log_preference=_module("t5")(5, 5))
    assert dispatch.last_dispatch["generalized_kernel"] == "fused"
    with pytest.raises(RuntimeError, match="double backward"):
        torch.autograd.grad(out.sum(), q, create_graph=True)


def test_a_float32_table_with_float64_inputs():
    t5 = _module("t5", dtype=torch.float32)
    q, k, v = _qkv(1, 3, 5, 6)
    out = generalized_attention(q, k, v, log_preference=t5(5, 6))
    assert dispatch.last_dispatch["generalized_kernel"] == "fused" and out.dtype == torch.float64
    out.sum().backward()
    assert t5.relative_attention_bias.weight.grad.dtype == torch.float32


def test_blas_lookup(monkeypatch):
    found = _native.blas()
    assert found is not None and found.sgemm and found.dgemm
    monkeypatch.setenv("ATTNOPT_NATIVE", "0")
    assert _native.blas() is None
    q, k, v = _qkv(1, 3, 5, 5)
    generalized_attention(q, k, v, log_preference=_module("t5")(5, 5))
    assert dispatch.last_dispatch["generalized_kernel"] != "fused"


def test_blas_probe_rejects_a_missing_library_or_a_wrong_product(monkeypatch):
    monkeypatch.setattr(_native, "_torch_cpu_library", lambda: None)
    assert _native._find_blas() is None
    monkeypatch.undo()
    monkeypatch.setattr(_native, "_gemm_works", lambda fn, ctype: False)  # noqa: ARG005
    assert _native._find_blas() is None


def test_overlapping_rows_and_single_rows_are_laid_out_for_blas():
    t5 = _module("t5")
    g = torch.Generator().manual_seed(8)
    base = torch.randn(2, 3, 1, 4, generator=g, dtype=torch.float64)
    q = base.expand(2, 3, 5, 4).requires_grad_()  # row stride 0: rows overlap
    k, v = (torch.randn(2, 3, 6, e, generator=g, dtype=torch.float64).requires_grad_() for e in (4, 3))
    _check(t5, q, k, v, False)
    q1 = torch.randn(2, 3, 4, generator=g, dtype=torch.float64).as_strided((2, 3, 1, 4), (12, 4, 1, 1))
    assert q1.is_contiguous() and q1.stride(2) == 1  # one query row with a row stride of 1
    _check(t5, q1.requires_grad_(), k, v, True)


def test_dispatch_mode_takes_the_visible_path() -> None:
    """Under a dispatch mode (FLOP / memory counters) the products must be aten ops, not hidden in C."""
    from torch.utils.flop_counter import FlopCounterMode

    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 16, 8, requires_grad=True) for _ in range(3))
    bias = T5RelativePreference(2)(16, 16)
    with FlopCounterMode(display=False) as counter:
        generalized_attention(q, k, v, log_preference=bias).sum().backward()
    assert dispatch.last_dispatch.get("generalized_kernel") != "fused"
    assert counter.get_total_flops() >= 2 * 2 * 16 * 16 * 8 * 2  # QKᵀ and PV at least
