"""The key/value cache of incremental (token-by-token) decoding."""
import numbers
import threading

import numpy as np

from ._aligned_arrays import copy_lines, on_lines, zeros_lines
from ._cache_formats import FloatFormat
from ._checks import float_dtype, positive_int


def _int_per_sequence(value, batch, name):
    """value (an int, or (batch,) ints) as an int64 (batch,) array; TypeError/ValueError else."""
    if isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be an int or {batch} ints; got {value!r}")
    int64 = np.iinfo(np.int64)
    if isinstance(value, numbers.Integral):
        if not int64.min <= value <= int64.max:      # np.full raised OverflowError
            raise ValueError(f"{name} is out of range; got {value}")
        return np.full(batch, int(value), dtype=np.int64)
    arr = np.asarray(value)
    if arr.dtype.kind not in "iu":
        raise TypeError(f"{name} must be an int or an integer array of shape ({batch},); got "
                        f"dtype {arr.dtype}")
    if arr.shape != (batch,):
        raise ValueError(f"{name} must be an int or have shape ({batch},); got {arr.shape}")
    if arr.dtype.kind == "u" and (arr > int64.max).any():    # would wrap to negative ints
        raise ValueError(f"{name} is out of range; got {arr[arr > int64.max][0]}")
    return arr.astype(np.int64)


# The storage arrays, each allocated on a cache line (_aligned_arrays): at NumPy's 16-byte
# offset the decode kernels' rows straddle one line more each. Zen 4, 1 thread, the kernel
# over the same float16 values (B4, 8 K/V heads, 2048 keys, D 128, 6 caches in turn): 2.49-2.54
# ms on a line, 2.81-2.87 ms at the 16-byte offset.
_STORAGE = ("key", "value", "key_scale", "value_scale")


