"""Arrays whose address is not a multiple of their item size (a view one byte into a buffer,
np.frombuffer at an offset) are valid NumPy arrays; the C kernels load REALs from aligned
addresses only (an unaligned load is undefined behaviour, which UBSan reports in the sanitizer
step), so such arrays are copied first. Results are bitwise those of aligned copies."""
import numpy as np
import pytest

import mha_cy
from mha_cy import reference

from conftest import DTYPES, assert_close
from fuzz_inputs import unaligned


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("lq, lk", [(1, 40), (7, 300), (1, 2048)])
def test_sdpa_with_unaligned_q_k_v_and_mask(rng, dtype, lq, lk):
    q = rng.standard_normal((2, 4, lq, 16)).astype(dtype)
    k = rng.standard_normal((2, 2, lk, 16)).astype(dtype)
    v = rng.standard_normal((2, 2, lk, 8)).astype(dtype)
    mask = rng.standard_normal((lq, lk)).astype(dtype)
    odd = [unaligned(a) for a in (q, k, v, mask)]
    assert not any(a.flags.aligned for a in odd)
    out = mha_cy.scaled_dot_product_attention(*odd[:3], attn_mask=odd[3], is_causal=True)
    expected = mha_cy.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=True)
    assert out.tobytes() == expected.tobytes()
    assert_close(out, reference.scaled_dot_product_attention(q, k, v, attn_mask=mask,
                                                             is_causal=True))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("length", [1, 5, 64])
def test_module_with_unaligned_inputs_weights_and_cache_steps(rng, dtype, length):
    mha = mha_cy.MultiHeadAttention(32, 4, num_kv_heads=2, dtype=dtype, seed=0)
    kw = dict(q_weight=mha.q_weight, k_weight=mha.k_weight, v_weight=mha.v_weight,
              out_weight=mha.out_weight, q_bias=mha.q_bias, k_bias=mha.k_bias,
              v_bias=mha.v_bias, out_bias=mha.out_bias)
    odd = mha_cy.MultiHeadAttention.from_weights(
        **{n: unaligned(w) for n, w in kw.items()}, num_heads=4, num_kv_heads=2, dtype=dtype)
    x = rng.standard_normal((2, length, 32)).astype(dtype)
    mem = rng.standard_normal((2, 9, 32)).astype(dtype)
    assert odd(unaligned(x)).tobytes() == mha(x).tobytes()
    assert odd(unaligned(x), is_causal=True).tobytes() == mha(x, is_causal=True).tobytes()
    assert odd(unaligned(x), unaligned(mem)).tobytes() == mha(x, mem).tobytes()
    c1, c2 = odd.new_cache(2, 2 * length), mha.new_cache(2, 2 * length)
    for _ in range(2):
        assert odd(unaligned(x), cache=c1).tobytes() == mha(x, cache=c2).tobytes()
