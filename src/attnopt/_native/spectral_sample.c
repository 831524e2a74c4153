/* The implicit spectral densities' sampler (attnopt.nn._spectral_native): every point set's
 * forward in one call and its whole backward (parameter gradients included) in another.
 *
 * Per set s (NN(x) = W_b tanh(W_a x + b_a) + b_b, weights row-major (out, in) as nn.Linear):
 *   [mu, rho] = NN_1(h),  ls = clamp(rho, -10, 5),  sig = exp(ls),
 *   z = mu + sig * e  (e = the base noise, or L~ eps along the heads with the copula),
 *   w+ = sign(z) * (scale |z| + NN_2(|z|)),  points [w+ || -w+],
 *   kl[b] = (half / 2) sum_{s, head, k} (sig^2 + mu^2 - 1 - 2 ls)  -  (d half S) sum_m log L~_mm.
 * The backward is the closed form of attnopt.nn._spectral_fused._SpectralSample.backward.
 *
 * Sizes are tiny (S <= 3 sets, M = B H rows, d = 64, hidden 32, half = R/2 base points): the
 * time is in the small matrix products, done by one register-blocked kernel (gemm below).
 * float32's tanh is a rational approximation (max error ~6 ulp, vectorizable); float64's
 * and the exponentials are libm's. One thread; the same file is compiled for float and double
 * (it includes itself).
 */
#ifndef SS_T

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define SS_MIN (-10.0)
#define SS_MAX 5.0
#ifndef SS_RB
#define SS_RB 8 /* rows per register block */
#endif

/* tanh in float32: Eigen's rational approximation on [-7.905, 7.905] (NaN kept) */
static inline float ss_tanh_f32(float x) {
    const float c = 7.90531110763549805f;
    const float xc = x > c ? c : (x < -c ? -c : x);
    const float x2 = xc * xc;
    float p = -2.76076847742355e-16f;
    p = p * x2 + 2.00018790482477e-13f;
    p = p * x2 + -8.60467152213735e-11f;
    p = p * x2 + 5.12229709037114e-08f;
    p = p * x2 + 1.48572235717979e-05f;
    p = p * x2 + 6.37261928875436e-04f;
    p = p * x2 + 4.89352455891786e-03f;
    float q = 1.19825839466702e-06f;
    q = q * x2 + 1.18534705686654e-04f;
    q = q * x2 + 2.26843463243900e-03f;
    q = q * x2 + 4.89352518554385e-03f;
    const float r = p * xc / q;
    return (x < 4e-4f && x > -4e-4f) ? x : r;
}

static inline double ss_tanh_f64(double x) { return tanh(x); }

/* tanh of n floats in place (for the tests) */
void ss_tanh_test_f32(float *x, int64_t n) {
    #pragma omp simd
    for (int64_t i = 0; i < n; ++i) x[i] = ss_tanh_f32(x[i]);
}

#define SS_T float
#define SS_F(name) name##_f32
#define SS_TANH ss_tanh_f32
#define SS_EXP expf
#define SS_LOG logf
#define SS_SQRT sqrtf
#define SS_JB 16
#define SS_FMA __builtin_fmaf
#include __FILE__
#undef SS_T
#undef SS_F
#undef SS_TANH
#undef SS_EXP
#undef SS_LOG
#undef SS_SQRT
#undef SS_JB
#undef SS_FMA

#define SS_T double
#define SS_F(name) name##_f64
#define SS_TANH ss_tanh_f64
#define SS_EXP exp
#define SS_LOG log
#define SS_SQRT sqrt
#define SS_JB 8
#define SS_FMA __builtin_fma
#include __FILE__

#else /* the body, once per type */

#define T SS_T

/* Columns [j0, j0 + W) of Y (rows x out, row stride ldy) = [Y or bias or 0] + X B, with
 * X(r, k) = x[r xr + k xk] and B (in x out) row-major: blocks of 4 rows x W columns held in
 * registers (W a compile-time constant: 8 independent FMA chains for W = 2 vectors). */
