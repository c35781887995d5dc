#!/usr/bin/env python3
"""What trace export costs end to end: `aqueduct bench --trace` 1 -> 1 (every publish frame
starts a sampled trace) against three release brokers in one run, alternating their order
each round:

  baseline  a broker built from the commit before trace export existed (--baseline),
  off       this commit's broker, tracing.otlp_endpoint unset (the default),
  on        this commit's broker exporting to an OTLP receiver on 127.0.0.1 with
            tracing.sample_ratio --ratio (default 0.01).

The receiver is `aqueduct trace-sink` (counts the spans it is sent). Prints a
markdown table: the median delivered rate of each, off / baseline and on / off, the per-round
ratios, and the spans the `on` broker exported (its aqueduct_trace_spans_exported_total).

From the repository root:

    git worktree add /tmp/aq-base <commit before trace export>
    cargo build --release -p aqueduct-cli --manifest-path /tmp/aq-base/Cargo.toml --target-dir target/base
    cargo build --release -p aqueduct-cli
    python3 scripts/tracebench.py --baseline target/base/release/aqueduct-broker --rounds 5

Every broker runs on 127.0.0.1 with its own temporary home and is stopped after its run; every
wait is bounded.
"""

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from speedbar import BROKER, CLIENT, bench_1to1, cpu_seconds, git_describe, start_broker  # noqa: E402

SINK = [CLIENT, "trace-sink", "--listen"]


def metric(metrics_addr, name):
    with urllib.request.urlopen(f"http://{metrics_addr}/metrics", timeout=5) as r:
        for line in r.read().decode().splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
    return None


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--messages", type=int, default=2_000_000)
    p.add_argument("--ratio", type=float, default=0.01)
    p.add_argument("--baseline", required=True, help="aqueduct-broker built before trace export")
    a = p.parse_args()
    sink = subprocess.Popen(SINK + ["127.0.0.1:0"], stdout=subprocess.PIPE, text=True)
    first = sink.stdout.readline()
    if not first.startswith("listening "):
        raise RuntimeError(f"aqueduct trace-sink did not start: {first!r}")
    endpoint = "http://" + first.split()[1]
    configs = {
        "baseline": (a.baseline, {}),
        "off": (BROKER, {}),
        "on": (BROKER, {"AQUEDUCT_TRACING_OTLP_ENDPOINT": endpoint,
                        "AQUEDUCT_TRACING_SAMPLE_RATIO": str(a.ratio)}),
    }
    rates = {k: [] for k in configs}
    cpu = {k: [] for k in configs}  # broker CPU seconds per million messages delivered
    exported = []
    order = list(configs)
    try:
        for r in range(a.rounds):
            random.Random(r).shuffle(order)
            for name in order:
                binary, env_extra = configs[name]
                with tempfile.TemporaryDirectory(prefix="aqueduct-tracebench-") as home:
                    proc, addr, metrics = start_broker(home, binary, env_extra=env_extra)
                    try:
                        cpu0 = cpu_seconds(proc.pid)
                        rate = bench_1to1(home, addr, a.messages, "--trace")
                        cpu[name].append((cpu_seconds(proc.pid) - cpu0) / (a.messages / 1e6))
                        if name == "on":
                            # The exporter sends within about half a second.
                            deadline = time.time() + 10
                            spans = metric(metrics, "aqueduct_trace_spans_recorded_total")
                            while time.time() < deadline:
                                done = metric(metrics, "aqueduct_trace_spans_exported_total")
                                if done is not None and done >= spans:
                                    break
                                time.sleep(0.2)
                            exported.append((spans, done,
                                             metric(metrics, "aqueduct_trace_spans_dropped_total")))
                    finally:
                        proc.send_signal(signal.SIGTERM)
                        proc.wait(timeout=30)
                    rates[name].append(rate)
                    print(f"round {r + 1} {name}: {rate:,.0f} msg/s, broker CPU {cpu[name][-1]:.3f} s per M", flush=True)
    finally:
        sink.send_signal(signal.SIGTERM)
        counts = json.loads(sink.stdout.read().strip().splitlines()[-1])
    med = {k: statistics.median(v) for k, v in rates.items()}
    print()
    print(f"code {git_describe()}, baseline {a.baseline}, {a.rounds} rounds, {a.messages:,} messages "
          f"of 128 B, 1 -> 1, batch 100, every batch frame a new sampled trace; on: sample_ratio {a.ratio}")
    print()
    print("| broker | delivered msg/s (median) | rounds |")
    print("|---|---:|---|")
    for k in configs:
        print(f"| {k} | {med[k]:,.0f} | {', '.join(f'{x:,.0f}' for x in rates[k])} |")
    per = lambda x, y: ", ".join(f"{p / q:.3f}" for p, q in zip(rates[x], rates[y]))  # noqa: E731
    print(f"| **off / baseline** | **{med['off'] / med['baseline']:.3f}** | {per('off', 'baseline')} |")
    print(f"| **on / off** | **{med['on'] / med['off']:.3f}** | {per('on', 'off')} |")
    print()
    cmed = {k: statistics.median(v) for k, v in cpu.items()}
    print("| broker | broker CPU s per million messages (median) | rounds |")
    print("|---|---:|---|")
    for k in configs:
        print(f"| {k} | {cmed[k]:.3f} | {', '.join(f'{x:.3f}' for x in cpu[k])} |")
    print(f"| **off / baseline** | **{cmed['off'] / cmed['baseline']:.3f}** | |")
    print(f"| **on / off** | **{cmed['on'] / cmed['off']:.3f}** | |")
    print()
    print("on: spans recorded / exported / dropped per run: "
          + "; ".join(f"{s:,.0f} / {e:,.0f} / {d:,.0f}" for s, e, d in exported))
    print(f"aqueduct trace-sink received {counts['spans']:,} spans of {counts['traces']:,} traces "
          f"in {counts['requests']:,} requests")


if __name__ == "__main__":
    main()
