/* Softmax with an additive bias: the N x N elementwise passes of
 * attnopt.functional.generalized.cpu, float32 (suffix f32) and float64 (f64).
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
#include <stdlib.h>
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
/* Row pass shared by both forwards: row <- row + br (br NULL: no bias), *m <- the row maximum;     \
 * returns 1 if the row holds a NaN. */                                                             \
static inline int row_bias_max_##SUF(T *row, const T *br, int64_t nk, T *m_out) {                   \
    T m = -(T)INFINITY;                                                                             \
    int nan = 0;                                                                                    \
    if (br) {                                                                                       \
        _Pragma("omp simd reduction(max : m) reduction(| : nan)")                                   \
        for (int64_t j = 0; j < nk; ++j) {                                                          \
            const T x = row[j] + br[j];                                                             \
            row[j] = x;                                                                             \
            m = x > m ? x : m;                                                                      \
            nan |= x != x;                                                                          \
        }                                                                                           \
    } else {                                                                                        \
        _Pragma("omp simd reduction(max : m) reduction(| : nan)")                                   \
        for (int64_t j = 0; j < nk; ++j) {                                                          \
            m = row[j] > m ? row[j] : m;                                                            \
            nan |= row[j] != row[j];                                                                \
        }                                                                                           \
    }                                                                                               \
    *m_out = m;                                                                                     \
    return nan;                                                                                     \
}                                                                                                   \
                                                                                                    \
