"""How a KVCache stores its keys and values: the storage formats of new_cache(dtype=...).

- FloatFormat: the module's float32 / float64, stored as computed.
- Float16Format: IEEE float16 (half the bytes of float32). Writing rounds to nearest even;
  finite values beyond +-65504 become +-inf (float16 cannot hold them), NaN stays NaN.
- Int8Format: symmetric int8 (a quarter of the bytes), one float32 scale per (batch, K/V
  head, position) for K and for V each: scale = max|x| / 127 over the position's head_dim
  values, x_int8 = round_half_even(x / scale) clipped to [-127, 127]; the stored value means
  x_int8 * scale (error at most scale / 2 per value). A zero row gets scale 0 (and a row too
  tiny for a nonzero float32 scale reads back as zeros). A row holding NaN or +-inf gets
  scale NaN and zeros: every value of it reads back NaN, never silently finite.
  So a NaN/inf written to any of these caches stays non-finite where it is used: the
  attention rows that see it are NaN, as with a float32 cache.

float16 and int8 caches compute in float32 (the kernels convert the stored values in
registers, or one key tile at a time into a per-thread buffer, never the whole cache); a
float64 module refuses them (its point is float64 accuracy, which they cannot keep).
Each format is a small record with the same methods (the kernels see only `kernel_format`):
encode (values -> storage), decode (storage -> float), and the arrays to allocate.
The float16 and int8 encodes are src/kv_encode.c (mha_cy._kv_encode), the code the compiled
decode step writes its cache with, so both paths store the same bits; tests check it against
the NumPy statement of these rules (tests/test_step_kernel_formats.py).
"""
import numpy as np

from . import _kv_encode


class FloatFormat:
    """Keys/values stored in the module's own float dtype."""
    has_scales = False

    def __init__(self, dtype):
        self.dtype = np.dtype(dtype)
        self.compute_dtype = self.dtype

    def encode(self, x):
        """(stored values, scales or None) of the float array x (..., head_dim)."""
        return x, None

    def decode(self, stored, scale):
        """The float values that stored (with its scales) means."""
        return stored

    def __eq__(self, other):
        return type(self) is type(other) and self.dtype == other.dtype

    def __hash__(self):
        return hash((type(self), self.dtype))


class Float16Format(FloatFormat):
    """Keys/values stored as float16, computed in float32."""

    def __init__(self):
        self.dtype = np.dtype(np.float16)
        self.compute_dtype = np.dtype(np.float32)

    def encode(self, x):
        return _kv_encode.encode_f16(x), None    # x.astype(np.float16), without its warning

    def decode(self, stored, scale):
        return stored.astype(np.float32)


class Int8Format(FloatFormat):
    """Symmetric int8 with one float32 scale per (batch, K/V head, position)."""
    has_scales = True

    def __init__(self):
        self.dtype = np.dtype(np.int8)
        self.compute_dtype = np.dtype(np.float32)

    def encode(self, x):
        # one C call: a decode step encodes a few rows, where each NumPy call's fixed cost is
        # the whole cost (a dozen of them: ~44 us for 4 heads x 16 values, here ~2 us)
        return _kv_encode.encode_i8(x)

    def decode(self, stored, scale):
        return stored.astype(np.float32) * scale[..., None]


def cache_format(dtype, module_dtype):
    """The format of new_cache(dtype=dtype) for a module of module_dtype; TypeError /
    ValueError naming dtype otherwise."""
    module_dtype = np.dtype(module_dtype)
    if dtype is None:
        return FloatFormat(module_dtype)
    expected = f"dtype must be None (= {module_dtype}), np.float16 or 'int8'"
    try:
        dt = np.dtype(dtype)
    except TypeError:       # not a dtype at all (a dtype this cache lacks: ValueError below)
        raise TypeError(f"{expected}; got {dtype!r}, which is not a NumPy dtype") from None
    if dt == module_dtype:
        return FloatFormat(module_dtype)
    if dt not in (np.dtype(np.float16), np.dtype(np.int8)):
        raise ValueError(f"{expected}; got {dt}")
    if module_dtype != np.float32:
        raise ValueError(f"dtype {dt} caches need a float32 module (they compute in float32); "
                         f"this module is {module_dtype}: use dtype=None")
    return Float16Format() if dt == np.float16 else Int8Format()
