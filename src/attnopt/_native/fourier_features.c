/* The elementwise passes of kernel attention with Fourier features (implicit-kernel-attention
 * eq. 9, 13, 15-16), one C call each where the PyTorch form takes 3-6 ops; the matmuls stay in
 * PyTorch. Same functions as attnopt.functional.kernel._fourier_pass's PyTorch path, to rounding.
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
 * float32's sin/cos: psincos.h (~1e-7, vectorized); |x| > 8192 (and NaN) go to libm. float64: libm.
 * float32's exp: pexp.h (~2 ulp). */
#include <math.h>
#include <stdint.h>
#include <string.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "lp_body.h"
#include "pexp.h"
#include "psincos.h"
#include "psum.h"

#define FF_BIG 8192.0f

#define ff_sincosf attnopt_psincosf

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
    lp_rows_f32(k, rows, d, mode, p, scale, cap, a, u, c);
}

static void ff_lp_f64(const double *k, int64_t rows, int64_t d, int mode, double p, double scale, double cap,
                      double *a, double *u, double *c) {
    lp_rows_f64(k, rows, d, mode, p, scale, cap, a, u, c);
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

/* ---------------------------------------------------------------------------------------------
 * Whole-call kernels for small sizes (ffw_*): the forward (or the backward) of heads [g0, g1) in
 * one call, the passes above per head and the matrix products by the caller's BLAS (Fortran
 * sgemm_ / dgemm_, passed as a function pointer: this file links no BLAS; integer arguments held
 * in int64, read alike by an LP64 and an ILP64 BLAS on a little-endian machine). Per head g,
 * row-major, q (nq, d), k (nk, d), v (nk, dv) contiguous by head, points W (S R, d) at
 * w + (g / hi) wsb + (g % hi) wsh (shared: wsb = wsh = 0), mask (nk) per head or NULL:
 *   forward:  Pq = Q W^T, Pk = K W^T; phi, cos, sin of both (ff_features); the key weights m
 *             (ffw_kw); F = phi_q phi_k^T; A_ij = (c4 F_ij^2 + eps) m_j / den_i with den_i the
 *             row sum before the division; O = A V (= num / den of the per-pass node, num = A vm:
 *             no vm, no 65th column in the product, no finishing pass). Saved per head
 *             (ffw_save_size entries): F, phi_q, phi_k, cos/sin of Pq and Pk, m, u, c, 1/den.
 *   backward: g = dout / den, gd = -<g, O> (ffw_gn); dv = m A^T g with A = c4 F^2 + eps
 *             again; dA_ij = m_j (<g_i, v_j> + gd_i) from the product G V^T, dF = 2 c4 F dA, and
 *             in the same loop dm_j = sum_i A_ij (<g_i, v_j> + gd_i) -> the magnitude's share of
 *             dk, u (dm m c); dphi_q = dF phi_k, dphi_k = dF^T phi_q; dP (ffw_dp); dq = dPq W,
 *             dk += dPk W, dW (+)= dPq^T Q + dPk^T K (dw_acc: always add, into a per-thread
 *             buffer for shared points).
 * Outputs not needed are NULL. MKL_Set_Num_Threads_Local(1), when given, keeps MKL from starting
 * threads inside the caller's threads; flush-to-zero / denormals-are-zero are on during the call
 * (x86) and restored after. */
#if defined(__x86_64__) || defined(__i386__)
#include <xmmintrin.h>
#define FFW_FTZ_ON() const unsigned int csr_saved = _mm_getcsr(); _mm_setcsr(csr_saved | 0x8040u)
#define FFW_FTZ_OFF() _mm_setcsr(csr_saved)
#else
#define FFW_FTZ_ON() do { } while (0)
#define FFW_FTZ_OFF() do { } while (0)
#endif

typedef int (*ffw_threads_t)(int);

int64_t ffw_save_size(int64_t nq, int64_t nk, int64_t d, int64_t dv, int64_t r, int64_t nsets) {
    const int64_t sr = r * nsets;
    (void)dv;
    return nq * nk + (nq + nk) * 2 * r + 2 * (nq + nk) * sr + nk + nk * d + nk + nq;
}

int64_t ffw_work_size(int64_t nq, int64_t nk, int64_t d, int64_t dv, int64_t r, int64_t nsets) {
    const int64_t sr = r * nsets, nm = nq > nk ? nq : nk;
    const int64_t fwd = nm * sr + nq * nk + sr * d;
    const int64_t bwd = nq * (dv + 1) + nq * nk + nk * (dv + 1) + (nq + nk) * 2 * r + (nq + nk) * sr;
    return fwd > bwd ? fwd : bwd;
}

/* The whole call's key weights: per row of k (one head of n keys), a_j = s*||k_j||_p^2/2 (mode -1:
 * none; lp_body.h's lp_rows) + mask_j, m_j = exp(a_j - max_l a_l) into kw (no vm: the forward scales
 * A's columns by m instead), u and c where not NULL. */
#define FFW_KW(T, SUF, EXP)                                                                  \
static void ffw_kw_##SUF(const T *k, const T *mask, int64_t n, int64_t d, int mode, double p, \
                         double scale, double cap, T *a, T *u, T *c) {                       \
    if (mode >= 0) {                                                                         \
        lp_rows_##SUF(k, n, d, mode, p, scale, cap, a, u, c);                                 \
    } else {                                                                                 \
        for (int64_t j = 0; j < n; ++j) a[j] = 0;                                            \
    }                                                                                        \
    if (mask) {                                                                              \
        _Pragma("omp simd")                                                                  \
        for (int64_t j = 0; j < n; ++j) a[j] += mask[j];                                     \
    }                                                                                        \
    T mx = -INFINITY;                                                                        \
    for (int64_t j = 0; j < n; ++j) mx = a[j] > mx ? a[j] : mx;                              \
    const T shift = isfinite(mx) ? mx : (T)0;                                                \
    _Pragma("omp simd")                                                                      \
    for (int64_t j = 0; j < n; ++j) a[j] = EXP(a[j] - shift);                                \
}

