"""Weights in and out (mha_cy/_weights_io.py): from_state_dict against torch and Hugging Face
attention modules built from small configs with random weights (no downloads), state dicts
given as tensors of any dtype, .safetensors and .npz files, save/load, pickling, and the error
messages. The torch/transformers tests skip cleanly when those packages are absent."""
import inspect
import io
import pickle
import sys

import numpy as np
import pytest

import mha_cy
from mha_cy import reference

from conftest import assert_close

MHA = mha_cy.MultiHeadAttention
HAS_ROPE = hasattr(mha_cy, "RoPE")
HAS_WINDOW = "window" in inspect.signature(MHA.from_weights).parameters


def _torch():
    return pytest.importorskip("torch")


def _transformers():
    _torch()
    return pytest.importorskip("transformers")


def randomize(module, seed):
    """Weights of std 0.25 and biases in [-0.5, 0.5): attention far from uniform, every bias
    exercised (the libraries' own inits give near-zero biases and near-uniform attention)."""
    torch = _torch()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            if p.ndim >= 2:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.25)
            else:
                p.copy_(torch.rand(p.shape, generator=gen) - 0.5)
    return module.eval()


def right_padding(rng, batch, length):
    """bool (B, L), True = padding, at the end of each sequence, every sequence >= 1 token."""
    lengths = rng.integers(1, length + 1, size=batch)
    lengths[0] = length
    return np.arange(length)[None, :] >= lengths[:, None]


def additive_mask(torch, padding, causal=False, window=None):
    """The (B, 1, L, L) float mask HF's eager attention adds to the scores."""
    L = padding.shape[1]
    allowed = ~padding[:, None, None, :]
    i, j = np.arange(L)[:, None], np.arange(L)[None, :]
    if causal:
        allowed = allowed & (j <= i)
    if window is not None:
        allowed = allowed & (j > i - window)
    mask = np.where(allowed, 0.0, np.finfo(np.float32).min).astype(np.float32)
    return torch.from_numpy(mask)


def hf_config(cls, **kwargs):
    config = cls(**kwargs)
    config._attn_implementation = "eager"      # the mask is exactly the one given
    return config


def tensor(torch, x):
    return torch.from_numpy(np.ascontiguousarray(x))


# ---------------------------------------------------------------------------------------------
# torch.nn.MultiheadAttention

@pytest.mark.parametrize("kind", ["packed", "kdim_vdim", "no_bias"])
def test_torch_layout_matches_nn_multiheadattention(kind, rng):
    torch = _torch()
    E, H, B, L = 32, 4, 3, 7
    kdim, vdim = (24, 20) if kind == "kdim_vdim" else (None, None)
    ref = randomize(torch.nn.MultiheadAttention(E, H, bias=kind != "no_bias", kdim=kdim,
                                                vdim=vdim, batch_first=True), 1)
    mha = MHA.from_state_dict(ref.state_dict(), "torch", num_heads=H)
    assert (mha.out_bias is None) == (kind == "no_bias")
    x = rng.standard_normal((B, L, E)).astype(np.float32)
    k = rng.standard_normal((B, L, kdim or E)).astype(np.float32)
    v = rng.standard_normal((B, L, vdim or E)).astype(np.float32)
    pad = right_padding(rng, B, L)
    expected, _ = ref(tensor(torch, x), tensor(torch, k), tensor(torch, v),
                      key_padding_mask=tensor(torch, pad), need_weights=False)
    assert_close(mha(x, k, v, key_padding_mask=pad), expected.detach().numpy())


def test_torch_layout_from_a_whole_model_state_dict_with_prefix(rng):
    torch = _torch()

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = torch.nn.LayerNorm(16)
            self.attn = torch.nn.MultiheadAttention(16, 2, batch_first=True)
            self.mlp = torch.nn.Linear(16, 16)

    block = randomize(Block(), 2)
    mha = MHA.from_state_dict(block.state_dict(), "torch", num_heads=2, prefix="attn.")
    x = rng.standard_normal((2, 5, 16)).astype(np.float32)
    xt = tensor(torch, x)
    assert_close(mha(x), block.attn(xt, xt, xt, need_weights=False)[0].detach().numpy())


# ---------------------------------------------------------------------------------------------
# Hugging Face: BERT, GPT-2, Llama (GQA), Qwen2 (biases), Mistral (window)

