"""The fault-injection harness as a long run: a three-node quorum cluster
of real processes, every node-to-node link behind a proxy, a concurrent
workload, faults on a seeded schedule; after healing and draining, every
violation count and availability per fault kind.

    python bench/fault_bench.py [--engine native|raft] [--fsync always|batch|off]
        [--duration 300] [--seed 1] [--faults kind,kind,...] [--workers 4]
        [--rate 25] [--qserver-src DIR] [--dir DIR] [--keep]

Fault kinds (default: all): kill-master, kill-slave, kill-all, pause-master,
isolate-master, split, one-way (tests/harness/nemesis.py says what each does).

--qserver-src DIR runs the nodes from another source tree (via PYTHONPATH),
e.g. a `git worktree` of an older commit; the harness itself (proxies,
workload, checker) is this tree's. The tree must know `<node dial
raft_dial>` (commit 3cf1e0f): the proxies are wired in through them.

Figures, not tests: nothing is asserted. The run directory (--dir, default
a new temporary directory) holds every node's config and log; it is removed
at the end unless --keep, or unless a violation was found. Exit status 0
when no violation was found, 1 otherwise, 2 for bad usage.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from harness import FAULT_KINDS, RunConfig, format_report, run


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine", choices=["native", "raft"], default="native")
    ap.add_argument("--fsync", choices=["always", "batch", "off"], default="always")
    ap.add_argument("--duration", type=float, default=300.0, help="seconds of faults (300)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--faults", default=",".join(FAULT_KINDS),
                    help="comma-separated fault kinds (default: all)")
    ap.add_argument("--workers", type=int, default=4, help="client threads (4)")
    ap.add_argument("--rate", type=float, default=25.0,
                    help="operations per second per worker, at most (25)")
    ap.add_argument("--qserver-src", default=None, help="run the nodes from this source tree")
    ap.add_argument("--dir", default=None, help="run directory (default: a new temporary one)")
    ap.add_argument("--keep", action="store_true", help="keep the run directory")
    args = ap.parse_args(argv)
    kinds = tuple(k.strip() for k in args.faults.split(",") if k.strip())
    bad = [k for k in kinds if k not in FAULT_KINDS]
    if bad or not kinds:
        ap.error(f"unknown fault kind(s) {bad}; known: {', '.join(FAULT_KINDS)}")
    if args.qserver_src and not os.path.isdir(os.path.join(args.qserver_src, "qserver")):
        ap.error(f"--qserver-src {args.qserver_src}: no qserver package there")
    workdir = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="qserver-faults-"))
    cfg = RunConfig(engine=args.engine, fsync=args.fsync, duration_s=args.duration,
                    seed=args.seed, faults=kinds, workers=args.workers,
                    rate_per_worker=args.rate, qserver_src=args.qserver_src)
    started = time.monotonic()
    print(f"fault bench: {cfg}", flush=True)
    print(f"run directory: {workdir}; load average {os.getloadavg()[0]:.2f}", flush=True)
    report, _ = run(cfg, workdir, log=lambda line: print(line, flush=True))
    print()
    print(format_report(report))
    print(f"wall time {time.monotonic() - started:.0f} s; load average {os.getloadavg()[0]:.2f}")
    if args.keep or not report.ok:
        print(f"logs kept in {workdir}")
    else:
        shutil.rmtree(workdir, ignore_errors=True)
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