FFW_KW(float, f32, attnopt_pexpf)
FFW_KW(double, f64, exp)

/* The whole call's features: ff_features with the set sums taken in the sin/cos loop (per row,
 * the sets of one feature index in one vector lane: no second pass over cos/sin) for S = 1 and
 * S = 2 (GCC vectorizes the lanes only when the loop over the sets has a constant count; other S:
 * ff_features); |x| > FF_BIG (or NaN) counted first, then redone by libm. */
static inline __attribute__((always_inline)) void ffw_feat_rows_f32(const float *restrict P, int64_t rows,
                                                                    int64_t r, const int64_t nsets,
                                                                    float *restrict phi, float *restrict cs,
                                                                    float *restrict sn) {
    const int64_t sr = r * nsets;
    for (int64_t row = 0; row < rows; ++row) {
        const float *restrict x = P + row * sr;
        float *restrict c = cs + row * sr, *restrict s = sn + row * sr, *restrict f = phi + row * 2 * r;
#pragma omp simd
        for (int64_t i = 0; i < r; ++i) {
            float fc = 0.0f, fs = 0.0f;
            for (int64_t k = 0; k < nsets; ++k) {
                float sv, cv;
                ff_sincosf(x[k * r + i], &sv, &cv);
                c[k * r + i] = cv;
                s[k * r + i] = sv;
                fc += cv;
                fs += sv;
            }
            f[i] = fc;
            f[r + i] = fs;
        }
    }
}

