#!/usr/bin/env python3
"""Throughput A/B: Aqueduct broker variants, alternated in one run.

Each round runs the speed bar's two throughput configurations (`aqueduct bench`, 128-byte
messages in batches of 100, overflow block: 1 -> 1 with 2,000,000 messages and 1 -> 4 with
1,000,000) once against every variant, and prints the delivered msg/s per round, the medians,
and each variant's per-round ratio to the first variant. Variants are given as for
scripts/latency-ab.py: NAME=[BROKER_BINARY][|KEY=VALUE,...[|CLIENT_BINARY]] (default binaries:
target/release/aqueduct-broker and target/release/aqueduct). From the repository root, after
`cargo build --release -p aqueduct-cli`:

    ROUNDS=3 python3 scripts/throughput-ab.py "default=" "flush0=|AQUEDUCT_BROKER_FLUSH_INTERVAL=0us"

MESSAGES=N scales both runs (1 -> 4 gets half of N); BATCH=N publishes in batches of N
instead of 100 (BATCH=1: one frame per message).
"""
import os
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import speedbar as sb  # noqa: E402

latency_ab = __import__("latency-ab")


def main():
    if len(sys.argv) < 2 or sys.argv[1] in ("-h", "--help"):
        print(__doc__)
        return 0 if len(sys.argv) >= 2 else 2
    rounds = int(os.environ.get("ROUNDS", "3"))
    messages = int(os.environ.get("MESSAGES", "2000000"))
    batch = os.environ.get("BATCH", "100")
    variants = [latency_ab.parse_variant(s) for s in sys.argv[1:]]
    home = tempfile.mkdtemp(prefix="throughput-ab-")
    procs = []
    targets = {}
    configs = [("1->1", ["--messages", str(messages), "--subscribers", "1"]),
               ("1->4", ["--messages", str(messages // 2), "--subscribers", "4"])]
    results = {(c, name): [] for c, _ in configs for name, *_ in variants}
    try:
        for name, binary, env, client in variants:
            h = os.path.join(home, name)
            os.makedirs(h)
            proc, addr, _metrics = sb.start_broker(h, binary=binary, env_extra=env)
            procs.append(proc)
            targets[name] = (addr, dict(os.environ, AQUEDUCT_HOME=h), client)
        for r in range(rounds):
            for config, args in configs:
                for name, (addr, env, client) in targets.items():
                    x = sb.aq(addr, "--payload-size", "128", "--batch", batch, "--overflow", "block",
                              *args, env=env, client=client)
                    if x["lost_total"] or x["duplicates_total"]:
                        sys.exit(f"throughput-ab: {name} lost or duplicated messages: {x}")
                    results[(config, name)].append(x["delivered_msgs_per_s"])
                print(f"round {r + 1} {config}: " + ", ".join(
                    f"{name} {results[(config, name)][-1]:,.0f}" for name in targets), flush=True)
    finally:
        for p in procs:
            p.terminate()
            p.wait()
    print()
    first = variants[0][0]
    for config, _ in configs:
        for name in targets:
            v = results[(config, name)]
            line = f"{config} {name:12} msg/s {[round(x) for x in v]} median {statistics.median(v):,.0f}"
            if name != first:
                ratios = [a / b for a, b in zip(v, results[(config, first)])]
                line += f"; / {first} per round {[round(x, 2) for x in ratios]}, median {statistics.median(ratios):.2f}"
            print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
