"""The producer side of issue 15, measured in one run: batch produce against
single produces, what a dedup id costs (memory per id, CPU per produce),
and what priorities cost the FIFO path of messages without one.

    python bench/producer_bench.py [--parts batch,dedup,priority] [--repeat 3]
        [--targets node,cluster] [--clients 4] [--window 16] [--batch 1000]
        [--duration 3] [--dedup-entries 200000] [--priority-messages 50000]
        [--consumers 8] [--count 100] [--baseline DIR] [--engine native] [--dir DIR]

The machine the figures come from has 2 cores, shared by this generator and
the node(s) it measures (and whatever else runs there: the CPU other
processes used is printed per run). The nodes are real `qserver run`
processes started with bench/consumer_bench.py's machinery (its
`start_single`, `start_cluster`, `drain`); the generator is built the same
cheap way (uvloop, asyncio Protocol callbacks, request bytes made by
concatenation). Messages carry 100 bytes of data, retry=0 (at-most-once),
a ttl a week away. Every variant runs `--repeat` times, in alternating
order, after a warm-up that is not recorded; printed per run and as
min / median / max, with each ratio taken between medians of the same run.

Part `batch`: messages per second, batch produce against single produces
- Targets, both started at the beginning: one node in memory, and a
  three-node quorum cluster with storage, fsync=batch (consumer_bench's,
  `--engine` native or raft), driven through its master.
- `--clients` TCP clients for `--duration` s each run, into a fresh queue
  (cleared afterwards, so that memory does not pile up):
  `single`: produce requests of one message each, pipelined as
  durability_bench's and consumer_bench's fills do (`--window` in flight per
  client; a new lot goes out when half of them are answered), so that the
  baseline is the server's rate, not the round trip's;
  `batch`: produce requests of `--batch` messages (`messages`), closed loop
  (one request in flight per client).
  Messages/s = messages acknowledged (code 0) / time from the first request
  to the last answer; the nodes' CPU per message is printed beside it.

Part `dedup`: what a dedup id costs
- memory: in child processes (one per measurement, nothing else in them),
  a Store applies `--dedup-entries` ProduceBatch entries of one message
  each (what a single produce with a dedup_id becomes), decided by
  `decide_produce_batch` as the service does, with a fresh 36-character
  UUID (str(uuid4())) as dedup id, and the same entries without dedup ids.
  Bytes per dedup id = (RSS the first added - RSS the second added) /
  entries: what the OS sees, allocator rounding and the dict's spare room
  included (tracemalloc, tried at 20,000 ids, agreed within 2% at ten
  times the time).
  Beside it, the table's objects by sys.getsizeof, per id: its structure
  (the OrderedDict and its nodes), the id string, the (ref, accepted time)
  tuple, the ref, the accepted times no message shares. The same with
  entries of `--batch` messages (a batch shares its accepted time), and
  the RSS per stored message without a dedup id.
- throughput: one node in memory, single produces pipelined as in `batch`,
  `--duration` s each: `plain` (no dedup_id: the plain produce path),
  `dedup_id` (a new id every produce: the general path, the id recorded),
  `resend` (every produce resends one of 1,000 ids accepted just before:
  each answered `duplicate: true`, nothing stored). Requests/s, the node's
  CPU per request, and each as a ratio of `plain`.

Part `priority`: the FIFO fast path with and without prioritized messages
- One node in memory. Per run and variant, `--priority-messages` single
  produces (pipelined as above, timed) into a fresh queue, then the queue
  drained by `--consumers` closed-loop consumers (consumer_bench's `drain`:
  each with one consume in flight until answered empty), once with single
  consumes and once (a second fill) with consume count=`--count`.
- Variants: `plain` (no message has a priority: the queue never leaves the
  FIFO path), `10% prio` (every tenth message has a priority from 0..2047,
  1024 excepted: the rest take the FIFO path beside them) and `all prio`
  (every message has one: the general path). Produce msg/s, drain msg/s,
  the node's CPU per message, and each as a ratio of `plain`.
- `--baseline DIR` (another source tree, e.g. `git archive f88a970 | tar
  -x -C DIR`, the commit before priorities): its node runs `plain` too, in
  the same rotation (`plain@base`; its table row is a ratio of this tree's
  `plain`, its summary line this tree's `plain` over it): the speed
  messages without a priority had before priorities existed.
- Node CPU per message comes from /proc/PID/stat (10 ms ticks): about 1%
  resolution for the produces and single-consume drains of 50,000
  messages, about 10% for the count=100 drains (0.1 s of CPU).

Every process started here is killed at the end, also on Ctrl-C or error.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

import orjson

try:
    import uvloop
except ImportError:  # plain asyncio then; the figures say which
    uvloop = None

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
REPO_DIR = os.path.dirname(BENCH_DIR)
sys.path.insert(0, BENCH_DIR)
import consumer_bench as cb  # noqa: E402  (this directory, script or not)
import durability_bench as dur  # noqa: E402

DATA = "x" * 100  # ~100-byte messages
TTL_S = 7 * 86400  # no message of the bench expires
BATCH = 1000  # the protocol's largest batch
# Single produces in flight per client: what consumer_bench's fill keeps
# (more made the cluster change master on the loaded 2-core machine).
WINDOW = cb.FILL_WINDOW
RUN_GRACE_S = 60.0  # a timed run's answers must all be in this long after its end
FILL_TIMEOUT_S = 300.0
RESEND_POOL = 1000  # ids the `resend` variant cycles through
# 10% prio: one message in this many has a priority.
PRIO_EVERY = 10

BATCH_FORMS = ("single", "batch")
DEDUP_VARIANTS = ("plain", "dedup_id", "resend")
PRIO_VARIANTS = ("plain", "10% prio", "all prio")
DRAIN_FORMS = ("single", "count")

mmm = cb.mmm


def priority_of(k: int) -> int:
    """A spread of priorities over 0..2047, never the default 1024."""
    p = (k * 7919 + 13) % 2047
    return p + 1 if p >= 1024 else p


# -- the generator ---------------------------------------------------------

class _Run:
    """What the clients of one run share."""

    def __init__(self, clients: int, deadline: float) -> None:
        self.running = clients
        self.deadline = deadline
        self.done = asyncio.get_running_loop().create_future()
        self.last_answer = 0.0
        self.ok = 0  # answers with code 0
        self.errors = 0
        self.first_error = b""

    def client_finished(self) -> None:
        self.running -= 1
        if self.running <= 0 and not self.done.done():
            self.done.set_result(None)


class _Pipe(asyncio.Protocol):
    """One producer: keeps up to `window` requests in flight (the next lot
    goes out when half of them are answered, as durability_bench's _Filler
    does; window 1 is a closed loop), until it has sent `count` requests or
    the run's deadline passed. `make(n)` gives the bytes of its next n
    requests."""

    def __init__(self, run: _Run, make: Callable[[int], bytes], window: int,
                 count: int | None) -> None:
        self.run = run
        self.make = make
        self.window = window
        self.left = count  # None: until the deadline
        self.in_flight = 0
        self.buf = b""
        self.transport: asyncio.Transport | None = None
        self.finished = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def start(self) -> None:
        self._pump(time.perf_counter())

    def _pump(self, now: float) -> None:
        n = self.window - self.in_flight
        if self.left is not None:
            n = min(n, self.left)
        elif now >= self.run.deadline:
            n = 0
        if n > 0:
            self.in_flight += n
            if self.left is not None:
                self.left -= n
            self.transport.write(self.make(n))
        elif self.in_flight == 0:
            self._finish()

    def data_received(self, data: bytes) -> None:
        buf = self.buf + data if self.buf else data
        end = buf.rfind(b"\n")
        if end < 0:
            self.buf = buf
            return
        if end + 1 == len(buf):
            whole, self.buf = buf, b""
        else:
            whole, self.buf = buf[:end + 1], buf[end + 1:]
        now = time.perf_counter()
        run = self.run
        run.last_answer = now
        n = whole.count(b"\n")
        ok = whole.count(b'"code":0')
        run.ok += ok
        if ok < n:
            run.errors += n - ok
            if not run.first_error:
                run.first_error = next((line for line in whole.split(b"\n")
                                        if line and b'"code":0' not in line), b"")
        self.in_flight -= n
        if self.in_flight <= self.window // 2:
            self._pump(now)

    def _finish(self) -> None:
        if not self.finished:
            self.finished = True
            self.run.client_finished()

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        if not self.finished:
            self.run.errors += 1
            if not self.run.first_error:
                self.run.first_error = f"connection lost ({exc})".encode()
            self._finish()


@dataclass
class PipeResult:
    requests: int  # answered with code 0
    messages: int  # messages those requests carried
    errors: int
    first_error: str
    elapsed_s: float
    node_cpu_s: float
    gen_cpu_s: float
    other_cores: float

    @property
    def rate(self) -> float:
        """Messages acknowledged per second."""
        return self.messages / self.elapsed_s if self.elapsed_s > 0 else 0.0

    @property
    def req_rate(self) -> float:
        return self.requests / self.elapsed_s if self.elapsed_s > 0 else 0.0

    def node_us(self, per: int | None = None) -> float:
        return self.node_cpu_s / max(per if per is not None else self.messages, 1) * 1e6

    def problem(self) -> str:
        return f"{self.errors} errors, first {self.first_error}" if self.errors else ""


async def pipe_run(port: int, makers: list[Callable[[int], bytes]], *, window: int,
                   per_request: int, cpu: Callable[[], float], duration: float | None = None,
                   count: int | None = None) -> PipeResult:
    """One client per maker, for `duration` s or `count` requests in all."""
    loop = asyncio.get_running_loop()
    clients = len(makers)
    run = _Run(clients, float("inf"))
    shares: list[int | None] = [None] * clients
    if count is not None:
        shares = [count // clients + (1 if i < count % clients else 0) for i in range(clients)]
    pipes: list[_Pipe] = []
    other = cb.OtherCpu()
    try:
        for make, share in zip(makers, shares, strict=True):
            _, p = await loop.create_connection(lambda m=make, s=share: _Pipe(run, m, window, s),
                                                "127.0.0.1", port)
            pipes.append(p)
        gc.collect()
        cpu0, gen0 = cpu(), time.process_time()
        start = time.perf_counter()
        if duration is not None:
            run.deadline = start + duration
        run.last_answer = start
        for p in pipes:
            p.start()
        limit = (duration if duration is not None else FILL_TIMEOUT_S) + RUN_GRACE_S
        await asyncio.wait_for(run.done, limit)
        elapsed = run.last_answer - start
        cpu1, gen1 = cpu(), time.process_time()
    finally:
        for p in pipes:
            if p.transport is not None:
                p.transport.close()
    return PipeResult(requests=run.ok, messages=run.ok * per_request, errors=run.errors,
                      first_error=run.first_error.decode(errors="replace")[:200],
                      elapsed_s=elapsed, node_cpu_s=cpu1 - cpu0, gen_cpu_s=gen1 - gen0,
                      other_cores=other.cores())


def _produce(queue: str, **fields: object) -> dict:
    return {"action": 1, "queue": queue, "ttl": int(time.time()) + TTL_S, "retry": 0, **fields}


def single_maker(queue: str) -> Callable[[int], bytes]:
    one = orjson.dumps(_produce(queue, data=DATA))
    return lambda n: one * n


def batch_maker(queue: str, size: int) -> Callable[[int], bytes]:
    one = orjson.dumps(_produce(queue, messages=[{"data": DATA}] * size))
    return lambda n: one * n


def dedup_maker(queue: str, prefix: str, cycle: int | None = None) -> Callable[[int], bytes]:
    """Single produces with dedup ids `prefix` + a 12-digit counter (36
    characters, a UUID's shape): new ones, or the first `cycle` over again."""
    head = orjson.dumps(_produce(queue))[:-1] + b',"dedup_id":"' + prefix.encode()
    tail = b'","data":' + orjson.dumps(DATA) + b"}"
    counter = 0

    def make(n: int) -> bytes:
        nonlocal counter
        c = counter
        counter += n
        if cycle:
            return b"".join(b"%s%012d%s" % (head, k % cycle, tail) for k in range(c, c + n))
        return b"".join(b"%s%012d%s" % (head, k, tail) for k in range(c, c + n))
    return make


def id_prefix() -> str:
    """24 characters of a fresh UUID (8-4-4-4-): 12 digits complete it."""
    return str(uuid.uuid4())[:24]


def priority_maker(queue: str, every: int, offset: int) -> Callable[[int], bytes]:
    """Single produces; every `every`-th has a priority (0: none has)."""
    plain = orjson.dumps(_produce(queue, data=DATA))
    head = orjson.dumps(_produce(queue))[:-1] + b',"priority":'
    tail = b',"data":' + orjson.dumps(DATA) + b"}"
    counter = offset

    def make(n: int) -> bytes:
        nonlocal counter
        c = counter
        counter += n
        if not every:
            return plain * n
        return b"".join(b"%s%d%s" % (head, priority_of(k), tail) if k % every == 0 else plain
                        for k in range(c, c + n))
    return make


async def clear(port: int, queue: str) -> None:
    a = await dur.ask(port, {"action": 6, "queue": queue}, timeout_s=60.0)
    if a is None or a.get("code") != 0:
        raise RuntimeError(f"clear of {queue!r} on port {port}: {a}")


def _other(r: PipeResult) -> str:
    return f"other processes {r.other_cores:.2f} cores"


def _ratio(a: list[float], b: list[float]) -> float:
    return statistics.median(a) / statistics.median(b) if a and b else 0.0


# -- part batch ------------------------------------------------------------

async def part_batch(args: argparse.Namespace, root: str) -> list[str]:
    print(f"\n== batch: messages/s, produce of {args.batch:,} messages per request (closed "
          f"loop) against single produces ({args.window} in flight per client), "
          f"{args.clients} TCP clients, {args.duration} s per run, {len(DATA)}-byte messages",
          flush=True)
    meter = dur.LoadMeter()
    nodes: list[dur.Node] = []
    # target -> [port, cpu function, cluster or None, master id]
    targets: dict[str, list] = {}
    try:
        if "node" in args.targets:
            single = await cb.start_single(root, "batch-node")
            nodes.append(single)
            targets["node"] = [single.port, single.cpu_seconds, None, 0]
            print(f"  node: one node in memory, port {single.port}", flush=True)
        if "cluster" in args.targets:
            cluster, master = await cb.start_cluster(root, args.engine)
            nodes += cluster.nodes.values()
            targets["cluster"] = [cluster.client_ports[master], cluster.cpu_seconds, cluster,
                                  master]
            print(f"  cluster: three nodes, quorum, storage fsync=batch "
                  f"({dur._fs_type(cluster.root)}), engine {args.engine}, master node {master}",
                  flush=True)
        return await _batch_runs(args, targets, nodes, meter)
    finally:
        await asyncio.gather(*(n.stop() for n in nodes))


async def _batch_runs(args: argparse.Namespace, targets: dict, nodes: list[dur.Node],
                      meter: dur.LoadMeter) -> list[str]:
    results: dict[tuple[str, str], list[PipeResult]] = {}
    serial = 0

    async def one(target: str, form: str, duration: float, record: bool) -> None:
        nonlocal serial
        t = targets[target]
        if t[2] is not None:  # the cluster: drive its master, never through a slave
            now = await t[2].wait_master(60.0)
            if now != t[3]:
                print(f"  {target}: the master changed from node {t[3]} to node {now}",
                      flush=True)
                t[0], t[3] = t[2].client_ports[now], now
        port, cpu = t[0], t[1]
        serial += 1
        queue = f"batch{serial}"
        if form == "single":
            makers = [single_maker(queue) for _ in range(args.clients)]
            window, per = args.window, 1
        else:
            makers = [batch_maker(queue, args.batch) for _ in range(args.clients)]
            window, per = 1, args.batch
        r = await pipe_run(port, makers, window=window, per_request=per, cpu=cpu,
                           duration=duration)
        for node in nodes:
            if not node.alive:
                raise RuntimeError(f"{node.name} exited with {node.proc.returncode}: "
                                   f"{node.log_tail(5)}")
        size = (await cb.monitor(port, queue))["size"]
        await clear(port, queue)
        if not record:
            return
        rs = results.setdefault((target, form), [])
        rs.append(r)
        bad = r.problem()
        if size != r.messages:
            bad += f"{'; ' if bad else ''}queue held {size:,}, {r.messages:,} acknowledged"
        print(f"  {target:7} {form:6} run {len(rs)}/{args.repeat}: {r.rate:>9,.0f} msg/s "
              f"({r.req_rate:,.0f} req/s)  {r.messages:,} msgs in {r.elapsed_s:.2f} s  node CPU "
              f"{r.node_us():.2f} us/msg  gen {r.gen_cpu_s / max(r.messages, 1) * 1e6:.2f} "
              f"us/msg  {_other(r)}" + (f"  PROBLEM: {bad}" if bad else ""), flush=True)

    for target in targets:
        for form in BATCH_FORMS:
            await one(target, form, min(1.0, args.duration), False)
    print("  warmed up: 1 s per target and form", flush=True)
    for i in range(args.repeat):
        for target in targets:
            forms = list(BATCH_FORMS)
            if i % 2:
                forms.reverse()
            for form in forms:
                await one(target, form, args.duration, True)

    print(f"\n  {'target':7} {'form':6} {'runs':>4} {'msg/s min / median / max':>32} "
          f"{'node us/msg':>11} {'x single':>8}")
    summary = []
    for target in targets:
        for form in BATCH_FORMS:
            rs = results.get((target, form), [])
            if not rs:
                continue
            rates = [r.rate for r in rs]
            base = [r.rate for r in results.get((target, "single"), [])]
            ratio = f"{_ratio(rates, base):.2f}" if form != "single" and base else ""
            us = statistics.median(r.node_us() for r in rs)
            print(f"  {target:7} {form:6} {len(rs):>4} {mmm(rates):>32} {us:>11.2f} {ratio:>8}")
        single = [r.rate for r in results.get((target, "single"), [])]
        batch = [r.rate for r in results.get((target, "batch"), [])]
        if single and batch:
            where = ("one node in memory" if target == "node" else
                     "three-node quorum cluster, fsync=batch")
            us_s = [r.node_us() for r in results[target, "single"]]
            us_b = [r.node_us() for r in results[target, "batch"]]
            summary.append(f"batch produce, {where}: {statistics.median(batch):,.0f} msg/s "
                           f"({mmm(batch)}) with {args.batch:,}-message requests against "
                           f"{statistics.median(single):,.0f} msg/s ({mmm(single)}) with single "
                           f"produces: x{_ratio(batch, single):.2f}; node CPU per message "
                           f"{statistics.median(us_b):.2f} against {statistics.median(us_s):.2f} "
                           f"us (single / batch x{_ratio(us_s, us_b):.2f})")
    print(f"  {meter.line()}", flush=True)
    return summary


# -- part dedup --------------------------------------------------------------

def memory_child(spec: str) -> None:
    """In a child process: build a Store from `n` ProduceBatch entries of
    `batch` messages, with dedup ids or without; print as JSON the RSS it
    added and, with ids, the sizes of the dedup table's objects."""
    n_s, batch_s, dedup_s = spec.split(",")
    n, batch, dedup = int(n_s), int(batch_s), dedup_s == "1"
    sys.path.insert(0, REPO_DIR)
    from qserver.state.store import READY_MS, Store
    from qserver.wire.requests import DEFAULT_PRIORITY, ProduceBatchRequest, ProduceItem

    def rss() -> int:
        with open("/proc/self/status", "rb") as f:
            for line in f:
                if line.startswith(b"VmRSS:"):
                    return int(line.split()[1]) * 1024
        return 0

    store = Store(queue_size=cb.BENCH_QUEUE_SIZE)
    data = DATA  # one string for every message: only the difference is measured
    gc.collect()
    before = rss()
    base_ms = int(time.time() * 1000)
    t0 = time.perf_counter()
    decided = entry = items = None
    for start in range(0, n, batch):
        k = min(batch, n - start)
        items = tuple(ProduceItem(data, None, None, 0, DEFAULT_PRIORITY,
                                  str(uuid.uuid4()) if dedup else "") for _ in range(k))
        # ~20 produces per millisecond, each decided with its own clock reading
        decided = store.decide_produce_batch(ProduceBatchRequest("q", items, batch > 1),
                                             base_ms + start // 20)
        entry = decided[0]
        store.apply(entry)
    seconds = time.perf_counter() - t0
    del decided, entry, items
    gc.collect()
    added = rss() - before
    q = store.queues["q"]
    ids = q.dedup.ids
    out = {"bytes": added, "messages": len(q.messages), "ids": len(ids), "seconds": seconds}
    if ids:
        # What the table holds, object by object (sys.getsizeof: without the
        # allocator's rounding): its structure (the OrderedDict with its
        # nodes), the id strings, the (ref, accepted_ms) tuples, the refs
        # (msg_id ints of their own) and the accepted times that no message
        # shares (a message's ready time is the same int when it had no delay).
        messages = q.messages
        times = {}
        keys = values = refs = 0
        for key, value in ids.items():
            keys += sys.getsizeof(key)
            values += sys.getsizeof(value)
            refs += sys.getsizeof(value[0])
            at = value[1]
            if at is not messages[value[0]][READY_MS]:
                times[id(at)] = sys.getsizeof(at)
        out["objects"] = {"structure": sys.getsizeof(ids) / len(ids), "key": keys / len(ids),
                          "value": values / len(ids), "ref": refs / len(ids),
                          "time": sum(times.values()) / len(ids)}
    print(json.dumps(out))


def run_memory_child(n: int, batch: int, dedup: bool) -> dict:
    p = subprocess.run([sys.executable, os.path.abspath(__file__), "--memory-child",
                        f"{n},{batch},{int(dedup)}"], capture_output=True, text=True,
                       cwd=REPO_DIR, timeout=600)
    if p.returncode != 0:
        raise RuntimeError(f"memory child failed: {p.stderr[-2000:]}")
    got = json.loads(p.stdout.strip().splitlines()[-1])
    want_ids = n if dedup else 0
    if got["messages"] != n or got["ids"] != want_ids:
        raise RuntimeError(f"memory child: {got} (wanted {n} messages, {want_ids} ids)")
    return got


async def part_dedup(args: argparse.Namespace, root: str) -> list[str]:
    n = args.dedup_entries
    print(f"\n== dedup: memory per dedup id (a Store applying {n:,} ProduceBatch entries, "
          f"36-character UUID ids, against the same without ids; child processes), and CPU "
          f"per produce with a dedup id (one node in memory, single produces, {args.clients} "
          f"TCP clients x {args.window} in flight, {args.duration} s per run)", flush=True)
    meter = dur.LoadMeter()
    summary: list[str] = []
    # shape (entries of 1 message / of --batch) -> [(bytes per id, bytes per message without)]
    shapes = (("1 msg/entry", 1), (f"{args.batch:,} msgs/entry", args.batch))
    mem: dict[str, list[tuple[float, float]]] = {}
    objects: list[dict] = []  # the table's objects per id, 1 msg/entry
    loop = asyncio.get_running_loop()
    for i in range(args.repeat):
        for label, batch in shapes:
            got = {}
            for dedup in ((False, True) if i % 2 == 0 else (True, False)):
                got[dedup] = await loop.run_in_executor(None, run_memory_child, n, batch, dedup)
            per_id = (got[True]["bytes"] - got[False]["bytes"]) / n
            per_msg = got[False]["bytes"] / n
            mem.setdefault(label, []).append((per_id, per_msg))
            o = got[True]["objects"]
            if batch == 1:
                objects.append(o)
            print(f"  memory {label:16} run {i + 1}/{args.repeat}: {per_id:6.1f} bytes of RSS "
                  f"per dedup id ({per_msg:.1f} per message without); the table's objects per "
                  f"id: {sum(o.values()):.1f} = structure {o['structure']:.1f} + id "
                  f"{o['key']:.1f} + (ref, time) tuple {o['value']:.1f} + ref {o['ref']:.1f} + "
                  f"time {o['time']:.1f}; apply {got[True]['seconds']:.2f} s with ids, "
                  f"{got[False]['seconds']:.2f} s without", flush=True)
    print(f"\n  {'memory':16} {'RSS bytes per dedup id min / median / max':>42} "
          f"{'bytes/msg without':>17} {'objects/id':>10}")
    for label, vals in mem.items():
        ids = [v[0] for v in vals]
        msgs = [v[1] for v in vals]
        obj = ""
        if label == shapes[0][0] and objects:
            obj = f"{statistics.median(sum(o.values()) for o in objects):.1f}"
        print(f"  {label:16} {mmm(ids, '{:,.1f}'):>42} {statistics.median(msgs):>17,.1f} "
              f"{obj:>10}")
    per_one = [v[0] for v in mem.get(shapes[0][0], [])]
    many = [v[0] for v in mem.get(shapes[1][0], [])]
    if per_one and objects:
        med = {k: statistics.median(o[k] for o in objects) for k in objects[0]}
        summary.append(
            f"dedup table: {statistics.median(per_one):,.1f} bytes of RSS per 36-character id "
            f"({mmm(per_one, '{:,.1f}')}) with {n:,} single produces, "
            f"{statistics.median(many):,.1f} "
            f"({mmm(many, '{:,.1f}')}) in {args.batch:,}-message batches; its objects "
            f"{sum(med.values()):.1f} bytes per id (structure {med['structure']:.1f}, id "
            f"{med['key']:.1f}, tuple {med['value']:.1f}, ref {med['ref']:.1f}, time "
            f"{med['time']:.1f})")

    node = await cb.start_single(root, "dedup-node")
    results: dict[str, list[PipeResult]] = {}
    serial = 0
    try:
        print(f"  throughput: one node in memory, port {node.port}", flush=True)

        async def one(variant: str, duration: float, record: bool) -> None:
            nonlocal serial
            serial += 1
            queue = f"dedup{serial}"
            if variant == "plain":
                makers = [single_maker(queue) for _ in range(args.clients)]
            elif variant == "dedup_id":
                makers = [dedup_maker(queue, id_prefix()) for _ in range(args.clients)]
            else:
                prefix = id_prefix()
                fill = await pipe_run(node.port, [dedup_maker(queue, prefix)], window=args.window,
                                      per_request=1, cpu=node.cpu_seconds, count=RESEND_POOL)
                if fill.requests != RESEND_POOL:
                    raise RuntimeError(f"resend pool: {fill.requests} of {RESEND_POOL} "
                                       f"accepted ({fill.problem()})")
                # each client resends the pool from its own place in it
                makers = []
                for c in range(args.clients):
                    m = dedup_maker(queue, prefix, cycle=RESEND_POOL)
                    m(c * RESEND_POOL // args.clients)
                    makers.append(m)
            r = await pipe_run(node.port, makers, window=args.window, per_request=1,
                               cpu=node.cpu_seconds, duration=duration)
            if not node.alive:
                raise RuntimeError(f"{node.name} exited: {node.log_tail(5)}")
            size = (await cb.monitor(node.port, queue))["size"]
            await clear(node.port, queue)
            if not record:
                return
            rs = results.setdefault(variant, [])
            rs.append(r)
            want = RESEND_POOL if variant == "resend" else r.requests
            bad = r.problem()
            if size != want:
                bad += f"{'; ' if bad else ''}queue held {size:,}, not {want:,}"
            print(f"  {variant:8} run {len(rs)}/{args.repeat}: {r.req_rate:>9,.0f} req/s  "
                  f"{r.requests:,} produces in {r.elapsed_s:.2f} s  node CPU "
                  f"{r.node_us(r.requests):.2f} us/req  {_other(r)}"
                  + (f"  PROBLEM: {bad}" if bad else ""), flush=True)

        for variant in DEDUP_VARIANTS:
            await one(variant, min(1.0, args.duration), False)
        print("  warmed up: 1 s per variant", flush=True)
        for i in range(args.repeat):
            order = list(DEDUP_VARIANTS)
            if i % 2:
                order.reverse()
            for variant in order:
                await one(variant, args.duration, True)
    finally:
        await node.stop()

    print(f"\n  {'variant':8} {'runs':>4} {'req/s min / median / max':>32} {'x plain':>7} "
          f"{'node us/req':>11} {'x plain':>7}")
    base = results.get("plain", [])
    base_us = [r.node_us(r.requests) for r in base]
    for variant in DEDUP_VARIANTS:
        rs = results.get(variant, [])
        if not rs:
            continue
        rates = [r.req_rate for r in rs]
        us = [r.node_us(r.requests) for r in rs]
        x = _ratio(rates, [r.req_rate for r in base])
        print(f"  {variant:8} {len(rs):>4} {mmm(rates):>32} {x:>7.2f} "
              f"{statistics.median(us):>11.2f} {_ratio(us, base_us):>7.2f}")
    if base:
        b = [r.req_rate for r in base]
        for variant in DEDUP_VARIANTS[1:]:
            rs = results.get(variant, [])
            if rs:
                rates = [r.req_rate for r in rs]
                us = [r.node_us(r.requests) for r in rs]
                what = ("a new dedup_id" if variant == "dedup_id"
                        else "a resent dedup_id (duplicate)")
                summary.append(f"produce with {what}: {statistics.median(rates):,.0f} req/s "
                               f"against {statistics.median(b):,.0f} without: x"
                               f"{_ratio(rates, b):.2f} req/s, x{_ratio(us, base_us):.2f} node "
                               f"CPU per produce ({statistics.median(us):.1f} against "
                               f"{statistics.median(base_us):.1f} us)")
    print(f"  {meter.line()}", flush=True)
    return summary


# -- part priority -----------------------------------------------------------

class _TreeNode(dur.Node):
    """durability_bench's Node, running the qserver of another source tree."""

    def __init__(self, name: str, config_path: str, port: int, log_path: str,
                 src: str) -> None:
        self.name = name
        self.config_path = config_path
        self.port = port
        self.log_path = log_path
        self._log = open(log_path, "ab")  # closed by stop/kill_now
        self.started_at = time.perf_counter()
        env = dict(os.environ, PYTHONPATH=src)
        # cwd=src: `python -m` puts the working directory first on sys.path.
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "qserver", "run", "--config", config_path],
            stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=src,
            env=env)
        dur._ALL_NODES.append(self)


async def start_tree_node(root: str, name: str, src: str) -> dur.Node:
    port = dur.free_port()
    path = os.path.join(root, f"{name}.xml")
    cb.write_file(path, cb.single_node_config(port))
    node = _TreeNode(name, path, port, os.path.join(root, f"{name}.log"), src)
    await dur.wait_answer(node, {"action": 104}, lambda a: a.get("code") == 0, 60.0)
    return node


def tree_head(src: str) -> str:
    """`git log -1` of a source tree ("" if it is no git checkout)."""
    return subprocess.run(["git", "log", "-1", "--format=%h %s"], cwd=src,
                          capture_output=True, text=True).stdout.strip()


@dataclass
class PrioRun:
    produce: PipeResult
    drain: cb.DrainResult


async def part_priority(args: argparse.Namespace, root: str) -> list[str]:
    n = args.priority_messages
    print(f"\n== priority: {n:,} single produces per run ({args.clients} TCP clients x "
          f"{args.window} in flight), then drained by {args.consumers} closed-loop consumers "
          f"(single consumes, and after a second fill consume count={args.count}); one node "
          f"in memory", flush=True)
    meter = dur.LoadMeter()
    nodes: dict[str, dur.Node] = {}
    results: dict[tuple[str, str], list[PrioRun]] = {}
    variants = list(PRIO_VARIANTS)
    serial = 0
    try:
        nodes["this"] = await cb.start_single(root, "prio-node")
        print(f"  this tree: port {nodes['this'].port}", flush=True)
        if args.baseline:
            nodes["baseline"] = await start_tree_node(root, "prio-baseline", args.baseline)
            head = tree_head(args.baseline)
            print(f"  baseline tree {args.baseline} ({head[:80] or 'not a git checkout'}): "
                  f"port {nodes['baseline'].port}, runs `plain` only", flush=True)
            variants.insert(1, "plain@base")

        async def one(variant: str, form: str, count: int, record: bool) -> None:
            nonlocal serial
            node = nodes["baseline" if variant == "plain@base" else "this"]
            serial += 1
            queue = f"prio{serial}"
            every = {"plain": 0, "plain@base": 0, "10% prio": PRIO_EVERY, "all prio": 1}[variant]
            makers = [priority_maker(queue, every, c * 1_000_003) for c in range(args.clients)]
            p = await pipe_run(node.port, makers, window=args.window, per_request=1,
                               cpu=node.cpu_seconds, count=count)
            size = (await cb.monitor(node.port, queue))["size"]
            d = await cb.drain(node.port, queue, size, clients=args.consumers,
                               count=args.count if form == "count" else None, confirm=None,
                               cpu=node.cpu_seconds)
            if not node.alive:
                raise RuntimeError(f"{node.name} exited: {node.log_tail(5)}")
            if not record:
                return
            rs = results.setdefault((variant, form), [])
            rs.append(PrioRun(p, d))
            bad = "; ".join(x for x in (p.problem(), d.problems(False),
                                        "" if size == count else f"queue held {size:,}") if x)
            fname = "single" if form == "single" else f"count={args.count}"
            print(f"  {variant:10} {fname:9} run {len(rs)}/{args.repeat}: produce "
                  f"{p.rate:>8,.0f} msg/s ({p.node_us():.2f} us/msg)  drain {d.rate:>9,.0f} "
                  f"msg/s ({d.node_cpu_s / max(d.delivered, 1) * 1e6:.2f} us/msg)  "
                  f"{_other(p)}" + (f"  PROBLEM: {bad}" if bad else ""), flush=True)

        for variant in variants:
            for form in DRAIN_FORMS:
                await one(variant, form, min(5000, n), False)
        print("  warmed up: 5,000 messages per variant and drain form", flush=True)
        for i in range(args.repeat):
            order = variants if i % 2 == 0 else variants[::-1]
            for variant in order:
                for form in (DRAIN_FORMS if i % 2 == 0 else DRAIN_FORMS[::-1]):
                    await one(variant, form, n, True)
    finally:
        await asyncio.gather(*(node.stop() for node in nodes.values()))

    def rates(variant: str, what: str) -> list[float]:
        """produce msg/s over both fills, or drain msg/s of one form."""
        if what == "produce":
            return [r.produce.rate for f in DRAIN_FORMS for r in results.get((variant, f), [])]
        return [r.drain.rate for r in results.get((variant, what), [])]

    def cpu(variant: str, what: str) -> list[float]:
        if what == "produce":
            return [r.produce.node_us() for f in DRAIN_FORMS
                    for r in results.get((variant, f), [])]
        return [r.drain.node_cpu_s / max(r.drain.delivered, 1) * 1e6
                for r in results.get((variant, what), [])]

    whats = (("produce", "produce (single)"), ("single", "drain, single consume"),
             ("count", f"drain, consume count={args.count}"))
    print(f"\n  {'variant':10} {'what':26} {'runs':>4} {'msg/s min / median / max':>32} "
          f"{'x plain':>7} {'node us/msg':>11} {'x plain':>7}")
    for variant in variants:
        for what, label in whats:
            rr = rates(variant, what)
            if not rr:
                continue
            us = cpu(variant, what)
            print(f"  {variant:10} {label:26} {len(rr):>4} {mmm(rr):>32} "
                  f"{_ratio(rr, rates('plain', what)):>7.2f} {statistics.median(us):>11.2f} "
                  f"{_ratio(us, cpu('plain', what)):>7.2f}")
    summary = []
    for variant in variants[1:]:
        # plain@base: this tree's plain against it; the others against plain
        this, other = ("plain", variant) if variant == "plain@base" else (variant, "plain")
        parts = []
        for what, label in whats:
            rr, base = rates(this, what), rates(other, what)
            if rr and base:
                us, base_us = cpu(this, what), cpu(other, what)
                parts.append(f"{label} x{_ratio(rr, base):.2f} msg/s ({statistics.median(rr):,.0f} "
                             f"against {statistics.median(base):,.0f}), x{_ratio(us, base_us):.2f} "
                             f"node CPU/msg ({statistics.median(us):.1f} against "
                             f"{statistics.median(base_us):.1f} us)")
        name = ("plain messages, this tree against the baseline tree" if variant == "plain@base"
                else f"{variant} against plain")
        summary.append(f"priority: {name}: " + "; ".join(parts))
    print(f"  {meter.line()}", flush=True)
    return summary


# -- main ------------------------------------------------------------------

PARTS = ("batch", "dedup", "priority")


def _choice(names: tuple[str, ...]):
    def parse(text: str) -> tuple[str, ...]:
        chosen = tuple(x.strip() for x in text.split(",") if x.strip())
        if not chosen or any(x not in names for x in chosen):
            raise argparse.ArgumentTypeError("choose from " + ",".join(names))
        return tuple(x for x in names if x in chosen)
    return parse


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="batch produce, dedup ids and priorities, "
                                            "measured in one run")
    p.add_argument("--parts", type=_choice(PARTS), default=PARTS,
                   help="comma-separated subset of batch,dedup,priority (default all)")
    p.add_argument("--repeat", type=int, default=3, help="runs per variant (default 3)")
    p.add_argument("--targets", type=_choice(("node", "cluster")), default=("node", "cluster"),
                   help="comma-separated subset of node,cluster for part batch (default both)")
    p.add_argument("--clients", "-c", type=int, default=4,
                   help="producer connections (default 4)")
    p.add_argument("--window", type=int, default=WINDOW,
                   help=f"single produces in flight per client (default {WINDOW})")
    p.add_argument("--batch", type=int, default=BATCH,
                   help=f"messages per batch produce (default {BATCH})")
    p.add_argument("--duration", type=float, default=3.0,
                   help="seconds per timed run (default 3)")
    p.add_argument("--dedup-entries", type=int, default=200_000,
                   help="entries applied per memory measurement (default 200000)")
    p.add_argument("--priority-messages", type=int, default=50_000,
                   help="messages per fill in part priority (default 50000)")
    p.add_argument("--consumers", type=int, default=8,
                   help="closed-loop consumers of part priority's drains (default 8)")
    p.add_argument("--count", type=int, default=100,
                   help="the batch consume's count in part priority (default 100)")
    p.add_argument("--baseline", default=None, metavar="DIR",
                   help="another source tree whose node runs part priority's plain variant")
    p.add_argument("--engine", choices=("native", "raft"), default="native",
                   help="the cluster's engine (default native)")
    p.add_argument("--keep", action="store_true",
                   help="keep the run directory (configs, node logs, data) and say where")
    p.add_argument("--dir", default=None, help="where the run directory goes "
                                                "(default: the system's temporary directory)")
    p.add_argument("--memory-child", default=None, help=argparse.SUPPRESS)
    return p


