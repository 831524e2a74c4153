/* The L^p key magnitude of kernel attention (implicit-kernel-attention eq. 11), 1 <= p <= 2,
 * one pass per row: a = s*T^{2/p}/2 with T = sum_i |k_i|^p (clamped at cap), and with grad
 * u_i = |k_i|^{p-1} sign(k_i) (0 at k_i = 0) and c = s*T^{2/p-1} (0 where the clamp is active).
 * Same function as attnopt.functional._kernel_fused._magnitude's PyTorch path, to rounding.
 * mode: 0 general p (pow), 1 p = 1, 2 p = 1.5 (sqrt), 3 p = 2.
 *
 * lp_key_weights: the key weights of the fused Fourier-feature node in the same pass, per head of
 * n keys: a_j = (magnitude above, mode >= 0; none for mode -1) + mask_j (mask may be NULL),
 * m_j = exp(a_j - max_l a_l) (shift 0 where the max is -inf: a fully masked head gets zeros),
 * kw_j = m_j and vm_j = [v_j m_j, m_j] (rows of dv + 1). float32's exp: pexp.h. */
#include <math.h>
#include <stdint.h>

#include "pexp.h"

#define LP_BODY(T, SQRT, POW, FABS, COPYSIGN)                                              \
    for (int64_t r = 0; r < rows; ++r) {                                                   \
        const T *x = k + r * d;                                                            \
        T *ur = u ? u + r * d : 0;                                                         \
        T tot = 0;                                                                         \
        if (mode == 3) {                                                                   \
            _Pragma("omp simd reduction(+:tot)")                                           \
            for (int64_t i = 0; i < d; ++i) tot += x[i] * x[i];                            \
            if (ur) for (int64_t i = 0; i < d; ++i) ur[i] = x[i];                          \
        } else if (mode == 1) {                                                            \
            _Pragma("omp simd reduction(+:tot)")                                           \
            for (int64_t i = 0; i < d; ++i) tot += FABS(x[i]);                             \
            if (ur) {                                                                      \
                _Pragma("omp simd")                                                        \
                for (int64_t i = 0; i < d; ++i)                                            \
                    ur[i] = x[i] > 0 ? (T)1 : (x[i] < 0 ? (T)-1 : (T)0);                   \
            }                                                                              \
        } else if (mode == 2) {                                                            \
            if (ur) {                                                                      \
                _Pragma("omp simd reduction(+:tot)")                                       \
                for (int64_t i = 0; i < d; ++i) {                                          \
                    T ax = FABS(x[i]), pw = SQRT(ax);                                      \
                    tot += ax * pw;                                                        \
                    ur[i] = COPYSIGN(pw, x[i]);                                            \
                }                                                                          \
            } else {                                                                       \
                _Pragma("omp simd reduction(+:tot)")                                       \
                for (int64_t i = 0; i < d; ++i) { T ax = FABS(x[i]); tot += ax * SQRT(ax); } \
            }                                                                              \
        } else {                                                                           \
            for (int64_t i = 0; i < d; ++i) {                                              \
                T ax = FABS(x[i]), pw = POW(ax, (T)(p - 1.0));                             \
                tot += ax * pw;                                                            \
                if (ur) ur[i] = COPYSIGN(pw, x[i]);                                        \
            }                                                                              \
        }                                                                                  \
        T tp = mode == 3 ? (T)1 : POW(tot, (T)(2.0 / p - 1.0));                            \
        T ar = tot * tp * (T)(0.5 * scale);                                                \
        int live = ar < (T)cap;                                                            \
        a[r] = live ? ar : (T)cap;                                                         \
        if (c) c[r] = live ? tp * (T)scale : (T)0;                                         \
    }

void lp_magnitude_f32(const float *k, int64_t rows, int64_t d, int mode, double p, double scale,
                      double cap, float *a, float *u, float *c) {
    LP_BODY(float, sqrtf, powf, fabsf, copysignf)
}

void lp_magnitude_f64(const double *k, int64_t rows, int64_t d, int mode, double p, double scale,
                      double cap, double *a, double *u, double *c) {
    LP_BODY(double, sqrt, pow, fabs, copysign)
}

#define KW_BODY(T, MAG, EXP)                                                               \
    for (int64_t h = 0; h < heads; ++h) {                                                  \
        T *a = kw + h * n;                                                                 \
        if (mode >= 0) {                                                                   \
            MAG(k + h * n * d, n, d, mode, p, scale, cap, a, u ? u + h * n * d : 0, c ? c + h * n : 0); \
        } else {                                                                           \
            for (int64_t j = 0; j < n; ++j) a[j] = 0;                                      \
        }                                                                                  \
        if (mask) {                                                                        \
            const T *mk = mask + h * n;                                                    \
            for (int64_t j = 0; j < n; ++j) a[j] += mk[j];                                 \
        }                                                                                  \
        T mx = -INFINITY;                                                                  \
        for (int64_t j = 0; j < n; ++j) mx = a[j] > mx ? a[j] : mx;                        \
        const T shift = isfinite(mx) ? mx : (T)0;                                          \
        for (int64_t j = 0; j < n; ++j) {                                                  \
            const T m = EXP(a[j] - shift);                                                 \
            const T *vr = v + (h * n + j) * dv;                                            \
            T *o = vm + (h * n + j) * (dv + 1);                                            \
            a[j] = m;                                                                      \
            _Pragma("omp simd")                                                            \
            for (int64_t i = 0; i < dv; ++i) o[i] = vr[i] * m;                             \
            o[dv] = m;                                                                     \
        }                                                                                  \
    }

void lp_key_weights_f32(const float *k, const float *v, const float *mask, int64_t heads, int64_t n,
                        int64_t d, int64_t dv, int mode, double p, double scale, double cap, float *vm,
                        float *kw, float *u, float *c) {
    KW_BODY(float, lp_magnitude_f32, attnopt_pexpf)
}

void lp_key_weights_f64(const double *k, const double *v, const double *mask, int64_t heads, int64_t n,
                        int64_t d, int64_t dv, int mode, double p, double scale, double cap, double *vm,
                        double *kw, double *u, double *c) {
    KW_BODY(double, lp_magnitude_f64, exp)
}
