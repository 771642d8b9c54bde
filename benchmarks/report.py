"""Markdown tables (and a bar chart) from pytest-benchmark JSON of the mha_cy benchmark suite.

Usage::

    python benchmarks/report.py                       # runs `pytest benchmarks/` itself, then reports
    python benchmarks/report.py --default-env         # + the SDPA workloads in the environment as it is
    python benchmarks/report.py run1.json [run2.json]  # reports saved runs (--benchmark-json / --benchmark-save)
    python benchmarks/report.py --chart speedups.png   # also writes a bar chart (needs matplotlib)
    python benchmarks/report.py --mha-threads 1 -- -k "encoder or tiny"   # options passed to pytest

One table per workload: implementation, median (and min) time, throughput at the median (GFLOP/s for compute-bound
workloads, GB/s for memory-bound ones, and the fraction of the machine's measured roof), speedup
over the NumPy baseline, and the ratio to the fastest peer (torch, onnxruntime): how many times
faster than the fastest peer (>1 = faster, <1 = slower). The ``threads`` table adds each
implementation's parallel speedup over its own 1-thread time.

The suite runs in a subprocess whose environment lacks OPENBLAS_CORETYPE and OPENBLAS_L2_SIZE
(``USER_ENV_DROPS``): a machine may set them to force OpenBLAS onto older, slower kernels, and a
user's machine has no such variables; the report prints the kernels that ran (scipy's OpenBLAS,
the one mha_cy calls, and numpy's). ``--default-env`` then also runs the attention-only
workloads (``DEFAULT_ENV_WORKLOADS``) with the environment untouched, to show what the
variables cost on this machine. When the suite ran the decode_cache_* workloads, the report
ends with ``cache_formats_interleaved.py``'s output (run right after, in user mode too): the
float16 / int8 steps' speedups over float32 from the same moments.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
BASELINE = "numpy"
PEERS = ("torch_sdpa", "torch_mha", "onnxruntime", "openvino")
IMPL_ORDER = ("mha_cy", "numpy", "torch_sdpa", "torch_mha", "onnxruntime", "openvino")
WORKLOAD_ORDER = ("encoder", "encoder_weights", "encoder_batched", "long_causal", "encoder_sdpa",
                  "encoder_batched_sdpa", "long_causal_sdpa", "decode_gqa", "decode_proj",
                  "decode_cache_f32", "decode_cache_f16", "decode_cache_int8", "decode_ragged",
                  "decode_window", "sentence", "tiny", "threads")
USER_ENV_DROPS = ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE")
DEFAULT_ENV_WORKLOADS = ("encoder_sdpa", "encoder_batched_sdpa", "long_causal_sdpa")


def fmt_time(seconds: float) -> str:
    if seconds < 1e-3:
        return f"{seconds * 1e6:.1f} µs"
    if seconds < 1:
        return f"{seconds * 1e3:.2f} ms" if seconds < 0.1 else f"{seconds * 1e3:.1f} ms"
    return f"{seconds:.3f} s"


def fmt_ratio(x: float | None) -> str:
    return "–" if x is None else f"{x:.2f}×"


def load(path: str) -> dict:
    with open(path) as fh:
        return json.load(fh)


def rows_by_workload(data: dict) -> dict:
    """{workload: [row, ...]} with row = extra_info + median (s) + name."""
    out: dict = {}
    for b in data.get("benchmarks", []):
        info = dict(b.get("extra_info") or {})
        if "workload" not in info:
            continue
        info["median"] = b["stats"]["median"]
        info["min"] = b["stats"]["min"]
        info["name"] = b["name"]
        out.setdefault(info["workload"], []).append(info)
    order = {w: i for i, w in enumerate(WORKLOAD_ORDER)}
    return dict(sorted(out.items(), key=lambda kv: order.get(kv[0], len(order))))


def _impl_key(row):
    name = row["implementation"]
    return (row.get("threads", 0), IMPL_ORDER.index(name) if name in IMPL_ORDER else len(IMPL_ORDER), name)


def machine_line(data: dict) -> str:
    mi = data.get("machine_info", {})
    mb = mi.get("mha_bench", {})
    rows = [r for rs in rows_by_workload(data).values() for r in rs]
    threads = mb.get("threads")
    roof = next((r["roof"] for r in rows if r.get("roof") and r["roof"].get("threads") == threads), None)
    parts = [f"{mb.get('cpu_model') or mi.get('processor', '?')} ({mb.get('logical_cpus', '?')} logical CPUs)",
             f"{threads} threads"]
    if roof:
        parts.append(f"roof: sgemm {roof['sgemm_gflops']:.0f} GFLOP/s, memory read {_mem_roof(roof):.0f} GB/s"
                     + (f" (copy {roof['copy_gbps']:.0f} GB/s)" if "read_gbps" in roof else "")
                     + (f", L3 {roof['l3_bytes'] / 2 ** 20:.0f} MiB" if roof.get("l3_bytes") else ""))
    v = mb.get("versions", {})
    parts.append(", ".join(f"{k} {v[k]}" for k in ("python", "numpy", "torch", "onnxruntime", "openvino") if k in v))
    bi = mb.get("mha_cy_build_info") or {}
    if bi:
        parts.append("mha_cy " + _build_summary(bi))
    kernels = mb.get("blas_kernels") or {}
    if kernels:
        parts.append("BLAS kernels: " + ", ".join(f"{pkg}'s {k}" for pkg, k in sorted(kernels.items())))
    env = mb.get("env") or {}
    parts.append("environment: " + (" ".join(f"{k}={val}" for k, val in env.items()) or "no BLAS/OpenMP variables"))
    line = "Machine: " + "; ".join(parts) + "."
    load = data.get("mha_load") or {}
    if load.get("other_processes_cpus") is not None:
        line += (f" Run: {load['elapsed_s']:.0f} s; other processes kept {load['other_processes_cpus']:.2f} "
                 f"CPUs busy on average meanwhile (load average {load['loadavg_start'][0]:.2f} before, "
                 f"{load['loadavg_end'][0]:.2f} after).")
    return line


def _build_summary(bi: dict) -> str:
    out = []
    if "version" in bi:
        out.append(str(bi["version"]))
    if "openmp" in bi:
        out.append("OpenMP" if bi["openmp"] else "no OpenMP")
    blas = bi.get("blas")
    if isinstance(blas, dict):
        out.append("BLAS " + " ".join(str(blas[k]) for k in ("internal_api", "version") if k in blas))
    elif blas:
        out.append(f"BLAS {blas}")
    if bi.get("simd"):
        out.append(f"SIMD {bi['simd']}")
    if "native_build" in bi:
        out.append("native build" if bi["native_build"] else "portable build")
    return ", ".join(out) if out else str(bi)


def _mem_roof(roof: dict):
    return roof.get("read_gbps") or roof.get("copy_gbps")


def workload_table(workload: str, rows: list) -> list[str]:
    rows = sorted(rows, key=_impl_key)
    first = rows[0]
    memory = first.get("bound") == "memory"
    threads_group = workload == "threads"

    base = {r["threads"]: r["median"] for r in rows if r["implementation"] == BASELINE}
    best_peer: dict = {}
    for r in rows:
        if r["implementation"] in PEERS:
            t = r["threads"]
            best_peer[t] = min(best_peer.get(t, float("inf")), r["median"])
    one_thread = {r["implementation"]: r["median"] for r in rows if r["threads"] == 1}

    unit = "GB/s" if memory else "GFLOP/s"
    head = ["implementation"] + (["threads"] if threads_group else []) + [
        "median", "min", unit, "% of roof", "speedup vs numpy", "vs fastest peer"]
    if threads_group:
        head.append("vs own 1 thread")
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join(["---"] + ["---:"] * (len(head) - 1)) + "|"]
    for r in rows:
        t, med = r["threads"], r["median"]
        work = r["bytes"] if memory else r["flops"]
        rate = work / med / 1e9
        roof = r.get("roof") or {}
        roof_rate = _mem_roof(roof) if memory else roof.get("sgemm_gflops")
        cells = [f"`{r['implementation']}`"] + ([str(t)] if threads_group else []) + [
            fmt_time(med), fmt_time(r["min"]), f"{rate:.1f}",
            f"{100 * rate / roof_rate:.0f}%" if roof_rate else "–",
            fmt_ratio(base[t] / med if t in base else None),
            fmt_ratio(best_peer[t] / med if t in best_peer else None)]
        if threads_group:
            own = one_thread.get(r["implementation"])
            cells.append(fmt_ratio(own / med if own else None))
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def workload_caption(workload: str, rows: list) -> str:
    r = rows[0]
    memory = r.get("bound") == "memory"
    roofs = {}  # threads -> roof of that thread count
    for row in sorted(rows, key=_impl_key):
        if row.get("roof"):
            roofs.setdefault(row["threads"], row["roof"])
    work = r["bytes"] if memory else r["flops"]
    roof_txt = f"{work / 2 ** 20:.0f} MiB moved" if memory else f"{work / 1e9:.3g} GFLOP"
    for t, roof in roofs.items():
        rate = _mem_roof(roof) if memory else roof.get("sgemm_gflops")
        if rate:
            roof_txt += (f"; roof {fmt_time(work / (rate * 1e9))} at {rate:.0f} "
                         f"{'GB/s' if memory else 'GFLOP/s'}" + (f" ({t} thread{'s' if t > 1 else ''})"
                                                                 if len(roofs) > 1 else ""))
    near = next((row["read_gbps_near"] for row in sorted(rows, key=_impl_key) if row.get("read_gbps_near")),
                None)
    if memory and near:
        roof_txt += f" (read measured again as this workload began: {near:.0f} GB/s)"
    shape = f"B={r['B']}, Lq={r['Lq']}, Lk={r['Lk']}, Hq={r['Hq']}, Hkv={r['Hkv']}, D={r['D']}"
    if r.get("kind") != "sdpa":
        shape += f", d_model={r['E']}"
    if r.get("causal"):
        shape += ", causal"
    if r.get("padding"):
        shape += ", key padding"
    if r.get("lengths"):
        shape += f", ragged: cached lengths {', '.join(map(str, r['lengths']))}"
    if r.get("window"):
        shape += f", window={r['window']}"
    return f"### {workload}\n\n{shape}; {roof_txt}.\n"


def weights_cost(by_workload: dict) -> str | None:
    """need_weights=True over the same call without: encoder_weights / encoder, per implementation."""
    plain = {r["implementation"]: r["median"] for r in by_workload.get("encoder", [])}
    ratios = [(r["implementation"], r["median"] / plain[r["implementation"]])
              for r in sorted(by_workload.get("encoder_weights", []), key=_impl_key) if r["implementation"] in plain]
    if not ratios:
        return None
    return ("need_weights=True costs (median time / encoder's): "
            + ", ".join(f"`{name}` {ratio:.2f}×" for name, ratio in ratios) + " (target: at most 1.5×).")


def cache_format_gain(by_workload: dict) -> str | None:
    """How many times faster a float16 / int8 cache makes the decode step than a float32 one
    (decode_cache_f32 median / theirs), per implementation, beside the most the bytes allow:
    the step reads the projection weights too, so at the read roof its time scales with all
    the bytes it moves, not with the cache's alone."""
    base = {r["implementation"]: r for r in by_workload.get("decode_cache_f32", [])}
    parts = []
    for fmt in ("f16", "int8"):
        for r in sorted(by_workload.get(f"decode_cache_{fmt}", []), key=_impl_key):
            b = base.get(r["implementation"])
            if b is not None and r.get("bytes"):
                parts.append(f"{fmt} `{r['implementation']}` {b['median'] / r['median']:.2f}× "
                             f"(bytes allow {b['bytes'] / r['bytes']:.2f}×)")
    if not parts:
        return None
    return ("Step speedup over the float32 cache (median): " + ", ".join(parts) + ". The suite "
            "times these workloads minutes apart, while the host's memory bandwidth moves; "
            "`benchmarks/cache_formats_interleaved.py` times the three steps in turn (its output ends "
            "this report when the suite ran here).")


