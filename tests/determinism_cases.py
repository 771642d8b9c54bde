"""Every kernel path, run at a given thread count: the cases of test_determinism.py, importable
by a fresh interpreter too (the BLAS kernel is chosen at load time, by the environment)."""
import numpy as np

import mha_cy

THREAD_COUNTS = (1, 2, 3, 4)


def _module(rng, embed_dim, heads, kv_heads, dtype):
    return mha_cy.MultiHeadAttention(embed_dim, heads, num_kv_heads=kv_heads, dtype=dtype,
                                     seed=int(rng.integers(1 << 30)))


def outputs(n_threads, dtype=np.float32, seed=0):
    """name -> output array of every path, computed on n_threads threads. Sizes are chosen so
    that the projections are cut into many tiles, attention into many tasks, split-K into
    several parts, and decode projections go through small_gemm."""
    rng = np.random.default_rng(seed)
    out = {}
    with mha_cy.threads(n_threads):
        mha = _module(rng, 256, 8, 8, dtype)
        x = rng.standard_normal((4, 200, 256))
        pad = np.zeros((4, 200), bool)
        pad[0, 150:] = pad[2, :20] = True
        mask = rng.standard_normal((4, 8, 200, 200)) * (rng.random((4, 8, 200, 200)) < 0.1)
        out["prefill_padding_mask"] = mha(x, key_padding_mask=pad, attn_mask=mask)
        out["causal"] = mha(x, is_causal=True)
        out["cross"] = mha(x[:, :37], x)
        y, w = mha(x, need_weights=True, is_causal=True)
        out["weights_out"], out["weights"] = y, w

        gqa = _module(rng, 512, 8, 2, dtype)         # decode projections: small_gemm
        cache = gqa.new_cache(3, 400)
        out["gqa_prefill"] = gqa(rng.standard_normal((3, 300, 512)), cache=cache)
        out["gqa_decode"] = gqa(rng.standard_normal((3, 1, 512)), cache=cache)

        q = rng.standard_normal((1, 4, 1, 64))          # one sequence, MQA: split-K
        k = rng.standard_normal((1, 1, 5000, 64))
        v = rng.standard_normal((1, 1, 5000, 64))
        out["split_k"] = mha_cy.scaled_dot_product_attention(q.astype(dtype), k, v)
        q = rng.standard_normal((2, 4, 300, 32))
        out["sdpa_causal"] = mha_cy.scaled_dot_product_attention(q.astype(dtype), q, q,
                                                                 is_causal=True)
    return out


def mismatches(dtype=np.float32):
    """Names of the outputs that differ bitwise between any thread count and 1 thread."""
    base = outputs(1, dtype)
    bad = []
    for n in THREAD_COUNTS[1:]:
        for name, value in outputs(n, dtype).items():
            if not np.array_equal(value, base[name], equal_nan=True):
                bad.append(f"{name} at {n} threads")
    return bad
