"""examples/generate.py runs end to end: ragged prefill and token-by-token generation through
mha_cy's caches give the NumPy baseline's tokens."""
import importlib.util
import pathlib

import numpy as np

EXAMPLE = pathlib.Path(__file__).resolve().parent.parent / "examples" / "generate.py"


def _example():
    spec = importlib.util.spec_from_file_location("generate_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_generation_matches_the_numpy_baseline(capsys):
    rows = _example().main(["--layers", "2", "--d-model", "64", "--heads", "4",
                            "--kv-heads", "2", "--vocab", "50", "--prompts", "3",
                            "--new-tokens", "6", "--repeats", "1", "--no-progress",
                            "--cache-dtypes", "float32"])
    labels = [row[0] for row in rows]
    assert labels == ["numpy baseline", "mha_cy, float32 cache"]
    baseline, tokens = rows[0][3], rows[1][3]
    assert baseline.shape == (3, 6) and baseline.min() >= 0 and baseline.max() < 50
    np.testing.assert_array_equal(tokens, baseline)
    out = capsys.readouterr().out
    assert "generate tok/s" in out and "18/18" in out


def test_generation_rate_counts_only_the_stepped_tokens(capsys):
    """The first new token comes from the prefill: with --new-tokens 1 no step runs (the
    rate printed was 2.3 million tok/s), and bad options are usage errors."""
    example = _example()
    example.main(["--layers", "1", "--d-model", "32", "--heads", "2", "--kv-heads", "1",
                  "--prompts", "2", "--new-tokens", "1", "--repeats", "1", "--no-progress",
                  "--cache-dtypes", "int8"])
    row = [line for line in capsys.readouterr().out.splitlines()
           if line.startswith("mha_cy, int8 cache")][0]
    assert row.split()[-2] == "-"
    import pytest
    for bad in (["--new-tokens", "0"], ["--prompts", "0"], ["--kv-heads", "3"],
                ["--cache-dtypes", "bogus"], ["--threads", "0"]):
        with pytest.raises(SystemExit):
            example.main(bad)


def test_prompts_of_different_lengths_each_follow_their_own_positions():
    """A sequence generates the same tokens alone as inside the ragged batch."""
    example = _example()
    import mha_cy
    model = example.ToyDecoder(40, 32, 4, 2, 2, seed=3)
    attention = model.attention_modules(mha_cy)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 40, n) for n in (2, 9, 5)]
    together, _, _ = example.generate(model, attention, prompts, 5)
    for b, prompt in enumerate(prompts):
        alone, _, _ = example.generate(model, attention, [prompt], 5)
        np.testing.assert_array_equal(alone[0], together[b])
