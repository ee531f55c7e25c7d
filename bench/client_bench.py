"""AsyncClient with many tasks on one client (issue 18, point 4): the calls
of concurrent tasks pipelined on the client's connection, against the
client before (one call at a time on the connection, behind a lock), in
one run.

    python bench/client_bench.py [--tasks 1,8,64] [--duration 3] [--warmup 1]
        [--repeat 3] [--targets node,cluster] [--baseline-rev 32daa59]

The baseline is the qserver.client of another commit (`--baseline-rev`,
default 32daa59, the last with the lock), taken with `git archive` into a
temporary directory and imported beside this tree's as `qserver_baseline`
(its client and errors only: they import nothing else of the package), so
that both run in the same process, on the same event loop (asyncio's own,
as a user's program has by default), against the same node.

Workload: `--tasks` asyncio tasks share one AsyncClient, each in a closed
loop of `await client.produce(queue, 100 bytes)` (retry 0) for
`--duration` s after a `--warmup` that is not counted. Produces/s = calls
answered / the time measured. Targets: one node in memory (`node`), and
the master of a three-node cluster in memory (`cluster`, the native
engine's quorum mode; its address only, so that the client talks to the
master). Per repeat, every (target, tasks) pair runs both clients in
alternating order; printed per run and as min / median / max with the
ratio of medians pipelined / baseline. The machine the figures come from
has 2 cores, shared by this generator and the nodes: the load average is
printed at the start and the end.

Every process it starts is killed before it exits, Ctrl-C too.

Figures (`--repeat 3`, 2-core machine shared with other work, load 1.2 to
3.9; produces/s, min / median / max, ratio of medians):

    node      1 tasks: lock   6,453 /  6,553 /  9,018   pipelined  7,073 /  7,110 / 10,965   1.08
    node      8 tasks: lock   5,504 /  7,048 /  8,104   pipelined 21,050 / 35,061 / 51,504   4.97
    node     64 tasks: lock   6,080 /  7,474 /  8,253   pipelined 30,646 / 53,598 / 60,445   7.17
    cluster   1 tasks: lock   1,732 /  1,899 /  2,537   pipelined  1,837 /  2,142 /  2,209   1.13
    cluster   8 tasks: lock   1,695 /  2,071 /  2,073   pipelined  5,870 /  7,878 /  8,501   3.80
    cluster  64 tasks: lock   2,021 /  2,174 /  2,368   pipelined 11,280 / 13,058 / 24,010   6.01

With the lock, more tasks buy nothing: one request is on the wire at a
time. Pipelined, they fill the connection, up to what the node (or the
master's replication) and this generator, on the same 2 cores, can do.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import io
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from procs import Cluster, NodeProcess, free_port, write_config  # noqa: E402
from qserver.client import AsyncClient  # noqa: E402

DATA = "x" * 100


def load_baseline(rev: str, into: Path):
    """The AsyncClient of commit `rev`, as module qserver_baseline.client."""
    tar = subprocess.run(["git", "-C", str(ROOT), "archive", rev, "qserver/client",
                          "qserver/errors.py"], check=True, capture_output=True).stdout
    with tarfile.open(fileobj=io.BytesIO(tar)) as t:
        t.extractall(into, filter="data")
    pkg = into / "qserver_baseline"
    (into / "qserver").rename(pkg)
    (pkg / "__init__.py").write_text("")
    sys.path.insert(0, str(into))
    return importlib.import_module("qserver_baseline.client").AsyncClient


async def run_tasks(make_client, host: str, tasks: int, duration_s: float,
                    warmup_s: float, queue: str) -> float:
    """Produces per second of `tasks` tasks sharing one client."""
    counted = False
    done = 0
    async with make_client(host, timeout=30, retry_for=30) as client:
        async def worker() -> None:
            nonlocal done
            while not stop:
                await client.produce(queue, DATA)
                if counted:
                    done += 1

        stop = False
        workers = [asyncio.create_task(worker()) for _ in range(tasks)]
        await asyncio.sleep(warmup_s)
        counted = True
        start = time.perf_counter()
        await asyncio.sleep(duration_s)
        counted = False
        took = time.perf_counter() - start
        stop = True
        await asyncio.gather(*workers)
        await client.clear(queue)
    return done / took


def mmm(values: list[float]) -> str:
    return (f"{min(values):,.0f} / {statistics.median(values):,.0f} / "
            f"{max(values):,.0f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tasks", default="1,8,64")
    ap.add_argument("--duration", type=float, default=3.0)
    ap.add_argument("--warmup", type=float, default=1.0)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--targets", default="node,cluster")
    ap.add_argument("--baseline-rev", default="32daa59")
    args = ap.parse_args()
    task_counts = [int(t) for t in args.tasks.split(",")]
    targets = args.targets.split(",")
    print(f"load average at start: {os.getloadavg()}")
    with tempfile.TemporaryDirectory() as tmp_dir:
        tmp = Path(tmp_dir)
        baseline = load_baseline(args.baseline_rev, tmp / "baseline")
        clients = {f"lock@{args.baseline_rev}": baseline, "pipelined": AsyncClient}
        hosts: dict[str, str] = {}
        node = cluster = None
        try:
            if "node" in targets:
                port = free_port()
                node = NodeProcess(write_config(tmp / "node.xml", port), port)
                node.wait_ready()
                hosts["node"] = f"127.0.0.1:{port}"
            if "cluster" in targets:
                (tmp / "cluster").mkdir()
                cluster = Cluster(tmp / "cluster")
                cluster.start_all()
                hosts["cluster"] = f"127.0.0.1:{cluster.port(cluster.wait_master())}"
            results: dict[tuple[str, int, str], list[float]] = {}
            for r in range(args.repeat):
                for target, host in hosts.items():
                    for tasks in task_counts:
                        order = list(clients.items())
                        if r % 2:
                            order.reverse()
                        for name, make in order:
                            rate = asyncio.run(run_tasks(make, host, tasks, args.duration,
                                                         args.warmup, f"bench_{tasks}"))
                            results.setdefault((target, tasks, name), []).append(rate)
                            print(f"run {r + 1}: {target:7} {tasks:3} tasks {name:16} "
                                  f"{rate:10,.0f} produces/s", flush=True)
        finally:
            if node is not None:
                node.kill()
            if cluster is not None:
                cluster.stop_all()
    print(f"load average at end: {os.getloadavg()}")
    print("\nproduces/s, min / median / max; ratio of medians pipelined / baseline")
    base = f"lock@{args.baseline_rev}"
    for target in hosts:
        for tasks in task_counts:
            b = results[(target, tasks, base)]
            p = results[(target, tasks, "pipelined")]
            print(f"{target:7} {tasks:3} tasks: {base} {mmm(b):>26}   pipelined {mmm(p):>26}"
                  f"   ratio {statistics.median(p) / statistics.median(b):.2f}")


if __name__ == "__main__":
    main()
