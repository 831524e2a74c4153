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

/* m_j = max over the rows that see key j of s_ij (-inf for a key no row sees). */
static void column_max(const float *sh, float *mh, int64_t nq, int64_t nk, int causal) {
    for (int64_t j = 0; j < nk; ++j) mh[j] = -__builtin_inff();
    for (int64_t i = 0; i < nq; ++i) {
        const float *row = sh + i * nk;
        const int64_t n = seen(i, nk, causal);
        #pragma omp simd
        for (int64_t j = 0; j < n; ++j) mh[j] = row[j] > mh[j] ? row[j] : mh[j];
    }
}

/* sh <- E = e^{S - m} (0 where a row does not see the key), bh <- beta = 1 / (E^T 1) (bh zeroed by
 * the caller; 0 for a dead key). */
static void column_exp(float *sh, const float *mh, float *bh, int64_t nq, int64_t nk, int causal) {
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
}

/* Forward of heads [h0, h1). In: s = S (scale Q K^T, plus a full mask), kbias (NULL or nk per
 * head: a key-only additive mask, not added to s), w (NULL: DNAS). Out: s <- the weights P;
 * m (+inf for a dead key), beta, u (HNAS), alpha, binv (HNAS) and the row sums rs, rho. */
void dn_fwd(float *s, int64_t c0, const float *kbias, const float *w, float *m, float *beta, float *u,
            float *alpha, float *binv, float *rs, float *rho, int64_t h0, int64_t h1, int64_t nq, int64_t nk,
            int causal) {
    for (int64_t h = h0; h < h1; ++h) {
        float *sh = s + (h - c0) * nq * nk, *mh = m + h * nk, *bh = beta + h * nk;
        float *uh = w ? u + h * nk : NULL;
        column_max(sh, mh, nq, nk, causal);
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
        column_exp(sh, mh, bh, nq, nk, causal);
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

/* Sinkhorn-K (K >= 2 steps, DNAS only) in scaling form, heads [h0, h1): beta_1 = 1/z (z = E^T 1),
 * alpha_t = 1/(E beta_t), beta_{t+1} = 1/(E^T alpha_t), P = diag(alpha_K) E diag(beta_K).
 * In: s = S (plus a full mask), kbias (NULL or nk per head: a key-only mask). Out: s <- P; m;
 * beta (K * nk per head: beta_1 .. beta_K), alpha (K * nq per head: alpha_1 .. alpha_K), rs = the
 * smallest row sum E beta_t of each row over the K steps (the caller's underflow test). */
void sk_fwd(float *s, int64_t c0, const float *kbias, float *m, float *beta, float *alpha, float *rs,
            int64_t h0, int64_t h1, int64_t nq, int64_t nk, int causal, int64_t kk) {
    for (int64_t h = h0; h < h1; ++h) {
        float *sh = s + (h - c0) * nq * nk, *mh = m + h * nk;
        float *bh = beta + h * kk * nk, *ah = alpha + h * kk * nq, *rh = rs + h * nq;
        column_max(sh, mh, nq, nk, causal);
        for (int64_t j = 0; j < nk; ++j) {
            const float me = kbias ? mh[j] + kbias[h * nk + j] : mh[j];
            mh[j] = me > -__builtin_inff() ? mh[j] : __builtin_inff();  /* a dead key: E = 0 */
            bh[j] = 0.0f;
        }
        column_exp(sh, mh, bh, nq, nk, causal);
        /* one pass per step: the row step (alpha_t = 1/(E beta_t)) and, on the same row, the column
         * sums of the next step (E^T alpha_t) or, at the last step, P = alpha_K E beta_K */
        for (int64_t t = 0; t < kk; ++t) {
            const float *bt = bh + t * nk;
            float *at = ah + t * nq, *bn = t + 1 < kk ? bh + (t + 1) * nk : NULL;
            if (bn) for (int64_t j = 0; j < nk; ++j) bn[j] = 0.0f;
            for (int64_t i = 0; i < nq; ++i) {
                float *row = sh + i * nk;
                const int64_t n = seen(i, nk, causal);
                float r = 0.0f;
                #pragma omp simd reduction(+ : r)
                for (int64_t j = 0; j < n; ++j) r += row[j] * bt[j];
                const float a = inv(r);
                at[i] = a;
                rh[i] = t == 0 || r < rh[i] ? r : rh[i];
                if (bn) {
                    #pragma omp simd
                    for (int64_t j = 0; j < n; ++j) bn[j] += a * row[j];
                } else {
                    #pragma omp simd
                    for (int64_t j = 0; j < n; ++j) row[j] *= a * bt[j];
                }
            }
            if (bn) {
                #pragma omp simd
                for (int64_t j = 0; j < nk; ++j) bn[j] = inv(bn[j]);
            }
        }
    }
}

/* Backward of sk_fwd, heads [h0, h1). In: s = S (as in the forward), dp = dO V^T, the forward's m,
 * beta, alpha. Out: s <- P (dV = P^T dO), dp <- dS. With A_K = dL/d alpha_K (A_K,i = sum_j E beta_K dP)
 * and B_K = sum_i alpha_K E dP (the direct terms), the steps reversed: c_t = -A_t alpha_t^2,
 * B_t += E^T c_t, d_t = -B_t beta_t^2, A_{t-1} = E d_t; then
 * dS = E (alpha_K beta_K dP + sum_t c_t beta_t^T + sum_t alpha_{t-1} d_t^T), alpha_0 = 1.
 * Returns 0, or -1 when out of memory. */
int sk_bwd(float *s, float *dp, int64_t c0, const float *m, const float *beta, const float *alpha,
           int64_t h0, int64_t h1, int64_t nq, int64_t nk, int causal, int64_t kk) {
    float *tmp = malloc(sizeof(float) * (size_t)(kk * nq + kk * nk + nk));
    if (!tmp) return -1;
    float *cx = tmp, *dy = tmp + kk * nq, *acc = tmp + kk * (nq + nk);
    for (int64_t h = h0; h < h1; ++h) {
        float *sh = s + (h - c0) * nq * nk, *gh = dp + (h - c0) * nq * nk;
        const float *mh = m + h * nk, *bh = beta + h * kk * nk, *ah = alpha + h * kk * nq;
        const float *bk = bh + (kk - 1) * nk, *ak = ah + (kk - 1) * nq;
        float *ck = cx + (kk - 1) * nq, *dk = dy + (kk - 1) * nk;
        for (int64_t j = 0; j < nk; ++j) dk[j] = 0.0f;
        /* pass A: E again; A_K, c_K and B_K = sum_i E (alpha_K dP + c_K) */
        for (int64_t i = 0; i < nq; ++i) {
            float *row = sh + i * nk;
            const float *g = gh + i * nk;
            const int64_t n = seen(i, nk, causal);
            float td = 0.0f;
            #pragma omp simd reduction(+ : td)
            for (int64_t j = 0; j < n; ++j) {
                const float e = pexp(row[j] - mh[j]);
                row[j] = e;
                td += e * bk[j] * g[j];
            }
            for (int64_t j = n; j < nk; ++j) row[j] = 0.0f;
            const float a = ak[i], c = -td * a * a;
            ck[i] = c;
            #pragma omp simd
            for (int64_t j = 0; j < n; ++j) dk[j] += row[j] * (a * g[j] + c);
        }
        #pragma omp simd
        for (int64_t j = 0; j < nk; ++j) dk[j] = -dk[j] * bk[j] * bk[j];
        for (int64_t t = kk - 2; t >= 0; --t) {  /* A_t = E d_{t+1}, c_t, B_t = E^T c_t, d_t */
            const float *dn = dy + (t + 1) * nk, *at = ah + t * nq, *bt = bh + t * nk;
            float *ct = cx + t * nq, *dt = dy + t * nk;
            for (int64_t j = 0; j < nk; ++j) dt[j] = 0.0f;
            for (int64_t i = 0; i < nq; ++i) {
                const float *row = sh + i * nk;
                const int64_t n = seen(i, nk, causal);
                float r = 0.0f;
                #pragma omp simd reduction(+ : r)
                for (int64_t j = 0; j < n; ++j) r += row[j] * dn[j];
                const float c = -r * at[i] * at[i];
                ct[i] = c;
                #pragma omp simd
                for (int64_t j = 0; j < n; ++j) dt[j] += row[j] * c;
            }
            #pragma omp simd
            for (int64_t j = 0; j < nk; ++j) dt[j] = -dt[j] * bt[j] * bt[j];
        }
        /* pass B: P = alpha_K E beta_K; dS = E (alpha_K beta_K dP + sum_t c_t beta_t + alpha_{t-1} d_t) */
        for (int64_t i = 0; i < nq; ++i) {
            float *row = sh + i * nk, *g = gh + i * nk;
            const int64_t n = seen(i, nk, causal);
            const float a = ak[i];
            #pragma omp simd
            for (int64_t j = 0; j < n; ++j) acc[j] = cx[i] * bh[j] + dy[j];  /* t = 1: alpha_0 = 1 */
            for (int64_t t = 1; t < kk; ++t) {
                const float c = cx[t * nq + i], ap = ah[(t - 1) * nq + i];
                const float *bt = bh + t * nk, *dt = dy + t * nk;
                #pragma omp simd
                for (int64_t j = 0; j < n; ++j) acc[j] += c * bt[j] + ap * dt[j];
            }
            #pragma omp simd
            for (int64_t j = 0; j < n; ++j) {
                const float f = a * bk[j], x = row[j];
                row[j] = x * f;
                g[j] = x * (g[j] * f + acc[j]);
            }
            for (int64_t j = n; j < nk; ++j) g[j] = 0.0f;
        }
    }
    free(tmp);
    return 0;
}
