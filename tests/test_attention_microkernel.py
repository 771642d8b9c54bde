"""The fused attention tile kernel (src/attention_microkernel.c) on its own: forced on with
_set_tile_kernel("fused"), against mha_cy.reference, for the shapes its register blocks and
tiles cut unevenly (4 query rows x 16 or 8 keys per block; 64 or 32 keys per tile where a
causal limit or a window cuts it, 128 or 64 elsewhere; dv in vectors of 8 or 4 lanes plus a
tail), every mask, the decode and split-K tasks, NaN, and any thread count."""
import numpy as np
import pytest

import mha_cy
from mha_cy import _attention_kernel, reference

from conftest import DTYPES, assert_close, make_pair

HEAD_DIMS = [1, 7, 16, 64, 100, 128, 256]


@pytest.fixture
def fused():
    previous = _attention_kernel._set_tile_kernel("fused")
    yield
    _attention_kernel._set_tile_kernel(previous)


def sdpa_pair(q, k, v, **kwargs):
    return (mha_cy.scaled_dot_product_attention(q, k, v, **kwargs),
            reference.scaled_dot_product_attention(q, k, v, **kwargs))


def normal(rng, shape, dtype):
    return rng.standard_normal(shape).astype(dtype)


def test_set_tile_kernel_returns_the_previous_setting():
    assert _attention_kernel._set_tile_kernel("fused") == "auto"
    assert _attention_kernel._set_tile_kernel("blas") == "fused"
    assert _attention_kernel._set_tile_kernel("auto") == "blas"
    with pytest.raises(ValueError, match="tile kernel"):
        _attention_kernel._set_tile_kernel("simd")
    assert _attention_kernel._set_tile_kernel("auto") == "auto"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", HEAD_DIMS)
@pytest.mark.parametrize("is_causal", [False, True])
def test_head_dims_and_uneven_tiles(rng, tile_kernel, dtype, d, is_causal):
    """Lq = 37 rows (9 blocks of 4 and one of 1), Lk = 70 keys (a full tile and a partial one
    of 6 or 38 keys): causal with Lq != Lk puts the diagonal inside both tiles."""
    q = normal(rng, (2, 3, 37, d), dtype)
    k, v = normal(rng, (2, 3, 70, d), dtype), normal(rng, (2, 3, 70, d), dtype)
    out, expected = sdpa_pair(q, k, v, is_causal=is_causal)
    assert_close(out, expected, dtype)


@pytest.mark.parametrize("d", [256, 300])
def test_auto_rule_either_side_of_the_crossover(rng, d):
    """The default rule runs the fused kernel up to D = 256 and BLAS above: both right."""
    assert _attention_kernel._set_tile_kernel("auto") == "auto"
    q = normal(rng, (1, 2, 70, d), np.float32)
    k, v = normal(rng, (1, 2, 90, d), np.float32), normal(rng, (1, 2, 90, d), np.float32)
    out, expected = sdpa_pair(q, k, v, is_causal=True)
    assert_close(out, expected, np.float32)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("q_len,k_len", [(1, 300), (5, 130), (130, 70), (200, 200), (65, 3)])