static inline __attribute__((always_inline)) void SS_F(gemm_cols)(
        int64_t rows, int64_t in, int64_t out, const T *x, int64_t xr, int64_t xk, const T *b,
        const T *bias, T *y, int64_t ldy, int acc, int64_t j0, const int W) {
    int64_t r = 0;
    for (; r + SS_RB <= rows; r += SS_RB) {
        T a[SS_RB][W];
        #pragma omp simd
        for (int j = 0; j < W; ++j) {
            const T init = bias ? bias[j0 + j] : (T)0;
            for (int i = 0; i < SS_RB; ++i) a[i][j] = acc ? y[(r + i) * ldy + j0 + j] : init;
        }
        const T *x0 = x + r * xr;
        for (int64_t k = 0; k < in; ++k) {
            const T *bk = b + k * out + j0;
            T v[SS_RB];
            for (int i = 0; i < SS_RB; ++i) v[i] = x0[i * xr + k * xk];
            #pragma omp simd
            for (int j = 0; j < W; ++j)
                for (int i = 0; i < SS_RB; ++i) a[i][j] = SS_FMA(v[i], bk[j], a[i][j]);
        }
        #pragma omp simd
        for (int j = 0; j < W; ++j)
            for (int i = 0; i < SS_RB; ++i) y[(r + i) * ldy + j0 + j] = a[i][j];
    }
    for (; r < rows; ++r) {
        T a0[W];
        T *y0 = y + r * ldy + j0;
        #pragma omp simd
        for (int j = 0; j < W; ++j) a0[j] = acc ? y0[j] : (bias ? bias[j0 + j] : (T)0);
        const T *x0 = x + r * xr;
        for (int64_t k = 0; k < in; ++k) {
            const T *bk = b + k * out + j0;
            const T v0 = x0[k * xk];
            #pragma omp simd
            for (int j = 0; j < W; ++j) a0[j] = SS_FMA(v0, bk[j], a0[j]);
        }
        #pragma omp simd
        for (int j = 0; j < W; ++j) y0[j] = a0[j];
    }
}

/* Y (rows x out, row stride ldy) = [Y (acc) or bias or 0] + X B, X(r, k) = x[r xr + k xk],
 * B (in x out) row-major. */
static void SS_F(gemm)(int64_t rows, int64_t in, int64_t out, const T *x, int64_t xr, int64_t xk,
                       const T *b, const T *bias, T *y, int64_t ldy, int acc) {
    int64_t j0 = 0;
    for (; j0 + 2 * SS_JB <= out; j0 += 2 * SS_JB)
        SS_F(gemm_cols)(rows, in, out, x, xr, xk, b, bias, y, ldy, acc, j0, 2 * SS_JB);
    for (; j0 + SS_JB <= out; j0 += SS_JB)
        SS_F(gemm_cols)(rows, in, out, x, xr, xk, b, bias, y, ldy, acc, j0, SS_JB);
    if (j0 < out) { /* the columns left over (sizes not a multiple of the block) */
        for (int64_t r = 0; r < rows; ++r) {
            T *yr = y + r * ldy;
            const T *xrow = x + r * xr;
            for (int64_t j = j0; j < out; ++j) yr[j] = acc ? yr[j] : (bias ? bias[j] : (T)0);
            for (int64_t k = 0; k < in; ++k) {
                const T v = xrow[k * xk];
                const T *bk = b + k * out;
                for (int64_t j = j0; j < out; ++j) yr[j] = SS_FMA(v, bk[j], yr[j]);
            }
        }
    }
}

/* dst (cols x rows) = src (rows x cols) transposed: contiguous stores, strided (gathered) loads */
static void SS_F(transpose)(const T *src, int64_t rows, int64_t cols, T *dst) {
    for (int64_t j = 0; j < cols; ++j) {
        T *dj = dst + j * rows;
        #pragma omp simd
        for (int64_t i = 0; i < rows; ++i) dj[i] = src[i * cols + j];
    }
}

