"""The sliding window of local attention (Mistral): checks of the `window=` argument.

With is_causal or a cache, query slot i sees key slots j with
i + (Lk - Lq) - window < j <= i + (Lk - Lq): the causal diagonal and the window - 1 keys
before it. The kernels skip the key tiles outside every row's window (a long decode reads only
the window); the reference applies it as one more boolean mask.
"""
import sys

from ._checks import positive_int


def check_window(window):
    """window as an int >= 1, or None (unlimited); TypeError / ValueError otherwise.
    At most sys.maxsize: the kernels take it as a C ssize_t (a larger int raised
    OverflowError in the middle of a call; sys.maxsize already covers any length)."""
    if window is None:
        return None
    window = positive_int(window, "window")
    if window > sys.maxsize:
        raise ValueError(f"window must be <= sys.maxsize = {sys.maxsize} (None = unlimited); "
                         f"got {window}")
    return window


def require_causal(window, causal):
    """A window is defined relative to the causal diagonal: refuse it without one."""
    if window is not None and not causal:
        raise ValueError(f"window={window} needs is_causal=True (or a cache, which is causal): "
                         "the window is counted back from the causal diagonal")
