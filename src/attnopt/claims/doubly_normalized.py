"""Claims of doubly-normalized-attention: GMM fixed points, Sinkhorn, Lemma 1, mode collapse."""
from __future__ import annotations

import math

import numpy as np
import torch

from attnopt.analysis import column_mass, count_clusters, iterate_attention, mode_collapse_distance
from attnopt.analysis.mode_collapse import Scheme
from attnopt.claims import ClaimContext, ClaimResult, claim, verdict
from attnopt.functional.doubly_normalized import doubly_normalized_attention, doubly_normalized_weights
from attnopt.report import markdown_table

PAPER = "doubly_normalized"
F64 = torch.float64
_SCHEMES: tuple[Scheme, Scheme] = ("lnas", "dnas")
#: each scheme with its number of Sinkhorn iterations (LNAS: none, DNAS: one)
_ITERATIONS: tuple[tuple[Scheme, int], ...] = (("lnas", 0), ("dnas", 1))


def _gmm_loglik(x: torch.Tensor, centres: torch.Tensor, log_prior: torch.Tensor) -> torch.Tensor:
    """Σ_x log Σ_c prior_c N(x | centre_c, I), x (N, d), centres (M, d)."""
    d = x.shape[-1]
    sq = torch.cdist(x, centres) ** 2
    return torch.logsumexp(log_prior - sq / 2 - d / 2 * math.log(2 * math.pi), dim=-1).sum()


@claim(paper=PAPER, key="eq4_eq8", title="LNAS / DNAS updates are GMM likelihood fixed-point steps",
       reference="eq. (3)-(4), (5)-(8)", requires=())
def gmm_fixed_points(ctx: ClaimContext) -> ClaimResult:
    """∇_q log-lik = π k − q (LNAS, eq. 3–4); zero of the DNAS gradient = DNAS output (eq. 8)."""
    g = ctx.generator(4)
    trials = 10 if ctx.quick else 100
    err_lnas = err_dnas = 0.0
    shift_grad = float("inf")
    for t in range(trials):
        nq, nk, d = (int(x) for x in torch.randint(2, 12, (3,), generator=g))
        q = torch.randn(nq, d, generator=g, dtype=F64).requires_grad_()
        k = torch.randn(nk, d, generator=g, dtype=F64)
        # eq. (2)-(3): centres k_j, priors α_j ∝ exp(|k_j|²/2); data q_i
        prior = torch.log_softmax((k * k).sum(-1) / 2, dim=0)
        grad = torch.autograd.grad(_gmm_loglik(q, k, prior), q)[0]
        qq, kk = q.detach()[None, None], k[None, None]
        lnas = doubly_normalized_attention(qq, kk, kk, iterations=0, scale=1.0)[0, 0]
        err_lnas = max(err_lnas, (grad - (lnas - q)).abs().max().item())
        # eq. (5)-(8): data k_j, centres q_i with priors β_i ∝ exp(|q_i|²/2) held fixed
        beta = torch.log_softmax((q * q).sum(-1).detach() / 2, dim=0)
        grad_q = torch.autograd.grad(_gmm_loglik(k, q, beta), q)[0]  # Σ_j ξ_ji (k_j − q_i)
        # ξ_ji: GMM responsibility of centre q_i for datum k_j (posterior, from the density itself)
        xi = torch.softmax(beta[:, None] - torch.cdist(q.detach(), k) ** 2 / 2, dim=0)
        fixed = q.detach() + grad_q / xi.sum(-1, keepdim=True)  # the zero of the gradient in q_i
        dnas = doubly_normalized_attention(qq, kk, kk, scale=1.0)[0, 0]
        err_dnas = max(err_dnas, (fixed - dnas).abs().max().item())
        if t == 0:  # iterate the LNAS update (mean shift) and check it reaches a stationary point
            x = q.detach().clone()
            for _ in range(200):
                x = doubly_normalized_attention(x[None, None], k[None, None], k[None, None], iterations=0,
                                                scale=1.0)[0, 0]
            xg = x.clone().requires_grad_()
            shift_grad = torch.autograd.grad(_gmm_loglik(xg, k, prior), xg)[0].abs().max().item()
    ok = err_lnas < 1e-10 and err_dnas < 1e-10 and shift_grad < 1e-6
    return ClaimResult(
        verdict=verdict(ok),
        summary=(f"Over {trials} random GMMs: autograd ∇ log-lik differs from LNAS(q)−q by {err_lnas:.1e}; "
                 f"the zero of the DNAS-side gradient (eq. 8) differs from DNAS by {err_dnas:.1e}; "
                 f"200 LNAS steps reach |∇ log-lik| = {shift_grad:.1e} (a fixed point)."),
        figures={"lnas_grad_err": err_lnas, "dnas_fixed_point_err": err_dnas,
                 "grad_after_200_lnas": shift_grad},
    )


