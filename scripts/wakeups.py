#!/usr/bin/env python3
"""How long woken threads wait for a CPU, from a `perf` scheduler trace.

Reads the text of `perf script -F comm,pid,tid,cpu,time,event,trace` over a recording of the
events sched:sched_wakeup, sched:sched_switch and power:cpu_idle, and prints:
- per process, its wake-ups, how many targeted a CPU that was in an idle state (a halted vCPU
  on a VM without guest polling), and the delay from wake-up to running, in µs;
- the total of the delays over 300 µs, and the largest of them, with the thread, its target
  CPU, and what that CPU was running.

From the repository root, after `cargo build --release -p aqueduct-cli`, with a broker running
on its default port (`target/release/aqueduct-broker`), as root (or with
`kernel.perf_event_paranoid` at -1: `perf record -a` traces every CPU):

    E=sched:sched_wakeup,sched:sched_switch,power:cpu_idle
    perf record -q -o target/aq.data -e $E -a -- target/release/aqueduct bench --rate 10000 \\
        --duration 3s --batch 1 --payload-size 128 --warmup 1000
    perf script -i target/aq.data -F comm,pid,tid,cpu,time,event,trace > target/aq.txt 2>/dev/null
    python3 scripts/wakeups.py target/aq.txt
"""
import argparse
import collections
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from speedbar import quantile  # noqa: E402

LINE = re.compile(r"\s*(.+?)\s+(\d+)/(\d+)\s+\[(\d+)\]\s+([\d.]+):\s+(\S+):\s*(.*)")
EXIT_IDLE = 4294967295


def analyse(path):
    idle = collections.defaultdict(bool)
    running = {}
    pending = {}
    process_of = {}
    names = collections.defaultdict(set)
    delays = collections.defaultdict(lambda: {True: [], False: []})
    large = []
    with open(path, errors="replace") as f:
        for line in f:
            m = LINE.match(line)
            if not m:
                continue
            comm, pid, tid, cpu, t, event, trace = m.groups()
            cpu, t, pid, tid = int(cpu), float(t), int(pid), int(tid)
            process_of[tid] = pid
            names[pid].add(comm)
            if event == "power:cpu_idle":
                state = re.search(r"state=(\d+)", trace)
                if state:
                    idle[cpu] = int(state.group(1)) != EXIT_IDLE
            elif event == "sched:sched_wakeup":
                w = re.search(r"pid=(\d+) prio=\d+ target_cpu=(\d+)", trace)
                if w:
                    target = int(w.group(2))
                    pending[int(w.group(1))] = (t, target, idle[target], running.get(target))
            elif event == "sched:sched_switch":
                n = re.search(r"prev_pid=(\d+) .*next_comm=(.+?) next_pid=(\d+)", trace)
                if not n:
                    continue
                # A thread woken while it was still on its CPU (on its way to sleep) runs on
                # without a switch to it: its wake-up had no delay. Seeing it switched out
                # before it was switched in says so.
                pending.pop(int(n.group(1)), None)
                n = re.search(r"next_comm=(.+?) next_pid=(\d+)", trace)
                woken = int(n.group(2))
                running[cpu] = n.group(1)
                if woken in pending:
                    at, target, was_idle, there = pending.pop(woken)
                    delay = (t - at) * 1e6
                    delays[woken][was_idle].append(delay)
                    if delay > 300:
                        large.append((delay, woken, target, was_idle, there))

    def label(pid):
        own = sorted(n for n in names.get(pid, ()) if not n.startswith("tokio"))
        return f"{pid} ({', '.join(own) or 'threads only'})"

    per_process = collections.defaultdict(lambda: {True: [], False: []})
    for tid, d in delays.items():
        for k in (True, False):
            per_process[process_of.get(tid, tid)][k].extend(d[k])
    print(path)
    ranked = sorted(per_process.items(), key=lambda kv: -(len(kv[1][True]) + len(kv[1][False])))
    for pid, d in ranked[:6]:
        halted, awake = sorted(d[True]), sorted(d[False])
        print(f"  process {label(pid)}: {len(halted) + len(awake)} wake-ups, {len(halted)} onto an idle CPU"
              f" (delay p50 {quantile(halted, .5):.0f}, p99 {quantile(halted, .99):.0f}, max {max(halted, default=0):.0f} us);"
              f" onto a busy one: p50 {quantile(awake, .5):.0f}, p99 {quantile(awake, .99):.0f}, max {max(awake, default=0):.0f} us")
    total = sum(d for d, *_ in large)
    print(f"  delays over 300 us: {len(large)}, {total / 1e3:.1f} ms in all")
    for delay, tid, target, was_idle, there in sorted(large, reverse=True)[:8]:
        print(f"    {delay:8.0f} us: thread {tid} of {label(process_of.get(tid, tid))}, onto cpu {target}"
              f" ({'idle' if was_idle else 'not idle'}, running {there})")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("traces", nargs="+", metavar="FILE", help="`perf script` output")
    for path in ap.parse_args().traces:
        analyse(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
