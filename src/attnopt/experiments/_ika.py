r"""Shared pieces of the implicit-kernel-attention tasks (Tables 2–5): arms and attention probes.

Arms map the paper's table rows to registry names (:func:`attnopt.nn.make_attention`):
``transformer`` is SDPA (``softmax``); the fixed kernels ``rbf-only``, ``expsin``, ``linear``;
the implicit kernels ``ika-s``, ``ika-ns`` (L2 magnitude), ``ikan``, ``ikan-direct``,
``mikan`` (L^p magnitude with the task's ``p``).

Probes run a model once more on a fixed batch and read, per attention layer, the weights or
the similarity × magnitude decomposition (Prop. 1) of the scores the layer computed; they
never change the model.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor, nn

__all__ = [
    "IKA_ARMS",
    "FIXED_ARMS",
    "arm_options",
    "attention_layers",
    "capture_layer_inputs",
    "layer_weights",
    "similarity_magnitude",
    "head_std",
    "sparsity_stats",
]

IKA_ARMS = ("ika-s", "ika-ns", "ikan", "ikan-direct", "mikan")
FIXED_ARMS = ("rbf-only", "expsin", "linear")
_REGISTRY_NAME = {"transformer": "softmax"}


def arm_options(
    arm: str, *, p: float, num_samples: int, hidden: int = 32, mode: str | None = None
) -> dict[str, Any]:
    """``{"attention": registry name, "attention_options": {...}}`` of one arm.

    ``ika-s``/``ika-ns`` keep the L2 magnitude (they are the paper's IKA rows); ``ikan``,
    ``ikan-direct`` and ``mikan`` use ``p``; every implicit kernel uses ``num_samples`` points.
    An arm ``"<base>-p<value>"`` (e.g. ``"mikan-p0.5"``) is ``<base>`` with that ``p``.
    ``mode="linear"`` selects the implicit kernels' exact linear-time form (long inputs; key
    padding masks only, so not for causal decoders); the task size knob ``attention_mode``.

    Raises:
        ValueError: unknown arm.
    """
    base = arm
    if "-p" in arm and arm.rsplit("-p", 1)[0] in ("ikan", "ikan-direct", "mikan"):
        base, p_txt = arm.rsplit("-p", 1)
        p = float(p_txt)
    if base in ("transformer", *FIXED_ARMS):
        return {"attention": _REGISTRY_NAME.get(base, base), "attention_options": {}}
    extra: dict[str, Any] = {} if mode is None else {"mode": mode}
    opts: dict[str, Any]
    if base in ("ika-s", "ika-ns"):
        opts = {"num_samples": num_samples, "hidden": hidden, **extra}
        return {"attention": base, "attention_options": opts}
    if base in ("ikan", "ikan-direct", "mikan"):
        opts = {"num_samples": num_samples, "p": p, **extra}
        if base != "ikan-direct":
            opts["hidden"] = hidden
        return {"attention": base, "attention_options": opts}
    raise ValueError(f"unknown arm {arm!r}; valid: transformer, {', '.join(FIXED_ARMS + IKA_ARMS)}")


def attention_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(name, module)`` of every attention module (it has ``q_proj`` and ``k_proj``), in order."""
    return [(n, m) for n, m in model.named_modules() if hasattr(m, "q_proj") and hasattr(m, "k_proj")]


def capture_layer_inputs(
    model: nn.Module, layers: list[nn.Module], run: Callable[[], Any]
) -> list[tuple[tuple[Any, ...], dict[str, Any]]]:
    """Run ``run()`` (a forward of ``model``) in eval mode, recording each layer's call arguments."""
    seen: list[tuple[tuple[Any, ...], dict[str, Any]] | None] = [None] * len(layers)
    handles = []
    for i, layer in enumerate(layers):

        def hook(_m: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], i: int = i) -> None:
            if seen[i] is None:
                seen[i] = (args, dict(kwargs))

        handles.append(layer.register_forward_pre_hook(hook, with_kwargs=True))
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            run()
    finally:
        for h in handles:
            h.remove()
        model.train(was_training)
    missing = [i for i, s in enumerate(seen) if s is None]
    if missing:
        raise RuntimeError(f"attention layers {missing} were not called by the probe forward")
    return [s for s in seen if s is not None]


def layer_weights(layer: nn.Module, call: tuple[tuple[Any, ...], dict[str, Any]]) -> Tensor:
    """The layer's attention weights ``(B, H, Nq, Nk)`` for a recorded call (eval mode, no grad)."""
    args, kwargs = call
    was_training = layer.training
    layer.eval()
    try:
        with torch.no_grad():
            _, w = layer(*args, **{**kwargs, "need_weights": True, "average_attn_weights": False})
    finally:
        layer.train(was_training)
    if w is None:
        raise RuntimeError(f"{type(layer).__name__} returned no weights with need_weights=True")
    if w.dim() == 3:  # nn.MultiheadAttention averages heads unless told otherwise
        raise RuntimeError("per-head weights are needed (B, H, Nq, Nk)")
    return w


