"""Ordinary autograd around ``torch.func.grad``: second derivatives of a transformed function.

``torch.autograd.grad(h(x), x)`` with ``h(x) = <torch.func.grad(f)(x), w>`` and ``x`` requiring
grad differentiates the backward that ran inside the transform. A closed-form backward that
is first order only there (the L^p magnitude's, which reused forward intermediates without
history) gave silently wrong second derivatives (12–39 % off); SDPA's CPU flash kernel, called
inside the transform, refused them. Checked in float64 against central differences of ``h``
along a random direction, for every functional op and registry module.
"""
from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import Tensor, func

from tests.functional._ad_cases import MODULES, OPS, D, Q, registry_module

pytestmark = pytest.mark.filterwarnings("ignore:There is a performance drop:UserWarning")


def _second_derivative_matches(f: Callable[..., Tensor], *shapes: tuple[int, ...]) -> None:
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(*s, dtype=D, generator=g) for s in shapes]
    ws = [torch.randn(*s, dtype=D, generator=g) for s in shapes]
    dirs = [torch.randn(*s, dtype=D, generator=g) for s in shapes]
    gout = torch.randn(f(*xs).shape, dtype=D, generator=g)

    def h(*a: Tensor) -> Tensor:
        grads = func.grad(lambda *b: (f(*b) * gout).sum(), argnums=tuple(range(len(a))))(*a)
        return sum((gi * wi).sum() for gi, wi in zip(grads, ws, strict=True))  # type: ignore[return-value]

    leaves = [x.clone().requires_grad_() for x in xs]
    analytic = torch.autograd.grad(h(*leaves), leaves, allow_unused=True)
    along = sum(((a if a is not None else torch.zeros_like(d)) * d).sum()
                for a, d in zip(analytic, dirs, strict=True))
    eps = 1e-5
    with torch.no_grad():
        fd = (h(*[x + eps * d for x, d in zip(xs, dirs, strict=True)])
              - h(*[x - eps * d for x, d in zip(xs, dirs, strict=True)])) / (2 * eps)
    assert float(abs(along - fd)) <= 1e-6 * max(1.0, float(abs(fd))), (float(along), float(fd))


@pytest.mark.parametrize("name", list(OPS))
def test_functional_op(name):
    f, shapes = OPS[name]
    _second_derivative_matches(f, *shapes)


@pytest.mark.parametrize("name", MODULES)
def test_registry_module_input_second_derivative(name):
    """MEM's closed form is first order: it raises when the second derivative is asked for."""
    mod = registry_module(name)
    if name == "mem":
        with pytest.raises(RuntimeError, match="first order only"):
            _second_derivative_matches(lambda x: mod(x)[0], (2, 5, 8))
        return
    _second_derivative_matches(lambda x: mod(x)[0], (2, 5, 8))


def test_mem_first_order_closed_form_raises_only_when_differentiated_again():
    """MEM's implicit-differentiation backward is first order: inside ``torch.func.grad`` with an
    input ordinary autograd tracks, the gradient is right, and asking for its derivative raises
    (it gave 15 % off second derivatives silently)."""
    from attnopt.dual import mem_attention

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(Q, dtype=D, generator=g) for _ in range(3))
    x = q.clone().requires_grad_()
    got = func.grad(lambda a: mem_attention(a, k, v).square().sum())(x)
    y = q.clone().requires_grad_()
    (ref,) = torch.autograd.grad(mem_attention(y, k, v).square().sum(), y)
    torch.testing.assert_close(got.detach(), ref, rtol=1e-9, atol=1e-12)
    with pytest.raises(RuntimeError, match="first order only"):
        torch.autograd.grad(got.sum(), x)
