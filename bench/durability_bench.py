"""What durability costs, measured in one run: fsync policies, restart, memory, catch-up.

    python bench/durability_bench.py [--quick] [--parts throughput,restart,catchup]
        [--messages 1000000] [--message-bytes 100] [--restart-fsync batch]
        [--catchup-messages 200000] [--catchup-log-size 1000]
        [--duration 3] [--repeat 3] [--warmup 1] [--concurrency 8] [--timeout 120]
        [--fill-connections 4] [--fill-window 2000] [--dir DIR] [--keep]

Every node is a real `qserver run` process on free loopback ports, with its
data directory under a temporary directory (on the same file system as
--dir, default the system's temp dir; its file system type is printed,
since fsync on tmpfs costs nothing). Figures, not tests: nothing is
asserted, every part prints what it measured, and a part that does not
finish within --timeout says "did not finish in N s" and the bench goes on.

Parts
- throughput (a): three three-node clusters (quorum mode, storage), one per
  fsync policy (off, batch, always), all running for the whole part. After a
  warm-up of each, bench/loadgen.py's closed loop (8 clients, one produce
  in flight each, as queue_server's own benchmark) runs against each
  cluster's master over TCP for --duration seconds, --repeat times, the
  order of the policies rotating from one round to the next. Prints
  min/median/max produce/s, p50/p99, the CPU per request of the master and
  of all three nodes, and each policy's median as a ratio of `off`'s median
  in the same run ("x off"; the goals: batch >= 0.8 x off, always >= 0.5 x
  off). "cpu x off" is off's CPU per request (three nodes) over the
  policy's: steadier than throughput on a busy machine, it is the ratio
  the throughputs would have if CPU were all that limited them (time spent
  waiting for fsync is not CPU, and the kernel's own work for a sync handed
  to it with Linux AIO is not the node's, so for `always` it flatters).
  Each run also prints the records per fsync of the master and of the
  slaves (monitor's `storage` counters): how well syncs are grouped.
- restart (b) and memory (c): one node with storage (--restart-fsync)
  filled with --messages messages of --message-bytes bytes in one queue,
  pipelined over TCP (--fill-connections connections, each keeping
  --fill-window produces in flight). Then, --repeat times each: stop it
  with SIGTERM (the time the orderly stop takes is printed too) and start it
  again; kill it with SIGKILL and start it again. Before every stop the
  node is left to settle (idle CPU, no unfinished *.tmp file in its data
  directory: e.g. a snapshot it writes after the fill or after recovering),
  so each restart starts from what a node left alone would have on disk;
  how long settling took is printed. Restart time is from the
  moment the process is started until a monitor request (action 4) answers
  with the queue's full size. VmRSS (and VmHWM, the peak) from
  /proc/PID/status after the fill and after every restart. Goals: restart
  < 10 s and RSS < 400 MB, for 1,000,000 messages of 100 bytes. The fill
  warms the page cache and the interpreter's files, so the restarts read
  the data directory from memory (a cold-cache restart after a reboot reads
  it from disk and takes longer).
- catchup (d): a three-node cluster (quorum, storage, log_size
  --catchup-log-size), one slave stopped with SIGTERM, --catchup-messages
  produced to the master (--catchup-fill-connections connections with
  --catchup-fill-window in flight each; produces answered with an error
  are made again), then the slave started again; timed
  until the slave's own monitor (action 104) reports at least the master's
  trans_id and applied_id and its copy of the queue holds every message.
  Printed as messages per second, from the slave's process start and from
  its first answer (the second leaves out its own start-up and recovery).
  A fresh cluster per repeat, so every repeat catches up the same state.

Machine load: the load average and the CPU used on the machine by
processes other than this bench and its nodes (from /proc/stat) are printed
for every part, so a noisy run shows.

--keep keeps the data directories (and their configs) and prints where they
are, e.g. to profile a restart by hand:

    py-spy record -o restart.svg -- .venv/bin/python -m qserver run --config DIR/restart/node.xml
"""

from __future__ import annotations

import argparse
import asyncio
import os
import resource
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import orjson
import uvloop

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
REPO_DIR = os.path.dirname(BENCH_DIR)
sys.path.insert(0, BENCH_DIR)
import loadgen  # noqa: E402  (this directory, whether run as a script or not)
from run_bench import free_port  # noqa: E402

FSYNC_POLICIES = ("off", "batch", "always")
SECRET = "durability-bench"

# Goals of the durability issue.
GOAL_BATCH_RATIO = 0.8
GOAL_ALWAYS_RATIO = 0.5
GOAL_RESTART_S = 10.0
GOAL_RSS_MB = 400.0
GOAL_MESSAGES = 1_000_000
GOAL_MESSAGE_BYTES = 100

# Large enough never to refuse a produce of the bench.
BENCH_QUEUE_SIZE = 100_000_000

FILL_QUEUE = "durability"
# A ttl far beyond the bench, so that no message of the fill expires.
FILL_TTL_S = 7 * 86400

POLL_S = 0.02  # how often a restarting node is asked
STOP_GRACE_S = 30.0  # SIGTERM, then SIGKILL after this

QUICK = dict(messages=100_000, catchup_messages=20_000, duration=1.5, repeat=2, warmup=0.5)

_CLK_TCK = os.sysconf("SC_CLK_TCK")


class DidNotFinish(Exception):
    """A phase ran past its deadline or its node died; the message says which."""


# -- processes -------------------------------------------------------------

_ALL_NODES: list[Node] = []  # every process started, for the final cleanup


