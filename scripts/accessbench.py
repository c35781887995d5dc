#!/usr/bin/env python3
"""What access control costs end to end: `aqueduct bench` 1 -> 1 against a release broker with
the ACL on (100 rules, the bench's client allowed by one of them) and a publish quota that does
not bind, and against the same broker with both off, alternating the two for --rounds rounds in
one run. Prints a markdown table: the median delivered rate of each and the ratio on / off.

From the repository root:

    cargo build --release -p aqueduct-cli
    python3 scripts/accessbench.py --rounds 5

Every broker runs on 127.0.0.1 with its own temporary home, and is stopped after its round.
"""

import argparse
import os
import signal
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from speedbar import bench_1to1, git_describe, start_broker  # noqa: E402


def acl_config(rules):
    lines = ["acl:", "  enabled: true", "  default: none", "  rules:"]
    for i in range(rules - 1):
        lines.append(f"    - {{client: \"svc-{i}\", topic: \"orders/{i}/#\", permission: all}}")
    # The bench connects without a certificate: it is `anonymous`.
    lines.append("    - {client: anonymous, topic: \"bench/#\", permission: all}")
    lines += [
        "broker:",
        "  quotas:",
        "    default_publish_rate: 100000000",
        "    default_burst_size: 10000000",
    ]
    return "\n".join(lines) + "\n"


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--messages", type=int, default=2_000_000)
    p.add_argument("--rules", type=int, default=100)
    a = p.parse_args()
    rates = {"off": [], "on": []}
    for r in range(a.rounds):
        for name, config in (("off", None), ("on", acl_config(a.rules))):
            with tempfile.TemporaryDirectory(prefix="aqueduct-accessbench-") as home:
                proc, addr, _ = start_broker(home, config=config)
                try:
                    rate = bench_1to1(home, addr, a.messages)
                finally:
                    proc.send_signal(signal.SIGTERM)
                    proc.wait(timeout=30)
                rates[name].append(rate)
                print(f"round {r + 1} {name}: {rate:,.0f} msg/s", flush=True)
    off, on = statistics.median(rates["off"]), statistics.median(rates["on"])
    print()
    print(f"code {git_describe()}, {a.rounds} rounds, {a.messages:,} messages of 128 B, 1 -> 1, batch 100")
    print()
    print("| configuration | delivered msg/s (median) | rounds |")
    print("|---|---:|---|")
    print(f"| ACL and quotas off | {off:,.0f} | {', '.join(f'{x:,.0f}' for x in rates['off'])} |")
    print(f"| ACL on ({a.rules} rules) + non-binding quota | {on:,.0f} | {', '.join(f'{x:,.0f}' for x in rates['on'])} |")
    print(f"| **on / off** | **{on / off:.3f}** | |")


if __name__ == "__main__":
    main()
