r"""Fused attention with the periodic ("Expsin") kernel × the key magnitude (internal).

implicit-kernel-attention Table 2, eq. (9) and (11) with the periodic kernel
``k(q, k) = exp(−2 sin²(π‖q − k‖/P)/l²) = exp(c·(cos θ − 1))``, ``θ = ω‖q − k‖``,
``ω = 2π/P``, ``c = 1/l²``. With the key bias ``b_j = s‖k_j‖²/2 + e_j`` (the L2 magnitude,
folded in here, plus an outside key bias ``e``: key masks, another L^p magnitude) and an
optional query-dependent additive mask ``m_ij``:

.. math:: W_{ij} = \exp(c\cos\theta_{ij} + b_j + m_{ij} - \sigma_i),\qquad
          O_i = \frac{\sum_j W_{ij} v_j}{\sum_j W_{ij}}

``σ_i`` is a detached per-row shift (it cancels): ``max_j b_j`` for a key-only bias, whose
logits then lie in ``[−2c, 0] + c``, and ``max_j (b_j + m_ij)`` with a mask; the kernel's
``e^{−c}`` cancels too. One autograd node, worked through the batch·head dimension in chunks
whose ``Nq × Nk`` blocks stay in cache. Forward per chunk: one matmul gives ``θ²``
(``−2ω² [q, −‖q‖²/2, 1]·[k, 1, −‖k‖²/2]``), then ``sqrt``, ``cos``, one add and ``exp``,
``W v`` and the row sums. Closed-form backward with ``g_i = dO_i/den_i``,
``δ_i = <g_i, O_i>``, ``dL = W ⊙ (g vᵀ − δ)`` (the logits' gradient) and
``E = dL ⊙ sin θ / θ``:

.. math:: dq_i = c\omega^2 \big((E k)_i - \textstyle\sum_j E_{ij}\, q_i\big),\quad
          dk_j = c\omega^2 \big((E^\top q)_j - \textstyle\sum_i E_{ij}\, k_j\big)
                 + s\,\textstyle\sum_i dL_{ij}\, k_j,\quad
          dv = W^\top g,\quad de_j = \textstyle\sum_i dL_{ij}.

``θ`` and ``W`` are saved for the backward when they are small
(``THRESHOLDS.periodic_save_bytes``) and recomputed chunk by chunk otherwise (as a flash kernel
does: writing and re-reading large fresh buffers cost more than the recompute). ``sin θ/θ`` is
smooth at ``θ = 0`` (``θ²`` is clamped at 1e-30, where it is 1), so the gradient at
``q_i = k_j`` is the kernel's, 0. A row with no admissible key gives zeros (and zero
gradients). Subnormal weights are flushed to zero while the node runs (:mod:`.._denormal`).

On CPU float32/float64 tensors with storage the router runs the same node with its elementwise
passes in C (:mod:`.periodic_cpu`, ``_native/periodic.c``: one row pass in the forward, one in
the backward, matmuls in torch); this PyTorch node is the fallback (no C compiler,
``ATTNOPT_NATIVE=0``, CUDA). Measured fwd+bwd vs SDPA in the same run (one thread, loaded
2-core machine, d = 64, float32), this node → the C passes: B·H = 8, N = 64 2.4× → 1.4×;
B·H = 64, N = 64 1.3–1.5× → 1.0×; B·H = 8, N = 128 1.7× → 1.1–1.2×, N = 256 1.4–1.5× →
1.1–1.2×, N = 512 1.4× → 1.1×. Training step of the encoder (``attention="expsin"``, d = 16)
1.4× → 1.3× the softmax one at N = 128, 1.8× → 1.5× at N = 512 (there, at d = 16, the
sine/cosine and exponential of each score cost more than its matmuls).
"""
from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any, NamedTuple

import torch
from torch import Tensor

from attnopt._validation import broadcast_shapes, host_readable
from attnopt.functional._autograd import refuse_double_backward
from attnopt.functional._denormal import flush_denormal
from attnopt.functional._thresholds import THRESHOLDS

