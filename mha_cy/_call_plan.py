"""The plan of one module call with a KV cache: where each sequence's new tokens go and which
keys it attends to (ragged batches, whose sequences have different lengths).

Sequence b has starts[b] cached tokens and appends its first counts[b] new ones (all Lq, or
lengths[b] of right-padded prompts); its query i is at position starts[b] + i and sees the
keys j <= starts[b] + i of its own k_lens[b] = starts[b] + counts[b]. Everything is checked
here, before anything is written, so that a failed call leaves the cache as it was.
"""
import numpy as np


def check_lengths(lengths, batch, q_len):
    """lengths: int (batch,) with 0 <= lengths[b] <= q_len, as int64."""
    arr = np.asarray(lengths)
    if arr.dtype.kind not in "iu":
        raise TypeError(f"lengths must be an integer array of shape ({batch},); got dtype "
                        f"{arr.dtype}")
    if arr.shape != (batch,):
        raise ValueError(f"lengths must have shape ({batch},) (one per sequence); got "
                         f"{arr.shape}")
    bad = np.flatnonzero((arr < 0) | (arr > q_len))
    if bad.size:
        raise ValueError(f"lengths must be in [0, {q_len}] (the query length); got "
                         f"{arr[bad[0]]} for sequence {int(bad[0])}")
    return arr.astype(np.int64)


class CachePlan:
    """starts, counts, k_lens: int64 (B,); k_len = max(k_lens) (the keys the kernels see);
    ragged: whether the sequences differ (else one slice and the kernel's uniform path)."""

    def __init__(self, cache, q_len, lengths):
        batch = cache.batch_size
        self.cache = cache
        self.q_len = q_len
        self.starts = cache.lengths
        self.counts = (np.full(batch, q_len, dtype=np.int64) if lengths is None
                       else check_lengths(lengths, batch, q_len))
        cache._check_room(self.counts)
        self.k_lens = self.starts + self.counts
        self.k_len = int(self.k_lens.max())
        self.ragged = bool((self.starts != self.starts[0]).any()
                           or (self.counts != q_len).any())

    def kernel_ragged(self):
        """The attention kernel's `ragged` argument: intp (3, B) query rows, keys and causal
        offsets per sequence; None when the batch is not ragged."""
        if not self.ragged:
            return None
        return np.ascontiguousarray(np.stack([self.counts, self.k_lens, self.starts]),
                                    dtype=np.intp)

    def write(self, k, v):
        """Append the new keys/values; the (B, Hkv, k_len, D) views to attend over."""
        return self.cache._write(k, v, self)

    def commit(self):
        self.cache._commit(self)

    def zero_padding(self, out, weights):
        """Rows past counts[b] (the padding of a right-padded prompt): exactly 0."""
        if not self.ragged:
            return
        for b, count in enumerate(self.counts.tolist()):
            out[b, count:] = 0
            if weights is not None:
                weights[b, :, count:] = 0
