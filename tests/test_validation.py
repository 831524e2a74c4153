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
