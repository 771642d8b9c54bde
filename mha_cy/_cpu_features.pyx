"""CPU / build features, from src/cpu_features.c."""

cdef extern from "cpu_features.h":
    const char *mha_simd_level() noexcept nogil
    const char *mha_simd_cpu_level() noexcept nogil
    int mha_native_build() noexcept nogil
    const char *mha_compiler_version() noexcept nogil
    const char *mha_build_flags() noexcept nogil
    const char *mha_int8_dot_name() noexcept nogil


def simd_level():
    """SIMD level every dispatching kernel runs: 'avx512', 'avx2', 'sse2', 'native' or
    'generic' (the CPU's best, or the lower one MHA_CY_SIMD forces)."""
    return mha_simd_level().decode("ascii")


def cpu_simd_level():
    """The best SIMD level this CPU runs, whatever MHA_CY_SIMD says."""
    return mha_simd_cpu_level().decode("ascii")


def int8_dot():
    """How the int8 KV cache's decode kernel multiplies: 'vnni' (AVX512-VNNI integer products,
    q and the probabilities rounded to 16 bits) or 'float' (float products of the dequantized
    values; MHA_CY_INT8_DOT=float forces it)."""
    return mha_int8_dot_name().decode("ascii")


def native_build():
    """True when built with MHA_CY_NATIVE=1 (-march=native: runs only on CPUs like the build host)."""
    return bool(mha_native_build())


def compiler_version():
    """Compiler that built the extensions, e.g. 'gcc 12.2.0'."""
    return mha_compiler_version().decode("utf-8", "replace")


def build_flags():
    """Extra C flags setup.py passed to every extension (space-separated)."""
    return mha_build_flags().decode("utf-8", "replace")
