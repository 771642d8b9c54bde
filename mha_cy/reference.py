"""mha_cy.reference: the whole API of mha_cy in plain, vectorized NumPy.

It is the oracle of every test and the baseline of every benchmark, so it stays short and
obviously right: the full (B, H, Lq, Lk) score tensor, a boolean "may attend" tensor, an
ordinary softmax. It shares argument checking and parameter handling with the fast path
(mha_cy._checks, mha_cy._module) but computes everything itself.
"""
import numpy as np

from ._cache import KVCache
from ._checks import check_sdpa_inputs
from ._module import MultiHeadAttentionBase
from ._window import check_window, require_causal

__all__ = ["MultiHeadAttention", "KVCache", "scaled_dot_product_attention"]


def _attention(q, k, v, attn_mask, key_padding_mask, is_causal, scale, window=None,
               kv_index=None):
    """(out, weights) of softmax(scale * q k^T + mask) v.

    q (B, Hq, Lq, D); k, v (B, Hkv, Lk, D); attn_mask None, bool (True = may attend) or
    additive, broadcastable to (B, Hq, Lq, Lk); key_padding_mask None or bool (B, Lk),
    True = ignore the key; is_causal: query i sees keys j <= i + Lk - Lq; window (with
    is_causal): and only keys j > i + Lk - Lq - window. kv_index: None (query head h reads
    K/V head h // (Hq / Hkv)) or the K/V head of each query head.

    A key is hidden from a row when a mask hides it (a False in a bool mask, padding,
    causality, the window, or -inf in an additive mask: then its score is never looked at,
    whatever q, k or the mask's other terms hold), or when its score is -inf from the data
    (q . k overflowing to -inf). A hidden key has no effect at all: weight 0, and its value
    is never read (0 * NaN would be NaN). A row whose keys are all hidden (or with no keys)
    gives zeros, in the output and the weights; so a row of -inf scores gives zeros, where
    torch gives NaN (the kernels cannot tell a -inf from the data from a mask's). In any
    other row a NaN or +inf that reaches the scores (from q, k, the scale or an additive
    mask) makes the whole row NaN, as in torch; and a visible key's value is multiplied by
    its weight even when that underflowed to 0 (so a NaN there makes that output NaN).
    """
    if kv_index is None:
        kv_index = np.arange(q.shape[1]) // max(q.shape[1] // max(k.shape[1], 1), 1)
    k, v = k[:, kv_index], v[:, kv_index]    # query head h reads key/value head kv_index[h]
    # float(): a NumPy float64 scale (1 / np.sqrt(D)) would promote float32 scores, and with
    # them the output and weights, to float64 (NEP 50); the result must keep q's dtype.
    scores = (q @ k.swapaxes(-1, -2)) * float(scale)
    allowed = np.ones(scores.shape, dtype=bool)
    if attn_mask is not None:
        if attn_mask.dtype == bool:
            allowed &= attn_mask
        else:
            allowed &= attn_mask != -np.inf
            scores = scores + attn_mask
    if key_padding_mask is not None:
        allowed &= ~key_padding_mask[:, None, None, :]
    if is_causal:
        q_len, k_len = scores.shape[-2:]
        query_pos = np.arange(q_len)[:, None] + (k_len - q_len)
        allowed &= np.arange(k_len)[None, :] <= query_pos
        if window is not None:
            allowed &= np.arange(k_len)[None, :] > query_pos - window
    scores = np.where(allowed, scores, -np.inf)
    visible = (scores > -np.inf) | np.isnan(scores)
    fully_masked = ~visible.any(axis=-1, keepdims=True)

    # An ordinary softmax: a NaN or +inf row maximum turns the row into NaN by itself
    # (NaN - NaN, inf - inf); fully masked rows get a harmless maximum and total instead.
    with np.errstate(invalid="ignore"):
        row_max = np.where(fully_masked, 0, scores.max(axis=-1, keepdims=True, initial=-np.inf))
        e = np.exp(scores - row_max)
        total = np.where(fully_masked, 1, e.sum(axis=-1, keepdims=True))
        weights = np.where(visible, e / total, 0)     # 0 at hidden keys, even in a NaN row
        out = np.where(fully_masked, 0, _weighted_values(weights, visible, v))
    return out, weights


def _weighted_values(weights, visible, v):
    """weights @ v, reading v only at the visible keys (where visible): the finite values by
    a product, and each non-finite entry as IEEE multiplies it by its weight (w * inf = inf
    for w > 0, NaN for w = 0; a NaN stays NaN; +inf and -inf together give NaN)."""
    bad = ~np.isfinite(v)
    out = weights @ np.where(bad, 0, v)
    if not bad.any():
        return out

    def any_key(rows, cols):        # [..., i, d]: some key j with rows[i, j] and cols[j, d]
        return (rows.astype(v.dtype) @ cols.astype(v.dtype)) > 0

    positive = visible & (weights > 0)
    nan = any_key(visible, np.isnan(v)) | any_key(visible & (weights == 0), np.isinf(v))
    plus, minus = any_key(positive, v == np.inf), any_key(positive, v == -np.inf)
    return np.where(nan | (plus & minus), np.nan,
                    np.where(plus, out + np.inf, np.where(minus, out - np.inf, out)))


