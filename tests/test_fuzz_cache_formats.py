"""Differential fuzzing (hypothesis) of attention over float16 and int8 caches.

The kernels read a cache in its stored format (src/kv_format.c; for int8 with AVX512-VNNI,
integer products: src/kv_int8_dot_impl.h). Each example stores random keys and values, some
NaN or inf, at magnitudes from 1e-36 to 1e36 (tiny queries against huge keys and the reverse,
tiny or huge values, logits far apart), and attends over them with the kernel call the decode
steps make: GQA groups of 1 to 12 rows, 1 to 3 query positions, head dims around the kernels'
vector steps and limits, padding, windows, split-K lengths, 1 or 2 threads. The oracle is
mha_cy.reference on the values the cache holds (its decoded keys and values): NaN and inf at
the same places, finite entries within float32 rounding, or within INT8_DOT_BOUND of max |V|
where int8 takes the integer products. Profiles and budget as test_fuzz_differential.py.
"""
import numpy as np
from hypothesis import given
from hypothesis import strategies as st

import mha_cy
from mha_cy import reference
from mha_cy.attention import _attend

from conftest import ATOL, fuzz_budget, fuzz_settings
from fuzz_inputs import SPECIALS, assert_same, inject
from test_cache_formats import INT8_DOT, INT8_DOT_BOUND

# (query, key) magnitudes: their products stay far from overflow (overflowing scores are
# test_fuzz_differential.py's), but each alone may sit at an end of the float32 range
QK_MAGNITUDES = {"one": (1.0, 1.0), "tiny_q_huge_k": (1e-36, 1e36),
                 "huge_q_tiny_k": (1e18, 1e-18), "both_tiny": (1e-20, 1e-20),
                 "far_logits": (30.0, 1.0)}
V_MAGNITUDES = {"one": 1.0, "tiny": 1e-33, "huge": 1e30}
SPECIAL = st.sampled_from(sorted(SPECIALS))


@st.composite
def cache_cases(draw):
    split_k = draw(st.booleans())
    if split_k:       # one (batch, K/V head) and long keys: the split-K decode path
        b, hkv, lk = 1, 1, draw(st.integers(1024, 2300))
    else:
        b, hkv, lk = draw(st.integers(1, 2)), draw(st.integers(1, 2)), draw(st.integers(1, 150))
    d = draw(st.sampled_from([8, 16, 33, 64, 100, 128, 256, 300]))
    return dict(
        fmt=draw(st.sampled_from(["float16", "int8"])), b=b, hkv=hkv, lk=lk, d=d,
        group=draw(st.sampled_from([1, 2, 3, 4, 8, 12])), lq=draw(st.sampled_from([1, 1, 2, 3])),
        dv=draw(st.sampled_from([d, d, 40])),
        qk_mag=draw(st.sampled_from(sorted(QK_MAGNITUDES))),
        v_mag=draw(st.sampled_from(sorted(V_MAGNITUDES))),
        specials={t: draw(st.lists(SPECIAL, max_size=2)) for t in "qkv"},
        padding=draw(st.booleans()), window=draw(st.sampled_from([None, None, 1, 3, 40, 700])),
        threads=draw(st.integers(1, 2)), seed=draw(st.integers(0, 2**32 - 1)))


def run_cache_case(c):
    rng = np.random.default_rng(c["seed"])
    b, hkv, lk, lq = c["b"], c["hkv"], c["lk"], min(c["lq"], c["lk"])
    hq = hkv * c["group"]
    qm, km = QK_MAGNITUDES[c["qk_mag"]]
    vm = V_MAGNITUDES[c["v_mag"]]
    q = rng.standard_normal((b, hq, lq, c["d"])) * qm
    k = rng.standard_normal((b, hkv, lk, c["d"])) * km
    v = rng.standard_normal((b, hkv, lk, c["dv"])) * vm
    q, k, v = (inject(rng, x, c["specials"][n]).astype(np.float32)
               for x, n in zip((q, k, v), "qkv"))
    fmt = mha_cy.MultiHeadAttention(8, 1, seed=0).new_cache(1, 1, dtype=c["fmt"])._format
    (ks, k_scale), (vs, v_scale) = fmt.encode(k), fmt.encode(v)
    kf, vf = fmt.decode(ks, k_scale), fmt.decode(vs, v_scale)
    pad = None
    if c["padding"]:
        pad = rng.random((b, lk)) < 0.3
        pad[:, -1] = False                 # the newest key stays visible (a decode step's own)
    scale = 1 / np.sqrt(c["d"])
    out = np.empty((b, hq, lq, c["dv"]), np.float32)
    with np.errstate(all="ignore"):
        expected, _ = reference._attention(q, kf, vf, None, pad, True, scale, c["window"])
        _attend(q, ks, vs, out, None, pad, True, scale, None, c["threads"], c["window"],
                k_scale=k_scale, v_scale=v_scale)
    finite_v = np.abs(vf[np.isfinite(vf)])
    value_scale = max(float(finite_v.max(initial=0)), 1e-38)
    infinite = bool(np.isinf(kf).any() or np.isinf(vf).any())
    integer = INT8_DOT and c["fmt"] == "int8"
    bound = (INT8_DOT_BOUND if integer else 4 * ATOL[np.float32]) + 4 * score_error(
        q, kf, scale, 1 / 65534 + FLOAT_SUM_EPS if integer else FLOAT_SUM_EPS)
    assert_same(out, expected, np.float32, infinite_values=infinite, value_scale=value_scale,
                factor=bound / ATOL[np.float32])


# A score's float32 rounding, relative to sum_p |q_p k_p|: a few ulps (sums in vector lanes)
FLOAT_SUM_EPS = 2.0 ** -22


def score_error(q, kf, scale, eps):
    """How far a score may move: scale * max |q_row| * max_j sum |k_j| * eps (eps = 1 / 65534
    for the integer products' rounding of q to 16 bits, half a step of 2^-15 of the row's
    largest value; plus the float sums' rounding), so a probability moves by a factor within
    exp(+-2 delta), which 4 delta covers while delta is small. Large logits (QK_MAGNITUDES
    "far_logits") make it matter: the softmax is as ill-conditioned as the logits are large,
    for every path."""
    finite_q, finite_k = np.where(np.isfinite(q), q, 0), np.where(np.isfinite(kf), kf, 0)
    return float(scale * np.abs(finite_q).max(initial=0) * eps
                 * np.abs(finite_k).sum(-1).max(initial=0))

@fuzz_settings()
@given(cache_cases())
def test_fuzz_cache_formats_against_the_reference(case):
    with fuzz_budget("cache_formats") as go:
        if go:
            run_cache_case(case)
