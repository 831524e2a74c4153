/* The fused Expsin (periodic kernel x L2 magnitude) attention's Nq x Nk elementwise passes:
 * attnopt.functional._periodic_fused, float32 (suffix f32) and float64 (f64).
 *
 * Per head g (flat batch x head index) with S = Q K^T (the caller's bmm), row i:
 *   theta_ij = sqrt(max(om2 (|q_i|^2 + |k_j|^2 - 2 S_ij), TH_TINY)),
 *   b_j = s2 |k_j|^2 + e_j (the L2 magnitude s|k|^2/2 and an outside key bias),
 *   sigma_i = max_j (b_j + m_ij) (m the optional query-dependent mask; a detached shift),
 *   W_ij = exp(c cos theta_ij + b_j + m_ij - sigma_i - c) <= 1, r_i = 1 / sum_j W_ij,
 *   P_ij = r_i W_ij (written over S), sinc_ij = sin theta_ij / theta_ij (when asked).
 * A row with sigma_i = -inf (no admissible key) gets P = 0, sinc = 0, r = 0. "aux" (per head,
 * 2 x Nk) receives |k_j|^2 and b_j for a later recompute.
 *
 * Backward, per row: delta_i = <dO_i, O_i>, dL_ij = P_ij (dP_ij - delta_i) with dP = dO V^T
 * (the caller's bmm, overwritten by E), E_ij = dL_ij sinc_ij; rs_i = sum_j E_ij and, per head,
 * cs_j = sum_i E_ij, dls_j = sum_i dL_ij. With "recompute", P and sinc are rebuilt from S (as
 * the forward, from the saved shift and r). dL and E below the smallest normal number are 0.
 * Finish: dq_i = coef (dq_i - rs_i q_i), dk_j = coef (dk_j - cs_j k_j) + s dls_j k_j.
 *
 * Heads are independent (the column sums are per head), so attnopt._native.parallel_rows may
 * split a head range [g0, g1) over threads. "S"-like buffers hold the heads of one chunk, the
 * first being cg0; every other array is indexed by the flat head g.
 *
 * float32's cos/sin: Cody-Waite reduction by pi/2 (three-part constant, fused multiply-adds) and
 * Cephes' polynomials on [-pi/4, pi/4] (about 1 ulp there), vectorizable; theta is clamped at
 * 4e6 (where a float32 theta has lost its phase anyway: its ulp is 0.25). float64: the same
 * scheme with fdlibm's polynomials (theta clamped at 1e15) and a polynomial exp.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "pexp.h"
#include "psincos.h"

/* exp(x) for x <= 0 in float64, vectorizable: n = round(x / ln 2) by the 1.5 * 2^52 trick,
 * r = x - n ln 2 (two-part constant, |r| <= ln2 / 2), e^r by its Taylor series to degree 13
 * (truncation below 2e-17 relative), times 2^n from the exponent bits. Results below the
 * smallest normal number (x < -708.39) are 0; positive x is treated as 0. */
static inline double pexpd(double x) {
    const int live = x > -708.0;
    x = live ? (x < 0.0 ? x : 0.0) : 0.0;
    const double t = __builtin_fma(x, 1.4426950408889634074, 6755399441055744.0);
    const double n = t - 6755399441055744.0;
    double r = __builtin_fma(n, -6.93147180369123816490e-01, x);
    r = __builtin_fma(n, -1.90821492927058770002e-10, r);
    double p = 1.0 / 6227020800.0;
    p = __builtin_fma(p, r, 1.0 / 479001600.0);
    p = __builtin_fma(p, r, 1.0 / 39916800.0);
    p = __builtin_fma(p, r, 1.0 / 3628800.0);
    p = __builtin_fma(p, r, 1.0 / 362880.0);
    p = __builtin_fma(p, r, 1.0 / 40320.0);
    p = __builtin_fma(p, r, 1.0 / 5040.0);
    p = __builtin_fma(p, r, 1.0 / 720.0);
    p = __builtin_fma(p, r, 1.0 / 120.0);
    p = __builtin_fma(p, r, 1.0 / 24.0);
    p = __builtin_fma(p, r, 1.0 / 6.0);
    p = __builtin_fma(p, r, 0.5);
    p = __builtin_fma(p, r * r, r) + 1.0;
    int64_t ti;
    memcpy(&ti, &t, sizeof ti);
    const int64_t bits = (int64_t)((uint64_t)(ti - 0x4338000000000000LL + 1023) << 52);
    double scale;
    memcpy(&scale, &bits, sizeof scale);
    return live ? p * scale : 0.0;
}

