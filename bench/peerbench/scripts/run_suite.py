#!/usr/bin/env python3
"""Run a peerbench suite N rounds, round-robin, and append RESULT lines to a
JSONL file; `summarize` turns that file into a min/median/max markdown table.

Usage (from the repository root, after building the harness with
`cargo build --release --manifest-path bench/peerbench/Cargo.toml --target-dir target/peerbench`):
  bench/peerbench/scripts/run_suite.py run  --out results.jsonl [--rounds 3] [--suite baseline|extra]
                                            [--nats-pid PID] [--quiet-idle 0.80] [--quiet-wait 600]
  bench/peerbench/scripts/run_suite.py summarize results.jsonl

The binary is target/peerbench/release/peerbench under the repository root; the
PEERBENCH environment variable overrides it.

Before every run, CPU idleness of the whole box is sampled for 1 s from
/proc/stat; the run waits (bounded by --quiet-wait seconds in total per run)
until idle >= --quiet-idle, because the box is shared. The idle fraction and
the load average seen are stored with each result ("noisy": true if the gate
gave up). Every subprocess runs under a hard timeout.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
# bench/peerbench/scripts -> the repository root, whose target/peerbench holds the build.
ROOT = os.path.normpath(os.path.join(HERE, "..", "..", ".."))
BIN = os.environ.get("PEERBENCH") or os.path.join(ROOT, "target", "peerbench", "release", "peerbench")

# name -> argv (after the binary). Sizes chosen for >= 3 s per run on the
# 2-core reference box; adjust for faster machines.
SUITES = {
    "baseline": {
        "nats-tp-p1s1": ["nats-throughput", "--msgs", "5000000", "--size", "128", "--pubs", "1", "--subs", "1"],
        "nats-tp-p1s4": ["nats-throughput", "--msgs", "2000000", "--size", "128", "--pubs", "1", "--subs", "4"],
        "nats-lat-10k": ["nats-latency", "--rate", "10000", "--secs", "5", "--size", "128"],
        "quic-ceiling": ["quic-ceiling", "--msgs", "20000000", "--size", "128"],
        "quic-ceiling-frame-writes": ["quic-ceiling", "--msgs", "5000000", "--size", "128", "--frame-writes"],
        "quic-lat-10k": ["quic-latency", "--rate", "10000", "--secs", "5", "--size", "128"],
        "timer-jitter-10k": ["timer-jitter", "--rate", "10000", "--secs", "5"],
    },
    # Supplementary variants: remove client-side buffering limits / OS limits.
    "extra": {
        "nats-tp-p1s1-bigbuf": ["nats-throughput", "--msgs", "5000000", "--size", "128", "--pubs", "1", "--subs", "1", "--sub-capacity", "4194304"],
        "nats-tp-p1s4-bigbuf": ["nats-throughput", "--msgs", "2000000", "--size", "128", "--pubs", "1", "--subs", "4", "--sub-capacity", "4194304"],
        "quic-ceiling-udpbuf4m": ["quic-ceiling", "--msgs", "20000000", "--size", "128", "--udp-buf", "4194304"],
        "quic-ceiling-aes128": ["quic-ceiling", "--msgs", "20000000", "--size", "128", "--cipher", "aes128"],
    },
}
NATS_MODES = ("nats-throughput", "nats-latency")


def cpu_idle_fraction(window=1.0):
    def snap():
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
        return v[3] + v[4], sum(v)  # idle + iowait, total

    i0, t0 = snap()
    time.sleep(window)
    i1, t1 = snap()
    return (i1 - i0) / max(1, t1 - t0)


def box_busy_cpu_secs():
    """Non-idle CPU seconds of the whole box since boot (all cores)."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    busy = sum(v[:8]) - v[3] - v[4]  # user..steal minus idle, iowait
    return busy / os.sysconf("SC_CLK_TCK")


def wait_quiet(min_idle, max_wait):
    start = time.time()
    while True:
        idle = cpu_idle_fraction()
        if idle >= min_idle:
            return idle, False
        if time.time() - start > max_wait:
            return idle, True
        print(f"  box busy (idle {idle:.0%}), waiting...", flush=True)
        time.sleep(9)


def run(args):
    suite = SUITES[args.suite]
    names = args.only.split(",") if args.only else list(suite)
    for rnd in range(args.start_round, args.start_round + args.rounds):
        for name in names:
            argv = [BIN] + suite[name] + ["--label", f"{name} round={rnd}"]
            if suite[name][0] in NATS_MODES and args.nats_pid:
                argv += ["--server-pid", str(args.nats_pid)]
            idle, noisy = wait_quiet(args.quiet_idle, args.quiet_wait)
            load = open("/proc/loadavg").read().split()[:3]
            print(f"== round {rnd} {name} (idle before {idle:.0%}, load {' '.join(load)})", flush=True)
            print("   $ " + " ".join(argv[1:]), flush=True)
            b0, w0 = box_busy_cpu_secs(), time.time()
            try:
                p = subprocess.run(argv, capture_output=True, text=True, timeout=args.timeout)
            except subprocess.TimeoutExpired:
                print("   TIMEOUT", flush=True)
                continue
            box_busy, wall = box_busy_cpu_secs() - b0, time.time() - w0
            log = p.stdout + p.stderr
            with open(args.out + ".log", "a") as f:
                f.write(f"== round {rnd} {name} idle={idle:.3f} load={load}\n$ {' '.join(argv)}\n{log}\n")
            res = [l for l in p.stdout.splitlines() if l.startswith("RESULT ")]
            if p.returncode != 0 or not res:
                print(f"   FAILED rc={p.returncode}\n{log}", flush=True)
                continue
            r = json.loads(res[-1][len("RESULT "):])
            cpu = r.get("cpu") or {}
            ours = (cpu.get("client_cpu_s") or 0) + (cpu.get("server_cpu_s") or 0)
            # CPU used by *other* processes on the box during the whole run
            # (cores), i.e. the interference this run suffered.
            others = max(0.0, (box_busy - ours) / wall)
            print(f"   other processes used {others:.2f} cores during this run", flush=True)
            r.update({"name": name, "round": rnd, "idle_before": idle, "noisy": noisy,
                      "others_cores": others, "box_busy_cores": box_busy / wall,
                      "loadavg": load, "argv": " ".join(argv[1:])})
            with open(args.out, "a") as f:
                f.write(json.dumps(r) + "\n")
            for l in p.stdout.splitlines():
                if not l.startswith("RESULT"):
                    print("   " + l, flush=True)


