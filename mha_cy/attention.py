"""The fast path: MultiHeadAttention and scaled_dot_product_attention on the compiled kernels.

One forward of self-attention is three parallel kernel calls and no Python loop:
  x (B*L, E) --linear--> QKV (B*L, (Hq + 2 Hkv) * D)      one GEMM on the packed weights
  QKV --attention--> context (B*L, Hq * D)                 heads read/written in place
  context --linear--> out (B*L, E)                         W_O mixes the heads
BLAS is held at one thread around them: all parallelism is the kernels' own OpenMP threads.
"""
import math

import numpy as np

from . import _attention_kernel, _linear_kernel, _rope_kernel, _step_kernel
from ._aligned_arrays import empty_lines
from ._cache import KVCache
from ._checks import check_sdpa_inputs
from ._module import MultiHeadAttentionBase
from ._scratch import Scratch
from ._threads import blas_single_threaded, kernel_threads
from ._window import check_window, require_causal

__all__ = ["MultiHeadAttention", "scaled_dot_product_attention"]


# BLAS takes 32-bit leading dimensions, and the row functions 32-bit key counts.
_INT_MAX = 2 ** 31 - 1


def _blas_operand(x):
    """A (B, H, L, D) view as the kernel needs it: last axis contiguous, non-negative strides
    and rows (and heads) at least D and at most 2**31 - 1 elements apart, as BLAS leading
    dimensions must be (a larger stride would be truncated to 32 bits: wrong rows, silently).
    Views of a projection or a cache already are; anything else is copied (also a view whose
    address is not a multiple of the item size: the C kernels' loads assume aligned REALs,
    and an unaligned load is undefined behaviour)."""
    item, d = x.itemsize, x.shape[3]
    s = x.strides
    # the row stride is a BLAS leading dimension even for one row (NumPy calls a 1-row view
    # with stride 0 contiguous; BLAS refuses ld 0 and leaves its output unwritten)
    ok = (x.flags.aligned and s[3] == item and all(st >= 0 and st % item == 0 for st in s)
          and d * item <= s[2] <= _INT_MAX * item
          and (x.shape[1] <= 1 or d * item <= s[1] <= _INT_MAX * item))
    return x if ok else np.array(x, order="C")    # a copy (ascontiguousarray keeps unaligned)


def _check_32_bit_sizes(q, k, weights):
    """What no copy can bring within BLAS's 32-bit arguments: refuse it, naming the size."""
    if weights is not None and k.shape[2] > _INT_MAX:
        raise ValueError(f"need_weights with {k.shape[2]} keys: at most {_INT_MAX} keys per "
                         "row are supported (32-bit BLAS and row lengths)")
    for name, x in (("q", q), ("k", k)):
        if x.shape[2] > 1 and x.strides[2] // x.itemsize > _INT_MAX:
            raise ValueError(f"{name} has rows {x.strides[2] // x.itemsize} elements apart; "
                             f"at most {_INT_MAX} are supported (32-bit BLAS)")


def _additive(attn_mask, dtype):
    """attn_mask as the kernels add it: a bool mask becomes 0 (may attend) / -inf of dtype;
    any other mask is returned as it is."""
    if attn_mask.dtype == np.bool_:
        return np.where(attn_mask, dtype.type(0), dtype.type(-np.inf))
    return attn_mask


def _kernel_masks(attn_mask, key_padding_mask, shape, dtype):
    """The kernel's mask arguments: an additive view broadcast to `shape` (a bool mask becomes
    0 / -inf) and key padding as uint8."""
    add = None
    if attn_mask is not None:
        attn_mask = _additive(attn_mask, dtype)
        if not attn_mask.flags.aligned:           # the row functions read it as REAL *
            attn_mask = attn_mask.copy()
        add = np.broadcast_to(attn_mask, shape)
    pad = None
    if key_padding_mask is not None:
        pad = np.ascontiguousarray(key_padding_mask).view(np.uint8)
    return add, pad


