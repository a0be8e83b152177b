"""Keep freed memory in the process instead of handing it back to the kernel at every step (glibc only).

glibc's malloc returns the top of its heap to the kernel once more than `M_TRIM_THRESHOLD` of it is free,
and serves large requests with fresh mmaps; both thresholds adapt to what the program frees, but a stage
that allocates and frees the same working set every step (annotate's forward over a shard, the trainer's
step) keeps crossing them: each step's buffers come back as new pages, and every page costs a fault. On
bench_trl's workload the annotate stage took 1.5 million faults for 400 shards, 2.9 of its 12.5 CPU-s in the
kernel (docs/benchmarks.md, "CPU per sample, a shard per version"). Fixed thresholds large against one step's working set stop that; memory
above them (a model's weights, loaded once) still comes from mmap and goes back when freed.

Called once per process, before the work starts: `opd`'s entry point and the fork server (its stages inherit
the setting). A user who tunes malloc through the environment keeps their setting.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys

MMAP_THRESHOLD_BYTES = 64 << 20  # requests up to this come from the heap, reused step after step
TRIM_THRESHOLD_BYTES = 256 << 20  # free heap kept before any is handed back
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # malloc.h
_USER_SETTINGS = ("GLIBC_TUNABLES", "MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_")


def keep_freed_memory() -> bool:
    """Fix glibc's trim and mmap thresholds (see the module docstring); True when they were set."""
    if not sys.platform.startswith("linux") or any(name in os.environ for name in _USER_SETTINGS):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False  # not glibc (musl has no mallopt): nothing to tune
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    # the mmap threshold first: setting either turns glibc's adaptation of both off
    return bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)) and bool(
        mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES)
    )