#if defined(__AVX512F__)
/* attnopt_psincosf on 16 lanes (the same operations, so the same values) */
static inline void ffw_sincos16(__m512 x, __m512 *sn, __m512 *cs) {
    const __m512 t = _mm512_fmadd_ps(x, _mm512_set1_ps(0.636619772367581343f), _mm512_set1_ps(12582912.0f));
    const __m512 n = _mm512_sub_ps(t, _mm512_set1_ps(12582912.0f));
    __m512 r = _mm512_fmadd_ps(n, _mm512_set1_ps(-1.5703125f), x);
    r = _mm512_fmadd_ps(n, _mm512_set1_ps(-4.837512969970703125e-4f), r);
    r = _mm512_fmadd_ps(n, _mm512_set1_ps(-7.54978995489188216e-8f), r);
    const __m512i quad = _mm512_castps_si512(t);
    const __m512 z = _mm512_mul_ps(r, r);
    const __m512 sp = _mm512_fmadd_ps(
        _mm512_mul_ps(_mm512_fmadd_ps(_mm512_fmadd_ps(_mm512_set1_ps(-1.9515295891e-4f), z,
                                                      _mm512_set1_ps(8.3321608736e-3f)),
                                      z, _mm512_set1_ps(-1.6666654611e-1f)),
                      z),
        r, r);
    const __m512 cp = _mm512_fmadd_ps(
        _mm512_mul_ps(_mm512_fmadd_ps(_mm512_fmadd_ps(_mm512_set1_ps(2.443315711809948e-5f), z,
                                                      _mm512_set1_ps(-1.388731625493765e-3f)),
                                      z, _mm512_set1_ps(4.166664568298827e-2f)),
                      z),
        z, _mm512_fmadd_ps(_mm512_set1_ps(-0.5f), z, _mm512_set1_ps(1.0f)));
    const __m512i one = _mm512_set1_epi32(1), two = _mm512_set1_epi32(2);
    const __mmask16 odd = _mm512_test_epi32_mask(quad, one);
    const __m512 s0 = _mm512_mask_blend_ps(odd, sp, cp), c0 = _mm512_mask_blend_ps(odd, cp, sp);
    const __mmask16 sneg = _mm512_test_epi32_mask(quad, two);
    const __mmask16 cneg = _mm512_test_epi32_mask(_mm512_add_epi32(quad, one), two);
    const __m512 sign = _mm512_set1_ps(-0.0f);
    *sn = _mm512_mask_xor_ps(s0, sneg, s0, sign);
    *cs = _mm512_mask_xor_ps(c0, cneg, c0, sign);
}

/* the rows of ffw_feat_rows_f32 by 16 lanes; returns whether some |x| > FF_BIG (or NaN) */
static int ffw_feat16_f32(const float *P, int64_t rows, int64_t r, int64_t nsets, float *phi, float *cs,
                          float *sn) {
    const int64_t sr = r * nsets;
    const __m512 big = _mm512_set1_ps(FF_BIG);
    __mmask16 bad = 0;
    for (int64_t row = 0; row < rows; ++row) {
        const float *x = P + row * sr;
        float *c = cs + row * sr, *s = sn + row * sr, *f = phi + row * 2 * r;
        for (int64_t i = 0; i < r; i += 16) {
            const __mmask16 live = r - i >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (r - i)) - 1u);
            __m512 fc = _mm512_setzero_ps(), fs = _mm512_setzero_ps();
            for (int64_t k = 0; k < nsets; ++k) {
                const __m512 xv = _mm512_maskz_loadu_ps(live, x + k * r + i);
                bad |= _mm512_mask_cmp_ps_mask(live, _mm512_abs_ps(xv), big, _CMP_NLE_UQ);
                __m512 sv, cv;
                ffw_sincos16(xv, &sv, &cv);
                _mm512_mask_storeu_ps(c + k * r + i, live, cv);
                _mm512_mask_storeu_ps(s + k * r + i, live, sv);
                fc = _mm512_add_ps(fc, cv);
                fs = _mm512_add_ps(fs, sv);
            }
            _mm512_mask_storeu_ps(f + i, live, fc);
            _mm512_mask_storeu_ps(f + r + i, live, fs);
        }
    }
    return bad != 0;
}
#endif

