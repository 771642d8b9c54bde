"""Parity at the boundary with peer frameworks, beyond tests/test_torch_parity.py and
tests/test_weights_io.py: nn.MultiheadAttention options and forward arguments, Hugging Face
attention layers with rotary embeddings (explicit positions, left padding, prefill + cache
decode, partial and interleaved rotary, float64), GPT-2 decode, torch SDPA over unusual
arguments, and refusals of what mha_cy cannot reproduce. Models are built from configs with
random weights (no downloads); skipped cleanly without torch / transformers."""
import numpy as np
import pytest

import mha_cy
from mha_cy import reference

torch = pytest.importorskip("torch")
F = torch.nn.functional

MHA = mha_cy.MultiHeadAttention
TOL = {np.float32: 1e-5, np.float64: 1e-12}
TORCH_DTYPE = {np.float32: torch.float32, np.float64: torch.float64}
DTYPES = [np.float32, np.float64]


def close(actual, expected, dtype, factor=1.0):
    """actual == expected within TOL[dtype] * factor, relative to max |expected|."""
    if hasattr(expected, "detach"):
        expected = expected.detach().numpy()
    actual, expected = np.asarray(actual), np.asarray(expected)
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    assert not np.isnan(expected).any() and not np.isnan(actual).any()
    tol = TOL[dtype] * factor
    scale = max(float(np.abs(expected).max(initial=0.0)), 1e-30)
    np.testing.assert_allclose(actual, expected, rtol=tol, atol=tol * scale)


def t(x):
    return torch.from_numpy(np.ascontiguousarray(x))


def _transformers():
    return pytest.importorskip("transformers")


def randomize(module, seed):
    """Weights of std 0.25 and biases in [-0.5, 0.5): far from uniform attention."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            if p.ndim >= 2:
                p.copy_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * 0.25)
            else:
                p.copy_(torch.rand(p.shape, generator=gen, dtype=p.dtype) - 0.5)
    return module.eval()


def torch_module(dtype, E=16, H=4, seed=0, **kwargs):
    torch.manual_seed(seed)
    mod = torch.nn.MultiheadAttention(E, H, dtype=TORCH_DTYPE[dtype], **kwargs)
    return randomize(mod, seed)


def hf_mask(B, Lq, Lk=None, padding=None, window=None):
    """HF's eager additive (B, 1, Lq, Lk) mask: causal (bottom-right), padding, window."""
    Lk = Lq if Lk is None else Lk
    i = np.arange(Lq)[:, None] + (Lk - Lq)
    j = np.arange(Lk)[None, :]
    allowed = np.broadcast_to(j <= i, (B, 1, Lq, Lk))
    if window is not None:
        allowed = allowed & (j > i - window)
    if padding is not None:
        allowed = allowed & ~padding[:, None, None, :]
    return t(np.where(allowed, 0.0, np.finfo(np.float32).min).astype(np.float32))


# ---------------------------------------------------------------------------------------------
# torch.nn.MultiheadAttention: options of the constructor, arguments of forward

