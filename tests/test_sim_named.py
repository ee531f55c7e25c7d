"""Named scenarios on the simulated network (tests/sim.py), each one a way
queue_server's replication failed or a replication protocol commonly fails.
The sim's Checker verifies design.md's invariants 1 to 4 after every
delivered message and timer in all of them; each test adds the property
its scenario is about."""

from __future__ import annotations

import itertools
import random

import pytest

import sim
from qserver.engines.messages import Pull, Push, Snapshot, VoteReply, VoteRequest, message_from_wire
from qserver.engines.native import core as native
from qserver.engines.native.core import Role, Timing
from qserver.state import store as sim_store
from qserver.state.entries import FINAL_MAX_DELIVERIES, DeadLetter, ProduceBatch
from qserver.state.store import message_view
from qserver.wire.requests import ConfirmRequest, ConsumeRequest, ProduceRequest
from sim import Network, Workload, message_data, run_schedule

E = 300  # the sim's election_ms (Timing(heartbeat_ms=50, election_ms=300, pull_retry_ms=100))


@pytest.fixture(autouse=True)
def small_compaction_slack(monkeypatch):
    # Compact as soon as the log passes log_size, so that a few dozen
    # entries are enough to push a lagging slave onto a snapshot.
    monkeypatch.setattr(native, "COMPACT_SLACK", 0)


# -- helpers -----------------------------------------------------------------


def produce(net: Network, node: int, queue: str, data: str, results: list,
            retry_s: float = 0) -> None:
    """A client produce on `node` (which must be master), as service.py does it."""
    core = net.core(node)
    entry = core.store.decide_produce(
        ProduceRequest(queue=queue, data=data, delay_s=None, ttl_s=None, retry_s=retry_s), net.now)
    net.propose(node, entry, results)


def consume(net: Network, node: int, queue: str, results: list) -> bool:
    core = net.core(node)
    entry = core.store.decide_consume(ConsumeRequest((queue,), None, 0, 0, False), net.now,
                                      core.vote_id)
    if entry is None:
        return False
    net.propose(node, entry, results)
    return True


def master_except(net: Network, *excluded: int) -> int | None:
    """The highest-vote master that is not one of `excluded`."""
    best = None
    for i in net.ids:
        c = net.core(i)
        if i not in excluded and c is not None and c.role is Role.MASTER:
            if best is None or c.vote_id > net.core(best).vote_id:
                best = i
    return best


def elect(net: Network, *excluded: int) -> int:
    assert net.run_until(lambda: master_except(net, *excluded) is not None, 10_000), \
        f"seed {net.seed}: no master elected"
    return master_except(net, *excluded)


def settle(net: Network, max_ms: int = 10_000) -> int:
    assert net.run_until(net.converged, max_ms), f"seed {net.seed}: the cluster did not converge"
    net.checker.final_check()
    return net.master()


def wires(net: Network) -> dict[int, list]:
    return {i: net.core(i).store.to_wire() for i in net.ids if net.core(i) is not None}


def all_data(net: Network, i: int) -> set[str]:
    return {message_data(m) for q in net.core(i).store.queues.values() for m in q.messages.values()}


def log_data(net: Network, i: int) -> set[str]:
    return {r.entry.data for r in net.core(i).log.records if hasattr(r.entry, "data")}


# -- (a) a deposed master whose log is longer but older ------------------------


@pytest.mark.parametrize("n", [3, 5])
@pytest.mark.parametrize("new_master_dies", [False, True])
@pytest.mark.parametrize("seed", range(4))
def test_deposed_master_with_longer_older_log_loses_and_truncates(n, new_master_dies, seed):
    """queue_server compared the bare trans_id first: a master cut off from
    the others kept appending, and on return its longer (but older) log won
    and erased what the others had committed. Here: master A of vote v
    appends 6 entries that reach only itself; B, master of v + 1, commits
    3 (a Noop and 2 produces). A must never win again against nodes holding
    B's entries, and its extra entries (applied speculatively to its store)
    must be truncated and taken back."""
    net = Network(n, seed)
    net.sent = []
    a = elect(net)
    early = []
    for k in range(3):
        produce(net, a, "q", f"early{k}", early)
    assert net.run_until(lambda: len(early) == 3, 5_000) and all(e is None for _, e in early)
    settle(net)

    net.isolate(a)
    lost = []
    for k in range(6):
        produce(net, a, "q", f"lost{k}", lost)
    vote_a = net.core(a).vote_id
    assert {f"lost{k}" for k in range(6)} <= all_data(net, a)  # applied speculatively

    b = elect(net, a)
    assert net.core(b).vote_id > vote_a
    won = []
    for k in range(2):
        produce(net, b, "q", f"won{k}", won)
    assert net.run_until(lambda: len(won) == 2, 5_000) and all(e is None for _, e in won)
    core_a, core_b = net.core(a), net.core(b)
    # The situation queue_server's ballot got wrong: A's log is longer, B's newer.
    assert core_a.log.last_trans_id > core_b.log.last_trans_id
    assert core_a.log.last_position()[0] < core_b.log.last_position()[0]
    # Cut off from its majority, A steps down (check-quorum), keeping its log.
    assert net.run_until(lambda: net.core(a).role is not Role.MASTER, 3 * E)
    assert all(error is not None for _r, error in lost)

    net.heal()
    if new_master_dies:
        # Only A and nodes holding B's entries are left, and A asks first.
        net.crash(b, drop_outgoing=True)
        net.core(a).election_due_ms = net.now
    sent_before = len(net.sent)
    m = elect(net, *((b,) if new_master_dies else ()))
    assert m != a
    if new_master_dies:
        m = settle(net)
        net.start(b)
    m = settle(net)
    assert m != a
    for vote, masters in net.masters_by_vote.items():
        assert vote <= vote_a or a not in masters, f"seed {seed}: A won vote {vote}"
    # No up-to-date node granted A a real vote after the heal.
    for _t, src, dst, msg in net.sent[sent_before:]:
        if dst == a and type(msg) is VoteReply and msg.granted and not msg.pre:
            pytest.fail(f"seed {seed}: node {src} granted the deposed master its vote "
                        f"{msg.vote_id}")
    # A's clients heard "outcome unknown" (when it stepped down), never ok.
    assert len(lost) == 6 and all(error is not None for _r, error in lost)
    # A's lone entries are gone from its log and its store; every store is the same.
    assert not {f"lost{k}" for k in range(6)} & (log_data(net, a) | all_data(net, a))
    assert {f"early{k}" for k in range(3)} | {"won0", "won1"} <= all_data(net, a)
    w = wires(net)
    assert all(v == w[m] for v in w.values()), f"seed {seed}: stores differ"
    assert net.stats["reverts"] >= 6 and net.stats["truncations"] >= 1


def write_now(net: Network, node: int, entry, results: list) -> None:
    """A client write on async master `node` by the fast path, as
    ClusterEngine.commit_now makes it (sim.Network.append_now): answered
    within this call, once its record is written. `results` gets (result,
    error, the node's record on disk at that trans_id when it answered)."""
    assert net.commits_at_once(node), f"seed {net.seed}: node {node} does not commit at once"
    disk = net.nodes[node]
    t = net.core(node).log.last_trans_id + 1
    before = len(results)
    record, answer = net.append_now(node, entry, lambda result, error: results.append(
        (result, error, disk.disk_record(t))))
    answer()
    net._flush(node)
    net.observe((node,))
    assert record.trans_id == t and len(results) == before + 1, "not answered at once"
    assert results[-1][1] is None and results[-1][2] == record, "answered before it was written"