__all__ = ["MAX_C", "Prepared", "flat", "periodic_fused_ok", "periodic_node", "prepare"]
#: Largest ``c = 1/l²`` per dtype: the weights ``exp(c cos θ + …)`` neither overflow nor all
#: underflow (the largest logit of a row is within ``2c`` of its shift). Larger ``c`` (a tiny
#: length-scale) takes the log-domain path of :func:`attnopt.functional.kernel_attention`.
MAX_C = {torch.float32: 30.0, torch.float64: 300.0}
_TINY = 1e-30  # θ² clamp: θ = 1e-15 > 0, so sin θ/θ is exactly 1 there
_DEN_TINY = {torch.float32: 1e-30, torch.float64: 1e-300}  # below any row's largest weight


def periodic_fused_ok(c: float, dtype: torch.dtype, attn_mask: Tensor | None) -> bool:
    """Whether the periodic node (:func:`periodic_node`, or its C passes) takes ``c`` in ``dtype``
    (the compute dtype) and ``attn_mask`` (it gives no gradient to a float mask)."""
    return c <= MAX_C.get(dtype, 0.0) and (attn_mask is None or not attn_mask.requires_grad)


def _per_chunk(bh: int, block: int, on_host: bool) -> int:
    """Heads per chunk: L2-sized on CPU, all of them elsewhere (no Python loop over B·H off the CPU)."""
    return min(bh, max(1, THRESHOLDS.periodic_chunk_bytes // max(block, 1))) if on_host else max(bh, 1)


def _chunks(bh: int, block: int, on_host: bool = True) -> Iterator[slice]:
    per = _per_chunk(bh, block, on_host)
    for b0 in range(0, bh, per):
        yield slice(b0, min(bh, b0 + per))


def _weights(
    w: Tensor, th: Tensor, qa: Tensor, kat: Tensor, kb: Tensor, mask: Tensor | None,
    rep: int, f: slice, c: float,
) -> None:
    """One chunk: ``θ`` into ``th`` and the unnormalized ``W`` into ``w``."""
    torch.bmm(qa, kat, out=th)
    th.clamp_min_(_TINY).sqrt_()
    torch.cos(th, out=w)
    if mask is None:
        torch.add(kb, w, alpha=c, out=w)
    else:  # query-dependent: shift each row by max_j (b_j + m_ij)
        idx = torch.arange(f.start, f.stop, device=w.device).div_(rep, rounding_mode="floor")
        bias = mask.index_select(0, idx).add_(kb)
        top = bias.amax(-1, keepdim=True)
        bias.sub_(torch.where(torch.isneginf(top), 0.0, top))
        torch.add(bias, w, alpha=c, out=w)
    w.exp_()


class _FusedPeriodic(torch.autograd.Function):
    """q (BH, Nq, d), k (BH, Nk, d), v (BH, Nk, dv) contiguous; ``e`` (BH, 1, Nk) or None;
    mask (G, Nq, Nk) constant or None, row ``i`` of the batch reading ``mask[i // rep]``;
    ``om2 = ω²``, ``c``, ``s`` (the L2 magnitude's scale, 0 for none); ``save``: keep ``θ``
    and ``W`` for the backward (else it recomputes them)."""

    @staticmethod
    def forward(
        ctx: Any, q: Tensor, k: Tensor, v: Tensor, e: Tensor | None, mask: Tensor | None,
        rep: int, om2: float, c: float, s: float, save: bool,
    ) -> Tensor:
        bh, nq, _ = q.shape
        nk, dv = k.shape[1], v.shape[-1]
        half_k2 = k.square().sum(-1, keepdim=True).mul_(0.5)  # ‖k‖²/2 (BH, Nk, 1)
        # θ² = −2ω² [q, −‖q‖²/2, 1]·[k, 1, −‖k‖²/2]: one matmul (the scale folded into qa)
        qa = torch.cat([q, q.square().sum(-1, keepdim=True).mul_(-0.5), q.new_ones(bh, nq, 1)], dim=-1)
        qa.mul_(-2.0 * om2)
        ka = torch.cat([k, k.new_ones(bh, nk, 1), half_k2.neg()], dim=-1)
        kb = half_k2.transpose(1, 2).mul(s) if s else q.new_zeros(bh, 1, nk)
        if e is not None:
            kb.add_(e)
        if mask is None:  # shift to max 0 per row (a fully masked row stays -inf: zeros)
            top = kb.amax(-1, keepdim=True)
            kb.sub_(torch.where(torch.isneginf(top), 0.0, top))
        kat = ka.transpose(1, 2)
        block = nq * nk * q.element_size()
        if save:
            th_buf, w_buf = q.new_empty(bh, nq, nk), q.new_empty(bh, nq, nk)
        else:
            per = _per_chunk(bh, block, host_readable(q))
            th_buf, w_buf = q.new_empty(per, nq, nk), q.new_empty(per, nq, nk)
        out, den = q.new_empty(bh, nq, dv), q.new_empty(bh, nq, 1)
        with flush_denormal(q):
            for f in _chunks(bh, block, host_readable(q)):
                part = f if save else slice(0, f.stop - f.start)
                th, w = th_buf[part], w_buf[part]
                _weights(w, th, qa[f], kat[f], kb[f], mask, rep, f, c)
                torch.bmm(w, v[f], out=out[f])
                torch.sum(w, -1, keepdim=True, out=den[f])
        # a row with no admissible key has W = 0 and den = 0: out = 0 · (1/tiny) = 0
        inv = den.clamp_min_(_DEN_TINY[q.dtype]).reciprocal_()
        out.mul_(inv)
        ctx.om2, ctx.c, ctx.s, ctx.rep = om2, c, s, rep
        saved = (th_buf, w_buf) if save else (None, None)
        ctx.save_for_backward(q, k, v, qa, ka, kb, mask, inv, out, *saved)
        return out

    @staticmethod
    def backward(ctx: Any, dout: Tensor) -> tuple[Tensor | None, ...]:
        refuse_double_backward(ctx, "kernel_attention (fused Expsin)",
                               "use kernel_weights(q, k, kernel=...) @ v")
        q, k, v, qa, ka, kb, mask, inv, out, th_all, w_all = ctx.saved_tensors
        bh, nq, _ = q.shape
        nk = k.shape[1]
        g = dout.to(out.dtype) * inv
        ndelta = (g * out).sum(-1, keepdim=True).neg_()  # −δ
        need_q, need_k, need_v, need_e = ctx.needs_input_grad[:4]
        need_e = need_e or (need_k and ctx.s != 0.0)
        need_qk = need_q or need_k
        dv = torch.empty_like(v)
        dq, dk = torch.empty_like(q), torch.empty_like(k)
        rs, cs = q.new_empty(bh, nq, 1), q.new_empty(bh, 1, nk)
        dl_sum = q.new_empty(bh, 1, nk) if need_e else None
        block = nq * nk * q.element_size()
        per = _per_chunk(bh, block, host_readable(q))
        dl_buf, e_buf = q.new_empty(per, nq, nk), q.new_empty(per, nq, nk)
        if th_all is None:
            th_buf = q.new_empty(per, nq, nk)
        kat, vt = ka.transpose(1, 2), v.transpose(1, 2)
        with flush_denormal(q):
            for f in _chunks(bh, block, host_readable(q)):
                rows = f.stop - f.start
                dl = dl_buf[:rows]
                if th_all is not None:
                    th, w = th_all[f], w_all[f]
                else:
                    th, w = th_buf[:rows], e_buf[:rows]  # e overwrites w once w is used
                    _weights(w, th, qa[f], kat[f], kb[f], mask, ctx.rep, f, ctx.c)
                torch.bmm(w.transpose(1, 2), g[f], out=dv[f])
                if not (need_qk or need_e):
                    continue
                torch.baddbmm(ndelta[f], g[f], vt[f], out=dl).mul_(w)  # the logits' gradient
                if dl_sum is not None:
                    torch.sum(dl, -2, keepdim=True, out=dl_sum[f])
                if not need_qk:
                    continue
                e = torch.sin(th, out=e_buf[:rows]).div_(th).mul_(dl)  # E = dL ⊙ sin θ / θ
                torch.bmm(e, k[f], out=dq[f])
                torch.bmm(e.transpose(1, 2), q[f], out=dk[f])
                torch.sum(e, -1, keepdim=True, out=rs[f])
                torch.sum(e, -2, keepdim=True, out=cs[f])
        coef = ctx.c * ctx.om2
        gq = dq.addcmul_(rs, q, value=-1.0).mul_(coef) if need_q else None
        gk = None
        if need_k:
            gk = dk.addcmul_(cs.transpose(1, 2), k, value=-1.0).mul_(coef)
            if ctx.s and dl_sum is not None:
                gk.addcmul_(dl_sum.transpose(1, 2), k, value=ctx.s)
        ge = dl_sum if ctx.needs_input_grad[3] else None
        return gq, gk, dv if need_v else None, ge, None, None, None, None, None, None


def _mask_groups(mask: Tensor, batch: tuple[int, ...], nq: int, nk: int) -> tuple[Tensor, int]:
    """``mask`` (broadcastable to ``(*batch, Nq, Nk)``) as ``(G, Nq, Nk)`` and ``rep``: flat batch
    row ``i`` reads group ``i // rep``. A view when the mask's batch dims are a prefix of ``batch``
    followed by ones (``(B, 1)``, ``(1, 1)``, ``(B, H)``: the models' masks); else a copy."""
    m = mask.reshape((1,) * (len(batch) + 2 - mask.dim()) + tuple(mask.shape))
    mb = tuple(m.shape[:-2])
    lead = len(mb)
    while lead > 0 and mb[lead - 1] == 1:
        lead -= 1
    if mb[:lead] == batch[:lead]:
        return m.expand(*mb, nq, nk).reshape(-1, nq, nk), math.prod(batch[lead:])
    return m.expand(*batch, nq, nk).reshape(-1, nq, nk), 1


class Prepared(NamedTuple):
    """The flattened operands of one call (see :func:`prepare`)."""

    batch: tuple[int, ...]
    bh: int
    e3: Tensor | None  # (B·H, 1, Nk) key bias, or None
    m3: Tensor | None  # (groups, Nq, Nk) full mask, or None
    rep: int  # batch rows sharing one mask group
    save: bool  # keep θ and W for the backward
    s: float  # the L2 magnitude's scale (0: none)


def prepare(
    q: Tensor, k: Tensor, v: Tensor, *, magnitude_scale: float | None, key_bias: Tensor | None,
    mask: Tensor | None,
) -> Prepared:
    """The operands of the node (PyTorch or C) for validated ``q (…, Nq, d)``, ``k (…, Nk, d)``,
    ``v (…, Nk, dv)`` of one dtype.

    ``magnitude_scale``: ``s`` of the L2 magnitude ``s‖k_j‖²/2`` (None: none); ``key_bias``
    ``(…, 1, Nk)``: any other key bias (may require grad); ``mask``: an additive mask
    broadcastable to ``(…, Nq, Nk)`` (constant); a key-only one joins the key bias.
    """
    nq, nk = q.shape[-2], k.shape[-2]
    if mask is not None and (mask.dim() < 2 or mask.shape[-2] == 1):
        key_bias = mask if key_bias is None else key_bias + mask
        mask = None
    shapes = [q.shape[:-2], k.shape[:-2], v.shape[:-2]]
    shapes += [x.shape[:-2] for x in (key_bias, mask) if x is not None]
    batch = broadcast_shapes(*shapes)
    bh, dt = math.prod(batch), q.dtype
    e3 = None if key_bias is None else flat(key_bias.to(dt).reshape(*key_bias.shape[:-2], 1, nk), batch)
    m3, rep = (None, 1) if mask is None else _mask_groups(mask.to(dt), batch, nq, nk)
    grad = torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in (q, k, v, key_bias))
    save = grad and bh * nq * nk * q.element_size() <= THRESHOLDS.periodic_save_bytes
    s = 0.0 if magnitude_scale is None else float(magnitude_scale)
    return Prepared(batch, bh, e3, m3, rep, save, s)


def flat(x: Tensor, batch: tuple[int, ...]) -> Tensor:
    """``x (…, N, ·)`` broadcast to ``batch`` as a contiguous ``(B·H, N, ·)``."""
    bh = math.prod(batch)
    if x.dim() == len(batch) + 2 and tuple(x.shape[:-2]) == batch and x.is_contiguous():
        return x.view(bh, *x.shape[-2:])
    return x.expand(*batch, *x.shape[-2:]).reshape(bh, *x.shape[-2:]).contiguous()


def periodic_node(q: Tensor, k: Tensor, v: Tensor, prep: Prepared, *, omega: float, c: float) -> Tensor:
    """``O`` above by the PyTorch node on the operands of :func:`prepare`; ``(*batch, Nq, dv)``."""
    b = prep.batch
    out = _FusedPeriodic.apply(flat(q, b), flat(k, b), flat(v, b), prep.e3, prep.m3, prep.rep, omega * omega,
                               float(c), prep.s, prep.save)
    return out.view(*b, q.shape[-2], v.shape[-1])
