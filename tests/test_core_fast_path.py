"""The native core's inputs for the adapter's fast path (NativeCore.append_now)
and async mode's coalesced pushes (push_interval_ms), without I/O: what is
appended, applied, committed and pushed, and when append_now refuses."""

from __future__ import annotations

import dataclasses
import random

import msgpack
import pytest

from qserver.engines.base import LeaderInfo
from qserver.engines.messages import Pull, Push, PushReply, message_from_wire
from qserver.engines.native.core import PUSH_AT_ONCE_RECORDS, SPARE_PUSH_MS, NativeCore
from qserver.engines.native.driver import ClusterEngine
from qserver.errors import InvariantError
from qserver.state.entries import Produce
from qserver.state.log import Log
from qserver.state.store import Store
from qserver.wire.requests import ProduceRequest

NOW = 1_700_000_000_000


def core(node_id: int, peers: list[int], *, async_mode: bool = False,
         push_interval_ms: int = 0, deferred: bool = False, **extra) -> NativeCore:
    """`extra`: more NativeCore arguments (log_size, external_snapshots, ...)."""
    return NativeCore(node_id=node_id, peer_ids=peers, store=Store(queue_size=10_000),
                      log=Log(), me=LeaderInfo(node_id=node_id, host="127.0.0.1",
                                               port=1000 + node_id),
                      rng=random.Random(node_id), now_ms=NOW, async_mode=async_mode,
                      push_interval_ms=push_interval_ms, deferred_sync=deferred, **extra)


def master_of_three(**kwargs) -> NativeCore:
    m = core(1, [1, 2, 3], **kwargs)
    m.vote_id = 1
    m._become_master(NOW)  # as if elected (elections are tested in test_sim_*)
    m.take_ready(NOW)  # the Noop, written and pushed
    return m


def entry(c: NativeCore, data: str) -> Produce:
    produced = c.store.decide_produce(ProduceRequest(queue="q", data=data, delay_s=None,
                                                     ttl_s=None, retry_s=0), NOW)
    assert isinstance(produced, Produce)
    return produced


def pushes(ready) -> list[tuple[int, Push]]:
    return [(to, msg) for to, msg in ready.messages if isinstance(msg, Push) and msg.records]


def test_alone_append_now_commits_at_once():
    c = core(1, [1])
    c.tick(NOW)
    assert c.is_master
    c.take_ready(NOW)  # the election's Noop
    record, result = c.append_now(entry(c, "a"))
    assert record.trans_id == 2 and c.commit_id == c.applied_id == 2
    assert result == (("q", 1),)
    assert not c.undo and not c.take_ready(NOW).records  # the caller writes it
    assert c.store.queues["q"].messages


def test_async_append_now_applies_with_undo_and_pushes_with_the_next_ready():
    m = master_of_three(async_mode=True)
    record, _ = m.append_now(entry(m, "a"))
    assert m.applied_id == record.trans_id and m.commit_id < record.trans_id
    assert m.undo and m.undo[-1][0] == record.trans_id  # a new master may roll it back
    ready = m.take_ready(NOW)
    assert not ready.records  # the adapter writes it, not the Ready
    assert sorted(to for to, _ in pushes(ready)) == [2, 3]
    assert all(p.records[-1].trans_id == record.trans_id for _, p in pushes(ready))
    m.step(PushReply(vote_id=1, node_id=2, match_id=record.trans_id), NOW)
    assert m.commit_id == record.trans_id and not m.undo


@pytest.mark.parametrize("kwargs", [{"async_mode": False}, {"async_mode": True, "deferred": True}])
def test_append_now_refuses_where_a_write_must_wait(kwargs):
    m = master_of_three(**kwargs)
    with pytest.raises(InvariantError):
        m.append_now(entry(m, "a"))


