"""Slow, obvious float64 oracles for the MEM problem (one problem at a time, scipy).

* :func:`dual_oracle` maximizes the dual (7) with scipy's BFGS (analytic gradient).
* :func:`primal_oracle` minimizes the primal (3) directly over the simplex restricted to the
  support of ``u`` (softmax parameterization, BFGS) — independent of the duality theorem.
"""
from __future__ import annotations

import numpy as np
import scipy.optimize as so
from scipy.special import logsumexp, softmax


def _prep(T, z, u):
    T = np.asarray(T, dtype=np.float64)
    z = np.asarray(z, dtype=np.float64)
    n = T.shape[0]
    u = np.full(n, 1.0 / n) if u is None else np.asarray(u, dtype=np.float64)
    u = u / u.sum()
    return T, z, u


def dual_objective(lam, T, z, u, alpha):
    T, z, u = _prep(T, z, u)
    b = u @ T + z
    with np.errstate(divide="ignore"):
        logu = np.log(u)
    return lam @ b - lam @ lam / (2 * alpha) - logsumexp(logu + T @ lam)


def dual_oracle(T, z, u, alpha):
    """λ* (d,) by BFGS on the negated dual objective."""
    T, z, u = _prep(T, z, u)
    b = u @ T + z
    with np.errstate(divide="ignore"):
        logu = np.log(u)

    def neg(lam):
        s = logu + T @ lam
        p = softmax(s)
        f = lam @ b - lam @ lam / (2 * alpha) - logsumexp(s)
        g = b - lam / alpha - p @ T
        return -f, -g

    res = so.minimize(neg, alpha * z, jac=True, method="BFGS", options={"gtol": 1e-12, "maxiter": 10_000})
    return res.x


def primal_objective(p, T, z, u, alpha):
    T, z, u = _prep(T, z, u)
    b = u @ T + z
    h = p @ T
    pos = p > 0
    kl = float(np.sum(p[pos] * (np.log(p[pos]) - np.log(u[pos]))))
    return alpha / 2 * float(np.sum((b - h) ** 2)) + kl


def primal_oracle(T, z, u, alpha):
    """p* (n,) minimizing α/2‖μ+z−Σp_i t_i‖² + KL(p‖u) over the simplex on supp(u)."""
    T, z, u = _prep(T, z, u)
    b = u @ T + z
    supp = u > 0
    Ts, us = T[supp], u[supp]

    def obj(theta):
        p = softmax(theta)
        r = b - p @ Ts
        f = alpha / 2 * r @ r + np.sum(p * (np.log(p) - np.log(us)))
        dfdp = -alpha * (Ts @ r) + np.log(p) - np.log(us) + 1.0
        g = p * (dfdp - p @ dfdp)
        return f, g

    res = so.minimize(obj, np.log(us), jac=True, method="BFGS", options={"gtol": 1e-13, "maxiter": 10_000})
    p = np.zeros(T.shape[0])
    p[supp] = softmax(res.x)
    return p
