/* attnopt_pexpf: exp(x) for x <= 0 in float32, shared by the native kernels (#include "pexp.h").
 *
 * A vectorizable Cephes-style polynomial (max error ~2 ulp on [-87, 0]), exactly 0 below -87
 * (and for -inf, NaN); positive x is treated as 0 (callers pass x - max <= 0). No libm call and
 * no branch: the input is clamped by selects of values at hand and a dead lane is zeroed by a bit
 * mask, so `#pragma omp simd` loops around it vectorize (a `live ? p * scale : 0` select would
 * make GCC keep the multiply conditional, since it may trap, and leave the loop scalar, ~5x
 * slower).
 */
#ifndef ATTNOPT_PEXP_H
#define ATTNOPT_PEXP_H

#include <stdint.h>
#include <string.h>

static inline float attnopt_pexpf(float x) {
    const int32_t live = x > -87.0f;
    x = x < 0.0f ? x : 0.0f;
    x = x > -87.0f ? x : -87.0f;
    /* n = round(x log2 e) by the 1.5 * 2^23 trick (vectorizes where floorf does not); the low
     * bits of t then hold n, which becomes the exponent field of 2^n */
    const float t = __builtin_fmaf(x, 1.44269504088896341f, 12582912.0f);
    const float n = t - 12582912.0f;
    float r = __builtin_fmaf(n, -0.693359375f, x);
    r = __builtin_fmaf(n, 2.12194440e-4f, r);
    float p = 1.9875691500e-4f;
    p = __builtin_fmaf(p, r, 1.3981999507e-3f);
    p = __builtin_fmaf(p, r, 8.3334519073e-3f);
    p = __builtin_fmaf(p, r, 4.1665795894e-2f);
    p = __builtin_fmaf(p, r, 1.6666665459e-1f);
    p = __builtin_fmaf(p, r, 5.0000001201e-1f);
    p = __builtin_fmaf(p, r * r, r) + 1.0f;
    int32_t ti;
    memcpy(&ti, &t, sizeof ti);
    const int32_t bits = (ti - 0x4B400000 + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    float v = p * scale;
    int32_t vb;
    memcpy(&vb, &v, sizeof vb);
    vb &= -live;
    memcpy(&v, &vb, sizeof v);
    return v;
}

#endif
