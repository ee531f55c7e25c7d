"""Throughput where users run it (issue 16), measured in one run: the no-op
floor, one node in memory, one node with storage, three-node clusters, and
queue_server's C++ cluster beside them.

    python bench/cluster_bench.py [--parts floor,single,storage,cluster,floor-cluster]
        [--repeat 3]
        [--seconds 2] [--warmup 0.5] [--protos tcp,udp] [--modes produce,consume_confirm]
        [--concurrency 8] [--reference HOST:PORT,... | --start-reference] [--dir DIR]

Targets (every process is started at the beginning and runs for the whole
bench, so every figure is measured under the same conditions):
- `floor`: bench/noop_server.py, the no-op uvloop+orjson server with
  qserver's framing (run_bench.py's floor).
- `single`: one `qserver run` node in memory (no `<storage>`).
- `storage`: one node with `<storage fsync="off|batch|always">`, three
  nodes, one per policy, each in a directory under --dir (its file system
  is printed: fsync on tmpfs costs nothing).
- `cluster`: three nodes, native engine, `mode="async"` and memory only
  (queue_server's own mode, like for like with the C++ cluster), and three
  nodes, `mode="quorum"` with `<storage fsync="batch">` (qserver's default
  guarantees); each measured sent to its master and sent to a slave
  (forward_request=1: the slave relays to the master).
- `floor-cluster`: the no-op cluster, bench/floor_cluster.py, async and
  quorum, to the master and to a slave: three processes that move
  requests, pushes and acknowledgements between them as qserver's native
  engine does and do nothing else (no store, no disk). What any Python
  cluster built this way can reach on this machine: the cluster goals
  read against it (the ratios "no-op ... / C++" and "... / no-op ...").
- the reference (with --reference or --start-reference): queue_server's
  C++ three-node cluster, asynchronous, memory only, sent to its master
  and to a slave (found with action 8). --start-reference builds it if
  needed and starts it with ../shared/reference/ (build.sh, cluster.sh;
  client ports 21111-21113) and stops it at the end; its queue_size is
  raised (--reference-queue-size) because the C++ server cannot clear a
  queue ("not support") and refuses produces once the queue is full, which
  its default of 100,000 would be within two seconds.

Load: bench/loadgen.py's closed loop (--concurrency clients, one request in
flight each, as queue_server's test/bench_queue.py), for --seconds per
run. For each protocol: the queue "bench" of every qserver target is
cleared, every target is warmed up (--warmup s), then --repeat rounds of
produce runs over all targets (order reversed every other round), then
--repeat rounds of consume_confirm runs (consume, confirm of the delivered
msg_id, consume, ...: each counts as one request), which consume what the
produce runs left. A qserver queue is topped up (pipelined, not measured)
before a consume run if it could run dry; a run that did find it empty
says so. The C++ server answers TCP requests with bare JSON objects and no
newline, so its TCP runs use loadgen's client with a framing that splits
answers at their closing brace (its answers are flat objects); everything
else (requests, timing, latency) is loadgen's.

Printed: every run; then per protocol, mode and target the min/median/max
requests/s over the runs, the median p50 and p99 latency, the errors, the
median server CPU per request (user+system from /proc/PID/stat, summed over
the target's node processes: three for a cluster, whichever node the
requests were sent to), the generator's CPU per request, and the median
throughput as a fraction of the floor's; then every ratio of the issue's
goal list (medians of the same run), with the goal and whether it is met,
for produce and beside it for consume+confirm (point 4), and the CPU that
other processes on the machine used meanwhile (the load generator and every
node share the machine's cores).

Every process started here is stopped at the end, also on Ctrl-C, SIGTERM
or an error. The default run (all parts, the reference, 3 repeats) takes
about 7 minutes on the 2-core development machine.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import glob
import os
import re
import shlex
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

import orjson
import uvloop

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
REPO_DIR = os.path.dirname(BENCH_DIR)
sys.path.insert(0, BENCH_DIR)
import durability_bench as dur  # noqa: E402  (this directory, script or not)
import loadgen  # noqa: E402
from loadgen import CONSUME_QUEUE, LoadResult  # noqa: E402
from run_bench import PREFILL_MARGIN, Cell, ServerProcess, free_port  # noqa: E402

PARTS = ("floor", "single", "storage", "cluster", "floor-cluster")
PROTOS = loadgen.PROTOS
MODES = ("produce", "consume_confirm")
FSYNC_POLICIES = dur.FSYNC_POLICIES  # off, batch, always

DEFAULT_REFERENCE_DIR = os.path.normpath(os.path.join(REPO_DIR, "..", "shared", "reference"))
# The C++ cluster as cluster.sh starts it: client ports (TCP and UDP).
REFERENCE_PORTS = (21111, 21112, 21113)
REFERENCE_INTERNAL_PORTS = (21101, 21102, 21103)
# The C++ server cannot clear a queue and refuses produces beyond queue_size:
# room for every produce of a default run (about 60,000/s x 2 s x 6 runs x 2
# protocols, plus warm-ups), about 100 bytes each per node.
REFERENCE_QUEUE_SIZE = 4_000_000

# Goals of issue 16 (ratios of medians measured in the same run).
GOAL_STORAGE = 0.7  # one node, fsync=batch / the same node in memory
GOAL_ASYNC = 1.0  # async cluster / C++ cluster
GOAL_QUORUM = 0.7  # quorum cluster, fsync=batch / C++ (async) cluster
GOAL_QUORUM_P99_MS = 2.0

START_TIMEOUT_S = 60.0
# Top-ups keep only this many produces in flight on their one connection: a
# thousand at once made a loaded cluster's master miss heartbeats
# (durability_bench's catch-up fill says the same).
TOP_UP_BATCH = 200
# A consume run with no rate measured yet for its target assumes this many
# consume+confirm requests per second when sizing the top-up.
TOP_UP_GUESS_RATE = 50_000.0

_CLK_TCK = os.sysconf("SC_CLK_TCK")


# -- targets -----------------------------------------------------------------

def pid_cpu_seconds(pid: int) -> float | None:
    """user+system CPU of a process (all its threads) so far; None if gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / _CLK_TCK
    except (OSError, IndexError, ValueError):
        return None


