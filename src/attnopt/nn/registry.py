r"""The attention registry: one name per mechanism, with its paper options.

``make_attention(name, embed_dim, num_heads, **options)`` builds a module with the
``nn.MultiheadAttention(batch_first=True)`` call convention::

    out, weights = module(query, key=None, value=None, key_padding_mask=None,
                          need_weights=False, attn_mask=None, average_attn_weights=True,
                          is_causal=False)

(boolean masks ``True`` = not allowed; ``key``/``value`` may differ from ``query`` for
cross-attention; unbatched ``(N, E)`` inputs as ``nn.MultiheadAttention``; weights averaged over
heads ``(B, Nq, Nk)`` by default, per head ``(B, H, Nq, Nk)`` with ``average_attn_weights=False``;
``need_weights`` defaults to ``False`` because the fast paths never form the weights), plus an
optional keyword ``query_padding_mask (B, Nq)`` (padded queries take no part:
zero rows, left out of normalizations over queries) so that padding never needs an
``Nq × Nk`` mask. Modules with an auxiliary loss (the IKA variants) also have ``kl()``.
The one exception is ``ot``: :class:`~attnopt.nn.OTAttention` pools a token set with a
learned query and a template bank (``module(tokens, bank=..., key_padding_mask=...) ->
(B, E)``), so it is used as the last layer of :class:`attnopt.models.ViT` (OT-ViT), not as a
drop-in self-attention.

=============  ================================================  ===============================
name           mechanism (paper)                                  options (default)
=============  ================================================  ===============================
softmax        scaled dot-product attention                       —
lnas           the same, under doubly-normalized-attention's name —
t5             generalized attention, T5 preference (fenchel 17)  num_buckets (32), max_distance
                                                                  (128), bidirectional (True)
alibi          generalized attention, ALiBi preference            —
mem            exact MEM / Fenchel-dual attention (fenchel 7, 9)  scale (1/√d), tol (1e-6),
                                                                  max_iter (50)
dnas           doubly-normalized attention (DNAS, eq. 6–8)        causal (None)
hnas           hybrid w·DNAS + (1−w)·LNAS, learned w (Sec. 6)     init_weight (0.5), per_head (False),
                                                                  causal (None)
sinkhorn       K Sinkhorn normalizations (eq. 10)                 iterations (3), causal (None)
sparsemax      Ω = ½‖p‖² (one-sided EOT Prop. 4.2)                —
entmax         Ω = Tsallis α (Prop. 4.3)                          alpha (1.5)
rbf-only       RBF similarity, no magnitude (implicit-kernel T2)  —
expsin         periodic kernel × L2 magnitude                     period (2π: matches RBF at 0)
linear         linear kernel × L2 magnitude                       mode ("quadratic")
ika-s          implicit stationary kernel (eq. 12–13)             num_samples (8), hidden (32), seed,
                                                                  mode ("quadratic")
ika-ns         implicit non-stationary kernel (eq. 14–16)         num_samples, hidden, seed, mode
ikan           ika-ns with an L^p magnitude                       p (2.0), num_samples, hidden, seed,
                                                                  mode
ikan-direct    learned spectral points (no sampling, no KL)       p, num_samples, seed, mode
mikan          ikan with a Gaussian copula across heads           p, num_samples, hidden, seed, mode
ot             OT-based attention pooling (fenchel Sec. 9)        alpha (1), gamma (√E), cost
                                                                  ("neg_dot")
=============  ================================================  ===============================

Every name also takes ``nn.MultiheadAttention``'s constructor options (:data:`MODULE_OPTIONS`):
``dropout`` (on the attention weights, training mode only), ``bias``, ``kdim``, ``vdim``,
``batch_first`` (``True`` only), ``device`` and ``dtype`` (``ot``: ``dropout``, ``bias``,
``device``, ``dtype``), e.g. ``make_attention("dnas", 32, 4, dropout=0.1, bias=False)``.

``mode="linear"`` (the kernels with a feature map: ``linear`` and the implicit kernels) computes
the same attention exactly in O(N) time and memory (implicit-kernel-attention §4, via the
features ``φ(x)⊗φ(x)``); it takes ``key_padding_mask``, ``query_padding_mask`` and ``is_causal``
(as :mod:`attnopt.models` passes them, also in a padded causal decoder), but not another
query-dependent ``attn_mask``.

``causal`` (``dnas``, ``hnas``, ``sinkhorn``): a causal mask restricts the transport plan but does
not make a normalization over queries autoregressive. ``None`` runs the autoregressive
``"prefix"`` variant when the module is called with ``is_causal=True`` (a decoder: no future
leak); ``"prefix"`` always normalizes over the queries up to each row (e.g. a decoder's
cross-attention); ``"plan"`` keeps the masked plan, which reads later queries (analysis).

The Hugging Face registration (:mod:`attnopt.integrations.hf`) and ``attnopt train`` use
the same names.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from torch import nn

if TYPE_CHECKING:
    from attnopt.nn.implicit_kernel import Variant

__all__ = ["AttentionSpec", "attention_names", "attention_spec", "make_attention"]


@dataclass(frozen=True)
class AttentionSpec:
    """One registry entry: ``name``, a one-line ``description``, the ``paper`` and its ``defaults``."""

    name: str
    description: str
    paper: str
    defaults: Mapping[str, Any]
    build: Callable[..., nn.Module]
    multihead_convention: bool = True


def _generalized(e: int, h: int, **mha: Any) -> nn.Module:
    from attnopt.nn.generalized import GeneralizedMultiheadAttention

    return GeneralizedMultiheadAttention(e, h, **mha)


def _t5(e: int, h: int, *, num_buckets: int, max_distance: int, bidirectional: bool, **mha: Any) -> nn.Module:
    from attnopt.nn.generalized import GeneralizedMultiheadAttention
    from attnopt.nn.preference import T5RelativePreference

    pref = T5RelativePreference(
        h, num_buckets=num_buckets, max_distance=max_distance, bidirectional=bidirectional
    )
    return GeneralizedMultiheadAttention(e, h, pref, **mha)


def _alibi(e: int, h: int, **mha: Any) -> nn.Module:
    from attnopt.nn.generalized import GeneralizedMultiheadAttention
    from attnopt.nn.preference import ALiBiPreference

    return GeneralizedMultiheadAttention(e, h, ALiBiPreference(h), **mha)


def _mem(e: int, h: int, *, scale: float | None, tol: float, max_iter: int, **mha: Any) -> nn.Module:
    from attnopt.nn.mem import MEMAttention

    return MEMAttention(e, h, scale=scale, tol=tol, max_iter=max_iter, **mha)


def _dn(e: int, h: int, *, iterations: int = 1, causal: str | None = None, **mha: Any) -> nn.Module:
    from attnopt.nn.doubly_normalized import DoublyNormalizedMultiheadAttention

    return DoublyNormalizedMultiheadAttention(e, h, iterations=iterations, causal=causal,  # type: ignore[arg-type]
                                              **mha)


def _hnas(
    e: int, h: int, *, init_weight: float, per_head: bool, causal: str | None = None, **mha: Any
) -> nn.Module:
    from attnopt.nn.doubly_normalized import HybridNormalizedMultiheadAttention

    return HybridNormalizedMultiheadAttention(e, h, init_weight=init_weight, per_head=per_head,
                                              causal=causal, **mha)  # type: ignore[arg-type]


def _sparsemax(e: int, h: int, **mha: Any) -> nn.Module:
    from attnopt.functional.regularized.regularizers import SquaredL2
    from attnopt.nn.regularized import RegularizedMultiheadAttention

    return RegularizedMultiheadAttention(e, h, SquaredL2(), **mha)


def _entmax(e: int, h: int, *, alpha: float, **mha: Any) -> nn.Module:
    from attnopt.functional.regularized.regularizers import Tsallis
    from attnopt.nn.regularized import RegularizedMultiheadAttention

    return RegularizedMultiheadAttention(e, h, Tsallis(alpha), **mha)


def _kernel(which: str) -> Callable[..., nn.Module]:
    def build(e: int, h: int, *, dropout: float, bias: bool, kdim: int | None, vdim: int | None,
              **opts: Any) -> nn.Module:
        from attnopt.kernels import RBF, Linear, Periodic
        from attnopt.nn.kernel import KernelMultiheadAttention

        mha: dict[str, Any] = dict(dropout=dropout, bias=bias, kdim=kdim, vdim=vdim)
        if which == "rbf-only":
            return KernelMultiheadAttention(e, h, RBF(), magnitude_p=None, **mha)
        if which == "expsin":
            return KernelMultiheadAttention(e, h, Periodic(opts["period"]), magnitude_p=2.0, **mha)
        return KernelMultiheadAttention(e, h, Linear(), magnitude_p=2.0, mode=opts["mode"], **mha)

    return build


def _ika(variant: Variant) -> Callable[..., nn.Module]:
    def build(e: int, h: int, **opts: Any) -> nn.Module:
        from attnopt.nn.implicit_kernel import ImplicitKernelAttention

        return ImplicitKernelAttention(e, h, variant, **opts)

    return build


def _ot(e: int, h: int, *, alpha: float, gamma: float | None, cost: str, dropout: float, bias: bool
        ) -> nn.Module:
    from attnopt.nn.ot import OTAttention

    return OTAttention(e, h, alpha=alpha, gamma=gamma, cost=cost, dropout=dropout, bias=bias)


#: the ``nn.MultiheadAttention`` constructor options every multi-head name takes, with its defaults
#: (``ot``, a pooling layer over one token set, takes ``dropout`` and ``bias`` only)
MODULE_OPTIONS: Mapping[str, Any] = {
    "dropout": 0.0, "bias": True, "kdim": None, "vdim": None, "batch_first": True,
    "device": None, "dtype": None,
}
#: ``nn.MultiheadAttention`` options no mechanism takes, with the reason
UNSUPPORTED_OPTIONS: Mapping[str, str] = {
    "add_bias_kv": "a learned extra key/value would take part in every normalization as a real key",
    "add_zero_attn": "a zero key would take part in every normalization as a real key",
}
_OT_OPTIONS = ("dropout", "bias", "batch_first", "device", "dtype")


_FD, _DN, _IK, _EOT = (
    "fenchel-dual-attention",
    "doubly-normalized-attention",
    "implicit-kernel-attention",
    "sdpa-one-sided-eot",
)
_IKA_OPTS = {"num_samples": 8, "hidden": 32, "seed": None, "mode": "quadratic"}

_SPECS: tuple[AttentionSpec, ...] = (
    AttentionSpec("softmax", "scaled dot-product attention (SDPA)", _EOT, {}, _generalized),
    AttentionSpec("lnas", "row-normalized attention = softmax (LNAS)", _DN, {}, _generalized),
    AttentionSpec(
        "t5",
        "generalized attention with T5's relative-position preference",
        _FD,
        {"num_buckets": 32, "max_distance": 128, "bidirectional": True},
        _t5,
    ),
    AttentionSpec("alibi", "generalized attention with the ALiBi preference", _EOT, {}, _alibi),
    AttentionSpec(
        "mem",
        "exact MEM / Fenchel-dual attention (Newton)",
        _FD,
        {"scale": None, "tol": 1e-6, "max_iter": 50},
        _mem,
    ),
    AttentionSpec("dnas", "doubly-normalized attention (one Sinkhorn step)", _DN, {"causal": None}, _dn),
    AttentionSpec(
        "hnas",
        "hybrid w*DNAS + (1-w)*LNAS with learned w",
        _DN,
        {"init_weight": 0.5, "per_head": False, "causal": None},
        _hnas,
    ),
    AttentionSpec("sinkhorn", "K Sinkhorn normalizations", _DN, {"iterations": 3, "causal": None}, _dn),
    AttentionSpec("sparsemax", "sparsemax (squared-L2 regularizer)", _EOT, {}, _sparsemax),
    AttentionSpec("entmax", "alpha-entmax (Tsallis regularizer)", _EOT, {"alpha": 1.5}, _entmax),
    AttentionSpec("rbf-only", "RBF similarity without the magnitude term", _IK, {}, _kernel("rbf-only")),
    AttentionSpec(
        "expsin", "periodic kernel x L2 magnitude", _IK, {"period": 2 * math.pi}, _kernel("expsin")
    ),
    AttentionSpec("linear", "linear kernel x L2 magnitude", _IK, {"mode": "quadratic"}, _kernel("linear")),
    AttentionSpec(
        "ika-s",
        "implicit stationary kernel (random Fourier, learned density)",
        _IK,
        dict(_IKA_OPTS),
        _ika("ika-s"),
    ),
    AttentionSpec("ika-ns", "implicit non-stationary kernel", _IK, dict(_IKA_OPTS), _ika("ika-ns")),
    AttentionSpec(
        "ikan", "implicit non-stationary kernel x L^p magnitude", _IK, {"p": 2.0, **_IKA_OPTS}, _ika("ikan")
    ),
    AttentionSpec(
        "ikan-direct",
        "learned spectral points x L^p magnitude",
        _IK,
        {"p": 2.0, "num_samples": 8, "seed": None, "mode": "quadratic"},
        _ika("ikan-direct"),
    ),
    AttentionSpec(
        "mikan", "ikan with a Gaussian copula across heads", _IK, {"p": 2.0, **_IKA_OPTS}, _ika("mikan")
    ),
    AttentionSpec(
        "ot",
        "OT-based attention pooling with a template bank (OT-ViT last layer)",
        _FD,
        {"alpha": 1.0, "gamma": None, "cost": "neg_dot"},
        _ot,
        multihead_convention=False,
    ),
)
_BY_NAME: dict[str, AttentionSpec] = {s.name: s for s in _SPECS}


def attention_names() -> list[str]:
    """Every registry name, in the table's order."""
    return [s.name for s in _SPECS]


