"""What serving metrics costs the client path, measured in one run.

    python bench/metrics_bench.py [--duration 3] [--repeat 5] [--protos tcp,udp]
                                  [--modes produce,consume_confirm] [--queues 100]
                                  [--scrape-interval 1] [--baseline DIR] [--parts load,scrape]

Starts one-node qserver processes on free loopback ports, each in memory
with the same settings:

- `plain`: no `<http>`;
- `http`: `<http>` on, and a scraper in this process that GETs /metrics
  every `--scrape-interval` seconds while that node's runs go (the way
  Prometheus would, one connection per scrape);
- `baseline` (with `--baseline DIR`): the qserver package of another
  source tree (e.g. `git archive` of the commit before the metrics, or
  the tree with the counting stripped), started with PYTHONPATH=DIR, no
  `<http>`: the cost of the counting itself.

Every node first gets `--queues` extra queues of one message each (so a
scrape has per-queue series to compute). Then, for each protocol and mode,
bench/loadgen.py's closed loop (8 clients, one request in flight each)
runs `--duration` s against each node, in an order that rotates from one
repeat to the next, `--repeat` times. Printed: every run (req/s, p50/p99,
the node's CPU per request from /proc), then per node min/median/max req/s
and the median CPU per request, and the ratios http/plain (and
baseline/plain) of the median throughput and of the median CPU per
request: both sides in the same run, on the same machine at the same time.
The scrapes' own figures (count, median and max time from connect to the
last byte, body size) close that part.

`scrape` part: what one scrape costs the node's event loop, in process
(no sockets): a node with 100, 1,000 and 10,000 queues of one message,
per_queue on and off, the CPU time of `NodeMetrics.render` (collect and
format), median of `--scrape-repeat` (10), and the body's size. A scrape
runs on the loop, so this is how long the node's clients wait behind it.

Nothing is asserted.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import shlex
import statistics
import sys
import tempfile
import time

import uvloop

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import loadgen  # this directory, whether run as a script or not
from loadgen import CONSUME_QUEUE, LoadResult
from run_bench import ServerProcess

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "tests"))
from procs import free_port

MODES = ("produce", "consume_confirm")
PROTOS = ("tcp", "udp")
# consume_confirm top-up: messages for this many times the expected run.
PREFILL_MARGIN = 1.5
QUEUE_SIZE = 100_000_000  # the produce runs keep every message until consumed


class Scraper:
    """GET /metrics every `interval_s` while running (one connection each)."""

    def __init__(self, host: str, port: int, interval_s: float) -> None:
        self.host, self.port, self.interval_s = host, port, interval_s
        self.times_ms: list[float] = []
        self.sizes: list[int] = []
        self.failures = 0
        self._task: asyncio.Task | None = None

    async def scrape(self) -> bytes:
        reader, writer = await asyncio.open_connection(self.host, self.port)
        try:
            writer.write(b"GET /metrics HTTP/1.1\r\nHost: bench\r\nAccept: */*\r\n\r\n")
            data = await reader.read()  # the server closes after the answer
        finally:
            writer.close()
        if not data.startswith(b"HTTP/1.1 200"):
            raise RuntimeError(f"scrape answered {data[:40]!r}")
        return data

    async def _loop(self) -> None:
        while True:
            started = time.perf_counter()
            try:
                body = await self.scrape()
            except (OSError, RuntimeError):
                self.failures += 1
            else:
                self.times_ms.append((time.perf_counter() - started) * 1000)
                self.sizes.append(len(body))
            await asyncio.sleep(max(0.0, self.interval_s - (time.perf_counter() - started)))

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._loop())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def _mmm(values: list[float]) -> str:
    if not values:
        return "-"
    return f"{min(values):>9,.0f} {statistics.median(values):>9,.0f} {max(values):>9,.0f}"


async def _queues(server: ServerProcess, n: int) -> None:
    """`n` extra queues of one message each (pipelined, not measured)."""
    for i in range(n):
        await loadgen.prefill(server.host, server.port, 1, queue=f"bench-extra-{i}")


async def _top_up(server: ServerProcess, need: int) -> None:
    have = await loadgen.queue_size(server.host, server.port, CONSUME_QUEUE) or 0
    if have < need:
        await loadgen.prefill(server.host, server.port, need - have)


async def _measure(args: argparse.Namespace, servers: dict[str, ServerProcess],
                   scraper: Scraper) -> None:
    names = list(servers)
    for server in servers.values():
        await _queues(server, args.queues)
    runs: dict[tuple[str, str, str], list[tuple[LoadResult, float | None]]] = {
        (p, m, n): [] for p in args.protos for m in args.modes for n in names}

    async def run(name: str, proto: str, mode: str, duration: float, keep: bool) -> None:
        server = servers[name]
        if server.proc.poll() is not None:
            raise RuntimeError(f"{name} exited during the bench with {server.proc.returncode}")
        if mode == "consume_confirm":
            best = max((r.throughput for (p, _, _n), rs in runs.items() if p == proto
                        for r, _ in rs), default=50_000.0)
            await _top_up(server, int(best / 2 * duration * PREFILL_MARGIN))
        if name == "http":
            scraper.start()
        cpu = server.cpu_seconds()
        try:
            res = await loadgen.run_load(server.host, server.port, proto=proto, mode=mode,
                                         concurrency=args.concurrency, duration=duration)
        finally:
            await scraper.stop()
        after = server.cpu_seconds()
        us = (after - cpu) / res.requests * 1e6 if cpu is not None and after is not None \
            and res.requests else None
        if keep:
            runs[proto, mode, name].append((res, us))
            print(f"  {proto} {mode:15} {name:8} {res.throughput:>9,.0f} req/s  "
                  f"p50 {res.p50_ms:.3f} ms  p99 {res.p99_ms:.3f} ms  errors {res.errors}  "
                  f"empty {res.empty}  node cpu/req {us or 0:.2f} us", flush=True)

    for proto in args.protos:
        for mode in args.modes:
            for name in names:  # warm-up
                await run(name, proto, mode, args.warmup, keep=False)
            for i in range(args.repeat):
                order = names[i % len(names):] + names[:i % len(names)]
                for name in order:
                    await run(name, proto, mode, args.duration, keep=True)

    print()
    header = (f"{'proto':5} {'mode':15} {'node':8} {'min req/s':>9} {'median':>9} {'max':>9} "
              f"{'p50 ms':>7} {'p99 ms':>7} {'cpu us':>7} {'req/s ratio':>11} {'cpu ratio':>9}")
    print(header)
    print("-" * len(header))
    for proto in args.protos:
        for mode in args.modes:
            base = runs[proto, mode, "plain"]
            base_tp = _median([r.throughput for r, _ in base])
            base_us = _median([u for _, u in base if u is not None])
            for name in names:
                rs = runs[proto, mode, name]
                tp = [r.throughput for r, _ in rs]
                us = _median([u for _, u in rs if u is not None])
                med = _median(tp)
                ratio = f"{med / base_tp:.3f}" if med and base_tp else "-"
                cpu_ratio = f"{us / base_us:.3f}" if us and base_us else "-"
                print(f"{proto:5} {mode:15} {name:8} {_mmm(tp)} "
                      f"{_median([r.p50_ms for r, _ in rs]) or 0:>7.3f} "
                      f"{_median([r.p99_ms for r, _ in rs]) or 0:>7.3f} "
                      f"{us or 0:>7.2f} {ratio:>11} {cpu_ratio:>9}")
    print()
    if scraper.times_ms:
        print(f"scrapes of the http node: {len(scraper.times_ms)} ({scraper.failures} failed), "
              f"time to the last byte median {statistics.median(scraper.times_ms):.2f} ms, "
              f"max {max(scraper.times_ms):.2f} ms; body {statistics.median(scraper.sizes):,.0f} "
              f"bytes ({args.queues + 1} queues)")


def scrape_cost(repeat: int) -> None:
    """The `scrape` part (see the module docstring)."""
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from qserver.config import parse_xml
    from qserver.metrics import NodeMetrics
    from qserver.node import Node

    print("one scrape, in process: the node's CPU (its event loop is busy for as long)")
    print(f"{'queues':>7} {'per_queue':>9} {'ms/scrape':>10} {'us/queue':>9} {'bytes':>10}")
    now_ms = int(time.time() * 1000)
    for queues in (100, 1_000, 10_000):
        for per_queue in (1, 0):
            config = parse_xml(f'<config><node_info node_id="1" host="127.0.0.1" port="1"/>'
                               f'<http port="0" per_queue="{per_queue}"/></config>', "bench")
            node = Node(config)  # never started: only its state and collector are used
            for i in range(queues):
                node.service.answer_now({"action": 1, "queue": f"q{i}", "data": "x"}, now_ms)
            metrics = NodeMetrics(node)
            times = []
            body = b""
            for _ in range(repeat):
                gc.collect()
                started = time.process_time()
                body, _ = metrics.render("")
                times.append(time.process_time() - started)
            ms = statistics.median(times) * 1000
            print(f"{queues:>7,} {per_queue:>9} {ms:>10.2f} {ms * 1000 / queues:>9.1f} "
                  f"{len(body):>10,}", flush=True)


def _config(path: str, port: int, http_port: int | None) -> str:
    http = f'<http host="127.0.0.1" port="{http_port}"/>' if http_port is not None else ""
    with open(path, "w") as f:
        f.write(f'<config><node_info node_id="1" host="127.0.0.1" port="{port}"/>'
                f'<queue_config queue_size="{QUEUE_SIZE}"/>{http}</config>\n')
    return path


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--duration", type=float, default=3.0, help="seconds per run (default 3)")
    p.add_argument("--repeat", type=int, default=5, help="runs per node, protocol and mode")
    p.add_argument("--warmup", type=float, default=0.5, help="seconds of warm-up per node")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--protos", type=lambda s: s.split(","), default=list(PROTOS))
    p.add_argument("--modes", type=lambda s: s.split(","), default=list(MODES))
    p.add_argument("--queues", type=int, default=100,
                   help="extra queues of one message on every node (default 100)")
    p.add_argument("--scrape-interval", type=float, default=1.0, metavar="S",
                   help="seconds between scrapes of the http node (default 1)")
    p.add_argument("--baseline", metavar="DIR",
                   help="also run the qserver package of this source tree (no <http>)")
    p.add_argument("--parts", type=lambda s: s.split(","), default=["load", "scrape"],
                   help="load (the client path with and without <http>), scrape (one "
                        "scrape's cost in process); default both")
    p.add_argument("--scrape-repeat", type=int, default=10)
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    print("$ " + shlex.join([sys.executable, sys.argv[0]]
                            + (sys.argv[1:] if argv is None else argv)))
    print(f"python {sys.version.split()[0]}, {os.cpu_count()} cpus, load average "
          f"{os.getloadavg()[0]:.2f} at start; {args.concurrency} clients, {args.duration} s "
          f"per run, {args.repeat} runs per node, protocol and mode", flush=True)
    servers: dict[str, ServerProcess] = {}
    if "load" not in args.parts:
        scrape_cost(args.scrape_repeat)
        return 0
    rc = 1
    with tempfile.TemporaryDirectory(prefix="qserver-metrics-bench-") as tmp:
        try:
            ports = set()
            while len(ports) < 4:
                ports.add(free_port())
            plain_port, http_client_port, http_port, base_port = sorted(ports)
            run = [sys.executable, "-m", "qserver", "run", "--config"]
            servers["plain"] = ServerProcess(
                "plain", run + [_config(f"{tmp}/plain.xml", plain_port, None)],
                f"{tmp}/plain.log")
            servers["http"] = ServerProcess(
                "http", run + [_config(f"{tmp}/http.xml", http_client_port, http_port)],
                f"{tmp}/http.log")
            if args.baseline:
                # env execs python: the pid (and so the CPU from /proc) is the node's
                servers["baseline"] = ServerProcess(
                    "baseline", ["env", f"PYTHONPATH={os.path.abspath(args.baseline)}"]
                    + run + [_config(f"{tmp}/baseline.xml", base_port, None)],
                    f"{tmp}/baseline.log")
            for name, server in servers.items():
                print(f"{name}: {shlex.join(server.argv)}")
                server.wait_ready()
            scraper = Scraper("127.0.0.1", http_port, args.scrape_interval)
            uvloop.run(_measure(args, servers, scraper))
            rc = 0
            if "scrape" in args.parts:
                print()
                scrape_cost(args.scrape_repeat)
        except KeyboardInterrupt:
            print("\ninterrupted; stopping the nodes", file=sys.stderr)
            rc = 130
        except Exception as exc:
            print(f"\nbench failed: {type(exc).__name__}: {exc}", file=sys.stderr)
            for s in servers.values():
                tail = s.log_tail()
                if tail:
                    print(f"--- {s.name} log ---\n{tail}", file=sys.stderr)
        finally:
            for s in servers.values():
                s.stop()
    print(f"load average {os.getloadavg()[0]:.2f} at the end")
    return rc


if __name__ == "__main__":
    sys.exit(main())
