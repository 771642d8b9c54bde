"""Differential fuzzing (hypothesis) of the fast path against mha_cy.reference.

Every example is a call a demanding user could make: NaN / +inf / -inf in inputs, weights and
masks, extreme magnitudes (scores that overflow or vanish, values near the float range), every
memory layout (padded rows, interleaved heads, unaligned, zero and negative strides), every mask
form and broadcast shape, causal with Lq != Lk, sliding windows, cache steps, ragged cache
batches (lengths=), RoPE, head_mask, pruned modules (uneven GQA groups), need_weights and
split-K lengths (>= 1024 keys with few tasks). Outputs must have NaN and inf at the same places
as the reference and agree elsewhere within the tolerance table (see fuzz_inputs.assert_same
for the one relaxation, inf against NaN where an infinite value reaches V).

How many examples run is a hypothesis settings profile (tests/conftest.py, MHA_CY_FUZZ_PROFILE):
"quick" (default, the normal suite), "ci" (.ci/run's fuzz step: thousands, under a time budget),
"sanitize" (the ASan/UBSan step). Under a budget, examples past it are skipped (not counted);
the counts tried go to MHA_CY_FUZZ_REPORT when set. Failures found by shrinking stay as
explicit regression tests in test_fuzz_regressions.py.
"""
import numpy as np
from hypothesis import given
from hypothesis import strategies as st

import mha_cy
from mha_cy import reference

from conftest import fuzz_budget, fuzz_settings
from fuzz_inputs import LAYOUTS, SPECIALS, assert_same, inject, with_layout

SDPA = mha_cy.scaled_dot_product_attention
DTYPES = st.sampled_from([np.float32, np.float64])
SPECIAL = st.sampled_from(sorted(SPECIALS))
MASK_SHAPES = ["2d", "3d", "4d", "4d_head_broadcast", "2d_row_broadcast"]


def _mask_shape(kind, b, h, lq, lk):
    return {"2d": (lq, lk), "3d": (b, lq, lk), "4d": (b, h, lq, lk),
            "4d_head_broadcast": (b, 1, lq, lk), "2d_row_broadcast": (1, lk)}[kind]


def _magnitude(name, dtype):
    """q/k or v scale factors ('overflow': see run_sdpa_case); 'huge' values stay summable
    over 2300 keys."""
    big = {np.float32: 1e25, np.float64: 1e160}[dtype]
    huge_v = {np.float32: 1e30, np.float64: 1e300}[dtype]
    return {"one": 1.0, "tiny": 1e-20, "overflow": big, "huge": huge_v}[name]


def _mask(rng, kind, shape, dtype, specials):
    if kind is None:
        return None
    if kind == "bool":
        m = rng.random(shape) < 0.75
    else:
        m = rng.standard_normal(shape)
        if kind == "float_minus_inf":
            m[rng.random(shape) < 0.3] = -np.inf
        elif kind == "float_huge_negative":
            m[rng.random(shape) < 0.3] = -1e30
        m = inject(rng, m, specials).astype(dtype)
    return m


@st.composite
def sdpa_cases(draw):
    split_k = draw(st.booleans())
    if split_k:      # one task per (batch, K/V head) and long keys: the split-K decode path
        b, hkv, lq, lk = 1, 1, draw(st.integers(1, 3)), draw(st.integers(1024, 2300))
    else:
        b, hkv = draw(st.integers(1, 2)), draw(st.integers(1, 2))
        lq, lk = draw(st.integers(1, 24)), draw(st.integers(1, 80))
    is_causal = draw(st.booleans())
    return dict(
        b=b, hkv=hkv, group=draw(st.integers(1, 3)), lq=lq, lk=lk,
        d=draw(st.sampled_from([1, 3, 8, 16, 32, 64])), dv=draw(st.sampled_from([1, 5, 16])),
        dtype=draw(DTYPES), layouts=[draw(st.sampled_from(LAYOUTS)) for _ in range(3)],
        qk_mag=draw(st.sampled_from(["one", "one", "tiny", "overflow"])),
        v_mag=draw(st.sampled_from(["one", "one", "huge"])),
        specials={t: draw(st.lists(SPECIAL, max_size=2)) for t in ("q", "k", "v", "mask")},
        mask=draw(st.sampled_from([None, "bool", "float", "float_minus_inf",
                                   "float_huge_negative"])),
        mask_shape=draw(st.sampled_from(MASK_SHAPES)), is_causal=is_causal,
        window=draw(st.sampled_from([None, 1, 3, 40, 1500])) if is_causal else None,
        scale=draw(st.sampled_from([None, 0.5, 3.0])), threads=draw(st.integers(1, 2)),
        tile=draw(st.sampled_from(["auto", "auto", "fused", "blas"])),
        seed=draw(st.integers(0, 2**32 - 1)))


