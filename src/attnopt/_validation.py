"""Input checks shared by every mechanism (internal).

Every public function validates its arguments here so that bad input raises a
``ValueError``/``TypeError`` naming the argument and what was expected, instead of a
shape error deep inside a kernel or a silent NaN.

The policies, one for every op (README "Layout and conventions"):

* **Layout.** Any strided layout is accepted (transposed, sliced, stride-0 expanded,
  permuted); a fused kernel that needs a layout gets a copy made to fit, only when needed.
* **Empty sizes** (:func:`empty_attention`): ``Nq = 0`` or an empty batch/head dim gives an
  empty output; ``Nk = 0`` gives zeros (a row with no key, as a fully masked row); finite
  (zero) gradients; no kernel ever sees an empty tensor.
* **Masks** (:func:`additive_mask`, :func:`check_mask`): anything that broadcasts to
  ``(B, H, Nq, Nk)`` — a 1-D key mask ``(Nk,)`` included — is given the full rank by leading
  singleton dims (a view) before it reaches PyTorch; anything else is a ``ValueError`` that
  names the accepted shapes.
* **Non-finite inputs** (:func:`check_finite`): NaN or ±inf in ``q``, ``k``, ``v`` is a
  ``ValueError`` naming the argument (an exponent-bit test in C on CPU, else one sum per
  tensor; ``-inf`` belongs in masks, not in the inputs). Under ``torch.func`` transforms the
  values under the wrappers are checked (under ``vmap``: the whole batch). Skipped while
  ``torch.compile`` traces and for meta / fake tensors (no values to read).
* **Where value checks run** (:data:`VALUE_CHECKS`, :func:`value_checks`). Reading a value on
  the host (``bool(t)``, ``float(t)``) is free for a CPU tensor but stalls a GPU stream (and
  a CUDA graph cannot capture it), so every *value* check of the library (non-finite inputs,
  NaN/+inf masks, negative preferences, ...) follows one switch. ``"cpu"`` (the default):
  checked for CPU tensors, not checked on other devices (no host sync on the hot path);
  ``"sync"``: checked on every device (one host read per check); ``"async"``: CPU tensors
  as ``"cpu"``, other devices by a device-side assert (``torch._assert_async``: no host sync,
  a failure surfaces at the next synchronization as a device error, not as this
  ``ValueError``); ``"off"``: no value checks. Shape, dtype and device checks always run.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

import torch
from torch import Tensor

from attnopt import _native
from attnopt._native.checks import require, require_size, require_view

__all__ = [
    "VALUE_CHECKS",
    "value_checks",
    "host_values",
    "host_readable",
    "device_assert",
    "check_tensor",
    "check_attention_inputs",
    "check_finite",
    "any_nonfinite",
    "check_mask",
    "validate_attention",
    "resolve_scale",
    "check_broadcastable",
    "additive_mask",
    "causal_additive_mask",
    "combine_additive",
    "empty_attention",
    "empty_weights",
    "to_rank",
    "zero_anchor",
]


#: Where value checks run: ``["cpu"]`` (default), ``["sync"]``, ``["async"]`` or ``["off"]`` (see the
#: module docstring). A one-element list (a module-level cell: ``torch.compile`` guards on it).
VALUE_CHECKS: list[str] = ["cpu"]
_VALUE_MODES = ("cpu", "sync", "async", "off")


@contextmanager
def value_checks(mode: str) -> Iterator[None]:
    """Set :data:`VALUE_CHECKS` inside a ``with`` block (restored on exit).

    Args:
        mode: ``"cpu"`` (check CPU tensors only: the default), ``"sync"`` (every device, one host
            read per check), ``"async"`` (other devices by ``torch._assert_async``) or ``"off"``.
    Raises:
        ValueError: unknown ``mode``.
    """
    if mode not in _VALUE_MODES:
        raise ValueError(f"value check mode must be one of {_VALUE_MODES}, got {mode!r}")
    previous = VALUE_CHECKS[0]
    VALUE_CHECKS[0] = mode
    try:
        yield
    finally:
        VALUE_CHECKS[0] = previous


def host_values(x: Tensor) -> Tensor | None:
    """The tensor whose values a check may read on the host now, or ``None`` to skip the check.

    ``None`` while ``torch.compile`` traces, for meta / fake tensors, with ``VALUE_CHECKS == "off"``
    and, unless ``"sync"``, for tensors off the CPU (a host read would stall the device). Under
    ``torch.func`` transforms: the values under the wrappers (for ``vmap`` the whole batch).
    """
    mode = VALUE_CHECKS[0]
    if mode == "off" or torch.compiler.is_compiling():
        return None
    values = _values(x)
    if values is None or not (values.is_cpu or mode == "sync"):
        return None
    return values


def host_readable(x: Tensor) -> bool:
    """Whether reading ``x``'s values on the host (``bool(t)``, ``float(t)``) is free *now*: a plain
    CPU tensor with memory, outside ``torch.compile``'s tracing and ``torch.func``'s wrappers.

    The data-dependent shortcuts of the CPU paths (skip a pass when nothing underflowed, a
    Python loop over cache-sized chunks) take this test; everywhere else (a GPU, meta / fake
    tensors, a compiled graph) the same code runs the on-device selection (``torch.where``) or
    one chunk, with no host sync and an op count that does not depend on the values or on B·H.
    """
    if torch.compiler.is_compiling():  # first: dynamo cannot trace the functorch query below
        return False
    return type(x) in _PLAIN and x.is_cpu and not _is_wrapped(x)


def device_assert(x: Tensor, ok: Callable[[Tensor], Tensor], message: str) -> None:
    """Under ``VALUE_CHECKS == "async"``, for a tensor off the CPU: ``torch._assert_async(ok(x))``.

    ``ok`` maps ``x`` to a 0-d boolean tensor; nothing is read on the host. A no-op otherwise
    (CPU tensors are checked on the host by the caller; meta / fake tensors have no values).
    """
    if VALUE_CHECKS[0] != "async" or x.is_cpu or x.is_meta:
        return
    if not torch.compiler.is_compiling() and (type(x) not in _PLAIN or _is_wrapped(x)):
        return
    torch._assert_async(ok(x.detach()), message)


def broadcast_shapes(*shapes: Sequence[int]) -> tuple[int, ...]:
    """:func:`torch.broadcast_shapes` for plain int shapes, ~20x faster (it runs on every call).

    Raises:
        RuntimeError: the shapes do not broadcast (as torch's).
    """
    first = shapes[0] if shapes else ()
    if all(sh == first for sh in shapes):  # the common case: one batch shape (a third of the cost)
        return tuple(first)
    rank = 0
    for sh in shapes:  # not max(..., default=0): torch.compile logs a warning per call site for it
        rank = max(rank, len(sh))
    out = [1] * rank
    for sh in shapes:
        offset = len(out) - len(sh)
        for i, n in enumerate(sh):
            j = offset + i
            if n == 1 or out[j] == n:
                continue
            if out[j] != 1:
                raise RuntimeError(f"shapes {[tuple(x) for x in shapes]} do not broadcast")
            out[j] = n
    return tuple(out)


def check_tensor(name: str, x: object, *, min_dim: int = 1, floating: bool = True) -> Tensor:
    """Raise ``TypeError``/``ValueError`` unless ``x`` is a tensor of at least ``min_dim`` dims."""
    if not isinstance(x, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() < min_dim:
        raise ValueError(f"{name} must have at least {min_dim} dimensions, got shape {tuple(x.shape)}")
    if floating and not x.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got dtype {x.dtype}")
    return x


def check_attention_inputs(q: Tensor, k: Tensor, v: Tensor | None = None) -> tuple[int, int, int]:
    """Validate ``q (..., Nq, d)``, ``k (..., Nk, d)``, ``v (..., Nk, dv)``.

    Returns:
        ``(Nq, Nk, d)``.
    Raises:
        TypeError: a non-tensor or non-floating input, or mixed dtypes.
        ValueError: mismatched head size, key/value length, or batch dimensions.
    """
    check_tensor("q", q, min_dim=2)
    check_tensor("k", k, min_dim=2)
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(
            f"q and k must share the last (head) dimension, got q {tuple(q.shape)} and k {tuple(k.shape)}"
        )
    if k.dtype != q.dtype:
        raise TypeError(f"q and k must have the same dtype, got {q.dtype} and {k.dtype}")
    if q.device != k.device:
        raise ValueError(f"q and k must be on the same device, got {q.device} and {k.device}")
    try:
        broadcast_shapes(q.shape[:-2], k.shape[:-2])
    except RuntimeError as exc:
        raise ValueError(
            f"batch dimensions of q {tuple(q.shape)} and k {tuple(k.shape)} do not broadcast"
        ) from exc
    if v is not None:
        check_tensor("v", v, min_dim=2)
        if v.shape[-2] != k.shape[-2]:
            raise ValueError(
                f"v must have as many rows as k (Nk = {k.shape[-2]}), got v {tuple(v.shape)}"
            )
        if v.dtype != q.dtype:
            raise TypeError(f"v must have the dtype of q ({q.dtype}), got {v.dtype}")
        if v.device != q.device:
            raise ValueError(f"v must be on the device of q ({q.device}), got {v.device}")
        try:
            broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2])
        except RuntimeError as exc:
            raise ValueError(
                f"batch dimensions of q, k, v do not broadcast: {tuple(q.shape)}, "
                f"{tuple(k.shape)}, {tuple(v.shape)}"
            ) from exc
    return q.shape[-2], k.shape[-2], q.shape[-1]


def check_finite(**tensors: Tensor | None) -> None:
    """Raise ``ValueError`` naming the first argument that holds NaN or ±inf (``None`` skipped).

    On CPU, float32/float64 tensors of up to 4 dims (any strides) with real storage go to a
    small C kernel (``_native/finite.c``) that tests the exponent bits: one vectorized pass, no
    temporary, ~1 µs of work at 8·64·64 entries plus ~1.5 µs of call overhead, where the
    PyTorch path below costs ~8 µs per tensor. Everything else (no compiler,
    ``ATTNOPT_NATIVE=0``, CUDA, half precision, > 4 dims) takes the PyTorch path: one sum per
    tensor (a NaN or ±inf entry makes the sum NaN or ±inf; finite entries whose sum overflows
    are told apart by an exact ``aminmax`` pass, only then), no full-size temporary.

    Under ``torch.func`` transforms (``vmap``, ``grad``, ``jvp``, ``jacrev``, ``functionalize``,
    nested) the check reads the values under the wrappers (:func:`_values`): under ``vmap`` that
    is the whole batch, so a NaN in any vmapped example raises, as it would in a batched call
    (``.item()`` on a batched tensor is an error under ``vmap``). Skipped where there are no
    values to read: while ``torch.compile`` traces (a data-dependent check would break the
    graph), and for meta and fake tensors (shape propagation).
    """
    if torch.compiler.is_compiling() or VALUE_CHECKS[0] == "off":
        return
    fns = _finite_fns()
    named = []
    for name, x in tensors.items():
        if x is None:
            continue
        bad = None if fns is None else _native_nonfinite(x, fns)
        if bad is None:  # not a plain CPU float32/float64 tensor: look under the wrappers
            values = host_values(x)
            if values is None:  # meta, fake, or off the CPU (VALUE_CHECKS)
                if x.is_floating_point():
                    device_assert(x, lambda t: torch.isfinite(_total(t)), _nonfinite_message(name))
                continue
            if values is not x:
                x = values
                bad = None if fns is None else _native_nonfinite(x, fns)
        if bad:
            _raise_nonfinite(name)
        elif bad is None and x.numel():
            named.append((name, x.detach() if x.requires_grad else x))
    if not named:
        return
    if not named[0][1].is_cpu:  # one host sync for all tensors
        ends = torch.stack([_total(x) for _, x in named])
        if bool(torch.isfinite(ends).all()):
            return
    for name, x in named:  # on CPU, reading each 0-d result directly is the cheapest
        if math.isfinite(float(_total(x))):
            continue
        low, high = torch.aminmax(x)  # exact: NaN propagates into both, a finite overflow does not
        if not (math.isfinite(float(low)) and math.isfinite(float(high))):
            _raise_nonfinite(name)


def any_nonfinite(x: Tensor) -> bool:
    """Whether ``x`` holds NaN or ±inf: :func:`check_finite`'s C kernel where it applies, else one
    exact ``aminmax`` (NaN and ±inf reach its ends; no overflow). ``False`` where
    :func:`host_values` skips the check (compiling, meta / fake, off the CPU unless
    ``VALUE_CHECKS == "sync"``)."""
    if VALUE_CHECKS[0] == "off":
        return False
    fns = _finite_fns()
    bad = None if fns is None else _native_nonfinite(x, fns)
    if bad is not None:
        return bad
    values = host_values(x)
    if values is None:  # meta, fake, compiling or off the CPU: nothing to read now
        return False
    if values is not x:
        x = values
        bad = None if fns is None else _native_nonfinite(x, fns)
        if bad is not None:
            return bad
    if not x.numel() or not (x.is_floating_point() or x.is_complex()):
        return False
    low, high = torch.aminmax(x.detach())
    return not (math.isfinite(float(low)) and math.isfinite(float(high)))


@_native.untraced
def _native_nonfinite(x: Tensor, fns: dict) -> bool | None:
    """NaN/±inf in ``x`` by the C kernel; ``None`` where it does not apply (see :func:`check_finite`)."""
    native = fns.get(x.dtype)
    if (native is None or type(x) not in _PLAIN or not x.is_cpu or x.layout is not torch.strided
            or x.dim() > 4 or _is_wrapped(x)):  # real float32/float64 memory (as _native.has_storage)
        return None
    dense, strided = native
    if x.is_contiguous():
        _check_finite(x, None, None)
        return bool(dense(x.data_ptr(), x.numel()))
    pad = 4 - x.dim()
    sizes, strides = (*((1,) * pad), *x.shape), (*((0,) * pad), *x.stride())
    _check_finite(x, sizes, strides)
    return bool(strided(x.data_ptr(), *sizes, *strides))


@torch.library.custom_op("attnopt::any_nonfinite", mutates_args=(), device_types="cpu")
def any_nonfinite_op(x: Tensor) -> Tensor:
    """A 0-d bool tensor: whether ``x`` holds NaN or ±inf, by ``nonfinite_*`` of ``_native/finite.c``
    where it applies (else ``~isfinite(x).all()``) — the C check as one op (issue 30 item 2). The
    library's own checks call :func:`check_finite` / :func:`any_nonfinite` directly (a host
    answer, and no ``custom_op`` per-call cost)."""
    fns = _finite_fns()
    bad = None if fns is None or not x.is_floating_point() else _native_nonfinite_untraced(x, fns)
    if bad is None:
        return ~torch.isfinite(x).all() if x.is_floating_point() else torch.tensor(False)
    return torch.tensor(bad)


@any_nonfinite_op.register_fake
def _(x: Tensor) -> Tensor:
    return x.new_empty((), dtype=torch.bool)


_native_nonfinite_untraced = _native.untraced(_native_nonfinite)  # (the op body takes an address)


def _check_finite(x: Tensor, sizes: tuple[int, ...] | None, strides: tuple[int, ...] | None) -> None:
    """What ``nonfinite_dense_*`` (``sizes`` None: ``x.numel()`` dense entries) or
    ``nonfinite_strided_*`` (four sizes and strides, in elements) reads of ``x``."""
    if sizes is None or strides is None:
        require("nonfinite_dense", "x", x, dtype=x.dtype)
    else:
        require_size("nonfinite_strided", "dims", len(sizes), at_least=4, at_most=4)
        require_view("nonfinite_strided", "x", x, dtype=x.dtype, sizes=sizes, strides=strides)


def _values(x: Tensor) -> Tensor | None:
    """The tensor that holds ``x``'s values, or ``None`` where there are none to read.

    ``torch.func`` wraps a tensor once per transform level (a ``vmap`` batched tensor, a
    ``grad``/``jvp`` wrapper, a functional tensor); the innermost tensor holds the values (for
    ``vmap``, those of the whole batch) and ordinary ops and ``.item()`` on it are allowed inside
    the transform. Meta tensors and the fake tensors of shape propagation have no values.
    """
    while _is_wrapped(x):
        x = _unwrap(x)
    if x.is_meta or (type(x) not in _PLAIN and _is_fake(x)):
        return None
    return x


def _is_fake(x: Tensor) -> bool:
    from torch._subclasses.fake_tensor import is_fake  # only for tensor subclasses (rare)

    return bool(is_fake(x))


def _nonfinite_message(name: str) -> str:
    return (
        f"{name} contains NaN or ±inf; attnopt rejects non-finite inputs (mask keys with "
        "attn_mask instead of -inf in the inputs)"
    )


def _raise_nonfinite(name: str) -> None:
    raise ValueError(_nonfinite_message(name))


_PLAIN = (torch.Tensor, torch.nn.Parameter)  # not subclasses such as torch.compile's fake tensors
_is_wrapped = torch._C._functorch.is_functorch_wrapped_tensor  # torch.func's grad/vmap wrappers
_unwrap = torch._C._functorch.get_unwrapped  # one level of them
#: ``(ATTNOPT_NATIVE=0?, {dtype: (dense, strided)} or None)``: the ``finite.c`` entry points,
#: loaded (and compiled) on the first check, looked up again when ``ATTNOPT_NATIVE`` changes
_FINITE: list = [None, None]


def _finite_fns() -> dict | None:
    state = _native.switched_off()
    if _FINITE[0] is state:
        return _FINITE[1]
    lib = _native.library("finite")
    fns = None
    if lib is not None:
        import ctypes

        fns = {}
        i64, ptr = ctypes.c_int64, ctypes.c_void_p
        for dtype, suf in ((torch.float32, "f32"), (torch.float64, "f64")):
            dense = getattr(lib, f"nonfinite_dense_{suf}")
            dense.argtypes, dense.restype = [ptr, i64], i64
            strided = getattr(lib, f"nonfinite_strided_{suf}")
            strided.argtypes, strided.restype = [ptr] + [i64] * 8, i64
            fns[dtype] = (dense, strided)
    _FINITE[:] = [state, fns]
    return fns


def _total(x: Tensor) -> Tensor:
    """Sum of ``x`` (float32 or float64), non-finite iff ``x`` holds NaN/±inf or the sum overflows."""
    if not x.is_floating_point():
        return torch.zeros((), dtype=torch.float32, device=x.device)  # integers are finite
    if x.dtype in (torch.float32, torch.float64):
        return x.sum()
    return x.sum(dtype=torch.float32)


_MASK_SHAPES = (
    "boolean or float, of a shape that broadcasts to (B, H, Nq, Nk), e.g. (Nk,), (B, 1, 1, Nk), (Nq, Nk)"
)


def check_mask(attn_mask: object, target: Sequence[int], name: str = "attn_mask") -> None:
    """Type and shape of an SDPA-style mask (the values are checked by :func:`additive_mask`)."""
    if attn_mask is None:
        return
    if not isinstance(attn_mask, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor or None, got {type(attn_mask).__name__}")
    if attn_mask.dtype != torch.bool and not attn_mask.is_floating_point():
        raise TypeError(f"{name} must be boolean or floating point, got {attn_mask.dtype}")
    try:
        check_broadcastable(name, attn_mask, target)
    except ValueError as exc:
        raise ValueError(f"{exc}; accepted: {_MASK_SHAPES}") from None


def validate_attention(
    q: Tensor, k: Tensor, v: Tensor | None = None, attn_mask: object = None
) -> tuple[int, int, int]:
    """The entry check of every attention op: shapes, dtypes, devices, mask shape, finiteness.

    Returns ``(Nq, Nk, d)``. See the module docstring for the policies.
    """
    nq, nk, d = check_attention_inputs(q, k, v)
    batch = broadcast_shapes(q.shape[:-2], k.shape[:-2], *(() if v is None else (v.shape[:-2],)))
    check_mask(attn_mask, (*batch, nq, nk))
    check_finite(q=q, k=k, v=v)
    return nq, nk, d


def to_rank(x: Tensor, ndim: int) -> Tensor:
    """View ``x`` with leading singleton dims up to ``ndim`` (what broadcasting would do)."""
    if x.dim() >= ndim:
        return x
    return x.reshape((1,) * (ndim - x.dim()) + tuple(x.shape))


def resolve_scale(scale: float | None, head_dim: int) -> float:
    """Return ``scale`` or the default ``1/sqrt(head_dim)``; reject non-positive or non-finite."""
    if scale is None:
        if head_dim < 1:
            raise ValueError("q and k have head dimension d = 0: pass an explicit scale")
        return 1.0 / math.sqrt(head_dim)
    if isinstance(scale, Tensor):
        raise TypeError("scale must be a Python number, not a tensor")
    scale = float(scale)
    if not math.isfinite(scale) or scale <= 0.0:
        raise ValueError(f"scale must be a finite number > 0, got {scale}")
    return scale


def check_broadcastable(name: str, x: Tensor, target: Sequence[int]) -> None:
    """Raise ``ValueError`` unless ``x`` broadcasts to ``target`` without growing ``target``."""
    try:
        out = broadcast_shapes(tuple(x.shape), tuple(target))
    except RuntimeError as exc:
        raise ValueError(
            f"{name} of shape {tuple(x.shape)} does not broadcast to {tuple(target)}"
        ) from exc
    if tuple(out) != tuple(target):
        raise ValueError(f"{name} of shape {tuple(x.shape)} does not broadcast to {tuple(target)}")


def additive_mask(
    attn_mask: Tensor | None, target: Sequence[int], dtype: torch.dtype, name: str = "attn_mask"
) -> Tensor | None:
    """Convert an SDPA-style mask to an additive float mask (0 = keep, -inf = drop).

    A boolean mask uses PyTorch's SDPA convention: ``True`` means *take part in attention*.
    A floating mask is added to the scores as is. ``target`` is the broadcast shape of the
    scores ``(..., Nq, Nk)``; the mask is not expanded, but it gets the rank of ``target``
    (leading singleton dims, a view), so that a 1-D key mask works wherever PyTorch wants
    ``(…, Nq, Nk)``.
    """
    if attn_mask is None:
        return None
    check_mask(attn_mask, target, name)
    assert isinstance(attn_mask, Tensor)
    if attn_mask.dtype == torch.bool:
        # zeros_like: batched like the mask under torch.func.vmap (an in-place fill of unbatched
        # zeros by a batched mask is an error there)
        out = torch.zeros_like(attn_mask, dtype=dtype)
        return to_rank(out.masked_fill_(~attn_mask, float("-inf")), len(target))
    # one reduction: max() is NaN if any entry is NaN and +inf if any is +inf; under torch.func the
    # values under the wrappers are read (none for meta tensors)
    values = host_values(attn_mask)
    if values is not None:
        if values.numel() and not bool(values.detach().max() < float("inf")):
            raise ValueError(f"{name} must not contain NaN or +inf")
    elif attn_mask.numel():
        device_assert(attn_mask, lambda t: t.max() < float("inf"), f"{name} must not contain NaN or +inf")
    return to_rank(attn_mask.to(dtype), len(target))


def causal_additive_mask(nq: int, nk: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    """``(Nq, Nk)`` additive mask of SDPA's ``is_causal`` (top-left aligned lower triangle)."""
    # j > i by a broadcast comparison, not ``tril``: tril parallelizes even a 3×4 tensor, and a
    # parallel region took ~20 ms of wall time on a loaded 2-core machine (TensorIterator ops
    # stay serial below their grain size)
    drop = torch.arange(nk, device=device) > torch.arange(nq, device=device).unsqueeze(-1)
    return torch.zeros(nq, nk, dtype=dtype, device=device).masked_fill_(drop, float("-inf"))