class Node:
    """One `qserver run` process, logging to a file."""

    def __init__(self, name: str, config_path: str, port: int, log_path: str) -> None:
        self.name = name
        self.config_path = config_path
        self.port = port
        self.log_path = log_path
        self._log = open(log_path, "ab")
        self.started_at = time.perf_counter()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "qserver", "run", "--config", config_path],
            stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=REPO_DIR)
        _ALL_NODES.append(self)

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def status_mb(self, key: str = "VmRSS") -> float | None:
        """A field of /proc/PID/status (VmRSS, VmHWM) in MB; None if gone."""
        try:
            with open(f"/proc/{self.proc.pid}/status", "rb") as f:
                for line in f:
                    if line.startswith(key.encode() + b":"):
                        return int(line.split()[1]) / 1024
        except OSError:
            pass
        return None

    def cpu_seconds(self) -> float:
        try:
            with open(f"/proc/{self.proc.pid}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
            return (int(fields[11]) + int(fields[12])) / _CLK_TCK
        except (OSError, IndexError):
            return 0.0

    async def stop(self, sig: int = signal.SIGTERM, grace_s: float = STOP_GRACE_S) -> float | None:
        """Send `sig` and wait for the exit; the seconds it took, or None if
        it had to be killed after `grace_s`."""
        if not self.alive:
            return 0.0
        t0 = time.perf_counter()
        self.proc.send_signal(sig)
        end = t0 + grace_s
        # A subprocess.Popen offers nothing to await: poll, at the 10 ms the
        # figure is reported to.
        while self.alive and time.perf_counter() < end:  # noqa: ASYNC110
            await asyncio.sleep(0.01)
        took: float | None = time.perf_counter() - t0
        if self.alive:
            self.proc.kill()
            took = None
        self.proc.wait()
        self._log.close()
        return took

    def kill_now(self) -> None:
        if self.alive:
            self.proc.kill()
        self.proc.wait()
        self._log.close()

    def log_tail(self, lines: int = 8) -> str:
        try:
            with open(self.log_path, "rb") as f:
                return b"\n".join(f.read().splitlines()[-lines:]).decode(errors="replace")
        except OSError:
            return ""


def node_config(node_id: int, port: int, data_dir: str, fsync: str, *,
                cluster: list[tuple[int, int]] | None = None, log_size: int | None = None,
                sync_rate: int | None = None) -> str:
    qc = f'queue_size="{BENCH_QUEUE_SIZE}"'
    if log_size is not None:
        qc += f' log_size="{log_size}"'
    if sync_rate is not None:
        qc += f' sync_rate="{sync_rate}"'
    lines = ['<config>', '  <log level="info"/>',
             f'  <node_info node_id="{node_id}" host="127.0.0.1" port="{port}"/>',
             f'  <queue_config {qc}/>']
    if cluster:
        lines.append(f'  <cluster secret="{SECRET}">')
        lines += [f'    <node id="{i}" host="127.0.0.1" port="{p}"/>' for i, p in cluster]
        lines.append('  </cluster>')
        lines.append('  <replication engine="native" mode="quorum" forward_request="1"/>')
    lines.append(f'  <storage dir="{data_dir}" fsync="{fsync}"/>')
    lines.append('</config>')
    return "\n".join(lines) + "\n"


def free_ports(n: int) -> list[int]:
    ports: list[int] = []
    while len(ports) < n:
        p = free_port()
        if p not in ports:
            ports.append(p)
    return ports


class Cluster:
    """Three (or n) nodes with storage on free loopback ports."""

    def __init__(self, root: str, name: str, fsync: str, n: int = 3,
                 log_size: int | None = None, sync_rate: int | None = None) -> None:
        self.root = root
        self.name = name
        os.makedirs(root, exist_ok=True)
        ports = free_ports(2 * n)
        self.client_ports = {i + 1: ports[i] for i in range(n)}
        internal = [(i + 1, ports[n + i]) for i in range(n)]
        self.configs: dict[int, str] = {}
        for i in self.client_ports:
            path = os.path.join(root, f"node{i}.xml")
            with open(path, "w") as f:
                f.write(node_config(i, self.client_ports[i], os.path.join(root, f"data{i}"), fsync,
                                    cluster=internal, log_size=log_size, sync_rate=sync_rate))
            self.configs[i] = path
        self.nodes: dict[int, Node] = {}
        self._runs = 0

    def start(self, node_id: int) -> Node:
        self._runs += 1
        node = Node(f"{self.name}/node{node_id}", self.configs[node_id], self.client_ports[node_id],
                    os.path.join(self.root, f"node{node_id}.log"))
        self.nodes[node_id] = node
        return node

    def start_all(self) -> None:
        for i in self.client_ports:
            self.start(i)

    async def wait_master(self, timeout_s: float) -> int:
        """The node that says it is master and that every live node follows."""
        end = time.perf_counter() + timeout_s
        while time.perf_counter() < end:
            live = [i for i, n in self.nodes.items() if n.alive]
            answers = await asyncio.gather(*(ask(self.client_ports[i], {"action": 104})
                                             for i in live))
            masters = [i for i, a in zip(live, answers) if a and a.get("role") == "master"]
            if len(masters) == 1 and all(a and a.get("leader_node_id") == masters[0]
                                         for a in answers):
                return masters[0]
            await asyncio.sleep(0.05)
        raise DidNotFinish(f"{self.name}: no master agreed on in {timeout_s:.0f} s")

    def cpu_seconds(self) -> float:
        return sum(n.cpu_seconds() for n in self.nodes.values() if n.alive)

    async def storage_counts(self) -> dict[int, tuple[int, int]]:
        """Per live node: (records written, fsyncs) from monitor's storage info."""
        live = [i for i, n in self.nodes.items() if n.alive]
        answers = await asyncio.gather(*(ask(self.client_ports[i], {"action": 104})
                                         for i in live))
        out = {}
        for i, a in zip(live, answers):
            st = (a or {}).get("storage")
            if isinstance(st, dict):
                out[i] = (st.get("records_written", 0), st.get("fsyncs", 0))
        return out

    async def stop_all(self) -> None:
        await asyncio.gather(*(n.stop() for n in self.nodes.values()))


def _per_fsync(before: dict, after: dict, master: int) -> str:
    """', records per fsync: master M, slaves S' over one run (empty without fsyncs)."""
    parts = []
    for who, ids in (("master", [master]), ("slaves", [i for i in after if i != master])):
        recs = sum(after[i][0] - before.get(i, (0, 0))[0] for i in ids if i in after)
        syncs = sum(after[i][1] - before.get(i, (0, 0))[1] for i in ids if i in after)
        if syncs:
            parts.append(f"{who} {recs / syncs:.1f}")
    return ", records/fsync " + ", ".join(parts) if parts else ""


# -- client side -----------------------------------------------------------

async def ask(port: int, request: dict, timeout_s: float = 2.0) -> dict | None:
    """One request over a fresh TCP connection; None if nothing answers."""
    writer = None
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port),
                                                timeout_s)
        writer.write(orjson.dumps(request))
        line = await asyncio.wait_for(reader.readline(), timeout_s)
        return orjson.loads(line) if line else None
    except (TimeoutError, OSError, orjson.JSONDecodeError):
        return None
    finally:
        if writer is not None:
            writer.close()


