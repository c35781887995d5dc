#!/usr/bin/env bash
# The broker's user-space instructions per delivered message, counted by valgrind's callgrind:
# repeatable for one binary and workload whatever else the machine is doing, unlike CPU seconds
# on a shared 2-core VM (kernel time is not counted). Each broker runs a 1 -> 1 `aqueduct bench`
# (128-byte payloads, batches of 100, overflow block) twice, with a small and a large message
# count, so that start-up (certificate generation, handshakes) cancels out:
#   per message = (instructions(large) - instructions(small)) / (large - small)
#
# From the repository root, after `cargo build --release -p aqueduct-cli` (needs valgrind):
#   scripts/broker-instructions.sh target/release/aqueduct-broker [OTHER_BROKER ...]
# The client is target/release/aqueduct unless CLIENT is set. SMALL and LARGE set the counts.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
CLIENT=${CLIENT:-$ROOT/target/release/aqueduct}
SMALL=${SMALL:-30000}
LARGE=${LARGE:-300000}
command -v valgrind >/dev/null || { echo "needs valgrind (apt-get install valgrind)" >&2; exit 2; }
[ $# -ge 1 ] || { echo "usage: $0 BROKER [BROKER ...]" >&2; exit 2; }

# count BROKER MESSAGES PORT -> prints the broker's total instruction count
count() {
    local broker=$1 msgs=$2 port=$3 home out pid total
    home=$(mktemp -d)
    out="$home/callgrind.out"
    AQUEDUCT_HOME=$home valgrind --tool=callgrind --callgrind-out-file="$out" "$broker" \
        --addr "127.0.0.1:$port" --metrics-addr "127.0.0.1:$((port + 1))" >/dev/null 2>"$home/valgrind.log" &
    pid=$!
    for _ in $(seq 600); do
        curl -fs "127.0.0.1:$((port + 1))/healthz" >/dev/null 2>&1 && break
        sleep 0.1
    done
    AQUEDUCT_HOME=$home timeout 600 "$CLIENT" --addr "127.0.0.1:$port" bench --json \
        --payload-size 128 --batch 100 --overflow block --messages "$msgs" >"$home/bench.json" 2>/dev/null
    kill -INT "$pid"
    wait "$pid" || true
    python3 -c "import json,sys; d=json.load(open(sys.argv[1])); assert d['lost_total']==0, d" "$home/bench.json"
    total=$(awk '/^summary:/{print $2}' "$out")
    rm -rf "$home"
    echo "$total"
}

port=16100
for broker in "$@"; do
    small=$(count "$broker" "$SMALL" $port)
    large=$(count "$broker" "$LARGE" $((port + 2)))
    port=$((port + 4))
    python3 -c "import sys; s,l,a,b=map(int,sys.argv[1:5]); print(f'{sys.argv[5]}: {(l-s)/(b-a):.0f} instructions per message ({s} at {a}, {l} at {b})')" \
        "$small" "$large" "$SMALL" "$LARGE" "$broker"
done