@claim(paper=PAPER, key="eq10_sinkhorn", reference="eq. (8), (10)",
       title="DNAS = one Sinkhorn iteration; K iterations converge (vs POT)", requires=("plots", "oracles"))
def sinkhorn_iterations(ctx: ClaimContext) -> ClaimResult:
    """Our K-step weights equal POT's ``ot.sinkhorn`` with K iterations; they converge as K grows."""
    import ot

    g = ctx.generator(10)
    nq, nk, d = (24, 40, 16) if ctx.quick else (96, 160, 32)
    q = torch.randn(1, 1, nq, d, generator=g, dtype=F64)
    k = torch.randn(1, 1, nk, d, generator=g, dtype=F64)
    v = torch.randn(1, 1, nk, 8, generator=g, dtype=F64)
    cost = -(q @ k.transpose(-1, -2))[0, 0].numpy() / math.sqrt(d)
    a, b = np.full(nq, 1 / nq), np.full(nk, 1 / nk)
    ks = [1, 2, 3, 5, 10, 20, 50, 100] + ([] if ctx.quick else [200, 500])
    limit = nq * ot.sinkhorn(a, b, cost, reg=1.0, numItermax=100_000, stopThr=1e-14, warn=False)
    rows, pot_err, dist, out_err = [], [], [], 0.0
    for it in ks:
        ours = doubly_normalized_weights(q, k, iterations=it)[0, 0].numpy()
        pot_k = nq * ot.sinkhorn(a, b, cost, reg=1.0, numItermax=it, stopThr=0.0, warn=False)
        pot_err.append(float(np.abs(ours - pot_k).max()))
        dist.append(float(np.abs(ours - limit).max()))
        out = doubly_normalized_attention(q, k, v, iterations=it)[0, 0].numpy()
        out_err = max(out_err, float(np.abs(out - pot_k @ v[0, 0].numpy()).max()))
        col = float(np.abs(ours.sum(0) - nq / nk).max())
        rows.append([it, pot_err[-1], dist[-1], col])
    ok = max(pot_err) < 1e-10 and out_err < 1e-10 and dist[-1] < 1e-6 and dist[-1] < dist[0]
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3.2))
    ax.semilogy(ks, dist, "o-", label="max |π^(K) − π^(∞)| (POT converged)")
    ax.semilogy(ks, [max(e, 1e-17) for e in pot_err], "s--", label="max |π^(K) − POT K iters|")
    ax.set_xscale("log")
    ax.set_xlabel("Sinkhorn iterations K (K = 1 is DNAS)")
    ax.legend(fontsize=7)
    ax.set_title(f"Sinkhorn-K vs POT, Nq={nq}, Nk={nk}")
    ctx.save_figure(fig, "convergence")
    return ClaimResult(
        verdict=verdict(ok),
        summary=(f"K-step weights match POT ot.sinkhorn(numItermax=K) to {max(pot_err):.1e} (K=1 is DNAS), "
                 f"the O(N) attention output matches POT's plan @ V to {out_err:.1e}; distance to the "
                 f"converged doubly-stochastic plan falls from {dist[0]:.2e} (K=1) to {dist[-1]:.1e} "
                 f"(K={ks[-1]})."),
        figures={"max_err_vs_pot": max(pot_err), "output_err": out_err, "dist_K1": dist[0],
                 f"dist_K{ks[-1]}": dist[-1]},
        details=markdown_table(["K", "err vs POT (K iters)", "dist to limit", "col-sum err (target Nq/Nk)"],
                               rows),
    )


def _adversarial_min_column_mass(nq: int, nk: int, iterations: int, steps: int, g: torch.Generator) -> float:
    """Minimize the smallest column mass over the scores by gradient descent; return the minimum."""
    s = (torch.randn(nq, nk, generator=g, dtype=F64) * 3).requires_grad_()
    opt = torch.optim.Adam([s], lr=0.3)
    best = float("inf")
    for _ in range(steps):
        # free scores: queries = rows of s, keys = identity, so <q_i, k_j> = s_ij
        eye = torch.eye(nk, dtype=F64)[None, None]
        w = doubly_normalized_weights(s[None, None], eye, iterations=iterations, scale=1.0)
        m = column_mass(w)[0, 0]
        loss = torch.logsumexp(-m * 50, 0)  # soft minimum of the column masses
        best = min(best, m.min().item())
        opt.zero_grad()
        (-loss).backward()
        opt.step()
    return best


