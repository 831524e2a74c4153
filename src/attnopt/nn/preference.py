r"""Preference modules producing ``log u`` for generalized attention (fenchel-dual-attention).

In the MEM view (eq. 16–18) a preference distribution ``u`` over the templates (keys) enters
attention as an additive ``log u`` on the scores. These modules produce it:

* :class:`T5RelativePreference` — ``u_ij ∝ exp(b_{bucket(j−i)})`` with learned per-head
  scalars ``b`` over T5's log-spaced relative-position buckets (eq. 17–18);
* :class:`ALiBiPreference` — ``log u_ij = −m_h |i − j|`` with fixed per-head slopes;
* :class:`KeyPreference` — a small network of the key-side context, ``log u_j = NN(x_j)``
  (the context-dependent preference of Sec. 7): key-only, shape ``(B, H, 1, Nk)``.

Every module implements ``log_preference(query, key)`` for inputs ``(B, Nq, E)``,
``(B, Nk, E)``, returning a tensor broadcastable to ``(B, H, Nq, Nk)``.
"""
from __future__ import annotations

import ctypes
import math
import weakref
from typing import Any

import torch
from torch import Tensor, nn

from attnopt import _func, _native
from attnopt._native.checks import fail, require, require_view
from attnopt.functional._thresholds import THRESHOLDS
from attnopt.functional.generalized._toeplitz import mark_toeplitz, mark_toeplitz_table

__all__ = [
    "PreferenceModule",
    "T5RelativePreference",
    "ALiBiPreference",
    "KeyPreference",
    "relative_position_bucket",
    "alibi_slopes",
]


class PreferenceModule(nn.Module):
    """Base class: a module producing ``log u`` broadcastable to ``(B, H, Nq, Nk)``."""

    def log_preference(self, query: Tensor, key: Tensor) -> Tensor:
        """``log u`` for ``query (B, Nq, E)`` and ``key (B, Nk, E)``."""
        raise NotImplementedError


def relative_position_bucket(
    relative_position: Tensor, *, bidirectional: bool = True, num_buckets: int = 32, max_distance: int = 128
) -> Tensor:
    """T5's bucketing of ``relative_position = key_pos − query_pos`` (as in T5 / HF transformers).

    Half of the buckets (per direction when ``bidirectional``) are exact small distances, the
    rest are log-spaced up to ``max_distance``; larger distances share the last bucket. With
    ``bidirectional=False`` (decoder / causal), positive (future) positions map to bucket 0.
    """
    buckets = torch.zeros_like(relative_position)
    if bidirectional:
        num_buckets //= 2
        buckets = buckets + (relative_position > 0).long() * num_buckets
        distance = relative_position.abs()
    else:
        distance = -torch.clamp(relative_position, max=0)
    max_exact = num_buckets // 2
    is_small = distance < max_exact
    large = max_exact + (
        torch.log(distance.float().clamp(min=1) / max_exact)
        / math.log(max_distance / max_exact)
        * (num_buckets - max_exact)
    ).long()
    large = torch.clamp(large, max=num_buckets - 1)
    return buckets + torch.where(is_small, distance, large)


