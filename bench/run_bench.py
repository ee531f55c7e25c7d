"""qserver's throughput as a fraction of a no-op floor, measured in one run.

    python bench/run_bench.py [--duration 3] [--repeat 3] [--concurrency 8]
                              [--warmup 0.3] [--protos tcp,udp]
                              [--modes produce,consume_confirm,list] [--qserver-cmd CMD]

--qserver-cmd starts qserver some other way (another interpreter, a
wrapper, a profiler); {python}, {config} and {port} in it are replaced, and
`--config FILE` is appended when it has no {config}.

What it does
- Starts two servers on free loopback ports and waits for their ready lines:
  bench/noop_server.py (uvloop + orjson and qserver's own framing; answers
  every request with code 0 and stores nothing) and one qserver node.
- Warms both up, then for each protocol (tcp, udp) and each mode (produce,
  consume_confirm, list) runs bench/loadgen.py's closed loop (8 clients,
  one request in flight each, as queue_server's own benchmark does) against
  both servers, alternating which goes first, `--repeat` times.
- Prints every run, then a table of min/median/max throughput, median p50
  and p99 latency, the median CPU time per request of the server ("srv
  us", from /proc) and of the generator ("gen us"), and the ratio of
  qserver's median throughput to the floor's median, per protocol and mode.
  CPU per request is steadier than throughput on a busy machine. "gen us"
  shows what the generator spends per request: against qserver it should
  be well below qserver's "srv us", so that qserver, not the generator, is
  what limits qserver's runs. Against the floor the two sides spend about
  the same, so the floor is the cost of a round trip between two Python
  processes on this transport, which is the point of measuring against it.

Why the ratio is fair: both servers are measured by the same generator, in
the same process, in the same run, with the same request bytes, alternating,
on the same (noisy, shared) machine. The generator competes with the server
for the machine's CPUs (two on the project's machines); it is built to be
cheap (see loadgen.py), so that the floor is set by the transport (event
loop, syscalls, qserver's framing and JSON codec) rather than by the
generator. A ratio of 1.0 would mean qserver's own work (validation, store,
log, engine) costs nothing. Other load on the machine moves both sides;
the load average is printed at the start and the end so a noisy run shows.

consume_confirm consumes from queue "bench", the queue the produce runs
just filled (retry 30 s, ttl 300 s, as in queue_server's bench), so the
queue's size stays bounded over the whole benchmark. Before each of
qserver's runs the queue is topped up if needed (pipelined over TCP, not
measured) to hold enough messages for the run, estimated from the rates
measured so far. The no-op server answers every consume with a message, so
both servers see the same consume, confirm, consume, ... mix, although the
floor does none of the work. A run in which qserver's queue ran dry is
flagged (its empty consumes are cheaper).

Every process started here is stopped at the end, also on Ctrl-C, SIGTERM or
an error. The default run takes about two minutes.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import re
import select
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

import uvloop

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import loadgen  # this directory, whether run as a script or not
from loadgen import CONSUME_QUEUE, MODES, PROTOS, LoadResult

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "tests"))
from procs import free_port

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
REPO_DIR = os.path.dirname(BENCH_DIR)

DEFAULT_QSERVER_CMD = "{python} -m qserver run --config {config}"

# A cold Python start on a loaded 2-core machine can take seconds.
READY_DEADLINE_S = 30.0

# How long a stopped server gets for its orderly shutdown before SIGKILL.
STOP_GRACE_S = 10.0

# The produce runs of one protocol keep every message until the
# consume_confirm runs take them; qserver's default queue_size (1e6) could be
# reached by a fast machine, so the bench node allows far more.
BENCH_QUEUE_SIZE = 100_000_000

# consume_confirm top-up: messages for this many times the expected run.
PREFILL_MARGIN = 1.5

# The goal of the issue that asked for this bench: produce at least this
# fraction of the floor, over TCP and over UDP.
PRODUCE_GOAL = 0.6

SERVERS = ("noop", "qserver")

_READY = re.compile(rb"ready on (\S+):(\d+)")

_CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


class ServerProcess:
    """A server child: started, waited for, and always stopped."""

    def __init__(self, name: str, argv: list[str], log_path: str) -> None:
        self.name = name
        self.argv = argv
        self.log_path = log_path
        self.host = ""
        self.port = 0
        self._log = open(log_path, "wb")
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=self._log,
                                     stdin=subprocess.DEVNULL, cwd=REPO_DIR)

    def wait_ready(self, deadline_s: float = READY_DEADLINE_S) -> None:
        """Wait for "... ready on HOST:PORT" on stdout; raise if it dies or
        does not say so in time."""
        end = time.monotonic() + deadline_s
        buf = b""
        fd = self.proc.stdout.fileno()
        while True:
            m = _READY.search(buf)
            if m:
                self.host, self.port = m.group(1).decode(), int(m.group(2))
                return
            left = end - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"{self.name} printed no ready line within {deadline_s:.0f} s "
                                   f"(stdout so far: {buf!r}; log: {self.log_path})")
            r, _, _ = select.select([fd], [], [], min(left, 0.5))
            if r:
                chunk = os.read(fd, 4096)
                if not chunk:
                    self.proc.wait(5)
                    raise RuntimeError(f"{self.name} exited with {self.proc.returncode} before it "
                                       f"was ready:\n{self.log_tail()}")
                buf += chunk

    def cpu_seconds(self) -> float | None:
        """CPU time (user + system, all threads) the server has used so far,
        from /proc; None where there is no /proc."""
        try:
            with open(f"/proc/{self.proc.pid}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
        except (OSError, IndexError):
            return None
        return (int(fields[11]) + int(fields[12])) / _CLK_TCK

    def log_tail(self, lines: int = 20) -> str:
        try:
            with open(self.log_path, "rb") as f:
                return b"\n".join(f.read().splitlines()[-lines:]).decode(errors="replace")
        except OSError:
            return ""

    def stop(self) -> int | None:
        """SIGTERM, then SIGKILL after a grace period. Idempotent."""
        proc = self.proc
        if proc.poll() is None:
            try:
                proc.send_signal(signal.SIGTERM)
                proc.wait(STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            except ProcessLookupError:
                pass
        if proc.stdout is not None:
            proc.stdout.close()
        self._log.close()
        return proc.returncode


@dataclass
class Cell:
    """The runs of one server on one protocol and mode."""

    results: list[LoadResult] = field(default_factory=list)
    server_us: list[float] = field(default_factory=list)  # server CPU per request, per run
    gen_us: list[float] = field(default_factory=list)  # generator CPU per request, per run

    @property
    def throughputs(self) -> list[float]:
        return [r.throughput for r in self.results]

    def median_throughput(self) -> float:
        return statistics.median(self.throughputs) if self.results else 0.0


def qserver_argv(template: str, config: str, port: int) -> list[str]:
    """The qserver command line from a template with {python}, {config} and
    {port}; `--config FILE` is appended if the template has no {config}."""
    argv = [part.format(python=sys.executable, config=config, port=port)
            for part in shlex.split(template)]
    if "{config}" not in template:
        argv += ["--config", config]
    return argv


def _fmt_rate(x: float) -> str:
    return f"{x:,.0f}"


def _fmt_us(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f}"


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def print_table(cells: dict) -> list[str]:
    """Print the summary table; return the goal lines."""
    header = (f"{'proto':5} {'mode':15} {'server':7} {'runs':>4} {'min req/s':>10} "
              f"{'median':>10} {'max':>10} {'p50 ms':>7} {'p99 ms':>7} {'errors':>6} "
              f"{'srv us':>7} {'gen us':>7} {'ratio':>6}")
    print(header)
    print("-" * len(header))
    goals = []
    for proto in PROTOS:
        for mode in MODES:
            floor = cells[proto, mode, "noop"].median_throughput()
            floor_us = _median(cells[proto, mode, "noop"].server_us)
            for server in SERVERS:
                cell = cells[proto, mode, server]
                rs = cell.results
                if not rs:
                    continue
                tp = cell.throughputs
                ratio = ""
                notes = []
                if server == "qserver" and floor > 0:
                    r = cell.median_throughput() / floor
                    ratio = f"{r:.2f}"
                    if mode == "produce":
                        cpu = ""
                        q_us = _median(cell.server_us)
                        if q_us and floor_us:
                            cpu = (f" (server CPU per request: qserver {q_us:.1f} us, "
                                   f"floor {floor_us:.1f} us)")
                        goals.append(f"goal: {proto} produce >= {PRODUCE_GOAL:.1f} x floor: "
                                     f"{r:.2f} {'met' if r >= PRODUCE_GOAL else 'NOT met'}{cpu}")
                    if mode == "consume_confirm":
                        notes.append("floor does no work here")
                empty = sum(x.empty for x in rs)
                if empty and server == "qserver":
                    notes.append(f"queue ran dry: {empty} empty consumes")
                print(f"{proto:5} {mode:15} {server:7} {len(rs):>4} {_fmt_rate(min(tp)):>10} "
                      f"{_fmt_rate(statistics.median(tp)):>10} {_fmt_rate(max(tp)):>10} "
                      f"{statistics.median(x.p50_ms for x in rs):>7.3f} "
                      f"{statistics.median(x.p99_ms for x in rs):>7.3f} "
                      f"{sum(x.errors for x in rs):>6} {_fmt_us(_median(cell.server_us)):>7} "
                      f"{_fmt_us(_median(cell.gen_us)):>7} {ratio:>6}"
                      + (f"  ({'; '.join(notes)})" if notes else ""))
    return goals


async def _top_up(server: ServerProcess, need: int) -> None:
    """Make qserver's consume queue hold at least `need` messages."""
    have = await loadgen.queue_size(server.host, server.port, CONSUME_QUEUE) or 0
    if have < need:
        await loadgen.prefill(server.host, server.port, need - have)


