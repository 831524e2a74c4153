"""Sample-input harness over every public op (in the spirit of PyTorch's OpInfo), issue 17.

One table, :data:`OPS`, has a row per public op (functional and ``nn``). A row names its
*family* — which says how its inputs look — and the family's sample generator yields, for
each dtype, the layouts and edge shapes every op must survive:

* strided layouts of every input: contiguous, transposed storage of the last two dims or of
  the heads/sequence dims, every-other-channel slices, channels-permuted storage, stride-0
  expands of the batch, sequence or feature dim;
* shapes: ``Nq != Nk``, ``d = 1``, 1-element sizes, ``dv != d``, and empty ``B``, ``H``,
  ``Nq``, ``Nk``;
* masks of every accepted rank (1-D key masks to full ``(B, H, Nq, Nk)``), boolean and
  float, masks that require grad, ``is_causal``;
* documented errors: a mask that does not broadcast, NaN / ±inf inputs.

The generic test checks each sample against the same op on contiguous float64 copies
(values and the gradients of every leaf, masks included; bfloat16: values within 5e-2, no
NaN, finite gradients), or against the documented error;
empty outputs against the empty-size policy (empty, or zeros for ``Nk = 0``, finite
gradients). A new op joins by adding one row. The default run takes a fixed random subset
of each row's samples; ``-m slow`` runs them all.
"""

from __future__ import annotations

import copy
import random
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from torch import Tensor

import attnopt
from attnopt import kernels
from attnopt import nn as ann
from attnopt.functional import SquaredL2, Tsallis

F64 = torch.float64
DTYPES = (torch.float32, torch.float64, torch.bfloat16)
HALF_TOL = (5e-2, 5e-2)  # bfloat16 values against float64; its gradients are checked finite only

# ---------------------------------------------------------------------------------- layouts
# Each layout maps a leaf to the op's input, differentiably and keeping the values; the
# expand layouts take a leaf with size 1 in the expanded dim.
LAYOUTS: dict[str, Callable[[Tensor, tuple[int, ...]], Tensor]] = {
    "contiguous": lambda x, s: x,  # noqa: ARG005
    "t_last": lambda x, s: x.transpose(-1, -2).contiguous().transpose(-1, -2),  # noqa: ARG005
    "t_seq": lambda x, s: x.transpose(-3, -2).contiguous().transpose(-3, -2),  # noqa: ARG005
    "sliced": lambda x, s: torch.stack((x, torch.zeros_like(x)), -1).flatten(-2)[..., ::2],  # noqa: ARG005
    "permuted": lambda x, s: (
        x.permute(*reversed(range(x.dim()))).contiguous().permute(*reversed(range(x.dim())))
    ),  # noqa: ARG005
    "expand_batch": lambda x, s: x.expand(s),
    "expand_seq": lambda x, s: x.expand(s),
    "expand_feature": lambda x, s: x.expand(s),
}
_EXPAND_DIM = {"expand_batch": 0, "expand_seq": -2, "expand_feature": -1}


def _leaf_shape(shape: tuple[int, ...], layout: str) -> tuple[int, ...]:
    dim = _EXPAND_DIM.get(layout)
    if dim is None:
        return shape
    out = list(shape)
    out[dim] = 1
    return tuple(out)


def _usable(shape: tuple[int, ...], layout: str) -> bool:
    if layout == "t_seq" and len(shape) < 3:
        return False
    dim = _EXPAND_DIM.get(layout)
    return dim is None or shape[dim] > 1


# ---------------------------------------------------------------------------------- samples
@dataclass
class Sample:
    """One call: tensor inputs (shape + layout), masks, keyword arguments, expected error."""

    desc: str
    shapes: dict[str, tuple[int, ...]]
    layouts: dict[str, str]
    masks: dict[str, Tensor] = field(default_factory=dict)  # float64/bool, used as given
    kwargs: dict[str, Any] = field(default_factory=dict)
    poison: tuple[str, float] | None = None  # (input, value) written into one entry
    error: tuple[type[Exception], str] | None = None
    nk_dim: tuple[str, int] | None = None  # (input, dim) whose emptiness means "no key": zeros
    seed: int = 0


