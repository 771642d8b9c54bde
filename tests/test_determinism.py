"""Results never depend on the thread count: every path is bitwise equal on 1..4 threads, in
this environment and in fresh interpreters with OpenBLAS forced onto its Haswell (AVX2)
kernels or left to pick its own."""
import os
import subprocess
import sys

import numpy as np
import pytest

import mha_cy

from conftest import DTYPES
from determinism_cases import mismatches, outputs

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
needs_openmp = pytest.mark.skipif(not mha_cy.build_info()["openmp"],
                                  reason="a serial build always runs one thread")


@pytest.mark.parametrize("dtype", DTYPES)
def test_every_path_bitwise_equal_on_any_thread_count(dtype):
    assert mismatches(dtype) == []


def test_cases_are_not_trivial():
    """The outputs compared are real results: finite, not all zero, of the expected shapes."""
    out = outputs(2)
    assert out["weights"].shape == (4, 8, 200, 200)
    assert out["gqa_decode"].shape == (3, 1, 512)
    for name, value in out.items():
        assert np.isfinite(value).all() and np.abs(value).max() > 0, name


@needs_openmp
@pytest.mark.parametrize("coretype", ["Haswell", None], ids=["haswell", "unset"])
def test_bitwise_equal_with_any_openblas_kernel(coretype):
    env = dict(os.environ)
    env.pop("OPENBLAS_L2_SIZE", None)
    if coretype is None:
        env.pop("OPENBLAS_CORETYPE", None)
    else:
        env["OPENBLAS_CORETYPE"] = coretype
    code = ("import sys; sys.path.insert(0, sys.argv[1]); import numpy as np; "
            "import mha_cy; from determinism_cases import mismatches; "
            "print(mha_cy.build_info()['blas'].get('architecture')); "
            "print(mismatches(np.float32) + mismatches(np.float64))")
    result = subprocess.run([sys.executable, "-c", code, TESTS_DIR], env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    arch, bad = result.stdout.strip().splitlines()[-2:]
    if coretype is not None:
        assert arch.lower() == coretype.lower()
    assert bad == "[]", f"OpenBLAS kernel {arch}: {bad}"