def _attend(q, k, v, out, attn_mask, key_padding_mask, is_causal, scale, weights, n_threads,
            window=None, ragged=None, kv_index=None, k_scale=None, v_scale=None):
    """out[...] = attention of q over k, v ((B, H, L, D) views as _blas_operand returns them),
    weights filled if given; window: None or an int (with is_causal); ragged: the kernel's
    per-sequence counts (CachePlan.kernel_ragged) or None; kv_index: the K/V head of each
    query head, None = even groups. k, v may be a float16 / int8 cache's storage views (with
    an int8 cache's k_scale, v_scale): the kernel reads them in that format."""
    _check_32_bit_sizes(q, k, weights)
    add = pad = None
    if attn_mask is not None or key_padding_mask is not None:
        add, pad = _kernel_masks(attn_mask, key_padding_mask,
                                 q.shape[:3] + (k.shape[2],), q.dtype)
    _attention_kernel.attention(q, k, v, out, add, pad, is_causal, scale, weights, n_threads,
                                window or 0, ragged, kv_index, k_scale, v_scale)


def scaled_dot_product_attention(q, k, v, *, attn_mask=None, is_causal=False, scale=None,
                                 window=None):
    """softmax(q k^T * scale + mask) v for every batch and head.

    q (B, Hq, Lq, D); k (B, Hkv, Lk, D); v (B, Hkv, Lk, Dv) with Hq % Hkv == 0: query head h
    reads key/value head h // (Hq / Hkv) (GQA, MQA with Hkv = 1; K/V are not repeated).
    attn_mask: bool (True = may attend) or additive, shaped (Lq, Lk), (B, Lq, Lk) or (B, Hq, Lq,
    Lk), axes of size 1 broadcast (a bool (B, 1, 1, Lk) padding mask runs as key padding: a
    sequence's padded tail is skipped, not masked). is_causal: query i sees keys j <= i + Lk -
    Lq (diagonal at the bottom right). scale: default 1/sqrt(D). A row with every key masked
    gives zeros. window: None or an int >= 1, with is_causal only: query i sees just the keys i
    + Lk - Lq - window < j <= i + Lk - Lq (sliding-window attention; the keys before the window
    are not read). Returns (B, Hq, Lq, Dv), float64 if any input is float64 (or wider) else
    float32.
    """
    if (attn_mask is None and scale is None and window is None
            and (is_causal is False or is_causal is True)):
        # the common call, on arrays the kernel takes as they are: one compiled call that
        # checks them (None: not plain, the general checks below name what is wrong)
        out = _attention_kernel.sdpa(q, k, v, is_causal, kernel_threads())
        if out is not None:
            return out
    window = check_window(window)
    q, k, v, attn_mask, is_causal, scale = check_sdpa_inputs(q, k, v, attn_mask, is_causal, scale)
    require_causal(window, is_causal)
    shape = q.shape[:3] + (v.shape[3],)
    if 0 in shape or k.shape[2] == 0:             # nothing to compute or to attend to
        return np.zeros(shape, dtype=q.dtype)
    out = np.empty(shape, dtype=q.dtype)
    padding = None if attn_mask is None else _as_key_padding(attn_mask, q.shape[0], k.shape[2])
    if padding is not None:
        attn_mask = None
    with blas_single_threaded():
        _attend(_blas_operand(q), _blas_operand(k), _blas_operand(v), out, attn_mask, padding,
                is_causal, scale, None, kernel_threads(), window)
    return out