static inline void sincos_f32(float x, float *sn, float *cs) {
    attnopt_psincosf(x < 4e6f ? x : 4e6f, sn, cs); /* n below 2^22: the rounding trick holds */
}

/* float64 sin and cos of x >= 0, vectorizable: the reduction by pi/2 with fdlibm's three-part
 * constant (fused multiply-adds), fdlibm's kernel polynomials on [-pi/4, pi/4]; x is clamped
 * at 1e15 (n below 2^51 for the rounding trick) */
static inline void sincos_f64(double x, double *sn, double *cs) {
    x = x < 1e15 ? x : 1e15;
    const double t = __builtin_fma(x, 6.36619772367581382433e-01, 6755399441055744.0);
    const double n = t - 6755399441055744.0;
    double r = __builtin_fma(n, -1.57079632673412561417e+00, x);
    r = __builtin_fma(n, -6.07710050630396597660e-11, r);
    r = __builtin_fma(n, -2.02226624871116645580e-21, r);
    int64_t ti;
    memcpy(&ti, &t, sizeof ti);
    const int64_t quad = ti & 3;
    const double z = r * r;
    double ps = 1.58969099521155010221e-10;
    ps = __builtin_fma(ps, z, -2.50507602534068634195e-08);
    ps = __builtin_fma(ps, z, 2.75573137070700676789e-06);
    ps = __builtin_fma(ps, z, -1.98412698298579493134e-04);
    ps = __builtin_fma(ps, z, 8.33333333332248946124e-03);
    ps = __builtin_fma(ps, z, -1.66666666666666324348e-01);
    const double sp = __builtin_fma(r * z, ps, r);
    double pc = -1.13596475577881948265e-11;
    pc = __builtin_fma(pc, z, 2.08757232129817482790e-09);
    pc = __builtin_fma(pc, z, -2.75573143513906633035e-07);
    pc = __builtin_fma(pc, z, 2.48015872894767294178e-05);
    pc = __builtin_fma(pc, z, -1.38888888888741095749e-03);
    pc = __builtin_fma(pc, z, 4.16666666666666019037e-02);
    const double hz = 0.5 * z, w = 1.0 - hz; /* fdlibm's cos: 1 - z/2 + z^2 pc, rounding kept */
    const double cp = w + (((1.0 - w) - hz) + z * z * pc);
    const double s0 = (quad & 1) ? cp : sp, c0 = (quad & 1) ? sp : cp;
    *sn = (quad & 2) ? -s0 : s0;
    *cs = ((quad + 1) & 2) ? -c0 : c0;
}

#define INLINE static inline __attribute__((always_inline))

/* Reductions over a fixed number of lanes (one 64-byte vector) closed by a tree: an
 * "omp simd reduction" ends in a chain of 16 scalar adds (~60 cycles), a lot per 64-key row. */
#define LANES(T) ((int)(64 / sizeof(T)))

#define REDUCE(T, SUF)                                                                                 \
INLINE T tree_sum_##SUF(T *acc) {                                                                     \
    for (int w = LANES(T) / 2; w > 0; w /= 2) {                                                       \
        _Pragma("omp simd")                                                                           \
        for (int l = 0; l < w; ++l) acc[l] += acc[l + w];                                             \
    }                                                                                                 \
    return acc[0];                                                                                    \
}                                                                                                     \
                                                                                                      \
INLINE T dot_##SUF(const T *x, const T *y, int64_t n) {                                               \
    T acc[LANES(T)];                                                                                  \
    for (int l = 0; l < LANES(T); ++l) acc[l] = 0;                                                    \
    int64_t j = 0;                                                                                    \
    for (; j + LANES(T) <= n; j += LANES(T)) {                                                        \
        _Pragma("omp simd")                                                                           \
        for (int l = 0; l < LANES(T); ++l) acc[l] += x[j + l] * y[j + l];                             \
    }                                                                                                 \
    for (int l = 0; j + l < n; ++l) acc[l] += x[j + l] * y[j + l];                                    \
    return tree_sum_##SUF(acc);                                                                       \
}

