r"""Per-epoch attention diagnostics of the doubly-normalized paper's training runs.

* Explaining away (Fig. 1): :func:`column_mass_summary` reduces attention weights to the
  minimum column mass :math:`\min_j \sum_i \pi_{ij}` and the fraction of keys whose mass is
  below :math:`1/(10 N_k)` (Lemma 1: DNAS never goes below :math:`1/N_k`; LNAS may explain
  keys away). :class:`ColumnMassLogger` collects it from every attention module of a model
  during an evaluation pass by asking the modules for their weights through forward hooks —
  the model itself is not changed.
* HNAS mixing weights (Fig. 3, Fig. 4): :func:`hnas_weights` reads ``w = sigmoid(θ)`` of every
  module that has a ``mixing_weight`` (:class:`attnopt.nn.HybridNormalizedMultiheadAttention`).
"""
from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor, nn

from attnopt.analysis.column_mass import column_mass

__all__ = [
    "ColumnMassLogger", "column_mass_over", "column_mass_summary", "hnas_weights", "is_attention_module",
    "padding_from_mask",
]


def column_mass_summary(
    weights: Tensor,
    *,
    key_padding_mask: Tensor | None = None,
    query_padding_mask: Tensor | None = None,
    ratio: float = 0.1,
) -> dict[str, float]:
    r"""Minimum column mass and the fraction of explained-away keys of a batch of weights.

    .. math:: m_{bhj} = \sum_{i \text{ real}} \pi_{bhij}, \qquad
              \text{frac} = \frac{\#\{(b,h,j): j \text{ real},\ m_{bhj} < \text{ratio}/N_k^{(b)}\}}
                                 {\#\{(b,h,j): j \text{ real}\}}

    Args:
        weights: (B, H, Nq, Nk) or (B, Nq, Nk) attention weights.
        key_padding_mask: (B, Nk) boolean, True = padding key (excluded; ``N_k^{(b)}`` counts
            the real keys of sample b).
        query_padding_mask: (B, Nq) boolean, True = padding query (its row is not summed).
        ratio: the threshold is ``ratio / N_k`` (the paper's plots: 1/(10 N_k)).
    Returns:
        ``{"min_column_mass", "min_column_mass_x_nk", "frac_explained_away", "n_keys"}``:
        the minimum over real keys, that minimum times the key count (>= 1 for DNAS,
        Lemma 1), the fraction below threshold, and the number of (b, h, j) counted.
    Raises:
        ValueError: bad shapes or ``ratio <= 0``.
    """
    if weights.dim() == 3:
        weights = weights.unsqueeze(1)
    if weights.dim() != 4:
        raise ValueError(f"weights must be (B, H, Nq, Nk) or (B, Nq, Nk), got {tuple(weights.shape)}")
    if not ratio > 0:
        raise ValueError(f"ratio must be > 0, got {ratio}")
    b, _, nq, nk = weights.shape
    w = weights.detach().double()
    if query_padding_mask is not None:
        if query_padding_mask.shape != (b, nq):
            raise ValueError(f"query_padding_mask must be ({b}, {nq}), got {tuple(query_padding_mask.shape)}")
        w = w.masked_fill(query_padding_mask.view(b, 1, nq, 1), 0.0)
    real = torch.ones(b, nk, dtype=torch.bool, device=w.device)
    if key_padding_mask is not None:
        if key_padding_mask.shape != (b, nk):
            raise ValueError(f"key_padding_mask must be ({b}, {nk}), got {tuple(key_padding_mask.shape)}")
        real = ~key_padding_mask.bool()
    mass = column_mass(w)  # (B, H, Nk)
    n_real = real.sum(-1).clamp_min(1).double()  # (B,)
    real3 = real.unsqueeze(1).expand_as(mass)
    below = (mass < (ratio / n_real).view(b, 1, 1)) & real3
    masked = mass.masked_fill(~real3, math.inf)
    scaled = (mass * n_real.view(b, 1, 1)).masked_fill(~real3, math.inf)
    count = int(real3.sum())
    return {
        "min_column_mass": float(masked.min()) if count else math.nan,
        "min_column_mass_x_nk": float(scaled.min()) if count else math.nan,
        "frac_explained_away": float(below.sum()) / count if count else math.nan,
        "n_keys": float(count),
    }


def padding_from_mask(attn_mask: Tensor, batch: int, nq: int, nk: int) -> tuple[Tensor, Tensor] | None:
    """``(key padding (B, Nk), query padding (B, Nq))`` of a padding-only mask, else ``None``.

    ``attn_mask`` is boolean (``True`` = not allowed) or additive (``-inf`` = not allowed),
    shaped ``(Nq, Nk)`` or ``(B|1, 1, Nq|1, Nk|1)`` (broadcast to ``(batch, nq, nk)``). It is a
    padding mask when it equals the
    union of its fully masked columns (padding keys) and fully masked rows (padding queries);
    a causal or any other structured mask gives ``None``.
    """
    m = attn_mask if attn_mask.dtype == torch.bool else torch.isneginf(attn_mask)
    if m.dim() == 2:
        m = m[None, None]
    if m.dim() != 4 or m.shape[1] != 1:
        return None
    m = m[:, 0].expand(batch, nq, nk)
    keys = m.all(dim=-2)
    queries = m.all(dim=-1)
    if not torch.equal(m, keys[:, None, :] | queries[:, :, None]):
        return None
    return keys, queries


def is_attention_module(module: nn.Module) -> bool:
    """Registry-style attention: ``forward(query, key, value, *, need_weights=...) -> (out, weights)``."""
    from attnopt.nn._multihead import MultiheadBase

    return isinstance(module, (MultiheadBase, nn.MultiheadAttention))


