"""Rotary position embeddings (RoPE): the configuration, and the positions of one call.

The rotation itself runs in mha_cy/_rope_kernel.pyx (src/rope.c) on the fast path and in
mha_cy.reference as a NumPy formula. This module only describes it and checks arguments, so
that MultiHeadAttention's __call__ needs one line for it.
"""
import math
import numbers

import numpy as np

from ._checks import check_bool_flag, positive_int, real_as_float, torch_to_numpy

__all__ = ["RoPE"]


class RoPE:
    """Rotary position embeddings of q and k (Llama, Mistral, Qwen, GPT-NeoX, GPT-J).

    RoPE(dim=None, base=10000.0, interleaved=False), given to MultiHeadAttention(rope=...) or
    from_weights(rope=...): the query and key heads of self-attention are rotated after the
    projections and before the attention (a KV cache stores the rotated keys).

    - dim: features rotated per head; None = head_dim. Even, <= head_dim (checked when given
      to a module); smaller = partial rotary: the first dim features rotate, the rest pass
      through unchanged.
    - base: > 0, finite; inv_freq[i] = base ** (-2i / dim) for i < dim / 2, and the token at
      position p turns its pair i by the angle p * inv_freq[i] (computed in float64).
    - interleaved=False: the half-split layout of HF Llama / GPT-NeoX (rotate_half: feature i
      pairs with i + dim / 2); True: the GPT-J layout (features 2i and 2i + 1 pair).

    Immutable, comparable (==) and picklable.
    """

    def __init__(self, dim=None, base=10000.0, interleaved=False):
        if dim is not None:
            dim = positive_int(dim, "dim")
            if dim % 2:
                raise ValueError(f"RoPE dim must be even (features rotate in pairs); got {dim}")
        if isinstance(base, (bool, np.bool_)) or not isinstance(base, numbers.Real):
            raise TypeError(f"RoPE base must be a real number; got {base!r}")
        value = real_as_float(base)
        if not (math.isfinite(value) and value > 0):
            raise ValueError(f"RoPE base must be finite and > 0; got {base}")
        base = value
        self._dim, self._base = dim, base
        self._interleaved = check_bool_flag(interleaved, "interleaved")
        self._inv_freq = {}         # head_dim -> inv_freq, filled on first use

    dim = property(lambda self: self._dim)
    base = property(lambda self: self._base)
    interleaved = property(lambda self: self._interleaved)

    def rotary_dim(self, head_dim):
        """The number of rotated features for heads of head_dim features (ValueError if dim
        does not fit)."""
        dim = head_dim if self._dim is None else self._dim
        if dim > head_dim:
            raise ValueError(f"RoPE dim ({dim}) must be <= head_dim ({head_dim})")
        if dim % 2:
            raise ValueError(f"RoPE(dim=None) rotates all head_dim = {head_dim} features, which "
                             "must be even (features rotate in pairs); give an even dim for "
                             "partial rotary")
        return dim

    def inv_freq(self, head_dim):
        """float64 (rotary_dim / 2,): base ** (-2i / rotary_dim), read-only."""
        freq = self._inv_freq.get(head_dim)
        if freq is None:
            dim = self.rotary_dim(head_dim)
            freq = self._base ** (-np.arange(0, dim, 2, dtype=np.float64) / dim)
            freq.flags.writeable = False
            self._inv_freq[head_dim] = freq
        return freq

    def __repr__(self):
        return f"RoPE(dim={self._dim}, base={self._base!r}, interleaved={self._interleaved})"

    def __eq__(self, other):
        if not isinstance(other, RoPE):
            return NotImplemented
        return self._key() == other._key()

    def __hash__(self):
        return hash(self._key())

    def __reduce__(self):           # the configuration only, not the inv_freq memo
        return (RoPE, self._key())

    def _key(self):
        return (self._dim, self._base, self._interleaved)


def check_rope(rope, head_dim):
    """rope as a module with heads of head_dim features keeps it: None or a fitting RoPE."""
    if rope is None:
        return None
    if not isinstance(rope, RoPE):
        raise TypeError(f"rope must be a mha_cy.RoPE or None; got {type(rope).__name__}")
    rope.rotary_dim(head_dim)
    return rope


def call_positions(rope, positions, batch, q_len, cache, self_attention):
    """The RoPE positions of one call's query tokens: an int64 (1 or batch, q_len) array (one
    row = shared by the batch), or None when the module has no RoPE.

    positions: None, or int (q_len,) or (batch, q_len), >= 0. None means 0 .. q_len - 1, or,
    with a cache, each sequence's cached length + 0 .. q_len - 1 (cache.lengths when the cache
    keeps one length per sequence, else cache.length).
    """
    if rope is None:
        if positions is not None:
            raise ValueError("positions was given, but this module has no rotary embeddings "
                             "(rope=None); make it with rope=mha_cy.RoPE(...)")
        return None
    if not self_attention:
        raise ValueError(f"this module has rope={rope!r}, which applies to self-attention only; "
                         "key and value must be None")
    if positions is None:       # one arange for the common cases (a decode step's overhead)
        lengths = None if cache is None else getattr(cache, "lengths", None)
        if lengths is None:
            start = 0 if cache is None else cache.length
            return np.arange(start, start + q_len, dtype=np.int64)[None]
        return np.asarray(lengths, dtype=np.int64).reshape(-1, 1) + np.arange(q_len)
    return _check_positions(positions, batch, q_len)


def _check_positions(positions, batch, q_len):
    arr = np.asarray(torch_to_numpy(positions))
    if arr.dtype.kind not in "iu":
        raise TypeError(f"positions must be an integer array; got dtype {arr.dtype}")
    if arr.shape not in ((q_len,), (batch, q_len)):
        raise ValueError(f"positions must have shape (query_len,) = ({q_len},) or "
                         f"(batch, query_len) = {(batch, q_len)}; got {arr.shape}")
    if arr.size:
        low, high = arr.min(), arr.max()
        if low < 0:
            raise ValueError(f"positions must be >= 0; got {low}")
        if high > np.iinfo(np.int64).max:
            raise ValueError(f"positions must be < 2**63; got {high}")
    return np.ascontiguousarray(arr[None] if arr.ndim == 1 else arr, dtype=np.int64)
