/* The L^p key magnitude of kernel attention (implicit-kernel-attention eq. 11), 1 <= p <= 2,
 * one pass per row: a = s*T^{2/p}/2 with T = sum_i |k_i|^p (clamped at cap), and with grad
 * u_i = |k_i|^{p-1} sign(k_i) (0 at k_i = 0) and c = s*T^{2/p-1} (0 where the clamp is active).
 * Same function as attnopt.functional.kernel._fourier_c._magnitude's PyTorch path, to rounding.
 * mode: 0 general p (pow), 1 p = 1, 2 p = 1.5 (sqrt), 3 p = 2. */
#include <math.h>
#include <stdint.h>

#include "lp_body.h"

void lp_magnitude_f32(const float *k, int64_t rows, int64_t d, int mode, double p, double scale,
                      double cap, float *a, float *u, float *c) {
    lp_rows_f32(k, rows, d, mode, p, scale, cap, a, u, c);
}

void lp_magnitude_f64(const double *k, int64_t rows, int64_t d, int mode, double p, double scale,
                      double cap, double *a, double *u, double *c) {
    lp_rows_f64(k, rows, d, mode, p, scale, cap, a, u, c);
}