def combine_additive(*masks: Tensor | None) -> Tensor | None:
    """Sum additive masks, skipping ``None``; ``None`` when all are ``None``."""
    out: Tensor | None = None
    for m in masks:
        if m is None:
            continue
        out = m if out is None else out + m
    return out


def zero_anchor(*xs: Tensor) -> Tensor:
    """An exact ``0.0`` that depends on every ``x`` (zero gradients, never NaN: empty slices)."""
    total = xs[0].new_zeros(())
    for x in xs:
        if x.dim() == 0:
            x = x.reshape(1)
        total = total + x.narrow(-1, 0, 0).sum().to(total.dtype)
    return total


def empty_attention(q: Tensor, k: Tensor, v: Tensor, *extra: Tensor | None) -> Tensor | None:
    """The result every attention op gives for empty sizes, or ``None`` if nothing is empty.

    Policy (one for every op): ``Nq = 0`` or an empty batch/head dimension gives an empty
    output ``(…, Nq, dv)``; ``Nk = 0`` (no key to attend to) gives zeros, like a fully
    masked row. The result is differentiable with zero (finite) gradients for ``q``, ``k``,
    ``v`` (and the ``extra`` tensors, e.g. a preference), and no kernel ever sees an empty
    tensor.
    """
    if q.numel() and k.numel() and v.numel():  # no empty dim anywhere: the common case, no shape work
        return None
    batch = broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2])
    shape = (*batch, q.shape[-2], v.shape[-1])
    if q.shape[-2] and k.shape[-2] and 0 not in batch:
        return None
    return q.new_zeros(shape) + zero_anchor(q, k, v, *(x for x in extra if x is not None)).to(q.dtype)


def empty_weights(q: Tensor, k: Tensor, *extra: Tensor | None) -> Tensor | None:
    """The ``(…, Nq, Nk)`` weights for empty sizes (an empty tensor), or ``None``.

    See :func:`empty_attention`.
    """
    batch = broadcast_shapes(q.shape[:-2], k.shape[:-2])
    shape = (*batch, q.shape[-2], k.shape[-2])
    if 0 not in shape:
        return None
    return q.new_zeros(shape) + zero_anchor(q, k, *(x for x in extra if x is not None)).to(q.dtype)