@pytest.mark.parametrize("new_writes", [0, 2])
@pytest.mark.parametrize("production", [False, True], ids=["sim-config", "production"])
@pytest.mark.parametrize("n", [3, 5])
@pytest.mark.parametrize("seed", range(3))
def test_async_master_undoes_the_writes_it_answered_at_once_when_a_new_master_has_others(
        seed, n, production, new_writes):
    """Async mode's fast path (NativeCore.append_now, ClusterEngine.commit_now):
    master A answers a write as soon as its record is on A's disk, before
    any slave holds it. Cut off from the others, A answers a produce, a
    consume of a committed message, the confirm of that delivery and
    another produce, all at once; B, master of a newer vote, commits its
    Noop and `new_writes` produces. Async mode allows losing A's four
    answered writes, and they are lost: when A rejoins, its log drops them
    (truncated, not taken over by a snapshot) and the undo records restore
    its store. At that moment it is the committed state at A's position;
    after the catch-up it is B's, and with no new writes exactly what it
    was before the partition (the consumed and confirmed message back,
    ready)."""
    net = Network(n, seed, async_mode=True, external_snapshots=production)
    a = elect(net)
    early: list = []
    for k in range(2):
        entry = net.core(a).store.decide_produce(
            ProduceRequest(queue="q", data=f"early{k}", delay_s=None, ttl_s=None, retry_s=1),
            net.now)
        write_now(net, a, entry, early)
    settle(net)
    before = net.core(a).store.to_wire()
    vote_a = net.core(a).vote_id

    net.isolate(a)
    lost: list = []
    core_a = net.core(a)
    write_now(net, a, core_a.store.decide_produce(
        ProduceRequest(queue="q", data="lost0", delay_s=None, ttl_s=None, retry_s=0), net.now),
        lost)
    consume_entry = core_a.store.decide_consume(ConsumeRequest(("q",), None, 0, 0, False),
                                                net.now, core_a.vote_id)
    write_now(net, a, consume_entry, lost)
    msg_id, data, deliveries = lost[-1][0]
    assert (data, deliveries) == ("early0", 1)
    write_now(net, a, core_a.store.decide_confirm(ConfirmRequest("q", msg_id)), lost)
    write_now(net, a, core_a.store.decide_produce(
        ProduceRequest(queue="q", data="lost1", delay_s=None, ttl_s=None, retry_s=0), net.now),
        lost)
    lost_data = {"lost0", "lost1"}
    assert all_data(net, a) == lost_data | {"early1"}  # applied at once, with their undo
    assert core_a.applied_id == core_a.log.last_trans_id == core_a.commit_id + 4
    reverts = net.stats["reverts"]

    b = elect(net, a)
    assert net.core(b).vote_id > vote_a
    won: list = []
    for k in range(new_writes):
        entry = net.core(b).store.decide_produce(
            ProduceRequest(queue="q", data=f"won{k}", delay_s=None, ttl_s=None, retry_s=0),
            net.now)
        write_now(net, b, entry, won)
    last_b = net.core(b).log.last_trans_id
    assert net.run_until(lambda: net.core(b).commit_id >= last_b, 5_000)

    # The moment A's log drops its lost entries, its store is the committed
    # state at its position: the undo records took all four back.
    rolled_back: list = []

    def on_step(ids) -> None:
        core = net.core(a)
        if a in ids and core is not None and not rolled_back and not log_data(net, a) & lost_data:
            rolled_back.append(core.applied_id)
            assert core.applied_id == core.commit_id
            assert core.store.to_wire() == net.checker.reference(core.applied_id), \
                f"seed {seed}: A's store after the rollback is not the committed state"

    net.observers.append(on_step)
    net.heal()
    m = settle(net)
    assert m != a and rolled_back, f"seed {seed}: A never dropped its lost entries"
    assert net.stats["reverts"] - reverts >= 4 and net.stats["truncations"] >= 1
    assert net.stats["snapshots"] == 0  # a truncation, not a snapshot install, dropped them
    assert not lost_data & (log_data(net, a) | all_data(net, a))
    w = wires(net)
    assert all(v == w[m] for v in w.values()), f"seed {seed}: stores differ"
    assert all_data(net, a) == {"early0", "early1"} | {f"won{k}" for k in range(new_writes)}
    if not new_writes:
        assert w[a] == before, f"seed {seed}: A's store is not what it was before the partition"


@pytest.mark.parametrize("seed", [2604, 3824, 4621])
def test_records_pulled_before_their_coalesced_push_and_compacted_do_not_stop_the_master(seed):
    """Async mode, push_interval_ms 20, log_size 10, in-memory snapshots
    (seed 2604): master 2 of vote 4 appends records 29-46 within one push
    interval; a heartbeat tells slave 1 its last trans_id, slave 1 pulls
    them all (served from 29: sent_upto 46, pushed_upto still 28), they
    commit with the master's copy (commit 46). The log used to be
    compacted to base 36 then, and the next take_ready's push from
    pushed_upto + 1 = 29 to slave 3 (still in step at 28) raised
    InvariantError; a master now never compacts past what it has pushed.
    Seeds 3824 and 4621 failed the same way (3 nodes, async); replayed as
    they ran then, without leader transfers."""
    run_schedule(seed, n=3, async_mode=True, transfers=False)


# -- (b) a split vote in which one voter could grant two candidates ----------


@pytest.mark.parametrize("voter_restarts", [False, True])
@pytest.mark.parametrize("seed", range(6))
def test_split_vote_voter_grants_at_most_one(voter_restarts, seed):
    """Nodes 1 and 2 become candidates for the same vote_id; node 3 sees
    both requests. It must grant at most one (its vote is persisted, so not
    even a restart between the two requests changes that); there is at
    most one master per vote_id; then the cluster converges on one master
    that everyone follows."""
    net = Network(3, seed)
    net.sent = []
    c1, c2, c3 = (net.core(i) for i in (1, 2, 3))
    c1.election_due_ms = c2.election_due_ms = net.now + 10
    c3.election_due_ms = net.now + 100 * E
    # Until both are candidates, only node 1's request to node 3 goes
    # through, and node 3's answer waits.
    net.hold_if = lambda src, dst, msg: (
        (type(msg) is VoteRequest and not msg.pre and (src, dst) != (1, 3))
        or (src == 3 and type(msg) is VoteReply and not msg.pre))
    assert net.run_until(lambda: c1.role is Role.CANDIDATE and c2.role is Role.CANDIDATE
                         and c1.vote_id == c2.vote_id and net.core(3).voted_for == 1, 5_000)
    vote = c1.vote_id
    assert net.nodes[3].disk_vote == (vote, 1)
    if voter_restarts:
        net.crash(3)
        net.start(3)
        net.core(3).election_due_ms = net.now + 100 * E
    net.hold_if = None
    net.release()
    net.run_for(50)
    grants = [(src, dst) for _t, src, dst, msg in net.sent
              if type(msg) is VoteReply and msg.granted and not msg.pre and msg.vote_id == vote
              and src == 3]
    assert grants and all(dst == 1 for _src, dst in grants), grants
    assert net.masters_by_vote.get(vote, set()) <= {1}
    m = settle(net)
    assert all(len(v) == 1 for v in net.masters_by_vote.values()), net.masters_by_vote
    for i in net.ids:
        if i != m:
            assert net.core(i).leader_id == m and net.core(i).role is Role.SLAVE