REDUCE(float, f32)
REDUCE(double, f64)

#define PERIODIC(T, SUF, EXP, SINCOS, TINY, TH_TINY)                                                   \
/* |k_j|^2 and b_j of head g into aux; returns max_j b_j */                                           \
static T head_setup_##SUF(const T *k, const T *e, T *aux, int64_t g, int64_t nk, int64_t d, T s2) {    \
    T *kn = aux + g * 2 * nk, *kb = kn + nk;                                                          \
    const T *kg = k + g * nk * d;                                                                     \
    const T *eg = e ? e + g * nk : NULL;                                                              \
    T top = -(T)INFINITY;                                                                             \
    for (int64_t j = 0; j < nk; ++j) {                                                                \
        const T *kr = kg + j * d;                                                                     \
        const T acc = dot_##SUF(kr, kr, d);                                                           \
        kn[j] = acc;                                                                                  \
        const T b = s2 * acc + (eg ? eg[j] : (T)0);                                                   \
        kb[j] = b;                                                                                    \
        top = b > top ? b : top;                                                                      \
    }                                                                                                 \
    return top;                                                                                       \
}                                                                                                     \
                                                                                                      \
/* W_j (over s_j) and, with WANT_SC, sin(theta)/theta (into sc_j) of one entry; returns W_j */        \
INLINE T entry_##SUF(T *s, T *sc, const T *kn, const T *kb, const T *mr, T base, T om2, T m2, T c,    \
                     T shift, int64_t j, const int MASKED, const int WANT_SC) {                       \
    T t2 = base + om2 * kn[j] + m2 * s[j];                                                            \
    t2 = t2 > TH_TINY ? t2 : TH_TINY;                                                                 \
    const T th = sqrt(t2);                                                                            \
    T sn, cs;                                                                                         \
    SINCOS(th, &sn, &cs);                                                                             \
    const T x = c * cs + (MASKED ? kb[j] + mr[j] : kb[j]) - shift;                                    \
    const T w = EXP(x);                                                                               \
    s[j] = w;                                                                                         \
    if (WANT_SC) sc[j] = sn / th;                                                                     \
    return w;                                                                                         \
}                                                                                                     \
                                                                                                      \
/* the entries of one row whose exponents are shifted by "shift"; returns sum_j W.                    \
 * MASKED: add the mask row mr. */                                                                    \
INLINE T row_exp_##SUF(T *s, T *sc, const T *kn, const T *kb, const T *mr, T base, T om2, T c,        \
                       T shift, int64_t nk, const int MASKED, const int WANT_SC) {                    \
    const T m2 = (T)-2 * om2;                                                                         \
    T acc[LANES(T)];                                                                                  \
    for (int l = 0; l < LANES(T); ++l) acc[l] = 0;                                                    \
    int64_t j = 0;                                                                                    \
    for (; j + LANES(T) <= nk; j += LANES(T)) {                                                       \
        _Pragma("omp simd")                                                                           \
        for (int l = 0; l < LANES(T); ++l)                                                            \
            acc[l] += entry_##SUF(s, sc, kn, kb, mr, base, om2, m2, c, shift, j + l, MASKED, WANT_SC);\
    }                                                                                                 \
    for (int l = 0; j + l < nk; ++l)                                                                  \
        acc[l] += entry_##SUF(s, sc, kn, kb, mr, base, om2, m2, c, shift, j + l, MASKED, WANT_SC);    \
    return tree_sum_##SUF(acc);                                                                       \
}                                                                                                     \
/* P = r W in place, flushed below the smallest normal number */                                     \
INLINE void row_scale_##SUF(T *s, T r, int64_t nk) {                                                  \
    _Pragma("omp simd")                                                                               \
    for (int64_t j = 0; j < nk; ++j) {                                                                \
        const T p = s[j] * r;                                                                         \
        s[j] = p >= TINY ? p : 0;                                                                     \
    }                                                                                                 \
}                                                                                                     \
                                                                                                      \
