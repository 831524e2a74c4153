/* The elementwise passes of kernel attention with Fourier features (implicit-kernel-attention
 * eq. 9, 13, 15-16), one C call each where the PyTorch form takes 3-6 ops; the matmuls stay in
 * PyTorch. Same functions as attnopt.functional._kernel_fused's PyTorch path, to rounding.
 *
 * ff_features: P (rows, S*R) -> cos P, sin P (kept for the backward) and
 *              phi = [sum_s cos P_s, sum_s sin P_s] (rows, 2R)
 * ff_dp:       dP_s = cos P_s * dphi_sin - sin P_s * dphi_cos (rows, S*R)
 * ff_finish:   inv = 1/den (0 where den <= 0), out = num[:, :e-1] * inv
 * ff_gn:       g = dout * inv, gn = [g, -<g, out>]
 * ff_key_weights: per head of n keys, a_j = s*||k_j||_p^2/2 (lp_body.h; mode -1: none) + mask_j
 *              (mask may be NULL), m_j = exp(a_j - max_l a_l) (shift 0 where the max is -inf: a
 *              fully masked head gets zeros), kw_j = m_j, vm_j = [v_j m_j, m_j] (rows of dv + 1),
 *              and the magnitude's gradient factors u, c where not NULL
 * ff_key_grads: from T = W^T gn (rows, dv+1): dv = m * T[:dv], dm = <v, T[:dv]> + T[dv],
 *              dk = u * (dm * m * c) (the magnitude's share of the key gradient)
 * ff_prepare / ff_tail: ff_features + ff_key_weights / ff_key_grads + ff_dp in one call
 *
 * float32's sin/cos: Cody-Waite reduction by pi/2 in three parts and Cephes' polynomials on
 * [-pi/4, pi/4] (~1e-7 relative, vectorized); |x| > 8192 (and NaN) go to libm. float64: libm.
 * float32's exp: pexp.h (~2 ulp). */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "lp_body.h"
#include "pexp.h"

#define FF_BIG 8192.0f

static inline void ff_sincosf(float x, float *so, float *co) {
    /* j = round(x 2/pi) by the 1.5 * 2^23 trick; its low bits give the quadrant */
    const float t = __builtin_fmaf(x, 0.636619772367581343f, 12582912.0f);
    const float j = t - 12582912.0f;
    int32_t ti;
    memcpy(&ti, &t, sizeof ti);
    const int32_t q = ti - 0x4B400000;
    float r = __builtin_fmaf(j, -1.5707963705062866f, x);
    r = __builtin_fmaf(j, 4.371138828673793e-08f, r);
    r = __builtin_fmaf(j, 1.7151245100058819e-15f, r);
    const float z = r * r;
    float ps = -1.9515295891e-4f;
    ps = __builtin_fmaf(ps, z, 8.3321608736e-3f);
    ps = __builtin_fmaf(ps, z, -1.6666654611e-1f);
    const float s = __builtin_fmaf(ps * z, r, r);
    float pc = 2.443315711809948e-5f;
    pc = __builtin_fmaf(pc, z, -1.388731625493765e-3f);
    pc = __builtin_fmaf(pc, z, 4.166664568298827e-2f);
    const float c = __builtin_fmaf(pc * z, z, __builtin_fmaf(-0.5f, z, 1.0f));
    const int swap = q & 1;
    const float sv = swap ? c : s, cv = swap ? s : c;
    *so = (q & 2) ? -sv : sv;
    *co = ((q + 1) & 2) ? -cv : cv;
}

void ff_features_f32(const float *P, int64_t rows, int64_t r, int64_t nsets, float *phi, float *cs,
                     float *sn) {
    const int64_t sr = r * nsets, n = rows * sr;
    int big = 0;
#pragma omp simd reduction(| : big)
    for (int64_t i = 0; i < n; ++i) {
        float s, c;
        ff_sincosf(P[i], &s, &c);
        cs[i] = c;
        sn[i] = s;
        big |= !(__builtin_fabsf(P[i]) <= FF_BIG);
    }
    if (big) {
        for (int64_t i = 0; i < n; ++i) {
            if (!(__builtin_fabsf(P[i]) <= FF_BIG)) {
                cs[i] = cosf(P[i]);
                sn[i] = sinf(P[i]);
            }
        }
    }
    for (int64_t row = 0; row < rows; ++row) {
        const float *c = cs + row * sr, *s = sn + row * sr;
        float *f = phi + row * 2 * r;
#pragma omp simd
        for (int64_t i = 0; i < r; ++i) {
            f[i] = c[i];
            f[r + i] = s[i];
        }
        for (int64_t k = 1; k < nsets; ++k) {
#pragma omp simd
            for (int64_t i = 0; i < r; ++i) {
                f[i] += c[k * r + i];
                f[r + i] += s[k * r + i];
            }
        }
    }
}

