#!/usr/bin/env bash
# Keep every CPU busy at SCHED_IDLE (the lowest scheduling class) while the bench client runs, so
# that no vCPU halts: one spinning process pinned to each CPU this script may use, then
# target/release/aqueduct "$@" (the client of scripts/latency-ab.py), then the spinners stop.
# A client wrapper for latency-ab.py (benchmarks.md, "Where the p99 comes from on this VM"):
#
#   ORDER=alternate ROUNDS=4 python3 scripts/latency-ab.py "spin=" "awake=||scripts/awake.sh"
#
# Linux only (sched_setaffinity, SCHED_IDLE).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
client="${AWAKE_CLIENT:-$here/../target/release/aqueduct}"
pids=()
for cpu in $(python3 -c 'import os; print(" ".join(map(str, sorted(os.sched_getaffinity(0)))))'); do
  python3 -c '
import os, sys
cpu = int(sys.argv[1])
os.sched_setaffinity(0, {cpu})
os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
while True:
    pass
' "$cpu" &
  pids+=("$!")
done
trap 'kill "${pids[@]}" 2>/dev/null || true' EXIT
"$client" "$@"
