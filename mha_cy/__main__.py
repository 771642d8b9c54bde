"""python -m mha_cy: show the build, run one attention layer through mha_cy and the NumPy
baseline, check that they agree and compare their speed.
python -m mha_cy heads SENTENCE: draw a real model's attention heads (mha_cy/_heads_cli.py)."""
import argparse
import contextlib
import statistics
import sys
import time

import numpy as np

from . import MultiHeadAttention, build_info, reference, threads
from ._build_info import format_build_info
from ._threads import MAX_NUM_THREADS

# Agreement required between mha_cy and the NumPy baseline, relative to the output's scale.
RTOL = {np.float32: 1e-4, np.float64: 1e-10}


def _parse_args(argv):
    parser = argparse.ArgumentParser(
        prog="python -m mha_cy",
        description="Print how mha_cy was built, then run one multi-head self-attention layer "
                    "(default: BERT-base size, batch 1 x 128 tokens, d_model 768, 12 heads) "
                    "through mha_cy and through the pure-NumPy baseline (mha_cy.reference) "
                    "with the same random weights; check that the outputs agree and print the "
                    "median time of each and the speedup. Exit status 1 if they disagree.",
        epilog="python -m mha_cy heads SENTENCE [--layer N] [--out PATH] draws the attention "
               "heads of a real sentence model instead (see python -m mha_cy heads --help).")
    parser.add_argument("--batch", type=int, default=1, help="sequences per call (default 1)")
    parser.add_argument("--seq-len", type=int, default=128, help="tokens per sequence (default 128)")
    parser.add_argument("--embed-dim", type=int, default=768, help="d_model (default 768)")
    parser.add_argument("--heads", type=int, default=12, help="query heads (default 12)")
    parser.add_argument("--kv-heads", type=int, default=None,
                        help="key/value heads: 1 = MQA, a divisor of --heads = GQA "
                             "(default: = --heads, plain MHA)")
    parser.add_argument("--causal", action="store_true",
                        help="decoder (causal) attention instead of encoder attention")
    parser.add_argument("--threads", type=int, default=None,
                        help="threads for mha_cy's kernels (default: all usable cores)")
    parser.add_argument("--dtype", choices=["float32", "float64"], default="float32")
    parser.add_argument("--repeats", type=int, default=None,
                        help="timed calls per implementation (default: as many as fit in ~1 s)")
    parser.add_argument("--seed", type=int, default=0, help="seed of weights and input")
    args = parser.parse_args(argv)
    for name in ("batch", "seq_len", "embed_dim", "heads"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.embed_dim % args.heads:
        parser.error(f"--heads ({args.heads}) must divide --embed-dim ({args.embed_dim})")
    if args.kv_heads is not None and (args.kv_heads < 1 or args.heads % args.kv_heads):
        parser.error(f"--kv-heads ({args.kv_heads}) must be >= 1 and divide --heads ({args.heads})")
    if args.threads is not None and not 1 <= args.threads <= MAX_NUM_THREADS:
        parser.error(f"--threads must be between 1 and {MAX_NUM_THREADS}")
    if args.seed < 0:
        parser.error("--seed must be >= 0")
    if args.repeats is not None and args.repeats < 1:
        parser.error("--repeats must be >= 1")
    return args


def _median_seconds(fn, repeats):
    fn()                                           # warm-up: allocations, thread start
    if repeats is None:                            # enough calls for ~1 s, at least 3
        start = time.perf_counter()
        fn()
        repeats = max(3, min(1000, int(1.0 / max(time.perf_counter() - start, 1e-6))))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), repeats


def _format_time(seconds):
    return f"{seconds * 1e3:.3f} ms" if seconds >= 1e-3 else f"{seconds * 1e6:.1f} us"


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["heads"]:               # the subcommand; everything else is the main job
        from ._heads_cli import main as heads_main
        return heads_main(argv[1:])
    args = _parse_args(argv)
    dtype = np.dtype(args.dtype).type
    with threads(args.threads) if args.threads else contextlib.nullcontext():
        print(format_build_info(build_info()))
        print()
        fast = MultiHeadAttention(args.embed_dim, args.heads, num_kv_heads=args.kv_heads,
                                  dtype=dtype, seed=args.seed)
        baseline = reference.MultiHeadAttention.from_weights(
            fast.q_weight, fast.k_weight, fast.v_weight, fast.out_weight,
            num_heads=args.heads, num_kv_heads=args.kv_heads, q_bias=fast.q_bias,
            k_bias=fast.k_bias, v_bias=fast.v_bias, out_bias=fast.out_bias, dtype=dtype)
        x = np.random.default_rng(args.seed).standard_normal(
            (args.batch, args.seq_len, args.embed_dim)).astype(dtype)

        kv = args.kv_heads or args.heads
        kind = "MHA" if kv == args.heads else ("MQA" if kv == 1 else f"GQA ({kv} kv heads)")
        print(f"workload: batch {args.batch} x {args.seq_len} tokens, d_model {args.embed_dim}, "
              f"{args.heads} heads {kind}, {'causal' if args.causal else 'no mask'}, "
              f"{args.dtype}, {build_info()['num_threads']} thread(s)")

        out_fast = fast(x, is_causal=args.causal)
        out_ref = baseline(x, is_causal=args.causal)
        scale = float(np.max(np.abs(out_ref))) or 1.0
        error = float(np.max(np.abs(out_fast - out_ref))) / scale
        agree = bool(np.all(np.isfinite(out_fast))) and error <= RTOL[dtype]
        print(f"agreement: max |mha_cy - numpy| / max |numpy| = {error:.2e} "
              f"(tolerance {RTOL[dtype]:.0e}): {'OK' if agree else 'MISMATCH'}")

        t_fast, n_fast = _median_seconds(lambda: fast(x, is_causal=args.causal), args.repeats)
        t_ref, n_ref = _median_seconds(lambda: baseline(x, is_causal=args.causal), args.repeats)
        print(f"mha_cy (Cython + OpenMP + BLAS): {_format_time(t_fast):>12}  median of {n_fast}")
        print(f"numpy baseline (reference):      {_format_time(t_ref):>12}  median of {n_ref}")
        print(f"speedup: {t_ref / t_fast:.2f}x")
    return 0 if agree else 1


if __name__ == "__main__":
    sys.exit(main())
