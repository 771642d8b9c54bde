"""Adversarial pass through the public API: odd layouts and dtypes on the fast paths, masks of
every form, cache steps with failing calls in between, zero sizes, weight edits, threads."""
import copy
import io
import itertools
import pickle
import threading

import numpy as np
import pytest

import mha_cy
from mha_cy import analysis
from mha_cy import reference as R

TOL = {np.dtype(np.float32): 1e-5, np.dtype(np.float64): 1e-12}
FMT_TOL = {None: 1e-5, np.float16: 1e-5, "int8": 2e-4}     # against the reference's cache


def close(actual, expected, tol=None, msg=""):
    """Same shape and dtype; equal within tol * max |expected| (NaN where expected is NaN)."""
    actual, expected = np.asarray(actual), np.asarray(expected)
    assert actual.shape == expected.shape, (msg, actual.shape, expected.shape)
    assert actual.dtype == expected.dtype, (msg, actual.dtype, expected.dtype)
    tol = TOL[expected.dtype] if tol is None else tol
    finite = np.isfinite(expected)
    scale = float(np.abs(expected[finite]).max(initial=0.0))
    np.testing.assert_allclose(actual, expected, rtol=0, atol=tol * max(scale, 1e-30),
                               equal_nan=True, err_msg=str(msg))


def pair(seed=1, **kw):
    return (mha_cy.MultiHeadAttention(**kw, seed=seed), R.MultiHeadAttention(**kw, seed=seed))


def odd_layouts(x):
    """x (float32, 3-D) in layouts and dtypes the fast paths must copy or convert."""
    ro = x.copy()
    ro.setflags(write=False)
    raw = np.zeros(x.size * 4 + 1, np.uint8)[1:].view(np.float32).reshape(x.shape)
    raw[...] = x                                  # unaligned
    return {"negative": x[:, ::-1], "fortran": np.asfortranarray(x),
            "strided": np.repeat(x, 2, axis=2)[:, :, ::2], "read_only": ro,
            "broadcast": np.broadcast_to(x[:1], x.shape), "big_endian": x.astype(">f4"),
            "float16": x.astype(np.float16), "int": (3 * x).astype(np.int32),
            "bool": x > 0, "float64": x.astype(np.float64), "unaligned": raw}


@pytest.mark.parametrize("layout", list(odd_layouts(np.zeros((1, 1, 1), np.float32))))
@pytest.mark.parametrize("causal", [False, True])
def test_self_attention_fast_path_takes_any_layout(rng, layout, causal):
    m, r = pair(embed_dim=16, num_heads=4, num_kv_heads=2)
    x = odd_layouts(rng.standard_normal((2, 5, 16)).astype(np.float32))[layout]
    close(m(x, is_causal=causal), r(x, is_causal=causal), msg=layout)


def _mask_variants(rng, B, H, L):
    kpm = rng.random((B, L)) < 0.3
    kpm[:, 0] = False
    am = rng.standard_normal((L, L)).astype(np.float32)
    return {
        "kpm_negative": dict(key_padding_mask=kpm[:, ::-1]),
        "kpm_fortran": dict(key_padding_mask=np.asfortranarray(kpm)),
        "kpm_list": dict(key_padding_mask=kpm.tolist()),
        "add_negative": dict(attn_mask=am[::-1, ::-1]),
        "add_fortran": dict(attn_mask=np.asfortranarray(am)),
        "add_big_endian": dict(attn_mask=am.astype(">f4")),
        "add_float64": dict(attn_mask=am.astype(np.float64)),
        "add_float16": dict(attn_mask=am.astype(np.float16)),
        "add_read_only_4d": dict(attn_mask=np.broadcast_to(am, (B, 1, L, L))),
        "add_stride0_rows": dict(attn_mask=np.broadcast_to(am[:1], (L, L))),
        "add_key_axis_1": dict(attn_mask=am[:, :1]),
        "add_minus_inf": dict(attn_mask=np.where(am > 1, -np.inf, am)),
        "bool_negative": dict(attn_mask=(am > -0.5)[::-1]),
        "bool_fortran_4d": dict(attn_mask=np.asfortranarray(
            np.broadcast_to(am > -0.5, (B, H, L, L)))),
        "bool_list": dict(attn_mask=(am > -0.5).tolist()),
        "bool_all_false_row": dict(attn_mask=np.broadcast_to(
            np.arange(L)[:, None] > 0, (L, L))),
        "both": dict(attn_mask=am[::-1], key_padding_mask=kpm[:, ::-1]),
    }


