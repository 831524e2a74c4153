"""Trace registry modules one after the other with ``torch.compile`` (issue 29's repro).

Run as a script (a crash must not take the test process down):
``python -m tests.native._traced_modules NAME [NAME ...]``; prints ``NAME ok`` per module and
``checked`` at the end. Each module's compiled output is compared with its eager output, so
memory corruption that changed numbers before it crashed is caught too.
"""
from __future__ import annotations

import sys
import warnings

import torch
import torch._dynamo

import attnopt.nn as ann


def run(names: list[str], threads: int = 1) -> None:
    torch.set_num_threads(threads)
    warnings.filterwarnings("ignore")
    for name in names:
        torch.manual_seed(0)
        mod = ann.make_attention(name, 32, 4)
        x = torch.randn(2, 32, 32)
        pad = torch.zeros(2, 32, dtype=torch.bool)
        pad[1, -5:] = True
        torch._dynamo.reset()
        compiled = torch.compile(mod, backend="eager")
        mod.eval()  # no sampling noise: the eager and the traced call must agree
        with torch.no_grad():
            want = mod(x, key_padding_mask=pad)
            want = want[0] if isinstance(want, tuple) else want
        mod.train()
        for _ in range(3):
            compiled(x, key_padding_mask=pad)
        mod.eval()
        with torch.no_grad():
            got = compiled(x, key_padding_mask=pad)
            got = got[0] if isinstance(got, tuple) else got
        if not torch.allclose(got, want, rtol=1e-4, atol=1e-5):
            raise SystemExit(f"{name}: traced output differs from eager by {(got - want).abs().max():.3g}")
        print(name, "ok", flush=True)
    print("checked", flush=True)


if __name__ == "__main__":
    args = sys.argv[1:]
    threads = 1
    if args and args[0].startswith("--threads="):
        threads = int(args.pop(0).split("=", 1)[1])
    run(args, threads)
