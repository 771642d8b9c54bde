"""What the fast MultiHeadAttention and the reference one share: parameters, argument checks,
the KV cache bookkeeping. The computation itself is each subclass's `_forward`."""
import numpy as np

from . import _weights_io
from ._cache import KVCache
from ._cache_formats import cache_format
from ._call_plan import CachePlan
from ._checks import (as_array, as_float_array, check_attn_mask, check_bool_flag, check_dim,
                      check_head_mask, check_key_padding_mask, check_ndim, float_dtype,
                      positive_int, result_dtype, torch_to_numpy)
from ._window import check_window, require_causal
from .rope import call_positions, check_rope


class MultiHeadAttentionBase:
    """Multi-head attention with PyTorch's conventions (see mha_cy.MultiHeadAttention)."""

    _window = None      # the sliding window (mha_cy._window); None = unlimited

    def __init__(self, embed_dim, num_heads, *, num_kv_heads=None, head_dim=None, kdim=None,
                 vdim=None, bias=True, dtype=np.float32, seed=None, window=None, rope=None):
        window = check_window(window)
        embed_dim = positive_int(embed_dim, "embed_dim")
        num_heads = positive_int(num_heads, "num_heads")
        if head_dim is None:
            if embed_dim % num_heads:
                raise ValueError(f"num_heads ({num_heads}) must divide embed_dim ({embed_dim}) "
                                 "when head_dim is not given")
            head_dim = embed_dim // num_heads
        head_dim = positive_int(head_dim, "head_dim")
        num_kv_heads = self._check_kv_heads(num_kv_heads, num_heads)
        rope = check_rope(rope, head_dim)
        kdim = embed_dim if kdim is None else positive_int(kdim, "kdim")
        vdim = embed_dim if vdim is None else positive_int(vdim, "vdim")
        bias = check_bool_flag(bias, "bias")
        dt = float_dtype(dtype)
        rng = np.random.default_rng(seed)

        def xavier(rows, cols):           # torch.nn.init.xavier_uniform_
            bound = np.sqrt(6.0 / (rows + cols))
            return rng.uniform(-bound, bound, size=(rows, cols))

        n_q, n_kv = num_heads * head_dim, num_kv_heads * head_dim
        out_bound = 1.0 / np.sqrt(n_q)    # nn.Linear's default init of the output projection
        zeros = (lambda n: np.zeros(n)) if bias else (lambda n: None)
        self._setup(num_heads, num_kv_heads, dt,
                    xavier(n_q, embed_dim), xavier(n_kv, kdim), xavier(n_kv, vdim),
                    rng.uniform(-out_bound, out_bound, size=(embed_dim, n_q)),
                    zeros(n_q), zeros(n_kv), zeros(n_kv), zeros(embed_dim))
        self.window = window
        self._rope = rope

    @classmethod
    def from_weights(cls, q_weight, k_weight, v_weight, out_weight, *, num_heads,
                     num_kv_heads=None, q_bias=None, k_bias=None, v_bias=None, out_bias=None,
                     dtype=None, window=None, rope=None):
        """A module with the given weights, in nn.Linear layout (out_features, in_features).

        q_weight (num_heads * head_dim, embed_dim), k_weight (num_kv_heads * head_dim, kdim),
        v_weight (num_kv_heads * head_dim, vdim), out_weight (embed_dim, num_heads * head_dim);
        embed_dim, kdim, vdim and head_dim are read off the shapes. A missing bias is zero
        (some models have no bias on k only); no bias at all means bias=False. The arrays are
        copied. dtype: float32 or float64; None = float64 if any weight is float64 (or wider), else
        float32.
        window: the sliding window, as in the constructor.
        rope: None or a mha_cy.RoPE (rotary embeddings of the q and k heads).
        """
        window = check_window(window)
        num_heads = positive_int(num_heads, "num_heads")
        num_kv_heads = cls._check_kv_heads(num_kv_heads, num_heads)
        weights = {name: as_array(w, name) for name, w in (
            ("q_weight", q_weight), ("k_weight", k_weight), ("v_weight", v_weight),
            ("out_weight", out_weight))}
        for name, w in weights.items():
            check_ndim(w, name, (2,), "(out_features, in_features)")
        qw, kw, vw, ow = weights.values()
        dt = result_dtype(*weights.values()) if dtype is None else float_dtype(dtype)
        n_q, embed_dim = qw.shape
        if n_q == 0 or n_q % num_heads:
            raise ValueError(f"q_weight has {n_q} rows, which num_heads={num_heads} does not divide "
                             "into heads of head_dim >= 1")
        head_dim = n_q // num_heads
        rope = check_rope(rope, head_dim)
        n_kv = num_kv_heads * head_dim
        for name, w in (("k_weight", kw), ("v_weight", vw)):
            if w.shape[0] != n_kv:
                raise ValueError(f"{name} has {w.shape[0]} rows; expected num_kv_heads * head_dim "
                                 f"= {num_kv_heads} * {head_dim} = {n_kv}")
        if ow.shape != (embed_dim, n_q):
            raise ValueError(f"out_weight must have shape (embed_dim, num_heads * head_dim) = "
                             f"{(embed_dim, n_q)}; got {ow.shape}")
        for name, w in weights.items():
            if 0 in w.shape:
                raise ValueError(f"{name} has an empty axis: shape {w.shape}")
        biases = []
        for name, b, n in (("q_bias", q_bias, n_q), ("k_bias", k_bias, n_kv),
                           ("v_bias", v_bias, n_kv), ("out_bias", out_bias, embed_dim)):
            if b is not None:
                b = as_array(b, name)
                if b.shape != (n,):
                    raise ValueError(f"{name} must have shape ({n},); got {b.shape}")
            biases.append(b)
        if any(b is not None for b in biases):
            sizes = (n_q, n_kv, n_kv, embed_dim)
            biases = [np.zeros(n) if b is None else b for b, n in zip(biases, sizes)]
        self = cls.__new__(cls)
        self._setup(num_heads, num_kv_heads, dt, qw, kw, vw, ow, *biases)
        self.window = window
        self._rope = rope
        return self

    @classmethod
    def from_torch(cls, module, *, dtype=None):
        """A module with the weights of a ``torch.nn.MultiheadAttention`` (torch itself is not
        imported here). Its ``batch_first`` does not matter: mha_cy is always batch first.
        Dropout is ignored (inference). ``add_bias_kv`` and ``add_zero_attn`` have no
        equivalent and raise ValueError. dtype as in from_weights."""
        if not all(hasattr(module, n) for n in ("num_heads", "out_proj", "in_proj_weight")):
            raise TypeError(f"module must be a torch.nn.MultiheadAttention; got "
                            f"{type(module).__name__} (for a Hugging Face attention layer, use "
                            "from_state_dict(layer.state_dict(), layout))")
        if getattr(module, "bias_k", None) is not None or getattr(module, "bias_v", None) is not None:
            raise ValueError("module was made with add_bias_kv=True, which mha_cy does not support")
        if getattr(module, "add_zero_attn", False):
            raise ValueError("module was made with add_zero_attn=True, which mha_cy does not support")

        def param(name, value):
            return None if value is None else as_array(value, f"module.{name}")

        if getattr(module, "in_proj_weight", None) is not None:      # kdim == vdim == embed_dim
            q_weight, k_weight, v_weight = np.split(param("in_proj_weight", module.in_proj_weight), 3)
        else:
            q_weight, k_weight, v_weight = (param(n, getattr(module, n)) for n in (
                "q_proj_weight", "k_proj_weight", "v_proj_weight"))
        in_bias = param("in_proj_bias", getattr(module, "in_proj_bias", None))
        q_bias, k_bias, v_bias = (None,) * 3 if in_bias is None else np.split(in_bias, 3)
        return cls.from_weights(q_weight, k_weight, v_weight,
                                param("out_proj.weight", module.out_proj.weight),
                                num_heads=module.num_heads, q_bias=q_bias, k_bias=k_bias,
                                v_bias=v_bias, out_bias=param("out_proj.bias", module.out_proj.bias),
                                dtype=dtype)

    @classmethod
    def from_state_dict(cls, state, layout, *, num_heads, num_kv_heads=None, prefix="",
                        rope=None, window=None, dtype=None):
        """A module with the weights of one attention layer of another library's state dict.

        state: a mapping name -> array (NumPy arrays or torch tensors of any dtype, device or
        strides; keys that do not start with prefix, or that the layout does not read, are
        ignored, so a whole model's state dict works), or a path (str or pathlib.Path) to a
        .safetensors file (needs the safetensors package) or an .npz file.
        layout and the names it reads after prefix:
          "torch": in_proj_weight (or q_proj_weight, k_proj_weight, v_proj_weight),
                   in_proj_bias, out_proj.weight, out_proj.bias (nn.MultiheadAttention)
          "bert":  self.query/.key/.value.weight/.bias, output.dense.weight/.bias (BERT,
                   RoBERTa, MiniLM; prefix e.g. "encoder.layer.0.attention."; the LayerNorm
                   and residual of output stay outside)
          "gpt2":  c_attn.weight (in, 3 * out) and .bias, c_proj.weight (in, out) and .bias
                   (Conv1D, transposed here; GPT-2 attention is causal: call with is_causal)
          "llama": q_proj, k_proj, v_proj, o_proj .weight, each optional .bias (Llama,
                   Mistral, Qwen2)
        num_kv_heads: None = read off the key projection's rows (GQA models need no extra
        argument); given, it is checked. rope, window: passed to from_weights when not None.
        dtype as in from_weights. A missing key raises KeyError naming the full key and listing
        the keys found under prefix; a misshapen array ValueError with both shapes.
        """
        return _weights_io.from_state_dict(cls, state, layout, num_heads=num_heads,
                                           num_kv_heads=num_kv_heads, prefix=prefix, rope=rope,
                                           window=window, dtype=dtype)

    def save(self, path):
        """Write the weights and configuration (dtype, heads, rope, window) to an .npz file
        at exactly path (or into a binary file object); MultiHeadAttention.load reads it."""
        _weights_io.save(self, path)

    @classmethod
    def load(cls, path):
        """A module from a file written by save() (read with allow_pickle=False)."""
        return _weights_io.load(cls, path)

    def __getstate__(self):         # pickling keeps the q/k/v views into the packed arrays
        return _weights_io.getstate(self)

    def __setstate__(self, state):
        _weights_io.setstate(self, state)

    @staticmethod
    def _check_kv_heads(num_kv_heads, num_heads):
        if num_kv_heads is None:
            return num_heads
        num_kv_heads = positive_int(num_kv_heads, "num_kv_heads")
        if num_heads % num_kv_heads:
            raise ValueError(f"num_kv_heads ({num_kv_heads}) must divide num_heads ({num_heads})")
        return num_kv_heads

    def _setup(self, num_heads, num_kv_heads, dtype, qw, kw, vw, ow, qb, kb, vb, ob):
        """Store copies of the weights. When kdim == vdim == embed_dim, the q/k/v weights (and
        biases) are views into one packed array, so that self-attention needs one GEMM."""
        self._num_heads, self._num_kv_heads, self._dtype = num_heads, num_kv_heads, dtype
        self._kv_index = None     # uneven groups only (prune_heads): K/V head of each query head
        self._head_dim = qw.shape[0] // num_heads
        self._embed_dim, self._kdim, self._vdim = qw.shape[1], kw.shape[1], vw.shape[1]
        rows = np.cumsum([0, qw.shape[0], kw.shape[0], vw.shape[0]])
        if self.kdim == self.vdim == self.embed_dim:
            self._in_proj_weight = np.concatenate([qw, kw, vw]).astype(dtype, order="C")
            self._q_weight, self._k_weight, self._v_weight = (
                self._in_proj_weight[a:b] for a, b in zip(rows[:-1], rows[1:]))
        else:
            self._in_proj_weight = None
            self._q_weight, self._k_weight, self._v_weight = (
                np.array(w, dtype=dtype, order="C") for w in (qw, kw, vw))
        if qb is None:
            self._in_proj_bias = self._q_bias = self._k_bias = self._v_bias = None
            self._out_bias = None
        else:
            self._in_proj_bias = np.concatenate([qb, kb, vb]).astype(dtype)
            self._q_bias, self._k_bias, self._v_bias = (
                self._in_proj_bias[a:b] for a, b in zip(rows[:-1], rows[1:]))
            self._out_bias = np.array(ob, dtype=dtype)
        self._out_weight = np.array(ow, dtype=dtype, order="C")

    # The parameters, read-only attributes: edit them in place (they are views into the packed
    # arrays) or build a new module with from_weights. Assigning a new packed array would have
    # left the q/k/v views on the old one: the cross-attention path read stale weights.
    # The geometry, read-only too: `mha.num_heads = 2` was accepted and the next call failed
    # deep in a kernel ("linear_heads: inconsistent shapes"). prune_heads makes fewer heads.
    num_heads = property(lambda self: self._num_heads)
    num_kv_heads = property(lambda self: self._num_kv_heads)
    head_dim = property(lambda self: self._head_dim)
    embed_dim = property(lambda self: self._embed_dim)
    kdim = property(lambda self: self._kdim)
    vdim = property(lambda self: self._vdim)
    dtype = property(lambda self: self._dtype)
    in_proj_weight = property(lambda self: self._in_proj_weight)   # None unless kdim == vdim
    in_proj_bias = property(lambda self: self._in_proj_bias)       # == embed_dim
    q_weight = property(lambda self: self._q_weight)
    k_weight = property(lambda self: self._k_weight)
    v_weight = property(lambda self: self._v_weight)
    out_weight = property(lambda self: self._out_weight)
    q_bias = property(lambda self: self._q_bias)
    k_bias = property(lambda self: self._k_bias)
    v_bias = property(lambda self: self._v_bias)
    out_bias = property(lambda self: self._out_bias)
    rope = property(lambda self: self._rope)      # None or a mha_cy.RoPE

    @property
    def window(self):
        """None (no limit) or the sliding window, an int >= 1 (see mha_cy._window)."""
        return self._window

    @window.setter
    def window(self, window):   # checked as in the constructor: 0 or -1 once meant "no limit"
        self._window = check_window(window)   # to the kernels and "no key" to the reference

    @property
    def kv_head_index(self):
        """intp (num_heads,): the K/V head each query head reads; h // (num_heads //
        num_kv_heads) unless prune_heads left uneven groups. A copy."""
        if self._kv_index is not None:
            return self._kv_index.copy()
        return np.arange(self.num_heads) // (self.num_heads // self.num_kv_heads)

    def prune_heads(self, heads):
        """A new, smaller module without the query heads `heads` (see mha_cy._pruning)."""
        from ._pruning import prune_heads
        return prune_heads(self, heads)

    def __repr__(self):
        groups = "" if self._kv_index is None else f", kv_head_index={self._kv_index.tolist()}"
        return (f"{type(self).__name__}(embed_dim={self.embed_dim}, num_heads={self.num_heads}, "
                f"num_kv_heads={self.num_kv_heads}{groups}, head_dim={self.head_dim}, "
                f"kdim={self.kdim}, vdim={self.vdim}, bias={self.out_bias is not None}, "
                f"dtype={self.dtype}"
                + ("" if self.window is None else f", window={self.window}")
                + f", rope={self.rope!r})")

    def new_cache(self, batch_size, max_len, dtype=None):
        """An empty KV cache for incremental decoding of batch_size sequences up to max_len.
        dtype: None (the module dtype), np.float16, or "int8" (symmetric, one float32 scale
        per (batch, K/V head, position)); float16 and int8 need a float32 module (see
        mha_cy._cache_formats for their rounding and NaN/inf handling)."""
        storage = cache_format(dtype, self.dtype)
        return KVCache(positive_int(batch_size, "batch_size"), self.num_kv_heads,
                       positive_int(max_len, "max_len"), self.head_dim, self.dtype, storage)

    def __call__(self, query, key=None, value=None, *, key_padding_mask=None, attn_mask=None,
                 is_causal=False, need_weights=False, cache=None, lengths=None,
                 positions=None, head_mask=None):
        """Attend query (B, Lq, E) to key (B, Lk, kdim) / value (B, Lk, vdim); see the class doc.

        Returns out (B, Lq, E), or (out, weights) with weights (B, num_heads, Lq, Lk) when
        need_weights. 2-D inputs (one unbatched sequence) give 2-D/3-D results.
        head_mask: (num_heads,) or (B, num_heads) multipliers of each head's context before
        the output projection (0 drops the head, as torch/HF head_mask); weights are not
        multiplied.
        """
        dt = self.dtype
        query = as_float_array(query, "query", dt)
        check_ndim(query, "query", (2, 3), "(batch, length, embed_dim) or (length, embed_dim)")
        check_dim(query.shape[-1], self.embed_dim, "query", "last axis (embed_dim) of size")
        unbatched = query.ndim == 2
        self_attention = key is None
        if key is None:
            if self.kdim != self.embed_dim or self.vdim != self.embed_dim:
                raise ValueError(f"key is required: this module has kdim={self.kdim}, "
                                 f"vdim={self.vdim} != embed_dim={self.embed_dim}, so it cannot "
                                 "do self-attention")
            if value is not None:
                raise ValueError("value was given without key; pass key too (key=None means "
                                 "self-attention: key = value = query)")
            key = value = query
        else:
            key = as_float_array(key, "key", dt)
            value = key if value is None else as_float_array(value, "value", dt)
            for name, arr, dim, dim_name in (("key", key, self.kdim, "kdim"),
                                             ("value", value, self.vdim, "vdim")):
                check_ndim(arr, name, (query.ndim,), f"like query (query is {query.ndim}-D)")
                check_dim(arr.shape[-1], dim, name, f"last axis ({dim_name}) of size")
                if not unbatched:
                    check_dim(arr.shape[0], query.shape[0], name, "batch size")
            check_dim(value.shape[-2], key.shape[-2], "value", "length (must equal key's)")
        if unbatched:
            query, key, value = query[None], key[None], value[None]
            if key_padding_mask is not None:
                key_padding_mask = np.asarray(torch_to_numpy(key_padding_mask))
                if key_padding_mask.ndim == 1:
                    key_padding_mask = key_padding_mask[None]
            if lengths is not None and np.ndim(lengths) == 0:
                lengths = [lengths]
        B, Lq, _ = query.shape
        Lk = key.shape[1]
        is_causal = check_bool_flag(is_causal, "is_causal")
        need_weights = check_bool_flag(need_weights, "need_weights")

        # one call at a time per cache (RuntimeError from another thread's, nothing changed)
        guard = cache._claim() if isinstance(cache, KVCache) else None
        try:
            plan = None
            if cache is not None:
                if not self_attention:
                    raise ValueError("cache= is for self-attention decoding: key and value "
                                     "must be None")
                self._check_cache(cache, B)
                plan = CachePlan(cache, Lq, lengths)     # checks lengths and room; writes nothing
                Lk = plan.k_len
                is_causal = True        # a decoder's new tokens see only the cache and themselves
            elif lengths is not None:
                raise ValueError("lengths= is for ragged batches in a cache: pass cache= too")
            require_causal(self.window, is_causal)
            positions = call_positions(self.rope, positions, B, Lq, cache, self_attention)
            if key_padding_mask is not None:
                key_padding_mask = check_key_padding_mask(key_padding_mask, B, Lk)
            if attn_mask is not None:
                attn_mask = check_attn_mask(attn_mask, B, self.num_heads, Lq, Lk, dt)
            if head_mask is not None:
                head_mask = check_head_mask(head_mask, B, self.num_heads, dt)

            if 0 in (B, Lq, Lk):        # nothing to compute, or nothing to attend to: zero context
                out = np.zeros((B, Lq, self.embed_dim), dt)
                if self.out_bias is not None:
                    out += self.out_bias
                weights = np.zeros((B, self.num_heads, Lq, Lk), dt)
            else:
                out, weights = self._forward(query, key, value, self_attention, key_padding_mask,
                                             attn_mask, is_causal, need_weights, plan, positions,
                                             head_mask)
            if plan is not None:
                plan.zero_padding(out, weights)
                plan.commit()
        finally:
            if guard is not None:
                guard.release()
        if unbatched:
            out = out[0]
            weights = None if weights is None else weights[0]
        return (out, weights) if need_weights else out

    def _check_cache(self, cache, batch):
        if not isinstance(cache, KVCache):
            raise TypeError(f"cache must be a KVCache from new_cache(); got {type(cache).__name__}")
        mine = (self.num_kv_heads, self.head_dim, self.dtype)
        theirs = (cache.num_kv_heads, cache.head_dim, cache.compute_dtype)
        if mine != theirs:
            raise ValueError(f"cache has (num_kv_heads, head_dim, dtype) = {theirs}; this module "
                             f"needs {mine}: make it with this module's new_cache()")
        if cache.batch_size != batch:       # either may be the wrong one: name both
            raise ValueError(f"cache has batch_size {cache.batch_size} but query has batch "
                             f"{batch} (an unbatched query is batch 1): they must match")

    def _forward(self, query, key, value, self_attention, key_padding_mask, attn_mask,
                 is_causal, need_weights, plan, positions, head_mask):
        """out (B, Lq, E) and weights (B, H, Lq, Lk) or None. Inputs are checked 3-D arrays of
        the module dtype; masks as returned by the _checks functions; with a cache, plan is its
        CachePlan: append the new keys/values (plan.write) and attend over each sequence's own
        keys (the base zeroes the padding rows and commits). self.window applies.
        positions: None, or (with self.rope) the int64 (1 or B, Lq) RoPE positions of the query
        tokens: rotate q and k there before the cache and the attention. head_mask None or
        (1 or B, H), scaling each head's context. Query head h reads K/V head h // group, or
        self._kv_index[h] when that is not None."""
        raise NotImplementedError
