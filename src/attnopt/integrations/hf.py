"""Run any Hugging Face transformers model with attnopt's attention mechanisms.

:func:`register` adds each parameter-free mechanism of the package to
``transformers.AttentionInterface`` **together with a mask function** in
``transformers.masking_utils.AttentionMaskInterface`` under the same name — a function
registered without one silently receives ``attention_mask=None`` (padded batches then attend
to padding). The mask function always materializes a boolean mask (``True`` = take part),
never relying on an ``is_causal`` shortcut; in self-attention the rows of padding queries
are masked too, so that normalizations over queries (DNAS, Sinkhorn) see only real tokens
(a padded batch gives the unpadded results; outputs at padding positions are zeros).
After ``register()``::

    model = AutoModel.from_pretrained(path, attn_implementation="attnopt_dnas")
    model.set_attn_implementation("attnopt_sparsemax")

=====================  ==================================================================
name                   mechanism (options: :func:`register` defaults, or per call as
                       ``model(..., attnopt_iterations=0)`` keywords)
=====================  ==================================================================
attnopt_generalized    :func:`attnopt.generalized_attention`; T5's position bias is ``log u``
attnopt_softmax,       the same under the registry's names (:func:`attnopt.nn.attention_names`;
attnopt_lnas,          a model's own position bias, e.g. T5's, is its ``log u``)
attnopt_t5
attnopt_dnas           :func:`attnopt.doubly_normalized_attention` (``attnopt_iterations``, 1)
attnopt_sinkhorn       the same with ``attnopt_iterations`` Sinkhorn steps (default 3)
attnopt_hnas           :func:`attnopt.hybrid_normalized_attention` with fixed ``attnopt_weight``,
                       or the layer's learned weight after :func:`add_hnas_weights`
attnopt_sparsemax      :func:`attnopt.regularized_attention` with ``SquaredL2()``
attnopt_entmax         the same with ``Tsallis(attnopt_alpha)`` (default 1.5)
=====================  ==================================================================

**Causal decoders** (``attnopt_dnas``, ``attnopt_sinkhorn``, ``attnopt_hnas``). A causal mask
restricts the transport plan but does not make a normalization over queries autoregressive:
``c_j = logsumexp_i s_ij`` runs over the later queries too, so with the mask alone every position
would read the tokens after it. In a causal self-attention (GPT-2, Llama, a BERT/T5 decoder's
self-attention) these names therefore run the autoregressive variant (``causal="prefix"`` of
:func:`attnopt.doubly_normalized_attention`: position ``i`` normalizes over positions ``≤ i``),
also in cached generation (:mod:`attnopt.integrations._hf_prefix`: the module keeps the past
queries it needs). ``model(..., attnopt_causal="plan")`` (or ``register(dn_causal="plan")``)
runs the masked plan instead, for analysis. Encoders and cross-attention are unaffected — note
that a decoder's *cross*-attention (T5, BART) under these names still normalizes each source key
over every target position, so with teacher forcing it reads later target positions too; only
the causal self-attention is made autoregressive here::

    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="attnopt_dnas")
    model.generate(ids, max_new_tokens=8)    # autoregressive DNAS, cached

**Learned HNAS weight** (the paper's Sec. 6: a trainable ``u_l ∈ [0, 1]`` per layer
``l``, trained jointly with the model): :func:`add_hnas_weights` attaches an
:class:`HNASWeight` (``w = sigmoid(θ)``, one scalar per attention layer, initial ``w = 0.5``
by default — the paper gives no initial value; 0.5 starts from the equal mixture, as
:class:`attnopt.nn.HybridNormalizedMultiheadAttention`) to every attention module of a model
and switches it to ``attnopt_hnas``, which then uses that module's weight instead of the fixed
one. The parameters are ordinary ``nn.Parameter`` s of the model (``model.parameters()`` and
the optimizer see them); ``HNASWeight.mixing_weight`` is the detached ``w`` that
:func:`attnopt.experiments._diagnostics.hnas_weights` reads for the Fig. 3 / Fig. 4 plots::

    hf.register()
    weights = hf.add_hnas_weights(model)      # list, one per layer, in module order
    [float(w.mixing_weight) for w in weights]

Names are ``attnopt_`` + the registry name (:func:`attnopt.nn.make_attention`) of the same
mechanism; ``attnopt_generalized`` is kept as an alias. The list is data
(:data:`MECHANISMS`): a mechanism whose function is missing from the package is reported
by :func:`register`, not a crash.

**Fine-tuning**: every name implements the model's attention dropout (``dropout > 0`` in
``train()`` mode) on the attention weights before the sum over values, as SDPA does; the
generalized names pass it to SDPA itself, the others compute the weights materialized for that call
(O(N²) memory, see :mod:`attnopt.functional._dropout`). In ``eval()`` transformers passes
``dropout=0`` and the O(N)-memory paths run. A per-call ``attnopt_*`` keyword the mechanism does
not take (``attnopt_iteratons=0``) raises a ``TypeError`` naming it and the valid ones.
"""
from __future__ import annotations

