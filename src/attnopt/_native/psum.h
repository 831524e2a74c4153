/* PSUM: a row sum that vectorizes well (shared by the native kernels). */
#ifndef ATTNOPT_PSUM_H
#define ATTNOPT_PSUM_H

#include <stdint.h>

/* OUT = sum over i < N of term_, set by the statements (...) from i: 64 bytes of partial sums and
 * a tree at the end. (GCC 12's `omp simd reduction` spills the lanes and adds them one after
 * another, 16 dependent adds per row of 64 floats: that was most of this file's row loops.) */
#define PSUM(T, N, OUT, ...)                                                              \
    do {                                                                                     \
        enum { L_ = 64 / sizeof(T) };                                                        \
        T acc_[L_];                                                                          \
        for (int l_ = 0; l_ < L_; ++l_) acc_[l_] = 0;                                        \
        const int64_t n_ = (N);                                                              \
        int64_t b_ = 0;                                                                      \
        for (; b_ + L_ <= n_; b_ += L_) {                                                    \
            _Pragma("omp simd")                                                              \
            for (int l_ = 0; l_ < L_; ++l_) {                                                \
                const int64_t i = b_ + l_;                                                   \
                T term_;                                                                     \
                __VA_ARGS__;                                                                 \
                acc_[l_] += term_;                                                           \
            }                                                                                \
        }                                                                                    \
        for (int l_ = 0; b_ + l_ < n_; ++l_) {                                               \
            const int64_t i = b_ + l_;                                                       \
            T term_;                                                                         \
            __VA_ARGS__;                                                                     \
            acc_[l_] += term_;                                                               \
        }                                                                                    \
        for (int w_ = L_ / 2; w_ >= 1; w_ /= 2) {                                            \
            _Pragma("omp simd")                                                              \
            for (int l_ = 0; l_ < w_; ++l_) acc_[l_] += acc_[l_ + w_];                       \
        }                                                                                    \
        OUT = acc_[0];                                                                       \
    } while (0)

#endif
