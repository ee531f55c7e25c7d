"""Native engine against raft engine, in one run: produce throughput of a
three-node cluster and failover time after kill -9 of its master.

    python bench/engines_bench.py [--repeat 3] [--duration 3] [--warmup 1]

For each repeat, and each engine in turn (alternating, so that both see the
same machine conditions), it starts a three-node cluster of real `qserver
run` processes on free loopback ports (tests/procs.py's Cluster, no
storage, quorum mode), waits for a master, warms up, then:

- throughput: bench/loadgen.py's closed-loop clients (8, TCP, produce)
  against the master for --duration seconds;
- failover: kill -9 of the master, then the time until a produce succeeds
  through a surviving node (each tried in turn with a fresh TCP connection,
  forwarding on), measured from the kill.

It prints min/median/max per engine and the ratio raft/native of the
medians. Every process it starts is killed before it exits, Ctrl-C too.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shlex
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests"))

from loadgen import run_load  # noqa: E402
from procs import Cluster, TcpClient  # noqa: E402

ENGINES = ("native", "raft")

# A failover that has not produced a serving master in this long is
# reported as failed (the figure would be meaningless).
FAILOVER_DEADLINE_S = 30.0


def produce_once(port: int, timeout_s: float) -> bool:
    """One produce over a fresh connection; True if it was acknowledged."""
    try:
        c = TcpClient(port)
        c.sock.settimeout(timeout_s)
        try:
            return c.request(action=1, queue="failover", data="probe").get("code") == 0
        finally:
            c.close()
    except (OSError, ConnectionError, ValueError):
        return False


def measure_once(engine: str, args: argparse.Namespace) -> dict:
    with tempfile.TemporaryDirectory(prefix=f"engines-bench-{engine}-") as tmp:
        c = Cluster(Path(tmp), engine=engine)
        try:
            c.start_all()
            m = c.wait_master(deadline_s=60)
            port = c.port(m)
            asyncio.run(run_load("127.0.0.1", port, proto="tcp", mode="produce",
                                 concurrency=args.concurrency, duration=args.warmup))
            load = asyncio.run(run_load("127.0.0.1", port, proto="tcp", mode="produce",
                                        concurrency=args.concurrency, duration=args.duration))
            survivors = [i for i in range(1, c.n + 1) if i != m]
            c.kill(m)
            killed = time.monotonic()
            failover = None
            k = 0
            while time.monotonic() - killed < FAILOVER_DEADLINE_S:
                if produce_once(c.port(survivors[k % len(survivors)]), timeout_s=2.0):
                    failover = time.monotonic() - killed
                    break
                k += 1
                time.sleep(0.01)
            return {"throughput": load.throughput, "p50_ms": load.p50_ms, "p99_ms": load.p99_ms,
                    "errors": load.errors, "failover_s": failover}
        finally:
            c.stop_all()


def _stats(values: list[float]) -> tuple[float, float, float]:
    return min(values), statistics.median(values), max(values)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeat", type=int, default=3, help="clusters per engine (default 3)")
    p.add_argument("--duration", type=float, default=3.0, help="seconds of load per run (3)")
    p.add_argument("--warmup", type=float, default=1.0, help="seconds of warm-up load (1)")
    p.add_argument("--concurrency", type=int, default=8, help="closed-loop clients (8)")
    args = p.parse_args(argv)
    print("$ " + shlex.join([sys.executable, *sys.argv]))
    print(f"python {sys.version.split()[0]}, {os.cpu_count()} cpus, load average "
          f"{os.getloadavg()[0]:.2f} at the start; {socket.gethostname()}")
    results: dict[str, list[dict]] = {e: [] for e in ENGINES}
    for i in range(args.repeat):
        for engine in ENGINES:
            r = measure_once(engine, args)
            results[engine].append(r)
            fo = f"{r['failover_s']:.2f} s" if r["failover_s"] is not None else "FAILED"
            print(f"  run {i + 1}/{args.repeat} {engine:6}: {r['throughput']:8.0f} req/s "
                  f"p50 {r['p50_ms']:.2f} ms p99 {r['p99_ms']:.2f} ms errors {r['errors']}; "
                  f"failover {fo}", flush=True)
    print()
    header = f"{'metric':22} {'engine':7} {'min':>9} {'median':>9} {'max':>9}"
    print(header)
    print("-" * len(header))
    medians: dict[tuple[str, str], float] = {}
    for metric, unit in (("throughput", "req/s"), ("p50_ms", "ms"), ("p99_ms", "ms"),
                         ("failover_s", "s")):
        for engine in ENGINES:
            values = [r[metric] for r in results[engine] if r[metric] is not None]
            if not values:
                print(f"{metric + ' (' + unit + ')':22} {engine:7} {'-':>9} {'-':>9} {'-':>9}")
                continue
            lo, mid, hi = _stats(values)
            medians[(metric, engine)] = mid
            fmt = "{:9.0f}" if metric == "throughput" else "{:9.2f}"
            print(f"{metric + ' (' + unit + ')':22} {engine:7} {fmt.format(lo)} "
                  f"{fmt.format(mid)} {fmt.format(hi)}")
    print()
    for metric in ("throughput", "failover_s"):
        a, b = medians.get((metric, "raft")), medians.get((metric, "native"))
        if a is not None and b:
            print(f"ratio raft/native, median {metric}: {a / b:.2f}")
    print(f"load average {os.getloadavg()[0]:.2f} at the end")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        sys.exit(130)