/* out[j] = sum_r x[r, j] for x (rows x cols) */
static void SS_F(colsum)(const T *x, int64_t rows, int64_t cols, T *out) {
    for (int64_t j = 0; j < cols; ++j) out[j] = 0;
    for (int64_t r = 0; r < rows; ++r) {
        const T *xr = x + r * cols;
        #pragma omp simd
        for (int64_t j = 0; j < cols; ++j) out[j] += xr[j];
    }
}

static inline T SS_F(clampls)(T rho) { return rho < (T)SS_MIN ? (T)SS_MIN : (rho > (T)SS_MAX ? (T)SS_MAX : rho); }

static inline T SS_F(sgn)(T v) { return (T)((v > 0) - (v < 0)); }

/* L = tril(raw, -1) + diag(exp(diag raw)), L~ = its rows at unit norm; returns sum_m log L~_mm */
static T SS_F(copula)(const T *raw, int64_t H, T *low, T *fac) {
    T logdiag = 0;
    for (int64_t m = 0; m < H; ++m) {
        T nrm = 0;
        for (int64_t j = 0; j < H; ++j) {
            const T v = j < m ? raw[m * H + j] : (j == m ? SS_EXP(raw[m * H + m]) : (T)0);
            low[m * H + j] = v;
            nrm += v * v;
        }
        nrm = SS_SQRT(nrm);
        for (int64_t j = 0; j < H; ++j) fac[m * H + j] = low[m * H + j] / nrm;
        logdiag += SS_LOG(fac[m * H + m]);
    }
    return logdiag;
}

/* Workspace per set, in this order: t1 (M hid), o1 (M 2d), sig (M d), z (R d), t2 (R hid),
 * e (R d, with the copula only); R = M half. Then low and L~ (H H each) with the copula. */
static int64_t SS_F(set_stride)(int64_t M, int64_t half, int64_t d, int64_t hid, int cop) {
    const int64_t R = M * half;
    return M * hid + M * 2 * d + M * d + R * d + R * hid + (cop ? R * d : 0);
}

/* The head summaries from the keys (B H, N, d) contiguous: h = (sum_n keys_n) / N, the sum in
 * order n = 0, 1, ... (as torch's sum over that dim at the sizes models train at; then the division). */
static void SS_F(key_mean)(const T *keys, int64_t M, int64_t N, int64_t d, T *h) {
    for (int64_t row = 0; row < M; ++row) {
        T *hr = h + row * d;
        const T *kr = keys + row * N * d;
        for (int64_t k = 0; k < d; ++k) hr[k] = 0;
        for (int64_t n = 0; n < N; ++n) {
            #pragma omp simd
            for (int64_t k = 0; k < d; ++k) hr[k] += kr[n * d + k];
        }
        #pragma omp simd
        for (int64_t k = 0; k < d; ++k) hr[k] /= (T)N;
    }
}

/* Forward. h (B H, d) contiguous, or keys (B H, N, d) contiguous when N > 0 (h = the keys' mean,
 * written to hbuf (B H, d)); noise element (s, b, m, n, k) at noise[s ns + b nb + m nh + n d + k];
 * raw (H, H) or NULL; params: 8 S addresses (W1a, b1a, W1b, b1b, W2a, b2a, W2b, b2b per set,
 * contiguous); scales (S). Out: pts (B H, S, 2, half, d), kl (B), kl_mean (its batch mean) unless
 * NULL, ws (S set_stride + 2 H H). Returns 0, or -1 when out of memory. */
