"""launch/heap.py: a stage that allocates and frees the same buffers every step reuses them, instead of
faulting fresh pages in each time (glibc Linux; elsewhere the call does nothing and says so)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import REPO

# 40 MB buffers, 64-byte aligned as torch allocates them, written and freed step after step: above glibc's
# largest adaptive mmap threshold (32 MB), so by default each one is a fresh mmap whose every page faults in.
# Counted over 30 steps after 15 (the heap settles within the first few: the steady state is what a stage sees)
STEPS = (
    "import ctypes, json, resource, sys\n"
    "from opd_cache.launch.heap import keep_freed_memory\n"
    "tuned = keep_freed_memory() if sys.argv[1] == 'tuned' else False\n"
    "libc = ctypes.CDLL('libc.so.6')\n"
    "libc.posix_memalign.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t, ctypes.c_size_t]\n"
    "libc.memset.argtypes, libc.free.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t], [ctypes.c_void_p]\n"
    "def step():\n"
    "    p = ctypes.c_void_p()\n"
    "    assert libc.posix_memalign(ctypes.byref(p), 64, 40_000_000) == 0\n"
    "    libc.memset(p, 1, 40_000_000)\n"
    "    libc.free(p)\n"
    "for _ in range(15):\n"
    "    step()\n"
    "before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt\n"
    "for _ in range(30):\n"
    "    step()\n"
    "faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before\n"
    "print(json.dumps({'tuned': tuned, 'faults': faults}))\n"
)


def run_steps(mode: str, **env: str) -> dict:
    clean = {k: v for k, v in os.environ.items() if k not in ("GLIBC_TUNABLES", "MALLOC_TRIM_THRESHOLD_")}
    out = subprocess.run(
        [sys.executable, "-c", STEPS, mode], cwd=REPO, env={**clean, **env}, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc (Linux)")
def test_freed_buffers_are_reused_instead_of_faulted_in_again():
    default, tuned = run_steps("default"), run_steps("tuned")
    assert tuned["tuned"] is True
    pages = 30 * 40_000_000 // 4096
    assert default["faults"] > pages // 2, default  # each step faulted its buffer in again
    assert tuned["faults"] < pages // 20, tuned  # the settled heap's pages, reused


def test_a_users_own_malloc_setting_is_left_alone():
    assert run_steps("tuned", MALLOC_TRIM_THRESHOLD_="131072")["tuned"] is False