class T5RelativePreference(PreferenceModule):
    r"""T5 relative position bias as a preference (fenchel-dual-attention eq. 17–18).

    .. math:: \log u_{ij} = b_{h,\,\mathrm{bucket}(j - i)}

    Args:
        num_heads: H; one learned scalar per (bucket, head).
        num_buckets: number of relative-position buckets (T5: 32).
        max_distance: distance beyond which positions share a bucket (T5: 128).
        bidirectional: encoder-style (True) or causal/decoder-style (False) buckets.

    Note:
        A learned bias requires grad: :func:`attnopt.generalized_attention` then runs a fused
        materialized path (O(Nq·Nk) memory, as SDPA's math kernel would). The bias is one
        autograd node from the ``num_buckets × H`` table (laid out in C where the native kernels
        run; its backward sums the gradient over diagonals into the buckets); the offset → bucket
        table is cached per (Nq, Nk, device). The returned tensor carries the table and the
        bucket of each offset (:mod:`attnopt.functional.generalized._toeplitz`): the C paths of
        generalized attention read the bias from them and send the gradient to the table
        directly — so ``torch.autograd.grad(out, bias)`` for this very tensor finds it unused
        there; ask for the gradient of the table, or of a copy (``bias.clone()`` is an ordinary
        tensor).
    """

    def __init__(
        self, num_heads: int, *, num_buckets: int = 32, max_distance: int = 128, bidirectional: bool = True
    ) -> None:
        super().__init__()
        if num_heads <= 0 or num_buckets <= 1 or max_distance <= 1:
            raise ValueError(
                f"num_heads > 0, num_buckets > 1 and max_distance > 1 required, got "
                f"{num_heads}, {num_buckets}, {max_distance}"
            )
        if (num_buckets // (2 if bidirectional else 1)) // 2 >= max_distance:
            raise ValueError("max_distance must exceed the number of exact buckets")
        self.num_heads, self.num_buckets = num_heads, num_buckets
        self.max_distance, self.bidirectional = max_distance, bidirectional
        self.relative_attention_bias = nn.Embedding(num_buckets, num_heads)
        nn.init.normal_(self.relative_attention_bias.weight, std=0.1)

    def forward(self, query_len: int, key_len: int) -> Tensor:
        """``log u`` of shape ``(1, H, query_len, key_len)`` (contiguous)."""
        weight = self.relative_attention_bias.weight
        if query_len == 0 or key_len == 0:
            return weight.new_zeros(1, self.num_heads, query_len, key_len)
        # the bias depends on j − i only: one autograd node lays the bucket values out as a Toeplitz
        # matrix (in C where the native kernels run); its backward sums the gradient over diagonals
        # and adds the sums into the buckets. The table rides along (see its toeplitz.py): the C paths of
        # generalized attention read it (or the per-offset values gathered from it) instead of the
        # bias and send the gradient to it directly (no (H, Nq, Nk) gradient)
        buckets, index = self._buckets(query_len, key_len, weight.device)
        if _func.under_transform():  # torch.func (vmap, grad, ...), forward AD: plain ops, no custom node
            return _t5_plain(weight, buckets, query_len, key_len)
        if torch.compiler.is_compiling():
            # traced by torch.compile / export: the C fill as one op (attnopt::t5_toeplitz) where the
            # library is built (_native.ready: answered at trace time), else plain ops; never
            # the custom node (its C forward is untraced: inside an autograd.Function that dynamo
            # traces as a higher-order op, an untraced frame cannot graph-break: fullgraph fails)
            if _native.ready("biased_softmax") and weight.device.type == "cpu" \
                    and weight.dtype in (torch.float32, torch.float64):
                traced: Tensor = torch.ops.attnopt.t5_toeplitz(weight, buckets, index, query_len, key_len)
                return traced
            return _t5_plain(weight, buckets, query_len, key_len)
        bias: Tensor = _T5Bias.apply(weight, buckets, index, query_len, key_len)
        return mark_toeplitz_table(bias, weight, buckets)

    def _buckets(self, query_len: int, key_len: int, device: torch.device) -> tuple[Tensor, Tensor | None]:
        """Bucket of each offset ``j − i = −(Nq−1) … Nk−1`` and, up to ``THRESHOLDS.t5_gather_limit``
        entries, the flat offset index of the ``(Nq, Nk)`` grid; cached per (Nq, Nk, device)."""
        key = (query_len, key_len, device)
        cache: dict[tuple[int, int, torch.device], tuple[Tensor, Tensor | None]] = self.__dict__.setdefault(
            "_bucket_cache", {})
        hit = cache.get(key)
        if hit is None:
            rel = torch.arange(-(query_len - 1), key_len, device=device)
            buckets = relative_position_bucket(
                rel, bidirectional=self.bidirectional, num_buckets=self.num_buckets,
                max_distance=self.max_distance,
            )
            index = None
            if query_len * key_len <= THRESHOLDS.t5_gather_limit:
                i = torch.arange(query_len, device=device)
                j = torch.arange(key_len, device=device)
                index = (j[None, :] - i[:, None] + (query_len - 1)).flatten()
            hit = (buckets, index)
            # inside torch.func (vmap of grad) the new tensors are wrapped; under compile / export, fake
            if _func.level() is None and not torch.compiler.is_compiling():
                if len(cache) >= 8:
                    cache.clear()
                cache[key] = hit
        return hit

    def log_preference(self, query: Tensor, key: Tensor) -> Tensor:
        return self(query.shape[-2], key.shape[-2])


def _toeplitz_view(buf: Tensor, nq: int, nk: int) -> Tensor:
    """``(H, Nq, Nq + Nk − 1)`` buffer -> ``(H, Nq, Nk)`` view ``T[:, i, j] = buf[:, i, j − i + Nq − 1]``.

    Row stride ``C − 1`` (``C = Nq + Nk − 1``) from offset ``Nq − 1`` shifts row ``i`` left by
    ``i``; the rows stay contiguous, so reading or writing the view runs at memcpy speed.
    """
    h, _, c = buf.shape
    return buf.as_strided((h, nq, nk), (nq * c, c - 1, 1), buf.storage_offset() + nq - 1)




def _t5_plain(table: Tensor, buckets: Tensor, nq: int, nk: int) -> Tensor:
    """:class:`_T5Bias`'s PyTorch-op forward, differentiated by autograd: the path under
    ``torch.func`` transforms (an old-style Function has no vmap rule; wrapped tensors have no
    memory for C). Not marked with its table: the consumers see an ordinary tensor."""
    per_offset = table.t().index_select(1, buckets)  # row i: the window from Nq − 1 − i
    return per_offset.unfold(-1, nk, 1).flip(-2).contiguous().view(1, table.shape[1], nq, nk)


class _T5Bias(torch.autograd.Function):
    """``table (num_buckets, H)`` -> contiguous ``(1, H, Nq, Nk)``, entry ``(h, i, j)`` =
    ``table[buckets[j − i + Nq − 1], h]``: one C call where the native kernels run (CPU
    float32/64 with storage, not while ``torch.compile`` traces), else a gather of the per-offset
    values and one contiguous copy of their windows (row ``i`` is the window from ``Nq − 1 − i``).
    The backward sums the gradient over each diagonal ``j − i`` (:func:`_diagonal_sums`; ``index``,
    the flat offsets ``j − i + Nq − 1`` or ``None``, selects its index-add route) and adds the sums
    into the buckets."""

    @staticmethod
    @_native.untraced
    def forward(ctx: Any, table: Tensor, buckets: Tensor, index: Tensor | None, nq: int, nk: int) -> Tensor:
        ctx.save_for_backward(buckets, index)
        ctx.rows = table.shape[0]
        heads = table.shape[1]
        lib = None
        if (table.device.type == "cpu" and table.dtype in (torch.float32, torch.float64)
                and not torch.compiler.is_compiling() and _native.has_storage(table)):
            lib = _native.library("biased_softmax")
        if lib is None:
            return _t5_plain(table, buckets, nq, nk)
        out = table.new_empty(1, heads, nq, nk)
        _check_t5_toeplitz(table, buckets, out, nq, nk)
        fill = _fill(lib, table.dtype)
        if fill(table.data_ptr(), table.stride(0), table.stride(1), buckets.data_ptr(), heads, nq, nk,
                out.data_ptr()) != 0:
            raise MemoryError("T5RelativePreference: out of memory")
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        # exact double backward: linear in grad, no forward state (index_add_ / copy_ are tracked)
        buckets, index = ctx.saved_tensors
        sums = _diagonal_sums(grad, index)  # (H, Nq + Nk − 1)
        table = sums.new_zeros(ctx.rows, sums.shape[0]).index_add_(0, buckets, sums.t())
        return table, None, None, None, None


@torch.library.custom_op("attnopt::t5_toeplitz", mutates_args=(), device_types="cpu")
def t5_toeplitz(table: Tensor, buckets: Tensor, index: Tensor | None, nq: int,  # noqa: ARG001
                nk: int) -> Tensor:
    """``(1, H, Nq, Nk)``, entry ``(h, i, j)`` = ``table[buckets[j − i + Nq − 1], h]``: the C fill
    (``bsf_toeplitz_*``) as one op (issue 30 item 2), for graphs; plain eager code calls
    :class:`_T5Bias` directly (the Python ``custom_op`` path costs a fixed few tens of µs per call).
    The registered backward is :class:`_T5Bias`'s (diagonal sums into the buckets, plain ops:
    differentiable again); ``index`` selects its route (:func:`_diagonal_sums`)."""
    return _t5_fill(table, buckets, nq, nk)


@_native.untraced
def _t5_fill(table: Tensor, buckets: Tensor, nq: int, nk: int) -> Tensor:
    lib = _native.library("biased_softmax") if table.dtype in (torch.float32, torch.float64) else None
    if lib is None:
        return _t5_plain(table, buckets, nq, nk)
    out = table.new_empty(1, table.shape[1], nq, nk)
    _check_t5_toeplitz(table, buckets, out, nq, nk)
    if _fill(lib, table.dtype)(table.data_ptr(), table.stride(0), table.stride(1), buckets.data_ptr(),
                               table.shape[1], nq, nk, out.data_ptr()) != 0:
        raise MemoryError("T5RelativePreference: out of memory")
    return out


@t5_toeplitz.register_fake
def _(table: Tensor, buckets: Tensor, index: Tensor | None, nq: int, nk: int) -> Tensor:  # noqa: ARG001
    return table.new_empty(1, table.shape[1], nq, nk)


def _t5_setup(ctx: Any, inputs: tuple, output: Tensor) -> None:  # noqa: ARG001
    table, buckets, index, _, _ = inputs
    ctx.rows = table.shape[0]
    ctx.save_for_backward(buckets, index)


def _t5_backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
    buckets, index = ctx.saved_tensors
    sums = _diagonal_sums(grad, index)  # (H, Nq + Nk − 1)
    return sums.new_zeros(ctx.rows, sums.shape[0]).index_add_(0, buckets, sums.t()), None, None, None, None


t5_toeplitz.register_autograd(_t5_backward, setup_context=_t5_setup)


def _check_t5_toeplitz(table: Tensor, buckets: Tensor, out: Tensor, nq: int, nk: int) -> None:
    """What ``bsf_toeplitz_*`` reads and writes: ``table`` (rows, H) with its strides, ``Nq + Nk − 1``
    dense int64 ``buckets`` (values in ``[0, rows)``: :func:`relative_position_bucket` clamps them to
    ``num_buckets − 1``, and the table is the ``(num_buckets, H)`` embedding), ``out`` dense
    ``(1, H, Nq, Nk)``."""
    kernel = "bsf_toeplitz"
    if table.dim() != 2:
        raise fail(kernel, "table", f"{table.dim()} dims, expected 2")
    require_view(kernel, "table", table, dtype=table.dtype, sizes=tuple(table.shape), strides=table.stride())
    require(kernel, "buckets", buckets, dtype=torch.int64, numel=nq + nk - 1)
    require(kernel, "out", out, dtype=table.dtype, numel=table.shape[1] * nq * nk)


def _fill(lib: ctypes.CDLL, dtype: torch.dtype) -> Any:
    """``bsf_toeplitz_{f32,f64}`` of ``_native/biased_softmax.c`` with its argument types declared
    (once per library object: plain ints are passed, no ctypes objects per call)."""
    name = "bsf_toeplitz_f64" if dtype == torch.float64 else "bsf_toeplitz_f32"
    done: dict[str, Any] = lib.__dict__.setdefault("_attnopt_t5", {})
    fn = done.get(name)
    if fn is None:
        fn = getattr(lib, name)
        vp, i64 = ctypes.c_void_p, ctypes.c_int64
        fn.restype, fn.argtypes = ctypes.c_int, [vp, i64, i64, vp, i64, i64, i64, vp]
        done[name] = fn
    return fn


def _diagonal_sums(grad: Tensor, index: Tensor | None) -> Tensor:
    """``(B|1, H, Nq, Nk)`` gradient -> its sums over each diagonal ``j − i``: ``(H, Nq + Nk − 1)``."""
    g = grad[0] if grad.shape[0] == 1 else grad.sum(0)  # (H, Nq, Nk)
    h, nq, nk = g.shape
    if index is not None:
        return g.new_zeros(h, nq + nk - 1).index_add_(1, index, g.reshape(h, -1))
    buf = g.new_zeros(h, nq, nq + nk - 1)
    _toeplitz_view(buf, nq, nk).copy_(g)
    return buf.sum(1)  # (H, Nq + Nk − 1): the diagonal sums, by offset j − i


def alibi_slopes(num_heads: int) -> Tensor:
    """ALiBi's default per-head slopes: ``2^(−8h/H)``, h = 1..H (interleaved if H is not a power of 2)."""
    if num_heads <= 0:
        raise ValueError(f"num_heads must be > 0, got {num_heads}")

    def power_of_two(n: int) -> list[float]:
        start = 2.0 ** (-8.0 / n)
        return [start ** (i + 1) for i in range(n)]

    if math.log2(num_heads).is_integer():
        slopes = power_of_two(num_heads)
    else:
        closest = 2 ** math.floor(math.log2(num_heads))
        slopes = power_of_two(closest) + power_of_two(2 * closest)[0::2][: num_heads - closest]
    return torch.tensor(slopes, dtype=torch.float64)


class ALiBiPreference(PreferenceModule):
    r"""ALiBi as a preference: ``log u_ij = −m_h |i − j|`` (fixed slopes ``m_h``).

    The same penalty is the locality regularizer of sdpa-one-sided-eot Prop. 4.4; it is
    computed exactly as ``-(slopes.view(H,1,1) * (arange(Nq)[:,None] - arange(Nk)[None,:]).abs())``.

    Args:
        num_heads: H.
        slopes: (H,) non-negative slopes; default :func:`alibi_slopes`.
    """

    slopes: Tensor

    def __init__(self, num_heads: int, *, slopes: Tensor | None = None) -> None:
        super().__init__()
        if slopes is None:
            slopes = alibi_slopes(num_heads)
        slopes = torch.as_tensor(slopes, dtype=torch.get_default_dtype())
        if slopes.shape != (num_heads,):
            raise ValueError(f"slopes must have shape ({num_heads},), got {tuple(slopes.shape)}")
        if not torch.isfinite(slopes).all() or (slopes < 0).any():
            raise ValueError("slopes must be finite and non-negative")
        self.num_heads = num_heads
        self.register_buffer("slopes", slopes.to(torch.get_default_dtype()))

    def forward(self, query_len: int, key_len: int) -> Tensor:
        """``log u`` of shape ``(1, H, query_len, key_len)``, contiguous, in the slopes' dtype.

        Built once per (Nq, Nk, device, dtype, slopes) and cached: the returned tensor is
        shared between calls (an in-place change of it, or of ``slopes``, is noticed by its
        version counter and the bias is built anew).
        """
        return self._cached(query_len, key_len, self.slopes.dtype)

    def _cached(self, query_len: int, key_len: int, dtype: torch.dtype) -> Tensor:
        slopes = self.slopes
        if _func.level() is not None or torch.compiler.is_compiling():
            # inside torch.func or while torch.compile traces: the new tensors may be wrapped or fake
            # and the slopes' storage is not reachable; built anew, not kept
            return self._build(query_len, key_len, self._per_offset(query_len,
                                                                    key_len)).to(dtype).contiguous()
        key = (query_len, key_len, slopes.device, dtype)
        storage = slopes.untyped_storage()
        layout = (slopes.storage_offset(), slopes.stride(), slopes._version)
        cache: dict[tuple[object, ...], tuple[weakref.ref, tuple[object, ...], Tensor, int]] = (
            self.__dict__.setdefault("_bias_cache", {}))
        hit = cache.get(key)
        if hit is not None and hit[0]() is storage and hit[1] == layout and hit[2]._version == hit[3]:
            return hit[2]
        per_offset = self._per_offset(query_len, key_len)
        bias = self._build(query_len, key_len, per_offset).to(dtype).contiguous()
        if len(cache) >= 8:
            cache.clear()
        if per_offset is not None:  # the C path of generalized attention reads these (its toeplitz.py)
            mark_toeplitz(bias, per_offset.to(dtype))
        # the slopes' memory is named by a weak reference to its storage object (PyTorch keeps one
        # Python object per storage while it lives), not by its address: a freed storage's address
        # may be reused by the next allocation (``slopes.data = other``), a dead weak reference not
        cache[key] = (weakref.ref(storage), layout, bias, bias._version)
        return bias

    def _per_offset(self, query_len: int, key_len: int) -> Tensor | None:
        """``−m_h |j − i|`` per offset ``j − i = −(Nq−1) … Nk−1``: (H, Nq + Nk − 1); ``None`` if empty."""
        if query_len == 0 or key_len == 0:
            return None
        dist = torch.arange(-(query_len - 1), key_len, device=self.slopes.device)
        return -(self.slopes.view(self.num_heads, 1) * dist.abs().to(self.slopes.dtype))

    def _build(self, query_len: int, key_len: int, per_offset: Tensor | None) -> Tensor:
        # the same products per offset j − i, laid out as a Toeplitz matrix (as in T5RelativePreference)
        if per_offset is None:
            return self.slopes.new_zeros(1, self.num_heads, query_len, key_len)
        return per_offset.unfold(-1, key_len, 1).flip(-2).unsqueeze(0)

    def log_preference(self, query: Tensor, key: Tensor) -> Tensor:
        return self._cached(query.shape[-2], key.shape[-2], query.dtype)


class KeyPreference(PreferenceModule):
    r"""Context-dependent, key-only preference (fenchel-dual-attention Sec. 7).

    .. math:: \log u_{h,j} = \mathrm{MLP}(x_j)_h

    A two-layer MLP of the key-side context maps each key to one log-preference per head;
    the output ``(B, H, 1, Nk)`` broadcasts over queries, so SDPA keeps its fused kernel and
    O(N) memory. Only ratios of ``u`` matter (rows are normalized), so ``log u`` is left
    unconstrained.

    Args:
        embed_dim: feature size E of the key-side context.
        num_heads: H.
        hidden_dim: MLP width (default ``embed_dim``).
    """

    def __init__(self, embed_dim: int, num_heads: int, *, hidden_dim: int | None = None) -> None:
        super().__init__()
        if embed_dim <= 0 or num_heads <= 0:
            raise ValueError(f"embed_dim and num_heads must be > 0, got {embed_dim}, {num_heads}")
        hidden = hidden_dim or embed_dim
        self.num_heads = num_heads
        self.net = nn.Sequential(nn.Linear(embed_dim, hidden), nn.GELU(), nn.Linear(hidden, num_heads))

    def forward(self, key: Tensor) -> Tensor:
        """``key (B, Nk, E)`` -> ``log u (B, H, 1, Nk)``."""
        if key.dim() != 3:
            raise ValueError(f"key must be (B, Nk, E), got {tuple(key.shape)}")
        return self.net(key).transpose(1, 2).unsqueeze(2)

    def log_preference(self, query: Tensor, key: Tensor) -> Tensor:  # noqa: ARG002
        return self(key)