void ff_features_f64(const double *P, int64_t rows, int64_t r, int64_t nsets, double *phi, double *cs,
                     double *sn) {
    const int64_t sr = r * nsets, n = rows * sr;
    for (int64_t i = 0; i < n; ++i) {
        cs[i] = cos(P[i]);
        sn[i] = sin(P[i]);
    }
    for (int64_t row = 0; row < rows; ++row) {
        const double *c = cs + row * sr, *s = sn + row * sr;
        double *f = phi + row * 2 * r;
        for (int64_t i = 0; i < r; ++i) {
            f[i] = c[i];
            f[r + i] = s[i];
        }
        for (int64_t k = 1; k < nsets; ++k) {
            for (int64_t i = 0; i < r; ++i) {
                f[i] += c[k * r + i];
                f[r + i] += s[k * r + i];
            }
        }
    }
}

#define FF_DP(T)                                                                             \
    const int64_t sr = r * nsets;                                                            \
    for (int64_t row = 0; row < rows; ++row) {                                               \
        const T *dc = dphi + row * 2 * r, *ds = dc + r;                                      \
        const T *c = cs + row * sr, *s = sn + row * sr;                                      \
        T *o = dp + row * sr;                                                                \
        for (int64_t k = 0; k < nsets; ++k) {                                                \
            _Pragma("omp simd")                                                              \
            for (int64_t i = 0; i < r; ++i) o[k * r + i] = c[k * r + i] * ds[i] - s[k * r + i] * dc[i]; \
        }                                                                                    \
    }

void ff_dp_f32(const float *dphi, const float *cs, const float *sn, int64_t rows, int64_t r, int64_t nsets,
               float *dp) {
    FF_DP(float)
}

void ff_dp_f64(const double *dphi, const double *cs, const double *sn, int64_t rows, int64_t r,
               int64_t nsets, double *dp) {
    FF_DP(double)
}

#define FF_FINISH(T)                                                                         \
    for (int64_t row = 0; row < rows; ++row) {                                               \
        const T *x = num + row * e;                                                          \
        const T den = x[e - 1];                                                              \
        const T iv = den > 0 ? (T)1 / den : (T)0;                                            \
        T *o = out + row * (e - 1);                                                          \
        inv[row] = iv;                                                                       \
        _Pragma("omp simd")                                                                  \
        for (int64_t i = 0; i < e - 1; ++i) o[i] = x[i] * iv;                                \
    }

void ff_finish_f32(const float *num, int64_t rows, int64_t e, float *out, float *inv) { FF_FINISH(float) }

void ff_finish_f64(const double *num, int64_t rows, int64_t e, double *out, double *inv) { FF_FINISH(double) }

/* dout read with strides (rs, cs): the gradient of a sum arrives as an expanded scalar (cs = 0);
 * the loops for cs = 1 and cs = 0 are written out (a runtime stride turns the loads into gathers) */
#define FF_GN_ROW(T, LOAD)                                                                   \
    for (int64_t row = 0; row < rows; ++row) {                                               \
        const T *d = dout + row * rs, *o = out + row * dv;                                   \
        const T iv = inv[row];                                                               \
        T *g = gn + row * (dv + 1);                                                          \
        T dot = 0;                                                                           \
        _Pragma("omp simd reduction(+:dot)")                                                 \
        for (int64_t i = 0; i < dv; ++i) {                                                   \
            const T x = (LOAD) * iv;                                                         \
            g[i] = x;                                                                        \
            dot += x * o[i];                                                                 \
        }                                                                                    \
        g[dv] = -dot;                                                                        \
    }
#define FF_GN(T)                                                                             \
    if (cs == 1) {                                                                           \
        FF_GN_ROW(T, d[i])                                                                   \
    } else if (cs == 0) {                                                                    \
        FF_GN_ROW(T, d[0])                                                                   \
    } else {                                                                                 \
        FF_GN_ROW(T, d[i * cs])                                                              \
    }

void ff_gn_f32(const float *dout, int64_t rs, int64_t cs, const float *inv, const float *out, int64_t rows,
               int64_t dv, float *gn) {
    FF_GN(float)
}

void ff_gn_f64(const double *dout, int64_t rs, int64_t cs, const double *inv, const double *out, int64_t rows,
               int64_t dv, double *gn) {
    FF_GN(double)
}