def _make_leaves(s: Sample, dtype: torch.dtype) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """Leaves for the run in ``dtype`` and float64 leaves for the reference (same values)."""
    g = torch.Generator().manual_seed(s.seed)
    run, ref = {}, {}
    for name, shape in s.shapes.items():
        base = torch.randn(_leaf_shape(shape, s.layouts[name]), generator=g, dtype=F64)
        if s.poison is not None and s.poison[0] == name and base.numel():
            base.view(-1)[base.numel() // 2] = s.poison[1]
        run[name] = base.detach().to(dtype, copy=True).requires_grad_(True)
        ref[name] = base.detach().clone().requires_grad_(True)
    return run, ref


def _build(s: Sample, leaves: dict[str, Tensor], contiguous: bool) -> dict[str, Tensor]:
    out = {}
    for name, leaf in leaves.items():
        x = LAYOUTS[s.layouts[name]](leaf, s.shapes[name])
        out[name] = x.contiguous() if contiguous else x
    return out


def _masks(s: Sample, dtype: torch.dtype) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    run, ref = {}, {}
    for name, m in s.masks.items():
        if m.dtype == torch.bool:
            run[name], ref[name] = m, m
        else:
            grad = m.requires_grad
            run[name] = m.detach().to(dtype).requires_grad_(grad)
            ref[name] = m.detach().clone().requires_grad_(grad)
    return run, ref


def _key_mask(
    shape: tuple[int, ...],
    nk: int,
    seed: int,
    *,
    dtype: torch.dtype | None = None,
    grad: bool = False,
    keep_first: bool = True,
    true_drops: bool = False,
) -> Tensor:
    """A random mask of ``shape`` (last dim = keys); bool (``True`` = keep, or drop) or float."""
    g = torch.Generator().manual_seed(seed)
    if dtype is None:
        keep = torch.rand(shape, generator=g) > 0.3
        if keep_first and nk:
            keep[..., 0] = True
        return ~keep if true_drops else keep
    m = torch.randn(shape, generator=g, dtype=F64)
    m = m.masked_fill(torch.rand(shape, generator=g) < 0.25, float("-inf"))
    if keep_first and nk:
        m[..., 0] = 0.5
    return m.requires_grad_(grad)


# shapes (B, H, Nq, Nk, d, dv)
SHAPES = [
    (2, 3, 5, 7, 4, 4),
    (1, 2, 6, 6, 3, 5),
    (2, 2, 4, 3, 1, 2),  # d = 1, Nq > Nk
    (1, 1, 1, 1, 1, 1),  # one element
    (2, 1, 3, 5, 2, 1),
]
EMPTY = [(1, 2, 0, 4, 3, 3), (1, 2, 4, 0, 3, 3), (0, 2, 3, 3, 3, 3), (1, 0, 3, 3, 3, 3)]
INPUT_LAYOUTS = [k for k in LAYOUTS if k != "contiguous"]


def _layouts(names: list[str], shapes: dict[str, tuple[int, ...]], rng: random.Random) -> dict[str, str]:
    out = {}
    for n in names:
        choices = [lay for lay in INPUT_LAYOUTS if _usable(shapes[n], lay)] or ["contiguous"]
        out[n] = rng.choice(choices + ["contiguous"])
    return out


def _mask_variants(b: int, h: int, nq: int, nk: int, seed: int) -> Iterator[tuple[str, Tensor | None]]:
    yield "no mask", None
    yield "1-D bool key mask", _key_mask((nk,), nk, seed)
    yield "2-D float (Nq, Nk) mask", _key_mask((nq, nk), nk, seed, dtype=F64)
    yield "bool (B, 1, 1, Nk) key padding", _key_mask((b, 1, 1, nk), nk, seed)
    yield "float (B, H, Nq, Nk) mask", _key_mask((b, h, nq, nk), nk, seed, dtype=F64)
    yield "float (1, H, 1, Nk) mask requiring grad", _key_mask((1, h, 1, nk), nk, seed, dtype=F64, grad=True)
    yield "float (H, Nq, Nk) mask requiring grad", _key_mask((h, nq, nk), nk, seed, dtype=F64, grad=True)


def qkv_samples(op: OpInfo) -> Iterator[Sample]:
    """q (B,H,Nq,d), k (B,H,Nk,d)[, v (B,H,Nk,dv)] in every layout, shape and mask rank."""
    rng = random.Random(zlib.crc32(op.name.encode()))
    names = ["q", "k", "v"] if op.family == "attention" else ["q", "k"]

    def shapes_of(b, h, nq, nk, d, dv):
        sh = {"q": (b, h, nq, d), "k": (b, h, nk, d), "v": (b, h, nk, dv)}
        return {n: sh[n] for n in names}

    seed = 0
    for b, h, nq, nk, d, dv in SHAPES:
        for desc, mask in _mask_variants(b, h, nq, nk, seed):
            if mask is not None and not op.masks:
                continue
            sh = shapes_of(b, h, nq, nk, d, dv)
            lay = _layouts(names, sh, rng)
            masks = {} if mask is None else {"attn_mask": mask}
            err = None
            if mask is not None and op.key_masks_only and mask.dim() >= 2 and mask.shape[-2] != 1:
                err = (ValueError, "key mask")
            yield Sample(f"{(b, h, nq, nk, d, dv)} {desc} {lay}", sh, lay, masks, error=err, seed=seed)
            seed += 1
        if op.causal and nq == nk:
            sh = shapes_of(b, h, nq, nk, d, dv)
            lay = _layouts(names, sh, rng)
            yield Sample(
                f"{(b, h, nq, nk, d, dv)} is_causal {lay}", sh, lay, kwargs={"is_causal": True}, seed=seed
            )
            seed += 1
    for b, h, nq, nk, d, dv in EMPTY:
        sh = shapes_of(b, h, nq, nk, d, dv)
        masks = {"attn_mask": _key_mask((nk,), nk, seed)} if op.masks else {}
        yield Sample(
            f"empty {(b, h, nq, nk, d, dv)}",
            sh,
            dict.fromkeys(names, "contiguous"),
            masks,
            nk_dim=("k", -2),
            seed=seed,
        )
    sh = shapes_of(2, 2, 3, 4, 3, 3)
    plain = dict.fromkeys(names, "contiguous")
    if op.masks:
        yield Sample(
            "mask (Nk + 1,) does not broadcast",
            sh,
            plain,
            {"attn_mask": torch.ones(5, dtype=torch.bool)},
            error=(ValueError, "broadcast"),
        )
        yield Sample(
            "mask with an extra leading dim",
            sh,
            plain,
            {"attn_mask": torch.ones(3, 2, 2, 3, 4, dtype=torch.bool)},
            error=(ValueError, "broadcast"),
        )
    for n, val in zip(names, (float("nan"), float("inf"), float("-inf")), strict=False):
        yield Sample(f"{val} in {n}", sh, plain, poison=(n, val), error=(ValueError, rf"\b{n}\b.*NaN"))


def scores_samples(op: OpInfo) -> Iterator[Sample]:
    """Scores (..., S) in every layout, with -inf entries, S = 1 and empty sizes."""
    rng = random.Random(zlib.crc32(op.name.encode()))
    for i, shape in enumerate([(2, 3, 4, 6), (3, 5), (1, 1), (2, 1, 3, 1), (4, 7)]):
        lay = {"scores": rng.choice([x for x in INPUT_LAYOUTS if _usable(shape, x)] + ["contiguous"])}
        yield Sample(f"{shape} {lay}", {"scores": shape}, lay, seed=i)
        if shape[-1] > 1:
            yield Sample(
                f"{shape} with -inf {lay}", {"scores": shape}, lay, poison=("scores", float("-inf")), seed=i
            )
    for shape in [(2, 3, 0), (0, 4), (2, 0, 3)]:
        yield Sample(f"empty {shape}", {"scores": shape}, {"scores": "contiguous"})
    yield Sample(
        "NaN in scores",
        {"scores": (2, 4)},
        {"scores": "contiguous"},
        poison=("scores", float("nan")),
        error=(ValueError, "NaN"),
    )


def ot_samples(op: OpInfo) -> Iterator[Sample]:
    """z (B,H,Nq,d), templates (B,H,n,d) in every layout; bank masks; empty sizes; NaN."""
    rng = random.Random(zlib.crc32(op.name.encode()))
    for i, (b, h, nq, n, d) in enumerate(
        [(2, 2, 3, 5, 4), (1, 3, 4, 4, 1), (1, 1, 1, 1, 2), (2, 1, 5, 2, 3)]
    ):
        sh = {"z": (b, h, nq, d), "templates": (b, h, n, d)}
        for desc, masks in [
            ("", {}),
            ("bank_mask (n,)", {"bank_mask": _key_mask((n,), n, i)}),
            ("bank_mask (B, 1, n)", {"bank_mask": _key_mask((b, 1, n), n, i)}),
        ]:
            yield Sample(f"{(b, h, nq, n, d)} {desc}", sh, _layouts(list(sh), sh, rng), masks, seed=i)
    for b, h, nq, n in [(1, 2, 0, 3), (1, 2, 3, 0), (0, 2, 3, 3), (1, 0, 3, 3)]:
        sh = {"z": (b, h, nq, 3), "templates": (b, h, n, 3)}
        yield Sample(f"empty {(b, h, nq, n)}", sh, dict.fromkeys(sh, "contiguous"), nk_dim=("templates", -2))
    sh = {"z": (2, 2, 3, 3), "templates": (2, 2, 4, 3)}
    for n, val in (("z", float("nan")), ("templates", float("inf"))):
        yield Sample(
            f"{val} in {n}",
            sh,
            dict.fromkeys(sh, "contiguous"),
            poison=(n, val),
            error=(ValueError, rf"\b{n}\b.*NaN"),
        )


def module_samples(op: OpInfo) -> Iterator[Sample]:
    """query (B,Nq,E), key/value (B,Nk,E) in every layout; nn.MultiheadAttention-style masks."""
    rng = random.Random(zlib.crc32(op.name.encode()))
    e, h = 4, 2
    for i, (b, nq, nk) in enumerate([(2, 3, 5), (1, 4, 4), (1, 1, 1), (3, 2, 1)]):
        sh = {"query": (b, nq, e), "key": (b, nk, e), "value": (b, nk, e)}
        variants: list[tuple[str, dict[str, Tensor], dict[str, Any]]] = [("", {}, {})]
        if op.masks:
            variants += [
                ("key_padding_mask", {"key_padding_mask": _key_mask((b, nk), nk, i, true_drops=True)}, {}),
                ("attn_mask (Nq, Nk) float", {"attn_mask": _key_mask((nq, nk), nk, i, dtype=F64)}, {}),
                (
                    "attn_mask (B*H, Nq, Nk) bool",
                    {"attn_mask": _key_mask((b * h, nq, nk), nk, i, true_drops=True)},
                    {},
                ),
            ]
        if op.causal and nq == nk:
            variants.append(("is_causal", {}, {"is_causal": True}))
        for desc, masks, kw in variants:
            yield Sample(f"{(b, nq, nk)} {desc}", sh, _layouts(list(sh), sh, rng), masks, kw, seed=i)
    for b, nq, nk in [(1, 0, 3), (1, 3, 0), (0, 3, 3)]:  # Nk = 0: out_proj(0), compared with float64
        sh = {"query": (b, nq, e), "key": (b, nk, e), "value": (b, nk, e)}
        yield Sample(f"empty {(b, nq, nk)}", sh, dict.fromkeys(sh, "contiguous"))
    sh = {"query": (2, 3, e), "key": (2, 4, e), "value": (2, 4, e)}
    name = "tokens" if op.name == "nn.OTAttention" else "key"
    yield Sample(
        "NaN in key",
        sh,
        dict.fromkeys(sh, "contiguous"),
        poison=("key", float("nan")),
        error=(ValueError, rf"\b{name}\b.*NaN"),
    )


# ---------------------------------------------------------------------------------- the table
@dataclass
class OpInfo:
    """One public op: how to call it and which samples it takes."""

    name: str
    call: Callable[..., Tensor]  # call(**inputs, **masks, **kwargs) -> Tensor
    family: str  # attention | weights | scores | ot | module
    masks: bool = True
    causal: bool = True
    key_masks_only: bool = False
    grad: bool = True
    tol32: tuple[float, float] = (1e-4, 1e-5)  # rtol, atol for float32 against float64
    k_default: int = 5  # non-error, non-empty samples in the default run
    samples: Callable[[OpInfo], Iterator[Sample]] = field(init=False)

    def __post_init__(self) -> None:
        self.samples = {
            "attention": qkv_samples,
            "weights": qkv_samples,
            "scores": scores_samples,
            "ot": ot_samples,
            "module": module_samples,
        }[self.family]


def _fn(f: Callable[..., Tensor], **fixed: Any) -> Callable[..., Tensor]:
    return lambda **a: f(**fixed, **a)


def _hybrid(f: Callable[..., Tensor]) -> Callable[..., Tensor]:
    return lambda **a: f(weight=torch.tensor(0.3, dtype=a["q"].dtype), **a)


def _module(factory: Callable[[], torch.nn.Module], tokens_only: bool = False) -> Callable[..., Tensor]:
    """Call one module in both dtypes with the same parameters (built once, float64, eval mode)."""
    cache: dict[torch.dtype, torch.nn.Module] = {}

    def call(query: Tensor, key: Tensor, value: Tensor, **kw: Any) -> Tensor:
        if not cache:  # copies before any forward (a module may then hold non-leaf state)
            torch.manual_seed(0)
            base = factory().to(F64).eval()
            cache.update({dt: copy.deepcopy(base).to(dt) for dt in DTYPES if dt != F64})
            cache[F64] = base
        mod = cache[query.dtype]
        return mod(key, **kw)[0] if tokens_only else mod(query, key, value, **kw)[0]

    return call


A, W, S, O, M = "attention", "weights", "scores", "ot", "module"
LOOSE = (1e-3, 1e-4)  # iterative solvers (entmax bisection, MEM Newton) in float32
OPS: list[OpInfo] = [
    # functional attention (q, k, v)
    OpInfo("generalized_attention", _fn(attnopt.generalized_attention), A),
    OpInfo("doubly_normalized_attention[K=1]", _fn(attnopt.doubly_normalized_attention), A),
    OpInfo("doubly_normalized_attention[K=2]", _fn(attnopt.doubly_normalized_attention, iterations=2), A),
    OpInfo("doubly_normalized_attention[K=0]", _fn(attnopt.doubly_normalized_attention, iterations=0), A),
    OpInfo("hybrid_normalized_attention", _hybrid(attnopt.hybrid_normalized_attention), A),
    OpInfo("kernel_attention[RBF]", _fn(attnopt.kernel_attention, kernel=kernels.RBF()), A),
    OpInfo(
        "kernel_attention[Periodic, p=1]",
        _fn(attnopt.kernel_attention, kernel=kernels.Periodic(2.0), magnitude_p=1.0),
        A,
    ),
    OpInfo(
        "kernel_attention[Linear, linear mode]",
        _fn(attnopt.kernel_attention, kernel=kernels.Linear(), mode="linear"),
        A,
        key_masks_only=True,
        tol32=LOOSE,
    ),
    OpInfo("regularized_attention[Shannon]", _fn(attnopt.regularized_attention), A),
    OpInfo(
        "regularized_attention[SquaredL2, ALiBi]",
        _fn(attnopt.regularized_attention, regularizer=SquaredL2(), locality=0.3),
        A,
    ),
    OpInfo(
        "regularized_attention[Tsallis 1.5]",
        _fn(attnopt.regularized_attention, regularizer=Tsallis(1.5)),
        A,
        tol32=LOOSE,
    ),
    OpInfo("mem_attention", _fn(attnopt.mem_attention), A, tol32=LOOSE, k_default=3),
    # functional weights (q, k)
    OpInfo("generalized_weights", _fn(attnopt.generalized_weights), W),
    OpInfo("doubly_normalized_weights", _fn(attnopt.doubly_normalized_weights), W),
    OpInfo("hybrid_normalized_weights", _hybrid(attnopt.hybrid_normalized_weights), W),
    OpInfo("kernel_weights[RBF]", _fn(attnopt.kernel_weights, kernel=kernels.RBF()), W),
    OpInfo(
        "regularized_attention_weights[SquaredL2]",
        _fn(attnopt.regularized_attention_weights, regularizer=SquaredL2()),
        W,
    ),
    OpInfo("mem_weights", _fn(attnopt.mem_weights), W, tol32=LOOSE, k_default=3),
    # score maps
    OpInfo("softmax_weights", _fn(attnopt.softmax_weights), S),
    OpInfo("sparsemax", _fn(attnopt.sparsemax), S),
    OpInfo("entmax[1.5]", _fn(attnopt.entmax), S, tol32=LOOSE),
    OpInfo("entmax15", _fn(attnopt.entmax15), S, tol32=LOOSE),
    OpInfo("entmax_bisect[1.25]", _fn(attnopt.entmax_bisect, alpha=1.25), S, tol32=LOOSE),
    OpInfo(
        "regularized_weights[Tsallis 1.5]",
        _fn(attnopt.regularized_weights, regularizer=Tsallis(1.5)),
        S,
        tol32=LOOSE,
    ),
    # optimal transport
    OpInfo("ot_attention", _fn(attnopt.ot_attention), O),
    OpInfo("ot_weights", _fn(attnopt.ot_weights), O),
    # nn modules
    OpInfo(
        "nn.DoublyNormalizedMultiheadAttention",
        _module(lambda: ann.DoublyNormalizedMultiheadAttention(4, 2)),
        M,
    ),
    OpInfo(
        "nn.HybridNormalizedMultiheadAttention",
        _module(lambda: ann.HybridNormalizedMultiheadAttention(4, 2, iterations=2)),
        M,
    ),
    OpInfo(
        "nn.GeneralizedMultiheadAttention[T5]",
        _module(lambda: ann.GeneralizedMultiheadAttention(4, 2, ann.T5RelativePreference(2))),
        M,
    ),
    OpInfo(
        "nn.RegularizedMultiheadAttention[SquaredL2]",
        _module(lambda: ann.RegularizedMultiheadAttention(4, 2, SquaredL2(), locality=0.2)),
        M,
    ),
    OpInfo(
        "nn.ImplicitKernelAttention[ikan]",
        _module(lambda: ann.ImplicitKernelAttention(4, 2, seed=0)),
        M,
        tol32=LOOSE,
    ),
    OpInfo(
        "nn.KernelMultiheadAttention[expsin]",
        _module(lambda: ann.KernelMultiheadAttention(4, 2, kernels.Periodic(6.283))),
        M,
        tol32=LOOSE,
    ),
    OpInfo("nn.MEMAttention", _module(lambda: ann.MEMAttention(4, 2)), M, tol32=LOOSE, k_default=3),
    OpInfo(
        "nn.OTAttention",
        _module(lambda: ann.OTAttention(4, 2), tokens_only=True),
        M,
        masks=False,
        causal=False,
    ),
]


# ---------------------------------------------------------------------------------- the tests
def _run(op: OpInfo, s: Sample, dtype: torch.dtype) -> None:
    run_leaves, ref_leaves = _make_leaves(s, dtype)
    run_masks, ref_masks = _masks(s, dtype)
    run_in = {**_build(s, run_leaves, contiguous=False), **run_masks}
    if s.error is not None:
        exc, match = s.error
        with pytest.raises(exc, match=match):
            op.call(**run_in, **s.kwargs)
        return
    out = op.call(**run_in, **s.kwargs)
    ref = op.call(**_build(s, ref_leaves, contiguous=True), **ref_masks, **s.kwargs)
    assert out.dtype == dtype and out.shape == ref.shape, (out.dtype, out.shape, ref.shape)
    rtol, atol = {F64: (1e-9, 1e-10), torch.float32: op.tol32}.get(dtype, HALF_TOL)
    assert not torch.isnan(out).any()
    torch.testing.assert_close(out.to(F64), ref, rtol=rtol, atol=atol)
    if s.nk_dim is not None and 0 in out.shape:
        pass
    elif s.nk_dim is not None and s.shapes[s.nk_dim[0]][s.nk_dim[1]] == 0:
        assert torch.equal(out, torch.zeros_like(out)), "Nk = 0 must give zeros"
    if not op.grad:
        return
    g = torch.Generator().manual_seed(123)
    cot = torch.randn(ref.shape, generator=g, dtype=F64)
    (out * cot.to(dtype)).sum().backward()
    (ref * cot).sum().backward()
    pairs = [(run_leaves[n], ref_leaves[n], n) for n in run_leaves]
    pairs += [(run_masks[n], ref_masks[n], n) for n in run_masks if run_masks[n].requires_grad]
    for a, b, n in pairs:
        if b.grad is None:
            assert a.grad is None or not a.grad.any(), n
            continue
        assert a.grad is not None, f"no gradient for {n}"
        assert torch.isfinite(a.grad).all(), f"non-finite gradient for {n}"
        if dtype not in (F64, torch.float32):
            continue
        torch.testing.assert_close(
            a.grad.to(F64), b.grad, rtol=rtol * 10, atol=atol * 10, msg=lambda m, n=n: f"{n}: {m}"
        )


def _check(op: OpInfo, dtype: torch.dtype, samples: list[Sample]) -> None:
    failures = []
    for s in samples:
        try:
            _run(op, s, dtype)
        except Exception as exc:  # noqa: BLE001 - collect every failing sample, report them together
            first = str(exc).splitlines()[0] if str(exc) else ""
            failures.append(f"[{s.desc}] {type(exc).__name__}: {first}")
    assert not failures, f"{op.name} {dtype}: {len(failures)} of {len(samples)} samples fail:\n" + "\n".join(
        failures
    )


def _subset(op: OpInfo, dtype: torch.dtype) -> list[Sample]:
    """The default run: every error/empty sample plus ``op.k_default`` others (fixed per op and dtype)."""
    all_samples = list(op.samples(op))
    must = [s for s in all_samples if s.error is not None or s.desc.startswith("empty")]
    rest = [s for s in all_samples if s not in must]
    rng = random.Random(zlib.crc32(f"{op.name}{dtype}".encode()))
    k = op.k_default if dtype in (F64, torch.float32) else 2
    return must + rng.sample(rest, min(k, len(rest)))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("op", OPS, ids=lambda o: o.name)
def test_sampled_inputs_match_contiguous_float64(op, dtype):
    _check(op, dtype, _subset(op, dtype))


@pytest.mark.slow
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("op", OPS, ids=lambda o: o.name)
def test_all_sample_inputs_match_contiguous_float64(op, dtype):
    _check(op, dtype, list(op.samples(op)))


def test_every_public_op_has_a_row():
    """A new public functional op or attention module must join the table."""
    covered = {o.name.split("[")[0].removeprefix("nn.") for o in OPS}
    # losses and regularizer values take scores and targets, not (q, k, v): tested on their own
    not_attention = {"locality_bias", "entmax_loss", "sparsemax_loss", "tsallis_negentropy",
                     "compiled", "cpu_compiler", "inductor_available"}  # the torch.compile helper
    functional = {n for n in attnopt.functional.__all__ if n[0].islower()} - not_attention
    functional |= {"mem_attention", "mem_weights"}
    modules = {n for n in ann.__all__ if n.endswith("Attention")}
    assert functional | modules <= covered, sorted((functional | modules) - covered)
