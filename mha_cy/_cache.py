"""The key/value cache of incremental (token-by-token) decoding."""
import numpy as np


class KVCache:
    """Preallocated keys and values of the tokens decoded so far, for one module.

    ``key`` and ``value`` are (batch_size, num_kv_heads, max_len, head_dim) arrays; the first
    ``length`` positions hold the projected keys/values of the tokens seen so far. With GQA/MQA
    only num_kv_heads heads are stored, which is what makes the cache smaller.

    A call ``mha(x, cache=cache)`` appends the keys/values of x and attends causally over the
    whole cache. A call that fails (bad input, overflow) leaves ``length`` unchanged, so the
    cache is exactly as it was: positions past ``length`` are scratch, never state.
    """

    def __init__(self, batch_size, num_kv_heads, max_len, head_dim, dtype):
        shape = (batch_size, num_kv_heads, max_len, head_dim)
        self.key = np.zeros(shape, dtype=dtype)
        self.value = np.zeros(shape, dtype=dtype)
        self._length = 0

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
        return self.key.dtype

    @property
    def length(self):
        """Number of tokens cached so far."""
        return self._length

    def truncate(self, length):
        """Forget every token after the first `length` (e.g. to roll back a rejected draft)."""
        if isinstance(length, bool) or not isinstance(length, (int, np.integer)):
            raise TypeError(f"length must be an int; got {length!r}")
        if not 0 <= length <= self._length:
            raise ValueError(f"length must be in [0, {self._length}] (the cached length); "
                             f"got {length}")
        self._length = int(length)

    def reset(self):
        """Empty the cache (the storage is kept for reuse)."""
        self._length = 0

    def _check_room(self, n_new):
        if self._length + n_new > self.max_len:
            raise ValueError(
                f"cache overflow: {self._length} cached + {n_new} new tokens > max_len "
                f"{self.max_len}; make the cache with a larger max_len (the cache is unchanged)")

    def _write(self, keys, values):
        """Store (B, Hkv, n, D) keys/values after the cached ones; return the (B, Hkv, length + n, D)
        views to attend over. The length is committed separately (_commit), after success."""
        start, stop = self._length, self._length + keys.shape[2]
        self.key[:, :, start:stop] = keys
        self.value[:, :, start:stop] = values
        return self.key[:, :, :stop], self.value[:, :, :stop]

    def _commit(self, n_new):
        self._length += n_new

    def __repr__(self):
        return (f"KVCache(batch_size={self.batch_size}, num_kv_heads={self.num_kv_heads}, "
                f"length={self.length}, max_len={self.max_len}, head_dim={self.head_dim}, "
                f"dtype={self.dtype})")
