"""mha_cy.analysis: what the heads do, in numbers.

- head_stats(weights): per head, how spread out its attention is (entropy), how far it looks
  (mean distance), how peaked (max weight) and where each query looks most (top key).
- rank_heads(mha, x): heads ordered by how much the output changes when each one is
  dropped (head_mask 0): the redundant heads come last.
Both are plain vectorized NumPy on the weights / outputs the module returns.
"""
import numpy as np

from ._checks import as_array, check_ndim

__all__ = ["head_stats", "rank_heads"]


def _query_means(rows, valid, count):
    """Mean over the query axis of rows (..., Lq), counting only the queries where `valid`;
    NaN where no query counts."""
    total = np.sum(rows * valid, axis=-1)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(count > 0, total / np.maximum(count, 1), np.nan)


def head_stats(weights, key_padding_mask=None):
    """Per-head statistics of attention weights.

    weights: (B, H, Lq, Lk) as returned by mha(x, need_weights=True) (or (H, Lq, Lk), one
    unbatched sequence: the results then have no batch axis). Returns a dict of float64
    arrays (B, H):
      "entropy":       mean over queries of -sum_j w_ij log w_ij, in nats (0 log 0 = 0);
                       0 = every query on one key, log(Lk) = uniform;
      "mean_distance": mean over queries of sum_j w_ij |i - j|, in positions; query i sits at
                       position i + Lk - Lq (the causal convention of a cache: the last
                       query is the last key; i itself when Lq == Lk);
      "max_weight":    mean over queries of max_j w_ij;
    and "top_key", int (B, H, Lq): argmax_j w_ij (the first one on ties).
    key_padding_mask: bool (B, Lk), True = padding, for self-attention (Lq == Lk): the means
    run over the unpadded queries only (NaN for a sequence that is all padding); top_key is
    still given for every query. A query whose keys were all masked has weights 0: entropy 0,
    distance 0, max weight 0.
    """
    w = as_array(weights, "weights")
    check_ndim(w, "weights", (3, 4), "(batch, heads, query_len, key_len) or "
                                     "(heads, query_len, key_len)")
    unbatched = w.ndim == 3
    if unbatched:
        w = w[None]
    w = w.astype(np.float64, copy=False)
    batch, _, q_len, k_len = w.shape
    if k_len == 0:
        raise ValueError(f"weights has no keys (shape {w.shape}): nothing to summarize")
    if key_padding_mask is None:
        valid = np.ones((batch, 1, q_len))
    else:
        pad = np.asarray(key_padding_mask)
        if pad.dtype != np.bool_:
            raise TypeError("key_padding_mask must be a bool array (True = padding); got dtype "
                            f"{pad.dtype}")
        if q_len != k_len:
            raise ValueError(f"key_padding_mask is for self-attention weights (query_len == "
                             f"key_len); weights have query_len {q_len}, key_len {k_len}")
        expected = (k_len,) if unbatched else (batch, k_len)
        if pad.shape != expected:
            what = "key_len: the weights are unbatched" if unbatched else "batch, key_len"
            raise ValueError(f"key_padding_mask must have shape {expected} ({what}); got "
                             f"{pad.shape}")
        valid = ~pad.reshape(batch, 1, k_len)
    count = valid.sum(axis=-1)

    log_w = np.log(w, out=np.zeros_like(w), where=w > 0)      # 0 log 0 = 0
    entropy_rows = -(w * log_w).sum(axis=-1)
    positions = np.arange(q_len) + (k_len - q_len)
    distance = np.abs(positions[:, None] - np.arange(k_len)[None, :])
    distance_rows = np.einsum("bhij,ij->bhi", w, distance)
    stats = {
        "entropy": _query_means(entropy_rows, valid, count),
        "mean_distance": _query_means(distance_rows, valid, count),
        "max_weight": _query_means(w.max(axis=-1), valid, count),
        "top_key": w.argmax(axis=-1),
    }
    if unbatched:
        stats = {name: value[0] for name, value in stats.items()}
    return stats


def _tile(x, copies):
    """copies of x one after another along the batch axis."""
    return np.concatenate([x] * copies)


def rank_heads(mha, query, key=None, value=None, *, key_padding_mask=None, attn_mask=None,
               is_causal=False):
    """The heads of mha from the most to the least important for this input.

    A head's score is ||out - out_without_h|| / ||out||, Frobenius norms over the whole
    (batch of) output, where out_without_h is the output with head_mask zero at head h only:
    the relative change of the output when the head is dropped. 0 = the head could go.
    One batched call evaluates all of them: the input repeated num_heads + 1 times, each copy
    with its own head_mask row (so it takes num_heads + 1 times the memory of one call).
    query, key, value and the masks are as in mha's call (a batched attn_mask is repeated
    with the input). Returns (heads, scores): int (num_heads,) head indices sorted by
    decreasing score, and their scores (float64).
    """
    heads = mha.num_heads
    copies = heads + 1
    query = as_array(query, "query")
    unbatched = query.ndim == 2
    for name, arr in (("key", key), ("value", value)):     # before the tiling reshapes them
        if arr is not None and np.ndim(arr) != query.ndim:
            raise ValueError(f"{name} must be {query.ndim}-D like query; got shape "
                             f"{np.shape(arr)}")
    if unbatched:                        # one sequence: a batch of one, like the call does
        query = query[None]
        key = None if key is None else as_array(key, "key")[None]
        value = None if value is None else as_array(value, "value")[None]
        if key_padding_mask is not None:
            key_padding_mask = np.asarray(key_padding_mask)[None]
    check_ndim(query, "query", (3,), "(batch, length, embed_dim) or (length, embed_dim)")
    batch = query.shape[0]
    kwargs = {"is_causal": is_causal}
    if key is not None:
        kwargs["key"] = _tile(as_array(key, "key"), copies)
    if value is not None:
        kwargs["value"] = _tile(as_array(value, "value"), copies)
    if key_padding_mask is not None:
        kwargs["key_padding_mask"] = _tile(np.asarray(key_padding_mask), copies)
    if attn_mask is not None:
        attn_mask = np.asarray(attn_mask)
        if attn_mask.ndim >= 3 and attn_mask.shape[0] != 1:    # per sequence: repeat it too
            attn_mask = _tile(attn_mask, copies)
        kwargs["attn_mask"] = attn_mask
    # copy 0: every head; copy 1 + h: all but head h
    head_mask = np.ones((copies, heads))
    head_mask[1 + np.arange(heads), np.arange(heads)] = 0
    out = mha(_tile(query, copies), head_mask=np.repeat(head_mask, batch, axis=0), **kwargs)
    out = out.reshape(copies, -1).astype(np.float64)
    change = np.linalg.norm(out[1:] - out[0], axis=1)
    with np.errstate(invalid="ignore", divide="ignore"):
        scores = change / np.linalg.norm(out[0])
    order = np.argsort(-scores, kind="stable")
    return order, scores[order]
