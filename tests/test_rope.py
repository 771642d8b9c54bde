"""Rotary position embeddings: the kernel against a NumPy formula written here and against
Hugging Face's apply_rotary_pos_emb (Llama's half-split and GPT-J's interleaved layouts), the
module against the reference, decoding through a cache, explicit positions, thread-count
invariance and every error."""
import pickle

import numpy as np
import pytest

import mha_cy
from mha_cy import RoPE, _rope_kernel, reference
from mha_cy.rope import call_positions

from conftest import DTYPES, assert_close, random_weights

# (head_dim, rope dim or None, interleaved): full and partial rotary, both layouts
LAYOUTS = [(16, None, False), (16, None, True), (24, 8, False), (24, 8, True), (6, 2, False),
           (64, 32, True)]


def rotate(x, positions, dim, base, interleaved):
    """The test's own RoPE: x (..., L, D) float64; positions (L,) or broadcastable (..., L).

    Each pair (a, b) of the first dim features is the complex number a + ib, multiplied by
    exp(i * position * base ** (-2j / dim)) for pair j."""
    x = np.asarray(x, dtype=np.float64)
    half = dim // 2
    theta = np.asarray(positions, dtype=np.float64)[..., None] * base ** (-2.0 * np.arange(half)
                                                                         / dim)
    if interleaved:
        z = x[..., 0:dim:2] + 1j * x[..., 1:dim:2]
    else:
        z = x[..., :half] + 1j * x[..., half:dim]
    z = z * np.exp(1j * theta)
    out = x.copy()
    if interleaved:
        out[..., 0:dim:2], out[..., 1:dim:2] = z.real, z.imag
    else:
        out[..., :half], out[..., half:dim] = z.real, z.imag
    return out


def qkv_buffer(rng, batch, heads, kv_heads, length, head_dim, dtype):
    """A (B, L, (H + 2 Hkv) D) projection output and its (B, H + 2 Hkv, L, D) head view."""
    buf = rng.standard_normal((batch, length, (heads + 2 * kv_heads) * head_dim)).astype(dtype)
    view = buf.reshape(batch, length, heads + 2 * kv_heads, head_dim).transpose(0, 2, 1, 3)
    return buf, view


@pytest.fixture
def fine_partition():
    """Tasks of 3 rows and threads from the first pair on: small shapes get many tasks."""
    previous = _rope_kernel._set_partition(3, 0)
    yield
    _rope_kernel._set_partition(*previous)


# -- the kernel ------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim, dim, interleaved", LAYOUTS)
@pytest.mark.parametrize("shared", [True, False], ids=["shared-positions", "per-sequence"])
def test_kernel_matches_formula_in_place_on_qk_heads(rng, dtype, head_dim, dim, interleaved,
                                                     shared, fine_partition):
    B, H, Hkv, L = 3, 4, 2, 19
    buf, view = qkv_buffer(rng, B, H, Hkv, L, head_dim, dtype)
    before = view.copy()
    positions = rng.integers(0, 100_000, size=(1 if shared else B, L))
    rope = RoPE(dim=dim, base=5e5, interleaved=interleaved)
    _rope_kernel.rope(view[:, :H + Hkv], positions, rope.inv_freq(head_dim), interleaved, 2)
    rot = rope.rotary_dim(head_dim)
    expected = rotate(before[:, :H + Hkv], positions[:, None, :], rot, 5e5, interleaved)
    assert_close(view[:, :H + Hkv], expected.astype(dtype), dtype)
    # pass-through features and the value heads are untouched, bitwise
    np.testing.assert_array_equal(view[:, :H + Hkv, :, rot:], before[:, :H + Hkv, :, rot:])
    np.testing.assert_array_equal(view[:, H + Hkv:], before[:, H + Hkv:])


def test_float32_accuracy_at_large_positions(rng):
    """cos/sin in double: float32 results at positions ~1e5..1e6 are as accurate as at 0 (a
    float32 angle would be off by ~1e-2 rad there)."""
    x = rng.standard_normal((1, 2, 64, 128))
    positions = np.arange(10**6 - 64, 10**6)[None]
    got = x.astype(np.float32)
    _rope_kernel.rope(got, positions, RoPE().inv_freq(128), False, 1)
    expected = rotate(x.astype(np.float32), positions, 128, 1e4, False)
    np.testing.assert_allclose(got, expected, rtol=0, atol=1e-6 * np.abs(expected).max())


