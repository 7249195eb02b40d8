#!/usr/bin/env bash
# The default suite under load, as CI runs it: a fresh clone of the commit that was HEAD when the script started,
# `CI=true bash .ci/run` with no standard input and no terminal (its own session, in the background), and CPU-bound
# processes beside it the whole time. A test that passes only on a quiet machine fails here.
#
#   tests/stress.sh            one run beside two CPU burners
#   tests/stress.sh 3          three runs, one after the other
#   BURNERS=0 tests/stress.sh  the same on a quiet machine (the suite's own wall time)
#
# Burners: `stress-ng --cpu N` where it is installed (apt-get install stress-ng), else N Python busy loops.
# Each run's log is kept in $STRESS_OUT (default /tmp/preempt-stress); one summary line per run is printed, and the
# exit code is the number of failed runs.
set -uo pipefail

runs=${1:-1}
burners=${BURNERS:-2}
out=${STRESS_OUT:-/tmp/preempt-stress}
repo=$(git -C "$(dirname "$0")" rev-parse --show-toplevel)
# every run tests the commit that was HEAD when the script started, so commits made meanwhile change nothing
rev=$(git -C "$repo" rev-parse HEAD)
mkdir -p "$out"
failed=0

start_burners() {
    [ "$burners" -gt 0 ] || return 0
    if command -v stress-ng >/dev/null; then
        stress-ng --cpu "$burners" --quiet >/dev/null 2>&1 &  # not on $(...)'s pipe, which it would hold open
        echo $!
    else
        for _ in $(seq "$burners"); do
            python3 -c 'while True: pass' >/dev/null 2>&1 &
            echo $!
        done
    fi
}

for i in $(seq "$runs"); do
    work=$(mktemp -d /tmp/preempt-stress-clone.XXXXXX)
    git clone -q "$repo" "$work/preempt" && git -C "$work/preempt" checkout -q "$rev"
    # CI finds the project's shared/ folder beside its clone; so does this one, where the checkout has one
    [ -d "$repo/../shared" ] && ln -s "$(cd "$repo/../shared" && pwd)" "$work/shared"
    log="$out/run-$i.log"
    pids=$(start_burners)
    t0=$(date +%s)
    (cd "$work/preempt" && CI=true setsid -w bash .ci/run </dev/null >"$log" 2>&1) &
    wait $!
    rc=$?
    t1=$(date +%s)
    # shellcheck disable=SC2086
    [ -n "$pids" ] && kill $pids 2>/dev/null
    wait 2>/dev/null
    summary=$(grep -E '^[0-9]+ (passed|failed)|^=+ .*(passed|failed).* =+$' "$log" | tail -n 1)
    echo "run $i of $runs: exit $rc after $((t1 - t0)) s beside $burners burner(s) on ${rev:0:7}: ${summary:-no pytest summary} (log $log)"
    grep -E '^(FAILED|ERROR) ' "$log" | sed 's/^/    /'
    [ "$rc" -eq 0 ] || failed=$((failed + 1))
    rm -rf "$work"
done
# .ci/run's `pip install -e .` pointed the editable install at the clone, now gone: point it back at this checkout
pip install -q --no-deps -e "$repo" >/dev/null 2>&1 || echo "could not reinstall $repo in editable mode" >&2
exit "$failed"
