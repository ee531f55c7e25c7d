"""The nemesis: faults on a seeded schedule, each healed before the next.

Theory of operation
-------------------
One thread loops until its deadline: a quiet spell (the cluster healthy),
then one fault, held for a few seconds, then healed. The seed fixes the
sequence: which kind of fault, how long it holds and how long the quiet
lasts, the style of a cut (blackhole or reset) and which of the candidate
nodes is hit. Who is master is read from the cluster when the fault starts
(the node that says it is master in the highest vote_id), so the same seed
hits the same roles, not necessarily the same node ids.

Kinds:
- kill-master, kill-slave: kill -9 one node, restart it (from its data
  directory) when the fault heals.
- kill-all: kill -9 every node at once, restart them all.
- pause-master: SIGSTOP the master for 3-8 s, then SIGCONT.
- isolate-master: the master cut off from both slaves, both ways.
- split: a random node alone on one side, the other two on the other.
- one-way: bytes dropped in one direction only: the master's to the slaves,
  the slaves' to the master, or one random directed pair.

After healing, the nemesis waits (with a deadline) until every node is up
and a master is agreed on before the next quiet spell, so that each fault
hits a working cluster; a cluster that does not recover by the deadline is
recorded (`Fault.recovered_s` is None) and the schedule goes on.

Each fault is a frozen `Fault` record with the times it started and was
healed, on the history's clock.
"""

from __future__ import annotations

import random
import threading
import time
from dataclasses import dataclass

from .nodes import FaultCluster
from .proxy import DROP

__all__ = ["Fault", "Nemesis", "FAULT_KINDS"]

FAULT_KINDS = ("kill-master", "kill-slave", "kill-all", "pause-master", "isolate-master",
               "split", "one-way")

HOLD_S = (3.0, 8.0)  # how long a fault holds
QUIET_S = (2.0, 4.0)  # healthy time between faults
RECOVER_DEADLINE_S = 60.0  # for every node up and a master agreed after a heal
MASTER_LOOKUP_S = 5.0  # to find the master when a fault wants it


@dataclass(frozen=True, slots=True, kw_only=True)
class Fault:
    kind: str
    t_start: float  # on the history's clock
    t_end: float  # healed
    nodes: tuple[int, ...]  # the nodes hit
    detail: str
    recovered_s: float | None  # heal -> all up and a master agreed; None: not by the deadline


def _join(*parts: str) -> str:
    return "; ".join(p for p in parts if p)