def test_append_now_refuses_on_a_slave_and_behind_a_pending_proposal():
    s = core(2, [1, 2, 3], async_mode=True)
    with pytest.raises(InvariantError):
        s.append_now(entry(s, "a"))
    m = master_of_three(async_mode=True)
    m.propose(entry(m, "p"), lambda result, error: None)  # its record is in the Ready
    with pytest.raises(InvariantError):
        m.append_now(entry(m, "a"))


def test_async_pushes_are_coalesced_within_the_interval():
    m = master_of_three(async_mode=True, push_interval_ms=5)
    t = NOW + 1000  # a quiet spell: the first records go at once
    m.tick(t)  # heartbeats sent: the next is due in heartbeat_ms
    m.append_now(entry(m, "a"))
    first = pushes(m.take_ready(t))
    assert len(first) == 2 and len(first[0][1].records) == 1
    for i in range(3):  # within the interval: held
        m.append_now(entry(m, f"b{i}"))
        assert pushes(m.take_ready(t + 1 + i)) == []
    assert m.next_deadline() == t + 5  # the timer's next call
    later = pushes(m.take_ready(t + 5))
    assert len(later) == 2 and [len(p.records) for _, p in later] == [3, 3]
    assert later[0][1].records[0].trans_id == first[0][1].records[-1].trans_id + 1


def test_many_records_are_pushed_at_once_whatever_the_interval():
    m = master_of_three(async_mode=True, push_interval_ms=5)
    t = NOW + 1000
    m.append_now(entry(m, "a"))
    m.take_ready(t)
    for i in range(PUSH_AT_ONCE_RECORDS):
        m.append_now(entry(m, f"c{i}"))
    assert len(pushes(m.take_ready(t + 1))) == 2


def test_push_at_says_when_take_ready_pushes_what_was_appended():
    """The adapter skips a flush per write while its timer fires by
    push_at: take_ready must push nothing before it and everything at it."""
    m = master_of_three(async_mode=True, push_interval_ms=5)
    t = NOW + 1000  # a quiet spell: the next push is due at once
    m.tick(t)  # heartbeats sent: the next is due in heartbeat_ms
    m.append_now(entry(m, "a"))
    assert m.push_at() <= t
    assert len(pushes(m.take_ready(t))) == 2
    m.append_now(entry(m, "b"))
    m.append_now(entry(m, "c"))
    assert m.push_at() == t + 5
    assert pushes(m.take_ready(m.push_at() - 1)) == []
    assert m.next_deadline() == m.push_at()  # the timer's call
    at = m.push_at()
    later = pushes(m.take_ready(at))
    assert [len(p.records) for _, p in later] == [2, 2]
    # many records waiting: at once, whatever the interval
    for i in range(PUSH_AT_ONCE_RECORDS):
        m.append_now(entry(m, f"d{i}"))
    assert m.push_at() == 0
    assert len(pushes(m.take_ready(at + 1))) == 2
    # without coalescing (quorum mode, or no interval): at once
    q = master_of_three(async_mode=True)
    q.append_now(entry(q, "e"))
    assert q.push_at() == 0


@pytest.mark.parametrize("async_mode", [True, False])
def test_a_slave_whose_pull_was_answered_ahead_of_the_push_keeps_getting_pushes(async_mode):
    """A pull answered while records wait for their push (a heartbeat
    announced them; a push interval or the turn holds them) takes that
    slave past what has been pushed. It is still in step: the next pushes
    carry what is new to it. (It used to count as catching up by pulls for
    good: under a steady load it got nothing but pull answers, at most
    sync_rate records a second, and fell behind without end.)"""
    m = master_of_three(async_mode=async_mode, push_interval_ms=5)
    t = NOW + 1000
    held = max(6, SPARE_PUSH_MS + 1)  # past the push interval, and the spare slave's turn

    def write(data: str) -> int:
        if async_mode:
            m.append_now(entry(m, data))
        else:
            m.propose(entry(m, data), lambda result, error: None)
        return m.log.last_trans_id

    a = write("a")
    m.take_ready(t)  # pushed at once: both slaves in step
    for node_id in (2, 3):
        acked(m, node_id, t)
    b = write("b")  # not pushed yet
    # slave 2 pulls after its last record (a heartbeat told it of b),
    # answered at once; then a new record in the same turn
    m.step(Pull(vote_id=1, node_id=2, trans_id=a, log_vote_id=1), t + 1)
    c = write("c")
    got = pushes(m.take_ready(t + held))
    # to slave 2: b in the pull's answer, c in the push
    assert [r.trans_id for to, p in got if to == 2 for r in p.records] == [b, c]
    assert [r.trans_id for to, p in got if to == 3 for r in p.records] == [b, c]
    for i in range(3):  # and each later record, to both slaves
        now = t + 2 * held * (i + 1)
        for node_id in (2, 3):
            acked(m, node_id, now)
        d = write(f"d{i}")
        got = pushes(m.take_ready(now + held))
        assert sorted(to for to, p in got if p.records[-1].trans_id == d) == [2, 3]