@pytest.mark.parametrize("causal", [False, True])
def test_masks_of_every_form_on_every_path(rng, causal):
    B, H, L = 2, 4, 5
    m, r = pair(embed_dim=16, num_heads=H, num_kv_heads=2)
    x = rng.standard_normal((B, L, 16)).astype(np.float32)
    for name, kw in _mask_variants(rng, B, H, L).items():
        expected, weights = r(x, is_causal=causal, need_weights=True, **kw)
        close(m(x, is_causal=causal, **kw), expected, msg=name)              # compiled call
        out, w = m(x, is_causal=causal, need_weights=True, **kw)            # general path
        close(out, expected, msg=name)
        close(w, weights, msg=name)


@pytest.mark.parametrize("kw, exc, match", [
    (dict(key_padding_mask=np.zeros((2, 5), np.float32)), TypeError, "key_padding_mask.*float32"),
    (dict(key_padding_mask=np.zeros((2, 5), np.int64)), TypeError, "key_padding_mask.*int64"),
    (dict(attn_mask=np.ones((5, 5), np.int32)), TypeError, "attn_mask.*int32"),
    (dict(attn_mask=np.ones((5, 5), np.uint8)), TypeError, "attn_mask.*uint8"),
    (dict(attn_mask=np.ones((5, 5), np.complex64)), TypeError, "attn_mask.*complex64"),
    (dict(key_padding_mask=np.zeros((2, 3), bool)), ValueError, r"\(2, 5\); got \(2, 3\)"),
    (dict(attn_mask=np.ones((3, 5), bool)), ValueError, r"shape \(3, 5\).*\(5, 5\)"),
])
def test_wrong_masks_on_the_fast_path_raise_naming_them(kw, exc, match):
    m = mha_cy.MultiHeadAttention(16, 4, seed=0)
    with pytest.raises(exc, match=match):
        m(np.ones((2, 5, 16), np.float32), **kw)


@pytest.mark.parametrize("fmt", [None, np.float16, "int8"])
def test_steps_of_odd_layouts_and_failed_calls_in_between(rng, fmt):
    """GQA + interleaved partial RoPE + window: a prefill, steps of odd layouts, a failed call
    of every kind after each step (cache bitwise unchanged), pickled/deep-copied state."""
    kw = dict(embed_dim=16, num_heads=4, num_kv_heads=2,
              rope=mha_cy.RoPE(dim=2, interleaved=True), window=3)
    m, r = pair(**kw)
    B = 2
    x = rng.standard_normal((B, 9, 16)).astype(np.float32)
    c, rc = m.new_cache(B, 12, dtype=fmt), r.new_cache(B, 12, dtype=fmt)
    got, want = [m(x[:, :4], cache=c)], [r(x[:, :4], cache=rc)]
    steps = [x[:, 4:5][:, ::-1], np.asfortranarray(x[:, 5:6]),
             np.broadcast_to(x[:, 6:7], (B, 1, 16)), x[:, 7:8].astype(np.float64),
             x[:, 8:9].astype(">f4")]
    one = x[:, :1]
    bad_calls = [dict(query=x[:, :1, :8]), dict(query=one, positions=np.array([1, 2])),
                 dict(query=one, head_mask=np.ones(3)),
                 dict(query=one, attn_mask=np.ones((2, 2), bool)),
                 dict(query=one, key_padding_mask=np.zeros((B, 3), bool)),
                 dict(query=x[:1, :1]), dict(query=x[:, :9]), dict(query=one, lengths=[1, 2]),
                 dict(query=one, is_causal=1), dict(query=one.astype(np.complex64)),
                 dict(query=one, key=one), dict(query=one, lengths=[1.0, 1.0])]
    for step in steps:
        got.append(m(step, cache=c))
        want.append(r(step, cache=rc))
        state = (c.lengths, c.key.copy(), c.value.copy())
        for bad in bad_calls:
            bad = dict(bad)
            with pytest.raises((ValueError, TypeError)):
                m(bad.pop("query"), cache=c, **bad)
            assert np.array_equal(c.lengths, state[0]), bad
            assert np.array_equal(c.key, state[1], equal_nan=True), bad
            assert np.array_equal(c.value, state[2], equal_nan=True), bad
    close(np.concatenate(got, 1), np.concatenate(want, 1), FMT_TOL[fmt])
    if fmt is None:                     # steps == one causal pass
        close(np.concatenate(got, 1), r(x, is_causal=True))
    z = rng.standard_normal((B, 1, 16)).astype(np.float32)
    expected = m(z, cache=c.copy())
    for mm, cc in ((pickle.loads(pickle.dumps(m)), pickle.loads(pickle.dumps(c, protocol=5))),
                   (copy.deepcopy(m), copy.deepcopy(c))):
        assert cc.key.flags.writeable
        assert np.array_equal(mm(z, cache=cc), expected)


