"""mha_cy.scaled_dot_product_attention against mha_cy.reference.scaled_dot_product_attention."""
import numpy as np
import pytest

import mha_cy
from mha_cy import reference

from conftest import DTYPES, assert_close, random_bool_mask, random_float_mask


def qkv(rng, dtype, B, Hq, Hkv, q_len, k_len, D, Dv=None):
    Dv = D if Dv is None else Dv
    return (rng.standard_normal((B, Hq, q_len, D)).astype(dtype),
            rng.standard_normal((B, Hkv, k_len, D)).astype(dtype),
            rng.standard_normal((B, Hkv, k_len, Dv)).astype(dtype))


def check(q, k, v, dtype=None, **kwargs):
    out = mha_cy.scaled_dot_product_attention(q, k, v, **kwargs)
    expected = reference.scaled_dot_product_attention(q, k, v, **kwargs)
    assert out.dtype == expected.dtype
    if dtype is not None:
        assert out.dtype == dtype
    assert_close(out, expected)
    return expected


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("Hq,Hkv", [(4, 4), (4, 2), (4, 1), (6, 3), (6, 2)])
@pytest.mark.parametrize("q_len,k_len", [(1, 1), (1, 37), (5, 5), (70, 130), (130, 70)])
@pytest.mark.parametrize("is_causal", [False, True])
def test_gqa_mqa(rng, dtype, Hq, Hkv, q_len, k_len, is_causal):
    q, k, v = qkv(rng, dtype, 2, Hq, Hkv, q_len, k_len, 16)
    out = check(q, k, v, dtype, is_causal=is_causal)
    # GQA = MHA with each K/V head repeated for its group of query heads
    group = Hq // Hkv
    repeated = mha_cy.scaled_dot_product_attention(q, np.repeat(k, group, 1),
                                                   np.repeat(v, group, 1), is_causal=is_causal)
    assert_close(repeated, out)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("D,Dv", [(8, 24), (24, 8), (1, 5), (80, 128)])
def test_value_head_dim_differs(rng, dtype, D, Dv):
    q, k, v = qkv(rng, dtype, 2, 4, 2, 9, 300, D, Dv)
    out = check(q, k, v, dtype)
    assert out.shape == (2, 4, 9, Dv)
    check(q[:, :, :1], k, v, dtype)                 # decode path


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("scale", [0.01, 1.0, 3.5, -0.5])
def test_custom_scale(rng, dtype, scale):
    q, k, v = qkv(rng, dtype, 1, 2, 2, 7, 11, 8)
    out = check(q, k, v, dtype, scale=scale)
    default = mha_cy.scaled_dot_product_attention(q, k, v)
    explicit = mha_cy.scaled_dot_product_attention(q, k, v, scale=1 / np.sqrt(8))
    assert_close(explicit, default)
    assert np.abs(out - default).max() > 1e-3


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", ["bool", "float"])
@pytest.mark.parametrize("shape", [(9, 300), (2, 9, 300), (2, 4, 9, 300), (1, 300), (9, 1),
                                   (2, 1, 1, 300), (1, 4, 9, 300), (2, 4, 1, 300)], ids=str)
@pytest.mark.parametrize("is_causal", [False, True])
def test_masks(rng, dtype, kind, shape, is_causal):
    q, k, v = qkv(rng, dtype, 2, 4, 2, 9, 300, 16)
    mask = (random_bool_mask(rng, shape, 0.8) if kind == "bool"
            else random_float_mask(rng, shape, 0.1))
    check(q, k, v, dtype, attn_mask=mask, is_causal=is_causal)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("q_len,k_len", [(1, 9), (4, 9), (9, 9), (9, 4), (65, 300), (300, 65)])
