"""The shared entry policy (attnopt._validation): broadcasting, non-finite inputs, empty sizes."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from attnopt._validation import broadcast_shapes, check_finite, empty_attention, validate_attention

_shape = st.lists(st.integers(0, 3), max_size=4).map(tuple)


@given(st.lists(_shape, min_size=1, max_size=3))
def test_broadcast_shapes_agrees_with_torch(shapes):
    try:
        expected: tuple | str = tuple(torch.broadcast_shapes(*shapes))
    except RuntimeError:
        expected = "error"
    try:
        got: tuple | str = broadcast_shapes(*shapes)
    except RuntimeError:
        got = "error"
    assert got == expected


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
def test_check_finite_names_the_argument(value, dtype):
    ok, bad = torch.randn(2, 3).to(dtype), torch.randn(2, 3).to(dtype)
    bad[1, 2] = value
    check_finite(q=ok, k=None, v=torch.empty(0, 3, dtype=dtype))
    with pytest.raises(ValueError, match=r"^k contains NaN"):
        check_finite(q=ok, k=bad, v=ok)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16])
def test_check_finite_tells_an_overflowing_sum_from_a_non_finite_entry(dtype):
    """The check sums each tensor: finite entries whose sum overflows pass (an exact second
    look), +inf next to -inf (a NaN sum) and a lone NaN among huge values are rejected."""
    big = torch.finfo(dtype).max
    huge = torch.full((4, 8), big, dtype=dtype)
    assert not torch.isfinite(huge.sum(dtype=torch.float64 if dtype == torch.float64 else torch.float32)) \
        or dtype == torch.float16  # float16 sums in float32 and does not overflow
    check_finite(q=huge, k=-huge, v=torch.arange(6).view(2, 3))
    for bad_values in ([float("inf"), float("-inf")], [float("nan"), big]):
        bad = huge.clone()
        bad[0, :2] = torch.tensor(bad_values, dtype=dtype)
        with pytest.raises(ValueError, match=r"^v contains NaN"):
            check_finite(q=huge, k=None, v=bad)


def test_validate_attention_rejects_a_mask_with_the_accepted_shapes():
    q = torch.randn(2, 3, 4, 5)
    with pytest.raises(ValueError, match=r"accepted: .*\(Nk,\)"):
        validate_attention(q, q, q, torch.ones(3, dtype=torch.bool))
    with pytest.raises(TypeError, match="attn_mask"):
        validate_attention(q, q, q, torch.ones(4, dtype=torch.int64))
    assert validate_attention(q, q, q, torch.ones(4, dtype=torch.bool)) == (4, 4, 5)


def test_empty_attention_shapes_and_zero_gradients():
    q = torch.randn(2, 1, 3, 4, requires_grad=True)
    k = torch.randn(2, 1, 0, 4, requires_grad=True)
    v = torch.randn(1, 1, 0, 6, requires_grad=True)
    out = empty_attention(q, k, v)
    assert out is not None and out.shape == (2, 1, 3, 6) and not out.any()
    out.sum().backward()
    assert torch.equal(q.grad, torch.zeros_like(q)) and k.grad.shape == k.shape and v.grad.shape == v.shape
    assert empty_attention(q, q, q) is None


@pytest.fixture(params=["native", "torch"])
def finite_path(request, monkeypatch):
    """Run a check_finite test on the C kernel (``_native/finite.c``) and on the PyTorch path."""
    from attnopt import _native, _validation

    if request.param == "native":
        monkeypatch.delenv("ATTNOPT_NATIVE", raising=False)
        if _native.library("finite") is None:
            pytest.skip("no C compiler")
    else:
        monkeypatch.setenv("ATTNOPT_NATIVE", "0")
        monkeypatch.setattr(_native, "_LIBS", {})
    monkeypatch.setattr(_validation, "_FINITE", [None, None])
    yield request.param
    assert (_validation._FINITE[1] is None) == (request.param == "torch")  # the path meant was taken


def _layouts(dtype):
    """(name, tensor builder from a contiguous base) pairs: contiguous, transposed, sliced, expanded,
    5-D (the fallback even on the native path), and a flat size that is no multiple of 16."""
    return [
        ("contiguous", lambda: torch.randn(3, 5, 7, 11, dtype=dtype), lambda t: t),
        ("flat-odd", lambda: torch.randn(37, dtype=dtype), lambda t: t),
        ("transposed", lambda: torch.randn(2, 9, 3, 5, dtype=dtype), lambda t: t.transpose(1, 2)),
        ("sliced", lambda: torch.randn(4, 6, 13, dtype=dtype), lambda t: t[1:, ::2, 3:11]),
        ("expanded", lambda: torch.randn(1, 5, 19, dtype=dtype), lambda t: t.expand(3, 5, 19)),
        ("5-D", lambda: torch.randn(2, 2, 3, 2, 5, dtype=dtype), lambda t: t),
    ]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_check_finite_every_position_and_layout(finite_path, dtype):
    """NaN / ±inf at the first, a middle and the last entry of the view (and nowhere else in the
    base) is found in every layout; an entry of the base outside the view is not looked at."""
    for layout, make, view in _layouts(dtype):
        base = make()
        x = view(base)
        check_finite(q=x, k=x, v=None)
        flat_index = torch.arange(base.numel()).view(base.shape)
        seen = view(flat_index).reshape(-1)
        for pos in (0, seen.numel() // 2, seen.numel() - 1):
            for value in (float("nan"), float("inf"), float("-inf")):
                bad_base = base.clone()
                bad_base.view(-1)[seen[pos]] = value
                with pytest.raises(ValueError, match=r"^k contains NaN or ±inf"):
                    check_finite(q=x, k=view(bad_base), v=x)
        outside = sorted(set(range(base.numel())) - set(seen.tolist()))
        if outside:  # a NaN in the storage but not in the view is no error
            bad_base = base.clone()
            bad_base.view(-1)[outside[0]] = float("nan")
            check_finite(q=view(bad_base), k=None, v=None)
        assert layout  # (named for the failure message)


def test_check_finite_empty_huge_and_grad_tensors(finite_path):
    big = torch.finfo(torch.float32).max
    check_finite(q=torch.empty(0, 4), k=torch.empty(2, 0, 3).transpose(0, 1), v=torch.full((5, 17), big))
    x = torch.randn(2, 3, 4, requires_grad=True)
    check_finite(q=x, k=x * 2, v=torch.arange(6).view(2, 3))
    bad = x.detach().clone()
    bad[-1, -1, -1] = float("nan")
    with pytest.raises(ValueError, match=r"^v contains"):
        check_finite(q=x, k=None, v=bad.requires_grad_())


def _checked_sum(a):
    check_finite(q=None, k=a, v=None)
    return a.sum()


def test_check_finite_under_torch_func_transforms(finite_path):
    """Under vmap / grad / jvp / jacrev / functionalize (nested too) the values under the wrappers
    are checked: finite input passes, a NaN raises the ValueError (``.item()`` on a vmapped tensor
    was a RuntimeError: "vmap: It looks like you're calling .item() on a Tensor")."""
    from torch import func

    x = torch.randn(3, 4, 5, dtype=torch.float64)
    bad = x.clone()
    bad[1, 2, 3] = float("nan")
    runs = {
        "vmap": lambda a: func.vmap(_checked_sum)(a),
        "vmap-vmap": lambda a: func.vmap(func.vmap(_checked_sum))(a),
        "vmap 5-D": lambda a: func.vmap(_checked_sum)(a.expand(2, 3, 3, 4, 5)),
        "grad": lambda a: func.grad(_checked_sum)(a),
        "vmap-grad": lambda a: func.vmap(func.grad(_checked_sum))(a),
        "jvp": lambda a: func.jvp(_checked_sum, (a,), (torch.ones_like(a),))[1],
        "jacrev": lambda a: func.jacrev(_checked_sum)(a),
        "functionalize": lambda a: func.functionalize(_checked_sum)(a),
    }
    for name, run in runs.items():
        out = run(x)
        assert torch.isfinite(out).all(), name
        with pytest.raises(ValueError, match=r"^k contains NaN or ±inf"):
            run(bad)
            pytest.fail(name)


def test_check_finite_skips_tensors_without_values(finite_path):
    """Meta and fake tensors have no values to read: the check is skipped (was a RuntimeError)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    check_finite(q=torch.empty(2, 3, 4, device="meta"), k=torch.empty(9, device="meta"), v=None)
    with FakeTensorMode():
        check_finite(q=torch.randn(2, 3, 4), k=torch.randn(2, 3, 4, dtype=torch.float16), v=None)
    from attnopt._validation import any_nonfinite

    assert not any_nonfinite(torch.empty(3, device="meta"))
    assert func_vmap_any_nonfinite(torch.tensor([[1.0, float("inf")]]))