/* the row's shift max_j (b_j + m_ij) + c (-inf: no admissible key) */                               \
INLINE T row_shift_##SUF(const T *kb, const T *mr, T top, T c, int64_t nk) {                          \
    if (mr) {                                                                                         \
        top = -(T)INFINITY;                                                                           \
        _Pragma("omp simd reduction(max : top)")                                                      \
        for (int64_t j = 0; j < nk; ++j) {                                                            \
            const T b = kb[j] + mr[j];                                                                \
            top = b > top ? b : top;                                                                  \
        }                                                                                             \
    }                                                                                                 \
    return top == -(T)INFINITY ? top : top + c;                                                       \
}                                                                                                     \
                                                                                                      \
/* P and (sc != NULL) sin(theta)/theta of row (g, i) of the forward; stores its shift and r */        \
INLINE void row_weights_##SUF(T *s, T *sc, const T *qi, const T *kn, const T *kb, const T *mr,        \
                              T top, T *shift, T *rinv, int64_t nk, int64_t d, T om2, T c) {          \
    const T sh = row_shift_##SUF(kb, mr, top, c, nk);                                                 \
    *shift = sh;                                                                                      \
    if (sh == -(T)INFINITY) {                                                                         \
        memset(s, 0, sizeof(T) * (size_t)nk);                                                         \
        if (sc) memset(sc, 0, sizeof(T) * (size_t)nk);                                                \
        *rinv = 0;                                                                                    \
        return;                                                                                       \
    }                                                                                                 \
    const T base = om2 * dot_##SUF(qi, qi, d);                                                        \
    T z;                                                                                              \
    if (mr && sc) z = row_exp_##SUF(s, sc, kn, kb, mr, base, om2, c, sh, nk, 1, 1);                   \
    else if (mr) z = row_exp_##SUF(s, sc, kn, kb, mr, base, om2, c, sh, nk, 1, 0);                    \
    else if (sc) z = row_exp_##SUF(s, sc, kn, kb, mr, base, om2, c, sh, nk, 0, 1);                    \
    else z = row_exp_##SUF(s, sc, kn, kb, mr, base, om2, c, sh, nk, 0, 0);                            \
    const T r = z > 0 ? 1 / z : 0; /* z >= e^-2c: the row's largest exponent is >= -2c */             \
    *rinv = r;                                                                                        \
    row_scale_##SUF(s, r, nk);                                                                        \
}                                                                                                     \
void px_fwd_##SUF(T *s, T *sc, const T *q, const T *k, const T *e, const T *mask, int64_t msg,      \
                  int64_t msi, int64_t rep, T *aux, T *shift, T *rinv, int64_t cg0, int64_t g0,      \
                  int64_t g1, int64_t nq, int64_t nk, int64_t d, T om2, T c, T s2) {                \
    for (int64_t g = g0; g < g1; ++g) {                                                               \
        const T top = head_setup_##SUF(k, e, aux, g, nk, d, s2);                                      \
        const T *kn = aux + g * 2 * nk, *kb = kn + nk;                                               \
        const T *mg = mask ? mask + (g / rep) * msg : NULL;                                           \
        for (int64_t i = 0; i < nq; ++i) {                                                            \
            const int64_t r = g * nq + i, at = ((g - cg0) * nq + i) * nk;                             \
            row_weights_##SUF(s + at, sc ? sc + at : NULL, q + r * d, kn, kb, mg ? mg + i * msi : NULL, \
                              top, shift + r, rinv + r, nk, d, om2, c);                                 \
        }                                                                                             \
    }                                                                                                 \
}                                                                                                     \
                                                                                                      \
/* dL_j = P_j (dP_j - delta), E_j = dL_j sinc_j (over dP_j), column sums; returns E_j */              \
INLINE T grad_entry_##SUF(const T *pr, const T *sr, T *dr, T *csg, T *dlg, T delta, int64_t j) {      \
    T dl = pr[j] * (dr[j] - delta);                                                                   \
    dl = (dl >= TINY || dl <= -TINY) ? dl : 0;                                                        \
    T ej = dl * sr[j];                                                                                \
    ej = (ej >= TINY || ej <= -TINY) ? ej : 0;                                                        \
    dr[j] = ej;                                                                                       \
    csg[j] += ej;                                                                                     \
    dlg[j] += dl;                                                                                     \
    return ej;                                                                                        \
}                                                                                                     \
/* the backward's recompute fused with grad_entry: P_j from S_j (over s_j, with the forward's         \
 * shift and r), sin(theta)/theta used at once (not stored) */                                        \
