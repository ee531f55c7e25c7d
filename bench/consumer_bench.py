"""The consumer side of issue 14, measured in one run: batch consume against
single consumes, and parked long polls (idle cost, wake-up latency) beside
plain produce throughput.

    python bench/consumer_bench.py [--parts drain,longpoll] [--targets node,cluster] [--repeat 3]
        [--messages 100000] [--cluster-messages 20000] [--count 100] [--clients 8]
        [--engine native] [--waiters 2000] [--connections 2000] [--wait 600]
        [--idle 5] [--produces 1000] [--duration 3] [--dir DIR]

The machine the figures come from has 2 cores, shared by this generator and
the node(s) it measures (and whatever else runs there: the load average and
the CPU other processes used are printed for each part). The generator is
built to be cheap: uvloop, asyncio Protocol callbacks (no coroutine per
request), request bytes made by concatenation, orjson for answers.

Part `drain`: messages per second drained from a pre-filled queue
- Targets, both started at the beginning and measured in the same run: one
  node in memory (no storage: the single-node engine, which commits at
  once), and a three-node cluster in quorum mode with storage, fsync=batch
  (bench/durability_bench.py's cluster; `--engine` native or raft).
- Each run produces `--messages` (node) or `--cluster-messages` (cluster)
  messages of 40 bytes into a fresh queue (pipelined over TCP, not
  measured; the queue's size is then read back with monitor, so an
  "outcome unknown" produce that did store its message is counted too),
  then `--clients` closed-loop TCP clients drain it, each with one request
  in flight, until each one is answered empty. Messages/s = messages
  delivered / time from the first request to the last answer.
- Variants, in alternating order per repeat:
  at-most-once (retry=0): `single` (consume, consume, ...) against `batch`
  (consume count=`--count`, ...);
  at-least-once (retry=300, ttl a week: every delivery has a receipt and
  none comes back during the run), every message confirmed with its
  receipt (action 3 with `receipt`, answered code 0 and found=true):
  `single` (consume, confirm, consume, ...), `batch+pipe` (consume
  count=N, then the N confirms in one write, their N answers, the next
  consume) and `batch+seq` (consume count=N, then the N confirms one after
  another, each waiting for its answer).
- Printed per run and as min/median/max over `--repeat` runs, with the
  ratio of each batch median to the single median of the same target and
  delivery (same run), the nodes' CPU per message delivered (the sum over
  the three nodes for the cluster), the generator's, and the CPU other
  processes on the machine used meanwhile. A run that delivered a
  different number of messages than the queue held, or got an error
  answer, says so. `--targets` picks node, cluster or both.

Part `longpoll`: parked consumes on one node (in memory, <limits max_wait=3600>)
- Per repeat, on the same node:
  1. idle reference: the node's CPU over `--idle` s with no clients;
  2. produce baseline: bench/loadgen.py's closed loop (`--clients` TCP
     clients, produce into "bench", `--duration` s), as run_bench.py runs it;
  3. `--waiters` consumes with wait=`--wait` on queue "lp", over
     `--connections` TCP connections (2,000 by default: one parked consume
     per connection; fewer connections pipeline several each, every one a
     separate request the node parks), until monitor reports them all
     waiting;
  4. the node's CPU over `--idle` s while they wait (utime+stime from
     /proc/PID/stat, as a percentage of one core) and its wake-ups
     (voluntary and involuntary context switches of all its threads):
     both must be about zero: a parked consume costs nothing. Also its
     RSS before and after parking;
  5. `--produces` produces into "lp", one at a time: each wakes the
     oldest parked consume; the time from writing the produce to that
     consumer's answer arriving is the wake latency (p50/p99/max), and the
     produce's own answer time in the same loop is printed beside it. The
     woken consumer parks a new consume at once, so `--waiters` stay
     parked throughout;
  6. idle CPU again, still parked (anything the wakes left running shows);
  7. the produce baseline again, while the waiters are parked (into
     "bench": it wakes none of them);
  8. every waiter's connection closed; the time until monitor reports
     none waiting;
  9. idle CPU without clients again, and the produce baseline once more.
  The produce ratio printed is step 7 over the mean of steps 2 and 9 (a
  baseline on both sides in time, as the machine's other load drifts),
  in requests/s and in the node's CPU per request (steadier on a shared
  machine). Each produce run follows an idle window of the same length:
  after a rest the scheduler favours a process over the machine's other
  load for a while, which made the first of them look faster. The produce
  runs' messages stay (ttl 300 s), so the node's RSS grows from round to
  round; what parking adds is printed.
  A warm-up (a short produce run, 100 waiters woken once) comes first.

Every process started here is killed at the end, also on Ctrl-C or error.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import glob
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
from dataclasses import dataclass, field

import orjson

try:
    import uvloop
except ImportError:  # plain asyncio then; the figures say which
    uvloop = None

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
REPO_DIR = os.path.dirname(BENCH_DIR)
sys.path.insert(0, BENCH_DIR)
import durability_bench as dur  # noqa: E402  (this directory, script or not)
import loadgen  # noqa: E402
from run_bench import free_port  # noqa: E402

# Large enough never to refuse a produce of the bench.
BENCH_QUEUE_SIZE = 100_000_000
DATA = loadgen.DEFAULT_DATA  # 40 bytes, as the other benches
TTL_S = 7 * 86400  # no message of the bench expires
# At-least-once retry: far beyond a run, so no delivery comes back during it.
ALO_RETRY_S = 300
# The longest long poll the long-poll node allows (the config's maximum).
MAX_WAIT_S = 3600

DRAIN_TIMEOUT_S = 300.0
FILL_CONNECTIONS = 8
# Produces in flight per fill connection. With 64 (512 in all) the cluster
# once changed master during a fill on the loaded 2-core machine (every
# produce in flight answered "outcome unknown"); 16 x 8 is what
# durability_bench's catch-up fill keeps in flight for the same reason.
FILL_WINDOW = 16
# A drain gives up after this many error answers (something is broken).
MAX_ERRORS = 1000
# A produce whose two answers (its own, the woken consumer's) take longer
# than this is counted as lost and the loop moves on.
WAKE_TIMEOUT_S = 10.0
CONNECT_CHUNK = 200  # connections opened at once (the node's backlog is 1024)

_CLK_TCK = os.sysconf("SC_CLK_TCK")

# (delivery, form): the drain variants, in the order they are printed.
VARIANTS = (("at-most-once", "single"), ("at-most-once", "batch"),
            ("at-least-once", "single"), ("at-least-once", "batch+pipe"),
            ("at-least-once", "batch+seq"))


def mmm(values: list[float], fmt: str = "{:,.0f}") -> str:
    """min / median / max."""
    if not values:
        return "-"
    return " / ".join(fmt.format(v) for v in (min(values), statistics.median(values),
                                               max(values)))


def percentile(sorted_values: list[float], q: float) -> float:
    """Nearest-rank percentile of an ascending list (0.0 when empty)."""
    if not sorted_values:
        return 0.0
    rank = max(int(q * len(sorted_values) + 0.999999) - 1, 0)
    return sorted_values[min(rank, len(sorted_values) - 1)]


def wakeups(pid: int) -> int:
    """Context switches (voluntary + involuntary) of every thread of `pid`
    so far: how often it was scheduled off a CPU, i.e. woke up."""
    total = 0
    for path in glob.glob(f"/proc/{pid}/task/*/status"):
        try:
            with open(path, "rb") as f:
                for line in f:
                    if line.startswith((b"voluntary_ctxt_switches", b"nonvoluntary_ctxt_switches")):
                        total += int(line.split()[1])
        except OSError:
            pass
    return total


class OtherCpu:
    """CPU the machine's other processes (not this bench, not its nodes)
    use from now on, in cores: durability_bench's LoadMeter."""

    def __init__(self) -> None:
        self.meter = dur.LoadMeter()

    def cores(self) -> float:
        m = self.meter
        dt = max(time.perf_counter() - m.t0, 1e-9)
        return max(m._busy() - m.busy0 - (m._ours() - m.ours0), 0.0) / dt


