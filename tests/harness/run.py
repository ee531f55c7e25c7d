"""One fault-harness run, start to report.

Theory of operation
-------------------
1. Start the proxied cluster (`nodes.FaultCluster`) and wait for a master.
2. Start the workload (`workload.Worker` threads) and, once it runs, the
   nemesis (`nemesis.Nemesis`) for `duration_s` of faults.
3. When the nemesis is done it has healed everything; the workers stop.
4. Wait until the nodes agree on a master and report the same state
   (`converge`), record each node's state ("healed"), drain every queue
   (`workload.Drainer`), wait for the same state again and record it
   ("drained").
5. Check the history and the states (`checker.check`) and return the
   `Report` with the run directory, which keeps every node's config and
   log, the proxies' log and `history.jsonl` (every fault, node state and
   operation attempt, one JSON object per line).

Every process started (nodes, the proxy process) is ended in a `finally`,
whatever happens. Waits are on conditions with deadlines; the only sleeps
are the workload's and the nemesis's pacing.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import random
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from .checker import NodeState, Report, check
from .nemesis import FAULT_KINDS, Nemesis
from .nodes import FaultCluster
from .workload import Drainer, History, Worker

__all__ = ["RunConfig", "run", "converge", "node_states"]

# Generous deadlines: a shared, noisy 2-core machine, and a raft node that
# was paused can take tens of seconds to catch up (issue 12, point 7b).
MASTER_DEADLINE_S = 60.0
CONVERGE_DEADLINE_S = 90.0
DRAIN_DEADLINE_S = 120.0
WORKER_JOIN_S = 60.0


@dataclass(frozen=True, slots=True, kw_only=True)
class RunConfig:
    engine: str = "native"
    fsync: str = "always"
    duration_s: float = 60.0
    seed: int = 1
    faults: tuple[str, ...] = FAULT_KINDS
    workers: int = 4
    rate_per_worker: float = 25.0  # operations per second per worker, at most
    queues: tuple[str, ...] = ("fa", "fb")
    qserver_src: str | None = None


def _save(path: Path, ops: list, faults: list, states: list) -> None:
    """The run's record, one JSON object per line, for a post-mortem."""
    with open(path, "w") as f:
        for rec in (*faults, *states, *ops):
            row = {"type": type(rec).__name__}
            fields = ((fl.name, getattr(rec, fl.name)) for fl in dataclasses.fields(rec))
            row.update({k: (v.value if isinstance(v, enum.Enum) else v) for k, v in fields})
            f.write(json.dumps(row) + "\n")


def node_states(c: FaultCluster, queues: tuple[str, ...], when: str) -> list[NodeState]:
    out = []
    for i in c.ids:
        status = c.ask(i, action=104)
        qs = {q: c.ask(i, action=104, queue=q) for q in queues}
        out.append(NodeState(node_id=i, when=when, status=status, queues=qs))
    return out


def _signature(states: list[NodeState]) -> set:
    sig = set()
    for s in states:
        if s.status is None or any(v is None for v in s.queues.values()):
            return {None, s.node_id}
        sig.add((s.status.get("commit_id"), s.status.get("applied_id"),
                 tuple((q, v.get("size"), v.get("max_id")) for q, v in sorted(s.queues.items()))))
    return sig


def converge(c: FaultCluster, queues: tuple[str, ...], when: str,
             deadline_s: float = CONVERGE_DEADLINE_S) -> tuple[list[NodeState], bool]:
    """Wait until a master is agreed and every node reports the same state;
    the states (the last seen, at the deadline) and whether they agree."""
    end = time.monotonic() + deadline_s
    states: list[NodeState] = []
    while time.monotonic() < end:
        if c.agreed_master() is not None:
            states = node_states(c, queues, when)
            if len(_signature(states)) == 1:
                return states, True
        time.sleep(0.2)
    return states or node_states(c, queues, when), False


def run(cfg: RunConfig, workdir: Path, log=print) -> tuple[Report, Path]:
    workdir = Path(workdir)
    c = FaultCluster(workdir, engine=cfg.engine, fsync=cfg.fsync, qserver_src=cfg.qserver_src)
    notes: list[str] = []
    try:
        source = c.source_fingerprint()
        c.start()
        c.wait_master(MASTER_DEADLINE_S)
        history = History(time.monotonic())
        stop = threading.Event()
        ports = {i: c.ports[i].client for i in c.ids}
        workers = [Worker(f"w{k}", history, ports, random.Random(f"{cfg.seed}-w{k}"), cfg.queues,
                          stop, cfg.rate_per_worker, follow_master=k % 2 == 0)
                   for k in range(cfg.workers)]
        for w in workers:
            w.start()
        nemesis = Nemesis(c, seed=cfg.seed, kinds=cfg.faults, duration_s=cfg.duration_s,
                          now=history.now, log=log)
        nemesis.start()
        try:
            nemesis.join(cfg.duration_s + 3600)
        finally:
            nemesis.stop.set()
            nemesis.join(300)
            stop.set()
            for w in workers:
                w.join(WORKER_JOIN_S)
        errors = [f"{w.name}: {w.error!r}" for w in workers if w.error] + (
            [f"nemesis: {nemesis.error!r}"] if nemesis.error else [])
        if errors:
            raise RuntimeError("harness thread failed: " + "; ".join(errors))
        load_end = history.now()
        log(f"[{load_end:7.1f}s] faults done ({len(nemesis.faults)}); converging")
        healed, agreed = converge(c, cfg.queues, "healed")
        if not agreed:
            notes.append("the nodes did not agree after the heal within the deadline")
        log(f"[{history.now():7.1f}s] draining")
        drainer = Drainer(history, ports, random.Random(f"{cfg.seed}-drain"), cfg.queues)
        drained = drainer.drain(DRAIN_DEADLINE_S)
        final, agreed = converge(c, cfg.queues, "drained")
        if not agreed:
            notes.append("the nodes did not agree after the drain within the deadline")
        log(f"[{history.now():7.1f}s] checking")
        notes.append(f"nodes import {source}")
        if c.source_fingerprint() != source:
            notes.append(f"THE SOURCE TREE CHANGED DURING THE RUN: now {c.source_fingerprint()}")
        _save(workdir / "history.jsonl", history.ops(), nemesis.faults, healed + final)
        report = check(history.ops(), nemesis.faults, healed + final, engine=cfg.engine,
                       fsync=cfg.fsync, seed=cfg.seed, duration_s=load_end, drained=drained,
                       notes=tuple(notes))
        return report, workdir
    finally:
        c.close()
