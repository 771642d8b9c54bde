#!/usr/bin/env bash
# Smoke test of the benchmark compare workflow (CI runs it), on the `tiny` workload only:
#   1. save a run                                   (--benchmark-save)
#   2. compare a second run against it: must pass   (--benchmark-compare --benchmark-compare-fail)
#   3. compare a deliberately slowed run: must FAIL (MHA_BENCH_SLEEP makes the timed mha_cy call
#      sleep 5 ms, ~400x its time; only benchmarks/ reads that variable)
# The check compares the fastest round (min), three times as slow at most (min:200%): on a noisy
# shared machine the median of an unchanged 13 us call once came out more than twice its saved
# value, while the min moves far less; the deliberate sleep is in every round, far beyond it.
# Exits 0 when all three behave, 1 otherwise.
# Options: PYTHON (default python), extra pytest arguments after the script name.
set -u -o pipefail
cd "$(dirname "$0")/.."

read -r -a PY <<< "${PYTHON:-python}"  # may hold options, e.g. PYTHON="python3 -X dev"
store=$(mktemp -d)
log=$(mktemp)
trap 'rm -rf "$store" "$log"' EXIT

run() {
    # one thread: the smoke test checks the workflow, not scaling, and 1 thread is the least noisy
    "${PY[@]}" -m pytest benchmarks/ -k "tiny-mha_cy or tiny-numpy" -p no:cacheprovider -q \
        --mha-threads=1 --benchmark-max-time=0.5 --benchmark-storage="file://$store" "$@"
}

FAIL_SPEC="min:200%"

fail() {
    echo "compare_smoke: FAIL: $*"
    echo "--- the checks that failed, then the last output:"
    grep "has failed" "$log"
    tail -n 30 "$log"
    exit 1
}

echo "compare_smoke: 1/3 saving a baseline run of the tiny workload"
run --benchmark-save=smoke_base "${@:1}" >"$log" 2>&1
rc=$?
[ $rc -eq 0 ] || fail "the baseline run exited $rc"
ls "$store"/*/0001_smoke_base.json >/dev/null 2>&1 || fail "no saved run in $store"

echo "compare_smoke: 2/3 comparing an unchanged run (--benchmark-compare-fail=$FAIL_SPEC): must pass"
run --benchmark-compare=0001 --benchmark-compare-fail="$FAIL_SPEC" "${@:1}" >"$log" 2>&1
rc=$?
echo "compare_smoke:     exit code $rc"
[ $rc -eq 0 ] || fail "an unchanged run was flagged as a regression (exit $rc)"

echo "compare_smoke: 3/3 comparing a run slowed by MHA_BENCH_SLEEP=0.005 (mha_cy only): must fail"
MHA_BENCH_SLEEP=0.005 MHA_BENCH_SLEEP_IMPL=mha_cy \
    run --benchmark-compare=0001 --benchmark-compare-fail="$FAIL_SPEC" "${@:1}" >"$log" 2>&1
rc=$?
echo "compare_smoke:     exit code $rc"
[ $rc -ne 0 ] || fail "the deliberate slowdown was not flagged (exit 0)"
grep -q "Performance has regressed" "$log" || fail "exit $rc, but not for a performance regression"
grep -A3 "Performance has regressed" "$log" | grep -q "tiny-mha_cy" || fail "the regression is not the slowed mha_cy"
grep -A3 "Performance has regressed" "$log" | grep -q "tiny-numpy" && fail "the unchanged numpy run was flagged too"
grep -A1 "Performance has regressed" "$log" | head -n 2 | sed 's/^/compare_smoke:     /'

echo "compare_smoke: OK (unchanged run passes, a 5 ms slowdown is flagged)"