INLINE T recompute_entry_##SUF(T *s, T *dr, T *csg, T *dlg, const T *kn, const T *kb, const T *mr,    \
                               T base, T om2, T m2, T c, T shift, T r, T delta, int64_t j,            \
                               const int MASKED) {                                                    \
    T t2 = base + om2 * kn[j] + m2 * s[j];                                                            \
    t2 = t2 > TH_TINY ? t2 : TH_TINY;                                                                 \
    const T th = sqrt(t2);                                                                            \
    T sn, cs;                                                                                         \
    SINCOS(th, &sn, &cs);                                                                             \
    const T x = c * cs + (MASKED ? kb[j] + mr[j] : kb[j]) - shift;                                    \
    T p = EXP(x) * r;                                                                                 \
    p = p >= TINY ? p : 0;                                                                            \
    s[j] = p;                                                                                         \
    T dl = p * (dr[j] - delta);                                                                       \
    dl = (dl >= TINY || dl <= -TINY) ? dl : 0;                                                        \
    T ej = dl * (sn / th);                                                                            \
    ej = (ej >= TINY || ej <= -TINY) ? ej : 0;                                                        \
    dr[j] = ej;                                                                                       \
    csg[j] += ej;                                                                                     \
    dlg[j] += dl;                                                                                     \
    return ej;                                                                                        \
}                                                                                                     \
                                                                                                      \
/* one row of the recomputing backward; returns sum_j E_j */                                          \
INLINE T recompute_row_##SUF(T *s, T *dr, T *csg, T *dlg, const T *kn, const T *kb, const T *mr,      \
                             T base, T om2, T c, T shift, T r, T delta, int64_t nk, const int MASKED) {\
    const T m2 = (T)-2 * om2;                                                                         \
    T acc[LANES(T)];                                                                                  \
    for (int l = 0; l < LANES(T); ++l) acc[l] = 0;                                                    \
    int64_t j = 0;                                                                                    \
    for (; j + LANES(T) <= nk; j += LANES(T)) {                                                       \
        _Pragma("omp simd")                                                                           \
        for (int l = 0; l < LANES(T); ++l)                                                            \
            acc[l] += recompute_entry_##SUF(s, dr, csg, dlg, kn, kb, mr, base, om2, m2, c, shift, r, delta,\
                                            j + l, MASKED);                                           \
    }                                                                                                 \
    for (int l = 0; j + l < nk; ++l)                                                                  \
        acc[l] += recompute_entry_##SUF(s, dr, csg, dlg, kn, kb, mr, base, om2, m2, c, shift, r, delta,\
                                        j + l, MASKED);                                               \
    return tree_sum_##SUF(acc);                                                                       \
}                                                                                                     \
void px_bwd_##SUF(T *s, T *sc, T *dp, int recompute, const T *q, const T *dout, const T *out,       \
                  int64_t dv, const T *mask, int64_t msg, int64_t msi, int64_t rep, const T *aux,    \
                  T *shift, T *rinv, T *rs, T *cs, T *dls, int64_t cg0, int64_t g0,                  \
                  int64_t g1, int64_t nq, int64_t nk, int64_t d, T om2, T c) {                      \
    for (int64_t g = g0; g < g1; ++g) {                                                               \
        const T *kn = aux + g * 2 * nk, *kb = kn + nk;                                               \
        const T *mg = mask ? mask + (g / rep) * msg : NULL;                                           \
        T *csg = cs + g * nk, *dlg = dls + g * nk;                                                    \
        memset(csg, 0, sizeof(T) * (size_t)nk);                                                       \
        memset(dlg, 0, sizeof(T) * (size_t)nk);                                                       \
        for (int64_t i = 0; i < nq; ++i) {                                                            \
            const int64_t r = g * nq + i, at = ((g - cg0) * nq + i) * nk;                             \
            T *pr = s + at, *sr = sc ? sc + at : NULL, *dr = dp + at;                                 \
            if (rinv[r] == 0) { /* no admissible key: P = 0, E = 0 */                                 \
                if (recompute) memset(pr, 0, sizeof(T) * (size_t)nk);                                 \
                memset(dr, 0, sizeof(T) * (size_t)nk);                                                \
                rs[r] = 0;                                                                            \
                continue;                                                                             \
            }                                                                                         \
            const T *dor = dout + r * dv, *orow = out + r * dv;                                       \
            const T delta = dot_##SUF(dor, orow, dv);                                                 \
            if (recompute) {                                                                          \
                const T *mr = mg ? mg + i * msi : NULL;                                               \
                const T base = om2 * dot_##SUF(q + r * d, q + r * d, d);                              \
                rs[r] = mr ? recompute_row_##SUF(pr, dr, csg, dlg, kn, kb, mr, base, om2, c, shift[r], rinv[r], \
                                                 delta, nk, 1)                                        \
                           : recompute_row_##SUF(pr, dr, csg, dlg, kn, kb, mr, base, om2, c, shift[r], rinv[r], \
                                                 delta, nk, 0);                                       \
                continue;                                                                             \
            }                                                                                         \
            T acc[LANES(T)];                                                                          \
            for (int l = 0; l < LANES(T); ++l) acc[l] = 0;                                            \
            int64_t j = 0;                                                                            \
            for (; j + LANES(T) <= nk; j += LANES(T)) {                                               \
                _Pragma("omp simd")                                                                   \
                for (int l = 0; l < LANES(T); ++l)                                                    \
                    acc[l] += grad_entry_##SUF(pr, sr, dr, csg, dlg, delta, j + l);                   \
            }                                                                                         \
            for (int l = 0; j + l < nk; ++l) acc[l] += grad_entry_##SUF(pr, sr, dr, csg, dlg, delta, j + l);\
            const T rsum = tree_sum_##SUF(acc);                                                       \
            rs[r] = rsum;                                                                             \
        }                                                                                             \
    }                                                                                                 \
}                                                                                                     \
                                                                                                      \
