"""Shared pytest marks."""
import pytest

from attnopt import _native

#: a test of a C kernel itself: skipped where the kernels are off (``ATTNOPT_NATIVE=0``: the run
#: that tests the PyTorch fallbacks) or cannot be built (no C compiler)
needs_native = pytest.mark.skipif(
    not _native.enabled(), reason="needs the native C kernels (off: ATTNOPT_NATIVE=0, or no C compiler)"
)
