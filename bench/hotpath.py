"""qserver's per-request Python cost, in process, against the no-op floor.

    python bench/hotpath.py [--n 50000] [--repeat 5] [--protos tcp,udp]
                            [--modes produce,consume,confirm] [--prefill N]
                            [--profile] [--storage off|batch|always] [--turn K]
                            [--loop uvloop|asyncio]

No sockets: the request bytes go straight into the protocol classes
(`ClientTcpProtocol.data_received`, `ClientUdpProtocol.datagram_received`)
of a single node, and into the floor's (`bench/noop_server.NoopTcp`,
`NoopUdp`), each with a fake transport that drops what is written. What is
timed is therefore exactly the Python work per request that the event loop
calls: framing, validation, store, log, engine and the encoded answer on
qserver's side; framing and the encoded echo on the floor's. The difference
is qserver's own cost, the one bench/run_bench.py sees as the gap to the
floor.

Each repeat starts a fresh node and runs, in order, `--n` produces (the load
generator's request: queue "bench", 40 bytes of data, absolute delay and
ttl, retry 30, a seq), `--n` consumes (each delivers one of those messages,
which moves to the retry index) and `--n` confirms of the delivered ids.
The floor gets the same bytes. The garbage collector is set as the server
sets it.

`--prefill N` first produces N messages, untimed, so that the steps run
against a larger store and, from the node's log_size (100,000) on, a full
log that frees its oldest records as it goes: the server's steady state,
where the garbage collector costs more per request (it scans the young
log records and messages). Without it the log never fills.

Prints min/median/max microseconds of CPU time per request for both
sides (process time, so that other load on a shared machine moves the
figures less than wall time would), the difference of the medians and the
ratio.

`--profile` runs one repeat of each selected step under cProfile instead
and prints the top functions.

`--storage off|batch|always` adds a third side: the same node with
`<storage fsync=...>` in a temporary directory (real files, real writes and
syncs: issue 16's first goal, a node with storage against the node in
memory, measured without sockets). Its answers wait for the records'
write at the end of the event-loop turn, so with it every side is fed in
turns of `--turn` requests (8 by default: the load generator's 8 clients),
with one loop iteration after each; that iteration's cost counts on every
side. The storage side's figures include the system time of its writes
(process time is user plus system).

The event loop is uvloop's, the one `qserver run` uses (`--loop asyncio`:
the standard library's, whose pure-Python call_soon and loop iteration
cost a node with storage more: it schedules a flush every turn).
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import dataclasses
import gc
import os
import pstats
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import orjson

from noop_server import NoopTcp, NoopUdp
from qserver.config import Config, Fsync
from qserver.node import GC_THRESHOLDS, Node
from qserver.server import ClientTcpProtocol, ClientUdpProtocol
from qserver.wire.codec import DEFAULT_MAX_REQUEST_SIZE, MAX_UDP_PAYLOAD

MODES = ("produce", "consume", "confirm")
PROTOS = ("tcp", "udp")
QUEUE = "bench"
DATA = "x" * 40  # bench/loadgen.py's DEFAULT_DATA
ADDR = ("127.0.0.1", 40000)


class FakeTransport:
    """Takes what a protocol writes and drops it; counts the answers."""

    def __init__(self) -> None:
        self.writes = 0
        self.last = b""

    def write(self, data: bytes) -> None:
        self.writes += data.count(b"\n")  # answers: a write may carry several
        self.last = data

    def sendto(self, data: bytes, addr) -> None:
        self.writes += 1
        self.last = data

    # Back-pressure (server.ClientTcpProtocol): a client that always reads.
    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        pass

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass

    def close(self) -> None:
        pass


def requests(mode: str, n: int, now_s: int) -> list[bytes]:
    """The n request payloads of one step, as the load generator frames them."""
    if mode == "produce":
        return [orjson.dumps({"action": 1, "queue": QUEUE, "delay": now_s, "ttl": now_s + 300,
                              "retry": 30, "data": DATA, "seq": i + 1}) for i in range(n)]
    if mode == "consume":
        return [orjson.dumps({"action": 2, "queue": QUEUE, "seq": i + 1}) for i in range(n)]
    if mode == "confirm":
        return [orjson.dumps({"action": 3, "queue": QUEUE, "msg_id": i + 1, "seq": i + 1})
                for i in range(n)]
    raise ValueError(mode)


def feeder(proto: str, handlers: list):
    """A function that delivers the i-th payload as the loop would: over
    TCP to connection i modulo their number (each a client of its own)."""
    if proto == "tcp":
        receivers = [h.data_received for h in handlers]
        if len(receivers) == 1:
            return lambda i, payload: receivers[0](payload)
        n = len(receivers)
        return lambda i, payload: receivers[i % n](payload)
    receive = handlers[0].datagram_received
    return lambda i, payload: receive(payload, ADDR)


@dataclasses.dataclass
class Side:
    """One server under test, fresh for each repeat: its connections (one
    UDP socket; over TCP one per client of a turn) and their transports."""

    handlers: list
    transports: list[FakeTransport]
    node: Node | None = None
    directory: str | None = None

    @property
    def answers(self) -> int:
        return sum(t.writes for t in self.transports)

    async def close(self) -> None:
        if self.node is not None and self.directory is not None:
            await self.node.engine.close()
            shutil.rmtree(self.directory, ignore_errors=True)


def _connect(make_handler, proto: str, clients: int) -> tuple[list, list[FakeTransport]]:
    handlers, transports = [], []
    for _ in range(clients if proto == "tcp" else 1):
        handler = make_handler()
        transport = FakeTransport()
        handler.connection_made(transport)
        handlers.append(handler)
        transports.append(transport)
    return handlers, transports


def _serve(node: Node, proto: str, clients: int) -> tuple[list, list[FakeTransport]]:
    return _connect((lambda: ClientTcpProtocol(node)) if proto == "tcp"
                    else (lambda: ClientUdpProtocol(node)), proto, clients)


async def make_qserver(proto: str, clients: int) -> Side:
    node = Node(Config.default())
    return Side(*_serve(node, proto, clients), node=node)


def storage_maker(fsync: Fsync):
    """The maker of a node with <storage fsync=...> in a fresh directory."""
    async def make_storage(proto: str, clients: int) -> Side:
        directory = tempfile.mkdtemp(prefix="qserver-hotpath-")
        node = Node(dataclasses.replace(Config.default(), storage_dir=directory, fsync=fsync))
        await node.engine.start()
        for _ in range(500):  # it elects itself at once; up to 5 s on a slow machine
            if node.engine.leader() is not None:
                break
            await asyncio.sleep(0.01)
        return Side(*_serve(node, proto, clients), node=node, directory=directory)
    return make_storage


async def make_floor(proto: str, clients: int) -> Side:
    return Side(*_connect(
        (lambda: NoopTcp(DEFAULT_MAX_REQUEST_SIZE)) if proto == "tcp"
        else (lambda: NoopUdp(MAX_UDP_PAYLOAD)), proto, clients))


async def feed_all(feed, batch: list[bytes], turn: int) -> None:
    """Every payload of `batch`; with `turn`, one loop iteration after each
    `turn` of them (where a node with storage writes and answers)."""
    if not turn:
        for i, p in enumerate(batch):
            feed(i, p)
        return
    for start in range(0, len(batch), turn):
        for i in range(start, min(start + turn, len(batch))):
            feed(i, batch[i])
        await asyncio.sleep(0)


async def answered(side: Side, count: int) -> None:
    """Wait until `count` answers are out: loop iterations, then (answers
    that wait for a timer, such as a batch fsync) up to 5 s."""
    for i in range(5100):
        if side.answers >= count:
            return
        await asyncio.sleep(0 if i < 100 else 0.001)


async def run_steps(name: str, make, proto: str, modes, payloads: dict, profile: bool = False,
                    prefill: list[bytes] = (), turn: int = 0) -> dict:
    """One repeat: a fresh server (`make`, called `name`), then each step in
    order; us/request per step."""
    side = await make(proto, max(turn, 1))
    feed = feeder(proto, side.handlers)
    try:
        await feed_all(feed, prefill, turn)
        await answered(side, len(prefill))
        out = {}
        for mode in MODES:
            batch = payloads[mode]
            if mode not in modes and mode != "produce":
                continue
            before = side.answers
            if profile and mode in modes:
                prof = cProfile.Profile()
                prof.enable()
                await feed_all(feed, batch, turn)
                await answered(side, before + len(batch))
                prof.disable()
                print(f"--- {name} {proto} {mode}")
                pstats.Stats(prof).sort_stats("tottime").print_stats(12)
            else:
                t0 = time.process_time()
                await feed_all(feed, batch, turn)
                await answered(side, before + len(batch))
                out[mode] = (time.process_time() - t0) / len(batch) * 1e6
            if side.answers - before != len(batch):
                raise SystemExit(f"{name} {proto} {mode}: {side.answers - before} "
                                 f"answers to {len(batch)} requests")
            if mode == "consume" and side.node is not None and not any(
                    b'"msg_id"' in t.last for t in side.transports):
                raise SystemExit("consume ran dry: the step does not measure a delivery")
        return out
    finally:
        await side.close()


def stats(values: list[float]) -> str:
    return f"{min(values):6.2f} {statistics.median(values):6.2f} {max(values):6.2f}"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, default=50_000, help="requests per step")
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--protos", default=",".join(PROTOS))
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--prefill", type=int, default=0, metavar="N",
                   help="produce N messages first, untimed")
    p.add_argument("--profile", action="store_true")
    p.add_argument("--storage", choices=[f.value for f in Fsync],
                   help="add a node with <storage fsync=...> (a temporary directory)")
    p.add_argument("--loop", choices=("uvloop", "asyncio"), default="uvloop",
                   help="the event loop (default uvloop, as `qserver run`)")
    p.add_argument("--turn", type=int, default=None, metavar="K",
                   help="requests per event-loop turn (default: 8 with --storage, else "
                        "all at once)")
    return p.parse_args(argv)


async def main(args: argparse.Namespace) -> int:
    protos = args.protos.split(",")
    modes = args.modes.split(",")
    turn = args.turn if args.turn is not None else (8 if args.storage else 0)
    makers = {"floor": make_floor, "qserver": make_qserver}
    if args.storage:
        makers[f"storage-{args.storage}"] = storage_maker(Fsync(args.storage))
    names = list(makers)
    gc.set_threshold(*GC_THRESHOLDS)
    now_s = int(time.time())
    payloads = {m: requests(m, args.n, now_s) for m in MODES}
    prefill = requests("produce", args.prefill, now_s)
    gc.freeze()
    if args.profile:
        for proto in protos:
            for name in names[1:]:
                await run_steps(name, makers[name], proto, modes, payloads, profile=True,
                                prefill=prefill, turn=turn)
        return 0
    # warm-up (imports, first queue, caches)
    for proto in protos:
        for name, make in makers.items():
            await run_steps(name, make, proto, modes,
                            {m: b[:2000] for m, b in payloads.items()}, turn=turn)
    results = {(proto, name, mode): [] for proto in protos for name in names for mode in modes}
    for r in range(args.repeat):
        for proto in protos:
            for name in (names if r % 2 == 0 else names[::-1]):
                got = await run_steps(name, makers[name], proto, modes, payloads,
                                      prefill=prefill, turn=turn)
                for mode in modes:
                    results[(proto, name, mode)].append(got[mode])
                gc.collect()
    print(f"CPU us per request, {args.repeat} repeats of {args.n}"
          f"{f' after {args.prefill:,} untimed produces' if args.prefill else ''}"
          f"{f', {turn} per loop turn' if turn else ''}: min median max")
    header = f"{'proto':5} {'mode':8} | {'floor':^20} | {'qserver':^20} | {'diff':>6} {'ratio':>6}"
    if args.storage:
        header += f" | {names[2]:^20} | {'x memory':>8}"
    print(header)
    for proto in protos:
        for mode in modes:
            f = results[(proto, "floor", mode)]
            q = results[(proto, "qserver", mode)]
            diff = statistics.median(q) - statistics.median(f)
            ratio = statistics.median(q) / statistics.median(f)
            line = f"{proto:5} {mode:8} | {stats(f)} | {stats(q)} | {diff:6.2f} {ratio:6.2f}"
            if args.storage:
                st = results[(proto, names[2], mode)]
                # as throughput: memory's CPU per request over the storage node's
                line += f" | {stats(st)} | {statistics.median(q) / statistics.median(st):8.2f}"
            print(line)
    return 0


if __name__ == "__main__":
    _args = parse_args()
    if _args.loop == "uvloop":
        import uvloop

        sys.exit(uvloop.run(main(_args)))
    sys.exit(asyncio.run(main(_args)))
