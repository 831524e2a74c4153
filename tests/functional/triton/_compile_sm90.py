"""Compile every Triton kernel of attnopt for an H100 (sm_90) on a machine without a GPU.

Run as ``python -m tests.functional.triton._compile_sm90`` in a process *without*
``TRITON_INTERPRET`` (the kernels must be decorated for compilation): Triton lowers each kernel
to PTX and its bundled ``ptxas`` assembles it, so Triton-language errors that the interpreter
accepts (early returns, loop-carried types, dot shapes, shared memory over the limit) show up
without a device. Prints one line per kernel variant and the shared memory it needs.
"""
from __future__ import annotations

import inspect
import os
import sys

SHARED_LIMIT = 227 * 1024  # H100 / H200: dynamic shared memory per block


def main() -> int:
    if os.environ.get("TRITON_INTERPRET") == "1":
        print("unset TRITON_INTERPRET first", file=sys.stderr)
        return 2
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.compiler import compile as tcompile

    from attnopt.functional.triton import _flash, _fourier, _fourier_scan, sparse

    only = sys.argv[1] if len(sys.argv) > 1 else None  # e.g. "fourier": only the kernels whose label has it

    def build(fn, dtypes: dict[str, str], consts: dict, floats: tuple[str, ...], label: str,
              options: dict | None = None) -> None:
        if only is not None and only not in label:
            return
        sig = {}
        for name in inspect.signature(fn.fn).parameters:
            sig[name] = ("constexpr" if name in consts else "*" + dtypes[name] if name in dtypes
                         else "fp32" if name in floats else "i32")
        kernel = tcompile(ASTSource(fn=fn, signature=sig, constexprs=consts),
                          target=GPUTarget("cuda", 90, 32),
                          options=options or {"num_warps": 8, "num_stages": 3})
        shared = kernel.metadata.shared
        print(f"ok {label}: shared {shared} B")
        assert shared <= SHARED_LIMIT, f"{label}: {shared} B of shared memory"

    io = {"CB": "fp32", "M": "fp32", "L": "fp32", "DELTA": "fp32", "DCB": "fp32", "TAU": "fp32", "ZN": "fp32",
          "U": "fp32", "CB2": "fp32", "L2": "fp32", "DELTA2": "fp32", "WG": "fp32"}
    for name in ("A", "B", "V", "O", "O2", "DO", "DB", "DV_", "DA_"):
        io[name] = "bf16"
    common = dict(CAUSAL=1, HAS_MASK=True, D=64, DV=64, BLOCK_M=128, BLOCK_N=64, ACC=tl.float32, PREC="tf32")
    for has_v, score, dual in ((True, 0, False), (True, 1, False), (False, 0, False), (True, 0, True)):
        consts = dict(common, HAS_V=has_v, SCORE=score, DUAL=dual)
        for fn in (_flash._fwd_kernel, _flash._bwd_cols_kernel, _flash._bwd_rows_kernel):
            label = f"{fn.fn.__name__} has_v={has_v} score={score} dual={dual}"
            build(fn, io, dict(consts), ("scale", "eps"), label)
    for kind in (0, 1, 2):
        consts = dict(common, KIND=kind)
        for fn in (sparse._fwd_kernel, sparse._bwd_cols_kernel, sparse._bwd_rows_kernel):
            build(fn, io, dict(consts), ("scale", "am1", "a", "tol"), f"entmax {fn.fn.__name__} kind={kind}")
    # implicit-kernel attention: the fused random-Fourier pass and the causal linear-mode scan (R = 32)
    ika = {name: "bf16" for name in ("Q", "K", "V", "O", "DO", "DQ", "DK", "DV_")}
    ika.update({name: "fp32" for name in ("W", "CB", "M", "L", "SC", "DELTA", "DCB", "DW", "CR", "DEN",
                                          "ST", "ZT")})
    fused = dict(HAS_MASK=False, D=64, DV=64, RP=32, BLOCK_M=128, BLOCK_N=64, ACC=tl.float32, PREC="tf32")
    for causal, mag, sets in ((0, 1, 2), (1, 3, 1)):
        for fn in (_fourier._fwd_kernel, _fourier._bwd_keys_kernel, _fourier._bwd_queries_kernel):
            consts = dict(fused, CAUSAL=causal, MAG=mag, S=sets)
            build(fn, ika, consts, (), f"fourier {fn.fn.__name__} causal={causal} mag={mag} sets={sets}")
    scan = dict(CH=64, D=64, EP=128, RP=32, MAG=1, S=2, ACC=tl.float32, PREC="ieee")
    for fn in (_fourier_scan._fwd_kernel, _fourier_scan._bwd_queries_kernel, _fourier_scan._bwd_keys_kernel):
        build(fn, ika, dict(scan), (), f"fourier scan {fn.fn.__name__}", {"num_warps": 4, "num_stages": 1})
    return 0


if __name__ == "__main__":
    sys.exit(main())
