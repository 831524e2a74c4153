"""implicit-kernel-attention Prop. 1 and Prop. 2: attention = similarity × magnitude (float64)."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from attnopt.analysis.decompose import decompose, decompose_gat
from attnopt.claims import ClaimContext, ClaimResult, claim, verdict
from attnopt.functional.kernel import kernel_weights
from attnopt.kernels import RBF

PAPER = "implicit_kernel"


@claim(paper=PAPER, key="prop1", title="dot-product attention = RBF similarity × exp-L2 magnitude",
       reference="Prop. 1", requires=())
def prop1(ctx: ClaimContext) -> ClaimResult:
    """exp(qᵀk/√d) = exp(−‖q−k‖²/(2√d))·exp((‖q‖²+‖k‖²)/(2√d)), and the weights are SDPA's."""
    g = ctx.generator(1)
    trials = 20 if ctx.quick else 200
    worst_rel, worst_w = 0.0, 0.0
    for _ in range(trials):
        nq, nk, d = (int(x) for x in torch.randint(1, 17, (3,), generator=g))
        norm = float(torch.rand((), generator=g)) * 3
        q = torch.randn(2, 2, nq, d, generator=g, dtype=torch.float64) * norm
        k = torch.randn(2, 2, nk, d, generator=g, dtype=torch.float64) * norm
        sim, mag = decompose(q, k)
        exact = torch.exp(q @ k.transpose(-1, -2) / math.sqrt(d))
        worst_rel = max(worst_rel, ((sim * mag - exact).abs() / exact).max().item())
        # weights from the explicit decomposition (not SDPA) against softmax(qkᵀ/√d)
        w = kernel_weights(q, k, kernel=RBF(), magnitude_p=2.0)
        ref = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(d), dim=-1)
        worst_w = max(worst_w, (w - ref).abs().max().item())
    ok = worst_rel < 1e-12 and worst_w < 1e-12
    return ClaimResult(
        verdict=verdict(ok),
        summary=(
            f"Over {trials} random float64 instances (Nq≠Nk, d ≤ 16, norms up to 3σ), similarity × magnitude "
            f"matches exp(qᵀk/√d) to relative error {worst_rel:.1e}, and the normalized RBF × magnitude "
            f"weights match softmax(QKᵀ/√d) to {worst_w:.1e} (threshold 1e-12)."
        ),
        figures={"max_rel_error_identity": worst_rel, "max_abs_error_weights": worst_w, "trials": trials},
    )


@claim(paper=PAPER, key="prop2", title="GAT attention = two RBF similarities through ca × magnitude",
       reference="Prop. 2", requires=("graph",))
def prop2(ctx: ClaimContext) -> ClaimResult:
    """exp(LeakyReLU(aᵀ[Wh_i‖Wh_j])) factorizes with c chosen by the sign of the raw score."""
    g = ctx.generator(2)
    trials = 20 if ctx.quick else 200
    worst, n_neg, n_tot = 0.0, 0, 0
    for _ in range(trials):
        nq, nk, f = (int(x) for x in torch.randint(1, 12, (3,), generator=g))
        slope = float(torch.rand((), generator=g)) * 0.5 + 0.01
        xq = torch.randn(nq, f, generator=g, dtype=torch.float64)
        xk = torch.randn(nk, f, generator=g, dtype=torch.float64)
        att = torch.randn(2 * f, generator=g, dtype=torch.float64)
        sim, mag = decompose_gat(xq, xk, att, negative_slope=slope)
        raw = (xq @ att[:f]).unsqueeze(-1) + (xk @ att[f:]).unsqueeze(0)
        exact = torch.exp(F.leaky_relu(raw, slope))
        worst = max(worst, ((sim * mag - exact).abs() / exact).max().item())
        n_neg += int((raw < 0).sum())
        n_tot += raw.numel()
    gat_err, gat_note = _gatconv_error(g)
    ok = worst < 1e-12 and 0 < n_neg < n_tot and (math.isnan(gat_err) or gat_err < 1e-10)
    return ClaimResult(
        verdict=verdict(ok),
        summary=(
            f"Over {trials} random float64 GAT scores ({n_neg}/{n_tot} on the negative LeakyReLU side), "
            f"the Prop. 2 factorization matches exp(LeakyReLU(e)) to relative error {worst:.1e}; "
            f"KernelGATConv(RBF, p=2) vs torch_geometric GATConv: max |Δ| = {gat_err:.1e} ({gat_note})."
        ),
        figures={
            "max_rel_error": worst,
            "negative_side_fraction": n_neg / n_tot,
            "gatconv_max_abs_diff": gat_err,
        },
    )


def _gatconv_error(g: torch.Generator) -> tuple[float, str]:
    try:
        from torch_geometric.nn import GATConv

        from attnopt.integrations.pyg import KernelGATConv
    except ImportError:
        return float("nan"), "torch_geometric not installed"
    torch.manual_seed(int(torch.randint(0, 2**31 - 1, (1,), generator=g)))
    gat = GATConv(6, 4, heads=3).double()
    conv = KernelGATConv(6, 4, heads=3, kernel="rbf", p=2.0).double()
    with torch.no_grad():
        gat.bias.normal_()
        for name in ("att_src", "att_dst", "bias"):
            getattr(conv, name).copy_(getattr(gat, name))
        conv.lin.weight.copy_(gat.lin.weight)
    x = torch.randn(30, 6, generator=g, dtype=torch.float64)
    ei = torch.randint(0, 30, (2, 120), generator=g)
    with torch.no_grad():
        return (conv(x, ei) - gat(x, ei)).abs().max().item(), "30 nodes, 120 random edges, 3 heads"