@pytest.mark.parametrize("cfg", [
    dict(embed_dim=32, num_heads=512, num_kv_heads=1, head_dim=1),
    dict(embed_dim=16, num_heads=256, num_kv_heads=8, head_dim=2),
    dict(embed_dim=8, num_heads=9, num_kv_heads=3, head_dim=300),
    dict(embed_dim=6, num_heads=3, head_dim=258, rope=mha_cy.RoPE(dim=256)),
])
def test_extreme_head_shapes_ragged_prefill_then_steps(rng, cfg):
    m, r = pair(seed=2, **cfg)
    x = rng.standard_normal((2, 12, cfg["embed_dim"])).astype(np.float32)
    close(m(x, is_causal=True), r(x, is_causal=True))
    kpm = np.zeros((2, 12), bool)
    kpm[0, 3:] = kpm[1, 0] = True
    out, w = m(x, is_causal=True, key_padding_mask=kpm, need_weights=True)
    ro, rw = r(x, is_causal=True, key_padding_mask=kpm, need_weights=True)
    close(out, ro)
    close(w, rw)
    for fmt in FMT_TOL:
        c, rc = m.new_cache(2, 14, dtype=fmt), r.new_cache(2, 14, dtype=fmt)
        got = [m(x[:, :9], cache=c, lengths=[9, 4])]
        want = [r(x[:, :9], cache=rc, lengths=[9, 4])]
        for i in range(9, 12):
            got.append(m(x[:, i:i + 1], cache=c))
            want.append(r(x[:, i:i + 1], cache=rc))
        close(np.concatenate(got, 1), np.concatenate(want, 1), FMT_TOL[fmt], msg=fmt)


def test_in_place_edits_of_every_weight_reach_every_path(rng):
    m, r = pair(seed=3, embed_dim=16, num_heads=4, num_kv_heads=2, rope=mha_cy.RoPE())
    x = rng.standard_normal((2, 6, 16)).astype(np.float32)
    no_pad = np.zeros((2, 6), bool)
    for name in ("q_weight", "k_weight", "v_weight", "out_weight",
                 "q_bias", "k_bias", "v_bias", "out_bias"):
        delta = rng.standard_normal(getattr(m, name).shape)
        getattr(m, name)[...] += delta
        getattr(r, name)[...] += delta
        close(m(x), r(x), msg=name)
        close(m(x, is_causal=True), r(x, is_causal=True), msg=name)
        close(m(x, key_padding_mask=no_pad), r(x, key_padding_mask=no_pad), msg=name)
        close(m(x, need_weights=True)[1], r(x, need_weights=True)[1], msg=name)
        c, rc = m.new_cache(2, 8), r.new_cache(2, 8)
        close(m(x, cache=c), r(x, cache=rc), msg=name)
        close(m(x[:, :1], cache=c), r(x[:, :1], cache=rc), msg=name)


