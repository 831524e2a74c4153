"""Similarity kernels for implicit kernel attention (implicit-kernel-attention Sec. 4).

Each kernel maps ``q (..., Nq, d)``, ``k (..., Nk, d)`` to a Gram matrix ``(..., Nq, Nk)``
via ``kernel(q, k)``; positive kernels (:class:`RBF`, :class:`Periodic`) also give
``log_gram``; kernels with a finite feature map (:class:`Linear`, :class:`RandomFourier`,
:class:`NonStationaryFourier`) give ``features(x)`` with ``f(q, k) = features(q)ᵀfeatures(k)``.
"""
from attnopt.kernels._base import Kernel
from attnopt.kernels.fourier import RandomFourier
from attnopt.kernels.linear import Linear
from attnopt.kernels.nonstationary import NonStationaryFourier
from attnopt.kernels.periodic import Periodic
from attnopt.kernels.rbf import RBF

__all__ = ["Kernel", "RBF", "Periodic", "Linear", "RandomFourier", "NonStationaryFourier"]
