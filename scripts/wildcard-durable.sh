#!/bin/bash
# A wildcard durable consumer over many topics: how long it takes to read N one-message topics
# (against N messages of one topic), and the broker's CPU while it stays connected, caught up,
# with nothing published (docs/benchmarks.md, "A wildcard durable consumer over many topics").
#
# From the repository root, after `cargo build --release -p aqueduct-cli`:
#
#     scripts/wildcard-durable.sh
#     N=200000 BROKER_BIN=target/exp/broker-old scripts/wildcard-durable.sh
set -euo pipefail
BROKER_BIN=${BROKER_BIN:-target/release/aqueduct-broker}
CLIENT=target/release/aqueduct
N=${N:-100000}
ADDR=127.0.0.1:24243
METRICS=127.0.0.1:29091
export AQUEDUCT_HOME=$(mktemp -d)
BROKER=
SUB=
trap 'kill $SUB 2>/dev/null || true; if [ -n "$BROKER" ]; then kill $BROKER 2>/dev/null; wait $BROKER 2>/dev/null; fi; rm -rf "$AQUEDUCT_HOME"' EXIT
(umask 077; head -c 32 /dev/urandom | base64 > "$AQUEDUCT_HOME/aal.key")
AQUEDUCT_AAL_ENABLED=true AQUEDUCT_AAL_KEY="$(cat "$AQUEDUCT_HOME/aal.key")" \
  "$BROKER_BIN" --addr $ADDR --metrics-addr $METRICS 2>"$AQUEDUCT_HOME/broker.log" & BROKER=$!
until curl -sf "$METRICS/metrics" >/dev/null; do
    kill -0 $BROKER 2>/dev/null || { cat "$AQUEDUCT_HOME/broker.log"; exit 1; }
    sleep 0.1
done
$CLIENT --addr $ADDR pub many x --count "$N" --topics "$N" >/dev/null
$CLIENT --addr $ADDR pub one x --count "$N" >/dev/null
elapsed() { local t0=$EPOCHREALTIME; "$@" >/dev/null 2>&1; awk "BEGIN { printf \"%.2f\", $EPOCHREALTIME - $t0 }"; }
echo "$N messages of one topic, read by a new durable consumer: $(elapsed $CLIENT --addr $ADDR sub one --durable a -n "$N") s"
echo "$N one-message topics, read by a new durable consumer of 'many/#': $(elapsed $CLIENT --addr $ADDR sub 'many/#' --durable b -n "$N") s"
# Caught up and still connected, nothing published: what the broker spends.
$CLIENT --addr $ADDR sub 'many/#' --durable b > "$AQUEDUCT_HOME/sub.out" 2>/dev/null & SUB=$!
sleep 3
cpu() { awk '{print $14 + $15}' /proc/$BROKER/stat; }
C0=$(cpu); sleep 10; C1=$(cpu)
echo "broker CPU over 10 s with that consumer connected and idle: $(( (C1 - C0) * 1000 / $(getconf CLK_TCK) )) ms"
