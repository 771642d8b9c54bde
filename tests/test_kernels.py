"""The compiled pieces on their own: the BLAS shim (_cython_blas), the threaded projection
(_linear_kernel), and the softmax/exp of the attention kernel through the public API with
extreme scores."""
import numpy as np
import pytest

import mha_cy
from mha_cy import reference
from mha_cy._cython_blas import BLAS_Trans, _gemm_memview
from mha_cy import _linear_kernel
from mha_cy._linear_kernel import linear

from conftest import DTYPES, RTOL, assert_close, make_pair

NoTrans, Trans = BLAS_Trans.NoTrans, BLAS_Trans.Trans
# A fused def function dispatches a Python float scalar to "double": pick the specialization by
# name, as scikit-learn's test_cython_blas does.
GEMM = {np.float32: _gemm_memview["float"], np.float64: _gemm_memview["double"]}


# -- _cython_blas -----------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("ta", [NoTrans, Trans], ids=["A", "At"])
@pytest.mark.parametrize("tb", [NoTrans, Trans], ids=["B", "Bt"])
@pytest.mark.parametrize("m,n,k", [(1, 1, 1), (3, 5, 7), (17, 4, 33), (64, 65, 2)])
def test_gemm_memview(rng, dtype, ta, tb, m, n, k):
    """C := alpha * op(A).op(B) + beta * C, row-major, against NumPy."""
    A = rng.standard_normal((m, k) if ta == NoTrans else (k, m)).astype(dtype)
    B = rng.standard_normal((k, n) if tb == NoTrans else (n, k)).astype(dtype)
    C = rng.standard_normal((m, n)).astype(dtype)
    opA = A if ta == NoTrans else A.T
    opB = B if tb == NoTrans else B.T
    for alpha, beta in ((1.0, 0.0), (0.5, 2.0), (-1.5, 1.0)):
        out = C.copy()
        GEMM[dtype](ta, tb, alpha, A, B, beta, out)
        expected = alpha * (opA.astype(np.float64) @ opB) + beta * C.astype(np.float64)
        assert_close(out, expected.astype(dtype), dtype, factor=10)


def test_gemm_memview_beta_zero_ignores_nan():
    """beta = 0 overwrites C (BLAS semantics): NaN already in C must not survive."""
    A = np.ones((2, 3), np.float32)
    C = np.full((2, 2), np.nan, np.float32)
    GEMM[np.float32](NoTrans, Trans, 1.0, A, A, 0.0, C)
    np.testing.assert_array_equal(C, 3)


# -- _linear_kernel ---------------------------------------------------------------------------

# linear() cuts the output into near-square tiles whose sizes depend on the shape only (fewer
# for small work: MIN_TILE_FLOPS); up to 8 rows (small_gemm.h), the
# tiles are column blocks computed by src/small_gemm.c in groups of 4 rows x 8, 4 or 1 weight
# rows, 16 lanes at a time (float; 8 for double): the "small" shapes hit every group size and
# remainder. The tests also run with tiny tiles (`many_tiles`) so that small shapes cross tile
# edges in both directions.
SHAPES = {
    "small_1_row": (1, 512, 600),        # M, K, N
    "small_2_rows_k_tail": (2, 1031, 270),
    "small_3_rows": (3, 300, 1000),
    "small_7_rows_k_tail": (7, 517, 520),
    "small_8_rows": (8, 256, 1100),
    "few_rows_small_weight": (4, 16, 40),
    "blas_columns": (40, 24, 300),       # wide N
    "blas_rows": (70, 24, 40),
    "blas_rows_uneven": (33, 7, 100),
    "panel_rows_tail_and_weight_rows_tail": (37, 50, 83),
    "more_rows_than_panels_handle": (300, 40, 70),
    "panel_row_groups": (600, 130, 70),  # packed x > PANEL_X_CACHED_BYTES: row groups + tail
    "tiny": (1, 1, 1),
}


# How linear() may compute: its default rule; tiles of a few hundred flops; BLAS wherever
# small_gemm does not apply; src/row_panel_gemm.c for every row count, with the best
# micro-kernel of this CPU and with the baseline (SSE2) one.
LINEAR_PATHS = {
    "default": {},
    "many_tiles": {"tiling": (200.0, 1000)},
    "blas": {"panel_max_rows": 0},
    "panels": {"panel_max_rows": 1 << 30},
    "panels_baseline_isa": {"panel_max_rows": 1 << 30, "panel_isa": 0},
}


