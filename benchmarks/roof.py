"""The machine's roof, measured once per thread count: what BLAS sgemm and memory copies reach.

- ``sgemm_gflops``: ``scipy.linalg.blas.sgemm`` on 2048 x 2048 float32 (2 * 2048**3 FLOP), best of 5,
  with BLAS limited to ``threads`` (threadpoolctl).
- ``read_gbps``: ``threads`` Python threads each run ``np.max`` over one slice of a float32 array
  of 1 GiB or ``BEYOND_L3`` times the L3 (``l3_bytes``), whichever is larger, so that it streams
  from memory on a Xeon with 480 MiB of L3 as on an EPYC with 32 MiB (``np.max`` is a pure read,
  vectorized, single-threaded and releases the GIL), best of 3. (BLAS ``sdot`` read half as
  fast: it does not keep up with the memory.)
- ``copy_gbps``: the same threads each ``np.copyto`` one slice of an array of 256 MiB or
  ``BEYOND_L3`` times the L3, counted as read + write = 2 x its size (STREAM "copy" convention,
  write-allocate traffic not counted).

Compute-bound workloads are compared with ``sgemm_gflops``; memory-bound ones (decoding: they read
a KV cache and weights and write almost nothing) with ``read_gbps``. ``copy_gbps`` is for the record.
"""

from __future__ import annotations

import concurrent.futures
import functools
import glob
import math
import os
import time

import numpy as np
import threadpoolctl

# A working set this many times the L3 streams from memory: what a call or the roof read finds
# in L3 from the one before is at most a third of it, less after the other tenants' traffic.
BEYOND_L3 = 3
_DEFAULT_L3 = 32 * 2 ** 20


def _best(fn, repeat=5):
    fn()  # warm up (first touch of the pages, BLAS thread start)
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def sgemm_gflops(threads: int, n: int = 2048) -> float:
    from scipy.linalg import blas

    rng = np.random.default_rng(0)
    a = np.asfortranarray(rng.standard_normal((n, n), dtype=np.float32))
    b = np.asfortranarray(rng.standard_normal((n, n), dtype=np.float32))
    c = np.zeros((n, n), np.float32, order="F")
    with threadpoolctl.threadpool_limits(limits=threads, user_api="blas"):
        t = _best(lambda: blas.sgemm(1.0, a, b, beta=0.0, c=c, overwrite_c=True))
    return 2.0 * n ** 3 / t / 1e9


def _slices(n, parts):
    bounds = np.linspace(0, n, parts + 1).astype(int)
    return [slice(lo, hi) for lo, hi in zip(bounds[:-1], bounds[1:])]


@functools.lru_cache(maxsize=None)
def l3_bytes() -> int:
    """The size of the largest cache that sysfs lists for CPU 0 (its L3: shared by the cores a
    call runs on), or 32 MiB where sysfs does not say (not Linux)."""
    sizes = []
    for index in glob.glob("/sys/devices/system/cpu/cpu0/cache/index*"):
        try:
            with open(os.path.join(index, "size")) as fh:
                text = fh.read().strip()
        except OSError:
            continue
        scale = {"K": 2 ** 10, "M": 2 ** 20, "G": 2 ** 30}.get(text[-1:], 1)
        digits = text.rstrip("KMG")
        if digits.isdigit():
            sizes.append(int(digits) * scale)
    return max(sizes) if sizes else _DEFAULT_L3


def copies_beyond_l3(bytes_per_copy: int, minimum: int = 1) -> int:
    """How many copies of a call's data (read ``bytes_per_copy`` each) a rotation needs so that
    their total is ``BEYOND_L3`` times the L3: at least ``minimum``."""
    return max(minimum, math.ceil(BEYOND_L3 * l3_bytes() / max(bytes_per_copy, 1)))


def _streamed_nbytes(minimum: int) -> int:
    """``minimum`` bytes or ``BEYOND_L3`` times the L3 (a whole number of MiB), the larger."""
    return max(minimum, math.ceil(BEYOND_L3 * l3_bytes() / 2 ** 20) * 2 ** 20)


def read_gbps(threads: int, nbytes: int | None = None) -> float:
    nbytes = nbytes or _streamed_nbytes(2 ** 30)
    src = np.ones(nbytes // 4, np.float32)
    slices = _slices(src.size, threads)
    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        t = _best(lambda: list(pool.map(lambda s: np.max(src[s]), slices)), repeat=3)
    return src.nbytes / t / 1e9


@functools.lru_cache(maxsize=None)
def read_gbps_near(threads: int, workload: str) -> float:
    """read_gbps measured again when ``workload`` begins (once per workload and thread count).
    A shared host's bandwidth moves within minutes (np.max over 1 GiB, 2 threads, Zen 4: 27-41
    GB/s within one minute, 52 at the start of a run whose decode steps then read 28), so a
    memory-bound workload is also set against the roof of its own moment."""
    return round(read_gbps(threads), 1)


def copy_gbps(threads: int, nbytes: int | None = None) -> float:
    nbytes = nbytes or _streamed_nbytes(256 * 2 ** 20)
    src = np.ones(nbytes // 4, np.float32)
    dst = np.empty_like(src)
    slices = _slices(src.size, threads)
    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        t = _best(lambda: list(pool.map(lambda s: np.copyto(dst[s], src[s]), slices)))
    return 2.0 * src.nbytes / t / 1e9


@functools.lru_cache(maxsize=None)
def measure(threads: int) -> dict:
    """``{"threads", "l3_bytes", "sgemm_gflops", "read_gbps", "copy_gbps"}``, once per process and thread count."""
    return {"threads": threads, "l3_bytes": l3_bytes(),
            "sgemm_gflops": round(sgemm_gflops(threads), 1),
            "read_gbps": round(read_gbps(threads), 1),
            "copy_gbps": round(copy_gbps(threads), 1)}


if __name__ == "__main__":
    for n in (1, 2):
        print(measure(n))
