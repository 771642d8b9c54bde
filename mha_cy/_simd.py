"""MHA_CY_SIMD: force every C kernel onto one SIMD path (tests, and CPUs that misbehave);
MHA_CY_INT8_DOT=float: keep an int8 KV cache's decode products in float where AVX512-VNNI
would multiply in integers.

The C side (src/cpu_features.c) reads the variable when each extension module loads; this
module makes a bad value loud instead of silently ignored, and says when the CPU cannot run
the path asked for (the kernels then run the best path it has).
"""

import os
import warnings

from ._cpu_features import cpu_simd_level, simd_level

ENV = "MHA_CY_SIMD"
# value -> the simd_level() it means ("portable" is the x86-64 baseline, sse2)
LEVELS = {"avx512": "avx512", "avx2": "avx2", "sse2": "sse2", "portable": "sse2"}
_RANK = {"sse2": 0, "avx2": 1, "avx512": 2}


INT8_DOT_ENV = "MHA_CY_INT8_DOT"
INT8_DOT_VALUES = ("auto", "vnni", "float")


def check_simd_request(environ=os.environ):
    """Raise ValueError for an unknown MHA_CY_SIMD or MHA_CY_INT8_DOT value; warn when
    MHA_CY_SIMD cannot be honoured."""
    dot = environ.get(INT8_DOT_ENV, "")
    if dot not in ("", *INT8_DOT_VALUES):
        raise ValueError(f"environment variable {INT8_DOT_ENV} must be one of "
                         f"{', '.join(INT8_DOT_VALUES)}; got {dot!r}")
    value = environ.get(ENV, "")
    if value in ("", "auto"):
        return
    if value not in LEVELS:
        raise ValueError(f"environment variable {ENV} must be one of auto, "
                         f"{', '.join(LEVELS)}; got {value!r}")
    wanted, running, best = LEVELS[value], simd_level(), cpu_simd_level()
    if running == wanted:
        return
    if best not in _RANK:       # native build, or no dispatch with this compiler / CPU
        why = f"this build does not dispatch (simd {running!r})"
    else:
        why = f"this CPU's best is {best!r}"
    warnings.warn(f"{ENV}={value!r} cannot be honoured: {why}; the kernels run {running!r}",
                  RuntimeWarning, stacklevel=2)
