"""What a replicating master spends per produce, in process: a node of a
three-node quorum cluster, against one node in memory fed the same way.

    python bench/master_bench.py [--n 20000] [--turn 4] [--repeat 5]
                                 [--storage] [--instructions]
                                 [--qserver-src DIR]

The master is a real `Node` (service, ClusterEngine, NativeCore, store,
log; with `--storage`, `<storage fsync="batch">` in a temporary directory)
whose peer links are a stand-in: what the adapter sends is kept, and each
push is answered as the slave it went to would (a PushReply for all of
it), as the peer link would deliver it (msgpack-decoded). The clients are
`--turn` TCP connections with fake transports (bench/hotpath.py's), one
produce each per turn, as loadgen's closed loop sends them (8 clients put
about 3 to 4 produces in a quorum master's turn). One turn is what the
event loop does for them:

1. reads: each connection's `data_received` (framing, the service's
   decision, the engine's proposal: appended, applied, waiting);
2. flush (push): the adapter's end-of-turn flush (its records on disk with
   `--storage`, the push to the slaves);
3. replies: the slaves' acknowledgements, as the peer link hands them over
   (`_on_message`: the commit);
4. flush (answers): the flush that answers the turn's produces and writes
   them to their connections.

The slaves' side (decoding the push, making its reply) is not counted.
Prints CPU us per produce (process time, min and median over `--repeat`
fresh nodes) for the master, split into the four steps, and for one node
in memory (the single-node fast path: answered in `data_received`), fed
the same turns in the same run.

`--instructions` counts instructions per produce under valgrind's callgrind
instead (two runs of different lengths, the difference per produce), with
the adapter's clock frozen but for one ms a turn, so that its timers
(heartbeats, the spare slave's pushes) do the same work on every run: the
same figure on every run within about 0.5%, where the CPU time moves by a
fifth on a shared machine. The master's figure then includes the
stand-in slaves' work (decoding each push, encoding its reply), the same
for every tree. `--qserver-src DIR` measures another tree (`git
archive REV | tar -x -C DIR`), for before/after figures.

The first line says whether the hot path ran compiled (qserver/compiled.py;
`QSERVER_PURE=1` for the same as Python). Either way the clock is frozen
under `--instructions`: the driver reads it through a module variable
(`driver.now_ms`), which compiled code looks up at every call.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import gc
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
REPO_DIR = BENCH_DIR.parent
STEPS = ("reads", "flush (push)", "replies", "flush (answers)")


class StandInNet:
    """The adapter's side of PeerNetwork: what it sends is kept, both slaves
    are always linked."""

    address = ("127.0.0.1", 0)

    def __init__(self, msgpack) -> None:
        self.sent: list[tuple[int, bytes]] = []
        self._pack = msgpack.Packer().pack

    def encode(self, obj: object) -> bytes:
        return self._pack(obj)

    def send_encoded(self, peer_id: int, body: bytes) -> bool:
        self.sent.append((peer_id, body))
        return True

    def send(self, peer_id: int, obj: object) -> bool:
        return self.send_encoded(peer_id, self._pack(obj))

    def flush(self, peer_id: int) -> None:
        pass

    def flush_all(self) -> None:
        pass

    def connected(self, peer_id: int) -> bool:
        return True

    def connected_ids(self) -> set[int]:
        return {2, 3}

    async def start(self) -> None:
        pass

    async def close(self) -> None:
        pass


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, default=20_000, help="produces per run")
    p.add_argument("--turn", type=int, default=4, help="produces (connections) per turn")
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--storage", action="store_true", help='<storage fsync="batch">')
    p.add_argument("--instructions", action="store_true",
                   help="count instructions under valgrind's callgrind instead of timing")
    p.add_argument("--qserver-src", default=None, help="measure this tree instead")
    p.add_argument("--measure-only", default=None, choices=("master", "single"),
                   help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.instructions:
        return _instructions(args)
    sys.path.insert(0, str(Path(args.qserver_src).resolve() if args.qserver_src else REPO_DIR))
    # qserver first: bench/hotpath.py puts this checkout first on sys.path,
    # and another tree's qserver must be the one imported.
    import qserver.node  # noqa: F401
    sys.path.insert(0, str(BENCH_DIR))
    import uvloop
    return uvloop.run(_measure(args))


async def _measure(args: argparse.Namespace) -> int:
    if args.measure_only is not None:  # one run, for _instructions
        await _run(args, master=args.measure_only == "master", frozen_clock=True)
        return 0
    import qserver.compiled
    print(f"qserver's modules: {qserver.compiled.status()}")
    print(f"{args.n} produces in turns of {args.turn}, {args.repeat} fresh nodes each; "
          f"CPU us per produce{' (with storage, fsync=batch)' if args.storage else ''}")
    for master in (False, True):
        runs = [await _run(args, master=master, frozen_clock=False) for _ in range(args.repeat)]
        totals = sorted(sum(r) for r in runs)
        name = "quorum master" if master else "one node in memory"
        print(f"  {name:20s} min {totals[0]:6.2f}  median {statistics.median(totals):6.2f}")
        if master:
            for i, step in enumerate(STEPS):
                print(f"    {step:18s} median {statistics.median(r[i] for r in runs):6.2f}")
    return 0


async def _run(args: argparse.Namespace, *, master: bool, frozen_clock: bool) -> list[float]:
    """One fresh node fed `args.n` produces: CPU us per produce of each step
    (one node in memory: all in the first)."""
    import msgpack

    from hotpath import FakeTransport, requests
    from qserver.config import Config, Fsync, PeerConfig
    from qserver.engines.messages import Push, PushReply, message_from_wire, message_to_wire
    from qserver.engines.native import driver
    from qserver.node import GC_THRESHOLDS, Node
    from qserver.server import ClientTcpProtocol

    directory = tempfile.mkdtemp(prefix="qserver-master-bench-")
    config = Config.default()
    if master:
        config = dataclasses.replace(config, node_id=1, peers=tuple(
            PeerConfig(node_id=i, host="127.0.0.1", port=1 + i) for i in (1, 2, 3)))
        if args.storage:
            config = dataclasses.replace(config, storage_dir=directory, fsync=Fsync.BATCH)
    node = Node(config)
    engine = node.engine
    net = StandInNet(msgpack)
    real_now = driver.now_ms
    clock = [real_now()]
    if master:
        engine.net = net  # type: ignore[attr-defined]  # before start(): no sockets
        engine.forwarder.net = net  # type: ignore[attr-defined]
        await engine.start()
        engine.core.vote_id += 1  # type: ignore[attr-defined]
        engine.core._become_master(real_now())  # type: ignore[attr-defined]  # as if elected
    if frozen_clock:
        driver.now_ms = lambda: clock[0]
    handlers, transports = [], []
    for _ in range(args.turn):
        handler, transport = ClientTcpProtocol(node), FakeTransport()
        handler.connection_made(transport)  # type: ignore[arg-type]
        handlers.append(handler)
        transports.append(transport)
    payloads = [r + b"\n" for r in requests("produce", args.n, int(time.time()))]

    def replies() -> list[tuple[int, object]]:
        """Each push answered by the slave it went to, as its link delivers it."""
        out = []
        for peer_id, body in net.sent:
            msg = message_from_wire(msgpack.unpackb(body))
            if type(msg) is Push:
                reply = PushReply(vote_id=msg.vote_id, node_id=peer_id,
                                  match_id=msg.prev_trans_id + len(msg.records),
                                  read_round=msg.read_round)
                out.append((peer_id, msgpack.unpackb(msgpack.packb(message_to_wire(reply)))))
        net.sent.clear()
        return out

    def deliver(items: list[tuple[int, object]]) -> None:
        for peer_id, obj in items:
            engine._on_message(peer_id, obj)  # type: ignore[attr-defined]

    for _ in range(20):  # the new master's first pushes answered: both slaves in step
        await asyncio.sleep(0)
        deliver(replies())
    gc.collect()
    gc.set_threshold(*GC_THRESHOLDS)  # as the node runs
    spent = [0.0] * 4
    cpu = time.process_time
    i = 0
    try:
        while i < args.n:
            clock[0] += 1
            t0 = cpu()
            for handler in handlers:
                handler.data_received(payloads[i])
                i += 1
            t1 = cpu()
            await asyncio.sleep(0)  # the end of the turn: the adapter's flush
            t2 = cpu()
            spent[0] += t1 - t0
            spent[1] += t2 - t1
            if master:
                items = replies()
                t0 = cpu()
                deliver(items)
                t1 = cpu()
                await asyncio.sleep(0)  # the flush that answers
                t2 = cpu()
                spent[2] += t1 - t0
                spent[3] += t2 - t1
        for _ in range(3):
            await asyncio.sleep(0)
    finally:
        driver.now_ms = real_now
        if master:
            await engine.close()
        shutil.rmtree(directory, ignore_errors=True)
    answered = sum(t.writes for t in transports)
    if answered != args.n:
        raise SystemExit(f"{answered} of {args.n} produces answered")
    return [s / args.n * 1e6 for s in spent]


def _instructions(args: argparse.Namespace) -> int:
    long_n, short_n = args.n, max(args.turn, args.n // 3)
    import qserver.compiled
    print(f"qserver's modules: {qserver.compiled.status()}")
    print(f"instructions per produce under callgrind (a run of {long_n} produces minus one of "
          f"{short_n}), turns of {args.turn}{', with storage' if args.storage else ''}")
    for what in ("single", "master"):
        counts = []
        for n in (long_n, short_n):
            cmd = ["valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null",
                   sys.executable, __file__, "--n", str(n), "--turn", str(args.turn),
                   "--measure-only", what]
            if args.storage:
                cmd.append("--storage")
            if args.qserver_src:
                cmd += ["--qserver-src", args.qserver_src]
            out = subprocess.run(cmd, capture_output=True, text=True,
                                 env=dict(os.environ, PYTHONHASHSEED="0"))
            found = re.search(r"refs:\s+([\d,]+)", out.stderr)
            if out.returncode != 0 or found is None:
                raise SystemExit(f"valgrind failed ({out.returncode}): {out.stderr[-400:]}")
            counts.append(int(found.group(1).replace(",", "")))
        name = "quorum master" if what == "master" else "one node in memory"
        print(f"  {name:20s} {(counts[0] - counts[1]) / (long_n - short_n):,.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