def test_rotation_is_relative():
    """q_m . k_n depends on m - n only (the point of RoPE), also at large offsets."""
    rng = np.random.default_rng(0)
    q, k = rng.standard_normal((2, 1, 1, 1, 32))
    dots = []
    for offset in (0, 7, 123_456):
        qr, kr = q.copy(), k.copy()
        _rope_kernel.rope(qr, np.array([[offset + 10]]), RoPE().inv_freq(32), False, 1)
        _rope_kernel.rope(kr, np.array([[offset + 3]]), RoPE().inv_freq(32), False, 1)
        dots.append(float(qr.ravel() @ kr.ravel()))
    np.testing.assert_allclose(dots, dots[0], rtol=1e-9)   # angles ~1e5 rad, 1e-16 relative


def test_position_zero_is_identity(rng):
    x = rng.standard_normal((2, 3, 1, 8))
    y = x.copy()
    _rope_kernel.rope(y, np.zeros((1, 1), np.int64), RoPE().inv_freq(8), True, 1)
    np.testing.assert_array_equal(y, x)


# -- Hugging Face parity ---------------------------------------------------------------------

def _torch():
    return pytest.importorskip("torch")


@pytest.mark.parametrize("head_dim, dim", [(16, None), (24, 8), (64, 32)])
def test_half_split_matches_hf_llama(rng, head_dim, dim):
    """HF's Llama apply_rotary_pos_emb with float64 cos/sin, on the first `dim` features (the
    rest passed through, as GPT-NeoX / Phi do for partial rotary)."""
    torch = _torch()
    llama = pytest.importorskip("transformers.models.llama.modeling_llama")
    B, H, Hkv, L, base = 2, 4, 2, 11, 1e6
    rope = RoPE(dim=dim, base=base)
    rot = rope.rotary_dim(head_dim)
    _, view = qkv_buffer(rng, B, H, Hkv, L, head_dim, np.float64)
    positions = rng.integers(0, 50_000, size=(B, L))
    q, k = torch.from_numpy(view[:, :H].copy()), torch.from_numpy(view[:, H:H + Hkv].copy())
    freqs = torch.from_numpy(positions).double()[..., None] * torch.from_numpy(
        rope.inv_freq(head_dim).copy())
    emb = torch.cat((freqs, freqs), dim=-1)                           # HF's (B, L, rot) layout
    q_rot, k_rot = llama.apply_rotary_pos_emb(q[..., :rot], k[..., :rot], emb.cos(), emb.sin())
    hf_q = torch.cat((q_rot, q[..., rot:]), dim=-1).numpy()
    hf_k = torch.cat((k_rot, k[..., rot:]), dim=-1).numpy()
    _rope_kernel.rope(view[:, :H + Hkv], positions, rope.inv_freq(head_dim), False, 2)
    assert_close(view[:, :H], hf_q, np.float64)
    assert_close(view[:, H:H + Hkv], hf_k, np.float64)


@pytest.mark.parametrize("head_dim, dim", [(16, None), (24, 8)])
def test_interleaved_matches_hf_gptj(rng, head_dim, dim):
    """HF's GPT-J apply_rotary_pos_emb (rotate_every_two; (B, L, H, D) tensors), float64."""
    torch = _torch()
    gptj = pytest.importorskip("transformers.models.gptj.modeling_gptj")
    B, H, L = 2, 3, 9
    rope = RoPE(dim=dim, interleaved=True)
    rot = rope.rotary_dim(head_dim)
    x = rng.standard_normal((B, L, H, head_dim))
    positions = rng.integers(0, 50_000, size=(B, L))
    freqs = torch.from_numpy(positions).double()[..., None] * torch.from_numpy(
        rope.inv_freq(head_dim).copy())
    t = torch.from_numpy(x.copy())
    hf = torch.cat((gptj.apply_rotary_pos_emb(t[..., :rot], freqs.sin(), freqs.cos()),
                    t[..., rot:]), dim=-1).numpy()
    view = x.transpose(0, 2, 1, 3)                  # (B, H, L, D) view, rows H * D apart
    _rope_kernel.rope(view, positions, rope.inv_freq(head_dim), True, 2)
    assert_close(x, hf, np.float64)