int64_t bs_fwd_##SUF(T *s, const T *bias, int64_t sb, int64_t sh, int64_t si, T *mx, T *rinv,        \
                     int64_t g0, int64_t g1, int64_t heads, int64_t r0, int64_t rh, int64_t i0,      \
                     int64_t i1, int64_t nq, int64_t nk) {                                           \
    int64_t bad = 0;                                                                                 \
    for (int64_t g = g0; g < g1; ++g) {                                                              \
        const T *bh = bias ? bias + (g / heads) * sb + (g % heads) * sh : NULL;                      \
        for (int64_t i = i0; i < i1; ++i) {                                                          \
            T *row = s + ((g - g0) * rh + (i - r0)) * nk;                                            \
            const T *br = bh ? bh + i * si : NULL;                                                   \
            T m;                                                                                    \
            const int nan = row_bias_max_##SUF(row, br, nk, &m);                                    \
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


/* ---------------------------------------------------------------------------------------------
 * Whole-call kernels for small sizes: the forward (or the backward) of all heads [g0, g1) in one
 * call, the matrix products by the caller's BLAS (Fortran sgemm_ / dgemm_, passed as a function
 * pointer: this file links no BLAS). Per head, row-major:
 *   forward:  S = scale Q K^T; per row E = exp(S + b - m), r = 1 / sum E; O = r (E V)
 *             (E saved in "e" for the backward);
 *   backward: dO' = r dO, delta' = <dO'_i, O_i>, dP' = dO' V^T, dS = E (dP' - delta') (flushed
 *             below the smallest normal), gb += dS; dV = E^T dO', dQ = scale dS K,
 *             dK = scale dS^T Q.
 * q, k, v, dout: element strides (batch, head, row), unit column stride (dout: any column
 * stride, it is copied); the bias row of (g, i) is bias + (g / heads) sb + (g % heads) sh + i si
 * (a per-offset Toeplitz bias: si = -1 from offsets + nq - 1), gb likewise with gsb, gsh, gsi.
 * Integer BLAS arguments are int64 holding small values: read correctly by an LP64 BLAS (the low
 * half, little-endian) and an ILP64 one. MKL_Set_Num_Threads_Local(1), when given, keeps MKL
 * from starting threads inside the caller's threads; the CPU's flush-to-zero / denormals-are-zero
 * modes are on during the call (x86) and restored after.
 */
#if defined(__x86_64__) || defined(__i386__)
#include <xmmintrin.h>
#define FTZ_ON() const unsigned int csr_saved = _mm_getcsr(); _mm_setcsr(csr_saved | 0x8040u)
#define FTZ_OFF() _mm_setcsr(csr_saved)
#else
#define FTZ_ON() do { } while (0)
#define FTZ_OFF() do { } while (0)
#endif

typedef int (*bs_threads_t)(int);

#define FUSED_SOFTMAX(T, SUF, EXP, TINY, UINT, EXPMASK)                                                             \
typedef void (*gemm_##SUF##_t)(const char *, const char *, const int64_t *, const int64_t *,         \
                               const int64_t *, const T *, const T *, const int64_t *, const T *,    \
                               const int64_t *, const T *, T *, const int64_t *);                    \
                                                                                                     \
/* row-major C (m x n, ldc) = alpha op(A) op(B) through the column-major BLAS: C^T = op(B)^T op(A)^T */\
static inline void mm_##SUF(gemm_##SUF##_t gemm, int ta, int tb, int64_t m, int64_t n, int64_t kk,   \
                            T alpha, const T *a, int64_t lda, const T *b, int64_t ldb, T *c,         \
                            int64_t ldc) {                                                           \
    const T zero = 0;                                                                                \
    gemm(tb ? "T" : "N", ta ? "T" : "N", &n, &m, &kk, &alpha, b, &ldb, a, &lda, &zero, c, &ldc);     \
}                                                                                                    \
                                                                                                     \
/* Non-finite entries of the (rows x cols, row stride ld) block x: 1 if any, else 0. The exponent  \
 * bits are tested (an integer | reduction: a float sum's in-order horizontal step per row cost    \
 * ~30 us a call at B H = 8, N = 64), the whole block in one loop where its rows are adjacent. */  \
static inline int nonfinite_##SUF(const T *x, int64_t rows, int64_t cols, int64_t ld) {             \
    if (ld == cols) { cols *= rows; rows = 1; }                                                      \
    UINT bad = 0;                                                                                    \
    for (int64_t i = 0; i < rows; ++i) {                                                             \
        const T *r = x + i * ld;                                                                     \
        _Pragma("omp simd reduction(| : bad)")                                                       \
        for (int64_t j = 0; j < cols; ++j) {                                                         \
            UINT b;                                                                                  \
            memcpy(&b, r + j, sizeof b);                                                             \
            bad |= (UINT)((b & EXPMASK) == EXPMASK);                                                 \
        }                                                                                            \
    }                                                                                                \
    return bad != 0;                                                                                 \
}                                                                                                    \
                                                                                                     \
/* Returns the rows with NaN / +inf scores (bias) + 2^32 * (1 q | 2 k | 4 v non-finite). */          \
int64_t bsf_fwd_##SUF(void *gemm_p, void *threads_p, const T *q, int64_t qsb, int64_t qsh,           \
                      int64_t qsi, const T *k, int64_t ksb, int64_t ksh, int64_t ksi, const T *v,    \
                      int64_t vsb, int64_t vsh, int64_t vsi, const T *bias, int64_t sb, int64_t sh,  \
                      int64_t si, T *e, T *out, T *rinv, int64_t g0, int64_t g1, int64_t heads,      \
                      int64_t nq, int64_t nk, int64_t d, int64_t dv, T scale, int check) {           \
    gemm_##SUF##_t gemm = (gemm_##SUF##_t)gemm_p;                                                    \
    bs_threads_t set_threads = (bs_threads_t)threads_p;                                              \
    const int prev = set_threads ? set_threads(1) : 0;                                               \
    FTZ_ON();                                                                                        \
    int64_t bad = 0, flags = 0;                                                                      \
    for (int64_t g = g0; g < g1; ++g) {                                                              \
        const int64_t bi = g / heads, hi = g % heads;                                                \
        const T *qg = q + bi * qsb + hi * qsh, *kg = k + bi * ksb + hi * ksh;                        \
        const T *vg = v + bi * vsb + hi * vsh;                                                       \
        if (check) {                                                                                 \
            flags |= nonfinite_##SUF(qg, nq, d, qsi) | nonfinite_##SUF(kg, nk, d, ksi) << 1          \
                     | nonfinite_##SUF(vg, nk, dv, vsi) << 2;                                        \
            if (flags) break;                                                                        \
        }                                                                                            \
        T *eg = e + g * nq * nk, *og = out + g * nq * dv;                                            \
        mm_##SUF(gemm, 0, 1, nq, nk, d, scale, qg, qsi, kg, ksi, eg, nk);                            \
        const T *bh = bias ? bias + bi * sb + hi * sh : NULL;                                        \
        for (int64_t i = 0; i < nq; ++i) {                                                           \
            T *row = eg + i * nk;                                                                    \
            T m;                                                                                    \
            const int nan = row_bias_max_##SUF(row, bh ? bh + i * si : NULL, nk, &m);               \
            const int64_t r = g * nq + i;                                                            \
            if (nan || m == (T)INFINITY) {                                                           \
                ++bad;                                                                               \
                memset(row, 0, sizeof(T) * (size_t)nk);                                              \
                rinv[r] = 0;                                                                         \
                continue;                                                                            \
            }                                                                                        \
            if (m == -(T)INFINITY) { /* no admissible key */                                         \
                memset(row, 0, sizeof(T) * (size_t)nk);                                              \
                rinv[r] = 0;                                                                         \
                continue;                                                                            \
            }                                                                                        \
            T z = 0;                                                                                 \
            _Pragma("omp simd reduction(+ : z)")                                                     \
            for (int64_t j = 0; j < nk; ++j) {                                                       \
                const T x = EXP(row[j] - m);                                                         \
                row[j] = x;                                                                          \
                z += x;                                                                              \
            }                                                                                        \
            rinv[r] = 1 / z;                                                                         \
        }                                                                                            \
        mm_##SUF(gemm, 0, 0, nq, dv, nk, 1, eg, nk, vg, vsi, og, dv);                                \
        for (int64_t i = 0; i < nq; ++i) {                                                           \
            const T ri = rinv[g * nq + i];                                                           \
            T *o = og + i * dv;                                                                      \
            _Pragma("omp simd")                                                                      \
            for (int64_t j = 0; j < dv; ++j) o[j] *= ri;                                             \
        }                                                                                            \
    }                                                                                                \
    FTZ_OFF();                                                                                       \
    if (set_threads) set_threads(prev);                                                              \
    return bad + (flags << 32);                                                                      \
}                                                                                                    \
                                                                                                     \
