"""Leader transfer under load (issue 17, point 3): how long the cluster is
without a master that answers writes when the role is handed over, against
the election timeout a failure would cost, and whether anything
acknowledged is lost.

    python bench/transfer_bench.py [--engine native|raft] [--mode quorum|async]
        [--storage] [--transfers 20] [--clients 8] [--pause 0.5] [--warmup 1]

Three real `qserver run` nodes on loopback (tests/procs.py; forwarding on).
`--clients` produce loops (asyncio, one connection and one request in
flight each, spread over the three nodes) run for the whole bench; a client
answered with an error ("no leader" while the role moves, a closed
connection) moves to the next node after 20 ms, as qserver's client does.
After --warmup s, --transfers transfers, round-robin to the next node
(master m hands its role to m % 3 + 1), --pause s apart. For each transfer:
the time from sending action 20 (transfer leader) to the master until

- `answered`: its answer (code 0, leader_node_id = the target);
- `writes`: the target answers a produce itself (it says role "master" in
  a node-local monitor, action 104, then a produce sent to it is answered
  code 0): the time the cluster took no write at its master.

Printed: each transfer, then min/median/worst of both against the election
timeout (native: 600-1200 ms; raft: pysyncobj's 600-1200 ms), the produces
acknowledged, and after the load stops, the messages consumed from the
final master (pipelined, 500 at a time) and how many acknowledged produces
are missing from them (lost). Figures, not tests: nothing is asserted; exit
status 1 if anything acknowledged was lost or a transfer failed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from procs import Cluster

ELECTION_MS = 600  # the shortest election timeout of both engines (DEFAULT_TIMING, _RAFT_TIMING)
QUEUE = "transfer-bench"
PROBE_QUEUE = "transfer-probe"
IO_TIMEOUT_S = 10.0


class Conn:
    """One client connection: one request in flight, answers by line."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    @classmethod
    async def open(cls, port: int) -> Conn:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        return cls(reader, writer)

    async def ask(self, request: dict) -> dict:
        self.writer.write(json.dumps(request).encode() + b"\n")
        return json.loads(await asyncio.wait_for(self.reader.readline(), IO_TIMEOUT_S))

    async def pipelined(self, requests: list[dict]) -> list[dict]:
        self.writer.write(b"".join(json.dumps(r).encode() + b"\n" for r in requests))
        return [json.loads(await asyncio.wait_for(self.reader.readline(), IO_TIMEOUT_S))
                for _ in requests]

    def close(self) -> None:
        self.writer.close()


async def ask(port: int, request: dict) -> dict | None:
    try:
        conn = await Conn.open(port)
    except OSError:
        return None
    try:
        return await conn.ask(request)
    except (TimeoutError, OSError, ValueError):
        return None
    finally:
        conn.close()


class Load:
    """The produce clients, and what they were told."""

    def __init__(self, ports: list[int], clients: int) -> None:
        self.ports = ports
        self.clients = clients
        self.acked: set[str] = set()
        self.errors: dict[str, int] = {}
        self.stop = asyncio.Event()

    async def client(self, k: int) -> None:
        node = k % len(self.ports)
        conn: Conn | None = None
        i = 0
        while not self.stop.is_set():
            i += 1
            data = f"c{k}-{i}"
            try:
                if conn is None:
                    conn = await Conn.open(self.ports[node])
                r = await conn.ask({"action": 1, "queue": QUEUE, "data": data})
            except (TimeoutError, OSError, ValueError):
                r = {"reason": "connection"}
            if r.get("code") == 0:
                self.acked.add(data)
                continue
            reason = str(r.get("reason"))
            self.errors[reason] = self.errors.get(reason, 0) + 1
            if conn is not None:
                conn.close()
                conn = None
            node = (node + 1) % len(self.ports)
            await asyncio.sleep(0.02)
        if conn is not None:
            conn.close()


async def master(c: Cluster) -> int | None:
    roles = [await ask(c.port(i), {"action": 104}) for i in range(1, c.n + 1)]
    masters = [i + 1 for i, r in enumerate(roles) if r and r.get("role") == "master"]
    if len(masters) != 1:
        return None
    m = masters[0]
    return m if all(r and r.get("leader_node_id") == m for r in roles) else None


async def wait_master(c: Cluster, deadline_s: float = 30.0) -> int:
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        m = await master(c)
        if m is not None:
            return m
        await asyncio.sleep(0.02)
    raise TimeoutError("no master agreed on")


async def writes_at(port: int, deadline_s: float = 10.0) -> float:
    """When the node at `port` first answers a produce as master itself."""
    end = time.monotonic() + deadline_s
    conn = await Conn.open(port)
    try:
        while time.monotonic() < end:
            r = await conn.ask({"action": 104})
            if r.get("role") == "master":
                r = await conn.ask({"action": 1, "queue": PROBE_QUEUE, "data": "probe"})
                if r.get("code") == 0:
                    return time.monotonic()
            await asyncio.sleep(0.001)
    finally:
        conn.close()
    raise TimeoutError("the target never answered writes as master")