def test_a_heartbeat_tells_a_slave_in_step_what_it_was_sent():
    """Records held by the push interval are not announced by a heartbeat
    to the slaves in step (they follow by push; told of them, a slave
    pulled them, each pull a detour through the sync_rate budget); a
    slave catching up by pulls is told of the log's end."""
    m = master_of_three(async_mode=True, push_interval_ms=5)
    t = NOW + 1000
    m.append_now(entry(m, "a"))
    m.take_ready(t)  # pushed at once
    pushed = m.log.last_trans_id
    m.append_now(entry(m, "b"))  # held by the interval
    m.sync_rate = 1  # 3 starts over, with a pull budget of one record
    m.step(Pull(vote_id=1, node_id=3, trans_id=0, log_vote_id=0), t)
    assert m.peers[3].sent_upto == 1 < pushed
    m.tick(t + m.timing.heartbeat_ms)
    beats = {to: msg for to, msg in m.take_ready(t + 1).messages
             if isinstance(msg, Push) and not msg.records}
    assert beats[2].last_trans_id == pushed < m.log.last_trans_id
    assert beats[3].last_trans_id == m.log.last_trans_id


class _EncodingNet:
    """The adapter's side of PeerNetwork for _send_all: what it encodes,
    and what it sends to whom."""

    def __init__(self) -> None:
        self.encoded: list[bytes] = []
        self.sent: list[tuple[int, bytes]] = []

    def encode(self, obj: object) -> bytes:
        body = msgpack.packb(obj)
        self.encoded.append(body)
        return body

    def send_encoded(self, peer_id: int, body: bytes) -> bool:
        self.sent.append((peer_id, body))
        return True


def test_the_adapter_encodes_a_turns_alike_pushes_to_several_slaves_once():
    m = master_of_three(async_mode=True)
    for i in range(5):
        m.append_now(entry(m, f"e{i}"))
    messages = m.take_ready(NOW).messages
    sent = {to: msg for to, msg in messages if isinstance(msg, Push)}
    assert sorted(sent) == [2, 3] and sent[2].records is sent[3].records
    # and a third push of the same records that differs in another field
    other = dataclasses.replace(sent[3], commit_id=sent[3].commit_id + 1)
    net = _EncodingNet()
    ClusterEngine._send_all(net, [*messages, (3, other)])
    assert len(net.encoded) == 2
    assert [to for to, _ in net.sent] == [2, 3, 3]
    assert [message_from_wire(msgpack.unpackb(body)) for _, body in net.sent] == [
        sent[2], sent[3], other]


def test_quorum_mode_never_coalesces_for_the_slaves_a_commit_needs():
    m = master_of_three(async_mode=False, push_interval_ms=5)
    answers: list = []
    t = NOW + 1000
    for i in range(3):
        m.propose(entry(m, f"q{i}"), lambda result, error: answers.append(error))
        got = pushes(m.take_ready(t))
        # every turn's records, at once, to one slave (a commit needs one);
        # the spare one had them at the first turn, and then waits
        assert [to for to, _ in got] == ([2, 3] if i == 0 else [2])