# -- (c) a slave that learned the master before it could pull ---------------


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("sync_rate", [100_000, 40])
def test_slave_that_never_pulled_catches_up_without_new_writes(seed, sync_rate):
    """A slave hears of the master from one heartbeat while its own link to
    the master is down, so the pull that heartbeat triggers is lost; then
    every later heartbeat to it is lost too. When its link comes back it
    must catch up by pulling on its own timer, with no client writing
    anything (queue_server pulled only when a push arrived)."""
    net = Network(3, seed, sync_rate=sync_rate)
    m = elect(net)
    s = next(i for i in net.ids if i != m)
    net.crash(s)
    results = []
    for k in range(30):
        produce(net, m, "q", f"m{k}", results, retry_s=1 if k % 3 else 0)
    assert net.run_until(lambda: len(results) == 30, 5_000)
    c = []
    for _ in range(5):
        consume(net, m, "q", c)
    net.run_for(200)

    heartbeats_seen = []
    down_until = net.now + 5 * E  # the slave's link to the master is down until then

    def drop(src, dst, msg):
        if dst == s and type(msg) is Push and not msg.records:
            if heartbeats_seen:  # the first heartbeat gets through, no other
                return True
            heartbeats_seen.append(msg)
            return False
        return src == s and dst == m and net.now < down_until  # its pulls are lost

    net.drop_if = drop
    net.start(s)
    assert net.run_until(lambda: heartbeats_seen, 1_000)
    assert net.core(s).leader_id == m
    assert net.core(s).log.last_trans_id < net.core(m).log.last_trans_id
    proposed = net.core(m).log.last_trans_id
    assert net.run_until(lambda: net.converged(), 10 * E + 30 * 1000 // sync_rate * 4), \
        f"seed {seed}: the slave did not catch up: {net.core(s).status()} vs {net.core(m).status()}"
    assert net.core(m).log.last_trans_id == proposed  # no new writes did it
    assert net.core(s).store.to_wire() == net.core(m).store.to_wire()
    net.checker.final_check()


# -- (d) a vote collision is retried promptly ----------------------------------


@pytest.mark.parametrize("timing", [None, Timing()], ids=["sim-timing", "default-timing"])
def test_split_vote_without_winner_is_retried_within_a_few_election_timeouts(timing):
    """All three nodes become candidates of the same vote_id and each votes
    for itself: nobody can win. A master must follow within about 2-3
    election timeouts of virtual time (a candidate whose election failed
    used to ignore every pre-vote reply, so the cluster hung on the split
    until something else happened)."""
    waits = []
    for seed in range(40):
        net = Network(3, seed, timing=timing)
        e = net.timing.election_ms
        for i in net.ids:
            net.core(i).election_due_ms = net.now + 5
        # Everyone grants everyone's pre-vote before anyone hears a grant;
        # nobody sees a real VoteRequest until all three are candidates.
        net.hold_if = lambda src, dst, msg: type(msg) is VoteReply or (
            type(msg) is VoteRequest and not msg.pre)
        assert net.run_until(lambda net=net: sum(type(message_from_wire(w)) is VoteReply
                                                 for _s, _d, w in net.held) == 6, 5 * e)
        net.hold_if = lambda src, dst, msg: type(msg) is VoteRequest and not msg.pre
        net.release()
        assert net.run_until(
            lambda net=net: all(net.core(i).role is Role.CANDIDATE for i in net.ids), 5 * e)
        vote = net.core(1).vote_id
        assert all(net.core(i).vote_id == vote and net.core(i).voted_for == i for i in net.ids)
        split_at = net.now
        net.hold_if = None
        net.release()
        assert net.run_until(lambda net=net: net.master() is not None, 20 * e), \
            f"seed {seed}: no master"
        assert vote not in net.masters_by_vote
        waits.append((net.now - split_at) / e)
        settle(net)
    assert max(waits) <= 3.0, f"elections after a split took {sorted(waits)[-5:]} election timeouts"
    assert sorted(waits)[len(waits) // 2] <= 2.0, sorted(waits)


# -- (e) a rejoining slave behind the master's log ------------------------------


@pytest.mark.parametrize("entries", [12, 150])
@pytest.mark.parametrize("sync_rate", [100_000, 200])
@pytest.mark.parametrize("seed", range(3))
def test_rejoining_slave_gets_exactly_the_masters_state(entries, sync_rate, seed):
    """A slave cut off while the master writes `entries` entries (log_size
    is 40: 150 entries need a snapshot, 12 do not) comes back. It must end
    with exactly the master's state and trans_id, and at no point hold a
    store that is not the committed sequence applied up to the trans_id it
    reports (queue_server's bounded log could leave it with half the
    messages while it reported the master's trans_id)."""
    net = Network(3, seed, log_size=40, sync_rate=sync_rate)
    work = Workload(net, random.Random(seed), at_master=True)
    m = elect(net)
    for _ in range(10):
        work.produce("a", retry_s=1)
    settle(net)
    s = next(i for i in net.ids if i != m)
    net.isolate(s)
    written = 0
    for op in itertools.cycle(range(4)):
        if written >= entries:
            break
        before = net.core(m).log.last_trans_id
        if op == 0 or op == 1:
            work.produce(retry_s=(0, 1)[written % 2])
        elif op == 2:
            work.consume()
        else:
            work.confirm()
        written += net.core(m).log.last_trans_id - before
        net.run_for(5)
    assert net.run_until(lambda: net.core(m).commit_id == net.core(m).log.last_trans_id, 5_000)
    lag = net.core(m).log.last_trans_id - net.core(s).log.last_trans_id
    assert lag >= entries
    snapshots_before = net.stats["snapshots"]
    net.heal()
    core_s = net.core(s)
    seen = set()

    def consistent() -> bool:
        # Whatever the slave reports, its store is the committed sequence
        # applied up to its applied_id, and nothing past its log.
        t = core_s.applied_id
        if t not in seen:
            seen.add(t)
            assert core_s.store.to_wire() == net.checker.reference(t), \
                f"seed {seed}: the slave's store at {t} is not the committed state at {t}"
        assert core_s.commit_id <= core_s.log.last_trans_id
        return net.converged()

    assert net.run_until(consistent, 20_000), f"seed {seed}: no catch-up: {core_s.status()}"
    core_m = net.core(m)
    assert core_s.status().trans_id == core_m.status().trans_id
    assert core_s.applied_id == core_m.applied_id
    assert core_s.store.to_wire() == core_m.store.to_wire()
    if entries > 40:
        assert net.stats["snapshots"] > snapshots_before
    else:
        assert net.stats["snapshots"] == snapshots_before
    net.checker.final_check()


# -- (f) a failover never reuses the msg_id of an acknowledged produce ------


@pytest.mark.parametrize("n", [3, 5])
@pytest.mark.parametrize("seed", range(5))
def test_acked_produce_keeps_its_msg_id_across_failovers(n, seed):
    """queue_server's master answered a produce before any slave had it; a
    failover then handed the same msg_id to the next message. In quorum
    mode, the master is killed right after the client hears the ack (with
    its unsent messages): the new master holds the message with its data,
    hands out strictly greater ids, and does not deliver again what was
    consumed with an ack. Three failovers in a row."""
    net = Network(n, seed)
    work = Workload(net, random.Random(seed), strict=True, at_master=True)
    acked: dict[str, tuple] = {}
    m = elect(net)
    for _round in range(3):
        # A pending at-least-once message, and an at-most-once one that a
        # client then consumes with an ack.
        names = {}
        for tag, retry in (("kept", 5), ("gone", 0)):
            data = names[tag] = work.produce("q", retry_s=retry, delay_s=None, ttl_s=None)
            assert net.run_until(lambda data=data: work.produced[data].acked_at is not None,
                                 5_000)
            acked[data] = work.produced[data].targets[0]
        for _ in range(20):
            if work.delivered(names["gone"]):
                break
            work.consume("q")
            assert net.run_until(lambda m=m: not net.core(m).waiting, 5_000)
        assert work.delivered(names["gone"])
        # Kill the master right after that ack, before it says anything else.
        net.crash(m, drop_outgoing=True)
        m2 = elect(net, m)
        q = net.core(m2).store.get("q")
        for data, (_queue, msg_id) in acked.items():
            if work.delivered(data) and work.produced[data].retry_ms == 0:
                assert msg_id not in q.messages, f"seed {seed}: consumed {data} is back"
            else:
                assert message_data(q.messages[msg_id]) == data
        before = q.max_id
        new = work.produce("q", retry_s=0, delay_s=None, ttl_s=None)
        assert net.run_until(lambda new=new: work.produced[new].acked_at is not None, 5_000)
        new_id = work.produced[new].targets[0][1]
        assert new_id > max(msg_id for _q, msg_id in acked.values()) and new_id > before
        acked[new] = work.produced[new].targets[0]
        net.start(m)
        m = m2
    m = settle(net)
    work.final_check(m)


# -- regressions found by the randomized schedules -----------------------------


@pytest.mark.parametrize("seed", range(3))
def test_late_snapshot_never_drops_entries_the_slave_acknowledged(seed):
    """A snapshot overtaken by pushes (the master sent it for an old pull)
    reaches a slave whose log already goes past it, entries it has
    acknowledged and the master counted for a commit. It must keep them:
    installing the snapshot used to clear the whole log, so the write was
    acknowledged on a majority of which one node no longer held it
    (schedule seed 559, 5 nodes, quorum: invariant 2 broke)."""
    net = Network(3, seed, log_size=4)
    work = Workload(net, random.Random(seed), strict=True, at_master=True)
    m = elect(net)
    for _ in range(8):
        work.produce("q", retry_s=0, delay_s=None, ttl_s=None)
    settle(net)
    s, t = (i for i in net.ids if i != m)
    net.crash(t)  # m and s are the majority now
    # Until t has been silent for two heartbeats, the master may still count
    # it among the slaves that keep up and leave s the spare one, pushed
    # only every SPARE_PUSH_MS: s would get the records below in fewer
    # pushes, and with them more of the commit position than this needs.
    net.run_for(3 * net.timing.heartbeat_ms)
    c0 = net.core(m).commit_id
    # s hears no heartbeat, so it learns no commit position after c0.
    net.drop_if = lambda src, dst, msg: dst == s and type(msg) is Push and not msg.records
    names = [work.produce("q", retry_s=0, delay_s=None, ttl_s=None) for _ in range(5)]
    assert net.run_until(lambda: all(work.produced[d].acked_at is not None for d in names), 2_000)
    core_s, core_m = net.core(s), net.core(m)
    at = core_s.commit_id + 1
    assert core_s.log.last_trans_id == c0 + 5 > at
    # The snapshot the master sent when its commit was at `at`.
    net.deliver(m, s, Snapshot(vote_id=core_m.vote_id, node_id=m, trans_id=at,
                               log_vote_id=core_m.log.vote_id_at(at),
                               state=net.checker.reference(at)))
    assert core_s.log.last_trans_id == c0 + 5 and core_s.commit_id == at  # kept, and commits
    # The acknowledged writes survive the master's death with the slave's copy.
    net.drop_if = None
    net.crash(m, drop_outgoing=True)
    net.start(t)
    elect(net, m)
    net.start(m)
    m = settle(net)
    work.final_check(m)


@pytest.mark.parametrize("seed", range(3))
def test_deposed_master_diverging_at_the_compaction_base_gets_a_snapshot(seed):
    """A deposed master's lone entries straddle the new master's compaction
    base: the first position their logs can share is the base itself, and
    the entries there differ. Only a snapshot can repair that; the master
    used to answer every pull with an empty push from its base, and the
    two nodes pulled and pushed forever (seeds 282 and 32: no convergence)."""
    log_size = 10
    net = Network(3, seed, log_size=log_size)
    a = elect(net)
    early = []
    for k in range(3):
        produce(net, a, "q", f"early{k}", early)
    settle(net)
    net.isolate(a)
    lost = []
    for k in range(10):
        produce(net, a, "q", f"lost{k}", lost)
    first_lost = net.core(a).log.last_trans_id - 9
    b = elect(net, a)
    assert net.run_until(lambda: net.core(a).role is not Role.MASTER, 3 * E)
    won = []
    for k in range(log_size + 4):
        produce(net, b, "q", f"won{k}", won)
    assert net.run_until(lambda: len(won) == log_size + 4, 5_000)
    base = net.core(b).log.base_trans_id
    assert first_lost < base <= net.core(a).log.last_trans_id, (first_lost, base)
    net.heal()
    m = settle(net)
    assert m != a
    assert net.stats["snapshots"] >= 1
    assert net.core(a).store.to_wire() == net.core(m).store.to_wire()
    assert not {f"lost{k}" for k in range(10)} & all_data(net, a)


@pytest.mark.parametrize("seed", range(3))
def test_slave_answered_by_stale_pulls_still_learns_the_commit(seed):
    """A slave's repeated pulls for one position reach the master late and
    together. The first answer brings the slave up to date; the later ones,
    cut short by the sync_rate budget, make the master believe the slave
    holds less than it does, so every heartbeat told the slave a commit
    position far behind, and its store waited for the next client write
    (seeds 1459 and 658). Without any new write it must catch up."""
    timing = Timing(heartbeat_ms=50, election_ms=2_000, pull_retry_ms=100)
    net = Network(3, seed, timing=timing, sync_rate=30)
    m = elect(net)
    settle(net)
    s, t = (i for i in net.ids if i != m)
    net.crash(t)  # commits need s
    net.isolate(s)
    results = []
    for k in range(20):
        produce(net, m, "q", f"m{k}", results)
    net.run_for(100)
    net.heal()
    net.hold_if = lambda src, dst, msg: src == s and dst == m and type(msg) is Pull
    assert net.run_until(lambda: len(net.held) >= 3, 1_000)
    net.hold_if = None
    net.release()
    proposed = net.core(m).log.last_trans_id
    assert net.run_until(lambda: len(results) == 20, 1_000)
    assert net.run_until(net.converged, 1_000), \
        f"seed {seed}: {net.core(s).status()} vs master {net.core(m).status()}"
    assert net.core(m).log.last_trans_id == proposed
    assert net.core(s).store.to_wire() == net.core(m).store.to_wire()


@pytest.mark.parametrize("seed", range(3))
def test_slave_with_newer_but_lost_entries_finds_the_common_point_quickly(seed):
    """Master A of vote 1 appends 20 entries that reach only itself; B, master
    of vote 2, appends 15 entries at the same positions that reach only
    itself; A comes back and wins vote 3 (its log is the most up to date
    left), which commits A's vote-1 entries. When B returns, its entries
    carry a newer vote than the master's at the same positions. Walking
    back one entry per pull, and starting over from its last entry at
    every heartbeat, B took some 40 pulls here, and in a 5-node schedule
    never found the common point (seed 200309); it must skip its whole run
    of vote-2 entries at once."""
    net = Network(3, seed)
    net.sent = []
    a = elect(net)
    settle(net)
    b, c = (i for i in net.ids if i != a)
    net.isolate(a)
    lone_a = []
    for k in range(20):
        produce(net, a, "q", f"a{k}", lone_a)
    net.core(c).election_due_ms = net.now + 100 * E  # b is the one to ask
    assert net.run_until(lambda: net.core(b).role is Role.MASTER, 5 * E)
    net.isolate(b)  # at once: its Noop does not reach c
    lone_b = []
    for k in range(15):
        produce(net, b, "q", f"b{k}", lone_b)
    assert net.core(c).log.last_trans_id < net.core(a).log.last_trans_id
    net.heal()
    net.isolate(b)
    m = elect(net, b)
    assert m == a and net.core(a).vote_id > net.core(b).vote_id
    settle_a = net.run_until(lambda: net.core(c).commit_id == net.core(a).log.last_trans_id, 5 * E)
    assert settle_a
    at = net.core(a).log.get(net.core(b).log.last_trans_id)
    assert at.vote_id < net.core(b).log.last_position()[0]  # the master's entry there is older
    pulls_before = sum(1 for _t, src, _d, msg in net.sent if src == b and type(msg) is Pull)
    net.heal()
    assert net.run_until(net.converged, 4 * E), \
        f"seed {seed}: {net.core(b).status()} vs master {net.core(a).status()}"
    pulls = sum(1 for _t, src, _d, msg in net.sent if src == b and type(msg) is Pull) - pulls_before
    assert pulls <= 6, f"seed {seed}: {pulls} pulls to find the common point"
    assert not {f"b{k}" for k in range(15)} & all_data(net, b)
    assert net.core(b).store.to_wire() == net.core(a).store.to_wire()


# -- answers that append no entry (issue 12) --------------------------------------


def request_of(work: Workload, data: str):
    return next(r for r in work.requests if r.data == data)


@pytest.mark.parametrize("production", [False, True], ids=["sim-config", "production"])
@pytest.mark.parametrize("n", [3, 5])
@pytest.mark.parametrize("seed", range(3))
def test_retried_confirm_on_a_cut_off_master_is_not_acknowledged(seed, n, production):
    """Issue 12, step by step: a message with retry > 0 is produced and
    consumed on master M; M is cut off from every slave; the client
    confirms on M, which appends the confirm and applies it to its store
    but cannot commit it; the client times out and retries the confirm on
    M, where the message is now unknown, so the answer appends no entry.
    M must not acknowledge it (it used to answer code 0 at once; the new
    master, which never had the confirm, delivered the message again once
    its retry came due). The client goes on retrying, finds the new
    master, which commits the confirm; the message is never delivered
    again and M's lone confirm is truncated."""
    net = Network(n, seed, external_snapshots=production, deferred_sync=production)
    work = Workload(net, random.Random(seed), at_master=True, max_attempts=30, timeout_ms=60,
                    backoff_ms=(40, 40), same_node_rate=1.0)
    m = elect(net)
    data = work.produce("q", retry_s=1, delay_s=None, ttl_s=None)
    assert net.run_until(lambda: work.produced[data].acked_at is not None, 2_000)
    consume = work.consume("q")
    assert net.run_until(lambda: consume.acked is not None, 2_000)
    key = ("q", work.produced[data].targets[0][1])
    assert [d.data for d in work.deliveries[key]] == [data]
    settle(net)

    net.isolate(m)
    confirm = work.confirm(key, node=m)
    at = net.core(m).log.last_trans_id
    lone = net.core(m).log.get(at)
    assert lone.entry == ("q", key[1]) and key[1] not in net.core(m).store.get("q").messages
    # The client's retry reaches M while it still believes it is master.
    assert net.run_until(lambda: (m, "read") in confirm.executed, E)
    assert net.core(m).role is Role.MASTER
    m2 = elect(net, m)
    # The new master commits its own entry at the position of M's lone
    # confirm (had M acknowledged that read, the Checker fails here), and
    # the client, retrying, finds it.
    assert net.run_until(lambda: confirm.finished and net.core(m2).commit_id >= at, 10_000)
    assert confirm.acked is not None and confirm.acked.target == m2
    assert confirm.acked.entry is not None
    reads_on_m = [i for i, (node, kind) in enumerate(confirm.executed)
                  if (node, kind) == (m, "read")]
    assert reads_on_m and all(confirm.outcomes[i] != "ok" for i in reads_on_m)

    net.heal()
    # Consumers on the new master, well past the message's retry time.
    for _ in range(10):
        work.consume("q", node=m2)
        net.run_for(150)
    m = settle(net)
    assert [d.data for d in work.deliveries[key]] == [data]
    assert net.checker.committed[at - 1] != lone  # M's lone confirm was undone
    assert key[1] not in net.core(m).store.get("q").messages
    work.final_check(m)


@pytest.mark.parametrize("production", [False, True], ids=["sim-config", "production"])
@pytest.mark.parametrize("seed", range(4))
def test_empty_consume_on_a_paused_master_is_not_acknowledged(seed, production):
    """Master M is paused (SIGSTOP) and cut off; the others elect a new
    master, which commits a produce. A consume sent to M meanwhile waits in
    its socket buffer and is read the moment M resumes, before its overdue
    timers fire: M still believes it is master and knows nothing of the
    produce, so its queue is empty. That answer (it appends no entry) must
    not be acknowledged: a consume asked after the produce was
    acknowledged must not find the queue empty. M answers "outcome
    unknown" once it has stepped down."""
    net = Network(3, seed, external_snapshots=production, deferred_sync=production)
    work = Workload(net, random.Random(seed), max_attempts=1, timeout_ms=5_000)
    m = elect(net)
    settle(net)
    net.isolate(m)
    net.pause(m)
    m2 = elect(net, m)
    data = work.produce("q", retry_s=0, delay_s=None, ttl_s=None, node=m2)
    assert net.run_until(lambda: work.produced[data].acked_at is not None, 2_000)
    consume = work.consume("q", node=m)
    net.run_for(100)
    assert consume.executed == [] and net.core(m).role is Role.MASTER
    net.resume(m)
    assert net.run_until(lambda: consume.finished, 3 * E)
    assert consume.executed == [(m, "read")]
    assert consume.acked is None and consume.outcomes == [native.OUTCOME_UNKNOWN]
    net.heal()
    m = settle(net)
    assert m == m2
    work.final_check(m)


@pytest.mark.parametrize("n, seeds", [(3, range(0, 40)), (5, range(0, 16))],
                         ids=["3nodes", "5nodes"])
def test_clients_retrying_through_master_partitions_get_only_committed_answers(n, seeds):
    """Random schedules (sim.run_schedule, faults="master_partitions") in
    which the master is cut off, paused or left alone again and again while
    clients retry on it, mostly on the same node: every acknowledged
    answer, empty consumes and "unknown id" confirms included, rests on
    the committed history (before the read index, 19 of the 40 3-node
    schedules and 5 of the 16 5-node ones acknowledged an answer that a new
    master then undid, or a stale one)."""
    failures = []
    for seed in seeds:
        try:
            run_schedule(seed, n=n, faults="master_partitions")
        except AssertionError as exc:
            failures.append((seed, str(exc)))
    assert not failures, f"seeds {[s for s, _ in failures]}; first: {failures[0][1]}"


# -- the production configuration: snapshot files, deferred sync -----------------


def produce_60(net: Network, work: Workload, queue: str) -> None:
    """60 produces to `queue`, 3 ms apart, half of them at-least-once, all
    answered."""
    for k in range(60):
        work.produce(queue, retry_s=(0, 1)[k % 2], delay_s=None, ttl_s=None)
        net.run_for(3)
    assert net.run_until(lambda: work.idle(), 5_000)


@pytest.mark.parametrize("seed", range(3))
def test_lagging_slave_installs_the_masters_snapshot_file_after_a_broken_stream(seed):
    """External snapshots: a slave cut off while the master writes 60
    entries (log_size 10: the master writes snapshot files and compacts
    its log up to them) comes back behind the master's log. The master
    streams its newest file; the link breaks at the first chunk (dropped),
    the stream is dropped, and the slave's next pull starts it again. The
    slave installs the file (the core gets a SnapshotLoader) and ends with
    the master's state; its disk then holds that file."""
    net = Network(3, seed, log_size=10, external_snapshots=True, deferred_sync=True,
                  snapshot_chunks=(2, 6))
    work = Workload(net, random.Random(seed), at_master=True)
    m = elect(net)
    settle(net)
    s = next(i for i in net.ids if i != m)
    net.isolate(s)
    produce_60(net, work, "a")
    assert net.stats["snapshots_written"] >= 2
    assert net.core(m).log.base_trans_id > net.core(s).log.last_trans_id
    broken = []

    def drop_first_chunk(src, dst, msg):
        if type(msg) is sim._Chunk and not broken:
            broken.append(msg)
            return True
        return False

    net.drop_if = drop_first_chunk
    net.heal()
    m = settle(net, 20_000)
    assert broken and net.stats["snapshot_streams_broken"] >= 1
    assert net.stats["snapshot_streams"] >= 2 and net.stats["snapshot_files_received"] >= 1
    assert net.core(s).store.to_wire() == net.core(m).store.to_wire()
    assert net.nodes[s].disk_base[0] >= broken[0].trans_id
    net.crash(s)
    net.start(s)  # it restarts from the installed file
    m = settle(net)
    work.final_check(m)


@pytest.mark.parametrize("async_mode", [False, True])
@pytest.mark.parametrize("seed", range(3))
def test_snapshots_on_demand_are_written_only_for_a_slave_behind_the_log(seed, async_mode):
    """Snapshots on demand (a node without a data directory): while both
    slaves keep up, no snapshot is written however many entries go by, and
    the log stays near log_size. A slave cut off meanwhile comes back
    behind the master's log: the master writes a snapshot then, streams
    it, holds its log after it, and the slave ends with its state."""
    net = Network(3, seed, async_mode=async_mode, log_size=10, external_snapshots=True,
                  snapshots_on_demand=True, snapshot_write_ms=(20, 60))
    work = Workload(net, random.Random(seed), at_master=True, strict=not async_mode)
    m = elect(net)
    settle(net)
    produce_60(net, work, "a")
    assert net.stats["snapshots_written"] == 0
    core = net.core(m)
    assert len(core.log) <= core.log_size + native.COMPACT_SLACK
    assert core.log.base_trans_id > 0  # compacted without a snapshot
    s = next(i for i in net.ids if i != m)
    net.isolate(s)
    produce_60(net, work, "b")
    assert net.stats["snapshots_written"] == 0  # nobody needed one yet
    assert net.core(m).log.base_trans_id > net.core(s).log.last_trans_id
    net.heal()
    m = settle(net, 20_000)
    assert net.stats["snapshots_written"] >= 1 and net.stats["snapshot_files_received"] >= 1
    assert not net.core(m).snapshot_wanted
    assert net.core(s).store.to_wire() == net.core(m).store.to_wire()
    work.final_check(m)


@pytest.mark.parametrize("seed", range(3))
def test_deferring_master_counts_its_own_copy_only_once_fsynced(seed):
    """Deferred sync (fsync=always): while both slaves keep up, they alone
    make the majority, so a write is acknowledged before the master's own
    fsync (left to the batch timer) has finished. With one slave down, the
    master's copy is needed: the Ready's own_sync is NOW, its fsync starts
    at once, and the write is acknowledged only after that fsync covers it."""
    fsync_ms = 80
    net = Network(3, seed, external_snapshots=True, deferred_sync=True,
                  fsync_ms=(fsync_ms, fsync_ms))
    work = Workload(net, random.Random(seed), at_master=True, timeout_ms=10_000)
    m = elect(net)
    settle(net)

    def acked_position(data):
        req = request_of(work, data)
        assert net.run_until(lambda: req.acked is not None, 1_000)
        return req.acked.trans_id

    start = net.now
    t = acked_position(work.produce("q", retry_s=0, delay_s=None, ttl_s=None))
    assert net.now - start < fsync_ms and net.nodes[m].synced_upto < t
    net.run_for(200)
    assert net.nodes[m].synced_upto >= t

    net.crash(next(i for i in net.ids if i != m))
    net.run_for(200)  # its last answers are older than two heartbeats now
    start = net.now
    t = acked_position(work.produce("q", retry_s=0, delay_s=None, ttl_s=None))
    assert net.now - start >= fsync_ms and net.nodes[m].synced_upto >= t
    net.start(next(i for i in net.ids if not net.alive(i)))
    m = settle(net)
    work.final_check(m)


@pytest.mark.parametrize("seed", range(4))
def test_power_loss_of_every_node_keeps_every_acknowledged_write(seed):
    """Invariant 5 with deferred sync: every node loses power at once while
    the master holds acknowledged records that it has written but not yet
    fsynced (its slaves had fsynced them before answering, which is why
    they were acknowledged). Those records are gone from the master's disk;
    the cluster comes back with every acknowledged write."""
    net = Network(3, seed, log_size=8, external_snapshots=True, deferred_sync=True,
                  fsync_ms=(30, 60))
    work = Workload(net, random.Random(seed), at_master=True, timeout_ms=10_000)
    m = elect(net)
    settle(net)
    for k in range(30):
        work.produce("q", retry_s=(0, 1)[k % 2], delay_s=None, ttl_s=None)
        if k % 3 == 2:
            work.consume("q")
        net.run_for(k % 4)

    def master_lacks_an_acked_write() -> bool:
        return any(r.acked is not None and r.acked.entry is not None
                   and r.acked.trans_id > net.nodes[m].synced_upto for r in work.requests)

    assert net.run_until(master_lacks_an_acked_write, 1_000)
    for i in net.ids:
        net.crash(i, drop_outgoing=True, keep_unsynced=False)
    assert net.stats["unsynced_lost"] > 0
    work.stop()
    for i in net.ids:
        net.start(i)
    m = settle(net)
    work.final_check(m)


@pytest.mark.parametrize("seed", [0, 2])
def test_a_stale_snapshot_file_read_with_the_new_masters_in_one_turn(seed):
    """A slave far behind gets two snapshot files in one loop turn: first the
    new master's (the core installs it), then the deposed master's, older
    (its stream started before the election; the core ignores it: an older
    vote). The adapter must install the file the core took and discard the
    other. Found by this scenario: SnapshotFiles remembered only the last
    file received, so the flush found the wrong one and install_into raised
    InvariantError, stopping the slave (fixed in 7a8e1d0, which the sim
    mirrors)."""
    net = Network(3, seed, log_size=10, external_snapshots=True, deferred_sync=True,
                  snapshot_chunks=(1, 1))
    work = Workload(net, random.Random(seed), at_master=True)
    a = elect(net)
    settle(net)
    s, c = (i for i in net.ids if i != a)
    net.isolate(s)
    for _ in range(40):
        work.produce("q", retry_s=0, delay_s=None, ttl_s=None)
        net.run_for(3)
    assert net.run_until(work.idle, 5_000)
    net.run_for(300)  # both write snapshot files
    net.hold_if = lambda src, dst, msg: type(msg) is sim._Chunk and dst == s
    net.heal()
    assert net.run_until(lambda: any(src == a for src, _d, _m in net.held), 2_000)
    net.isolate(a)
    assert net.run_until(lambda: net.core(c).role is Role.MASTER, 10 * E)
    assert net.run_until(lambda: any(src == c for src, _d, _m in net.held), 10 * E)
    files = {src: (chunk.trans_id, chunk.vote_id) for src, _d, chunk in net.held}
    assert files[a][1] < files[c][1] and files[a][0] != files[c][0], files
    # The new master's file, then the stale one, in one loop turn of the slave.
    net.held.sort(key=lambda held: held[0] != c)
    net.hold_if = None
    net.heal()
    net.batch_rate = 1.0
    net.release()
    net.run_for(20)
    net.batch_rate = 0.0
    m = settle(net)
    assert m == c and net.core(s).store.to_wire() == net.core(m).store.to_wire()
    work.final_check(m)


@pytest.mark.parametrize("production", [False, True], ids=["sim-config", "production"])
@pytest.mark.parametrize("seed", range(4))
def test_stale_master_elected_late_need_not_hold_entries_a_later_master_committed(seed,
                                                                                  production):
    """Master A of vote v, cut off, appends entries that only it holds,
    and crashes. B asks for vote v + 1 and is paused (SIGSTOP) right away;
    C grants it (C lacks A's entries too), and the grant waits in B's
    socket buffer. A restarts and wins vote v + 2 with C's vote (its log is
    newer than C's); its Noop commits A's entries of vote v along with it.
    B resumes, reads C's grant first and becomes master of v + 1: a stale
    master, whose log lacks those entries of vote v. That is no breach of
    invariant 2: they were committed under vote v + 2, later than B's (a
    majority had not stored them when C voted for B), and B can neither
    commit nor confirm a read; the first message of vote v + 2 it reads
    deposes it. Found as seed 6346 of run_schedule (3 nodes, quorum,
    production): the Checker took an entry's own vote_id for the one
    under which it was committed, and failed here."""
    net = Network(3, seed, external_snapshots=production, deferred_sync=production)
    a = elect(net)
    settle(net)
    v = net.core(a).vote_id
    net.isolate(a)
    lost: list = []
    for k in range(4):
        produce(net, a, "q", f"only-on-a{k}", lost)
    a_last = net.core(a).log.last_position()
    assert a_last[0] == v
    net.crash(a, keep_unsynced=True)
    net.heal()

    assert net.run_until(lambda: any(net.core(i).role is Role.CANDIDATE
                                     for i in net.ids if i != a), 10 * E)
    b = next(i for i in net.ids if i != a and net.core(i).role is Role.CANDIDATE)
    c = next(i for i in net.ids if i not in (a, b))
    assert net.core(b).vote_id == v + 1
    net.pause(b)
    assert net.run_until(lambda: net.core(c).voted_for == b and net.core(c).vote_id == v + 1,
                         2 * E)
    assert net.core(c).log.last_position() < a_last and net.core(b).log.last_position() < a_last

    net.start(a)
    assert net.run_until(lambda: net.core(a).role is Role.MASTER
                         and net.core(a).commit_id > a_last[1], 20 * E)
    va = net.core(a).vote_id
    assert va > v + 1
    committed, commit_votes = net.checker.committed, net.checker.commit_votes
    assert [r.vote_id for r in committed[a_last[1] - 4:a_last[1]]] == [v] * 4
    assert commit_votes[a_last[1] - 4:a_last[1]] == [va] * 4

    net.resume(b)  # reads C's grant first: master of v + 1 (the Checker must not fail)
    assert net.run_until(lambda: b in net.masters_by_vote.get(v + 1, ()), E)
    assert net.run_until(lambda: net.core(b).role is not Role.MASTER, E)
    m = settle(net)
    assert m == a and {f"only-on-a{k}" for k in range(4)} <= log_data(net, b)


# -- receipts, nack, touch, max_deliveries and dead letters (issue 14) -------------


@pytest.mark.parametrize("n", [3, 5])
@pytest.mark.parametrize("seed", range(3))
def test_receipt_of_a_delivery_that_a_failover_undid_is_refused(n, seed):
    """Async mode: master A answers a consume at once, before any slave
    has the delivery, and dies. The new master B delivers the message
    again: its first delivery once more (deliveries=1), as A's was. Only
    the epoch in the receipt (the vote_id of the master that decided the
    delivery) tells the two apart: the first consumer's confirm, nack and
    touch with A's receipt are refused ("stale receipt"), never applied to
    the second consumer's delivery, and the second consumer's confirm
    with its own receipt goes through."""
    net = Network(n, seed, async_mode=True)
    work = Workload(net, random.Random(seed), strict=False, at_master=True, max_attempts=1,
                    timeout_ms=2_000)
    a = elect(net)
    data = work.produce("q", retry_s=1, delay_s=None, ttl_s=None)
    assert net.run_until(lambda: work.produced[data].acked_at is not None, 2_000)
    settle(net)
    key = ("q", work.produced[data].targets[0][1])
    net.isolate(a)
    first = work.consume("q", node=a)
    assert net.run_until(lambda: first.finished, 1_000) and first.acked is not None
    [d1] = work.deliveries[key]
    assert d1.receipt == (net.core(a).vote_id, key[1], 1)
    net.crash(a, drop_outgoing=True)
    b = elect(net, a)
    second = work.consume("q", node=b)
    assert net.run_until(lambda: second.finished, 1_000) and second.acked is not None
    d2 = work.deliveries[key][-1]
    assert d2 is not d1 and d2.deliveries == 1 and d2.receipt == (net.core(b).vote_id, key[1], 1)
    stale = [work.confirm(key, node=b, receipt=d1), work.nack(key, node=b, receipt=d1),
             work.touch(key, node=b, receipt=d1, lease_ms=5_000)]
    assert net.run_until(lambda: all(r.finished for r in stale), 1_000)
    assert [r.outcomes for r in stale] == [["stale receipt"]] * 3
    assert net.core(b).store.get("q").messages[key[1]][sim_store.RETRY_AT_MS] == d2.retry_at_ms
    confirm = work.confirm(key, node=b, receipt=d2)
    assert net.run_until(lambda: confirm.finished, 1_000) and confirm.outcomes == ["ok"]
    net.heal()
    net.start(a)
    for _ in range(5):
        work.consume("q")
        net.run_for(300)
    m = settle(net)
    assert len(work.deliveries[key]) == 2
    assert key[1] not in net.core(m).store.get("q").messages


@pytest.mark.parametrize("production", [False, True], ids=["sim-config", "production"])
@pytest.mark.parametrize("seed", range(3))
def test_late_confirm_after_a_redelivery_by_a_new_master_is_refused(seed, production):
    """Consumer 1 takes a message (retry 0.2 s) from master A and overruns
    its lease; A dies; consumer 2 takes the redelivery from the new master
    B. Consumer 1's late confirm, nack and touch with its receipt get
    "stale receipt" (the confirm would otherwise delete consumer 2's job);
    consumer 2's confirm with its receipt is found; the message is never
    delivered again. The Checker holds each answer against the committed
    history: the refusals were read from a state in which consumer 1's
    delivery was no longer current, the confirm from one in which consumer
    2's was."""
    net = Network(3, seed, external_snapshots=production, deferred_sync=production)
    work = Workload(net, random.Random(seed), at_master=True, max_attempts=10, timeout_ms=300)
    a = elect(net)
    data = work.produce("q", retry_s=0.2, delay_s=None, ttl_s=None)
    assert net.run_until(lambda: work.produced[data].acked_at is not None, 2_000)
    first = work.consume("q")
    assert net.run_until(lambda: first.acked is not None, 2_000)
    key = ("q", work.produced[data].targets[0][1])
    [d1] = work.deliveries[key]
    settle(net)
    net.run_for(250)  # consumer 1 overruns its lease
    net.crash(a, drop_outgoing=True)
    b = elect(net, a)
    second = work.consume("q", node=b)
    assert net.run_until(lambda: second.acked is not None, 2_000)
    d2 = work.deliveries[key][-1]
    assert d2.deliveries == 2 and d2.receipt == (net.core(b).vote_id, key[1], 2)
    stale = [work.confirm(key, receipt=d1), work.nack(key, receipt=d1),
             work.touch(key, receipt=d1, lease_ms=5_000)]
    assert net.run_until(lambda: all(r.acked is not None for r in stale), 3_000)
    assert [r.outcomes[-1] for r in stale] == ["stale receipt"] * 3
    confirm = work.confirm(key, receipt=d2)
    assert net.run_until(lambda: confirm.acked is not None, 3_000)
    assert confirm.outcomes[-1] == "ok" and confirm.acked.entry is not None
    net.start(a)
    for _ in range(5):
        work.consume("q")
        net.run_for(300)
    m = settle(net)
    assert len(work.deliveries[key]) == 2
    work.final_check(m)


@pytest.mark.parametrize("production", [False, True], ids=["sim-config", "production"])
@pytest.mark.parametrize("seed", range(3))
def test_confirm_with_receipt_retried_on_a_cut_off_master_is_not_refused(seed, production):
    """Issue 12's scenario with a receipt: master M, cut off, appends the
    client's confirm and applies it (the message is gone from its store)
    but cannot commit it. The client's retry reaches M, which now finds no
    delivery for the receipt: "stale receipt", an answer that appends no
    entry. M must not send it: the committed history still has the
    delivery current (the new master knows nothing of the confirm), and a
    consumer told "stale receipt" would believe someone else had the job.
    The client retries on, the new master commits the confirm, and the
    message is never delivered again."""
    net = Network(3, seed, external_snapshots=production, deferred_sync=production)
    work = Workload(net, random.Random(seed), at_master=True, max_attempts=30, timeout_ms=60,
                    backoff_ms=(40, 40), same_node_rate=1.0)
    m = elect(net)
    data = work.produce("q", retry_s=1, delay_s=None, ttl_s=None)
    assert net.run_until(lambda: work.produced[data].acked_at is not None, 2_000)
    consume_req = work.consume("q")
    assert net.run_until(lambda: consume_req.acked is not None, 2_000)
    key = ("q", work.produced[data].targets[0][1])
    [d] = work.deliveries[key]
    settle(net)

    net.isolate(m)
    confirm = work.confirm(key, node=m, receipt=d)
    assert key[1] not in net.core(m).store.get("q").messages
    assert net.run_until(lambda: (m, "read") in confirm.executed, E)
    m2 = elect(net, m)
    assert net.run_until(lambda: confirm.finished, 10_000)
    assert confirm.acked is not None and confirm.acked.target == m2
    assert confirm.acked.entry is not None and confirm.outcomes[-1] == "ok"
    assert "stale receipt" not in confirm.outcomes  # M's answers never went out
    net.heal()
    for _ in range(10):
        work.consume("q", node=m2)
        net.run_for(150)
    m = settle(net)
    assert len(work.deliveries[key]) == 1
    work.final_check(m)


@pytest.mark.parametrize("old_master", ["crashes", "is-cut-off"])
@pytest.mark.parametrize("production", [False, True], ids=["sim-config", "production"])
@pytest.mark.parametrize("seed", range(3))
def test_last_delivery_moves_to_the_dead_letter_queue_once_across_a_failover(seed, production,
                                                                            old_master):
    """Queue q has max_deliveries 2 and dead_letter dl. A message's second
    delivery is its last (final); its master fails during that lease
    (crashes, or is cut off: then its own expiry tick moves the message
    out, an entry that never commits). The new master, once the lease has
    run out, moves it to dl (its expiry tick is armed when it becomes
    master): exactly one committed move, by the new master; the message is
    never delivered a third time from q, and dl holds one copy, with its
    origin, which a consumer of dl gets."""
    net = Network(3, seed, external_snapshots=production, deferred_sync=production)
    work = Workload(net, random.Random(seed), at_master=True, max_attempts=10, timeout_ms=300)
    m = elect(net)
    configure = work.configure("q", {"max_deliveries": 2, "dead_letter": "dl"})
    data = work.produce("q", retry_s=0.2, delay_s=None, ttl_s=None)
    assert net.run_until(lambda: work.produced[data].acked_at is not None
                         and configure.acked is not None, 2_000)
    key = ("q", work.produced[data].targets[0][1])
    first = work.consume("q")
    assert net.run_until(lambda: first.acked is not None, 2_000)
    net.run_for(250)  # its lease runs out
    lease_ms = 1_000 if old_master == "crashes" else 100
    second = work.consume("q", lease_ms=lease_ms)
    assert net.run_until(lambda: second.acked is not None, 2_000)
    d2 = work.deliveries[key][-1]
    assert d2.deliveries == 2 and d2.final == FINAL_MAX_DELIVERIES
    if old_master == "crashes":
        net.crash(m, drop_outgoing=True)
    else:
        net.isolate(m)
        assert net.run_until(lambda: any(type(r.entry) is DeadLetter
                                         for r in net.core(m).log.records), E)
    m2 = elect(net, m)
    for _ in range(6):
        work.consume("q", node=m2)
        net.run_for(100)
    assert net.run_until(lambda: key[1] not in net.core(m2).store.get("q").messages, 2_000)
    net.heal()
    if old_master == "crashes":
        net.start(m)
    m = settle(net)
    moves = [r for r in net.checker.committed if type(r.entry) is DeadLetter]
    assert [r.entry.targets for r in moves] == [(("dl", 1),)]
    assert moves[0].vote_id == net.core(m2).vote_id and moves[0].entry.msg_id == key[1]
    copy = net.core(m).store.get("dl").messages[1]
    view = message_view(1, copy, net.now)
    assert (view["data"], view["origin_queue"], view["origin_msg_id"],
            view["dead_letter_reason"]) == (data, "q", key[1], "max_deliveries")
    dl = work.consume("dl")
    assert net.run_until(lambda: dl.acked is not None, 2_000)
    assert [d.data for d in work.deliveries[("dl", 1)]] == [data]
    assert [d.deliveries for d in work.deliveries[key]] == [1, 2]
    m = settle(net)
    work.final_check(m)


# -- dedup ids across failovers (issue 15) -------------------------------------------


def dedup_items(net: Network, dedup_id: str) -> list:
    """The committed ProduceBatch items that record `dedup_id`: (trans_id, vote_id, item)."""
    return [(r.trans_id, r.vote_id, item) for r in net.checker.committed
            if type(r.entry) is ProduceBatch for item in r.entry.items if item[5] == dedup_id]


@pytest.mark.parametrize("batch", [False, True], ids=["single", "batch"])
@pytest.mark.parametrize("old_master", ["crashes", "is-cut-off"])
@pytest.mark.parametrize("production", [False, True], ids=["sim-config", "production"])
@pytest.mark.parametrize("seed", range(2))
def test_dedup_id_acknowledged_before_failovers_is_recognised_after_them(seed, production,
                                                                          old_master, batch):
    """A producer's produce with a dedup id (or a batch of three, each with
    its own) is acknowledged by master A; A then crashes or is cut off, B
    becomes master, and the producer, which never heard the answer,
    resends the same request to B: every item answers `duplicate: true`
    with the msg_id A gave it (an answer that appends no entry: sent once
    the original is committed). B fails in turn, a third master takes the
    same resend the same way. The committed history holds each dedup id
    once; the Checker holds every answer against it."""
    net = Network(3, seed, external_snapshots=production, deferred_sync=production)
    work = Workload(net, random.Random(seed), at_master=True, max_attempts=10, timeout_ms=300)
    a = elect(net)
    if batch:
        first = work.produce_batch("q", 3, dedup=True, retry_s=0, delay_s=None, ttl_s=None)
    else:
        first = request_of(work, work.produce("q", dedup_id="order-17", retry_s=0,
                                              delay_s=None, ttl_s=None))
    assert net.run_until(lambda: first.acked is not None, 2_000)
    assert [dup for _named, dup, _k in first.answer] == [False] * len(first.batch.items)
    named = [named for named, _dup, _k in first.answer]
    masters = [a]
    for _failover in range(2):
        old = masters[-1]
        if old_master == "crashes":
            net.crash(old, drop_outgoing=True)
        else:
            net.isolate(old)
        new = elect(net, old)
        masters.append(new)
        again = work.resend(first, node=new)
        assert net.run_until(lambda again=again: again.finished, 3_000)
        assert again.acked is not None and again.acked.target == new
        assert again.acked.entry is None  # duplicates only: nothing appended
        assert [(n, dup) for n, dup, _k in again.answer] == [(n, True) for n in named]
        # the old master comes back as a slave; the next failover takes the new one
        if old_master == "crashes":
            net.start(old)
        else:
            net.heal()
        settle(net)
    m = settle(net)
    for item in first.batch.items:
        [(_t, vote, _item)] = dedup_items(net, item.dedup_id)
        assert vote == net.checker.commit_votes[_t - 1]
    q = net.core(m).store.get("q")
    assert sorted(message_data(msg) for msg in q.messages.values()) == sorted(
        item.data for item in first.batch.items)
    work.final_check(m)


@pytest.mark.parametrize("n", [3, 5])
@pytest.mark.parametrize("production", [False, True], ids=["sim-config", "production"])
@pytest.mark.parametrize("seed", range(3))
def test_resend_of_a_produce_the_master_lost_is_stored_once(seed, production, n):
    """Master A, cut off, appends a produce with dedup id k1 and applies it
    (its dedup table now holds k1) but cannot commit it; the producer times
    out. Its resend reaches A while A still believes it is master: A finds
    k1 in its own table, a duplicate of an entry that will never commit,
    and must not answer (it would point at a message that is lost): it
    answers "outcome unknown" once it steps down. The producer resends on,
    reaches the new master B, which never saw k1: stored (duplicate
    false), once; A's entry is truncated. A resend to B after that is a
    duplicate of B's message."""
    net = Network(n, seed, external_snapshots=production, deferred_sync=production)
    work = Workload(net, random.Random(seed), at_master=True, max_attempts=1, timeout_ms=200,
                    backoff_ms=(40, 80), same_node_rate=1.0)
    a = elect(net)
    settle(net)
    net.isolate(a)
    first = request_of(work, work.produce("q", dedup_id="k1", retry_s=0, delay_s=None,
                                          ttl_s=None, node=a))
    at = net.core(a).log.last_trans_id
    lone = net.core(a).log.get(at)
    assert type(lone.entry) is ProduceBatch and lone.entry.items[0][5] == "k1"
    assert net.run_until(lambda: first.finished, 1_000) and first.acked is None
    again = work.resend(first, node=a, max_attempts=40)
    assert net.run_until(lambda: (a, "read") in again.executed, E)  # a duplicate of its own
    b = elect(net, a)
    assert net.run_until(lambda: again.finished, 10_000)
    assert again.acked is not None and again.acked.target == b
    assert again.acked.entry is not None  # stored by B
    [(named, duplicate, _k)] = again.answer
    assert not duplicate
    reads_on_a = [i for i, (node, kind) in enumerate(again.executed) if (node, kind) == (a, "read")]
    assert reads_on_a and all(again.outcomes[i] != "ok" for i in reads_on_a)
    once_more = work.resend(first, node=b, max_attempts=10)
    assert net.run_until(lambda: once_more.finished, 3_000)
    assert [(n, dup) for n, dup, _k in once_more.answer] == [(named, True)]
    net.heal()
    m = settle(net)
    [(t, _vote, _item)] = dedup_items(net, "k1")
    assert net.checker.committed[t - 1].vote_id == net.core(b).vote_id
    assert net.checker.committed[at - 1] != lone  # A's lone produce was undone
    q = net.core(m).store.get("q")
    assert [message_data(msg) for msg in q.messages.values()] == [first.data]
    work.final_check(m)


@pytest.mark.parametrize("seed", range(3))
def test_dedup_id_in_a_snapshot_is_recognised_by_a_master_restored_from_it(seed):
    """The dedup table travels in snapshots: a dedup id is accepted, then
    pushed into snapshot files by further writes (log_size 4); slave C,
    cut off meanwhile, catches up by installing the master's snapshot
    file, and slave B restarts from its own. The master crashes: the new
    master (B or C) built its store from a snapshot that holds the id,
    and answers the producer's resend `duplicate: true` with the
    original msg_id."""
    net = Network(3, seed, log_size=4, external_snapshots=True, deferred_sync=True)
    work = Workload(net, random.Random(seed), at_master=True, max_attempts=10, timeout_ms=300)
    a = elect(net)
    settle(net)
    b, c = [i for i in net.ids if i != a]
    net.isolate(c)
    first = request_of(work, work.produce("q", dedup_id="k1", retry_s=0, delay_s=None,
                                          ttl_s=None))
    assert net.run_until(lambda: first.acked is not None, 2_000)
    t = first.acked.trans_id
    for _ in range(30):
        work.produce("q", retry_s=0, delay_s=None, ttl_s=None)
        net.run_for(3)
    assert net.run_until(lambda: work.idle(), 5_000)
    assert net.run_until(lambda: net.core(a).log.base_trans_id > net.core(c).log.last_trans_id,
                         2_000)
    net.heal()
    settle(net)
    assert net.stats["snapshot_files_received"] >= 1
    assert net.nodes[c].disk_base[0] > t
    net.crash(b)
    net.start(b)
    assert net.nodes[b].disk_base[0] > t
    net.crash(a, drop_outgoing=True)
    m = elect(net, a)
    again = work.resend(first, node=m)
    assert net.run_until(lambda: again.finished, 3_000)
    assert again.acked is not None and again.acked.target == m
    assert [(n, dup) for n, dup, _k in again.answer] == [(first.answer[0][0], True)]
    net.start(a)
    m = settle(net)
    assert len(dedup_items(net, "k1")) == 1
    work.final_check(m)


@pytest.mark.parametrize("seed", range(2))
def test_dedup_window_turned_off_and_on_for_a_virtual_queue(seed):
    """Virtual queue ab (a, b) takes its dedup window from a. A produce to
    ab with dedup id v1 is stored; a's window is turned off (0): a resend
    of v1 is stored again (duplicate false: dedup ids are ignored), and
    prunes ab's table. Turned on again, the table has forgotten v1: the
    next resend is stored once more, and the one after it is its
    duplicate. The Checker compares every store with the committed
    history (Store._check included) when the cluster settles: the table
    pruned to nothing is gone (found by this sim and the store's producer
    tests: it used to stay, empty)."""
    net = Network(3, seed, virtual_queues={"ab": ("a", "b")})
    work = Workload(net, random.Random(seed), at_master=True, max_attempts=10, timeout_ms=300)
    elect(net)

    def send(req):
        assert net.run_until(lambda: req.acked is not None, 3_000), req.outcomes
        return req

    first = send(request_of(work, work.produce("ab", dedup_id="v1", retry_s=0, delay_s=None,
                                               ttl_s=None)))
    [(named, duplicate, _k)] = first.answer
    assert not duplicate and [q for q, _i in named] == ["a", "b"]
    send(work.configure("a", {"dedup_window_ms": 0}))
    [(off, duplicate, _k)] = send(work.resend(first)).answer
    assert not duplicate and off != named
    settle(net)
    send(work.configure("a", {"dedup_window_ms": 300_000}))
    [(on, duplicate, _k)] = send(work.resend(first)).answer
    assert not duplicate and on not in (named, off)
    assert send(work.resend(first)).answer == [(on, True, None)]
    m = settle(net)
    assert len(dedup_items(net, "v1")) == 2  # the one stored with the window off records none
    work.final_check(m)
