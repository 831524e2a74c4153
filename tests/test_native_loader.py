"""The native-kernel loader: builds, caches, parallelizes, and falls back without error."""
from __future__ import annotations

import ctypes
import warnings

import pytest
import torch

from attnopt import _native

_SOURCE = """
#include <stdint.h>
void twice(const double *x, double *y, int64_t r0, int64_t r1, int64_t n) {
  for (int64_t i = r0 * n; i < r1 * n; ++i) y[i] = 2.0 * x[i];
}
"""


@pytest.fixture
def fresh(monkeypatch, tmp_path):
    """A loader with an empty library table, a private cache and a source folder of our own."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "twice.c").write_text(_SOURCE)
    (src / "broken.c").write_text("this is not C;")
    monkeypatch.setattr(_native, "_HERE", src)
    monkeypatch.setattr(_native, "_LIBS", {})
    monkeypatch.setenv("ATTNOPT_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("ATTNOPT_NATIVE", raising=False)
    return tmp_path


@pytest.mark.skipif(_native.compiler() is None, reason="no C compiler on this machine")
def test_builds_caches_and_runs_in_parallel(fresh):
    lib = _native.library("twice")
    assert lib is not None
    assert len(list((fresh / "cache").glob("twice-*.so"))) == 1
    x = torch.randn(300, 700, dtype=torch.float64)
    y = torch.full_like(x, float("nan"))
    seen = []

    def call(r0: int, r1: int) -> None:
        seen.append((r0, r1))
        lib.twice(ctypes.c_void_p(x.data_ptr()), ctypes.c_void_p(y.data_ptr()),
                  ctypes.c_int64(r0), ctypes.c_int64(r1), ctypes.c_int64(x.shape[1]))

    with_threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        _native.parallel_rows(call, x.shape[0], x.shape[1])
    finally:
        torch.set_num_threads(with_threads)
    assert sorted(seen) == [(0, 150), (150, 300)]  # two disjoint halves
    assert torch.equal(y, 2 * x)
    # a second loader (new process) finds the cached library instead of compiling again
    _native._LIBS.clear()
    assert _native.library("twice") is not None
    assert len(list((fresh / "cache").glob("*"))) == 1  # no temporary left behind


@pytest.mark.skipif(_native.compiler() is None, reason="no C compiler on this machine")
def test_shared_header_is_found_and_part_of_the_cache_key(fresh):
    src = fresh / "src"
    (src / "factor.h").write_text("static inline double factor(void) { return 3.0; }\n")
    (src / "thrice.c").write_text('#include <stdint.h>\n#include "factor.h"\n'
                                  "double thrice(double x) { return factor() * x; }\n")
    lib = _native.library("thrice")
    assert lib is not None
    lib.thrice.restype, lib.thrice.argtypes = ctypes.c_double, [ctypes.c_double]
    assert lib.thrice(2.0) == 6.0
    # a changed header is a new library, not the stale cached one
    (src / "factor.h").write_text("static inline double factor(void) { return 4.0; }\n")
    _native._LIBS.clear()
    lib = _native.library("thrice")
    assert lib is not None
    lib.thrice.restype, lib.thrice.argtypes = ctypes.c_double, [ctypes.c_double]
    assert lib.thrice(2.0) == 8.0
    assert len(list((fresh / "cache").glob("thrice-*.so"))) == 2


def test_small_inputs_take_one_call(fresh):
    seen = []
    _native.parallel_rows(lambda r0, r1: seen.append((r0, r1)), 10, 10)
    assert seen == [(0, 10)]


def test_disabled_by_environment(fresh, monkeypatch):
    monkeypatch.setenv("ATTNOPT_NATIVE", "0")
    assert not _native.enabled()
    assert _native.library("twice") is None


def test_no_compiler_falls_back_silently(fresh, monkeypatch, recwarn):
    monkeypatch.setenv("CC", "/nonexistent/cc")
    assert _native.compiler() is None
    assert _native.library("twice") is None
    assert not recwarn.list


@pytest.mark.skipif(_native.compiler() is None, reason="no C compiler on this machine")
def test_compile_error_warns_once_and_falls_back(fresh):
    with pytest.warns(RuntimeWarning, match="'broken' kernel did not build"):
        assert _native.library("broken") is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # remembered: no second warning, no second compile
        assert _native.library("broken") is None
    assert not list((fresh / "cache").glob("*.so"))