static void ffw_features_f32(const float *restrict P, int64_t rows, int64_t r, int64_t nsets,
                             float *restrict phi, float *restrict cs, float *restrict sn) {
#if defined(__AVX512F__)
    if (ffw_feat16_f32(P, rows, r, nsets, phi, cs, sn)) ff_features_f32(P, rows, r, nsets, phi, cs, sn);
    return;
#endif
    if (nsets != 1 && nsets != 2) {
        ff_features_f32(P, rows, r, nsets, phi, cs, sn);
        return;
    }
    const int64_t sr = r * nsets;
    float nbig;
    PSUM(float, rows * sr, nbig, term_ = !(__builtin_fabsf(P[i]) <= FF_BIG) ? 1.0f : 0.0f);
    if (nbig != 0.0f) {
        ff_features_f32(P, rows, r, nsets, phi, cs, sn);
    } else if (nsets == 1) {
        ffw_feat_rows_f32(P, rows, r, 1, phi, cs, sn);
    } else {
        ffw_feat_rows_f32(P, rows, r, 2, phi, cs, sn);
    }
}

static void ffw_features_f64(const double *P, int64_t rows, int64_t r, int64_t nsets, double *phi, double *cs,
                             double *sn) {
    ff_features_f64(P, rows, r, nsets, phi, cs, sn);
}

/* ff_dp with restrict rows and, for S = 1 and S = 2, the sets of one feature index in one lane */
#define FFW_DP(T, SUF)                                                                       \
static inline __attribute__((always_inline)) void ffw_dp_rows_##SUF(                         \
    const T *restrict dphi, const T *restrict cs, const T *restrict sn, int64_t rows, int64_t r, \
    const int64_t nsets, T *restrict dp) {                                                   \
    const int64_t sr = r * nsets;                                                            \
    for (int64_t row = 0; row < rows; ++row) {                                               \
        const T *restrict dc = dphi + row * 2 * r, *restrict ds = dc + r;                    \
        const T *restrict c = cs + row * sr, *restrict s = sn + row * sr;                    \
        T *restrict o = dp + row * sr;                                                       \
        _Pragma("omp simd")                                                                  \
        for (int64_t i = 0; i < r; ++i) {                                                    \
            const T a = ds[i], b = dc[i];                                                    \
            for (int64_t k = 0; k < nsets; ++k) o[k * r + i] = c[k * r + i] * a - s[k * r + i] * b; \
        }                                                                                    \
    }                                                                                        \
}                                                                                            \
static void ffw_dp_##SUF(const T *dphi, const T *cs, const T *sn, int64_t rows, int64_t r, int64_t nsets, \
                         T *dp) {                                                            \
    if (nsets == 1) {                                                                        \
        ffw_dp_rows_##SUF(dphi, cs, sn, rows, r, 1, dp);                                     \
    } else if (nsets == 2) {                                                                 \
        ffw_dp_rows_##SUF(dphi, cs, sn, rows, r, 2, dp);                                     \
    } else {                                                                                 \
        ff_dp_##SUF(dphi, cs, sn, rows, r, nsets, dp);                                       \
    }                                                                                        \
}

FFW_DP(float, f32)
FFW_DP(double, f64)

/* ffw_tr_f32: b (cols x rows, row stride ldb) = a^T, a (rows x cols, row stride lda); 16 x 16
 * blocks in registers where AVX-512 is compiled in, the edges (and other machines) one by one */
#if defined(__AVX512F__)
static inline void ffw_tr16_f32(const float *a, int64_t lda, float *b, int64_t ldb) {
    __m512 r[16], t[16];
    for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_ps(a + i * lda);
    for (int i = 0; i < 8; ++i) {
        t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; ++i) {
        r[4 * i] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], 0x44);
        r[4 * i + 1] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], 0xEE);
        r[4 * i + 2] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0x44);
        r[4 * i + 3] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0xEE);
    }
    for (int h = 0; h < 2; ++h) {
        for (int i = 0; i < 4; ++i) {
            t[8 * h + i] = _mm512_shuffle_f32x4(r[8 * h + i], r[8 * h + 4 + i], 0x88);
            t[8 * h + 4 + i] = _mm512_shuffle_f32x4(r[8 * h + i], r[8 * h + 4 + i], 0xDD);
        }
    }
    for (int i = 0; i < 8; ++i) {
        r[i] = _mm512_shuffle_f32x4(t[i], t[8 + i], 0x88);
        r[8 + i] = _mm512_shuffle_f32x4(t[i], t[8 + i], 0xDD);
    }
    for (int i = 0; i < 16; ++i) _mm512_storeu_ps(b + i * ldb, r[i]);
}
#define FFW_TR_BLOCK 16
#else
#define FFW_TR_BLOCK 0
#endif

