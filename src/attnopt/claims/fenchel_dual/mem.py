"""fenchel-dual-attention: Theorem 1, eq. (13)/(14) accuracy, Sec. 5 Gaussian closed form, Fig. 3."""
from __future__ import annotations

import math

import numpy as np
import torch

from attnopt.claims import ClaimContext, ClaimResult, claim, verdict
from attnopt.dual import approx_lambda, gaussian_mem, mem_dual_objective, mem_primal_objective, solve_mem
from attnopt.functional.generalized import generalized_attention
from attnopt.report import markdown_table

PAPER = "fenchel_dual"
F64 = torch.float64


def _primal_direct(T: torch.Tensor, z: torch.Tensor, u: torch.Tensor, alpha: float) -> torch.Tensor:
    """Minimize the primal (3) directly over the simplex, without the dual: entropic mirror
    descent with the KL term handled exactly (log domain, float64),

    ``log p⁺ = (η log u + log p − η ∇f(p)) / (1 + η) + c``, ``f = α/2 ‖b − Tᵀp‖²``,
    ``η = 1/L`` with ``L = α maxᵢⱼ |<tᵢ, tⱼ>|`` (relative smoothness), which converges linearly
    because the KL term is relatively strongly convex.
    """
    ub = u / u.sum()
    supp = ub > 0
    Ts, log_us = T[supp], ub[supp].log()
    b = ub @ T + z
    eta = 1.0 / max(alpha * float((Ts @ Ts.T).abs().max()), 1e-12)
    logp = log_us.clone()
    for _ in range(200_000):
        p = logp.exp()
        grad = -alpha * (Ts @ (b - p @ Ts))
        new = torch.log_softmax((eta * log_us + logp - eta * grad) / (1 + eta), 0)
        done = float((new.exp() - p).abs().max()) < 1e-16
        logp = new
        if done:
            break
    out = torch.zeros_like(ub)
    out[supp] = logp.exp()
    return out


@claim(paper=PAPER, key="thm1", title="dual optimum = primal optimum (exact Newton solver)",
       reference="Theorem 1, eq. (3), (7), (9)", requires=())
def theorem1(ctx: ClaimContext) -> ClaimResult:
    """The maximizer λ* of (7) recovers, via (9), the minimizer of the primal (3); values coincide."""
    g = ctx.generator(1)
    trials = 8 if ctx.quick else 40
    rows, worst_p, worst_gap, worst_obj, iters = [], 0.0, 0.0, 0.0, 0
    for i in range(trials):
        n = int(torch.randint(1, 16, (1,), generator=g))
        d = int(torch.randint(1, 12, (1,), generator=g))
        alpha = float(10 ** (torch.rand((), generator=g, dtype=F64) * 2 - 1))
        T = torch.randn(n, d, generator=g, dtype=F64)
        z = torch.randn(d, generator=g, dtype=F64) * 2
        u = torch.rand(n, generator=g, dtype=F64)
        if n > 2:
            u[i % n] = 0.0  # an excluded template
        sol = solve_mem(T, z, preference=u, alpha=alpha, tol=1e-12)
        p_direct = _primal_direct(T, z, u, alpha)
        dual = float(mem_dual_objective(sol.lam, T, z, preference=u, alpha=alpha))
        primal_rec = float(mem_primal_objective(sol.weights, T, z, preference=u, alpha=alpha))
        primal_dir = float(mem_primal_objective(p_direct, T, z, preference=u, alpha=alpha))
        dp = float((sol.weights - p_direct).abs().max())
        worst_p, worst_gap = max(worst_p, dp), max(worst_gap, abs(primal_rec - dual))
        worst_obj = max(worst_obj, primal_rec - primal_dir)  # > 0 would mean the direct solve beat us
        iters = max(iters, sol.iterations)
        if i < 8:
            rows.append([n, d, f"{alpha:.3g}", sol.iterations, f"{dp:.1e}", f"{primal_rec - dual:.1e}",
                         f"{primal_rec - primal_dir:.1e}"])
    ok = worst_p < 1e-8 and worst_gap < 1e-9 and worst_obj < 1e-10
    table = markdown_table(["n", "d", "α", "Newton its", "max|p̃ − p_direct|", "primal − dual",
                            "primal(p̃) − primal(p_direct)"], rows)
    return ClaimResult(
        verdict=verdict(ok),
        summary=(
            f"On {trials} random instances (n ≤ 15, d ≤ 11, α ∈ [0.1, 10], one zero preference), p̃ recovered "
            f"from the Newton dual solution matches a direct (entropic mirror-descent) solve of the "
            f"primal to {worst_p:.1e}, the "
            f"duality gap is {worst_gap:.1e} and the direct primal solve never beats p̃ by more than "
            f"{max(worst_obj, 0.0):.1e} (thresholds 1e-8, 1e-9, 1e-10); ≤ {iters} Newton "
            "iterations for the dual."
        ),
        figures={"max_abs_p_diff": worst_p, "max_duality_gap": worst_gap, "max_newton_iters": iters},
        details=table,
    )


