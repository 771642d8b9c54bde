"""Every SIMD path of the C kernels this CPU can run, forced with MHA_CY_SIMD, against the
reference: the portable (x86-64 baseline) code a wheel runs on old CPUs is tested even on an
AVX-512 machine. The variable is read when the extension modules load, so each path runs in
a fresh interpreter; the reference and the assertions stay in this process."""

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import mha_cy
from mha_cy import reference
from mha_cy._linear_kernel import _set_panel_isa
from mha_cy._simd import check_simd_request

from conftest import assert_close, random_weights

RANK = {"sse2": 0, "avx2": 1, "avx512": 2}
PATHS = {"avx512": "avx512", "avx2": "avx2", "portable": "sse2"}   # MHA_CY_SIMD -> simd

# Each case exercises other kernels: projections of few rows (small_gemm) and of a moderate
# number (row_panel_gemm), the packed and the direct fused attention tiles, the softmax rows of
# need_weights, and the BLAS path's online softmax (head_dim > 256).
CASES = {
    "self_causal": dict(embed_dim=64, num_heads=4, num_kv_heads=2, batch=2, length=40,
                        call=dict(is_causal=True)),
    "weights": dict(embed_dim=48, num_heads=3, batch=2, length=19,
                    call=dict(need_weights=True)),
    "decode": dict(embed_dim=64, num_heads=4, batch=2, length=21, decode=3, call={}),
    # MQA, 8 query heads of head dim 32 on one K/V head: the direct kernel's 8-row block
    # (AVX-512 only; 2 blocks of 4 rows below), over two key tiles and a partial one
    "decode_mqa": dict(embed_dim=256, num_heads=8, num_kv_heads=1, batch=2, length=150,
                       decode=3, call={}),
    "wide_heads": dict(embed_dim=600, num_heads=2, batch=1, length=9,
                       call=dict(is_causal=True)),
}

CHILD = textwrap.dedent(
    """\
    import json, sys
    import numpy as np
    import mha_cy
    from mha_cy._linear_kernel import _set_panel_isa
    data = np.load(sys.argv[1], allow_pickle=True)
    cases = json.loads(sys.argv[2])
    out = {"simd": mha_cy.build_info()["simd"], "file": mha_cy.__file__}
    _set_panel_isa(2)                        # capped at the forced level
    out["panel_isa"] = _set_panel_isa(-1)
    results = {}
    for name, case in cases.items():
        for dtype in ("float32", "float64"):
            w = data[name + "_weights"].item()
            x = data[name + "_x"].astype(dtype)
            mha = mha_cy.MultiHeadAttention.from_weights(**w, dtype=dtype)
            steps = case.get("decode", 0)
            if steps:                        # prefill, then one token at a time
                cache = mha.new_cache(x.shape[0], x.shape[1])
                parts = [mha(x[:, :-steps], cache=cache)]
                parts += [mha(x[:, t:t + 1], cache=cache) for t in range(x.shape[1] - steps,
                                                                          x.shape[1])]
                results[f"{name}_{dtype}"] = np.concatenate(parts, axis=1)
            else:
                res = mha(x, **case["call"])
                if isinstance(res, tuple):
                    results[f"{name}_{dtype}"], results[f"{name}_{dtype}_w"] = res
                else:
                    results[f"{name}_{dtype}"] = res
    np.savez(sys.argv[3], **results)
    print(json.dumps(out))
    """
)


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    rng = np.random.default_rng(1234)
    arrays = {}
    for name, case in CASES.items():
        arrays[name + "_weights"] = np.array(
            random_weights(rng, case["embed_dim"], case["num_heads"],
                           num_kv_heads=case.get("num_kv_heads")), dtype=object)
        arrays[name + "_x"] = rng.standard_normal((case["batch"], case["length"],
                                                   case["embed_dim"]))
    path = tmp_path_factory.mktemp("simd") / "inputs.npz"
    np.savez(path, **arrays)
    return path, arrays


def _expected(arrays, name, dtype):
    case = CASES[name]
    ref = reference.MultiHeadAttention.from_weights(**arrays[name + "_weights"].item(),
                                                    dtype=dtype)
    x = arrays[name + "_x"].astype(dtype)
    if case.get("decode"):                   # a cache is causal attention over the prefix
        return ref(x, is_causal=True), None
    res = ref(x, **case["call"])
    return res if isinstance(res, tuple) else (res, None)


@pytest.mark.parametrize("request_value", list(PATHS))
def test_forced_simd_path_matches_reference(request_value, inputs, tmp_path):
    info = mha_cy.build_info()
    if info["simd_cpu"] not in RANK:
        pytest.skip(f"no run-time SIMD dispatch in this build (simd {info['simd_cpu']!r}: "
                    "native build, or not gcc on x86-64)")
    level = PATHS[request_value]
    if RANK[level] > RANK[info["simd_cpu"]]:
        pytest.skip(f"this CPU cannot run the {level} path (its best is {info['simd_cpu']!r})")
    path, arrays = inputs
    out_path = tmp_path / "out.npz"
    env = dict(os.environ, MHA_CY_SIMD=request_value)
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, str(path), json.dumps(CASES), str(out_path)],
        env=env, capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr
    child = json.loads(proc.stdout.strip().splitlines()[-1])
    # the same package as this process, running the forced path in every dispatcher
    assert os.path.dirname(child["file"]) == os.path.dirname(mha_cy.__file__)
    assert child["simd"] == level
    assert child["panel_isa"] == RANK[level]
    got = np.load(out_path)
    for name in CASES:
        for dtype in (np.float32, np.float64):
            key = f"{name}_{np.dtype(dtype).name}"
            expected, weights = _expected(arrays, name, dtype)
            assert_close(got[key], expected, dtype, factor=10, err_msg=f"{key} {level}")
            if weights is not None:
                assert_close(got[key + "_w"], weights, dtype, factor=10,
                             err_msg=f"{key} weights {level}")


def test_simd_request_checked():
    with pytest.raises(ValueError, match="MHA_CY_SIMD.*'avx3'"):
        check_simd_request({"MHA_CY_SIMD": "avx3"})
    check_simd_request({})                              # unset and auto: nothing to say
    check_simd_request({"MHA_CY_SIMD": "auto"})
    if mha_cy.build_info()["simd"] == "avx2":          # a level this CPU lacks: a warning
        with pytest.warns(RuntimeWarning, match="avx512"):
            check_simd_request({"MHA_CY_SIMD": "avx512"})


def test_panel_isa_hook_is_capped():
    best = _set_panel_isa(-1)
    try:
        assert _set_panel_isa(5) == best and _set_panel_isa(-1) == best
    finally:
        _set_panel_isa(-1)
