#!/usr/bin/env bash
# A worker group keeps serving while the a2ad daemon is upgraded and a worker is replaced.
#
#   1. start a daemon (host backend) on a temp runtime folder, and two workers
#      (examples/helpers/ops_worker.py: the MoE layer of moe_layer.py, every round verified);
#   2. `a2ad-ctl upgrade`: a successor daemon takes every job over; the workers' rounds go on;
#   3. kill -9 worker 1: worker 0 gets PeerLost and calls recover(), which waits;
#   4. start a replacement worker 1: it joins, the job is re-armed, rounds resume on both;
#   5. stop the workers, shut the daemon down.
#
# Every wait is bounded (TIMEOUT seconds, default 60), and ends at once when a process it
# depends on (the daemon, a worker) exits early; on exit, even on failure or Ctrl-C, every
# process this script started is stopped and the temp folder removed. The last line says
# "ops_restart: OK" or "ops_restart: FAIL"; the exit status is non-zero on failure.
# Environment: PYTHON (default python3), TIMEOUT.
set -u -o pipefail

usage() {
    cat <<'USAGE'
usage: bash examples/ops_restart.sh [--help]

A worker group keeps serving while the a2ad daemon is upgraded and a worker is replaced:
starts a daemon (host backend) on a temp runtime folder and two workers, runs
`a2ad-ctl upgrade` under traffic, kills worker 1 with kill -9, starts a replacement, and
stops everything. Takes no arguments; the last line says "ops_restart: OK" or
"ops_restart: FAIL" (exit status non-zero on failure).

environment:
  PYTHON   the Python with a2ad installed (default python3)
  TIMEOUT  seconds each wait may take (default 60)
USAGE
}
case "${1-}" in
    -h|--help) usage; exit 0 ;;
    "") ;;
    *) usage >&2; printf 'ops_restart: unknown argument %s\n' "$1" >&2; exit 2 ;;
esac

PYTHON=${PYTHON:-python3}
TIMEOUT=${TIMEOUT:-60}
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
WORK=$(mktemp -d "${TMPDIR:-/tmp}/a2ad-ops-XXXXXX")
RUNTIME="$WORK/run"
JOB=ops-example
CTL=("$PYTHON" -m a2ad.tools.ctl --runtime-dir "$RUNTIME" --timeout 10)   # the same as `a2ad-ctl`
DAEMON_PID=
declare -A WORKER_PID=()

say() { printf 'ops_restart: %s\n' "$*"; }

