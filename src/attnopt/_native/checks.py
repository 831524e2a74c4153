r"""What a C kernel receives, checked in Python before the call (issue 29, item 3).

A C kernel of :mod:`attnopt._native` gets bare addresses and sizes: it cannot tell a short
buffer, a strided view or a float64 tensor read as float32 from the right argument, and any of
them is a silent out-of-bounds read or write. So each wrapper has one ``_check_<kernel>(...)``
beside its C call that states, with the sizes it passes to C, what every tensor argument must be
(:func:`require`, :func:`require_view`), and calls it right before the call. A mismatch is a bug
of attnopt (the wrapper built a buffer of the wrong size, forgot a ``.contiguous()``, ...): it
raises :class:`NativeArgumentError` naming the kernel and the argument, and never reaches C.

The checks are integer arithmetic on the shapes and strides at hand (no tensor ops): a few
attribute reads per tensor, paid on every call of the native path.
"""
from __future__ import annotations

import torch

__all__ = ["NativeArgumentError", "fail", "require", "require_dense", "require_size", "require_view"]


class NativeArgumentError(RuntimeError):
    """A tensor or size about to be handed to a C kernel does not fit what the kernel reads or
    writes (an internal error of attnopt: please report it)."""


def fail(kernel: str, name: str | None, what: str) -> NativeArgumentError:
    """The error for ``kernel``'s argument ``name`` (None: the call as a whole), to raise."""
    where = f"C kernel {kernel!r}" if name is None else f"C kernel {kernel!r}, argument {name!r}"
    return NativeArgumentError(f"attnopt internal error: {where}: {what}")


def require(
    kernel: str, name: str, t: torch.Tensor, *, dtype: torch.dtype, numel: int | None = None,
    min_numel: int | None = None, contiguous: bool = True,
) -> None:
    """Check that ``t`` is a CPU tensor of ``dtype``, contiguous (unless ``contiguous=False``), with
    exactly ``numel`` entries or at least ``min_numel``.

    Args:
        kernel: the C entry point (family), for the message.
        name: the argument, for the message.
        t: the tensor whose address the kernel gets.
        dtype: the element type the kernel reads it as.
        numel: the entries the kernel reads or writes from the address on, if exact.
        min_numel: a lower bound on the entries, where the tensor may be larger (a scratch buffer).
        contiguous: whether the kernel reads it densely (row-major, no gaps).
    Raises:
        NativeArgumentError: any of these does not hold.
    """
    if t.dtype is not dtype:
        raise fail(kernel, name, f"dtype {t.dtype}, expected {dtype}")
    if not t.is_cpu:
        raise fail(kernel, name, f"on {t.device}, expected the CPU")
    if contiguous and not t.is_contiguous():
        raise fail(kernel, name, f"not contiguous (shape {tuple(t.shape)}, strides {t.stride()})")
    if numel is not None and t.numel() != numel:
        raise fail(kernel, name, f"{t.numel()} entries, the kernel uses {numel}")
    if min_numel is not None and t.numel() < min_numel:
        raise fail(kernel, name, f"{t.numel()} entries, the kernel uses {min_numel}")