def test_causal_lq_ne_lk(rng, fused, dtype, q_len, k_len):
    """Bottom-right causal: with Lq > Lk the first Lq - Lk rows see no key and give zeros."""
    q = normal(rng, (1, 2, q_len, 64), dtype)
    k, v = normal(rng, (1, 2, k_len, 64), dtype), normal(rng, (1, 2, k_len, 64), dtype)
    out, expected = sdpa_pair(q, k, v, is_causal=True)
    assert_close(out, expected, dtype)
    np.testing.assert_array_equal(out[:, :, :max(0, q_len - k_len)], 0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("is_causal", [False, True])
def test_key_padding_at_both_ends(rng, tile_kernel, dtype, is_causal):
    """The kernel's padding flags, through the module's key_padding_mask: padding at either end
    (the task skips it) and inside a tile (the kernel masks it); a fully padded sequence."""
    b, k_len = 5, 150
    fast, ref = make_pair(rng, 32, 2, dtype)
    x = rng.standard_normal((b, k_len, 32))
    pad = np.zeros((b, k_len), bool)
    pad[0, 100:] = True
    pad[1, :70] = True
    pad[2, :3] = pad[2, 140:] = True
    pad[3, 20:90] = pad[3, 95] = True
    pad[4] = True
    assert_close(fast(x, key_padding_mask=pad, is_causal=is_causal),
                 ref(x, key_padding_mask=pad, is_causal=is_causal), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("k_len", [63, 64, 65, 127, 128, 129, 200, 257])
@pytest.mark.parametrize("mask", ["none", "padding", "additive", "causal", "window"])
def test_wide_and_edge_tiles(rng, fused, dtype, k_len, mask):
    """Key counts either side of both tile widths (the wide tiles of rows that see every key,
    the narrow ones where a causal limit or a window cuts a tile), with the masks that keep
    the wide tiles (padding inside and past a tile, an additive mask) and those that do not;
    against the reference, and the same bits on 1 and 3 threads."""
    q = normal(rng, (2, 2, 45, 40), dtype)
    k, v = normal(rng, (2, 2, k_len, 40), dtype), normal(rng, (2, 2, k_len, 40), dtype)
    kwargs = {"causal": {"is_causal": True},
              "window": {"is_causal": True, "window": 50}}.get(mask, {})
    if mask == "padding":
        keep = np.ones((2, 1, 1, k_len), bool)
        keep[0, ..., k_len // 2:] = False
        keep[1, ..., 60:70] = keep[1, ..., k_len - 1] = False
        kwargs = {"attn_mask": keep}
    elif mask == "additive":
        add = rng.standard_normal((2, 1, 45, k_len)).astype(dtype)
        add[rng.random(add.shape) < 0.1] = -np.inf
        kwargs = {"attn_mask": add}
    out, expected = sdpa_pair(q, k, v, **kwargs)
    assert_close(out, expected, dtype)
    with mha_cy.threads(1):
        one = mha_cy.scaled_dot_product_attention(q, k, v, **kwargs)
    with mha_cy.threads(3):
        three = mha_cy.scaled_dot_product_attention(q, k, v, **kwargs)
    np.testing.assert_array_equal(one, out)
    np.testing.assert_array_equal(three, out)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", HEAD_DIMS)
@pytest.mark.parametrize("padded", [False, True])
def test_wide_tiles_every_head_dim(rng, fused, dtype, d, padded):
    """200 keys in a wide tile and a partial one (128 + 72 float32, 3 x 64 + 8 float64), every
    head dim (the packed tile grows with it), with and without padding inside the partial
    tile."""
    q = normal(rng, (1, 2, 30, d), dtype)
    k, v = normal(rng, (1, 2, 200, d), dtype), normal(rng, (1, 2, 200, d), dtype)
    kwargs = {}
    if padded:
        keep = np.ones((1, 1, 1, 200), bool)
        keep[..., 150:190] = False
        kwargs = {"attn_mask": keep}
    out, expected = sdpa_pair(q, k, v, **kwargs)
    assert_close(out, expected, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(40, 90), (1, 1, 90), (2, 1, 40, 90), (2, 3, 40, 90)])
def test_additive_mask(rng, tile_kernel, dtype, shape):
    """Additive masks with every broadcast (the kernel's row and key strides), -inf included."""
    q = normal(rng, (2, 3, 40, 16), dtype)
    k, v = normal(rng, (2, 3, 90, 16), dtype), normal(rng, (2, 3, 90, 16), dtype)
    mask = rng.standard_normal(shape).astype(dtype)
    mask[rng.random(shape) < 0.2] = -np.inf
    out, expected = sdpa_pair(q, k, v, attn_mask=mask)
    assert_close(out, expected, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("is_causal", [False, True])
def test_boolean_mask_with_fully_masked_rows(rng, tile_kernel, dtype, is_causal):
    q = normal(rng, (2, 2, 30, 24), dtype)
    k, v = normal(rng, (2, 2, 75, 24), dtype), normal(rng, (2, 2, 75, 24), dtype)
    mask = rng.random((2, 1, 30, 75)) < 0.7
    mask[0, :, 3] = False                           # fully masked rows of batch 0
    mask[1, :, 10:20] = False                       # and of batch 1, several blocks
    mask[:, :, 25, :64] = False                     # a row with keys in the second tile only
    out, expected = sdpa_pair(q, k, v, attn_mask=mask, is_causal=is_causal)
    assert_close(out, expected, dtype)
    np.testing.assert_array_equal(out[0, :, 3], 0)
    np.testing.assert_array_equal(out[1, :, 10:20], 0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [7, 64, 128])
def test_gqa_decode(rng, tile_kernel, dtype, d):
    """Lq = 1 with groups of 4 query heads: one task per (batch, KV head), its rows the group's
    heads (row stride = head stride), with a key padding mask."""
    q = normal(rng, (3, 8, 1, d), dtype)
    k, v = normal(rng, (3, 2, 333, d), dtype), normal(rng, (3, 2, 333, d), dtype)
    mask = np.ones((3, 1, 1, 333), bool)
    mask[0, ..., 300:] = False
    mask[1, ..., :5] = False
    out, expected = sdpa_pair(q, k, v, attn_mask=mask)
    assert_close(out, expected, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("masked", [False, True])
def test_split_k(rng, tile_kernel, dtype, masked):
    """Lq = 1 and one KV head over 5000 keys: the keys are split into parts that run in
    parallel and are merged; a mask hides whole parts."""
    q = normal(rng, (1, 1, 1, 64), dtype)
    k, v = normal(rng, (1, 1, 5000, 64), dtype), normal(rng, (1, 1, 5000, 64), dtype)
    mask = None
    if masked:
        mask = np.ones((1, 1, 1, 5000), bool)
        mask[..., :1500] = mask[..., 4000:4100] = False
    for n_threads in (1, 2, 3):
        with mha_cy.threads(n_threads):
            out, expected = sdpa_pair(q, k, v, attn_mask=mask)
        assert_close(out, expected, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("is_causal", [False, True])
def test_nan_key_propagates(rng, tile_kernel, dtype, is_causal):
    """A NaN in key 50 makes NaN the rows that see it (all, or with causal the rows >= 50),
    never a silent 0; the other rows are untouched."""
    q = normal(rng, (1, 2, 100, 16), dtype)
    k, v = normal(rng, (1, 2, 100, 16), dtype), normal(rng, (1, 2, 100, 16), dtype)
    k[0, 1, 50, 3] = np.nan
    out, expected = sdpa_pair(q, k, v, is_causal=is_causal)
    sees = np.zeros(out.shape[:3], bool)
    sees[0, 1, 50 if is_causal else 0:] = True
    np.testing.assert_array_equal(np.isnan(out).any(-1), sees)
    assert np.isnan(out[sees]).all()
    assert_close(out[~sees], expected[~sees], dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", ["self_causal", "decode", "split_k", "padded"])
def test_threads_bitwise_equal(rng, fused, dtype, case):
    """The fused kernel's sums run in an order fixed by the shapes: 1, 2 or 3 threads give the
    same bits."""
    kwargs = {}
    if case == "self_causal":
        q = normal(rng, (2, 3, 300, 40), dtype)
        k = v = q
        kwargs["is_causal"] = True
    elif case == "decode":
        q = normal(rng, (2, 8, 1, 64), dtype)
        k, v = normal(rng, (2, 2, 700, 64), dtype), normal(rng, (2, 2, 700, 64), dtype)
    elif case == "split_k":
        q = normal(rng, (1, 1, 1, 32), dtype)
        k, v = normal(rng, (1, 1, 5000, 32), dtype), normal(rng, (1, 1, 5000, 32), dtype)
    else:
        q = normal(rng, (3, 2, 200, 16), dtype)
        k = v = q
        mask = np.ones((3, 1, 1, 200), bool)
        mask[1, ..., 150:] = mask[2, ..., :30] = False
        kwargs["attn_mask"] = mask
    results = []
    for n_threads in (1, 2, 3):
        with mha_cy.threads(n_threads):
            results.append(mha_cy.scaled_dot_product_attention(q, k, v, **kwargs))
    assert_close(results[0], reference.scaled_dot_product_attention(q, k, v, **kwargs), dtype)
    for other in results[1:]:
        np.testing.assert_array_equal(other, results[0])


@pytest.mark.parametrize("dtype", DTYPES)
def test_row_blocks_change_no_bit(rng, fused, dtype):
    """The packed kernel runs blocks of 12 query rows at AVX-512 (6 below) and a last block of
    what is left: a row's output is the same bits whatever block it falls in (each score one
    chain over d, each output one chain over the keys), for every tail length."""
    previous = _attention_kernel._set_fused_direct(0, 0)     # every task on the packed kernel
    try:
        q = normal(rng, (1, 2, 40, 48), dtype)
        k, v = normal(rng, (1, 2, 100, 48), dtype), normal(rng, (1, 2, 100, 48), dtype)
        whole = mha_cy.scaled_dot_product_attention(q, k, v)
        assert_close(whole, reference.scaled_dot_product_attention(q, k, v), dtype)
        for n in range(1, 40):
            part = mha_cy.scaled_dot_product_attention(np.ascontiguousarray(q[:, :, :n]), k, v)
            np.testing.assert_array_equal(part, whole[:, :, :n], err_msg=f"{n} rows")
    finally:
        _attention_kernel._set_fused_direct(*previous)


@pytest.fixture(params=[0, 8], ids=["packed", "direct"])
def fused_variant(request):
    """The fused kernel with tasks of <= 8 rows on its direct variant (no packed keys) or
    on the packed one."""
    previous_kernel = _attention_kernel._set_tile_kernel("fused")
    previous = _attention_kernel._set_fused_direct(request.param, 0)   # at any head dim
    yield request.param
    _attention_kernel._set_fused_direct(*previous)
    _attention_kernel._set_tile_kernel(previous_kernel)


def test_set_fused_direct_returns_the_previous_setting():
    default = _attention_kernel._set_fused_direct(3, 0)
    assert default == (8, 32)
    assert _attention_kernel._set_fused_direct(*default) == (3, 0)
    with pytest.raises(ValueError):
        _attention_kernel._set_fused_direct(-1, 0)


@pytest.mark.parametrize("d", [16, 64])
@pytest.mark.parametrize("group", [1, 4])
def test_direct_default_rule(rng, d, group):
    """The default rule (direct for <= 8 rows at D >= 32 or for one row) gives right results
    either side."""
    q = normal(rng, (1, 2 * group, 1, d), np.float32)
    k, v = normal(rng, (1, 2, 300, d), np.float32), normal(rng, (1, 2, 300, d), np.float32)
    out, expected = sdpa_pair(q, k, v)
    assert_close(out, expected, np.float32)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [1, 7, 40, 64, 88, 128, 256])
@pytest.mark.parametrize("group", [1, 2, 3, 4, 5, 6, 7, 8])
def test_direct_decode_rows(rng, fused_variant, dtype, d, group):
    """Decode with groups of 1..8 query heads (the task's rows: one block of them at AVX-512,
    blocks of up to 4 below; keys per score block 8 / rows, P V panels of 8 / rows column
    vectors and the narrower panels of the columns left: d 40 and 88 leave 1-3 of them and a
    partial vector), 141 keys (two full tiles and a partial one, a partial score block), a
    boolean mask hiding keys inside tiles and key padding at both ends."""
    kv_heads, k_len = 2, 141
    q = normal(rng, (2, kv_heads * group, 1, d), dtype)
    k, v = normal(rng, (2, kv_heads, k_len, d), dtype), normal(rng, (2, kv_heads, k_len, d), dtype)
    mask = rng.random((2, 1, 1, k_len)) < 0.8
    mask[0, ..., :3] = mask[1, ..., 130:] = False
    out, expected = sdpa_pair(q, k, v, attn_mask=mask)
    assert_close(out, expected, dtype)
    out, expected = sdpa_pair(q, k, v)
    assert_close(out, expected, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [1, 7, 64, 128, 256])
@pytest.mark.parametrize("q_len", [1, 2, 3, 4, 5, 6, 7, 8])
@pytest.mark.parametrize("is_causal", [False, True])
def test_direct_few_query_rows(rng, fused_variant, dtype, d, q_len, is_causal):
    """Lq = 1..8 query rows (one task of Lq rows) over 150 keys: causal with Lq != Lk puts
    the diagonal in the last tile; an additive mask with -inf, broadcast over heads."""
    k_len = 150
    q = normal(rng, (2, 3, q_len, d), dtype)
    k, v = normal(rng, (2, 3, k_len, d), dtype), normal(rng, (2, 3, k_len, d), dtype)
    mask = rng.standard_normal((2, 1, q_len, k_len)).astype(dtype)
    mask[rng.random(mask.shape) < 0.2] = -np.inf
    out, expected = sdpa_pair(q, k, v, attn_mask=mask, is_causal=is_causal)
    assert_close(out, expected, dtype)
    out, expected = sdpa_pair(q, k, v, is_causal=is_causal)
    assert_close(out, expected, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_direct_padding_nan_and_fully_masked(rng, fused_variant, dtype):
    """Key padding (a fully padded sequence gives zeros), and a NaN key: the rows that see it
    are NaN, the others right."""
    b, h, k_len, d = 3, 4, 200, 40
    q = normal(rng, (b, h, 3, d), dtype)
    k, v = normal(rng, (b, 1, k_len, d), dtype), normal(rng, (b, 1, k_len, d), dtype)
    pad = np.ones((b, 1, 1, k_len), bool)
    pad[0, ..., 150:] = False
    pad[1] = False
    out, expected = sdpa_pair(q, k, v, attn_mask=pad)
    assert_close(out, expected, dtype)
    np.testing.assert_array_equal(out[1], 0)
    k[2, 0, 120, 5] = np.nan
    out, expected = sdpa_pair(q, k, v, is_causal=True)
    sees = np.zeros(out.shape[:3], bool)
    sees[2] = True                         # rows i see keys <= i + 197 >= 120
    np.testing.assert_array_equal(np.isnan(out).any(-1), sees)
    assert_close(out[~sees], expected[~sees], dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", ["gqa", "mqa_split_k", "few_rows_causal"])
def test_direct_threads_bitwise_equal(rng, fused_variant, dtype, case):
    kwargs = {}
    if case == "gqa":
        q = normal(rng, (2, 12, 1, 128), dtype)
        k, v = normal(rng, (2, 2, 900, 128), dtype), normal(rng, (2, 2, 900, 128), dtype)
    elif case == "mqa_split_k":
        q = normal(rng, (1, 8, 1, 64), dtype)
        k, v = normal(rng, (1, 1, 6000, 64), dtype), normal(rng, (1, 1, 6000, 64), dtype)
    else:
        q = normal(rng, (2, 2, 5, 72), dtype)
        k, v = normal(rng, (2, 2, 333, 72), dtype), normal(rng, (2, 2, 333, 72), dtype)
        kwargs["is_causal"] = True
    results = []
    for n_threads in (1, 2, 3):
        with mha_cy.threads(n_threads):
            results.append(mha_cy.scaled_dot_product_attention(q, k, v, **kwargs))
    assert_close(results[0], reference.scaled_dot_product_attention(q, k, v, **kwargs), dtype)
    for other in results[1:]:
        np.testing.assert_array_equal(other, results[0])
