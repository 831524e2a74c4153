/* LP_BODY: the L^p key magnitude loop of kernel attention (implicit-kernel-attention eq. 11),
 * 1 <= p <= 2, shared by lp_magnitude.c and fourier_features.c (#include "lp_body.h"): per row of
 * k (rows, d), a = s*T^{2/p}/2 with T = sum_i |k_i|^p (clamped at cap), and where u / c are not
 * NULL u_i = |k_i|^{p-1} sign(k_i) (0 at k_i = 0) and c = s*T^{2/p-1} (0 where the clamp is
 * active). mode: 0 general p (pow), 1 p = 1, 2 p = 1.5 (sqrt), 3 p = 2. Expects k, rows, d,
 * mode, p, scale, cap, a, u, c in scope. */
#ifndef ATTNOPT_LP_BODY_H
#define ATTNOPT_LP_BODY_H

#include <math.h>
#include <stdint.h>

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

#endif
