#!/usr/bin/env bash
# Run the test suite inside a network namespace where only loopback is up, so that
# nothing a test starts (a Jupyter kernel, a Ray cluster) can reach or advertise
# another address. Where no namespace can be made, tests that start a server or a
# cluster are skipped with a reason that says so. Arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
# Cache compiled bytecode (__pycache__/, ignored by git), pytest's rewritten test modules
# included: where the environment turns that off, each pytest worker, kernel and script
# compiled rlnb and the tests from source again, several seconds a process.
unset PYTHONDONTWRITEBYTECODE
if [ "${RLNB_NETNS:-}" != "1" ]; then
    if [ "$(id -u)" = 0 ]; then flags=(--net); else flags=(--net --map-root-user); fi
    if unshare "${flags[@]}" -- true 2>/dev/null; then
        exec unshare "${flags[@]}" -- env RLNB_NETNS=1 sh -c 'ip link set lo up && exec "$@"' sh "$0" "$@"
    fi
    echo "scripts/test.sh: cannot make a network namespace here; server and cluster tests will be skipped" >&2
fi
# One torch (OpenMP) thread a process where pytest-xdist runs two workers at once, with
# kernels and engines beside them, on the machine's cores: each process on every core
# left threads waiting on each other (measured: the main pass took 5 % longer, the
# notebooks 10-17 %); the Ray tests, two at a time, likewise. A test about
# thread counts sets its own.
threads="${OMP_NUM_THREADS:-1}"
# --fast: the unit tier only (no subprocess, kernel, browser, vLLM or Ray; see the tiers in
# tests/conftest.py), under a minute on two cores: the loop to run after every change.
# Three workers on two cores: dozens of its tests wait a second for a hang, a stall or a
# timeout to show, which a third worker fills (measured: 49 s against 59-61 s with two).
if [ "${1:-}" = "--fast" ]; then
    shift
    exec env OMP_NUM_THREADS="$threads" .venv/bin/python -m pytest -m unit -n "${RLNB_TEST_WORKERS:-3}" --dist loadfile "$@"
fi
# Two pytest processes: Ray's driver keeps C++ threads that open sockets after
# ray.shutdown(), which the leak checks of later tests in the same process would see;
# the tests that start Ray (marker "ray") run in a process of their own, after the
# others. Run beside them, everything took longer: once 14 minutes instead of 17 with
# timing-bound tests failing, once (with one torch thread a process) the Ray tests
# took 16 minutes instead of 5, each Ray start 3-7 times as long, and four failed.
# Exit 5 (nothing collected) from one of them is fine when the other ran tests.
#
# The first runs on RLNB_TEST_WORKERS pytest-xdist workers (default 2), a test module
# per worker at a time (module fixtures, such as the shared vLLM engine, stay whole),
# handed out in the order tests/conftest.py sorts them: the notebooks first (the longest
# module, training on one core while the other worker's tests mostly wait), then modules
# with kernel, browser and engine tests, short unit modules last, so that neither worker
# idles at the end.
# `-n 0` runs it in one process.
#
# The Ray tests run on two workers too, a module each at a time: much of a Ray test is
# waiting (on a raylet, a restarted replica, Ray's own 30 s start timeout), which the
# other worker fills (measured: 2:50 against 3:18-4:00 one at a time). Ray makes its
# token for a local cluster's authentication (~/.ray/auth_token) on the first start
# where there is none; two first starts at once would each write their own, and a
# cluster's later processes would read the other's, so it is made here first.
set +e
OMP_NUM_THREADS="$threads" .venv/bin/python -m pytest -m "not ray" -n "${RLNB_TEST_WORKERS:-2}" --dist loadfile --no-loadscope-reorder "$@"
first=$?
if [ ! -e "$HOME/.ray/auth_token" ] && [ -x .venv/bin/ray ]; then
    .venv/bin/ray get-auth-token --generate >/dev/null 2>&1
fi
OMP_NUM_THREADS="$threads" .venv/bin/python -m pytest -m ray -n "${RLNB_TEST_WORKERS:-2}" --dist loadfile "$@"
second=$?
set -e
if [ "$first" = 5 ] && [ "$second" = 5 ]; then exit 5; fi
[ "$first" = 5 ] && first=0
[ "$second" = 5 ] && second=0
[ "$first" != 0 ] && exit "$first"
exit "$second"