async def transfer_once(c: Cluster, m: int, target: int) -> tuple[float, float, dict]:
    conn = await Conn.open(c.port(m))
    try:
        t0 = time.monotonic()
        probe = asyncio.create_task(writes_at(c.port(target)))
        answer = await conn.ask({"action": 20, "node_id": target})
        answered = time.monotonic() - t0
        if answer.get("code") != 0:
            probe.cancel()
            return answered, float("nan"), answer
        try:
            writes = await probe - t0
        except TimeoutError:
            roles = [await ask(c.port(i), {"action": 104}) for i in range(1, c.n + 1)]
            seen = [(r or {}).get("role") for r in roles]
            return answered, float("nan"), {"code": -1, "reason": "target never took writes",
                                            "roles": seen}
        return answered, writes, answer
    finally:
        conn.close()


async def consume_all(port: int) -> set[str]:
    conn = await Conn.open(port)
    got: set[str] = set()
    try:
        while True:
            answers = await conn.pipelined([{"action": 2, "queue": QUEUE}] * 500)
            empty = False
            for r in answers:
                if r.get("code") != 0:
                    raise RuntimeError(f"consume answered {r}")
                if "msg_id" in r:
                    got.add(r["data"])
                else:
                    empty = True
            if empty:
                return got
    finally:
        conn.close()


def figures(name: str, values: list[float]) -> str:
    ms = sorted(v * 1000 for v in values)
    if not ms:
        return f"{name}: none"
    med = statistics.median(ms)
    return (f"{name}: min {ms[0]:.1f} ms, median {med:.1f} ms, worst {ms[-1]:.1f} ms "
            f"(median {med / ELECTION_MS:.2f}x, worst {ms[-1] / ELECTION_MS:.2f}x the "
            f"{ELECTION_MS} ms election timeout)")


async def bench(c: Cluster, args: argparse.Namespace) -> int:
    m = await wait_master(c)
    probe = await ask(c.port(m), {"action": 20, "node_id": m})
    if not probe or probe.get("code") != 0:
        print(f"action 20 (transfer leader) is not served: {probe}")
        return 2
    load = Load([c.port(i) for i in range(1, c.n + 1)], args.clients)
    tasks = [asyncio.create_task(load.client(k)) for k in range(args.clients)]
    failed = 0
    answered: list[float] = []
    writes: list[float] = []
    try:
        await asyncio.sleep(args.warmup)
        for k in range(args.transfers):
            m = await wait_master(c)
            target = m % c.n + 1
            before = len(load.acked)
            a, w, answer = await transfer_once(c, m, target)
            ok = answer.get("code") == 0 and answer.get("leader_node_id") == target
            failed += not ok
            if ok:
                answered.append(a)
                writes.append(w)
            print(f"transfer {k + 1:2d}: {m} -> {target}: answered in {a * 1000:7.1f} ms, "
                  f"target takes writes after {w * 1000:7.1f} ms"
                  + ("" if ok else f"  FAILED: {answer}"), flush=True)
            await asyncio.sleep(args.pause)
            if len(load.acked) == before:
                print("  (no produce acknowledged since the previous transfer)")
    finally:
        load.stop.set()
        await asyncio.gather(*tasks)
    final = await wait_master(c)
    got = await consume_all(c.port(final))
    lost = load.acked - got
    print()
    print(f"engine {args.engine}, mode {args.mode}, storage "
          f"{'fsync=batch' if args.storage else 'none'}, {args.clients} clients, "
          f"{args.transfers} transfers ({failed} failed); load average "
          f"{os.getloadavg()[0]:.2f}")
    print(figures("request to answer      ", answered))
    print(figures("request to writes taken", writes))
    print(f"produces acknowledged {len(load.acked)}, consumed at the end {len(got)}, "
          f"acknowledged and lost {len(lost)}")
    print(f"client errors (retried): {dict(sorted(load.errors.items()))}")
    return 1 if lost or failed else 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine", choices=["native", "raft"], default="native")
    ap.add_argument("--mode", choices=["quorum", "async"], default="quorum")
    ap.add_argument("--storage", action="store_true", help='<storage fsync="batch"> per node')
    ap.add_argument("--transfers", type=int, default=20)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--pause", type=float, default=0.5, help="seconds between transfers (0.5)")
    ap.add_argument("--warmup", type=float, default=1.0, help="seconds of load first (1)")
    args = ap.parse_args(argv)
    workdir = Path(tempfile.mkdtemp(prefix="qserver-transfer-"))
    extra = f'  <replication mode="{args.mode}"/>\n'
    c = Cluster(workdir, n=3, engine=args.engine, extra=extra)
    if args.storage:
        # one data directory per node: the config text is per node
        original = c.config_path

        def config_path(node_id: int) -> Path:
            path = original(node_id)
            text = path.read_text().replace(
                "</config>", f'  <storage dir="{workdir}/data{node_id}" fsync="batch"/>\n'
                             "</config>")
            path.write_text(text)
            return path

        c.config_path = config_path  # type: ignore[method-assign]
    try:
        c.start_all()
        return asyncio.run(bench(c, args))
    finally:
        c.stop_all()
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
