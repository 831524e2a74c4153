# mypy: disallow-untyped-defs=False
r"""Tile helpers shared by the flash-style Triton kernels (internal).

``@triton.jit`` functions that :mod:`._flash` and :mod:`._fourier` (and :mod:`._fourier_scan`) call
from their kernels: the program's (batch, head) and row block, masked loads and stores of a
``(BLOCK, C)`` tile through its strides, a row's saved log-sum-exp, and the online-softmax step
and finish (flash-attention-2, Dao 2023):

.. math:: m' = \max(m, \max_j t_{ij}),\quad \ell' = \ell\,e^{m - m'} + \sum_j e^{t_{ij} - m'},\quad
          o = \frac{\mathrm{acc}}{\ell},\quad \mathrm{lse} = m + \log \ell

(a row with no admissible column keeps ``ℓ = 0`` and gets ``lse = -inf``, ``o = 0``). Triton
inlines them into the kernels, so they cost nothing on the GPU.
"""
import triton
import triton.language as tl


@triton.jit
def _program(H, BLOCK: tl.constexpr):
    """``(pid, pid_g, ob, oh, offs)`` of a program on the grid ``(blocks, B·H)``: its block index,
    its (batch, head) as one index and as ``(b, h)``, and its ``BLOCK`` row offsets."""
    pid = tl.program_id(0)
    pid_g = tl.program_id(1)
    return pid, pid_g, pid_g // H, pid_g % H, pid * BLOCK + tl.arange(0, BLOCK)


@triton.jit
def _span(pid, N, UPPER: tl.constexpr, LOWER: tl.constexpr, BLOCK: tl.constexpr, BLOCK_O: tl.constexpr):
    """``(lo, hi)``: the range of the other axis (``N`` long, walked in ``BLOCK_O`` tiles from ``lo``)
    that block ``pid`` of ``BLOCK`` visits under a causal rule seen from its axis: ``UPPER`` keeps
    only indices up to the block's own (stop at its end), ``LOWER`` only from them on (start at the
    tile holding its first index)."""
    lo = 0
    hi = N
    if UPPER:
        hi = tl.minimum(N, (pid + 1) * BLOCK)
    if LOWER:
        lo = (pid * BLOCK // BLOCK_O) * BLOCK_O
    return lo, hi


@triton.jit
def _load_tile(X, ob, oh, sb, sh, sn, sd, offs, N, offs_c, CA):
    """The ``(BLOCK, C)`` tile of ``X[ob, oh]`` (strides ``sb, sh, sn, sd``) at rows ``offs`` and
    columns ``offs_c``; 0 outside ``N`` rows and ``CA`` columns."""
    return tl.load(X + ob * sb + oh * sh + offs[:, None] * sn + offs_c[None, :] * sd,
                   mask=(offs[:, None] < N) & (offs_c[None, :] < CA), other=0.0)


@triton.jit
def _store_tile(X, ob, oh, sb, sh, sn, sd, offs, N, offs_c, CA, x):
    """Store the ``(BLOCK, C)`` tile ``x`` (cast to ``X``'s dtype) where :func:`_load_tile` reads."""
    tl.store(X + ob * sb + oh * sh + offs[:, None] * sn + offs_c[None, :] * sd, x.to(X.dtype.element_ty),
             mask=(offs[:, None] < N) & (offs_c[None, :] < CA))


@triton.jit
def _store_rows(X, rows, offs, N, x, C: tl.constexpr, CA):
    """Store the ``(BLOCK, C)`` tile ``x`` as rows ``rows`` of the contiguous ``(·, C)`` buffer ``X``
    (a gradient in its padded buffer): ``offs < N`` rows, ``CA`` columns."""
    offs_c = tl.arange(0, C)
    tl.store(X + rows[:, None] * C + offs_c[None, :], x.to(X.dtype.element_ty),
             mask=(offs[:, None] < N) & (offs_c[None, :] < CA))


@triton.jit
def _load_lse(L, ob, oh, sb, sh, sn, offs, N, ACC: tl.constexpr):
    """The rows' saved log-sum-exp in ``ACC``, ``-inf`` (no admissible column) read as ``+inf``, so
    that ``P = e^{t − ℓ}`` is 0 on such a row."""
    lse = tl.load(L + ob * sb + oh * sh + offs * sn, mask=offs < N, other=float("-inf")).to(ACC)
    return tl.where(lse == float("-inf"), float("inf"), lse)


@triton.jit
def _online(t, m_i, l_i):
    """One online-softmax step over a score tile ``t``: ``(p, corr, m', ℓ')`` with ``p = e^{t − m'}``
    and ``corr = e^{m − m'}`` (the factor on what was accumulated), ``-inf`` maxima read as 0."""
    m_new = tl.maximum(m_i, tl.max(t, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp(t - m_safe[:, None])
    corr = tl.exp(m_i - m_safe)
    return p, corr, m_new, l_i * corr + tl.sum(p, 1)


@triton.jit
def _accumulate(acc, corr, p, v, ACC: tl.constexpr, PREC: tl.constexpr):
    """``acc·corr + p v`` (``p`` in ``v``'s dtype): the online softmax's weighted values."""
    return acc * corr[:, None] + tl.dot(p.to(v.dtype), v, out_dtype=ACC, input_precision=PREC)


@triton.jit
def _finish(O, L, ob, oh, sob, soh, son, sod, slb, slh, sln, offs, N, offs_c, CA, acc, m_i, l_i,
            HAS_V: tl.constexpr):
    """Store a row block's ``lse = m + log ℓ`` (``-inf`` where ``ℓ = 0``) and, with values, its
    output ``acc / ℓ`` (0 where ``ℓ = 0``)."""
    some = l_i > 0
    lse = tl.where(some, m_i + tl.log(tl.where(some, l_i, 1.0)), float("-inf"))
    tl.store(L + ob * slb + oh * slh + offs * sln, lse, mask=offs < N)
    if HAS_V:
        out = acc / tl.where(some, l_i, 1.0)[:, None]
        _store_tile(O, ob, oh, sob, soh, son, sod, offs, N, offs_c, CA, out)