def test_bert_layout_matches_bert_attention(rng):
    transformers = _transformers()
    torch = _torch()
    from transformers.models.bert.modeling_bert import BertAttention
    config = hf_config(transformers.BertConfig, hidden_size=32, num_attention_heads=4,
                       intermediate_size=64)
    att = randomize(BertAttention(config), 3)
    mha = MHA.from_state_dict(att.state_dict(), "bert", num_heads=4)
    B, L = 3, 9
    x = rng.standard_normal((B, L, 32)).astype(np.float32)
    pad = right_padding(rng, B, L)
    with torch.no_grad():
        xt = tensor(torch, x)
        context = att.self(xt, attention_mask=additive_mask(torch, pad))[0]
        expected = att.output.dense(context).numpy()
        # the whole BertAttention: mha_cy's output plus the residual, through the LayerNorm
        full = att(xt, attention_mask=additive_mask(torch, pad))[0].numpy()
        ours_full = att.output.LayerNorm(tensor(torch, mha(x, key_padding_mask=pad)) + xt).numpy()
    out = mha(x, key_padding_mask=pad)
    assert_close(out[~pad], expected[~pad])      # padded queries are never read by BERT
    assert_close(ours_full[~pad], full[~pad], factor=4)


def test_bert_layout_from_a_bert_model_state_dict(rng):
    transformers = _transformers()
    torch = _torch()
    config = hf_config(transformers.BertConfig, hidden_size=32, num_attention_heads=4,
                       num_hidden_layers=2, intermediate_size=64, vocab_size=50)
    model = randomize(transformers.BertModel(config), 4)
    state = model.state_dict()
    mha = MHA.from_state_dict(state, "bert", num_heads=4, prefix="encoder.layer.1.attention.")
    att = model.encoder.layer[1].attention
    x = rng.standard_normal((2, 6, 32)).astype(np.float32)
    with torch.no_grad():
        expected = att.output.dense(att.self(tensor(torch, x))[0]).numpy()
    assert_close(mha(x), expected)


def test_gpt2_layout_matches_gpt2_attention(rng):
    transformers = _transformers()
    torch = _torch()
    from transformers.models.gpt2.modeling_gpt2 import GPT2Attention
    config = hf_config(transformers.GPT2Config, n_embd=48, n_head=4, n_layer=1)
    att = randomize(GPT2Attention(config, layer_idx=0), 5)
    mha = MHA.from_state_dict(att.state_dict(), "gpt2", num_heads=4)
    B, L = 2, 8
    x = rng.standard_normal((B, L, 48)).astype(np.float32)
    pad = right_padding(rng, B, L)
    with torch.no_grad():
        expected = att(tensor(torch, x),
                       attention_mask=additive_mask(torch, pad, causal=True))[0].numpy()
    assert_close(mha(x, is_causal=True, key_padding_mask=pad), expected)


def _no_rotation(torch, B, L, head_dim):
    """HF's position_embeddings for 'rotate by angle 0': the layout alone is under test."""
    return torch.ones(B, L, head_dim), torch.zeros(B, L, head_dim)


@pytest.mark.parametrize("model", ["llama", "qwen2"])
def test_llama_layout_with_gqa_matches_hf_attention_without_rotation(model, rng):
    transformers = _transformers()
    torch = _torch()
    if model == "llama":
        from transformers.models.llama.modeling_llama import LlamaAttention as Attention
        config = hf_config(transformers.LlamaConfig, hidden_size=64, num_attention_heads=8,
                           num_key_value_heads=2, head_dim=16, attention_bias=True)
    else:
        from transformers.models.qwen2.modeling_qwen2 import Qwen2Attention as Attention
        config = hf_config(transformers.Qwen2Config, hidden_size=64, num_attention_heads=8,
                           num_key_value_heads=2)
    att = randomize(Attention(config, layer_idx=0), 6)
    mha = MHA.from_state_dict(att.state_dict(), "llama", num_heads=8)
    assert (mha.num_kv_heads, mha.head_dim) == (2, att.head_dim)     # read off k_proj
    if model == "qwen2":        # q/k/v biases, none on o_proj: a zero out_bias
        assert not mha.out_bias.any() and mha.q_bias.any()
    B, L = 3, 10
    x = rng.standard_normal((B, L, 64)).astype(np.float32)
    pad = right_padding(rng, B, L)
    with torch.no_grad():
        expected = att(tensor(torch, x), _no_rotation(torch, B, L, att.head_dim),
                       additive_mask(torch, pad, causal=True))[0].numpy()
    assert_close(mha(x, is_causal=True, key_padding_mask=pad), expected)


