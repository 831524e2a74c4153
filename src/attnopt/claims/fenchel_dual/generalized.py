"""fenchel-dual-attention eq. (16) and eq. (18): generalized attention special cases."""
from __future__ import annotations

import torch

from attnopt.claims import ClaimContext, ClaimResult, claim, verdict
from attnopt.functional.generalized import generalized_attention
from attnopt.nn.preference import T5RelativePreference

PAPER = "fenchel_dual"


@claim(paper=PAPER, key="eq16", title="uniform preference = dot-product attention", reference="eq. (16)",
       requires=())
def uniform_preference_is_dot_product(ctx: ClaimContext) -> ClaimResult:
    """With u uniform (any constant), ĥ of eq. (16) is softmax dot-product attention."""
    g = ctx.generator(16)
    worst = 0.0
    trials = 20 if ctx.quick else 200
    for _ in range(trials):
        b, h, nq, nk, d = (int(x) for x in torch.randint(1, 9, (5,), generator=g))
        q = torch.randn(b, h, nq, d, generator=g, dtype=torch.float64) * 3
        k = torch.randn(b, h, nk, d, generator=g, dtype=torch.float64) * 3
        v = torch.randn(b, h, nk, d, generator=g, dtype=torch.float64)
        const = float(torch.rand((), generator=g, dtype=torch.float64)) * 10 + 1e-3
        u = torch.full((1, 1, 1, nk), const, dtype=torch.float64)
        ours = generalized_attention(q, k, v, preference=u)
        # the explicit softmax of the paper (not SDPA, which our op itself calls)
        explicit = torch.softmax(q @ k.transpose(-2, -1) / d**0.5, dim=-1) @ v
        worst = max(worst, (ours - explicit).abs().max().item())
    ok = worst < 1e-12
    return ClaimResult(
        verdict=verdict(ok),
        summary=(
            f"Over {trials} random float64 instances (Nq != Nk, random constant u), generalized attention "
            f"differs from explicit softmax(QK^T/sqrt(d))V by at most {worst:.2e} (threshold 1e-12)."
        ),
        figures={"max_abs_error": worst, "trials": trials},
    )


def _t5_case(bidirectional: bool, g: torch.Generator) -> tuple[float, str]:
    """Max |HF T5Attention - generalized attention| on one random layer (float64)."""
    try:
        from transformers import T5Config
        from transformers.models.t5.modeling_t5 import T5Attention
    except ImportError:  # the hf extra is not installed
        return float("nan"), "transformers not installed"
    torch.manual_seed(int(torch.randint(0, 2**31 - 1, (1,), generator=g)))
    cfg = T5Config(d_model=32, d_kv=8, num_heads=4, relative_attention_num_buckets=32,
                   relative_attention_max_distance=128, is_decoder=not bidirectional)
    cfg._attn_implementation = "eager"
    attn = T5Attention(cfg, has_relative_attention_bias=True, layer_idx=0).double().eval()
    with torch.no_grad():
        attn.relative_attention_bias.weight.normal_(0, 1.0, generator=g)
    b, n = 3, 40  # n > 32 exercises the log-spaced buckets
    x = torch.randn(b, n, 32, generator=g, dtype=torch.float64)
    lengths = torch.tensor([n, n - 7, n - 15])
    keep = torch.arange(n)[None, :] < lengths[:, None]  # (B, Nk), True = real token
    keep4 = keep[:, None, None, :].expand(b, 1, n, n)
    if not bidirectional:
        keep4 = keep4 & torch.ones(n, n, dtype=torch.bool).tril()
    hf_mask = torch.zeros(b, 1, n, n, dtype=torch.float64).masked_fill(~keep4, torch.finfo(torch.float64).min)
    with torch.no_grad():
        hf_out = attn(x, mask=hf_mask)[0]
        pref = T5RelativePreference(4, num_buckets=32, max_distance=128, bidirectional=bidirectional).double()
        pref.relative_attention_bias.weight.copy_(attn.relative_attention_bias.weight)

        def heads(t: torch.Tensor) -> torch.Tensor:
            return t.view(b, n, 4, 8).transpose(1, 2)

        q, k, v = heads(attn.q(x)), heads(attn.k(x)), heads(attn.v(x))
        out = generalized_attention(q, k, v, log_preference=pref(n, n), attn_mask=keep4, scale=1.0)
        ours = attn.o(out.transpose(1, 2).reshape(b, n, 32))
    valid = keep[:, :, None]  # compare real query rows (padded queries are undefined in HF)
    return (ours - hf_out).abs().masked_fill(~valid, 0).max().item(), "HF T5Attention (eager)"


@claim(paper=PAPER, key="eq18", title="T5 attention = generalized attention, u ∝ exp(b)·mask",
       reference="eq. (17)-(18)", requires=("hf",))
def t5_is_generalized_attention(ctx: ClaimContext) -> ClaimResult:
    """T5's relative-position-biased attention equals generalized attention with u_ij ∝ exp(b_{j−i})."""
    g = ctx.generator(18)
    enc, peer = _t5_case(True, g)
    dec, _ = _t5_case(False, g)
    if enc != enc:  # NaN: transformers missing
        return ClaimResult(verdict="not reproduced", summary="transformers is not installed (hf extra).")
    ok = max(enc, dec) < 1e-10
    return ClaimResult(
        verdict=verdict(ok),
        summary=(
            f"A random T5 attention layer ({peer}, 4 heads, 32 buckets, padded batch) against "
            f"generalized attention with log u = T5RelativePreference (same bias table) and the padding "
            f"mask as u = 0: max |diff| {enc:.2e} (encoder, bidirectional) and {dec:.2e} (decoder, causal)."
        ),
        figures={"encoder_max_abs_diff": enc, "decoder_max_abs_diff": dec},
    )
