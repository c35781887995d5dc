#!/usr/bin/env python3
"""Latency A/B: nats-server and one or more Aqueduct broker variants, alternated in one run.

Each round runs the speed bar's latency configuration (one publisher at 10,000 msg/s for 5 s,
128-byte messages, one subscriber) once against nats-server and once against every variant,
and prints p50 and p99 per round, their medians, and each variant's p50 ratio to nats-server
per round. Rounds alternate the brokers so that the machine's drift hits them alike.

A variant is NAME=[BROKER_BINARY][|ENV[|CLIENT_BINARY]], ENV being comma-separated KEY=VALUE
pairs for the broker (default binaries: target/release/aqueduct-broker, and
target/release/aqueduct for the bench client). From the repository root, with the speed bar's
prerequisites (see scripts/speedbar.py):

    ROUNDS=5 python3 scripts/latency-ab.py "default=" "one-thread=|AQUEDUCT_BROKER_WORKER_THREADS=1"
    python3 scripts/latency-ab.py "old=target/exp/broker-old" "new=target/release/aqueduct-broker"
    python3 scripts/latency-ab.py "old=target/exp/broker-old||target/exp/client-old" "new="

WARMUP=N leaves each latency run's first N messages out of both clients' histograms
(default 1000, as the speed bar; 0 passes nothing, for bench clients older than --warmup).

ORDER=alternate puts nats-server first in odd rounds and last in even ones (default: always
first), to see whether a run's place in the round moves its figures.

CLIENT_THREADS=N runs both clients (peerbench for nats-server, `aqueduct bench` for every
variant) with N runtime worker threads (tokio's TOKIO_WORKER_THREADS); by default each uses one
per CPU.

For each variant it also prints how often the broker's runtime threads went to sleep per
message (`aqueduct_runtime_worker_parks_total`): each is a wake-up between threads later; and
for every broker, nats-server included, the CPU time it used per run (from /proc).

RATE=N publishes N msg/s instead of 10,000 (both clients), e.g. to see what a setting costs
where it cannot help:

    RATE=1000 ROUNDS=2 python3 scripts/latency-ab.py "spin=" "off=|AQUEDUCT_BROKER_IDLE_SPIN=0s"

WARM=NAME[,NAME...] runs the speed bar's two throughput runs (1 -> 1 2,000,000 messages and
1 -> 4 1,000,000, batches of 100, overflow block) against those variants before each round's
latency runs, as the speed bar times its latency on the broker that has just done them:

    WARM=used ROUNDS=4 python3 scripts/latency-ab.py "fresh=" "used="
"""
import os
import shutil
import statistics
import sys
import tempfile
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import speedbar as sb  # noqa: E402


def parse_variant(spec):
    if "=" not in spec:
        sys.exit(f"latency-ab: {spec!r} is not NAME=[BROKER][|KEY=VALUE,...[|CLIENT]]")
    name, rest = spec.split("=", 1)
    binary, _, rest = rest.partition("|")
    env, _, client = rest.partition("|")
    pairs = dict(kv.split("=", 1) for kv in env.split(",") if kv)
    return name, binary or sb.BROKER, pairs, client or sb.CLIENT


def parks(metrics):
    """The broker's `aqueduct_runtime_worker_parks_total`, or None if it has no such metric."""
    with urllib.request.urlopen(f"http://{metrics}/metrics", timeout=5) as r:
        for line in r.read().decode().splitlines():
            if line.startswith("aqueduct_runtime_worker_parks_total "):
                return float(line.split()[1])
    return None