def test_sdpa_argument_grid_matches_the_reference(rng):
    grid = itertools.product(
        (np.float32, np.float64), ((4, 4), (4, 2), (3, 1)), ((1, 1), (1, 7), (5, 5), (7, 3),
                                                            (2, 0)),
        (1, 5), (None, 0.0, -0.7), (None, 2), (False, True),
        (None, "bool2", "add3", "pad", "bool4h", "all_false"))
    for dt, (Hq, Hkv), (Lq, Lk), D, scale, window, causal, kind in grid:
        if window is not None and not causal:
            continue
        B = 2
        q = rng.standard_normal((B, Hq, Lq, D)).astype(dt)
        k = rng.standard_normal((B, Hkv, Lk, D)).astype(dt)
        v = rng.standard_normal((B, Hkv, Lk, 3)).astype(dt)
        mask = {None: None, "bool2": rng.random((Lq, Lk)) < 0.7,
                "add3": np.where(rng.random((B, Lq, Lk)) < 0.2, -np.inf,
                                 rng.standard_normal((B, Lq, Lk))),
                "pad": rng.random((B, 1, 1, Lk)) < 0.7, "bool4h": rng.random((1, Hq, Lq, Lk)) < 0.6,
                "all_false": np.zeros((B, 1, 1, Lk), bool)}[kind]
        args = dict(attn_mask=mask, is_causal=causal, scale=scale, window=window)
        close(mha_cy.scaled_dot_product_attention(q, k, v, **args),
              R.scaled_dot_product_attention(q, k, v, **args),
              msg=(dt, Hq, Hkv, Lq, Lk, D, scale, window, causal, kind))


def test_sdpa_odd_operands_and_extreme_scales(rng):
    q = rng.standard_normal((2, 4, 5, 8)).astype(np.float32)
    k = rng.standard_normal((2, 2, 6, 8)).astype(np.float32)
    v = rng.standard_normal((2, 2, 6, 8)).astype(np.float32)
    for name in odd_layouts(q):
        ops = [odd_layouts(a)[name] for a in (q.reshape(8, 5, 8), k.reshape(4, 6, 8),
                                             v.reshape(4, 6, 8))]
        ops = [a.reshape(b.shape) for a, b in zip(ops, (q, k, v))]
        for kw in (dict(), dict(is_causal=True), dict(is_causal=True, window=2, scale=0.3)):
            close(mha_cy.scaled_dot_product_attention(*ops, **kw),
                  R.scaled_dot_product_attention(*ops, **kw), msg=(name, kw))
    with np.errstate(all="ignore"):
        for scale, dt in itertools.product((1e30, -1e30, 1e-40, 5e-324), (np.float32, np.float64)):
            ops = [a.astype(dt) for a in (q, k, v)]
            close(mha_cy.scaled_dot_product_attention(*ops, scale=scale, is_causal=True),
                  R.scaled_dot_product_attention(*ops, scale=scale, is_causal=True),
                  msg=(scale, dt))


@pytest.mark.parametrize("cfg", [
    dict(embed_dim=16, num_heads=4, num_kv_heads=2, rope=mha_cy.RoPE()),
    dict(embed_dim=16, num_heads=4, window=2), dict(embed_dim=16, num_heads=4, bias=False)])
@pytest.mark.parametrize("B, L", [(0, 5), (2, 0), (0, 0), (1, 1)])
def test_zero_sizes_with_weights_masks_and_caches(rng, cfg, B, L):
    m, r = pair(seed=3, **cfg)
    x = rng.standard_normal((B, L, 16)).astype(np.float32)
    for kw in (dict(need_weights=True, is_causal=True),
               dict(is_causal=True, key_padding_mask=np.ones((B, L), bool), need_weights=True)):
        (o, w), (ro, rw) = m(x, **kw), r(x, **kw)
        close(o, ro)
        close(w, rw)
    if B == 0:
        return
    c, rc = m.new_cache(B, 4), r.new_cache(B, 4)
    (o, w), (ro, rw) = m(x, cache=c, need_weights=True), r(x, cache=rc, need_weights=True)
    close(o, ro)
    close(w, rw)
    two = rng.standard_normal((B, 2, 16)).astype(np.float32)
    close(m(two, cache=c), r(two, cache=rc))
    empty = np.zeros((B, 0, 16), np.float32)
    (o, w), (ro, rw) = m(empty, cache=c, need_weights=True), r(empty, cache=rc, need_weights=True)
    close(o, ro)
    close(w, rw)
    assert c.length == rc.length == L + 2
    one = np.ones((B, 1, 16), np.float32)
    (o, w) = m(one, cache=c, lengths=[0] * B, need_weights=True)
    (ro, rw) = r(one, cache=rc, lengths=[0] * B, need_weights=True)
    close(o, ro)
    close(w, rw)
    assert not o.any() and c.length == L + 2


