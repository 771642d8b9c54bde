"""mha_cy.MultiHeadAttention (the compiled fast path) against mha_cy.reference.

Both modules are built from the same random weights (conftest.make_pair); every call is checked
with and without need_weights (conftest.check_modules).
"""
import numpy as np
import pytest

import mha_cy
from mha_cy import reference

from conftest import (DTYPES, assert_close, check_modules, make_pair, random_bool_mask,
                      random_float_mask, random_padding, random_weights)


# -- shapes ---------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("L", [1, 2, 3, 17, 63, 64, 65, 129, 300])
@pytest.mark.parametrize("is_causal", [False, True])
def test_self_attention_lengths(rng, dtype, L, is_causal):
    """Around the kernel's 64-row query blocks and 256-key tiles."""
    fast, ref = make_pair(rng, 16, 2, dtype)
    x = rng.standard_normal((2, L, 16)).astype(dtype)
    out, _ = check_modules(fast, ref, x, is_causal=is_causal)
    assert out.shape == (2, L, 16)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("q_len,k_len", [(1, 1), (1, 300), (3, 65), (65, 3), (64, 257),
                                         (129, 63), (17, 512)])
@pytest.mark.parametrize("is_causal", [False, True])
def test_cross_attention_lengths(rng, dtype, q_len, k_len, is_causal):
    fast, ref = make_pair(rng, 16, 4, dtype, kdim=12, vdim=20)
    q = rng.standard_normal((2, q_len, 16))
    kv_k = rng.standard_normal((2, k_len, 12))
    kv_v = rng.standard_normal((2, k_len, 20))
    out, weights = check_modules(fast, ref, q, kv_k, kv_v, is_causal=is_causal)
    assert out.shape == (2, q_len, 16) and weights.shape == (2, 4, q_len, k_len)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [1, 32, 64, 80, 128])
@pytest.mark.parametrize("heads,kv_heads", [(2, 2), (4, 1)])
@pytest.mark.parametrize("batch", [1, 2])
def test_head_dims(rng, dtype, head_dim, heads, kv_heads, batch):
    fast, ref = make_pair(rng, 24, heads, dtype, num_kv_heads=kv_heads, head_dim=head_dim)
    assert fast.head_dim == head_dim
    x = rng.standard_normal((batch, 70, 24))
    check_modules(fast, ref, x, is_causal=True)
    check_modules(fast, ref, x[:, :1])                       # decode-shaped call


@pytest.mark.parametrize("dtype", DTYPES)
def test_head_dim_1_batch_1(rng, dtype):
    """BUG (kernel): with head_dim 1 and batch 1 the (B, H, L, 1) context view is also
    F-contiguous, NumPy exports it through the buffer protocol with the canonical F strides
    (the size-1 last axis gets stride L*H*itemsize), and _attention_kernel.attention rejects it:
    "ValueError: attention: q, k, v and out need a contiguous last axis".
    Reproduction: mha_cy.MultiHeadAttention(2, 2)(np.ones((1, 3, 2), np.float32))."""
    fast, ref = make_pair(rng, 2, 2, dtype)                  # head_dim 1
    x = rng.standard_normal((1, 3, 2))
    try:
        out = fast(x)
    except ValueError as exc:
        pytest.fail(f"head_dim=1, batch=1 self-attention rejected by the kernel: {exc}")
    assert_close(out, ref(x), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2), (4, 1), (6, 3)])