class _Filler(asyncio.Protocol):
    """Produces `count` copies of one request, keeping up to `window` in
    flight: a new batch goes out whenever half the window has been answered,
    so the server always has a full read waiting."""

    def __init__(self, one: bytes, count: int, window: int) -> None:
        self.one = one
        self.left = count
        self.window = window
        self.in_flight = 0
        self.ok = 0
        self.errors = 0
        self.first_error = b""
        self.buf = b""
        self.transport: asyncio.Transport | None = None
        self.done = asyncio.get_running_loop().create_future()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self._pump()
        self._check_done()

    def _pump(self) -> None:
        n = min(self.window - self.in_flight, self.left)
        if n > 0:
            self.transport.write(self.one * n)
            self.in_flight += n
            self.left -= n

    def data_received(self, data: bytes) -> None:
        buf = self.buf + data
        end = buf.rfind(b"\n")
        if end < 0:
            self.buf = buf
            return
        whole, self.buf = buf[:end + 1], buf[end + 1:]
        n = whole.count(b"\n")
        ok = whole.count(b'"code":0')
        self.ok += ok
        if ok < n:
            self.errors += n - ok
            if not self.first_error:
                self.first_error = next((line for line in whole.split(b"\n")
                                         if line and b'"code":0' not in line), b"")
        self.in_flight -= n
        if self.in_flight <= self.window // 2:
            self._pump()
        self._check_done()

    def _check_done(self) -> None:
        if self.left == 0 and self.in_flight == 0 and not self.done.done():
            self.done.set_result(None)

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.done.done():
            self.done.set_exception(ConnectionError(f"connection lost ({exc or 'closed'})"))


@dataclass
class FillResult:
    ok: int
    errors: int
    first_error: str
    seconds: float

    @property
    def rate(self) -> float:
        return self.ok / self.seconds if self.seconds > 0 else 0.0


async def fill(port: int, count: int, *, connections: int, window: int, data: str,
               timeout_s: float, queue: str = FILL_QUEUE, rounds: int = 3) -> FillResult:
    """Produce `count` messages into `queue`, pipelined over `connections`
    TCP connections, `window` in flight on each. Produces answered with an
    error are made again, up to `rounds` rounds in all (an "outcome unknown"
    error may still have stored its message, so the queue can end up with
    a few more). Raises DidNotFinish past the deadline."""
    total = FillResult(ok=0, errors=0, first_error="", seconds=0.0)
    end = time.perf_counter() + timeout_s
    left = count
    for _ in range(rounds):
        r = await _fill_round(port, left, connections=connections, window=window, data=data,
                              timeout_s=end - time.perf_counter(), queue=queue, done=total.ok)
        total = FillResult(ok=total.ok + r.ok, errors=total.errors + r.errors,
                           first_error=total.first_error or r.first_error,
                           seconds=total.seconds + r.seconds)
        left = count - total.ok
        if left <= 0:
            break
    return total


async def _fill_round(port: int, count: int, *, connections: int, window: int, data: str,
                      timeout_s: float, queue: str, done: int) -> FillResult:
    loop = asyncio.get_running_loop()
    now_s = int(time.time())
    one = orjson.dumps({"action": 1, "queue": queue, "ttl": now_s + FILL_TTL_S, "data": data})
    connections = max(1, min(connections, count))
    share = [count // connections + (1 if i < count % connections else 0)
             for i in range(connections)]
    fillers: list[_Filler] = []
    t0 = time.perf_counter()
    try:
        for n in share:
            if n:
                _, f = await loop.create_connection(
                    lambda n=n: _Filler(one, n, window), "127.0.0.1", port)
                fillers.append(f)
        try:
            await asyncio.wait_for(asyncio.gather(*(f.done for f in fillers)), max(timeout_s, 0))
        except TimeoutError:
            ok = done + sum(f.ok for f in fillers)
            raise DidNotFinish(f"fill did not finish in the time allowed ({ok:,} produced, "
                               f"{sum(f.errors for f in fillers):,} errors)") from None
        seconds = time.perf_counter() - t0
    finally:
        for f in fillers:
            if f.transport is not None:
                f.transport.close()
    first = next((f.first_error for f in fillers if f.first_error), b"")
    return FillResult(ok=sum(f.ok for f in fillers), errors=sum(f.errors for f in fillers),
                      first_error=first.decode(errors="replace")[:200], seconds=seconds)