@pytest.mark.parametrize("layout", ["fortran", "negative", "read_only", "big_endian",
                                    "float32", "float16"])
def test_from_weights_of_odd_layouts(rng, layout):
    E, H, Hkv, D = 12, 4, 2, 3
    raw = [rng.standard_normal(s) for s in ((H * D, E), (Hkv * D, E), (Hkv * D, E), (E, H * D))]

    def lay(a):
        if layout == "read_only":
            a = a.copy()
            a.setflags(write=False)
            return a
        return {"fortran": np.asfortranarray,
                "negative": lambda a: a[::-1, ::-1].copy()[::-1, ::-1],
                "big_endian": lambda a: a.astype(">f8"), "float32": lambda a: a.astype(np.float32),
                "float16": lambda a: a.astype(np.float16)}[layout](a)

    weights = [lay(w) for w in raw]
    biases = dict(q_bias=lay(rng.standard_normal((1, H * D)))[0], out_bias=rng.standard_normal(E))
    for dt in (None, np.float32, np.float64):
        m = mha_cy.MultiHeadAttention.from_weights(*weights, num_heads=H, num_kv_heads=Hkv,
                                                   dtype=dt, **biases)
        r = R.MultiHeadAttention.from_weights(*[np.array(w, np.float64) for w in weights],
                                              num_heads=H, num_kv_heads=Hkv, dtype=m.dtype,
                                              **biases)
        assert m.in_proj_weight.flags.writeable and m.in_proj_weight.flags.c_contiguous
        for xdt in (np.float32, np.float64, np.float16):
            x = rng.standard_normal((2, 5, E)).astype(xdt)
            close(m(x, is_causal=True), r(x, is_causal=True), msg=(dt, xdt))
        for twin in (pickle.loads(pickle.dumps(m)), copy.deepcopy(m)):
            twin.q_weight[0, 0] += 1.0         # still a view of the packed weights, not m's
            assert twin.in_proj_weight[0, 0] == twin.q_weight[0, 0] != m.q_weight[0, 0]
    f = io.BytesIO()
    m.prune_heads([1]).save(f)
    f.seek(0)
    x = rng.standard_normal((2, 5, E))
    assert np.array_equal(mha_cy.MultiHeadAttention.load(f)(x), m.prune_heads([1])(x))


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_rope_at_huge_positions(rng, interleaved, dtype):
    m, r = pair(seed=3, embed_dim=16, num_heads=2, dtype=dtype,
                rope=mha_cy.RoPE(dim=6, interleaved=interleaved))
    x = rng.standard_normal((2, 4, 16)).astype(dtype)
    for p0 in (10 ** 5, 2 ** 31, 2 ** 53, 2 ** 63 - 4):
        pos = np.arange(p0, p0 + 4, dtype=np.int64)
        close(m(x, positions=pos, is_causal=True), r(x, positions=pos, is_causal=True), msg=p0)


@pytest.mark.parametrize("fmt", [None, np.float16, "int8"])
def test_nan_in_ragged_padding_rows_reaches_nothing(rng, fmt):
    m = mha_cy.MultiHeadAttention(16, 4, num_kv_heads=2, rope=mha_cy.RoPE(dim=2), seed=3)
    x = rng.standard_normal((3, 6, 16)).astype(np.float32)
    lens = np.array([6, 2, 4])
    x_nan = x.copy()
    for b, n in enumerate(lens):
        x_nan[b, n:] = np.nan
    c1, c2 = m.new_cache(3, 10, dtype=fmt), m.new_cache(3, 10, dtype=fmt)
    (a, wa), (b, wb) = (m(x, cache=c1, lengths=lens, need_weights=True),
                        m(x_nan, cache=c2, lengths=lens, need_weights=True))
    assert np.array_equal(a, b) and np.array_equal(wa, wb)
    step = m(x[:, :1], cache=c2)
    assert np.isfinite(step).all() and np.array_equal(step, m(x[:, :1], cache=c1))


