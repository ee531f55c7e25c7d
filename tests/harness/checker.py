"""The fault harness's checker: the recorded history and the nodes' final
states against design.md's invariants.

Theory of operation
-------------------
Input: every attempt of every client operation (`workload.Op`, with its
outcome and the times it was sent and answered), the faults (`nemesis.Fault`)
and what each node reported about its own state once the cluster was healed
and drained (`NodeState`). Output: a frozen `Report` with every violation
found, the counts, and availability per fault kind; `format_report` prints
it.

A message is named by (queue, msg_id). What counts as a violation:

- lost: a produce answered with a msg_id (OK) whose message was never
  delivered, to the workload or to the drain. Not counted (listed as
  `unverifiable`) for a retry=0 message when a consume of its queue with
  an unknown outcome was sent after the produce: that consume may have
  taken it, and retry=0 never delivers twice.
- dup_retry0: a retry=0 message delivered more than once.
- delivered_after_confirm: a delivery of a message whose consume was sent
  after a confirm of that message had been answered code 0 (issue 12).
  Deliveries whose consume was already under way when the confirm was
  answered are concurrent with it and not counted.
- phantom: a delivery whose data no produce ever sent.
- id_conflict: one message seen with two different data (two deliveries,
  or a delivery and the produce that was answered with its msg_id).
- failed_applied: a produce all of whose attempts failed definitely ("no
  leader", nothing sent), whose data was delivered all the same.
- divergence: nodes that, once healed and quiet, do not report the same
  state: the same commit_id and applied_id, and per queue the same size and
  max_id (checked after the heal and again after the drain).
- drain_incomplete: the queues could not be drained by the deadline (what
  remained is also reported as lost).

Availability: for each fault, the longest time without an answered produce
from the moment the fault started until the first produce answered after
it healed (so a slow recovery counts against the fault that caused it);
per kind, the worst and the median over its occurrences, and the same
figure for the quiet spells (`none`) as a baseline.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from dataclasses import dataclass, field

from .nemesis import Fault
from .workload import Op, Outcome, retry_of

__all__ = ["NodeState", "Report", "check", "format_report", "VIOLATION_KINDS"]

VIOLATION_KINDS = ("lost", "dup_retry0", "delivered_after_confirm", "phantom", "id_conflict",
                   "failed_applied", "divergence", "drain_incomplete")


@dataclass(frozen=True, slots=True, kw_only=True)
class NodeState:
    """What one node reports about its own state (104 and, per queue, 104)."""

    node_id: int
    when: str  # "healed" | "drained"
    status: dict | None  # 104 without a queue
    queues: dict[str, dict | None]  # 104 with each queue


@dataclass(frozen=True, slots=True, kw_only=True)
class Availability:
    kind: str
    count: int
    max_gap_s: float
    median_gap_s: float


@dataclass(frozen=True, slots=True, kw_only=True)
class Report:
    engine: str
    fsync: str
    seed: int
    duration_s: float
    ops: dict[str, dict[str, int]]  # kind -> outcome -> attempts
    acked_produces: int
    deliveries: int
    acked_confirms: int
    faults: dict[str, int]  # kind -> count
    unrecovered_faults: int
    violations: dict[str, list]  # kind -> examples (all of them)
    unverifiable: int
    availability: tuple[Availability, ...]
    drained: bool
    notes: tuple[str, ...] = field(default_factory=tuple)

    def counts(self) -> dict[str, int]:
        return {k: len(self.violations.get(k, [])) for k in VIOLATION_KINDS}

    @property
    def ok(self) -> bool:
        return not any(self.counts().values())


def _during(faults: list[Fault], t: float) -> str:
    """", during <fault>" if a fault held at time t (for a violation's story)."""
    for f in faults:
        if f.t_start <= t <= f.t_end:
            return f", during {f.kind} on {list(f.nodes)}" + (f" ({f.detail})" if f.detail else "")
    return ""


def _deliveries(ops: list[Op]) -> list[Op]:
    return [o for o in ops
            if o.kind == "consume" and o.outcome is Outcome.OK and o.msg_id is not None]


def _availability(ops: list[Op], faults: list[Fault], end: float) -> tuple[Availability, ...]:
    acks = sorted(o.t_complete for o in ops
                  if o.kind == "produce" and o.outcome is Outcome.OK and o.phase == "load")
    by_kind: dict[str, list[float]] = defaultdict(list)

    def worst_gap(start: float, until: float) -> float:
        """Longest span without an ack from `start` to the first ack after `until`."""
        points = [start] + [t for t in acks if start < t <= until]
        after = next((t for t in acks if t > until), end)
        points.append(max(after, points[-1]))
        return max(b - a for a, b in zip(points, points[1:]))

    for f in faults:
        by_kind[f.kind].append(worst_gap(f.t_start, f.t_end))
    # Quiet spells: from a fault's recovery to the next fault (and the
    # first spell, before any fault), without the recovery itself.
    spans = []
    prev = acks[0] if acks else 0.0
    for f in sorted(faults, key=lambda f: f.t_start):
        spans.append((prev, f.t_start))
        prev = f.t_end + (f.recovered_s or 0.0)
    load_end = max((o.t_complete for o in ops if o.phase == "load"), default=prev)
    spans.append((prev, load_end))
    for a, b in spans:
        if b > a:
            inside = [a] + [t for t in acks if a < t < b] + [b]
            by_kind["none"].append(max(y - x for x, y in zip(inside, inside[1:])))
    return tuple(Availability(kind=k, count=len(v), max_gap_s=max(v),
                              median_gap_s=statistics.median(v))
                 for k, v in sorted(by_kind.items()) if v)


def _divergence(states: list[NodeState]) -> list[str]:
    out = []
    for when in ("healed", "drained"):
        group = [s for s in states if s.when == when]
        if not group:
            continue
        missing = [s.node_id for s in group if s.status is None]
        if missing:
            out.append(f"{when}: nodes {missing} did not report their state")
            continue
        ids = {s.node_id: (s.status.get("commit_id"), s.status.get("applied_id")) for s in group}
        if len(set(ids.values())) > 1:
            out.append(f"{when}: (commit_id, applied_id) differ: {ids}")
        queues = sorted({q for s in group for q in s.queues})
        for q in queues:
            seen = {s.node_id: (None if s.queues.get(q) is None else
                                (s.queues[q].get("size"), s.queues[q].get("max_id")))
                    for s in group}
            if len(set(seen.values())) > 1:
                out.append(f"{when}: queue {q} (size, max_id) differ: {seen}")
    return out


def check(ops: list[Op], faults: list[Fault], states: list[NodeState], *, engine: str,
          fsync: str, seed: int, duration_s: float, drained: bool,
          notes: tuple[str, ...] = ()) -> Report:
    violations: dict[str, list] = {k: [] for k in VIOLATION_KINDS}
    deliveries = _deliveries(ops)
    by_msg: dict[tuple[str, int], list[Op]] = defaultdict(list)
    for d in deliveries:
        by_msg[(d.queue, d.msg_id)].append(d)

    # What was produced: every data sent, and the acknowledged messages.
    sent_data: dict[str, list[Op]] = defaultdict(list)
    acked: dict[tuple[str, int], Op] = {}
    for o in ops:
        if o.kind != "produce":
            continue
        sent_data[o.data].append(o)
        if o.outcome is Outcome.OK and o.msg_id is not None:
            key = (o.queue, o.msg_id)
            if key in acked and acked[key].data != o.data:
                violations["id_conflict"].append(
                    f"{key}: produced as {acked[key].data!r} and as {o.data!r}")
            acked[key] = o

    # Consumes with an unknown outcome, per queue, by the time they were sent.
    unknown_consumes: dict[str, list[float]] = defaultdict(list)
    for o in ops:
        if o.kind == "consume" and o.outcome is Outcome.UNKNOWN:
            unknown_consumes[o.queue].append(o.t_invoke)

    unverifiable = 0
    for key, p in sorted(acked.items()):
        got = by_msg.get(key)
        if got:
            for d in got:
                if d.data != p.data:
                    violations["id_conflict"].append(
                        f"{key}: produced as {p.data!r}, delivered as {d.data!r} (node {d.node}, "
                        f"t={d.t_invoke:.2f})")
            continue
        if p.retry == 0 and any(t > p.t_invoke for t in unknown_consumes[p.queue]):
            unverifiable += 1
            continue
        violations["lost"].append(f"{key}: {p.data!r} acknowledged by node {p.node} at "
                                  f"t={p.t_complete:.2f}{_during(faults, p.t_complete)}, "
                                  f"never delivered")

    for key, got in sorted(by_msg.items()):
        datas = {d.data for d in got}
        if len(datas) > 1:
            violations["id_conflict"].append(
                f"{key}: delivered with different data {sorted(datas)}")
        for d in got:
            if d.data not in sent_data:
                violations["phantom"].append(f"{key}: delivered {d.data!r} (node {d.node}, "
                                             f"t={d.t_invoke:.2f}), never produced")
            elif all(o.outcome is Outcome.FAIL for o in sent_data[d.data]):
                violations["failed_applied"].append(
                    f"{key}: {d.data!r} delivered, but every produce attempt failed definitely: "
                    + "; ".join(f"node {o.node}: {o.reason}" for o in sent_data[d.data]))
        if retry_of(got[0].data or "") == 0 and len(got) > 1:
            violations["dup_retry0"].append(
                f"{key}: retry=0 message {got[0].data!r} delivered {len(got)} times: "
                + ", ".join(f"node {d.node} t={d.t_invoke:.2f}" for d in got))

    # Delivered after an acknowledged confirm.
    first_confirm: dict[tuple[str, int], Op] = {}
    for o in ops:
        if o.kind == "confirm" and o.outcome is Outcome.OK:
            key = (o.queue, o.msg_id)
            if key not in first_confirm or o.t_complete < first_confirm[key].t_complete:
                first_confirm[key] = o
    for key, c in sorted(first_confirm.items()):
        for d in by_msg.get(key, []):
            if d.t_invoke > c.t_complete:
                violations["delivered_after_confirm"].append(
                    f"{key}: confirm answered code 0 by node {c.node} (attempt {c.attempt}, "
                    f"sent t={c.t_invoke:.2f}, answered t={c.t_complete:.2f}"
                    f"{_during(faults, c.t_complete)}); delivered again by node {d.node} to a "
                    f"consume sent at t={d.t_invoke:.2f}")

    violations["divergence"] = _divergence(states)
    if not drained:
        violations["drain_incomplete"].append("the queues were not empty by the drain deadline")

    counts: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    for o in ops:
        counts[o.kind][o.outcome.value] += 1
    fault_counts: dict[str, int] = defaultdict(int)
    for f in faults:
        fault_counts[f.kind] += 1
    end = max((o.t_complete for o in ops), default=0.0)
    return Report(
        engine=engine, fsync=fsync, seed=seed, duration_s=duration_s,
        ops={k: dict(v) for k, v in sorted(counts.items())},
        acked_produces=len(acked), deliveries=len(deliveries),
        acked_confirms=sum(1 for o in ops if o.kind == "confirm" and o.outcome is Outcome.OK),
        faults=dict(sorted(fault_counts.items())),
        unrecovered_faults=sum(1 for f in faults if f.recovered_s is None),
        violations=violations, unverifiable=unverifiable,
        availability=_availability(ops, faults, end), drained=drained, notes=tuple(notes))


def format_report(r: Report, examples: int = 5) -> str:
    lines = [(f"fault harness: engine {r.engine}, fsync {r.fsync}, seed {r.seed}, "
              f"{r.duration_s:.0f} s of faults")]
    lines.append("operations (attempts by outcome):")
    for kind, by in r.ops.items():
        total = sum(by.values())
        parts = ", ".join(f"{k} {v}" for k, v in sorted(by.items()))
        lines.append(f"  {kind:8s} {total:7d}  ({parts})")
    lines.append(f"  acknowledged produces {r.acked_produces}, deliveries {r.deliveries}, "
                 f"acknowledged confirms {r.acked_confirms}")
    lines.append("faults: " + (", ".join(f"{k} {v}" for k, v in r.faults.items()) or "none")
                 + (f"; {r.unrecovered_faults} not recovered within the deadline"
                    if r.unrecovered_faults else ""))
    lines.append("violations:")
    for k, n in r.counts().items():
        lines.append(f"  {k:24s} {n}")
        for ex in r.violations.get(k, [])[:examples]:
            lines.append(f"      {ex}")
    lines.append(f"  (unverifiable: {r.unverifiable} acknowledged retry=0 messages never seen, "
                 f"possibly taken by a consume whose answer was lost)")
    lines.append("availability: longest time without an acknowledged produce, from the fault "
                 "to the first produce after healing:")
    lines.append(f"  {'fault':16s} {'count':>5s} {'max s':>7s} {'median s':>9s}")
    for a in r.availability:
        lines.append(f"  {a.kind:16s} {a.count:5d} {a.max_gap_s:7.2f} {a.median_gap_s:9.2f}")
    for n in r.notes:
        lines.append(f"note: {n}")
    found = ", ".join(f"{k} {v}" for k, v in r.counts().items() if v)
    lines.append("RESULT: " + ("no violations" if r.ok else "VIOLATIONS: " + found))
    return "\n".join(lines)
