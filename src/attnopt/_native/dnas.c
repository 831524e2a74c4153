/* DNAS / HNAS (one Sinkhorn step) in scaling form: the N x N elementwise passes of
 * attnopt.functional.doubly_normalized.cpu, float32.
 *
 * dn_fwd / dn_bwd work on the heads [h0, h1) of one call: "s" (and "dp") hold the scores of
 * the chunk's heads only, (h1 - h0, nq, nk) row-major, "c0" is the first head of the chunk;
 * the per-head vectors (m, beta, u: nk entries; alpha, binv, rs, rho, drow: nq entries; w: 1)
 * are indexed by the absolute head. Heads are independent, so attnopt._native.parallel_rows
 * may split [h0, h1) over threads. "causal" = SDPA's top-left mask: query i sees keys j <= i.
 *
 * The exponential is a vectorizable Cephes-style polynomial (max error ~2 ulp on [-87, 0]),
 * exactly 0 below -87 (and for -inf): E = exp(S - m) has S - m <= 0 by construction.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "pexp.h"

#define pexp attnopt_pexpf


/* keys query i may see: all, or j <= i */
static inline int64_t seen(int64_t i, int64_t nk, int causal) {
    return causal ? (i + 1 < nk ? i + 1 : nk) : nk;
}

/* Exponential of each entry of x[0, n) in place (for tests against torch.exp). */
void dn_exp(float *x, int64_t r0, int64_t r1, int64_t n) {
    (void)n;
    #pragma omp simd
    for (int64_t j = r0; j < r1; ++j) x[j] = pexp(x[j]);
}

static inline float inv(float x) { return x > 0.0f ? 1.0f / x : 0.0f; }

/* Forward of heads [h0, h1). In: s = S (scale Q K^T, plus a full mask), kbias (NULL or nk per
 * head: a key-only additive mask, not added to s), w (NULL: DNAS). Out: s <- the weights P;
 * m (+inf for a dead key), beta, u (HNAS), alpha, binv (HNAS) and the row sums rs, rho. */
void dn_fwd(float *s, int64_t c0, const float *kbias, const float *w, float *m, float *beta, float *u,
            float *alpha, float *binv, float *rs, float *rho, int64_t h0, int64_t h1, int64_t nq, int64_t nk,
            int causal) {
    for (int64_t h = h0; h < h1; ++h) {
        float *sh = s + (h - c0) * nq * nk, *mh = m + h * nk, *bh = beta + h * nk;
        float *uh = w ? u + h * nk : NULL;
        for (int64_t j = 0; j < nk; ++j) mh[j] = -__builtin_inff();
        for (int64_t i = 0; i < nq; ++i) {
            const float *row = sh + i * nk;
            const int64_t n = seen(i, nk, causal);
            #pragma omp simd
            for (int64_t j = 0; j < n; ++j) mh[j] = row[j] > mh[j] ? row[j] : mh[j];
        }
        /* m_eff = m + bias: a dead key (m_eff = -inf) gets m = +inf, so E = e^{S - m} = 0 there */
        float mu = -__builtin_inff();
        for (int64_t j = 0; j < nk; ++j) {
            const float me = kbias ? mh[j] + kbias[h * nk + j] : mh[j];
            const int live = me > -__builtin_inff();
            if (uh) {
                uh[j] = me;
                mu = live && me > mu ? me : mu;
            }
            mh[j] = live ? mh[j] : __builtin_inff();
            bh[j] = 0.0f;
        }
        if (uh) {
            mu = mu > -__builtin_inff() ? mu : 0.0f;
            #pragma omp simd
            for (int64_t j = 0; j < nk; ++j) uh[j] = pexp(uh[j] - mu);
        }
        for (int64_t i = 0; i < nq; ++i) {
            float *row = sh + i * nk;
            const int64_t n = seen(i, nk, causal);
            #pragma omp simd
            for (int64_t j = 0; j < n; ++j) {
                const float e = pexp(row[j] - mh[j]);
                row[j] = e;
                bh[j] += e;
            }
            for (int64_t j = n; j < nk; ++j) row[j] = 0.0f;
        }
        #pragma omp simd
        for (int64_t j = 0; j < nk; ++j) bh[j] = inv(bh[j]);
        const float ww = w ? w[h] : 1.0f;
        for (int64_t i = 0; i < nq; ++i) {
            float *row = sh + i * nk;
            const int64_t n = seen(i, nk, causal), r = h * nq + i;
            float a = 0.0f, p = 0.0f;
            if (uh) {
                #pragma omp simd reduction(+ : a, p)
                for (int64_t j = 0; j < n; ++j) {
                    a += row[j] * bh[j];
                    p += row[j] * uh[j];
                }
                rho[r] = p;
                binv[r] = inv(p);
            } else {
                #pragma omp simd reduction(+ : a)
                for (int64_t j = 0; j < n; ++j) a += row[j] * bh[j];
            }
            rs[r] = a;
            alpha[r] = inv(a);
            const float ca = ww * alpha[r], cb = uh ? (1.0f - ww) * binv[r] : 0.0f;
            if (uh) {
                #pragma omp simd
                for (int64_t j = 0; j < n; ++j) row[j] *= ca * bh[j] + cb * uh[j];
            } else {
                #pragma omp simd
                for (int64_t j = 0; j < n; ++j) row[j] *= ca * bh[j];
            }
        }
    }
}

