"""build_info() / format_build_info() report the real build."""

import os
import subprocess
import sys

import numpy as np
import pytest
import scipy

import mha_cy
from mha_cy._blas_kernel import SIMD_RANK, blas_warning, kernel_simd_level
from mha_cy._build_info import build_info, format_build_info
from mha_cy._cpu_features import simd_level
from mha_cy._openmp_helpers import openmp_enabled
from mha_cy._threads import get_num_threads, threads
from mha_cy._version import __version__

# Builds made with MHA_CY_DISABLE_OPENMP=1 / MHA_CY_NATIVE=1 are tested with the
# same variable set; any other build must have OpenMP and be portable.
EXPECT_OPENMP = os.environ.get("MHA_CY_DISABLE_OPENMP", "0") in ("", "0")
EXPECT_NATIVE = os.environ.get("MHA_CY_NATIVE", "0") not in ("", "0")

KEYS = {
    "version": str,
    "openmp": bool,
    "num_threads": int,
    "max_threads": int,
    "blas": (dict, str),
    "blas_warning": (str, type(None)),
    "simd": str,
    "simd_cpu": str,
    "native_build": bool,
    "python": str,
    "numpy": str,
    "scipy": str,
    "compiler": dict,
    "platform": str,
}


@pytest.fixture(scope="module")
def info():
    return build_info()


def test_keys_and_types(info):
    assert set(KEYS) <= set(info)
    for key, expected_type in KEYS.items():
        assert isinstance(info[key], expected_type), (key, info[key])


def test_versions(info):
    assert info["version"] == __version__
    assert info["numpy"] == np.__version__
    assert info["scipy"] == scipy.__version__
    assert info["python"] == "%d.%d.%d" % sys.version_info[:3]


def test_openmp(info):
    assert info["openmp"] is EXPECT_OPENMP
    assert info["openmp"] is openmp_enabled()
    if info["openmp"]:
        assert info["max_threads"] >= 1
        assert "-fopenmp" in info["compiler"]["flags"].split() or os.name == "nt"
    else:
        assert info["max_threads"] == 1
        assert "-fopenmp" not in info["compiler"]["flags"].split()


def test_num_threads_is_live():
    assert build_info()["num_threads"] == get_num_threads()
    with threads(1):
        assert build_info()["num_threads"] == 1


def test_blas_is_scipys(info):
    blas = info["blas"]
    assert isinstance(blas, dict), blas
    for key in ("internal_api", "version", "filepath", "threading_layer", "num_threads"):
        assert key in blas
    assert os.path.exists(blas["filepath"])
    assert isinstance(blas["num_threads"], int) and blas["num_threads"] >= 1
    # scipy's own BLAS, not numpy's (numpy's wheel BLAS is also *named* libscipy_openblas)
    parts = os.path.dirname(os.path.realpath(blas["filepath"])).split(os.sep)
    assert any(p == "scipy" or p.startswith("scipy.") for p in parts), blas["filepath"]


def _cpu_flags():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return None