/* kw, cm, u may be NULL (no key weight / no magnitude); dvo, dm, dk may be NULL (not needed) */
#define FF_KEY_GRADS(T)                                                                      \
    for (int64_t row = 0; row < rows; ++row) {                                               \
        const T *tr = t + row * (dv + 1), *vr = v + row * dv;                                \
        const T m = kw ? kw[row] : (T)1;                                                     \
        if (dvo) {                                                                           \
            T *o = dvo + row * dv;                                                           \
            _Pragma("omp simd")                                                              \
            for (int64_t i = 0; i < dv; ++i) o[i] = tr[i] * m;                               \
        }                                                                                    \
        if (dm || dk) {                                                                      \
            T s = 0;                                                                         \
            _Pragma("omp simd reduction(+:s)")                                               \
            for (int64_t i = 0; i < dv; ++i) s += tr[i] * vr[i];                             \
            s += tr[dv];                                                                     \
            if (dm) dm[row] = s;                                                             \
            if (dk) {                                                                        \
                const T f = s * m * cm[row];                                                 \
                const T *ur = u + row * d;                                                   \
                T *o = dk + row * d;                                                         \
                _Pragma("omp simd")                                                          \
                for (int64_t i = 0; i < d; ++i) o[i] = ur[i] * f;                            \
            }                                                                                \
        }                                                                                    \
    }

void ff_key_grads_f32(const float *t, const float *v, const float *kw, const float *cm, const float *u,
                      int64_t rows, int64_t dv, int64_t d, float *dvo, float *dm, float *dk) {
    FF_KEY_GRADS(float)
}

void ff_key_grads_f64(const double *t, const double *v, const double *kw, const double *cm, const double *u,
                      int64_t rows, int64_t dv, int64_t d, double *dvo, double *dm, double *dk) {
    FF_KEY_GRADS(double)
}

static void ff_lp_f32(const float *k, int64_t rows, int64_t d, int mode, double p, double scale, double cap,
                      float *a, float *u, float *c) {
    LP_BODY(float, sqrtf, powf, fabsf, copysignf)
}

static void ff_lp_f64(const double *k, int64_t rows, int64_t d, int mode, double p, double scale, double cap,
                      double *a, double *u, double *c) {
    LP_BODY(double, sqrt, pow, fabs, copysign)
}

#define FF_KW(T, MAG, EXP)                                                                 \
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

void ff_key_weights_f32(const float *k, const float *v, const float *mask, int64_t heads, int64_t n, int64_t d,
                        int64_t dv, int mode, double p, double scale, double cap, float *vm, float *kw, float *u,
                        float *c) {
    FF_KW(float, ff_lp_f32, attnopt_pexpf)
}

void ff_key_weights_f64(const double *k, const double *v, const double *mask, int64_t heads, int64_t n,
                        int64_t d, int64_t dv, int mode, double p, double scale, double cap, double *vm,
                        double *kw, double *u, double *c) {
    FF_KW(double, ff_lp_f64, exp)
}

void ff_prepare_f32(const float *P, int64_t prows, int64_t r, int64_t nsets, float *phi, float *cs, float *sn,
                    const float *k, const float *v, const float *mask, int64_t heads, int64_t n, int64_t d,
                    int64_t dv, int mode, double p, double scale, double cap, float *vm, float *kw, float *u,
                    float *c) {
    ff_features_f32(P, prows, r, nsets, phi, cs, sn);
    ff_key_weights_f32(k, v, mask, heads, n, d, dv, mode, p, scale, cap, vm, kw, u, c);
}

void ff_prepare_f64(const double *P, int64_t prows, int64_t r, int64_t nsets, double *phi, double *cs,
                    double *sn, const double *k, const double *v, const double *mask, int64_t heads, int64_t n,
                    int64_t d, int64_t dv, int mode, double p, double scale, double cap, double *vm, double *kw,
                    double *u, double *c) {
    ff_features_f64(P, prows, r, nsets, phi, cs, sn);
    ff_key_weights_f64(k, v, mask, heads, n, d, dv, mode, p, scale, cap, vm, kw, u, c);
}

void ff_tail_f32(const float *t, const float *v, const float *kw, const float *cm, const float *u, int64_t rows,
                 int64_t dv, int64_t d, float *dvo, float *dm, float *dk, const float *dphi, const float *cs,
                 const float *sn, int64_t prows, int64_t r, int64_t nsets, float *dp) {
    ff_key_grads_f32(t, v, kw, cm, u, rows, dv, d, dvo, dm, dk);
    ff_dp_f32(dphi, cs, sn, prows, r, nsets, dp);
}

void ff_tail_f64(const double *t, const double *v, const double *kw, const double *cm, const double *u,
                 int64_t rows, int64_t dv, int64_t d, double *dvo, double *dm, double *dk, const double *dphi,
                 const double *cs, const double *sn, int64_t prows, int64_t r, int64_t nsets, double *dp) {
    ff_key_grads_f64(t, v, kw, cm, u, rows, dv, d, dvo, dm, dk);
    ff_dp_f64(dphi, cs, sn, prows, r, nsets, dp);
}