class Interrupted(Exception):
    """Raised when SIGINT or SIGTERM stops the bench."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


async def _bench(args: argparse.Namespace, servers: dict[str, ServerProcess]) -> int:
    # Inside the loop a signal cancels the bench (a handler that raised
    # would only be logged by the loop); main() turns that into cleanup.
    loop = asyncio.get_running_loop()
    task = asyncio.current_task()
    received: list[int] = []

    def on_signal(signum: int) -> None:
        received.append(signum)
        task.cancel()

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal, sig)
    try:
        return await _measure(args, servers)
    except asyncio.CancelledError:
        if received:
            raise Interrupted(received[0]) from None
        raise


async def _measure(args: argparse.Namespace, servers: dict[str, ServerProcess]) -> int:
    conc = args.concurrency

    async def run(server: ServerProcess, proto: str, mode: str, duration: float,
                  cell: Cell | None = None) -> LoadResult:
        for s in servers.values():
            if s.proc.poll() is not None:
                raise RuntimeError(f"{s.name} exited during the bench with {s.proc.returncode}")
        gc.collect()  # not during the measurement
        server_cpu, gen_cpu = server.cpu_seconds(), time.process_time()
        res = await loadgen.run_load(server.host, server.port, proto=proto, mode=mode,
                                     concurrency=conc, duration=duration)
        gen_cpu = time.process_time() - gen_cpu
        if cell is not None and res.requests:
            cell.results.append(res)
            after = server.cpu_seconds()
            if server_cpu is not None and after is not None:
                cell.server_us.append((after - server_cpu) / res.requests * 1e6)
            cell.gen_us.append(gen_cpu / res.requests * 1e6)
        return res

    protos, modes = args.protos, args.modes
    if args.warmup > 0:
        for proto in protos:
            for mode in modes:
                for name in SERVERS:
                    if name == "qserver" and mode == "consume_confirm":
                        await _top_up(servers[name], 1000)
                    await run(servers[name], proto, mode, args.warmup)
        print(f"warmed up: {args.warmup} s per server, protocol and mode", flush=True)

    cells = {(p, m, s): Cell() for p in PROTOS for m in MODES for s in SERVERS}
    for proto in protos:
        for mode in modes:
            for i in range(args.repeat):
                order = SERVERS if i % 2 == 0 else SERVERS[::-1]
                for name in order:
                    server = servers[name]
                    if name == "qserver" and mode == "consume_confirm":
                        # Enough messages for a run at the best rate seen yet.
                        best = max((r.throughput for (p, _, s), c in cells.items()
                                    if p == proto and s == "qserver" for r in c.results),
                                   default=50_000.0)
                        await _top_up(server, int(best / 2 * args.duration * PREFILL_MARGIN))
                    cell = cells[proto, mode, name]
                    res = await run(server, proto, mode, args.duration, cell)
                    print(f"  {proto} {mode:15} {name:7} run {i + 1}/{args.repeat}: "
                          f"{_fmt_rate(res.throughput):>8} req/s  p50 {res.p50_ms:.3f} ms  "
                          f"p99 {res.p99_ms:.3f} ms  max {res.max_ms:.1f} ms  "
                          f"errors {res.errors}  empty {res.empty}  "
                          f"cpu/req server "
                          f"{_fmt_us(cell.server_us[-1] if cell.server_us else None)} us"
                          f" gen {_fmt_us(cell.gen_us[-1] if cell.gen_us else None)} us",
                          flush=True)
    print()
    goals = print_table(cells)
    print()
    for line in goals:
        print(line)
    return 0


def _choices(allowed: tuple[str, ...]):
    def parse(text: str) -> tuple[str, ...]:
        chosen = tuple(x.strip() for x in text.split(",") if x.strip())
        bad = [x for x in chosen if x not in allowed]
        if bad or not chosen:
            raise argparse.ArgumentTypeError(f"choose from {','.join(allowed)}")
        return tuple(x for x in allowed if x in chosen)  # in the bench's order
    return parse


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="qserver vs a no-op floor, same generator, same run")
    p.add_argument("--duration", type=float, default=3.0, help="seconds per run (default 3)")
    p.add_argument("--repeat", type=int, default=3, help="runs per server, protocol and mode")
    p.add_argument("--concurrency", "-c", type=int, default=8, help="clients (default 8)")
    p.add_argument("--warmup", type=float, default=0.3,
                   help="seconds of warm-up per server, protocol and mode (default 0.3)")
    p.add_argument("--protos", type=_choices(PROTOS), default=PROTOS, metavar="LIST",
                   help="comma-separated subset of tcp,udp (default both)")
    p.add_argument("--modes", type=_choices(MODES), default=MODES, metavar="LIST",
                   help="comma-separated subset of produce,consume_confirm,list (default all)")
    p.add_argument("--qserver-cmd", default=DEFAULT_QSERVER_CMD, metavar="CMD",
                   help="how to start qserver; {python}, {config} and {port} are replaced "
                        f"(default: {DEFAULT_QSERVER_CMD!r})")
    return p


def _raise_interrupted(signum, frame) -> None:
    # Outside the event loop (starting the servers): interrupt at once.
    raise Interrupted(signum)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    cmdline = [sys.executable, sys.argv[0]] + (sys.argv[1:] if argv is None else argv)
    print("$ " + shlex.join(cmdline))
    load = os.getloadavg()
    print(f"python {sys.version.split()[0]}, {os.cpu_count()} cpus, load average "
          f"{load[0]:.2f} at start; concurrency {args.concurrency}, {args.duration} s per run, "
          f"{args.repeat} runs per server, protocol and mode", flush=True)
    signal.signal(signal.SIGINT, _raise_interrupted)
    signal.signal(signal.SIGTERM, _raise_interrupted)
    servers: dict[str, ServerProcess] = {}
    rc = 1
    with tempfile.TemporaryDirectory(prefix="qserver-bench-") as tmp:
        try:
            noop_port, q_port = free_port(), free_port()
            while q_port == noop_port:
                q_port = free_port()
            config = os.path.join(tmp, "qserver.xml")
            with open(config, "w") as f:
                f.write(f'<config><node_info node_id="1" host="127.0.0.1" port="{q_port}"/>'
                        f'<queue_config queue_size="{BENCH_QUEUE_SIZE}"/></config>\n')
            noop_argv = [sys.executable, os.path.join(BENCH_DIR, "noop_server.py"),
                         "--port", str(noop_port)]
            q_argv = qserver_argv(args.qserver_cmd, config, q_port)
            print(f"noop:    {shlex.join(noop_argv)}")
            print(f"qserver: {shlex.join(q_argv)}", flush=True)
            servers["noop"] = ServerProcess("noop", noop_argv, os.path.join(tmp, "noop.log"))
            servers["qserver"] = ServerProcess("qserver", q_argv, os.path.join(tmp, "qserver.log"))
            for s in servers.values():
                s.wait_ready()
            rc = uvloop.run(_bench(args, servers))
            for s in servers.values():
                if s.proc.poll() is not None:
                    print(f"{s.name} exited during the bench with {s.proc.returncode}; "
                          f"the figures are not valid:\n{s.log_tail()}")
                    rc = 1
        except Interrupted as exc:
            print(f"\ninterrupted by {exc}; stopping the servers", file=sys.stderr)
            rc = 128 + exc.signum
        except KeyboardInterrupt:  # SIGINT while no handler of ours was installed
            print("\ninterrupted; stopping the servers", file=sys.stderr)
            rc = 130
        except Exception as exc:
            print(f"\nbench failed: {type(exc).__name__}: {exc}", file=sys.stderr)
            for s in servers.values():
                tail = s.log_tail()
                if tail:
                    print(f"--- {s.name} log ---\n{tail}", file=sys.stderr)
            rc = 1
        finally:
            for sig in (signal.SIGINT, signal.SIGTERM):
                signal.signal(sig, signal.SIG_IGN)  # let the cleanup finish
            for s in servers.values():
                s.stop()
    print(f"load average {os.getloadavg()[0]:.2f} at the end")
    return rc


if __name__ == "__main__":
    sys.exit(main())
