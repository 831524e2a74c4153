"""Subprocess entry point of :func:`attnopt.bench._harness.peak_memory_mb` (internal).

Usage: ``python -m attnopt.bench._memprobe module:function '<json kwargs>' cpu|cuda``.
Prints the peak extra memory of one call of the built closure, in MB. The closure is run
once untimed first (so that code pages of newly used kernels, thread pools and lazy
initializations, which count in RSS, are not charged to it), then measured on a second call;
closures that run a backward should reset ``.grad = None`` of their inputs first.
"""
from __future__ import annotations

import gc
import importlib
import json
import resource
import sys


def _rss_kb(field: str) -> int | None:
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def _reset_hwm() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
        return True
    except OSError:
        return False


def main() -> None:
    factory, kwargs, device = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
    import torch

    module, func = factory.split(":")
    run = getattr(importlib.import_module(module), func)(**kwargs)
    run()  # warm-up: lazy initialization and code pages are not the call's memory
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        run()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
        print((peak - base) / 2**20)
        return
    base_kb = _rss_kb("VmRSS")
    if base_kb is not None and _reset_hwm():
        run()
        peak_kb = _rss_kb("VmHWM") or 0
    else:  # no /proc: fall back to ru_maxrss (an upper bound that includes import peaks)
        base_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        run()
        peak_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(max(peak_kb - base_kb, 0) / 1024)


if __name__ == "__main__":
    main()
