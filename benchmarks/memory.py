"""Peak extra memory of one call, per workload and implementation.

Usage::

    python benchmarks/memory.py                         # every workload (but `threads`), every implementation
    python benchmarks/memory.py --workloads long_causal --impls numpy mha_cy
    python benchmarks/memory.py --json mem.json         # also save the raw numbers

Each measurement runs in a fresh Python process (so one implementation's allocator state, arenas
or thread pools never show up in another's numbers), which:

1. prepares the call as the benchmarks do (inputs, weights, sessions, a prefilled KV cache): not
   counted in the call figures below;
2. **first call**: resets the kernel's peak-RSS mark (``/proc/self/clear_refs`` = 5), makes one
   call, and reports ``ru_maxrss`` (``resource.getrusage``) minus the RSS just before the call:
   everything the call touched, including one-time growth (arenas, thread stacks, lazily loaded
   code);
   Also the highest RSS from just before ``prepare`` through that call, minus the RSS before
   ``prepare``: the weights, sessions and caches the setup builds, and any memory that calls made
   during the setup (onnxruntime's choice of its fastest op runs each variant) keep in an arena,
   which the first and steady calls then no longer show;
3. **steady call**: the same for a second call: what a call in a serving loop needs on top of what
   the process already holds;
4. **tracemalloc**: a third call under ``tracemalloc``: the peak of NumPy's and Python's own
   allocations (NumPy reports its data buffers to tracemalloc; torch, onnxruntime and C/Cython
   ``malloc`` do not, so their figure there is only the Python-side part).

Where ``/proc/self/clear_refs`` is unavailable (not Linux), the RSS figures are of the whole process
peak and say so. The output is a markdown table; the NumPy baseline on ``long_causal`` shows its
(B, H, L, L) = 1 x 8 x 4096 x 4096 float32 score tensor: 512 MiB, and more for the softmax's
temporaries.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
MiB = 2 ** 20


def _status_kib(key: str) -> int | None:
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith(key + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def _reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
        return True
    except OSError:
        return False


def _peak_rss_bytes() -> int:
    import resource

    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    hwm = _status_kib("VmHWM")
    return 1024 * max(peak_kib, hwm or 0)


def _rss_bytes() -> int:
    kib = _status_kib("VmRSS")
    if kib is not None:
        return 1024 * kib
    import resource

    return 1024 * resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def child(workload: str, impl_name: str, threads: int) -> dict:
    """Runs in the fresh process: prepare, then measure three calls."""
    import gc
    import tracemalloc

    sys.path.insert(0, HERE)
    import implementations
    import workloads

    w = workloads.get(workload)
    impl = implementations.IMPLEMENTATIONS[impl_name]
    reason = impl.unavailable() or impl.unsupported_here(w)
    if reason:
        return {"skipped": reason}
    data = workloads.make_data(workload)
    with implementations.thread_limits(threads):
        # from before prepare: an implementation whose prepare calls it (onnxruntime's choice
        # of its fastest op, warm-up runs) grows its arenas there, and the calls after it
        # then need nothing more
        gc.collect()
        reset = _reset_peak()
        setup_start = _rss_bytes()
        prepared = impl.prepare(w, data, threads)
        setup_peak = _peak_rss_bytes()

        def one_call():
            args, kwargs = prepared.setup() if prepared.setup is not None else ((), {})
            gc.collect()
            return args, kwargs

        result = {}
        for label in ("first", "steady"):
            args, kwargs = one_call()
            reset = _reset_peak() and reset
            before = _rss_bytes()
            out = prepared.run(*args, **kwargs)
            peak = _peak_rss_bytes()
            del out, args, kwargs
            result[label] = peak - before
            result["peak_reset"] = reset
            if label == "first":    # the highest RSS from before prepare through this call
                result["prepared"] = max(setup_peak, peak) - setup_start
        args, kwargs = one_call()
        tracemalloc.start()
        base, _ = tracemalloc.get_traced_memory()
        tracemalloc.reset_peak()
        out = prepared.run(*args, **kwargs)
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        del out
        result["tracemalloc"] = peak - base
    return result


def measure(workload: str, impl_name: str, threads: int) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", workload, impl_name, str(threads)]
    # the child imports what this process imports (same sys.path: e.g. a checkout's mha_cy)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["?"]
        return {"error": f"exit {proc.returncode}: {tail[0]}"}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def fmt_mib(n: int | None) -> str:
    if n is None:
        return "–"
    if abs(n) < MiB:
        return f"{n / 1024:.0f} KiB"
    return f"{n / MiB:.1f} MiB" if n < 100 * MiB else f"{n / MiB:.0f} MiB"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workloads", nargs="*", default=None, help="default: all but `threads`")
    p.add_argument("--impls", nargs="*", default=None, help="default: all")
    p.add_argument("--mha-threads", type=int, default=2)
    p.add_argument("--json", metavar="PATH", help="also write the raw numbers")
    p.add_argument("--child", nargs=3, metavar=("WORKLOAD", "IMPL", "THREADS"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)

    if args.child:
        w, impl, n = args.child
        print(json.dumps(child(w, impl, int(n))))
        return 0

    sys.path.insert(0, HERE)
    import implementations
    import workloads

    names = args.workloads or [n for n in workloads.WORKLOADS if n != "threads"]
    impls = args.impls or list(implementations.IMPLEMENTATIONS)
    print(f"Peak extra memory of one call ({args.mha_threads} threads; a fresh process per row; "
          f"ΔRSS = peak RSS during the call minus RSS before it; 'prepare + first call': from "
          f"before the implementation's setup (weights, session, a prefilled cache, the warm-up calls "
          f"some setups make) through its first call, so that memory a setup's calls keep in an arena "
          f"counts)\n")
    print("| workload | implementation | ΔRSS prepare + first call | ΔRSS first call | ΔRSS steady call "
          "| tracemalloc peak (NumPy/Python) |")
    print("|---|---|---:|---:|---:|---:|")
    raw = []
    for wname in names:
        for impl in impls:
            r = measure(wname, impl, args.mha_threads)
            raw.append({"workload": wname, "implementation": impl, **r})
            if "skipped" in r:
                continue
            if "error" in r:
                print(f"| {wname} | `{impl}` | error: {r['error']} | | | |", flush=True)
                continue
            note = "" if r.get("peak_reset") else " (process peak)"
            print(f"| {wname} | `{impl}` | {fmt_mib(r['prepared'])}{note} | {fmt_mib(r['first'])}{note} | "
                  f"{fmt_mib(r['steady'])}{note} | {fmt_mib(r['tracemalloc'])} |", flush=True)
    w = workloads.get("long_causal")
    scores = 4 * w.B * w.Hq * w.Lq * w.Lk
    print(f"\nFor scale: long_causal's full score tensor, B*H*L*L float32 = {w.B}*{w.Hq}*{w.Lq}*{w.Lk}*4 B "
          f"= {fmt_mib(scores)}; its input and output, B*L*E float32 = {fmt_mib(4 * w.B * w.Lq * w.E)} each.")
    for r in raw:
        if r["workload"] == "long_causal" and "steady" in r:
            # a call that grows by a quarter of the score tensor holds it; one whose setup (and
            # its calls' arenas, sessions and libraries) holds that much but whose calls do not
            # grow cannot be told apart here
            quarter = scores / 4
            if max(r["first"], r["steady"]) >= quarter:
                verdict = "O(L^2) memory"
            elif r["prepared"] < quarter:
                verdict = "O(L) memory, no L x L tensor"
            else:
                verdict = ("not told here: its calls grow by less than a quarter of the score "
                           "tensor, but the process grew more from before its setup (whose own "
                           "calls warm its arenas) through the first call")
            print(f"- long_causal `{r['implementation']}`: first call {fmt_mib(r['first'])}, steady "
                  f"call {fmt_mib(r['steady'])}, setup through the first call "
                  f"{fmt_mib(r['prepared'])}: {verdict}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(raw, fh, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