# -- quorum mode: quorum - 1 slaves get every turn's push, the spare ones less often


def acked(m: NativeCore, node_id: int, t: int) -> None:
    """Node `node_id` answers the pushes so far: it holds everything."""
    m.step(PushReply(vote_id=m.vote_id, node_id=node_id, match_id=m.log.last_trans_id), t)


def test_a_spare_slave_gets_new_records_every_spare_push_ms_and_they_commit():
    m = master_of_three()
    t = NOW + 10
    m.tick(t)  # heartbeats sent: the next is due in heartbeat_ms
    acked(m, 2, t)
    acked(m, 3, t)
    done: list = []
    m.propose(entry(m, "a"), lambda result, error: done.append(error))
    assert [to for to, _ in pushes(m.take_ready(t))] == [2, 3]  # the spare's first in a while
    for i in range(3):
        m.propose(entry(m, f"b{i}"), lambda result, error: done.append(error))
        assert [to for to, _ in pushes(m.take_ready(t + 1))] == [2]
    assert m.next_deadline() == t + SPARE_PUSH_MS  # the timer wakes us for the spare
    got = pushes(m.take_ready(t + SPARE_PUSH_MS))
    assert [(to, [r.trans_id for r in p.records]) for to, p in got] == [(3, [3, 4, 5])]
    # the spare's answer alone commits them, as a slave's does
    acked(m, 3, t + SPARE_PUSH_MS)
    for answer in m.take_ready(t + SPARE_PUSH_MS).answers:
        answer()
    assert m.commit_id == 5 and done == [None] * 4
    assert m.next_deadline() > t + SPARE_PUSH_MS  # nothing more held for it


def answered_master_of_three(t: int) -> NativeCore:
    """A master of three whose slaves both answered at `t`, after a turn
    whose record went to both (the spare one's first push in a while)."""
    m = master_of_three()
    acked(m, 2, t)
    acked(m, 3, t)
    m.propose(entry(m, "a"), lambda result, error: None)
    assert [to for to, _ in pushes(m.take_ready(t))] == [2, 3]
    return m


def test_a_spare_slave_takes_the_place_of_one_that_stops_answering():
    t = NOW + 10
    m = answered_master_of_three(t)
    t2 = t + 1000  # node 2 went silent; node 3 still answers
    acked(m, 3, t2)
    m.propose(entry(m, "b"), lambda result, error: None)
    m.propose(entry(m, "c"), lambda result, error: None)
    # node 3 now gets every turn's records; node 2 is the spare one (whose
    # first push in a while goes at once)
    assert [to for to, _ in pushes(m.take_ready(t2))] == [2, 3]
    m.propose(entry(m, "d"), lambda result, error: None)
    assert [to for to, _ in pushes(m.take_ready(t2 + 1))] == [3]


def test_many_records_go_to_a_spare_slave_at_once():
    t = NOW + 10
    m = answered_master_of_three(t)
    for i in range(PUSH_AT_ONCE_RECORDS):
        m.propose(entry(m, f"c{i}"), lambda result, error: None)
    assert [to for to, _ in pushes(m.take_ready(t + 1))] == [2, 3]


def test_five_nodes_push_every_turn_to_two_slaves():
    m = core(1, [1, 2, 3, 4, 5])
    m.vote_id = 1
    m._become_master(NOW)
    m.take_ready(NOW)
    t = NOW + 10
    for p in (2, 3, 4, 5):
        acked(m, p, t)
    m.propose(entry(m, "a"), lambda result, error: None)
    assert len(pushes(m.take_ready(t))) == 4
    m.propose(entry(m, "b"), lambda result, error: None)
    assert [to for to, _ in pushes(m.take_ready(t + 1))] == [2, 3]


