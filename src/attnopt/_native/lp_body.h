/* The L^p key magnitude of kernel attention (implicit-kernel-attention eq. 11), 1 <= p <= 2,
 * shared by lp_magnitude.c and fourier_features.c (#include "lp_body.h"): lp_rows_f32 / lp_rows_f64
 * give, per row of k (rows, d), a = s*T^{2/p}/2 with T = sum_i |k_i|^p (clamped at cap), and
 * where u / c are not NULL u_i = |k_i|^{p-1} sign(k_i) (0 at k_i = 0) and c = s*T^{2/p-1} (0 where
 * the clamp is active). mode: 0 general p (pow), 1 p = 1, 2 p = 1.5 (sqrt; float32 with AVX-512:
 * rsqrt14 and a Newton step), 3 p = 2. T^{2/p-1} is taken after the row sums, over the rows:
 * p = 1 (T), p = 1.5 (a cube root: Newton in float32, libm's cbrt in float64), p = 2 (1), without
 * a libm pow per row. */
#ifndef ATTNOPT_LP_BODY_H
#define ATTNOPT_LP_BODY_H

#include <math.h>
#include <stdint.h>
#include <string.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "psum.h"

static inline float lp_cbrtf(float x) {
    /* x >= 0: exponent / 3 by the integer trick (~4 %), three Newton steps (~1 ulp); 0, NaN kept;
     * +inf -> NaN, which the callers clamp like inf (a = cap, c = 0) */
    int32_t i;
    memcpy(&i, &x, sizeof i);
    i = i / 3 + 0x2a5137a0;
    float y;
    memcpy(&y, &i, sizeof y);
    y = (2.0f * y + x / (y * y)) * (1.0f / 3.0f);
    y = (2.0f * y + x / (y * y)) * (1.0f / 3.0f);
    y = (2.0f * y + x / (y * y)) * (1.0f / 3.0f);
    return x > 0.0f ? y : x;
}

/* p = 1.5 on one row of d: returns sum |x|^1.5, u = sign(x) |x|^0.5 where u is not NULL. float32
 * with AVX-512: |x|^0.5 = |x| y with y = rsqrt14(|x|) and one Newton step (~1 ulp; vsqrtps is
 * about 6x slower, and this loop was bound by it), 0 at x = 0. */
#define LP15_C(T, SUF, SQRT, FABS, COPYSIGN)                                             \
static inline T lp15_c_##SUF(const T *x, int64_t d, T *ur) {                             \
    T tot;                                                                                   \
    if (ur) {                                                                                \
        PSUM(T, d, tot, const T ax = FABS(x[i]); const T pw = SQRT(ax);                   \
                ur[i] = COPYSIGN(pw, x[i]); term_ = ax * pw);                                \
    } else {                                                                                 \
        PSUM(T, d, tot, const T ax = FABS(x[i]); term_ = ax * SQRT(ax));                  \
    }                                                                                        \
    return tot;                                                                              \
}
LP15_C(float, f32, sqrtf, fabsf, copysignf)
LP15_C(double, f64, sqrt, fabs, copysign)

static inline double lp15_f64(const double *x, int64_t d, double *ur) { return lp15_c_f64(x, d, ur); }

#if defined(__AVX512F__)
static inline float lp15_f32(const float *x, int64_t d, float *ur) {
    const __m512 half = _mm512_set1_ps(0.5f), three_halves = _mm512_set1_ps(1.5f);
    const __m512i sign = _mm512_set1_epi32((int)0x80000000u);
    __m512 acc = _mm512_setzero_ps();
    for (int64_t i = 0; i < d; i += 16) {
        const __mmask16 live = d - i >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (d - i)) - 1u);
        const __m512 xv = _mm512_maskz_loadu_ps(live, x + i);
        const __m512 ax = _mm512_abs_ps(xv);
        __m512 y = _mm512_rsqrt14_ps(ax);
        /* y (1.5 - 0.5 ax y^2) */
        y = _mm512_mul_ps(y, _mm512_fnmadd_ps(_mm512_mul_ps(half, ax), _mm512_mul_ps(y, y), three_halves));
        const __mmask16 pos = _mm512_cmp_ps_mask(ax, _mm512_setzero_ps(), _CMP_GT_OQ) & live;
        const __m512 pw = _mm512_maskz_mul_ps(pos, ax, y); /* |x|^0.5, 0 at 0 (and off the row) */
        acc = _mm512_fmadd_ps(ax, pw, acc);
        if (ur) {
            const __m512i sx = _mm512_and_si512(_mm512_castps_si512(xv), sign);
            const __m512i su = _mm512_or_si512(_mm512_castps_si512(pw), sx);
            _mm512_mask_storeu_ps(ur + i, live, _mm512_castsi512_ps(su));
        }
    }
    return _mm512_reduce_add_ps(acc);
}
#else
static inline float lp15_f32(const float *x, int64_t d, float *ur) { return lp15_c_f32(x, d, ur); }
#endif