@pytest.mark.parametrize("dtype", DTYPES)
def test_from_torch_seq_first_and_eval_dropout_module(rng, dtype):
    """batch_first=False and dropout > 0 (in eval mode) are read as any other module; mha_cy
    takes (B, L, E) whatever the module's batch_first."""
    mod = torch_module(dtype, dropout=0.5, batch_first=False)
    mha = MHA.from_torch(mod)
    assert mha.dtype == np.dtype(dtype)
    x = rng.standard_normal((3, 6, 16)).astype(dtype)
    xs = t(x.transpose(1, 0, 2))
    with torch.no_grad():
        expected = mod(xs, xs, xs, need_weights=False)[0].transpose(0, 1)
    close(mha(x), expected, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_from_torch_float64_module_cast_to_float32(rng, dtype):
    mod = torch_module(np.float64, batch_first=True)
    mha = MHA.from_torch(mod, dtype=dtype)
    assert mha.dtype == np.dtype(dtype) and MHA.from_torch(mod).dtype == np.float64
    x = rng.standard_normal((2, 5, 16))
    with torch.no_grad():
        expected = mod(t(x), t(x), t(x), need_weights=False)[0].numpy()
    close(mha(x.astype(dtype)), expected.astype(dtype), dtype, factor=4)


@pytest.mark.parametrize("dtype", DTYPES)
def test_averaged_and_unbatched_weights(rng, dtype):
    mod = torch_module(dtype, batch_first=True)
    mha = MHA.from_torch(mod)
    x = rng.standard_normal((3, 6, 16)).astype(dtype)
    xt = t(x)
    with torch.no_grad():
        out, avg = mod(xt, xt, xt, need_weights=True, average_attn_weights=True)
        out1, w1 = mod(xt[0], xt[0], xt[0], need_weights=True, average_attn_weights=False)
    ours, weights = mha(x, need_weights=True)
    close(ours, out, dtype)
    close(weights.mean(axis=1), avg, dtype)
    ours1, weights1 = mha(x[0], need_weights=True)          # unbatched: 2-D out, 3-D weights
    assert ours1.shape == (6, 16) and weights1.shape == (4, 6, 6)
    close(ours1, out1, dtype)
    close(weights1, w1, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_torch_3d_float_mask_reshaped_and_refused_as_is(rng, dtype):
    """torch's (B * H, Lq, Lk) mask means (B, H, Lq, Lk) here; passed as is it is refused
    with a hint (B != H) rather than read as (B, Lq, Lk)."""
    B, H, L = 3, 4, 6
    mod = torch_module(dtype, H=H, batch_first=True)
    mha = MHA.from_torch(mod)
    x = rng.standard_normal((B, L, 16)).astype(dtype)
    mask = rng.standard_normal((B * H, L, L)).astype(dtype)
    with torch.no_grad():
        out, w = mod(t(x), t(x), t(x), attn_mask=t(mask), average_attn_weights=False)
    ours, weights = mha(x, attn_mask=mask.reshape(B, H, L, L), need_weights=True)
    close(ours, out, dtype)
    close(weights, w, dtype)
    with pytest.raises(ValueError, match=r"B \* num_heads.*reshape it"):
        mha(x, attn_mask=mask)


@pytest.mark.parametrize("dtype", DTYPES)
def test_causal_padding_and_bool_mask_together(rng, dtype):
    """is_causal, bool key padding and a bool attn_mask (True = may attend, torch's inverse)
    against torch given the same as one float mask and a float padding mask."""
    B, L = 3, 7
    mod = torch_module(dtype, batch_first=True)
    mha = MHA.from_torch(mod)
    x = rng.standard_normal((B, L, 16)).astype(dtype)
    pad = np.zeros((B, L), bool)
    pad[0, -2:] = True
    allowed = rng.random((L, L)) > 0.3
    np.fill_diagonal(allowed, True)
    causal = np.triu(np.full((L, L), -np.inf), 1)
    torch_mask = np.where(allowed, 0.0, -np.inf) + causal
    with torch.no_grad():
        out, w = mod(t(x), t(x), t(x), attn_mask=t(torch_mask.astype(dtype)),
                     key_padding_mask=t(np.where(pad, -np.inf, 0.0).astype(dtype)),
                     average_attn_weights=False)
    ours, weights = mha(x, key_padding_mask=pad, attn_mask=allowed, is_causal=True,
                        need_weights=True)
    close(ours, out, dtype)
    close(weights, w, dtype)


def test_fully_padded_sequence_gives_the_out_bias_where_torch_gives_nan(rng):
    """Documented difference: a sequence with every key padded gives zero context (the output
    is the output bias, weights 0); torch with need_weights gives NaN (its other paths vary).
    The other sequences agree."""
    mod = torch_module(np.float32, batch_first=True)
    mha = MHA.from_torch(mod)
    x = rng.standard_normal((3, 5, 16)).astype(np.float32)
    pad = np.zeros((3, 5), bool)
    pad[1] = True
    with torch.no_grad():
        out = mod(t(x), t(x), t(x), key_padding_mask=t(pad), need_weights=True)[0].numpy()
    ours, weights = mha(x, key_padding_mask=pad, need_weights=True)
    assert np.isnan(out[1]).all()
    np.testing.assert_array_equal(ours[1], np.broadcast_to(mha.out_bias, (5, 16)))
    assert not weights[1].any()
    close(ours[[0, 2]], out[[0, 2]], np.float32)


def test_unreproducible_torch_options_are_refused():
    mod = torch.nn.MultiheadAttention(16, 4, add_bias_kv=True, kdim=8, vdim=8)
    with pytest.raises(ValueError, match="add_bias_kv"):
        MHA.from_torch(mod)
    with pytest.raises(ValueError, match="bias_k.*add_bias_kv"):
        MHA.from_state_dict(mod.state_dict(), "torch", num_heads=4)
    mha = MHA(16, 4)
    x = np.zeros((1, 3, 16), np.float32)
    with pytest.raises(TypeError, match="key_padding_mask must be a bool array"):
        mha(x, key_padding_mask=np.array([[0.0, -np.inf, 0.0]]))     # torch's float form


# ---------------------------------------------------------------------------------------------
# Hugging Face decoders with rotary embeddings

def _decoder(name, seed):
    tr = _transformers()
    if name == "llama":
        from transformers.models.llama import modeling_llama as m
        cfg = tr.LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                             head_dim=32, rope_theta=1000.0, attention_bias=True)
        att, rot = m.LlamaAttention, m.LlamaRotaryEmbedding
    elif name == "qwen2":
        from transformers.models.qwen2 import modeling_qwen2 as m
        cfg = tr.Qwen2Config(hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                             rope_theta=1000.0)
        att, rot = m.Qwen2Attention, m.Qwen2RotaryEmbedding
    else:
        from transformers.models.mistral import modeling_mistral as m
        cfg = tr.MistralConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                               head_dim=16, rope_theta=1000.0, sliding_window=5)
        att, rot = m.MistralAttention, m.MistralRotaryEmbedding
    cfg._attn_implementation = "eager"
    layer = randomize(att(cfg, layer_idx=0), seed)
    window = getattr(cfg, "sliding_window", None) if name == "mistral" else None
    mha = MHA.from_state_dict(layer.state_dict(), "llama", num_heads=4, window=window,
                              rope=mha_cy.RoPE(base=cfg.rope_parameters["rope_theta"]))
    return layer, rot(cfg), mha, window


