"""The ``attnopt analyze`` pipeline: capture every attention call, then measure it.

For each attention site (layer × kind) of one forward pass this computes the dual deviation
``‖λ* − αz‖/‖λ*‖`` per head and query with its reconstruction check
(:mod:`attnopt.analysis.dual_deviation`) and the per-head lenses
(:mod:`attnopt.analysis.lenses`). A tqdm bar counts layers × heads.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from attnopt.analysis.dual_deviation import DualDeviation, dual_deviation, map_captured
from attnopt.analysis.hooks import capture_attention, find_attention_sites
from attnopt.analysis.lenses import HeadLenses, attention_entropy, head_lenses
from attnopt.analysis.pretrained import model_inputs

__all__ = ["SiteAnalysis", "AnalysisResult", "analyze_model"]

KIND_TITLES = {"self": "encoder self-attention", "decoder_self": "decoder self-attention",
               "cross": "cross-attention"}


@dataclass
class SiteAnalysis:
    """Everything measured on one attention module.

    Attributes:
        name, kind, layer, num_heads: the site.
        deviation: the :class:`DualDeviation` (per head and query).
        lenses: the :class:`HeadLenses` (per head).
        entropy: (B, H, Nq) row entropies (nats).
        seconds: time spent on the solve.
    """

    name: str
    kind: str
    layer: int
    num_heads: int
    deviation: DualDeviation
    lenses: HeadLenses
    entropy: Tensor
    seconds: float

    @property
    def head_means(self) -> Tensor:
        """(H,) mean deviation per head."""
        return self.deviation.head_means()

    @property
    def mean(self) -> float:
        """Mean deviation over heads and covered queries (the number printed in Fig. 4)."""
        vals = self.deviation.values()
        return float(vals.mean()) if vals.numel() else 0.0


@dataclass
class AnalysisResult:
    """A full analysis: per-site results, inputs and the time split."""

    model_name: str
    n_sentences: int
    max_tokens: int
    sites: list[SiteAnalysis]
    timings: dict[str, float] = field(default_factory=dict)
    cpu_timings: dict[str, float] = field(default_factory=dict)
    tokens: list[list[str]] | None = None
    notes: list[str] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def kinds(self) -> list[str]:
        """The attention kinds present, in a fixed order."""
        return [k for k in KIND_TITLES if any(s.kind == k for s in self.sites)]

    def by_kind(self, kind: str) -> list[SiteAnalysis]:
        """Sites of one kind, by layer."""
        return sorted((s for s in self.sites if s.kind == kind), key=lambda s: s.layer)

    @property
    def reconstruction_failures(self) -> list[SiteAnalysis]:
        """Sites whose rebuilt weights differ from the model's by more than the tolerance."""
        return [s for s in self.sites if s.deviation.reconstruction_ok is False]


def _query_masks(kwargs: dict[str, Any]) -> dict[str, Tensor]:
    masks = {"self": kwargs["attention_mask"].bool()}
    dec = kwargs.get("decoder_attention_mask")
    if dec is not None:
        masks["decoder_self"] = dec.bool()
        masks["cross"] = dec.bool()
    return masks


def analyze_model(
    model: nn.Module,
    input_ids: Tensor,
    attention_mask: Tensor,
    *,
    model_name: str = "model",
    solver: str = "full",
    atol: float = 1e-5,
    tol: float = 1e-8,
    max_iter: int = 50,
    progress: bool = True,
) -> AnalysisResult:
    """Run ``model`` once on the batch and analyze every attention site.

    Args:
        model: a Hugging Face BERT-family or T5 model (any attention implementation; it runs
            eagerly while captured).
        input_ids, attention_mask: (B, N) tokenized text (T5 gets the shifted text as
            decoder input).
        model_name: label for the report.
        solver: dual solver (see :func:`attnopt.analysis.dual_deviation.dual_deviation`).
        atol: reconstruction tolerance (1e-5).
        tol, max_iter: Newton stopping rule.
        progress: show a tqdm bar over layers × heads.
    Returns:
        an :class:`AnalysisResult` (``timings`` has ``forward``, ``solves``, ``lenses`` wall
        seconds; ``cpu_timings`` the process CPU seconds of the same phases).
    """
    from tqdm.auto import tqdm

    sites = find_attention_sites(model)
    kwargs = model_inputs(model, input_ids, attention_mask)
    qmasks = _query_masks(kwargs)
    t0, c0 = time.perf_counter(), time.process_time()
    with capture_attention(model, sites=sites) as cap, torch.no_grad():
        model(**kwargs)
    timings = {"forward": time.perf_counter() - t0, "solves": 0.0, "lenses": 0.0}
    cpu = {"forward": time.process_time() - c0, "solves": 0.0, "lenses": 0.0}
    results: list[SiteAnalysis] = []
    bar = tqdm(total=sum(r.site.num_heads for r in cap.records), unit="head", disable=not progress,
               desc="dual solves (layers x heads)")
    for rec in cap.records:
        qm = qmasks.get(rec.site.kind)
        t1, c1 = time.perf_counter(), time.process_time()
        mapping = map_captured(rec, query_mask=qm)
        dev = dual_deviation(mapping, model_weights=rec.weights, atol=atol, tol=tol, max_iter=max_iter,
                             solver=solver)
        t2, c2 = time.perf_counter(), time.process_time()
        weights = rec.weights if rec.weights is not None else mapping.weights().to(rec.q.dtype)
        lens = head_lenses(weights, rec.q, rec.k, scale=rec.site.scaling, query_mask=mapping.query_mask)
        ent = attention_entropy(weights)
        timings["solves"] += t2 - t1
        timings["lenses"] += time.perf_counter() - t2
        cpu["solves"] += c2 - c1
        cpu["lenses"] += time.process_time() - c2
        results.append(SiteAnalysis(rec.site.name, rec.site.kind, rec.site.layer, rec.site.num_heads,
                                    dev, lens, ent, t2 - t1))
        bar.set_postfix_str(f"{rec.site.kind} layer {rec.site.layer + 1}: mean {results[-1].mean:.3f}")
        bar.update(rec.site.num_heads)
    bar.close()
    return AnalysisResult(model_name, int(input_ids.shape[0]), int(input_ids.shape[1]), results, timings,
                          cpu)
