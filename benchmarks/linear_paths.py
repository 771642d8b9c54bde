"""CPU time of the projection kernel per path, each figure from a fresh process.

OpenBLAS keeps per-process state that changes the speed of later calls (see PANEL_MAX_ROWS in
mha_cy/_linear_kernel.pyx), so a figure measured after other shapes ran in the same process can
be off by 3x: each (shape, path) runs in its own interpreter. Paths: `panels` (the default:
src/row_panel_gemm.c), `blas_tiles` (the pre-fix rule: BLAS tiles above 256 rows), `numpy`
(one large sgemm, x @ w.T). One thread is timed with process_time; more threads report the total
CPU time of the call (wall time on a loaded machine says little).

    python benchmarks/linear_paths.py [--threads 1 2]
"""
import argparse
import subprocess
import sys

SHAPES = {   # name: (rows M, in_features K, out_features N)
    "encoder qkv": (128, 768, 2304), "encoder out": (128, 768, 768),
    "encoder_batched qkv": (4096, 768, 2304), "long_causal qkv": (4096, 512, 1536),
    "MiniLM qkv": (512, 384, 1152), "257 rows": (257, 384, 1152), "300 rows": (300, 384, 1152),
    "1024 rows": (1024, 384, 1152), "4096 rows": (4096, 384, 1152),
}

CHILD = r"""
import sys, time, numpy as np
from threadpoolctl import threadpool_limits
from mha_cy import _linear_kernel as lk
path, M, K, N, nt = sys.argv[1], *map(int, sys.argv[2:6])
threadpool_limits(nt if path == "numpy" else 1)
if path == "blas_tiles":
    lk._set_panel_max_rows(256)
rng = np.random.default_rng(0)
x, w = (rng.standard_normal(s).astype(np.float32) for s in ((M, K), (N, K)))
out = np.empty((M, N), np.float32)
run = (lambda: np.matmul(x, w.T, out=out)) if path == "numpy" else (lambda: lk.linear(x, w, None, out, nt))
run()
reps, best = max(1, int(5e8 / (2 * M * N * K))), float("inf")
for _ in range(2):
    t0 = time.process_time()
    for _ in range(reps):
        run()
    best = min(best, (time.process_time() - t0) / reps)
np.testing.assert_allclose(out, x @ w.T, rtol=1e-3, atol=1e-2)
print(f"{best * 1e3:.2f}")
"""


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, nargs="+", default=[1])
    parser.add_argument("--paths", nargs="+", default=["blas_tiles", "panels", "numpy"])
    args = parser.parse_args()
    cols = [(p, t) for t in args.threads for p in args.paths]
    print("| shape (M, K -> N) | " + " | ".join(f"{p} {t}T ms" for p, t in cols) + " |")
    print("|---|" + "---:|" * len(cols))
    for name, (M, K, N) in SHAPES.items():
        cells = [subprocess.run([sys.executable, "-c", CHILD, p, str(M), str(K), str(N), str(t)],
                                capture_output=True, text=True, check=True).stdout.strip()
                 for p, t in cols]
        print(f"| {name} ({M}, {K} -> {N}) | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