@pytest.fixture(params=list(LINEAR_PATHS), ids=list(LINEAR_PATHS))
def tiling(request):
    """Run a test once per entry of LINEAR_PATHS, restoring the defaults afterwards."""
    setters = {"tiling": _linear_kernel._set_tiling,
               "panel_max_rows": _linear_kernel._set_panel_max_rows,
               "panel_isa": _linear_kernel._set_panel_isa}
    restore = []
    try:
        for name, value in LINEAR_PATHS[request.param].items():
            args = value if isinstance(value, tuple) else (value,)
            previous = setters[name](*args)
            restore.append((setters[name], previous))
        yield request.param
    finally:
        for setter, previous in reversed(restore):
            setter(*(previous if isinstance(previous, tuple) else (previous,)))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m", [1, 5, 15, 16, 17, 40])
@pytest.mark.parametrize("k", [1, 7, 16, 17, 45])
@pytest.mark.parametrize("isa", [2, 1, 0])
def test_pack_row_panels(rng, dtype, m, k, isa):
    """The panels (k-major, the last zero-padded) are x's values, bit for bit, at every ISA
    level's pack (AVX-512: 16 x 16 blocks transposed in registers), from a row stride > k."""
    wide = rng.standard_normal((m, k + 3)).astype(dtype)
    x = wide[:, :k]
    rows = 16 if np.dtype(dtype) == np.float32 else 8     # MHA_PANEL_ROWS_F32 / _F64
    previous = _linear_kernel._set_panel_isa(isa)
    try:
        packed = _linear_kernel._pack_row_panels(x)
    finally:
        _linear_kernel._set_panel_isa(previous)
    panels = -(-m // rows)
    padded = np.zeros((panels * rows, k), dtype)
    padded[:m] = x
    np.testing.assert_array_equal(packed, padded.reshape(panels, rows, k).transpose(0, 2, 1).ravel())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", list(SHAPES.values()), ids=list(SHAPES))
@pytest.mark.parametrize("n_threads", [1, 2, 3])
@pytest.mark.parametrize("with_bias", [False, True])
def test_linear(rng, dtype, shape, n_threads, with_bias, tiling):
    M, K, N = shape
    x = rng.standard_normal((M, K)).astype(dtype)
    w = rng.standard_normal((N, K)).astype(dtype)
    bias = rng.standard_normal(N).astype(dtype) if with_bias else None
    out = np.full((M, N), np.nan, dtype)                # every entry must be written
    res = linear(x, w, bias, out, n_threads)
    assert res is not None
    expected = x.astype(np.float64) @ w.T.astype(np.float64)
    if with_bias:
        expected += bias
    assert_close(out, expected.astype(dtype), dtype, factor=10)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(70, 48, 300), (300, 64, 700), (5, 700, 800), (600, 130, 70)],
                         ids=["blas", "blas_2d_grid", "small_gemm", "panel_row_groups"])
def test_linear_bitwise_same_for_any_thread_count(rng, dtype, shape, tiling):
    """Tiles depend on the shape only, so BLAS rounds every element the same way."""
    M, K, N = shape
    x = rng.standard_normal((M, K)).astype(dtype)
    w = rng.standard_normal((N, K)).astype(dtype)
    b = rng.standard_normal(N).astype(dtype)
    outs = []
    for n in (1, 2, 3, 4, 7):
        out = np.empty((M, N), dtype)
        linear(x, w, b, out, n)
        outs.append(out)
    for out in outs[1:]:
        np.testing.assert_array_equal(out, outs[0])


# (batch, length, K, heads, head_dim): one sequence; a panel straddling two sequences
# (length 37); rows fewer than a panel; a head dim that column tiles cut (80: tiles of 16 x n
# columns) and one of 1; few rows (small_gemm: copied into the heads); K = 0 (bias only)
HEAD_SHAPES = {"one_sequence": (1, 70, 48, 6, 16), "straddling_panels": (3, 37, 40, 5, 8),
               "rows_below_a_panel": (2, 3, 24, 4, 8), "head_dim_80": (2, 20, 33, 3, 80),
               "head_dim_1": (2, 17, 9, 7, 1), "few_rows": (1, 4, 600, 4, 128),
               "k_0": (2, 5, 0, 2, 4), "panel_row_groups": (3, 211, 130, 5, 16)}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", list(HEAD_SHAPES.values()), ids=list(HEAD_SHAPES))