def listening_pids(ports: list[int]) -> list[int]:
    """The processes that listen on these local TCP ports (from /proc/net and
    every process's fds; those of other users only when run as root)."""
    inodes: set[str] = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                next(f)
                for line in f:
                    cols = line.split()
                    if cols[3] == "0A" and int(cols[1].rsplit(":", 1)[1], 16) in ports:
                        inodes.add(cols[9])
        except (OSError, StopIteration):
            pass
    pids: set[int] = set()
    for fd in glob.glob("/proc/[0-9]*/fd/*"):
        try:
            link = os.readlink(fd)
        except OSError:
            continue
        if link.startswith("socket:[") and link[8:-1] in inodes:
            pids.add(int(fd.split("/")[2]))
    return sorted(pids)


@dataclass
class Target:
    """Somewhere the load generator sends requests, and the processes whose
    CPU those requests cost."""

    name: str  # as printed, e.g. "quorum->slave"
    kind: str  # "noop", "qserver" or "reference"
    port: int
    pids: list[int]
    host: str = "127.0.0.1"
    admin_port: int = 0  # where the queue is cleared, topped up, sized: the master
    alive: object = None  # () -> str | None: why a process of the target is gone

    def cpu_seconds(self) -> float | None:
        total = 0.0
        for pid in self.pids:
            s = pid_cpu_seconds(pid)
            if s is None:
                return None
            total += s
        return total if self.pids else None


def single_config(port: int, data_dir: str, fsync: str | None) -> str:
    """durability_bench's node config; without `<storage>` for fsync None."""
    text = dur.node_config(1, port, data_dir, fsync or "off")
    return text if fsync else re.sub(r"  <storage [^\n]*\n", "", text)


