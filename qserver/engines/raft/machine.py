"""The raft engine's state-machine side: which committed entries count, and
the master's speculation around them. No I/O: the adapter
(`engines.raft.driver`) feeds it pysyncobj's committed commands and carries
out what it returns.

Theory of operation
-------------------
pysyncobj orders opaque commands; every node applies the committed ones in
log order. A qserver entry records decisions the master took on its own
store, so it is only meaningful on top of exactly the state it was decided
on. pysyncobj does not guarantee that by itself: a deposed leader's
proposals can be relayed to the new leader and appended after entries the
old leader never saw. So every command carries where it was decided, and
one deterministic rule, applied identically on every node, drops the ones
decided on a state that is not the one they land on:

- A *barrier* `[BARRIER, term, k, node_id]` opens epoch (term, k, node_id).
  It counts only if that is greater than the current epoch; then it is the
  epoch, and the epoch's next sequence number is 1. (The node id makes an
  epoch belong to one proposer even if two nodes were leader in one term,
  which raft rules out only while votes survive restarts.)
- An *entry* `[ENTRY, term, k, node_id, seq, entry]` counts only if (term,
  k, node_id) is the current epoch and seq is the epoch's next sequence
  number; then it is applied and the next sequence number grows by one.
  Anything else is skipped, on every node alike.

A node that becomes raft leader in term T proposes a barrier (T, k) and takes
no request until that barrier is applied: by then its store holds every
entry before it, which raft will commit along with it. From then on it
decides each request on its store, applies the entry at once (keeping the
undo record, so the next decision sees it) and proposes it with the next
seq. When its entries come back committed, in order, they are already
applied: the client is answered. If one of its entries comes back skipped,
or someone else's entry comes back while its own are pending, or the node
learns it lost leadership, every pending entry is reverted (newest first)
and answered "outcome unknown"; entries of that epoch that still commit are
then applied like anyone else's, in order, and the rest are skipped. A
leader that wants to go on opens a new epoch (T, k + 1).

Why that is safe: an entry counts only directly after its predecessor in
the same epoch, which counts only after the barrier, which counts only
after everything its proposer had in its store when it proposed it. So
every entry applied anywhere is applied on top of the state it was decided
on, and every node applies the same sequence: the committed log, filtered
by a rule that reads only the log.

Rules
- `epoch` and `next_seq` are replicated state: snapshots carry them.
- Nothing here reads a clock, a socket or a thread; `pending` and
  `my_epoch` are this node's own bookkeeping, never replicated.

This module does no I/O.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from functools import partial
from typing import Any

import msgpack

from ...errors import InvariantError
from ...state.entries import Entry, entry_from_wire, entry_to_wire
from ...state.store import Store
from ..base import Done

__all__ = ["RaftMachine", "BARRIER", "ENTRY", "OUTCOME_UNKNOWN", "SNAPSHOT_FORMAT"]

BARRIER = 0
ENTRY = 1

# The same words as the native engine's, for the same situation.
OUTCOME_UNKNOWN = "master changed before the write committed; outcome unknown"

# First element of a snapshot value; bump when its layout changes.
SNAPSHOT_FORMAT = 1

_packb: Callable[[object], bytes] = msgpack.Packer(use_bin_type=True).pack


def _unpack(payload: bytes) -> list[Any]:
    cmd: list[Any] = msgpack.unpackb(payload, raw=False, use_list=True, strict_map_key=False)
    return cmd


class RaftMachine:
    """The replicated epoch rule over a `Store`, plus this node's pending
    (applied, uncommitted) proposals when it is master."""

    def __init__(self, *, store: Store, node_id: int, async_mode: bool = False) -> None:
        self.store = store
        self.node_id = node_id
        self.async_mode = async_mode  # answer at propose time (queue_server's async mode)
        # Replicated (identical on every node after the same commands):
        # (term, k, node_id) of the last barrier that counted
        self.epoch: tuple[int, int, int] = (0, 0, 0)
        self.next_seq = 1  # seq the next entry of `epoch` must carry to count
        # This node's own:
        self.applied_index = 0  # raft index of the last committed command handled
        self.my_epoch: tuple[int, int, int] | None = None  # set while this node may decide
        self.my_next_seq = 1  # seq of this node's next proposal in my_epoch
        self.barrier_wanted: tuple[int, int, int] | None = None  # our barrier, not yet applied
        self._last_k = 0  # highest k this node has proposed (any term)
        # (token, undo ops, done, result, entry), oldest first; token = (*epoch, seq)
        self.pending: deque[tuple[tuple[int, ...], list[Any], Done | None, object, Entry]] = deque()

    @property
    def is_master(self) -> bool:
        return self.my_epoch is not None

    # -- proposing (master) -----------------------------------------------------

    def make_barrier(self, term: int) -> bytes:
        """A barrier opening a new epoch in `term`; this node decides nothing
        until it comes back applied."""
        k = max(self._last_k, self.epoch[1] if self.epoch[0] == term else 0) + 1
        self._last_k = k
        self.barrier_wanted = (term, k, self.node_id)
        return _packb([BARRIER, term, k, self.node_id])

    def propose(self, entry: Entry, done: Done) -> bytes | None:
        """Apply `entry` speculatively and return the command to replicate;
        None (and `done` answered) if this node may not decide now."""
        if self.my_epoch is None:
            done(None, "not master")
            return None
        term, k, node_id = self.my_epoch
        seq = self.my_next_seq
        self.my_next_seq = seq + 1
        ops: list[Any] = []
        result = self.store.apply(entry, ops)
        waiting: Done | None = done  # None once answered
        if self.async_mode:
            done(result, None)
            waiting = None
        self.pending.append(((term, k, node_id, seq), ops, waiting, result, entry))
        return _packb([ENTRY, term, k, node_id, seq, entry_to_wire(entry)])

    # -- committed commands (every node) ----------------------------------------

    def apply_committed(self, index: int, payload: bytes) -> list[Callable[[], None]]:
        """Handle the committed command at raft index `index`. Returns the
        client answers to run (after this returns). Raises InvariantError
        if an entry that counts does not fit the store (never expected)."""
        answers: list[Callable[[], None]] = []
        self.applied_index = index
        cmd = _unpack(payload)
        if cmd[0] == BARRIER:
            epoch = (cmd[1], cmd[2], cmd[3])
            if epoch > self.epoch:
                if self.pending:
                    self._abandon(answers)
                self.epoch = epoch
                self.next_seq = 1
                if self.barrier_wanted == epoch:
                    self.my_epoch = epoch
                    self.my_next_seq = 1
                    self.barrier_wanted = None
            elif self.barrier_wanted == epoch:
                self.barrier_wanted = None  # outdated: the adapter tries again
            return answers
        if cmd[0] != ENTRY:
            raise InvariantError(f"unknown raft command kind {cmd[0]!r}")
        _, term, k, node_id, seq, wire = cmd
        counts = (term, k, node_id) == self.epoch and seq == self.next_seq
        if counts:
            self.next_seq = seq + 1
        pending = self.pending
        if pending and pending[0][0] == (term, k, node_id, seq):
            if counts:
                _, _, done, result, _ = pending.popleft()
                if done is not None:
                    answers.append(lambda: done(result, None))
                return answers
            self._abandon(answers)  # ours, but a predecessor went missing
            return answers
        if counts:
            if pending:
                self._abandon(answers)  # someone else decided: ours cannot count
            self.store.apply(entry_from_wire(wire))
        return answers

    # -- losing the right to decide ---------------------------------------------

    def lose_leadership(self) -> list[Callable[[], None]]:
        """This node is no longer raft leader: revert and fail what is pending."""
        answers: list[Callable[[], None]] = []
        self._abandon(answers)
        self.barrier_wanted = None
        return answers

    def proposal_failed(self) -> list[Callable[[], None]]:
        """pysyncobj refused or dropped one of our commands: nothing after it
        in this epoch can count, so give up the epoch (the adapter opens a
        new one if it is still leader)."""
        answers: list[Callable[[], None]] = []
        self._abandon(answers)
        return answers

    def _abandon(self, answers: list[Callable[[], None]]) -> None:
        pending = self.pending
        while pending:
            _, ops, done, _, _ = pending.pop()  # newest first
            self.store.revert(ops)
            if done is not None:
                answers.append(partial(done, None, OUTCOME_UNKNOWN))
        self.my_epoch = None

    # -- snapshots ------------------------------------------------------------------

    def snapshot(self) -> list[Any]:
        """The replicated state as a msgpack-friendly value, without this
        node's pending entries (undone around the dump and redone)."""
        pending = list(self.pending)
        for _, undo, _, _, _ in reversed(pending):
            self.store.revert(undo)
        state = [SNAPSHOT_FORMAT, list(self.epoch), self.next_seq, self.store.to_wire()]
        self.pending.clear()
        for token, _, done, result, entry in pending:
            ops: list[Any] = []
            # Same entries in the same order on the same state: same results.
            self.store.apply(entry, ops)
            self.pending.append((token, ops, done, result, entry))
        return state

    def load_snapshot(self, index: int, state: list[Any]) -> list[Callable[[], None]]:
        """Replace the replicated state with a snapshot taken at `index`."""
        answers: list[Callable[[], None]] = []
        self._abandon(answers)
        if not isinstance(state, list) or len(state) != 4 or state[0] != SNAPSHOT_FORMAT:
            raise InvariantError("raft snapshot of an unknown format")
        _, epoch, next_seq, store_wire = state
        self.store.load_wire(store_wire)
        self.epoch = tuple(epoch)
        self.next_seq = next_seq
        self.applied_index = index
        return answers