@pytest.mark.parametrize("with_bias", [False, True])
def test_linear_heads_is_linear_split_into_heads_bitwise(rng, dtype, shape, with_bias, tiling):
    """linear_heads writes head by head what linear computes, every bit, for every path and
    thread count; nothing of out is left unwritten (NaN-filled)."""
    B, L, K, H, D = shape
    x = rng.standard_normal((B * L, K)).astype(dtype)
    w = rng.standard_normal((H * D, K)).astype(dtype)
    bias = rng.standard_normal(H * D).astype(dtype) if with_bias else None
    flat = np.empty((B * L, H * D), dtype)
    linear(x, w, bias, flat, 1)
    expected = flat.reshape(B, L, H, D).transpose(0, 2, 1, 3)
    for n in (1, 2, 3):
        out = np.full((B, H, L, D), np.nan, dtype)
        _linear_kernel.linear_heads(x, w, bias, out, n)
        np.testing.assert_array_equal(out, expected)


@pytest.mark.parametrize("dtype", DTYPES)
def test_panel_row_groups_change_no_bit(rng, dtype):
    """Beyond PANEL_X_CACHED_BYTES of packed x the panel tiles are row groups
    (PANEL_X_GROUP_BYTES): each output is still one chain of FMAs, so its rows equal those of
    the same rows computed alone, as one group, bit for bit."""
    M, K, N = 1500, 130, 90
    x = rng.standard_normal((M, K)).astype(dtype)
    w = rng.standard_normal((N, K)).astype(dtype)
    b = rng.standard_normal(N).astype(dtype)
    whole = np.empty((M, N), dtype)
    linear(x, w, b, whole, 2)
    rows = 256 * 1024 // (K * np.dtype(dtype).itemsize) // 16 * 16   # alone: no groups
    for r0 in (0, 480, M - rows):
        part = np.empty((rows, N), dtype)
        linear(np.ascontiguousarray(x[r0:r0 + rows]), w, b, part, 1)
        np.testing.assert_array_equal(whole[r0:r0 + rows], part, err_msg=str(r0))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tail", [1, 4, 8])
def test_half_panels_change_no_bit(rng, dtype, tail):
    """A last panel of at most half its rows runs a half-width micro-kernel (AVX2):
    its rows equal those of the same rows inside a full panel, bit for bit, with or without a
    bias, on 1 and 2 threads, and match the float64 product."""
    K, N = 70, 101
    x = rng.standard_normal((64, K)).astype(dtype)
    w = rng.standard_normal((N, K)).astype(dtype)
    for b in (None, rng.standard_normal(N).astype(dtype)):
        full = np.empty((64, N), dtype)
        linear(x, w, b, full, 1)
        for m in (16 + tail, 48 + tail):            # the rows past m - tail: a half panel
            for threads in (1, 2):
                part = np.empty((m, N), dtype)
                linear(np.ascontiguousarray(x[:m]), w, b, part, threads)
                np.testing.assert_array_equal(part, full[:m], err_msg=f"{m} rows, {threads}")
        expected = x.astype(np.float64) @ w.T.astype(np.float64) + (0 if b is None else b)
        np.testing.assert_allclose(full, expected, rtol=1e-4 if dtype == np.float32 else 1e-12,
                                   atol=1e-4 if dtype == np.float32 else 1e-12)


@pytest.mark.parametrize("dtype", DTYPES)
def test_two_panel_blocks_change_no_bit(rng, dtype):
    """At AVX-512 the micro-kernel runs two panels a register block (a last one alone, or
    with a padded partner): every row equals the same row computed in a call of one panel,
    bit for bit, with or without a bias, on 1 and 2 threads (small_gemm, which would take a
    call of 8 float64 rows, is off)."""
    K, N = 70, 101
    panel = 16 if dtype == np.float32 else 8
    x = rng.standard_normal((5 * panel, K)).astype(dtype)
    w = rng.standard_normal((N, K)).astype(dtype)
    previous = _linear_kernel._set_small_gemm_rule(0, 0)
    try:
        _compare_two_panel_blocks(x, w, rng.standard_normal(N).astype(dtype), panel)
    finally:
        _linear_kernel._set_small_gemm_rule(*previous)