def run_sdpa_case(c):
    rng = np.random.default_rng(c["seed"])
    dt, hq = c["dtype"], c["hkv"] * c["group"]
    qk, vm = _magnitude(c["qk_mag"], dt), _magnitude(c["v_mag"], dt)
    q = rng.standard_normal((c["b"], hq, c["lq"], c["d"])) * qk
    k = rng.standard_normal((c["b"], c["hkv"], c["lk"], c["d"])) * qk
    v = rng.standard_normal((c["b"], c["hkv"], c["lk"], c["dv"])) * vm
    if c["qk_mag"] == "overflow":
        # Every product of a score overflows, all of one sign per (query, key): the score is
        # +inf or -inf whatever the order of the sum. (Mixed signs are not: an FMA adds the
        # exact product, so fma(x, y, -inf) stays -inf where x * y rounded would be +inf and
        # the sum NaN; the kernels' order of FMAs is theirs.)
        q, k = np.abs(q), np.abs(k) * rng.choice([-1, 1], size=k.shape[:3])[..., None]
    specials = dict(c["specials"])
    if c["qk_mag"] == "overflow":       # (an injected inf of the other sign: see above)
        specials.update({n: [s for s in specials[n] if s == "nan"] for n in "qk"})
    q, k, v = (with_layout(inject(rng, x, specials[n]).astype(dt), lay)
               for x, n, lay in zip((q, k, v), "qkv", c["layouts"]))
    mask = _mask(rng, c["mask"], _mask_shape(c["mask_shape"], c["b"], hq, c["lq"], c["lk"]),
                 dt, c["specials"]["mask"])
    kw = dict(attn_mask=mask, is_causal=c["is_causal"], scale=c["scale"],
              window=c.get("window"))
    previous = mha_cy._attention_kernel._set_tile_kernel(c.get("tile", "auto"))
    try:
        with np.errstate(all="ignore"):
            expected = reference.scaled_dot_product_attention(q, k, v, **kw)
            with mha_cy.threads(c["threads"]):
                out = SDPA(q, k, v, **kw)
    finally:
        mha_cy._attention_kernel._set_tile_kernel(previous)
    finite_v = np.abs(v[np.isfinite(v)])
    assert_same(out, expected, dt,
                infinite_values=bool({"inf", "-inf"} & set(c["specials"]["v"])),
                value_scale=max(float(finite_v.max(initial=0)), 1e-300))


@st.composite
def module_cases(draw):
    kv_heads = draw(st.integers(1, 2))
    heads = kv_heads * draw(st.integers(1, 3))
    head_dim = draw(st.sampled_from([1, 4, 16, 32]))
    mode = draw(st.sampled_from(["self", "cross", "cache", "cache"]))
    is_causal = draw(st.booleans())
    ragged = mode == "cache" and draw(st.booleans())
    rope = None
    if mode != "cross" and head_dim % 2 == 0 and draw(st.booleans()):
        rope = (draw(st.sampled_from([None, 2, head_dim])), draw(st.booleans()))
    return dict(
        heads=heads, kv_heads=kv_heads, head_dim=head_dim,
        embed_dim=draw(st.sampled_from([heads * head_dim, 12])), mode=mode,
        b=draw(st.integers(1, 3)), lq=draw(st.integers(1, 12)),
        lk=draw(st.sampled_from([1, 7, 33, 1100])) if mode == "cross" else None,
        steps=draw(st.integers(1, 3)) if mode == "cache" else 1, bias=draw(st.booleans()),
        dtype=draw(DTYPES), layout=draw(st.sampled_from(LAYOUTS)),
        weight_specials=draw(st.lists(st.tuples(
            st.sampled_from(["q_weight", "k_weight", "v_weight", "out_weight", "q_bias",
                             "v_bias"]), SPECIAL), max_size=1)),
        input_specials=draw(st.lists(SPECIAL, max_size=1)),
        # not huge: scores of ~1e300 make the softmax as ill-conditioned as one likes (equal
        # keys a rounding apart), and overflowing ones depend on the order of the FMAs (see
        # run_sdpa_case); the sdpa cases overflow scores in a controlled way
        x_mag=draw(st.sampled_from(["one", "one", "tiny"])),
        mask=None if ragged else draw(st.sampled_from([None, "bool", "float_minus_inf"])),
        mask_shape=draw(st.sampled_from(MASK_SHAPES)),
        padding=not ragged and draw(st.booleans()), is_causal=is_causal,
        window=draw(st.sampled_from([None, 1, 2, 5])) if is_causal or mode == "cache" else None,
        ragged=ragged, rope=rope,
        head_mask=draw(st.sampled_from([None, "heads", "batch_heads"])),
        prune=draw(st.sets(st.integers(0, heads - 1), max_size=heads - 1)) if heads > 1
        else set(),
        need_weights=draw(st.booleans()), threads=draw(st.integers(1, 2)),
        seed=draw(st.integers(0, 2**32 - 1)))