static void ffw_tr_f32(const float *a, int64_t rows, int64_t cols, int64_t lda, float *b, int64_t ldb) {
    int64_t i0 = 0;
#if FFW_TR_BLOCK
    int64_t j0 = 0;
    for (; i0 + 16 <= rows; i0 += 16)
        for (j0 = 0; j0 + 16 <= cols; j0 += 16) ffw_tr16_f32(a + i0 * lda + j0, lda, b + j0 * ldb + i0, ldb);
    for (int64_t i = 0; i < i0; ++i)
        for (int64_t j = j0; j < cols; ++j) b[j * ldb + i] = a[i * lda + j];
#endif
    for (int64_t i = i0; i < rows; ++i)
        for (int64_t j = 0; j < cols; ++j) b[j * ldb + i] = a[i * lda + j];
}

static void ffw_tr_f64(const double *a, int64_t rows, int64_t cols, int64_t lda, double *b, int64_t ldb) {
    for (int64_t i = 0; i < rows; ++i)
        for (int64_t j = 0; j < cols; ++j) b[j * ldb + i] = a[i * lda + j];
}

/* Whether the whole call transposes W and V for "NN" products: float32 where the 16 x 16 blocks
 * are compiled in (a transpose one by one costs about what it saves; float64 measured so) */
#define FFW_NN_f32 (FFW_TR_BLOCK != 0)
#define FFW_NN_f64 0

/* Save layout per head (ffw_save_size entries; the vm block of the per-pass node is left unused) */
#define FFW_LAYOUT(T)                                                                        \
    const int64_t sr = r * nsets, r2 = 2 * r;                                                \
    const int64_t per = ffw_save_size(nq, nk, d, dv, r, nsets);                              \
    T *F = save + g * per, *phq = F + nq * nk, *phk = phq + nq * r2;                         \
    T *cq = phk + nk * r2, *sq = cq + nq * sr, *ck = sq + nq * sr, *sk = ck + nk * sr;       \
    T *kw = sk + nk * sr, *u = kw + nk, *cm = u + nk * d, *inv = cm + nk;                    \
    const T *qg = q + g * nq * d, *kg = k + g * nk * d, *vg = v + g * nk * dv;               \
    const T *wg = w + (g / hi) * wsb + (g % hi) * wsh;                                       \
    (void)inv; (void)u; (void)cm; (void)sq; (void)sk; (void)vg;

#define FFW(T, SUF)                                                                          \
typedef void (*ffw_gemm_##SUF##_t)(const char *, const char *, const int64_t *, const int64_t *, \
                                   const int64_t *, const T *, const T *, const int64_t *,   \
                                   const T *, const int64_t *, const T *, T *, const int64_t *); \
                                                                                             \
/* row-major C (m x n, ldc) = alpha op(A) op(B) + beta C through the column-major BLAS */    \
static inline void ffw_mm_##SUF(ffw_gemm_##SUF##_t gemm, int ta, int tb, int64_t m, int64_t n, \
                                int64_t kk, T alpha, const T *a, int64_t lda, const T *b,    \
                                int64_t ldb, T beta, T *c, int64_t ldc) {                    \
    if (m <= 0 || n <= 0) return;                                                            \
    if (kk <= 0) {                                                                           \
        for (int64_t i = 0; i < m; ++i)                                                      \
            for (int64_t j = 0; j < n; ++j) c[i * ldc + j] = beta == 0 ? 0 : beta * c[i * ldc + j]; \
        return;                                                                              \
    }                                                                                        \
    gemm(tb ? "T" : "N", ta ? "T" : "N", &n, &m, &kk, &alpha, b, &ldb, a, &lda, &beta, c, &ldc); \
}                                                                                            \
                                                                                             \