@claim(paper=PAPER, key="lemma1", title="DNAS column mass >= 1/Nk; LNAS can explain keys away",
       reference="Lemma 1, Fig. 1", requires=("plots", "oracles"))
def lemma1_column_mass(ctx: ClaimContext) -> ClaimResult:
    """Minimum column mass of DNAS over random and adversarial scores vs the bound 1/Nk.

    The bound alone would also hold for maps that are not DNAS (a column softmax, the two
    normalizations in the wrong order), so every DNAS matrix is also checked to be
    row-stochastic and equal to POT's log-domain Sinkhorn stopped after one iteration
    (column then row normalization of ``exp(s)``, eq. (6)–(8)).
    """
    import ot

    g = ctx.generator(1)
    trials = 200 if ctx.quick else 2000
    n = 16
    mins: dict[Scheme, list[float]] = {"lnas": [], "dnas": []}
    row_err = pot_err = 0.0
    for _ in range(trials):
        nq = int(torch.randint(2, 2 * n, (), generator=g))
        spread = float(torch.empty(()).exponential_(0.2, generator=g))
        q = torch.randn(1, 1, nq, 8, generator=g, dtype=F64) * spread
        k = torch.randn(1, 1, n, 8, generator=g, dtype=F64) * spread
        if torch.rand((), generator=g) < 0.3:  # adversarial: one key far from every query
            k[..., 0, :] = -q.mean(-2) * 50
        for name, it in _ITERATIONS:
            w = doubly_normalized_weights(q, k, iterations=it)
            mins[name].append(column_mass(w).min().item())
        row_err = max(row_err, (w.sum(-1) - 1).abs().max().item())
        cost = -(q @ k.transpose(-1, -2))[0, 0].numpy() / math.sqrt(8)
        pot = nq * ot.sinkhorn(np.full(nq, 1 / nq), np.full(n, 1 / n), cost, reg=1.0, method="sinkhorn_log",
                               numItermax=1, stopThr=0.0, warn=False)
        pot_err = max(pot_err, float(np.abs(w[0, 0].numpy() - pot).max()))
    steps = 60 if ctx.quick else 300
    adv = {name: _adversarial_min_column_mass(n, n, it, steps, ctx.generator(2)) for name, it in _ITERATIONS}
    bound = 1.0 / n
    dn_min = min(min(mins["dnas"]), adv["dnas"])
    ln_min = min(min(mins["lnas"]), adv["lnas"])
    ok = dn_min >= bound - 1e-12 and ln_min < 0.01 * bound and row_err < 1e-12 and pot_err < 1e-10
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3.2))
    bins = np.logspace(-12, math.log10(2 * n), 60).tolist()
    for name, color in (("lnas", "tab:blue"), ("dnas", "tab:red")):
        ax.hist(np.clip(mins[name], 1e-12, None), bins=bins, alpha=0.6, color=color, label=name.upper())
    ax.axvline(bound, color="k", ls="--", label="1/Nk")
    ax.set_xscale("log")
    ax.set_xlabel(r"min$_j$ $\sum_i \pi_{ij}$ per score matrix")
    ax.legend(fontsize=7)
    ax.set_title(f"Explaining away, Nk={n}, {trials} random matrices")
    ctx.save_figure(fig, "min_column_mass")
    return ClaimResult(
        verdict=verdict(ok),
        summary=(f"Over {trials} random (30% adversarial) score matrices and a gradient-descent adversary, "
                 f"the smallest DNAS column mass found is {dn_min:.4g} "
                 f"{'>=' if dn_min >= bound - 1e-12 else '<'} 1/Nk = {bound:.4g} "
                 f"(ratio {dn_min / bound:.3f}); LNAS reaches {ln_min:.2e}. DNAS rows sum to one to "
                 f"{row_err:.1e} (required 1e-12) and DNAS differs from POT's one-iteration Sinkhorn by "
                 f"{pot_err:.1e} (required 1e-10)."),
        figures={"dnas_min_column_mass": dn_min, "bound_1_over_Nk": bound, "lnas_min_column_mass": ln_min,
                 "dnas_row_sum_err": row_err, "dnas_err_vs_pot": pot_err, "dnas_adversary_min": adv["dnas"]},
    )


@claim(paper=PAPER, key="eq11_12_fig2", title="centre distance after one update: closed form vs simulation",
       reference="eq. (11)-(12), Fig. 2")