int SS_F(ss_fwd)(int64_t S, int64_t B, int64_t H, int64_t half, int64_t d, int64_t hid, const T *h,
                 int64_t N, T *hbuf, const T *noise, int64_t ns, int64_t nb, int64_t nh, const T *raw,
                 const int64_t *params, const double *scales, T *pts, T *kl, T *kl_mean, T *ws) {
    const int64_t M = B * H, R = M * half;
    if (N > 0) {
        SS_F(key_mean)(h, M, N, d, hbuf);
        h = hbuf;
    }
    const int cop = raw != NULL;
    const int64_t stride = SS_F(set_stride)(M, half, d, hid, cop);
    T *low = ws + S * stride, *fac = low + H * H;
    T *scratch = malloc(sizeof(T) * (size_t)(d * hid + hid * 2 * d + d * hid + hid * d + 2 * R * d + 1));
    if (!scratch) return -1;
    T *w1at = scratch, *w1bt = w1at + d * hid, *w2at = w1bt + hid * 2 * d, *w2bt = w2at + d * hid;
    T *abs_z = w2bt + hid * d, *inner = abs_z + R * d;
    const T logdiag = cop ? SS_F(copula)(raw, H, low, fac) : (T)0;
    for (int64_t b = 0; b < B; ++b) kl[b] = 0;
    for (int64_t s = 0; s < S; ++s) {
        const T *w1a = (const T *)(intptr_t)params[8 * s], *b1a = (const T *)(intptr_t)params[8 * s + 1];
        const T *w1b = (const T *)(intptr_t)params[8 * s + 2], *b1b = (const T *)(intptr_t)params[8 * s + 3];
        const T *w2a = (const T *)(intptr_t)params[8 * s + 4], *b2a = (const T *)(intptr_t)params[8 * s + 5];
        const T *w2b = (const T *)(intptr_t)params[8 * s + 6], *b2b = (const T *)(intptr_t)params[8 * s + 7];
        const T scale = (T)scales[s];
        T *t1 = ws + s * stride, *o1 = t1 + M * hid, *sig = o1 + M * 2 * d, *z = sig + M * d;
        T *t2 = z + R * d, *e = cop ? t2 + R * hid : NULL;
        SS_F(transpose)(w1a, hid, d, w1at);
        SS_F(transpose)(w1b, 2 * d, hid, w1bt);
        SS_F(transpose)(w2a, hid, d, w2at);
        SS_F(transpose)(w2b, d, hid, w2bt);
        SS_F(gemm)(M, d, hid, h, d, 1, w1at, b1a, t1, hid, 0);
        #pragma omp simd
        for (int64_t i = 0; i < M * hid; ++i) t1[i] = SS_TANH(t1[i]);
        SS_F(gemm)(M, hid, 2 * d, t1, hid, 1, w1bt, b1b, o1, 2 * d, 0);
        for (int64_t b = 0; b < B; ++b) {
            T acc = 0;
            for (int64_t m = 0; m < H; ++m) {
                const int64_t row = b * H + m;
                const T *mu = o1 + row * 2 * d, *rho = mu + d;
                T *sg = sig + row * d;
                for (int64_t k = 0; k < d; ++k) {
                    const T ls = SS_F(clampls)(rho[k]);
                    sg[k] = SS_EXP(ls);
                    acc += sg[k] * sg[k] + mu[k] * mu[k] - (T)1 - (T)2 * ls;
                }
                /* the base noise of this row: e = L~ eps along the heads with the copula */
                const T *er;
                if (cop) {
                    T *dst = e + row * half * d;
                    for (int64_t i = 0; i < half * d; ++i) dst[i] = 0;
                    for (int64_t j = 0; j <= m; ++j) {
                        const T f = fac[m * H + j];
                        const T *src = noise + s * ns + b * nb + j * nh;
                        #pragma omp simd
                        for (int64_t i = 0; i < half * d; ++i) dst[i] += f * src[i];
                    }
                    er = dst;
                } else {
                    er = noise + s * ns + b * nb + m * nh;
                }
                T *zr = z + row * half * d, *ar = abs_z + row * half * d;
                for (int64_t n = 0; n < half; ++n) {
                    #pragma omp simd
                    for (int64_t k = 0; k < d; ++k) {
                        const T v = mu[k] + sg[k] * er[n * d + k];
                        zr[n * d + k] = v;
                        ar[n * d + k] = v < 0 ? -v : v;
                    }
                }
            }
            kl[b] += (T)0.5 * (T)half * acc;
        }
        SS_F(gemm)(R, d, hid, abs_z, d, 1, w2at, b2a, t2, hid, 0);
        #pragma omp simd
        for (int64_t i = 0; i < R * hid; ++i) t2[i] = SS_TANH(t2[i]);
        SS_F(gemm)(R, hid, d, t2, hid, 1, w2bt, b2b, inner, d, 0);
        for (int64_t r = 0; r < R; ++r) {
            const int64_t row = r / half, n = r % half;
            T *p0 = pts + ((row * S + s) * 2 * half + n) * d, *p1 = p0 + half * d;
            const T *zr = z + r * d, *ir = inner + r * d, *ar = abs_z + r * d;
            #pragma omp simd
            for (int64_t k = 0; k < d; ++k) {
                const T v = SS_F(sgn)(zr[k]) * (ir[k] + scale * ar[k]);
                p0[k] = v;
                p1[k] = -v;
            }
        }
    }
    if (cop) {
        const T term = (T)(d * half * S) * logdiag;
        for (int64_t b = 0; b < B; ++b) kl[b] -= term;
    }
    if (kl_mean) { /* the batch mean: the sum in order, then the division */
        T sum = 0;
        for (int64_t b = 0; b < B; ++b) sum += kl[b];
        *kl_mean = sum / (T)B;
    }
    free(scratch);
    return 0;
}