async def wait_answer(node: Node, request: dict, good,
                      timeout_s: float) -> tuple[float, float, dict]:
    """Poll `node` with `request` from its process start until `good(answer)`.
    Returns (seconds to its first answer, seconds to a good one, that answer),
    both from the process start. Raises DidNotFinish."""
    first = None
    last: dict | None = None
    end = node.started_at + timeout_s
    while True:
        if not node.alive:
            raise DidNotFinish(f"{node.name} exited with {node.proc.returncode}: "
                               f"{node.log_tail(3)}")
        a = await ask(node.port, request, timeout_s=2.0)
        now = time.perf_counter()
        if a is not None:
            last = a
            if first is None:
                first = now - node.started_at
            if good(a):
                return first, now - node.started_at, a
        if now > end:
            seen = "no answer" if last is None else f"last answer {_brief(last)}"
            raise DidNotFinish(f"did not finish in {timeout_s:.0f} s ({seen})")
        await asyncio.sleep(POLL_S)


def _brief(answer: dict) -> str:
    keys = ("code", "reason", "role", "trans_id", "commit_id", "applied_id", "size")
    return ", ".join(f"{k}={answer[k]}" for k in keys if k in answer)


def _own_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


async def settle(node: Node, data_dir: str, timeout_s: float, quiet_s: float = 1.0,
                 idle_cpu: float = 0.03) -> str:
    """Wait until the node is idle (under `idle_cpu` of a core for
    `quiet_s`) and its data directory holds no unfinished write (*.tmp),
    e.g. a snapshot it writes after a fill or a restart. Returns what
    happened, for the log."""
    t0 = time.perf_counter()
    end = t0 + timeout_s
    last_cpu, last_t = node.cpu_seconds(), t0
    while True:
        await asyncio.sleep(quiet_s)
        if not node.alive:
            return f"exited with {node.proc.returncode} while settling"
        cpu, now = node.cpu_seconds(), time.perf_counter()
        busy = (cpu - last_cpu) / (now - last_t)
        last_cpu, last_t = cpu, now
        try:
            tmp = [n for n in os.listdir(data_dir) if n.endswith(".tmp")]
        except OSError:
            tmp = []
        if busy < idle_cpu and not tmp:
            return f"idle after {now - t0:.1f} s"
        if now > end:
            return (f"did not settle in {timeout_s:.0f} s (CPU {busy:.0%} of a core"
                    + (f", unfinished {', '.join(tmp)}" if tmp else "") + ")")


# -- machine load ----------------------------------------------------------

class LoadMeter:
    """CPU used on the whole machine during a part, minus what this bench
    and its (waited-for) nodes used: the other load of a shared machine."""

    def __init__(self) -> None:
        self.t0 = time.perf_counter()
        self.busy0 = self._busy()
        self.ours0 = self._ours()
        self.load0 = os.getloadavg()[0]

    @staticmethod
    def _busy() -> float:
        try:
            with open("/proc/stat") as f:
                v = [int(x) for x in f.readline().split()[1:]]
        except OSError:
            return 0.0
        # user nice system idle iowait irq softirq steal
        return (v[0] + v[1] + v[2] + v[5] + v[6] + (v[7] if len(v) > 7 else 0)) / _CLK_TCK

    @staticmethod
    def _ours() -> float:
        s = resource.getrusage(resource.RUSAGE_SELF)
        c = resource.getrusage(resource.RUSAGE_CHILDREN)
        live = sum(n.cpu_seconds() for n in _ALL_NODES if n.alive)
        return s.ru_utime + s.ru_stime + c.ru_utime + c.ru_stime + live

    def line(self) -> str:
        dt = max(time.perf_counter() - self.t0, 1e-9)
        other = max(self._busy() - self.busy0 - (self._ours() - self.ours0), 0.0) / dt
        return (f"load average {self.load0:.2f} -> {os.getloadavg()[0]:.2f}; CPU used by other "
                f"processes meanwhile: {other:.2f} of {os.cpu_count()} cores")


# -- report ----------------------------------------------------------------

@dataclass
class Goal:
    name: str
    measured: str
    goal: str
    met: bool | None  # None: not measured or no goal


@dataclass
class Report:
    goals: list[Goal] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def mmm(values: list[float], fmt: str = "{:,.2f}") -> str:
    """min / median / max."""
    if not values:
        return "-"
    return " / ".join(fmt.format(x) for x in (min(values), statistics.median(values), max(values)))


def dir_mb(path: str) -> tuple[float, int]:
    total, files = 0, 0
    for dp, _, names in os.walk(path):
        for n in names:
            try:
                total += os.path.getsize(os.path.join(dp, n))
                files += 1
            except OSError:
                pass
    return total / 1e6, files


def dir_listing(path: str) -> str:
    try:
        names = sorted(os.listdir(path))
    except OSError:
        return "-"
    kinds: dict[str, int] = {}
    for n in names:
        k = n.split("-")[0].split(".")[0] if ("-" in n or "." in n) else n
        kinds[k] = kinds.get(k, 0) + 1
    return ", ".join(f"{v} {k}" for k, v in sorted(kinds.items()))


# -- (a) produce throughput per fsync policy --------------------------------