class Nemesis:
    def __init__(self, cluster: FaultCluster, *, seed: int, kinds: tuple[str, ...],
                 duration_s: float, now, log=print) -> None:
        unknown = set(kinds) - set(FAULT_KINDS)
        if unknown or not kinds:
            raise ValueError(f"unknown fault kinds {sorted(unknown)} "
                             f"(known: {', '.join(FAULT_KINDS)})")
        self.cluster = cluster
        self.rng = random.Random(seed)
        self.kinds = tuple(kinds)
        self.duration_s = duration_s
        self.now = now  # the history's clock
        self.log = log
        self.faults: list[Fault] = []
        self.stop = threading.Event()
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name="harness-nemesis", daemon=True)
        # What is broken right now, for heal().
        self._killed: set[int] = set()
        self._paused: set[int] = set()

    def start(self) -> None:
        self.thread.start()

    def join(self, timeout_s: float) -> None:
        self.thread.join(timeout_s)

    # -- the schedule ------------------------------------------------------------

    def _run(self) -> None:
        end = self.now() + self.duration_s
        try:
            while not self.stop.is_set():
                self.stop.wait(self.rng.uniform(*QUIET_S))  # pacing of the schedule
                if self.stop.is_set() or self.now() >= end:
                    break
                kind = self.rng.choice(self.kinds)
                hold = self.rng.uniform(*HOLD_S)
                style = self.rng.choice([DROP, "close"])
                pick = self.rng.random()  # chooses among candidate nodes
                self._one(kind, hold, style, pick)
        except BaseException as exc:  # reported by the run
            self.error = exc
        finally:
            try:
                self.heal()
            except BaseException as exc:
                self.error = self.error or exc

    def _master(self) -> int | None:
        deadline = time.monotonic() + MASTER_LOOKUP_S
        while True:
            m = self.cluster.master()
            if m is not None or time.monotonic() >= deadline:
                return m
            time.sleep(0.1)

    @staticmethod
    def _choose(items: list[int], pick: float) -> int:
        return sorted(items)[int(pick * len(items)) % len(items)]

    def _one(self, kind: str, hold: float, style: str, pick: float) -> None:
        c = self.cluster
        ids = c.ids
        m = self._master() if kind != "kill-all" else None
        master = m if m is not None else self._choose(ids, pick)
        slaves = [i for i in ids if i != master]
        detail = "" if m is not None or kind == "kill-all" else "master unknown"
        t_start = self.now()
        if kind == "kill-master":
            hit = (master,)
            c.kill(master)
            self._killed.add(master)
        elif kind == "kill-slave":
            victim = self._choose(slaves, pick)
            hit = (victim,)
            c.kill(victim)
            self._killed.add(victim)
        elif kind == "kill-all":
            hit = tuple(ids)
            for i in ids:
                c.nodes[i].proc.kill()  # all signals first, then reap
            for i in ids:
                c.kill(i)
            self._killed.update(ids)
        elif kind == "pause-master":
            hit = (master,)
            c.pause(master)
            self._paused.add(master)
        elif kind == "isolate-master":
            hit = (master,)
            c.set_cuts({(master, s) for s in slaves} | {(s, master) for s in slaves}, style)
            detail = _join(detail, f"style {style}")
        elif kind == "split":
            alone = self._choose(ids, pick)
            hit = (alone,)
            rest = [i for i in ids if i != alone]
            c.set_cuts({(alone, s) for s in rest} | {(s, alone) for s in rest}, style)
            detail = _join(detail, f"style {style}; "
                           f"{'the master' if alone == m else 'not the master'} alone")
        elif kind == "one-way":
            variant = self.rng.choice(["from-master", "to-master", "pair"])
            if variant == "from-master":
                cuts = {(master, s) for s in slaves}
            elif variant == "to-master":
                cuts = {(s, master) for s in slaves}
            else:
                a = self._choose(ids, pick)
                b = self._choose([i for i in ids if i != a], self.rng.random())
                cuts = {(a, b)}
            hit = tuple(sorted({n for pair in cuts for n in pair}))
            c.set_cuts(cuts, DROP)
            detail = _join(detail, f"{variant}: " + ", ".join(f"{a}->{b}" for a, b in sorted(cuts)))
        else:  # checked in __init__
            raise ValueError(kind)
        self.log(f"[{t_start:7.1f}s] fault {kind} on {list(hit)} for {hold:.1f} s"
                 + (f" ({detail})" if detail else ""))
        self.stop.wait(hold)  # the fault holds: pacing, not synchronisation
        t_end = self.now()
        self.heal()
        recovered = self._wait_recovered()
        self.faults.append(Fault(kind=kind, t_start=t_start, t_end=t_end, nodes=hit,
                                 detail=detail, recovered_s=recovered))
        self.log(f"[{t_end:7.1f}s] healed {kind}; "
                 + (f"recovered in {recovered:.1f} s" if recovered is not None
                    else f"NOT recovered within {RECOVER_DEADLINE_S:.0f} s"))

    def heal(self) -> None:
        """Undo every fault in place: links, pauses, kills."""
        c = self.cluster
        c.heal_links()
        for i in sorted(self._paused):
            c.resume(i)
        self._paused.clear()
        for i in sorted(self._killed):
            c.restart(i)
        self._killed.clear()

    def _wait_recovered(self) -> float | None:
        t0 = time.monotonic()
        while time.monotonic() - t0 < RECOVER_DEADLINE_S and not self.stop.is_set():
            if len(self.cluster.running()) == len(self.cluster.ids) and \
                    self.cluster.agreed_master() is not None:
                return time.monotonic() - t0
            time.sleep(0.1)
        return None
