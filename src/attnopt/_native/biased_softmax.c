/* Softmax with an additive bias: the N x N elementwise passes of
 * attnopt.functional._generalized_native, float32 (suffix f32) and float64 (f64).
 *
 * Layout. A call works on the heads [g0, g1) of one chunk and on the query rows [i0, i1) of
 * each of them: "s" (and "dp") hold the chunk's scores row-major, rh rows per head starting at
 * row r0 (all rows: r0 = 0, rh = nq; a row block of one head when a head's scores exceed the
 * cache), head g0 first. Row (g, i) has its bias row at bias + (g / heads) * sb + (g % heads) * sh + i * si
 * (a stride 0 broadcasts; the key dimension is contiguous) and its O(1) state (row maximum m,
 * inverse row sum r, delta) at index g * nq + i. Rows are independent, so
 * attnopt._native.parallel_rows may split [0, nq) over threads; the bias gradient "gb" is
 * indexed like the bias, so threads write disjoint rows of it unless si = 0.
 *
 * Forward: s <- E = exp(s + bias - m), m the row maximum; r = 1 / sum_j E (the caller scales
 * E V by r: P = r E is never formed). A row with no admissible key (m = -inf: bias -inf
 * everywhere) gets E = 0, m = -inf, r = 0. Returns the number of rows with a NaN or +inf
 * (from the bias: the caller checks q and k), which are left as they are.
 * Backward: E again (bitwise as in the forward, from S, or as given), dS = E (dP' - delta')
 * with the caller's dP' = r dP and delta' = r delta (so dS = P (dP - delta)), flushed to 0
 * below the smallest normal number; s <- E, dp <- dS, gb += dS.
 *
 * float32's exponential is a vectorizable Cephes-style polynomial (~2 ulp on [-87, 0], exactly
 * 0 below -87, as in dnas.c); float64's is libm's exp.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "pexp.h"

#define pexpf attnopt_pexpf


/* exp of x <= 0, results below the smallest normal number flushed to 0 (float32's pexpf has
 * none: its smallest nonzero value is e^-87) */
static inline double pexpd(double x) {
    const double e = exp(x < 0.0 ? x : 0.0);
    return e >= DBL_MIN ? e : 0.0;
}

/* Exponential of x[r0, r1) in place (for tests against torch.exp). */
void bs_exp_f32(float *x, int64_t r0, int64_t r1) {
    #pragma omp simd
    for (int64_t j = r0; j < r1; ++j) x[j] = pexpf(x[j]);
}

#define BIASED_SOFTMAX(T, SUF, EXP, TINY)                                                              \
int64_t bs_fwd_##SUF(T *s, const T *bias, int64_t sb, int64_t sh, int64_t si, T *mx, T *rinv,        \
                     int64_t g0, int64_t g1, int64_t heads, int64_t r0, int64_t rh, int64_t i0,      \
                     int64_t i1, int64_t nq, int64_t nk) {                                           \
    int64_t bad = 0;                                                                                 \
    for (int64_t g = g0; g < g1; ++g) {                                                              \
        const T *bh = bias ? bias + (g / heads) * sb + (g % heads) * sh : NULL;                      \
        for (int64_t i = i0; i < i1; ++i) {                                                          \
            T *row = s + ((g - g0) * rh + (i - r0)) * nk;                                            \
            const T *br = bh ? bh + i * si : NULL;                                                   \
            T m = -(T)INFINITY;                                                                      \
            int nan = 0;                                                                             \
            if (br) {                                                                                \
                _Pragma("omp simd reduction(max : m) reduction(| : nan)")                            \
                for (int64_t j = 0; j < nk; ++j) {                                                   \
                    const T x = row[j] + br[j];                                                      \
                    row[j] = x;                                                                      \
                    m = x > m ? x : m;                                                               \
                    nan |= x != x;                                                                   \
                }                                                                                    \
            } else {                                                                                 \
                _Pragma("omp simd reduction(max : m) reduction(| : nan)")                            \
                for (int64_t j = 0; j < nk; ++j) {                                                   \
                    m = row[j] > m ? row[j] : m;                                                     \
                    nan |= row[j] != row[j];                                                         \
                }                                                                                    \
            }                                                                                        \
            const int64_t r = g * nq + i;                                                            \
            if (nan || m == (T)INFINITY) {                                                           \
                ++bad;                                                                               \
                mx[r] = m;                                                                           \
                rinv[r] = (T)NAN;                                                                    \
                continue;                                                                            \
            }                                                                                        \
            if (m == -(T)INFINITY) { /* no admissible key */                                         \
                memset(row, 0, sizeof(T) * (size_t)nk);                                              \
                mx[r] = m;                                                                           \
                rinv[r] = 0;                                                                         \
                continue;                                                                            \
            }                                                                                        \
            T z = 0;                                                                                 \
            _Pragma("omp simd reduction(+ : z)")                                                     \
            for (int64_t j = 0; j < nk; ++j) {                                                       \
                const T e = EXP(row[j] - m);                                                         \
                row[j] = e;                                                                          \
                z += e;                                                                              \
            }                                                                                        \
            mx[r] = m;                                                                               \
            rinv[r] = 1 / z; /* z >= 1: the maximum contributes e^0 */                               \
        }                                                                                            \
    }                                                                                                \
    return bad;                                                                                      \
}                                                                                                    \
                                                                                                     \
