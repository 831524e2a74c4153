r"""sdpa-one-sided-eot Thm 6.3, eq. (149) and Thm 7.3 read with the pseudo-inverse.

*Thm 6.3 / eq. (149).* The dual potential of one-sided entropic OT is the conjugate of the
constrained negentropy,

.. math:: \varphi(s) = \sup_{p \in \Delta} \langle s, p\rangle - \tau \textstyle\sum_j p_j \log p_j
          = \tau \log \textstyle\sum_j e^{s_j/\tau} \quad (149),
          \qquad \nabla\varphi(s) = \mathrm{softmax}(s/\tau) \quad (\text{Thm 6.3}).

The supremum is computed by the generic interior-point solver
(:func:`attnopt.dual.solve_regularized`, which knows only ``Ω``), and bounded from below by
random points of the simplex (Fenchel–Young: none may exceed it); the gradient by autograd.

*Thm 7.3 with the pseudo-inverse.* The Fisher matrix ``F = (diag p − ppᵀ)/τ²`` is singular:
``F·1 = 0`` (shifting every score leaves ``p`` unchanged), so the paper's "natural gradient
``F⁻¹ ∇_s L``" only exists as the Moore–Penrose pseudo-inverse on the tangent space ``1^⊥``
(rank ``n − 1`` when ``p > 0``). With ``∇_s L = −τ F U`` (Thm 7.3),

.. math:: F^{+} \nabla_s L = -\tau\, F^{+}F\, U = -\tau \big(U - \bar U \mathbf 1\big),

the utilities centred by their *plain* mean: the natural-gradient direction is ``U`` up to the
null direction ``1``, which the softmax ignores.
"""

from __future__ import annotations

import math

import torch

from attnopt.analysis.policy import fisher_matrix
from attnopt.claims import ClaimContext, ClaimResult, claim, verdict
from attnopt.dual import solve_regularized
from attnopt.functional import Shannon
from attnopt.report import markdown_table

PAPER = "one_sided_eot"
F64 = torch.float64
#: float64 agreement of closed forms with autograd / the pseudo-inverse (rounding is ~1e-15)
TOL = 1e-10
#: agreement of the interior-point solver's supremum with the closed form (its KKT tolerance)
SOLVER_TOL = 1e-6


def dual_potential(scores: torch.Tensor, temperature: float) -> torch.Tensor:
    """``φ(s) = τ·logsumexp(s/τ)`` along the last dim (Thm 6.3, eq. 71/149)."""
    return temperature * torch.logsumexp(scores / temperature, dim=-1)


def _scores(ctx: ClaimContext, offset: int) -> torch.Tensor:
    rows, n = (8, 7) if ctx.quick else (128, 12)
    g = ctx.generator(offset)
    return torch.randn(rows, n, generator=g, dtype=F64)  # p_min stays well above rounding at τ = 0.5


@claim(paper=PAPER, key="thm63_eq149",
       title="log-sum-exp is the dual potential: its gradient is softmax, its value the conjugate's sup",
       reference="Thm 6.3, eq. (71), (149), App. B", requires=())