def _compare_two_panel_blocks(x, w, bias, panel):
    N, dtype = len(w), x.dtype
    for b in (None, bias):
        alone = np.empty((len(x), N), dtype)
        for r0 in range(0, len(x), panel):       # each panel in a call of its own
            linear(np.ascontiguousarray(x[r0:r0 + panel]), w, b, alone[r0:r0 + panel], 1)
        for m in (panel + 1, 2 * panel - 1, 2 * panel, 3 * panel, 4 * panel + 3, 5 * panel):
            for threads in (1, 2):
                part = np.empty((m, N), dtype)
                linear(np.ascontiguousarray(x[:m]), w, b, part, threads)
                np.testing.assert_array_equal(part, alone[:m], err_msg=f"{m} rows, {threads}")


def test_linear_heads_rejects_inconsistent_shapes():
    x, w = np.ones((6, 4)), np.ones((8, 4))
    for out in (np.empty((2, 2, 2, 4)), np.empty((2, 4, 3, 4)), np.empty((2, 2, 3, 2))):
        with pytest.raises(ValueError, match="inconsistent shapes"):
            _linear_kernel.linear_heads(x, w, None, out, 1)
    with pytest.raises(ValueError):            # not C-contiguous
        _linear_kernel.linear_heads(x, w, None, np.empty((2, 3, 2, 4)).transpose(0, 2, 1, 3), 1)


@pytest.mark.parametrize("shape", [(128, 768, 2304), (4096, 768, 2304), (4096, 768, 768),
                                   (16, 64, 192), (1, 1, 1), (3, 5, 10 ** 6), (2 ** 33, 8, 8)])
