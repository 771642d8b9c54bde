"""The command line shared by the benchmark scripts that time rounds on some threads."""

from __future__ import annotations

import argparse


def rounds_and_threads(argv, doc: str, rounds: int, threads: int,
                       rounds_help: str = "timed rounds") -> argparse.Namespace:
    """--rounds and --threads (both >= 1, else the usage error), the description the first
    line of doc."""
    p = argparse.ArgumentParser(description=doc.split("\n")[0])
    p.add_argument("--rounds", type=int, default=rounds, help=f"{rounds_help} (default {rounds})")
    p.add_argument("--threads", type=int, default=threads, help=f"threads (default {threads})")
    args = p.parse_args(argv)
    if args.rounds < 1 or args.threads < 1:
        p.error(f"--rounds and --threads must be >= 1, got {args.rounds} and {args.threads}")
    return args
