"""Thread settings that cannot kill the process, and threads(n) local to a thread / task."""
import asyncio
import subprocess
import sys
import threading

import numpy as np
import pytest

import mha_cy
from mha_cy._openmp_helpers import openmp_enabled
from mha_cy._threads import MAX_NUM_THREADS, get_num_threads, set_num_threads, threads

TIMEOUT = 10


def _expected(n):
    return n if openmp_enabled() else 1


@pytest.fixture(autouse=True)
def _reset_num_threads():
    set_num_threads(None)
    yield
    set_num_threads(None)


# -- bound ----------------------------------------------------------------------------


def test_bound_is_documented_and_sane():
    import os
    assert MAX_NUM_THREADS == max(64, 4 * (os.cpu_count() or 1))
    assert "MAX_NUM_THREADS" in mha_cy._threads.__doc__
    assert "MAX_NUM_THREADS" in set_num_threads.__doc__


@pytest.mark.parametrize("bad", [MAX_NUM_THREADS + 1, 40000, 2**31, 2**63, 10**30])
def test_too_many_threads_raise_value_error_naming_n_and_bound(bad):
    set_num_threads(2)
    with pytest.raises(ValueError, match=rf"\bn\b.*MAX_NUM_THREADS = {MAX_NUM_THREADS}.*got {bad}"):
        set_num_threads(bad)
    with pytest.raises(ValueError, match=rf"MAX_NUM_THREADS.*got {bad}"):
        with threads(bad):
            pass  # pragma: no cover
    assert get_num_threads() == _expected(2)      # the rejected value changed nothing


def test_bound_itself_is_accepted():
    set_num_threads(MAX_NUM_THREADS)
    assert get_num_threads() == _expected(MAX_NUM_THREADS)
    with threads(MAX_NUM_THREADS) as n:
        assert n == _expected(MAX_NUM_THREADS)


def test_huge_request_never_exits_the_process():
    # Used to be accepted, then the next large call died inside libgomp (no exception).
    code = (
        "import numpy as np, mha_cy\n"
        "for n in (40000, 2**31):\n"
        "    try:\n"
        "        mha_cy.set_num_threads(n)\n"
        "    except ValueError:\n"
        "        pass\n"
        "m = mha_cy.MultiHeadAttention(64, 4, seed=0)\n"
        "x = np.ones((4, 512, 64), np.float32)\n"
        "assert np.isfinite(m(x)).all()\n"
        "print('ok')\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


# -- threads(n) is a context variable -------------------------------------------------


def test_overlapping_blocks_in_two_python_threads_do_not_interfere():
    # A enters, B enters, A leaves while B is inside, then B leaves: with a process-wide
    # setting A's exit restored its own entry value under B, and B's exit restored A's n.
    set_num_threads(2)
    a_in, b_in, a_out, b_checked = (threading.Event() for _ in range(4))
    seen, errors = {}, []

    def thread_a():
        try:
            with threads(1):
                a_in.set()
                assert b_in.wait(TIMEOUT)
                seen["a_inside_after_b_entered"] = get_num_threads()
            seen["a_after"] = get_num_threads()
            a_out.set()
            assert b_checked.wait(TIMEOUT)
            seen["a_after_b_left"] = get_num_threads()
        except BaseException as exc:  # noqa: BLE001 (reported below)
            errors.append(exc)
            a_out.set()

    def thread_b():
        try:
            assert a_in.wait(TIMEOUT)
            with threads(3):
                b_in.set()
                assert a_out.wait(TIMEOUT)
                seen["b_inside_after_a_left"] = get_num_threads()
            seen["b_after"] = get_num_threads()
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)
            b_in.set()
        finally:
            b_checked.set()

    workers = [threading.Thread(target=thread_a), threading.Thread(target=thread_b)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(TIMEOUT)
    assert not any(w.is_alive() for w in workers)
    assert not errors, errors
    assert seen == {
        "a_inside_after_b_entered": 1,
        "a_after": _expected(2),
        "b_inside_after_a_left": _expected(3),
        "b_after": _expected(2),
        "a_after_b_left": _expected(2),
    }
    assert get_num_threads() == _expected(2)


def test_block_in_one_thread_is_not_seen_by_another():
    seen = []
    inside, checked = threading.Event(), threading.Event()

    def other():
        assert inside.wait(TIMEOUT)
        seen.append(get_num_threads())
        checked.set()

    default = get_num_threads()
    worker = threading.Thread(target=other)
    worker.start()
    with threads(1):
        inside.set()
        assert checked.wait(TIMEOUT)
        assert get_num_threads() == 1
    worker.join(TIMEOUT)
    assert seen == [default]


def test_set_num_threads_is_still_process_wide():
    set_num_threads(1)
    seen = []
    worker = threading.Thread(target=lambda: seen.append(get_num_threads()))
    worker.start()
    worker.join(TIMEOUT)
    assert seen == [1]


def test_threads_none_inside_means_automatic_default():
    default = get_num_threads()
    set_num_threads(1)
    with threads(None):
        assert get_num_threads() == default
    assert get_num_threads() == 1


def test_asyncio_tasks_each_keep_their_own_setting():
    async def task(n, started, other_started):
        with threads(n):
            started.set()
            await asyncio.wait_for(other_started.wait(), TIMEOUT)
            await asyncio.sleep(0)
            return get_num_threads()

    async def main():
        e1, e2 = asyncio.Event(), asyncio.Event()
        return await asyncio.gather(task(1, e1, e2), task(3, e2, e1))

    default = get_num_threads()
    assert asyncio.run(main()) == [1, _expected(3)]
    assert get_num_threads() == default


def test_kernels_follow_the_block_of_their_own_thread():
    # Two Python threads in different blocks compute the same (bitwise) result.
    m = mha_cy.MultiHeadAttention(32, 4, seed=0)
    x = np.random.default_rng(0).standard_normal((2, 200, 32)).astype(np.float32)
    expected = m(x)
    barrier = threading.Barrier(2, timeout=TIMEOUT)
    outs = {}

    def run(n):
        with threads(n):
            barrier.wait()
            outs[n] = (m(x), get_num_threads())

    workers = [threading.Thread(target=run, args=(n,)) for n in (1, 2)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(60)
    assert outs[1][1] == 1 and outs[2][1] == _expected(2)
    for out, _ in outs.values():
        np.testing.assert_array_equal(out, expected)