def test_simd_level(info):
    assert info["simd"] in ("avx512", "avx2", "sse2", "native", "generic")
    assert info["simd"] == simd_level()
    flags = _cpu_flags()
    if flags is None or "sse2" not in flags:
        pytest.skip("no x86 /proc/cpuinfo")
    # the x86-64-v4 / v3 levels of src/cpu_features.c
    if EXPECT_NATIVE:
        expected = "native"
    elif {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"} <= flags:
        expected = "avx512"
    elif {"avx2", "fma", "bmi1", "bmi2", "f16c", "movbe"} <= flags:
        expected = "avx2"
    else:
        expected = "sse2"
    assert info["simd_cpu"] == expected
    if os.environ.get("MHA_CY_SIMD", "auto") == "auto":     # nothing forced
        assert info["simd"] == expected


def test_portable_flags(info):
    flags = info["compiler"]["flags"].split()
    assert info["native_build"] is EXPECT_NATIVE
    assert ("-march=native" in flags) is EXPECT_NATIVE
    assert "-ffast-math" not in flags  # IEEE inf/NaN semantics are relied upon
    assert info["compiler"]["version"]


def test_format_build_info(info):
    text = format_build_info(info)
    assert isinstance(text, str)
    assert text.splitlines()[0] == f"mha_cy {__version__}"
    assert "OpenMP" in text and "BLAS" in text and "SIMD" in text
    assert info["simd"] in text
    assert ("NO (serial" in text) is (not info["openmp"])
    assert format_build_info().splitlines()[0] == text.splitlines()[0]


# --- scipy's BLAS kernels below the CPU's SIMD level ------------------------------------------


@pytest.mark.parametrize("core,level", [
    ("SkylakeX", "avx512"), ("SapphireRapids", "avx512"), ("Haswell", "avx2"), ("Zen", "avx2"),
    ("zen", "avx2"), ("Sandybridge", "avx"), ("Nehalem", "sse2"), ("Prescott", "sse2"),
    ("NoSuchCore", None), ("", None), (None, None),
])
def test_kernel_simd_level(core, level):
    assert kernel_simd_level(core) == level


@pytest.mark.parametrize("core,cpu,warns", [
    ("Haswell", "avx512", True),
    ("Sandybridge", "avx512", True),
    ("Sandybridge", "avx2", True),
    ("Haswell", "avx2", False),
    ("Zen", "avx2", False),
    ("SkylakeX", "avx512", False),
    ("SkylakeX", "avx2", False),       # a kernel above the dispatch level is not ours to judge
    ("Haswell", "native", False),      # native builds have no comparable level
    ("NoSuchCore", "avx512", False),   # unknown cores: no guess
    ("Katmai", "avx512", True),        # what OPENBLAS_CORETYPE=Prescott, Core2, ... report
    ("Katmai", "avx2", True),
])
def test_blas_warning_decision(core, cpu, warns):
    assert (blas_warning(core, cpu, {}) is not None) is warns


def test_blas_warning_names_reason_and_remedy():
    forced = blas_warning("Haswell", "avx512", {"OPENBLAS_CORETYPE": "Haswell", "OPENBLAS_L2_SIZE": "1048576"})
    assert "OPENBLAS_CORETYPE=Haswell" in forced and "forces" in forced
    assert "unset OPENBLAS_CORETYPE and OPENBLAS_L2_SIZE" in forced
    assert "Haswell" in forced and "avx2" in forced and "avx512" in forced
    chosen = blas_warning("Haswell", "avx512", {})
    assert "OpenBLAS chose them itself" in chosen and "unset" not in chosen


def test_blas_warning_matches_this_process(info):
    """Compared with the CPU's level, not the one MHA_CY_SIMD forces on mha_cy's kernels:
    OpenBLAS could use the CPU's (forcing avx2 hid the Haswell warning on AVX-512 CPUs)."""
    core = info["blas"].get("architecture") if isinstance(info["blas"], dict) else None
    assert info["blas_warning"] == blas_warning(core, info["simd_cpu"], os.environ)


def test_format_build_info_prints_the_warning(info):
    assert "WARNING" not in format_build_info(dict(info, blas_warning=None))
    text = format_build_info(dict(info, blas_warning="scipy's OpenBLAS runs Haswell kernels"))
    assert "WARNING:  scipy's OpenBLAS runs Haswell kernels" in text


@pytest.mark.parametrize("core", ["Haswell", "Sandybridge"])
def test_forced_coretype_warns_in_python_m_mha_cy(core):
    """A real process with OPENBLAS_CORETYPE forced: the warning appears exactly when the core
    is below this CPU's level (Haswell warns on AVX-512 CPUs only, Sandybridge on AVX2 too)."""
    cpu = simd_level()
    if cpu not in ("avx2", "avx512"):
        pytest.skip(f"forcing {core} kernels needs an AVX2 CPU (simd_level {cpu!r})")
    env = dict(os.environ, OPENBLAS_CORETYPE=core)
    root = os.path.dirname(os.path.dirname(os.path.abspath(mha_cy.__file__)))  # import this mha_cy
    out = subprocess.run([sys.executable, "-m", "mha_cy", "--seq-len", "8", "--embed-dim", "32",
                          "--heads", "2", "--repeats", "1"],
                         cwd=root, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    expected = SIMD_RANK[kernel_simd_level(core)] < SIMD_RANK[cpu]
    assert (f"OPENBLAS_CORETYPE={core} in the environment forces them" in out.stdout) is expected, out.stdout
    assert f"{core} kernels" in out.stdout  # the BLAS line names the kernels that ran