# Rounds of the cache formats' interleaved timing after the suite (about 15 s on Zen 4)
INTERLEAVED_ROUNDS = 150

# A line under a workload's table that compares it with another workload.
SUMMARIES = {"encoder_weights": weights_cost, "decode_cache_int8": cache_format_gain}


def report(data: dict, source: str) -> str:
    out = [f"Source: {source}", "", machine_line(data), ""]
    by_workload = rows_by_workload(data)
    for workload, rows in by_workload.items():
        out.append(workload_caption(workload, rows))
        out += workload_table(workload, rows)
        summary = SUMMARIES[workload](by_workload) if workload in SUMMARIES else None
        if summary:
            out += ["", summary]
        out.append("")
    if len(out) == 4:
        out.append("(no mha_cy benchmark in this file)")
    return "\n".join(out)


def chart(datasets: list, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = datasets[-1][0]
    groups = []  # (label, {impl: speedup})
    for workload, rows in rows_by_workload(data).items():
        for t in sorted({r["threads"] for r in rows}):
            sub = [r for r in rows if r["threads"] == t]
            base = next((r["median"] for r in sub if r["implementation"] == BASELINE), None)
            if base is None:
                continue
            label = f"{workload}\n({t} thread{'s' if t > 1 else ''})" if workload == "threads" else workload
            groups.append((label, {r["implementation"]: base / r["median"] for r in sub}))
    impls = [i for i in IMPL_ORDER if any(i in g for _, g in groups)]
    width = 0.8 / max(len(impls), 1)
    fig, ax = plt.subplots(figsize=(max(8, 1.5 * len(groups)), 4.8))
    colors = {"mha_cy": "#d62728", "numpy": "#7f7f7f", "torch_sdpa": "#1f77b4", "torch_mha": "#aec7e8",
              "onnxruntime": "#2ca02c", "openvino": "#9467bd"}
    for j, impl in enumerate(impls):
        xs = [i + (j - (len(impls) - 1) / 2) * width for i, (_, g) in enumerate(groups) if impl in g]
        ys = [g[impl] for _, g in groups if impl in g]
        bars = ax.bar(xs, ys, width, label=impl, color=colors.get(impl))
        for bar, y in zip(bars, ys):
            ax.annotate(f"{y:.2g}", (bar.get_x() + bar.get_width() / 2, y), ha="center", va="bottom",
                        fontsize=7, xytext=(0, 1), textcoords="offset points")
    ax.axhline(1.0, color="black", linewidth=0.8)
    values = [y for _, g in groups for y in g.values()] + [1.0]
    log = max(values) / min(values) > 30  # speedups spanning decades: a log axis keeps both ends legible
    if log:
        ax.set_yscale("log")
        ax.set_ylim(min(values) / 1.5, max(values) * 5.0)  # headroom for the legend
    else:
        ax.set_ylim(0, max(values) * 1.3)  # headroom for the legend
    ax.set_xticks(range(len(groups)), [g for g, _ in groups])
    ax.set_ylabel("speedup over the NumPy baseline (×, higher is better" + (", log scale)" if log else ")"))
    threads = (data.get("machine_info", {}).get("mha_bench") or {}).get("threads")
    ax.set_title(f"mha_cy benchmarks: speedup over numpy (median, {threads} threads)")
    ax.legend(ncols=len(impls), fontsize=8, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def subprocess_env(user_env: bool = True) -> dict:
    """This process's environment, without the variables of ``USER_ENV_DROPS`` when
    ``user_env`` (OpenBLAS reads them when it loads, so only a fresh process can drop them)."""
    return {k: v for k, v in os.environ.items() if not (user_env and k in USER_ENV_DROPS)}


def run_suite(threads: int | None, pytest_args: list, user_env: bool = True) -> tuple[dict, str]:
    """Run the suite in a subprocess; ``user_env``: without the variables of ``USER_ENV_DROPS``
    (subprocess_env)."""
    env = subprocess_env(user_env)
    dropped = [k for k in USER_ENV_DROPS if user_env and k in os.environ]
    fd, path = tempfile.mkstemp(prefix="mha_bench_", suffix=".json")
    os.close(fd)
    root = os.path.dirname(HERE)
    cmd = [sys.executable, "-m", "pytest", os.path.relpath(HERE, root), f"--benchmark-json={path}",
           "-p", "no:cacheprovider"]
    if threads is not None:
        cmd.append(f"--mha-threads={threads}")
    cmd += pytest_args
    print("$ " + "".join(f"env -u {k} " for k in dropped) + " ".join(shlex.quote(c) for c in cmd),
          file=sys.stderr, flush=True)
    proc = subprocess.run(cmd, cwd=root, env=env, stdout=sys.stderr)
    if proc.returncode != 0:
        sys.exit(f"pytest failed with exit code {proc.returncode}")
    data = load(path)
    os.unlink(path)
    return data, "python benchmarks/report.py" + (f" --mha-threads {threads}" if threads else "") + (
        " -- " + " ".join(shlex.quote(a) for a in pytest_args) if pytest_args else "")


def run_interleaved(threads: int | None, rounds: int = INTERLEAVED_ROUNDS) -> str:
    """cache_formats_interleaved.py in a subprocess, in user mode as the suite: the float16 /
    int8 steps' speedups over float32 from the same moments (the suite times the three
    workloads minutes apart, while the host's bandwidth moves)."""
    env = subprocess_env()
    script = os.path.join(HERE, "cache_formats_interleaved.py")
    cmd = [sys.executable, script, "--rounds", str(rounds), "--threads", str(threads or 2)]
    proc = subprocess.run(cmd, cwd=os.path.dirname(HERE), env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"cache_formats_interleaved.py failed ({proc.returncode}):\n{proc.stderr}")
    shown = "python benchmarks/" + " ".join(shlex.quote(c) for c in [os.path.basename(script)] + cmd[2:])
    return (f"## The cache formats timed in turn\n\nSource: {shown} (right after the suite)\n\n"
            f"```\n{proc.stdout.strip()}\n```\n")


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    pytest_args = []
    if "--" in argv:
        i = argv.index("--")
        argv, pytest_args = argv[:i], argv[i + 1:]
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("json", nargs="*", help="pytest-benchmark JSON files (default: run the suite)")
    p.add_argument("--chart", metavar="PNG", help="write a bar chart of the speedups over numpy")
    p.add_argument("--mha-threads", type=int, default=None, help="passed to pytest when running the suite")
    p.add_argument("--default-env", action="store_true",
                   help="also run the SDPA workloads with the environment as it is (OPENBLAS_CORETYPE ... kept)")
    args = p.parse_args(argv)

    if args.json:
        datasets = [(load(path), path) for path in args.json]
    else:
        datasets = [run_suite(args.mha_threads, pytest_args)]
    for data, source in datasets:
        command = data.get("mha_command")
        print(report(data, source + (f" (made by: `{command}`)" if command else "")))
    if not args.json and any(w.startswith("decode_cache_") for w in rows_by_workload(datasets[0][0])):
        print(run_interleaved(args.mha_threads))
    if args.default_env and not args.json:
        selected = ["-k", " or ".join(DEFAULT_ENV_WORKLOADS)]
        data, source = run_suite(args.mha_threads, selected, user_env=False)
        print("## In this machine's default environment (variables as they are)\n")
        print(report(data, source.replace("report.py", "report.py --default-env")))
    if args.chart:
        try:
            chart(datasets, args.chart)
        except ImportError:
            print("matplotlib is not installed: no chart (pip install matplotlib)", file=sys.stderr)
            return 1
        print(f"chart written to {args.chart}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
