"""Does a stall of every node at once change a healthy master?

    python bench/stall_bench.py [--clusters native-quorum,native-async,raft-quorum]
        [--pauses 10] [--pause-s 1.5] [--after-s 2.5] [--qserver-src DIR]

For each cluster kind, a fresh three-node cluster of real `qserver run`
processes on loopback (durability_bench.Cluster: quorum mode with storage,
fsync=batch; async mode in memory; `raft-quorum` is the raft engine), then
`--pauses` times: SIGSTOP to every node at once for `--pause-s` (one host
stalled: a VM paused, a long garbage collection everywhere), SIGCONT to
every node, `--after-s` for an election, had one started, to end, and the
master asked for (monitor 104, every node agreeing). It prints how many
pauses changed the master and how many elections the nodes' logs show
after the first. A stall is not the others' silence (the native core's
"A stall"): the answer should be 0.

`--qserver-src DIR` runs the nodes from another tree (`git archive REV |
tar -x -C DIR`), for before/after figures. Every process started here is
ended before exit, Ctrl-C too.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import re
import shutil
import signal
import sys
import tempfile

import durability_bench as dur

CLUSTERS = ("native-quorum", "native-async", "raft-quorum")
START_TIMEOUT_S = 60.0


def configure(c: dur.Cluster, kind: str) -> None:
    """durability_bench's quorum configs, made into `kind`'s."""
    for path in c.configs.values():
        with open(path) as f:
            text = f.read()
        if kind == "native-async":
            text = re.sub(r"  <storage [^\n]*\n", "", text.replace('mode="quorum"',
                                                                   'mode="async"'))
        elif kind == "raft-quorum":
            text = text.replace('engine="native"', 'engine="raft"')
        with open(path, "w") as f:
            f.write(text)


def elections(c: dur.Cluster) -> int:
    """Elections won, from the nodes' logs (each logs its own)."""
    won = 0
    for node in c.nodes.values():
        with open(node.log_path, errors="replace") as f:
            won += sum(1 for line in f if re.search(r": master in (vote|term) ", line))
    return won


async def master_after(c: dur.Cluster) -> int | None:
    try:
        return await c.wait_master(START_TIMEOUT_S)
    except dur.DidNotFinish:
        return None


async def run_one(kind: str, args: argparse.Namespace, root: str) -> tuple[int, int, int]:
    """-> (pauses that changed the master, elections after the first, pauses)."""
    c = dur.Cluster(os.path.join(root, kind), kind, "batch")
    configure(c, kind)
    c.start_all()
    try:
        master = await c.wait_master(START_TIMEOUT_S)
        first = elections(c)
        pids = [n.proc.pid for n in c.nodes.values()]
        changed = 0
        for i in range(args.pauses):
            await asyncio.sleep(0.3 + random.random() * 0.3)  # somewhere between heartbeats
            for pid in pids:
                os.kill(pid, signal.SIGSTOP)
            await asyncio.sleep(args.pause_s)
            for pid in pids:
                os.kill(pid, signal.SIGCONT)
            await asyncio.sleep(args.after_s)
            now = await master_after(c)
            if now != master:
                changed += 1
            print(f"  {kind} pause {i + 1}/{args.pauses}: master {master} -> {now}", flush=True)
            master = now if now is not None else master
        return changed, elections(c) - first, args.pauses
    finally:
        for n in c.nodes.values():
            if n.alive:
                os.kill(n.proc.pid, signal.SIGCONT)
        await c.stop_all()


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--clusters", default=",".join(CLUSTERS))
    p.add_argument("--pauses", type=int, default=10)
    p.add_argument("--pause-s", type=float, default=1.5)
    p.add_argument("--after-s", type=float, default=2.5)
    p.add_argument("--qserver-src", default=None,
                   help="run the nodes from this tree instead of this checkout")
    return p


async def _main(args: argparse.Namespace) -> int:
    kinds = [k for k in args.clusters.split(",") if k]
    bad = [k for k in kinds if k not in CLUSTERS]
    if bad:
        print(f"unknown cluster kind(s): {', '.join(bad)}; choose from {', '.join(CLUSTERS)}",
              file=sys.stderr)
        return 2
    print(f"stall bench: nodes import qserver from {dur.REPO_DIR}; {args.pauses} pauses of "
          f"{args.pause_s:g} s of every node at once", flush=True)
    root = tempfile.mkdtemp(prefix="qserver-stall-")
    results = {}
    try:
        for kind in kinds:
            results[kind] = await run_one(kind, args, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print()
    for kind, (changed, won, pauses) in results.items():
        print(f"{kind:14} master changed after {changed} of {pauses} pauses; "
              f"{won} elections after the first")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.qserver_src:
        dur.REPO_DIR = os.path.abspath(args.qserver_src)
    try:
        return asyncio.run(_main(args))
    finally:
        for n in dur._ALL_NODES:
            if n.alive:
                os.kill(n.proc.pid, signal.SIGCONT)
                n.kill_now()


if __name__ == "__main__":
    sys.exit(main())
