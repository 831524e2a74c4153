"""Second derivatives are exact or refused, never silently wrong (the policy of ``_autograd``).

Every public op (one row of the sample-input table each), every registry attention, and every
internal path with its own ``torch.autograd.Function`` (forced by ``impl`` or a size threshold)
must, in float64 at tiny sizes, either pass ``gradgradcheck`` or raise a ``RuntimeError`` that
says double backward is unsupported. A closed-form backward that silently returns a wrong
second derivative makes ``gradgradcheck`` fail here.
"""
from __future__ import annotations

import ast
import pathlib
from collections.abc import Callable

import pytest
import torch
from torch import Tensor
from torch.autograd.gradcheck import GradcheckError

import attnopt
from attnopt import kernels
from attnopt import nn as ann
from attnopt.functional import SquaredL2, Tsallis
from attnopt.functional._thresholds import THRESHOLDS
from tests.test_sample_inputs import OPS, OpInfo

F64 = torch.float64
SRC = pathlib.Path(attnopt.__file__).parent


def _second_order(fn: Callable[..., Tensor], inputs: tuple[Tensor, ...]) -> str:
    """``"exact"`` when gradgradcheck passes, ``"refused"`` on the documented error; else fails."""
    try:
        torch.autograd.gradgradcheck(fn, inputs, fast_mode=True, atol=1e-5, rtol=1e-4)
    except GradcheckError:
        raise
    except RuntimeError as exc:  # ours, or PyTorch's own for SDPA's fused CPU flash kernel
        refused = "double backward" in str(exc) or "derivative for aten::" in str(exc)
        assert refused, f"not a double-backward refusal: {exc}"
        return "refused"
    return "exact"


def _leaves(*shapes: tuple[int, ...], seed: int = 0) -> tuple[Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(s, generator=g, dtype=F64).requires_grad_() for s in shapes)


KEYS = torch.tensor([True, False, True, True])  # one dropped key: the masked branches


def _op_case(op: OpInfo) -> tuple[Callable[..., Tensor], tuple[Tensor, ...]]:
    """A tiny float64 call of one table row, as a function of its tensor leaves."""
    mask = {"attn_mask": KEYS} if op.masks and op.family in ("attention", "weights") else {}
    if op.family == "attention":
        names, shapes = ("q", "k", "v"), ((1, 2, 3, 3), (1, 2, 4, 3), (1, 2, 4, 2))
    elif op.family == "weights":
        names, shapes = ("q", "k"), ((1, 2, 3, 3), (1, 2, 4, 3))
    elif op.family == "scores":
        names, shapes = ("scores",), ((2, 5),)
    elif op.family == "ot":
        names, shapes = ("z", "templates"), ((1, 2, 3, 3), (1, 2, 4, 3))
    else:
        names, shapes = ("query", "key", "value"), ((1, 3, 4), (1, 4, 4), (1, 4, 4))
        if op.masks:
            mask = {"key_padding_mask": ~KEYS[None]}

    def fn(*xs: Tensor) -> Tensor:
        return op.call(**dict(zip(names, xs, strict=True)), **mask)

    return fn, _leaves(*shapes)


@pytest.mark.parametrize("op", OPS, ids=lambda o: o.name)
def test_public_op_second_derivative_is_exact_or_refused(op):
    _second_order(*_op_case(op))


def _registry_case(name: str) -> tuple[Callable[..., Tensor], tuple[Tensor, ...]]:
    opts = {"seed": 0} if name.startswith(("ika", "ikan", "mikan")) else {}
    torch.manual_seed(0)
    mod = ann.make_attention(name, 4, 2, **opts).to(F64).eval()
    # the mechanism's own parameters (preference, mixing weight, spectral nets); the projections'
    # mixed derivatives reach the attention node through q, k, v like the input's
    params = {n: p for n, p in mod.named_parameters() if "_proj." not in n}

    def fn(x: Tensor, *ps: Tensor) -> Tensor:  # mixed d²/dx dθ too (gradient penalties)
        out = torch.func.functional_call(mod, dict(zip(params, ps, strict=True)), (x,))
        return out[0] if isinstance(out, tuple) else out

    return fn, (*_leaves((1, 3, 4)), *(p.detach().clone().requires_grad_() for p in params.values()))


@pytest.mark.parametrize("name", ann.attention_names())
def test_registry_attention_second_derivative_is_exact_or_refused(name):
    _second_order(*_registry_case(name))


QKV = ((1, 2, 3, 3), (1, 2, 4, 3), (1, 2, 4, 2))
SELF = ((1, 2, 4, 3), (1, 2, 4, 3), (1, 2, 4, 2))
DN = attnopt.doubly_normalized_attention


def _hyb(impl: str, **kw: object) -> Callable[..., Tensor]:
    w = torch.tensor(0.3, dtype=F64)
    return lambda q, k, v: attnopt.hybrid_normalized_attention(q, k, v, w, impl=impl, **kw)  # type: ignore[arg-type]


def _reg(reg: object, impl: str, **kw: object) -> Callable[..., Tensor]:
    return lambda q, k, v: attnopt.regularized_attention(q, k, v, regularizer=reg, impl=impl, **kw)  # type: ignore[arg-type]