@pytest.mark.skipif(not HAS_ROPE, reason="mha_cy.RoPE is not merged yet (the lead merges it)")
def test_llama_layout_with_rope_matches_llama_attention(rng):
    """With real rotary embeddings: runs once mha_cy.RoPE exists."""
    transformers = _transformers()
    torch = _torch()
    from transformers.models.llama.modeling_llama import LlamaAttention, LlamaRotaryEmbedding
    config = hf_config(transformers.LlamaConfig, hidden_size=64, num_attention_heads=8,
                       num_key_value_heads=2, head_dim=16, rope_theta=500.0)
    att = randomize(LlamaAttention(config, layer_idx=0), 7)
    base = config.rope_parameters["rope_theta"]
    mha = MHA.from_state_dict(att.state_dict(), "llama", num_heads=8, rope=mha_cy.RoPE(base=base))
    B, L = 2, 12
    x = rng.standard_normal((B, L, 64)).astype(np.float32)
    positions = torch.arange(L)[None].expand(B, L)
    with torch.no_grad():
        cos_sin = LlamaRotaryEmbedding(config)(tensor(torch, x), positions)
        expected = att(tensor(torch, x), cos_sin,
                       additive_mask(torch, np.zeros((B, L), bool), causal=True))[0].numpy()
    assert_close(mha(x, is_causal=True), expected, factor=4)


@pytest.mark.skipif(not HAS_WINDOW, reason="window= is not merged yet (the lead merges it)")
def test_llama_layout_with_window_matches_mistral_attention(rng):
    """Sliding-window attention: runs once MultiHeadAttention takes window=."""
    transformers = _transformers()
    torch = _torch()
    from transformers.models.mistral.modeling_mistral import MistralAttention
    window = 4
    config = hf_config(transformers.MistralConfig, hidden_size=64, num_attention_heads=8,
                       num_key_value_heads=4, head_dim=8, sliding_window=window)
    att = randomize(MistralAttention(config, layer_idx=0), 8)
    mha = MHA.from_state_dict(att.state_dict(), "llama", num_heads=8, window=window)
    B, L = 2, 11
    x = rng.standard_normal((B, L, 64)).astype(np.float32)
    with torch.no_grad():
        expected = att(tensor(torch, x), _no_rotation(torch, B, L, 8),
                       additive_mask(torch, np.zeros((B, L), bool), causal=True,
                                     window=window))[0].numpy()
    assert_close(mha(x, is_causal=True), expected)


def test_rope_and_window_are_passed_to_from_weights_only_when_given():
    state = _llama_state(np.random.default_rng(0))
    plain = MHA.from_state_dict(state, "llama", num_heads=4)
    assert getattr(plain, "window", None) is None and getattr(plain, "rope", None) is None
    if HAS_WINDOW:
        assert MHA.from_state_dict(state, "llama", num_heads=4, window=3).window == 3
    else:
        with pytest.raises(TypeError, match="window"):
            MHA.from_state_dict(state, "llama", num_heads=4, window=3)
    if HAS_ROPE:
        rope = mha_cy.RoPE()
        assert MHA.from_state_dict(state, "llama", num_heads=4, rope=rope).rope == rope
    else:
        with pytest.raises(TypeError, match="rope"):
            MHA.from_state_dict(state, "llama", num_heads=4, rope=object())


# ---------------------------------------------------------------------------------------------
# What a state may be: tensors of any dtype/strides, files

def _llama_state(rng, E=16, H=4, Hkv=2, bias=True, prefix=""):
    d = E // H
    shapes = {"q_proj": (H * d, E), "k_proj": (Hkv * d, E), "v_proj": (Hkv * d, E),
              "o_proj": (E, H * d)}
    state = {}
    for name, shape in shapes.items():
        state[f"{prefix}{name}.weight"] = rng.standard_normal(shape).astype(np.float32)
        if bias:
            state[f"{prefix}{name}.bias"] = rng.standard_normal(shape[0]).astype(np.float32)
    return state


