"""The raft engine's leader-transfer watcher (`_QueueSync._transfer_tick`,
run on pysyncobj's thread at every tick), stepped by hand on a clock of our
own: when it sends TimeoutNow, and how the transfer ends.

The watcher reads pysyncobj's private state (its role, term, leader, match
and commit indexes); here that state is set directly on an instance built
without pysyncobj's constructor, so each case is exactly the state it
names. Transfers over real pysyncobj nodes are tested in
test_transfer_cluster.py and test_ops_cluster.py.
"""

from __future__ import annotations

import pytest
from pysyncobj.fast_queue import FastQueue

from qserver.engines.raft import driver
from qserver.engines.raft.driver import (
    _FOLLOWER,
    _LEADER,
    RAFT_TRANSFER_ELECTION_S,
    RAFT_TRANSFER_S,
    _QueueSync,
)

TARGET = "127.0.0.1:7002"
OTHER = "127.0.0.1:7003"


class _Node:
    def __init__(self, addr: str) -> None:
        self.id = addr


class _Engine:
    """What the watcher tells the event loop: (leader address, reason)."""

    def __init__(self) -> None:
        self.ended: list[tuple[str | None, str | None]] = []

    def _from_thread(self, fn, *args) -> None:
        self.ended.append(args)

    def _transfer_ended(self, *args) -> None:  # named by the watcher; never run here
        raise AssertionError("the watcher must hand the outcome to the loop")


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch):
    c = Clock()
    monkeypatch.setattr(driver.time, "monotonic", c)
    return c


def leader_of_term_1(caught_up: bool = True):
    """A leader of term 1 with two followers, asked to transfer to TARGET."""
    sync = object.__new__(_QueueSync)
    target, other = _Node(TARGET), _Node(OTHER)
    sync._SyncObj__otherNodes = [target, other]
    sync._SyncObj__raftState = _LEADER
    sync._SyncObj__raftCurrentTerm = 1
    sync._SyncObj__raftLeader = None
    sync._SyncObj__raftCommitIndex = 10
    sync._SyncObj__raftMatchIndex = {target: 10 if caught_up else 7, other: 10}
    sync._SyncObj__getCurrentLogIndex = lambda: 10
    sync._SyncObj__commandsQueue = FastQueue(0)  # pysyncobj's: proposed, not yet appended
    sync.sent = []
    sync.transferLeadership = sync.sent.append
    sync._engine = _Engine()
    sync._transfer = None
    sync.transfer_request = TARGET
    return sync, target, other


def step_down(sync, term: int, leader: _Node | None) -> None:
    sync._SyncObj__raftState = _FOLLOWER
    sync._SyncObj__raftCurrentTerm = term
    sync._SyncObj__raftLeader = leader


def test_timeout_now_goes_once_the_target_is_caught_up(clock):
    sync, target, _ = leader_of_term_1(caught_up=False)
    sync._transfer_tick()
    assert sync.sent == [] and sync._engine.ended == []
    clock.now += 0.1
    sync._SyncObj__raftMatchIndex[target] = 10
    sync._transfer_tick()
    assert sync.sent == [target]
    sync._transfer_tick()  # sent once
    assert sync.sent == [target]


def test_no_timeout_now_while_proposed_commands_wait_to_be_appended(clock):
    """A tick appends only what it has time for: a command proposed before
    the transfer began and appended after the TimeoutNow would make the
    leader's log longer than the target's, and the voters refuse it."""
    sync, target, _ = leader_of_term_1()
    sync._SyncObj__commandsQueue.put_nowait((b"cmd", None))
    sync._transfer_tick()
    assert sync.sent == []
    sync._SyncObj__commandsQueue.get_nowait()  # appended (and replicated) by a tick
    sync._transfer_tick()
    assert sync.sent == [target]


def test_a_target_that_never_catches_up(clock):
    sync, _, _ = leader_of_term_1(caught_up=False)
    sync._transfer_tick()
    clock.now += RAFT_TRANSFER_S + 0.01
    sync._transfer_tick()
    assert sync.sent == [] and sync._engine.ended == [(None, "node not caught up")]
    assert sync.transfer_request is None and sync._transfer is None


def test_the_new_leader_ends_the_transfer(clock):
    sync, target, _ = leader_of_term_1()
    sync._transfer_tick()
    clock.now += 0.05
    step_down(sync, 2, target)
    sync._transfer_tick()
    assert sync._engine.ended == [(TARGET, None)]


def test_an_election_that_splits_is_waited_for(clock):
    """The TimeoutNow arrived (this node stepped down in the target's
    term) but that election split: the next, randomized one, after another
    election timeout, is waited for, and whoever wins it is the outcome
    (pysyncobj has no pre-vote). This failed a SIGTERM hand-over in CI when
    the wait ended RAFT_TRANSFER_S after the TimeoutNow."""
    sync, _, other = leader_of_term_1()
    sync._transfer_tick()
    step_down(sync, 2, None)
    clock.now += RAFT_TRANSFER_S + 0.2
    sync._transfer_tick()
    assert sync._engine.ended == []  # still under way
    clock.now += 0.6
    step_down(sync, 3, other)
    sync._transfer_tick()
    assert sync._engine.ended == [(OTHER, None)]


def test_no_leader_after_the_longer_wait(clock):
    sync, _, _ = leader_of_term_1()
    sync._transfer_tick()
    step_down(sync, 2, None)
    clock.now += RAFT_TRANSFER_S + RAFT_TRANSFER_ELECTION_S - 0.01
    sync._transfer_tick()
    assert sync._engine.ended == []
    clock.now += 0.02
    sync._transfer_tick()
    assert sync._engine.ended == [(None, "transfer timed out")]


def test_a_lost_timeout_now_ends_after_the_short_wait(clock):
    """Still leader of the same term: the TimeoutNow (sent once) was lost
    or ignored; the write freeze ends RAFT_TRANSFER_S after it, not later."""
    sync, _, _ = leader_of_term_1()
    sync._transfer_tick()
    clock.now += RAFT_TRANSFER_S + 0.01
    sync._transfer_tick()
    assert sync._engine.ended == [(None, "transfer timed out")]


def test_the_whole_hand_over_fits_a_sigterm():
    """Catch-up, the TimeoutNow's wait and the longer one stay within what
    a stopping master gives its hand-over."""
    from qserver.node import HAND_OVER_ON_STOP_S
    assert RAFT_TRANSFER_S + RAFT_TRANSFER_S + RAFT_TRANSFER_ELECTION_S < HAND_OVER_ON_STOP_S
