"""Does the host give this process one core per thread right now?

Each round times a one-thread mha_cy call (the `sentence` workload's shape) alone, two such
calls side by side in two Python threads, each with its own module and input (no shared
writes, no OpenMP team), and the call alone again. With a core each, side by side takes the
time alone; on a VM whose two vCPUs run, for that moment, at the pace of one core, it takes
twice as long. In that state every 2-thread figure reads as the 1-thread time, whatever the
code does (see README.md, Noise).

    python benchmarks/host_check.py [rounds]
"""

from __future__ import annotations

import statistics
import sys
import threading
import time

import numpy as np

import mha_cy

E, HEADS, L = 384, 12, 32      # the sentence workload: all-MiniLM-L6-v2, 32 tokens
CALLS = 300


def _median_us(module, x):
    with mha_cy.threads(1):
        for _ in range(20):
            module(x)
        times = []
        for _ in range(CALLS):
            t0 = time.perf_counter()
            module(x)
            times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def main(rounds: int = 10) -> None:
    rng = np.random.default_rng(0)
    modules, inputs = [], []
    for _ in range(2):
        w = [rng.standard_normal((E, E), dtype=np.float32) * 0.05 for _ in range(4)]
        modules.append(mha_cy.MultiHeadAttention.from_weights(*w, num_heads=HEADS))
        inputs.append(rng.standard_normal((1, L, E), dtype=np.float32))
    for r in range(rounds):
        alone = _median_us(modules[0], inputs[0])
        side = [0.0, 0.0]

        def run(i):
            side[i] = _median_us(modules[i], inputs[i])
        threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        alone = min(alone, _median_us(modules[0], inputs[0]))    # alone: before or after
        cores = 2 * alone / max(side)
        print(f"round {r}: alone {alone:.0f} us, side by side {side[0]:.0f} / {side[1]:.0f} us: "
              f"{cores:.2f} cores' worth" + ("" if cores > 1.7 else "  <- the host gave less"))


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 10)