def _assert_same_module(a, b):
    assert (a.num_heads, a.num_kv_heads, a.head_dim, a.dtype) == \
        (b.num_heads, b.num_kv_heads, b.head_dim, b.dtype)
    for name in ("q_weight", "k_weight", "v_weight", "out_weight", "q_bias", "k_bias",
                 "v_bias", "out_bias"):
        x, y = getattr(a, name), getattr(b, name)
        assert (x is None) == (y is None), name
        if x is not None:
            assert x.dtype == y.dtype and np.array_equal(x, y), name


def test_torch_tensors_of_every_dtype_and_stride_are_read(rng):
    torch = _torch()
    state = _llama_state(rng, prefix="model.layers.0.self_attn.")
    expected = MHA.from_state_dict(state, "llama", num_heads=4,
                                   prefix="model.layers.0.self_attn.")
    tensors = {k: torch.nn.Parameter(tensor(torch, v)) for k, v in state.items()}  # requires_grad
    _assert_same_module(MHA.from_state_dict(tensors, "llama", num_heads=4,
                                            prefix="model.layers.0.self_attn."), expected)
    # non-contiguous: the transpose of a contiguous transpose
    strided = {k: tensor(torch, v.T.copy()).T if v.ndim == 2 else tensor(torch, v)
               for k, v in state.items()}
    assert not strided["model.layers.0.self_attn.q_proj.weight"].is_contiguous()
    _assert_same_module(MHA.from_state_dict(strided, "llama", num_heads=4,
                                            prefix="model.layers.0.self_attn."), expected)
    for low in (torch.bfloat16, torch.float16):       # widened exactly to float32
        low_state = {k: tensor(torch, v).to(low) for k, v in state.items()}
        exact = {k: v.float().numpy() for k, v in low_state.items()}
        mha = MHA.from_state_dict(low_state, "llama", num_heads=4,
                                  prefix="model.layers.0.self_attn.")
        assert mha.dtype == np.float32
        _assert_same_module(mha, MHA.from_state_dict(exact, "llama", num_heads=4,
                                                     prefix="model.layers.0.self_attn."))
    double = {k: tensor(torch, v).double() for k, v in state.items()}
    assert MHA.from_state_dict(double, "llama", num_heads=4,
                               prefix="model.layers.0.self_attn.").dtype == np.float64
    assert MHA.from_state_dict(double, "llama", num_heads=4, prefix="model.layers.0.self_attn.",
                               dtype=np.float32).dtype == np.float32


def test_npz_and_safetensors_files(rng, tmp_path):
    state = _llama_state(rng, prefix="layers.3.attn.")
    state["layers.3.mlp.weight"] = np.ones((2, 2), np.float32)         # ignored
    expected = MHA.from_state_dict(state, "llama", num_heads=4, prefix="layers.3.attn.")
    np.savez(tmp_path / "w.npz", **state)
    for path in (tmp_path / "w.npz", str(tmp_path / "w.npz")):
        _assert_same_module(MHA.from_state_dict(path, "llama", num_heads=4,
                                                prefix="layers.3.attn."), expected)
    safetensors_numpy = pytest.importorskip("safetensors.numpy")
    safetensors_numpy.save_file(state, str(tmp_path / "w.safetensors"))
    _assert_same_module(MHA.from_state_dict(tmp_path / "w.safetensors", "llama", num_heads=4,
                                            prefix="layers.3.attn."), expected)


def test_bfloat16_safetensors_file_is_read_as_float32(rng, tmp_path):
    torch = _torch()
    safetensors_torch = pytest.importorskip("safetensors.torch")
    state = {k: tensor(torch, v).to(torch.bfloat16) for k, v in _llama_state(rng).items()}
    safetensors_torch.save_file(state, str(tmp_path / "bf16.safetensors"))
    mha = MHA.from_state_dict(tmp_path / "bf16.safetensors", "llama", num_heads=4)
    _assert_same_module(mha, MHA.from_state_dict(state, "llama", num_heads=4))
    assert mha.dtype == np.float32


def test_safetensors_missing_gives_an_install_hint(tmp_path, monkeypatch):
    (tmp_path / "w.safetensors").write_bytes(b"\0" * 16)
    monkeypatch.setitem(sys.modules, "safetensors", None)       # import safetensors fails
    with pytest.raises(ImportError, match="pip install safetensors"):
        MHA.from_state_dict(tmp_path / "w.safetensors", "llama", num_heads=4)


# ---------------------------------------------------------------------------------------------
# Error messages

