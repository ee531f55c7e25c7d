"""fsync=always with the master's own fsync off the event loop
(NativeCore.deferred_sync, Raft thesis 10.2.1): the master sends its records
before they are durable on its own disk and counts itself towards a
majority only up to what the adapter reports synced (`synced_to`); each
Ready says how the core relies on our own fsync (`Ready.own_sync`): before
anything is sent, at once, or by the batch timer."""

from __future__ import annotations

import random

from qserver.engines.base import LeaderInfo
from qserver.engines.messages import Push, PushReply
from qserver.engines.native.core import NativeCore, OwnSync
from qserver.state.log import Log
from qserver.state.store import Store
from qserver.wire.requests import ProduceRequest

NOW = 1_700_000_000_000


def core(node_id: int, peers: list[int], deferred: bool) -> NativeCore:
    return NativeCore(node_id=node_id, peer_ids=peers, store=Store(queue_size=100), log=Log(),
                      me=LeaderInfo(node_id=node_id, host="127.0.0.1", port=1000 + node_id),
                      rng=random.Random(node_id), now_ms=NOW, deferred_sync=deferred)


def produce(c: NativeCore, data: str, answers: list) -> None:
    entry = c.store.decide_produce(ProduceRequest(queue="q", data=data, delay_s=None,
                                                  ttl_s=None, retry_s=0), NOW)
    c.propose(entry, lambda result, error: answers.append((data, error)))


def run_answers(ready) -> None:
    for answer in ready.answers:
        answer()


def test_a_lone_master_answers_only_once_its_fsync_covers_the_write():
    c = core(1, [1], deferred=True)
    c.tick(NOW)
    assert c.is_master
    answers: list = []
    produce(c, "a", answers)
    ready = c.take_ready(NOW)
    assert [r.trans_id for r in ready.records] == [1, 2]  # the master's noop, then the write
    run_answers(ready)
    assert answers == [] and c.commit_id == 0  # written, not yet durable: nobody is answered
    c.synced_to(1)
    run_answers(c.take_ready(NOW))
    assert answers == [] and c.commit_id == 1
    c.synced_to(2)
    run_answers(c.take_ready(NOW))
    assert answers == [("a", None)] and c.commit_id == 2


def test_without_deferral_the_master_counts_what_it_has_written():
    c = core(1, [1], deferred=False)
    c.tick(NOW)
    answers: list = []
    produce(c, "a", answers)
    run_answers(c.take_ready(NOW))
    assert answers == [("a", None)]


def elected_master_of_three() -> NativeCore:
    """Node 1 as master of {1, 2, 3}, its records pushed but acked by nobody."""
    m = core(1, [1, 2, 3], deferred=True)
    m.vote_id = 1
    m._become_master(NOW)  # as if elected (elections are tested in test_sim_*)
    return m


def ack(m: NativeCore, peer: int, match: int) -> None:
    m.step(PushReply(vote_id=m.vote_id, node_id=peer, match_id=match), NOW)


def test_two_slaves_commit_what_the_master_has_not_yet_synced():
    m = elected_master_of_three()
    answers: list = []
    produce(m, "a", answers)
    ready = m.take_ready(NOW)
    assert any(isinstance(msg, Push) for _, msg in ready.messages)  # sent before any fsync
    ack(m, 2, 2)
    run_answers(m.take_ready(NOW))
    assert answers == []  # one slave, and the master's own copy is not durable
    ack(m, 3, 2)
    run_answers(m.take_ready(NOW))
    assert answers == [("a", None)]  # a majority of durable copies: the two slaves


def test_the_master_synced_and_one_slave_commit():
    m = elected_master_of_three()
    answers: list = []
    produce(m, "a", answers)
    m.take_ready(NOW)
    ack(m, 2, 2)
    run_answers(m.take_ready(NOW))
    assert answers == []
    m.synced_to(2)
    run_answers(m.take_ready(NOW))
    assert answers == [("a", None)]


def test_a_lone_master_needs_its_own_fsync_at_once():
    c = core(1, [1], deferred=True)
    c.tick(NOW)
    produce(c, "a", [])
    assert c.take_ready(NOW).own_sync is OwnSync.NOW
    c.synced_to(c.log.last_trans_id)
    assert c.take_ready(NOW).own_sync is OwnSync.MAY_WAIT  # nothing left to sync


def test_the_master_fsync_may_wait_only_while_both_slaves_keep_up():
    m = elected_master_of_three()
    assert m.take_ready(NOW).own_sync is OwnSync.NOW  # no slave has answered yet
    last = m.log.last_trans_id
    ack(m, 2, last)
    assert m.take_ready(NOW).own_sync is OwnSync.NOW  # one slave is not a majority without us
    ack(m, 3, last)
    produce(m, "a", [])
    # pushed to both in this take_ready, which then finds they keep up
    assert m.take_ready(NOW).own_sync is OwnSync.MAY_WAIT  # the two slaves can make the majority
    later = NOW + 2 * m.timing.heartbeat_ms + 1
    assert m.take_ready(later).own_sync is OwnSync.NOW  # they stopped answering: we count again


def test_a_slave_being_caught_up_does_not_count_as_keeping_up():
    m = elected_master_of_three()
    m.take_ready(NOW)
    last = m.log.last_trans_id
    ack(m, 2, last)
    ack(m, 3, last)
    m.peers[3].sent_upto = last - 1  # e.g. a snapshot stream or pull in progress
    produce(m, "a", [])
    m.take_ready(NOW)
    m.peers[3].sent_upto = last - 1
    assert m.take_ready(NOW).own_sync is OwnSync.NOW


def test_a_slave_syncs_before_it_answers():
    """Its PushReply vouches for the records it appended."""
    m = elected_master_of_three()
    push = next(msg for dst, msg in m.take_ready(NOW).messages
                if dst == 2 and isinstance(msg, Push))
    s = core(2, [1, 2, 3], deferred=True)
    s.step(push, NOW)
    ready = s.take_ready(NOW)
    assert ready.records and any(isinstance(msg, PushReply) for _, msg in ready.messages)
    assert ready.own_sync is OwnSync.BEFORE_SEND


def test_without_deferral_every_sync_comes_before_sending():
    c = core(1, [1], deferred=False)
    c.tick(NOW)
    produce(c, "a", [])
    assert c.take_ready(NOW).own_sync is OwnSync.BEFORE_SEND