@pytest.mark.parametrize("name", ["llama", "qwen2", "mistral"])
def test_hf_rope_positions_and_cache_decode(rng, name):
    """Per-sequence position offsets, prefill + one token at a time through a KV cache, and
    left padding with HF's position ids, against one full HF forward each."""
    layer, rotary, mha, window = _decoder(name, 1)
    B, L = 2, 12
    x = rng.standard_normal((B, L, 64)).astype(np.float32)
    xt = t(x)
    pos = np.tile(np.arange(L), (B, 1)) + np.array([[0], [7]])
    with torch.no_grad():
        expected = layer(xt, rotary(xt, t(pos)), hf_mask(B, L, window=window))[0].numpy()
    close(mha(x, is_causal=True, positions=pos), expected, np.float32)
    cache = mha.new_cache(B, 32)
    outs = [mha(x[:, :5], cache=cache, positions=pos[:, :5])]
    outs += [mha(x[:, i:i + 1], cache=cache, positions=pos[:, i:i + 1]) for i in range(5, L)]
    close(np.concatenate(outs, axis=1), expected, np.float32)

    pad = np.zeros((B, L), bool)
    pad[1, :4] = True                                   # left padding, as HF generates
    hf_pos = np.cumsum(~pad, axis=1) - 1
    hf_pos[pad] = 1
    with torch.no_grad():
        expected = layer(xt, rotary(xt, t(hf_pos)),
                         hf_mask(B, L, padding=pad, window=window))[0].numpy()
    ours = mha(x, is_causal=True, key_padding_mask=pad, positions=hf_pos)
    close(ours[~pad], expected[~pad], np.float32)


