"""Capture queries, keys, values, masks and weights of every attention layer of a model.

Forward hooks on the query/key/value projections record their inputs ``x`` (the templates
and evidence of fenchel-dual-attention eq. 19) and outputs; a forward hook (with keyword
arguments) on the attention module records the mask, T5's relative position bias and, when
the model runs its eager attention, its own attention weights.

Architectures are described by data (:data:`ADAPTERS`): Hugging Face BERT-family encoders
(BERT, RoBERTa, MiniLM, ELECTRA, … — ``query``/``key``/``value``), DistilBERT
(``q_lin``/``k_lin``/``v_lin``) and T5 (``q``/``k``/``v`` with a relative position bias;
encoder self-, decoder self- and cross-attention). Nothing here imports ``transformers``.
"""
from __future__ import annotations

import re
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

__all__ = [
    "ArchitectureAdapter",
    "ADAPTERS",
    "AttentionSite",
    "CapturedAttention",
    "AttentionCapture",
    "find_attention_sites",
    "capture_attention",
    "to_additive_mask",
]


@dataclass(frozen=True)
class ArchitectureAdapter:
    """How one family of attention modules names its parts.

    Attributes:
        name: family name (``"bert"``, ``"distilbert"``, ``"t5"``).
        query, key, value: attribute names of the ``nn.Linear`` projections.
        heads: attribute holding the number of heads.
        head_dim: attribute holding the head size.
        mask_arg: keyword under which the module receives its mask.
        out_proj: attribute of an output projection applied *inside* the module's forward
            (its first output is then ``out_proj(context)``), or ``None``.
        position_bias_output: index of the position bias in the module's output tuple.
    """

    name: str
    query: str
    key: str
    value: str
    heads: str
    head_dim: str
    mask_arg: str
    out_proj: str | None = None
    position_bias_output: int | None = None


ADAPTERS: tuple[ArchitectureAdapter, ...] = (
    ArchitectureAdapter("bert", "query", "key", "value", "num_attention_heads", "attention_head_size",
                        "attention_mask"),
    ArchitectureAdapter("distilbert", "q_lin", "k_lin", "v_lin", "n_heads", "attention_head_size",
                        "attention_mask", out_proj="out_lin"),
    ArchitectureAdapter("t5", "q", "k", "v", "n_heads", "key_value_proj_dim", "mask", out_proj="o",
                        position_bias_output=1),
)


@dataclass(frozen=True)
class AttentionSite:
    """One attention module of a model.

    Attributes:
        name: qualified module name, e.g. ``encoder.layer.0.attention.self``.
        kind: ``"self"`` (encoder), ``"decoder_self"`` or ``"cross"``.
        layer: 0-based block index within its stack.
        adapter: the :class:`ArchitectureAdapter` that matched.
        module: the attention module.
        num_heads, head_dim: head count and size ``d'``.
        scaling: the factor applied to ``<q, k>`` (``1/sqrt(d')``; 1 for T5).
    """

    name: str
    kind: str
    layer: int
    adapter: ArchitectureAdapter
    module: nn.Module
    num_heads: int
    head_dim: int
    scaling: float

    def projection(self, which: str) -> nn.Linear:
        """The ``"query"``, ``"key"``, ``"value"`` or ``"out"`` linear layer."""
        attr = self.adapter.out_proj if which == "out" else getattr(self.adapter, which)
        if attr is None:
            raise ValueError(f"{self.adapter.name} attention has no {which} projection")
        lin = getattr(self.module, attr)
        assert isinstance(lin, nn.Linear)
        return lin


