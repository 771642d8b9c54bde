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
    ragged: whether the sequences differ (else one slice and the kernel's uniform path).
    The common call (equal lengths, no lengths=) is planned with Python ints only: a decode
    step of a small model takes a few microseconds, and NumPy calls cost about one each."""

    def __init__(self, cache, q_len, lengths):
        self.cache = cache
        self.q_len = q_len
        equal = cache._equal_length
        if lengths is None and equal is not None:
            cache._check_room_uniform(q_len)
            self.ragged = False
            self.start, self.k_len = equal, equal + q_len
            self._arrays = None
            return
        starts = cache.lengths
        counts = (np.full(cache.batch_size, q_len, dtype=np.int64) if lengths is None
                  else check_lengths(lengths, cache.batch_size, q_len))
        cache._check_room(counts)
        k_lens = starts + counts
        self.k_len = int(k_lens.max())
        self.ragged = bool((starts != starts[0]).any() or (counts != q_len).any())
        self.start = None if self.ragged else int(starts[0])
        self._arrays = (starts, counts, k_lens)

    def _get(self, i):
        if self._arrays is None:      # the uniform plan: arrays only when someone asks
            batch = self.cache.batch_size
            self._arrays = tuple(np.full(batch, n, dtype=np.int64)
                                 for n in (self.start, self.q_len, self.k_len))
        return self._arrays[i]

    starts = property(lambda self: self._get(0), doc="cached tokens per sequence before")
    counts = property(lambda self: self._get(1), doc="new tokens per sequence")
    k_lens = property(lambda self: self._get(2), doc="keys per sequence after the call")

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

    def scales(self):
        """The int8 cache's (key_scale, value_scale) views to attend over, or (None, None)."""
        return self.cache._scales(self.k_len)

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
