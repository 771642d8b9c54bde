"""Building blocks of the differential fuzz tests (tests/test_fuzz_differential.py).

Hypothesis draws only small parameters (shapes, layouts, where to put a NaN, a seed); the
arrays come from a seeded NumPy generator, so examples are cheap to make and shrink well.
"""
import numpy as np

SPECIALS = {"nan": np.nan, "inf": np.inf, "-inf": -np.inf}
LAYOUTS = ["contiguous", "padded_rows", "heads_interleaved", "unaligned", "zero_stride",
           "negative_stride"]


def unaligned(a):
    """A copy of a whose data address is one byte off the item size's alignment."""
    buf = np.empty(a.nbytes + a.itemsize, dtype=np.uint8)
    out = buf[1:1 + a.nbytes].view(a.dtype).reshape(a.shape)
    out[...] = a
    assert not out.flags.aligned or a.itemsize == 1
    return out


def with_layout(a, layout):
    """An array for the call with the memory layout named (values may change: zero_stride
    repeats the first row; both implementations get the same array)."""
    if layout == "contiguous":
        return a
    if layout == "padded_rows":              # rows further apart than their length
        big = np.zeros(a.shape[:-1] + (a.shape[-1] + 3,), dtype=a.dtype)
        big[..., :a.shape[-1]] = a
        return big[..., :a.shape[-1]]
    if layout == "heads_interleaved":        # (B, L, H, D) memory seen as (B, H, L, D)
        if a.ndim < 3:
            return np.asfortranarray(a)
        return np.ascontiguousarray(np.swapaxes(a, -3, -2)).swapaxes(-3, -2)
    if layout == "unaligned":
        return unaligned(a)
    if layout == "zero_stride":              # every row the same: stride 0 along the rows
        return np.broadcast_to(a[..., :1, :], a.shape)
    if layout == "negative_stride":
        return np.ascontiguousarray(a[..., ::-1, :])[..., ::-1, :]
    raise ValueError(layout)


def inject(rng, a, specials):
    """Put each named special value ("nan", "inf", "-inf") at a random place of a copy of a."""
    a = np.array(a)
    for name in specials:
        a[tuple(rng.integers(n) for n in a.shape)] = SPECIALS[name]
    return a


def assert_same(actual, expected, dtype, factor=4.0, what="output", infinite_values=False,
                value_scale=None):
    """Same NaN / +inf / -inf positions, finite entries within the tolerance table.

    value_scale: the absolute tolerance's scale (default max |expected|): an output that
    averages many values of V cancels down to much less than they are (pass max |V|).

    infinite_values: the inputs hold an infinite value that may reach V (or overflow there).
    Then which entries are finite must still agree exactly, but an entry may be inf in one and
    NaN in the other: inf * w is NaN only where the weight w underflowed to exactly 0, and the
    online softmax's partial weights underflow elsewhere than the reference's whole-row ones.
    """
    from conftest import ATOL, RTOL, assert_close
    actual, expected = np.asarray(actual), np.asarray(expected)
    assert actual.dtype == expected.dtype == np.dtype(dtype), (actual.dtype, expected.dtype)
    assert actual.shape == expected.shape
    tests = (("non-finite", lambda x: ~np.isfinite(x)),) if infinite_values else (
        ("NaN", np.isnan), ("+inf", np.isposinf), ("-inf", np.isneginf))
    for name, test in tests:
        where_a, where_e = test(actual), test(expected)
        if not np.array_equal(where_a, where_e):
            bad = np.argwhere(where_a != where_e)[:5]
            raise AssertionError(f"{what}: {name} at different places, e.g. {bad.tolist()}: "
                                 f"actual {actual[tuple(bad[0])]}, "
                                 f"expected {expected[tuple(bad[0])]}")
    finite = np.isfinite(expected)
    actual, expected = np.where(finite, actual, 0), np.where(finite, expected, 0)
    if value_scale is None:
        assert_close(actual, expected, dtype, factor, what)
    else:
        key = np.dtype(dtype).type
        np.testing.assert_allclose(actual, expected, rtol=RTOL[key] * factor,
                                   atol=ATOL[key] * factor * value_scale, err_msg=what)
