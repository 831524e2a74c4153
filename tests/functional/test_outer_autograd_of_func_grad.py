"""Ordinary autograd around ``torch.func.grad``: second derivatives of a transformed function.

``torch.autograd.grad(h(x), x)`` with ``h(x) = <torch.func.grad(f)(x), w>`` and ``x`` requiring
grad differentiates the backward that ran inside the transform. A closed-form backward that
is first order only there (the L^p magnitude's, which reused forward intermediates without
history) gave silently wrong second derivatives (12–39 % off); SDPA's CPU flash kernel, called
inside the transform, refused them. Checked in float64 against central differences of ``h``
along a random direction, for every functional op and a registry module per mechanism family.
"""
from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import Tensor, func

import attnopt.functional as AF
from attnopt.kernels import RBF, NonStationaryFourier, RandomFourier
from attnopt.nn import make_attention
from attnopt.nn.registry import attention_names

pytestmark = pytest.mark.filterwarnings("ignore:There is a performance drop:UserWarning")
D = torch.float64
Q = (2, 2, 5, 4)


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


_RFF = RandomFourier(torch.randn(8, 4, dtype=D, generator=torch.Generator().manual_seed(3)))
_NSF = NonStationaryFourier(*torch.randn(2, 8, 4, dtype=D, generator=torch.Generator().manual_seed(4)))
OPS: dict[str, tuple[Callable[..., Tensor], tuple[tuple[int, ...], ...]]] = {
    "entmax-1.5": (lambda x: AF.entmax(x, alpha=1.5), ((3, 7),)),
    "dnas": (lambda q, k, v: AF.doubly_normalized_attention(q, k, v), (Q, Q, Q)),
    "sinkhorn-3": (lambda q, k, v: AF.doubly_normalized_attention(q, k, v, iterations=3), (Q, Q, Q)),
    "hnas": (lambda q, k, v: AF.hybrid_normalized_attention(q, k, v, torch.tensor(0.3, dtype=D)), (Q, Q, Q)),
    "sparsemax-attention": (lambda q, k, v: AF.regularized_attention(q, k, v, regularizer=AF.SquaredL2()),
                            (Q, Q, Q)),
    "entmax-attention": (lambda q, k, v: AF.regularized_attention(q, k, v, regularizer=AF.Tsallis(1.5)),
                         (Q, Q, Q)),
    "softmax-attention": (lambda q, k, v: AF.regularized_attention(q, k, v), (Q, Q, Q)),
    "generalized": (lambda q, k, v, b: AF.generalized_attention(q, k, v, log_preference=b),
                    (Q, Q, Q, (1, 2, 5, 5))),
    "rbf-p2 (sdpa)": (lambda q, k, v: AF.kernel_attention(q, k, v, kernel=RBF()), (Q, Q, Q)),
    "rbf-p1.5": (lambda q, k, v: AF.kernel_attention(q, k, v, kernel=RBF(), magnitude_p=1.5), (Q, Q, Q)),
    "rff-p1.5": (lambda q, k, v: AF.kernel_attention(q, k, v, kernel=_RFF, magnitude_p=1.5), (Q, Q, Q)),
    "nsf-p1.5": (lambda q, k, v: AF.kernel_attention(q, k, v, kernel=_NSF, magnitude_p=1.5), (Q, Q, Q)),
    "nsf-p1.5-linear": (
        lambda q, k, v: AF.kernel_attention(q, k, v, kernel=_NSF, magnitude_p=1.5, mode="linear"), (Q, Q, Q)),
    "nsf-p1.5-linear-causal": (
        lambda q, k, v: AF.kernel_attention(q, k, v, kernel=_NSF, magnitude_p=1.5, mode="linear",
                                            is_causal=True), (Q, Q, Q)),
}


@pytest.mark.parametrize("name", list(OPS))
def test_functional_op(name):
    f, shapes = OPS[name]
    _second_derivative_matches(f, *shapes)


@pytest.mark.parametrize("name", [n for n in attention_names() if n != "ot"])
def test_registry_module_input_second_derivative(name):
    """Every registry module (``ot`` pools, no per-token output); MEM's closed form is first
    order: it raises when the second derivative is asked for (below)."""
    torch.manual_seed(0)
    opts = {"seed": 0} if name.startswith(("ika", "mika")) else {}
    mod = make_attention(name, 8, 2, **opts).to(D).eval()
    with torch.no_grad():  # off the initialization (zero last layers)
        for p in mod.parameters():
            p.add_(0.3 * torch.randn_like(p))
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