def test_module_matches_hf_llama_rotary_embedding(rng):
    """End to end in float32 with HF's own LlamaRotaryEmbedding (its float32 cos/sin: small
    positions keep its angle error below float32 tolerance)."""
    torch = _torch()
    llama = pytest.importorskip("transformers.models.llama.modeling_llama")
    config = llama.LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                               head_dim=16, rope_theta=10000.0)
    hf_rope = llama.LlamaRotaryEmbedding(config)
    B, H, Hkv, L, D = 2, 4, 2, 12, 16
    _, view = qkv_buffer(rng, B, H, Hkv, L, D, np.float32)
    positions = np.tile(np.arange(L), (B, 1)) + np.array([[0], [5]])
    q, k = torch.from_numpy(view[:, :H].copy()), torch.from_numpy(view[:, H:H + Hkv].copy())
    cos, sin = hf_rope(q, torch.from_numpy(positions))
    hf_q, hf_k = (t.numpy() for t in llama.apply_rotary_pos_emb(q, k, cos, sin))
    _rope_kernel.rope(view[:, :H + Hkv], positions, RoPE().inv_freq(D), False, 1)
    assert_close(view[:, :H], hf_q, np.float32, factor=4)
    assert_close(view[:, H:H + Hkv], hf_k, np.float32, factor=4)


# -- the module ------------------------------------------------------------------------------

def rope_pair(rng, dtype, rope, embed_dim=48, num_heads=4, num_kv_heads=2, head_dim=None):
    weights = random_weights(rng, embed_dim, num_heads, num_kv_heads, head_dim=head_dim)
    fast = mha_cy.MultiHeadAttention.from_weights(**weights, dtype=dtype, rope=rope)
    ref = reference.MultiHeadAttention.from_weights(**weights, dtype=dtype, rope=rope)
    return fast, ref, weights


def by_hand(weights, x, positions, rope, is_causal):
    """Self-attention with RoPE from the weights, the test's formula and reference SDPA."""
    H, Hkv = weights["num_heads"], weights["num_kv_heads"]
    B, L, _ = x.shape

    def heads(w, b, n):
        return (x @ w.T + b).reshape(B, L, n, -1).transpose(0, 2, 1, 3)

    q = heads(weights["q_weight"], weights["q_bias"], H)
    k = heads(weights["k_weight"], weights["k_bias"], Hkv)
    v = heads(weights["v_weight"], weights["v_bias"], Hkv)
    dim = rope.rotary_dim(q.shape[-1])
    pos = np.asarray(positions).reshape(-1, 1, L)
    q, k = (rotate(t, pos, dim, rope.base, rope.interleaved) for t in (q, k))
    ctx = reference.scaled_dot_product_attention(q, k, v, is_causal=is_causal)
    return ctx.transpose(0, 2, 1, 3).reshape(B, L, -1) @ weights["out_weight"].T + weights[
        "out_bias"]


@pytest.mark.parametrize("head_dim, dim, interleaved", LAYOUTS[:4])
@pytest.mark.parametrize("is_causal", [False, True])
def test_reference_is_the_formula(rng, head_dim, dim, interleaved, is_causal):
    rope = RoPE(dim=dim, base=500.0, interleaved=interleaved)
    _, ref, weights = rope_pair(rng, np.float64, rope, head_dim=head_dim)
    x = rng.standard_normal((2, 10, 48))
    positions = rng.integers(0, 1000, size=(2, 10))
    assert_close(ref(x, is_causal=is_causal, positions=positions),
                 by_hand(weights, x, positions, rope, is_causal), np.float64)
    assert_close(ref(x, is_causal=is_causal),
                 by_hand(weights, x, np.arange(10), rope, is_causal), np.float64)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim, dim, interleaved", LAYOUTS[:4])
def test_module_matches_reference(rng, dtype, head_dim, dim, interleaved):
    fast, ref, _ = rope_pair(rng, dtype, RoPE(dim=dim, interleaved=interleaved),
                             head_dim=head_dim)
    x = rng.standard_normal((3, 13, 48)).astype(dtype)
    for is_causal in (False, True):
        assert_close(fast(x, is_causal=is_causal), ref(x, is_causal=is_causal), dtype)  # fast path
        out_f, w_f = fast(x, is_causal=is_causal, need_weights=True)
        out_r, w_r = ref(x, is_causal=is_causal, need_weights=True)
        assert_close(out_f, out_r, dtype)
        assert_close(w_f, w_r, dtype)
    pad = np.zeros((3, 13), bool)
    pad[1, 9:] = True
    assert_close(fast(x, key_padding_mask=pad), ref(x, key_padding_mask=pad), dtype)
    # the rotation changes the result (the test would pass vacuously otherwise)
    plain = mha_cy.MultiHeadAttention.from_weights(fast.q_weight, fast.k_weight, fast.v_weight,
                                                   fast.out_weight, num_heads=4, num_kv_heads=2,
                                                   q_bias=fast.q_bias, k_bias=fast.k_bias,
                                                   v_bias=fast.v_bias, out_bias=fast.out_bias)
    assert np.abs(plain(x.astype(np.float32)) - fast(x).astype(np.float32)).max() > 1e-3