def single_node_config(port: int) -> str:
    return (f'<config>\n  <node_info node_id="1" host="127.0.0.1" port="{port}"/>\n'
            f'  <queue_config queue_size="{BENCH_QUEUE_SIZE}"/>\n'
            f'  <limits max_wait="{MAX_WAIT_S}"/>\n</config>\n')


def write_file(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


async def start_single(root: str, name: str) -> dur.Node:
    port = free_port()
    path = os.path.join(root, f"{name}.xml")
    write_file(path, single_node_config(port))
    node = dur.Node(name, path, port, os.path.join(root, f"{name}.log"))
    await dur.wait_answer(node, {"action": 104}, lambda a: a.get("code") == 0, 60.0)
    return node


async def start_cluster(root: str, engine: str) -> tuple[dur.Cluster, int]:
    """A three-node quorum cluster with storage, fsync=batch; (cluster, master id)."""
    c = dur.Cluster(os.path.join(root, "cluster"), "cluster", "batch")
    if engine != "native":
        for path in c.configs.values():
            with open(path) as f:  # noqa: ASYNC230  (before any node runs)
                text = f.read()
            write_file(path, text.replace('engine="native"', f'engine="{engine}"'))
    c.start_all()
    return c, await c.wait_master(60.0)


async def monitor(port: int, queue: str) -> dict:
    a = await dur.ask(port, {"action": 4, "queue": queue}, timeout_s=10.0)
    if a is None or a.get("code") != 0:
        raise RuntimeError(f"monitor of {queue!r} on port {port}: {a}")
    return a


async def fill(port: int, queue: str, count: int, retry: int) -> int:
    """Produce `count` messages into `queue` (pipelined, not measured);
    returns the queue's size afterwards, which the drain must deliver."""
    loop = asyncio.get_running_loop()
    one = orjson.dumps({"action": 1, "queue": queue, "ttl": int(time.time()) + TTL_S,
                        "retry": retry, "data": DATA})
    conns = max(1, min(FILL_CONNECTIONS, count))
    share = [count // conns + (1 if i < count % conns else 0) for i in range(conns)]
    fillers = []
    try:
        for n in share:
            _, f = await loop.create_connection(lambda n=n: dur._Filler(one, n, FILL_WINDOW),
                                                "127.0.0.1", port)
            fillers.append(f)
        await asyncio.wait_for(asyncio.gather(*(f.done for f in fillers)), DRAIN_TIMEOUT_S)
    finally:
        for f in fillers:
            if f.transport is not None:
                f.transport.close()
    errors = sum(f.errors for f in fillers)
    if errors:
        first = next(f.first_error for f in fillers if f.first_error)
        print(f"    fill of {queue}: {errors} errors, first {first[:200]!r}", flush=True)
    return (await monitor(port, queue))["size"]


# -- drain -----------------------------------------------------------------

class _Drain:
    """What the clients of one drain share."""

    def __init__(self, clients: int) -> None:
        self.running = clients
        self.done = asyncio.get_running_loop().create_future()
        self.delivered = 0
        self.confirmed = 0
        self.requests = 0
        self.errors = 0
        self.first_error = ""
        self.last_answer = 0.0

    def error(self, what: str) -> None:
        self.errors += 1
        if not self.first_error:
            self.first_error = what[:200]

    def client_finished(self) -> None:
        self.running -= 1
        if self.running <= 0 and not self.done.done():
            self.done.set_result(None)


class _Drainer(asyncio.Protocol):
    """One closed-loop consumer: consume (count=N or single); then, for
    at-least-once, confirm what it got by receipt (all in one write, or one
    after another); then the next consume; stops at the first empty answer."""

    def __init__(self, run: _Drain, queue: str, count: int | None, confirm: str | None) -> None:
        self.run = run
        q = orjson.dumps(queue)
        self.consume_req = (b'{"action":2,"queue":%s,"count":%d}' % (q, count) if count
                            else b'{"action":2,"queue":%s}' % q)
        self.confirm_head = b'{"action":3,"queue":%s,"msg_id":' % q
        self.batch = bool(count)
        self.confirm = confirm  # None (at-most-once), "pipe" or "seq"
        self.todo: list[bytes] = []  # confirms not sent yet ("seq")
        self.expect = 0  # confirm answers awaited
        self.buf = b""
        self.transport: asyncio.Transport | None = None
        self.finished = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def start(self) -> None:
        self.transport.write(self.consume_req)

    def data_received(self, data: bytes) -> None:
        if self.buf:
            data = self.buf + data
        *lines, self.buf = data.split(b"\n")
        for line in lines:
            if line and not self.finished:
                self._answer(line)

    def _answer(self, line: bytes) -> None:
        run = self.run
        run.requests += 1
        run.last_answer = time.perf_counter()
        obj = orjson.loads(line)
        ok = obj.get("code") == 0
        if obj.get("action") == 3:
            if not ok or obj.get("found") is not True:
                run.error(line.decode(errors="replace"))
            else:
                run.confirmed += 1
            self.expect -= 1
            if self.expect == 0:
                if self.todo:
                    self.expect = 1
                    self.transport.write(self.todo.pop())
                else:
                    self.transport.write(self.consume_req)
            return
        if not ok:
            run.error(line.decode(errors="replace"))
            if run.errors > MAX_ERRORS:
                self._finish()
            else:
                self.transport.write(self.consume_req)
            return
        if self.batch:
            msgs = obj.get("messages") or []
        else:
            msgs = [obj] if "msg_id" in obj else []
        if not msgs:
            self._finish()
            return
        run.delivered += len(msgs)
        if self.confirm is None:
            self.transport.write(self.consume_req)
            return
        head = self.confirm_head
        reqs = []
        for m in msgs:
            receipt = m.get("receipt")
            if receipt is None:
                run.error(f"no receipt: {m}")
                reqs.append(b'%s%d}' % (head, m["msg_id"]))
            else:
                reqs.append(b'%s%d,"receipt":"%s"}' % (head, m["msg_id"], receipt.encode()))
        if self.confirm == "pipe":
            self.expect = len(reqs)
            self.transport.write(b"".join(reqs))
        else:
            reqs.reverse()
            self.todo = reqs
            self.expect = 1
            self.transport.write(self.todo.pop())

    def _finish(self) -> None:
        if not self.finished:
            self.finished = True
            self.run.client_finished()

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        if not self.finished:
            self.run.error(f"connection lost ({exc})")
            self._finish()


@dataclass
class DrainResult:
    messages: int  # the queue's size before the drain
    delivered: int
    confirmed: int
    requests: int
    errors: int
    first_error: str
    elapsed_s: float
    node_cpu_s: float
    gen_cpu_s: float
    other_cores: float = 0.0  # CPU other processes used meanwhile

    @property
    def rate(self) -> float:
        return self.delivered / self.elapsed_s if self.elapsed_s > 0 else 0.0

    def problems(self, at_least_once: bool) -> str:
        out = []
        if self.delivered != self.messages:
            out.append(f"delivered {self.delivered} of {self.messages}")
        if at_least_once and self.confirmed != self.delivered:
            out.append(f"confirmed {self.confirmed} of {self.delivered}")
        if self.errors:
            out.append(f"{self.errors} errors, first {self.first_error}")
        return "; ".join(out)


async def drain(port: int, queue: str, messages: int, *, clients: int, count: int | None,
                confirm: str | None, cpu) -> DrainResult:
    loop = asyncio.get_running_loop()
    run = _Drain(clients)
    drainers: list[_Drainer] = []
    try:
        for _ in range(clients):
            _, d = await loop.create_connection(lambda: _Drainer(run, queue, count, confirm),
                                                "127.0.0.1", port)
            drainers.append(d)
        gc.collect()
        cpu0, gen0 = cpu(), time.process_time()
        start = time.perf_counter()
        run.last_answer = start
        for d in drainers:
            d.start()
        await asyncio.wait_for(run.done, DRAIN_TIMEOUT_S)
        elapsed = run.last_answer - start
        cpu1, gen1 = cpu(), time.process_time()
    finally:
        for d in drainers:
            if d.transport is not None:
                d.transport.close()
    return DrainResult(messages=messages, delivered=run.delivered, confirmed=run.confirmed,
                       requests=run.requests, errors=run.errors, first_error=run.first_error,
                       elapsed_s=elapsed, node_cpu_s=cpu1 - cpu0, gen_cpu_s=gen1 - gen0)


def _variant_args(delivery: str, form: str, count: int) -> tuple[int, int | None, str | None]:
    """(retry, count, confirm) of a variant."""
    retry = 0 if delivery == "at-most-once" else ALO_RETRY_S
    n = None if form == "single" else count
    if delivery == "at-most-once":
        return retry, n, None
    return retry, n, ("seq" if form in ("single", "batch+seq") else "pipe")


async def part_drain(args: argparse.Namespace, root: str) -> list[str]:
    print(f"\n== drain: messages/s drained from a pre-filled queue, {args.clients} closed-loop "
          f"TCP clients, batch = consume count={args.count}", flush=True)
    meter = dur.LoadMeter()
    targets = {}
    masters: dict[str, tuple[dur.Cluster, int]] = {}  # the cluster and its master's id
    nodes: list[dur.Node] = []
    single = cluster = None
    try:
        if "node" in args.targets:
            single = await start_single(root, "drain-node")
            nodes.append(single)
            targets["node"] = (single.port, args.messages, single.cpu_seconds)
            print(f"  node: one node in memory, port {single.port}", flush=True)
        if "cluster" in args.targets:
            cluster, master = await start_cluster(root, args.engine)
            nodes += cluster.nodes.values()
            targets["cluster"] = (cluster.client_ports[master], args.cluster_messages,
                                  cluster.cpu_seconds)
            masters["cluster"] = (cluster, master)
            print(f"  cluster: three nodes, quorum, storage fsync=batch "
                  f"({dur._fs_type(cluster.root)}), engine {args.engine}, master node {master}",
                  flush=True)
        return await _drains(args, targets, masters, nodes, meter)
    finally:
        await asyncio.gather(*(n.stop() for n in nodes))


async def _drains(args: argparse.Namespace, targets: dict, masters: dict,
                  nodes: list[dur.Node], meter: dur.LoadMeter) -> list[str]:
    results: dict[tuple[str, str, str], list[DrainResult]] = {}
    serial = 0

    async def one(target: str, delivery: str, form: str, n: int, record: bool) -> None:
        nonlocal serial
        if target in masters:  # a run drives the master itself, never through a slave
            cluster, was = masters[target]
            now = await cluster.wait_master(60.0)
            if now != was:
                print(f"  {target}: the master changed from node {was} to node {now} "
                      f"(an election during the previous run)", flush=True)
                masters[target] = (cluster, now)
                targets[target] = (cluster.client_ports[now], *targets[target][1:])
        port, _, cpu = targets[target]
        retry, count, confirm = _variant_args(delivery, form, args.count)
        serial += 1
        queue = f"drain{serial}"
        size = await fill(port, queue, n, retry)
        for node in nodes:
            if not node.alive:
                raise RuntimeError(f"{node.name} exited with {node.proc.returncode}: "
                                   f"{node.log_tail(5)}")
        other = OtherCpu()
        r = await drain(port, queue, size, clients=args.clients, count=count, confirm=confirm,
                        cpu=cpu)
        r.other_cores = other.cores()
        if not record:
            return
        results.setdefault((target, delivery, form), []).append(r)
        bad = r.problems(delivery == "at-least-once")
        print(f"  {target:7} {delivery:13} {form:10} run {len(results[target, delivery, form])}"
              f"/{args.repeat}: {r.rate:>9,.0f} msg/s  {r.delivered:,} msgs in {r.elapsed_s:.2f} s"
              f"  {r.requests:,} requests  node CPU {r.node_cpu_s / max(r.delivered, 1) * 1e6:.1f}"
              f" us/msg  gen {r.gen_cpu_s / max(r.delivered, 1) * 1e6:.1f} us/msg  other "
              f"processes {r.other_cores:.2f} cores"
              + (f"  PROBLEM: {bad}" if bad else ""), flush=True)

    for target in targets:  # warm-up, not recorded
        for delivery, form in VARIANTS:
            await one(target, delivery, form, min(2000, targets[target][1]), False)
    print("  warmed up: 2,000 messages per target and variant", flush=True)
    for i in range(args.repeat):
        for target in targets:
            for delivery in ("at-most-once", "at-least-once"):
                forms = [f for d, f in VARIANTS if d == delivery]
                if i % 2:
                    forms.reverse()
                for form in forms:
                    await one(target, delivery, form, targets[target][1], True)

    print(f"\n  {'target':7} {'delivery':13} {'form':10} {'runs':>4} "
          f"{'msg/s min / median / max':>30} {'node us/msg':>11} {'x single':>8}")
    summary = []
    for target in targets:
        for delivery, form in VARIANTS:
            rs = results.get((target, delivery, form), [])
            if not rs:
                continue
            rates = [r.rate for r in rs]
            base = results.get((target, delivery, "single"), [])
            ratio = ""
            if form != "single" and base:
                ratio = f"{statistics.median(rates) / statistics.median(r.rate for r in base):.2f}"
            cpu = statistics.median(r.node_cpu_s / max(r.delivered, 1) * 1e6 for r in rs)
            bad = [p for p in (r.problems(delivery == "at-least-once") for r in rs) if p]
            line = (f"  {target:7} {delivery:13} {form:10} {len(rs):>4} {mmm(rates):>30} "
                    f"{cpu:>11.1f} {ratio:>8}" + (f"  PROBLEMS: {bad[0]}" if bad else ""))
            print(line)
            if ratio:
                summary.append(f"drain {target} {delivery} {form} / single: {ratio} "
                               f"(medians {statistics.median(rates):,.0f} and "
                               f"{statistics.median(r.rate for r in base):,.0f} msg/s)")
    print(f"  {meter.line()}", flush=True)
    return summary


# -- long poll -------------------------------------------------------------

class _LongPoll:
    """The parked consumers and the producer of the long-poll part."""

    def __init__(self, queue: str, wait_s: int) -> None:
        self.park_req = orjson.dumps({"action": 2, "queue": queue, "wait": wait_s})
        self.produce_head = (orjson.dumps({"action": 1, "queue": queue, "ttl": int(time.time())
                                           + TTL_S, "retry": 0})[:-1] + b',"data":"')
        self.repark = True
        self.expected = ""  # the data of the produce in flight
        self.t_woken = 0.0
        self.t_produced = 0.0
        self.both: asyncio.Future | None = None
        self.woken = 0
        self.empty = 0  # parked consumes answered empty (their wait ran out)
        self.errors = 0
        self.first_error = ""
        self.stray = 0  # deliveries of a produce other than the one in flight
        self.lost = 0  # connections the node closed

    def error(self, what: str) -> None:
        self.errors += 1
        if not self.first_error:
            self.first_error = what[:200]

    def consumer_answer(self, parker: _Parker, line: bytes) -> None:
        now = time.perf_counter()
        obj = orjson.loads(line)
        if obj.get("code") != 0:
            self.error(line.decode(errors="replace"))
        elif "data" not in obj:
            self.empty += 1
        else:
            self.woken += 1
            if obj["data"] == self.expected and not self.t_woken:
                self.t_woken = now
                self._check()
            else:
                self.stray += 1
        if self.repark and parker.transport is not None:
            parker.transport.write(self.park_req)

    def producer_answer(self, line: bytes) -> None:
        now = time.perf_counter()
        if b'"code":0' not in line:
            self.error(line.decode(errors="replace"))
        self.t_produced = now
        self._check()

    def _check(self) -> None:
        if self.t_woken and self.t_produced and self.both is not None and not self.both.done():
            self.both.set_result(None)


class _Lines(asyncio.Protocol):
    """Newline-framed answers to a callback."""

    def __init__(self) -> None:
        self.buf = b""
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        if self.buf:
            data = self.buf + data
        *lines, self.buf = data.split(b"\n")
        for line in lines:
            if line:
                self.line(line)

    def line(self, line: bytes) -> None:
        raise NotImplementedError


class _Parker(_Lines):
    """One connection with parked consumes on it."""

    def __init__(self, lp: _LongPoll) -> None:
        super().__init__()
        self.lp = lp
        self.closing = False

    def line(self, line: bytes) -> None:
        self.lp.consumer_answer(self, line)

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        if not self.closing:
            self.lp.lost += 1


class _Producer(_Lines):
    def __init__(self, lp: _LongPoll) -> None:
        super().__init__()
        self.lp = lp

    def line(self, line: bytes) -> None:
        self.lp.producer_answer(line)


async def connect_many(factory, n: int, port: int) -> list:
    loop = asyncio.get_running_loop()
    out = []
    for i in range(0, n, CONNECT_CHUNK):
        got = await asyncio.gather(*(loop.create_connection(factory, "127.0.0.1", port)
                                     for _ in range(min(CONNECT_CHUNK, n - i))))
        out += [p for _, p in got]
    return out


async def wait_waiting(port: int, queue: str, want: int, timeout_s: float) -> float:
    """Seconds until monitor reports `want` parked consumes on `queue`."""
    t0 = time.perf_counter()
    while True:
        a = await monitor(port, queue)
        if a.get("waiting") == want:
            return time.perf_counter() - t0
        if time.perf_counter() - t0 > timeout_s:
            raise RuntimeError(f"{queue}: {a.get('waiting')} waiting, not {want}, "
                               f"after {timeout_s:.0f} s")
        await asyncio.sleep(0.05)


async def idle_cpu(node: dur.Node, seconds: float) -> tuple[float, float, float]:
    """(node CPU % of one core, node wake-ups per second, generator CPU %)
    over `seconds` in which the bench sends nothing."""
    gc.collect()
    await asyncio.sleep(1.0)  # answers to the last requests, the node's own settling
    w0, c0, g0, t0 = wakeups(node.proc.pid), node.cpu_seconds(), time.process_time(), \
        time.perf_counter()
    await asyncio.sleep(seconds)
    w1, c1, g1, t1 = wakeups(node.proc.pid), node.cpu_seconds(), time.process_time(), \
        time.perf_counter()
    dt = t1 - t0
    return (c1 - c0) / dt * 100, (w1 - w0) / dt, (g1 - g0) / dt * 100


@dataclass
class LongPollRun:
    # (node CPU %, node wake-ups/s, generator CPU %) over --idle s each:
    idle_none: tuple[float, float, float] = (0.0, 0.0, 0.0)  # no clients, before
    idle_parked: tuple[float, float, float] = (0.0, 0.0, 0.0)  # waiters just parked
    idle_woken: tuple[float, float, float] = (0.0, 0.0, 0.0)  # parked, after the wake loop
    idle_after: tuple[float, float, float] = (0.0, 0.0, 0.0)  # no clients, after
    connect_s: float = 0.0
    park_s: float = 0.0
    rss_before_mb: float = 0.0  # just before parking
    rss_parked_mb: float = 0.0  # with every consume parked
    wake_ms: list[float] = field(default_factory=list)
    produce_ms: list[float] = field(default_factory=list)
    lost_produces: int = 0
    produce_before: loadgen.LoadResult | None = None  # no waiters, before parking
    produce_parked: loadgen.LoadResult | None = None
    produce_after: loadgen.LoadResult | None = None  # no waiters, after they went
    # The node's CPU per produce (us) in those three runs: steadier than
    # req/s on a machine whose other load moves.
    produce_us: tuple[float, float, float] = (0.0, 0.0, 0.0)
    other_cores: float = 0.0  # CPU other processes used during the round
    release_s: float = 0.0
    problems: list[str] = field(default_factory=list)

    @property
    def produce_without(self) -> float:
        """Produce req/s without waiters: the mean of the runs before and after."""
        return (self.produce_before.throughput + self.produce_after.throughput) / 2

    @property
    def produce_ratio(self) -> float:
        return self.produce_parked.throughput / self.produce_without

    @property
    def produce_us_ratio(self) -> float:
        """Node CPU per produce, parked / the mean of before and after."""
        before, parked, after = self.produce_us
        return parked / ((before + after) / 2) if before + after else 0.0


async def wake_loop(lp: _LongPoll, producer: _Producer, produces: int, run: LongPollRun,
                    tag: str) -> None:
    """`produces` produces one at a time, each waking one parked consume."""
    loop = asyncio.get_running_loop()
    head = lp.produce_head
    gc.collect()
    for i in range(produces):
        lp.expected = f"{tag}{i}"
        lp.t_woken = lp.t_produced = 0.0
        lp.both = loop.create_future()
        t0 = time.perf_counter()
        producer.transport.write(b'%s%s"}' % (head, lp.expected.encode()))
        try:
            await asyncio.wait_for(lp.both, WAKE_TIMEOUT_S)
        except TimeoutError:
            run.lost_produces += 1
            continue
        run.wake_ms.append((lp.t_woken - t0) * 1000)
        run.produce_ms.append((lp.t_produced - t0) * 1000)
    lp.both = None


async def longpoll_round(node: dur.Node, args: argparse.Namespace, queue: str, *,
                         waiters: int, connections: int, produces: int,
                         measure: bool) -> LongPollRun:
    port = node.port
    run = LongPollRun()
    other = OtherCpu()

    cpu_us: list[float] = []

    async def produce_baseline() -> loadgen.LoadResult:
        gc.collect()
        c0 = node.cpu_seconds()
        r = await loadgen.run_load("127.0.0.1", port, proto="tcp", mode="produce",
                                   concurrency=args.clients, duration=args.duration)
        cpu_us.append((node.cpu_seconds() - c0) / max(r.requests, 1) * 1e6)
        return r

    if measure:
        run.idle_none = await idle_cpu(node, args.idle)
        run.produce_before = await produce_baseline()
    lp = _LongPoll(queue, args.wait)
    parkers: list[_Parker] = []
    producer = None
    try:
        t0 = time.perf_counter()
        parkers = await connect_many(lambda: _Parker(lp), connections, port)
        _, producer = await asyncio.get_running_loop().create_connection(
            lambda: _Producer(lp), "127.0.0.1", port)
        run.connect_s = time.perf_counter() - t0
        run.rss_before_mb = node.status_mb() or 0.0
        t0 = time.perf_counter()
        per = [waiters // connections + (1 if i < waiters % connections else 0)
               for i in range(connections)]
        for p, n in zip(parkers, per):
            if n:
                p.transport.write(lp.park_req * n)
        await wait_waiting(port, queue, waiters, 120.0)
        run.park_s = time.perf_counter() - t0
        run.rss_parked_mb = node.status_mb() or 0.0
        if measure:
            run.idle_parked = await idle_cpu(node, args.idle)
        await wake_loop(lp, producer, produces, run, "w" if measure else "warm")
        if measure:
            # Idle again before each produce run, so that all three start
            # alike (after a rest, the scheduler favours a process over the
            # machine's other load for a while).
            run.idle_woken = await idle_cpu(node, args.idle)
            run.produce_parked = await produce_baseline()
        still = (await monitor(port, queue)).get("waiting")
        if still != waiters:
            run.problems.append(f"{still} waiting after the wake loop, not {waiters}")
    finally:
        for p in parkers:
            p.closing = True
            if p.transport is not None:
                p.transport.close()
        if producer is not None and producer.transport is not None:
            producer.transport.close()
    t0 = time.perf_counter()
    await wait_waiting(port, queue, 0, 60.0)
    run.release_s = time.perf_counter() - t0
    if measure:
        run.idle_after = await idle_cpu(node, args.idle)
        run.produce_after = await produce_baseline()
        run.produce_us = (cpu_us[0], cpu_us[1], cpu_us[2])
    run.other_cores = other.cores()
    if lp.errors:
        run.problems.append(f"{lp.errors} error answers, first {lp.first_error}")
    if lp.empty:
        run.problems.append(f"{lp.empty} parked consumes answered empty (wait ran out)")
    if lp.stray:
        run.problems.append(f"{lp.stray} deliveries of another produce than the one in flight")
    if lp.lost:
        run.problems.append(f"{lp.lost} connections closed by the node")
    if run.lost_produces:
        run.problems.append(f"{run.lost_produces} produces without both answers in "
                            f"{WAKE_TIMEOUT_S:.0f} s")
    return run


def _idle(fig: tuple[float, float, float]) -> str:
    return f"{fig[0]:.2f}% ({fig[1]:.1f})"


async def part_longpoll(args: argparse.Namespace, root: str) -> list[str]:
    print(f"\n== longpoll: {args.waiters:,} parked consumes (wait={args.wait} s) over "
          f"{args.connections:,} TCP connections on one node in memory; produce baseline: "
          f"{args.clients} closed-loop TCP clients, {args.duration} s, before parking, while "
          f"parked, after they went", flush=True)
    meter = dur.LoadMeter()
    node = await start_single(root, "longpoll-node")
    runs: list[LongPollRun] = []
    try:
        await loadgen.run_load("127.0.0.1", node.port, mode="produce", concurrency=args.clients,
                               duration=min(args.duration, 0.5))
        await longpoll_round(node, args, "lp-warm", waiters=100, connections=100, produces=100,
                             measure=False)
        print("  warmed up: a short produce run, 100 waiters woken once", flush=True)
        for i in range(args.repeat):
            r = await longpoll_round(node, args, "lp", waiters=args.waiters,
                                     connections=args.connections, produces=args.produces,
                                     measure=True)
            runs.append(r)
            w = sorted(r.wake_ms)
            p = sorted(r.produce_ms)
            print(f"  run {i + 1}/{args.repeat}: node idle CPU % of one core (wake-ups/s): "
                  f"without clients {_idle(r.idle_none)}, with {args.waiters:,} parked "
                  f"{_idle(r.idle_parked)} [generator {r.idle_parked[2]:.2f}%], still parked "
                  f"after the wakes {_idle(r.idle_woken)}, after they went "
                  f"{_idle(r.idle_after)}", flush=True)
            print(f"      connect {r.connect_s:.2f} s, park {r.park_s:.2f} s, "
                  f"RSS {r.rss_before_mb:.0f} -> {r.rss_parked_mb:.0f} MB", flush=True)
            print(f"      wake latency p50 {percentile(w, .5):.3f} p99 {percentile(w, .99):.3f} "
                  f"max {w[-1] if w else 0:.3f} ms over {len(w)} produces (the produce's own "
                  f"answer: p50 {percentile(p, .5):.3f} p99 {percentile(p, .99):.3f} ms)",
                  flush=True)
            print(f"      produce req/s: {r.produce_before.throughput:,.0f} before, "
                  f"{r.produce_parked.throughput:,.0f} parked, {r.produce_after.throughput:,.0f} "
                  f"after (p50 {r.produce_before.p50_ms:.3f} / {r.produce_parked.p50_ms:.3f} / "
                  f"{r.produce_after.p50_ms:.3f} ms; node CPU {r.produce_us[0]:.1f} / "
                  f"{r.produce_us[1]:.1f} / {r.produce_us[2]:.1f} us/req): parked / without "
                  f"x{r.produce_ratio:.2f} req/s, x{r.produce_us_ratio:.2f} CPU/req; "
                  f"all released {r.release_s:.2f} s after their connections closed; other "
                  f"processes {r.other_cores:.2f} cores"
                  + (f"\n      PROBLEMS: {'; '.join(r.problems)}" if r.problems else ""),
                  flush=True)
    finally:
        await node.stop()

    def col(f) -> list[float]:
        return [f(r) for r in runs]

    print(f"\n  {'figure':58} {'min / median / max':>30}")
    rows = [
        ("node CPU, no clients, % of one core (before and after)",
         col(lambda r: r.idle_none[0]) + col(lambda r: r.idle_after[0]), "{:.2f}"),
        (f"node CPU, {args.waiters:,} parked, % of one core",
         col(lambda r: r.idle_parked[0]), "{:.2f}"),
        (f"node CPU, {args.waiters:,} parked after the wakes, % of one core",
         col(lambda r: r.idle_woken[0]), "{:.2f}"),
        ("node wake-ups/s, no clients (before and after)",
         col(lambda r: r.idle_none[1]) + col(lambda r: r.idle_after[1]), "{:.1f}"),
        (f"node wake-ups/s, {args.waiters:,} parked", col(lambda r: r.idle_parked[1]), "{:.1f}"),
        (f"node wake-ups/s, {args.waiters:,} parked after the wakes",
         col(lambda r: r.idle_woken[1]), "{:.1f}"),
        ("wake latency p50, ms", col(lambda r: percentile(sorted(r.wake_ms), .5)), "{:.3f}"),
        ("wake latency p99, ms", col(lambda r: percentile(sorted(r.wake_ms), .99)), "{:.3f}"),
        ("produce answer in the same loop p50, ms",
         col(lambda r: percentile(sorted(r.produce_ms), .5)), "{:.3f}"),
        ("produce answer in the same loop p99, ms",
         col(lambda r: percentile(sorted(r.produce_ms), .99)), "{:.3f}"),
        (f"produce req/s, {args.clients} clients, no waiters (mean of before/after)",
         col(lambda r: r.produce_without), "{:,.0f}"),
        (f"produce req/s, {args.clients} clients, {args.waiters:,} parked",
         col(lambda r: r.produce_parked.throughput), "{:,.0f}"),
        ("produce req/s, parked / without (ratio)", col(lambda r: r.produce_ratio), "{:.2f}"),
        ("node CPU per produce, us, no waiters (mean of before/after)",
         col(lambda r: (r.produce_us[0] + r.produce_us[2]) / 2), "{:.1f}"),
        (f"node CPU per produce, us, {args.waiters:,} parked",
         col(lambda r: r.produce_us[1]), "{:.1f}"),
        ("node CPU per produce, parked / without (ratio)",
         col(lambda r: r.produce_us_ratio), "{:.2f}"),
        (f"node RSS added by parking {args.waiters:,}, MB",
         col(lambda r: r.rss_parked_mb - r.rss_before_mb), "{:.1f}"),
    ]
    for name, values, fmt in rows:
        print(f"  {name:58} {mmm(values, fmt):>30}")
    print(f"  {meter.line()}", flush=True)
    med = statistics.median
    without = med(col(lambda r: r.produce_without))
    parked = med(col(lambda r: r.produce_parked.throughput))
    return [(f"longpoll: {args.waiters:,} parked: node CPU "
             f"{med(col(lambda r: r.idle_parked[0])):.2f}% of one core "
             f"({med(col(lambda r: r.idle_parked[1])):.1f} wake-ups/s); wake latency p50 "
             f"{med(col(lambda r: percentile(sorted(r.wake_ms), .5))):.3f} ms, p99 "
             f"{med(col(lambda r: percentile(sorted(r.wake_ms), .99))):.3f} ms; produce "
             f"{without:,.0f} req/s without waiters, {parked:,.0f} with them parked (ratio of "
             f"the medians {parked / without:.2f}; median of the runs' ratios: req/s "
             f"{med(col(lambda r: r.produce_ratio)):.2f}, node CPU per produce "
             f"{med(col(lambda r: r.produce_us_ratio)):.2f}); medians over {len(runs)} runs")]


# -- main ------------------------------------------------------------------

def _parts(text: str) -> tuple[str, ...]:
    chosen = tuple(x.strip() for x in text.split(",") if x.strip())
    if not chosen or any(x not in ("drain", "longpoll") for x in chosen):
        raise argparse.ArgumentTypeError("choose from drain,longpoll")
    return chosen


def _targets(text: str) -> tuple[str, ...]:
    chosen = tuple(x.strip() for x in text.split(",") if x.strip())
    if not chosen or any(x not in ("node", "cluster") for x in chosen):
        raise argparse.ArgumentTypeError("choose from node,cluster")
    return tuple(x for x in ("node", "cluster") if x in chosen)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="batch consume and long poll, measured in one run")
    p.add_argument("--parts", type=_parts, default=("drain", "longpoll"),
                   help="comma-separated subset of drain,longpoll (default both)")
    p.add_argument("--repeat", type=int, default=3, help="runs per variant (default 3)")
    p.add_argument("--clients", "-c", type=int, default=8,
                   help="closed-loop clients of the drains and the produce baseline (default 8)")
    p.add_argument("--messages", type=int, default=100_000,
                   help="messages per drain on the single node (default 100000)")
    p.add_argument("--cluster-messages", type=int, default=20_000,
                   help="messages per drain on the cluster (default 20000)")
    p.add_argument("--targets", type=_targets, default=("node", "cluster"),
                   help="comma-separated subset of node,cluster for the drains (default both)")
    p.add_argument("--count", type=int, default=100, help="the batch consume's count (default 100)")
    p.add_argument("--engine", choices=("native", "raft"), default="native",
                   help="the cluster's engine (default native)")
    p.add_argument("--waiters", type=int, default=2000, help="parked consumes (default 2000)")
    p.add_argument("--connections", type=int, default=None,
                   help="TCP connections they are spread over (default: one each)")
    p.add_argument("--wait", type=int, default=600,
                   help=f"the parked consumes' wait, seconds (default 600, at most {MAX_WAIT_S})")
    p.add_argument("--idle", type=float, default=5.0,
                   help="seconds over which idle CPU is measured (default 5)")
    p.add_argument("--produces", type=int, default=1000,
                   help="produces that each wake one parked consume (default 1000)")
    p.add_argument("--duration", type=float, default=3.0,
                   help="seconds per produce baseline run (default 3)")
    p.add_argument("--keep", action="store_true",
                   help="keep the run directory (configs, node logs, data) and say where")
    p.add_argument("--dir", default=None, help="where the cluster's data directories go "
                                                "(default: the system's temporary directory)")
    return p


async def _run(args: argparse.Namespace, root: str) -> list[str]:
    summary = []
    if "drain" in args.parts:
        summary += await part_drain(args, root)
    if "longpoll" in args.parts:
        summary += await part_longpoll(args, root)
    return summary


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.connections is None:
        args.connections = args.waiters
    if not 0 < args.connections <= args.waiters:
        raise SystemExit("--connections must be between 1 and --waiters")
    if not 0 < args.wait <= MAX_WAIT_S:
        raise SystemExit(f"--wait must be between 1 and {MAX_WAIT_S}")
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = args.connections + 256
    if soft != resource.RLIM_INFINITY and soft < need:
        want = need if hard == resource.RLIM_INFINITY else min(hard, need)
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
        if want < need:
            raise SystemExit(f"open-file limit {want}: not enough for {args.connections} "
                             f"connections (ulimit -Hn)")
    base = args.dir or tempfile.gettempdir()
    os.makedirs(base, exist_ok=True)
    root = tempfile.mkdtemp(prefix="qserver-consumer-", dir=base)
    print("$ " + shlex.join([sys.executable, sys.argv[0]]
                            + (sys.argv[1:] if argv is None else argv)))
    head = subprocess.run(["git", "log", "-1", "--format=%h %s"], cwd=REPO_DIR,
                          capture_output=True, text=True).stdout.strip()
    print(f"qserver at {head[:100]}")
    print(f"python {sys.version.split()[0]}, {'uvloop' if uvloop else 'asyncio'} generator, "
          f"{os.cpu_count()} cpus shared by the generator and the nodes, load average "
          f"{os.getloadavg()[0]:.2f} at start", flush=True)

    def on_term(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)
    rc = 0
    summary: list[str] = []
    t0 = time.perf_counter()
    try:
        summary = (uvloop.run if uvloop else asyncio.run)(_run(args, root))
    except KeyboardInterrupt:
        print("\ninterrupted; stopping every node", file=sys.stderr)
        rc = 130
    except Exception as exc:
        print(f"\nbench failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        for n in dur._ALL_NODES:
            tail = n.log_tail(5)
            if tail and n.alive is False:
                print(f"--- {n.name} log ---\n{tail}", file=sys.stderr)
        rc = 1
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        for n in dur._ALL_NODES:
            if n.alive:
                n.kill_now()
        if args.keep:
            print(f"kept {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)
    if summary:
        print()
        for line in summary:
            print(line)
    print(f"\nload average {os.getloadavg()[0]:.2f} at the end; {time.perf_counter() - t0:.0f} s "
          f"in all")
    return rc


if __name__ == "__main__":
    sys.exit(main())