import importlib
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from attnopt.integrations import _hf_prefix

__all__ = [
    "MECHANISMS", "Mechanism", "RegisterReport", "HNASWeight", "add_hnas_weights", "attention_modules",
    "register", "registered_names", "embedding_shift",
]

#: attribute name of the :class:`HNASWeight` submodule that :func:`add_hnas_weights` attaches
HNAS_ATTRIBUTE = "attnopt_hnas_weight"


@dataclass(frozen=True)
class Mechanism:
    """One registrable attention: ``name`` and the ``module:function`` it needs."""

    name: str
    target: str
    defaults: tuple[tuple[str, Any], ...] = ()


MECHANISMS: tuple[Mechanism, ...] = (
    Mechanism("attnopt_generalized", "attnopt.functional:generalized_attention"),
    # the registry's names (attnopt.nn.attention_names) for the same parameter-free mechanisms
    Mechanism("attnopt_softmax", "attnopt.functional:generalized_attention"),
    Mechanism("attnopt_lnas", "attnopt.functional:generalized_attention"),
    Mechanism("attnopt_t5", "attnopt.functional:generalized_attention"),
    Mechanism("attnopt_dnas", "attnopt.functional:doubly_normalized_attention",
              (("iterations", 1), ("causal", None))),
    Mechanism("attnopt_hnas", "attnopt.functional:hybrid_normalized_attention",
              (("iterations", 1), ("weight", 0.5), ("causal", None))),
    Mechanism("attnopt_sinkhorn", "attnopt.functional:doubly_normalized_attention",
              (("iterations", 3), ("causal", None))),
    Mechanism("attnopt_sparsemax", "attnopt.functional:regularized_attention"),
    Mechanism("attnopt_entmax", "attnopt.functional:regularized_attention", (("alpha", 1.5),)),
)


@dataclass
class RegisterReport:
    """What :func:`register` did: ``registered`` names, ``missing`` ``{name: reason}``."""

    registered: list[str] = field(default_factory=list)
    missing: dict[str, str] = field(default_factory=dict)


def _resolve(target: str) -> Callable[..., Tensor]:
    module, _, attr = target.partition(":")
    fn = getattr(importlib.import_module(module), attr)
    if not callable(fn):
        raise TypeError(f"{target} is not callable")
    return fn


def _bool_mask_function(*args: Any, **kwargs: Any) -> Tensor | None:
    """``AttentionMaskInterface`` entry: SDPA's boolean mask, always materialized."""
    from transformers.masking_utils import sdpa_mask

    kwargs["allow_is_causal_skip"] = False
    kwargs["allow_is_bidirectional_skip"] = False
    return sdpa_mask(*args, **kwargs)


def _masks(module: Any, query: Tensor, key: Tensor, attention_mask: Tensor | None,
           position_bias: Tensor | None) -> tuple[Tensor | None, Tensor | None]:
    """``(bool mask or None, additive float bias or None)`` of the HF call."""
    keep: Tensor | None = None
    bias: Tensor | None = None
    if attention_mask is not None:
        if attention_mask.dtype == torch.bool:
            keep = attention_mask
        else:  # an eager-style float mask: finfo.min marks excluded pairs
            keep = attention_mask > torch.finfo(attention_mask.dtype).min / 2
            bias = torch.where(keep, attention_mask, torch.zeros_like(attention_mask)).to(query.dtype)
    elif getattr(module, "is_causal", False) and query.shape[-2] > 1:
        nq, nk = query.shape[-2], key.shape[-2]
        keep = torch.ones(nq, nk, dtype=torch.bool, device=query.device).tril(nk - nq)
    if position_bias is not None:
        pb = position_bias.to(query.dtype)
        bias = pb if bias is None else bias + pb
    if keep is not None and keep.shape[-2:] != (query.shape[-2], key.shape[-2]):
        keep = keep[..., : query.shape[-2], : key.shape[-2]]
    if keep is not None and not _is_cross(module) and keep.shape[-1] == keep.shape[-2]:
        # self-attention: a query whose own token is masked is padding; drop its row so that
        # normalizations over queries (DNAS, Sinkhorn) see only real tokens
        keep = keep & keep.diagonal(dim1=-2, dim2=-1).unsqueeze(-1)
    return keep, bias