@pytest.mark.parametrize("dtype", DTYPES)
def test_constructor_rope(rng, dtype):
    rope = RoPE(dim=8, interleaved=True)
    fast = mha_cy.MultiHeadAttention(32, 2, num_kv_heads=1, dtype=dtype, seed=3, rope=rope)
    ref = reference.MultiHeadAttention(32, 2, num_kv_heads=1, dtype=dtype, seed=3, rope=rope)
    assert fast.rope is rope and ref.rope == rope and "rope=RoPE(dim=8" in repr(fast)
    x = rng.standard_normal((2, 7, 32)).astype(dtype)
    assert_close(fast(x, is_causal=True), ref(x, is_causal=True), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("interleaved", [False, True])
def test_prefill_and_steps_equal_one_causal_pass(rng, dtype, interleaved):
    fast, ref, _ = rope_pair(rng, dtype, RoPE(dim=8, interleaved=interleaved), head_dim=12)
    B, L, prefill = 2, 11, 6
    x = rng.standard_normal((B, L, 48)).astype(dtype)
    for mha in (fast, ref):
        full = mha(x, is_causal=True)
        cache = mha.new_cache(B, 16)
        parts = [mha(x[:, :prefill], cache=cache)]
        parts += [mha(x[:, t:t + 1], cache=cache) for t in range(prefill, L)]
        assert cache.length == L
        assert_close(np.concatenate(parts, axis=1), full, dtype)
    # the cache (ref's, the last one) holds the rotated keys: those at positions 0 .. L - 1
    k = (x.astype(np.float64) @ fast.k_weight.T + fast.k_bias).reshape(B, L, 2, 12)
    expected = rotate(k.transpose(0, 2, 1, 3), np.arange(L), 8, 1e4, interleaved)
    assert_close(cache.key[:, :, :L], expected.astype(dtype), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_explicit_positions(rng, dtype):
    fast, ref, _ = rope_pair(rng, dtype, RoPE())
    x = rng.standard_normal((2, 9, 48)).astype(dtype)
    default = fast(x, is_causal=True)
    np.testing.assert_array_equal(fast(x, is_causal=True, positions=np.arange(9)), default)
    np.testing.assert_array_equal(
        fast(x, is_causal=True, positions=np.tile(np.arange(9, dtype=np.int32), (2, 1))), default)
    # per-sequence positions: each sequence as if run alone at its positions
    positions = np.array([np.arange(9) + 4, np.arange(9)[::-1] * 3])
    out = fast(x, positions=positions)
    assert_close(out, ref(x, positions=positions), dtype)
    for b in range(2):
        assert_close(out[b], ref(x[b], positions=positions[b]), dtype)
        assert_close(out[b:b + 1], fast(x[b:b + 1], positions=positions[b]), dtype)
    # only relative positions matter: a large common offset changes nothing but rounding
    # (float64: angles of 1e5 rad carry 1e-11 rad of rounding)
    assert_close(fast(x, is_causal=True, positions=np.arange(9) + 100_000), default, dtype,
                 factor=10 if dtype == np.float32 else 1000)


@pytest.mark.parametrize("dtype", DTYPES)
def test_positions_with_a_cache(rng, dtype):
    """Explicit positions through a cache; default positions continue after cache.length."""
    fast, ref, _ = rope_pair(rng, dtype, RoPE(interleaved=True))
    x = rng.standard_normal((2, 8, 48)).astype(dtype)
    full = ref(x, is_causal=True, positions=np.arange(8) + 50)
    for mha in (fast, ref):
        cache = mha.new_cache(2, 8)
        a = mha(x[:, :5], cache=cache, positions=np.arange(5) + 50)
        b = mha(x[:, 5:], cache=cache, positions=np.tile(np.arange(5, 8) + 50, (2, 1)))
        assert_close(np.concatenate([a, b], axis=1), full, dtype)
    cache = fast.new_cache(2, 8)
    fast(x[:, :3], cache=cache)
    positions = call_positions(fast.rope, None, 2, 2, cache, True)
    assert positions.dtype == np.int64
    np.testing.assert_array_equal(np.broadcast_to(positions, (2, 2)), [[3, 4], [3, 4]])

    class PerSequence:                          # a cache with one length per sequence
        lengths = np.array([3, 1])
    np.testing.assert_array_equal(call_positions(fast.rope, None, 2, 2, PerSequence(), True),
                                  [[3, 4], [1, 2]])


def test_unbatched_and_empty(rng):
    fast, ref, _ = rope_pair(rng, np.float32, RoPE())
    x = rng.standard_normal((7, 48)).astype(np.float32)
    assert_close(fast(x, positions=np.arange(7) * 2), ref(x, positions=np.arange(7) * 2),
                 np.float32)
    assert_close(fast(x, positions=np.arange(7)[None]), fast(x), np.float32)
    out = fast(np.zeros((2, 0, 48), np.float32), positions=np.zeros((2, 0), np.int64))
    assert out.shape == (2, 0, 48)


@pytest.mark.skipif(not mha_cy.build_info()["openmp"], reason="a serial build runs one thread")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shared", [True, False])
def test_bitwise_equal_on_any_thread_count(rng, dtype, shared):
    """Both the kernel's default partition (a long sequence) and a fine one, threads 1..4."""
    rope = RoPE(dim=24, interleaved=not shared)
    _, view = qkv_buffer(rng, 2, 4, 2, 700, 32, dtype)
    positions = rng.integers(0, 10**5, size=(1 if shared else 2, 700))
    for rows_per_task, min_pairs in ((16, 1 << 14), (1, 0)):
        previous = _rope_kernel._set_partition(rows_per_task, min_pairs)
        try:
            results = []
            for n in (1, 2, 3, 4):
                y = view.copy()
                _rope_kernel.rope(y[:, :6], positions, rope.inv_freq(32), rope.interleaved, n)
                results.append(y)
        finally:
            _rope_kernel._set_partition(*previous)
        for y in results[1:]:
            np.testing.assert_array_equal(y, results[0])
    fast, _, _ = rope_pair(rng, dtype, rope, embed_dim=64, head_dim=32)
    x = rng.standard_normal((2, 300, 64)).astype(dtype)
    outs = []
    for n in (1, 2, 3, 4):
        with mha_cy.threads(n):
            outs.append(fast(x, is_causal=True))
    for out in outs[1:]:
        np.testing.assert_array_equal(out, outs[0])


# -- the configuration -----------------------------------------------------------------------

def test_rope_repr_eq_hash_pickle():
    rope = RoPE(dim=8, base=5e5, interleaved=True)
    assert repr(rope) == "RoPE(dim=8, base=500000.0, interleaved=True)"
    assert repr(RoPE()) == "RoPE(dim=None, base=10000.0, interleaved=False)"
    assert rope == RoPE(dim=8, base=500000, interleaved=True) and hash(rope) == hash(
        RoPE(8, 5e5, True))
    assert rope != RoPE(dim=8, base=5e5) and rope != RoPE(dim=None, base=5e5, interleaved=True)
    assert rope != "RoPE"
    rope.inv_freq(16)
    again = pickle.loads(pickle.dumps(rope))
    assert again == rope and repr(again) == repr(rope)
    np.testing.assert_array_equal(again.inv_freq(16), 5e5 ** (-np.arange(0, 8, 2) / 8))
    assert rope.inv_freq(16).flags.writeable is False
    with pytest.raises(AttributeError):
        rope.dim = 4
    mha = mha_cy.MultiHeadAttention(32, 2, seed=0, rope=rope)
    x = np.random.default_rng(0).standard_normal((2, 5, 32)).astype(np.float32)
    again = pickle.loads(pickle.dumps(mha))
    assert again.rope == rope
    np.testing.assert_array_equal(again(x), mha(x))


@pytest.mark.parametrize("kwargs, error, words", [
    (dict(dim=3), ValueError, "even"),
    (dict(dim=0), ValueError, "dim"),
    (dict(dim=-2), ValueError, "dim"),
    (dict(dim=4.0), TypeError, "dim"),
    (dict(dim=True), TypeError, "dim"),
    (dict(base=0.0), ValueError, "base"),
    (dict(base=-10.0), ValueError, "base"),
    (dict(base=float("inf")), ValueError, "base"),
    (dict(base=float("nan")), ValueError, "base"),
    (dict(base=10 ** 400), ValueError, "base must be finite"),    # was OverflowError
    (dict(base="1e4"), TypeError, "base"),
    (dict(interleaved=1), TypeError, "interleaved"),
])
def test_rope_config_errors(kwargs, error, words):
    with pytest.raises(error, match=words):
        RoPE(**kwargs)


def test_rope_must_fit_the_module(rng):
    with pytest.raises(ValueError, match=r"RoPE dim \(16\) must be <= head_dim \(12\)"):
        mha_cy.MultiHeadAttention(48, 4, rope=RoPE(dim=16))
    weights = random_weights(rng, 48, 4)
    with pytest.raises(ValueError, match=r"<= head_dim \(12\)"):
        reference.MultiHeadAttention.from_weights(**weights, rope=RoPE(dim=14))
    with pytest.raises(ValueError, match="head_dim = 5 features, which must be even"):
        mha_cy.MultiHeadAttention(20, 4, rope=RoPE())
    assert mha_cy.MultiHeadAttention(20, 4, rope=RoPE(dim=4)).rope.dim == 4
    with pytest.raises(TypeError, match="rope must be a mha_cy.RoPE or None; got dict"):
        mha_cy.MultiHeadAttention.from_weights(**weights, rope={"dim": 4})


@pytest.mark.parametrize("module", [mha_cy.MultiHeadAttention, reference.MultiHeadAttention])
def test_call_errors_leave_the_cache_unchanged(rng, module):
    mha = module(48, 4, seed=0, rope=RoPE())
    x = rng.standard_normal((2, 5, 48)).astype(np.float32)
    cache = mha.new_cache(2, 8)
    mha(x[:, :2], cache=cache)
    keys = cache.key.copy()
    bad = [
        (dict(positions=np.arange(5.0)), TypeError, "positions must be an integer array; got "
                                                    "dtype float64"),
        (dict(positions=np.ones(5, bool)), TypeError, "integer array; got dtype bool"),
        (dict(positions=np.arange(4)), ValueError, r"\(query_len,\) = \(5,\) or \(batch, "
                                                   r"query_len\) = \(2, 5\); got \(4,\)"),
        (dict(positions=np.zeros((3, 5), int)), ValueError, r"got \(3, 5\)"),
        (dict(positions=np.arange(5) - 1), ValueError, "positions must be >= 0; got -1"),
        (dict(positions=np.array([0, 1, 2, 3, 2**63], np.uint64)), ValueError, "2\\*\\*63"),
    ]
    for kwargs, error, words in bad:
        with pytest.raises(error, match=words):
            mha(x, cache=cache, **kwargs)
        assert cache.length == 2
        np.testing.assert_array_equal(cache.key, keys)
    with pytest.raises(ValueError, match="self-attention only; key and value must be None"):
        mha(x, x)
    with pytest.raises(ValueError, match="self-attention only"):
        mha(x, x, x, positions=np.arange(5))
    plain = module(48, 4, seed=0)
    with pytest.raises(ValueError, match=r"positions was given, but this module has no rotary "
                                         r"embeddings \(rope=None\)"):
        plain(x, positions=np.arange(5))
    assert plain(x, x).shape == x.shape              # cross-attention without RoPE still works


@pytest.mark.parametrize("impl", ["fast", "reference"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window", [None, 4])
def test_ragged_batch_with_rope_equals_each_sequence_alone(rng, impl, dtype, window):
    """Right-padded prompts (lengths=) then steps: each sequence's tokens sit at its own
    positions (cache.lengths[b] + 0, 1, ...), as in one causal pass over it alone."""
    weights = random_weights(rng, 48, 4, 2)
    rope = RoPE(dim=8, interleaved=True)
    cls = mha_cy.MultiHeadAttention if impl == "fast" else reference.MultiHeadAttention
    mha = cls.from_weights(**weights, dtype=dtype, rope=rope, window=window)
    ref = reference.MultiHeadAttention.from_weights(**weights, dtype=dtype, rope=rope,
                                                    window=window)
    lengths, B, Lq, steps = np.array([7, 2, 0]), 3, 7, 4
    prompts = rng.standard_normal((B, Lq, 48)).astype(dtype)
    tokens = rng.standard_normal((B, steps, 48)).astype(dtype)
    cache = mha.new_cache(B, Lq + steps)
    out = mha(prompts, cache=cache, lengths=lengths)
    outs = [mha(tokens[:, t:t + 1], cache=cache) for t in range(steps)]
    for b, n in enumerate(lengths):
        whole = ref(np.concatenate([prompts[b, :n], tokens[b]])[None], is_causal=True)[0]
        if n:
            assert_close(out[b, :n], whole[:n], dtype)
        assert_close(np.concatenate([o[b] for o in outs]), whole[n:], dtype)
