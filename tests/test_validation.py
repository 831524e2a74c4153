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
