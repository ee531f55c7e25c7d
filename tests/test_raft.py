"""The raft engine's pieces without processes: the epoch/seq rule and the
master's speculation (engines.raft.machine), and what pysyncobj's journal does
and does not make durable (engines.raft.driver.DurableJournal)."""

from __future__ import annotations

import os

import pytest
from pysyncobj.journal import FileJournal

from qserver.config import Config, PeerConfig
from qserver.engines.raft.driver import DurableJournal, raft_password
from qserver.engines.raft.machine import OUTCOME_UNKNOWN, RaftMachine
from qserver.state.entries import Confirm, Consume
from qserver.state.store import Store


def machine(node_id: int) -> RaftMachine:
    return RaftMachine(store=Store(queue_size=100), node_id=node_id)


def produce(store: Store, queue: str, data: str, now_ms: int = 1_000):
    return store.decide_produce_values(queue, data, None, None, 60, now_ms)


class Log:
    """Committed commands, applied by every machine in order."""

    def __init__(self, *machines: RaftMachine) -> None:
        self.machines = machines
        self.index = 0

    def commit(self, payload: bytes) -> None:
        self.index += 1
        for m in self.machines:
            for answer in m.apply_committed(self.index, payload):
                answer()
        states = {repr(m.store.to_wire()) for m in self.machines if not m.pending}
        assert len(states) <= 1, "nodes without pending entries disagree"
        for m in self.machines:
            m.store._check()


def elect(m: RaftMachine, log: Log, term: int) -> None:
    log.commit(m.make_barrier(term))
    assert m.is_master


def test_master_entries_commit_in_order_and_slaves_apply_them():
    a, b = machine(1), machine(2)
    log = Log(a, b)
    elect(a, log, term=1)
    answers = []
    payloads = [a.propose(produce(a.store, "q", f"d{i}"), lambda r, e: answers.append((r, e)))
                for i in range(3)]
    assert a.store.get("q").max_id == 3 and b.store.get("q") is None  # speculative on a only
    for p in payloads:
        log.commit(p)
    assert [r for r, _ in answers] == [(("q", 1),), (("q", 2),), (("q", 3),)]
    assert a.store.to_wire() == b.store.to_wire() and not a.pending


def test_a_deposed_masters_late_entries_are_skipped_everywhere():
    # a decides msg 1 while b, newly elected, decides its own msg 1: both
    # reach the log (a's relayed after b's barrier); only b's counts.
    a, b, c = machine(1), machine(2), machine(3)
    log = Log(a, b, c)
    elect(a, log, term=1)
    failed = []
    stale = a.propose(produce(a.store, "q", "from a"), lambda r, e: failed.append(e))
    for answer in a.lose_leadership():
        answer()
    assert failed == [OUTCOME_UNKNOWN] and a.store.get("q") is None  # reverted
    elect(b, log, term=2)
    fresh = b.propose(produce(b.store, "q", "from b"), lambda r, e: None)
    log.commit(stale)
    log.commit(fresh)
    for m in (a, b, c):
        assert m.store.get("q").messages[1][0] == "from b"


def test_after_a_gap_the_rest_of_the_epoch_is_skipped_and_a_new_epoch_works():
    a, b = machine(1), machine(2)
    log = Log(a, b)
    elect(a, log, term=1)
    outcomes = []
    p1 = a.propose(produce(a.store, "q", "one"), lambda r, e: outcomes.append(e))
    p2 = a.propose(Consume("q", 1, 0), lambda r, e: outcomes.append(e))  # decided on p1
    assert p1 and p2
    # p1 never reaches the log (pysyncobj refused it); p2 does.
    for answer in a.proposal_failed():
        answer()
    log.commit(p2)  # would be "consume of a missing message" if applied
    assert outcomes == [OUTCOME_UNKNOWN, OUTCOME_UNKNOWN]
    assert a.store.get("q") is None and b.store.get("q") is None
    elect(a, log, term=1)  # same term, next k
    log.commit(a.propose(produce(a.store, "q", "again"), lambda r, e: outcomes.append(e)))
    assert outcomes[-1] is None and b.store.get("q").messages[1][0] == "again"


