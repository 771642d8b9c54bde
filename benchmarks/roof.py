"""The machine's roof, measured once per thread count: what BLAS sgemm and memory copies reach.

- ``sgemm_gflops``: ``scipy.linalg.blas.sgemm`` on 2048 x 2048 float32 (2 * 2048**3 FLOP), best of 5,
  with BLAS limited to ``threads`` (threadpoolctl).
- ``read_gbps``: ``threads`` Python threads each run ``np.max`` over one slice of a 1 GiB float32
  array (far larger than L3, so it streams from memory; ``np.max`` is a pure read, vectorized,
  single-threaded and releases the GIL), best of 3. (BLAS ``sdot`` read half as fast: it does
  not keep up with the memory.)
- ``copy_gbps``: the same threads each ``np.copyto`` one slice of a 256 MiB array, counted as
  read + write = 2 * 256 MiB (STREAM "copy" convention, write-allocate traffic not counted).

Compute-bound workloads are compared with ``sgemm_gflops``; memory-bound ones (decoding: they read
a KV cache and weights and write almost nothing) with ``read_gbps``. ``copy_gbps`` is for the record.
"""

from __future__ import annotations

import concurrent.futures
import functools
import time

import numpy as np
import threadpoolctl


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


def read_gbps(threads: int, nbytes: int = 2 ** 30) -> float:
    src = np.ones(nbytes // 4, np.float32)
    slices = _slices(src.size, threads)
    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        t = _best(lambda: list(pool.map(lambda s: np.max(src[s]), slices)), repeat=3)
    return src.nbytes / t / 1e9


def copy_gbps(threads: int, nbytes: int = 256 * 2 ** 20) -> float:
    src = np.ones(nbytes // 4, np.float32)
    dst = np.empty_like(src)
    slices = _slices(src.size, threads)
    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        t = _best(lambda: list(pool.map(lambda s: np.copyto(dst[s], src[s]), slices)))
    return 2.0 * src.nbytes / t / 1e9


@functools.lru_cache(maxsize=None)
def measure(threads: int) -> dict:
    """``{"threads", "sgemm_gflops", "read_gbps", "copy_gbps"}``, once per process and thread count."""
    return {"threads": threads,
            "sgemm_gflops": round(sgemm_gflops(threads), 1),
            "read_gbps": round(read_gbps(threads), 1),
            "copy_gbps": round(copy_gbps(threads), 1)}


if __name__ == "__main__":
    for n in (1, 2):
        print(measure(n))
