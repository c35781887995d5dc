#!/usr/bin/env bash
# Keep every CPU busy at SCHED_IDLE (the lowest scheduling class) while the bench client runs, so
# that no vCPU halts: one spinning process pinned to each CPU this script may use, then
# target/release/aqueduct "$@" (the client of scripts/latency-ab.py; AWAKE_CLIENT names another
# program), then the spinners stop. A client wrapper for latency-ab.py (benchmarks.md, "Where the
# p99 comes from on this VM"):
#
#   ORDER=alternate ROUNDS=4 python3 scripts/latency-ab.py "spin=" "awake=||scripts/awake.sh"
#
# The spinners stop when this script ends, however it ends: each also stops by itself as soon as
# this script is gone (even after a SIGKILL, which no trap sees). Linux only (sched_setaffinity,
# SCHED_IDLE).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
client="${AWAKE_CLIENT:-$here/../target/release/aqueduct}"
cpus="$(python3 -c 'import os; print(" ".join(map(str, sorted(os.sched_getaffinity(0)))))')"
pids=()
client_pid=""
cleanup() {
  [ -n "$client_pid" ] && kill "$client_pid" 2>/dev/null || true
  [ "${#pids[@]}" -gt 0 ] && kill "${pids[@]}" 2>/dev/null || true
  wait 2>/dev/null || true
}
trap cleanup EXIT
trap 'exit 143' TERM
trap 'exit 130' INT
ready="$(mktemp -d)"
for cpu in $cpus; do
  python3 -c '
import os, sys
cpu, parent, ready = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
os.sched_setaffinity(0, {cpu})
os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
open(os.path.join(ready, str(cpu)), "w").close()
n = 0
while True:
    n += 1
    if n % 1000000 == 0 and os.getppid() != parent:
        break  # the script is gone
' "$cpu" "$$" "$ready" </dev/null >/dev/null 2>&1 &
  pids+=("$!")
done
# Every spinner at SCHED_IDLE on its CPU before the client starts.
for _ in $(seq 1 500); do
  [ "$(ls "$ready" | wc -l)" -ge "${#pids[@]}" ] && break
  sleep 0.01
done
rm -rf "$ready"
"$client" "$@" &
client_pid=$!
status=0
wait "$client_pid" || status=$?
client_pid=""
exit "$status"
