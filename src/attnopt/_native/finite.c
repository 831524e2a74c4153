/* Finiteness tests for attnopt._validation.check_finite: 1 if any entry is NaN or +-inf, else 0.
 *
 * An entry is non-finite iff all its exponent bits are set (IEEE 754), so the test is an integer
 * AND/compare with an OR reduction: it vectorizes, reads each entry once and never overflows
 * (a float sum can overflow on finite entries and needs a second exact pass then). float32 of
 * 8*64*64 entries: ~1 us, where torch's sum + float() costs ~8 us per tensor at that size.
 *
 * Two layouts: a dense range of n entries (a contiguous tensor), and a strided block of up to
 * four dims (sizes s0..s3, strides t0..t3 in entries; the innermost loop runs over dim 3, so a
 * unit inner stride vectorizes). Negative strides are not passed by torch; zero strides are fine.
 */
#include <stdint.h>
#include <string.h>

#define NONFINITE(SUF, T, UINT, EXPMASK)                                                            \
int64_t nonfinite_dense_##SUF(const T *x, int64_t n) {                                              \
    UINT bad = 0;                                                                                   \
    _Pragma("omp simd reduction(| : bad)")                                                          \
    for (int64_t i = 0; i < n; ++i) {                                                               \
        UINT b;                                                                                     \
        memcpy(&b, x + i, sizeof b);                                                                \
        bad |= (UINT)((b & EXPMASK) == EXPMASK);                                                    \
    }                                                                                               \
    return bad != 0;                                                                                \
}                                                                                                   \
                                                                                                    \
int64_t nonfinite_strided_##SUF(const T *x, int64_t s0, int64_t s1, int64_t s2, int64_t s3,         \
                                int64_t t0, int64_t t1, int64_t t2, int64_t t3) {                   \
    UINT bad = 0;                                                                                   \
    for (int64_t a = 0; a < s0; ++a)                                                                \
        for (int64_t b = 0; b < s1; ++b)                                                            \
            for (int64_t c = 0; c < s2; ++c) {                                                      \
                const T *r = x + a * t0 + b * t1 + c * t2;                                          \
                if (t3 == 1) {                                                                      \
                    _Pragma("omp simd reduction(| : bad)")                                          \
                    for (int64_t i = 0; i < s3; ++i) {                                              \
                        UINT u;                                                                     \
                        memcpy(&u, r + i, sizeof u);                                                \
                        bad |= (UINT)((u & EXPMASK) == EXPMASK);                                    \
                    }                                                                               \
                } else {                                                                            \
                    for (int64_t i = 0; i < s3; ++i) {                                              \
                        UINT u;                                                                     \
                        memcpy(&u, r + i * t3, sizeof u);                                           \
                        bad |= (UINT)((u & EXPMASK) == EXPMASK);                                    \
                    }                                                                               \
                }                                                                                   \
                if (bad) return 1;                                                                  \
            }                                                                                       \
    return 0;                                                                                       \
}

NONFINITE(f32, float, uint32_t, 0x7f800000u)
NONFINITE(f64, double, uint64_t, 0x7ff0000000000000ull)
