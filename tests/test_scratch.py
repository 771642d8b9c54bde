"""The scratch arrays a module reuses between calls (mha_cy/_scratch.py): no result of a call
is ever overwritten by a later one, concurrent calls never share them, shapes may change
between calls, and pickling, deepcopy and release_scratch() carry or keep no buffer.
Tolerances: float32 against the NumPy reference, rtol 2e-5 / atol 2e-6 (sums of at most a
few hundred products of values of order 1)."""
import copy
import pickle
import threading

import numpy as np
import pytest

import mha_cy
from mha_cy import _scratch

from conftest import make_pair

E, H = 64, 4
TOL = dict(rtol=2e-5, atol=2e-6)


def _kept_bytes(module):
    return sum(b.nbytes for s in module._scratch()._free for b in s.values())


def _cases(rng, batch, length):
    """(args, kwargs) of calls that take the paths with scratch arrays: plain and causal
    self-attention, key padding with weights, cross-attention with separate key and value."""
    x = rng.standard_normal((batch, length, E)).astype(np.float32)
    mem = rng.standard_normal((batch, length + 5, E)).astype(np.float32)
    val = rng.standard_normal((batch, length + 5, E)).astype(np.float32)
    pad = rng.random((batch, length)) < 0.3
    pad[:, 0] = False
    return [((x,), {}), ((x,), dict(is_causal=True)),
            ((x,), dict(key_padding_mask=pad, need_weights=True)),
            ((x, mem), {}), ((x, mem, val), {})]


def _as_tuple(out):
    return out if isinstance(out, tuple) else (out,)


@pytest.mark.parametrize("batch, length", [(2, 96), (1, 300), (3, 400)])
def test_results_survive_later_calls(batch, length):
    rng = np.random.default_rng(0)
    fast, ref = make_pair(rng, E, H)
    cases = _cases(rng, batch, length)
    outs = [_as_tuple(fast(*a, **k)) for a, k in cases]   # every call reuses the scratch
    assert _kept_bytes(fast) > 0, "these calls should have kept scratch arrays"
    for (args, kwargs), out in zip(cases, outs):
        expected = _as_tuple(ref(*args, **kwargs))
        for o, e in zip(out, expected):
            if e is not None:
                np.testing.assert_allclose(o, e, **TOL)


def test_shapes_change_between_calls():
    rng = np.random.default_rng(1)
    fast, ref = make_pair(rng, E, H)
    for batch, length in [(1, 300), (3, 257), (2, 640), (1, 512), (2, 290)]:
        x = rng.standard_normal((batch, length, E)).astype(np.float32)
        np.testing.assert_allclose(fast(x), ref(x), **TOL)


def test_concurrent_calls_of_one_module_share_nothing():
    """Threads calling one module at once (its kernels release the GIL) each get their own
    result: a lease is one call's, the others allocate."""
    rng = np.random.default_rng(2)
    fast, ref = make_pair(rng, E, H)
    xs = [rng.standard_normal((2, 280 + 10 * i, E)).astype(np.float32) for i in range(6)]
    expected = [ref(x) for x in xs]
    errors = []
    barrier = threading.Barrier(len(xs))

    def body(i):
        try:
            barrier.wait(timeout=60)
            for _ in range(20):
                np.testing.assert_allclose(fast(xs[i]), expected[i], **TOL)
        except BaseException as exc:        # noqa: BLE001 (reported below)
            errors.append(exc)

    workers = [threading.Thread(target=body, args=(i,), daemon=True) for i in range(len(xs))]
    for w in workers:
        w.start()
    for w in workers:
        w.join(300)
    assert not any(w.is_alive() for w in workers), "a thread hung"
    assert not errors, errors[0]
    assert len(fast._scratch()._free) <= 1      # one set kept, whatever the interleaving


def test_a_failed_call_hands_its_lease_back(monkeypatch):
    rng = np.random.default_rng(3)
    fast, ref = make_pair(rng, E, H)
    x = rng.standard_normal((2, 300, E)).astype(np.float32)
    fast(x)
    kept = fast._scratch()._free[0]

    def fail(*args, **kwargs):
        raise RuntimeError("kernel failed")

    monkeypatch.setattr(mha_cy.attention._attention_kernel, "attention", fail)
    with pytest.raises(RuntimeError, match="kernel failed"):
        fast(x)
    monkeypatch.undo()
    assert fast._scratch()._free == [kept]
    np.testing.assert_allclose(fast(x), ref(x), **TOL)


def test_release_pickle_and_deepcopy_keep_no_buffers():
    rng = np.random.default_rng(4)
    fast, ref = make_pair(rng, E, H)
    x = rng.standard_normal((2, 300, E)).astype(np.float32)
    fast(x)
    assert _kept_bytes(fast) > 0
    for other in (pickle.loads(pickle.dumps(fast)), copy.deepcopy(fast)):
        assert _kept_bytes(other) == 0
        np.testing.assert_allclose(other(x), ref(x), **TOL)
    fast.release_scratch()
    assert _kept_bytes(fast) == 0
    np.testing.assert_allclose(fast(x), ref(x), **TOL)


def test_sets_above_the_cap_are_not_kept(monkeypatch):
    rng = np.random.default_rng(5)
    fast, ref = make_pair(rng, E, H)
    x = rng.standard_normal((2, 300, E)).astype(np.float32)
    monkeypatch.setattr(_scratch, "MAX_KEPT_BYTES", 1000)
    np.testing.assert_allclose(fast(x), ref(x), **TOL)
    assert _kept_bytes(fast) == 0


def test_lease_arrays_start_on_cache_lines_and_grow():
    lease = _scratch.Lease({})
    small = lease.array("a", (3, 5), np.float32)
    big = lease.array("a", (100, 70), np.float64)
    for a in (small, big):
        assert a.__array_interface__["data"][0] % 64 == 0 and a.flags.c_contiguous
    assert big.shape == (100, 70) and big.dtype == np.float64
    again = lease.array("a", (10, 7), np.float32)    # fits: the same memory as big
    assert again.__array_interface__["data"][0] == big.__array_interface__["data"][0]
