r"""Small C kernels, compiled on first use with the system C compiler and called through ctypes.

Some CPU loops of attnopt are a dozen streaming passes when written with PyTorch ops, and one
pass over cache-resident data when written in C (e.g. the 1.5-entmax threshold search: per
row, a handful of sweeps over a few kB). Such a kernel lives here as a plain C file beside this
module (no PyTorch headers: it compiles in well under a second) and is built the first time it
is needed:

* the compiler is ``$CC`` or the first of ``cc``, ``gcc``, ``clang`` found on ``PATH``; the
  flags are :data:`FLAGS` (``-O3 -march=native``, ``#pragma omp simd`` loops vectorized with
  ``-fopenmp-simd``, no OpenMP runtime and no fast-math: IEEE ``inf``/``NaN`` semantics are
  kept);
* the shared library is cached in ``$ATTNOPT_CACHE_DIR`` (default
  ``$XDG_CACHE_HOME/attnopt/native``, i.e. ``~/.cache/attnopt/native``; the system temporary
  folder if that is not writable), under a name hashed from the source, the flags, the
  compiler's version and this CPU's model and flags, written to a temporary file and renamed
  into place (safe for concurrent test workers);
* with no compiler, with ``ATTNOPT_NATIVE=0`` in the environment, or on a compile error
  (a :class:`RuntimeWarning`, once), :func:`library` returns ``None`` and the caller runs its
  PyTorch path — the same result to rounding, only slower.

:func:`parallel_rows` splits a row range over ``torch.get_num_threads()`` Python threads;
ctypes releases the GIL during the foreign call, so the threads run in parallel.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
import warnings
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, NamedTuple, TypeVar, cast

import torch
import torch.autograd.forward_ad as _fwad
from torch._C._dynamo.eval_frame import get_eval_frame_callback as _eval_frame_callback

from attnopt._backend import BACKEND as _BACKEND

__all__ = [
    "FLAGS", "SANITIZERS", "Blas", "blas", "build_flags", "compiler", "enabled", "forward_ad_active",
    "has_storage", "library", "parallel_rows", "pointer", "ready", "switched_off", "untraced",
]

FLAGS = ("-O3", "-march=native", "-fno-math-errno", "-fopenmp-simd", "-fPIC", "-shared", "-std=c11")
#: ``ATTNOPT_NATIVE_SANITIZE`` values and the flags each adds to :data:`FLAGS` (a comma-separated
#: list, e.g. ``address,undefined``). An ASan build needs ASan's runtime loaded first:
#: ``LD_PRELOAD=$(cc -print-file-name=libasan.so)`` (``scripts/asan_tests.sh`` does it).
SANITIZERS = {
    "address": ("-fsanitize=address", "-fno-omit-frame-pointer", "-g"),
    "undefined": ("-fsanitize=undefined", "-fno-sanitize-recover=undefined", "-fno-omit-frame-pointer", "-g"),
}
_HERE = Path(__file__).resolve().parent
_LOCK = threading.Lock()
_LIBS: dict[str, ctypes.CDLL | None] = {}
_POOL: ThreadPoolExecutor | None = None
_POOL_SIZE = 0
#: ``[attnopt.functional._thresholds.THRESHOLDS]`` once that module is imported (it registers
#: itself: importing it from here would import every family); read for
#: ``native_parallel_min_entries`` by :func:`min_parallel`
TABLE: list[Any] = []


def switched_off() -> bool:
    """Whether ``ATTNOPT_NATIVE=0`` is set now (read on every call: tests and users toggle it).

    ``True`` while ``torch.compile`` traces: the kernels read memory that fake tensors do not have,
    and dynamo cannot trace the environment lookup; ``True`` inside ``attnopt.backend("reference")``.

    Reads the dictionary behind ``os.environ`` (``os.environ.get`` is ~0.85 µs, a few times per
    attention call at small sizes; this is ~50 ns), with ``os.environ`` itself as the fallback.
    """
    if torch.compiler.is_compiling() or _BACKEND[0] == "reference":
        return True
    return _env_off()


def _env_off() -> bool:
    """``ATTNOPT_NATIVE=0`` is set now."""
    if _ENV_DATA is not None:
        return _ENV_DATA.get(_ENV_KEY) == _ENV_OFF
    return os.environ.get("ATTNOPT_NATIVE", "1") == "0"


# os.environ's own mapping (CPython's os._Environ: encoded keys and values, updated by every
# assignment to os.environ, which is also how os.putenv is reached); None if that ever changes
try:
    _ENV_DATA: dict | None = os.environ._data  # type: ignore[attr-defined]
    _ENV_KEY = os.environ.encodekey("ATTNOPT_NATIVE")
    _ENV_OFF = os.environ.encodevalue("0")
    if not isinstance(_ENV_DATA, dict):
        _ENV_DATA = None
except (AttributeError, TypeError):
    _ENV_DATA = None


def forward_ad_active() -> bool:
    """Whether a ``torch.autograd.forward_ad`` dual level is open (its dual tensors look like plain
    tensors with storage; a C kernel or a path chosen because nothing requires grad would drop
    their tangents)."""
    return _fwad._current_level >= 0


def enabled() -> bool:
    """Whether native kernels may be used: ``ATTNOPT_NATIVE`` is not ``0`` and a compiler exists."""
    return not switched_off() and compiler() is not None


def has_storage(*tensors: torch.Tensor | None) -> bool:
    """Whether every tensor (``None`` skipped) has real memory a C kernel can read.

    False for the wrapped tensors of ``torch.func`` transforms (``grad``, ``vmap``, ...) and for
    tensor subclasses such as the fake tensors of ``torch.compile``: those take the PyTorch path.
    False too while a ``torch.autograd.forward_ad`` dual level is open (:func:`forward_ad_active`):
    a dual tensor has storage, but a C kernel would drop its tangent; for tensors off the CPU (the
    kernels read host memory); and while ``torch.compile`` traces (checked first, so that dynamo
    never reaches the functorch query, which it cannot trace).
    """
    if forward_ad_active() or torch.compiler.is_compiling() or _tracing():  # fake tensors: no memory
        return False
    for t in tensors:  # (a loop, not all() over a generator: ~1 µs less at three tensors)
        if t is not None and (type(t) not in _PLAIN or not t.is_cpu or _is_wrapped(t)):
            return False
    return True


_PLAIN = (torch.Tensor, torch.nn.Parameter)
_is_wrapped = torch._C._functorch.is_functorch_wrapped_tensor
_FAKE_MODE = torch._C._TorchDispatchModeKey.FAKE


def _tracing() -> bool:
    """Whether a fake-tensor mode is active (``torch.export``'s non-strict tracing runs the Python
    code with it, outside dynamo: the tensors an autograd Function sees there look plain)."""
    return torch._C._get_dispatch_mode(_FAKE_MODE) is not None


_F = TypeVar("_F", bound=Callable[..., Any])


def untraced(fn: _F) -> _F:
    """Keep ``torch.compile`` (dynamo) out of ``fn``, a function that hands tensor addresses to C.

    Why: dynamo splits a traced function at each graph break into resume functions that receive
    only the locals still *used* later. A buffer whose address was taken (``w.data_ptr()``) but
    whose Python name is not used after the C call is dead to that analysis, so dynamo drops it
    and its memory is freed *before* the C call reads or writes it (a heap use-after-free: issue 29,
    the whole-call Fourier path's ``work`` scratch and the expanded key mask). Plain Python keeps
    every local alive until the function returns; so every frame that takes an address and calls
    C runs untraced, as one ordinary frame (``torch.compiler.disable``, recursive: the helpers it
    calls are not traced either). Under ``torch.compile`` such a call is a graph break; the
    kernels reach compiled graphs as ``torch.library`` ops instead.
    """
    # torch.compiler.disable imports dynamo (and its optional dependencies): done at the first call
    # that needs it, not when attnopt is imported (a plain install imports nothing but torch and numpy).
    # Eager code with no torch.compile active anywhere (no eval-frame callback: nothing would trace
    # fn's frame or its callees) calls fn directly, without the wrapper's per-call frame switching.
    # While dynamo traces ``call``, is_compiling() is the constant True, so the callback lookup (a C
    # builtin dynamo would break on) is never traced; resume frames of a compiled function run with
    # dynamo's callback set, and take the disabled path.
    disabled: list[Callable[..., Any]] = []

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        if not torch.compiler.is_compiling() and _eval_frame_callback() is None:
            return fn(*args, **kwargs)
        if not disabled:
            disabled.append(torch.compiler.disable(fn, reason="attnopt: hands tensor addresses to C"))
        return disabled[0](*args, **kwargs)

    return cast(_F, call)


def pointer(t: torch.Tensor | None) -> ctypes.c_void_p | None:
    """The address of ``t``'s first element for a C call (``None`` -> a NULL pointer)."""
    return None if t is None else ctypes.c_void_p(t.data_ptr())


#: ``compiler()`` per ``($CC, $PATH)``: the ``PATH`` search stats a dozen files (~35 µs per call,
#: three calls per attention call at N = 64, where the whole call is ~0.2 ms)
_COMPILERS: dict[tuple[str | None, str | None], str | None] = {}


def compiler() -> str | None:
    """Path of the C compiler: ``$CC``, else the first of ``cc``, ``gcc``, ``clang`` on ``PATH``.

    Looked up once per value of ``($CC, $PATH)``.
    """
    key = (os.environ.get("CC"), os.environ.get("PATH"))
    if key in _COMPILERS:
        return _COMPILERS[key]
    names = [os.environ["CC"]] if os.environ.get("CC") else ["cc", "gcc", "clang"]
    found = None
    for name in names:
        found = shutil.which(name)
        if found is not None:
            break
    _COMPILERS[key] = found
    return found


def _cache_dir() -> Path:
    root = os.environ.get("ATTNOPT_CACHE_DIR")
    if root:
        base = Path(root)
    else:
        xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        base = Path(xdg) / "attnopt" / "native"
    try:
        base.mkdir(parents=True, exist_ok=True)
        if os.access(base, os.W_OK):
            return base
    except OSError:
        pass
    fallback = Path(tempfile.gettempdir()) / f"attnopt-native-{os.getuid() if hasattr(os, 'getuid') else 0}"
    fallback.mkdir(parents=True, exist_ok=True)
    return fallback


def _cpu_signature() -> str:
    """The CPU model and feature flags (``-march=native`` code must not run on another CPU)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.machine() + platform.processor()
    keep = [line for line in text.splitlines() if line.startswith(("model name", "flags", "Features"))]
    return platform.machine() + "\n".join(sorted(set(keep)))


def _version(cc: str) -> str:
    try:
        return subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return ""


def build_flags() -> tuple[str, ...]:
    """:data:`FLAGS` plus those of the sanitizers named in ``ATTNOPT_NATIVE_SANITIZE`` (read when a
    library is first built in a process).

    Raises:
        ValueError: ``ATTNOPT_NATIVE_SANITIZE`` names an unknown sanitizer.
    """
    wanted = [w.strip() for w in os.environ.get("ATTNOPT_NATIVE_SANITIZE", "").split(",") if w.strip()]
    extra: list[str] = []
    for name in wanted:
        if name not in SANITIZERS:
            raise ValueError(
                f"ATTNOPT_NATIVE_SANITIZE: unknown sanitizer {name!r}; known: {sorted(SANITIZERS)}")
        extra += [f for f in SANITIZERS[name] if f not in extra]
    return (*FLAGS, *extra)


def _build(name: str, cc: str) -> ctypes.CDLL:
    flags = build_flags()
    source = (_HERE / f"{name}.c").read_bytes()
    headers = b"".join(h.read_bytes() for h in sorted(_HERE.glob("*.h")))  # shared "pexp.h" etc.
    key = hashlib.sha256(b"\0".join(
        [source, headers, " ".join(flags).encode(), _version(cc).encode(), _cpu_signature().encode()]
    )).hexdigest()[:20]
    target = _cache_dir() / f"{name}-{key}.so"
    if not target.exists():
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
        os.close(fd)
        try:
            cmd = [cc, *flags, "-I", str(_HERE), "-o", tmp, str(_HERE / f"{name}.c"), "-lm"]
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
            if done.returncode != 0:
                raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stderr.strip()}")
            os.replace(tmp, target)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    return ctypes.CDLL(str(target))


def library(name: str) -> ctypes.CDLL | None:
    """The compiled ``_native/{name}.c``, or ``None`` where native kernels cannot be used."""
    if switched_off():
        return None
    return _load(name)


def _load(name: str) -> ctypes.CDLL | None:
    """:func:`library` without the switches: build or load ``name`` (``None`` without a compiler)."""
    built = _LIBS.get(name)
    if built is not None:  # built already (so a compiler was found): skip the lookup, ~2 µs a call
        return built
    if compiler() is None:
        return None
    with _LOCK:
        if name not in _LIBS:
            cc = compiler()
            try:
                _LIBS[name] = _build(name, cc) if cc is not None else None
            except (OSError, RuntimeError, subprocess.SubprocessError) as err:
                warnings.warn(f"attnopt: the native {name!r} kernel did not build, using the PyTorch path "
                              f"({err})", RuntimeWarning, stacklevel=3)
                _LIBS[name] = None
        return _LIBS[name]


def ready(*names: str) -> bool:
    """Whether :func:`library` gives every one of ``names`` now (``"blas"``: whether :func:`blas`
    finds PyTorch's BLAS) — readable while ``torch.compile`` / ``torch.export`` trace: dynamo runs
    this function at trace time (it builds or loads the libraries through ctypes, which a traced
    region cannot) and keeps its answer as a constant of the graph (so, unlike :func:`library`, it
    does not answer ``None`` merely because dynamo is tracing). The routers ask it before they put
    an ``attnopt::`` op into a graph; plain eager code asks :func:`library`."""
    if _BACKEND[0] == "reference" or _env_off():
        return False
    return all((_blas_once() if name == "blas" else _load(name)) is not None for name in names)


# what torch._dynamo.assume_constant_result(ready) does (torch marks its own justknobs_check the
# same way), without importing torch._dynamo when attnopt is imported
ready._dynamo_marked_constant = True  # type: ignore[attr-defined]


def _pool(workers: int) -> ThreadPoolExecutor:
    global _POOL, _POOL_SIZE
    with _LOCK:
        if _POOL is None or _POOL_SIZE < workers:
            if _POOL is not None:
                _POOL.shutdown(wait=False)
            _POOL = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="attnopt-native")
            _POOL_SIZE = workers
        return _POOL


def min_parallel() -> int:
    """Entries below which a C call runs on one thread (``THRESHOLDS.native_parallel_min_entries``)."""
    return TABLE[0].native_parallel_min_entries if TABLE else 1 << 16


def parallel_rows(call: Callable[[int, int], None], rows: int, row_len: int) -> None:
    """Run ``call(r0, r1)`` on contiguous row ranges covering ``[0, rows)``, one per thread.

    Uses ``torch.get_num_threads()`` threads when there are at least :func:`min_parallel`
    entries, else one call. ``call`` must release the GIL (a ctypes foreign call does) and
    write disjoint rows.
    """
    threads = min(torch.get_num_threads(), rows)
    if threads <= 1 or rows * row_len < min_parallel():
        call(0, rows)
        return
    bounds = [rows * i // threads for i in range(threads + 1)]
    pool = _pool(threads)
    futures = [pool.submit(call, bounds[i], bounds[i + 1]) for i in range(1, threads)]
    call(bounds[0], bounds[1])
    for fut in futures:
        fut.result()


class Blas(NamedTuple):
    """Addresses of the BLAS routines inside PyTorch's own library, for a C kernel to call."""

    sgemm: int  #: Fortran ``sgemm_``
    dgemm: int  #: Fortran ``dgemm_``
    set_threads: int  #: MKL's ``MKL_Set_Num_Threads_Local(int)`` (0 where absent: not MKL)


_BLAS: list[Blas | None] = []  # [] until looked up, then [result]


def _torch_cpu_library() -> ctypes.CDLL | None:
    folder = Path(torch.__file__).resolve().parent / "lib"
    for name in ("libtorch_cpu.so", "libtorch_cpu.dylib", "torch_cpu.dll"):
        if (folder / name).exists():
            try:
                return ctypes.CDLL(str(folder / name))
            except OSError:
                return None
    return None


def _gemm_works(fn: Callable[..., object], ctype: type[ctypes.c_float] | type[ctypes.c_double]) -> bool:
    """``fn`` (a Fortran ``?gemm_``) computes a 2×3 · 3×2 product right, with int64-held dimensions."""
    a = (ctype * 6)(1, 2, 3, 4, 5, 6)  # column-major 2×3
    b = (ctype * 6)(1, 0, 2, -1, 3, 1)  # column-major 3×2
    c = (ctype * 4)(7, 7, 7, 7)
    m, n, k = ctypes.c_int64(2), ctypes.c_int64(2), ctypes.c_int64(3)
    one, zero = ctype(1), ctype(0)
    fn.restype = None  # type: ignore[attr-defined]
    fn(b"N", b"N", ctypes.byref(m), ctypes.byref(n), ctypes.byref(k), ctypes.byref(one), a, ctypes.byref(m),
       b, ctypes.byref(k), ctypes.byref(zero), c, ctypes.byref(m))
    return list(c) == [11.0, 14.0, 13.0, 16.0]


def blas() -> Blas | None:
    """The ``sgemm_`` / ``dgemm_`` (and MKL's ``MKL_Set_Num_Threads_Local``) of PyTorch's own
    library, or ``None``: ``ATTNOPT_NATIVE=0``, a build without them, a big-endian machine, or a
    probe product that came out wrong. Looked up once.

    A C kernel calls them with the integer arguments held in ``int64_t`` (small values, read
    alike by an LP64 and an ILP64 BLAS on a little-endian machine) and, with MKL, sets its
    thread-local thread count to 1 around them (the kernel runs inside attnopt's own threads).
    """
    if switched_off():
        return None
    return _blas_once()


def _blas_once() -> Blas | None:
    """:func:`blas` without the switches (looked up once)."""
    if not _BLAS:
        with _LOCK:
            if not _BLAS:
                _BLAS.append(_find_blas())
    return _BLAS[0]


def _find_blas() -> Blas | None:
    if sys.byteorder != "little":
        return None
    lib = _torch_cpu_library()
    if lib is None:
        return None
    try:
        sgemm, dgemm = lib.sgemm_, lib.dgemm_
    except AttributeError:
        return None
    try:
        if not (_gemm_works(sgemm, ctypes.c_float) and _gemm_works(dgemm, ctypes.c_double)):
            return None
    except (OSError, ValueError):
        return None
    # the by-value C entry point (in this build the lower-case name is the Fortran one, by reference)
    setter = getattr(lib, "MKL_Set_Num_Threads_Local", None)
    address = ctypes.cast
    return Blas(address(sgemm, ctypes.c_void_p).value or 0, address(dgemm, ctypes.c_void_p).value or 0,
                0 if setter is None else address(setter, ctypes.c_void_p).value or 0)