void ffw_fwd_##SUF(void *gemm_p, void *threads_p, const T *q, const T *k, const T *v, const T *w, \
                   int64_t wsb, int64_t wsh, int64_t hi, const T *mask, int64_t g0, int64_t g1, \
                   int64_t nq, int64_t nk, int64_t d, int64_t dv, int64_t r, int64_t nsets,  \
                   int mode, double p, double scale, double cap, double c4, double eps, int grad, \
                   T *save, T *out, T *work) {                                               \
    ffw_gemm_##SUF##_t gemm = (ffw_gemm_##SUF##_t)gemm_p;                                    \
    ffw_threads_t set_threads = (ffw_threads_t)threads_p;                                    \
    const int prev = set_threads ? set_threads(1) : 0;                                       \
    FFW_FTZ_ON();                                                                            \
    const T tc4 = (T)c4, teps = (T)eps, *wt_of = NULL;                                       \
    for (int64_t g = g0; g < g1; ++g) {                                                      \
        FFW_LAYOUT(T)                                                                        \
        T *P = work, *A = P + (nq > nk ? nq : nk) * sr, *Wt = A + nq * nk;                   \
        /* W^T (d, S R) for "NN" products (MKL's "TN", row-major X Y^T, is ~20 % slower) */  \
        if (FFW_NN_##SUF && wg != wt_of) {                                                   \
            ffw_tr_##SUF(wg, sr, d, d, Wt, sr);                                              \
            wt_of = wg;                                                                      \
        }                                                                                    \
        for (int side = 0; side < 2; ++side) { /* the queries' features, then the keys' */  \
            const int64_t nx = side ? nk : nq;                                               \
            const T *xg = side ? kg : qg;                                                    \
            if (FFW_NN_##SUF) {                                                              \
                ffw_mm_##SUF(gemm, 0, 0, nx, sr, d, 1, xg, d, Wt, sr, 0, P, sr);             \
            } else {                                                                         \
                ffw_mm_##SUF(gemm, 0, 1, nx, sr, d, 1, xg, d, wg, d, 0, P, sr);              \
            }                                                                                \
            ffw_features_##SUF(P, nx, r, nsets, side ? phk : phq, side ? ck : cq, side ? sk : sq); \
        }                                                                                    \
        ffw_kw_##SUF(kg, mask ? mask + g * nk : NULL, nk, d, mode, p, scale, cap, kw,        \
                     grad ? u : NULL, grad ? cm : NULL);                                     \
        ffw_mm_##SUF(gemm, 0, 1, nq, nk, r2, 1, phq, r2, phk, r2, 0, F, nk);                 \
        /* A_ij = (eps + c4 F_ij^2) m_j / den_i, den_i = sum_j (eps + c4 F_ij^2) m_j: then   \
         * O = A v is the output (num = A [v m, m] and O = num / den of the per-pass node) */ \
        for (int64_t i = 0; i < nq; ++i) {                                                   \
            const T *f = F + i * nk;                                                         \
            T *ar = A + i * nk, den;                                                         \
            PSUM(T, nk, den, term_ = ar[i] = (teps + tc4 * f[i] * f[i]) * kw[i]);         \
            const T iv = den > 0 ? (T)1 / den : (T)0;                                        \
            inv[i] = iv;                                                                     \
            _Pragma("omp simd")                                                              \
            for (int64_t j = 0; j < nk; ++j) ar[j] *= iv;                                    \
        }                                                                                    \
        ffw_mm_##SUF(gemm, 0, 0, nq, dv, nk, 1, A, nk, vg, dv, 0, out + g * nq * dv, dv);    \
    }                                                                                        \
    FFW_FTZ_OFF();                                                                           \
    if (set_threads) set_threads(prev);                                                      \
}                                                                                            \
                                                                                             \