@dataclass
class CapturedAttention:
    """What one attention module saw and produced in one forward pass.

    Shapes: ``B`` batch, ``H`` heads, ``Nq``/``Nk`` query/key lengths, ``d`` model width,
    ``d'`` head size.

    Attributes:
        site: the :class:`AttentionSite`.
        x_query: (B, Nq, d) input of the query projection (``x_k`` / ``y_k`` in eq. 19).
        x_key: (B, Nk, d) input of the key projection (``x_i`` in eq. 19).
        q, k, v: (B, H, N, d') projected and split into heads (biases included).
        attn_mask: additive mask broadcastable to (B, H, Nq, Nk), ``-inf`` = excluded, or None.
        position_bias: T5's relative position bias (1|B, H, Nq, Nk), or None.
        weights: (B, H, Nq, Nk) the model's own attention weights (eager attention), or None.
        output: the module's first output (B, Nq, ·).
    """

    site: AttentionSite
    x_query: Tensor
    x_key: Tensor
    q: Tensor
    k: Tensor
    v: Tensor
    attn_mask: Tensor | None
    position_bias: Tensor | None
    weights: Tensor | None
    output: Tensor

    def score_bias(self) -> Tensor | None:
        """``position_bias + attn_mask`` (the log-preference ``log u`` up to a row constant)."""
        parts = [p for p in (self.position_bias, self.attn_mask) if p is not None]
        if not parts:
            return None
        out = parts[0]
        for p in parts[1:]:
            out = out + p
        return out

    def rebuild_output(self) -> Tensor:
        """Recompute the module's output from the captured ``q, k, v`` and bias (for checks)."""
        scores = torch.matmul(self.q, self.k.transpose(-2, -1)) * self.site.scaling
        bias = self.score_bias()
        if bias is not None:
            scores = scores + bias.to(scores.dtype)
        weights = torch.softmax(scores, dim=-1)
        ctx = torch.matmul(weights, self.v).transpose(1, 2).reshape(self.q.shape[0], self.q.shape[2], -1)
        if self.site.adapter.out_proj is not None:
            ctx = self.site.projection("out")(ctx)
        return ctx


def to_additive_mask(mask: Tensor | None, dtype: torch.dtype = torch.float32) -> Tensor | None:
    """A Hugging Face mask as an additive float mask with ``-inf`` for excluded pairs.

    Boolean masks follow SDPA (``True`` = take part). Float masks use ``finfo.min`` for
    excluded pairs; any value below ``finfo.min / 2`` becomes ``-inf`` so that the
    preference ``u = exp(mask)`` is exactly 0 there.
    """
    if mask is None:
        return None
    if mask.dtype == torch.bool:
        return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))
    if not mask.is_floating_point():
        raise TypeError(f"attention mask must be boolean or floating point, got {mask.dtype}")
    low = torch.finfo(mask.dtype).min / 2
    return mask.to(dtype).masked_fill(mask <= low, float("-inf"))


def _layer_index(name: str) -> int:
    m = re.search(r"(?:layer|block|layers|h)\.(\d+)", name)
    return int(m.group(1)) if m else 0


def _kind(name: str, module: nn.Module) -> str:
    lname = name.lower()
    if "encdec" in lname or "crossattention" in lname or "cross_attn" in lname:
        return "cross"
    if lname.startswith("decoder") or getattr(module, "is_decoder", False):
        return "decoder_self"
    return "self"


def _match(module: nn.Module) -> ArchitectureAdapter | None:
    for adapter in ADAPTERS:
        if all(isinstance(getattr(module, a, None), nn.Linear) for a in (adapter.query, adapter.key,
                                                                           adapter.value)) and (
            isinstance(getattr(module, adapter.heads, None), int)
            and isinstance(getattr(module, adapter.head_dim, None), int)
        ):
            return adapter
    return None


def find_attention_sites(model: nn.Module) -> list[AttentionSite]:
    """Every attention module of ``model`` that an :data:`ADAPTERS` entry recognizes.

    Raises:
        ValueError: no attention module was recognized (unsupported architecture).
    """
    sites: list[AttentionSite] = []
    for name, module in model.named_modules():
        adapter = _match(module)
        if adapter is None:
            continue
        heads = int(getattr(module, adapter.heads))
        head_dim = int(getattr(module, adapter.head_dim))
        scaling = float(getattr(module, "scaling", head_dim**-0.5))
        sites.append(AttentionSite(name, _kind(name, module), _layer_index(name), adapter, module,
                                   heads, head_dim, scaling))
    if not sites:
        raise ValueError(
            f"model {type(model).__name__}: no supported attention module found "
            f"(supported: {', '.join(a.name for a in ADAPTERS)})"
        )
    return sites


