"""Scratch arrays a module reuses from call to call: the projections' heads (q, k, v) and the
attention's context, intermediates that no caller ever sees.

Why: NumPy's arrays above 32 MiB come from fresh mmap'ed pages (glibc's largest mmap
threshold), so each call paid the page faults of its first writes: 4.2 ms to touch a new
38 MiB array (the QKV heads of encoder_batched, B 8, L 512, d 768) where touching a reused one
took 0.1 ms. encoder_batched's module call, 2 threads, Intel Xeon, 3 alternating runs of min
of 7: 99.0-101.5 -> 92.8-97.3 ms with these buffers.

Rules that keep it safe:
- a call leases the buffers for itself (list.pop, atomic under the GIL) and hands them back
  when it ends, also on an exception; a concurrent call of the same module finds none and
  allocates its own, so two calls never share an array;
- nothing a caller receives may view a scratch array (outputs, weights and cache entries are
  copies): the next call overwrites it;
- a module keeps one set of buffers, at most MAX_KEPT_BYTES, and release() frees them;
  pickling and deepcopy carry no buffers.
"""
from contextlib import contextmanager

import numpy as np

from ._aligned_arrays import lines_bytes, lines_view

# The most bytes of buffers a module keeps between calls (larger sets are dropped at the end of
# the call that needed them, as before this cache existed).
MAX_KEPT_BYTES = 512 * 1024 * 1024


class Scratch:
    """One module's reusable scratch buffers (see the module docstring)."""

    def __init__(self):
        self._free = []         # at most one set: {name: raw uint8 array}

    @contextmanager
    def lease(self):
        """A Lease of this module's buffers for the duration of one call."""
        try:
            buffers = self._free.pop()
        except IndexError:      # first call, after release(), or another call holds them
            buffers = {}
        try:
            yield Lease(buffers)
        finally:
            if not self._free and sum(b.nbytes for b in buffers.values()) <= MAX_KEPT_BYTES:
                self._free.append(buffers)

    def release(self):
        """Free the kept buffers (a call in progress keeps its own until it ends)."""
        self._free.clear()

    def __reduce__(self):       # pickled and deep-copied modules start without buffers
        return Scratch, ()


class Lease:
    """The scratch buffers of one call: array(name, ...) gives the same memory each call."""

    def __init__(self, buffers):
        self._buffers = buffers

    def array(self, name, shape, dtype):
        """An uninitialized C-contiguous array starting on a cache line (as empty_lines), in
        the buffer `name`, grown when too small. One array per name and call."""
        nbytes = lines_bytes(shape, dtype)
        raw = self._buffers.get(name)
        if raw is None or raw.nbytes < nbytes:
            raw = self._buffers[name] = np.empty(nbytes, dtype=np.uint8)
        return lines_view(raw, shape, dtype)
