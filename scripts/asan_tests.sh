#!/usr/bin/env bash
# Run the tests of attnopt's C kernels with the kernels built under AddressSanitizer and
# UndefinedBehaviorSanitizer (issue 29). Any out-of-bounds access, use after free or undefined
# behaviour in a kernel aborts the test process, so pytest fails.
#
#   bash scripts/asan_tests.sh            # the native tests (CI runs this as its own step)
#   bash scripts/asan_tests.sh -m slow    # extra pytest arguments are passed on
#
# The sanitized libraries are cached beside the normal ones under their own hash
# (ATTNOPT_NATIVE_SANITIZE is part of the build flags). Python and torch are not instrumented:
# ASan's runtime is preloaded so that every heap block (torch's CPU tensors included) gets
# redzones and quarantine, and the instrumented kernels' accesses are checked against them.
set -euo pipefail
cd "$(dirname "$0")/.."
cc=${CC:-cc}
asan=$("$cc" -print-file-name=libasan.so)
ubsan=$("$cc" -print-file-name=libubsan.so)
cxx=$("$cc" -print-file-name=libstdc++.so.6)  # after ASan, so that its __cxa_throw interceptor finds it
for lib in "$asan" "$ubsan"; do
  if [ ! -e "$lib" ]; then echo "asan_tests: $lib not found (install the compiler's sanitizer runtimes)" >&2; exit 1; fi
done
export ATTNOPT_NATIVE_SANITIZE=${ATTNOPT_NATIVE_SANITIZE:-address}
export ASAN_OPTIONS=detect_leaks=0:abort_on_error=1:halt_on_error=1:allocator_may_return_null=1
export UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
export HYPOTHESIS_PROFILE=${HYPOTHESIS_PROFILE:-ci}
tests=(
  ${ASAN_TESTS_ONLY:-tests/native}
  tests/test_native_loader.py
  tests/functional/test_dnas_native.py tests/functional/test_dnas_no_grad.py
  tests/functional/test_sparse_native.py tests/functional/test_sparse_no_grad.py
  tests/functional/test_entmax_fast_path.py
  tests/functional/test_generalized_native.py tests/functional/test_generalized_wholecall.py
  tests/functional/test_kernel_fused.py tests/functional/test_kernel_wholecall.py
  tests/functional/test_periodic_native.py
  tests/nn/test_gaussian_noise.py tests/nn/test_sampled_fourier.py tests/nn/test_spectral_native.py
  tests/nn/test_preference.py tests/test_validation.py
  # the kernels as torch.library ops (issue 30): the same C calls through opcheck / compile
  tests/functional/test_dnas_ops.py tests/functional/test_generalized_ops.py
  tests/functional/test_periodic_ops.py tests/functional/test_kernel_ops.py
  tests/functional/test_sparse_ops.py tests/nn/test_spectral_ops.py tests/nn/test_small_ops.py
)
set +e
# the sanitizers' instrumentation changes how the compiler vectorizes float sums, so the few tests
# that pin float32 rounding to a few ulps are left to the normal run ("to_rounding" in their names)
LD_PRELOAD="$asan $ubsan $cxx" python -m pytest -q "${tests[@]}" -k "not to_rounding" "$@"
rc=$?
set -e
echo "asan_tests: pytest exit code $rc"
if [ "$rc" -eq 5 ]; then echo "asan_tests: no tests ran" >&2; exit 1; fi
exit "$rc"