@dataclass
class AttentionCapture:
    """Records filled by :func:`capture_attention`, in execution order."""

    sites: list[AttentionSite]
    records: list[CapturedAttention] = field(default_factory=list)

    def by_kind(self, kind: str) -> list[CapturedAttention]:
        """Records of one kind (``"self"``, ``"decoder_self"``, ``"cross"``), in order."""
        return [r for r in self.records if r.site.kind == kind]


def _split_heads(x: Tensor, heads: int, head_dim: int) -> Tensor:
    return x.reshape(*x.shape[:-1], heads, head_dim).transpose(-3, -2)


@contextmanager
def capture_attention(
    model: nn.Module, *, sites: Sequence[AttentionSite] | None = None, eager: bool = True
) -> Iterator[AttentionCapture]:
    """Context manager recording a :class:`CapturedAttention` per attention call.

    Args:
        model: a Hugging Face model (or any module tree the adapters recognize).
        sites: the sites to watch (default: :func:`find_attention_sites`).
        eager: switch the model to ``attn_implementation="eager"`` inside the block (so that
            the model's own weights are recorded) and restore it afterwards.

    Yields:
        an :class:`AttentionCapture` whose ``records`` fill up as the model runs. Tensors are
        detached. Run the model with ``use_cache=False`` for encoder-decoders.
    """
    watched = list(sites) if sites is not None else find_attention_sites(model)
    capture = AttentionCapture(watched)
    handles: list[Any] = []
    pending: dict[int, dict[str, Tensor]] = {}

    def proj_hook(site_id: int, which: str):  # type: ignore[no-untyped-def]
        def hook(_mod: nn.Module, inputs: tuple[Tensor, ...], output: Tensor) -> None:
            slot = pending.setdefault(site_id, {})
            slot[f"x_{which}"] = inputs[0].detach()
            slot[which] = output.detach()

        return hook

    def site_hook(site_id: int, site: AttentionSite):  # type: ignore[no-untyped-def]
        def hook(_mod: nn.Module, _args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None:
            slot = pending.pop(site_id, {})
            if not {"query", "key", "value"} <= slot.keys():
                return  # cached keys (generation): nothing complete to record
            outs = output if isinstance(output, tuple) else (output,)
            bias = None
            at = site.adapter.position_bias_output
            if at is not None and len(outs) > at:
                bias = outs[at]
            weights = outs[-1] if len(outs) > 1 and isinstance(outs[-1], Tensor) else None
            if weights is not None and weights.dim() != 4:
                weights = None
            capture.records.append(CapturedAttention(
                site=site,
                x_query=slot["x_query"],
                x_key=slot["x_key"],
                q=_split_heads(slot["query"], site.num_heads, site.head_dim),
                k=_split_heads(slot["key"], site.num_heads, site.head_dim),
                v=_split_heads(slot["value"], site.num_heads, slot["value"].shape[-1] // site.num_heads),
                attn_mask=to_additive_mask(kwargs.get(site.adapter.mask_arg)),
                position_bias=None if bias is None else bias.detach().float(),
                weights=None if weights is None else weights.detach(),
                output=outs[0].detach(),
            ))

        return hook

    for i, site in enumerate(watched):
        for which in ("query", "key", "value"):
            handles.append(site.projection(which).register_forward_hook(proj_hook(i, which)))
        handles.append(site.module.register_forward_hook(site_hook(i, site), with_kwargs=True))
    config = getattr(model, "config", None)
    previous = getattr(config, "_attn_implementation", None)
    switch = eager and previous not in (None, "eager") and hasattr(model, "set_attn_implementation")
    if switch:
        model.set_attn_implementation("eager")  # type: ignore[operator]  # a transformers model (hasattr)
    try:
        yield capture
    finally:
        for h in handles:
            h.remove()
        if switch:
            model.set_attn_implementation(previous)  # type: ignore[operator]  # a transformers model
