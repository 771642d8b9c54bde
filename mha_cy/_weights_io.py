"""Weights in and out: other libraries' state dicts, mha_cy's own .npz files, pickling.

MultiHeadAttentionBase's from_state_dict, save, load, __getstate__ and __setstate__ only call
the functions here, so that the module class stays about attention. Nothing here imports torch:
a torch tensor is converted through its own methods (.detach().cpu().numpy()).

A layout is a function reading one attention layer's arrays, by the names of one library, into
the nn.Linear-shaped (out_features, in_features) weights of from_weights. Every array is looked
up by its full key (prefix + name) and every shape is checked against what the others imply, so
that a wrong prefix, head count or file fails with the key, the expected and the actual shape.
"""
import json
import os
import pathlib
from collections.abc import Mapping

import numpy as np

from ._checks import positive_int, torch_to_numpy

# The version of the .npz files written by save(); load() refuses other versions.
FORMAT = "mha_cy.MultiHeadAttention/1"
_CONFIG_KEY = "config"


class MissingKeyError(KeyError):
    """A KeyError whose message prints as written (KeyError's own str() shows a repr)."""

    def __str__(self):
        return str(self.args[0])


# ---------------------------------------------------------------------------------------------
# Reading a state: a mapping, a .safetensors file or an .npz file

def _to_numpy(value, key):
    """A NumPy array from a NumPy array or a torch tensor (any device, dtype, strides, with or
    without requires_grad). bfloat16 and the float8 types have no NumPy dtype: they are widened
    to float32, which holds them exactly."""
    arr = np.asarray(torch_to_numpy(value))
    if arr.dtype.kind not in "fiu":
        raise TypeError(f"state[{key!r}] must hold real numbers; got dtype {arr.dtype}")
    return arr


class _State:
    """The keys of one layer: get(name) reads state[prefix + name] as a NumPy array."""

    def __init__(self, mapping, prefix, source):
        self.mapping, self.prefix, self.source = mapping, prefix, source

    def has(self, name):
        return self.prefix + name in self.mapping

    def get(self, name, required=True):
        key = self.prefix + name
        if key not in self.mapping:
            if not required:
                return None
            raise MissingKeyError(f"{self.source} has no key {key!r}; {self._found()}")
        return _to_numpy(self.mapping[key], key)

    def missing(self, *alternatives):
        keys = " or ".join(repr(self.prefix + a) for a in alternatives)
        return MissingKeyError(f"{self.source} has none of the keys {keys}; {self._found()}")

    def _found(self):
        keys = [str(k) for k in self.mapping.keys()]
        under = sorted(k for k in keys if k.startswith(self.prefix))
        if under:
            shown = ", ".join(under[:40]) + (", ..." if len(under) > 40 else "")
            return f"the keys under prefix {self.prefix!r} are: {shown}"
        shown = ", ".join(sorted(keys)[:20]) + (", ..." if len(keys) > 20 else "")
        return (f"no key starts with prefix {self.prefix!r} (a wrong prefix?); the state has "
                f"{len(keys)} keys: {shown or 'none'}")


def _open_state(state):
    """(mapping, a description for messages, a close function) for a mapping or a file path."""
    if isinstance(state, (str, os.PathLike)):
        path = pathlib.Path(state)
        if not path.is_file():
            raise FileNotFoundError(f"state: no such file: {str(path)!r}")
        suffix = path.suffix.lower()
        if suffix == ".safetensors":
            tensors = _SafetensorsFile(path)
            return tensors, path.name, tensors.close
        if suffix == ".npz":
            npz = np.load(path, allow_pickle=False)
            return npz, path.name, npz.close
        raise ValueError(f"state: a path must name a .safetensors or .npz file; got {str(path)!r}")
    if isinstance(state, Mapping) or (hasattr(state, "keys") and hasattr(state, "__getitem__")):
        return state, "state", lambda: None
    raise TypeError("state must be a mapping of names to arrays/tensors or a path (str or "
                    f"pathlib.Path) to a .safetensors or .npz file; got {type(state).__name__}")


