"""Head pruning: a smaller module without some query heads (MultiHeadAttention.prune_heads).

Query head h owns rows h*D:(h+1)*D of W_Q (and of the q bias) and the same columns of W_O, so
removing it removes those; the output bias stays. A K/V head goes with the last query head
that reads it. With GQA the groups left behind may be uneven (8 query / 2 K/V heads without
heads 1, 5, 6: groups of 3 and 2); the new module then keeps the K/V head of each query head
as an index array (module._kv_index) that the attention kernel and the reference read.
Pruning equals masking: the pruned module's output is the original's with head_mask zero at
the pruned heads (same weights, the dropped terms of the W_O product left out).
"""
import numbers

import numpy as np


def _check_heads(heads, num_heads):
    """The sorted query heads to remove: ints in [0, num_heads), no duplicates, not empty,
    not all of them."""
    if isinstance(heads, numbers.Integral) and not isinstance(heads, (bool, np.bool_)):
        raise TypeError(f"heads must be a sequence of head indices (e.g. [{heads}]); got the "
                        f"int {heads}")
    if isinstance(heads, (set, frozenset)):     # a natural way to name heads; sorted below
        heads = sorted(heads)
    try:
        arr = np.asarray(heads)
    except Exception as exc:
        raise TypeError(f"heads must be a sequence of ints; got {type(heads).__name__}") from exc
    if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
        raise TypeError(f"heads must be a 1-D sequence of ints; got {heads!r}")
    if arr.size == 0:
        raise ValueError("heads is empty: name at least one query head to prune")
    bad = arr[(arr < 0) | (arr >= num_heads)]
    if bad.size:
        raise ValueError(f"heads must be in [0, {num_heads}) (num_heads = {num_heads}); got "
                         f"{bad.tolist()}")
    unique, counts = np.unique(arr, return_counts=True)
    if (counts > 1).any():
        raise ValueError(f"heads has duplicates: {unique[counts > 1].tolist()}")
    if unique.size == num_heads:
        raise ValueError(f"heads names all {num_heads} query heads: a module needs at least one")
    return unique


def _head_rows(heads, head_dim):
    """Row (or column) indices of the given heads' head_dim-wide slices."""
    return (heads[:, None] * head_dim + np.arange(head_dim)).ravel()


def prune_heads(mha, heads):
    """A new module of mha's class without the query heads `heads` (any order).

    Removes their rows of W_Q and q bias and their columns of W_O; a K/V head (rows of W_K,
    W_V and their biases) goes when every query head reading it goes. The remaining heads
    keep their order and are renumbered 0..n-1. Uneven GQA groups are kept as an index
    (kv_head_index); even ones (and MHA, MQA) give an ordinary module. mha is unchanged.
    """
    pruned = _check_heads(heads, mha.num_heads)
    keep = np.setdiff1d(np.arange(mha.num_heads), pruned)
    kv_of_kept = mha.kv_head_index[keep]
    keep_kv = np.unique(kv_of_kept)
    return _rebuild(mha, keep, keep_kv, np.searchsorted(keep_kv, kv_of_kept))


def _rebuild(mha, keep, keep_kv, kv_index):
    """A copy of mha with only the query heads `keep` and K/V heads `keep_kv` (sorted index
    arrays), query head i of the copy reading its K/V head kv_index[i]. Every other attribute
    (a rotary embedding, a window, ...) is carried over as it is."""
    d = mha.head_dim
    q_rows, kv_rows = _head_rows(keep, d), _head_rows(keep_kv, d)

    def rows(a, r):
        return None if a is None else a[r]

    new = type(mha).__new__(type(mha))
    new.__dict__.update(mha.__dict__)         # _setup replaces every weight and head count
    new._setup(keep.size, keep_kv.size, mha.dtype, mha.q_weight[q_rows],
               mha.k_weight[kv_rows], mha.v_weight[kv_rows], mha.out_weight[:, q_rows],
               rows(mha.q_bias, q_rows), rows(mha.k_bias, kv_rows), rows(mha.v_bias, kv_rows),
               mha.out_bias)
    kv_index = np.asarray(kv_index, dtype=np.intp)
    group = keep.size // keep_kv.size
    even = keep.size % keep_kv.size == 0 and np.array_equal(
        kv_index, np.arange(keep.size) // group)
    if not even:
        new._kv_index = kv_index
    return new


def regroup(mha, kv_index):
    """mha (an MHA module whose K/V head h is the one query head h reads) with K/V heads
    shared as kv_index says: K/V head g keeps the weights of the first query head that reads
    it. How load() rebuilds a pruned module with uneven groups through from_weights."""
    kv_index = np.asarray(kv_index, dtype=np.intp)
    n_kv = int(kv_index.max()) + 1
    first = np.array([np.flatnonzero(kv_index == g)[0] for g in range(n_kv)])
    return _rebuild(mha, np.arange(mha.num_heads), first, kv_index)
