r"""Kernel graph attention as a PyTorch Geometric layer (implicit-kernel-attention eq. 10, Prop. 2).

For an edge ``j → i`` with ``q_i = [Wh_i ‖ 0]``, ``k_j = [0 ‖ Wh_j]``, ``a = [a_dst ‖ a_src]``
and the LeakyReLU slope ``c_ij`` picked by the sign of GAT's raw score ``aᵀ(q_i + k_j)``:

.. math:: \tilde\alpha_{ij} = \mathrm{sim}(q_i, c a)\,\mathrm{sim}(c a, k_j)\,
          \exp\!\big((2\|ca\|_p^2 + \|q_i\|_p^2 + \|k_j\|_p^2)/2\big)

normalized over the incoming edges of ``i`` (in the log domain). With the exact RBF kernel
(``l = 1``) and ``p = 2`` this is ``GATConv`` (Prop. 2). Kernels that can be negative are
squared, ``sim = f² + ε``.

The learned kernels of the paper's Table 5: ``kernel="direct"`` (IKAN-direct: the
non-stationary spectral points are parameters) and ``kernel="ikan"`` / ``"mikan"`` (the points
are drawn from implicit spectral densities, eq. 5–8, heads coupled by a Gaussian copula for
MIKAN; :meth:`KernelGATConv.kl` gives the ELBO's KL term). The density's input ``h^{(m)}``
for head ``m`` is the mean over the graph's nodes of ``q_i + k_i = [Wh_i ‖ Wh_i]``.

Needs the ``graph`` extra (``torch_geometric``), imported when this module is imported;
``import attnopt`` never imports it.
"""
from __future__ import annotations

import math
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attnopt._extras import MissingExtraError
from attnopt.functional.kernel import log_magnitude
from attnopt.kernels import RBF, Kernel, NonStationaryFourier
from attnopt.nn.spectral import ImplicitSpectralPoints

try:
    from torch_geometric.nn import MessagePassing
    from torch_geometric.utils import add_self_loops, remove_self_loops, softmax
except ImportError as _exc:  # one message naming the extra, not a bare ImportError
    raise MissingExtraError("graph", ["torch_geometric"], "attnopt.integrations.pyg") from _exc

__all__ = ["KernelGATConv"]


