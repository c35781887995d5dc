#!/usr/bin/env bash
# How long a message spends inside the broker at 10k msg/s, seen from the wire: tcpdump on
# loopback timestamps each publisher -> broker packet carrying a message and the next broker ->
# subscriber packet carrying its delivery; the difference is the broker's residence (quinn's
# receive and send paths, the task hand-overs and the broker's own work). Compare it with the
# broker's `aqueduct_delivery_latency_seconds` (publish to written, which excludes quinn) and
# with the end-to-end p50 the bench prints. Needs tcpdump (apt-get install tcpdump) and root.
#
# From the repository root, after `cargo build --release -p aqueduct-cli`:
#   scripts/residence.sh [BROKER]        # default target/release/aqueduct-broker
# The client is target/release/aqueduct unless CLIENT is set.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
BROKER=${1:-$ROOT/target/release/aqueduct-broker}
CLIENT=${CLIENT:-$ROOT/target/release/aqueduct}
command -v tcpdump >/dev/null || { echo "needs tcpdump (apt-get install tcpdump)" >&2; exit 2; }
PORT=${PORT:-17400}
home=$(mktemp -d)
trap 'rm -rf "$home"' EXIT
AQUEDUCT_HOME=$home "$BROKER" --addr "127.0.0.1:$PORT" --metrics-addr "127.0.0.1:$((PORT + 1))" >/dev/null 2>&1 &
broker=$!
for _ in $(seq 100); do
    curl -fs "127.0.0.1:$((PORT + 1))/healthz" >/dev/null 2>&1 && break
    sleep 0.1
done
# Capture 2 s from the middle of a 5 s run (after the handshake and warm-up).
(sleep 2; timeout 2 tcpdump -i lo -n -tt -s 64 udp port "$PORT" -w "$home/run.pcap" >/dev/null 2>&1 || true) &
capture=$!
AQUEDUCT_HOME=$home "$CLIENT" --addr "127.0.0.1:$PORT" bench --json --rate 10000 --duration 5s \
    --batch 1 --payload-size 128 2>/dev/null |
    python3 -c "import json,sys; d=json.load(sys.stdin); print(f\"end to end: p50 {d['latency']['p50_us']:.0f} us\")"
wait "$capture"
kill "$broker"
wait "$broker" 2>/dev/null || true
tcpdump -r "$home/run.pcap" -n -tt 2>/dev/null | python3 -c "
import sys
from collections import Counter
port = '.$PORT'
rows = []
for line in sys.stdin:
    f = line.split()
    rows.append((float(f[0]), f[2], f[4].rstrip(':'), int(f[-1])))
# The publisher sends the large packets to the broker; the subscriber receives them from it
# (acknowledgements are small).
pub = Counter(r[1] for r in rows if r[2].endswith(port) and r[3] > 100).most_common(1)[0][0]
sub = Counter(r[2] for r in rows if r[1].endswith(port) and r[3] > 100).most_common(1)[0][0]
res, ack_first = [], 0
for k, (t, src, dst, size) in enumerate(rows):
    if src != pub or size <= 100:
        continue
    later = rows[k + 1:k + 20]
    out = next((r for r in later if r[1].endswith(port) and r[2] == sub and r[3] > 100), None)
    ack = next((r for r in later if r[1].endswith(port) and r[2] == pub), None)
    if out:
        res.append((out[0] - t) * 1e6)
        ack_first += bool(ack and ack[0] < out[0])
res.sort()
q = lambda p: res[int(p * (len(res) - 1))]
print(f'broker residence: p10 {q(0.1):.0f} us, p50 {q(0.5):.0f} us, p90 {q(0.9):.0f} us over {len(res)} messages;'
      f' the broker acknowledged the publisher before sending the delivery for {100 * ack_first / len(res):.0f}% of them')
"
