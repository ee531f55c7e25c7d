"""Memory of a node holding many messages: after the fill and after kill -9.

    python bench/memory_bench.py [--messages 1000000] [--size 100]
        [--parts single,cluster] [--batch 0] [--fill-connections 4]
        [--fill-window 2000] [--timeout 300] [--fill-timeout 900]
        [--dir DIR] [--keep]

Every node is a real `qserver run` process on free loopback ports with
`<storage fsync="batch">`, its data directory under a temporary directory
(durability_bench's node_config, Cluster, fill and settle helpers). Figures,
not tests: nothing is asserted.

Parts
- single: one node filled with --messages messages of --size bytes in one
  queue (pipelined single produces over --fill-connections TCP connections,
  --fill-window in flight on each; or with --batch N, batch produces of N
  messages each). Once the node answers monitor (action 4) with the full
  size, it is left to settle (idle CPU, no unfinished *.tmp in its data
  directory: the snapshot it writes after the fill), then VmRSS and VmHWM
  (the peak) are read from /proc/PID/status. Then kill -9, start again
  from the same directory, and the same figures once monitor shows every
  message ("at serve") and once the node has settled again.
- cluster: three nodes (native engine, mode quorum, fsync batch), filled
  through the master the same way; once every node's own monitor (action
  104) shows the full size with everything applied, and each has settled,
  the RSS of each. Then a slave is killed with kill -9 and started again;
  its RSS once its monitor shows every message and once it has settled.

Goals (issue 16, for 1,000,000 messages of 100 bytes): a single node
under 400 MB RSS after the fill and after a kill -9 restart; a cluster
node under 450 MB (its in-memory log holds up to log_size records more).
The table at the end prints each figure with its goal.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from dataclasses import dataclass, field

import orjson

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
REPO_DIR = os.path.dirname(BENCH_DIR)
sys.path.insert(0, BENCH_DIR)
import durability_bench as db  # noqa: E402  (this directory, whether run as a script or not)
from durability_bench import (  # noqa: E402
    FILL_QUEUE,
    FILL_TTL_S,
    Cluster,
    DidNotFinish,
    Node,
    fill,
    node_config,
    settle,
    wait_answer,
)
from run_bench import free_port  # noqa: E402

# Goals of issue 16 (goal 5), for GOAL_MESSAGES messages of GOAL_SIZE bytes.
GOAL_SINGLE_MB = 400.0
GOAL_CLUSTER_MB = 450.0
GOAL_MESSAGES = 1_000_000
GOAL_SIZE = 100

PARTS = ("single", "cluster")


@dataclass
class Row:
    what: str
    rss_mb: float | None
    hwm_mb: float | None
    goal_mb: float | None
    note: str = ""


@dataclass
class Report:
    rows: list[Row] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def measure(self, what: str, node: Node, goal_mb: float | None, note: str = "") -> Row:
        row = Row(what, node.status_mb("VmRSS"), node.status_mb("VmHWM"), goal_mb, note)
        self.rows.append(row)
        rss = "-" if row.rss_mb is None else f"{row.rss_mb:.0f}"
        hwm = "-" if row.hwm_mb is None else f"{row.hwm_mb:.0f}"
        print(f"  {what}: VmRSS {rss} MB, VmHWM {hwm} MB{'; ' + note if note else ''}",
              flush=True)
        return row


# -- filling -------------------------------------------------------------------

async def batch_fill(port: int, count: int, *, batch: int, connections: int, window: int,
                     data: str, timeout_s: float) -> db.FillResult:
    """Produce `count` messages as batch produces (`messages`) of `batch`
    each (the rest in one last, shorter batch), `window` requests in flight
    on each of `connections` connections. A batch is all or nothing; one
    answered with an error is not made again (the bench waits for the
    queue's size afterwards and says so if it is short)."""
    loop = asyncio.get_running_loop()
    ttl = int(time.time()) + FILL_TTL_S
    full, rest = divmod(count, batch)

    def request(n: int) -> bytes:
        return orjson.dumps({"action": 1, "queue": FILL_QUEUE,
                             "messages": [{"data": data, "ttl": ttl}] * n})

    rounds = [(request(batch), full, batch, connections)]
    if rest:
        rounds.append((request(rest), 1, rest, 1))
    ok = errors = 0
    first = b""
    t0 = time.perf_counter()
    end = t0 + timeout_s
    for one_request, n_requests, per_request, n_conns in rounds:
        n_conns = max(1, min(n_conns, n_requests))
        share = [n_requests // n_conns + (1 if i < n_requests % n_conns else 0)
                 for i in range(n_conns)]
        fillers: list[db._Filler] = []
        try:
            for n in share:
                if n:
                    _, f = await loop.create_connection(
                        lambda n=n, one=one_request: db._Filler(one, n, window),
                        "127.0.0.1", port)
                    fillers.append(f)
            try:
                await asyncio.wait_for(asyncio.gather(*(f.done for f in fillers)),
                                       max(end - time.perf_counter(), 0))
            except TimeoutError:
                raise DidNotFinish("batch fill did not finish in the time allowed") from None
        finally:
            for f in fillers:
                if f.transport is not None:
                    f.transport.close()
        ok += sum(f.ok for f in fillers) * per_request
        errors += sum(f.errors for f in fillers)
        first = first or next((f.first_error for f in fillers if f.first_error), b"")
    return db.FillResult(ok=ok, errors=errors, first_error=first.decode(errors="replace")[:200],
                         seconds=time.perf_counter() - t0)


async def fill_node(args: argparse.Namespace, port: int) -> None:
    data = "m" * args.size
    if args.batch > 0:
        fr = await batch_fill(port, args.messages, batch=args.batch,
                              connections=args.fill_connections,
                              window=max(1, args.fill_window // args.batch), data=data,
                              timeout_s=args.fill_timeout)
    else:
        fr = await fill(port, args.messages, connections=args.fill_connections,
                        window=args.fill_window, data=data, timeout_s=args.fill_timeout)
    print(f"  filled {fr.ok:,} messages in {fr.seconds:.1f} s ({fr.rate:,.0f}/s, "
          f"errors {fr.errors}{', first: ' + fr.first_error if fr.errors else ''})", flush=True)


def _write(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


def _full(want: int):
    return lambda a: a.get("code") == 0 and isinstance(a.get("size"), int) and a["size"] >= want


# -- parts ----------------------------------------------------------------------

async def part_single(args: argparse.Namespace, root: str, report: Report) -> None:
    print(f"\n== single node, storage fsync=batch, {args.messages:,} messages of {args.size} "
          f"bytes", flush=True)
    os.makedirs(root, exist_ok=True)
    port = free_port()
    data_dir = os.path.join(root, "data")
    config = os.path.join(root, "node.xml")
    _write(config, node_config(1, port, data_dir, "batch", log_size=args.log_size))
    log_path = os.path.join(root, "node.log")
    node = Node("single", config, port, log_path)
    monitor = {"action": 4, "queue": FILL_QUEUE}
    try:
        await wait_answer(node, {"action": 4}, lambda a: a.get("code") == 0, args.timeout)
        await fill_node(args, port)
        _, took, a = await wait_answer(node, monitor, _full(args.messages),
                                       args.timeout + time.perf_counter() - node.started_at)
        size = a["size"]
        print(f"    settling: {await settle(node, data_dir, args.timeout)}", flush=True)
        report.measure("single: after the fill", node, GOAL_SINGLE_MB, f"{size:,} messages")
        node.kill_now()
        node = Node("single", config, port, log_path)
        _, took, a = await wait_answer(node, monitor, _full(size), args.timeout)
        report.measure("single: kill -9, at serve", node, GOAL_SINGLE_MB,
                       f"all {a['size']:,} messages at {took:.1f} s")
        print(f"    settling: {await settle(node, data_dir, args.timeout)}", flush=True)
        report.measure("single: kill -9, settled", node, GOAL_SINGLE_MB)
    except (DidNotFinish, OSError, ConnectionError) as exc:
        print(f"  {exc}\n  " + node.log_tail(3).replace("\n", "\n  "), flush=True)
        report.notes.append(f"single: {exc}")
    finally:
        await node.stop()


async def part_cluster(args: argparse.Namespace, root: str, report: Report) -> None:
    print(f"\n== three-node cluster (native, quorum, storage fsync=batch), {args.messages:,} "
          f"messages of {args.size} bytes", flush=True)
    cl = Cluster(root, "cluster", "batch")
    local = {"action": 104, "queue": FILL_QUEUE}

    def caught_up(want: int):
        return lambda a: (_full(want)(a) and a.get("applied_id") == a.get("commit_id")
                          and a.get("commit_id", 0) >= a.get("trans_id", 0))

    try:
        cl.start_all()
        master = await cl.wait_master(args.timeout)
        print(f"  master: node {master}", flush=True)
        await fill_node(args, cl.client_ports[master])
        _, _, a = await wait_answer(cl.nodes[master], {"action": 4, "queue": FILL_QUEUE},
                                    _full(args.messages), args.timeout
                                    + time.perf_counter() - cl.nodes[master].started_at)
        size = a["size"]
        for node in cl.nodes.values():
            await wait_answer(node, local, caught_up(size),
                              args.timeout + time.perf_counter() - node.started_at)
        for i, node in cl.nodes.items():
            print(f"    node {i} settling: "
                  f"{await settle(node, os.path.join(root, f'data{i}'), args.timeout)}",
                  flush=True)
        for i, node in cl.nodes.items():
            role = "master" if i == master else "slave"
            report.measure(f"cluster: node {i} ({role}) after the fill", node, GOAL_CLUSTER_MB,
                           f"{size:,} messages")
        victim = next(i for i in cl.nodes if i != master)
        cl.nodes[victim].kill_now()
        node = cl.start(victim)
        _, took, a = await wait_answer(node, local, caught_up(size), args.timeout)
        report.measure(f"cluster: node {victim} (slave) kill -9, at serve", node,
                       GOAL_CLUSTER_MB, f"all {a['size']:,} messages at {took:.1f} s")
        print(f"    settling: "
              f"{await settle(node, os.path.join(root, f'data{victim}'), args.timeout)}",
              flush=True)
        report.measure(f"cluster: node {victim} (slave) kill -9, settled", node,
                       GOAL_CLUSTER_MB)
    except (DidNotFinish, OSError, ConnectionError) as exc:
        print(f"  {exc}", flush=True)
        for nid, n in cl.nodes.items():
            tail = n.log_tail(3)
            if tail:
                print(f"    node {nid} log: " + tail.replace("\n", "\n      "), flush=True)
        report.notes.append(f"cluster: {exc}")
    finally:
        await cl.stop_all()


# -- main -------------------------------------------------------------------------

def _parts(text: str) -> tuple[str, ...]:
    chosen = [x.strip() for x in text.split(",") if x.strip()]
    bad = [x for x in chosen if x not in PARTS]
    if bad or not chosen:
        raise argparse.ArgumentTypeError(f"choose from {','.join(PARTS)}")
    return tuple(p for p in PARTS if p in chosen)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="RSS of a qserver node (single, cluster) holding "
                                            "many messages, after the fill and after kill -9")
    p.add_argument("--messages", type=int, default=GOAL_MESSAGES,
                   help=f"messages to hold ({GOAL_MESSAGES})")
    p.add_argument("--size", type=int, default=GOAL_SIZE, help=f"bytes per message ({GOAL_SIZE})")
    p.add_argument("--parts", type=_parts, default=PARTS, metavar="LIST",
                   help="comma-separated subset of single,cluster (default both)")
    p.add_argument("--batch", type=int, default=0,
                   help="fill with batch produces of this many messages (default 0: pipelined "
                        "single produces)")
    p.add_argument("--fill-connections", type=int, default=4)
    p.add_argument("--fill-window", type=int, default=2000,
                   help="produces in flight per fill connection (2000; with --batch, messages)")
    p.add_argument("--timeout", type=float, default=300.0,
                   help="seconds allowed for a start, a restart or settling (300)")
    p.add_argument("--fill-timeout", type=float, default=900.0,
                   help="seconds allowed for a fill (900)")
    p.add_argument("--log-size", type=int, default=None,
                   help="the single node's log_size (default qserver's; one above --messages "
                        "writes no snapshot, so that the restart replays the whole log)")
    p.add_argument("--dir", default=None, help="where the temporary data directories go")
    p.add_argument("--keep", action="store_true", help="keep the data directories")
    return p


def print_table(args: argparse.Namespace, report: Report) -> None:
    print("\n== summary")
    if not report.rows:
        print("  nothing measured")
    else:
        scaled = (args.messages, args.size) != (GOAL_MESSAGES, GOAL_SIZE)
        w = max(len(r.what) for r in report.rows)
        print(f"  {'what':{w}}  {'VmRSS MB':>8}  {'VmHWM MB':>8}  {'goal':>8}  met")
        print("  " + "-" * (w + 38))
        for r in report.rows:
            rss = "-" if r.rss_mb is None else f"{r.rss_mb:.0f}"
            hwm = "-" if r.hwm_mb is None else f"{r.hwm_mb:.0f}"
            goal = "-" if r.goal_mb is None else f"< {r.goal_mb:.0f}"
            met = "-" if r.goal_mb is None or r.rss_mb is None or scaled else (
                "yes" if r.rss_mb < r.goal_mb else "NO")
            print(f"  {r.what:{w}}  {rss:>8}  {hwm:>8}  {goal:>8}  {met}")
        if scaled:
            print(f"  ({args.messages:,} x {args.size} B: the goals are for "
                  f"{GOAL_MESSAGES:,} x {GOAL_SIZE} B, so 'met' is not judged)")
    for n in report.notes:
        print(f"  {n}")


async def _run(args: argparse.Namespace, root: str, report: Report) -> None:
    if "single" in args.parts:
        await part_single(args, os.path.join(root, "single"), report)
    if "cluster" in args.parts:
        await part_cluster(args, os.path.join(root, "cluster"), report)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    report = Report()
    rc, t0 = db.run_in_a_data_dir(args, argv, "qserver-memory-",
                                  lambda root: _run(args, root, report))
    print_table(args, report)
    print(f"\n{time.perf_counter() - t0:.0f} s in all")
    return rc


if __name__ == "__main__":
    sys.exit(main())