def _slope(alphas: np.ndarray, errs: np.ndarray) -> float:
    return float(np.polyfit(np.log(alphas), np.log(errs), 1)[0])


@claim(paper=PAPER, key="eq13_14", title="λ ≈ αz (14) and λ ≈ α(I+αΣ)⁻¹z (13) as α → 0",
       reference="eq. (12)-(14), Theorem 2")
def approximation_orders(ctx: ClaimContext) -> ClaimResult:
    """Both approximations become exact as α → 0: error O(α²) for (14) and O(α³) for (13)."""
    import matplotlib.pyplot as plt

    g = ctx.generator(13)
    alphas = np.logspace(-2.5, 0.5, 7 if ctx.quick else 16)
    inst = 4 if ctx.quick else 16
    e1 = np.zeros((inst, alphas.size))
    e2 = np.zeros_like(e1)
    for j in range(inst):
        T = torch.randn(16, 8, generator=g, dtype=F64) / math.sqrt(2)
        z = torch.randn(8, generator=g, dtype=F64)
        u = torch.rand(16, generator=g, dtype=F64)
        for k, a in enumerate(alphas):
            lam = solve_mem(T, z, preference=u, alpha=float(a), tol=1e-14).lam
            e1[j, k] = float((approx_lambda(T, z, preference=u, alpha=float(a), order=1) - lam).norm())
            e2[j, k] = float((approx_lambda(T, z, preference=u, alpha=float(a), order=2) - lam).norm())
    m1, m2 = np.exp(np.log(e1).mean(0)), np.exp(np.log(e2).mean(0))  # geometric means over instances
    small = alphas <= 0.1
    s1, s2 = _slope(alphas[small], m1[small]), _slope(alphas[small], m2[small])
    fig, ax = plt.subplots(figsize=(5.2, 4))
    ax.loglog(alphas, m1, "o-", label=f"(14) λ≈αz: slope {s1:.2f}")
    ax.loglog(alphas, m2, "s-", label=f"(13) λ≈α(I+αΣ)⁻¹z: slope {s2:.2f}")
    for m, style in ((m1, "C0--"), (m2, "C1--")):
        c = np.polyfit(np.log(alphas[small]), np.log(m[small]), 1)
        ax.loglog(alphas, np.exp(np.polyval(c, np.log(alphas))), style, lw=0.8)
    ax.set_xlabel("α")
    ax.set_ylabel("‖λ_approx − λ*‖ (geometric mean)")
    ax.set_title("Approximation error of λ* (n=16, d=8)")
    ax.legend(fontsize=8)
    ax.grid(True, which="both", alpha=0.3)
    ctx.save_figure(fig, "error_vs_alpha")
    ok = 1.8 < s1 < 2.2 and 2.7 < s2 < 3.3 and bool(np.all(m2[small] < m1[small]))
    rows = [[f"{a:.3g}", f"{x:.2e}", f"{y:.2e}"] for a, x, y in zip(alphas, m1, m2)]
    return ClaimResult(
        verdict=verdict(ok),
        summary=(
            f"Against the exact Newton λ* on {inst} random instances, the error of (14) falls with slope "
            f"{s1:.2f} and that of (13) with slope {s2:.2f} in log-log (α ≤ 0.1; expected 2 and 3 from the "
            f"cumulant expansion (12)); (13) is the more accurate at every small α."
        ),
        figures={"slope_eq14": s1, "slope_eq13": s2, "err_eq14_at_alpha_1": float(np.interp(0, np.log(alphas),
                                                                                          m1))},
        details=markdown_table(["α", "error (14)", "error (13)"], rows),
    )


