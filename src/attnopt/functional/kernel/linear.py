r"""Exact linear-time kernel attention for kernels with a feature map (implicit-kernel-attention §4).

With ``f(q, k) = φ(q)ᵀφ(k)`` (``φ (…, N, D)``, ``D = 2R`` for Fourier kernels),

.. math:: f^2 = \langle \phi(q)\otimes\phi(q),\ \phi(k)\otimes\phi(k)\rangle, \qquad
          \mathrm{out}_i = \frac{\phi_i^\top S\, \phi_i + \varepsilon\, e}{\ldots}, \quad
          S = \sum_j m_j\, \phi(k_j)\phi(k_j)^\top \otimes [v_j, 1],\ e = \sum_j m_j [v_j, 1]

where ``m_j = exp(a_j − c)`` is the key magnitude shifted by the shared (detached) max ``c``
(the query magnitude cancels). Time O(N·D²·dv), extra memory O(D²·dv) plus one chunk. With
``is_causal`` the sums become prefix sums, computed chunk by chunk: an exact quadratic block
inside the chunk and the running state ``S`` for earlier keys; each row ``i`` is shifted by
its own running max ``c_i = max_{j≤i} a_j`` so no row underflows.

Without autograd the extra memory is the state plus one chunk (rows sized so a chunk holds
about 2^19 state-width entries) and the output is written in place; under autograd each
chunk's intermediates are kept for the backward, O(N·D·dv) in total.

Rows whose denominator is 0 (every key masked, or ``ε = 0`` and ``f ≡ 0``) give zeros.
The output equals the quadratic mode up to float rounding (``ε`` is included exactly), but that
rounding is amplified: ``φ_iᵀSφ_i`` sums ``D²`` products whose size is set by the keys that
dominate ``S``, and cancels to ``Σ_j m_j f_ij²``, which is small for a query far from those keys
(measured 25–50× in float64, up to ~1000× in float32 gradients; float32 R = 16, d = 64: output
9e-4, ``dq`` 4e-3 relative to the largest entry, where the quadratic mode gives 2e-5 / 4e-5).
Caveat (non-causal, ``ε = 0``): keys whose magnitude is below the largest one by more than
~87 (float32) or ~700 (float64) in log scale underflow to weight 0, where the quadratic mode
would still rank them within a row that ignores the large key — a regime that only arises
with extreme norms.
"""
from __future__ import annotations

import math

import torch
from torch import Tensor

from attnopt.functional._autograd import under_transform
from attnopt.functional._thresholds import THRESHOLDS
from attnopt.kernels import Kernel

__all__ = ["linear_kernel_attention"]



def _outer_state(phi: Tensor, vm: Tensor) -> Tensor:
    """``Σ_j φ_j φ_jᵀ ⊗ vm_j``: (…, N, D), (…, N, E) -> (…, D, D·E)."""
    n, dd = phi.shape[-2], phi.shape[-1]
    x = (phi.unsqueeze(-1) * vm.unsqueeze(-2)).reshape(*vm.shape[:-2], n, dd * vm.shape[-1])
    return torch.matmul(phi.transpose(-2, -1), x)


def _read_state(phi: Tensor, state: Tensor, e: int) -> Tensor:
    """``φ_iᵀ S φ_i``: (…, N, D), (…, D, D·E) -> (…, N, E)."""
    n, dd = phi.shape[-2], phi.shape[-1]
    t = torch.matmul(phi, state).reshape(*phi.shape[:-2], n, dd, e)
    return (t * phi.unsqueeze(-1)).sum(-2)


def _finish(num: Tensor) -> Tensor:
    den = num[..., -1:]
    ok = den > 0
    return torch.where(ok, num[..., :-1] / torch.where(ok, den, torch.ones_like(den)), torch.zeros_like(den))


