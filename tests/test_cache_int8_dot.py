"""The int8 cache's decode kernel with integer products (src/kv_int8_dot_impl.h, AVX512-VNNI).

Where the CPU has AVX512-VNNI (build_info()["int8_dot"] == "vnni"), decode tasks over an int8
cache round q and the probabilities to 16 bits and multiply in int32. Checked here: that path
against the reference on the cache's values (within INT8_DOT_BOUND of max |output|), the
float path of the same build (MHA_CY_INT8_DOT=float, in a child process) at float32
rounding, head dims and row counts around the kernel's steps and limits, values at the edge
of int32, NaN and inf, and thread counts. On a CPU without VNNI both runs take the float
path and every comparison is at float32 rounding."""
import os
import subprocess
import sys

import numpy as np
import pytest

import mha_cy
from mha_cy import reference
from mha_cy._cpu_features import int8_dot
from mha_cy._simd import check_simd_request
from mha_cy.attention import _attend

from conftest import assert_close
from test_cache_formats import INT8_DOT, INT8_DOT_BOUND, assert_exact, stored

CASES = {
    # name: (B, Hq, Hkv, Lk, D, dv, window, padded)
    "gqa4_d128": (2, 8, 2, 300, 128, None, None, False),
    "gqa4_d64_one_tile": (1, 4, 1, 64, 64, None, None, False),
    "gqa4_d64_tile_plus_one": (1, 4, 1, 65, 64, None, None, False),
    "rows1_d8": (2, 3, 3, 77, 8, None, None, False),
    "rows1_d256_split_k": (1, 1, 1, 3000, 256, None, None, False),
    "rows2_d40_odd_keys": (1, 4, 2, 127, 40, None, None, True),
    "rows3_d33": (1, 6, 2, 131, 33, None, None, False),
    "rows5_d100": (1, 10, 2, 200, 100, None, None, True),
    "rows8_mqa_split_k": (1, 8, 1, 2500, 128, None, None, False),
    "rows8_window": (1, 8, 1, 2100, 96, None, 700, False),
    "d64_dv40": (1, 4, 1, 150, 64, 40, None, False),
    "d48_dv200": (2, 4, 2, 90, 48, 200, None, True),
    "one_key": (1, 4, 1, 1, 32, None, None, False),
    "two_keys_d33": (1, 2, 1, 2, 33, None, None, False),
    # not direct tasks (2 rows of D < 32; D above the fused kernels' 256): converted tiles
    "rows2_d20_tiles": (1, 4, 2, 127, 20, None, None, True),
    "rows1_d300_tiles": (1, 1, 1, 70, 300, None, None, False),
}


def integer_path(name):
    """Whether the case's tasks run the direct kernel (few rows, D <= 256; D >= 32 unless one
    row: _kernel_rules.direct_rows), where int8 takes the integer products."""
    B, Hq, Hkv, Lk, D, dv, window, padded = CASES[name]
    rows = Hq // Hkv
    return INT8_DOT and rows <= 8 and D <= 256 and (rows == 1 or D >= 32)


def make_case(name):
    B, Hq, Hkv, Lk, D, dv, window, padded = CASES[name]
    rng = np.random.default_rng(sum(map(ord, name)))
    q = (rng.standard_normal((B, Hq, 1, D)) * 2).astype(np.float32)
    k, v, ks, vs, kf, vf = stored(rng, "int8", (B, Hkv, Lk, D), dv)
    pad = rng.random((B, Lk)) < 0.3 if padded else None
    if pad is not None:
        pad[:, -1] = False            # the newest key is always visible
    return q, k, v, ks, vs, kf, vf, pad, window


def run(q, k, v, ks, vs, pad, window, threads=2):
    out = np.empty(q.shape[:3] + (v.shape[3],), np.float32)
    _attend(q, k, v, out, None, pad, True, 1 / np.sqrt(q.shape[3]), None, threads, window,
            k_scale=ks, v_scale=vs)
    return out


