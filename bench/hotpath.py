"""qserver's per-request Python cost, in process, against the no-op floor.

    python bench/hotpath.py [--n 50000] [--repeat 5] [--protos tcp,udp]
                            [--modes produce,consume,confirm] [--prefill N]
                            [--profile]

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
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import gc
import os
import pstats
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import orjson

from noop_server import NoopTcp, NoopUdp
from qserver.config import Config
from qserver.node import GC_THRESHOLDS, Node
from qserver.server import ClientTcpProtocol, ClientUdpProtocol
from qserver.wire.codec import DEFAULT_MAX_REQUEST_SIZE, MAX_UDP_PAYLOAD

MODES = ("produce", "consume", "confirm")
PROTOS = ("tcp", "udp")
QUEUE = "bench"
DATA = "x" * 40  # bench/loadgen.py's DEFAULT_DATA
ADDR = ("127.0.0.1", 40000)


class FakeTransport:
    """Takes what a protocol writes and drops it; counts the writes."""

    def __init__(self) -> None:
        self.writes = 0
        self.last = b""

    def write(self, data: bytes) -> None:
        self.writes += 1
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


def feeder(proto: str, handler):
    """A function that delivers one payload to `handler` as the loop would."""
    if proto == "tcp":
        return handler.data_received
    receive = handler.datagram_received
    return lambda payload: receive(payload, ADDR)


def make_qserver(proto: str):
    node = Node(Config.default())
    handler = ClientTcpProtocol(node) if proto == "tcp" else ClientUdpProtocol(node)
    transport = FakeTransport()
    handler.connection_made(transport)
    return handler, transport


def make_floor(proto: str):
    handler = NoopTcp(DEFAULT_MAX_REQUEST_SIZE) if proto == "tcp" else NoopUdp(MAX_UDP_PAYLOAD)
    transport = FakeTransport()
    handler.connection_made(transport)
    return handler, transport


def run_steps(make, proto: str, modes, payloads: dict, profile: str | None = None,
              prefill: list[bytes] = ()) -> dict:
    """One repeat: a fresh server, then each step in order; us/request per step."""
    handler, transport = make(proto)
    feed = feeder(proto, handler)
    for p in prefill:
        feed(p)
    out = {}
    for mode in MODES:
        batch = payloads[mode]
        if mode not in modes and mode != "produce":
            continue
        before = transport.writes
        if profile and mode in modes:
            prof = cProfile.Profile()
            prof.enable()
            for p in batch:
                feed(p)
            prof.disable()
            print(f"--- {profile} {proto} {mode}")
            pstats.Stats(prof).sort_stats("tottime").print_stats(12)
        else:
            t0 = time.process_time()
            for p in batch:
                feed(p)
            out[mode] = (time.process_time() - t0) / len(batch) * 1e6
        if transport.writes - before != len(batch):
            raise SystemExit(f"{proto} {mode}: {transport.writes - before} answers "
                             f"to {len(batch)} requests")
        if mode == "consume" and make is make_qserver and b'"msg_id"' not in transport.last:
            raise SystemExit("consume ran dry: the step does not measure a delivery")
    return out


def stats(values: list[float]) -> str:
    return f"{min(values):6.2f} {statistics.median(values):6.2f} {max(values):6.2f}"


async def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, default=50_000, help="requests per step")
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--protos", default=",".join(PROTOS))
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--prefill", type=int, default=0, metavar="N",
                   help="produce N messages first, untimed")
    p.add_argument("--profile", action="store_true")
    args = p.parse_args(argv)
    protos = args.protos.split(",")
    modes = args.modes.split(",")
    gc.set_threshold(*GC_THRESHOLDS)
    now_s = int(time.time())
    payloads = {m: requests(m, args.n, now_s) for m in MODES}
    prefill = requests("produce", args.prefill, now_s)
    gc.freeze()
    if args.profile:
        for proto in protos:
            run_steps(make_qserver, proto, modes, payloads, profile="qserver", prefill=prefill)
        return 0
    # warm-up (imports, first queue, caches)
    for proto in protos:
        for make in (make_floor, make_qserver):
            run_steps(make, proto, modes, {m: b[:2000] for m, b in payloads.items()})
    results = {(proto, side, mode): [] for proto in protos for side in ("floor", "qserver")
               for mode in modes}
    for r in range(args.repeat):
        for proto in protos:
            order = (make_floor, make_qserver) if r % 2 == 0 else (make_qserver, make_floor)
            for make in order:
                side = "floor" if make is make_floor else "qserver"
                got = run_steps(make, proto, modes, payloads, prefill=prefill)
                for mode in modes:
                    results[(proto, side, mode)].append(got[mode])
                gc.collect()
    print(f"CPU us per request, {args.repeat} repeats of {args.n}"
          f"{f' after {args.prefill:,} untimed produces' if args.prefill else ''}: min median max")
    print(f"{'proto':5} {'mode':8} | {'floor':^20} | {'qserver':^20} | {'diff':>6} {'ratio':>6}")
    for proto in protos:
        for mode in modes:
            f = results[(proto, "floor", mode)]
            q = results[(proto, "qserver", mode)]
            diff = statistics.median(q) - statistics.median(f)
            ratio = statistics.median(q) / statistics.median(f)
            print(f"{proto:5} {mode:8} | {stats(f)} | {stats(q)} | {diff:6.2f} {ratio:6.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