def _is_cross(module: Any) -> bool:
    """Cross-attention module? (BERT-style ``*CrossAttention`` classes; T5's non-causal decoder one)."""
    if "cross" in type(module).__name__.lower():
        return True
    return bool(getattr(module, "is_decoder", False)) and not bool(getattr(module, "is_causal", True))


def _additive(keep: Tensor | None, bias: Tensor | None, dtype: torch.dtype) -> Tensor | None:
    if bias is None:
        return keep
    if keep is None:
        return bias
    return bias.to(dtype).masked_fill(~keep, float("-inf"))


def _hnas_weight(module: Any, opts: dict[str, Any], query: Tensor) -> Tensor:
    """The layer's learned :class:`HNASWeight` (differentiable) or the fixed ``attnopt_weight``."""
    learned = getattr(module, HNAS_ATTRIBUTE, None)
    if isinstance(learned, HNASWeight):
        return learned().to(query.dtype)  # differentiable: the layer's trained u_l
    if not 0.0 <= float(opts["weight"]) <= 1.0:
        raise ValueError(f"attnopt_weight must be in [0, 1], got {opts['weight']}")
    return torch.as_tensor(float(opts["weight"]), dtype=query.dtype, device=query.device)


def _check_keywords(name: str, kwargs: dict[str, Any], defaults: dict[str, Any]) -> None:
    """Refuse an ``attnopt_*`` per-call keyword that ``name`` does not take (a misspelling would
    otherwise be ignored silently). Other keywords are Hugging Face's own (``position_ids``,
    ``position_bias``, cache arguments, ...) and pass untouched.

    Raises:
        TypeError: naming the unknown keyword(s) and the valid ones.
    """
    unknown = sorted(k for k in kwargs if k.startswith("attnopt_") and k[len("attnopt_"):] not in defaults)
    if unknown:
        valid = ", ".join(f"attnopt_{o}" for o in defaults) or "none"
        raise TypeError(f"{name} got unexpected keyword argument(s) {', '.join(unknown)}; "
                        f"valid attnopt keywords for {name}: {valid}")


def _make(mech: Mechanism, fn: Callable[..., Tensor], defaults: dict[str, Any]) -> Callable[..., Any]:
    from attnopt.functional import SquaredL2, Tsallis

    def attention(module: Any, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
                  scaling: float | None = None, dropout: float = 0.0, **kwargs: Any) -> tuple[Tensor, None]:
        groups = int(getattr(module, "num_key_value_groups", 1) or 1)
        if groups > 1:
            key = key.repeat_interleave(groups, dim=1)
            value = value.repeat_interleave(groups, dim=1)
        _check_keywords(mech.name, kwargs, defaults)
        opts = {o: kwargs.get(f"attnopt_{o}", v) for o, v in defaults.items()}
        generalized = mech.target.endswith(":generalized_attention")
        keep, bias = _masks(module, query, key, attention_mask, kwargs.get("position_bias"))
        causal_self = bool(getattr(module, "is_causal", False)) and not _is_cross(module)
        if generalized:
            out = fn(query, key, value, log_preference=bias, attn_mask=keep, scale=scaling, dropout_p=dropout)
        elif "causal" in opts and _hf_prefix.causal_mode(opts["causal"], causal_self) == "prefix":
            # the autoregressive variant: no position reads a later one (module docstring)
            w = _hnas_weight(module, opts, query) if mech.name == "attnopt_hnas" else None
            out = _hf_prefix.prefix_call(module, mech.name, query, key, value,
                                         _additive(keep, bias, query.dtype), scaling=scaling,
                                         iterations=int(opts["iterations"]), weight=w, dropout_p=dropout)
        elif mech.name in ("attnopt_dnas", "attnopt_sinkhorn"):
            out = fn(query, key, value, iterations=int(opts["iterations"]),
                     attn_mask=_additive(keep, bias, query.dtype), scale=scaling, causal="plan",
                     dropout_p=dropout)
        elif mech.name == "attnopt_hnas":
            out = fn(query, key, value, _hnas_weight(module, opts, query), iterations=int(opts["iterations"]),
                     attn_mask=_additive(keep, bias, query.dtype), scale=scaling, causal="plan",
                     dropout_p=dropout)
        else:
            reg = SquaredL2() if mech.name == "attnopt_sparsemax" else Tsallis(float(opts["alpha"]))
            out = fn(query, key, value, regularizer=reg, attn_mask=_additive(keep, bias, query.dtype),
                     scale=scaling, dropout_p=dropout)
        return out.transpose(1, 2).contiguous(), None

    attention.__name__ = mech.name
    attention.__doc__ = f"Hugging Face attention function {mech.name} ({mech.target})."
    return attention


