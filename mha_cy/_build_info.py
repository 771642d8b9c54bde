"""What this installation of mha_cy is: build options, threads, BLAS, SIMD."""

import os
import platform
import sys

from ._blas_kernel import blas_warning
from ._cpu_features import (build_flags, compiler_version, cpu_simd_level, int8_dot,
                            native_build, simd_level)
from ._openmp_helpers import openmp_enabled, openmp_max_threads
from ._threads import _scipy_blas_info, get_num_threads
from ._version import __version__

__all__ = ["build_info", "format_build_info"]

_BLAS_KEYS = ("internal_api", "version", "filepath", "threading_layer", "num_threads")


def _blas_info():
    """scipy's BLAS as threadpoolctl sees it, or "unknown"."""
    try:
        info = _scipy_blas_info()
    except Exception:  # threadpoolctl failing must not break build_info()
        info = None
    if info is None:
        return "unknown"
    blas = {key: info.get(key) for key in _BLAS_KEYS}
    if info.get("architecture"):
        blas["architecture"] = info["architecture"]
    return blas


def build_info():
    """Facts about this build and process, as a dict (for bug reports and tests).

    Keys:
      version        mha_cy version (str)
      openmp         compiled and linked with OpenMP (bool); False: serial kernels
      num_threads    threads the kernels use now: get_num_threads() (int)
      max_threads    omp_get_max_threads() (int; 1 without OpenMP)
      blas           scipy's BLAS, the one the kernels call (dict with internal_api,
                     version, filepath, threading_layer, num_threads[, architecture]),
                     or "unknown" when threadpoolctl cannot find it
      blas_warning   None, or why scipy's BLAS runs kernels below the CPU's SIMD level
                     (e.g. OPENBLAS_CORETYPE=Haswell on an AVX-512 CPU) and the remedy (str)
      simd           SIMD level every C kernel runs (str: "avx512", "avx2", "sse2",
                     "generic"; "native" in native builds): the CPU's best, or the lower
                     one the environment variable MHA_CY_SIMD forces
      simd_cpu       the best level this CPU runs (str, same values)
      int8_dot       how an int8 KV cache's decode steps multiply: "vnni" (integer
                     products, AVX512-VNNI at the avx512 level) or "float"; the
                     environment variable MHA_CY_INT8_DOT=float forces "float"
      native_build   built with MHA_CY_NATIVE=1 / -march=native (bool)
      python, numpy, scipy   versions (str)
      compiler       {"version": ..., "flags": extra C flags of the build} (dict)
      platform       e.g. "Linux-6.1-x86_64" (str)
    """
    import numpy  # noqa: PLC0415
    import scipy  # noqa: PLC0415

    blas, simd = _blas_info(), simd_level()
    core = blas.get("architecture") if isinstance(blas, dict) else None
    return {
        "version": __version__,
        "openmp": openmp_enabled(),
        "num_threads": get_num_threads(),
        "max_threads": openmp_max_threads(),
        "blas": blas,
        "blas_warning": blas_warning(core, cpu_simd_level(), os.environ),
        "simd": simd,
        "simd_cpu": cpu_simd_level(),
        "int8_dot": int8_dot(),
        "native_build": native_build(),
        "python": platform.python_version(),
        "numpy": numpy.__version__,
        "scipy": scipy.__version__,
        "compiler": {"version": compiler_version(), "flags": build_flags()},
        "platform": platform.platform(terse=True),
    }


def format_build_info(info=None):
    """A few human-readable lines of build_info() (what ``python -m mha_cy`` prints)."""
    if info is None:
        info = build_info()
    openmp = "yes" if info["openmp"] else "NO (serial kernels)"
    native = ", native build (-march=native)" if info["native_build"] else ""
    blas = info["blas"]
    if isinstance(blas, dict):
        kernels = f"{blas['architecture']} kernels, " if blas.get("architecture") else ""
        blas_line = (
            f"{blas.get('internal_api')} {blas.get('version')} "
            f"({kernels}{blas.get('threading_layer')}, {blas.get('num_threads')} threads) "
            f"at {blas.get('filepath')}"
        )
    else:
        blas_line = str(blas)
    compiler = info.get("compiler") or {}
    lines = [
        f"mha_cy {info['version']}",
        f"  OpenMP:   {openmp}; kernels use {info['num_threads']} thread(s), "
        f"OpenMP max {info['max_threads']}",
        f"  SIMD:     {info['simd']}{native}; int8 cache products: {info.get('int8_dot', '?')}",
        f"  BLAS:     {blas_line}",
        *([f"  WARNING:  {info['blas_warning']}"] if info.get("blas_warning") else []),
        f"  compiler: {compiler.get('version', 'unknown')}  {compiler.get('flags', '')}".rstrip(),
        f"  python {info['python']}, numpy {info['numpy']}, scipy {info['scipy']}, "
        f"{info.get('platform', sys.platform)}",
    ]
    return "\n".join(lines)
