/* Exact CPU forward and backward of sparsemax and 1.5-entmax along contiguous rows.
 *
 * Python side: attnopt/functional/regularized/cpu.py (which documents the algorithm).
 * Entry points, for T = float (suffix f32) and T = double (suffix f64), on `rows` contiguous
 * rows of length n; every thread of a call runs the same call and claims runs of rows from the
 * shared counter *next (0 at the start):
 *
 *   entmax15_fwd_S(x, p, theta, status, next, rows, n, max_iter)
 *   sparsemax_fwd_S(x, p, theta, status, next, rows, n, max_iter)
 *   entmax15_bwd_S(p, g, out, next, rows, n)      out = s (g - <s, g>/<s, 1>),  s = sqrt(p)
 *   sparsemax_bwd_S(p, g, out, next, rows, n)     out = 1_S (g - mean_S g),     S = {p > 0}
 *
 * theta is the row's threshold relative to the row max m (sparsemax: p = [x - m - theta]+;
 * 1.5-entmax: p = [(x - m)/2 - theta]+^2). status[r]: 0 done, 1 the search did not settle
 * (the caller reruns the row on its own path), 2 NaN or +inf in the row.
 *
 * Sums run in T over blocks of BLK entries (vectorized: #pragma omp simd reduction) and are
 * carried across blocks in double, so a row's sums are accurate to a few T roundings.
 * This file includes itself once per type (SM_T undefined: the driver part below).
 */
#ifndef SM_T

#include <math.h>
#include <stdint.h>

#define BLK 256
#define CHUNK 16384 /* entries per claimed run of rows */
#define GUARD_ULPS 4096 /* 1.5-entmax: |sum p - 1| allowed to an exact threshold, in units of eps */
#define CAT2(a, b) a##_##b

/* Claim the next run of rows [r0, *r1) from the shared counter (returns r0; >= rows: none left).
 * Every thread of a call loops on it: a thread that is descheduled on a busy machine does not
 * hold the others up, and each row's result does not depend on which thread computed it. */
static inline int64_t claim(int64_t *next, int64_t rows, int64_t n, int64_t *r1) {
  int64_t step = n < CHUNK ? CHUNK / n : 1;
  int64_t r0 = __atomic_fetch_add(next, step, __ATOMIC_RELAXED);
  *r1 = r0 + step < rows ? r0 + step : rows;
  return r0;
}
#define CAT(a, b) CAT2(a, b)

#define SM_T float
#define SM_S f32
#define SM_EPS 1.1920928955078125e-07
#define SM_SQRT sqrtf
#include __FILE__
#undef SM_T
#undef SM_S
#undef SM_EPS
#undef SM_SQRT

#define SM_T double
#define SM_S f64
#define SM_EPS 2.220446049250313e-16
#define SM_SQRT sqrt
#include __FILE__
#undef SM_T
#undef SM_S
#undef SM_EPS
#undef SM_SQRT

#else /* the kernels, for one type SM_T */

#define T SM_T
#define FN(name) CAT(name, SM_S)

/* Row max and whether the row holds a NaN. */
static inline T FN(row_max)(const T *x, int64_t n, int *has_nan) {
  T m = -INFINITY;
  T nan = 0;
#pragma omp simd reduction(max : m) reduction(+ : nan)
  for (int64_t j = 0; j < n; ++j) {
    T v = x[j];
    m = v > m ? v : m;
    nan += v != v ? (T)1 : (T)0;
  }
  *has_nan = nan > 0;
  return m;
}

/* z = x - m written to z, and k, s1, s2 of [z - c]+. */
static inline void FN(shift_stats)(const T *x, T *z, int64_t n, T m, T c, double *k, double *s1, double *s2) {
  double K = 0, S1 = 0, S2 = 0;
  for (int64_t j0 = 0; j0 < n; j0 += BLK) {
    int64_t j1 = j0 + BLK < n ? j0 + BLK : n;
    T a = 0, b = 0, d = 0;
#pragma omp simd reduction(+ : a, b, d)
    for (int64_t j = j0; j < j1; ++j) {
      T zj = x[j] - m;
      z[j] = zj;
      T v = zj - c;
      v = v > 0 ? v : (T)0;
      a += v > 0 ? (T)1 : (T)0;
      b += v;
      d += v * v;
    }
    K += a;
    S1 += b;
    S2 += d;
  }
  *k = K, *s1 = S1, *s2 = S2;
}

