"""Obvious float64 oracle for generalized attention: explicit scores, exp, normalize."""
import torch


def generalized_weights_ref(q, k, *, preference=None, attn_mask=None, scale=None, is_causal=False):
    q, k = q.double(), k.double()
    nq, nk, d = q.shape[-2], k.shape[-2], q.shape[-1]
    scale = d**-0.5 if scale is None else scale
    e = torch.exp(scale * q @ k.transpose(-2, -1))
    if preference is not None:
        e = e * preference.double()
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            e = e * attn_mask.double()
        else:
            e = e * torch.exp(attn_mask.double())
    if is_causal:
        e = e * torch.ones(nq, nk, dtype=torch.float64).tril()
    z = e.sum(-1, keepdim=True)
    return torch.where(z > 0, e / torch.where(z > 0, z, 1.0), torch.zeros_like(e))


def generalized_attention_ref(q, k, v, **kw):
    return generalized_weights_ref(q, k, **kw) @ v.double()
