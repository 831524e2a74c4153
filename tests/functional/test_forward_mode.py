"""Forward-mode AD — ``torch.func.jvp`` and ``torch.autograd.forward_ad`` dual tensors — against
central differences (float64), for every functional op and registry module.

Found wrong before: the quadratic feature-kernel path squared the scores in place when nothing
required grad, and forward AD of ``mul_(f, f)`` on ``f`` itself is wrong (every IKA module and
the ``linear`` one, tangents 40–190 % off under ``jvp``); dual tensors have storage and no
``requires_grad``, so sparsemax / entmax attention took their no-grad C path and dropped the
tangent of the weights (150–250 % off). Now a forward-AD level makes every op take its plain
PyTorch path (:func:`attnopt.functional._autograd.under_transform`), the L^p magnitude has a
forward-mode rule, ``torch.cdist`` gives way to its matmul form, and MEM has a forward rule by
implicit differentiation (it raised before).
"""
from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.autograd.forward_ad as fwad
from torch import Tensor, func

from tests.functional._ad_cases import MODULES, OPS, D, registry_module

pytestmark = pytest.mark.filterwarnings("ignore:There is a performance drop:UserWarning")


def _dual(f: Callable[..., Tensor], xs: list[Tensor], ts: list[Tensor]) -> Tensor:
    with fwad.dual_level():
        out = f(*[fwad.make_dual(x, t) for x, t in zip(xs, ts, strict=True)])
        tangent = fwad.unpack_dual(out).tangent
    assert tangent is not None
    return tangent


def _jvp(f: Callable[..., Tensor], xs: list[Tensor], ts: list[Tensor]) -> Tensor:
    return func.jvp(f, tuple(xs), tuple(ts))[1]


def _tangent_matches(
    how: Callable[..., Tensor], f: Callable[..., Tensor], shapes: tuple[tuple[int, ...], ...],
    tol: float = 1e-6,
) -> None:
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(*s, dtype=D, generator=g) for s in shapes]
    ts = [torch.randn(*s, dtype=D, generator=g) for s in shapes]
    got = how(f, xs, ts)
    eps = 1e-6
    with torch.no_grad():
        fd = (f(*[x + eps * t for x, t in zip(xs, ts, strict=True)])
              - f(*[x - eps * t for x, t in zip(xs, ts, strict=True)])) / (2 * eps)
    torch.testing.assert_close(got, fd, rtol=0, atol=tol * max(1.0, float(fd.abs().max())))


HOW = {"torch.func.jvp": _jvp, "forward_ad": _dual}


@pytest.mark.parametrize("how", list(HOW))
@pytest.mark.parametrize("name", list(OPS))
def test_functional_op(name, how):
    f, shapes = OPS[name]
    _tangent_matches(HOW[how], f, shapes)


@pytest.mark.parametrize("how", list(HOW))
@pytest.mark.parametrize("name", MODULES)
def test_registry_module(name, how):
    mod = registry_module(name)
    # MEM: its Newton solve stops at tol = 1e-8 (the difference quotient sees that)
    _tangent_matches(HOW[how], lambda x: mod(x)[0], ((2, 5, 8),), 1e-5 if name == "mem" else 1e-6)


@pytest.mark.parametrize("how", list(HOW))
@pytest.mark.parametrize("n, d", [(5, 4), (5, 8)])  # Cholesky and low-rank (n < d) Hessian solves
def test_mem_attention_with_a_preference(how, n, d):
    """MEM's forward rule (implicit differentiation, the backward's Hessian solve): tangents in
    q, k, v and the log-preference."""
    from attnopt.dual import mem_attention

    q = (2, 2, n, d)
    _tangent_matches(HOW[how], lambda q_, k, v, b: mem_attention(q_, k, v, log_preference=b),
                     (q, q, q, (1, 2, n, n)), 1e-5)


def test_frozen_module_under_forward_ad_keeps_the_tangent():
    """Parameters that require no grad: the C paths (chosen when nothing requires grad) step aside
    while a dual level is open, so the input's tangent goes through."""
    mod = registry_module("sparsemax").requires_grad_(False)
    _tangent_matches(_dual, lambda x: mod(x)[0], ((2, 5, 8),))


@pytest.mark.parametrize("order", ["jacfwd(jacrev)", "jacrev(jacfwd)"])
def test_mem_hessian_mixes_its_forward_and_backward_rules(order):
    """``torch.func.hessian`` (forward over reverse) and reverse over forward of MEM agree with
    central differences of its gradient (the rules are exact implicit derivatives; reverse over
    reverse is refused: tests/functional/test_double_backward.py)."""
    from attnopt.dual import mem_attention

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 1, 4, 3, dtype=D, generator=g) for _ in range(3))

    def f(x: Tensor) -> Tensor:
        return mem_attention(x, k, v).square().sum()

    d = torch.randn(q.shape, dtype=D, generator=g)
    eps = 1e-5
    fd = (func.grad(f)(q + eps * d) - func.grad(f)(q - eps * d)) / (2 * eps)
    outer, inner = (func.jacfwd, func.jacrev) if order == "jacfwd(jacrev)" else (func.jacrev, func.jacfwd)
    hd = (outer(inner(f))(q).reshape(q.numel(), q.numel()) @ d.flatten()).reshape(q.shape)
    torch.testing.assert_close(hd, fd, rtol=0, atol=1e-6 * float(fd.abs().max()))


@pytest.mark.parametrize("shape", [(2, 1, 8), (1, 3, 8), (0, 5, 8), (2, 0, 8)])
@pytest.mark.parametrize("name", MODULES)
def test_registry_module_edge_sizes_under_forward_ad(name, shape):
    """One token, three tokens, an empty batch, empty sequences: dual tensors through every
    module (T5's one-token call took a node without a forward rule)."""
    mod = registry_module(name)
    g = torch.Generator().manual_seed(0)
    x, t = (torch.randn(*shape, dtype=D, generator=g) for _ in range(2))
    got = _dual(lambda a: mod(a)[0], [x], [t]) if x.numel() else None
    if got is None:
        with fwad.dual_level():
            out = mod(fwad.make_dual(x, t))[0]
        assert out.shape == x.shape
        return
    eps = 1e-6
    with torch.no_grad():
        fd = (mod(x + eps * t)[0] - mod(x - eps * t)[0]) / (2 * eps)
    torch.testing.assert_close(got, fd, rtol=0, atol=1e-5 * max(1.0, float(fd.abs().max())))