@claim(paper=PAPER, key="gaussian", title="Gaussian preference: closed-form λ*, ĥ exact for all α",
       reference="Sec. 5 (motivating example), footnote to eq. (13)", requires=())
def gaussian_closed_form(ctx: ClaimContext) -> ClaimResult:
    """u = N(μ, I) (a fine grid in d = 2): the solver reproduces λ* = α/(1+α)(b−μ), ĥ = (μ+αb)/(1+α)."""
    g = ctx.generator(5)
    step = 0.25 if ctx.quick else 0.1
    mu = torch.randn(2, generator=g, dtype=F64)
    ax = torch.arange(-8.0, 8.0 + 1e-9, step, dtype=F64)
    grid = torch.cartesian_prod(ax, ax) + mu
    u = torch.exp(-0.5 * ((grid - mu) ** 2).sum(-1))
    rows, worst_h, worst_l, worst_13 = [], 0.0, 0.0, 0.0
    for alpha in (0.1, 0.5, 1.0, 4.0, 16.0):
        z = torch.randn(2, generator=g, dtype=F64) * 1.5
        sol = solve_mem(grid, z, preference=u, alpha=alpha, tol=1e-11)
        closed = gaussian_mem(mu, mu + z, alpha)
        e_l = float((sol.lam - closed.lam).norm())
        e_h = float((sol.h - closed.h).norm())
        # (13) against the closed form (the solver starts from (13), so comparing those would be circular)
        e_13 = float((approx_lambda(grid, z, preference=u, alpha=alpha, order=2) - closed.lam).norm())
        worst_h, worst_l, worst_13 = max(worst_h, e_h), max(worst_l, e_l), max(worst_13, e_13)
        rows.append([alpha, f"{e_l:.1e}", f"{e_h:.1e}", f"{e_13:.1e}", f"{float(sol.grad_norm):.1e}"])
    ok = max(worst_h, worst_l, worst_13) < 1e-6
    return ClaimResult(
        verdict=verdict(ok),
        summary=(
            f"With u = N(μ, I) discretized on a {ax.numel()}² grid (spacing {step}), the exact dual solution "
            f"matches the closed form of Sec. 5 for α from 0.1 to 16: max ‖λ* − λ_closed‖ = {worst_l:.1e}, "
            f"‖ĥ − ĥ_closed‖ = {worst_h:.1e}, and (13) is exact too ({worst_13:.1e}) — no small-α "
            f"assumption needed (threshold 1e-6)."
        ),
        figures={"max_lambda_err": worst_l, "max_h_err": worst_h, "max_eq13_err": worst_13},
        details=markdown_table(["α", "‖λ*−closed‖", "‖ĥ−closed‖", "‖(13)−closed‖", "‖∇ dual‖ at λ*"], rows),
    )


@claim(paper=PAPER, key="fig3", title="Fig. 3: exact vs approximate ĥ for α ∈ {4, 2, 1, 0.5}",
       reference="Fig. 3, eq. (7)+(10) vs (16)")