fail() {
    say "FAILED: $*"
    for f in "$WORK"/*.log; do [ -e "$f" ] && { echo "---- $(basename "$f") (last lines)"; tail -n 15 "$f"; }; done
    say "FAIL"
    exit 1
}

# The processes the current step needs alive (name=pid ...): a wait fails at once when one exits.
WATCH=()

# check_watched: fail, naming it and its exit status where known, if a watched process is gone
check_watched() {
    local entry name pid rc
    for entry in "${WATCH[@]}"; do
        name=${entry%=*} pid=${entry##*=}
        if ! kill -0 "$pid" 2>/dev/null; then
            wait "$pid" 2>/dev/null; rc=$?
            [ "$rc" -eq 127 ] && rc="unknown: not a child of this script"
            fail "the $name (pid $pid) exited early (status $rc)"
        fi
    done
}

# wait_for SECONDS WHAT COMMAND...: poll COMMAND until it succeeds, fail after SECONDS, or at
# once when a watched process exits
wait_for() {
    local limit=$1 what=$2; shift 2
    local end=$((SECONDS + limit))
    until "$@" >/dev/null 2>&1; do
        check_watched
        [ "$SECONDS" -ge "$end" ] && fail "timed out after ${limit} s waiting for $what"
        sleep 0.1
    done
}

rounds() { cat "$WORK/progress.$1" 2>/dev/null || echo 0; }
rounds_at_least() { [ "$(rounds "$1")" -ge "$2" ]; }
alive() { kill -0 "$1" 2>/dev/null; }
not_alive() { ! alive "$1"; }
daemon_pid() { "${CTL[@]}" --json ping | "$PYTHON" -c 'import json, sys; print(json.load(sys.stdin)["pid"])'; }

cleanup() {
    trap - EXIT INT TERM
    touch "$WORK/stop"
    for pid in "${WORKER_PID[@]}"; do alive "$pid" && kill -TERM "$pid" 2>/dev/null; done
    # the daemon now running may be the upgrade's successor, not our child: ask it, then its pid
    local pid
    pid=$(daemon_pid 2>/dev/null) || pid=
    "${CTL[@]}" shutdown --free-jobs >/dev/null 2>&1
    for p in $pid $DAEMON_PID "${WORKER_PID[@]}"; do
        for _ in $(seq 50); do alive "$p" || break; sleep 0.1; done
        alive "$p" && kill -KILL "$p" 2>/dev/null
    done
    # the fd keeper the daemon started (it exits when asked)
    "$PYTHON" -c 'import sys; from a2ad.tools.launcher import reap_keeper; reap_keeper(sys.argv[1])' "$RUNTIME" 2>/dev/null
    wait 2>/dev/null
    rm -rf "$WORK"
}
trap cleanup EXIT
trap 'fail "interrupted"' INT TERM

start_worker() {  # start_worker RANK
    "$PYTHON" "$HERE/helpers/ops_worker.py" --rank "$1" --ranks 2 --job "$JOB" --runtime-dir "$RUNTIME" \
        --progress "$WORK/progress.$1" --stop "$WORK/stop" --timeout "$TIMEOUT" \
        > >(tee -a "$WORK/worker$1.log") 2>&1 &
    WORKER_PID[$1]=$!
}

# ---------------------------------------------------------------- 1. daemon and workers
say "step 1: start a daemon (host backend) on $RUNTIME"
"$PYTHON" -m a2ad.tools.cli serve --runtime-dir "$RUNTIME" --backend host --grace 10 >"$WORK/daemon.log" 2>&1 &
DAEMON_PID=$!
WATCH=("daemon=$DAEMON_PID")
wait_for "$TIMEOUT" "the daemon to answer" "${CTL[@]}" ping
say "daemon pid $DAEMON_PID is up; starting workers 0 and 1 (job $JOB)"
start_worker 0
start_worker 1
WATCH=("daemon=$DAEMON_PID" "worker 0=${WORKER_PID[0]}" "worker 1=${WORKER_PID[1]}")
wait_for "$TIMEOUT" "worker 0 to verify 20 rounds" rounds_at_least 0 20
wait_for "$TIMEOUT" "worker 1 to verify 20 rounds" rounds_at_least 1 20
say "both workers serve: $(rounds 0) and $(rounds 1) rounds verified"
"${CTL[@]}" jobs

# ---------------------------------------------------------------- 2. upgrade the daemon
say "step 2: a2ad-ctl upgrade while the workers run"
WATCH=("worker 0=${WORKER_PID[0]}" "worker 1=${WORKER_PID[1]}")  # the old daemon is meant to exit
"${CTL[@]}" upgrade || fail "the upgrade failed"
wait_for 20 "the old daemon (pid $DAEMON_PID) to exit" not_alive "$DAEMON_PID"
wait "$DAEMON_PID"; rc=$?
[ "$rc" -eq 0 ] || fail "the old daemon exited with status $rc"
NEW_PID=$(daemon_pid) || fail "no daemon answers after the upgrade"
WATCH+=("successor daemon=$NEW_PID")
before0=$(rounds 0) before1=$(rounds 1)
wait_for "$TIMEOUT" "worker 0 to go on" rounds_at_least 0 $((before0 + 20))
wait_for "$TIMEOUT" "worker 1 to go on" rounds_at_least 1 $((before1 + 20))
say "old daemon exited 0; the successor (pid $NEW_PID) holds the job; rounds went on: $(rounds 0) and $(rounds 1) verified"
"${CTL[@]}" jobs

# ---------------------------------------------------------------- 3. lose a worker
say "step 3: kill -9 worker 1 (pid ${WORKER_PID[1]})"
WATCH=("worker 0=${WORKER_PID[0]}" "successor daemon=$NEW_PID")
disown "${WORKER_PID[1]}"  # no "Killed" notice from bash; the cleanup still finds it by pid
kill -KILL "${WORKER_PID[1]}"
wait_for 10 "worker 1 to die" not_alive "${WORKER_PID[1]}"
wait_for "$TIMEOUT" "worker 0 to see PeerLost" grep -q "calling recover" "$WORK/worker0.log"
say "worker 0 got PeerLost and waits in recover(); the daemon sees:"
"${CTL[@]}" job "$JOB"

# ---------------------------------------------------------------- 4. replace it
say "step 4: start a replacement worker 1"
survivor=$(rounds 0)
rm -f "$WORK/progress.1"
start_worker 1
WATCH+=("replacement worker 1=${WORKER_PID[1]}")
wait_for "$TIMEOUT" "worker 0 to recover" grep -q "recovered in" "$WORK/worker0.log"
wait_for "$TIMEOUT" "worker 0 to resume" rounds_at_least 0 $((survivor + 20))
wait_for "$TIMEOUT" "the replacement to verify 20 rounds" rounds_at_least 1 20
say "rounds resumed: worker 0 at $(rounds 0) verified rounds, the replacement at $(rounds 1)"
"${CTL[@]}" job "$JOB"

# ---------------------------------------------------------------- 5. stop
say "step 5: stop the workers"
WATCH=()
touch "$WORK/stop"
for r in 0 1; do
    wait_for "$TIMEOUT" "worker $r to stop" not_alive "${WORKER_PID[$r]}"
    wait "${WORKER_PID[$r]}"; rc=$?
    [ "$rc" -eq 0 ] || fail "worker $r exited with status $rc"
done
"${CTL[@]}" shutdown --free-jobs || fail "the daemon did not shut down"
wait_for 20 "the daemon (pid $NEW_PID) to exit" not_alive "$NEW_PID"
say "workers exited 0, daemon stopped"
say "OK"