def test_causal_bottom_right(rng, dtype, q_len, k_len):
    q, k, v = qkv(rng, dtype, 2, 2, 1, q_len, k_len, 8)
    out = check(q, k, v, dtype, is_causal=True)
    i, j = np.ogrid[:q_len, :k_len]
    bottom_right = j <= i + (k_len - q_len)
    explicit = mha_cy.scaled_dot_product_attention(q, k, v, attn_mask=bottom_right)
    assert_close(explicit, out)
    if q_len > k_len:
        np.testing.assert_array_equal(out[:, :, :q_len - k_len], 0)
        np.testing.assert_array_equal(
            mha_cy.scaled_dot_product_attention(q, k, v, is_causal=True)[:, :, :q_len - k_len], 0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("Hq,Hkv", [(8, 2), (8, 1), (4, 4)])
@pytest.mark.parametrize("kind", ["bool", "float"])
@pytest.mark.parametrize("k_len", [1, 5, 300, 600])
def test_decode_grouped_heads_per_head_masks(rng, dtype, Hq, Hkv, kind, k_len):
    """Lq = 1 with grouped heads: the kernel runs a group's query heads together against the
    shared K/V head; every head of a group must still get its own mask row."""
    q, k, v = qkv(rng, dtype, 3, Hq, Hkv, 1, k_len, 16)
    shape = (3, Hq, 1, k_len)
    mask = (random_bool_mask(rng, shape, 0.6) if kind == "bool"
            else random_float_mask(rng, shape, 0.3) * 3)
    if kind == "bool":
        mask[0, 1] = False                      # one head of a group sees nothing
        mask[0, 0, 0, 0] = True                 # its neighbour sees something
    out = check(q, k, v, dtype, attn_mask=mask)
    if kind == "bool":
        np.testing.assert_array_equal(
            mha_cy.scaled_dot_product_attention(q, k, v, attn_mask=mask)[0, 1], 0)
    # head by head, as separate single-head problems
    fast = mha_cy.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=True)
    group = Hq // Hkv
    for h in range(Hq):
        one = mha_cy.scaled_dot_product_attention(
            q[:, h:h + 1], k[:, h // group:h // group + 1], v[:, h // group:h // group + 1],
            attn_mask=mask[:, h:h + 1])
        assert_close(fast[:, h:h + 1], one, err_msg=f"head {h}")
    assert_close(out, fast)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("q_len", [1, 7, 100])
def test_long_keys(rng, dtype, q_len):
    """Lk = 1000: several 256-key tiles (the last one partial), causal and padding."""
    B, Hq, Hkv, k_len = 2, 4, 2, 1000
    q, k, v = qkv(rng, dtype, B, Hq, Hkv, q_len, k_len, 32)
    pad = rng.random((B, 1, 1, k_len)) > 0.3        # bool "may attend": padding as a mask
    pad[1, ..., 600:] = False                       # sequence 1 is 600 long
    check(q, k, v, dtype)
    check(q, k, v, dtype, is_causal=True)
    check(q, k, v, dtype, attn_mask=pad)
    check(q, k, v, dtype, attn_mask=pad, is_causal=True)
    fmask = random_float_mask(rng, (q_len, k_len), 0.5)
    fmask[:, :512] = -np.inf                        # the first two tiles fully masked
    check(q, k, v, dtype, attn_mask=fmask, is_causal=True)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("B,Hq,Hkv,q_len", [(1, 4, 1, 1), (1, 8, 2, 1), (3, 2, 2, 1),
                                             (1, 1, 1, 3), (1, 2, 1, 40)])
@pytest.mark.parametrize("k_len", [1024, 1500, 2600])
def test_split_keys_few_tasks(rng, dtype, B, Hq, Hkv, q_len, k_len):
    """Fewer than 8 tasks and >= 1024 keys: the kernel splits each task's keys into parts run
    in parallel and merges them (split-K). Parts whose keys are all masked, padding at either
    end, causal, per-head masks; the result must not depend on the thread count."""
    q, k, v = qkv(rng, dtype, B, Hq, Hkv, q_len, k_len, 16)
    mask = random_bool_mask(rng, (B, Hq, q_len, k_len), 0.7)
    mask[..., : k_len // 2] = False                   # the first parts see nothing at all
    mask[..., -1] = True                              # ... but every row sees something
    bias = random_float_mask(rng, (B, Hq, q_len, k_len), 0.05)
    for kwargs in (dict(), dict(attn_mask=mask), dict(attn_mask=bias, is_causal=True)):
        outs = []
        for n in (1, 2, 3):
            with mha_cy.threads(n):
                outs.append(mha_cy.scaled_dot_product_attention(q, k, v, **kwargs))
        assert_close(outs[0], reference.scaled_dot_product_attention(q, k, v, **kwargs))
        for out in outs[1:]:
            np.testing.assert_array_equal(out, outs[0])
    none = np.zeros((B, Hq, q_len, k_len), bool)      # every key of every row masked: zeros
    np.testing.assert_array_equal(mha_cy.scaled_dot_product_attention(q, k, v, attn_mask=none), 0)


@pytest.mark.parametrize("dtypes", [(np.float32, np.float32, np.float64),
                                    (np.float64, np.float32, np.float32),
                                    (np.float32, np.float64, np.float32),
                                    (np.float16, np.float32, np.float32),
                                    (np.int64, np.float32, np.float32)], ids=str)
def test_mixed_dtypes(rng, dtypes):
    q, k, v = (rng.standard_normal(s) for s in ((2, 4, 5, 8), (2, 2, 6, 8), (2, 2, 6, 8)))
    q, k, v = (a.astype(d) for a, d in zip((q, k, v), dtypes))
    expected_dtype = np.float64 if np.float64 in dtypes else np.float32
    out = check(q, k, v, expected_dtype, attn_mask=random_float_mask(rng, (5, 6), 0.2))
    assert out.dtype == expected_dtype
    # the float64 result is computed in float64 (not rounded through float32)
    if expected_dtype == np.float64:
        ref64 = reference.scaled_dot_product_attention(*(a.astype(np.float64) for a in (q, k, v)))
        assert_close(mha_cy.scaled_dot_product_attention(q, k, v), ref64)


@pytest.mark.parametrize("dtype", DTYPES)
def test_non_contiguous_inputs(rng, dtype):
    B, L, Hq, Hkv, D = 2, 9, 4, 2, 8
    packed = rng.standard_normal((B, L, (Hq + 2 * Hkv) * D)).astype(dtype)   # a fused QKV
    heads = packed.reshape(B, L, Hq + 2 * Hkv, D).transpose(0, 2, 1, 3)
    q, k, v = heads[:, :Hq], heads[:, Hq:Hq + Hkv], heads[:, Hq + Hkv:]
    expected = reference.scaled_dot_product_attention(*(np.ascontiguousarray(a)
                                                        for a in (q, k, v)), is_causal=True)
    assert_close(mha_cy.scaled_dot_product_attention(q, k, v, is_causal=True), expected)
    for f in (np.asfortranarray, lambda a: a[..., ::-1][..., ::-1],
              lambda a: np.repeat(a, 2, axis=-1)[..., ::2]):
        out = mha_cy.scaled_dot_product_attention(f(q), f(k), f(v), is_causal=True)
        assert_close(out, expected)
    # broadcast (zero-stride) operands and read-only arrays
    q1 = np.broadcast_to(q[:, :, :1], q.shape)
    assert_close(mha_cy.scaled_dot_product_attention(q1, k, v),
                 reference.scaled_dot_product_attention(np.ascontiguousarray(q1), k, v))
    ro = [np.array(a) for a in (q, k, v)]
    for a in ro:
        a.setflags(write=False)
    assert_close(mha_cy.scaled_dot_product_attention(*ro, is_causal=True), expected)


@pytest.mark.parametrize("dtype", DTYPES)
def test_head_dim_1_fortran_contiguous_operands(rng, dtype):
    """BUG (kernel): a (1, H, L, 1) operand whose NumPy strides have a contiguous last axis but
    that is also F-contiguous is exported by the buffer protocol with the F strides (stride of
    the size-1 last axis = H*L*itemsize); _blas_operand does not copy it (its NumPy strides
    are fine) and the kernel raises "q, k, v and out need a contiguous last axis".
    Reproduction: q = np.ones((1, 3, 2, 1)).transpose(0, 2, 1, 3);
    mha_cy.scaled_dot_product_attention(q, q, q)."""
    q = np.ascontiguousarray(rng.standard_normal((1, 3, 2, 1)).astype(dtype)).transpose(0, 2, 1, 3)
    assert q.flags.f_contiguous and q.strides[3] == q.itemsize
    expected = reference.scaled_dot_product_attention(q, q, q)
    try:
        out = mha_cy.scaled_dot_product_attention(q, q, q)
    except ValueError as exc:
        pytest.fail(f"head_dim=1 F-contiguous q/k/v rejected by the kernel: {exc}")
    assert_close(out, expected)


@pytest.mark.parametrize("dtype", DTYPES)
def test_thread_count_bitwise(rng, dtype):
    q, k, v = qkv(rng, dtype, 2, 4, 2, 130, 300, 16)
    mask = random_float_mask(rng, (2, 4, 130, 300), 0.1)
    results = []
    for n in (1, 2, 3):
        with mha_cy.threads(n):
            results.append((mha_cy.scaled_dot_product_attention(q, k, v, attn_mask=mask),
                            mha_cy.scaled_dot_product_attention(q[:, :, :1], k, v)))
    for r in results[1:]:
        for a, b in zip(results[0], r):
            np.testing.assert_array_equal(a, b)


def test_empty_shapes(rng):
    q, k, v = qkv(rng, np.float32, 2, 4, 2, 3, 0, 8, 5)
    out = mha_cy.scaled_dot_product_attention(q, k, v)
    assert out.shape == (2, 4, 3, 5)
    np.testing.assert_array_equal(out, 0)
    q, k, v = qkv(rng, np.float64, 0, 4, 2, 3, 4, 8)
    assert mha_cy.scaled_dot_product_attention(q, k, v).shape == (0, 4, 3, 8)


def test_no_heads_gives_an_empty_result_as_torch(rng):
    """q and k/v with 0 heads: an empty (B, 0, Lq, Dv) result, as torch returns (it raised
    ValueError); query heads without K/V heads stay an error."""
    q, k, v = qkv(rng, np.float32, 2, 0, 0, 3, 4, 8, 5)
    for kwargs in ({}, {"is_causal": True}, {"attn_mask": np.ones((3, 4), bool)},
                   {"scale": 0.5, "window": 2, "is_causal": True}):
        for sdpa in (mha_cy.scaled_dot_product_attention, reference.scaled_dot_product_attention):
            out = sdpa(q, k, v, **kwargs)
            assert out.shape == (2, 0, 3, 5) and out.dtype == np.float32, (sdpa, kwargs)
    q4 = rng.standard_normal((2, 4, 3, 8)).astype(np.float32)
    for sdpa in (mha_cy.scaled_dot_product_attention, reference.scaled_dot_product_attention):
        with pytest.raises(ValueError, match="q has 4 heads and k/v have 0"):
            sdpa(q4, k, v)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 4, 1, 17, 4, 16), (2, 8, 5, 300, 2, 64),
                                   (1, 2, 40, 40, 2, 300)],
                         ids=["decode_mha", "gqa_lq_ne_lk", "head_dim_300_blas"])
