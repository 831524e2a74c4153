"""Size-based dispatch (materialized vs streaming): both sides against the float64 reference."""
from __future__ import annotations

import contextlib

import entmax as entmax_pkg
import pytest
import torch

from attnopt.functional import dispatch, regularized
from attnopt.functional._thresholds import THRESHOLDS
from attnopt.functional.doubly_normalized import doubly_normalized_attention, hybrid_normalized_attention
from attnopt.functional.regularized import materialized as _sparse_attention_fused
from attnopt.functional.regularized import regularized_attention
from attnopt.functional.regularized.regularizers import SquaredL2, Tsallis
from tests.reference.doubly_normalized import attention_ref, hybrid_ref
from tests.reference.regularized import attention_reference, entmax_bisect_ref, sparsemax_sort


@contextlib.contextmanager
def crossover(mechanism: str, elements: int):
    saved = dict(dispatch.CROSSOVERS[mechanism])
    dispatch.CROSSOVERS[mechanism].update({key: elements for key in saved})
    try:
        yield
    finally:
        dispatch.CROSSOVERS[mechanism].update(saved)


def _qkv(nq, nk, b=2, h=3, d=4, dv=5, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(b, h, n, e, generator=g, dtype=dtype).requires_grad_()
            for n, e in ((nq, d), (nk, d), (nk, dv))]


def _full_mask(b, h, nq, nk):
    m = torch.rand(b, h, nq, nk, generator=torch.Generator().manual_seed(7)) > 0.3
    m[0, 0, 1, :] = False  # a fully masked row
    m[-1, -1, :, 0] = False  # a key nobody sees
    return m


def test_choose_impl_both_sides_of_default_crossovers():
    for mech, table in dispatch.CROSSOVERS.items():
        for dtype, key in ((torch.float32, "float32"), (torch.float64, "float64"), (torch.bfloat16, "half")):
            limit = table[key]
            n = int(limit**0.5)
            assert dispatch.choose_impl(mech, nq=n, nk=n, batch=1, dtype=dtype) == "materialized"
            assert dispatch.choose_impl(mech, nq=n + 1, nk=n + 1, batch=1, dtype=dtype) == "streaming"
            assert dispatch.choose_impl(mech, nq=n, nk=n, batch=2, dtype=dtype) == "streaming"
            assert dispatch.choose_impl(mech, nq=n + 1, nk=n + 1, impl="materialized") == "materialized"
    assert dispatch.choose_impl("doubly_normalized", nq=1024, nk=1024, batch=64) == "materialized"
    assert dispatch.choose_impl("doubly_normalized", nq=1024, nk=1024, batch=128) == "streaming"
    with pytest.raises(ValueError, match="impl"):
        dispatch.choose_impl("sparse", nq=4, nk=4, impl="fast")
    with pytest.raises(ValueError, match="mechanism"):
        dispatch.choose_impl("nope", nq=4, nk=4)
    q, k, v = _qkv(3, 3)
    with pytest.raises(ValueError, match="impl"):
        doubly_normalized_attention(q, k, v, impl="fast")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="impl"):
        regularized_attention(q, k, v, regularizer=SquaredL2(), impl="dense")  # type: ignore[arg-type]


