r"""Multi-head implicit kernel attention: IKA_S, IKA_NS, IKAN, IKAN-direct, MIKAN.

implicit-kernel-attention eq. 9, 11 with the spectral densities of :mod:`attnopt.nn.spectral`:

========== ======================== ============================ ===========
variant    kernel                   spectral points              magnitude
========== ======================== ============================ ===========
ika-s      stationary (eq. 12–13)   implicit density (sampled)   L2
ika-ns     non-stationary (14–16)   two implicit densities       L2
ikan       non-stationary           two implicit densities       L^p
ikan-direct non-stationary          learned parameters (no KL)   L^p
mikan      non-stationary           two densities + copula       L^p
========== ======================== ============================ ===========

The inference network's input ``h^{(m)}`` for head ``m`` is the mean of that head's projected
keys over the non-padded key positions (so spectral points are per example and per head).
Training draws fresh base noise (reparameterized; from ``seed``'s generator when given);
evaluation uses a fixed base sample drawn once at construction from ``seed`` (common random
numbers), so ``eval()`` outputs are deterministic and represent the density by the same R
quasi-samples every call.

Under ``torch.func`` transforms (``vmap``, ``grad``, ``jacrev``; per-example gradients) the sampler
and the attention take their plain PyTorch forms (the same function). In training mode the noise is
drawn inside the call: under ``vmap`` its ``randomness`` flag decides (``"different"``: a draw per
example, ``"same"``: one shared draw); the default ``"error"`` raises a ``RuntimeError`` naming the
module. ``kl()`` holds the transform's tensor: read it inside the transformed function.
"""
from __future__ import annotations

import math
from typing import Literal

import torch
from torch import Tensor, nn

from attnopt import _func
from attnopt.functional.kernel import kernel_attention, kernel_weights, sample_spectral_points
from attnopt.functional.kernel.gaussian_noise import draw_seed, gaussian_noise, noise_from_seed
from attnopt.functional.kernel.sampled_fourier import sampled_fourier_attention
from attnopt.functional.kernel.spectral import fusable
from attnopt.kernels import Kernel, NonStationaryFourier, RandomFourier
from attnopt.nn._multihead import MultiheadBase
from attnopt.nn.spectral import GaussianCopula, ImplicitSpectralDensity

__all__ = ["ImplicitKernelAttention"]


Variant = Literal["ika-s", "ika-ns", "ikan", "ikan-direct", "mikan"]
_VARIANTS = ("ika-s", "ika-ns", "ikan", "ikan-direct", "mikan")