/* k, s1, s2 of [z - c]+. */
static inline void FN(stats)(const T *z, int64_t n, T c, double *k, double *s1, double *s2) {
  double K = 0, S1 = 0, S2 = 0;
  for (int64_t j0 = 0; j0 < n; j0 += BLK) {
    int64_t j1 = j0 + BLK < n ? j0 + BLK : n;
    T a = 0, b = 0, d = 0;
#pragma omp simd reduction(+ : a, b, d)
    for (int64_t j = j0; j < j1; ++j) {
      T v = z[j] - c;
      v = v > 0 ? v : (T)0;
      a += v > 0 ? (T)1 : (T)0;
      b += v;
      d += v * v;
    }
    K += a;
    S1 += b;
    S2 += d;
  }
  *k = K, *s1 = S1, *s2 = S2;
}

static inline void FN(zero_row)(T *p, int64_t n) {
#pragma omp simd
  for (int64_t j = 0; j < n; ++j) p[j] = 0;
}

/* 1.5-entmax of one row, in z = x - m units: p = ([z - c]+ / 2)^2, c the root of
 * ||[z - c]+||^2 = 4 in [-2, 0]. Every pass evaluates (k, s1, s2) at a trial c and the closed
 * form c_S on its support S = {z > c}. c is exact, and accepted, when it is the closed form of
 * its own support: c was computed as the closed form of a support of the same size (the two
 * sets are nested, so they are equal), or c_S rounds to c (entries tied at the threshold);
 * |s2/4 - 1| <= GUARD rejects a closed form spoilt by rounding. The next trial is c_S, else
 * Newton's step, else bisection, always strictly inside the bracket [lo, hi] of the root. */
static int FN(entmax15_row)(const T *x, T *p, T *theta, int64_t n, int64_t max_iter) {
  int has_nan;
  T m = FN(row_max)(x, n, &has_nan);
  if (has_nan || m == INFINITY) return 2;
  if (m == -INFINITY) {
    FN(zero_row)(p, n);
    *theta = 0;
    return 0;
  }
  double k, s1, s2;
  T c = -2;
  FN(shift_stats)(x, p, n, m, c, &k, &s1, &s2);
  double lo = -2, hi = 0;  /* F(-2) >= 2 (the max entry alone), F(0) = 0 */
  double k_from = -1;      /* size of the support c is the closed form of, or -1 */
  for (int64_t it = 0; it < max_iter; ++it) {
    /* k >= 1: c < 0 and the max entry has z = 0 */
    double r = s2 * 0.25 - 1;
    double disc = s1 * s1 - k * (s2 - 4);
    double d = (s2 - 4) / (s1 + sqrt(disc > 0 ? disc : 0)); /* c_S - c: smaller root, no cancellation */
    double cs = c + d;
    if (fabs(r) <= GUARD_ULPS * SM_EPS && (k == k_from || (T)cs == c)) {
      /* the threshold is c + d, d at rounding level (s2 = 4 up to rounding), kept apart from c:
       * c alone is a T, too coarse for the normalization once the support is large */
      T dt = (T)d;
      T inv = (T)(1.0 / (s2 - 2 * d * s1 + k * d * d)); /* sum over S of (v - d)^2, = 4 to rounding */
#pragma omp simd
      for (int64_t j = 0; j < n; ++j) {
        T u = p[j] - c;
        T v = u - dt;
        v = u > 0 && v > 0 ? v : (T)0; /* the support stays S */
        p[j] = v * v * inv;
      }
      *theta = (T)(cs * 0.5);
      return 0;
    }
    if (r > 0) lo = c > lo ? c : lo;
    else hi = c < hi ? c : hi;
    double next = cs;
    k_from = k;
    if (!((T)next > lo && (T)next < hi && (T)next != c)) {
      double nrm = sqrt(s2);
      next = c + (nrm - 2) * nrm / s1;
      k_from = -1;
      if (!((T)next > lo && (T)next < hi && (T)next != c)) {
        next = 0.5 * (lo + hi);
        if (!((T)next > lo && (T)next < hi)) return 1; /* the bracket has no T inside it */
      }
    }
    c = (T)next;
    FN(stats)(p, n, c, &k, &s1, &s2);
  }
  return 1;
}

/* sparsemax of one row, z = x - m units: p = [z - t]+, t the root of sum [z - t]+ = 1 in
 * [-1, 0]. Michelot: t <- t + (s1 - 1)/k from the lower bound -1 (every iterate is one), the
 * closed form on the support {z > t}; exact once the support stops changing. */