_PREF = torch.rand(1, 2, 3, 4, dtype=F64, generator=torch.Generator().manual_seed(1)) + 0.5
# internal paths with their own autograd.Function, forced by impl: (fn, input shapes)
PATHS: dict[str, tuple[Callable[..., Tensor], tuple[tuple[int, ...], ...]]] = {
    "dnas K=1 streaming": (lambda q, k, v: DN(q, k, v, impl="streaming", attn_mask=KEYS), QKV),
    "dnas K=1 streaming causal": (lambda q, k, v: DN(q, k, v, impl="streaming",
                                                     causal="plan", is_causal=True), SELF),
    "dnas K=2 streaming": (lambda q, k, v: DN(q, k, v, iterations=2, impl="streaming", attn_mask=KEYS), QKV),
    "dnas K=2 materialized": (lambda q, k, v: DN(q, k, v, iterations=2, impl="materialized"), QKV),
    "hnas materialized": (_hyb("materialized", attn_mask=KEYS), QKV),
    "hnas streaming": (_hyb("streaming"), QKV),
    "generalized bias materialized": (
        lambda q, k, v: attnopt.generalized_attention(q, k, v, preference=_PREF, impl="materialized"), QKV),
    "generalized bias streaming": (
        lambda q, k, v: attnopt.generalized_attention(q, k, v, preference=_PREF, impl="streaming"), QKV),
    "sparsemax attention fused": (_reg(SquaredL2(), "materialized", attn_mask=KEYS), QKV),
    "sparsemax attention blocked": (_reg(SquaredL2(), "streaming", attn_mask=KEYS), QKV),
    "entmax-1.5 attention blocked, ALiBi": (_reg(Tsallis(1.5), "streaming", locality=0.3), QKV),
    "entmax-1.3 attention fused": (_reg(Tsallis(1.3), "materialized"), QKV),
    "entmax-1.3 attention blocked": (_reg(Tsallis(1.3), "streaming"), QKV),
    "kernel RBF p=1.5": (
        lambda q, k, v: attnopt.kernel_attention(q, k, v, kernel=kernels.RBF(), magnitude_p=1.5), QKV),
}


@pytest.mark.parametrize("path", list(PATHS))
def test_internal_path_second_derivative_is_exact_or_refused(path):
    fn, shapes = PATHS[path]
    _second_order(fn, _leaves(*shapes))


@pytest.mark.parametrize("iterations", [1, 2])
def test_chunked_materialized_dnas_kernel_refuses(monkeypatch, iterations):
    """The materialized kernel chunk by chunk (large sizes only): forced by lowering its threshold."""
    monkeypatch.setattr(THRESHOLDS, "dnas_materialized_chunk_entries", 0)
    q, k, v = _leaves(*QKV)
    out = DN(q, k, v, iterations=iterations, impl="materialized")
    with pytest.raises(RuntimeError, match="double backward"):
        torch.autograd.grad(out.square().sum(), q, create_graph=True)


@pytest.mark.parametrize("hybrid", [False, True])
def test_native_dnas_kernel_refuses(monkeypatch, hybrid):
    """The native C path (float32 CPU, large sizes only): forced by lowering its thresholds."""
    from attnopt.functional.doubly_normalized import cpu as native

    monkeypatch.setattr(THRESHOLDS, "dnas_native_min_entries", 0)
    monkeypatch.setattr(THRESHOLDS, "dnas_cpu_chunk_entries", 100)
    q, k, v = (x.detach().float().requires_grad_() for x in _leaves(*QKV))
    if native.library(q, 1) is None:
        pytest.skip("no native library (no compiler or ATTNOPT_NATIVE=0)")
    out = _hyb("materialized")(q, k, v) if hybrid else DN(q, k, v, impl="materialized")
    with pytest.raises(RuntimeError, match="double backward"):
        torch.autograd.grad(out.square().sum(), q, create_graph=True)


@pytest.mark.parametrize("alpha", [2.0, 1.5, 1.25, 0.7, 3.0])
def test_entmax_double_backward_is_exact(alpha):
    (x,) = _leaves((3, 6))
    assert _second_order(lambda x: attnopt.entmax(x, alpha), (x,)) == "exact"


def test_entmax_tensor_alpha_double_backward_is_exact():
    x, a = _leaves((3, 5), (3, 1))
    a = (1.2 + a.detach().abs() * 0.3).requires_grad_()
    assert _second_order(lambda x, a: attnopt.entmax(x, a), (x, a)) == "exact"


@pytest.mark.parametrize("impl", ["materialized", "streaming"])
@pytest.mark.parametrize("reg", [SquaredL2(), Tsallis(1.5), Tsallis(1.3)], ids=str)
def test_sparse_attention_double_backward_is_exact_with_a_learned_locality(impl, reg):
    """The fused and blocked sparse nodes differentiate their plain form: q, k, v and ALiBi's β."""
    q, k, v, beta = _leaves(*SELF, (2,))

    def fn(q: Tensor, k: Tensor, v: Tensor, beta: Tensor) -> Tensor:
        return attnopt.regularized_attention(q, k, v, regularizer=reg, impl=impl, locality=beta,
                                             is_causal=True)

    assert _second_order(fn, (q, k, v, beta.detach().abs().requires_grad_())) == "exact"