/* Backward of heads [h0, h1). In: s = S (as in the forward), dp = dO V^T, and the forward's
 * m, beta, u, w, alpha, binv. Out: s <- P (dV = P^T dO), dp <- dS, drow (HNAS: <dO, out^D - out^L>
 * per row). Returns 0, or -1 when out of memory. */
int dn_bwd(float *s, float *dp, int64_t c0, const float *w, const float *m, const float *beta, const float *u,
           const float *alpha, const float *binv, float *drow, int64_t h0, int64_t h1, int64_t nq, int64_t nk,
           int causal) {
    float *tmp = malloc(sizeof(float) * (size_t)(2 * nq + nk));
    if (!tmp) return -1;
    float *dl = tmp, *cx = tmp + nq, *gb = tmp + 2 * nq;
    for (int64_t h = h0; h < h1; ++h) {
        float *sh = s + (h - c0) * nq * nk, *gh = dp + (h - c0) * nq * nk;
        const float *mh = m + h * nk, *bt = beta + h * nk, *uh = w ? u + h * nk : NULL;
        const float ww = w ? w[h] : 1.0f;
        for (int64_t j = 0; j < nk; ++j) gb[j] = 0.0f;
        /* pass A: E again; dd = <dO, out^D>, dl = <dO, out^L>, cx = -w alpha dd,
         * gb_j = sum_i E (w alpha dP + cx) */
        for (int64_t i = 0; i < nq; ++i) {
            float *row = sh + i * nk;
            const float *g = gh + i * nk;
            const int64_t n = seen(i, nk, causal), r = h * nq + i;
            float td = 0.0f, tl = 0.0f;
            if (uh) {
                #pragma omp simd reduction(+ : td, tl)
                for (int64_t j = 0; j < n; ++j) {
                    const float e = pexp(row[j] - mh[j]);
                    row[j] = e;
                    td += e * bt[j] * g[j];
                    tl += e * uh[j] * g[j];
                }
                dl[i] = binv[r] * tl;
            } else {
                #pragma omp simd reduction(+ : td)
                for (int64_t j = 0; j < n; ++j) {
                    const float e = pexp(row[j] - mh[j]);
                    row[j] = e;
                    td += e * bt[j] * g[j];
                }
                dl[i] = 0.0f;
            }
            for (int64_t j = n; j < nk; ++j) row[j] = 0.0f;
            const float a = ww * alpha[r], d = alpha[r] * td, c = -a * d;
            cx[i] = c;
            if (drow) drow[r] = d - dl[i];
            #pragma omp simd
            for (int64_t j = 0; j < n; ++j) gb[j] += row[j] * (a * g[j] + c);
        }
        #pragma omp simd
        for (int64_t j = 0; j < nk; ++j) gb[j] = -gb[j] * bt[j] * bt[j];  /* cy */
        /* pass B: f = w alpha beta + (1 - w) binv u; P = E f; dS = E (dP f + cx beta + cy - bdl u) */
        for (int64_t i = 0; i < nq; ++i) {
            float *row = sh + i * nk, *g = gh + i * nk;
            const int64_t n = seen(i, nk, causal), r = h * nq + i;
            const float a = ww * alpha[r], c = cx[i];
            if (uh) {
                const float b = (1.0f - ww) * binv[r], bd = b * dl[i];
                #pragma omp simd
                for (int64_t j = 0; j < n; ++j) {
                    const float f = a * bt[j] + b * uh[j], x = row[j];
                    row[j] = x * f;
                    g[j] = x * (g[j] * f + c * bt[j] + gb[j] - bd * uh[j]);
                }
            } else {
                #pragma omp simd
                for (int64_t j = 0; j < n; ++j) {
                    const float f = a * bt[j], x = row[j];
                    row[j] = x * f;
                    g[j] = x * (g[j] * f + c * bt[j] + gb[j]);
                }
            }
            for (int64_t j = n; j < nk; ++j) g[j] = 0.0f;
        }
    }
    free(tmp);
    return 0;
}