def write_file(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


def read_file(path: str) -> str:
    with open(path) as f:
        return f.read()


def _node_gone(nodes: list[dur.Node]):
    def check() -> str | None:
        for n in nodes:
            if not n.alive:
                return f"{n.name} exited with {n.proc.returncode}: {n.log_tail(3)}"
        return None
    return check


async def start_single(root: str, name: str, fsync: str | None) -> Target:
    port = free_port()
    path = os.path.join(root, f"{name}.xml")
    write_file(path, single_config(port, os.path.join(root, f"{name}-data"), fsync))
    node = dur.Node(name, path, port, os.path.join(root, f"{name}.log"))
    await dur.wait_answer(node, {"action": 104}, lambda a: a.get("code") == 0, START_TIMEOUT_S)
    return Target(name, "qserver", port, [node.proc.pid], admin_port=port,
                  alive=_node_gone([node]))


async def start_cluster(root: str, name: str, mode: str) -> list[Target]:
    """Three native nodes: `async` in memory, or `quorum` with fsync=batch.
    Returns the targets "NAME->master" and "NAME->slave"."""
    c = dur.Cluster(os.path.join(root, name), name, "batch")
    for path in c.configs.values():
        text = read_file(path)
        if mode == "async":
            text = re.sub(r"  <storage [^\n]*\n", "", text.replace('mode="quorum"', 'mode="async"'))
        write_file(path, text)
    c.start_all()
    master = await c.wait_master(START_TIMEOUT_S)
    slave = min(i for i in c.client_ports if i != master)
    pids = [n.proc.pid for n in c.nodes.values()]
    gone = _node_gone(list(c.nodes.values()))
    return [Target(f"{name}->{role}", "qserver", c.client_ports[i], pids,
                   admin_port=c.client_ports[master], alive=gone)
            for role, i in (("master", master), ("slave", slave))]


def start_floor_cluster(root: str, mode: str) -> list[Target]:
    """Three bench/floor_cluster.py processes (`mode` async or quorum): the
    no-op cluster. Returns the targets "floor-MODE->master" and
    "floor-MODE->slave"."""
    script = os.path.join(BENCH_DIR, "floor_cluster.py")
    internal = free_port()
    master = ServerProcess(
        f"floor-{mode} master",
        [sys.executable, script, "--role", "master", "--mode", mode, "--port", str(free_port()),
         "--internal-port", str(internal)],
        os.path.join(root, f"floor-{mode}-1.log"))
    _FLOORS.append(master)
    slaves = []
    for i in (2, 3):
        s = ServerProcess(
            f"floor-{mode} slave", [sys.executable, script, "--role", "slave", "--port",
                                    str(free_port()), "--master", f"127.0.0.1:{internal}"],
            os.path.join(root, f"floor-{mode}-{i}.log"))
        _FLOORS.append(s)
        slaves.append(s)
    for s in (*slaves, master):  # the master is ready once both slaves are linked
        s.wait_ready()
    procs = [master, *slaves]
    pids = [s.proc.pid for s in procs]

    def gone() -> str | None:
        for s in procs:
            if s.proc.poll() is not None:
                return f"{s.name} exited with {s.proc.returncode}"
        return None
    return [Target(f"floor-{mode}->{role}", "noop", s.port, pids, host=s.host, alive=gone)
            for role, s in (("master", master), ("slave", slaves[0]))]


def start_floor(root: str) -> tuple[Target, ServerProcess]:
    argv = [sys.executable, os.path.join(BENCH_DIR, "noop_server.py"), "--port", str(free_port())]
    s = ServerProcess("floor", argv, os.path.join(root, "floor.log"))
    s.wait_ready()

    def gone() -> str | None:
        return None if s.proc.poll() is None else f"floor exited with {s.proc.returncode}"
    return Target("floor", "noop", s.port, [s.proc.pid], host=s.host, alive=gone), s


# -- the C++ reference --------------------------------------------------------

def udp_request(host: str, port: int, request: dict, timeout_s: float = 1.0) -> dict | None:
    """One request to a queue_server over UDP (its TCP answers carry no
    newline, so the bench's TCP helpers do not fit); None without an answer."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.settimeout(timeout_s)
        try:
            s.sendto(orjson.dumps(request), (host, port))
            return orjson.loads(s.recvfrom(65536)[0])
        except (OSError, orjson.JSONDecodeError):
            return None


def reference_targets(addresses: list[tuple[str, int]]) -> list[Target]:
    """"c++->master" and "c++->slave" from the addresses of a running C++
    cluster: the master is the address action 8 names as leader."""
    leader = None
    for host, port in addresses:
        a = udp_request(host, port, {"action": 8})
        if a and a.get("leader_port"):
            leader = (a.get("leader_host") or host, int(a["leader_port"]))
            break
    if leader is None:
        raise RuntimeError(f"no reference node at {addresses} named a leader (action 8)")
    master = next(((h, p) for h, p in addresses if p == leader[1]), leader)
    slaves = [(h, p) for h, p in addresses if (h, p) != master]
    pids = listening_pids([p for _, p in addresses])
    a = udp_request(master[0], master[1], {"action": 4, "queue": CONSUME_QUEUE}) or {}
    print(f"reference: master {master[0]}:{master[1]}, slaves "
          f"{', '.join(f'{h}:{p}' for h, p in slaves) or 'none'}; processes "
          f"{pids or 'not found (their CPU is not measured)'}; queue {CONSUME_QUEUE!r} holds "
          f"{a.get('size', '?')} messages (the C++ server refuses produces beyond its "
          f"queue_size)", flush=True)

    def gone() -> str | None:
        dead = [p for p in pids if pid_cpu_seconds(p) is None]
        return f"reference process {dead} exited" if dead else None
    out = [Target("c++->master", "reference", master[1], pids, host=master[0], alive=gone)]
    if slaves:
        out.append(Target("c++->slave", "reference", slaves[0][1], pids, host=slaves[0][0],
                          alive=gone))
    return out


class Reference:
    """queue_server's C++ cluster through ../shared/reference/cluster.sh."""

    def __init__(self, ref_dir: str, run_dir: str, queue_size: int) -> None:
        self.ref_dir = ref_dir
        self.env = dict(os.environ, QS_RUN=run_dir, QUEUE_SIZE=str(queue_size))
        self.started = False

    def _sh(self, script: str, *args: str, timeout_s: float) -> subprocess.CompletedProcess:
        return subprocess.run(["bash", os.path.join(self.ref_dir, script), *args], env=self.env,
                              capture_output=True, text=True, timeout=timeout_s)

    def start(self) -> list[tuple[str, int]]:
        busy = [p for p in REFERENCE_PORTS + REFERENCE_INTERNAL_PORTS if not _port_free(p)]
        if busy:
            raise RuntimeError(f"ports {busy} are in use (another C++ cluster? then pass "
                               f"--reference 127.0.0.1:21111,127.0.0.1:21112,127.0.0.1:21113)")
        binary = self.env.get("QS_BIN", "/tmp/qs_src/queue_server/queue_server.bin")
        if not os.access(binary, os.X_OK):
            print(f"reference: building {binary} with {self.ref_dir}/build.sh (a minute or "
                  f"two)", flush=True)
            r = self._sh("build.sh", os.path.dirname(os.path.dirname(binary)), timeout_s=1800)
            if r.returncode != 0:
                raise RuntimeError(f"build.sh failed: {(r.stdout + r.stderr)[-800:]}")
        self.started = True
        r = self._sh("cluster.sh", "start", timeout_s=300)
        out = (r.stdout + r.stderr).strip()
        print("reference: cluster.sh start: " + out.replace("\n", "; "), flush=True)
        if r.returncode != 0:
            raise RuntimeError("cluster.sh start failed")
        return [("127.0.0.1", p) for p in REFERENCE_PORTS]

    def stop(self) -> None:
        if self.started:
            r = self._sh("cluster.sh", "stop", timeout_s=60)
            print("reference: " + (r.stdout + r.stderr).strip().replace("\n", "; "))
            self.started = False


def _port_free(port: int) -> bool:
    """Nothing listens on the port (connections in TIME_WAIT do not count:
    the C++ server binds with SO_REUSEADDR too)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


class _BareJsonTcpClient(loadgen._TcpClient):
    """loadgen's TCP client for a server that writes bare JSON objects, no
    newline (queue_server): an answer ends at its closing brace. Its answers
    to produce, consume and confirm are flat objects whose strings (the
    bench's data is 'x' * 40) hold no brace."""

    def data_received(self, data: bytes) -> None:
        if self.buf:
            data = self.buf + data
            self.buf = b""
        if data[-1] == 125 and data.count(b"}") == 1:  # one whole answer: the usual read
            self._answered(data)
            return
        *objects, self.buf = data.split(b"}")
        for obj in objects:
            obj = obj.strip()
            if obj:
                self._answered(obj + b"}")
        self.buf = self.buf.strip()


@contextlib.contextmanager
def bare_json_tcp(on: bool):
    """Make loadgen's run_load use _BareJsonTcpClient for TCP while active."""
    saved = loadgen._TcpClient
    if on:
        loadgen._TcpClient = _BareJsonTcpClient
    try:
        yield
    finally:
        loadgen._TcpClient = saved


# -- measuring ------------------------------------------------------------------

@dataclass
class Bench:
    args: argparse.Namespace
    targets: list[Target]
    cells: dict = field(default_factory=dict)  # (proto, mode, target name) -> Cell
    # CPU of the other targets' processes during the last run, in cores:
    # background work of idle targets (snapshot writers, timers) that the
    # measured target shares the machine with
    idle_cores: float = 0.0

    def cell(self, proto: str, mode: str, name: str) -> Cell:
        return self.cells.setdefault((proto, mode, name), Cell())

    def check_alive(self) -> None:
        for t in self.targets:
            why = t.alive() if t.alive else None
            if why:
                raise RuntimeError(why)

    async def run(self, t: Target, proto: str, mode: str, seconds: float,
                  record: bool) -> LoadResult:
        self.check_alive()
        gc.collect()  # not during the measurement
        others = sorted({pid for o in self.targets for pid in o.pids} - set(t.pids))
        idle0 = sum(pid_cpu_seconds(p) or 0.0 for p in others)
        cpu0, gen0 = t.cpu_seconds(), time.process_time()
        with bare_json_tcp(t.kind == "reference"):
            res = await loadgen.run_load(t.host, t.port, proto=proto, mode=mode,
                                         concurrency=self.args.concurrency, duration=seconds)
        gen = time.process_time() - gen0
        cpu1 = t.cpu_seconds()
        self.idle_cores = (sum(pid_cpu_seconds(p) or 0.0 for p in others) - idle0) / max(
            res.elapsed_s, 1e-9)
        if record and res.requests:
            cell = self.cell(proto, mode, t.name)
            cell.results.append(res)
            if cpu0 is not None and cpu1 is not None:
                cell.server_us.append((cpu1 - cpu0) / res.requests * 1e6)
            cell.gen_us.append(gen / res.requests * 1e6)
        return res

    async def prepare_consume(self, t: Target, proto: str) -> None:
        """Enough messages in a qserver target's queue for a consume run."""
        if t.kind != "qserver":
            return
        rates = [r.throughput for (p, m, n), c in self.cells.items()
                 if n == t.name and m == "consume_confirm" for r in c.results]
        rate = max(rates) if rates else TOP_UP_GUESS_RATE
        need = int(rate / 2 * self.args.seconds * PREFILL_MARGIN) + 1000
        have = await loadgen.queue_size(t.host, t.admin_port, CONSUME_QUEUE) or 0
        if have < need:
            await loadgen.prefill(t.host, t.admin_port, need - have, batch=TOP_UP_BATCH,
                                  timeout_s=120.0)

    async def clear(self) -> None:
        """Empty the queue of every qserver target (the C++ server cannot)."""
        for port in sorted({t.admin_port for t in self.targets if t.kind == "qserver"}):
            a = await dur.ask(port, {"action": 6, "queue": CONSUME_QUEUE}, timeout_s=60.0)
            if a is None or a.get("code") != 0:
                raise RuntimeError(f"clear of {CONSUME_QUEUE!r} on port {port}: {a}")

    async def measure(self) -> None:
        args = self.args
        for proto in args.protos:
            await self.clear()
            for mode in args.modes:
                if args.warmup > 0:
                    for t in self.targets:
                        if mode == "consume_confirm":
                            await self.prepare_consume(t, proto)
                        await self.run(t, proto, mode, args.warmup, record=False)
                    print(f"{proto} {mode}: warmed up, {args.warmup} s per target", flush=True)
                for i in range(args.repeat):
                    order = self.targets if i % 2 == 0 else self.targets[::-1]
                    for t in order:
                        if mode == "consume_confirm":
                            await self.prepare_consume(t, proto)
                        res = await self.run(t, proto, mode, args.seconds, record=True)
                        cell = self.cell(proto, mode, t.name)
                        srv = f"{cell.server_us[-1]:6.1f}" if cell.server_us and \
                            len(cell.server_us) == len(cell.results) else "     -"
                        empty = f" EMPTY {res.empty}" if res.empty else ""
                        print(f"  {proto} {mode:15} {t.name:20} run {i + 1}/{args.repeat}: "
                              f"{res.throughput:9,.0f} req/s p50 {res.p50_ms:6.3f} p99 "
                              f"{res.p99_ms:6.3f} ms errors {res.errors} srv {srv} us "
                              f"gen {cell.gen_us[-1] if cell.gen_us else 0:5.1f} us "
                              f"idle targets {self.idle_cores:4.2f} cores{empty}",
                              flush=True)


# -- report -----------------------------------------------------------------------

def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def print_table(bench: Bench) -> None:
    args = bench.args
    header = (f"{'proto':5} {'mode':15} {'target':20} {'runs':>4} {'min req/s':>10} "
              f"{'median':>10} {'max':>10} {'p50 ms':>7} {'p99 ms':>7} {'errors':>6} "
              f"{'srv us':>7} {'gen us':>7} {'x floor':>7}")
    print(header)
    print("-" * len(header))
    for proto in args.protos:
        for mode in args.modes:
            floor = bench.cells.get((proto, mode, "floor"))
            floor_tp = floor.median_throughput() if floor else 0.0
            for t in bench.targets:
                cell = bench.cells.get((proto, mode, t.name))
                if not cell or not cell.results:
                    continue
                rs, tp = cell.results, cell.throughputs
                ratio = f"{cell.median_throughput() / floor_tp:.2f}" if floor_tp else "-"
                srv = _median(cell.server_us)
                gen = _median(cell.gen_us)
                empty = sum(r.empty for r in rs)
                note = f"  (queue ran dry: {empty} empty consumes)" if empty and \
                    t.kind != "noop" else ""
                print(f"{proto:5} {mode:15} {t.name:20} {len(rs):>4} {min(tp):>10,.0f} "
                      f"{statistics.median(tp):>10,.0f} {max(tp):>10,.0f} "
                      f"{statistics.median(r.p50_ms for r in rs):>7.3f} "
                      f"{statistics.median(r.p99_ms for r in rs):>7.3f} "
                      f"{sum(r.errors for r in rs):>6} "
                      f"{'-' if srv is None else f'{srv:.1f}':>7} "
                      f"{'-' if gen is None else f'{gen:.1f}':>7} {ratio:>7}{note}")
        print()


# (label, numerator target, denominator target, goal or None, p99 goal for the numerator)
RATIOS = (
    ("1. one node, fsync=batch / in memory", "storage-batch", "single", GOAL_STORAGE, None),
    ("   one node, fsync=always / in memory", "storage-always", "single", None, None),
    ("   one node, fsync=off / in memory", "storage-off", "single", None, None),
    ("   one node in memory / floor", "single", "floor", None, None),
    ("2. async cluster / C++, to the master", "async->master", "c++->master", GOAL_ASYNC, None),
    ("   async cluster / C++, to a slave", "async->slave", "c++->slave", GOAL_ASYNC, None),
    ("3. quorum batch / C++ async, to the master", "quorum->master", "c++->master", GOAL_QUORUM,
     GOAL_QUORUM_P99_MS),
    ("   quorum batch / C++ async, to a slave", "quorum->slave", "c++->slave", GOAL_QUORUM,
     GOAL_QUORUM_P99_MS),
    # The no-op cluster (floor-cluster): what any Python cluster built this
    # way can reach here, against C++ and against qserver's own.
    ("   no-op async cluster / C++, to the master", "floor-async->master", "c++->master",
     None, None),
    ("   no-op async cluster / C++, to a slave", "floor-async->slave", "c++->slave", None, None),
    ("   no-op quorum cluster / C++ async, to the master", "floor-quorum->master",
     "c++->master", None, None),
    ("   no-op quorum cluster / C++ async, to a slave", "floor-quorum->slave", "c++->slave",
     None, None),
    ("   async cluster / no-op async cluster, to the master", "async->master",
     "floor-async->master", None, None),
    ("   async cluster / no-op async cluster, to a slave", "async->slave", "floor-async->slave",
     None, None),
    ("   quorum batch / no-op quorum cluster, to the master", "quorum->master",
     "floor-quorum->master", None, None),
    ("   quorum batch / no-op quorum cluster, to a slave", "quorum->slave",
     "floor-quorum->slave", None, None),
)


def print_ratios(bench: Bench) -> None:
    """Every ratio of the issue's goal list: produce (with the goal) and,
    beside it, consume+confirm (point 4: reported, no goal)."""
    args = bench.args
    cols = [(p, m) for m in args.modes for p in args.protos]
    w = max(len(r[0]) for r in RATIOS)
    print(f"{'ratio of medians (same run)':{w}} "
          + " ".join(f"{(m if m == 'produce' else 'cons+conf') + ' ' + p:>15}" for p, m in cols)
          + "  goal (produce)")
    print("-" * (w + 16 * len(cols) + 16))
    verdicts = []
    for label, num, den, goal, p99_goal in RATIOS:
        cells = []
        met = []
        for p, m in cols:
            a, b = bench.cells.get((p, m, num)), bench.cells.get((p, m, den))
            if not (a and a.results and b and b.results and b.median_throughput()):
                cells.append("-")
                continue
            r = a.median_throughput() / b.median_throughput()
            cells.append(f"{r:.2f}")
            if m == "produce" and goal is not None:
                ok = r >= goal
                if p99_goal is not None:
                    p99 = statistics.median(x.p99_ms for x in a.results)
                    ok = ok and p99 < p99_goal
                met.append((p, ok))
        goal_text = ""
        if goal is not None:
            goal_text = f">= {goal:.1f}" + (f", p99 < {p99_goal:g} ms" if p99_goal else "")
            if met:
                bad = [p for p, ok in met if not ok]
                goal_text += ": met" if not bad else f": NOT met ({', '.join(bad)})"
                verdicts.append(not bad)
            else:
                goal_text += ": not measured"
        print(f"{label:{w}} " + " ".join(f"{c:>15}" for c in cells) + f"  {goal_text}")
    if verdicts:
        print(f"goals met: {sum(verdicts)} of {len(verdicts)} measured")


# -- main ------------------------------------------------------------------------

def _choices(allowed: tuple[str, ...]):
    def parse(text: str) -> tuple[str, ...]:
        chosen = tuple(x.strip() for x in text.split(",") if x.strip())
        bad = [x for x in chosen if x not in allowed]
        if bad or not chosen:
            raise argparse.ArgumentTypeError(f"choose from {','.join(allowed)}")
        return tuple(x for x in allowed if x in chosen)  # in the bench's order
    return parse


def _addresses(text: str) -> list[tuple[str, int]]:
    out = []
    for part in text.split(","):
        host, _, port = part.strip().rpartition(":")
        if not host or not port.isdigit():
            raise argparse.ArgumentTypeError(f"{part!r} is not HOST:PORT")
        out.append((host, int(port)))
    return out


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--parts", type=_choices(PARTS), default=PARTS, metavar="LIST",
                   help=f"comma-separated subset of {','.join(PARTS)} (default all)")
    p.add_argument("--protos", type=_choices(PROTOS), default=PROTOS, metavar="LIST",
                   help="comma-separated subset of tcp,udp (default both)")
    p.add_argument("--modes", type=_choices(MODES), default=MODES, metavar="LIST",
                   help="comma-separated subset of produce,consume_confirm (default both)")
    p.add_argument("--seconds", type=float, default=2.0, help="seconds per measurement (2)")
    p.add_argument("--warmup", type=float, default=0.5,
                   help="seconds of warm-up per target, protocol and mode (0.5)")
    p.add_argument("--repeat", type=int, default=3, help="runs per target, protocol and mode (3)")
    p.add_argument("--concurrency", "-c", type=int, default=8, help="closed-loop clients (8)")
    ref = p.add_mutually_exclusive_group()
    ref.add_argument("--reference", type=_addresses, metavar="HOST:PORT,...",
                     help="a running queue_server C++ cluster's client addresses")
    ref.add_argument("--start-reference", action="store_true",
                     help="build (if needed), start and at the end stop the C++ cluster with "
                          "--reference-dir's scripts (ports 21111-21113 and 21101-21103)")
    p.add_argument("--reference-dir", default=DEFAULT_REFERENCE_DIR,
                   help=f"build.sh and cluster.sh (default {DEFAULT_REFERENCE_DIR})")
    p.add_argument("--reference-queue-size", type=int, default=REFERENCE_QUEUE_SIZE,
                   help=f"queue_size of a started C++ cluster ({REFERENCE_QUEUE_SIZE:,})")
    p.add_argument("--dir", help="where the nodes' data directories go (default: system temp)")
    return p


async def _run(args: argparse.Namespace, root: str, reference: Reference | None,
               bench: Bench) -> None:
    targets = bench.targets
    if "floor" in args.parts:
        t, proc = start_floor(root)
        _FLOORS.append(proc)
        targets.append(t)
    starting = []
    if "single" in args.parts:
        starting.append(start_single(root, "single", None))
    if "storage" in args.parts:
        starting += [start_single(root, f"storage-{f}", f) for f in FSYNC_POLICIES]
    singles = await asyncio.gather(*starting)
    targets += singles
    if "cluster" in args.parts:
        for mode in ("async", "quorum"):
            targets += await start_cluster(root, mode, mode)
    if "floor-cluster" in args.parts:
        for mode in ("async", "quorum"):
            targets += await asyncio.to_thread(start_floor_cluster, root, mode)
    addresses = args.reference
    if reference is not None:
        addresses = await asyncio.to_thread(reference.start)
    if addresses:
        targets += await asyncio.to_thread(reference_targets, addresses)
    print("targets: " + ", ".join(f"{t.name} (:{t.port}, pids {t.pids})" for t in targets),
          flush=True)
    meter = dur.LoadMeter()
    busy0 = meter._busy()
    ours0 = _ours_cpu(targets)
    t0 = time.perf_counter()
    await bench.measure()
    dt = time.perf_counter() - t0
    other = max(meter._busy() - busy0 - (_ours_cpu(targets) - ours0), 0.0) / dt
    print(f"\nmeasured in {dt:.0f} s; load average {meter.load0:.2f} -> "
          f"{os.getloadavg()[0]:.2f}; CPU used by processes other than this bench and its "
          f"targets meanwhile: {other:.2f} of {os.cpu_count()} cores\n")


def _ours_cpu(targets: list[Target]) -> float:
    """CPU of this process and of every target's processes (each counted once)."""
    pids = {pid for t in targets for pid in t.pids}
    own = time.process_time()
    return own + sum(pid_cpu_seconds(p) or 0.0 for p in pids)


_FLOORS: list[ServerProcess] = []


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    base = args.dir or tempfile.gettempdir()
    os.makedirs(base, exist_ok=True)
    root = tempfile.mkdtemp(prefix="qserver-cluster-bench-", dir=base)
    print("$ " + shlex.join([sys.executable, sys.argv[0]]
                            + (sys.argv[1:] if argv is None else argv)))
    head = subprocess.run(["git", "log", "-1", "--format=%h %s"], cwd=REPO_DIR,
                          capture_output=True, text=True).stdout.strip()
    print(f"qserver at {head[:100]}")
    # what the nodes run: the hot path compiled or as Python (qserver/compiled.py)
    modules = subprocess.run([sys.executable, "-m", "qserver.hotbuild", "status"], cwd=REPO_DIR,
                             capture_output=True, text=True).stdout.strip()
    print(f"qserver's modules: {modules}")
    print(f"python {sys.version.split()[0]}, {os.cpu_count()} cpus shared by the generator and "
          f"every node, load average {os.getloadavg()[0]:.2f} at start; {args.concurrency} "
          f"closed-loop clients, {args.seconds} s per run, {args.repeat} runs per target, "
          f"protocol and mode; data under {root} ({dur._fs_type(root)})", flush=True)

    def on_term(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)
    reference = None
    if args.start_reference:
        reference = Reference(args.reference_dir, os.path.join(root, "reference"),
                              args.reference_queue_size)
    rc = 0
    bench = Bench(args, [])  # filled as targets start; what was measured is printed
    t0 = time.perf_counter()
    try:
        uvloop.run(_run(args, root, reference, bench))
    except KeyboardInterrupt:
        print("\ninterrupted; stopping every process", file=sys.stderr)
        rc = 130
    except Exception as exc:
        print(f"\nbench failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        rc = 1
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        for n in dur._ALL_NODES:
            if n.alive:
                n.kill_now()
        for s in _FLOORS:
            s.stop()
        if reference is not None:
            reference.stop()
        shutil.rmtree(root, ignore_errors=True)
    if bench.cells:
        print_table(bench)
        print_ratios(bench)
    print(f"\nload average {os.getloadavg()[0]:.2f} at the end; {time.perf_counter() - t0:.0f} s "
          f"in all")
    return rc


if __name__ == "__main__":
    sys.exit(main())