def attention_spec(name: str) -> AttentionSpec:
    """The :class:`AttentionSpec` of ``name``.

    Raises:
        ValueError: unknown name (the message lists the valid ones).
    """
    if not isinstance(name, str) or name not in _BY_NAME:
        raise ValueError(f"unknown attention {name!r}; valid names: {', '.join(attention_names())}")
    return _BY_NAME[name]


def make_attention(name: str, embed_dim: int, num_heads: int, **options: Any) -> nn.Module:
    """Build the attention module registered as ``name``.

    Args:
        name: a registry name (:func:`attention_names`).
        embed_dim: E (divisible by ``num_heads``).
        num_heads: H.
        **options: the mechanism's options (see the module table) and the
            ``nn.MultiheadAttention(batch_first=True)`` constructor options of
            :data:`MODULE_OPTIONS` (``dropout``, ``bias``, ``kdim``, ``vdim``, ``batch_first``
            (``True`` only), ``device``, ``dtype``); omitted ones take their defaults.
            ``add_bias_kv`` / ``add_zero_attn`` are refused (:data:`UNSUPPORTED_OPTIONS`).
    Returns:
        an ``nn.Module`` with the ``nn.MultiheadAttention(batch_first=True)`` convention
        (``ot``: the pooling convention of :class:`~attnopt.nn.OTAttention`).
    Raises:
        ValueError: unknown name or option (the message lists the valid ones), or an option
            value the mechanism rejects.
    """
    spec = attention_spec(name)
    shared = MODULE_OPTIONS if spec.multihead_convention else {k: MODULE_OPTIONS[k] for k in _OT_OPTIONS}
    refused = sorted(set(options) & set(UNSUPPORTED_OPTIONS))
    if refused:
        why = UNSUPPORTED_OPTIONS[refused[0]]
        raise ValueError(f"attention {name!r}: {refused[0]} is not supported ({why})")
    unknown = sorted(set(options) - set(spec.defaults) - set(shared))
    if unknown:
        valid = ", ".join(spec.defaults) or "none"
        raise ValueError(
            f"attention {name!r} has no option {', '.join(map(repr, unknown))}; valid options: {valid}; "
            f"and the nn.MultiheadAttention options {', '.join(shared)}"
        )
    module_opts = {**shared, **{k: v for k, v in options.items() if k in shared}}
    if module_opts.pop("batch_first") is not True:
        raise ValueError(f"attention {name!r}: only batch_first=True is supported (inputs are (B, N, E))")
    device, dtype = module_opts.pop("device"), module_opts.pop("dtype")
    specific = {k: v for k, v in options.items() if k not in shared}
    try:
        module = spec.build(embed_dim, num_heads, **{**spec.defaults, **specific}, **module_opts)
    except TypeError as exc:
        raise ValueError(f"attention {name!r}: {exc}") from exc
    if device is not None or dtype is not None:
        module = module.to(device=device, dtype=dtype)
    return module
