#!/usr/bin/env python3
"""Where a latency run's tail comes from: a few stalls, or many small delays?

Reads latency traces, the CSV files (`sent_ns,latency_ns`) that `aqueduct bench
--latency-trace FILE` and `peerbench nats-latency --trace FILE` write, and prints for each:
the percentiles; how many messages took longer than THRESHOLD_US; how those group into
episodes (slow messages sent less than 1 ms apart belong to one episode: one stall delays every
message sent during it); the largest episodes; and whether a stall's backlog arrived at once or
drained slowly (the median gap between arrivals after each peak above 2 ms).

From the repository root, with the speed bar's prerequisites (see scripts/speedbar.py) and a
broker and a nats-server running on their default ports:

    target/release/aqueduct bench --rate 10000 --duration 5s --batch 1 --payload-size 128 \\
        --warmup 1000 --latency-trace target/aq.csv
    target/peerbench/release/peerbench nats-latency --rate 10000 --secs 5 --size 128 \\
        --warmup-msgs 1000 --trace target/nats.csv
    python3 scripts/latency-tail.py 300 target/nats.csv target/aq.csv

Machine noise shows up as episodes of dozens of messages with peaks of milliseconds, in both
brokers' traces; a broker's own slow path shows up as many small episodes.
"""
import argparse
import statistics
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from speedbar import quantile  # noqa: E402


def load(path):
    rows = []
    with open(path) as f:
        header = next(f, "").strip()
        if header != "sent_ns,latency_ns":
            sys.exit(f"latency-tail: {path} is not a latency trace (its first line is {header!r})")
        for line in f:
            sent, latency = line.split(",")
            rows.append((int(sent), int(latency)))
    rows.sort()
    return rows


def episodes(rows, threshold_ns):
    """Slow messages grouped by send time: [first sent, last sent, count, peak latency]."""
    eps = []
    for sent, latency in rows:
        if latency <= threshold_ns:
            continue
        if eps and sent - eps[-1][1] < 1_000_000:
            eps[-1][1] = sent
            eps[-1][2] += 1
            eps[-1][3] = max(eps[-1][3], latency)
        else:
            eps.append([sent, sent, 1, latency])
    return eps


def drain_gaps(rows):
    """For each peak above 2 ms: the median gap (µs) between the arrivals of the messages that
    follow it while they stay above 200 µs (0: the backlog arrived at once)."""
    gaps = []
    i = 0
    while i < len(rows):
        if rows[i][1] <= 2_000_000:
            i += 1
            continue
        j = i
        while j + 1 < len(rows) and rows[j + 1][1] >= rows[j][1]:
            j += 1
        k = j
        while k + 1 < len(rows) and rows[k + 1][1] > 200_000:
            k += 1
        if k > j + 3:
            arrivals = sorted(s + l for s, l in rows[j:k + 1])
            gaps.append(statistics.median(b - a for a, b in zip(arrivals, arrivals[1:])) / 1e3)
        i = k + 1
    return gaps


def analyse(path, threshold_ns):
    rows = load(path)
    if not rows:
        print(f"{path}: no timed message")
        return
    lat = sorted(latency for _, latency in rows)
    n = len(lat)

    def q(x):
        return quantile(lat, x) / 1e3

    eps = episodes(rows, threshold_ns)
    slow = sum(e[2] for e in eps)
    stalls = [e for e in eps if e[2] >= 5]
    print(f"{path}: {n} messages; p50 {q(0.5):.0f} p90 {q(0.9):.0f} p99 {q(0.99):.0f} "
          f"p99.9 {q(0.999):.0f} max {lat[-1] / 1e3:.0f} us")
    print(f"  over {threshold_ns / 1e3:.0f} us: {slow} messages in {len(eps)} episodes; "
          f"{sum(e[2] for e in stalls)} of them in {len(stalls)} episodes of 5 or more")
    biggest = sorted(eps, key=lambda e: -e[2])[:8]
    print("  largest episodes (ms into the run, messages, peak us): "
          + ", ".join(f"({(e[0] - rows[0][0]) / 1e6:.0f}, {e[2]}, {e[3] / 1e3:.0f})" for e in biggest))
    gaps = drain_gaps(rows)
    if gaps:
        print(f"  after peaks over 2 ms, median gap between arrivals: {', '.join(f'{g:.1f}' for g in gaps[:12])} us")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("threshold_us", type=float, metavar="THRESHOLD_US",
                    help="a message slower than this many microseconds is slow")
    ap.add_argument("traces", nargs="+", metavar="FILE", help="latency traces (CSV)")
    args = ap.parse_args()
    for path in args.traces:
        analyse(path, int(args.threshold_us * 1000))
    return 0


if __name__ == "__main__":
    sys.exit(main())