def _as_key_padding(mask, batch, k_len):
    """A bool attn_mask (4-D, as check_attn_mask gives it) that varies only along the batch and
    the keys, (B or 1, 1, 1, Lk or 1): PyTorch's usual padding mask. As key padding (B, Lk),
    True = hidden, the kernel skips each sequence's trailing padded key tiles and reads no
    additive mask, with the same results (a hidden key weighs +0 either way). None for other
    masks. (Broadcast to k_len, not to the mask's last axis: a key axis of size 1 made a
    (B, 1) padding that the kernel read Lk bytes of.)"""
    if mask.dtype != np.bool_ or mask.shape[1] != 1 or mask.shape[2] != 1:
        return None
    return np.logical_not(np.broadcast_to(mask[:, 0, 0, :], (batch, k_len)))


def _token_rows(x):
    """A (B, L, in) array as the (B * L, in) C-contiguous, aligned rows the linear kernel reads
    (copied if needed: unaligned REAL * loads are UB in C)."""
    if not (x.flags.c_contiguous and x.flags.aligned):
        x = np.array(x, order="C")
    return x.reshape(x.shape[0] * x.shape[1], x.shape[2])


def _linear(x, weight, bias, n_threads):
    """(B, L, in) @ weight.T + bias -> (B, L, out), on the threads of the linear kernel."""
    batch, length, _ = x.shape
    out = np.empty((batch * length, weight.shape[0]), dtype=x.dtype)
    _linear_kernel.linear(_token_rows(x), weight, bias, out, n_threads)
    return out.reshape(batch, length, -1)


def _linear_heads(x, weight, bias, heads, head_dim, n_threads, scratch=None, name=None,
                  padding=None, padding_from=0):
    """(B, L, in) @ weight.T + bias split into heads: a C-contiguous (B, heads, L, head_dim)
    array (each head's rows contiguous, as the attention kernel reads them fastest), in the
    scratch buffer `name` of a Lease (_scratch.py), or new. padding: None or a bool (B, L)
    key padding mask: the heads from padding_from on are K/V heads, and the rows of padded
    keys may be left 0 there (the attention reads none of them: linear_heads' skip_rows)."""
    batch, length, _ = x.shape
    shape = (batch, heads, length, head_dim)         # rows read in whole vectors: on lines
    out = empty_lines(shape, x.dtype) if scratch is None else scratch.array(name, shape, x.dtype)
    skip = None if padding is None else padding.reshape(-1)
    _linear_kernel.linear_heads(_token_rows(x), weight, bias, out, n_threads, skip,
                                padding_from * head_dim)
    return out


def _rotate_qk(qkv, heads, kv_heads, rope, positions, n_threads):
    """RoPE in place on the query and key heads of a (B, heads + 2 kv_heads, L, D) QKV view,
    at int64 (1 or B, L) positions."""
    _rope_kernel.rope(qkv[:, :heads + kv_heads], positions, rope.inv_freq(qkv.shape[3]),
                      rope.interleaved, n_threads)


def _split_heads(x, heads, head_dim):
    """(B, L, heads * head_dim) -> (B, heads, L, head_dim) view."""
    return x.reshape(x.shape[0], x.shape[1], heads, head_dim).transpose(0, 2, 1, 3)


