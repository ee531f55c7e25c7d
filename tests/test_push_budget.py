"""The native master keeps each Push far below the peers' frame limit: a
push of new records, and a push that answers a slave's pull, carry at most
MAX_BATCH_BYTES of entries (entries.entry_weight), in several pushes in
order when there is more, so that 1 MiB batch produces cannot build one
message over the 64 MiB frame limit (which the link would refuse to send,
stalling that slave)."""

from __future__ import annotations

import random

import pytest

from qserver.engines.base import LeaderInfo
from qserver.engines.messages import Pull, Push, PushReply
from qserver.engines.native import core as core_module
from qserver.engines.native.core import NativeCore
from qserver.state.entries import entry_weight
from qserver.state.log import Log
from qserver.state.store import Store
from qserver.wire.requests import ProduceBatchRequest, ProduceItem

NOW = 1_700_000_000_000
BUDGET = 4000


@pytest.fixture(autouse=True)
def small_budget(monkeypatch):
    monkeypatch.setattr(core_module, "MAX_BATCH_BYTES", BUDGET)


def master_of_three() -> NativeCore:
    m = NativeCore(node_id=1, peer_ids=[1, 2, 3], store=Store(queue_size=10_000), log=Log(),
                   me=LeaderInfo(node_id=1, host="127.0.0.1", port=1001),
                   rng=random.Random(1), now_ms=NOW)
    m.vote_id = 1
    m._become_master(NOW)  # as if elected (elections are tested in test_sim_*)
    m.take_ready(NOW)
    return m


def batch(m: NativeCore, n: int, size: int) -> None:
    items = tuple(ProduceItem("x" * size, None, None, 0, 1024, "") for _ in range(n))
    decided = m.store.decide_produce_batch(ProduceBatchRequest("q", items, True), NOW)
    assert not isinstance(decided, str) and decided[0] is not None
    m.propose(decided[0], lambda result, error: None)


def pushes_to(ready, peer: int) -> list[Push]:
    return [msg for dst, msg in ready.messages if dst == peer and isinstance(msg, Push)]


def assert_chained_within_budget(pushes: list[Push], first_prev: int, last: int) -> None:
    prev = first_prev
    for push in pushes:
        assert push.prev_trans_id == prev
        assert push.records, "no empty push"
        weights = [entry_weight(r.entry) for r in push.records]
        assert len(weights) == 1 or sum(weights) <= BUDGET
        assert [r.trans_id for r in push.records] == list(range(prev + 1,
                                                                prev + 1 + len(weights)))
        prev += len(weights)
    assert prev == last


def test_new_records_over_the_budget_go_out_in_several_pushes_in_order():
    m = master_of_three()
    start = m.log.last_trans_id
    for _ in range(7):
        batch(m, 3, 500)  # ~1.6 KB each by weight: two fit in one push
    # (after SPARE_PUSH_MS: the spare slave's turn too, not only the one a commit needs)
    ready = m.take_ready(NOW + core_module.SPARE_PUSH_MS)
    for peer in (2, 3):
        pushes = pushes_to(ready, peer)
        assert len(pushes) >= 3
        assert_chained_within_budget(pushes, start, m.log.last_trans_id)
        # each piece tells the slave of its own end, not the log's: the
        # next pieces follow by push, and a slave told of more would pull it
        assert [p.last_trans_id for p in pushes] == [
            p.prev_trans_id + len(p.records) for p in pushes]


def test_one_record_over_the_budget_is_still_sent_alone():
    m = master_of_three()
    start = m.log.last_trans_id
    batch(m, 10, 1000)  # one entry of ~10 KB: over the budget on its own
    batch(m, 1, 10)
    pushes = pushes_to(m.take_ready(NOW), 2)
    assert [len(p.records) for p in pushes] == [1, 1]
    assert_chained_within_budget(pushes, start, m.log.last_trans_id)


def test_a_pull_is_answered_within_the_budget():
    m = master_of_three()
    for _ in range(6):
        batch(m, 3, 500)
    m.take_ready(NOW)
    m.step(Pull(vote_id=m.vote_id, node_id=2, trans_id=0, log_vote_id=0), NOW)
    pushes = pushes_to(m.take_ready(NOW), 2)
    assert len(pushes) == 1 and pushes[0].prev_trans_id == 0
    weights = [entry_weight(r.entry) for r in pushes[0].records]
    assert 1 <= len(weights) < m.log.last_trans_id and sum(weights) <= BUDGET
    # behind what was pushed: told of the log's end, so that it pulls on
    assert pushes[0].last_trans_id == m.log.last_trans_id


def spare_held_back(m: NativeCore, t: int) -> tuple[int, int, int]:
    """Both slaves answer; then writes in one instant, so that the spare
    slave's turn (every SPARE_PUSH_MS) never comes: (eager, spare, what the
    spare was sent)."""
    for peer in (2, 3):
        m.step(PushReply(vote_id=m.vote_id, node_id=peer, match_id=m.log.last_trans_id), t)
    batch(m, 3, 500)
    m.take_ready(t)  # to both: the spare's turn
    eager = next(p for p in (2, 3) if not m.peers[p].spare)
    spare = 5 - eager
    start = m.peers[spare].sent_upto
    for _ in range(6):
        batch(m, 3, 500)
        m.take_ready(t)
        m.step(PushReply(vote_id=m.vote_id, node_id=eager, match_id=m.log.last_trans_id), t)
    assert m.peers[spare].spare and start < m.pushed_upto == m.log.last_trans_id
    assert m.peers[spare].sent_upto == start
    return eager, spare, start


def test_a_spare_taking_a_quiet_slaves_place_is_told_the_end_of_each_piece():
    """A spare slave behind by more than one push's budget takes the place
    of the eager one once that one stops answering: its push is split, and
    every piece tells of its own end, as the rest follows by push. (Told
    of the log's end, it pulled, and a pull answered short of what was
    pushed left it catching up by pulls, at sync_rate.)"""
    m = master_of_three()
    t = NOW + 1000
    _eager, spare, start = spare_held_back(m, t)
    later = t + 3 * m.timing.heartbeat_ms  # the eager slave is quiet since t
    m.step(PushReply(vote_id=m.vote_id, node_id=spare, match_id=start), later)
    batch(m, 1, 10)
    pushes = pushes_to(m.take_ready(later), spare)
    assert len(pushes) >= 3
    assert_chained_within_budget(pushes, start, m.log.last_trans_id)
    assert [p.last_trans_id for p in pushes] == [
        p.prev_trans_id + len(p.records) for p in pushes]
    assert not m.peers[spare].spare and m.peers[spare].sent_upto == m.pushed_upto


def test_a_spare_whose_pull_is_answered_short_of_what_was_pushed_is_told_the_logs_end():
    """A pull answer short of what was pushed leaves the slave catching up
    by pulls, spare or not: it must hear of the log's end to pull on (told
    only of the answer's end, it waited for a heartbeat)."""
    m = master_of_three()
    t = NOW + 1000
    _eager, spare, start = spare_held_back(m, t)
    m.step(Pull(vote_id=m.vote_id, node_id=spare, trans_id=start,
                log_vote_id=m.log.vote_id_at(start)), t)
    pushes = pushes_to(m.take_ready(t), spare)
    assert len(pushes) == 1 and pushes[0].prev_trans_id == start
    assert start < start + len(pushes[0].records) < m.log.last_trans_id  # cut by the budget
    assert pushes[0].last_trans_id == m.log.last_trans_id
    assert not m.peers[spare].spare