void ffw_bwd_##SUF(void *gemm_p, void *threads_p, const T *q, const T *k, const T *v, const T *w, \
                   int64_t wsb, int64_t wsh, int64_t hi, const T *dout, int64_t dsg, int64_t drs, \
                   int64_t dcs, const T *out, int64_t g0, int64_t g1, int64_t nq, int64_t nk, \
                   int64_t d, int64_t dv, int64_t r, int64_t nsets, int mag, double c4, double eps, \
                   T *save, T *work, T *dq, T *dk, T *dvo, T *dw, int64_t dsb, int64_t dsh,  \
                   int dw_acc) {                                                             \
    ffw_gemm_##SUF##_t gemm = (ffw_gemm_##SUF##_t)gemm_p;                                    \
    ffw_threads_t set_threads = (ffw_threads_t)threads_p;                                    \
    const int prev = set_threads ? set_threads(1) : 0;                                       \
    FFW_FTZ_ON();                                                                            \
    const int need_f = dq || dk || dw, need_mag = mag && dk;                                 \
    const T tc4 = (T)c4, teps = (T)eps, two = 2 * tc4;                                       \
    for (int64_t g = g0; g < g1; ++g) {                                                      \
        FFW_LAYOUT(T)                                                                        \
        /* gn = [g, gd] of the per-pass node, held as g (nq, dv) and gd (nq); Tt = A^T g (or \
         * V^T), td = dm */                                                                  \
        T *gm = work, *gd = gm + nq * dv, *A = gd + nq, *Tt = A + nq * nk, *td = Tt + nk * dv; \
        T *dphq = td + nk, *dphk = dphq + nq * r2, *dPq = dphk + nk * r2, *dPk = dPq + nq * sr; \
        const T *og = out + g * nq * dv;                                                     \
        T *dqg = dq ? dq + g * nq * d : NULL, *dkg = dk ? dk + g * nk * d : NULL;            \
        T *dvg = dvo ? dvo + g * nk * dv : NULL;                                             \
        ffw_gn_##SUF(dout + g * dsg, drs, dcs, inv, og, nq, dv, gm, gd);                     \
        if (dvg) { /* dv = m A^T g */                                                        \
            for (int64_t i = 0; i < nq; ++i) {                                               \
                const T *f = F + i * nk;                                                     \
                T *ar = A + i * nk;                                                          \
                _Pragma("omp simd")                                                          \
                for (int64_t j = 0; j < nk; ++j) ar[j] = teps + tc4 * f[j] * f[j];           \
            }                                                                                \
            ffw_mm_##SUF(gemm, 1, 0, nk, dv, nq, 1, A, nk, gm, dv, 0, Tt, dv);               \
            for (int64_t j = 0; j < nk; ++j) {                                               \
                const T m = kw[j], *tr = Tt + j * dv;                                        \
                T *o = dvg + j * dv;                                                         \
                _Pragma("omp simd")                                                          \
                for (int64_t i = 0; i < dv; ++i) o[i] = tr[i] * m;                           \
            }                                                                                \
        }                                                                                    \
        if (!need_f) continue;                                                               \
        /* dA_ij = <gn_i, vm_j> = m_j (<g_i, v_j> + gd_i); dF = 2 c4 F dA */                 \
        if (FFW_NN_##SUF) { /* V^T (dv, nk) in T's place: G V^T "NN" */                      \
            ffw_tr_##SUF(vg, nk, dv, dv, Tt, nk);                                            \
            ffw_mm_##SUF(gemm, 0, 0, nq, nk, dv, 1, gm, dv, Tt, nk, 0, A, nk);               \
        } else {                                                                             \
            ffw_mm_##SUF(gemm, 0, 1, nq, nk, dv, 1, gm, dv, vg, dv, 0, A, nk);               \
        }                                                                                    \
        /* and dm_j = sum_i A_ij (<g_i, v_j> + gd_i) (= <v_j, T_j> + (A^T gd)_j) in the same loop: \
         * the magnitude's share of dk, u (dm m c) */                                        \
        if (need_mag) {                                                                      \
            for (int64_t j = 0; j < nk; ++j) td[j] = 0;                                      \
            for (int64_t i = 0; i < nq; ++i) {                                               \
                const T *f = F + i * nk, gi = gd[i];                                         \
                T *ar = A + i * nk;                                                          \
                _Pragma("omp simd")                                                          \
                for (int64_t j = 0; j < nk; ++j) {                                           \
                    const T t = ar[j] + gi;                                                  \
                    td[j] += (teps + tc4 * f[j] * f[j]) * t;                                 \
                    ar[j] = t * kw[j] * two * f[j];                                          \
                }                                                                            \
            }                                                                                \
            for (int64_t j = 0; j < nk; ++j) {                                               \
                const T fj = td[j] * kw[j] * cm[j], *ur = u + j * d;                         \
                T *o = dkg + j * d;                                                          \
                _Pragma("omp simd")                                                          \
                for (int64_t i = 0; i < d; ++i) o[i] = ur[i] * fj;                           \
            }                                                                                \
        } else {                                                                             \
            for (int64_t i = 0; i < nq; ++i) {                                               \
                const T *f = F + i * nk, gi = gd[i];                                         \
                T *ar = A + i * nk;                                                          \
                _Pragma("omp simd")                                                          \
                for (int64_t j = 0; j < nk; ++j) ar[j] = (ar[j] + gi) * kw[j] * two * f[j];  \
            }                                                                                \
        }                                                                                    \
        ffw_mm_##SUF(gemm, 0, 0, nq, r2, nk, 1, A, nk, phk, r2, 0, dphq, r2);                \
        ffw_mm_##SUF(gemm, 1, 0, nk, r2, nq, 1, A, nk, phq, r2, 0, dphk, r2);                \
        ffw_dp_##SUF(dphq, cq, sq, nq, r, nsets, dPq);                                       \
        ffw_dp_##SUF(dphk, ck, sk, nk, r, nsets, dPk);                                       \
        if (dqg) ffw_mm_##SUF(gemm, 0, 0, nq, d, sr, 1, dPq, sr, wg, d, 0, dqg, d);          \
        if (dkg) ffw_mm_##SUF(gemm, 0, 0, nk, d, sr, 1, dPk, sr, wg, d, need_mag ? 1 : 0, dkg, d); \
        if (dw) {                                                                            \
            T *dwg = dw + (g / hi) * dsb + (g % hi) * dsh;                                   \
            ffw_mm_##SUF(gemm, 1, 0, sr, d, nq, 1, dPq, sr, qg, d, dw_acc ? 1 : 0, dwg, d);  \
            ffw_mm_##SUF(gemm, 1, 0, sr, d, nk, 1, dPk, sr, kg, d, 1, dwg, d);               \
        }                                                                                    \
    }                                                                                        \
    FFW_FTZ_OFF();                                                                           \
    if (set_threads) set_threads(prev);                                                      \
}