def mode_collapse_one_step(ctx: ClaimContext) -> ClaimResult:
    """Eq. (11)/(12) against direct 1-D simulation; DNAS ≥ LNAS, equal at r = 1 (Fig. 2)."""
    import matplotlib.pyplot as plt

    n1 = 20
    n0s = [1, 2, 4, 7, 10, 14, 20, 28, 40, 80, 160, 400] if not ctx.quick else [1, 4, 10, 20, 40, 160]
    r_grid = torch.logspace(-2, 2, 200, dtype=F64)
    worst_rel, gap_ok, eq_err = 0.0, True, 0.0
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.2))
    rows = []
    for ax, a in zip(axes, (0.5, 1.0, 2.0)):
        ln, dn = mode_collapse_distance(r_grid, a, "lnas"), mode_collapse_distance(r_grid, a, "dnas")
        gap_ok &= bool((dn >= ln - 1e-12).all())
        one = torch.tensor(1.0, dtype=F64)
        at_one = mode_collapse_distance(one, a, "lnas") - mode_collapse_distance(one, a, "dnas")
        eq_err = max(eq_err, abs(float(at_one)))
        ax.plot(r_grid, ln, "b-", label="LNAS eq. (11)")
        ax.plot(r_grid, dn, "r--", label="DNAS eq. (12)")
        for n0 in n0s:
            x = torch.cat([torch.full((n0, 1), a, dtype=F64), torch.full((n1, 1), -a, dtype=F64)])
            for scheme, mk in zip(_SCHEMES, ("bo", "r^")):
                y = iterate_attention(x, scheme, 1)[1]
                sim = float(y[0, 0] - y[-1, 0])
                ref = float(mode_collapse_distance(n0 / n1, a, scheme))
                worst_rel = max(worst_rel, abs(sim - ref) / ref)
                ax.plot(n0 / n1, sim, mk, ms=4, mfc="none")
        ax.set_xscale("log")
        ax.set_title(f"a = {a}")
        ax.set_xlabel("r = N0/N1")
        rows.append([a, float(ln.min()), float(dn.min()), float((dn - ln).max())])
    axes[0].set_ylabel("centre distance after one update")
    axes[0].legend(fontsize=7)
    ctx.save_figure(fig, "fig2")
    ok = worst_rel < 1e-9 and gap_ok and eq_err < 1e-12
    return ClaimResult(
        verdict=verdict(ok),
        summary=(f"Direct simulation (markers) matches eq. (11)/(12) to relative error {worst_rel:.1e}; "
                 f"DNAS >= LNAS on the whole grid r in [1e-2, 1e2]: {gap_ok}; equal at r = 1 "
                 f"(diff {eq_err:.1e})."),
        figures={"max_rel_err_sim": worst_rel, "dnas_ge_lnas": gap_ok, "diff_at_r1": eq_err},
        details=markdown_table(["a", "min LNAS distance", "min DNAS distance", "max gap"], rows),
    )


@claim(paper=PAPER, key="fig5_6", title="multi-step mode collapse on 2-D Gaussian mixtures",
       reference="Fig. 5-6")