@pytest.mark.parametrize("causal", [False, True])
def test_the_common_call_equals_the_checked_path_bitwise(rng, dtype, shape, causal):
    """sdpa(q, k, v) on plain contiguous arrays skips the general checks; an explicit scale
    (1 / sqrt(D), the default) takes the checked path: both must give the same bits."""
    B, Hq, Lq, Lk, Hkv, D = shape
    q = rng.standard_normal((B, Hq, Lq, D)).astype(dtype)
    k = rng.standard_normal((B, Hkv, Lk, D)).astype(dtype)
    v = rng.standard_normal((B, Hkv, Lk, D)).astype(dtype)
    fast = mha_cy.scaled_dot_product_attention(q, k, v, is_causal=causal)
    checked = mha_cy.scaled_dot_product_attention(q, k, v, is_causal=causal,
                                                  scale=1.0 / np.sqrt(D))
    np.testing.assert_array_equal(fast, checked)
    assert fast.dtype == dtype
    ref = mha_cy.reference.scaled_dot_product_attention(q, k, v, is_causal=causal)
    assert_close(fast, ref, dtype)


def test_the_common_call_still_checks_what_it_does_not_take(rng):
    q = rng.standard_normal((1, 4, 3, 8)).astype(np.float32)
    k = rng.standard_normal((1, 3, 5, 8)).astype(np.float32)          # 4 % 3 != 0
    with pytest.raises(ValueError, match="multiple"):
        mha_cy.scaled_dot_product_attention(q, k, k)
    k = rng.standard_normal((1, 2, 5, 8))                              # float64: promoted
    out = mha_cy.scaled_dot_product_attention(q, k, k)
    assert out.dtype == np.float64
    assert_close(out, mha_cy.reference.scaled_dot_product_attention(q, k, k), np.float64)
    with pytest.raises(ValueError, match="length"):
        mha_cy.scaled_dot_product_attention(q, k, k[:, :, :4])
    assert (mha_cy.scaled_dot_product_attention(q, k[:, :, :0], k[:, :, :0]) == 0).all()