@pytest.mark.parametrize("iterations", [1, 3])
@pytest.mark.parametrize("hybrid", [False, True])
def test_auto_dispatch_observable_and_both_sides_match_reference(iterations, hybrid):
    """Crossover set to 2·3·6·6 entries: Nq = Nk = 6 materializes, 7 streams; both match float64."""
    mech = "hybrid_normalized" if hybrid else ("doubly_normalized" if iterations == 1 else "sinkhorn")
    w = torch.tensor([0.2, 0.5, 0.9], dtype=torch.float64, requires_grad=True)
    with crossover(mech, 2 * 3 * 6 * 6):
        for n, expected in ((6, "materialized"), (7, "streaming")):
            for causal, use_mask in ((False, False), (True, False), (False, True), (True, True)):
                q, k, v = _qkv(n, n)
                mask = _full_mask(2, 3, n, n) if use_mask else None
                if hybrid:
                    out = hybrid_normalized_attention(q, k, v, w, iterations=iterations, attn_mask=mask,
                                                      causal="plan", is_causal=causal)
                    ref = hybrid_ref(q, k, v, w, iterations, mask=mask, is_causal=causal)
                    leaves = (q, k, v, w)
                else:
                    out = doubly_normalized_attention(q, k, v, iterations=iterations, attn_mask=mask,
                                                      causal="plan", is_causal=causal)
                    ref = attention_ref(q, k, v, iterations, mask=mask, is_causal=causal)
                    leaves = (q, k, v)
                assert dispatch.last_dispatch[mech] == expected
                torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-12)
                go = torch.randn_like(out)
                for a, b in zip(torch.autograd.grad(out, leaves, go), torch.autograd.grad(ref, leaves, go)):
                    torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11)