# Figures shown per result kind: (label, extractor)
def figures(r):
    m = r["mode"]
    if m == "nats-throughput":
        out = [
            ("publish msgs/s", r["pub_msgs_per_s"]),
            ("publish MB/s", r["pub_mb_per_s"]),
            ("slowest subscriber msgs/s", r["sub_min_msgs_per_s"]),
            ("slowest subscriber MB/s", r["sub_min_mb_per_s"]),
            ("delivered msgs/s (all subs)", r["delivered_msgs_per_s"]),
            ("lost msgs (all subs)", r["lost_total"]),
        ]
        cpu = r.get("cpu") or {}
        if cpu.get("server_cpu_s") is not None:
            out.append(("nats-server CPU, % of 1 core", 100 * cpu["server_cpu_s"] / cpu["active_s"]))
        out.append(("peerbench CPU, % of 1 core", 100 * cpu["client_cpu_s"] / cpu["active_s"]))
        return out
    if m == "timer-jitter":
        L = r["latency"]
        return [("wake-up lateness p50 µs", L["p50_us"]), ("p99 µs", L["p99_us"]),
                ("p99.9 µs", L["p999_us"]), ("max µs", L["max_us"])]
    if m in ("nats-latency", "quic-latency"):
        L = r["latency"]
        out = [("p50 µs", L["p50_us"]), ("p90 µs", L["p90_us"]), ("p99 µs", L["p99_us"]),
               ("p99.9 µs", L["p999_us"]), ("max µs", L["max_us"]), ("lost", r["lost"])]
        cpu = r.get("cpu") or {}
        if cpu.get("server_cpu_s") is not None:
            out.append(("nats-server CPU, % of 1 core", 100 * cpu["server_cpu_s"] / cpu["active_s"]))
        out.append(("peerbench CPU, % of 1 core", 100 * cpu["client_cpu_s"] / cpu["active_s"]))
        return out
    if m.startswith("quic-ceiling"):
        cpu = r.get("cpu") or {}
        return [("msgs/s", r["msgs_per_s"]), ("MB/s payload", r["mb_per_s"]),
                ("UDP datagrams/s", r["udp_datagrams"] / r["secs"]),
                ("lost packets", r["lost_packets"]),
                ("peerbench CPU, % of 1 core", 100 * cpu["client_cpu_s"] / cpu["active_s"])]
    return []


def fmt(x):
    if isinstance(x, int) or (isinstance(x, float) and x.is_integer() and abs(x) >= 1000):
        return f"{int(x):,}"
    if abs(x) >= 1000:
        return f"{x:,.0f}"
    if abs(x) >= 100:
        return f"{x:.0f}"
    return f"{x:.1f}"


def summarize(args):
    rows = [json.loads(l) for l in open(args.file) if l.strip()]
    groups = {}
    for r in rows:
        groups.setdefault(r["name"], []).append(r)
    print("| run | figure | n | min | median | max |")
    print("|---|---|---|---|---|---|")
    for name, rs in groups.items():
        per = {}
        for r in rs:
            for k, v in figures(r):
                per.setdefault(k, []).append(v)
        per["other procs' CPU during run, cores"] = [r.get("others_cores", float("nan")) for r in rs]
        noisy = sum(1 for r in rs if r.get("noisy"))
        tag = name + (f" ({noisy} noisy)" if noisy else "")
        for k, vs in per.items():
            print(f"| {tag} | {k} | {len(vs)} | {fmt(min(vs))} | {fmt(statistics.median(vs))} | {fmt(max(vs))} |")


def main():
    ap = argparse.ArgumentParser()
    sp = ap.add_subparsers(dest="cmd", required=True)
    r = sp.add_parser("run")
    r.add_argument("--out", required=True)
    r.add_argument("--rounds", type=int, default=3)
    r.add_argument("--start-round", type=int, default=1, help="number of the first round (for resuming)")
    r.add_argument("--suite", default="baseline", choices=list(SUITES))
    r.add_argument("--only", default="", help="comma-separated subset of run names")
    r.add_argument("--nats-pid", type=int, default=None)
    r.add_argument("--quiet-idle", type=float, default=0.80)
    r.add_argument("--quiet-wait", type=float, default=600)
    r.add_argument("--timeout", type=float, default=180)
    s = sp.add_parser("summarize")
    s.add_argument("file")
    a = ap.parse_args()
    if a.cmd == "run":
        run(a)
    else:
        summarize(a)


if __name__ == "__main__":
    sys.exit(main())