@pytest.mark.parametrize("gather", [False, True])
def test_toeplitz_preference_node_double_backward_is_exact(gather):
    """T5's bias node is linear in its weight and its backward only reads the incoming gradient."""
    from attnopt.nn.preference import _T5Bias

    nq, nk = 3, 4
    buckets = torch.tensor([0, 1, 2, 3, 4, 1])
    index = (torch.arange(nk)[None] - torch.arange(nq)[:, None] + nq - 1).reshape(-1) if gather else None
    (w,) = _leaves((5, 2))
    def node(w):
        return _T5Bias.apply(w, buckets, index, nq, nk).square()

    assert _second_order(node, (w,)) == "exact"


def test_gradient_penalty_through_a_refusing_op_raises_even_with_inputs():
    """``torch.autograd.grad(..., inputs=...)`` is the case ``@once_differentiable`` gets wrong."""
    q, k, v = _leaves(*QKV)
    out = DN(q, k, v, impl="streaming")
    with pytest.raises(RuntimeError, match="double backward"):
        torch.autograd.grad((out * q.sum()).sum(), q, create_graph=True)


def _functions() -> list[tuple[str, str, str]]:
    """(file, class, backward source) of every ``autograd.Function`` subclass under src/attnopt."""
    found = []
    for path in sorted(SRC.rglob("*.py")):
        text = path.read_text()
        if "Function" not in text:
            continue
        for node in ast.walk(ast.parse(text)):
            if not isinstance(node, ast.ClassDef):
                continue
            if not any("Function" in ast.unparse(b) for b in node.bases):
                continue
            back = [f for f in node.body if isinstance(f, ast.FunctionDef) and f.name == "backward"]
            src = ast.get_source_segment(text, back[0]) if back else ""
            # ``backward = staticmethod(Other.backward)``: the same policy as ``Other``'s backward
            alias = [a.value for a in node.body if isinstance(a, ast.Assign)
                     and any(isinstance(t, ast.Name) and t.id == "backward" for t in a.targets)]
            if not back and alias:
                src = "alias:" + ast.unparse(alias[0])
            found.append((str(path.relative_to(SRC)), node.name, src or ""))
    by_class = {c: b for _, c, b in found}
    resolved = []
    for f, c, b in found:
        if b.startswith("alias:"):  # e.g. "staticmethod(_Sparsemax.backward)" -> _Sparsemax's source
            target = b.split("(")[-1].split(".")[0]
            b = by_class.get(target, "")
        resolved.append((f, c, b))
    return resolved


def test_every_function_states_its_double_backward():
    """Each Function's backward either refuses (``refuse_double_backward``) or switches to a
    differentiable formula (``double_backward(ctx)`` / ``torch.is_grad_enabled()``), or says
    ``# exact double backward`` (its formula is already tracked: then a gradgradcheck test
    backs it), or ``# refuses every backward`` (``first_order_only``'s marker node). A new
    Function joins the policy or this test fails; ``@once_differentiable`` does not count."""
    funcs = _functions()
    assert len(funcs) >= 15, funcs
    marks = ("double_backward(", "is_grad_enabled()", "# exact double backward", "# refuses every backward")
    silent = [f"{f}:{c}" for f, c, src in funcs if not any(m in src for m in marks)]
    assert not silent, f"backward without a double-backward policy (see functional/_autograd.py): {silent}"


def test_torch_func_first_order_keeps_working_and_nested_grad_is_policed():
    """``torch.func`` runs backwards with grad mode on: one ``grad`` is first order (allowed),
    ``grad(grad(f))`` is a second derivative: exact (DNAS takes its plain-ops path under
    ``torch.func``, tests/functional/test_func_transforms.py) or refused, as under autograd."""
    q, k, v = (x.detach() for x in _leaves(*QKV))

    def dnas(q: Tensor) -> Tensor:
        return DN(q, k, v, impl="streaming").square().sum()

    x = q.clone().requires_grad_()
    (expected,) = torch.autograd.grad(dnas(x), x)
    torch.testing.assert_close(torch.func.grad(dnas)(q), expected)
    x = q.clone().requires_grad_()
    w = attnopt.doubly_normalized_weights(x, k)  # the plain reference, differentiated twice by autograd
    (g,) = torch.autograd.grad(torch.matmul(w, v).square().sum(), x, create_graph=True)
    (hv,) = torch.autograd.grad(g.sum(), x)
    torch.testing.assert_close(torch.func.grad(lambda q: torch.func.grad(dnas)(q).sum())(q), hv)

    def sm(s: Tensor) -> Tensor:
        return attnopt.sparsemax(s).pow(3).sum()

    (g,) = torch.autograd.grad(sm(x), x, create_graph=True)
    (hv,) = torch.autograd.grad(g.sum(), x)
    torch.testing.assert_close(torch.func.grad(lambda s: torch.func.grad(sm)(s).sum())(q), hv)