def run_module_case(c):
    rng = np.random.default_rng(c["seed"])
    dt = c["dtype"]
    rope = None if c.get("rope") is None else mha_cy.RoPE(dim=c["rope"][0],
                                                          interleaved=c["rope"][1])
    fast = mha_cy.MultiHeadAttention(c["embed_dim"], c["heads"], num_kv_heads=c["kv_heads"],
                                     head_dim=c["head_dim"], bias=c["bias"], dtype=dt,
                                     seed=c["seed"] % 2**31, window=c.get("window"), rope=rope)
    for name, special in c["weight_specials"]:
        w = getattr(fast, name)
        if w is not None:                        # views into the packed arrays: edit in place
            w[tuple(rng.integers(n) for n in w.shape)] = SPECIALS[special]
    ref = reference.MultiHeadAttention.from_weights(
        fast.q_weight, fast.k_weight, fast.v_weight, fast.out_weight, num_heads=c["heads"],
        num_kv_heads=c["kv_heads"], q_bias=fast.q_bias, k_bias=fast.k_bias,
        v_bias=fast.v_bias, out_bias=fast.out_bias, dtype=dt, window=c.get("window"),
        rope=rope)
    if c.get("prune"):                           # uneven groups of query heads per K/V head
        fast, ref = fast.prune_heads(sorted(c["prune"])), ref.prune_heads(sorted(c["prune"]))
    heads = fast.num_heads
    mag = {"one": 1.0, "tiny": 1e-20}
    b, lq = c["b"], c["lq"]
    infinite = any(s in ("inf", "-inf") for s in c["input_specials"]) or any(
        s in ("inf", "-inf") for _, s in c["weight_specials"])

    def tokens(length):
        x = rng.standard_normal((b, length, c["embed_dim"])) * mag[c["x_mag"]]
        return with_layout(inject(rng, x, c["input_specials"]).astype(dt), c["layout"])

    cache_mode = c["mode"] == "cache"
    caches = (fast.new_cache(b, lq * c["steps"]), ref.new_cache(b, lq * c["steps"])) \
        if cache_mode else (None, None)
    for step in range(c["steps"]):
        x = tokens(lq)
        args = (x, tokens(c["lk"])) if c["mode"] == "cross" else (x,)
        lk = {"cross": c["lk"], "self": lq, "cache": lq * (step + 1)}[c["mode"]]
        kw = dict(is_causal=c["is_causal"], need_weights=c["need_weights"])
        if cache_mode and c.get("ragged"):       # each sequence appends its first tokens only
            kw["lengths"] = rng.integers(0, lq + 1, size=b)
        if c["padding"]:
            kw["key_padding_mask"] = rng.random((b, lk)) < 0.3
        mask = _mask(rng, c["mask"], _mask_shape(c["mask_shape"], b, heads, lq, lk), dt, [])
        if mask is not None:
            kw["attn_mask"] = mask
        if c.get("head_mask") == "heads":
            kw["head_mask"] = rng.choice([0.0, 0.5, 1.0, 2.0], size=heads)
        elif c.get("head_mask") == "batch_heads":
            kw["head_mask"] = rng.choice([0.0, 1.0, -3.0], size=(b, heads))
        with np.errstate(all="ignore"):
            expected = ref(*args, cache=caches[1], **kw)
            with mha_cy.threads(c["threads"]):
                out = fast(*args, cache=caches[0], **kw)
        if c["need_weights"]:
            assert_same(out[0], expected[0], dt, what="output", infinite_values=infinite)
            assert_same(out[1], expected[1], dt, what="weights", infinite_values=infinite)
        else:
            assert_same(out, expected, dt, infinite_values=infinite)
        if caches[0] is not None:
            np.testing.assert_array_equal(caches[0].lengths, caches[1].lengths)


@fuzz_settings()
@given(sdpa_cases())
def test_fuzz_sdpa_against_the_reference(case):
    with fuzz_budget("sdpa") as go:
        if go:
            run_sdpa_case(case)


@fuzz_settings()
@given(module_cases())
def test_fuzz_module_against_the_reference(case):
    with fuzz_budget("module") as go:
        if go:
            run_module_case(case)