def _rotate(x, positions, rope):
    """x (B, H, L, D) with RoPE at positions (1 or B, L): the pairs (a, b) of the first dim
    features turned by the angles position * base ** (-2i / dim), in float64."""
    dim = rope.rotary_dim(x.shape[-1])
    angle = positions[:, None, :, None] * rope.base ** (-np.arange(0, dim, 2) / dim)
    cos, sin = np.cos(angle), np.sin(angle)
    pairs = np.arange(dim // 2)
    a, b = (2 * pairs, 2 * pairs + 1) if rope.interleaved else (pairs, pairs + dim // 2)
    out = x.astype(np.float64)
    out[..., a] = x[..., a] * cos - x[..., b] * sin
    out[..., b] = x[..., b] * cos + x[..., a] * sin
    return out.astype(x.dtype)


def scaled_dot_product_attention(q, k, v, *, attn_mask=None, is_causal=False, scale=None,
                                 window=None):
    """softmax(q k^T * scale + mask) v; see mha_cy.scaled_dot_product_attention."""
    window = check_window(window)
    q, k, v, attn_mask, is_causal, scale = check_sdpa_inputs(q, k, v, attn_mask, is_causal, scale)
    require_causal(window, is_causal)
    return _attention(q, k, v, attn_mask, None, is_causal, scale, window)[0]


def _ragged_attention(q, k, v, attn_mask, key_padding_mask, scale, window, plan,
                      kv_index=None):
    """_attention of a ragged cache batch: each sequence on its own, over its own new queries
    and keys (so causally at its own positions); padding query rows stay 0."""
    B, H, Lq, _ = q.shape
    Lk = k.shape[2]
    out = np.zeros(q.shape[:3] + (v.shape[3],), dtype=q.dtype)
    weights = np.zeros((B, H, Lq, Lk), dtype=q.dtype)
    if attn_mask is not None:
        attn_mask = np.broadcast_to(attn_mask, (B, H, Lq, Lk))
    for b, (n, kl) in enumerate(zip(plan.counts.tolist(), plan.k_lens.tolist())):
        if n == 0:
            continue
        mask = None if attn_mask is None else attn_mask[b:b + 1, :, :n, :kl]
        pad = None if key_padding_mask is None else key_padding_mask[b:b + 1, :kl]
        o, w = _attention(q[b:b + 1, :, :n], k[b:b + 1, :, :kl], v[b:b + 1, :, :kl], mask, pad,
                          True, scale, window, kv_index)
        out[b, :, :n], weights[b, :, :n, :kl] = o[0], w[0]
    return out, weights


class MultiHeadAttention(MultiHeadAttentionBase):
    """Multi-head attention in plain NumPy; see mha_cy.MultiHeadAttention."""

    def _forward(self, query, key, value, self_attention, key_padding_mask, attn_mask,
                 is_causal, need_weights, plan, positions, head_mask):
        batch, q_len, _ = query.shape

        def project(x, weight, bias, heads):       # (B, L, in) -> (B, heads, L, head_dim)
            y = x @ weight.T
            if bias is not None:
                y = y + bias
            return y.reshape(batch, x.shape[1], heads, self.head_dim).transpose(0, 2, 1, 3)

        q = project(query, self.q_weight, self.q_bias, self.num_heads)
        k = project(key, self.k_weight, self.k_bias, self.num_kv_heads)
        v = project(value, self.v_weight, self.v_bias, self.num_kv_heads)
        if positions is not None:
            q, k = _rotate(q, positions, self.rope), _rotate(k, positions, self.rope)
        scale = 1.0 / np.sqrt(self.head_dim)
        if plan is not None:       # attend over the values the cache holds (decoded)
            plan.write(k, v)
            k, v = plan.cache.dequantize(plan.k_len)
        if plan is not None and plan.ragged:
            context, weights = _ragged_attention(q, k, v, attn_mask, key_padding_mask, scale,
                                                 self.window, plan, self._kv_index)
        else:
            context, weights = _attention(q, k, v, attn_mask, key_padding_mask, is_causal, scale,
                                          self.window, self._kv_index)
        if head_mask is not None:                  # (B, H, Lq, D) * (B, H, 1, 1)
            context = context * head_mask[:, :, None, None]
        # concatenate the heads, then mix them with the output projection
        context = context.transpose(0, 2, 1, 3).reshape(batch, q_len, -1)
        out = context @ self.out_weight.T
        if self.out_bias is not None:
            out = out + self.out_bias
        return out, (weights if need_weights else None)