class HNASWeight(nn.Module):
    r"""The learned HNAS mixing weight of one attention layer, :math:`u_l = \sigma(\theta_l)`.

    .. math:: \pi_{ij} = u_l\, \pi^{\mathrm{DNAS}}_{ij} + (1 - u_l)\, \pi^{\mathrm{LNAS}}_{ij}

    (doubly-normalized-attention Sec. 6). The sigmoid keeps ``u`` in (0, 1) for any ``θ``.

    Args:
        init_weight: initial ``u`` in (0, 1) (default 0.5, the equal mixture).

    Raises:
        ValueError: ``init_weight`` not in (0, 1).
    """

    def __init__(self, init_weight: float = 0.5) -> None:
        super().__init__()
        if not 0.0 < float(init_weight) < 1.0:
            raise ValueError(f"init_weight must lie in (0, 1), got {init_weight}")
        self.weight_logit = nn.Parameter(torch.tensor(math.log(init_weight / (1.0 - init_weight))))

    def forward(self) -> Tensor:
        """``u`` as a differentiable 0-d tensor."""
        return torch.sigmoid(self.weight_logit)

    @property
    def mixing_weight(self) -> Tensor:
        """The current ``u`` (detached), for logging and plots."""
        return torch.sigmoid(self.weight_logit.detach())

    def extra_repr(self) -> str:
        return f"u={float(self.mixing_weight):.4f}"


