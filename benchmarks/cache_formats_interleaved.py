"""The decode step over each KV cache dtype, timed in turn: how much faster float16 / int8 are.

The suite times ``decode_cache_f32``, ``_f16`` and ``_int8`` one after the other, minutes
apart; on a shared host the memory bandwidth moves in between, and the float32 step follows it
while steps bound by their arithmetic do not. Here each round runs the three steps back to back
(each over its own 8 or more prefilled caches in turn, as in the suite), so a host phase meets
all three alike, and the ratios come from the same moments::

    python benchmarks/cache_formats_interleaved.py [--rounds 300] [--threads 2]

Run it in user mode as the report does (``env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE``). It
prints each step's median and read rate, the read roof measured before and after, and the
speedups over float32: of the medians, and the median of the per-round ratios.
"""

from __future__ import annotations

import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import implementations  # noqa: E402
import roof  # noqa: E402
import script_args  # noqa: E402
import workloads  # noqa: E402

NAMES = ("decode_cache_f32", "decode_cache_f16", "decode_cache_int8")
WARMUP_ROUNDS = 16


def rotating_step(name: str, threads: int) -> implementations.Prepared:
    """The suite's mha_cy step of workload ``name``, each call over the next of its caches."""
    impl = implementations.IMPLEMENTATIONS["mha_cy"]
    return implementations.rotating(workloads.get(name), impl, workloads.make_data(name), threads)


def main(argv=None) -> None:
    args = script_args.rounds_and_threads(argv, __doc__, rounds=300, threads=2)

    with implementations.thread_limits(args.threads):
        roof_before = roof.read_gbps(args.threads)
        steps = {name: rotating_step(name, args.threads) for name in NAMES}
        times = {name: [] for name in NAMES}
        for r in range(WARMUP_ROUNDS + args.rounds):
            for name, step in steps.items():
                call_args, kwargs = step.setup()
                t0 = time.perf_counter()
                step.run(*call_args, **kwargs)
                if r >= WARMUP_ROUNDS:
                    times[name].append(time.perf_counter() - t0)
        roof_after = roof.read_gbps(args.threads)

    print(f"{args.rounds} rounds, {args.threads} threads; read roof {roof_before:.1f} GB/s before, "
          f"{roof_after:.1f} after; OPENBLAS_CORETYPE={os.environ.get('OPENBLAS_CORETYPE')}")
    base = NAMES[0]
    for name in NAMES:
        med = statistics.median(times[name])
        rate = workloads.get(name).bytes / med / 1e9
        line = f"{name}: median {med * 1e3:.3f} ms, {rate:.1f} GB/s"
        if name != base:
            allow = workloads.get(base).bytes / workloads.get(name).bytes
            per_round = statistics.median(a / b for a, b in zip(times[base], times[name]))
            line += (f"; {statistics.median(times[base]) / med:.2f}x the float32 step "
                     f"(per-round median {per_round:.2f}x; the bytes allow {allow:.2f}x)")
        print(line)


if __name__ == "__main__":
    main()
