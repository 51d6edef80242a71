#!/usr/bin/env bash
# The whole test suite as `make test` runs it: two pytest processes side by side.
#  - the tests on real vLLM servers (tests/real_vllm.py) in a process of their own, which launches
#    the servers as soon as it has collected: they install and boot while the rest runs;
#  - every other test spread over $TEST_WORKERS pytest-xdist workers (default 3: most tests wait on
#    real processes and sockets, so three share two cores well). `--dist loadgroup`: a file whose
#    tests share a module-scoped fixture stays on one worker (tests/conftest.py).
# Each prints its slowest tests (--durations): the suite's time is budgeted (README, "Tests").
# Arguments go to both (paths, -x, ...; not -m, which each process sets).
# Exit status: the first failure of the two, else 0.
set -u
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
workers=${TEST_WORKERS:-3}
log=var/test-logs/real-vllm-tests.log
mkdir -p var/test-logs
"$PY" -m pytest -q -m real_vllm --durations=5 "$@" >"$log" 2>&1 &
real=$!
trap 'kill -TERM "$real" 2>/dev/null; exit 130' INT TERM
"$PY" -m pytest -n "$workers" --dist loadgroup --durations=15 -m "not real_vllm" "$@"
rest_status=$?
wait "$real"
real_status=$?
[ "$real_status" = 5 ] && real_status=0  # none selected (pytest's "no tests collected")
echo "== the real-vLLM tests, run beside the rest in a process of their own (log: $log)"
if [ "$real_status" = 0 ]; then tail -n 3 "$log"; else cat "$log"; fi
[ "$rest_status" != 0 ] && exit "$rest_status"
exit "$real_status"