def mode_collapse_multi_step(ctx: ClaimContext) -> ClaimResult:
    """Balanced mixture: both keep 2 clusters; unbalanced: LNAS collapses to 1 by step 4, DNAS keeps 2."""
    import matplotlib.pyplot as plt

    n = 200 if ctx.quick else 1000
    sep, std, radius = 3.0, 0.3, 0.5
    steps = (0, 1, 2, 4)
    counts: dict[tuple[str, str], list[int]] = {}
    fig, axes = plt.subplots(4, 4, figsize=(12, 11))
    for row0, (label, frac) in zip((0, 2), (("balanced", 0.5), ("unbalanced", 0.1))):
        g = ctx.generator(56 + row0)
        n1 = int(n * frac)
        centre = torch.tensor([sep, 0.0], dtype=F64)
        x = torch.cat([torch.randn(n - n1, 2, generator=g, dtype=F64) * std,
                       torch.randn(n1, 2, generator=g, dtype=F64) * std + centre])
        lo, hi = x.min(0).values - 0.3, x.max(0).values + 0.3
        for r, scheme in enumerate(_SCHEMES):
            traj = iterate_attention(x, scheme, max(steps))
            counts[(label, scheme)] = [count_clusters(traj[s], radius, min_size=max(2, n // 50))
                                       for s in steps]
            for c, s in enumerate(steps):
                ax = axes[row0 + r, c]
                ax.scatter(traj[s][:, 0], traj[s][:, 1], s=3, c=["tab:blue"] * (n - n1) + ["tab:orange"] * n1)
                ax.set_xlim(float(lo[0]), float(hi[0]))
                ax.set_ylim(float(lo[1]), float(hi[1]))
                ax.set_title(f"{label} {scheme.upper()}, step {s}: {counts[(label, scheme)][c]} clusters",
                             fontsize=8)
    ctx.save_figure(fig, "fig5_6")
    shown = (counts[("balanced", "lnas")][-1] == 2 and counts[("balanced", "dnas")][-1] == 2
             and counts[("unbalanced", "lnas")][-1] == 1 and counts[("unbalanced", "dnas")][-1] == 2)
    sweep = _collapse_sweep(ctx, n=n, std=std, radius=radius, steps=max(steps))
    regime = [k for k, (ln, dn) in sweep.items() if ln < dn]
    worse = [k for k, (ln, dn) in sweep.items() if dn < ln]
    ok = shown and bool(regime) and not worse
    rows = [[lab, sch.upper(), *cs] for (lab, sch), cs in counts.items()]
    sweep_rows = [[f"{sep_:g}", f"{frac_:g}", ln, dn, "DNAS keeps more" if ln < dn else
                   ("DNAS WORSE" if dn < ln else "same")] for (sep_, frac_), (ln, dn) in sweep.items()]
    regime_txt = ", ".join(f"sep {a:g}/minority {b:g}" for a, b in regime) or "none"
    return ClaimResult(
        verdict=verdict(ok, partial=bool(regime)),
        summary=(f"Clusters at steps {steps} (N={n}, centres {sep} apart, std {std}, Gaussian weights, "
                 "no residual): "
                 + "; ".join(f"{lab} {sch.upper()} {cs}" for (lab, sch), cs in counts.items())
                 + f". Sweep of separation × minority share ({len(sweep)} settings, step {max(steps)}): "
                 f"DNAS keeps more clusters than LNAS in {len(regime)} ({regime_txt}), fewer in "
                 f"{len(worse)}, the same elsewhere. Paper: balanced both keep 2; unbalanced LNAS "
                 "collapses to 1 by step 4, DNAS keeps 2."),
        figures={**{f"{lab}_{sch}_step4": cs[-1] for (lab, sch), cs in counts.items()},
                 "sweep_settings": len(sweep), "sweep_dnas_keeps_more": len(regime),
                 "sweep_dnas_worse": len(worse)},
        details=markdown_table(["mixture", "scheme", *[f"step {s}" for s in steps]], rows)
        + f"\n\nMixture: 2-D, unbalanced = 90%/10%, single-linkage radius {radius}, clusters of >= "
        f"{max(2, n // 50)} points counted. Configuration chosen by us (the paper does not give it)."
        + "\n\n**Sweep** (clusters after the last step; the regime where the paper's effect appears is "
        "where DNAS keeps more clusters than LNAS):\n\n"
        + markdown_table(["separation", "minority share", "LNAS clusters", "DNAS clusters", "effect"],
                         sweep_rows),
    )


def _collapse_sweep(
    ctx: ClaimContext, *, n: int, std: float, radius: float, steps: int
) -> dict[tuple[float, float], tuple[int, int]]:
    """(separation, minority share) -> (LNAS, DNAS) cluster counts after ``steps`` iterations on a
    two-component 2-D mixture; the regime where the paper's Fig. 5-6 effect appears is where
    DNAS keeps more clusters than LNAS."""
    seps = (2.0, 3.0, 4.0) if ctx.quick else (1.0, 1.5, 2.0, 2.5, 3.0, 4.0, 5.0)
    fracs = (0.05, 0.1, 0.3) if ctx.quick else (0.03, 0.05, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5)
    out = {}
    for i, sep in enumerate(seps):
        for j, frac in enumerate(fracs):
            g = ctx.generator(500 + 10 * i + j)
            n1 = max(1, int(n * frac))
            centre = torch.tensor([sep, 0.0], dtype=F64)
            x = torch.cat([torch.randn(n - n1, 2, generator=g, dtype=F64) * std,
                           torch.randn(n1, 2, generator=g, dtype=F64) * std + centre])
            res = tuple(count_clusters(iterate_attention(x, scheme, steps)[steps], radius,
                                       min_size=max(2, n // 50)) for scheme in ("lnas", "dnas"))
            out[(sep, frac)] = (int(res[0]), int(res[1]))
    return out