def test_missing_key_names_the_full_key_and_lists_the_keys_under_the_prefix(rng):
    state = _llama_state(rng, prefix="model.layers.0.self_attn.")
    del state["model.layers.0.self_attn.v_proj.weight"]
    with pytest.raises(KeyError) as err:
        MHA.from_state_dict(state, "llama", num_heads=4, prefix="model.layers.0.self_attn.")
    msg = str(err.value)
    assert "'model.layers.0.self_attn.v_proj.weight'" in msg
    assert "model.layers.0.self_attn.q_proj.weight" in msg and "o_proj.bias" in msg


def test_wrong_prefix_says_no_key_has_it(rng):
    state = _llama_state(rng, prefix="model.layers.0.self_attn.")
    with pytest.raises(KeyError, match="no key starts with prefix 'model.layers.0.attn.'"):
        MHA.from_state_dict(state, "llama", num_heads=4, prefix="model.layers.0.attn.")
    with pytest.raises(KeyError, match="'in_proj_weight' or 'q_proj_weight'"):
        MHA.from_state_dict(state, "torch", num_heads=4)


def test_misshapen_arrays_give_expected_and_actual_shapes(rng):
    state = _llama_state(rng)
    with pytest.raises(ValueError, match=r"'k_proj.weight' has 8 rows; expected num_kv_heads "
                                         r"\* head_dim = 4 \* 4 = 16"):
        MHA.from_state_dict(state, "llama", num_heads=4, num_kv_heads=4)
    bad = dict(state, **{"o_proj.weight": state["o_proj.weight"][:, :-1]})
    with pytest.raises(ValueError, match=r"'o_proj.weight' has shape \(16, 15\); "
                                         r"expected \(16, 16\)"):
        MHA.from_state_dict(bad, "llama", num_heads=4)
    bad = dict(state, **{"v_proj.weight": state["v_proj.weight"][:, :-1]})
    with pytest.raises(ValueError, match=r"'v_proj.weight' has shape \(8, 15\); expected \(8, 16\)"):
        MHA.from_state_dict(bad, "llama", num_heads=4)
    bad = dict(state, **{"q_proj.bias": state["q_proj.bias"][:-1]})
    with pytest.raises(ValueError, match=r"'q_proj.bias' has shape \(15,\); expected \(16,\)"):
        MHA.from_state_dict(bad, "llama", num_heads=4)
    with pytest.raises(ValueError, match="num_heads=3 does not divide"):
        MHA.from_state_dict(state, "llama", num_heads=3)
    gpt2 = {"c_attn.weight": np.zeros((8, 16)), "c_attn.bias": np.zeros(24),
            "c_proj.weight": np.zeros((8, 8)), "c_proj.bias": np.zeros(8)}
    with pytest.raises(ValueError, match=r"'c_attn.weight' has shape \(8, 16\); "
                                         r"expected \(8, 24\)"):
        MHA.from_state_dict(gpt2, "gpt2", num_heads=2)
    torch_state = {"in_proj_weight": np.zeros((10, 4)), "out_proj.weight": np.zeros((4, 4))}
    with pytest.raises(ValueError, match=r"'in_proj_weight' has shape \(10, 4\)"):
        MHA.from_state_dict(torch_state, "torch", num_heads=2)


def test_bad_layout_state_and_paths(rng, tmp_path):
    state = _llama_state(rng)
    with pytest.raises(ValueError, match=r"layout must be one of \['bert', 'gpt2', 'llama', "
                                         r"'torch'\]; got 'mistral'"):
        MHA.from_state_dict(state, "mistral", num_heads=4)
    with pytest.raises(TypeError, match="state must be a mapping"):
        MHA.from_state_dict([1, 2], "llama", num_heads=4)
    with pytest.raises(FileNotFoundError, match="no such file"):
        MHA.from_state_dict(tmp_path / "nope.npz", "llama", num_heads=4)
    (tmp_path / "w.pt").write_bytes(b"")
    with pytest.raises(ValueError, match=r"\.safetensors or \.npz"):
        MHA.from_state_dict(tmp_path / "w.pt", "llama", num_heads=4)
    with pytest.raises(TypeError, match="num_heads"):
        MHA.from_state_dict(state, "llama", num_heads=4.0)
    with pytest.raises(ValueError, match="add_bias_kv"):
        MHA.from_state_dict({"bias_k": np.zeros((1, 1, 4))}, "torch", num_heads=2)


# ---------------------------------------------------------------------------------------------
# save / load, pickling