/* Backward. The forward's arguments and workspace (h: the summaries, hbuf in keys mode); gpts
 * (B H, S, 2, half, d) contiguous, gkl (B) with element b at gkl[b gks] / gdiv (gdiv = B for the
 * KL's batch mean, 1 otherwise). Out: dh (B H, d) or NULL; with N > 0, dkeys (B H, N, d) the keys'
 * gradient through the mean, dh / N on every key (added to dkeys when acc, else written; dh may
 * then be NULL); dnoise (S, B, H, half, d) contiguous or NULL (the gradient of the noise as
 * broadcast to that shape); draw (H, H) or NULL (copula only); gparams: 8 S addresses of contiguous
 * gradients, written. Returns 0, or -1 when out of memory. */
int SS_F(ss_bwd)(int64_t S, int64_t B, int64_t H, int64_t half, int64_t d, int64_t hid, const T *h,
                 const T *noise, int64_t ns, int64_t nb, int64_t nh, const T *raw, const int64_t *params,
                 const double *scales, const T *ws, const T *gpts, const T *gkl, int64_t gks, int64_t gdiv,
                 T *dh, int64_t N, T *dkeys, int acc, T *dnoise, T *draw, const int64_t *gparams) {
    const int64_t M = B * H, R = M * half;
    const int cop = raw != NULL;
    const int own_dh = N > 0 && dkeys && !dh; /* dh only on the way to the keys: in the scratch */
    const int64_t stride = SS_F(set_stride)(M, half, d, hid, cop);
    const T *low = ws + S * stride, *fac = low + H * H;
    T *scratch = malloc(sizeof(T) * (size_t)(3 * R * d + R * hid + M * 2 * d + M * hid + d + H * H + 1
                                             + (own_dh ? M * d : 0)));
    if (!scratch) return -1;
    T *gi = scratch, *abs_z = gi + R * d, *dz = abs_z + R * d, *du2 = dz + R * d, *do1 = du2 + R * hid;
    T *du1 = do1 + M * 2 * d, *dsum = du1 + M * hid, *dfac = dsum + d;
    if (own_dh) dh = dfac + H * H;
    if (dh)
        for (int64_t i = 0; i < M * d; ++i) dh[i] = 0;
    if (dnoise)
        for (int64_t i = 0; i < S * R * d; ++i) dnoise[i] = 0;
    const int need_de = dnoise != NULL || draw != NULL;
    T gsum = 0;
    for (int64_t b = 0; b < B; ++b) gsum += gkl[b * gks] / (T)gdiv;
    for (int64_t i = 0; i < H * H; ++i) dfac[i] = 0;
    for (int64_t s = 0; s < S; ++s) {
        const T *w1a = (const T *)(intptr_t)params[8 * s], *w1b = (const T *)(intptr_t)params[8 * s + 2];
        const T *w2a = (const T *)(intptr_t)params[8 * s + 4], *w2b = (const T *)(intptr_t)params[8 * s + 6];
        T *dw1a = (T *)(intptr_t)gparams[8 * s], *db1a = (T *)(intptr_t)gparams[8 * s + 1];
        T *dw1b = (T *)(intptr_t)gparams[8 * s + 2], *db1b = (T *)(intptr_t)gparams[8 * s + 3];
        T *dw2a = (T *)(intptr_t)gparams[8 * s + 4], *db2a = (T *)(intptr_t)gparams[8 * s + 5];
        T *dw2b = (T *)(intptr_t)gparams[8 * s + 6], *db2b = (T *)(intptr_t)gparams[8 * s + 7];
        const T scale = (T)scales[s];
        const T *t1 = ws + s * stride, *o1 = t1 + M * hid, *sig = o1 + M * 2 * d, *z = sig + M * d;
        const T *t2 = z + R * d, *e = cop ? t2 + R * hid : NULL;
        /* d inner = (g+ - g-) sign z; |z| again */
        for (int64_t r = 0; r < R; ++r) {
            const int64_t row = r / half, n = r % half;
            const T *g0 = gpts + ((row * S + s) * 2 * half + n) * d, *g1 = g0 + half * d;
            const T *zr = z + r * d;
            T *gr = gi + r * d, *ar = abs_z + r * d;
            #pragma omp simd
            for (int64_t k = 0; k < d; ++k) {
                gr[k] = (g0[k] - g1[k]) * SS_F(sgn)(zr[k]);
                ar[k] = zr[k] < 0 ? -zr[k] : zr[k];
            }
        }
        /* NN_2: dW2b = gi^T t2, db2b = sum gi, dt2 = gi W2b, du2 = dt2 (1 - t2^2) */
        SS_F(colsum)(gi, R, d, db2b);
        SS_F(gemm)(d, R, hid, gi, 1, d, t2, NULL, dw2b, hid, 0);
        SS_F(gemm)(R, d, hid, gi, d, 1, w2b, NULL, du2, hid, 0);
        #pragma omp simd
        for (int64_t i = 0; i < R * hid; ++i) du2[i] = du2[i] - du2[i] * t2[i] * t2[i];
        SS_F(colsum)(du2, R, hid, db2a);
        SS_F(gemm)(hid, R, d, du2, 1, hid, abs_z, NULL, dw2a, d, 0);
        /* da = du2 W2a + scale gi, dz = da sign z */
        SS_F(gemm)(R, hid, d, du2, hid, 1, w2a, NULL, dz, d, 0);
        #pragma omp simd
        for (int64_t i = 0; i < R * d; ++i) dz[i] = (dz[i] + scale * gi[i]) * SS_F(sgn)(z[i]);
        /* NN_1's outputs: dmu = sum_n dz + half gk mu, dls = (sum_n dz e + half gk sig) sig - half gk */
        for (int64_t row = 0; row < M; ++row) {
            const int64_t b = row / H, m = row % H;
            const T gk = (T)half * (gkl[b * gks] / (T)gdiv);
            const T *mu = o1 + row * 2 * d, *rho = mu + d, *sg = sig + row * d;
            const T *dzr = dz + row * half * d;
            const T *er = cop ? e + row * half * d : noise + s * ns + b * nb + m * nh;
            T *dmu = do1 + row * 2 * d, *dls = dmu + d;
            for (int64_t k = 0; k < d; ++k) {
                dmu[k] = 0;
                dsum[k] = 0;
            }
            for (int64_t n = 0; n < half; ++n) {
                #pragma omp simd
                for (int64_t k = 0; k < d; ++k) {
                    dmu[k] += dzr[n * d + k];
                    dsum[k] += dzr[n * d + k] * er[n * d + k];
                }
            }
            #pragma omp simd
            for (int64_t k = 0; k < d; ++k) {
                const T ls = SS_F(clampls)(rho[k]);
                dmu[k] += gk * mu[k];
                dls[k] = ((dsum[k] + gk * sg[k]) * sg[k] - gk) * (T)(ls == rho[k]);
            }
            if (!need_de) continue;
            /* de = dz sig; with the copula (e = L~ eps): d eps = L~^T de, dL~ = sum de eps^T */
            T *de = abs_z + row * half * d; /* |z| of this row is no longer needed */
            for (int64_t n = 0; n < half; ++n) {
                #pragma omp simd
                for (int64_t k = 0; k < d; ++k) de[n * d + k] = dzr[n * d + k] * sg[k];
            }
            if (!cop) {
                T *dst = dnoise + (s * M + row) * half * d;
                for (int64_t i = 0; i < half * d; ++i) dst[i] = de[i];
                continue;
            }
            for (int64_t j = 0; j <= m; ++j) {
                const T *epsj = noise + s * ns + b * nb + j * nh;
                if (draw) {
                    T acc = 0;
                    #pragma omp simd reduction(+ : acc)
                    for (int64_t i = 0; i < half * d; ++i) acc += de[i] * epsj[i];
                    dfac[m * H + j] += acc;
                }
                if (dnoise) {
                    const T f = fac[m * H + j];
                    T *dst = dnoise + (s * M + b * H + j) * half * d;
                    #pragma omp simd
                    for (int64_t i = 0; i < half * d; ++i) dst[i] += f * de[i];
                }
            }
        }
        /* NN_1: dW1b = do1^T t1, db1b, dt1 = do1 W1b, du1 = dt1 (1 - t1^2), dW1a = du1^T h, dh += du1 W1a */
        SS_F(colsum)(do1, M, 2 * d, db1b);
        SS_F(gemm)(2 * d, M, hid, do1, 1, 2 * d, t1, NULL, dw1b, hid, 0);
        SS_F(gemm)(M, 2 * d, hid, do1, 2 * d, 1, w1b, NULL, du1, hid, 0);
        #pragma omp simd
        for (int64_t i = 0; i < M * hid; ++i) du1[i] = du1[i] - du1[i] * t1[i] * t1[i];
        SS_F(colsum)(du1, M, hid, db1a);
        SS_F(gemm)(hid, M, d, du1, 1, hid, h, NULL, dw1a, d, 0);
        if (dh) SS_F(gemm)(M, hid, d, du1, hid, 1, w1a, NULL, dh, d, 1);
    }
    if (draw) {
        /* d log L~_mm = -(d half S) sum gkl; L~ = L / |L_m|: dL = (dL~ - L~ sum_k dL~_k L~_k) / |L_m|;
         * L_mm = exp(raw_mm) */
        const T gld = gsum * (T)(-(d * half * S));
        for (int64_t m = 0; m < H; ++m) {
            dfac[m * H + m] += gld / fac[m * H + m];
            T dot = 0, nrm = 0;
            for (int64_t j = 0; j < H; ++j) {
                dot += dfac[m * H + j] * fac[m * H + j];
                nrm += low[m * H + j] * low[m * H + j];
            }
            nrm = SS_SQRT(nrm);
            for (int64_t j = 0; j < H; ++j) {
                const T dl = (dfac[m * H + j] - fac[m * H + j] * dot) / nrm;
                draw[m * H + j] = j < m ? dl : (j == m ? dl * low[m * H + m] : (T)0);
            }
        }
    }
    if (N > 0 && dkeys) { /* the mean's backward: dh / N on every key (divided once per row: dsh) */
        T *dsh = gi; /* R d >= d entries of scratch, no longer needed */
        for (int64_t row = 0; row < M; ++row) {
            const T *dr = dh + row * d;
            T *kr = dkeys + row * N * d;
            #pragma omp simd
            for (int64_t k = 0; k < d; ++k) dsh[k] = dr[k] / (T)N;
            for (int64_t n = 0; n < N; ++n) {
                if (acc) {
                    #pragma omp simd
                    for (int64_t k = 0; k < d; ++k) kr[n * d + k] += dsh[k];
                } else {
                    #pragma omp simd
                    for (int64_t k = 0; k < d; ++k) kr[n * d + k] = dsh[k];
                }
            }
        }
    }
    free(scratch);
    return 0;
}

#undef T
#endif