def test_hf_llama_float64_at_large_positions_with_weights():
    """float64 end to end (HF's sdpa attention: its eager path takes the softmax in float32),
    positions near 1e5, prefill and decode weights through the cache."""
    tr = _transformers()
    from transformers.models.llama.modeling_llama import LlamaAttention
    cfg = tr.LlamaConfig(hidden_size=64, num_attention_heads=8, num_key_value_heads=2,
                         head_dim=16, rope_theta=10000.0, attention_bias=True)
    cfg._attn_implementation = "sdpa"
    layer = randomize(LlamaAttention(cfg, 0).double(), 3)
    rope = mha_cy.RoPE(base=10000.0)
    mha = MHA.from_state_dict(layer.state_dict(), "llama", num_heads=8, rope=rope)
    assert mha.dtype == np.float64 and mha.num_kv_heads == 2
    B, L = 2, 10
    x = np.random.default_rng(0).standard_normal((B, L, 64))
    pos = np.tile(np.arange(L), (B, 1)) + np.array([[0], [100_000]])
    freqs = t(pos).double()[..., None] * t(rope.inv_freq(16).copy())
    emb = torch.cat((freqs, freqs), dim=-1)
    causal = t(np.triu(np.full((L, L), -np.inf), 1))[None, None]
    with torch.no_grad():
        expected = layer(t(x), (emb.cos(), emb.sin()), causal)[0].numpy()
    full, weights = mha(x, is_causal=True, positions=pos, need_weights=True)
    close(full, expected, np.float64, factor=10)
    cache = mha.new_cache(B, 16)
    outs = [mha(x[:, :6], cache=cache, positions=pos[:, :6])]
    for i in range(6, L):
        out, w = mha(x[:, i:i + 1], cache=cache, positions=pos[:, i:i + 1], need_weights=True)
        close(w, weights[:, :, i:i + 1, :i + 1], np.float64, factor=10)
        outs.append(out)
    close(np.concatenate(outs, axis=1), expected, np.float64, factor=10)