def _modules():
    yield MHA(16, 4, seed=1)
    yield MHA(16, 4, num_kv_heads=2, bias=False, dtype=np.float64, seed=2)
    yield MHA(16, 2, kdim=8, vdim=12, seed=3)                  # unpacked q/k/v weights
    yield reference.MultiHeadAttention(16, 4, num_kv_heads=1, seed=4)
    if HAS_WINDOW:
        yield MHA(16, 4, window=5, seed=5)
    if HAS_ROPE:
        yield MHA(16, 4, rope=mha_cy.RoPE(dim=2, base=100.0, interleaved=True), seed=6)


def _outputs(mha, rng):
    x = rng.standard_normal((2, 5, mha.embed_dim))
    if mha.kdim == mha.embed_dim:
        return mha(x, is_causal=True)
    return mha(x, rng.standard_normal((2, 3, mha.kdim)), rng.standard_normal((2, 3, mha.vdim)))


@pytest.mark.parametrize("index", range(len(list(_modules()))))
def test_save_load_round_trips_exactly(index, tmp_path):
    mha = list(_modules())[index]
    path = tmp_path / "attention.weights"          # no .npz suffix: written exactly there
    mha.save(path)
    assert path.is_file() and not (tmp_path / "attention.weights.npz").exists()
    np.load(path, allow_pickle=False)               # no object arrays inside
    loaded = type(mha).load(path)
    _assert_same_module(loaded, mha)
    assert repr(loaded) == repr(mha)
    assert getattr(loaded, "window", None) == getattr(mha, "window", None)
    assert getattr(loaded, "rope", None) == getattr(mha, "rope", None)
    out, out2 = (_outputs(m, np.random.default_rng(0)) for m in (mha, loaded))
    assert np.array_equal(out, out2)


def test_save_to_a_file_object_and_load_into_the_other_class():
    mha = MHA(8, 2, seed=0)
    buf = io.BytesIO()
    mha.save(buf)
    buf.seek(0)
    _assert_same_module(reference.MultiHeadAttention.load(buf), mha)


def test_load_refuses_other_files(tmp_path):
    np.savez(tmp_path / "other.npz", a=np.zeros(2))
    with pytest.raises(ValueError, match="not a file written by MultiHeadAttention.save"):
        MHA.load(tmp_path / "other.npz")
    np.savez(tmp_path / "future.npz", config=np.array('{"format": "mha_cy.MultiHeadAttention/9"}'))
    with pytest.raises(ValueError, match="has format"):
        MHA.load(tmp_path / "future.npz")


@pytest.mark.parametrize("index", range(len(list(_modules()))))
def test_pickle_round_trips_exactly(index):
    mha = list(_modules())[index]
    copy = pickle.loads(pickle.dumps(mha))
    _assert_same_module(copy, mha)
    assert repr(copy) == repr(mha)
    assert np.array_equal(_outputs(copy, np.random.default_rng(1)),
                          _outputs(mha, np.random.default_rng(1)))


def test_unpickled_qkv_weights_are_still_views_of_the_packed_arrays():
    mha = MHA(16, 4, num_kv_heads=2, seed=0)
    copy = pickle.loads(pickle.dumps(mha))
    for name in ("q_weight", "k_weight", "v_weight"):
        assert np.shares_memory(getattr(copy, name), copy.in_proj_weight), name
        assert getattr(copy, name).flags.writeable
    for name in ("q_bias", "k_bias", "v_bias"):
        assert np.shares_memory(getattr(copy, name), copy.in_proj_bias), name
    assert not np.shares_memory(copy.in_proj_weight, mha.in_proj_weight)
    # an in-place edit reaches the packed array, so the fast path sees it, like the original's
    for m in (mha, copy):
        m.k_weight[3] *= -2.0
        m.v_bias[1:4] = 0.5
    assert np.array_equal(copy.in_proj_weight, mha.in_proj_weight)
    assert np.array_equal(copy.in_proj_bias, mha.in_proj_bias)
    x = np.random.default_rng(2).standard_normal((2, 6, 16)).astype(np.float32)
    assert np.array_equal(copy(x), mha(x))
    again = pickle.loads(pickle.dumps(copy, protocol=2))      # a copy of a copy, old protocol
    assert np.shares_memory(again.v_weight, again.in_proj_weight)
    assert np.array_equal(again(x), mha(x))


