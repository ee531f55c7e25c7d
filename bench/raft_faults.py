"""Availability and catch-up of a three-node cluster through faults of its
master, on real processes: write gaps, catch-up time, truncation alarms.

    python bench/raft_faults.py [--engines raft,native] [--scenarios steady,pause,...]
        [--repeat 3] [--fault-s 5] [--clients 6] [--fsync always|batch|off]
        [--log-size 100000] [--qserver-src DIR]

Each run starts a fresh three-node quorum cluster of real `qserver run`
processes on loopback with every node-to-node link behind a proxy
(tests/harness: FaultCluster, storage with --fsync), puts it under a
produce load (`--clients` closed-loop TCP clients spread over the three
nodes, forwarding on, 2 s per request; plus a probe: a produce on a fresh
connection every 50 ms, to each node in turn), lets it settle, applies one
fault schedule to the master M and prints what it measured. Scenarios:

- `steady`: no fault for `--steady-s`: pysyncobj's `truncating
  already-applied log entries` alarms per minute, and writes per second.
- `pause`: SIGSTOP of M for `--fault-s`, then SIGCONT.
- `isolate`: every link of M cut (bytes dropped both ways, connections left
  up, as a partition TCP has not noticed) for `--fault-s`, then healed.
- `pause_other`, `isolate_other`: as above, and 1 s after M is back the
  other slave is paused for `--fault-s`: the new master then needs M to
  commit anything, so the gap shows whether M was useful again.

Figures per run:
- `gap_s`: from the fault (for *_other, the second one) to the first
  acknowledged write sent after it;
- `max_gap_s`: the longest time without an acknowledged write, from that
  fault until `--settle-s` after the last fault ended;
- `catchup_s`: from the end of M's fault until M's own monitor (104)
  reports an applied_id at least the master's commit_id of 0.1 s before
  (as far behind as a live slave is); `-` if not within
  `--catchup-deadline-s`;
- `snapshot`: whether M loaded a snapshot to catch up;
- `alarms`: pysyncobj's truncation alarms (CRITICAL) over all nodes.

`--qserver-src DIR` runs the nodes from another tree (a `git worktree` of an
older commit), for before/after figures in one command each. Every process
started here is ended before exit, Ctrl-C too.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))

from harness import FaultCluster  # noqa: E402
from procs import TcpClient  # noqa: E402

# A monitor sample older than this, on the master, is what M's applied_id
# is compared with: a live slave trails the master's commit by a round trip.
CATCHUP_SLACK_S = 0.1
REQUEST_TIMEOUT_S = 2.0
PROBE_EVERY_S = 0.05
PROBE_TIMEOUT_S = 10.0
ALARM = re.compile(r"truncating already-applied log entries")
SNAPSHOT = re.compile(r"loading raft snapshot")


# -- load, monitor, logs -------------------------------------------------------------------


class Run:
    """Load, monitor samples and log lines of one cluster."""

    def __init__(self, c: FaultCluster, clients: int) -> None:
        self.c = c
        self.acks: list[tuple[float, float]] = []  # (sent, acknowledged), monotonic
        self.samples: dict[int, list[tuple[float, dict]]] = {i: [] for i in (1, 2, 3)}
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._monitor, args=(i,), daemon=True)
                        for i in (1, 2, 3)]
        self.threads += [threading.Thread(target=self._client, args=(k % 3 + 1, k), daemon=True)
                         for k in range(clients)]
        self.threads.append(threading.Thread(target=self._probes, daemon=True))
        for t in self.threads:
            t.start()

    def _monitor(self, node: int) -> None:
        client = None
        while not self.stop.is_set():
            try:
                if client is None:
                    client = TcpClient(self.c.ports[node].client)
                    client.sock.settimeout(0.5)
                r = client.request(action=104)
                self.samples[node].append((time.monotonic(), r))
            except (OSError, ConnectionError, ValueError):
                if client is not None:
                    client.close()
                client = None
            time.sleep(0.02)

    def _client(self, node: int, k: int) -> None:
        client, i = None, 0
        while not self.stop.is_set():
            i += 1
            try:
                if client is None:
                    client = TcpClient(self.c.ports[node].client)
                    client.sock.settimeout(REQUEST_TIMEOUT_S)
                sent = time.monotonic()
                r = client.request(action=1, queue=f"q{k}", data=f"c{k}-{i}", retry=0)
                if r.get("code") != 0:
                    raise ConnectionError(r.get("reason"))
                self.acks.append((sent, time.monotonic()))
            except (OSError, ConnectionError, ValueError):
                if client is not None:
                    client.close()
                client = None
                time.sleep(0.05)

    def _probes(self) -> None:
        """A produce on a fresh connection every PROBE_EVERY_S, to each node
        in turn, each in a thread of its own: unlike the closed-loop
        clients, whose requests are stuck on a paused master until they
        time out, a probe sent after a fault shows when a fresh request
        first succeeds."""
        k = 0
        while not self.stop.is_set():
            k += 1
            threading.Thread(target=self._probe, args=(k % 3 + 1, k), daemon=True).start()
            time.sleep(PROBE_EVERY_S)

    def _probe(self, node: int, k: int) -> None:
        sent = time.monotonic()
        try:
            client = TcpClient(self.c.ports[node].client)
            try:
                client.sock.settimeout(PROBE_TIMEOUT_S)
                r = client.request(action=1, queue="probe", data=f"p{k}", retry=0)
            finally:
                client.close()
        except (OSError, ConnectionError, ValueError):
            return
        if r.get("code") == 0:
            self.acks.append((sent, time.monotonic()))

    def finish(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(5)

    # -- figures

    def gap_after(self, t: float) -> float | None:
        after = [a for s, a in self.acks if s >= t]
        return min(after) - t if after else None

    def max_gap(self, t0: float, t1: float) -> float:
        times = sorted(a for _, a in self.acks if t0 <= a <= t1)
        points = [t0, *times, t1]
        return max(b - a for a, b in zip(points, points[1:]))

    def last_sample(self, node: int, before: float) -> dict | None:
        for t, r in reversed(self.samples[node]):
            if t <= before:
                return r
        return None

    def wait_caught_up(self, node: int, since: float, deadline_s: float) -> float | None:
        end = since + deadline_s
        seen = 0
        while time.monotonic() < end:
            samples = self.samples[node]
            for t, r in samples[seen:]:
                if t < since:
                    continue
                m = next((i for i in (1, 2, 3) if i != node
                          and (self.last_sample(i, t) or {}).get("role") == "master"), None)
                ref = self.last_sample(m, t - CATCHUP_SLACK_S) if m else None
                if ref and r.get("applied_id", 0) >= ref.get("commit_id", 1 << 62):
                    return t - since
            seen = len(samples)
            time.sleep(0.05)
        return None

    def count(self, pattern: re.Pattern, nodes=(1, 2, 3)) -> int:
        return sum(len(pattern.findall(self.c.log_path(i).read_text(errors="replace")))
                   for i in nodes)


# -- one run -------------------------------------------------------------------------------


def wait_writes(run: Run, n: int, deadline_s: float = 60) -> None:
    end = time.monotonic() + deadline_s
    start = len(run.acks)
    while len(run.acks) < start + n:
        if time.monotonic() > end:
            raise TimeoutError("no writes")
        time.sleep(0.05)


def measure(engine: str, scenario: str, args) -> dict:
    with tempfile.TemporaryDirectory(prefix=f"raft-faults-{engine}-") as tmp:
        extra = f'  <queue_config log_size="{args.log_size}"/>\n'
        c = FaultCluster(Path(tmp), engine=engine, fsync=args.fsync, extra=extra,
                         qserver_src=args.qserver_src)
        run = None
        try:
            c.start()
            c.wait_master()
            run = Run(c, args.clients)
            wait_writes(run, 200)
            time.sleep(args.warmup_s)
            m = c.wait_master()
            others = [i for i in c.ids if i != m]
            out: dict = {}
            alarms0 = run.count(ALARM)
            t0 = time.monotonic()
            if scenario == "steady":
                time.sleep(args.steady_s)
                elapsed = time.monotonic() - t0
                out["alarms_per_min"] = (run.count(ALARM) - alarms0) * 60 / elapsed
                out["writes_per_s"] = sum(1 for _, a in run.acks if a >= t0) / elapsed
                return out
            out.update(gap_s=None, catchup_s=None)  # printed in this order
            isolate = scenario.startswith("isolate")
            if isolate:
                c.set_cuts({(m, j) for j in others} | {(j, m) for j in others})
            else:
                c.pause(m)
            time.sleep(args.fault_s)
            if isolate:
                c.heal_links()
            else:
                c.resume(m)
            t_back = t_end = time.monotonic()
            gap_from = t0
            if scenario.endswith("_other"):
                time.sleep(1.0)
                new = c.master()
                other = next((i for i in others if i != new), others[0])
                gap_from = time.monotonic()
                c.pause(other)
                time.sleep(args.fault_s)
                c.resume(other)
                t_end = time.monotonic()
            out["catchup_s"] = run.wait_caught_up(m, t_back, args.catchup_deadline_s)
            time.sleep(max(0.0, t_end + args.settle_s - time.monotonic()))
            out["gap_s"] = run.gap_after(gap_from)
            out["max_gap_s"] = run.max_gap(gap_from, time.monotonic())
            out["snapshot"] = run.count(SNAPSHOT, nodes=(m,)) > 0
            out["alarms"] = run.count(ALARM) - alarms0
            return out
        finally:
            if run is not None:
                run.finish()
            c.close()


SCENARIOS = ("steady", "pause", "pause_other", "isolate", "isolate_other")


def _fmt(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        return f"{v:.2f}"
    return str(v)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--engines", default="raft")
    p.add_argument("--scenarios", default=",".join(SCENARIOS))
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--fault-s", type=float, default=5.0)
    p.add_argument("--steady-s", type=float, default=20.0)
    p.add_argument("--warmup-s", type=float, default=2.0)
    p.add_argument("--settle-s", type=float, default=5.0)
    p.add_argument("--catchup-deadline-s", type=float, default=60.0)
    p.add_argument("--clients", type=int, default=6)
    p.add_argument("--fsync", default="always", choices=("off", "batch", "always"))
    p.add_argument("--log-size", type=int, default=100_000)
    p.add_argument("--qserver-src", default=None,
                   help="run the nodes from this source tree "
                        "(e.g. a git worktree of an older commit)")
    args = p.parse_args(argv)
    print("$ " + shlex.join([sys.executable, *sys.argv]))
    print(f"python {sys.version.split()[0]}, {os.cpu_count()} cpus, load average "
          f"{os.getloadavg()[0]:.2f} at the start")
    engines = args.engines.split(",")
    scenarios = args.scenarios.split(",")
    results: dict[tuple[str, str], list[dict]] = {}
    for rep in range(args.repeat):
        for scenario in scenarios:
            for engine in engines:
                r = measure(engine, scenario, args)
                results.setdefault((engine, scenario), []).append(r)
                print(f"  run {rep + 1}/{args.repeat} {engine:6} {scenario:11} "
                      + " ".join(f"{k} {_fmt(v)}" for k, v in r.items()), flush=True)
    print()
    for (engine, scenario), rs in results.items():
        keys = list(rs[0])
        parts = []
        for k in keys:
            vals = [r[k] for r in rs]
            nums = [v for v in vals if isinstance(v, (int, float)) and not isinstance(v, bool)]
            if nums and len(nums) == len(vals):
                parts.append(f"{k} {min(nums):.2f}/{statistics.median(nums):.2f}/{max(nums):.2f}")
            else:
                parts.append(f"{k} " + ",".join(_fmt(v) for v in vals))
        print(f"{engine:6} {scenario:11} (min/median/max) " + "; ".join(parts))
    print(f"load average {os.getloadavg()[0]:.2f} at the end")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        sys.exit(130)