/* work: 2 nq nk + nq (dv + 1) + nq + nk - 1 entries of this call's own scratch. With gtable     \
 * (T5's bucket table gradient, (num_buckets, H) strides gts, gth) each head's gradient by offset  \
 * is added into gtable[buckets[o], h] (gb unused); else into gb, laid out like the bias. */                                      \
void bsf_bwd_##SUF(void *gemm_p, void *threads_p, const T *q, int64_t qsb, int64_t qsh, int64_t qsi, \
                   const T *k, int64_t ksb, int64_t ksh, int64_t ksi, const T *v, int64_t vsb,       \
                   int64_t vsh, int64_t vsi, const T *dout, int64_t dsb, int64_t dsh, int64_t dsi,   \
                   int64_t dsj, const T *e, const T *out, const T *rinv, T *gb, int64_t gsb,         \
                   int64_t gsh, int64_t gsi, const int64_t *buckets, T *gtable, int64_t gts,         \
                   int64_t gth, T *dq, T *dk, T *dvv, T *work, int64_t g0, int64_t g1,               \
                   int64_t heads, int64_t nq, int64_t nk, int64_t d, int64_t dv, T scale) {          \
    gemm_##SUF##_t gemm = (gemm_##SUF##_t)gemm_p;                                                    \
    bs_threads_t set_threads = (bs_threads_t)threads_p;                                              \
    const int prev = set_threads ? set_threads(1) : 0;                                               \
    FTZ_ON();                                                                                        \
    T *dp = work, *dsc = work + nq * nk, *dob = work + 2 * nq * nk, *dl = dob + nq * dv;             \
    T *line = dl + nq; /* with a table: one head's per-offset sums (nq + nk - 1) */                  \
    const int64_t c = nq + nk - 1;                                                                   \
    for (int64_t g = g0; g < g1; ++g) {                                                              \
        const int64_t bi = g / heads, hi = g % heads;                                                \
        const T *qg = q + bi * qsb + hi * qsh, *kg = k + bi * ksb + hi * ksh;                        \
        const T *vg = v + bi * vsb + hi * vsh, *dg = dout + bi * dsb + hi * dsh;                     \
        const T *eg = e + g * nq * nk, *og = out + g * nq * dv;                                      \
        T *gh = gb ? gb + bi * gsb + hi * gsh : NULL;                                                \
        if (gtable) { /* T5: the head's sums by offset here, added into the table after its rows */  \
            memset(line, 0, sizeof(T) * (size_t)c);                                                  \
            gh = line + (nq - 1);                                                                    \
            gsi = -1;                                                                                \
        }                                                                                            \
        for (int64_t i = 0; i < nq; ++i) { /* dO' = r dO and delta' = <dO'_i, O_i> */               \
            const T ri = rinv[g * nq + i];                                                           \
            const T *di = dg + i * dsi, *oi = og + i * dv;                                           \
            T *bi_ = dob + i * dv, acc = 0;                                                          \
            if (dsj == 1) {                                                                          \
                _Pragma("omp simd reduction(+ : acc)")                                               \
                for (int64_t j = 0; j < dv; ++j) { bi_[j] = ri * di[j]; acc += bi_[j] * oi[j]; }     \
            } else {                                                                                 \
                _Pragma("omp simd reduction(+ : acc)")                                               \
                for (int64_t j = 0; j < dv; ++j) { bi_[j] = ri * di[j * dsj]; acc += bi_[j] * oi[j]; } \
            }                                                                                        \
            dl[i] = acc;                                                                             \
        }                                                                                            \
        mm_##SUF(gemm, 0, 1, nq, nk, dv, 1, dob, dv, vg, vsi, dp, nk);                               \
        for (int64_t i = 0; i < nq; ++i) {                                                           \
            const T *er = eg + i * nk;                                                               \
            const T *dr = dp + i * nk;                                                               \
            T *sr = dsc + i * nk;                                                                    \
            const T di = dl[i];                                                                      \
            if (gh) {                                                                                \
                T *gr = gh + i * gsi;                                                                \
                _Pragma("omp simd")                                                                  \
                for (int64_t j = 0; j < nk; ++j) {                                                   \
                    const T x = er[j] * (dr[j] - di);                                                \
                    const T y = (x >= TINY || x <= -TINY) ? x : 0;                                   \
                    sr[j] = y;                                                                       \
                    gr[j] += y;                                                                      \
                }                                                                                    \
            } else {                                                                                 \
                _Pragma("omp simd")                                                                  \
                for (int64_t j = 0; j < nk; ++j) {                                                   \
                    const T x = er[j] * (dr[j] - di);                                                \
                    sr[j] = (x >= TINY || x <= -TINY) ? x : 0;                                       \
                }                                                                                    \
            }                                                                                        \
        }                                                                                            \
        if (gtable) {                                                                                \
            T *gt = gtable + hi * gth;                                                               \
            for (int64_t o = 0; o < c; ++o) gt[buckets[o] * gts] += line[o];                         \
        }                                                                                            \
        mm_##SUF(gemm, 1, 0, nk, dv, nq, 1, eg, nk, dob, dv, dvv + g * nk * dv, dv);                 \
        mm_##SUF(gemm, 0, 0, nq, d, nk, scale, dsc, nk, kg, ksi, dq + g * nq * d, d);                \
        mm_##SUF(gemm, 1, 0, nk, d, nq, scale, dsc, nk, qg, qsi, dk + g * nk * d, d);                \
    }                                                                                                \
    FTZ_OFF();                                                                                       \
    if (set_threads) set_threads(prev);                                                              \
}