static int FN(sparsemax_row)(const T *x, T *p, T *theta, int64_t n, int64_t max_iter) {
  int has_nan;
  T m = FN(row_max)(x, n, &has_nan);
  if (has_nan || m == INFINITY) return 2;
  if (m == -INFINITY) {
    FN(zero_row)(p, n);
    *theta = 0;
    return 0;
  }
  double k, s1, s2;
  T t = -1;
  FN(shift_stats)(x, p, n, m, t, &k, &s1, &s2);
  for (int64_t it = 0; it < max_iter; ++it) {
    T next = (T)(t + (s1 - 1) / k); /* k >= 1: the max entry (z = 0 > t) */
    double k2;
    if (next <= t) { /* no progress: rounding level, the support is final */
      next = t;
      k2 = k;
    } else {
      FN(stats)(p, n, next, &k2, &s1, &s2);
    }
    if (k2 == k) { /* exact: the threshold is next + (s1 - 1)/k, the correction at rounding level */
      double d = (s1 - 1) / k;
      T dt = (T)d;
#pragma omp simd
      for (int64_t j = 0; j < n; ++j) {
        T u = p[j] - next;
        T v = u - dt;
        p[j] = u > 0 && v > 0 ? v : (T)0;
      }
      *theta = (T)(next + d);
      return 0;
    }
    t = next;
    k = k2;
  }
  return 1;
}

void FN(entmax15_fwd)(const T *x, T *p, T *theta, int8_t *status, int64_t *next, int64_t rows, int64_t n,
                      int64_t max_iter) {
  for (int64_t r0, r1; (r0 = claim(next, rows, n, &r1)) < rows;)
    for (int64_t r = r0; r < r1; ++r)
      status[r] = (int8_t)FN(entmax15_row)(x + r * n, p + r * n, theta + r, n, max_iter);
}

void FN(sparsemax_fwd)(const T *x, T *p, T *theta, int8_t *status, int64_t *next, int64_t rows, int64_t n,
                       int64_t max_iter) {
  for (int64_t r0, r1; (r0 = claim(next, rows, n, &r1)) < rows;)
    for (int64_t r = r0; r < r1; ++r)
      status[r] = (int8_t)FN(sparsemax_row)(x + r * n, p + r * n, theta + r, n, max_iter);
}

void FN(entmax15_bwd)(const T *p, const T *g, T *out, int64_t *next, int64_t rows, int64_t n) {
  for (int64_t r0, r1; (r0 = claim(next, rows, n, &r1)) < rows;)
  for (int64_t r = r0; r < r1; ++r) {
    const T *pr = p + r * n, *gr = g + r * n;
    T *o = out + r * n;
    double W = 0, WG = 0;
    for (int64_t j0 = 0; j0 < n; j0 += BLK) {
      int64_t j1 = j0 + BLK < n ? j0 + BLK : n;
      T a = 0, b = 0;
#pragma omp simd reduction(+ : a, b)
      for (int64_t j = j0; j < j1; ++j) {
        T s = SM_SQRT(pr[j]);
        a += s;
        b += s * gr[j];
      }
      W += a;
      WG += b;
    }
    T q = (T)(W > 0 ? WG / W : 0);
#pragma omp simd
    for (int64_t j = 0; j < n; ++j) {
      T s = SM_SQRT(pr[j]);
      o[j] = s * gr[j] - s * q;
    }
  }
}

void FN(sparsemax_bwd)(const T *p, const T *g, T *out, int64_t *next, int64_t rows, int64_t n) {
  for (int64_t r0, r1; (r0 = claim(next, rows, n, &r1)) < rows;)
  for (int64_t r = r0; r < r1; ++r) {
    const T *pr = p + r * n, *gr = g + r * n;
    T *o = out + r * n;
    double K = 0, G = 0;
    for (int64_t j0 = 0; j0 < n; j0 += BLK) {
      int64_t j1 = j0 + BLK < n ? j0 + BLK : n;
      T a = 0, b = 0;
#pragma omp simd reduction(+ : a, b)
      for (int64_t j = j0; j < j1; ++j) {
        int in = pr[j] > 0;
        a += in ? (T)1 : (T)0;
        b += in ? gr[j] : (T)0;
      }
      K += a;
      G += b;
    }
    T q = (T)(K > 0 ? G / K : 0);
#pragma omp simd
    for (int64_t j = 0; j < n; ++j) o[j] = pr[j] > 0 ? gr[j] - q : (T)0;
  }
}

#undef T
#undef FN
#endif
