"""Does scipy's OpenBLAS run kernels below this CPU's SIMD level, and why?

OpenBLAS picks its kernels once, when it loads: from its own CPU detection, or from
OPENBLAS_CORETYPE when that is set (OPENBLAS_L2_SIZE overrides the cache size its blocking
assumes). A forced or misdetected older core (e.g. "Haswell", AVX2, on an AVX-512 CPU) makes
every projection slower while nothing else looks wrong, so build_info() says so.
"""

__all__ = ["SIMD_RANK", "kernel_simd_level", "blas_warning"]

# The SIMD levels of mha_cy's run-time dispatch (simd_level()), lowest first; "avx" sits between
# sse2 and avx2 only because some OpenBLAS cores stop there.
SIMD_RANK = {"generic": 0, "sse2": 1, "avx": 2, "avx2": 3, "avx512": 4}

# OpenBLAS core names (openblas_get_corename, threadpoolctl's "architecture"), lower-cased, by
# the widest instructions their x86-64 kernels use.
_CORE_LEVELS = {
    "avx512": ("skylakex", "cooperlake", "sapphirerapids"),
    "avx2": ("haswell", "zen"),
    "avx": ("sandybridge", "bulldozer", "piledriver", "steamroller", "excavator"),
    # Katmai & co.: the generic cores scipy's OpenBLAS reports for OPENBLAS_CORETYPE=Prescott,
    # Core2, Penryn, Opteron, Nano, ... (the slowest kernels: 1.8x SkylakeX's sgemm time)
    "sse2": ("prescott", "core2", "penryn", "dunnington", "nehalem", "atom", "opteron",
             "opteron_sse3", "barcelona", "bobcat", "nano", "katmai", "coppermine",
             "northwood", "banias", "yonah", "athlon"),
}
_LEVEL_OF_CORE = {core: level for level, cores in _CORE_LEVELS.items() for core in cores}


def kernel_simd_level(core):
    """The SIMD level of an OpenBLAS core name ("Haswell" -> "avx2"), or None if unknown."""
    return _LEVEL_OF_CORE.get(str(core).strip().lower()) if core else None


def blas_warning(core, cpu_level, environ):
    """A warning (str) when OpenBLAS core ``core`` runs below ``cpu_level``, else None.

    ``cpu_level`` is the CPU's own level (cpu_simd_level(): what OpenBLAS could use, whatever
    MHA_CY_SIMD forces on mha_cy's kernels; unknown names give None: no comparison is
    possible); ``environ`` is the environment OpenBLAS was loaded with.
    """
    kernel = kernel_simd_level(core)
    if kernel is None or cpu_level not in SIMD_RANK or SIMD_RANK[kernel] >= SIMD_RANK[cpu_level]:
        return None
    forced = environ.get("OPENBLAS_CORETYPE")
    reason = (f"OPENBLAS_CORETYPE={forced} in the environment forces them" if forced
              else "OpenBLAS chose them itself (its CPU detection)")
    set_vars = [v for v in ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE") if environ.get(v)]
    remedy = (f"unset {' and '.join(set_vars)} before Python starts" if set_vars
              else "a newer scipy (its OpenBLAS may know this CPU), or OPENBLAS_CORETYPE set to "
                   "a core of this CPU's level")
    return (f"scipy's OpenBLAS runs {core} kernels ({kernel}) on a CPU with {cpu_level}: {reason}; "
            f"the projections run slower than they could. Remedy: {remedy}.")
