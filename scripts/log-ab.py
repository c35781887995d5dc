#!/usr/bin/env python3
"""Confirmed-publish A/B of broker builds with the durable log on, alternated in one run.

Each round starts every variant in turn (a fresh log each time, `aal.fsync: batch`, AES-256-GCM)
and runs logbench.py's publish_sync configuration against it: `aqueduct bench-durable
--messages MSGS publish --batch 100 --window 8`, 128-byte messages. Prints each round's msg/s
and every variant's median. A variant is NAME=BROKER_BINARY. From the repository root, after
`cargo build --release -p aqueduct-cli` (the bench client is target/release/aqueduct):

    ROUNDS=4 python3 scripts/log-ab.py "before=target/exp/broker-before" "after=target/release/aqueduct-broker"

ROUNDS (default 3) and MSGS (default 1000000) set the size of the run.
"""
import os
import shutil
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import logbench as lb  # noqa: E402


def main():
    if len(sys.argv) < 2 or sys.argv[1] in ("-h", "--help"):
        print(__doc__)
        return 0 if len(sys.argv) >= 2 else 2
    variants = []
    for spec in sys.argv[1:]:
        if "=" not in spec:
            sys.exit(f"log-ab: {spec!r} is not NAME=BROKER_BINARY")
        name, binary = spec.split("=", 1)
        variants.append((name, binary))
    rounds = int(os.environ.get("ROUNDS", "3"))
    msgs = int(os.environ.get("MSGS", "1000000"))
    results = {name: [] for name, _ in variants}
    port = 17300
    try:
        for r in range(rounds):
            for name, binary in variants:
                home = tempfile.mkdtemp(prefix=f"log-ab-{name}-")
                aq = lb.Aqueduct(home, port, binary=binary)
                port += 4
                aq.start()
                try:
                    rate = aq.publish(msgs)["msgs_per_s"]
                finally:
                    aq.stop()
                    shutil.rmtree(home, ignore_errors=True)
                results[name].append(rate)
                print(f"round {r + 1}/{rounds}  {name:12} {rate:12,.0f} msg/s", flush=True)
    finally:
        for p in lb.PROCS:
            if p.poll() is None:
                p.kill()
    print("\n| build | per round, msg/s | median |\n|---|---|---:|")
    for name, rates in results.items():
        per = ", ".join(f"{x:,.0f}" for x in rates)
        print(f"| {name} | {per} | {statistics.median(rates):,.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