class MultiHeadAttention(MultiHeadAttentionBase):
    """Multi-head attention for CPU inference, with PyTorch's conventions.

    mha = MultiHeadAttention(embed_dim, num_heads, *, num_kv_heads=None, head_dim=None,
                             kdim=None, vdim=None, bias=True, dtype=np.float32, seed=None,
                             window=None, rope=None)
    out = mha(query, key=None, value=None, *, key_padding_mask=None, attn_mask=None,
              is_causal=False, need_weights=False, cache=None, lengths=None, positions=None)

    - query (B, Lq, E) (or (Lq, E), unbatched); key=None: self-attention; value=None: value = key.
    - num_kv_heads: None = num_heads (MHA), 1 = MQA, a divisor of num_heads = GQA.
    - key_padding_mask: bool (B, Lk), True = padding (ignored).
    - attn_mask: bool (True = may attend) or float (added to the scores), shaped (Lq, Lk),
      (B, Lq, Lk) or (B, num_heads, Lq, Lk); size-1 axes broadcast. Masks combine.
    - is_causal: query i sees keys j <= i + Lk - Lq (bottom-right diagonal, as with a cache).
    - need_weights: also return the per-head weights (B, num_heads, Lq, Lk).
    - cache: a KVCache from new_cache(); the call appends the keys/values of query and attends
      causally over everything cached. A failed call leaves the cache as it was.
    - window: sliding-window attention (Mistral), with is_causal or a cache: query i sees the
      keys i + Lk - Lq - window < j <= i + Lk - Lq only. None = unlimited.
    - lengths: int (B,), with a cache (ragged batches of right-padded prompts): sequence b
      appends only its first lengths[b] tokens, at its own position cache.lengths[b], and
      attends to its own tokens; its output rows past lengths[b] are 0 (no bias).
    - head_mask: (num_heads,) or (B, num_heads) multipliers of each head's context before W_O
      (0 drops the head); the returned weights are not multiplied. prune_heads(heads) removes
      heads for good (a smaller, faster module with the same output as zeros in head_mask).
    - rope: a mha_cy.RoPE: rotary embeddings of the q and k heads (self-attention only; the
      cache stores rotated keys). positions: int (Lq,) or (B, Lq), the query tokens' RoPE
      positions; default 0 .. Lq - 1 after each sequence's cached tokens.
    Weights are nn.Linear-shaped (out_features, in_features): q_weight, k_weight, v_weight,
    out_weight, q_bias, ... (the q/k/v ones are views of in_proj_weight when kdim == vdim ==
    embed_dim). Output dtype is the module dtype (float32 or float64); other inputs are converted.
    The module keeps its intermediates' memory between calls (never what a call returns);
    release_scratch() frees it.
    """

    def __call__(self, query, key=None, value=None, *, key_padding_mask=None, attn_mask=None,
                 is_causal=False, need_weights=False, cache=None, lengths=None,
                 positions=None, head_mask=None):
        # The common call, mha(x) or mha(x, is_causal=True) on a 3-D array of the module's
        # dtype, has nothing to check but the array itself: it skips the general argument
        # handling (about a quarter of a tiny layer's time). With a key_padding_mask or an
        # attn_mask array, the compiled small call checks them (else the general path).
        # Everything else takes that path.
        if (key is None and value is None
                and cache is None and lengths is None and need_weights is False
                and positions is None and head_mask is None
                and (is_causal is True or (is_causal is False and self.window is None))
                and type(query) is np.ndarray and query.ndim == 3
                and query.dtype == self.dtype and query.shape[2] == self.embed_dim
                and query.shape[0] and query.shape[1] and self.in_proj_weight is not None):
            if key_padding_mask is None and attn_mask is None:
                return self._self_attention(query, is_causal)
            if ((key_padding_mask is None or type(key_padding_mask) is np.ndarray)
                    and (attn_mask is None or type(attn_mask) is np.ndarray)):
                # (checked by the compiled call; a bool mask made additive as the general
                # path makes it)
                add = None if attn_mask is None else _additive(attn_mask, self.dtype)
                out = self._small_self_attention(query, is_causal, key_padding_mask, add)
                if out is not None:
                    return out
        # The common decode step, mha(x, cache=cache): the same, for a cache of this module's
        # geometry (the general path costs a small model's step several times its kernels),
        # stored in the module dtype, float16 or int8 (E = 64, 4 heads, 16 cached tokens, 1
        # thread: 14 / 15 / 15 us; float16 / int8 took the general path's 120 / 230 us before).
        # The compiled step checks the shapes and dtypes of query, cache and weights itself
        # (mismatches go to the general path, which names them).
        if (cache is not None and type(cache) is KVCache and key is None and value is None
                and key_padding_mask is None and attn_mask is None and lengths is None
                and need_weights is False
                and positions is None and head_mask is None
                and (is_causal is True or is_causal is False)
                and type(query) is np.ndarray and query.ndim == 3
                and self.in_proj_weight is not None):
            return self._cached_step(query, cache)
        return super().__call__(query, key, value, key_padding_mask=key_padding_mask,
                                attn_mask=attn_mask, is_causal=is_causal,
                                need_weights=need_weights, cache=cache, lengths=lengths,
                                positions=positions, head_mask=head_mask)

    def release_scratch(self):
        """Free the scratch arrays the module keeps between calls (its projections' heads and
        the attention's context, reused to spare each call the page faults of fresh memory:
        mha_cy/_scratch.py); the next call allocates them again."""
        self._scratch().release()

    def _scratch(self):
        """This module's Scratch (made on first use: also for modules unpickled without one)."""
        scratch = self.__dict__.get("_scratch_buffers")
        if scratch is None:
            scratch = self._scratch_buffers = Scratch()
        return scratch

    def _self_attention(self, x, is_causal):
        """Self-attention of a checked, non-empty (B, L, E) array: one QKV projection, the
        attention kernel, the output projection. _forward's self-attention branch without its
        cache, mask, weights and positions handling: calling _forward instead cost the tiny
        layer 5-10 us of its 61-66 (measured)."""
        batch, length, _ = x.shape
        heads, kv_heads, d = self.num_heads, self.num_kv_heads, self.head_dim
        n_threads = kernel_threads()
        out = self._small_self_attention(x, is_causal, None, None, n_threads)
        if out is not None:                # a small call: one compiled call
            return out
        with blas_single_threaded(), self._scratch().lease() as scratch:
            qkv = _linear_heads(x, self.in_proj_weight, self.in_proj_bias, heads + 2 * kv_heads,
                                d, n_threads, scratch, "qkv")
            if self.rope is not None:      # positions 0 .. L - 1 for every sequence
                _rotate_qk(qkv, heads, kv_heads, self.rope,
                           np.arange(length, dtype=np.int64)[None], n_threads)
            context = scratch.array("context", (batch, length, heads * d), self.dtype)
            _attention_kernel.attention(qkv[:, :heads], qkv[:, heads:heads + kv_heads],
                                        qkv[:, heads + kv_heads:],
                                        _split_heads(context, heads, d), None, None,
                                        is_causal, 1.0 / math.sqrt(d), None, n_threads,
                                        self.window or 0, None, self._kv_index)
            return _linear(context, self.out_weight, self.out_bias, n_threads)

    def _small_self_attention(self, x, is_causal, key_padding_mask, attn_mask, n_threads=None):
        """_step_kernel.self_attention for this module (None where it does not apply)."""
        return _step_kernel.self_attention(
            x, is_causal, key_padding_mask, attn_mask, self.in_proj_weight, self.in_proj_bias,
            self.out_weight, self.out_bias, self.num_heads, self.num_kv_heads, self._kv_index,
            self.head_dim, self.window or 0, *self._rope_tables(),
            kernel_threads() if n_threads is None else n_threads)

    def _cached_step(self, x, cache):
        """Append a (B, L, E) array to a cache and attend causally over it: the compiled step
        (_step_kernel.decode_step) where it applies, which checks the shapes, dtypes and the
        cache's room itself, else the general path (which names what is wrong). A failed
        call changes nothing: the compiled step writes only once everything has passed."""
        guard = cache._guard                # one call at a time per cache (_claim, inlined:
        if not guard.acquire(False):        # a small model's step takes ~5 us)
            guard = cache._claim()          # raises
        try:
            start = cache._equal_length     # None: a ragged cache, each sequence at its own
            out = self._compiled_step(x, cache, cache._lengths if start is None else start)
            if out is None:
                return super().__call__(x, cache=cache)
            cache._advance(x.shape[1])
        finally:
            guard.release()
        return out

    def _compiled_step(self, x, cache, start):
        """_step_kernel.decode_step for this module (None where it does not apply)."""
        return _step_kernel.decode_step(
            x, start, cache.key, cache.value, cache.key_scale, cache.value_scale,
            self.in_proj_weight, self.in_proj_bias, self.out_weight, self.out_bias,
            self.num_heads, self.num_kv_heads, self._kv_index, self.window or 0,
            *self._rope_tables(), kernel_threads())

    def _rope_tables(self):
        """(inv_freq, interleaved) of the compiled calls: (None, False) without RoPE."""
        rope = self.rope
        return (None, False) if rope is None else (rope.inv_freq(self.head_dim),
                                                   rope.interleaved)

    def _forward(self, query, key, value, self_attention, key_padding_mask, attn_mask,
                 is_causal, need_weights, plan, positions, head_mask):
        batch, q_len, _ = query.shape
        heads, kv_heads, d = self.num_heads, self.num_kv_heads, self.head_dim
        n_q = heads * d
        n_threads = kernel_threads()
        # Padded keys: their K/V rows are not computed (0s), unless a cache keeps them
        padding = key_padding_mask if plan is None else None
        with blas_single_threaded(), self._scratch().lease() as scratch:
            if self_attention and self.in_proj_weight is not None:
                qkv = _linear_heads(query, self.in_proj_weight, self.in_proj_bias,
                                    heads + 2 * kv_heads, d, n_threads, scratch, "qkv",
                                    padding, heads)
                if positions is not None:
                    _rotate_qk(qkv, heads, kv_heads, self.rope, positions, n_threads)
                q, k, v = qkv[:, :heads], qkv[:, heads:heads + kv_heads], qkv[:, heads + kv_heads:]
            else:
                q = _linear_heads(query, self.q_weight, self.q_bias, heads, d, n_threads,
                                  scratch, "q")
                if key is value and self.in_proj_weight is not None:   # one GEMM for K and V
                    kv_bias = None if self.in_proj_bias is None else self.in_proj_bias[n_q:]
                    kv = _linear_heads(key, self.in_proj_weight[n_q:], kv_bias, 2 * kv_heads, d,
                                       n_threads, scratch, "kv", padding)
                    k, v = kv[:, :kv_heads], kv[:, kv_heads:]
                else:
                    k = _linear_heads(key, self.k_weight, self.k_bias, kv_heads, d, n_threads,
                                      scratch, "k", padding)
                    v = _linear_heads(value, self.v_weight, self.v_bias, kv_heads, d, n_threads,
                                      scratch, "v", padding)
            ragged = k_scale = v_scale = None
            if plan is not None:     # k, v: the cache's storage, in its format
                k, v = plan.write(k, v)
                k_scale, v_scale = plan.scales()
                ragged = plan.kernel_ragged()
            # q, k, v are head views of the projections (or of the cache): BLAS-ready as they are
            # (a ragged batch's padding rows are not computed: zeros, not scratch, go to W_O)
            alloc = np.empty if ragged is None else np.zeros
            context = (scratch.array("context", (batch, q_len, n_q), self.dtype)
                       if ragged is None else np.zeros((batch, q_len, n_q), dtype=self.dtype))
            weights = None
            if need_weights:
                weights = alloc((batch, heads, q_len, k.shape[2]), dtype=self.dtype)
            _attend(q, k, v, _split_heads(context, heads, d), attn_mask, key_padding_mask,
                    is_causal, 1.0 / math.sqrt(d), weights, n_threads, self.window, ragged,
                    self._kv_index, k_scale, v_scale)
            if head_mask is not None:     # one pass over the context: (B, L, H, D) * (B, 1, H, 1)
                heads_view = context.reshape(batch, q_len, heads, d)
                np.multiply(heads_view, head_mask[:, None, :, None], out=heads_view)
            out = _linear(context, self.out_weight, self.out_bias, n_threads)
        return out, weights