def test_a_deferred_sync_pushes_every_turn_to_every_slave():
    # fsync=always: the master's own fsync may wait only while the slaves
    # alone hold a majority of everything, so none of them is spared
    m = master_of_three(deferred=True)
    t = NOW + 10
    acked(m, 2, t)
    acked(m, 3, t)
    for i in range(3):
        m.propose(entry(m, f"q{i}"), lambda result, error: None)
        assert [to for to, _ in pushes(m.take_ready(t + i))] == [2, 3]


def test_a_snapshot_wanted_on_demand_holds_the_log_however_long_its_writer_takes():
    """Snapshots on demand (a node without a data directory): a slave
    behind the log makes the master want one; until it is written the log
    is not compacted, however many entries come meanwhile, so the file
    (of the state when the writer forked) is past the log's base when it
    is adopted and the slave gets it. (Held only up to 2 x log_size, the
    log moved past the writer's point under a steady load: the file was
    stale when adopted, and another was wanted, without end.)"""
    m = master_of_three(log_size=10, external_snapshots=True, snapshots_on_demand=True)

    def write(n: int) -> None:  # n writes, committed by slave 2
        for i in range(n):
            m.propose(entry(m, f"w{i}"), lambda result, error: None)
            m.take_ready(NOW)
            m.step(PushReply(vote_id=1, node_id=2, match_id=m.log.last_trans_id), NOW)

    write(2000)  # compacted without any snapshot
    assert m.log.base_trans_id > 0 and m.snapshot_id == 0 and not m.snapshot_wanted
    m.step(Pull(vote_id=1, node_id=3, trans_id=0, log_vote_id=0), NOW)  # behind the base
    assert m.snapshot_wanted
    point, vote = m.snapshot_point()  # the writer forks here
    base = m.log.base_trans_id
    write(2000)  # the writer takes long: 200 x log_size entries meanwhile
    assert m.log.base_trans_id == base <= point
    m.snapshot_taken(point, vote)
    assert not m.snapshot_wanted  # it covers the base: the slave's next pull gets it
    m.step(Pull(vote_id=1, node_id=3, trans_id=0, log_vote_id=0), NOW)
    assert m.take_ready(NOW).snapshot_sends == [(3, point, vote)]


def test_a_slave_appends_a_push_after_its_last_record_as_one_run_and_applies_what_commits():
    """The common push (every record after the slave's last) is appended
    as one run (Log.extend) and what it commits is applied in order; a
    push that overlaps what the slave holds takes the record-by-record
    path, which skips the records it holds already."""
    m = core(1, [1, 2, 3], async_mode=True)
    m.vote_id = 1
    m._become_master(NOW)  # as if elected; its Noop goes with the first push
    s = core(2, [1, 2, 3], async_mode=True)
    s.step([p for to, p in pushes(m.take_ready(NOW)) if to == 2][0], NOW)
    for _ in range(3):
        m.append_now(entry(m, "a"))
    (push,) = [p for to, p in pushes(m.take_ready(NOW)) if to == 2]
    assert push.prev_trans_id == 1 and len(push.records) == 3
    s.step(push, NOW)
    assert [r.trans_id for r in s.log.records] == [1, 2, 3, 4]
    assert [r.trans_id for r in s.take_ready(NOW).records] == [1, 2, 3, 4]
    assert s.applied_id == 0  # the master's commit was 0 when it pushed
    m.step(PushReply(vote_id=1, node_id=3, match_id=4), NOW)  # the other slave: committed
    m.append_now(entry(m, "b"))
    (push,) = [p for to, p in pushes(m.take_ready(NOW)) if to == 2]
    assert push.prev_trans_id == 4 and push.commit_id == 4
    s.step(push, NOW)
    assert s.log.last_trans_id == 5 and s.applied_id == s.commit_id == 4
    assert sorted(s.store.queues["q"].messages) == [1, 2, 3]  # by msg_id
    # The same push again (resent after a pull, say) overlaps: nothing is
    # appended twice.
    s.step(push, NOW)
    assert [r.trans_id for r in s.log.records] == [1, 2, 3, 4, 5]
