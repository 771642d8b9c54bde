"""scaled_dot_product_attention with a bool padding mask (B or 1, 1, 1, Lk) runs as key padding
(attention._as_key_padding: the kernel skips trailing padded tiles): it must agree with the same
mask spelled out over the query rows (the additive-mask path) and with the reference. Not bit
for bit: the last tile a padded row sees is shorter, which moves a sum's order (1-2 ulp)."""
import numpy as np
import pytest

import mha_cy
from mha_cy import reference
from mha_cy.attention import _as_key_padding

TOL = {np.float32: dict(rtol=1e-5, atol=1e-6), np.float64: dict(rtol=1e-12, atol=1e-13)}


def _padding_mask(rng, batch, lk):
    """Visible prefixes of random lengths, one sequence fully hidden, one fully visible."""
    mask = np.zeros((batch, 1, 1, lk), bool)
    for b, n in enumerate(rng.integers(1, lk + 1, size=batch)):
        mask[b, ..., :n] = True
    mask[0] = False
    mask[-1] = True
    return mask


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("hq,hkv,lq,lk,d", [(4, 4, 70, 70, 64), (8, 2, 1, 300, 128),
                                            (6, 3, 33, 130, 24), (2, 1, 129, 257, 80)])
@pytest.mark.parametrize("causal,window", [(False, None), (True, None), (True, 40)])
def test_padding_mask_agrees_with_the_full_mask(dtype, hq, hkv, lq, lk, d, causal, window):
    rng = np.random.default_rng(lq * 7 + lk)
    B = 4
    q = rng.standard_normal((B, hq, lq, d)).astype(dtype)
    k = rng.standard_normal((B, hkv, lk, d)).astype(dtype)
    v = rng.standard_normal((B, hkv, lk, d)).astype(dtype)
    mask = _padding_mask(rng, B, lk)
    v[~np.broadcast_to(mask[:, :, 0, :, None], v.shape)] = np.nan    # hidden: never read
    got = mha_cy.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal,
                                              window=window)
    full = np.broadcast_to(mask, (B, 1, lq, lk)).copy()              # the additive-mask path
    same = mha_cy.scaled_dot_product_attention(q, k, v, attn_mask=full, is_causal=causal,
                                               window=window)
    np.testing.assert_allclose(got, same, **TOL[dtype])
    want = reference.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal,
                                                  window=window)
    np.testing.assert_allclose(got, want, **TOL[dtype])
    assert not got[0].any()                                          # every key hidden: zeros


def test_a_batch_one_padding_mask_broadcasts_over_the_batch():
    rng = np.random.default_rng(5)
    q, k, v = (rng.standard_normal((3, 2, 20, 16)).astype(np.float32) for _ in range(3))
    mask = np.ones((1, 1, 1, 20), bool)
    mask[..., 13:] = False
    got = mha_cy.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    same = mha_cy.scaled_dot_product_attention(q, k, v, attn_mask=np.broadcast_to(
        mask, (3, 1, 20, 20)).copy())
    np.testing.assert_allclose(got, same, **TOL[np.float32])


@pytest.mark.parametrize("shape,dtype", [((2, 1, 5, 9), bool), ((2, 3, 1, 9), bool),
                                         ((2, 1, 1, 9), np.float32)])
def test_other_masks_are_not_key_padding(shape, dtype):
    assert _as_key_padding(np.zeros(shape, dtype), 2, 9) is None


def test_key_padding_is_the_negated_mask():
    mask = np.array([[True, True, False], [False, True, True]])[:, None, None, :]
    np.testing.assert_array_equal(_as_key_padding(mask, 2, 3), [[False, False, True],
                                                                [True, False, False]])


@pytest.mark.parametrize("mask_shape", [(1, 1), (3, 1, 1), (1, 1, 1, 1), (3, 1, 1, 1),
                                        (1, 1, 1, 300)])
@pytest.mark.parametrize("value", [True, False])
def test_masks_of_one_key_broadcast_to_every_key(rng, mask_shape, value):
    """A bool mask whose key axis has size 1 became a (B, 1) key padding that the kernel read
    Lk bytes of: garbage results (errors up to 5e29 in a random sweep) and a read past the
    array. It must broadcast to every key, as in the reference."""
    q = rng.standard_normal((3, 2, 4, 8)).astype(np.float32)
    k, v = (rng.standard_normal((3, 2, 300, 8)).astype(np.float32) for _ in range(2))
    mask = np.full(mask_shape, value)
    got = mha_cy.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    want = reference.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    np.testing.assert_allclose(got, want, **TOL[np.float32])
    if value:
        np.testing.assert_array_equal(got, mha_cy.scaled_dot_product_attention(q, k, v))


def test_the_kernel_refuses_masks_of_another_shape():
    """The kernel indexes masks without bounds: it checks their shapes itself."""
    from mha_cy import _attention_kernel
    q = np.zeros((2, 1, 3, 8), np.float32)
    k = v = np.zeros((2, 1, 5, 8), np.float32)
    out = np.empty_like(q)
    args = (False, 0.5, None, 1, 0, None, None, None, None)
    with pytest.raises(ValueError, match=r"key padding must be \(B, Lk\) = \(2, 5\); got "
                                         r"\(2, 1\)"):
        _attention_kernel.attention(q, k, v, out, None, np.zeros((2, 1), np.uint8), *args)
    with pytest.raises(ValueError, match=r"mask must be \(B, Hq, Lq, Lk\) = \(2, 1, 3, 5\)"):
        _attention_kernel.attention(q, k, v, out, np.zeros((2, 1, 3, 4), np.float32), None,
                                    *args)