void px_fin_##SUF(T *dq, const T *q, const T *rs, T *dk, const T *k, const T *cs, const T *dls,     \
                  int64_t g0, int64_t g1, int64_t nq, int64_t nk, int64_t d, T coef, T s) {         \
    for (int64_t g = g0; g < g1; ++g) {                                                               \
        if (dq) {                                                                                     \
            for (int64_t i = g * nq; i < (g + 1) * nq; ++i) {                                         \
                const T a = rs[i];                                                                    \
                T *x = dq + i * d;                                                                    \
                const T *y = q + i * d;                                                               \
                _Pragma("omp simd")                                                                   \
                for (int64_t t = 0; t < d; ++t) x[t] = coef * (x[t] - a * y[t]);                      \
            }                                                                                         \
        }                                                                                             \
        if (dk) {                                                                                     \
            for (int64_t j = g * nk; j < (g + 1) * nk; ++j) {                                         \
                const T a = cs[j], b = s * dls[j];                                                    \
                T *x = dk + j * d;                                                                    \
                const T *y = k + j * d;                                                               \
                _Pragma("omp simd")                                                                   \
                for (int64_t t = 0; t < d; ++t) x[t] = coef * (x[t] - a * y[t]) + b * y[t];           \
            }                                                                                         \
        }                                                                                             \
    }                                                                                                 \
}

PERIODIC(float, f32, attnopt_pexpf, sincos_f32, FLT_MIN, 1e-30f)
PERIODIC(double, f64, pexpd, sincos_f64, DBL_MIN, 1e-30)

/* sin and cos of x[0, n), exp of -x[0, n) (for tests against torch.sin / cos / exp) */
void px_sincos_f32(const float *x, float *sn, float *cs, int64_t n) {
    #pragma omp simd
    for (int64_t j = 0; j < n; ++j) sincos_f32(x[j], sn + j, cs + j);
}

void px_sincos_f64(const double *x, double *sn, double *cs, int64_t n) {
    #pragma omp simd
    for (int64_t j = 0; j < n; ++j) sincos_f64(x[j], sn + j, cs + j);
}

void px_expneg_f64(const double *x, double *e, int64_t n) {
    #pragma omp simd
    for (int64_t j = 0; j < n; ++j) e[j] = pexpd(-x[j]);
}