def test_tile_grid_covers_and_is_bounded(shape):
    M, K, N = shape
    rows, cols = _linear_kernel.tile_grid(M, N, K)
    assert 1 <= rows <= M and 1 <= cols <= N
    assert (cols == N or cols % 16 == 0) and (rows == M or rows % 8 == 0)
    assert rows <= 2 ** 20 and cols <= 2 ** 20          # BLAS's 32-bit sizes, whatever M
    n_tiles = -(-M // rows) * -(-N // cols)
    flops = 2.0 * M * N * K
    target = max(1, min(64, flops / 16e6))
    assert target / 2 - 1 <= n_tiles <= 2 * target + 2 or rows == 2 ** 20      # near the target count


@pytest.mark.parametrize("shape", [(12, 384, 1152), (32, 384, 384), (64, 384, 1152)],
                         ids=["minilm_qkv_12_tokens", "minilm_out_32_tokens", "minilm_qkv_64"])
def test_column_tiles_share_mid_size_products_evenly(shape):
    """The panel path's tiles of a MiniLM-size projection are many enough (>= 8) that 2 or 3
    threads taking them dynamically finish within an eighth of each other (3 tiles of 12 x 384
    -> 1152 ran 1.5x one thread on 2), and at least 16 columns wide."""
    M, K, N = shape
    rows, cols = _linear_kernel.tile_grid(M, N, K, True)
    assert rows == M and cols % 16 == 0 and cols >= 16
    assert -(-N // cols) >= 8


@pytest.mark.parametrize("shape,min_cols", [((32, 384, 1152), 1), ((12, 384, 1152), 1),
                                            ((128, 768, 2304), 64), ((4, 256, 768), 1),
                                            ((4, 4096, 6144), 1), ((4096, 768, 2304), 64),
                                            ((5, 7, 100), 1), ((300, 64, 47), 1),
                                            ((16, 50000, 20), 0)])
def test_column_tiles_hold_whole_register_blocks(shape, min_cols):
    """Column tiles of the paths without BLAS are multiples of 48 columns (or all of them), so
    that no tile ends in a narrow register block of the micro-kernels (6 or 8 weight rows of
    the panels, 8/6/4/3 of small_gemm), and at least min_cols wide. min_cols is 0 for the
    panels when a weight row alone outgrows PANEL_TILE_WEIGHT_BYTES: never a tile of 0."""
    M, K, N = shape
    rows, cols = _linear_kernel.tile_grid(M, N, K, True, min_cols)
    assert 1 <= cols and (cols == N or (cols % 48 == 0 and cols >= min_cols))


@pytest.mark.parametrize("dtype", DTYPES)
def test_linear_with_rows_wider_than_a_panel_tile(rng, dtype):
    """K so large that one weight row outgrows PANEL_TILE_WEIGHT_BYTES (the panels' min_cols
    is 0) and few output columns: the column tiles stay at least one column wide (rounded to
    0 they once divided by zero)."""
    M, K, N = 16, 50000, 20
    x = rng.standard_normal((M, K)).astype(dtype)
    w = rng.standard_normal((N, K)).astype(dtype)
    for threads in (1, 2):
        out = np.empty((M, N), dtype)
        linear(x, w, None, out, threads)
        np.testing.assert_allclose(out, x.astype(np.float64) @ w.T.astype(np.float64),
                                   rtol=1e-4 if dtype == np.float32 else 1e-12,
                                   atol=1e-2 if dtype == np.float32 else 1e-10)


def test_linear_rejects_inconsistent_shapes():
    x, w = np.ones((3, 4)), np.ones((5, 4))
    with pytest.raises(ValueError, match="inconsistent shapes"):
        linear(x, w, None, np.empty((3, 6)), 1)
    with pytest.raises(ValueError, match="bias"):
        linear(x, w, np.ones(4), np.empty((3, 5)), 1)


# -- softmax / exp with extreme scores ---------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("q_scale", [1e-6, 1.0, 30.0, 1e3])
@pytest.mark.parametrize("q_len,k_len", [(1, 600), (70, 300)])
def test_extreme_logits(rng, dtype, q_scale, q_len, k_len):
    """Very large / small logits: the softmax is shift-invariant, so no overflow, no NaN."""
    q = (rng.standard_normal((2, 4, q_len, 16)) * q_scale).astype(dtype)
    k = rng.standard_normal((2, 2, k_len, 16)).astype(dtype)
    v = rng.standard_normal((2, 2, k_len, 16)).astype(dtype)
    out = mha_cy.scaled_dot_product_attention(q, k, v, is_causal=True)
    expected = reference.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert np.isfinite(out).all()
    # logits of size 1e3 * |q||k| amplify the rounding of the scores themselves: the scores
    # are the same products in another summation order, so allow a tolerance that grows with
    # the logit size (in float32 a score of 1e4 is only known to ~1e-3)
    factor = 1.0 if q_scale <= 1 else q_scale * 50
    assert_close(out, expected, dtype, factor=factor)
    # a convex combination of the rows of v
    assert (np.abs(out) <= np.abs(v).max(axis=2, keepdims=True).max(axis=1)[:, None] * 1.0001
            ).all()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("big", [-np.inf, -1e30, -1e4, np.finfo(np.float32).min])
def test_extreme_additive_masks(rng, dtype, big):
    """-inf, -1e30, the most negative float32: masked keys get weight 0, fully masked rows
    give zeros for -inf and a uniform average for finite values (as the reference does)."""
    q_len, k_len = 70, 520
    q = rng.standard_normal((2, 4, q_len, 16)).astype(dtype)
    k = rng.standard_normal((2, 2, k_len, 16)).astype(dtype)
    v = rng.standard_normal((2, 2, k_len, 16)).astype(dtype)
    mask = np.where(rng.random((2, 1, q_len, k_len)) < 0.5, big, 0.0)
    mask[0, 0, 3] = big                              # a fully masked row
    mask[1, 0, :, :300] = big                        # whole leading key tiles masked
    for is_causal in (False, True):
        out = mha_cy.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal)
        expected = reference.scaled_dot_product_attention(q, k, v, attn_mask=mask,
                                                          is_causal=is_causal)
        assert np.isfinite(expected).all()
        assert_close(out, expected, dtype)
    if big == -np.inf:
        np.testing.assert_array_equal(out[0, :, 3], 0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_extreme_values_through_the_module(rng, dtype):
    """Large inputs through MultiHeadAttention with -inf/-1e30 masks and weights."""
    fast, ref = make_pair(rng, 16, 4, dtype, num_kv_heads=2)
    x = (rng.standard_normal((2, 300, 16)) * 30).astype(dtype)
    mask = np.where(rng.random((300, 300)) < 0.3, -1e30, 0.0)
    mask[5] = -np.inf
    out, w = fast(x, attn_mask=mask, is_causal=True, need_weights=True)
    out_r, w_r = ref(x, attn_mask=mask, is_causal=True, need_weights=True)
    assert np.isfinite(out).all() and np.isfinite(w).all()
    np.testing.assert_array_equal(w[:, :, 5], 0)
    scale = np.abs(out_r).max()
    tol = 200 * RTOL[dtype]
    np.testing.assert_allclose(out, out_r, rtol=tol, atol=tol * scale)
    np.testing.assert_allclose(w, w_r, rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", DTYPES)
def test_softmax_precision_of_the_vectorized_exp(rng, dtype):
    """Scores spread over the whole useful exp range: weights are exact to a few ulps."""
    k_len = 700
    # scores s_j = q . k_j: make q a unit vector and k_j = t_j * q with t_j spread in [-80, 0]
    q = np.zeros((1, 1, 1, 4), dtype)
    q[..., 0] = 1
    t = np.linspace(-80, 0, k_len) if dtype == np.float32 else np.linspace(-700, 0, k_len)
    k = np.zeros((1, 1, k_len, 4), dtype)
    k[0, 0, :, 0] = t
    t = k[0, 0, :, 0].astype(np.float64)                  # the scores the kernel sees, exactly
    v = np.eye(k_len, dtype=dtype)[None, None]            # the output is the weights row
    out = mha_cy.scaled_dot_product_attention(q, k, v, scale=1.0)
    expected = np.exp(t - t.max()) / np.exp(t - t.max()).sum()
    big = expected > np.finfo(dtype).tiny * 1e3
    np.testing.assert_allclose(out[0, 0, 0][big], expected[big], rtol=8 * np.finfo(dtype).eps)
    assert (out[0, 0, 0][~big] <= np.finfo(dtype).tiny * 1e4).all()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kernel", ["fused", "blas"])
def test_equal_scores_get_equal_weights_in_every_lane(rng, dtype, kernel):
    """The softmax's exp runs on vectors, several at a time, and the last n % lanes scores on
    scalars: equal scores in one tile must get bitwise equal weights wherever they land."""
    from mha_cy import _attention_kernel
    k_len = 63                              # one tile; vectors of 8 / 4 lanes and a tail
    base = rng.uniform(-30, 0, 13)
    t = base[np.arange(k_len) % 13]         # every score repeats at other lanes and the tail
    q = np.zeros((1, 1, 1, 4), dtype)
    q[..., 0] = 1
    k = np.zeros((1, 1, k_len, 4), dtype)
    k[0, 0, :, 0] = t                       # scores q . k_j = t_j exactly
    v = np.eye(k_len, dtype=dtype)[None, None]
    previous = _attention_kernel._set_tile_kernel(kernel)
    try:
        w = mha_cy.scaled_dot_product_attention(q, k, v, scale=1.0)[0, 0, 0]
    finally:
        _attention_kernel._set_tile_kernel(previous)
    bits = w.view(np.uint32 if dtype == np.float32 else np.uint64)
    for r in range(13):
        assert (bits[r::13] == bits[r]).all(), r
    np.testing.assert_allclose(w.sum(), 1, rtol=10 * np.finfo(dtype).eps)


# -- tile sizes ---------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_q,block_k", [(1, 1), (3, 7), (64, 64), (512, 1024)])
@pytest.mark.parametrize("q_len", [70, 1])        # many query rows; one (GQA decode tasks)
def test_results_do_not_depend_on_the_tile_sizes(rng, dtype, block_q, block_k, q_len):
    """Every tiling of queries and keys (down to 1 x 1) gives the reference's answer, with
    masks, padding at both ends, causal and the weights path."""
    from mha_cy import _attention_kernel
    fast, ref = make_pair(rng, 32, 4, dtype, num_kv_heads=2)
    keys = rng.standard_normal((2, 70, 32))
    query = keys[:, -q_len:]
    pad = np.zeros((2, 70), bool)
    pad[0, :5] = pad[0, 60:] = pad[1, 30:40] = True
    mask = rng.standard_normal((2, 4, q_len, 70))
    previous = _attention_kernel._set_tile_sizes(block_q, block_k)
    try:
        for kwargs in (dict(is_causal=True, key_padding_mask=pad), dict(attn_mask=mask)):
            out, weights = fast(query, keys, need_weights=True, **kwargs)
            expected, expected_weights = ref(query, keys, need_weights=True, **kwargs)
            assert_close(out, expected, dtype, factor=2)
            assert_close(weights, expected_weights, dtype, factor=2)
            assert_close(fast(query, keys, **kwargs), expected, dtype, factor=2)
    finally:
        _attention_kernel._set_tile_sizes(*previous)