def test_mha_gqa_mqa(rng, dtype, batch, heads, kv_heads):
    fast, ref = make_pair(rng, 24, heads, dtype, num_kv_heads=kv_heads)
    assert fast.k_weight.shape == (kv_heads * (24 // heads), 24)
    x = rng.standard_normal((batch, 37, 24))
    check_modules(fast, ref, x)
    check_modules(fast, ref, x, is_causal=True)
    check_modules(fast, ref, x[:, :1])
    y = rng.standard_normal((batch, 90, 24))
    check_modules(fast, ref, x, y, key_padding_mask=random_padding(rng, batch, 90))


@pytest.mark.parametrize("dtype", DTYPES)
def test_unbatched_input(rng, dtype):
    fast, ref = make_pair(rng, 16, 4, dtype, kdim=8)
    q = rng.standard_normal((5, 16))
    k = rng.standard_normal((7, 8))
    v = rng.standard_normal((7, 16))
    pad = np.array([False, True, False, False, True, False, False])
    out, weights = check_modules(fast, ref, q, k, v, key_padding_mask=pad, is_causal=True)
    assert out.shape == (5, 16) and weights.shape == (4, 5, 7)
    batched = fast(q[None], k[None], v[None], key_padding_mask=pad[None], is_causal=True)
    assert_close(fast(q, k, v, key_padding_mask=pad, is_causal=True), batched[0], dtype)
    # self-attention, 2-D with a 2-D attn_mask
    fast, ref = make_pair(rng, 16, 4, dtype)
    x = rng.standard_normal((6, 16))
    out, _ = check_modules(fast, ref, x, attn_mask=random_bool_mask(rng, (6, 6)))
    assert out.shape == (6, 16)


@pytest.mark.parametrize("dtype", DTYPES)
def test_value_none_means_value_is_key(rng, dtype):
    fast, ref = make_pair(rng, 16, 2, dtype, kdim=10, vdim=10)
    q = rng.standard_normal((2, 5, 16))
    k = rng.standard_normal((2, 9, 10))
    check_modules(fast, ref, q, k)
    assert_close(fast(q, k), fast(q, k, k), dtype)
    # kdim == vdim == embed_dim: value=None with an explicit key (the fused K/V projection)
    fast, ref = make_pair(rng, 16, 2, dtype)
    k = rng.standard_normal((2, 9, 16))
    check_modules(fast, ref, q, k)
    assert_close(fast(q, k), fast(q, k, k.copy()), dtype)
    # key = value = query given explicitly is self-attention
    assert_close(fast(q, q, q), fast(q), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bias", [True, False])
def test_bias_on_off(rng, dtype, bias):
    fast, ref = make_pair(rng, 16, 2, dtype, bias=bias)
    assert (fast.out_bias is None) == (not bias)
    assert (fast.q_bias is None) == (not bias)
    check_modules(fast, ref, rng.standard_normal((2, 9, 16)))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("given", ["q_bias", "k_bias", "v_bias", "out_bias"])
def test_partial_biases(rng, dtype, given):
    """A missing bias is zero when another one is given."""
    w = random_weights(rng, 16, 2, kdim=8, bias=False)
    w[given] = rng.standard_normal(16)                      # every bias has 16 entries here
    fast = mha_cy.MultiHeadAttention.from_weights(**w, dtype=dtype)
    ref = reference.MultiHeadAttention.from_weights(**w, dtype=dtype)
    for name in ("q_bias", "k_bias", "v_bias", "out_bias"):
        b = getattr(fast, name)
        expected = w[given] if name == given else np.zeros(16)
        np.testing.assert_array_equal(b, expected.astype(dtype))
    q, k = rng.standard_normal((2, 5, 16)), rng.standard_normal((2, 6, 8))
    v = rng.standard_normal((2, 6, 16))
    out, _ = check_modules(fast, ref, q, k, v)
    no_bias = mha_cy.MultiHeadAttention.from_weights(
        **{n: a for n, a in w.items() if n != given}, dtype=dtype)
    # the bias changes the result (k_bias only shifts every score of a row equally: no effect)
    if given != "k_bias":
        assert np.abs(no_bias(q, k, v) - out).max() > 1e-3
    else:
        assert_close(no_bias(q, k, v), out, dtype, factor=10)


@pytest.mark.parametrize("dtype", DTYPES)
def test_seeded_constructor_matches_reference(rng, dtype):
    fast = mha_cy.MultiHeadAttention(16, 4, num_kv_heads=2, dtype=dtype, seed=3)
    ref = reference.MultiHeadAttention(16, 4, num_kv_heads=2, dtype=dtype, seed=3)
    other = mha_cy.MultiHeadAttention(16, 4, num_kv_heads=2, dtype=dtype, seed=4)
    np.testing.assert_array_equal(fast.q_weight, ref.q_weight)
    assert not np.array_equal(fast.q_weight, other.q_weight)
    assert fast.q_weight.dtype == dtype
    check_modules(fast, ref, rng.standard_normal((2, 9, 16)), is_causal=True)


# -- dtypes ---------------------------------------------------------------------------------

def test_dtype_conversion(rng):
    w = random_weights(rng, 16, 2)
    f32 = mha_cy.MultiHeadAttention.from_weights(**w, dtype=np.float32)
    f64 = mha_cy.MultiHeadAttention.from_weights(**w, dtype=np.float64)
    ref32 = reference.MultiHeadAttention.from_weights(**w, dtype=np.float32)
    x = rng.standard_normal((2, 5, 16))                       # float64 input
    out32 = f32(x)
    assert out32.dtype == np.float32
    assert_close(out32, ref32(x.astype(np.float32)), np.float32)
    assert_close(out32, f64(x), np.float32)                   # float32 accuracy
    assert f64(x.astype(np.float32)).dtype == np.float64
    assert f32(x.astype(np.float16)).dtype == np.float32
    xi = rng.integers(-3, 3, size=(2, 5, 16))
    assert_close(f32(xi), ref32(xi.astype(np.float32)), np.float32)
    # from_weights: dtype None = float64 if any weight is float64
    assert mha_cy.MultiHeadAttention.from_weights(**w).dtype == np.float64
    w32 = {n: (a.astype(np.float32) if isinstance(a, np.ndarray) else a) for n, a in w.items()}
    assert mha_cy.MultiHeadAttention.from_weights(**w32).dtype == np.float32


# -- masks ----------------------------------------------------------------------------------

B, H, LQ, LK = 2, 4, 70, 300
MASK_SHAPES = [(LQ, LK), (B, LQ, LK), (B, H, LQ, LK),
               (1, LK), (LQ, 1), (1, 1), (B, 1, LK), (1, LQ, LK), (B, 1, 1, LK),
               (1, H, LQ, LK), (B, H, 1, LK), (1, 1, LQ, 1)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", ["bool", "float"])
@pytest.mark.parametrize("shape", MASK_SHAPES, ids=str)
def test_attn_mask_shapes(rng, dtype, kind, shape):
    fast, ref = make_pair(rng, 16, H, dtype, num_kv_heads=2)
    q, kv = rng.standard_normal((B, LQ, 16)), rng.standard_normal((B, LK, 16))
    mask = (random_bool_mask(rng, shape, 0.9) if kind == "bool"
            else random_float_mask(rng, shape, 0.05))
    out, weights = check_modules(fast, ref, q, kv, attn_mask=mask)
    if shape[-1] > 1:       # the mask did something (a mask constant along a row may not)
        assert np.abs(weights - ref(q, kv, need_weights=True)[1]).max() > 1e-3


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("q_len,k_len", [(70, 300), (300, 70), (65, 65), (1, 40)])
@pytest.mark.parametrize("attn,padding,is_causal", [
    (attn, padding, causal) for attn in (None, "bool", "float", "bool4", "float4")
    for padding in (False, True) for causal in (False, True) if attn or padding or causal])
def test_mask_combinations(rng, dtype, q_len, k_len, attn, padding, is_causal):
    b, heads = 2, 4
    fast, ref = make_pair(rng, 16, heads, dtype, num_kv_heads=2)
    q = rng.standard_normal((b, q_len, 16))
    kv = rng.standard_normal((b, k_len, 16))
    shape = (b, heads, q_len, k_len) if attn and attn.endswith("4") else (q_len, k_len)
    mask = None
    if attn and attn.startswith("bool"):
        mask = random_bool_mask(rng, shape, 0.8)
    elif attn:
        mask = random_float_mask(rng, shape, 0.1)
    pad = random_padding(rng, b, k_len) if padding else None
    check_modules(fast, ref, q, kv, attn_mask=mask, key_padding_mask=pad, is_causal=is_causal)


@pytest.mark.parametrize("dtype", DTYPES)
def test_fully_masked_rows_give_zeros(rng, dtype):
    b, heads, q_len, k_len = 3, 2, 70, 260
    fast, ref = make_pair(rng, 16, heads, dtype, bias=False)
    q = rng.standard_normal((b, q_len, 16))
    kv = rng.standard_normal((b, k_len, 16))
    pad = random_padding(rng, b, k_len)
    pad[1] = True                                     # sequence 1: every key padded
    mask = np.ones((b, heads, q_len, k_len), bool)
    mask[0, 1, 5] = False                             # one row of one head: nothing allowed
    fmask = np.zeros((q_len, k_len))
    fmask[7] = -np.inf                                # one query: every key at -inf
    for kwargs in (dict(key_padding_mask=pad), dict(attn_mask=mask), dict(attn_mask=fmask)):
        out, weights = check_modules(fast, ref, q, kv, **kwargs)
        out_f, w_f = fast(q, kv, need_weights=True, **kwargs)
        assert np.isfinite(out_f).all() and np.isfinite(w_f).all()
    out_f, w_f = fast(q, kv, key_padding_mask=pad, need_weights=True)
    np.testing.assert_array_equal(out_f[1], 0)        # no bias: a zero context gives 0
    np.testing.assert_array_equal(w_f[1], 0)
    np.testing.assert_array_equal(fast(q, kv, key_padding_mask=pad)[1], 0)
    _, w_f = fast(q, kv, attn_mask=mask, need_weights=True)
    np.testing.assert_array_equal(w_f[0, 1, 5], 0)
    np.testing.assert_allclose(w_f[0, 0, 5].sum(), 1, rtol=1e-5)
    _, w_f = fast(q, kv, attn_mask=fmask, need_weights=True)
    np.testing.assert_array_equal(w_f[:, :, 7], 0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("is_causal", [False, True])
def test_padding_at_the_ends_of_the_keys(rng, dtype, is_causal):
    """Right- and left-padded batches (the kernel skips padded keys at either end of a row;
    lengths chosen around its 256-key tiles), with padding in the middle too."""
    b, k_len = 5, 600
    fast, ref = make_pair(rng, 16, 2, dtype)
    x = rng.standard_normal((b, k_len, 16))
    pad = np.zeros((b, k_len), bool)
    pad[0, 300:] = True                               # right padding
    pad[1, :257] = True                               # left padding
    pad[2, :10] = pad[2, 500:] = True                 # both ends
    pad[3, 100:400] = True                            # middle only
    pad[4, 1:] = True                                 # a single real key
    check_modules(fast, ref, x, key_padding_mask=pad, is_causal=is_causal)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("q_len,k_len", [(5, 2), (300, 70), (70, 1)])
def test_causal_more_queries_than_keys(rng, dtype, q_len, k_len):
    """Bottom-right causal with Lq > Lk: the first Lq - Lk queries see no key at all."""
    fast, ref = make_pair(rng, 16, 2, dtype, bias=False)
    q = rng.standard_normal((2, q_len, 16))
    kv = rng.standard_normal((2, k_len, 16))
    out, weights = check_modules(fast, ref, q, kv, is_causal=True)
    blind = q_len - k_len
    out_f, w_f = fast(q, kv, is_causal=True, need_weights=True)
    np.testing.assert_array_equal(out_f[:, :blind], 0)
    np.testing.assert_array_equal(w_f[:, :, :blind], 0)
    np.testing.assert_array_equal(fast(q, kv, is_causal=True)[:, :blind], 0)
    np.testing.assert_allclose(w_f[:, :, blind:].sum(-1), 1, rtol=1e-5)
    # query blind + i sees keys 0..i
    assert (w_f[:, :, blind:][..., np.triu_indices(k_len, 1)[0],
                              np.triu_indices(k_len, 1)[1]] == 0).all()


@pytest.mark.parametrize("dtype", DTYPES)
def test_need_weights_per_head(rng, dtype):
    fast, ref = make_pair(rng, 32, 4, dtype, num_kv_heads=2)
    x = rng.standard_normal((2, 20, 32))
    out, weights = fast(x, need_weights=True, is_causal=True)
    _, ref_w = ref(x, need_weights=True, is_causal=True)
    assert weights.shape == (2, 4, 20, 20) and weights.dtype == dtype
    assert_close(weights, ref_w, dtype)
    assert not np.allclose(weights[:, 0], weights[:, 1])      # per head, not averaged
    np.testing.assert_allclose(weights.sum(-1), 1, rtol=1e-5)
    assert_close(out, fast(x, is_causal=True), dtype)          # same out either way


# -- memory layouts ---------------------------------------------------------------------------

def _layouts(arr):
    """arr in several memory layouts, all equal to arr."""
    strided = np.empty(arr.shape[:-1] + (2 * arr.shape[-1],), arr.dtype)[..., ::2]
    strided[...] = arr
    reversed_ = np.ascontiguousarray(arr[:, ::-1])[:, ::-1]
    readonly = arr.copy()
    readonly.setflags(write=False)
    transposed = np.ascontiguousarray(arr.swapaxes(0, 1)).swapaxes(0, 1)
    return {"strided": strided, "fortran": np.asfortranarray(arr), "reversed": reversed_,
            "readonly": readonly, "transposed": transposed}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", ["strided", "fortran", "reversed", "readonly", "transposed"])
def test_non_contiguous_inputs(rng, dtype, layout):
    fast, ref = make_pair(rng, 16, 4, dtype, num_kv_heads=2, kdim=12)
    q = rng.standard_normal((3, 9, 16)).astype(dtype)
    k = rng.standard_normal((3, 11, 12)).astype(dtype)
    v = rng.standard_normal((3, 11, 16)).astype(dtype)
    mask = random_float_mask(rng, (3, 4, 9, 11), 0.1)
    pad = random_padding(rng, 3, 11)
    expected = ref(q, k, v, attn_mask=mask, key_padding_mask=pad)
    ql, kl, vl, ml, pl = (_layouts(a)[layout] for a in (q, k, v, mask, pad))
    for qq in (q, ql):
        out = fast(qq, kl, vl, attn_mask=ml, key_padding_mask=pl)
        assert_close(out, expected, dtype)
    # self-attention too
    fast, ref = make_pair(rng, 16, 4, dtype)
    assert_close(fast(ql, is_causal=True), ref(q, is_causal=True), dtype)
    assert_close(fast(ql[0], is_causal=True), ref(q[0], is_causal=True), dtype)


# -- threads ----------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads,q_len", [(4, 4, 150), (4, 2, 1), (4, 1, 70)])
def test_thread_count_does_not_change_results(rng, dtype, heads, kv_heads, q_len):
    fast, _ = make_pair(rng, 64, heads, dtype, num_kv_heads=kv_heads)
    q = rng.standard_normal((3, q_len, 64))
    kv = rng.standard_normal((3, 300, 64))
    pad = random_padding(rng, 3, 300)
    mask = random_float_mask(rng, (3, heads, q_len, 300), 0.1)
    results = []
    serial = not mha_cy.build_info()["openmp"]      # a serial build always runs 1 thread
    for n in (1, 2, 3):
        with mha_cy.threads(n):
            assert mha_cy.get_num_threads() == (1 if serial else n)
            results.append((fast(q, kv, key_padding_mask=pad, attn_mask=mask),
                            fast(q, kv, need_weights=True, is_causal=True),
                            fast(kv, is_causal=True)))
    flat = [[r[0], *r[1], r[2]] for r in results]    # out, (out, weights), out
    for other in flat[1:]:
        for x, y in zip(flat[0], other):
            # work partitions depend on the shapes only: bitwise equal
            np.testing.assert_array_equal(x, y)


# -- parameters are views ---------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kdim", [None, 12])
def test_weight_attributes_are_live_views(rng, dtype, kdim):
    fast, ref = make_pair(rng, 16, 4, dtype, num_kv_heads=2, kdim=kdim, vdim=kdim)
    q = rng.standard_normal((2, 6, 16))
    kv = rng.standard_normal((2, 8, kdim or 16))
    before = fast(q, kv)
    for mha in (fast, ref):
        mha.q_weight[:] *= 2
        mha.k_weight[0] += 0.5
        mha.v_weight[:, 1] -= 1
        mha.out_weight[3] = 0
        mha.q_bias[:] += 1
        mha.v_bias[2] = 7
        mha.out_bias[:] = 0.25
    after = fast(q, kv)
    assert np.abs(after - before).max() > 1e-2
    assert_close(after, ref(q, kv), dtype)
    np.testing.assert_array_equal(after[..., 3], np.float32(0.25).astype(dtype))
    if kdim is None:
        # the q/k/v weights are views of the packed in_proj_weight (one GEMM for self-attention)
        assert np.shares_memory(fast.q_weight, fast.in_proj_weight)
        assert_close(fast(q), ref(q), dtype)
        fast.in_proj_weight[:] *= 0.5
        ref.in_proj_weight[:] *= 0.5
        assert_close(fast(q), ref(q), dtype)
        fast.k_bias[:] = 3                              # through the packed in_proj_bias
        ref.k_bias[:] = 3
        assert_close(fast(q), ref(q), dtype)


def test_weights_are_copied_from_the_arrays_given(rng):
    w = random_weights(rng, 16, 2)
    fast = mha_cy.MultiHeadAttention.from_weights(**w, dtype=np.float64)
    x = rng.standard_normal((1, 4, 16))
    before = fast(x)
    w["q_weight"][:] = 0
    np.testing.assert_array_equal(fast(x), before)


def test_repr_and_attributes():
    mha = mha_cy.MultiHeadAttention(32, 8, num_kv_heads=2, kdim=16, vdim=24, bias=False, seed=0)
    assert (mha.embed_dim, mha.num_heads, mha.num_kv_heads, mha.head_dim) == (32, 8, 2, 4)
    assert (mha.kdim, mha.vdim, mha.dtype) == (16, 24, np.float32)
    assert mha.q_weight.shape == (32, 32) and mha.k_weight.shape == (8, 16)
    assert mha.v_weight.shape == (8, 24) and mha.out_weight.shape == (32, 32)
    assert "num_kv_heads=2" in repr(mha) and "bias=False" in repr(mha)


def test_concurrent_python_threads(rng):
    """The kernels release the GIL: several Python threads may run inferences at once, with
    the same results as one after the other."""
    import threading
    fast, _ = make_pair(rng, 64, 8, np.float32, num_kv_heads=2)
    xs = [rng.standard_normal((2, 100, 64)).astype(np.float32) for _ in range(6)]
    expected = [fast(x, is_causal=True) for x in xs]
    ok = [None] * len(xs)

    def work(i):
        ok[i] = all(np.array_equal(fast(xs[i], is_causal=True), expected[i]) for _ in range(5))

    workers = [threading.Thread(target=work, args=(i,)) for i in range(len(xs))]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    assert ok == [True] * len(xs)
