"""What the read index costs: answers that append no entry (empty consumes,
confirms of unknown ids) and produces on a three-node quorum cluster, for
this source tree against a baseline tree, in one run.

    python bench/read_bench.py --baseline DIR [--engines native,raft]
                               [--repeat 3] [--duration 3] [--warmup 1]

DIR is another checkout of qserver (e.g. `git worktree add /tmp/qs-base
5528c8f`, the release before the read index). For each repeat, each engine
and each tree in turn (alternating, so that both see the same machine
conditions), it starts a three-node cluster of real `qserver run`
processes on free loopback ports (no storage, quorum mode; the nodes import
qserver from that tree), waits for a master and drives it with
bench/loadgen.py's closed-loop clients (8, TCP) in three modes: produce,
empty_consume and confirm_unknown, each for --duration seconds after a
--warmup. It prints requests/s and p50/p99 per tree, engine and mode
(medians over the repeats) and the ratio this tree / baseline.

Every process it starts is killed before it exits, Ctrl-C too.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests"))

from loadgen import run_load  # noqa: E402
from procs import Cluster, NodeProcess  # noqa: E402

MODES = ("produce", "empty_consume", "confirm_unknown")


class _TreeNode(NodeProcess):
    """A `qserver run` process importing qserver from `src`."""

    def __init__(self, config_path: Path, port: int, src: Path) -> None:
        self.config_path = config_path
        self.port = port
        env = dict(os.environ, PYTHONPATH=str(src))
        # cwd=src: `python -m` puts the working directory first on sys.path.
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "qserver", "run", "--config", str(config_path)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, cwd=src)
        self.stdout_lines = []
        self.stderr_text = ""


class TreeCluster(Cluster):
    """tests/procs.py's Cluster, its nodes running the qserver of `src`."""

    def __init__(self, tmp_path: Path, src: Path, engine: str) -> None:
        super().__init__(tmp_path, engine=engine)
        self.src = src

    def start(self, node_id: int, wait: bool = True) -> NodeProcess:
        node = _TreeNode(self.config_path(node_id), self.client_ports[node_id - 1], self.src)
        self.nodes[node_id] = node
        if wait:
            node.wait_ready()
        return node


def measure(src: Path, engine: str, args: argparse.Namespace) -> dict[str, dict]:
    with tempfile.TemporaryDirectory(prefix=f"read-bench-{engine}-") as tmp:
        c = TreeCluster(Path(tmp), src, engine)
        try:
            c.start_all()
            port = c.port(c.wait_master(deadline_s=60))
            out = {}
            for mode in MODES:
                asyncio.run(run_load("127.0.0.1", port, mode=mode, concurrency=args.concurrency,
                                     duration=args.warmup))
                r = asyncio.run(run_load("127.0.0.1", port, mode=mode,
                                         concurrency=args.concurrency, duration=args.duration))
                out[mode] = {"rps": r.throughput, "p50": r.p50_ms, "p99": r.p99_ms,
                             "errors": r.errors}
            return out
        finally:
            c.stop_all()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--baseline", required=True, type=Path, help="another qserver checkout")
    p.add_argument("--engines", default="native,raft")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--duration", type=float, default=3.0)
    p.add_argument("--warmup", type=float, default=1.0)
    p.add_argument("--concurrency", type=int, default=8)
    args = p.parse_args(argv)
    trees = {"baseline": args.baseline.resolve(), "this": HERE.parent}
    engines = args.engines.split(",")
    runs: dict[tuple[str, str, str], list[dict]] = {}
    for rep in range(args.repeat):
        for engine in engines:
            for name, src in trees.items():
                got = measure(src, engine, args)
                for mode, fig in got.items():
                    runs.setdefault((name, engine, mode), []).append(fig)
                    print(f"run {rep + 1} {name:8} {engine:6} {mode:15} {fig['rps']:9,.0f} req/s "
                          f"p50 {fig['p50']:.2f} p99 {fig['p99']:.2f} ms errors {fig['errors']}",
                          flush=True)
    print("\nmedians over", args.repeat, "runs (requests/s; p50/p99 ms)")
    print(f"{'engine':6} {'mode':15} {'baseline':>22} {'this tree':>22} {'ratio':>6}")
    for engine in engines:
        for mode in MODES:
            med = {}
            for name in trees:
                figs = runs[(name, engine, mode)]
                med[name] = (statistics.median(f["rps"] for f in figs),
                             statistics.median(f["p50"] for f in figs),
                             statistics.median(f["p99"] for f in figs))
            b, t = med["baseline"], med["this"]
            print(f"{engine:6} {mode:15} {b[0]:9,.0f} {b[1]:5.2f}/{b[2]:5.2f} "
                  f"{t[0]:9,.0f} {t[1]:5.2f}/{t[2]:5.2f} {t[0] / b[0]:6.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