CHILD = """
import sys
import numpy as np
sys.path.insert(0, sys.argv[3])
import mha_cy
from test_cache_int8_dot import CASES, make_case, run
out = {name: run(*[a for i, a in enumerate(make_case(name)) if i not in (5, 6)])
       for name in CASES}
np.savez(sys.argv[1], **out)
with open(sys.argv[2], "w") as f:
    f.write(mha_cy.build_info()["int8_dot"])
"""


@pytest.fixture(scope="module")
def float_path(tmp_path_factory):
    """Every case's output with MHA_CY_INT8_DOT=float, from one child process."""
    d = tmp_path_factory.mktemp("int8_float")
    env = dict(os.environ, MHA_CY_INT8_DOT="float")
    proc = subprocess.run([sys.executable, "-c", CHILD, str(d / "out.npz"), str(d / "dot.txt"),
                           os.path.dirname(__file__)], env=env, capture_output=True, text=True,
                          timeout=300, check=False, cwd=os.getcwd())
    assert proc.returncode == 0, proc.stderr
    assert (d / "dot.txt").read_text() == "float"
    return dict(np.load(d / "out.npz"))


@pytest.mark.parametrize("name", sorted(CASES))
def test_against_reference_and_float_path(name, float_path):
    q, k, v, ks, vs, kf, vf, pad, window = make_case(name)
    out = run(q, k, v, ks, vs, pad, window)
    expected, _ = reference._attention(q, kf, vf, None, pad, True, 1 / np.sqrt(q.shape[3]),
                                       window)
    assert_close(float_path[name], expected, np.float32, err_msg="the float products")
    assert_exact(out, expected, "int8", np.abs(vf).max(), err_msg="this CPU's path")
    if integer_path(name):
        assert not np.array_equal(out, float_path[name]), "the integer path did not run"
    else:
        np.testing.assert_array_equal(out, float_path[name])


def test_largest_products_stay_exact():
    """Every product at its largest (q16 = +-32767, k = +-127, D = 256: |q16 . k| up to
    32767 * 127 * 256 < 2^31) and the largest value scales: no int32 overflow."""
    for D in (64, 256):
        q = np.full((1, 1, 1, D), 3.0, np.float32)
        k = np.full((1, 1, 5, D), 127, np.int8)
        k[0, 0, ::2] = -127
        v = np.tile(np.arange(D, dtype=np.int8)[None, None, None] % 100 - 50, (1, 1, 5, 1))
        ks = np.full((1, 1, 5), 1e-3, np.float32)
        vs = np.full((1, 1, 5), 0.5, np.float32)
        kf, vf = k * ks[..., None], v * vs[..., None]
        out = run(q, k, v, ks, vs, None, None)
        expected, _ = reference._attention(q, kf, vf, None, None, True, 1 / np.sqrt(D))
        assert_exact(out, expected, "int8", np.abs(vf).max(), err_msg=f"D={D}")



@pytest.mark.parametrize("q_mag, k_mag, v_mag", [
    (1.0, 1.0, 1e-33),       # values so small that 32767 / max p overflows float32
    (1e-36, 1e36, 1.0),      # a query so small that 32767 / max |q| overflows float32
    (1e-20, 1e20, 1e-25),    # both small, still within range
    (1.0, 30.0, 1.0),        # scores ~100 apart: far tiles' probabilities underflow to ~1e-40
])
def test_extreme_magnitudes_keep_the_relative_error(q_mag, k_mag, v_mag):
    """Rounding to 16 bits is relative to a row's (a tile's) largest value: wherever that
    largest value is too small for the reciprocal to fit in float32, the kernel must not
    round against an overflowed scale (the float products take over), so the error stays
    within INT8_DOT_BOUND of max |V| at any magnitude."""
    rng = np.random.default_rng(3)
    D, Lk = 64, 300
    q = (rng.standard_normal((1, 4, 1, D)) * q_mag).astype(np.float32)
    k, v, ks, vs, kf, vf = stored(rng, "int8", (1, 1, Lk, D))
    ks = (ks * np.float32(k_mag)).astype(np.float32)
    vs = (vs * np.float32(v_mag)).astype(np.float32)
    kf = k * ks[..., None]
    vf = v * vs[..., None]
    out = run(q, k, v, ks, vs, None, None)
    expected, _ = reference._attention(q, kf, vf, None, None, True, 1 / np.sqrt(D))
    assert np.isfinite(expected).all()
    assert_exact(out, expected, "int8", np.abs(vf).max())