@pytest.mark.parametrize("cls", [MHA, reference.MultiHeadAttention])
def test_packed_weights_cannot_be_replaced(cls):
    """Assigning a new in_proj_weight / in_proj_bias once left q/k/v_weight viewing the old
    array: self-attention used the new weights and cross-attention the old ones. Replacing
    is refused like every other parameter's; in-place edits stay the way."""
    mha = cls(16, 4, seed=0)
    for name in ("in_proj_weight", "in_proj_bias", "q_weight", "out_bias"):
        with pytest.raises(AttributeError):
            setattr(mha, name, np.zeros_like(getattr(mha, name)))
    # the geometry too: num_heads = 2 was accepted and the next call failed inside a kernel
    for name, value in (("num_heads", 2), ("num_kv_heads", 2), ("head_dim", 8),
                        ("embed_dim", 8), ("kdim", 8), ("vdim", 8), ("dtype", np.float64)):
        with pytest.raises(AttributeError):
            setattr(mha, name, value)
    mha.in_proj_weight[:] = 0.25
    assert (mha.q_weight == 0.25).all() and (mha.v_weight == 0.25).all()


@pytest.mark.parametrize("cls", [MHA, reference.MultiHeadAttention])
def test_window_attribute_is_checked_when_set(cls):
    """window=0 once reached the kernels as "no limit" and the reference as "no key"; a
    huge int raised OverflowError in the middle of a call."""
    mha = cls(16, 4, seed=0)
    for bad, error in ((0, ValueError), (-1, ValueError), (10 ** 30, ValueError),
                       (2.0, TypeError), ("3", TypeError)):
        with pytest.raises(error, match="window"):
            mha.window = bad
        assert mha.window is None
    mha.window = 2
    assert mha.window == 2 and "window=2" in repr(mha)
    x = np.random.default_rng(3).standard_normal((2, 6, 16)).astype(np.float32)
    ref = reference.MultiHeadAttention.from_weights(
        mha.q_weight, mha.k_weight, mha.v_weight, mha.out_weight, num_heads=4,
        q_bias=mha.q_bias, k_bias=mha.k_bias, v_bias=mha.v_bias, out_bias=mha.out_bias,
        window=2)
    assert_close(mha(x, is_causal=True), ref(x, is_causal=True))
    mha.window = None
    assert_close(mha(x, is_causal=True), reference.MultiHeadAttention.from_weights(
        mha.q_weight, mha.k_weight, mha.v_weight, mha.out_weight, num_heads=4,
        q_bias=mha.q_bias, k_bias=mha.k_bias, v_bias=mha.v_bias,
        out_bias=mha.out_bias)(x, is_causal=True))


def test_pickles_with_the_old_attribute_names_still_load():
    """Pickles made while in_proj_weight, in_proj_bias and window were plain attributes keep
    those names in their state: loading maps them to the properties' storage, views and all,
    and checks the window."""
    mha = MHA(16, 4, seed=0, window=3)
    state = mha.__getstate__()
    renamed = ("_in_proj_weight", "_in_proj_bias", "_window", "_num_heads", "_num_kv_heads",
               "_head_dim", "_embed_dim", "_kdim", "_vdim", "_dtype")
    old = {name.lstrip("_") if name in renamed else name: value
           for name, value in state.items()}
    old["__views__"] = {name: (owner.lstrip("_") if owner == "_in_proj_weight" else owner,
                               *where) for name, (owner, *where) in state["__views__"].items()}
    assert "in_proj_weight" in old and "_in_proj_weight" not in old
    copy = MHA.__new__(MHA)
    copy.__setstate__(old)
    _assert_same_module(copy, mha)
    assert copy.window == 3
    assert np.shares_memory(copy.q_weight, copy.in_proj_weight)
    x = np.random.default_rng(4).standard_normal((1, 5, 16)).astype(np.float32)
    assert np.array_equal(copy(x, is_causal=True), mha(x, is_causal=True))
    old["window"] = 0
    with pytest.raises(ValueError, match="window"):
        MHA.__new__(MHA).__setstate__(old)


