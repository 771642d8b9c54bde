"""Argument checks shared by the fast path and the reference.

Every error names the argument and gives the expected and the actual value. The checks only
validate and convert; what a mask *means* is computed separately by each implementation, so
that the reference stays an independent oracle for the kernels.
"""
import math
import numbers

import numpy as np

FLOAT_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))


def float_dtype(dtype, name="dtype"):
    """The numpy dtype for a module/compute dtype: float32 or float64, else TypeError.

    None is refused: np.dtype(None) is float64, which would silently double the memory of a
    module whose documented default is float32. Callers with a meaning for None (e.g.
    "infer from the weights") handle it before calling.
    """
    if dtype is None:
        raise TypeError(f"{name} must be float32 or float64; got None")
    try:
        dt = np.dtype(dtype)
    except TypeError:
        raise TypeError(f"{name} must be float32 or float64; got {dtype!r}") from None
    if dt not in FLOAT_DTYPES:
        raise TypeError(f"{name} must be float32 or float64; got {dt}")
    return dt


def real_as_float(value):
    """A numbers.Real as a Python float; inf for an int beyond float range (10**400), where
    float() raises OverflowError, so that the caller's finiteness check names the argument."""
    try:
        return float(value)
    except OverflowError:
        return math.inf if value > 0 else -math.inf


def positive_int(value, name):
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int >= 1; got {value!r}")
    if value < 1:
        raise ValueError(f"{name} must be >= 1; got {value}")
    return int(value)


def torch_to_numpy(x):
    """x, or a CPU torch tensor's values as a NumPy array (any device, strides, requires_grad;
    bfloat16 and the float8 types, which NumPy lacks, widened to float32, which holds them
    exactly; torch's own error for them named no argument). torch is not imported."""
    if hasattr(x, "detach") and hasattr(x, "cpu") and hasattr(x, "numpy"):
        x = x.detach().cpu()
        if x.is_floating_point() and str(x.dtype) not in (
                "torch.float16", "torch.float32", "torch.float64"):
            x = x.float()
        x = x.numpy()
    return x


def as_array(x, name):
    """x as a numpy array of real numbers (CPU torch tensors are accepted too).

    bool arrays are data like any other (True = 1.0) and are converted by the callers; the
    bool *masks* have their own checks (check_key_padding_mask, check_attn_mask).
    """
    x = torch_to_numpy(x)
    try:
        arr = np.asarray(x)
    except Exception as exc:
        raise TypeError(f"{name} must be an array of real numbers; got {type(x).__name__}") from exc
    if arr.dtype.kind not in "fiub":
        raise TypeError(
            f"{name} must have a real floating (or integer or bool) dtype; got {arr.dtype}")
    return arr


def as_float_array(x, name, dtype):
    """x converted to dtype (no copy when it already has it)."""
    return as_array(x, name).astype(dtype, copy=False)


def result_dtype(*arrays):
    """float64 if any input is a float of 8 bytes or more (float64 in either byte order,
    longdouble: computed in float32 before), else float32 (the two dtypes computed natively)."""
    wide = any(a.dtype.kind == "f" and a.dtype.itemsize >= 8 for a in arrays)
    return np.dtype(np.float64) if wide else np.dtype(np.float32)


def check_ndim(arr, name, ndims, what):
    if arr.ndim not in ndims:
        expected = " or ".join(f"{n}-D" for n in ndims)
        raise ValueError(f"{name} must be {expected} {what}; got shape {arr.shape}")


def check_dim(actual, expected, name, axis_name):
    if actual != expected:
        raise ValueError(f"{name} has {axis_name} {actual}; expected {expected}")


def check_bool_flag(value, name):
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be a bool; got {value!r}")
    return bool(value)


def check_key_padding_mask(mask, batch, k_len):
    """A bool (batch, k_len) array, True = padding (the key is ignored)."""
    arr = np.asarray(torch_to_numpy(mask))
    if arr.dtype != np.bool_:
        raise TypeError(
            f"key_padding_mask must be a bool array (True = padding, ignored); got dtype {arr.dtype}")
    if arr.shape != (batch, k_len):
        raise ValueError(
            f"key_padding_mask must have shape (batch, key_len) = {(batch, k_len)}; got {arr.shape}")
    return arr


