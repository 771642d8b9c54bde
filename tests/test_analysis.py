"""mha_cy.analysis: head_stats and rank_heads against NumPy formulas written out here."""
import numpy as np
import pytest

import mha_cy
from mha_cy import analysis, reference

from conftest import DTYPES, assert_close, make_pair, random_padding


def random_weights(rng, shape, zero_rows=()):
    """Softmax rows (B, H, Lq, Lk), some entries exactly 0, some rows all 0 (masked)."""
    w = rng.random(shape) ** 3
    w[rng.random(shape) < 0.2] = 0
    w /= np.maximum(w.sum(axis=-1, keepdims=True), 1e-300)
    for index in zero_rows:
        w[index] = 0
    return w


def stats_by_loops(w, valid=None):
    """The definitions, one query row at a time."""
    batch, heads, q_len, k_len = w.shape
    out = {name: np.zeros((batch, heads)) for name in ("entropy", "mean_distance", "max_weight")}
    for b in range(batch):
        rows = [i for i in range(q_len) if valid is None or valid[b, i]]
        for h in range(heads):
            ent, dist, mx = [], [], []
            for i in rows:
                p = w[b, h, i]
                ent.append(-sum(x * np.log(x) for x in p if x > 0))
                dist.append(sum(p[j] * abs(i + (k_len - q_len) - j) for j in range(k_len)))
                mx.append(p.max())
            for name, values in (("entropy", ent), ("mean_distance", dist), ("max_weight", mx)):
                out[name][b, h] = np.mean(values) if values else np.nan
    return out


@pytest.mark.parametrize("shape", [(2, 3, 5, 5), (1, 2, 1, 7), (2, 2, 3, 6)])
def test_head_stats_match_the_definitions(rng, shape):
    w = random_weights(rng, shape, zero_rows=[(0, 0, 0)])
    stats = analysis.head_stats(w)
    expected = stats_by_loops(w)
    for name in ("entropy", "mean_distance", "max_weight"):
        assert stats[name].shape == shape[:2] and stats[name].dtype == np.float64
        np.testing.assert_allclose(stats[name], expected[name], rtol=1e-12, atol=1e-14,
                                   err_msg=name)
    assert stats["top_key"].shape == shape[:3]
    np.testing.assert_array_equal(stats["top_key"], w.argmax(axis=-1))


def test_head_stats_known_values():
    """Uniform rows: entropy log(Lk); one-hot on the diagonal: entropy 0, distance 0."""
    uniform = np.full((1, 1, 4, 4), 0.25)
    s = analysis.head_stats(uniform)
    np.testing.assert_allclose(s["entropy"], [[np.log(4)]])
    np.testing.assert_allclose(s["max_weight"], [[0.25]])
    np.testing.assert_allclose(s["mean_distance"], [[np.mean([1.5, 1.0, 1.0, 1.5])]])
    diagonal = np.eye(4)[None, None]
    s = analysis.head_stats(diagonal)
    assert s["entropy"][0, 0] == 0 and s["mean_distance"][0, 0] == 0
    np.testing.assert_array_equal(s["top_key"][0, 0], np.arange(4))
    previous = np.eye(4, k=-1)[None, None]            # each query looks one token back
    previous[0, 0, 0, 0] = 1
    np.testing.assert_allclose(analysis.head_stats(previous)["mean_distance"], [[0.75]])


def test_head_stats_with_key_padding(rng):
    w = random_weights(rng, (3, 2, 6, 6))
    pad = random_padding(rng, 3, 6)
    pad[2] = True                                     # a sequence that is all padding
    stats = analysis.head_stats(w, key_padding_mask=pad)
    expected = stats_by_loops(w, valid=~pad)
    for name in ("entropy", "mean_distance", "max_weight"):
        np.testing.assert_allclose(stats[name], expected[name], rtol=1e-12, err_msg=name)
        assert np.isnan(stats[name][2]).all()
    np.testing.assert_array_equal(stats["top_key"], w.argmax(axis=-1))


def test_head_stats_of_a_module_unbatched(rng):
    fast, _ = make_pair(rng, 32, 4, np.float32)
    x = rng.standard_normal((9, 32)).astype(np.float32)
    _, w = fast(x, need_weights=True)                 # (H, Lq, Lk): unbatched
    stats = analysis.head_stats(w)
    assert stats["entropy"].shape == (4,) and stats["top_key"].shape == (4, 9)
    batched = analysis.head_stats(w[None].astype(np.float64))
    for name, value in stats.items():
        np.testing.assert_allclose(value, batched[name][0], rtol=1e-12)
    assert (stats["entropy"] <= np.log(9) + 1e-6).all()