/* ff_gn with g and gd = -<g, out> in two arrays (rows of dv, not dv + 1) */
#define FFW_GN_ROW(T, LOAD)                                                                  \
    for (int64_t row = 0; row < rows; ++row) {                                               \
        const T *d = dout + row * rs, *o = out + row * dv;                                   \
        const T iv = inv[row];                                                               \
        T *gr = gm + row * dv;                                                               \
        T dot;                                                                               \
        PSUM(T, dv, dot, const T x = (LOAD) * iv; gr[i] = x; term_ = x * o[i]);           \
        gd[row] = -dot;                                                                      \
    }

#define FFW_GN(T, SUF)                                                                       \
static inline void ffw_gn_##SUF(const T *dout, int64_t rs, int64_t cs, const T *inv, const T *out, \
                                int64_t rows, int64_t dv, T *gm, T *gd) {                    \
    if (cs == 1) {                                                                           \
        FFW_GN_ROW(T, d[i])                                                                  \
    } else if (cs == 0) {                                                                    \
        FFW_GN_ROW(T, d[0])                                                                  \
    } else {                                                                                 \
        FFW_GN_ROW(T, d[i * cs])                                                             \
    }                                                                                        \
}

FFW_GN(float, f32)
FFW_GN(double, f64)
FFW(float, f32)
FFW(double, f64)