def test_partial_and_interleaved_rotary_layers(rng):
    """GPT-J (interleaved, rotary_dim < head_dim), Phi (half-split, partial_rotary_factor,
    GQA) and GPT-NeoX (fused per-head qkv, rotary_pct) through from_weights + RoPE(dim=...)."""
    tr = _transformers()
    from transformers.models.gpt_neox import modeling_gpt_neox as neox
    from transformers.models.gptj import modeling_gptj as gptj
    from transformers.models.phi import modeling_phi as phi
    B, L, E, H = 2, 9, 64, 4
    x = rng.standard_normal((B, L, E)).astype(np.float32)
    xt = t(x)
    pos = np.tile(np.arange(L), (B, 1)) + np.array([[0], [3]])
    mask = hf_mask(B, L)

    def w(p):
        return p.detach().numpy()

    cfg = tr.GPTJConfig(n_embd=E, n_head=H, rotary_dim=8, n_positions=64)
    cfg._attn_implementation = "eager"
    att = randomize(gptj.GPTJAttention(cfg, 0), 1)
    mha = MHA.from_weights(w(att.q_proj.weight), w(att.k_proj.weight), w(att.v_proj.weight),
                           w(att.out_proj.weight), num_heads=H,
                           rope=mha_cy.RoPE(dim=8, interleaved=True))
    with torch.no_grad():
        expected = att(xt, gptj.GPTJRotaryEmbedding(cfg)(xt, t(pos)), mask)[0]
    close(mha(x, is_causal=True, positions=pos), expected, np.float32)

    cfg = tr.PhiConfig(hidden_size=E, num_attention_heads=H, num_key_value_heads=2,
                       partial_rotary_factor=0.5, rope_theta=300.0)
    cfg._attn_implementation = "eager"
    att = randomize(phi.PhiAttention(cfg, 0), 2)
    mha = MHA.from_weights(w(att.q_proj.weight), w(att.k_proj.weight), w(att.v_proj.weight),
                           w(att.dense.weight), num_heads=H, num_kv_heads=2,
                           q_bias=w(att.q_proj.bias), k_bias=w(att.k_proj.bias),
                           v_bias=w(att.v_proj.bias), out_bias=w(att.dense.bias),
                           rope=mha_cy.RoPE(dim=att.head_dim // 2, base=300.0))
    with torch.no_grad():
        expected = att(xt, phi.PhiRotaryEmbedding(cfg)(xt, t(pos)), mask)[0]
    close(mha(x, is_causal=True, positions=pos), expected, np.float32)

    cfg = tr.GPTNeoXConfig(hidden_size=E, num_attention_heads=H, rotary_pct=0.25,
                           intermediate_size=64, num_hidden_layers=1)
    cfg._attn_implementation = "eager"
    att = randomize(neox.GPTNeoXAttention(cfg, 0), 3)
    D = E // H
    qkv = w(att.query_key_value.weight).reshape(H, 3, D, E)      # per head: q, k, v rows
    qkv_b = w(att.query_key_value.bias).reshape(H, 3, D)
    mha = MHA.from_weights(*(qkv[:, i].reshape(E, E) for i in range(3)), w(att.dense.weight),
                           num_heads=H, q_bias=qkv_b[:, 0].ravel(), k_bias=qkv_b[:, 1].ravel(),
                           v_bias=qkv_b[:, 2].ravel(), out_bias=w(att.dense.bias),
                           rope=mha_cy.RoPE(dim=D // 4))
    with torch.no_grad():
        rot = neox.GPTNeoXRotaryEmbedding(cfg)(xt, t(pos))
        expected = att(xt, mask, position_embeddings=rot)[0]
    close(mha(x, is_causal=True, positions=pos), expected, np.float32)


def test_gpt2_whole_model_state_cache_decode_and_cross_attention_refused(rng):
    tr = _transformers()
    B, L, E, H = 2, 9, 48, 4
    cfg = tr.GPT2Config(n_embd=E, n_head=H, n_layer=2, vocab_size=64, n_positions=32,
                        bos_token_id=0, eos_token_id=0, add_cross_attention=True)
    cfg._attn_implementation = "eager"
    model = randomize(tr.GPT2Model(cfg), 0)
    state = model.state_dict()
    mha = MHA.from_state_dict(state, "gpt2", num_heads=H, prefix="h.1.attn.")
    x = rng.standard_normal((B, L, E)).astype(np.float32)
    with torch.no_grad():
        expected = model.h[1].attn(t(x), attention_mask=hf_mask(B, L))[0].numpy()
    close(mha(x, is_causal=True), expected, np.float32)
    cache = mha.new_cache(B, 16)
    outs = [mha(x[:, :4], cache=cache)] + [mha(x[:, i:i + 1], cache=cache) for i in range(4, L)]
    close(np.concatenate(outs, axis=1), expected, np.float32)
    # GPT-2's cross-attention (q_attn + a 2 * E c_attn) is not the self-attention layout
    with pytest.raises(ValueError, match=r"crossattention\.q_attn\.weight. is present: this is "
                                         r"GPT-2.s cross-attention"):
        MHA.from_state_dict(state, "gpt2", num_heads=H, prefix="h.1.crossattention.")


def test_other_layer_names_are_refused_with_the_keys_found():
    tr = _transformers()
    from transformers.models.gptj.modeling_gptj import GPTJAttention
    att = GPTJAttention(tr.GPTJConfig(n_embd=32, n_head=4, rotary_dim=4), 0)
    with pytest.raises(KeyError, match="o_proj.weight.*out_proj.weight"):
        MHA.from_state_dict(att.state_dict(), "llama", num_heads=4)


# ---------------------------------------------------------------------------------------------
# torch.nn.functional.scaled_dot_product_attention

def sdpa_case(rng, dtype, B=2, Hq=4, Hkv=2, Lq=5, Lk=7, D=8):
    return (rng.standard_normal((B, Hq, Lq, D)).astype(dtype),
            rng.standard_normal((B, Hkv, Lk, D)).astype(dtype),
            rng.standard_normal((B, Hkv, Lk, D)).astype(dtype))


def torch_sdpa(q, k, v, **kwargs):
    kwargs = {n: t(a) if isinstance(a, np.ndarray) else a for n, a in kwargs.items()}
    with torch.no_grad():
        return F.scaled_dot_product_attention(t(q), t(k), t(v), enable_gqa=True, **kwargs)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("scale", [0.0, -1.0, 100.0, np.float32(0.25)])
def test_sdpa_unusual_scales(rng, dtype, scale):
    q, k, v = sdpa_case(rng, dtype)
    expected = torch_sdpa(q, k, v, scale=float(scale))
    for sdpa in (mha_cy.scaled_dot_product_attention, reference.scaled_dot_product_attention):
        close(sdpa(q, k, v, scale=scale), expected, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_sdpa_fully_masked_rows_and_finfo_min_rows_match_torch(rng, dtype):
    """A row hidden by bool False or -inf gives zeros in both; a row of finfo(float32).min
    (HF's mask value) is a finite shift: the plain average in both."""
    q, k, v = sdpa_case(rng, dtype)
    allowed = np.ones((5, 7), bool)
    allowed[2] = False
    hidden = np.zeros((5, 7), dtype)
    hidden[2] = -np.inf
    shifted = np.zeros((5, 7), dtype)
    shifted[2] = np.finfo(np.float32).min
    for mask in (allowed, hidden, shifted):
        expected = torch_sdpa(q, k, v, attn_mask=mask).numpy()
        for sdpa in (mha_cy.scaled_dot_product_attention, reference.scaled_dot_product_attention):
            got = sdpa(q, k, v, attn_mask=mask)
            close(got, expected, dtype)
            if mask.dtype == bool or np.isinf(mask).any():
                assert not got[:, :, 2].any()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(2, 1, 1, 7), (1, 4, 5, 1), (2, 4, 1, 7), (1, 1, 5, 7)])
@pytest.mark.parametrize("kind", ["bool", "float"])
def test_sdpa_broadcast_masks_match_torch(rng, dtype, shape, kind):
    q, k, v = sdpa_case(rng, dtype)
    if kind == "bool":
        mask = rng.random(shape) < 0.6
    else:
        mask = np.where(rng.random(shape) < 0.3, -np.inf, rng.standard_normal(shape))
        mask = mask.astype(dtype)
    expected = torch_sdpa(q, k, v, attn_mask=mask)
    for sdpa in (mha_cy.scaled_dot_product_attention, reference.scaled_dot_product_attention):
        close(sdpa(q, k, v, attn_mask=mask), expected, dtype)


@pytest.mark.parametrize("shape", [(1, 1), (2, 1, 1), (1, 1, 1, 1)])
def test_module_bool_mask_broadcast_along_every_axis(rng, shape):
    """A bool mask of size 1 along the key axis broadcasts in the module (all True = no
    mask, all False = zero context)."""
    mha, ref = MHA(16, 2, seed=0), reference.MultiHeadAttention(16, 2, seed=0)
    x = rng.standard_normal((2, 70, 16)).astype(np.float32)
    close(mha(x, attn_mask=np.ones(shape, bool)), mha(x), np.float32)
    close(mha(x, attn_mask=np.ones(shape, bool)), ref(x), np.float32)
    np.testing.assert_array_equal(mha(x, attn_mask=np.zeros(shape, bool)),
                                  np.broadcast_to(mha.out_bias, x.shape))