class ImplicitKernelAttention(MultiheadBase):
    """Multi-head attention with an implicit (learned) kernel and an L^p magnitude.

    ``forward`` is :class:`~attnopt.nn._multihead.MultiheadBase`'s (as
    ``nn.MultiheadAttention(batch_first=True)``). After each forward, :meth:`kl` gives the KL
    term of the ELBO for the spectral samples just used.

    Args:
        embed_dim, num_heads: as ``nn.MultiheadAttention``.
        variant: one of ``"ika-s"``, ``"ika-ns"``, ``"ikan"``, ``"ikan-direct"``, ``"mikan"``.
        num_samples: ``R`` spectral points per head (even for sampled variants).
        p: magnitude exponent ``p > 0`` (``ika-s``/``ika-ns`` use L2 and require ``p = 2``).
        mode: ``"quadratic"`` or ``"linear"`` (the exact O(N·R²) form for long inputs; takes
            key padding, also combined with query padding as :mod:`attnopt.models` passes it,
            and ``is_causal``, but not other query-dependent masks).
        eps: added to ``f²`` (the authors' ``1e-5``).
        hidden: width of the spectral-density networks.
        seed: seeds the training noise generator and the fixed evaluation noise.
        bias, kdim, vdim, dropout: as ``nn.MultiheadAttention``.
    Raises:
        ValueError: unknown variant, ``p <= 0`` or ``p != 2`` for ``ika-s``/``ika-ns``, bad
            ``num_samples``, bad sizes.
    """

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        variant: Variant = "ikan",
        num_samples: int = 8,
        p: float = 2.0,
        *,
        mode: Literal["quadratic", "linear"] = "quadratic",
        eps: float = 1e-5,
        hidden: int = 32,
        seed: int | None = None,
        bias: bool = True,
        kdim: int | None = None,
        vdim: int | None = None,
        dropout: float = 0.0,
    ) -> None:
        super().__init__(embed_dim, num_heads, bias=bias, kdim=kdim, vdim=vdim, dropout=dropout)
        if variant not in _VARIANTS:
            raise ValueError(f"variant must be one of {_VARIANTS}, got {variant!r}")
        if not (math.isfinite(p) and p > 0):
            raise ValueError(f"p must be a finite number > 0, got {p}")
        if variant in ("ika-s", "ika-ns") and p != 2.0:
            raise ValueError(f"variant {variant!r} uses the L2 magnitude (p = 2); use 'ikan' for p = {p}")
        if mode not in ("quadratic", "linear"):
            raise ValueError(f"mode must be 'quadratic' or 'linear', got {mode!r}")
        if num_samples < 1:
            raise ValueError(f"num_samples must be >= 1, got {num_samples}")
        self.variant, self.num_samples, self.p, self.mode, self.eps = variant, num_samples, p, mode, eps
        d = self.head_dim
        n_sets = 1 if variant == "ika-s" else 2
        self._generator: torch.Generator | None = None
        gen = torch.Generator().manual_seed(seed) if seed is not None else None
        if seed is not None:
            self._generator = torch.Generator().manual_seed(seed + 1)
        if variant == "ikan-direct":
            std = 1.0 / math.sqrt(2 * math.sqrt(d))
            init = torch.randn(n_sets, num_heads, num_samples, d, generator=gen) * std
            self.spectral_points = nn.Parameter(init)
            self.densities = nn.ModuleList()
        else:
            self.densities = nn.ModuleList(
                ImplicitSpectralDensity(d, num_samples, hidden) for _ in range(n_sets)
            )
            self.register_buffer(
                "eval_noise", torch.randn(n_sets, num_heads, num_samples // 2, d, generator=gen)
            )
        self.copula = GaussianCopula(num_heads) if variant == "mikan" else None
        self._kl: Tensor | None = None

    def _head_summary(self, k: Tensor, mask: Tensor | None) -> Tensor:
        """``h`` per head: mean of the head's keys over non-padded positions, (B, H, d)."""
        if k.shape[-2] == 0:  # no key (Nk = 0): the empty mean is taken as 0, not NaN
            return k.sum(dim=-2)
        if mask is None:  # = k.mean(-2) bitwise (ATen's mean is this sum and division); its backward
            # is a small division and an expand view, where mean's divides the expanded (B, H, N, d)
            # gradient (~30 µs at B·H = 8, N = 64)
            return torch.div(k.sum(dim=-2), k.shape[-2])
        valid = (~torch.isneginf(mask).all(dim=-2)).to(k.dtype)  # (B|1, H|1, Nk)
        valid = valid.expand(*k.shape[:-1])
        return (k * valid.unsqueeze(-1)).sum(-2) / valid.sum(-1, keepdim=True).clamp_min(1.0)

    def spectral_points_for(self, k: Tensor, mask: Tensor | None = None) -> tuple[list[Tensor], Tensor]:
        """Spectral point sets (each (B, H, R, d) or (H, R, d)) and the per-example KL (B,)."""
        sets, _, kl = self._sample(k, mask)
        return sets, kl

    def _base_noise(self, k: Tensor, seed: Tensor | None = None) -> Tensor:
        """Every set's base noise ``(S, B, H, R/2, d)`` in one draw (training: float32 values from one
        seed of the module's generator, :mod:`~attnopt.functional.kernel.gaussian_noise`; eval: the
        fixed buffer).

        ``seed``: the training draw's seed when the caller drew it already (:meth:`_attend_whole`).
        """
        b = k.shape[0]
        if self.training:
            n_sets, half = len(self._modules["densities"]), self.num_samples // 2  # type: ignore[arg-type]
            shape = (n_sets, b, self.num_heads, half, self.head_dim)
            if _func.level() is not None:
                return self._noise_under_transform(shape, k)
            if seed is None:
                seed = draw_seed(self._generator)
            noise = noise_from_seed(seed, shape, torch.float64 if k.dtype == torch.float64 else torch.float32)
            if noise.dtype == k.dtype and noise.device == k.device:
                return noise
            return noise.to(device=k.device, dtype=k.dtype)
        return self.get_buffer("eval_noise").to(k.dtype).unsqueeze(1).expand(-1, b, -1, -1, -1)

    def _noise_under_transform(self, shape: tuple[int, ...], k: Tensor) -> Tensor:
        """The training noise drawn inside a ``torch.func`` transform: ``vmap``'s ``randomness``
        decides (``"different"``: each example its own draw, as in a batched call; ``"same"``: one
        draw for all); its default ``"error"`` raises, naming the module."""
        try:
            noise = gaussian_noise(shape, self._generator)
        except RuntimeError as exc:
            if "randomness" not in str(exc):
                raise
            raise RuntimeError(
                f"ImplicitKernelAttention({self.variant!r}) draws fresh spectral noise in training mode: "
                "under torch.func.vmap pass randomness='different' (each example its own draw, as a "
                "batched call) or 'same', or call eval() (the fixed evaluation noise)"
            ) from exc
        return noise.to(device=k.device, dtype=k.dtype)

    def _sample(
        self, k: Tensor, mask: Tensor | None, split: bool = True, kl_mean: bool = False,
        noise: Tensor | None = None,
    ) -> tuple[list[Tensor], Tensor | None, Tensor]:
        """(point sets, the same sets stacked along the points or None, KL per example).

        With ``split=False`` the sets are left out (an empty list) where the stacked tensor is given;
        with ``kl_mean=True`` the KL is its batch mean (0-d; taken inside the sampling node);
        ``noise``: :meth:`_base_noise` when the caller drew it already.
        """
        b = k.shape[0]
        if self.variant == "ikan-direct":
            w = self.spectral_points.to(k.dtype)  # (S, H, R, d)
            return list(w), None, k.new_zeros(()) if kl_mean else k.new_zeros(b)
        n_sets, half = len(self.densities), self.num_samples // 2
        # the copula correlates the base noise (inside the sampling node, or in one einsum with its
        # factor computed once per forward)
        if noise is None:
            noise = self._base_noise(k)
        params = fusable(self.densities)
        if params is not None and (self.copula is None or type(self.copula) is GaussianCopula):
            # the stock density networks (and copula): every set and the copula in one node; without
            # a mask the head summary (the keys' mean) is taken inside it too
            raw = None if self.copula is None else self.copula.raw
            keys = mask is None and k.shape[-2] > 0
            src = k if keys else self._head_summary(k, mask)
            pts, kl = sample_spectral_points(src, noise, self.densities, params, raw, kl_mean, keys)
            r = self.num_samples
            if not split:  # the caller takes the stacked points (no slice views, no autograd nodes)
                return [], pts, kl
            return [pts[..., i * r : (i + 1) * r, :] for i in range(n_sets)], pts, kl
        h = self._head_summary(k, mask)
        log_det = None
        if self.copula is not None:
            factor = self.copula.factor()
            noise = self.copula.correlate(noise, factor)
            log_det = 2 * factor.diagonal().log().sum().to(k.dtype)
        sets, kl = [], k.new_zeros(b)
        for i, dens in enumerate(self.densities):
            assert isinstance(dens, ImplicitSpectralDensity)
            mu, log_sigma = dens.posterior(h)  # (B, H, d)
            z_tilde = torch.addcmul(mu.unsqueeze(-2), log_sigma.exp().unsqueeze(-2), noise[i])
            sets.append(dens.transform(z_tilde))
            set_kl = ImplicitSpectralDensity.gaussian_kl(mu, log_sigma).sum(-1)
            if log_det is not None:
                set_kl = set_kl - 0.5 * self.head_dim * log_det
            kl = kl + half * set_kl
        return sets, None, (kl.mean() if kl_mean else kl)

    def kernel_for(self, k: Tensor, mask: Tensor | None = None, noise: Tensor | None = None) -> Kernel:
        """The kernel used for keys ``k`` (B, H, Nk, d); records the KL for :meth:`kl`.

        ``noise``: the base noise when already drawn (:meth:`_base_noise`), else drawn here.
        """
        sets, stacked, kl = self._sample(k, mask, split=False, kl_mean=True, noise=noise)
        self._kl = kl if k.shape[0] else k.new_zeros(())  # an empty batch adds 0, not a NaN mean
        if self.variant == "ika-s":  # one set: the stacked tensor is that set
            return RandomFourier(sets[0] if stacked is None else stacked)
        if stacked is not None:  # one tensor holds both sets: attention takes it without a copy
            return NonStationaryFourier.stacked(stacked)
        return NonStationaryFourier(sets[0], sets[1])

    def kl(self) -> Tensor:
        """KL term of the ELBO for the last forward pass, per example (mean over the batch).

        The latent variables are the ``R/2`` base points of every head (i.i.d. given ``h``), so
        this is ``R/2`` times the sum over heads (and over both densities for non-stationary
        variants) of ``KL(N(μ, σ²) ‖ N(0, I))``; for MIKAN the copula adds ``−(d/2) log det C``
        per point. It is 0 for ``ikan-direct`` and after an empty batch (B = 0). Add
        ``kl_weight * module.kl()`` to a per-example (batch-mean) task loss: ``kl_weight = 1`` is
        the ELBO of eq. 5; smaller weights (or annealing) are common.

        Raises:
            RuntimeError: called before any forward pass.
        """
        if self._kl is None:
            raise RuntimeError("kl() is available after a forward pass")
        return self._kl

    def attend(
        self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, is_causal: bool, need_weights: bool
    ) -> tuple[Tensor, Tensor | None]:
        noise = None
        if mask is None and not is_causal and not need_weights and not (self.training and self.dropout > 0):
            # the sampler and the attention in one node where both C paths apply (small CPU sizes)
            noise, out = self._attend_whole(q, k, v)
            if out is not None:
                return out, None
        kernel = self.kernel_for(k, mask, noise)
        if need_weights or (self.training and self.dropout > 0):
            w = kernel_weights(
                q, k, kernel=kernel, magnitude_p=self.p, attn_mask=mask, is_causal=is_causal, eps=self.eps
            )
            wd = nn.functional.dropout(w, p=self.dropout, training=self.training)
            return torch.matmul(wd, v), (w if need_weights else None)
        out = kernel_attention(
            q, k, v, kernel=kernel, magnitude_p=self.p, attn_mask=mask, is_causal=is_causal,
            mode=self.mode, eps=self.eps,
        )
        return out, None

    def _attend_whole(self, q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor | None, Tensor | None]:
        """``(base noise or None, O or None)``: the one-node path of
        :mod:`~attnopt.functional.kernel.sampled_fourier` where it
        applies (stock networks and copula, quadratic mode). In training it takes the draw's seed
        (the node makes the values); where it does not apply the noise of that seed is handed on
        to the two-node path (one draw either way: the same random stream)."""
        if self.variant == "ikan-direct" or self.mode != "quadratic" or k.dim() != 4:
            return None, None
        mods = self._modules  # (nn.Module.__getattr__ costs ~1 µs a submodule)
        densities, copula = mods["densities"], mods.get("copula")
        assert isinstance(densities, nn.ModuleList)
        params = fusable(densities)
        raw = None
        if copula is not None:
            if type(copula) is not GaussianCopula:
                return None, None
            raw = copula.raw
        if params is None:
            return None, None
        scales = tuple(float(dens.base_scale) for dens in densities._modules.values())  # type: ignore[arg-type]
        half = self.num_samples // 2
        if self.training and _func.level() is None:
            # the training draw's seed: the one-node path makes the noise inside its node, and hands
            # the seed back where it does not apply (the same values either way)
            seed = draw_seed(self._generator)
            done = sampled_fourier_attention(q, k, v, seed, raw, scales, params, self.p, self.eps, half)
            if done is None:
                return self._base_noise(k, seed), None
        else:
            noise = self._base_noise(k)
            done = sampled_fourier_attention(q, k, v, noise, raw, scales, params, self.p, self.eps, half)
            if done is None:
                return noise, None
        out, kl = done
        object.__setattr__(self, "_kl", kl)  # a plain attribute (nn.Module.__setattr__ costs ~3 µs)
        return None, out