@pytest.mark.parametrize("tile", ["auto", "blas"])
def test_broadcast_operands_of_one_key_are_not_taken_as_they_are(tile):
    """A broadcast view of one key is flagged C-contiguous with strides 0: as a BLAS leading
    dimension that was an illegal value, and the BLAS path returned v (fuzz finding). Data -inf
    scores hide their key: the row is zeros."""
    from mha_cy import _attention_kernel
    previous = _attention_kernel._set_tile_kernel(tile)
    try:
        q = np.full((1, 1, 1, 1), 0.7, np.float32)
        k = np.broadcast_to(np.float32(-np.inf), (1, 1, 1, 1))
        v = np.full((1, 1, 1, 1), 0.64, np.float32)
        assert k.flags.c_contiguous and k.strides == (0, 0, 0, 0)
        out = mha_cy.scaled_dot_product_attention(q, k, v, is_causal=True)
        np.testing.assert_array_equal(out, reference.scaled_dot_product_attention(
            q, k, v, is_causal=True))
        k = np.broadcast_to(rng_values := np.float32(0.5), (1, 2, 1, 1))
        out = mha_cy.scaled_dot_product_attention(np.ones((1, 2, 1, 1), np.float32), k,
                                                  np.broadcast_to(rng_values, (1, 2, 1, 1)))
        np.testing.assert_array_equal(out, np.full((1, 2, 1, 1), 0.5, np.float32))
    finally:
        _attention_kernel._set_tile_kernel(previous)


