#!/usr/bin/env bash
# `make test`'s pytest, in two runs:
#   1. everything but the real-model and Ray tests, in WORKERS processes (pytest-xdist). These run
#      the simulator and tiny models, mostly one busy thread each, so on 2 cores two processes take
#      about half the time of one (2,582 tests: 3 min 58 s, against ~9 min in one process);
#   2. the real-model and Ray tests (markers real_model, cluster) in this one process. They fill
#      every core on their own (llama.cpp's and OpenBLAS's threads spin while they wait), so two
#      processes would only oversubscribe the cores; and Ray runs one local cluster per process.
# Both runs always happen, so that one failure does not hide another. A run that selects no test
# (exit 5: PYTEST_ARGS names a file of one kind only) is fine as long as the other ran tests; if
# neither did, the result is 5, a failure like any other.
#
# Usage: scripts/run-tests.sh PYTHON WORKERS [pytest arguments...]
# A `-m EXPR` among the arguments narrows both runs (it is and-ed with each run's own expression).
set -u
python=$1
workers=$2
shift 2

args=()
narrow=""
while [ $# -gt 0 ]; do
    if [ "$1" = "-m" ] && [ $# -gt 1 ]; then
        narrow="($2) and "
        shift 2
    else
        args+=("$1")
        shift
    fi
done

pytest() {
    "$python" -m pytest -p no:cacheprovider "$@"
}

pytest -n "$workers" -m "${narrow}not real_model and not cluster" ${args[@]+"${args[@]}"}
first=$?
echo "run-tests: simulated and tiny-model tests ($workers processes): exit $first"
pytest -m "${narrow}(real_model or cluster)" ${args[@]+"${args[@]}"}
second=$?
echo "run-tests: real-model and Ray tests (one process): exit $second"

if [ "$first" -eq 5 ] && [ "$second" -eq 5 ]; then
    echo "run-tests: no test was selected" >&2
    exit 5
fi
for rc in "$first" "$second"; do
    if [ "$rc" -ne 0 ] && [ "$rc" -ne 5 ]; then
        exit "$rc"
    fi
done
exit 0
