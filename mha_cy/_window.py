"""The sliding window of local attention (Mistral): checks of the `window=` argument.

With is_causal or a cache, query slot i sees key slots j with
i + (Lk - Lq) - window < j <= i + (Lk - Lq): the causal diagonal and the window - 1 keys
before it. The kernels skip the key tiles outside every row's window (a long decode reads only
the window); the reference applies it as one more boolean mask.
"""
import numbers

import numpy as np


def check_window(window):
    """window as an int >= 1, or None (unlimited); TypeError / ValueError otherwise."""
    if window is None:
        return None
    if isinstance(window, (bool, np.bool_)) or not isinstance(window, numbers.Integral):
        raise TypeError(f"window must be an int >= 1 or None; got {window!r}")
    if window < 1:
        raise ValueError(f"window must be >= 1 (or None for no window); got {window}")
    return int(window)


def require_causal(window, causal):
    """A window is defined relative to the causal diagonal: refuse it without one."""
    if window is not None and not causal:
        raise ValueError(f"window={window} needs is_causal=True (or a cache, which is causal): "
                         "the window is counted back from the causal diagonal")
