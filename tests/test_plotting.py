"""mha_cy.plot_heads: one heatmap per head, token labels, one colour scale, a file."""
import builtins
import importlib.util

import numpy as np
import pytest

import mha_cy
from mha_cy import plotting

from conftest import make_pair

# the extra "plot"; the last test (the message without it) runs either way
needs_matplotlib = pytest.mark.skipif(importlib.util.find_spec("matplotlib") is None,
                                      reason="matplotlib (the plot extra) is not installed")

TOKENS = ["the", "trophy", "did", "not", "fit", "it"]


def heatmap_axes(fig):
    return [ax for ax in fig.axes if ax.images and ax.get_title().startswith("head")]


@needs_matplotlib
def test_one_labelled_panel_per_head_and_a_colour_bar(rng, tmp_path):
    fast, _ = make_pair(rng, 40, 5, np.float32)
    x = rng.standard_normal((2, 6, 40)).astype(np.float32)
    _, weights = fast(x, need_weights=True)
    path = tmp_path / "heads.png"
    fig = mha_cy.plot_heads(weights, TOKENS, batch=1, path=path)
    panels = heatmap_axes(fig)
    assert len(panels) == 5
    assert len(fig.axes) == 6                       # 5 heatmaps (spare grid cells removed) + bar
    assert [ax.get_title() for ax in panels] == [f"head {h}" for h in range(5)]
    for h, ax in enumerate(panels):
        assert [t.get_text() for t in ax.get_xticklabels()] == TOKENS
        assert [t.get_text() for t in ax.get_yticklabels()] == TOKENS
        np.testing.assert_array_equal(ax.images[0].get_array(), weights[1, h])
        assert ax.images[0].get_clim() == (0.0, pytest.approx(float(weights[1].max())))
    colour_bars = [ax for ax in fig.axes if ax not in panels]
    assert len(colour_bars) == 1 and colour_bars[0].get_ylabel() == "attention weight"
    assert path.stat().st_size > 1000 and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@needs_matplotlib
def test_positions_pairs_of_labels_and_a_subset_of_heads(rng):
    weights = rng.random((3, 2, 4))                  # unbatched (H, Lq, Lk), cross-attention
    fig = plotting.plot_heads(weights, (["a", "b"], ["w", "x", "y", "z"]), heads=[2, 0])
    panels = heatmap_axes(fig)
    assert [ax.get_title() for ax in panels] == ["head 2", "head 0"]
    assert [t.get_text() for t in panels[0].get_yticklabels()] == ["a", "b"]
    fig = plotting.plot_heads(weights)               # positions; queries are the last keys
    panels = heatmap_axes(fig)
    assert [t.get_text() for t in panels[0].get_xticklabels()] == ["0", "1", "2", "3"]
    assert [t.get_text() for t in panels[0].get_yticklabels()] == ["2", "3"]


@needs_matplotlib
def test_plot_heads_errors(rng):
    weights = rng.random((1, 2, 3, 3))
    with pytest.raises(ValueError, match="3 key labels"):
        plotting.plot_heads(weights, ["a", "b"])
    with pytest.raises(ValueError, match=r"batch must be in \[0, 1\)"):
        plotting.plot_heads(weights, batch=1)
    with pytest.raises(ValueError, match="weights must be 3-D or 4-D"):
        plotting.plot_heads(weights[0, 0])
    with pytest.raises(ValueError, match=r"heads in \[0, 2\)"):
        plotting.plot_heads(weights, heads=[2])
    # 1.7 was drawn as head 1, an int raised "'int' object is not iterable", no heads divided
    # by zero
    for bad in ([1.7], [True], "1"):
        with pytest.raises(TypeError, match="heads must be an int or a list of ints"):
            plotting.plot_heads(weights, heads=bad)
    with pytest.raises(ValueError, match="weights have no heads"):
        plotting.plot_heads(np.zeros((1, 0, 3, 3)))


def test_one_head_by_int_long_axes_and_non_finite_weights(rng):
    pytest.importorskip("matplotlib")
    weights = rng.random((1, 3, 4, 4))
    assert len(plotting.plot_heads(weights, heads=2).axes) == 2       # the panel + colour bar
    # 512 tokens drew a 1.9 Gpx picture: panels stop growing at MAX_LABELS tokens
    n = 512
    fig = plotting.plot_heads(np.full((1, 2, n, n), 1.0 / n))
    assert (fig.get_size_inches() * 110).prod() < 40e6
    assert len(fig.axes[0].get_xticks()) <= plotting.MAX_LABELS
    # NaN / inf weights: the colour scale of the finite ones (it was (-0.1, 0.1))
    w = np.full((1, 2, 3, 3), 0.25)
    w[0, 0, 0, 0], w[0, 1, 1, 1] = np.nan, np.inf
    assert plotting.plot_heads(w).axes[0].images[0].get_clim() == (0.0, 0.25)


def test_a_clear_message_without_matplotlib(monkeypatch):
    real_import = builtins.__import__

    def no_matplotlib(name, *args, **kwargs):
        if name.startswith("matplotlib"):
            raise ImportError("No module named 'matplotlib'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    with pytest.raises(ImportError, match=r'pip install "mha_cy\[plot\]"'):
        plotting.plot_heads(np.ones((1, 1, 2, 2)))
