"""mha_cy.plot_heads: a grid of per-head attention heatmaps (matplotlib, an optional extra).

matplotlib is imported when a picture is drawn, never by `import mha_cy`. The figure is a
plain matplotlib.figure.Figure (no pyplot state: nothing to close, safe in servers and
loops); show it in a notebook as the last expression, or save it with fig.savefig or path=.
"""
import math
import numbers

import numpy as np

from ._checks import as_array, check_ndim

# Tokens per axis that get a label each (panels grow with them up to that size).
MAX_LABELS = 64

__all__ = ["plot_heads"]

_INSTALL_HINT = ('plot_heads needs matplotlib: pip install "mha_cy[plot]" '
                 '(or pip install matplotlib)')


def _import_matplotlib():
    try:
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise ImportError(_INSTALL_HINT) from exc
    return Figure


def _labels(tokens, q_len, k_len):
    """(query labels, key labels) from tokens: None (positions), one sequence of k_len labels
    (the queries are the last q_len of them: self-attention, or a decode step over a cache),
    or a pair (query labels, key labels)."""
    if tokens is None:
        return [str(i) for i in range(k_len - q_len, k_len)], [str(j) for j in range(k_len)]
    tokens = list(tokens)
    if (len(tokens) == 2 and all(not isinstance(t, str) for t in tokens)
            and all(hasattr(t, "__len__") for t in tokens)):
        q_tokens, k_tokens = (list(map(str, t)) for t in tokens)
    else:
        k_tokens = list(map(str, tokens))
        q_tokens = k_tokens[len(k_tokens) - q_len:] if len(k_tokens) >= q_len else None
    if len(k_tokens) != k_len or q_tokens is None or len(q_tokens) != q_len:
        raise ValueError(f"tokens must give {k_len} key labels (and {q_len} query labels); got "
                         f"{len(k_tokens)} labels" + ("" if q_tokens is None else
                                                      f" and {len(q_tokens)} query labels"))
    return q_tokens, k_tokens


def plot_heads(weights, tokens=None, *, batch=0, path=None, heads=None, title=None):
    """One heatmap per head of the attention weights of one sequence; returns the Figure.

    weights: (B, H, Lq, Lk) as mha(x, need_weights=True) returns them, or (H, Lq, Lk).
    tokens: labels of the keys (the x axis) and queries (the y axis): a sequence of Lk
    strings (for self-attention), or a pair (query labels, key labels); None = positions.
    batch: which sequence of the batch to draw. heads: which heads (default all), in order.
    path: save the picture there too (any format matplotlib knows from the extension).
    Rows are queries, columns keys; one colour scale (0 to the largest weight shown) is
    shared by every panel, with a colour bar beside the grid.
    """
    w = as_array(weights, "weights")
    check_ndim(w, "weights", (3, 4), "(batch, heads, query_len, key_len) or "
                                     "(heads, query_len, key_len)")
    if w.ndim == 3:
        w = w[None]
    if isinstance(batch, bool) or not isinstance(batch, (int, np.integer)):
        raise TypeError(f"batch must be an int; got {batch!r}")
    if not 0 <= batch < w.shape[0]:
        raise ValueError(f"batch must be in [0, {w.shape[0]}) (the weights' batch size); got "
                         f"{batch}")
    w = w[batch].astype(np.float64, copy=False)
    n_heads, q_len, k_len = w.shape
    if n_heads == 0:            # (the grid's arithmetic divided by zero)
        raise ValueError(f"weights have no heads (shape {w.shape}): nothing to draw")
    heads = _check_heads(heads, n_heads)
    if 0 in (q_len, k_len):
        raise ValueError(f"weights have no queries or no keys (shape {w.shape}): nothing to draw")
    q_labels, k_labels = _labels(tokens, q_len, k_len)
    Figure = _import_matplotlib()

    cols = min(len(heads), max(1, math.ceil(math.sqrt(len(heads)))))
    rows = math.ceil(len(heads) / cols)
    # panels grow with the number of tokens so that every label stays readable, up to
    # MAX_LABELS tokens; longer axes keep that size and label every n-th token (512 tokens
    # made a 1.9 Gpx picture)
    cell = 0.22
    panel_w = max(2.5, 0.9 + cell * min(k_len, MAX_LABELS))
    panel_h = max(2.5, 0.9 + cell * min(q_len, MAX_LABELS))
    fig = Figure(figsize=(cols * panel_w + 1.2, rows * panel_h + 0.6), layout="constrained")
    axes = fig.subplots(rows, cols, squeeze=False)
    drawn = w[heads]
    finite = drawn[np.isfinite(drawn)]     # NaN / inf weights: the scale of the others
    vmax = float(finite.max()) if finite.size and finite.max() > 0 else 1.0
    font = 7 if max(q_len, k_len) > 12 else 8
    used = []
    for i, ax in enumerate(axes.flat):
        if i >= len(heads):          # the grid's spare cells
            fig.delaxes(ax)
            continue
        used.append(ax)
        h = heads[i]
        image = ax.imshow(w[h], cmap="viridis", vmin=0.0, vmax=vmax, aspect="auto",
                          interpolation="nearest")
        ax.set_title(f"head {h}", fontsize=font + 2)
        kx, qy = _every(k_len), _every(q_len)
        ax.set_xticks(range(0, k_len, kx), k_labels[::kx], rotation=90, fontsize=font)
        ax.set_yticks(range(0, q_len, qy), q_labels[::qy], fontsize=font)
        ax.tick_params(length=0)
    fig.colorbar(image, ax=used, shrink=0.6, label="attention weight")
    if title is not None:
        fig.suptitle(title)
    if path is not None:
        fig.savefig(path, dpi=110)
    return fig


def _every(n):
    """The step between labelled ticks on an axis of n tokens: at most MAX_LABELS labels."""
    return max(1, math.ceil(n / MAX_LABELS))


def _check_heads(heads, n_heads):
    """heads (None, an int, or ints) as a non-empty list of ints in [0, n_heads)."""
    if heads is None:
        return list(range(n_heads))
    if isinstance(heads, numbers.Integral) and not isinstance(heads, (bool, np.bool_)):
        heads = [heads]
    try:
        heads = list(heads)
    except TypeError:
        raise TypeError(f"heads must be an int or a list of ints; got {heads!r}") from None
    if any(isinstance(h, (bool, np.bool_)) or not isinstance(h, numbers.Integral)
           for h in heads):       # 1.7 was drawn as head 1, True as head 1
        raise TypeError(f"heads must be an int or a list of ints; got {heads!r}")
    heads = [int(h) for h in heads]
    if not heads or any(not 0 <= h < n_heads for h in heads):
        raise ValueError(f"heads must be a non-empty list of heads in [0, {n_heads}); got "
                         f"{heads}")
    return heads