async def part_throughput(args: argparse.Namespace, root: str, report: Report) -> None:
    print(f"\n== (a) produce throughput, three-node cluster (quorum, storage), fsync "
          f"{'/'.join(FSYNC_POLICIES)}; {args.concurrency} closed-loop TCP clients to the master, "
          f"{args.duration} s per run, {args.repeat} runs per policy, rotating order", flush=True)
    meter = LoadMeter()
    clusters = {p: Cluster(os.path.join(root, f"tp-{p}"), f"fsync={p}", p) for p in FSYNC_POLICIES}
    results: dict[str, list] = {p: [] for p in FSYNC_POLICIES}
    cpu: dict[str, list[tuple[float, float]]] = {p: [] for p in FSYNC_POLICIES}
    try:
        for c in clusters.values():
            c.start_all()
        masters = {}
        for p, c in clusters.items():
            masters[p] = await c.wait_master(args.timeout)
        print("  masters: " + ", ".join(f"{p}: node {m}" for p, m in masters.items()))
        if args.warmup > 0:
            for p, c in clusters.items():
                await loadgen.run_load("127.0.0.1", c.client_ports[masters[p]], proto="tcp",
                                       mode="produce", concurrency=args.concurrency,
                                       duration=args.warmup)
            print(f"  warmed up: {args.warmup} s per cluster", flush=True)
        for i in range(args.repeat):
            k = i % len(FSYNC_POLICIES)
            for p in FSYNC_POLICIES[k:] + FSYNC_POLICIES[:k]:
                c = clusters[p]
                master = c.nodes[masters[p]]
                m0, c0 = master.cpu_seconds(), c.cpu_seconds()
                s0 = await c.storage_counts()
                try:
                    res = await loadgen.run_load("127.0.0.1", master.port, proto="tcp",
                                                 mode="produce", concurrency=args.concurrency,
                                                 duration=args.duration)
                except (OSError, TimeoutError) as exc:
                    print(f"  fsync={p:6} run {i + 1}: failed: {type(exc).__name__}: {exc}")
                    continue
                n = max(res.requests, 1)
                s1 = await c.storage_counts()
                cpu[p].append(((master.cpu_seconds() - m0) / n * 1e6,
                               (c.cpu_seconds() - c0) / n * 1e6))
                results[p].append(res)
                print(f"  fsync={p:6} run {i + 1}/{args.repeat}: {res.throughput:>8,.0f} req/s  "
                      f"p50 {res.p50_ms:.3f} ms  p99 {res.p99_ms:.3f} ms  max {res.max_ms:.1f} ms  "
                      f"errors {res.errors}  cpu/req master {cpu[p][-1][0]:.0f} us, "
                      f"cluster {cpu[p][-1][1]:.0f} us{_per_fsync(s0, s1, masters[p])}",
                      flush=True)
    except (DidNotFinish, OSError) as exc:
        print(f"  {type(exc).__name__}: {exc}")
    finally:
        for c in clusters.values():
            await c.stop_all()
    print()
    header = (f"  {'fsync':6} {'runs':>4} {'min req/s':>10} {'median':>10} {'max':>10} "
              f"{'p50 ms':>7} {'p99 ms':>7} {'errors':>6} {'master us':>9} {'cluster us':>10} "
              f"{'x off':>6} {'cpu x off':>9}")
    print(header)
    print("  " + "-" * (len(header) - 2))
    base = statistics.median([r.throughput for r in results["off"]]) if results["off"] else 0.0
    base_us = statistics.median(c[1] for c in cpu["off"]) if cpu["off"] else 0.0
    ratios: dict[str, float | None] = {}
    for p in FSYNC_POLICIES:
        rs = results[p]
        if not rs:
            print(f"  {p:6} no completed run")
            ratios[p] = None
            continue
        tp = [r.throughput for r in rs]
        ratios[p] = statistics.median(tp) / base if base else None
        print(f"  {p:6} {len(rs):>4} {min(tp):>10,.0f} {statistics.median(tp):>10,.0f} "
              f"{max(tp):>10,.0f} {statistics.median(r.p50_ms for r in rs):>7.3f} "
              f"{statistics.median(r.p99_ms for r in rs):>7.3f} {sum(r.errors for r in rs):>6} "
              f"{statistics.median(c[0] for c in cpu[p]):>9.0f} "
              f"{statistics.median(c[1] for c in cpu[p]):>10.0f} "
              f"{'-' if ratios[p] is None else format(ratios[p], '.2f'):>6} "
              f"{base_us / statistics.median(c[1] for c in cpu[p]) if base_us else 0:>9.2f}")
    print(f"  ({meter.line()})")
    report.notes.append(f"(a): {meter.line()}")
    for p, goal in (("batch", GOAL_BATCH_RATIO), ("always", GOAL_ALWAYS_RATIO)):
        r = ratios.get(p)
        report.goals.append(Goal(f"(a) produce, fsync={p} / off", "-" if r is None else f"{r:.2f}",
                                 f">= {goal}", None if r is None else r >= goal))


# -- (b) restart and (c) memory ----------------------------------------------