def require_view(
    kernel: str, name: str, t: torch.Tensor, *, dtype: torch.dtype, sizes: tuple[int, ...],
    strides: tuple[int, ...], offset: int = 0, limit: int | None = None,
) -> None:
    """Check that a kernel reading ``t``'s memory from ``t.data_ptr() + offset`` elements with
    ``sizes`` and ``strides`` (in elements, as passed to C) stays inside ``t``'s storage: the
    element indices it reaches, ``offset + Σ i_d · stride_d`` over ``0 <= i_d < size_d``, lie in
    ``[-t.storage_offset(), room)`` where ``room`` is the storage's length past ``t``'s first
    element. A negative stride reads backwards (a Toeplitz bias's rows: stride −1 from offset
    ``Nq − 1``).

    ``limit``: where the view is a region of a scratch tensor, the end of the region (the reads stay
    below it: they do not run into the next region). Also checks ``dtype`` and the CPU. Used where a
    kernel reads a view with its own strides (a
    broadcast mask, a head-shared parameter, a transposed gradient) or a buffer at an offset.

    Raises:
        NativeArgumentError: the reads overrun the storage (either end), or the dtype or device differ.
    """
    if t.dtype is not dtype:
        raise fail(kernel, name, f"dtype {t.dtype}, expected {dtype}")
    if not t.is_cpu:
        raise fail(kernel, name, f"on {t.device}, expected the CPU")
    if len(sizes) != len(strides):
        raise fail(kernel, name, f"{len(sizes)} sizes and {len(strides)} strides")
    if offset == 0 and limit is None:
        if sizes == t.shape and strides == t.stride():
            return  # t itself: every element reached is one of its own
        if len(sizes) == t.dim() and _inside(t, sizes, strides):
            return  # a sub-view or broadcast of t's own elements (no storage lookup)
    low = high = offset
    for size, stride in zip(sizes, strides):
        if size <= 0:
            return  # nothing is read
        if stride < 0:
            low += (size - 1) * stride
        else:
            high += (size - 1) * stride
    if low >= 0 and high < (t.numel() if limit is None else min(limit, t.numel())) and t.is_contiguous():
        return  # inside t's own (dense) elements and the region: no storage lookup
    start = t.storage_offset()
    room = t.untyped_storage().nbytes() // t.element_size() - start
    if limit is not None:
        room = min(room, limit)
    if low < -start or high >= room:
        raise fail(kernel, name, f"reads elements {low}..{high} from its first one (sizes {sizes}, strides "
                                  f"{strides}, offset {offset}), its storage holds {-start}..{room - 1}")


def _inside(t: torch.Tensor, sizes: tuple[int, ...], strides: tuple[int, ...]) -> bool:
    """Whether the reads of ``sizes``/``strides`` from ``t``'s first element reach only ``t``'s own
    elements: along each dim the size is at most ``t``'s with ``t``'s stride, or the stride is 0 (a
    broadcast), or one index is read."""
    shape, own = t.shape, t.stride()
    if 0 in shape:  # no element of its own (index 0 of a broadcast dim is none either)
        return False
    for i, (size, stride) in enumerate(zip(sizes, strides)):
        if size > 1 and stride != 0 and (stride != own[i] or size > shape[i]):
            return False
    return True


def require_size(kernel: str, name: str, value: int, *, at_most: int | None = None,
                 at_least: int = 0) -> None:
    """Check an integer handed to C (a count, an offset into a buffer) against its bounds.

    Raises:
        NativeArgumentError: ``value < at_least`` or ``value > at_most``.
    """
    if value < at_least or (at_most is not None and value > at_most):
        raise fail(kernel, name, f"{value}, expected within [{at_least}, {at_most}]")


def require_dense(kernel: str, name: str, x: torch.Tensor | tuple[torch.Tensor, int] | tuple[torch.Tensor,
                                                                                             int, int],
                  *, dtype: torch.dtype, numel: int) -> None:
    """Check a dense buffer of ``numel`` entries: a contiguous tensor of exactly ``numel`` entries, or
    ``(t, offset)``: ``numel`` entries of the contiguous ``t`` from element ``offset`` on, inside ``t``, or
    ``(t, offset, end)``: the same inside the region ``[offset, end)`` of ``t`` (a plan's scratch layout:
    a buffer that does not run into the next one). A region's scratch tensor is checked for its dtype
    and bounds only: the caller checks once per call that it is a contiguous CPU tensor (:func:`require`).

    Raises:
        NativeArgumentError: dtype, device, contiguity or the bounds do not hold.
    """
    if isinstance(x, tuple):
        t, offset = x[0], x[1]
        total = t.numel()
        end = total if len(x) < 3 else min(x[2], total)  # type: ignore[misc]
        if t.dtype is not dtype:  # (the scratch's device and layout: checked once per call by the caller)
            raise fail(kernel, name, f"dtype {t.dtype}, expected {dtype}")
        if offset < 0 or offset + numel > end:
            raise fail(kernel, name, f"entries {offset}..{offset + numel} of a region {offset}..{end} of a "
                                      f"scratch of {t.numel()}")
        return
    require(kernel, name, x, dtype=dtype, numel=numel)