def attention_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The modules of a transformers model that call the attention interface, in module order.

    A module counts when it has the attributes the interface functions of transformers read
    (``config`` and ``scaling``, or ``is_causal`` and ``num_key_value_groups``) and the query
    projection (``query`` or ``q_proj``): BERT-family ``*SelfAttention``, Llama-style ``*Attention``.
    """
    out = []
    for name, m in model.named_modules():
        has_proj = hasattr(m, "query") or hasattr(m, "q_proj")
        has_attrs = (hasattr(m, "config") and hasattr(m, "scaling")) or (
            hasattr(m, "is_causal") and hasattr(m, "num_key_value_groups"))
        if has_proj and has_attrs and not isinstance(m, HNASWeight):
            out.append((name, m))
    return out


def add_hnas_weights(model: nn.Module, *, init_weight: float = 0.5, switch: bool = True) -> list[HNASWeight]:
    """Attach a learned :class:`HNASWeight` to every attention layer of a transformers model.

    Each attention module (:func:`attention_modules`) gets the submodule ``attnopt_hnas_weight``
    (so its parameter is part of ``model.parameters()`` and of the state dict); ``attnopt_hnas``
    then mixes with it. A module that already has one keeps it.

    Args:
        model: a transformers ``PreTrainedModel`` (or any module containing one).
        init_weight: initial ``u`` of every layer.
        switch: also call ``model.set_attn_implementation("attnopt_hnas")`` (registering the
            attnopt mechanisms first when needed).

    Returns:
        the weights, one per attention layer, in module order.

    Raises:
        ValueError: the model has no attention module that calls the interface, or a bad ``init_weight``.
    """
    mods = attention_modules(model)
    if not mods:
        raise ValueError(f"no attention modules found in {type(model).__name__}")
    out = []
    for _, m in mods:
        w = getattr(m, HNAS_ATTRIBUTE, None)
        if not isinstance(w, HNASWeight):
            w = HNASWeight(init_weight)
            ref = next(m.parameters(), None)
            if ref is not None:
                w = w.to(device=ref.device)
            m.add_module(HNAS_ATTRIBUTE, w)
        out.append(w)
    if switch:
        from transformers import AttentionInterface

        if "attnopt_hnas" not in AttentionInterface._global_mapping:
            register()
        model.set_attn_implementation("attnopt_hnas")  # type: ignore[operator]  # PreTrainedModel method
    return out


def register(
    *,
    dnas_iterations: int = 1,
    sinkhorn_iterations: int = 3,
    hnas_weight: float = 0.5,
    entmax_alpha: float = 1.5,
    dn_causal: str | None = None,
) -> RegisterReport:
    """Register every available mechanism with ``AttentionInterface`` and ``AttentionMaskInterface``.

    Args:
        dnas_iterations: default Sinkhorn steps of ``attnopt_dnas`` / ``attnopt_hnas`` (0 = softmax).
        sinkhorn_iterations: default steps of ``attnopt_sinkhorn``.
        hnas_weight: fixed mixing weight ``w`` of ``attnopt_hnas`` (1 = DNAS, 0 = softmax).
        entmax_alpha: ``α`` of ``attnopt_entmax``.
        dn_causal: default ``attnopt_causal`` of ``attnopt_dnas`` / ``attnopt_sinkhorn`` /
            ``attnopt_hnas`` in causal self-attention: ``None`` or ``"prefix"`` (autoregressive,
            the default) or ``"plan"`` (the masked plan: every position reads the later queries
            through the column normalization; for analysis). Encoders and cross-attention run
            the mechanism as is.

    Returns:
        a :class:`RegisterReport`; a mechanism whose function cannot be imported is listed in
        ``missing`` with the reason.

    Raises:
        ImportError: ``transformers`` is not installed (``pip install 'attnopt[hf]'``).
        ValueError: an option out of range.
    """
    if dnas_iterations < 0 or sinkhorn_iterations < 0:
        raise ValueError("iterations must be >= 0")
    if not 0.0 <= hnas_weight <= 1.0:
        raise ValueError(f"hnas_weight must be in [0, 1], got {hnas_weight}")
    if not entmax_alpha > 0.0:
        raise ValueError(f"entmax_alpha must be > 0, got {entmax_alpha}")
    _hf_prefix.causal_mode(dn_causal, True)  # validates
    try:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError("attnopt.integrations.hf needs transformers: pip install 'attnopt[hf]'") from exc
    overrides: dict[str, dict[str, Any]] = {
                 "attnopt_dnas": {"iterations": dnas_iterations, "causal": dn_causal},
                 "attnopt_hnas": {"iterations": dnas_iterations, "weight": hnas_weight, "causal": dn_causal},
                 "attnopt_sinkhorn": {"iterations": sinkhorn_iterations, "causal": dn_causal},
                 "attnopt_entmax": {"alpha": entmax_alpha}}
    report = RegisterReport()
    for mech in MECHANISMS:
        try:
            fn = _resolve(mech.target)
        except (ImportError, AttributeError, TypeError) as exc:
            report.missing[mech.name] = f"{mech.target}: {exc}"
            continue
        defaults = {**dict(mech.defaults), **overrides.get(mech.name, {})}
        AttentionInterface.register(mech.name, _make(mech, fn, defaults))
        AttentionMaskInterface.register(mech.name, _bool_mask_function)
        report.registered.append(mech.name)
    return report


def registered_names() -> list[str]:
    """The attnopt names currently known to ``AttentionInterface``."""
    from transformers import AttentionInterface

    return [m.name for m in MECHANISMS if m.name in AttentionInterface._global_mapping]


def _pooled(model: Any, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
    encoder = model.get_encoder() if getattr(model.config, "is_encoder_decoder", False) else model
    hidden = encoder(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
    m = attention_mask.unsqueeze(-1).to(hidden.dtype)
    return (hidden * m).sum(1) / m.sum(1).clamp_min(1)


def embedding_shift(model: Any, input_ids: Tensor, attention_mask: Tensor, attention: str) -> Tensor:
    """Cosine similarity per sentence between mean-pooled embeddings before/after swapping attention.

    The model runs with its current implementation, then with ``attention`` (registered
    first when it is an attnopt name), then its implementation is restored.

    Returns:
        (B,) cosine similarities (1 = the embedding did not move).
    Raises:
        ValueError: ``attention`` is not a known implementation.
    """
    from transformers import AttentionInterface

    if attention.startswith("attnopt_") and attention not in AttentionInterface._global_mapping:
        register()
    previous = model.config._attn_implementation
    with torch.no_grad():
        base = _pooled(model, input_ids, attention_mask)
        try:
            model.set_attn_implementation(attention)
        except (ValueError, ImportError, KeyError) as exc:
            raise ValueError(f"unknown attention implementation {attention!r}: {exc}") from exc
        try:
            swapped = _pooled(model, input_ids, attention_mask)
        finally:
            model.set_attn_implementation(previous)
    return torch.nn.functional.cosine_similarity(base, swapped, dim=-1)