@pytest.mark.parametrize("iterations", [1, 2])
def test_materialized_gradcheck_rectangular_causal_and_hybrid(iterations):
    q, k, v = _qkv(4, 6, b=1, h=2, d=3, dv=2, seed=2)
    mask = _full_mask(1, 2, 4, 6)
    assert torch.autograd.gradcheck(
        lambda q, k, v: doubly_normalized_attention(q, k, v, iterations=iterations, attn_mask=mask,
                                                    impl="materialized"), (q, k, v), fast_mode=True)
    w = torch.tensor(0.3, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(
        lambda q, k, v, w: hybrid_normalized_attention(q, k, v, w, iterations=iterations,
                                                       causal="plan", is_causal=True,
                                                       impl="materialized"), (q, k, v, w), fast_mode=True)


def test_materialized_row_underflow_falls_back_to_log_domain():
    """A row dominated in every column (its ξ underflows in float32) still gets exact weights."""
    q, k, v = (x.detach() for x in _qkv(6, 6, b=1, h=1, dtype=torch.float32, seed=3))
    bias = torch.zeros(1, 1, 6, 6)
    bias[..., 2, :] = -200.0  # finite: the row is admissible, but exp(-200) underflows in float32
    out = doubly_normalized_attention(q, k, v, attn_mask=bias, impl="materialized")
    out3 = doubly_normalized_attention(q, k, v, attn_mask=bias, iterations=3, impl="materialized")
    ref = attention_ref(q.double(), k.double(), v.double(), 1, mask=bias.double())
    ref3 = attention_ref(q.double(), k.double(), v.double(), 3, mask=bias.double())
    assert torch.isfinite(out).all() and torch.isfinite(out3).all()
    torch.testing.assert_close(out.double(), ref, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(out3.double(), ref3, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_materialized_half_precision_finite(dtype):
    q, k, v = (x.detach().to(dtype).requires_grad_() for x in _qkv(8, 8, seed=4))
    out = doubly_normalized_attention(q * 6, k, v, iterations=2,
                                      causal="plan", is_causal=True, impl="materialized")
    sp = regularized_attention(q * 6, k, v, regularizer=Tsallis(1.5), impl="materialized")
    assert out.dtype == dtype and torch.isfinite(out).all() and torch.isfinite(sp).all()
    (out.float().sum() + sp.float().sum()).backward()
    assert all(torch.isfinite(x.grad).all() for x in (q, k, v))


def _oracle_map(reg):
    """The entmax package's float64 map (sort-based, exact gradient) with this repo's conventions:
    ``-inf`` gets 0 and a row that is entirely ``-inf`` gives zeros (and zero gradient)."""
    alpha = 2.0 if isinstance(reg, SquaredL2) else float(reg.alpha)

    def weights(s):
        empty = torch.isneginf(s).all(-1, keepdim=True)
        finite = s.masked_fill(torch.isneginf(s), -1e4)  # far below any threshold: weight exactly 0
        if alpha == 2.0:
            p = entmax_pkg.sparsemax(finite, dim=-1)
        elif alpha == 1.5:
            p = entmax_pkg.entmax15(finite, dim=-1)
        else:
            p = entmax_pkg.entmax_bisect(finite, alpha, dim=-1, n_iter=100)
        return p.masked_fill(empty, 0.0)

    return weights


def _check_sparse_against_oracle(reg, q, k, v, *, mask=None, causal=False, beta=None, rtol=1e-8, atol=1e-9,
                                 bisection=True):
    """Values against the float64 sort/bisection oracle of tests/reference (``bisection``) and the
    entmax package's float64 map, gradients (q, k, v, β) against the latter under autograd."""
    out = regularized_attention(q, k, v, regularizer=reg, attn_mask=mask, is_causal=causal, locality=beta)
    h, nq, nk = q.shape[-3], q.shape[-2], k.shape[-2]
    dist = (torch.arange(nq)[:, None] - torch.arange(nk)[None, :]).abs().to(q.dtype)
    bias = None if beta is None else -(beta.view(h, 1, 1) * dist)
    value_map = sparsemax_sort if isinstance(reg, SquaredL2) else (
        lambda s: entmax_bisect_ref(s, float(reg.alpha)))
    if bisection:
        with torch.no_grad():
            ref = attention_reference(q, k, v, value_map, mask=mask, bias=bias, causal=causal)
        torch.testing.assert_close(out, ref, rtol=rtol, atol=atol)
    oracle = attention_reference(q, k, v, _oracle_map(reg), mask=mask, bias=bias, causal=causal)
    torch.testing.assert_close(out, oracle, rtol=rtol, atol=atol)
    leaves = (q, k, v) if beta is None else (q, k, v, beta)
    go = torch.randn_like(out)
    for a, b in zip(torch.autograd.grad(out, leaves, go), torch.autograd.grad(oracle, leaves, go)):
        torch.testing.assert_close(a, b, rtol=rtol * 10, atol=atol * 10)
    return out


@pytest.mark.parametrize("reg", [SquaredL2(), Tsallis(1.5), Tsallis(1.3)], ids=["sparsemax", "1.5", "1.3"])
def test_sparse_auto_dispatch_both_sides_match_reference(reg):
    """Crossover at 2·3·6·6 entries: N = 6 materializes, 7 streams; values, gradients (q, k, v, β),
    masks with a fully masked row, causal, against float64 oracles."""
    beta = torch.tensor([0.1, 0.2, 0.3], dtype=torch.float64, requires_grad=True)
    with crossover("sparse", 2 * 3 * 6 * 6):
        for n, expected in ((6, "materialized"), (7, "streaming")):
            for causal, use_mask, loc in ((False, False, None), (True, True, None), (False, True, beta)):
                q, k, v = _qkv(n, n, seed=n)
                mask = _full_mask(2, 3, n, n) if use_mask else None
                out = _check_sparse_against_oracle(reg, q, k, v, mask=mask, causal=causal, beta=loc)
                assert dispatch.last_dispatch["sparse"] == expected
                if use_mask:
                    assert torch.equal(out[0, 0, 1], torch.zeros(5, dtype=torch.float64))  # fully masked row


@pytest.mark.parametrize("reg", [SquaredL2(), Tsallis(1.5)], ids=["sparsemax", "1.5"])
@pytest.mark.parametrize("spread", [0.02, 1.0, 30.0], ids=["dense-rows", "typical", "one-hot-rows"])
def test_sparse_materialized_row_blocks_match_reference(reg, spread, monkeypatch):
    """The in-place threshold search of the fused path over several row blocks (block shrunk to
    64 entries: 5 blocks of 8 rows), at score spreads where the support is every key, a few, or one."""
    monkeypatch.setattr(THRESHOLDS, "sparse_row_block_entries", 64)
    q, k, v = _qkv(20, 8, b=1, h=2, d=4, dv=3, seed=11)
    with torch.no_grad():
        q.mul_(spread)
    mask = torch.ones(20, 8, dtype=torch.bool)
    mask[5] = False  # a fully masked row
    out = _check_sparse_against_oracle(reg, q, k, v, mask=mask, causal=True)
    assert dispatch.last_dispatch["sparse"] == "materialized"
    assert torch.equal(out[:, :, 5], torch.zeros_like(out[:, :, 5]))


def test_sparse_explicit_block_size_keeps_blocked_path_and_gradcheck():
    q, k, v = _qkv(5, 6, b=1, h=2, d=3, dv=2, seed=5)
    regularized_attention(q, k, v, regularizer=SquaredL2(), block_size=2)
    assert dispatch.last_dispatch["sparse"] == "streaming"
    for reg in (SquaredL2(), Tsallis(1.5)):
        assert torch.autograd.gradcheck(
            lambda q, k, v, reg=reg: regularized_attention(q, k, v, regularizer=reg, is_causal=True,
                                                           impl="materialized"), (q, k, v), fast_mode=True)


def test_generalized_biased_paths_match_reference_and_dispatch(monkeypatch):
    from attnopt.functional.generalized import generalized_attention, generalized_weights

    monkeypatch.setattr(THRESHOLDS, "generalized_sdpa_below", 0)  # these tiny sizes would go to SDPA itself
    monkeypatch.setattr(THRESHOLDS, "generalized_sdpa_below_learned_native", 0)
    # the crossover below decides, C path or not
    monkeypatch.setattr(THRESHOLDS, "generalized_native_crossover", 0)

    q, k, v = _qkv(5, 7, seed=6)
    bias = torch.randn(1, 3, 5, 7, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    bias[..., 0, :] = float("-inf")  # a row that excludes every key
    for learned, elements, expected in ((True, -1, "materialized"), (False, 2 * 3 * 5 * 7, "materialized"),
                                        (False, 2 * 3 * 5 * 7 - 1, "streaming")):
        b = bias.clone().requires_grad_(learned)
        with crossover("generalized", elements):
            out = generalized_attention(q, k, v, log_preference=b, is_causal=True)
        assert dispatch.last_dispatch["generalized"] == expected
        ref = generalized_weights(q, k, log_preference=b, is_causal=True) @ v
        leaves = (q, k, v, b) if learned else (q, k, v)
        torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-12)
        assert torch.equal(out[:, :, 0], torch.zeros_like(out[:, :, 0]))
        go = torch.randn_like(out)
        for a, r in zip(torch.autograd.grad(out, leaves, go), torch.autograd.grad(ref, leaves, go)):
            torch.testing.assert_close(a, r, rtol=1e-9, atol=1e-11)
    with torch.no_grad():
        generalized_attention(q, k, v, log_preference=bias)
    assert dispatch.last_dispatch["generalized"] == "streaming"
    b = bias[..., 1:, :].clone().requires_grad_()
    assert torch.autograd.gradcheck(
        lambda q, k, v, b: generalized_attention(q[..., 1:, :], k, v, log_preference=b, impl="materialized"),
        (q, k, v, b), fast_mode=True)


def test_toeplitz_preferences_equal_the_elementwise_formulas():
    from attnopt.nn.preference import ALiBiPreference, T5RelativePreference, relative_position_bucket

    t5, alibi = T5RelativePreference(3), ALiBiPreference(3)
    for nq, nk in ((1, 1), (4, 9), (9, 4), (40, 40)):
        rel = torch.arange(nk)[None, :] - torch.arange(nq)[:, None]
        ref = t5.relative_attention_bias(relative_position_bucket(rel)).permute(2, 0, 1).unsqueeze(0)
        assert torch.equal(t5(nq, nk), ref)
        ref_a = -(alibi.slopes.view(3, 1, 1) * rel.abs().to(alibi.slopes.dtype)).unsqueeze(0)
        assert torch.equal(alibi(nq, nk), ref_a)
    w = torch.randn(1, 3, 6, 8)
    (t5(6, 8) * w).sum().backward()
    rel = torch.arange(8)[None, :] - torch.arange(6)[:, None]
    expected = torch.zeros_like(t5.relative_attention_bias.weight)
    expected.index_add_(0, relative_position_bucket(rel).flatten(), w[0].permute(1, 2, 0).reshape(-1, 3))
    torch.testing.assert_close(t5.relative_attention_bias.weight.grad, expected)


@pytest.mark.parametrize("nonstationary", [False, True])
def test_kernel_fused_both_sides_match_log_domain_weights(nonstationary):
    from attnopt.functional.kernel import kernel_attention, kernel_weights
    from attnopt.kernels import NonStationaryFourier, RandomFourier

    g = torch.Generator().manual_seed(8)
    if nonstationary:
        w1, w2 = (torch.randn(4, 4, generator=g, dtype=torch.float64).requires_grad_() for _ in range(2))
        kern, points = NonStationaryFourier(w1, w2), (w1, w2)
    else:
        w = torch.randn(4, 4, generator=g, dtype=torch.float64).requires_grad_()
        kern, points = RandomFourier(w), (w,)
    keys = torch.ones(2, 1, 1, 7, dtype=torch.bool)
    keys[1, ..., :3] = False
    with crossover("kernel", 2 * 3 * 6 * 7):
        for nq, expected in ((6, "materialized"), (7, "streaming")):
            q, k, v = _qkv(nq, 7, seed=nq)
            out = kernel_attention(q, k, v, kernel=kern, magnitude_p=1.5, attn_mask=keys)
            assert dispatch.last_dispatch["kernel"] == expected
            ref = kernel_weights(q, k, kernel=kern, magnitude_p=1.5, attn_mask=keys) @ v
            torch.testing.assert_close(out, ref, rtol=1e-9, atol=1e-11)
            leaves = (q, k, v, *points)
            go = torch.randn_like(out)
            for a, b in zip(torch.autograd.grad(out, leaves, go), torch.autograd.grad(ref, leaves, go)):
                torch.testing.assert_close(a, b, rtol=1e-8, atol=1e-10)
    q, k, v = _qkv(3, 4, b=1, h=2, seed=9)
    assert torch.autograd.gradcheck(lambda q, k, v: kernel_attention(q, k, v, kernel=kern), (q, k, v),
                                    fast_mode=True)


@pytest.mark.parametrize("reg", [SquaredL2(), Tsallis(1.5)], ids=["sparsemax", "1.5"])
@pytest.mark.parametrize("native", [True, False], ids=["c-map", "torch-search"])
def test_sparse_materialized_native_map_route_matches_reference(reg, native, monkeypatch):
    """Above sparse_native_min_entries the fused path runs the C map on the scores (threshold lowered to 0
    here): values and gradients (q, k, v, β) equal the oracles, masks, a fully masked row, causal;
    the in-place search below it (threshold raised) gives the same."""
    from attnopt.functional.regularized import cpu as _sparse_native

    if native and not _sparse_native.library_available():
        pytest.skip("no C compiler: the native map cannot be built")
    monkeypatch.setattr(THRESHOLDS, "sparse_native_min_entries", 0 if native else 1 << 62)
    q, k, v = _qkv(9, 7, b=1, h=2, d=4, dv=3, seed=12)
    mask = torch.ones(9, 7, dtype=torch.bool)
    mask[4] = False  # a fully masked row
    beta = torch.tensor([0.3, 0.1], dtype=torch.float64, requires_grad=True)
    out = _check_sparse_against_oracle(reg, q, k, v, mask=mask, causal=True, beta=beta)
    assert dispatch.last_dispatch["sparse"] == "materialized"
    assert _sparse_attention_fused._native_map(q.reshape(-1, 9, 4), 7, regularized._KERNELS) is native
    assert torch.equal(out[:, :, 4], torch.zeros_like(out[:, :, 4]))