class _SafetensorsFile(Mapping):
    """The tensors of a .safetensors file, read one at a time on access (taking one layer out
    of a whole model's file does not load the rest)."""

    def __init__(self, path):
        try:
            from safetensors import safe_open
        except ImportError:
            raise ImportError("reading .safetensors files needs the safetensors package: "
                              "pip install safetensors (or mha_cy[safetensors])") from None
        self._path = path
        self._handle = safe_open(str(path), framework="np")
        self._keys = list(self._handle.keys())

    def __getitem__(self, key):
        if key not in self._keys:
            raise KeyError(key)
        try:
            return self._handle.get_tensor(key)
        except TypeError:           # bfloat16: NumPy has no such dtype
            return _read_bfloat16(self._path, key)

    def __iter__(self):
        return iter(self._keys)

    def __len__(self):
        return len(self._keys)

    def close(self):
        self._handle = None


def _read_bfloat16(path, key):
    """A bfloat16 tensor of a .safetensors file as float32 (exact: bfloat16 is float32's top
    16 bits). The format: an 8-byte little-endian header size, a JSON header giving each
    tensor's dtype, shape and byte range after the header, then the data."""
    with open(path, "rb") as f:
        size = int.from_bytes(f.read(8), "little")
        info = json.loads(f.read(size))[key]
        if info["dtype"] != "BF16":
            raise TypeError(f"{key!r} in {path.name} has dtype {info['dtype']}, which NumPy "
                            "cannot hold")
        start, stop = info["data_offsets"]
        f.seek(8 + size + start)
        raw = np.frombuffer(f.read(stop - start), dtype="<u2")
    return (raw.astype(np.uint32) << 16).view(np.float32).reshape(info["shape"])


# ---------------------------------------------------------------------------------------------
# The layouts

def _check_shape(key, arr, expected, why):
    """expected: a tuple of ints, or None for a free axis."""
    ok = arr.ndim == len(expected) and all(e is None or e == a for e, a in zip(expected, arr.shape))
    if not ok:
        shown = "(" + ", ".join("*" if e is None else str(e) for e in expected) + \
            ("," if len(expected) == 1 else "") + ")"
        raise ValueError(f"{key!r} has shape {arr.shape}; expected {shown} ({why})")