def test_ragged_cache_with_every_option_against_the_reference(rng):
    m, r = pair(seed=3, embed_dim=16, num_heads=4, num_kv_heads=2, rope=mha_cy.RoPE(dim=2))
    x = rng.standard_normal((3, 5, 16)).astype(np.float32)
    for fmt in FMT_TOL:
        c, rc = m.new_cache(3, 10, dtype=fmt), r.new_cache(3, 10, dtype=fmt)
        zero = m(x, cache=c, lengths=[0, 0, 0])
        assert not zero.any() and c.length == 0
        close(zero, r(x, cache=rc, lengths=[0, 0, 0]))
        kw = dict(lengths=[5, 2, 0], head_mask=rng.random((3, 4)).astype(np.float32),
                  need_weights=True, positions=np.array([[0, 1, 2, 3, 4], [5, 6, 7, 8, 9],
                                                         [2, 2, 2, 2, 2]]))
        (o, w), (ro, rw) = m(x, cache=c, **kw), r(x, cache=rc, **kw)
        close(o, ro, FMT_TOL[fmt])
        close(w, rw, FMT_TOL[fmt])
        kpm = np.zeros((3, 6), bool)
        kpm[0, 1] = kpm[1, 0] = True
        add = rng.standard_normal((3, 1, 1, 6)).astype(np.float32)
        close(m(x[:, :1], cache=c, key_padding_mask=kpm, attn_mask=add),
              r(x[:, :1], cache=rc, key_padding_mask=kpm, attn_mask=add), FMT_TOL[fmt])
        for cache in (c, rc):
            cache.reorder([2, 0, 0])
            cache.truncate([0, 3, 1])
        for i in range(2):
            close(m(x[:, i:i + 1], cache=c), r(x[:, i:i + 1], cache=rc), FMT_TOL[fmt])
        assert np.array_equal(c.lengths, [2, 5, 3])