class KVCache:
    """Preallocated keys and values of the tokens decoded so far, for one module.

    ``key`` and ``value`` are (batch_size, num_kv_heads, max_len, head_dim) arrays; sequence b
    holds the projected keys/values of its tokens so far in its first ``lengths[b]`` positions.
    Sequences may have different lengths (ragged batches: right-padded prompts, see the
    ``lengths=`` argument of the module call); ``length`` is the longest. With GQA/MQA only
    num_kv_heads heads are stored, which is what makes the cache smaller.

    A call ``mha(x, cache=cache)`` appends the keys/values of x to each sequence, at that
    sequence's own position, and attends causally over the sequence's cached tokens. A call
    that fails (bad input, overflow) leaves ``lengths`` and the stored values unchanged:
    positions past a sequence's length are scratch, never state, and nothing is written
    before every check has passed.

    Storage formats (mha_cy._cache_formats, chosen by new_cache(dtype=...)): the module's
    float dtype, float16, or int8 with one float32 scale per (batch, K/V head, position) in
    ``key_scale`` and ``value_scale`` (batch_size, num_kv_heads, max_len); None for the
    float formats. ``dtype`` is the stored dtype; ``dequantize()`` gives the float values.
    """

    def __init__(self, batch_size, num_kv_heads, max_len, head_dim, dtype, storage=None):
        if storage is None:     # dtype is the compute dtype; float16 made a cache computing
            try:                # in float16, which no path takes
                fmt = FloatFormat(float_dtype(dtype))
            except TypeError as e:
                raise TypeError(f"{e} (the dtype the cache computes in; for a float16 or int8 "
                                "cache, use module.new_cache(..., dtype=np.float16 or "
                                "'int8'))") from None
        else:
            fmt = storage
        # (new_cache checks its own arguments; KVCache is public, so direct construction too)
        shape = tuple(positive_int(n, name) for n, name in (
            (batch_size, "batch_size"), (num_kv_heads, "num_kv_heads"), (max_len, "max_len"),
            (head_dim, "head_dim")))
        self._format = fmt
        try:
            self.key = zeros_lines(shape, fmt.dtype)
        except ValueError:      # NumPy's "array is too big" names no argument
            raise ValueError(
                f"a KV cache of batch_size={shape[0]}, num_kv_heads={shape[1]}, "
                f"max_len={shape[2]}, head_dim={shape[3]} ({fmt.dtype}) is too large to "
                "allocate") from None
        self.value = zeros_lines(shape, fmt.dtype)
        self.key_scale = self.value_scale = None
        if fmt.has_scales:
            self.key_scale = zeros_lines(shape[:3], np.float32)
            self.value_scale = zeros_lines(shape[:3], np.float32)
        self._set_lengths(np.zeros(batch_size, dtype=np.int64))
        self._guard = threading.RLock()

    def _claim(self):
        """The cache's guard, acquired (release it when done): one call or method at a time
        may use a cache. Two threads stepping one cache both passed the room check and left
        lengths past max_len. Reentrant: the compiled step falls back to the general path
        under the same claim."""
        guard = self._guard
        if not guard.acquire(blocking=False):
            raise RuntimeError("this KVCache is in use by a call in another thread: a cache "
                               "serves one call at a time (give each thread its own cache); "
                               "the cache is unchanged")
        return guard

    def __getstate__(self):         # a lock does not pickle: each copy gets its own
        return {name: value for name, value in self.__dict__.items() if name != "_guard"}

    def __setstate__(self, state):
        self.__dict__.update(state)
        for name in _STORAGE:       # unpickled arrays start wherever malloc put them
            if getattr(self, name, None) is not None:
                setattr(self, name, on_lines(getattr(self, name)))
        self._guard = threading.RLock()

    def _set_lengths(self, lengths):
        """The only writer of the lengths: _equal_length is their common value, or None when
        they differ (the uniform fast paths of truncate and CachePlan use Python ints)."""
        self._lengths = lengths
        first = int(lengths[0])
        self._equal_length = first if (lengths == first).all() else None

    @property
    def batch_size(self):
        return self.key.shape[0]

    @property
    def num_kv_heads(self):
        return self.key.shape[1]

    @property
    def max_len(self):
        return self.key.shape[2]

    @property
    def head_dim(self):
        return self.key.shape[3]

    @property
    def dtype(self):
        """The stored dtype: the module's float dtype, float16 or int8."""
        return self.key.dtype

    @property
    def compute_dtype(self):
        """The dtype the attention computes in (float32 for float16 and int8 caches)."""
        return self._format.compute_dtype

    def dequantize(self, length=None):
        """(key, value) as float arrays (batch_size, num_kv_heads, length, head_dim) of
        compute_dtype, length = max_len by default: views of the storage for a float cache,
        new arrays otherwise (the decoded values the kernels compute with)."""
        stop = self.max_len if length is None else self._check_stop(length)
        scales = (self.key_scale, self.value_scale)
        return tuple(self._format.decode(x[:, :, :stop],
                                         None if s is None else s[:, :, :stop])
                     for x, s in zip((self.key, self.value), scales))

    def _check_stop(self, length):
        """length (of dequantize) as an int in [0, max_len]: a slice took -1 as max_len - 1."""
        if isinstance(length, (bool, np.bool_)) or not isinstance(length, numbers.Integral):
            raise TypeError(f"length must be None or an int; got {length!r}")
        if not 0 <= length <= self.max_len:
            raise ValueError(f"length must be in [0, {self.max_len}] (max_len); got {length}")
        return int(length)

    @property
    def lengths(self):
        """Tokens cached per sequence, int64 (batch_size,) (a copy)."""
        return self._lengths.copy()

    @property
    def length(self):
        """Tokens cached in the longest sequence (all of them when the lengths are equal)."""
        if self._equal_length is not None:
            return self._equal_length
        return int(self._lengths.max())

    @property
    def nbytes(self):
        """Bytes of the allocated storage (the max_len capacity, not only the cached tokens)."""
        scales = 0 if self.key_scale is None else self.key_scale.nbytes + self.value_scale.nbytes
        return self.key.nbytes + self.value.nbytes + scales

    def truncate(self, length):
        """Forget every token of sequence b after its first length[b] (e.g. to roll back a
        rejected draft). length: an int (the same for every sequence) or (batch_size,) ints,
        each between 0 and that sequence's cached length."""
        guard = self._claim()
        try:
            self._truncate(length)
        finally:
            guard.release()

    def _truncate(self, length):
        equal = self._equal_length
        if (equal is not None and isinstance(length, numbers.Integral)
                and not isinstance(length, (bool, np.bool_)) and 0 <= length <= equal):
            self._lengths.fill(length)          # the common case, without NumPy reductions
            self._equal_length = int(length)
            return
        new = _int_per_sequence(length, self.batch_size, "length")
        bad = np.flatnonzero((new < 0) | (new > self._lengths))
        if bad.size:
            b = int(bad[0])
            raise ValueError(f"length must be in [0, {self._lengths[b]}] (the cached length) for "
                             f"sequence {b}; got {new[b]}")
        self._set_lengths(new)

    def reorder(self, indices):
        """Sequence b becomes the old sequence indices[b] (beam search: repeats allowed, a
        sequence not listed is dropped). indices: (batch_size,) ints in [0, batch_size)."""
        guard = self._claim()
        try:
            self._reorder(indices)
        finally:
            guard.release()

    def _reorder(self, indices):
        if np.ndim(indices) == 0:
            raise TypeError(f"indices must be {self.batch_size} ints; got {indices!r}")
        idx = _int_per_sequence(indices, self.batch_size, "indices")
        bad = np.flatnonzero((idx < 0) | (idx >= self.batch_size))
        if bad.size:
            raise ValueError(f"indices must be in [0, {self.batch_size}); got {idx[bad[0]]} at "
                             f"position {int(bad[0])}")
        # only the cached positions carry state; the rest of each row is scratch
        stop = self.length
        # every check before the first write: a read-only array found after the keys moved
        # would leave the keys of one beam beside the values of another
        arrays = self._writeable_arrays("reorder")
        moved = [a[idx, :, :stop] for a in arrays]      # copies, taken before any write
        for a, m in zip(arrays, moved):
            a[:, :, :stop] = m
        self._set_lengths(self._lengths[idx])

    def _writeable_arrays(self, action):
        """The storage arrays (key, value and the int8 scales), or ValueError naming the first
        read-only one: checked before any write, so that the cache stays as it was."""
        arrays = []
        for name in _STORAGE:
            a = getattr(self, name)
            if a is None:
                continue
            if not a.flags.writeable:
                raise ValueError(f"cache.{name} is read-only: cannot {action} (the cache is "
                                 "unchanged)")
            arrays.append(a)
        return arrays

    def copy(self):
        """An independent deep copy (storage and lengths)."""
        guard = self._claim()       # not torn by a call writing meanwhile
        try:
            new = object.__new__(type(self))
            new.__setstate__({name: (copy_lines(value) if name in _STORAGE else value.copy())
                              if isinstance(value, np.ndarray) else value
                              for name, value in self.__getstate__().items()})
        finally:
            guard.release()
        return new

    def reset(self):
        """Empty the cache (the storage is kept for reuse)."""
        guard = self._claim()
        try:
            self._lengths.fill(0)
            self._equal_length = 0
        finally:
            guard.release()

    def _check_room_uniform(self, n_new):
        """_check_room for equal lengths and n_new tokens for every sequence."""
        if self._equal_length + n_new > self.max_len:
            self._check_room(np.full(self.batch_size, n_new, dtype=np.int64))

    def _check_room(self, counts):
        """Raise, changing nothing, unless every sequence b has room for counts[b] tokens."""
        over = np.flatnonzero(self._lengths + counts > self.max_len)
        if over.size:
            b = int(over[0])
            seq = "" if self.batch_size == 1 else f" (sequence {b})"
            raise ValueError(
                f"cache overflow: {self._lengths[b]} cached + {counts[b]} new tokens > "
                f"max_len {self.max_len}{seq}; make the cache with a larger max_len (the cache "
                "is unchanged)")

    def _write(self, keys, values, plan):
        """Store (B, Hkv, n, D) keys/values: sequence b's first plan.counts[b] after its cached
        ones. Return the (B, Hkv, plan.k_len, D) views of the storage to attend over (stored
        dtype; sequence b's keys past plan.k_lens[b] are scratch: the kernels read only its
        own); _scales gives the int8 scales. The lengths are committed separately (_commit),
        after success. Everything is encoded before anything is stored."""
        stop = plan.k_len
        # (NumPy's own "assignment destination is read-only" names no argument)
        self._writeable_arrays("append the new keys and values")
        (k, k_scale), (v, v_scale) = self._format.encode(keys), self._format.encode(values)
        targets = [(self.key, k), (self.value, v)]
        if k_scale is not None:
            targets += [(self.key_scale, k_scale), (self.value_scale, v_scale)]
        if not plan.ragged:
            start = plan.start
            for dst, src in targets:
                dst[:, :, start:stop] = src
        else:
            for b, (start, count) in enumerate(zip(plan.starts.tolist(), plan.counts.tolist())):
                for dst, src in targets:
                    dst[b, :, start:start + count] = src[b, :, :count]
        return self.key[:, :, :stop], self.value[:, :, :stop]

    def _scales(self, stop):
        """(key_scale, value_scale) views (B, Hkv, stop), or (None, None)."""
        if self.key_scale is None:
            return None, None
        return self.key_scale[:, :, :stop], self.value_scale[:, :, :stop]

    def _advance(self, n):
        """Count n more tokens in every sequence: the commit of a call that wrote them and
        succeeded (never before: a failed call leaves the lengths as they were)."""
        equal = self._equal_length
        if equal is None:
            self._set_lengths(self._lengths + n)
        else:                               # the decode step's case, without NumPy reductions
            self._lengths.fill(equal + n)
            self._equal_length = equal + n

    def _commit(self, plan):
        if plan.ragged:
            self._set_lengths(plan.k_lens.copy())
        else:
            self._advance(plan.q_len)

    def __repr__(self):
        lengths = (f"length={self._equal_length}" if self._equal_length is not None
                   else f"lengths={self._lengths.tolist()}")
        return (f"KVCache(batch_size={self.batch_size}, num_kv_heads={self.num_kv_heads}, "
                f"{lengths}, max_len={self.max_len}, head_dim={self.head_dim}, "
                f"dtype={self.dtype})")