async def _run(args: argparse.Namespace, root: str) -> list[str]:
    summary = []
    if "batch" in args.parts:
        summary += await part_batch(args, root)
    if "dedup" in args.parts:
        summary += await part_dedup(args, root)
    if "priority" in args.parts:
        summary += await part_priority(args, root)
    return summary


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.memory_child:
        memory_child(args.memory_child)
        return 0
    if not 1 <= args.batch <= BATCH:
        raise SystemExit(f"--batch must be between 1 and {BATCH}")
    if args.repeat < 1 or args.clients < 1 or args.window < 1:
        raise SystemExit("--repeat, --clients and --window must be at least 1")
    if args.baseline:
        args.baseline = os.path.abspath(args.baseline)
        if not os.path.isfile(os.path.join(args.baseline, "qserver", "__main__.py")):
            raise SystemExit(f"--baseline {args.baseline}: no qserver/__main__.py there")
    base = args.dir or tempfile.gettempdir()
    os.makedirs(base, exist_ok=True)
    root = tempfile.mkdtemp(prefix="qserver-producer-", dir=base)
    print("$ " + shlex.join([sys.executable, sys.argv[0]]
                            + (sys.argv[1:] if argv is None else argv)))
    print(f"qserver at {tree_head(REPO_DIR)[:100]}")
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