def test_a_foreign_entry_reverts_the_masters_pending_ones():
    a, b = machine(1), machine(2)
    log = Log(a, b)
    elect(b, log, term=1)
    b_entry = b.propose(produce(b.store, "q", "b's"), lambda r, e: None)
    # a still believes it may decide in term 1 (two leaders in one term: a
    # node that forgot its vote) and guessed msg 1 too
    a.my_epoch, a.my_next_seq = (1, 1, 1), 1
    outcome = []
    a.propose(produce(a.store, "q", "a's"), lambda r, e: outcome.append(e))
    log.commit(b_entry)
    assert outcome == [OUTCOME_UNKNOWN] and not a.is_master
    assert a.store.to_wire() == b.store.to_wire()


def test_snapshot_leaves_out_pending_entries_and_restores_them():
    a, b = machine(1), machine(2)
    log = Log(a, b)
    elect(a, log, term=3)
    log.commit(a.propose(produce(a.store, "q", "committed"), lambda r, e: None))
    a.propose(produce(a.store, "q", "pending"), lambda r, e: None)
    a.propose(Confirm("q", 1), lambda r, e: None)
    state = a.snapshot()
    assert a.store.get("q").max_id == 2 and 1 not in a.store.get("q").messages  # redone
    fresh = machine(3)
    fresh.load_snapshot(log.index, state)
    assert fresh.store.to_wire() == b.store.to_wire()
    assert (fresh.epoch, fresh.next_seq) == (b.epoch, b.next_seq)


def test_an_outdated_barrier_does_not_count():
    a, b = machine(1), machine(2)
    log = Log(a, b)
    old = a.make_barrier(1)
    elect(b, log, term=2)
    log.commit(old)
    assert not a.is_master and a.epoch == b.epoch == (2, 1, 2)


# -- the password -------------------------------------------------------------


def test_password_is_derived_from_the_secret_and_never_empty():
    peers = (PeerConfig(node_id=1, host="127.0.0.1", port=1101),)
    one = raft_password(Config(secret="s1", peers=peers))
    assert one == raft_password(Config(secret="s1", peers=peers)) != raft_password(
        Config(secret="s2", peers=peers))
    assert "s1" not in one and len(one) == 64
    assert raft_password(Config(peers=peers))  # no secret: still set (and warned about)


# -- what pysyncobj's journal makes durable -----------------------------------


@pytest.fixture
def fsyncs(monkeypatch):
    """Every path (or fd's path) fsynced while the test runs."""
    seen: list[str] = []
    real = os.fsync

    def spy(fd):
        seen.append(os.readlink(f"/proc/self/fd/{fd}") if isinstance(fd, int) else str(fd))
        return real(fd)

    monkeypatch.setattr(os, "fsync", spy)
    return seen


def test_stock_pysyncobj_journal_keeps_term_and_vote_but_fsyncs_nothing(tmp_path, fsyncs):
    path = str(tmp_path / "j")
    j = FileJournal(path)
    j.setCurrentTerm(7, "127.0.0.1:2001")
    j.add(b"\x00cmd", 2, 7)
    j._destroy()
    assert fsyncs == []  # neither the vote nor the entry is forced to disk
    again = FileJournal(path)  # but both survive a process restart
    assert (again.getCurrentTerm(), again.getVotedForNodeId()) == (7, "127.0.0.1:2001")
    assert again[-1] == (b"\x00cmd", 2, 7)
    again._destroy()


def test_durable_journal_fsyncs_the_vote_before_returning_and_entries_on_sync(tmp_path, fsyncs):
    path = str(tmp_path / "j")
    j = DurableJournal(path)
    j.setCurrentTerm(3, "127.0.0.1:2002")
    assert fsyncs == [path + ".meta", str(tmp_path)]  # file, then its directory entry
    fsyncs.clear()
    j.sync()
    assert fsyncs == []  # nothing written: nothing to sync
    j.add(b"\x00a", 2, 3)
    j.add(b"\x00b", 3, 3)
    assert j.dirty
    j.sync()
    assert fsyncs == [path] and not j.dirty  # one fsync for the batch
    j._destroy()
    again = DurableJournal(path)
    assert again.getCurrentTerm() == 3 and len(again) == 2
    again._destroy()