def figure3(ctx: ClaimContext) -> ClaimResult:
    """d = 2, three templates with preferences 0.3/0.4/0.6: (16) approaches the exact ĥ as α shrinks.

    Exact: ĥ of (10) with λ* maximizing (7) (Newton). Approximate: generalized attention (16)
    (λ ≈ αz), computed by :func:`attnopt.functional.generalized_attention`. Equation numbers are
    the final paper's throughout.
    """
    import matplotlib.pyplot as plt

    T = torch.tensor([[-1.0, 0.0], [1.0, 0.0], [0.0, 1.5]], dtype=F64)
    u = torch.tensor([0.3, 0.4, 0.6], dtype=F64)
    ub = u / u.sum()
    mu = ub @ T
    n_dir = 24 if ctx.quick else 72
    th = torch.linspace(0, 2 * math.pi, n_dir + 1, dtype=F64)[:-1]
    z = torch.stack([th.cos(), th.sin()], -1)  # ‖z‖ = 1 in every direction
    alphas = (4.0, 2.0, 1.0, 0.5)
    fig, axes = plt.subplots(1, 4, figsize=(16, 4.3), sharex=True, sharey=True)
    err, shift, rows = [], [], []
    for ax, a in zip(axes, alphas):
        exact = solve_mem(T, z, preference=u, alpha=a, tol=1e-12).h
        tt, pref = T[None, None], u.view(1, 1, 1, -1)
        approx = generalized_attention(z[None, None], tt, tt, preference=pref, scale=a)[0, 0]  # eq. (16)
        e = (exact - approx).norm(dim=-1)
        s = (exact - mu).norm(dim=-1)
        err.append(float(e.mean()))
        shift.append(float(s.mean()))
        rows.append([a, f"{err[-1]:.3f}", f"{float(e.max()):.3f}", f"{shift[-1]:.3f}",
                     f"{err[-1] / shift[-1]:.2f}"])
        circ = mu + z

        def closed(x: torch.Tensor) -> np.ndarray:
            return torch.cat([x, x[:1]]).numpy()

        ax.plot(*closed(circ).T, ":", color="0.6", lw=1, label="μ + z (‖z‖ = 1)")
        ax.plot(*closed(exact).T, "-", color="tab:red", lw=1.2, label="exact ĥ (dual solve)")
        ax.plot(*closed(approx).T, "-", color="tab:purple", lw=1.2, label="approx. ĥ (16)")
        k = n_dir // 8  # one highlighted evidence, as in the paper's figure
        ax.annotate("", xy=tuple(circ[k].tolist()), xytext=tuple(mu.tolist()),
                    arrowprops={"arrowstyle": "->", "color": "darkblue", "lw": 1.5})
        ax.plot(*exact[k].tolist(), "s", color="tab:red", ms=8)
        ax.plot(*approx[k].tolist(), "s", color="tab:purple", ms=8)
        ax.scatter(T[:, 0], T[:, 1], color="tab:orange", s=60, zorder=3, label="templates (support of u)")
        for t, w in zip(T, u):
            ax.annotate(f"{float(w):.1f}", tuple(t.tolist()), textcoords="offset points", xytext=(0, 7),
                        ha="center", fontsize=9)
        ax.plot(*mu.tolist(), "k+", ms=9)
        ax.set_title(f"α = {a}: mean ‖ĥ − ĥ₁₆‖ = {err[-1]:.3f}")
        ax.set_aspect("equal")
    axes[0].legend(fontsize=7, loc="lower left")
    ctx.save_figure(fig, "exact_vs_approx_h")
    monotone = all(err[i] > err[i + 1] for i in range(len(err) - 1))
    good_small = err[-1] < 0.3 * shift[-1]
    ok = monotone and good_small
    return ClaimResult(
        verdict=verdict(ok, partial=monotone),
        summary=(
            f"With templates (−1,0), (1,0), (0,1.5), preferences 0.3/0.4/0.6 and ‖z‖ = 1 in {n_dir} "
            "directions, "
            f"the mean distance between exact ĥ and the approximation (16) is "
            + ", ".join(f"{e:.3f} (α={a})" for a, e in zip(alphas, err))
            + f": it shrinks monotonically with α, and at α = 0.5 it is {err[-1] / shift[-1]:.0%} of the "
            f"shift ‖ĥ − μ‖ = {shift[-1]:.3f} caused by z (criteria: monotone, < 30%). At α = 1 the ratio is "
            f"{err[-2] / shift[-2]:.0%}, so 'good' there is a qualitative reading."
        ),
        figures={f"mean_err_alpha_{a:g}": e for a, e in zip(alphas, err)}
        | {"err_over_shift_alpha_0.5": err[-1] / shift[-1]},
        details=markdown_table(["α", "mean ‖ĥ−ĥ₁₆‖", "max", "mean ‖ĥ−μ‖", "ratio"], rows),
    )