void bs_bwd_##SUF(T *s, T *dp, int recompute, const T *bias, int64_t sb, int64_t sh, int64_t si,     \
                  const T *mx, const T *rinv, const T *delta, T *gb, int64_t gsb, int64_t gsh,       \
                  int64_t gsi, int64_t g0, int64_t g1, int64_t heads, int64_t r0, int64_t rh,        \
                  int64_t i0, int64_t i1, int64_t nq, int64_t nk) {                                  \
    for (int64_t g = g0; g < g1; ++g) {                                                              \
        const T *bh = bias ? bias + (g / heads) * sb + (g % heads) * sh : NULL;                      \
        T *gh = gb ? gb + (g / heads) * gsb + (g % heads) * gsh : NULL;                              \
        for (int64_t i = i0; i < i1; ++i) {                                                          \
            const int64_t at = ((g - g0) * rh + (i - r0)) * nk;                                      \
            T *row = s + at, *d = dp + at;                                                           \
            const int64_t r = g * nq + i;                                                            \
            const T m = mx[r], dl = delta[r];                                                        \
            T *gr = gh ? gh + i * gsi : NULL;                                                        \
            if (recompute && bh && m != -(T)INFINITY) { /* the common case in one loop */            \
                const T *br = bh + i * si;                                                           \
                if (gr) {                                                                            \
                    _Pragma("omp simd")                                                              \
                    for (int64_t j = 0; j < nk; ++j) {                                               \
                        const T e = EXP((row[j] + br[j]) - m), x = e * (d[j] - dl);                  \
                        const T y = (x >= TINY || x <= -TINY) ? x : 0;                               \
                        row[j] = e;                                                                  \
                        d[j] = y;                                                                    \
                        gr[j] += y;                                                                  \
                    }                                                                                \
                } else {                                                                             \
                    _Pragma("omp simd")                                                              \
                    for (int64_t j = 0; j < nk; ++j) {                                               \
                        const T e = EXP((row[j] + br[j]) - m), x = e * (d[j] - dl);                  \
                        row[j] = e;                                                                  \
                        d[j] = (x >= TINY || x <= -TINY) ? x : 0;                                    \
                    }                                                                                \
                }                                                                                    \
                continue;                                                                            \
            }                                                                                        \
            if (recompute) {                                                                         \
                if (m == -(T)INFINITY) {                                                             \
                    memset(row, 0, sizeof(T) * (size_t)nk);                                          \
                } else if (bh) {                                                                     \
                    const T *br = bh + i * si;                                                       \
                    _Pragma("omp simd")                                                              \
                    for (int64_t j = 0; j < nk; ++j) {                                               \
                        row[j] = EXP((row[j] + br[j]) - m);                                          \
                    }                                                                                \
                } else {                                                                             \
                    _Pragma("omp simd")                                                              \
                    for (int64_t j = 0; j < nk; ++j) {                                               \
                        row[j] = EXP(row[j] - m);                                                    \
                    }                                                                                \
                }                                                                                    \
            }                                                                                        \
            if (gr) {                                                                                \
                _Pragma("omp simd")                                                                  \
                for (int64_t j = 0; j < nk; ++j) {                                                   \
                    const T x = row[j] * (d[j] - dl);                                                \
                    const T y = (x >= TINY || x <= -TINY) ? x : 0;                                   \
                    d[j] = y;                                                                        \
                    gr[j] += y;                                                                      \
                }                                                                                    \
            } else {                                                                                 \
                _Pragma("omp simd")                                                                  \
                for (int64_t j = 0; j < nk; ++j) {                                                   \
                    const T x = row[j] * (d[j] - dl);                                                \
                    d[j] = (x >= TINY || x <= -TINY) ? x : 0;                                        \
                }                                                                                    \
            }                                                                                        \
        }                                                                                            \
    }                                                                                                \
}

BIASED_SOFTMAX(float, f32, pexpf, FLT_MIN)
BIASED_SOFTMAX(double, f64, pexpd, DBL_MIN)
