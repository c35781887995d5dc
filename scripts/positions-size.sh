#!/bin/bash
# The durable consumers' positions file with a wildcard durable consumer over many topics, and
# what its checkpoints write (docs/benchmarks.md, "A wildcard durable consumer's positions").
# From the repository root, after `cargo build --release -p aqueduct-cli`: scripts/positions-size.sh
set -e
export AQUEDUCT_HOME=$(mktemp -d)
(umask 077; head -c 32 /dev/urandom | base64 > $AQUEDUCT_HOME/aal.key)
AQUEDUCT_AAL_ENABLED=true AQUEDUCT_AAL_KEY="$(cat $AQUEDUCT_HOME/aal.key)" \
  target/release/aqueduct-broker --addr 127.0.0.1:24242 --metrics-addr 127.0.0.1:29090 2>$AQUEDUCT_HOME/broker.log & BROKER=$!
until curl -sf 127.0.0.1:29090/metrics >/dev/null; do sleep 0.1; done
target/release/aqueduct --addr 127.0.0.1:24242 sub 'churn/#' --durable d > /dev/null & SUB=$!
sleep 1
for n in 20000 100000; do
  target/release/aqueduct --addr 127.0.0.1:24242 pub churn x --count $n --topics $n >/dev/null
  sleep 3
  ls -l $AQUEDUCT_HOME/aal/consumers | awk '{print "positions file after '$n' topics: "$5" bytes"}'
  # writes of the positions file over 2 s of one message a second... count via strace? use /proc io
  W0=$(grep '^write_bytes' /proc/$BROKER/io | awk '{print $2}')
  for i in 1 2 3 4 5 6 7 8 9 10; do target/release/aqueduct --addr 127.0.0.1:24242 pub churn/1 x >/dev/null; sleep 0.2; done
  W1=$(grep '^write_bytes' /proc/$BROKER/io | awk '{print $2}')
  echo "bytes written by the broker while 10 messages went to one topic (2 s): $((W1-W0))"
done
kill $SUB; kill $BROKER; wait $BROKER || true
rm -rf $AQUEDUCT_HOME
