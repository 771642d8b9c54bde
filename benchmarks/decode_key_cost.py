"""What one cached key costs a decode step, per cache dtype, when the cache is not the limit.

A decode step over a cache held in L2/L3 is bound by its arithmetic, not by memory; the
difference between the step over two cache lengths, divided by the keys added, is that cost
(the projections and the call's overhead cancel out). The six steps are timed in turn, round
after round, and each point is a median. One thread by default: a key a core::

    python benchmarks/decode_key_cost.py [--threads 1] [--rounds 400]

Shapes: a batch of one, 16 query heads over 4 K/V heads (groups of 4, as the decode_cache_*
workloads), head dim 128, d_model 64; 256 and 768 cached tokens (3 MiB of float32 cache).
Run it in user mode as the report does (``env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE``).
"""

from __future__ import annotations

import os
import statistics
import sys
import time

import numpy as np

import mha_cy

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import script_args  # noqa: E402

DTYPES = ("float32", "float16", "int8")
SHORT, LONG = 256, 768
HEADS, KV_HEADS, HEAD_DIM, D_MODEL = 16, 4, 128, 64


def prepared_step(dtype: str, cached: int):
    """One step over `cached` tokens, the cache rewound before each call: a timed callable."""
    rng = np.random.default_rng(0)
    module = mha_cy.MultiHeadAttention(D_MODEL, HEADS, num_kv_heads=KV_HEADS,
                                       head_dim=HEAD_DIM, seed=0)
    cache = module.new_cache(1, cached + 1, dtype=dtype)
    module(rng.standard_normal((1, cached, D_MODEL)).astype(np.float32), cache=cache)
    x = rng.standard_normal((1, 1, D_MODEL)).astype(np.float32)

    def timed() -> float:
        cache.truncate(cached)
        t0 = time.perf_counter()
        module(x, cache=cache)
        return time.perf_counter() - t0
    return timed


def main(argv=None) -> None:
    args = script_args.rounds_and_threads(argv, __doc__, rounds=400, threads=1,
                                          rounds_help="timed calls per point")
    print(f"{args.threads} thread(s); {HEADS} query heads over {KV_HEADS} K/V heads, D "
          f"{HEAD_DIM}; steps over {SHORT} and {LONG} cached tokens")
    points = [(dtype, n) for dtype in DTYPES for n in (SHORT, LONG)]
    steps = {point: prepared_step(*point) for point in points}
    times = {point: [] for point in points}
    with mha_cy.threads(args.threads):
        for _ in range(args.rounds):      # round after round: a host phase meets every point
            for point, step in steps.items():
                times[point].append(step())
        for dtype in DTYPES:
            short, long = (statistics.median(times[dtype, n]) for n in (SHORT, LONG))
            per_key = (long - short) / ((LONG - SHORT) * KV_HEADS) * args.threads
            print(f"{dtype:8s} {per_key * 1e9:5.1f} ns a key and thread (steps {short * 1e6:.1f}"
                  f" / {long * 1e6:.1f} us)")


if __name__ == "__main__":
    main()