def thm63_eq149(ctx: ClaimContext) -> ClaimResult:
    """Thm 6.3 (∇φ = softmax(s/τ), autograd) and eq. (149) (φ = the supremum, solver + Fenchel–Young)."""
    rows = []
    grad_err = value_err = 0.0
    fy_violation = -math.inf
    for tau in (0.5, 1.0, math.sqrt(8.0)):
        s = _scores(ctx, 1 + int(10 * tau)).requires_grad_(True)
        phi = dual_potential(s, tau)
        (grad,) = torch.autograd.grad(phi.sum(), s)
        s = s.detach()
        p = torch.softmax(s / tau, -1)
        g_err = float((grad - p).abs().max())
        reg = Shannon(tau)
        sol = solve_regularized(s, reg)
        sup = (s * sol.weights).sum(-1) - reg.value(sol.weights)
        v_err = float(((sup - phi.detach()).abs() / phi.detach().abs().clamp_min(1.0)).max())
        # Fenchel–Young: no point of the simplex beats the supremum (random points: normalized
        # exponentials are uniform on the simplex)
        e = -torch.log(torch.rand(64, s.shape[-1], generator=ctx.generator(99), dtype=F64))
        draws = e / e.sum(-1, keepdim=True)
        fy = (s[:, None, :] * draws[None]).sum(-1) - reg.value(draws[None].expand(s.shape[0], -1, -1))
        viol = float((fy - phi.detach()[:, None]).max())
        grad_err, value_err = max(grad_err, g_err), max(value_err, v_err)
        fy_violation = max(fy_violation, viol)
        rows.append([f"{tau:.3g}", f"{g_err:.1e}", f"{v_err:.1e}", f"{viol:.2e}", sol.converged])
    ok = grad_err <= TOL and value_err <= SOLVER_TOL and fy_violation <= 1e-12
    return ClaimResult(
        verdict=verdict(ok),
        summary=(f"Over τ ∈ {{0.5, 1, √8}}: max |∇φ − softmax(s/τ)| = {grad_err:.1e} (autograd, tolerance "
                 f"{TOL:g}); max relative |sup_p ⟨s,p⟩ − τΣp log p − τ·lse(s/τ)| = {value_err:.1e} (generic "
                 f"solver, tolerance {SOLVER_TOL:g}); largest ⟨s,p⟩ − Ω(p) − φ(s) over 64 random simplex "
                 f"points per row = {fy_violation:.2e} (Fenchel–Young: must be ≤ 0)."),
        figures={"grad_err": grad_err, "eq149_rel_err": value_err, "fenchel_young_max": fy_violation},
        details=markdown_table(
            ["τ", "|∇φ − softmax|", "eq. 149 rel err", "max FY gap", "solver converged"], rows),
    )


@claim(paper=PAPER, key="thm73_pinv",
       title="Thm 7.3's natural gradient: F is singular (F·1 = 0); F⁺∇L = −τ(U − Ū·1)",
       reference="Thm 7.3, eq. (78)-(79), (98)-(99)", requires=())
def thm73_pinv(ctx: ClaimContext) -> ClaimResult:
    """F·1 = 0 and rank n − 1; the pseudo-inverse natural gradient of an autograd ∂L/∂s equals
    −τ times the centred utilities (the loss ``L = ⟨c, p⟩ + ‖p‖²`` has non-constant utilities)."""
    rows = []
    null_err = rel_err = 0.0
    ranks_ok = True
    for tau in (0.5, 1.0, math.sqrt(8.0)):
        s = _scores(ctx, 2 + int(10 * tau)).requires_grad_(True)
        c = torch.randn(s.shape, generator=ctx.generator(7), dtype=F64)
        p = torch.softmax(s / tau, -1)
        loss = (c * p).sum() + (p**2).sum()
        (u,) = torch.autograd.grad(loss, p, retain_graph=True)
        (g,) = torch.autograd.grad(loss, s)
        u = -u  # utilities U = −∂L/∂p
        pd = p.detach()
        fisher = fisher_matrix(pd, temperature=tau)
        n = s.shape[-1]
        ones = torch.ones(n, dtype=F64)
        f1 = float((fisher @ ones).abs().max() / fisher.abs().max())
        rank = torch.linalg.matrix_rank(fisher, hermitian=True)
        ranks_ok = ranks_ok and bool((rank == n - 1).all())
        nat = (torch.linalg.pinv(fisher, hermitian=True) @ g.unsqueeze(-1)).squeeze(-1)
        want = -tau * (u - u.mean(-1, keepdim=True))
        err = float((nat - want).abs().max() / want.abs().max())
        null_err, rel_err = max(null_err, f1), max(rel_err, err)
        rows.append([f"{tau:.3g}", f"{f1:.1e}", int(rank.min()), int(rank.max()), n, f"{err:.1e}"])
    ok = null_err <= TOL and ranks_ok and rel_err <= TOL
    return ClaimResult(
        verdict=verdict(ok),
        summary=(f"F = (diag p − ppᵀ)/τ² is singular: max |F·1| / max |F| = {null_err:.1e}, rank n − 1 in "
                 f"every row: {ranks_ok} — so Thm 7.3's F⁻¹ is the pseudo-inverse on 1^⊥; "
                 f"F⁺ ∂L/∂s vs −τ(U − Ū·1): max relative error {rel_err:.1e} (tolerance {TOL:g}; autograd "
                 "gradients, float64). The natural gradient is the utilities centred by their plain mean."),
        figures={"fisher_times_ones": null_err, "rank_n_minus_1": ranks_ok, "pinv_rel_err": rel_err},
        details=markdown_table(
            ["τ", "|F·1|/|F|", "min rank", "max rank", "n", "F⁺g vs −τ(U − Ū) rel err"], rows),
    )