def _heads(q_rows, k_rows, q_key, k_key, num_heads, num_kv_heads):
    """(head_dim, num_kv_heads) read off the q and k projections' rows."""
    if q_rows % num_heads:
        raise ValueError(f"{q_key!r} has {q_rows} rows, which num_heads={num_heads} does not "
                         "divide into heads")
    head_dim = q_rows // num_heads
    if num_kv_heads is None:
        if k_rows % head_dim or num_heads % (k_rows // head_dim or 1) or k_rows == 0:
            raise ValueError(f"{k_key!r} has {k_rows} rows, not a number of heads of head_dim "
                             f"{head_dim} dividing num_heads={num_heads}")
        num_kv_heads = k_rows // head_dim
    elif k_rows != num_kv_heads * head_dim:
        raise ValueError(f"{k_key!r} has {k_rows} rows; expected num_kv_heads * head_dim = "
                         f"{num_kv_heads} * {head_dim} = {num_kv_heads * head_dim}")
    return head_dim, num_kv_heads


def _linear_layout(s, names, num_heads, num_kv_heads, biases_required):
    """Four nn.Linear layers named names = (q, k, v, out), each with .weight / .bias, all
    reading the same input (self-attention layers: kdim = vdim = embed_dim)."""
    full = {role: s.prefix + n for role, n in zip("qkvo", names)}
    qw, kw, vw, ow = (s.get(n + ".weight") for n in names)
    _check_shape(full["q"] + ".weight", qw, (None, None), "(out_features, in_features)")
    _check_shape(full["k"] + ".weight", kw, (None, None), "(out_features, in_features)")
    head_dim, num_kv_heads = _heads(qw.shape[0], kw.shape[0], full["q"] + ".weight",
                                    full["k"] + ".weight", num_heads, num_kv_heads)
    n_q, embed_dim, n_kv = qw.shape[0], qw.shape[1], num_kv_heads * head_dim
    _check_shape(full["k"] + ".weight", kw, (n_kv, embed_dim),
                 "num_kv_heads * head_dim, in_features")
    _check_shape(full["v"] + ".weight", vw, (n_kv, embed_dim),
                 "num_kv_heads * head_dim, in_features")
    _check_shape(full["o"] + ".weight", ow, (embed_dim, n_q), "embed_dim, num_heads * head_dim")
    biases = {}
    for role, n, size in (("q", names[0], n_q), ("k", names[1], n_kv), ("v", names[2], n_kv),
                          ("out", names[3], embed_dim)):
        b = s.get(n + ".bias", required=biases_required)
        if b is not None:
            _check_shape(s.prefix + n + ".bias", b, (size,), "out_features")
        biases[role + "_bias"] = b
    return (qw, kw, vw, ow), num_kv_heads, biases


def _layout_torch(s, num_heads, num_kv_heads):
    """torch.nn.MultiheadAttention's state_dict."""
    for name in ("bias_k", "bias_v"):
        if s.has(name):
            raise ValueError(f"{s.prefix + name!r} is present: the module was made with "
                             "add_bias_kv=True, which mha_cy does not support")
    if s.has("in_proj_weight"):
        key = s.prefix + "in_proj_weight"
        packed = s.get("in_proj_weight")
        if packed.ndim != 2 or packed.shape[0] != 3 * packed.shape[1]:
            raise ValueError(f"{key!r} has shape {packed.shape}; expected (3 * embed_dim, "
                             "embed_dim) (q, k and v stacked)")
        qw, kw, vw = np.split(packed, 3)
    elif s.has("q_proj_weight"):
        qw, kw, vw = (s.get(n) for n in ("q_proj_weight", "k_proj_weight", "v_proj_weight"))
    else:
        raise s.missing("in_proj_weight", "q_proj_weight")
    ow = s.get("out_proj.weight")
    for n, w in (("q_proj_weight", qw), ("k_proj_weight", kw), ("v_proj_weight", vw)):
        _check_shape(s.prefix + n, w, (None, None), "(out_features, in_features)")
    head_dim, num_kv_heads = _heads(qw.shape[0], kw.shape[0], s.prefix + "q_proj_weight",
                                    s.prefix + "k_proj_weight", num_heads, num_kv_heads)
    n_q, embed_dim = qw.shape
    n_kv = num_kv_heads * head_dim
    _check_shape(s.prefix + "v_proj_weight", vw, (n_kv, None), "num_kv_heads * head_dim, vdim")
    _check_shape(s.prefix + "out_proj.weight", ow, (embed_dim, n_q),
                 "embed_dim, num_heads * head_dim")
    biases = dict.fromkeys(("q_bias", "k_bias", "v_bias", "out_bias"))
    in_bias = s.get("in_proj_bias", required=False)
    if in_bias is not None:
        _check_shape(s.prefix + "in_proj_bias", in_bias, (n_q + 2 * n_kv,), "q, k, v biases")
        biases["q_bias"], biases["k_bias"], biases["v_bias"] = np.split(in_bias, [n_q, n_q + n_kv])
    out_bias = s.get("out_proj.bias", required=False)
    if out_bias is not None:
        _check_shape(s.prefix + "out_proj.bias", out_bias, (embed_dim,), "embed_dim")
        biases["out_bias"] = out_bias
    return (qw, kw, vw, ow), num_kv_heads, biases


def _layout_bert(s, num_heads, num_kv_heads):
    """BERT/RoBERTa/MiniLM's BertAttention: self.{query,key,value} and output.dense."""
    return _linear_layout(s, ("self.query", "self.key", "self.value", "output.dense"),
                          num_heads, num_kv_heads, biases_required=True)


def _layout_llama(s, num_heads, num_kv_heads):
    """Llama/Mistral/Qwen2's attention: {q,k,v,o}_proj, each bias optional (Qwen2 has q/k/v)."""
    for name in ("q_norm.weight", "k_norm.weight"):
        if s.has(name):     # loading the projections alone gave relative errors of 0.75-0.83
            raise ValueError(f"{s.prefix + name!r} is present: the layer normalizes each head's "
                             "q and k before RoPE (Qwen3, OLMo2, Gemma3, Cohere's qk norm), "
                             "which mha_cy does not support")
    return _linear_layout(s, ("q_proj", "k_proj", "v_proj", "o_proj"),
                          num_heads, num_kv_heads, biases_required=False)


def _layout_gpt2(s, num_heads, num_kv_heads):
    """GPT-2's Conv1D layers, which store weights as (in_features, out_features)."""
    if s.has("q_attn.weight"):
        raise ValueError(f"{s.prefix + 'q_attn.weight'!r} is present: this is GPT-2's "
                         "cross-attention (q_attn for the queries, c_attn for keys and values), "
                         "which the 'gpt2' layout does not load (only self-attention)")
    attn_w, proj_w = s.get("c_attn.weight"), s.get("c_proj.weight")
    attn_b, proj_b = s.get("c_attn.bias"), s.get("c_proj.bias")
    key = s.prefix + "c_attn.weight"
    _check_shape(key, attn_w, (None, None), "(in_features, out_features): Conv1D")
    embed_dim = attn_w.shape[0]
    if embed_dim % num_heads:
        raise ValueError(f"{key!r} has shape {attn_w.shape}: num_heads={num_heads} does not "
                         f"divide its embed_dim {embed_dim}")
    head_dim = embed_dim // num_heads       # GPT-2: the queries are embed_dim wide
    num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
    n_kv = num_kv_heads * head_dim
    _check_shape(key, attn_w, (embed_dim, embed_dim + 2 * n_kv),
                 "embed_dim, q + k + v features: Conv1D stores (in, out)")
    _check_shape(s.prefix + "c_attn.bias", attn_b, (embed_dim + 2 * n_kv,), "q + k + v features")
    _check_shape(s.prefix + "c_proj.weight", proj_w, (embed_dim, embed_dim),
                 "embed_dim, embed_dim: Conv1D stores (in, out)")
    _check_shape(s.prefix + "c_proj.bias", proj_b, (embed_dim,), "embed_dim")
    cuts = [embed_dim, embed_dim + n_kv]
    qw, kw, vw = np.split(attn_w.T, cuts)
    qb, kb, vb = np.split(attn_b, cuts)
    return (qw, kw, vw, proj_w.T), num_kv_heads, dict(q_bias=qb, k_bias=kb, v_bias=vb,
                                                      out_bias=proj_b)


LAYOUTS = {"torch": _layout_torch, "bert": _layout_bert, "gpt2": _layout_gpt2,
           "llama": _layout_llama}


def from_state_dict(cls, state, layout, *, num_heads, num_kv_heads=None, prefix="", rope=None,
                    window=None, dtype=None):
    """See MultiHeadAttentionBase.from_state_dict."""
    if not isinstance(layout, str) or layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {sorted(LAYOUTS)}; got {layout!r}")
    if not isinstance(prefix, str):
        raise TypeError(f"prefix must be a str; got {type(prefix).__name__}")
    num_heads = positive_int(num_heads, "num_heads")
    if num_kv_heads is not None:
        num_kv_heads = positive_int(num_kv_heads, "num_kv_heads")
    mapping, source, close = _open_state(state)
    try:
        (qw, kw, vw, ow), num_kv_heads, biases = LAYOUTS[layout](
            _State(mapping, prefix, source), num_heads, num_kv_heads)
    finally:
        close()
    # rope/window only when given, so this works whether or not from_weights knows them.
    extra = {name: value for name, value in (("rope", rope), ("window", window))
             if value is not None}
    return cls.from_weights(qw, kw, vw, ow, num_heads=num_heads, num_kv_heads=num_kv_heads,
                            dtype=dtype, **biases, **extra)


# ---------------------------------------------------------------------------------------------
# mha_cy's own files: save / load

_WEIGHTS = ("q_weight", "k_weight", "v_weight", "out_weight")
_BIASES = ("q_bias", "k_bias", "v_bias", "out_bias")


def _config(module):
    config = {"format": FORMAT, "class": type(module).__name__, "dtype": module.dtype.name,
              "num_heads": module.num_heads, "num_kv_heads": module.num_kv_heads}
    rope = getattr(module, "rope", None)
    if rope is not None:
        config["rope"] = {"dim": rope.dim, "base": rope.base, "interleaved": rope.interleaved}
    window = getattr(module, "window", None)
    if window is not None:
        config["window"] = int(window)
    if getattr(module, "_kv_index", None) is not None:     # uneven groups (prune_heads)
        config["kv_head_index"] = module._kv_index.tolist()
    return config


def save(module, path):
    """See MultiHeadAttentionBase.save."""
    arrays = {name: getattr(module, name) for name in _WEIGHTS + _BIASES
              if getattr(module, name) is not None}
    arrays[_CONFIG_KEY] = np.array(json.dumps(_config(module)))
    if isinstance(path, (str, os.PathLike)):
        with open(path, "wb") as f:         # exactly this path (np.savez would append .npz)
            np.savez(f, **arrays)
    else:
        np.savez(path, **arrays)


def load(cls, path):
    """See MultiHeadAttentionBase.load."""
    with np.load(path, allow_pickle=False) as npz:
        if _CONFIG_KEY not in npz.files:
            raise ValueError(f"{path!r} is not a file written by MultiHeadAttention.save "
                             f"(no {_CONFIG_KEY!r} entry); its entries are {npz.files}")
        config = json.loads(str(npz[_CONFIG_KEY]))
        if config.get("format") != FORMAT:
            raise ValueError(f"{path!r} has format {config.get('format')!r}; this mha_cy reads "
                             f"{FORMAT!r}")
        arrays = {name: npz[name] for name in _WEIGHTS + _BIASES if name in npz.files}
    extra = {}
    if "rope" in config:
        import mha_cy
        if not hasattr(mha_cy, "RoPE"):
            raise ValueError(f"{path!r} holds a module with rotary embeddings, which this "
                             "version of mha_cy does not have")
        extra["rope"] = mha_cy.RoPE(**config["rope"])
    if "window" in config:
        extra["window"] = config["window"]
    weights = [arrays.pop(name) for name in _WEIGHTS]
    kv_index = config.get("kv_head_index")
    if kv_index is None:
        return cls.from_weights(*weights, num_heads=config["num_heads"],
                                num_kv_heads=config["num_kv_heads"], dtype=config["dtype"],
                                **arrays, **extra)
    # uneven groups: from_weights checks an MHA module with each K/V head repeated per query
    # head, which regroup() then shares again
    from ._pruning import regroup
    kv_index = np.asarray(kv_index, dtype=np.intp)
    if (kv_index.shape != (config["num_heads"],) or kv_index.min() < 0
            or np.unique(kv_index).size != config["num_kv_heads"]
            or kv_index.max() != config["num_kv_heads"] - 1):
        raise ValueError(f"{path!r} has kv_head_index {kv_index.tolist()}, which does not map "
                         f"{config['num_heads']} query heads onto {config['num_kv_heads']} "
                         "K/V heads")
    d = weights[0].shape[0] // config["num_heads"]
    rows = (kv_index[:, None] * d + np.arange(d)).ravel()
    for i in (1, 2):
        weights[i] = weights[i][rows]
    for name in ("k_bias", "v_bias"):
        if name in arrays:
            arrays[name] = arrays[name][rows]
    return regroup(cls.from_weights(*weights, num_heads=config["num_heads"],
                                    dtype=config["dtype"], **arrays, **extra), kv_index)


# ---------------------------------------------------------------------------------------------
# Pickling: arrays that are views into another attribute stay views

def getstate(module):
    """The module's __dict__, with every array that views another array attribute (q/k/v
    weights into in_proj_weight, ...) replaced by where it sits in that array, since pickle
    would otherwise store it as an independent copy and in-place edits would stop reaching the
    packed array."""
    state = dict(module.__dict__)
    # an owner: an array attribute that others view (its own .base may be anything, e.g. the
    # buffer an earlier unpickling made); C-contiguous, so that views can be rebuilt on it
    owners = {id(v): k for k, v in state.items()
              if isinstance(v, np.ndarray) and v.flags.c_contiguous}
    views = {}
    for name, value in state.items():
        if (isinstance(value, np.ndarray) and value.base is not None
                and owners.get(id(value.base), name) != name):
            base = value.base
            offset = (value.__array_interface__["data"][0]
                      - base.__array_interface__["data"][0])
            views[name] = (owners[id(base)], offset, value.shape, value.strides)
    for name in views:
        del state[name]
    state["__views__"] = views
    return state


# Attributes that became read-only properties, under the names pickles made before keep them.
_RENAMED = {name: "_" + name for name in (
    "in_proj_weight", "in_proj_bias", "window", "num_heads", "num_kv_heads", "head_dim",
    "embed_dim", "kdim", "vdim", "dtype")}


def setstate(module, state):
    state = {_RENAMED.get(name, name): value for name, value in state.items()}
    views = {name: (_RENAMED.get(owner, owner), *where)
             for name, (owner, *where) in state.pop("__views__", {}).items()}
    module.__dict__.update(state)
    for name, (owner, offset, shape, strides) in views.items():
        base = state[owner]
        module.__dict__[name] = np.ndarray(shape, base.dtype, buffer=base, offset=offset,
                                           strides=strides)
    if "_window" in state:      # an old pickle's plain attribute may hold any value: check it
        module.window = state["_window"]
