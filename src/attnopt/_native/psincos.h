/* attnopt_psincosf: sin and cos of a float32 x in one call, shared by the native kernels
 * (#include "psincos.h"; Expsin's periodic.c, the Fourier features of fourier_features.c).
 *
 * Vectorizable (no libm call): n = round(x 2/pi) by the 1.5 * 2^23 trick (its low bits give the
 * quadrant), Cody-Waite reduction r = x - n pi/2 with Cephes' three-part constant (each product
 * exact for |n| < 2^13), and Cephes' sin/cos polynomials on [-pi/4, pi/4]: ~1e-7 absolute for
 * |x| <= 8192. Beyond that the reduction loses bits: callers clamp or take libm there.
 */
#ifndef ATTNOPT_PSINCOS_H
#define ATTNOPT_PSINCOS_H

#include <stdint.h>
#include <string.h>

static inline void attnopt_psincosf(float x, float *sn, float *cs) {
    const float t = __builtin_fmaf(x, 0.636619772367581343f, 12582912.0f); /* round(x 2/pi) */
    const float n = t - 12582912.0f;
    float r = __builtin_fmaf(n, -1.5703125f, x);
    r = __builtin_fmaf(n, -4.837512969970703125e-4f, r);
    r = __builtin_fmaf(n, -7.54978995489188216e-8f, r);
    int32_t ti;
    memcpy(&ti, &t, sizeof ti);
    const int32_t quad = ti & 3; /* = n mod 4 (the constant's own low bits are 0) */
    const float z = r * r;
    const float sp = __builtin_fmaf(__builtin_fmaf(__builtin_fmaf(-1.9515295891e-4f, z, 8.3321608736e-3f), z,
                                                   -1.6666654611e-1f) * z, r, r);
    const float cp = __builtin_fmaf(__builtin_fmaf(__builtin_fmaf(2.443315711809948e-5f, z, -1.388731625493765e-3f),
                                                   z, 4.166664568298827e-2f) * z, z, __builtin_fmaf(-0.5f, z, 1.0f));
    const float s0 = (quad & 1) ? cp : sp, c0 = (quad & 1) ? sp : cp;
    *sn = (quad & 2) ? -s0 : s0;
    *cs = ((quad + 1) & 2) ? -c0 : c0;
}

#endif