def main():
    if len(sys.argv) < 2 or sys.argv[1] in ("-h", "--help"):
        print(__doc__)
        return 0 if len(sys.argv) >= 2 else 2
    rounds = int(os.environ.get("ROUNDS", "3"))
    variants = [parse_variant(s) for s in sys.argv[1:]]
    sb.check_nats("nats-server", allow_old=False)
    threads = os.environ.get("CLIENT_THREADS")
    client = {"TOKIO_WORKER_THREADS": threads} if threads else {}
    print(f"client runtime threads: {threads or 'one per CPU'}", flush=True)
    home = tempfile.mkdtemp(prefix="latency-ab-")
    brokers = sb.Brokers(home)
    results = {"nats": []}
    cpu = {"nats": []}
    pids = {}
    rate = os.environ.get("RATE", "10000")
    targets = {}
    per_msg = {}
    try:
        pids["nats"] = brokers.start_nats(4222).pid
        for name, binary, env, client_binary in variants:
            h = os.path.join(home, name)
            os.makedirs(h)
            proc, addr, metrics = sb.start_broker(h, binary=binary, env_extra=env)
            brokers.procs.append(proc)
            pids[name] = proc.pid
            cpu[name] = []
            targets[name] = (addr, metrics, dict(os.environ, AQUEDUCT_HOME=h, **client),
                             client_binary)
            results[name] = []
            per_msg[name] = []
        alternate = os.environ.get("ORDER") == "alternate"
        warm = [w for w in os.environ.get("WARM", "").split(",") if w]
        for w in warm:
            if w not in targets:
                sys.exit(f"latency-ab: WARM names {w!r}, which is not a variant")
        # Both clients leave the same first messages out of their histograms (WARMUP=0: none,
        # for bench clients older than `--warmup`).
        warmup = os.environ.get("WARMUP", sb.WARMUP)
        aq_warmup = ["--warmup", warmup] if warmup != "0" else []

        def nats_run():
            c0 = sb.cpu_seconds(pids["nats"])
            x = sb.run([sb.PEERBENCH, "nats-latency", "--url", "nats://127.0.0.1:4222",
                        "--rate", rate, "--secs", "5", "--size", "128", "--warmup-msgs", warmup],
                       env=dict(os.environ, **client))
            cpu["nats"].append(sb.cpu_seconds(pids["nats"]) - c0)
            results["nats"].append((x["latency"]["p50_us"], x["latency"]["p99_us"]))

        for r in range(rounds):
            for w in warm:
                addr, _, env, client_binary = targets[w]
                for _, _, aq_args, _ in sb.THROUGHPUT_RUNS:
                    sb.aq(addr, "--payload-size", "128", "--batch", "100", "--overflow", "block",
                          *aq_args, env=env, client=client_binary)
            nats_last = alternate and r % 2 == 1
            if not nats_last:
                nats_run()
            for name, (addr, metrics, env, client_binary) in targets.items():
                before = parks(metrics)
                c0 = sb.cpu_seconds(pids[name])
                x = sb.aq(addr, "--rate", rate, "--duration", "5s", "--batch", "1",
                          "--payload-size", "128", *aq_warmup, env=env, client=client_binary)
                cpu[name].append(sb.cpu_seconds(pids[name]) - c0)
                after = parks(metrics)
                results[name].append((x["latency"]["p50_us"], x["latency"]["p99_us"]))
                if before is not None and after is not None and x.get("msgs"):
                    per_msg[name].append((after - before) / x["msgs"])
            if nats_last:
                nats_run()
            order = "nats-server last" if nats_last else "nats-server first"
            print(f"round {r + 1} ({order}): " + ", ".join(f"{k} p50 {v[-1][0]:.0f} p99 {v[-1][1]:.0f} us"
                                                 for k, v in results.items()), flush=True)
    finally:
        brokers.stop()
        shutil.rmtree(home, ignore_errors=True)
    print()
    for name, rows in results.items():
        p50 = [a for a, _ in rows]
        p99 = [b for _, b in rows]
        print(f"{name:12} p50 {[round(v) for v in p50]} median {statistics.median(p50):.0f} us; "
              f"p99 {[round(v) for v in p99]} median {statistics.median(p99):.0f} us")
    for name, rows in results.items():
        if name == "nats":
            continue
        ratios = [a / n for (a, _), (n, _) in zip(rows, results["nats"])]
        print(f"{name:12} p50 / nats-server per round {[round(v, 2) for v in ratios]}, "
              f"median {statistics.median(ratios):.2f}")
    for name, v in per_msg.items():
        if v:
            print(f"{name:12} runtime worker parks per message {[round(x, 2) for x in v]}, "
                  f"median {statistics.median(v):.2f}")
    for name, v in cpu.items():
        print(f"{name:12} broker CPU s per 5 s run {[round(x, 2) for x in v]}, "
              f"median {statistics.median(v):.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