class _Tagged(np.ndarray):
    """An ndarray subclass: not a plain operand (its methods may differ)."""


def _misaligned(a):
    """A copy of a whose data starts one byte past an aligned address (flags.aligned False)."""
    raw = np.empty(a.nbytes + 1, np.uint8)
    out = raw[1:].view(a.dtype).reshape(a.shape)
    out[...] = a
    return out


@pytest.mark.parametrize("variant", ["byteswapped", "fortran", "misaligned", "subclass",
                                     "float16", "int32", "mixed", "three_d", "uneven_groups",
                                     "no_keys", "head_dim_300", "blas_rule", "list"])
def test_the_compiled_common_call_takes_only_plain_operands(rng, variant):
    """_attention_kernel.sdpa (the common call in one compiled call) returns None for any
    operand it cannot take as it is, and the general path then gives the reference's result
    or its error; plain operands it computes itself."""
    from mha_cy import _attention_kernel
    q, k, v = qkv(rng, np.float32, 2, 4, 2, 3, 5, 8)
    assert _attention_kernel.sdpa(q, k, v, False, 1) is not None
    previous = None
    if variant == "byteswapped":
        q = q.astype(q.dtype.newbyteorder())
    elif variant == "fortran":
        k = np.asfortranarray(k)
    elif variant == "misaligned":
        v = _misaligned(v)
        assert not v.flags.aligned
    elif variant == "subclass":
        q = q.view(_Tagged)
    elif variant == "float16":
        q, k, v = (x.astype(np.float16) for x in (q, k, v))
    elif variant == "int32":
        q, k, v = (np.round(x * 4).astype(np.int32) for x in (q, k, v))
    elif variant == "mixed":
        k = k.astype(np.float64)
    elif variant == "three_d":
        q = q[0]
    elif variant == "uneven_groups":
        q = rng.standard_normal((2, 3, 3, 8)).astype(np.float32)
    elif variant == "no_keys":
        k, v = k[:, :, :0], v[:, :, :0]
    elif variant == "head_dim_300":
        q, k, v = qkv(rng, np.float32, 1, 2, 2, 3, 5, 300)
    elif variant == "blas_rule":
        previous = _attention_kernel._set_tile_kernel("blas")
    else:
        q = q.tolist()
    try:
        assert _attention_kernel.sdpa(q, k, v, False, 1) is None
        try:
            expected = reference.scaled_dot_product_attention(q, k, v)
        except (ValueError, TypeError) as error:
            with pytest.raises(type(error)):
                mha_cy.scaled_dot_product_attention(q, k, v)
            return
        out = mha_cy.scaled_dot_product_attention(q, k, v)
        assert out.dtype == expected.dtype
        assert_close(out, expected)
    finally:
        if previous is not None:
            _attention_kernel._set_tile_kernel(previous)


def test_longdouble_inputs_compute_in_float64(rng):
    """np.longdouble inputs were computed in float32, silently: float64 is the nearest."""
    q, k, v = (rng.standard_normal((1, 2, 5, 8)) for _ in range(3))
    got = mha_cy.scaled_dot_product_attention(q.astype(np.longdouble), k, v.astype(np.float32))
    assert got.dtype == np.float64
    assert_close(got, reference.scaled_dot_product_attention(q, k, v.astype(np.float32)))