def func_vmap_any_nonfinite(x):
    from attnopt._validation import any_nonfinite

    seen = []
    torch.func.vmap(lambda a: seen.append(any_nonfinite(a)) or a)(x)
    return seen[0]


@pytest.mark.parametrize("op", ["generalized", "regularized"])
def test_public_ops_under_vmap_and_grad(finite_path, op):
    """The attention ops under torch.vmap equal the batched call, under torch.func.grad the
    autograd gradient; a NaN in one vmapped example is the usual ValueError."""
    from attnopt.functional import generalized_attention, regularized_attention

    fn = generalized_attention if op == "generalized" else regularized_attention
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(3, 2, 4, 8, dtype=torch.float64, generator=g) for _ in range(3))
    torch.testing.assert_close(torch.func.vmap(fn)(q, k, v), fn(q, k, v))
    dq = torch.func.grad(lambda a: fn(a, k, v).square().sum())(q)
    qr = q.clone().requires_grad_()
    fn(qr, k, v).square().sum().backward()
    torch.testing.assert_close(dq, qr.grad)
    bad = q.clone()
    bad[2, 1, 0, 0] = float("inf")
    with pytest.raises(ValueError, match=r"^q contains NaN or ±inf"):
        torch.func.vmap(fn)(bad, k, v)
    with pytest.raises(ValueError, match=r"^q contains NaN or ±inf"):
        torch.func.grad(lambda a: fn(a, k, v).sum())(bad)