def check_attn_mask(mask, batch, heads, q_len, k_len, dtype):
    """attn_mask as a 4-D array whose axes are 1 or the full (B, H, Lq, Lk) size.

    Accepted: (Lq, Lk), (B, Lq, Lk), (B, H, Lq, Lk), any axis may be 1 (broadcast).
    bool: True = may attend. floating: added to the scores (converted to dtype).
    """
    arr = np.asarray(torch_to_numpy(mask))
    if arr.dtype.kind == "f":
        arr = arr.astype(dtype, copy=False)
    elif arr.dtype != np.bool_:
        raise TypeError(
            "attn_mask must be bool (True = may attend) or floating (added to the scores); "
            f"got dtype {arr.dtype}")
    full = (batch, heads, q_len, k_len)
    if arr.ndim == 2:
        arr4 = arr[None, None]
    elif arr.ndim == 3:
        arr4 = arr[:, None]
    elif arr.ndim == 4:
        arr4 = arr
    else:
        raise ValueError(f"attn_mask must be 2-D (Lq, Lk), 3-D (B, Lq, Lk) or 4-D (B, H, Lq, Lk); "
                         f"got shape {arr.shape}")
    if any(a not in (1, f) for a, f in zip(arr4.shape, full)):
        names = {2: "(Lq, Lk)", 3: "(B, Lq, Lk)", 4: "(B, H, Lq, Lk)"}[arr.ndim]
        expected = {2: full[2:], 3: (batch,) + full[2:], 4: full}[arr.ndim]
        hint = ""
        if arr.ndim == 3 and arr.shape[0] == batch * heads and heads > 1:
            hint = (" (PyTorch's (B * num_heads, Lq, Lk) layout: reshape it to "
                    "(B, num_heads, Lq, Lk))")
        elif arr.ndim == 3 and arr.shape[0] == heads and heads > 1:
            hint = (" (torch's scaled_dot_product_attention broadcasts a 3-D mask as "
                    "(num_heads, Lq, Lk): for a mask per head, reshape it to "
                    "(1, num_heads, Lq, Lk))")
        raise ValueError(f"attn_mask of shape {arr.shape} does not fit {names} = {expected} "
                         f"(each axis must equal that size or be 1){hint}")
    return arr4


def check_head_mask(mask, batch, heads, dtype):
    """head_mask as a (1 or batch, heads) array of dtype: a multiplier of each head's context.

    Accepted: (num_heads,) for every sequence, or (batch, num_heads) per sequence.
    """
    arr = as_float_array(mask, "head_mask", dtype)
    if arr.shape == (heads,):
        return arr[None]
    if arr.shape != (batch, heads):
        raise ValueError(f"head_mask must have shape (num_heads,) = ({heads},) or "
                         f"(batch, num_heads) = {(batch, heads)}; got {arr.shape}")
    return arr


def check_scale(scale, head_dim):
    if scale is None:
        return 1.0 / float(np.sqrt(head_dim))     # a Python float, like an explicit scale
    if isinstance(scale, (bool, np.bool_)) or not isinstance(scale, numbers.Real):
        raise TypeError(f"scale must be a real number or None; got {scale!r}")
    value = real_as_float(scale)    # (np.isfinite refuses a Fraction)
    if not math.isfinite(value):
        raise ValueError(f"scale must be finite; got {scale}")
    return value


def check_sdpa_inputs(q, k, v, attn_mask, is_causal, scale):
    """Validated (q, k, v, attn_mask_4d_or_None, is_causal, scale) for scaled_dot_product_attention.

    q (B, Hq, Lq, D), k (B, Hkv, Lk, D), v (B, Hkv, Lk, Dv), Hq % Hkv == 0; all converted to
    one dtype: float64 if any of them is float64, else float32.
    """
    q, k, v = as_array(q, "q"), as_array(k, "k"), as_array(v, "v")
    for name, arr in (("q", q), ("k", k), ("v", v)):
        check_ndim(arr, name, (4,), "(batch, heads, length, head_dim)")
    dt = result_dtype(q, k, v)
    q, k, v = (a.astype(dt, copy=False) for a in (q, k, v))
    B, Hq, Lq, D = q.shape
    check_dim(k.shape[0], B, "k", "batch size")
    check_dim(v.shape[0], B, "v", "batch size")
    check_dim(k.shape[3], D, "k", "head_dim (last axis, must match q's)")
    check_dim(v.shape[1], k.shape[1], "v", "heads (must match k's)")
    check_dim(v.shape[2], k.shape[2], "v", "length (must match k's)")
    Hkv, Lk = k.shape[1], k.shape[2]
    if Hq % max(Hkv, 1) != 0 or (Hkv == 0 and Hq != 0):    # (no heads at all: an empty result)
        raise ValueError(f"q has {Hq} heads and k/v have {Hkv}: the number of query heads must be "
                         "a multiple of the number of key/value heads")
    if D == 0:
        raise ValueError("q and k have head_dim 0; expected >= 1")
    is_causal = check_bool_flag(is_causal, "is_causal")
    scale = check_scale(scale, D)
    mask = None
    if attn_mask is not None:
        mask = check_attn_mask(attn_mask, B, Hq, Lq, Lk, dt)
    return q, k, v, mask, is_causal, scale