def test_from_weights_accepts_transposed_weights():
    """Conv1D and some checkpoints hand over transposed (Fortran-ordered) arrays: the packed
    in_proj_weight must still be C-contiguous for the kernels (it once was not, and crashed)."""
    rng = np.random.default_rng(3)
    w = [rng.standard_normal((8, 8)) for _ in range(4)]
    mha = MHA.from_weights(*(a.T for a in w), num_heads=2)
    ref = MHA.from_weights(*(np.ascontiguousarray(a.T) for a in w), num_heads=2)
    assert mha.in_proj_weight.flags.c_contiguous
    x = rng.standard_normal((2, 3, 8)).astype(np.float32)
    pad = np.array([[False, False, True], [False, False, False]])
    assert np.array_equal(mha(x, is_causal=True), ref(x, is_causal=True))
    assert np.array_equal(mha(x, key_padding_mask=pad), ref(x, key_padding_mask=pad))


def _llama_qk_state(rng, prefix="", extra=()):
    w = {f"{prefix}{n}_proj.weight": rng.standard_normal(shape).astype(np.float32)
         for n, shape in (("q", (16, 16)), ("k", (8, 16)), ("v", (8, 16)), ("o", (16, 16)))}
    w.update({prefix + name: np.ones(4, np.float32) for name in extra})
    return w


@pytest.mark.parametrize("norm", ["q_norm.weight", "k_norm.weight"])
def test_llama_layout_refuses_per_head_qk_norms(norm):
    """Qwen3 / OLMo2 / Gemma3 keep q_norm / k_norm beside the projections: loading the
    projections alone gave relative errors of 0.75-0.83 against the model, silently."""
    rng = np.random.default_rng(0)
    state = _llama_qk_state(rng, "layers.0.self_attn.", extra=(norm,))
    with pytest.raises(ValueError, match=rf"'layers.0.self_attn.{norm}' is present: .*normalizes"):
        MHA.from_state_dict(state, "llama", num_heads=4, prefix="layers.0.self_attn.")
    plain = _llama_qk_state(rng, "layers.0.self_attn.")
    assert MHA.from_state_dict(plain, "llama", num_heads=4,
                               prefix="layers.0.self_attn.").num_kv_heads == 2


def test_gpt2_layout_names_cross_attention():
    e = 8
    state = {"c_attn.weight": np.zeros((e, 2 * e), np.float32),
             "c_attn.bias": np.zeros(2 * e, np.float32),
             "q_attn.weight": np.zeros((e, e), np.float32), "q_attn.bias": np.zeros(e, np.float32),
             "c_proj.weight": np.zeros((e, e), np.float32), "c_proj.bias": np.zeros(e, np.float32)}
    with pytest.raises(ValueError, match="'q_attn.weight' is present: this is GPT-2's "
                                         "cross-attention"):
        MHA.from_state_dict(state, "gpt2", num_heads=2)


def test_from_torch_names_what_it_needs():
    torch = _torch()
    for wrong in (torch.nn.Linear(4, 4), torch.nn.TransformerEncoderLayer(8, 2)):
        with pytest.raises(TypeError, match=r"must be a torch.nn.MultiheadAttention; got "
                                            + type(wrong).__name__):
            MHA.from_torch(wrong)


def test_bfloat16_and_requires_grad_tensors_are_read_like_the_others():
    """torch's .numpy() raised 'Got unsupported ScalarType BFloat16' (no argument named) and
    refused tensors that require grad as masks: they are widened to float32 (exact) and
    detached, as from_state_dict already did."""
    torch = _torch()
    torch_mha = torch.nn.MultiheadAttention(8, 2, batch_first=True).eval()
    exact = MHA.from_torch(torch_mha)
    bf16 = MHA.from_torch(torch_mha.to(torch.bfloat16))
    assert np.array_equal(bf16.in_proj_weight,
                          torch_mha.in_proj_weight.detach().float().numpy())
    assert not np.array_equal(bf16.in_proj_weight, exact.in_proj_weight)   # really rounded
    x = torch.randn(2, 3, 8).to(torch.bfloat16)
    x32 = x.float().numpy()
    mask = torch.zeros(3, 3, requires_grad=True)
    padding = torch.tensor([[False, False, True], [False, False, False]])
    got = bf16(x, attn_mask=mask, key_padding_mask=padding)
    assert got.dtype == np.float32
    assert_close(got, bf16(x32, attn_mask=np.zeros((3, 3), np.float32),
                           key_padding_mask=padding.numpy()))
    q = torch.randn(1, 2, 3, 4).to(torch.bfloat16)
    assert_close(mha_cy.scaled_dot_product_attention(q, q, q, attn_mask=mask),
                 mha_cy.scaled_dot_product_attention(*(q.float().numpy(),) * 3))