class KernelGATConv(MessagePassing):
    """GAT layer whose attention is kernel similarity × L^p magnitude (eq. 10).

    Parameters are named as in ``torch_geometric.nn.GATConv`` (``lin``, ``att_src``,
    ``att_dst``, ``bias``), so a trained GAT's weights load directly.

    Args:
        in_channels: input feature size.
        out_channels: ``F`` per head.
        heads: ``H``.
        kernel: ``"rbf"`` (exact RBF, ``l = 1``: GAT itself when ``p = 2``), ``"direct"``
            (IKAN-direct: learned non-stationary spectral points, ``num_samples`` per head,
            both sets drawn independently from ``N(0, I/2)``, so ``E f = ½[k(x − y) +
            k(x)k(y)]`` with ``k(u) = exp(−‖u‖²/4)``: the ``l = 1`` RBF of ``f²`` only for
            inputs near 0 — the magnitude still cancels in expectation, not per draw),
            ``"ikan"`` / ``"mikan"`` (non-stationary points from two implicit spectral
            densities, copula-coupled heads for ``"mikan"``; they also start at ``N(0, I/2)``),
            or any :class:`~attnopt.kernels.Kernel` on ``2F``-dimensional inputs (spectral
            points broadcast over (E, H, ·)).
        p: magnitude exponent ``p > 0``.
        num_samples: ``R`` for ``kernel="direct"``.
        concat: concatenate heads (else average), as ``GATConv``.
        negative_slope: LeakyReLU slope ``c`` of negative raw scores.
        dropout: dropout on the edge weights during training.
        add_self_loops: as ``GATConv``.
        bias: learn an additive bias.
        eps: added to ``f²`` for squared kernels.
        hidden: width of the density networks (``"ikan"``/``"mikan"``).
        seed: seeds the densities' training noise and fixed evaluation noise.
    Raises:
        ValueError: bad sizes, ``p <= 0``, unknown kernel name.
        TypeError: ``kernel`` neither a name nor a :class:`~attnopt.kernels.Kernel`.
    """

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        heads: int = 1,
        *,
        kernel: Kernel | Literal["rbf", "direct", "ikan", "mikan"] = "rbf",
        p: float = 2.0,
        num_samples: int = 8,
        concat: bool = True,
        negative_slope: float = 0.2,
        dropout: float = 0.0,
        add_self_loops: bool = True,
        bias: bool = True,
        eps: float = 1e-5,
        hidden: int = 32,
        seed: int | None = None,
    ) -> None:
        super().__init__(aggr="add", node_dim=0)
        if in_channels < 1 or out_channels < 1 or heads < 1:
            raise ValueError(f"channels and heads must be >= 1, got {in_channels}, {out_channels}, {heads}")
        if not (math.isfinite(p) and p > 0):
            raise ValueError(f"p must be a finite number > 0, got {p}")
        if not negative_slope > 0:
            raise ValueError(f"negative_slope must be > 0, got {negative_slope}")
        self.in_channels, self.out_channels, self.heads = in_channels, out_channels, heads
        self.p, self.concat, self.negative_slope = float(p), concat, negative_slope
        self.dropout, self.add_self_loops, self.eps = dropout, add_self_loops, eps
        self.lin = nn.Linear(in_channels, heads * out_channels, bias=False)
        self.att_src = nn.Parameter(torch.empty(1, heads, out_channels))
        self.att_dst = nn.Parameter(torch.empty(1, heads, out_channels))
        n_out = heads * out_channels if concat else out_channels
        self.bias = nn.Parameter(torch.zeros(n_out)) if bias else None
        self.spectral_points: nn.Parameter | None = None
        self.sampler: ImplicitSpectralPoints | None = None
        self._sampled: Kernel | None = None
        self._kl: Tensor | None = None
        if isinstance(kernel, str):
            if kernel == "rbf":
                self._kernel: Kernel | None = RBF(1.0)
            elif kernel == "direct":
                self._kernel = None
                self.spectral_points = nn.Parameter(
                    torch.randn(2, heads, num_samples, 2 * out_channels) / math.sqrt(2.0)
                )
            elif kernel in ("ikan", "mikan"):
                self._kernel = None
                self.sampler = ImplicitSpectralPoints(
                    2 * out_channels, heads, num_samples, n_sets=2, copula=kernel == "mikan",
                    hidden=hidden, lengthscale_sq=1.0, seed=seed,
                )
            else:
                raise ValueError(
                    f"kernel must be 'rbf', 'direct', 'ikan', 'mikan' or a Kernel, got {kernel!r}"
                )
        elif isinstance(kernel, Kernel):
            self._kernel = kernel
        else:
            raise TypeError(
                f"kernel must be 'rbf', 'direct' or an attnopt Kernel, got {type(kernel).__name__}"
            )
        self.reset_parameters()

    def reset_parameters(self) -> None:
        super().reset_parameters()
        nn.init.xavier_uniform_(self.lin.weight)
        nn.init.xavier_uniform_(self.att_src)
        nn.init.xavier_uniform_(self.att_dst)
        if self.bias is not None:
            nn.init.zeros_(self.bias)

    @property
    def kernel(self) -> Kernel:
        """The similarity kernel on ``2F``-dimensional vectors (sampled ones: the last forward's)."""
        if self._kernel is not None:
            return self._kernel
        if self.sampler is not None:
            if self._sampled is None:
                raise RuntimeError("a sampled kernel ('ikan'/'mikan') exists after a forward pass")
            return self._sampled
        assert self.spectral_points is not None
        return NonStationaryFourier(self.spectral_points[0], self.spectral_points[1])

    def _sample_kernel(self, h: Tensor) -> None:
        """Draw this pass's spectral points from the densities (``h (N, H, F)``) and record the KL."""
        if self.sampler is None:
            return
        # (H, F): the mean of q_i + k_i = [Wh_i ‖ Wh_i] over the nodes; 0 for a graph with no node
        # (h.mean would be NaN there, and the sampled points with it)
        summary = h.sum(dim=0) / max(h.shape[0], 1)
        (w1, w2), kl = self.sampler(torch.cat([summary, summary], dim=-1))
        self._sampled = NonStationaryFourier(w1, w2)
        self._kl = kl

    def kl(self) -> Tensor:
        """KL term of the ELBO for the last forward (0 for fixed or directly learned kernels).

        For ``"ikan"``/``"mikan"``: ``(R/2)·Σ_sets [Σ_heads KL(N(μ, σ²)‖N(0, I)) − (2F/2)·log det C]``
        (see :class:`~attnopt.nn.spectral.ImplicitSpectralPoints`); the engine adds
        ``kl_weight · kl()`` to the task loss.
        """
        if self.sampler is None:
            return self.lin.weight.new_zeros(())
        if self._kl is None:
            raise RuntimeError("kl() is available after a forward pass")
        return self._kl

    def _loops(self, edge_index: Tensor, n: int) -> Tensor:
        if self.add_self_loops:
            edge_index, _ = remove_self_loops(edge_index)
            edge_index, _ = add_self_loops(edge_index, num_nodes=n)
        return edge_index

    def forward(self, x: Tensor, edge_index: Tensor) -> Tensor:
        """``x (N, in_channels)``, ``edge_index (2, E)`` (source, target) -> (N, H·F) or (N, F)."""
        n = x.shape[0]
        h = self.lin(x).view(n, self.heads, self.out_channels)
        self._sample_kernel(h)
        out = self.propagate(self._loops(edge_index, n), x=h, size=None)
        out = out.reshape(n, self.heads * self.out_channels) if self.concat else out.mean(dim=1)
        return out if self.bias is None else out + self.bias

    def edge_weights(self, x: Tensor, edge_index: Tensor) -> tuple[Tensor, Tensor]:
        """``(edge_index with self loops, α (E, H))``: the normalized attention of each edge."""
        n = x.shape[0]
        h = self.lin(x).view(n, self.heads, self.out_channels)
        self._sample_kernel(h)
        ei = self._loops(edge_index, n)
        score = self._score(h[ei[1]], h[ei[0]])
        return ei, softmax(score, ei[1], num_nodes=n)

    def _score(self, x_i: Tensor, x_j: Tensor) -> Tensor:
        """Log of eq. 10 per edge: (E, H, F) target and source features -> (E, H)."""
        a_q, a_k = self.att_dst.to(x_i.dtype), self.att_src.to(x_i.dtype)
        raw = (x_i * a_q).sum(-1) + (x_j * a_k).sum(-1)
        c = torch.where(raw >= 0, torch.ones_like(raw), torch.full_like(raw, self.negative_slope))
        c = c.unsqueeze(-1)
        zeros = torch.zeros_like(x_i)
        q = torch.cat([x_i, zeros], dim=-1)
        k = torch.cat([zeros, x_j], dim=-1)
        ca = c * torch.cat([a_q, a_k], dim=-1).expand_as(q)
        kern = self.kernel
        if kern.squared:
            log_sim = torch.log(kern.paired(q, ca).square() + self.eps) + torch.log(
                kern.paired(ca, k).square() + self.eps
            )
        else:
            log_sim = kern.log_paired(q, ca) + kern.log_paired(ca, k)
        mag = log_magnitude(ca, self.p, 2.0) + log_magnitude(x_i, self.p, 1.0)
        mag = mag + log_magnitude(x_j, self.p, 1.0)
        return log_sim + mag.clamp(max=1e30).to(log_sim.dtype)

    def message(
        self, x_i: Tensor, x_j: Tensor, index: Tensor, ptr: Tensor | None, size_i: int | None
    ) -> Tensor:
        alpha = softmax(self._score(x_i, x_j), index, ptr, size_i)
        alpha = F.dropout(alpha, p=self.dropout, training=self.training)
        return x_j * alpha.unsqueeze(-1)

    def _kernel_label(self) -> str:
        if self.sampler is not None:
            return "'mikan'" if self.sampler.copula is not None else "'ikan'"
        return repr(self.kernel)

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}({self.in_channels}, {self.out_channels}, heads={self.heads}, "
            f"kernel={self._kernel_label()}, p={self.p})"
        )
