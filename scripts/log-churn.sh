#!/bin/bash
# Memory of a broker with the durable log while a client publishes to ever new topic names.
#
# From the repository root, after `cargo build --release -p aqueduct-cli`:
#
#     scripts/log-churn.sh                 # 3 rounds, the log on
#     ROUNDS=6 scripts/log-churn.sh
#     AAL=false scripts/log-churn.sh       # the same without the log
#     BROKER_BIN=target/exp/broker-old scripts/log-churn.sh
#     DURABLE='#' scripts/log-churn.sh     # with a durable consumer of that filter reading along
#
# The broker runs with 1 MiB segments and `retention_bytes` 4 MiB. It gets 200,000 messages to
# one topic; then, per round, 200,000 messages to 200,000 new topics (churnN/0 ..) and 200,000
# more to the one topic (so retention deletes the segments the new topics were in), and 25 s
# for the log writer's retention pass (every 10 s). After each step it prints the broker's RSS
# and its topic gauges (docs/benchmarks.md, "With the durable log on"); with DURABLE, also the
# size of the durable consumers' positions file.
set -euo pipefail
BROKER_BIN=${BROKER_BIN:-target/release/aqueduct-broker}
CLIENT=target/release/aqueduct
ADDR=127.0.0.1:24242
METRICS=127.0.0.1:29090
export AQUEDUCT_HOME=$(mktemp -d)
BROKER=
trap 'if [ -n "$BROKER" ]; then kill $BROKER 2>/dev/null; wait $BROKER 2>/dev/null; fi; rm -rf "$AQUEDUCT_HOME"' EXIT
(umask 077; head -c 32 /dev/urandom | base64 > "$AQUEDUCT_HOME/aal.key")
AQUEDUCT_AAL_ENABLED=${AAL:-true} AQUEDUCT_AAL_KEY="$(cat "$AQUEDUCT_HOME/aal.key")" \
AQUEDUCT_AAL_MAX_SIZE=1048576 AQUEDUCT_AAL_RETENTION_BYTES=4194304 \
  "$BROKER_BIN" --addr $ADDR --metrics-addr $METRICS 2>"$AQUEDUCT_HOME/broker.log" & BROKER=$!
until curl -sf "$METRICS/metrics" >/dev/null; do
    kill -0 $BROKER 2>/dev/null || { cat "$AQUEDUCT_HOME/broker.log"; exit 1; }
    sleep 0.1
done
SUB=
if [ -n "${DURABLE:-}" ]; then
    $CLIENT --addr $ADDR sub "$DURABLE" --durable churn-reader >/dev/null & SUB=$!
    trap 'kill $SUB 2>/dev/null; if [ -n "$BROKER" ]; then kill $BROKER 2>/dev/null; wait $BROKER 2>/dev/null; fi; rm -rf "$AQUEDUCT_HOME"' EXIT
fi
show() {
    printf '%-44s %s  %s%s\n' "$1" "$(grep VmRSS /proc/$BROKER/status | tr -s ' \t' ' ')" \
        "$(curl -s "$METRICS/metrics" | grep -E '^aqueduct_(topics|log_topics|log_topics_forgotten_total|log_bytes) ' | tr '\n' ' ')" \
        "${SUB:+positions file $(stat -c %s "$AQUEDUCT_HOME/aal/consumers" 2>/dev/null || echo 0) B}"
}
show start
$CLIENT --addr $ADDR pub one x --count 200000 >/dev/null
show "200,000 to one topic"
for i in $(seq 1 "${ROUNDS:-3}"); do
    $CLIENT --addr $ADDR pub "churn$i" x --count 200000 --topics 200000 >/dev/null
    $CLIENT --addr $ADDR pub one x --count 200000 >/dev/null
    sleep 25
    show "+ $((i * 200000)) topics, after retention"
done
grep -E "retention|gave the memory|WARN|ERROR" "$AQUEDUCT_HOME/broker.log" | cut -c1-200 || true