async def part_restart(args: argparse.Namespace, root: str, report: Report) -> None:
    n_msgs = args.messages
    data = "m" * args.message_bytes
    where = os.path.join(root, "restart")
    os.makedirs(where, exist_ok=True)
    port = free_port()
    config = os.path.join(where, "node.xml")
    data_dir = os.path.join(where, "data")
    # A small file, written before anything is measured.
    with open(config, "w") as f:  # noqa: ASYNC230
        f.write(node_config(1, port, data_dir, args.restart_fsync, log_size=args.restart_log_size))
    print(f"\n== (b) restart and (c) memory: one node with storage (fsync={args.restart_fsync}, "
          f"log_size {args.restart_log_size or 'default'}) holding {n_msgs:,} messages of "
          f"{args.message_bytes} bytes", flush=True)
    meter = LoadMeter()
    log_path = os.path.join(where, "node.log")
    node = Node("restart-node", config, port, log_path)
    size_req = {"action": 4, "queue": FILL_QUEUE}
    clean: list[float] = []
    killed: list[float] = []
    stops: list[float] = []
    rss_fill: float | None = None
    rss_restart: list[float] = []
    hwm_restart: list[float] = []
    failures: dict[str, str] = {}
    try:
        await wait_answer(node, {"action": 4}, lambda a: a.get("code") == 0, args.timeout)
        print(f"  filling: {args.fill_connections} connections, {args.fill_window} in flight each",
              flush=True)
        srv0, own0 = node.cpu_seconds(), _own_cpu()
        fr = await fill(port, n_msgs, connections=args.fill_connections, window=args.fill_window,
                        data=data, timeout_s=args.fill_timeout)
        srv_us = (node.cpu_seconds() - srv0) / max(fr.ok, 1) * 1e6
        own_us = (_own_cpu() - own0) / max(fr.ok, 1) * 1e6
        print(f"  filled {fr.ok:,} in {fr.seconds:.1f} s: {fr.rate:,.0f} produce/s "
              f"(errors {fr.errors}{', first: ' + fr.first_error if fr.errors else ''}); "
              f"CPU per message: node {srv_us:.0f} us, filler {own_us:.0f} us")
        a = await ask(port, size_req, timeout_s=30)
        size = a.get("size") if a else None
        print(f"  monitor: size {size}")
        if size != n_msgs:
            # Measure what it holds rather than stop: the target is its size.
            print(f"  note: the queue holds {size} messages, not {n_msgs:,}; timing restarts "
                  f"to that size")
        target = size if isinstance(size, int) else n_msgs
        rss_fill = node.status_mb("VmRSS")
        print(f"  settling: {await settle(node, data_dir, args.timeout)}; VmRSS then "
              f"{node.status_mb('VmRSS'):.0f} MB")
        hwm = node.status_mb("VmHWM")
        mb, files = dir_mb(data_dir)
        print(f"  after fill: VmRSS {rss_fill:.0f} MB (peak {hwm:.0f} MB); data directory "
              f"{mb:.0f} MB in {files} files ({dir_listing(data_dir)})", flush=True)

        async def restart(kind: str, i: int) -> Node:
            nonlocal node
            print(f"    before the stop: data directory {dir_listing(data_dir)}", flush=True)
            if kind == "SIGTERM":
                took = await node.stop(signal.SIGTERM)
                if took is None:
                    print(f"  SIGTERM: did not exit in {STOP_GRACE_S:.0f} s, killed")
                else:
                    stops.append(took)
            else:
                node.kill_now()
            node = Node("restart-node", config, port, log_path)
            try:
                first, full, _ = await wait_answer(
                    node, size_req, lambda a: a.get("code") == 0 and a.get("size") == target,
                    args.timeout)
            except DidNotFinish as exc:
                failures[kind] = str(exc)
                print(f"  after {kind} {i + 1}/{args.repeat}: {exc}", flush=True)
                return node
            (clean if kind == "SIGTERM" else killed).append(full)
            rss, peak = node.status_mb("VmRSS"), node.status_mb("VmHWM")
            if rss is not None:
                rss_restart.append(rss)
                hwm_restart.append(peak)
            print(f"  after {kind} {i + 1}/{args.repeat}: first answer at {first:.2f} s, size "
                  f"{target:,} at {full:.2f} s from process start; VmRSS {rss:.0f} MB "
                  f"(peak {peak:.0f} MB)" + (f"; orderly stop took {stops[-1]:.2f} s"
                                             if kind == "SIGTERM" and stops else ""), flush=True)
            print(f"    settling: {await settle(node, data_dir, args.timeout)}", flush=True)
            return node

        for kind in ("SIGTERM", "SIGKILL"):
            for i in range(args.repeat):
                await restart(kind, i)
                if kind in failures:
                    break
        mb, files = dir_mb(data_dir)
        print(f"  data directory at the end: {mb:.0f} MB in {files} files "
              f"({dir_listing(data_dir)})")
    except (DidNotFinish, OSError) as exc:
        failures.setdefault("fill", str(exc))
        print(f"  {exc}")
        print("  " + node.log_tail(3).replace("\n", "\n  "))
    finally:
        await node.stop()
    print(f"  restart after SIGTERM, s (min / median / max): {mmm(clean)}")
    print(f"  restart after SIGKILL, s (min / median / max): {mmm(killed)}")
    print(f"  orderly stop (SIGTERM to exit), s: {mmm(stops)}")
    print(f"  ({meter.line()})")
    report.notes.append(f"(b), (c): {meter.line()}")
    size_note = "" if (n_msgs, args.message_bytes) == (GOAL_MESSAGES, GOAL_MESSAGE_BYTES) else \
        f" [{n_msgs:,} x {args.message_bytes} B; goal is for 1,000,000 x 100 B]"
    for kind, values in (("SIGTERM", clean), ("SIGKILL", killed)):
        if values:
            report.goals.append(Goal(f"(b) restart after {kind}{size_note}",
                                     f"{statistics.median(values):.2f} s (max {max(values):.2f})",
                                     f"< {GOAL_RESTART_S:.0f} s",
                                     statistics.median(values) < GOAL_RESTART_S))
        else:
            why = failures.get(kind) or failures.get("fill") or "not measured"
            report.goals.append(Goal(f"(b) restart after {kind}{size_note}", why,
                                     f"< {GOAL_RESTART_S:.0f} s",
                                     False if kind in failures else None))
    report.goals.append(Goal(f"(c) VmRSS after fill{size_note}",
                             "-" if rss_fill is None else f"{rss_fill:.0f} MB",
                             f"< {GOAL_RSS_MB:.0f} MB",
                             None if rss_fill is None else rss_fill < GOAL_RSS_MB))
    report.goals.append(Goal(f"(c) VmRSS after restart{size_note}",
                             f"{max(rss_restart):.0f} MB (peak {max(hwm_restart):.0f} MB)"
                             if rss_restart else "-",
                             f"< {GOAL_RSS_MB:.0f} MB",
                             max(rss_restart) < GOAL_RSS_MB if rss_restart else None))
    if args.keep:
        report.notes.append(f"restart node kept: {config} (data {data_dir})")