def test_threads_and_python_threads_give_serial_bits(rng):
    """Mixed paths (fast, weights, cache) from 3 Python threads, each at its own thread count,
    and a ragged int8 + RoPE + window + masks + head_mask call at 1..3 threads: same bits."""
    m = mha_cy.MultiHeadAttention(32, 4, num_kv_heads=2, seed=0, rope=mha_cy.RoPE(dim=4),
                                  window=5)
    jobs = [(rng.standard_normal((2, n, 32)).astype(np.float32), i % 3)
            for i, n in enumerate((3, 40, 300, 7, 90, 260))]

    def run(x, kind):
        if kind == 0:
            return m(x, is_causal=True)
        if kind == 1:
            return m(x, need_weights=True, is_causal=True)[0]
        c = m.new_cache(2, x.shape[1] + 1, dtype="int8")
        return np.concatenate([m(x, cache=c), m(x[:, :1], cache=c)], 1)

    serial = [run(*j) for j in jobs]
    bad = []

    def worker(t):
        with mha_cy.threads(1 + t):
            for rep in range(2):
                for i in range(len(jobs)):
                    k = (i + t) % len(jobs)
                    if not np.array_equal(run(*jobs[k]), serial[k]):
                        bad.append((t, k))

    workers = [threading.Thread(target=worker, args=(t,)) for t in range(3)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(60)
    assert not any(w.is_alive() for w in workers) and not bad, bad

    x = rng.standard_normal((3, 7, 32)).astype(np.float32)
    kpm = rng.random((3, 9)) < 0.2
    results = []
    for n in (1, 2, 3):
        with mha_cy.threads(n):
            c = m.new_cache(3, 12, dtype="int8")
            m(x[:, :2], cache=c, lengths=[2, 1, 0])
            results.append(m(x, cache=c, lengths=[7, 3, 5], key_padding_mask=kpm,
                             need_weights=True, head_mask=np.arange(4.0)))
    for o, w in results[1:]:
        assert np.array_equal(o, results[0][0]) and np.array_equal(w, results[0][1])


def test_rank_heads_equals_a_loop_over_head_masks(rng):
    m = mha_cy.MultiHeadAttention(16, 4, seed=3, kdim=8, vdim=8)
    q = rng.standard_normal((2, 5, 16)).astype(np.float32)
    k = rng.standard_normal((2, 7, 8)).astype(np.float32)
    cases = [((q, k), dict(key_padding_mask=rng.random((2, 7)) < 0.3)),
             ((q, k), dict(attn_mask=rng.random((2, 5, 7)) < 0.7)),
             ((q, k), dict(attn_mask=rng.standard_normal((2, 4, 5, 7)))),
             ((q[0], k[0]), dict(key_padding_mask=rng.random(7) < 0.3)),
             ((q[:1], k[:1]), dict(attn_mask=rng.random((1, 5, 7)) < 0.7)),
             ((q, k), dict(is_causal=True))]
    for args, kw in cases:
        heads, scores = analysis.rank_heads(m, *args, **kw)
        base = m(*args, **kw).astype(np.float64)
        expected = []
        for h in range(4):
            mask = np.ones(4)
            mask[h] = 0
            change = m(*args, head_mask=mask, **kw) - base
            expected.append(np.linalg.norm(change) / np.linalg.norm(base))
        np.testing.assert_allclose(scores, np.array(expected)[heads], rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("call, exc, match", [
    (lambda m, c, x: m.new_cache(2, 4, dtype=np.float64), ValueError, "dtype must be None"),
    (lambda m, c, x: m.new_cache(2, 4, dtype="bfloat16"), TypeError, "dtype must be None"),
    (lambda m, c, x: m.new_cache(1.0, 4), TypeError, "batch_size must be an int"),
    (lambda m, c, x: m.new_cache(2 ** 40, 2 ** 40), ValueError, "too large to allocate"),
    (lambda m, c, x: c.truncate(-1), ValueError, r"length must be in \[0, 0\].*got -1"),
    (lambda m, c, x: c.truncate(True), TypeError, "length must be an int"),
    (lambda m, c, x: c.truncate(np.array([2 ** 64 - 1, 0], np.uint64)), ValueError,
     "length is out of range"),
    (lambda m, c, x: c.reorder([-1, 0]), ValueError, r"indices must be in \[0, 2\); got -1"),
    (lambda m, c, x: c.reorder([0.0, 1.0]), TypeError, "indices must be.*float64"),
    (lambda m, c, x: c.reorder([0]), ValueError, r"indices must .*shape \(2,\); got \(1,\)"),
    (lambda m, c, x: m(x, cache=c, lengths=[-1, 0]), ValueError, r"lengths must be in \[0, 5\]"),
    (lambda m, c, x: m(x, cache=c, lengths=[1.0, 0]), TypeError, "lengths must be an integer"),
    (lambda m, c, x: m(x, lengths=[1, 0]), ValueError, "lengths= is for ragged batches"),
    (lambda m, c, x: m(x, cache=c, lengths=[5, 0]), ValueError,
     r"cache overflow: 0 cached \+ 5 new tokens > max_len 4 \(sequence 0\)"),
    (lambda m, c, x: m(x, positions=np.arange(-1, 4)), ValueError, "positions must be >= 0"),
    (lambda m, c, x: m(x, positions=np.arange(5.0)), TypeError, "positions must be an integer"),
    (lambda m, c, x: m(x, positions=np.full(5, 2 ** 64 - 1, np.uint64)), ValueError,
     r"positions must be < 2\*\*63"),
    (lambda m, c, x: m(x, x), ValueError, "self-attention only"),
])
def test_cache_and_call_argument_errors_name_the_argument(call, exc, match):
    m = mha_cy.MultiHeadAttention(16, 4, num_kv_heads=2, rope=mha_cy.RoPE(dim=2), seed=0)
    c = m.new_cache(2, 4)
    with pytest.raises(exc, match=match):
        call(m, c, np.ones((2, 5, 16), np.float32))
    assert np.array_equal(c.lengths, [0, 0]) and not c.key.any() and not c.value.any()
