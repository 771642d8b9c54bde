"""python -m mha_cy (mha_cy/__main__.py): the main job on small sizes."""
import numpy as np
import pytest

from mha_cy import __main__ as main_job


@pytest.mark.parametrize("argv", [
    ["--seq-len", "16", "--embed-dim", "64", "--heads", "4", "--repeats", "2"],
    ["--seq-len", "33", "--embed-dim", "48", "--heads", "6", "--kv-heads", "2", "--causal",
     "--threads", "1", "--dtype", "float64", "--repeats", "1", "--batch", "2"],
])
def test_main_job_agrees_and_reports(capsys, argv):
    assert main_job.main(argv) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0].startswith("mha_cy ")          # the build info comes first
    assert "OpenMP" in out and "BLAS" in out and "SIMD" in out
    assert ": OK" in out and "speedup:" in out
    assert "causal" in out if "--causal" in argv else "no mask" in out


def test_main_job_exit_status_1_on_disagreement(capsys, monkeypatch):
    """A wrong fast path must not be reported as a speedup."""
    real_call = main_job.MultiHeadAttention.__call__
    monkeypatch.setattr(main_job.MultiHeadAttention, "__call__",
                        lambda self, *a, **k: real_call(self, *a, **k) + np.float32(1e-2))
    assert main_job.main(["--seq-len", "8", "--embed-dim", "32", "--heads", "2",
                          "--repeats", "1"]) == 1
    assert "MISMATCH" in capsys.readouterr().out


@pytest.mark.parametrize("argv,message", [
    (["--heads", "5"], "must divide"),
    (["--kv-heads", "5"], "kv-heads"),
    (["--seq-len", "0"], "seq-len"),
    (["--threads", "0"], "threads"),
    (["--threads", "100000"], "--threads must be between 1 and"),
    (["--seed", "-1"], "--seed must be >= 0"),
])
def test_main_job_rejects_bad_options(capsys, argv, message):
    with pytest.raises(SystemExit) as exc:
        main_job.main(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err