# -- (d) snapshot catch-up ----------------------------------------------------

async def part_catchup(args: argparse.Namespace, root: str, report: Report) -> None:
    n_msgs = args.catchup_messages
    data = "m" * args.message_bytes
    print(f"\n== (d) catch-up: three-node cluster (quorum, storage fsync={args.catchup_fsync}, "
          f"log_size {args.catchup_log_size}), one slave stopped, {n_msgs:,} messages of "
          f"{args.message_bytes} bytes produced, slave started again; a fresh cluster per "
          f"repeat", flush=True)
    meter = LoadMeter()
    from_start: list[float] = []
    from_answer: list[float] = []
    rates: list[float] = []
    failure = ""
    for i in range(args.repeat):
        cl = Cluster(os.path.join(root, f"catchup-{i + 1}"), f"catchup{i + 1}", args.catchup_fsync,
                     log_size=args.catchup_log_size)
        try:
            cl.start_all()
            master = await cl.wait_master(args.timeout)
            slave = next(n for n in cl.client_ports if n != master)
            await cl.nodes[slave].stop()
            fr = await fill(cl.client_ports[master], n_msgs,
                            connections=args.catchup_fill_connections,
                            window=args.catchup_fill_window, data=data,
                            timeout_s=args.fill_timeout)
            _, _, m = await wait_answer(
                cl.nodes[master], {"action": 104, "queue": FILL_QUEUE},
                lambda a: a.get("commit_id") == a.get("trans_id") == a.get("applied_id"),
                args.timeout + (time.perf_counter() - cl.nodes[master].started_at))
            want_t, want_a, want_size = m["trans_id"], m["applied_id"], m.get("size")
            node = cl.start(slave)
            first, done, s = await wait_answer(
                node, {"action": 104, "queue": FILL_QUEUE},
                lambda a, want_t=want_t, want_a=want_a, want_size=want_size: (
                    a.get("trans_id", 0) >= want_t and a.get("applied_id", 0) >= want_a
                    and a.get("size") == want_size), args.timeout)
            held = want_size if isinstance(want_size, int) else n_msgs
            from_start.append(done)
            from_answer.append(done - first)
            rates.append(held / done)
            print(f"  run {i + 1}/{args.repeat}: filled {fr.ok:,} in {fr.seconds:.1f} s "
                  f"({fr.rate:,.0f}/s, errors {fr.errors}"
                  f"{', first: ' + fr.first_error if fr.errors else ''}) with node {slave} "
                  f"down; master "
                  f"trans_id {want_t}, size {want_size}; node {slave} first answered at "
                  f"{first:.2f} s, caught up at {done:.2f} s from its start: "
                  f"{held / done:,.0f} msg/s ({held / max(done - first, 1e-9):,.0f} msg/s "
                  f"from its first answer)", flush=True)
            mb, files = dir_mb(os.path.join(cl.root, f"data{slave}"))
            print(f"    slave's data directory: {mb:.0f} MB in {files} files "
                  f"({dir_listing(os.path.join(cl.root, f'data{slave}'))})")
        except (DidNotFinish, OSError) as exc:
            failure = str(exc) or type(exc).__name__
            print(f"  run {i + 1}/{args.repeat}: {exc}")
            for nid, n in cl.nodes.items():
                tail = n.log_tail(3)
                if tail:
                    print(f"    node {nid} log: " + tail.replace("\n", "\n      "))
        finally:
            await cl.stop_all()
            if not args.keep:
                shutil.rmtree(cl.root, ignore_errors=True)
        if failure:
            break
    print(f"  catch-up, s from the slave's start (min / median / max): {mmm(from_start)}")
    print(f"  catch-up rate, msg/s (min / median / max): {mmm(rates, '{:,.0f}')}")
    print(f"  ({meter.line()})")
    report.notes.append(f"(d): {meter.line()}")
    report.goals.append(Goal(f"(d) catch-up of {n_msgs:,} msgs (log_size {args.catchup_log_size})",
                             f"{statistics.median(rates):,.0f} msg/s, "
                             f"{statistics.median(from_start):.2f} s" if rates else
                             (failure or "not measured"),
                             "(no goal)", None if rates else (False if failure else None)))


# -- main ------------------------------------------------------------------

PARTS = ("throughput", "restart", "catchup")