FUSED_SOFTMAX(float, f32, pexpf, FLT_MIN, uint32_t, 0x7f800000u)
FUSED_SOFTMAX(double, f64, pexpd, DBL_MIN, uint64_t, 0x7ff0000000000000u)

/* T5's per-offset values from its bucket table: offs[h, o] = table[buckets[o], h] (table (nb, H)
 * with strides ts, th). */
#define BUCKETS(T, SUF)                                                                              \
void bsf_gather_##SUF(const T *table, int64_t ts, int64_t th, const int64_t *buckets, int64_t heads,  \
                      int64_t c, T *offs) {                                                          \
    for (int64_t h = 0; h < heads; ++h)                                                              \
        for (int64_t o = 0; o < c; ++o) offs[h * c + o] = table[buckets[o] * ts + h * th];           \
}

BUCKETS(float, f32)
BUCKETS(double, f64)

/* T5's bias laid out: out[h, i, j] = table[buckets[j - i + nq - 1], h] (out (H, nq, nk)
 * contiguous), through one row of per-offset values per head. Returns -1 if out of memory. */
#define TOEPLITZ(T, SUF)                                                                             \
int bsf_toeplitz_##SUF(const T *table, int64_t ts, int64_t th, const int64_t *buckets,               \
                       int64_t heads, int64_t nq, int64_t nk, T *out) {                              \
    const int64_t c = nq + nk - 1;                                                                   \
    T *offs = malloc(sizeof(T) * (size_t)c);                                                         \
    if (!offs) return -1;                                                                            \
    for (int64_t h = 0; h < heads; ++h) {                                                            \
        for (int64_t o = 0; o < c; ++o) offs[o] = table[buckets[o] * ts + h * th];                  \
        for (int64_t i = 0; i < nq; ++i)                                                             \
            memcpy(out + (h * nq + i) * nk, offs + (nq - 1 - i), sizeof(T) * (size_t)nk);            \
    }                                                                                                \
    free(offs);                                                                                      \
    return 0;                                                                                        \
}

TOEPLITZ(float, f32)
TOEPLITZ(double, f64)