def test_zero_query_is_the_mean_of_the_values():
    rng = np.random.default_rng(1)
    q = np.zeros((1, 4, 1, 64), np.float32)
    k, v, ks, vs, kf, vf = stored(rng, "int8", (1, 1, 100, 64))
    out = run(q, k, v, ks, vs, None, None)
    mean = vf[0, 0].mean(axis=0)
    assert_exact(out[0, :, 0], np.broadcast_to(mean, (4, 64)), "int8", np.abs(vf).max())


def test_non_finite_values_propagate_as_in_the_float_path():
    """A query row holding NaN or inf gives NaN for that row only; a cached value row holding
    NaN (its scale NaN) makes every row that sees it NaN, and none that the padding hides."""
    rng = np.random.default_rng(2)
    q = rng.standard_normal((2, 4, 1, 64)).astype(np.float32)
    k, v, ks, vs, kf, vf = stored(rng, "int8", (2, 1, 150, 64))
    q[0, 1, 0, 5] = np.nan
    q[0, 2, 0, 7] = np.inf
    vs[1, 0, 70] = np.nan                # batch 1: a NaN value row, visible
    pad = np.zeros((2, 150), bool)
    out = run(q, k, v, ks, vs, pad, None)
    assert np.isnan(out[0, 1]).all() and not np.isfinite(out[0, 2]).all()
    expected, _ = reference._attention(q[:1, [0, 3]], kf[:1], vf[:1], None, None, True,
                                       1 / 8)
    assert_exact(out[:1, [0, 3]], expected, "int8", np.abs(vf).max())
    assert np.isnan(out[1]).all()
    pad[1, 70] = True                    # hidden by the padding: never read
    out = run(q, k, v, ks, vs, pad, None)
    vf[1, 0, 70] = 0
    expected, _ = reference._attention(q[1:], kf[1:], vf[1:], None, pad[1:], True, 1 / 8)
    assert_exact(out[1:], expected, "int8", np.abs(vf).max())


@pytest.mark.parametrize("name", ["rows8_mqa_split_k", "gqa4_d128", "rows2_d40_odd_keys"])
def test_thread_count_does_not_change_bits(name):
    q, k, v, ks, vs, _, _, pad, window = make_case(name)
    results = [run(q, k, v, ks, vs, pad, window, threads=n) for n in (1, 2, 3, 4)]
    for r in results[1:]:
        np.testing.assert_array_equal(r, results[0])


def test_reported_path_matches_the_cpu():
    info = mha_cy.build_info()
    assert info["int8_dot"] == int8_dot()
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "").split()
    except OSError:
        flags = []
    expected = (info["simd"] == "avx512" and "avx512_vnni" in flags
                and os.environ.get("MHA_CY_INT8_DOT") != "float")
    assert info["int8_dot"] == ("vnni" if expected else "float")
    assert "int8 cache products" in mha_cy._build_info.format_build_info(info)


def test_unknown_env_value_is_an_error():
    with pytest.raises(ValueError, match="MHA_CY_INT8_DOT.*'fast'"):
        check_simd_request({"MHA_CY_INT8_DOT": "fast"})
    for value in ("", "auto", "vnni", "float"):
        check_simd_request({"MHA_CY_INT8_DOT": value})