def _parts(text: str) -> tuple[str, ...]:
    chosen = [x.strip() for x in text.split(",") if x.strip()]
    bad = [x for x in chosen if x not in PARTS]
    if bad or not chosen:
        raise argparse.ArgumentTypeError(f"choose from {','.join(PARTS)}")
    return tuple(p for p in PARTS if p in chosen)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="fsync cost, restart time, memory and catch-up of "
                                            "qserver with storage, in one run")
    p.add_argument("--quick", action="store_true",
                   help="smaller run: " + ", ".join(f"--{k.replace('_', '-')} {v}"
                                                    for k, v in QUICK.items())
                        + " (explicit options win)")
    p.add_argument("--parts", type=_parts, default=PARTS, metavar="LIST",
                   help="comma-separated subset of throughput,restart,catchup (default all)")
    p.add_argument("--messages", type=int, help="messages held by the restart node (1000000)")
    p.add_argument("--message-bytes", type=int, default=100, help="bytes per message (100)")
    p.add_argument("--restart-fsync", choices=("off", "batch", "always"), default="batch")
    p.add_argument("--restart-log-size", type=int, default=None,
                   help="log_size of the restart node (default: qserver's)")
    p.add_argument("--catchup-messages", type=int, help="messages the slave misses (200000)")
    p.add_argument("--catchup-log-size", type=int, default=1000)
    p.add_argument("--catchup-fsync", choices=("off", "batch", "always"), default="batch")
    p.add_argument("--duration", type=float, help="seconds per throughput run (3)")
    p.add_argument("--repeat", type=int, help="runs per throughput policy, restarts per kind, "
                                              "catch-ups (3)")
    p.add_argument("--warmup", type=float, help="seconds of warm-up per cluster (1)")
    p.add_argument("--concurrency", "-c", type=int, default=8, help="closed-loop clients (8)")
    p.add_argument("--timeout", type=float, default=120.0,
                   help="seconds allowed for a master to be agreed on, a restart or a catch-up "
                        "(120)")
    p.add_argument("--fill-timeout", type=float, default=600.0,
                   help="seconds allowed for a fill (600)")
    p.add_argument("--fill-connections", type=int, default=4)
    p.add_argument("--fill-window", type=int, default=2000,
                   help="produces in flight per fill connection (2000)")
    p.add_argument("--catchup-fill-connections", type=int, default=16)
    p.add_argument("--catchup-fill-window", type=int, default=8,
                   help="produces in flight per connection when filling the catch-up cluster (8): "
                        "thousands in flight per event-loop turn can delay the master's "
                        "heartbeats past the election timeout on a loaded machine")
    p.add_argument("--dir", default=None, help="where the temporary data directories go "
                                                "(default: the system's temp dir)")
    p.add_argument("--keep", action="store_true", help="keep the data directories")
    return p


def _fill_defaults(args: argparse.Namespace) -> None:
    full = dict(messages=GOAL_MESSAGES, catchup_messages=200_000, duration=3.0, repeat=3,
                warmup=1.0)
    for k, v in (QUICK if args.quick else full).items():
        if getattr(args, k) is None:
            setattr(args, k, v)


def _fs_type(path: str) -> str:
    best, fstype = "", "?"
    try:
        with open("/proc/mounts") as f:
            for line in f:
                parts = line.split()
                mnt = parts[1]
                inside = path == mnt or path.startswith(mnt.rstrip("/") + "/")
                if inside and len(mnt) >= len(best):
                    best, fstype = mnt, parts[2]
    except OSError:
        pass
    return fstype


async def _run(args: argparse.Namespace, root: str, report: Report) -> Report:
    if "throughput" in args.parts:
        await part_throughput(args, root, report)
    if "restart" in args.parts:
        await part_restart(args, root, report)
    if "catchup" in args.parts:
        await part_catchup(args, root, report)
    return report


def print_summary(report: Report) -> None:
    print("\n== summary")
    if not report.goals:
        print("  no part finished")
        return
    w = max([len(g.name) for g in report.goals] + [4])
    m = max([len(g.measured) for g in report.goals] + [8])
    print(f"  {'what':{w}}  {'measured':{m}}  {'goal':10}  met")
    print("  " + "-" * (w + m + 19))
    for g in report.goals:
        met = "-" if g.met is None else ("yes" if g.met else "NO")
        print(f"  {g.name:{w}}  {g.measured:{m}}  {g.goal:10}  {met}")
    for n in report.notes:
        print(f"  {n}")


def run_in_a_data_dir(args: argparse.Namespace, argv: list[str] | None, prefix: str,
                      run: Callable[[str], Awaitable[object]]) -> tuple[int, float]:
    """The frame of a bench's main() that starts nodes: a fresh directory
    under --dir, the header lines, SIGTERM taken as Ctrl-C, `run(root)` on
    uvloop, then every node started here stopped (also on an error or
    Ctrl-C) and the directory removed unless --keep. Returns the exit
    status and the start time."""
    base = args.dir or tempfile.gettempdir()
    os.makedirs(base, exist_ok=True)
    root = tempfile.mkdtemp(prefix=prefix, dir=base)
    print("$ " + shlex.join([sys.executable, sys.argv[0]]
                            + (sys.argv[1:] if argv is None else argv)))
    head = subprocess.run(["git", "log", "-1", "--format=%h %s"], cwd=REPO_DIR,
                          capture_output=True, text=True).stdout.strip()
    print(f"qserver at {head[:100]}")
    print(f"python {sys.version.split()[0]}, {os.cpu_count()} cpus, load average "
          f"{os.getloadavg()[0]:.2f} at start; data under {root} ({_fs_type(root)})", flush=True)

    def on_term(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)
    rc = 0
    t0 = time.perf_counter()
    try:
        uvloop.run(run(root))
    except KeyboardInterrupt:
        print("\ninterrupted; stopping every node", file=sys.stderr)
        rc = 130
    except Exception as exc:  # a bug here: still stop the nodes and print what was measured
        print(f"\nbench failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        rc = 1
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        for n in _ALL_NODES:
            if n.alive:
                n.kill_now()
        if args.keep:
            print(f"kept {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)
    return rc, t0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    _fill_defaults(args)
    report = Report()
    rc, t0 = run_in_a_data_dir(args, argv, "qserver-durability-",
                               lambda root: _run(args, root, report))
    print_summary(report)
    print(f"\nload average {os.getloadavg()[0]:.2f} at the end; {time.perf_counter() - t0:.0f} s "
          f"in all")
    return rc


if __name__ == "__main__":
    sys.exit(main())