class ColumnMassLogger:
    """Context manager collecting :func:`column_mass_summary` from a model's attention modules.

    Inside the ``with`` block every selected module is called with ``need_weights=True`` and
    ``average_attn_weights=False`` (a forward pre-hook) and its weights are reduced on the fly;
    the caller still receives what it asked for (``None`` weights, or their head average).
    Outside the block the model is untouched. Padding given as
    ``key_padding_mask``/``query_padding_mask`` or as a padding-only ``attn_mask``
    (:func:`padding_from_mask`) is excluded; causal or otherwise structured masks are skipped:
    there a key is hidden from most queries by construction (the last key is seen by one query),
    which is not explaining away. In self-attention (key is the query) the key padding mask also
    removes padding queries.

    Args:
        model: any module.
        select: ``(name, module) -> bool`` choosing the modules (default: :func:`is_attention_module`).
        ratio: threshold ratio of :func:`column_mass_summary`.

    Example::

        with ColumnMassLogger(model) as log:
            model(x)
        log.summary()  # {"min_column_mass": ..., "frac_explained_away": ..., ...}
    """

    def __init__(self, model: nn.Module, *, select: Callable[[str, nn.Module], bool] | None = None,
                 ratio: float = 0.1) -> None:
        choose = select or (lambda _n, m: is_attention_module(m))
        self.modules = [(n, m) for n, m in model.named_modules() if choose(n, m)]
        self.ratio = ratio
        self._handles: list[Any] = []
        self._asked: list[bool] = []
        self._average: list[bool] = []
        self._min = math.inf
        self._min_nk = math.inf
        self._below = 0.0
        self._count = 0.0

    def _pre(self, _module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, Any]:
        self._asked.append(bool(kwargs.get("need_weights", False)))
        self._average.append(bool(kwargs.get("average_attn_weights", True)))
        kwargs = dict(kwargs, need_weights=True, average_attn_weights=False)  # per head, for the summary
        return args, kwargs

    def _post(self, _module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> Any:
        asked = self._asked.pop() if self._asked else True
        average = self._average.pop() if self._average else False
        weights = output[1] if isinstance(output, tuple) and len(output) > 1 else None
        if weights is None:
            return None
        # what the caller asked for: no weights, or the head average (the modules' default)
        given = (weights.mean(dim=-3) if average and weights.dim() >= 3 else weights) if asked else None
        unchanged = (output[0], given, *output[2:])
        if kwargs.get("is_causal"):
            return unchanged  # not a set of keys (see the class docstring)
        query = args[0] if args else kwargs.get("query")
        key = args[1] if len(args) > 1 else kwargs.get("key")
        kpm = kwargs.get("key_padding_mask")
        if kpm is not None and kpm.dtype != torch.bool:
            kpm = torch.isneginf(kpm)
        qpm = kpm if (key is None or key is query) else None
        qpad = kwargs.get("query_padding_mask")  # the models pass query padding this way (O(N))
        if qpad is not None:
            qpad = qpad if qpad.dtype == torch.bool else torch.isneginf(qpad)
            qpm = qpad if qpm is None else qpm | qpad
        attn_mask = kwargs.get("attn_mask")
        if attn_mask is not None:
            pads = padding_from_mask(attn_mask, weights.shape[0], weights.shape[-2], weights.shape[-1])
            if pads is None:
                return unchanged  # causal or otherwise structured: not explaining away
            kpm = pads[0] if kpm is None else kpm | pads[0]
            qpm = pads[1] if qpm is None else qpm | pads[1]
        s = column_mass_summary(weights, key_padding_mask=kpm, query_padding_mask=qpm, ratio=self.ratio)
        if s["n_keys"]:
            self._min = min(self._min, s["min_column_mass"])
            self._min_nk = min(self._min_nk, s["min_column_mass_x_nk"])
            self._below += s["frac_explained_away"] * s["n_keys"]
            self._count += s["n_keys"]
        return unchanged

    def __enter__(self) -> ColumnMassLogger:
        for _, m in self.modules:
            self._handles.append(m.register_forward_pre_hook(self._pre, with_kwargs=True))
            self._handles.append(m.register_forward_hook(self._post, with_kwargs=True))
        return self

    def __exit__(self, *exc: object) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def summary(self) -> dict[str, float]:
        """``{"min_column_mass", "min_column_mass_x_nk", "frac_explained_away"}`` over all calls so far
        (NaN when nothing was recorded)."""
        if not self._count:
            return {"min_column_mass": math.nan, "min_column_mass_x_nk": math.nan,
                    "frac_explained_away": math.nan}
        return {"min_column_mass": self._min, "min_column_mass_x_nk": self._min_nk,
                "frac_explained_away": self._below / self._count}


@torch.no_grad()
def column_mass_over(model: nn.Module, batches: Iterable[Any], forward: Callable[[nn.Module, Any], Any],
                     *, select: Callable[[str, nn.Module], bool] | None = None) -> dict[str, float]:
    """Run ``forward(model, batch)`` over ``batches`` in eval mode under a :class:`ColumnMassLogger`."""
    was_training = model.training
    model.eval()
    try:
        with ColumnMassLogger(model, select=select) as log:
            for batch in batches:
                forward(model, batch)
    finally:
        model.train(was_training)
    return log.summary()


def hnas_weights(model: nn.Module) -> dict[str, float]:
    """``{"hnas_w/<i>": w}`` for the i-th module (in ``named_modules`` order) with a ``mixing_weight``
    (mean over heads when per head); empty when the model has none. Each ``w`` lies in (0, 1)."""
    out: dict[str, float] = {}
    i = 0
    for _, m in model.named_modules():
        w = getattr(m, "mixing_weight", None)
        if isinstance(w, Tensor):
            out[f"hnas_w/{i}"] = float(w.float().mean())
            i += 1
    return out