def test_head_stats_errors(rng):
    w = random_weights(rng, (2, 2, 4, 4))
    with pytest.raises(ValueError, match=r"weights must be 3-D or 4-D .* got shape \(4, 4\)"):
        analysis.head_stats(w[0, 0])
    with pytest.raises(ValueError, match=r"key_padding_mask must have shape \(2, 4\) .* "
                                         r"got \(2, 5\)"):
        analysis.head_stats(w, key_padding_mask=np.zeros((2, 5), bool))
    with pytest.raises(TypeError, match="key_padding_mask must be a bool array"):
        analysis.head_stats(w, key_padding_mask=np.zeros((2, 4)))
    with pytest.raises(ValueError, match="query_len 4, key_len 6"):
        analysis.head_stats(random_weights(rng, (2, 2, 4, 6)),
                            key_padding_mask=np.zeros((2, 6), bool))
    with pytest.raises(ValueError, match="no keys"):
        analysis.head_stats(np.zeros((1, 1, 2, 0)))


def rank_by_formula(mha, x, **kwargs):
    """||out - out without head h|| / ||out||, one call per head with the reference."""
    ref = reference.MultiHeadAttention.from_weights(
        mha.q_weight, mha.k_weight, mha.v_weight, mha.out_weight, num_heads=mha.num_heads,
        num_kv_heads=mha.num_kv_heads, q_bias=mha.q_bias, k_bias=mha.k_bias,
        v_bias=mha.v_bias, out_bias=mha.out_bias, dtype=np.float64)
    full = ref(x, **kwargs)
    scores = []
    for h in range(mha.num_heads):
        mask = np.ones(mha.num_heads)
        mask[h] = 0
        scores.append(np.linalg.norm(ref(x, head_mask=mask, **kwargs) - full)
                      / np.linalg.norm(full))
    return np.array(scores)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rank_heads_matches_the_formula(rng, dtype):
    fast, _ = make_pair(rng, 48, 6, dtype, num_kv_heads=3)
    # make head 4 matter little: its columns of W_O are tiny
    fast.out_weight[:, 4 * 8:5 * 8] *= 1e-3
    x = rng.standard_normal((2, 7, 48))
    pad = random_padding(rng, 2, 7)
    heads, scores = analysis.rank_heads(fast, x, key_padding_mask=pad, is_causal=True)
    expected = rank_by_formula(fast, x, key_padding_mask=pad, is_causal=True)
    assert sorted(heads.tolist()) == list(range(6)) and heads[-1] == 4
    assert (np.diff(scores) <= 0).all()
    tol = 1e-4 if dtype == np.float32 else 1e-10
    np.testing.assert_allclose(scores, expected[heads], rtol=tol)


def test_rank_heads_cross_attention_and_per_sequence_masks(rng):
    fast, _ = make_pair(rng, 32, 4, np.float64, kdim=12, vdim=12)
    x, k = rng.standard_normal((3, 5, 32)), rng.standard_normal((3, 6, 12))
    attn_mask = rng.random((3, 5, 6)) < 0.7
    attn_mask[..., 0] = True
    heads, scores = analysis.rank_heads(fast, x, k, attn_mask=attn_mask)
    expected = rank_by_formula(fast, x, key=k, attn_mask=attn_mask)
    np.testing.assert_allclose(scores, expected[heads], rtol=1e-10)
    # unbatched input: the same as a batch of one
    h1, s1 = analysis.rank_heads(fast, x[0], k[0], attn_mask=attn_mask[0])
    h2, s2 = analysis.rank_heads(fast, x[:1], k[:1], attn_mask=attn_mask[:1])
    np.testing.assert_array_equal(h1, h2)
    np.testing.assert_allclose(s1, s2, rtol=1e-12)


def test_rank_heads_of_a_pruned_module(rng):
    fast, _ = make_pair(rng, 64, 8, np.float64, num_kv_heads=2)
    small = fast.prune_heads([1, 5, 6])
    x = rng.standard_normal((1, 6, 64))
    heads, scores = analysis.rank_heads(small, x)
    assert sorted(heads.tolist()) == list(range(5))
    # the formula with the pruned module's own head_mask
    full = small(x)
    for h, score in zip(heads, scores):
        mask = np.ones(5)
        mask[h] = 0
        assert_close(score, np.linalg.norm(small(x, head_mask=mask) - full)
                     / np.linalg.norm(full))


def test_analysis_is_reachable_from_the_package():
    assert mha_cy.analysis.head_stats is analysis.head_stats


def test_messages_name_what_the_user_passed(rng):
    """rank_heads named the shape it tiled internally ((5, 1, 7, 16) for a 2-D query with a
    3-D key) and head_stats spoke of a batch the unbatched weights do not have."""
    mha = mha_cy.MultiHeadAttention(16, 4, seed=0)
    x = rng.standard_normal((7, 16)).astype(np.float32)
    with pytest.raises(ValueError, match=r"key must be 2-D like query; got shape \(1, 7, 16\)"):
        analysis.rank_heads(mha, x, x[None])
    with pytest.raises(ValueError, match=r"value must be 3-D like query; got shape \(7, 16\)"):
        analysis.rank_heads(mha, x[None], x[None], x)
    with pytest.raises(ValueError, match=r"\(5,\) \(key_len: the weights are unbatched\)"):
        analysis.head_stats(np.full((4, 5, 5), 0.2), key_padding_mask=np.zeros((1, 5), bool))