def linear_kernel_attention(
    q: Tensor, k: Tensor, v: Tensor, *, kernel: Kernel, key_bias: Tensor | None, is_causal: bool, eps: float
) -> Tensor:
    """Linear-time core (inputs already validated and in the compute dtype).

    Args:
        q, k, v: (…, Nq, d), (…, Nk, d), (…, Nk, dv).
        kernel: a kernel with ``has_features``.
        key_bias: (…, 1, Nk) log key weight ``a_j`` (magnitude plus key mask, ``-inf`` =
            masked) or ``None`` (all 0).
        is_causal: prefix sums (``Nq == Nk``).
        eps: added to ``f²``.
    Returns:
        (…, Nq, dv).
    Raises:
        ValueError: the kernel has no feature map.
    """
    if not kernel.has_features:
        raise ValueError(f"mode='linear' needs a kernel with a feature map; {kernel!r} has none")
    batch = torch.broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2])
    nk, dv = k.shape[-2], v.shape[-1]
    a = torch.zeros(*batch, nk, dtype=q.dtype, device=q.device) if key_bias is None else key_bias.squeeze(-2)
    a = a.expand(*batch, nk)
    if is_causal:
        v1 = torch.cat([v, torch.ones_like(v[..., :1])], dim=-1).expand(*batch, nk, dv + 1)
        phi_q = kernel.features(q).expand(*batch, q.shape[-2], -1)
        return _causal(phi_q, kernel.features(k).expand(*batch, nk, -1), v1, a, eps)
    c = a.amax(dim=-1, keepdim=True).detach()
    c = torch.where(torch.isfinite(c), c, torch.zeros_like(c))
    m = torch.exp(a - c)
    e = dv + 1
    state: Tensor | None = None
    esum: Tensor | None = None
    width = math.prod(batch) * kernel.features(k[..., :1, :]).shape[-1] * e
    t = THRESHOLDS
    rows = max(t.kernel_linear_key_chunk, min(4096, t.kernel_linear_chunk_elements // max(1, width)))
    for start in range(0, nk, rows):  # key side: S = Σ_j m_j φ_jφ_jᵀ ⊗ [v_j, 1], chunk by chunk
        sl = slice(start, start + rows)
        phi_k = kernel.features(k[..., sl, :])
        phi_k = phi_k.expand(*batch, *phi_k.shape[-2:])
        mc = m[..., sl].unsqueeze(-1)
        vm = torch.cat([v[..., sl, :] * mc, mc], dim=-1)
        part = _outer_state(phi_k, vm)
        state = part if state is None else state + part
        es = vm.sum(-2)
        esum = es if esum is None else esum + es
    assert state is not None and esum is not None
    nq = q.shape[-2]
    track = under_transform() or (torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v, state)))
    out = None if track else q.new_empty(*batch, nq, dv)
    outs = []
    for start in range(0, nq, rows):  # query side, chunk by chunk
        phi = kernel.features(q[..., start : start + rows, :])
        num = _read_state(phi.expand(*batch, *phi.shape[-2:]), state, e)
        if eps:
            num = num + eps * esum.unsqueeze(-2)
        if out is None:
            outs.append(_finish(num))
        else:
            out[..., start : start + rows, :] = _finish(num)
    if out is not None:
        return out
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=-2)


def _causal(phi_q: Tensor, phi_k: Tensor, v1: Tensor, a: Tensor, eps: float) -> Tensor:
    """Chunked prefix sums with a per-row running-max shift."""
    n, dd, e = phi_q.shape[-2], phi_q.shape[-1], v1.shape[-1]
    lead = phi_q.shape[:-2]
    state = phi_q.new_zeros(*lead, dd, dd * e)
    esum = phi_q.new_zeros(*lead, e)
    c_prev = torch.full((*lead, 1), float("-inf"), dtype=phi_q.dtype, device=phi_q.device)
    outs = []
    step = THRESHOLDS.kernel_linear_causal_chunk
    for start in range(0, n, step):
        sl = slice(start, start + step)
        pq, pk, vc, ac = phi_q[..., sl, :], phi_k[..., sl, :], v1[..., sl, :], a[..., sl]
        size = ac.shape[-1]
        c_row = torch.maximum(torch.cummax(ac.detach(), dim=-1).values, c_prev)  # (…, C)
        fin = torch.isfinite(c_row)
        c_safe = torch.where(fin, c_row, torch.zeros_like(c_row))
        # earlier chunks: S was shifted by c_prev; rescale to each row's c_i (factor ≤ 1).
        both = fin & torch.isfinite(c_prev)
        carry = torch.where(both, torch.exp(c_prev - c_safe), torch.zeros_like(c_safe))
        num = _read_state(pq, state, e)
        if eps:
            num = num + eps * esum.unsqueeze(-2)
        num = num * carry.unsqueeze(-1)
        # inside the chunk: exact (f² + ε) exp(a_j − c_i) for j ≤ i.
        f2 = torch.matmul(pq, pk.transpose(-2, -1)).square() + eps
        logw = ac.unsqueeze(-2) - c_safe.unsqueeze(-1)
        keep = torch.ones(size, size, dtype=torch.bool, device=pq.device).tril()
        w = torch.where(keep & fin.unsqueeze(-1), f2 * torch.exp(logw.clamp(max=0)), torch.zeros_like(f2))
        num = num + torch.matmul(w, vc)
        outs.append(_finish(num))
        # update the state to the chunk's last running max.
        c_new = c_row[..., -1:]
        fin_new = torch.isfinite(c_new)
        c_new_safe = torch.where(fin_new, c_new, torch.zeros_like(c_new))
        both_new = torch.isfinite(c_prev) & fin_new
        decay = torch.where(both_new, torch.exp(c_prev - c_new_safe), torch.zeros_like(c_new))
        mk = torch.where(fin_new, torch.exp(ac - c_new_safe), torch.zeros_like(ac))
        vm = vc * mk.unsqueeze(-1)
        state = state * decay.unsqueeze(-1) + _outer_state(pk, vm)
        esum = esum * decay + vm.sum(-2)
        c_prev = c_new
    return torch.cat(outs, dim=-2)