#define LP_ROWS(T, ROW15, POW, CBRT, FABS, COPYSIGN)                                     \
    /* pass 1: T_r = sum |k|^p (and u) per row into a */                                     \
    {                                                                                        \
        for (int64_t r = 0; r < rows; ++r) {                                                 \
            const T *x = k + r * d;                                                          \
            T *ur = u ? u + r * d : 0;                                                       \
            T tot = 0;                                                                       \
            if (mode == 3) {                                                                 \
                PSUM(T, d, tot, term_ = x[i] * x[i]);                                     \
                if (ur) memcpy(ur, x, (size_t)d * sizeof(T));                                \
            } else if (mode == 1) {                                                          \
                PSUM(T, d, tot, term_ = FABS(x[i]));                                      \
                if (ur) {                                                                    \
                    _Pragma("omp simd")                                                      \
                    for (int64_t i = 0; i < d; ++i)                                          \
                        ur[i] = x[i] > 0 ? (T)1 : (x[i] < 0 ? (T)-1 : (T)0);                 \
                }                                                                            \
            } else if (mode == 2) {                                                          \
                tot = ROW15(x, d, ur);                                                       \
            } else {                                                                         \
                const T pm1 = (T)(p - 1.0);                                                  \
                for (int64_t i = 0; i < d; ++i) {                                            \
                    const T ax = FABS(x[i]), pw = POW(ax, pm1);                              \
                    tot += ax * pw;                                                          \
                    if (ur) ur[i] = COPYSIGN(pw, x[i]);                                      \
                }                                                                            \
            }                                                                                \
            a[r] = tot;                                                                      \
        }                                                                                    \
    }                                                                                        \
    /* pass 2, over the rows: tp = T^{2/p-1}, a = s T tp / 2 clamped at cap, c = s tp */     \
    {                                                                                        \
        const T hs = (T)(0.5 * scale), ts = (T)scale, tcap = (T)cap, ex = (T)(2.0 / p - 1.0); \
        if (mode == 2) {                                                                     \
            _Pragma("omp simd")                                                              \
            for (int64_t r = 0; r < rows; ++r) {                                             \
                const T tot = a[r], tp = CBRT(tot), ar = tot * tp * hs;                      \
                const int live = ar < tcap;                                                  \
                a[r] = live ? ar : tcap;                                                     \
                if (c) c[r] = live ? tp * ts : (T)0;                                         \
            }                                                                                \
        } else {                                                                             \
            for (int64_t r = 0; r < rows; ++r) {                                             \
                const T tot = a[r];                                                          \
                const T tp = mode == 3 ? (T)1 : (mode == 1 ? tot : POW(tot, ex));            \
                const T ar = tot * tp * hs;                                                  \
                const int live = ar < tcap;                                                  \
                a[r] = live ? ar : tcap;                                                     \
                if (c) c[r] = live ? tp * ts : (T)0;                                         \
            }                                                                                \
        }                                                                                    \
    }

static inline void lp_rows_f32(const float *k, int64_t rows, int64_t d, int mode, double p, double scale, double cap,
                       float *a, float *u, float *c) {
    LP_ROWS(float, lp15_f32, powf, lp_cbrtf, fabsf, copysignf)
}

static inline void lp_rows_f64(const double *k, int64_t rows, int64_t d, int mode, double p, double scale, double cap,
                       double *a, double *u, double *c) {
    LP_ROWS(double, lp15_f64, pow, cbrt, fabs, copysign)
}

#endif
