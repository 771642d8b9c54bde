"""pytest-benchmark configuration of the mha_cy benchmark suite (``pytest benchmarks/``).

- ``--mha-threads N`` (default 2): the thread count of every implementation. The ``threads``
  workload runs at 1, 2 and N threads whatever N is.
- The test cases (workload x implementation) are generated here, because the thread counts of the
  ``threads`` workload depend on the option.
- ``machine_info`` of the saved JSON gains an ``mha_bench`` entry: thread count, CPU model, the
  BLAS/OpenMP environment variables, package versions, ``mha_cy.build_info()`` and
  ``blas_kernels``: the kernels (threadpoolctl's ``architecture``) scipy's OpenBLAS (the one
  mha_cy calls) and numpy's run, which OPENBLAS_CORETYPE can force to an older core. The measured
  roof (sgemm GFLOP/s, memory read/copy GB/s) varies run to run, so it goes in each benchmark's
  ``extra_info`` instead (a varying machine_info would make every ``--benchmark-compare`` warn).
- The JSON also gets ``mha_command`` (the pytest command line) and ``mha_load`` (how many CPUs
  other processes kept busy during the run: the noise floor of the figures).
- ``MHA_BENCH_SLEEP=seconds`` (with ``MHA_BENCH_SLEEP_IMPL=name[,name]``, default: all) makes the
  timed call sleep first: a deliberate regression to prove that ``--benchmark-compare-fail``
  catches one (benchmarks/compare_smoke.sh). Nothing outside this harness reads it.
"""

from __future__ import annotations

import json
import os
import platform
import sys
import time

import pytest

# The helper modules beside this file (workloads, implementations, roof) must import whatever
# --import-mode the root configuration picks.
_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)

# BLAS/OpenMP environment as the user set it (snapshot before threadpoolctl, which sets
# KMP_DUPLICATE_LIB_OK itself on import).
_ENV_PREFIXES = ("OPENBLAS_", "OMP_", "MKL_", "GOTO", "KMP_", "MHA_CY")
_ENV = {k: v for k, v in sorted(os.environ.items()) if k.startswith(_ENV_PREFIXES)}


def pytest_addoption(parser):
    group = parser.getgroup("mha_cy benchmarks")
    group.addoption("--mha-threads", type=int, default=2, metavar="N",
                    help="threads for every implementation (BLAS, OpenMP, torch, ORT, mha_cy); default 2")


def _threads(config) -> int:
    n = config.getoption("mha_threads")
    if n is None or n < 1:
        raise pytest.UsageError(f"--mha-threads must be >= 1, got {n}")
    return n


def pytest_generate_tests(metafunc):
    if "case" not in metafunc.fixturenames:
        return
    import implementations
    import workloads

    n = _threads(metafunc.config)
    cases, ids = [], []
    for wname in workloads.WORKLOADS:  # the order: encoder ... tiny, threads
        w = workloads.get(wname)
        counts = sorted({1, 2, n}) if wname == "threads" else [n]
        for t in counts:
            for impl in implementations.IMPLEMENTATIONS.values():
                cases.append((w, t, impl))
                ids.append(f"{wname}-{t}t-{impl.name}" if wname == "threads" else f"{wname}-{impl.name}")
    metafunc.parametrize("case", cases, ids=ids)


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def blas_kernels() -> dict:
    """{"scipy": core, "numpy": core}: the kernels each package's own BLAS runs."""
    import scipy.linalg  # noqa: F401  (loads scipy's BLAS)
    import threadpoolctl

    out = {}
    for lib in threadpoolctl.threadpool_info():
        if lib.get("user_api") != "blas":
            continue
        parts = os.path.realpath(lib.get("filepath", "")).split(os.sep)
        for package in ("scipy", "numpy"):  # wheels keep their BLAS in <package>.libs/
            if any(p == package or p.startswith(package + ".") for p in parts):
                out[package] = f"{lib.get('internal_api')} {lib.get('version')} {lib.get('architecture', '?')}"
    return out


def bench_machine_info(threads: int) -> dict:
    """The stable facts of this machine and software stack (what the report prints)."""
    import mha_cy

    import implementations

    try:
        build = json.loads(json.dumps(mha_cy.build_info(), default=str))
    except Exception as exc:  # report, don't fail the run
        build = {"error": repr(exc)}
    return {
        "threads": threads,
        "cpu_model": _cpu_model(),
        "logical_cpus": os.cpu_count(),
        "env": dict(_ENV),
        "blas_kernels": blas_kernels(),
        "versions": implementations.versions(),
        "mha_cy_build_info": build,
    }


def pytest_benchmark_update_machine_info(config, machine_info):
    cpu = machine_info.get("cpu")
    if isinstance(cpu, dict):  # drop what changes between two runs on the same machine
        for key in ("hz_actual", "hz_actual_friendly"):
            cpu.pop(key, None)
    machine_info["mha_bench"] = bench_machine_info(_threads(config))


def _cpu_snapshot():
    """(wall time, busy CPU seconds of the whole machine, CPU seconds of this process)."""
    import resource

    busy = None
    try:
        with open("/proc/stat") as fh:
            fields = [int(x) for x in fh.readline().split()[1:]]
        idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
        busy = (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        pass
    own = resource.getrusage(resource.RUSAGE_SELF)
    return time.monotonic(), busy, own.ru_utime + own.ru_stime


_SESSION_START: dict = {}


def pytest_sessionstart(session):
    _SESSION_START["cpu"] = _cpu_snapshot()
    _SESSION_START["loadavg"] = os.getloadavg()


def pytest_benchmark_update_json(config, benchmarks, output_json):
    # Kept out of machine_info (they vary run to run): the command that made the file, and how
    # busy the machine was with other work while the suite ran (the figures' noise floor).
    import shlex

    output_json["mha_command"] = "pytest " + " ".join(shlex.quote(str(a)) for a in config.invocation_params.args)
    if "cpu" in _SESSION_START:
        t0, busy0, own0 = _SESSION_START["cpu"]
        t1, busy1, own1 = _cpu_snapshot()
        foreign = None
        if busy0 is not None and busy1 is not None and t1 > t0:
            foreign = max(0.0, ((busy1 - busy0) - (own1 - own0)) / (t1 - t0))
        output_json["mha_load"] = {
            "elapsed_s": round(t1 - t0, 1),
            "other_processes_cpus": None if foreign is None else round(foreign, 2),
            "loadavg_start": [round(x, 2) for x in _SESSION_START["loadavg"]],
            "loadavg_end": [round(x, 2) for x in os.getloadavg()],
        }