def _heads(layer: nn.Module, x: Tensor, proj: str) -> Tensor:
    """``layer``'s projection ``proj`` (a submodule name) of ``x`` (B, N, E), split into heads (B, H, N, E/H).

    Raises:
        TypeError: ``layer`` has no integer ``num_heads``.
    """
    y = layer.get_submodule(proj)(x)
    b, n, e = y.shape
    heads = getattr(layer, "num_heads", None)
    if not isinstance(heads, numbers.Integral):
        raise TypeError(f"{type(layer).__name__} needs an integer num_heads, got {heads!r}")
    h = int(heads)
    return y.view(b, n, h, e // h).transpose(1, 2)


def similarity_magnitude(
    layer: nn.Module, call: tuple[tuple[Any, ...], dict[str, Any]]
) -> tuple[float, float]:
    r"""Fig. 3's measures for one layer: (mean over queries of the maximum similarity, mean log magnitude).

    The scores of every mechanism factor as similarity × magnitude (Prop. 1, eq. 9):

    - SDPA (and the fixed kernels' RBF part): ``sim_ij = exp(−‖q_i − k_j‖²/(2√d))``,
      ``log mag_ij = (‖q_i‖² + ‖k_j‖²)/(2√d)`` (:func:`attnopt.analysis.decompose`);
    - implicit kernels: ``sim_ij = f(q_i, k_j)² + ε`` with the layer's kernel for this input
      and ``log mag_ij = (‖q_i‖_p² + ‖k_j‖_p²)/(2√d)``.

    The magnitude is reported as a mean logarithm (its raw value overflows). Only admissible
    (query, key) pairs count (``key_padding_mask``, ``query_padding_mask``, boolean or additive
    ``attn_mask``, ``is_causal``); queries with no admissible key (padding rows) are left out.
    """
    from attnopt.analysis.decompose import decompose
    from attnopt.functional.kernel import log_magnitude
    from attnopt.nn.implicit_kernel import ImplicitKernelAttention

    args, kwargs = call
    query = args[0]
    key = args[1] if len(args) > 1 and args[1] is not None else kwargs.get("key", query)
    key = query if key is None else key
    with torch.no_grad():
        q = _heads(layer, query, "q_proj")
        k = _heads(layer, key, "k_proj")
        d = q.shape[-1]
        allowed = _allowed(kwargs, q.shape[-2], k.shape[-2], q.device)  # (B|1, 1, Nq, Nk)
        if isinstance(layer, ImplicitKernelAttention):
            was = layer.training
            layer.eval()
            add = (
                None
                if allowed is None
                else torch.zeros(allowed.shape, dtype=k.dtype).masked_fill(~allowed, -math.inf)
            )
            kern = layer.kernel_for(k, add)  # h over the admissible keys
            layer.train(was)
            sim = kern(q, k).square() + float(getattr(layer, "eps", 1e-5))
            p = float(getattr(layer, "p", 2.0))
            s = 1.0 / math.sqrt(d)
            log_mag = log_magnitude(q, p, s).unsqueeze(-1) + log_magnitude(k, p, s).unsqueeze(-2)
        else:
            sim, log_mag = decompose(q, k, log=True)
            sim = sim.exp()
        if allowed is None:
            return float(sim.amax(-1).mean()), float(log_mag.mean())
        allowed = allowed.expand_as(sim)
        rows = allowed.any(-1)  # queries with at least one admissible key (padding queries drop out)
        row_max = sim.masked_fill(~allowed, 0.0).amax(-1)
        w = allowed.to(log_mag.dtype)
        return float(row_max[rows].mean()), float((log_mag * w).sum() / w.sum())


def _allowed(kwargs: Mapping[str, Any], nq: int, nk: int, device: torch.device) -> Tensor | None:
    """Boolean ``(B|1, 1, Nq, Nk)``: True where a key is admissible for a query (from the call's masks)."""
    out: Tensor | None = None
    pad = kwargs.get("key_padding_mask")
    if pad is not None:
        out = ~pad.bool().view(pad.shape[0], 1, 1, nk)
    qpad = kwargs.get("query_padding_mask")
    if qpad is not None:
        qp = qpad if qpad.dtype == torch.bool else torch.isneginf(qpad)
        q_ok = ~qp.view(qp.shape[0], 1, nq, 1)
        out = q_ok if out is None else out & q_ok
    mask = kwargs.get("attn_mask")
    if mask is not None:
        m = mask if mask.dtype == torch.bool else torch.isneginf(mask)
        while m.dim() < 4:
            m = m.unsqueeze(0)
        ok = ~m
        out = ok if out is None else out & ok
    if kwargs.get("is_causal"):
        tri = torch.ones(nq, nk, dtype=torch.bool, device=device).tril(nk - nq).view(1, 1, nq, nk)
        out = tri if out is None else out & tri
    return out


def head_std(weights: Tensor, valid: Tensor | None = None) -> float:
    """Fig. 5d: the standard deviation of the weights across heads, averaged over entries.

    ``weights (..., H, E)`` with heads on dim ``-2``; ``valid`` (broadcastable to ``(..., E)``)
    selects the entries that count.
    """
    sd = weights.std(dim=-2, unbiased=False)
    if valid is None:
        return float(sd.mean())
    v = valid.expand_as(sd).to(sd.dtype)
    return float((sd * v).sum() / v.sum())


def sparsity_stats(weights: Tensor, valid: Tensor | None = None) -> Mapping[str, float]:
    """Fig. 4's measures of rows ``(..., Nk)``: mean max weight, share of weights < 0.01 and > 0.99."""
    w = weights if valid is None else weights[valid.expand_as(weights)]
    rows_max = weights.amax(-1)
    return {
        "mean_max_weight": float(rows_max.mean()),
        "share_below_0.01": float((w < 0.01).double().mean()),
        "share_above_0.99": float((w > 0.99).double().mean()),
    }
