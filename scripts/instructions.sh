#!/usr/bin/env bash
# User-space instructions per delivered message of the broker (or the bench client), counted by
# valgrind's callgrind:
# repeatable for one binary and workload whatever else the machine is doing, unlike CPU seconds
# on a shared 2-core VM (kernel time is not counted). Each run is a 1 -> 1 `aqueduct bench`
# (128-byte payloads, batches of 100, overflow block) done twice, with a small and a large message
# count, so that start-up (certificate generation, handshakes) cancels out:
#   per message = (instructions(large) - instructions(small)) / (large - small)
#
# From the repository root, after `cargo build --release -p aqueduct-cli` (needs valgrind):
#   scripts/instructions.sh target/release/aqueduct-broker [OTHER_BROKER ...]
# The client is target/release/aqueduct unless CLIENT is set. SMALL and LARGE set the counts.
# With WHAT=client the arguments are client binaries instead, and the client (publisher and
# subscriber in one process) is counted, against BROKER (default target/release/aqueduct-broker).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
CLIENT=${CLIENT:-$ROOT/target/release/aqueduct}
BROKER=${BROKER:-$ROOT/target/release/aqueduct-broker}
WHAT=${WHAT:-broker}
SMALL=${SMALL:-30000}
LARGE=${LARGE:-300000}
command -v valgrind >/dev/null || { echo "needs valgrind (apt-get install valgrind)" >&2; exit 2; }
[ $# -ge 1 ] || { echo "usage: $0 BINARY [BINARY ...]" >&2; exit 2; }

# count BINARY MESSAGES PORT -> prints the counted process's total instruction count
count() {
    local binary=$1 msgs=$2 port=$3 home out pid total broker=$BROKER client=$CLIENT
    local broker_run=() client_run=()
    home=$(mktemp -d)
    out="$home/callgrind.out"
    if [ "$WHAT" = client ]; then
        client=$binary
        client_run=(valgrind --tool=callgrind --callgrind-out-file="$out")
    else
        broker=$binary
        broker_run=(valgrind --tool=callgrind --callgrind-out-file="$out")
    fi
    AQUEDUCT_HOME=$home "${broker_run[@]}" "$broker" \
        --addr "127.0.0.1:$port" --metrics-addr "127.0.0.1:$((port + 1))" >/dev/null 2>"$home/broker.log" &
    pid=$!
    for _ in $(seq 600); do
        curl -fs "127.0.0.1:$((port + 1))/healthz" >/dev/null 2>&1 && break
        sleep 0.1
    done
    AQUEDUCT_HOME=$home timeout 600 "${client_run[@]}" "$client" --addr "127.0.0.1:$port" bench --json \
        --payload-size 128 --batch 100 --overflow block --messages "$msgs" >"$home/bench.json" 2>"$home/client.log"
    kill -INT "$pid"
    wait "$pid" || true
    python3 -c "import json,sys; d=json.load(open(sys.argv[1])); assert d['lost_total']==0, d" "$home/bench.json"
    total=$(awk '/^summary:/{print $2}' "$out")
    rm -rf "$home"
    echo "$total"
}

port=16100
for binary in "$@"; do
    small=$(count "$binary" "$SMALL" $port)
    large=$(count "$binary" "$LARGE" $((port + 2)))
    port=$((port + 4))
    python3 -c "import sys; s,l,a,b=map(int,sys.argv[1:5]); print(f'{sys.argv[5]}: {(l-s)/(b-a):.0f} instructions per message ({s} at {a}, {l} at {b})')" \
        "$small" "$large" "$SMALL" "$LARGE" "$WHAT $binary"
done
