"""pysyncobj's log replication held to Raft's rules: a follower keeps the
entries it already holds and deletes only from a conflict; a follower that
rejects an append tells the leader where to resume, and the answers to one
round of appends agree; an acknowledgement never moves the leader's next
index for that follower back. And its idle links are kept alive, so that
an election's first vote request is not lost.

Theory of operation
-------------------
What pysyncobj 0.3.17 does (`SyncObj.__onMessageReceived`,
`__sendAppendEntries`), and why qserver cannot leave it so:

1. A follower given entries after `prevLogIdx` deletes every entry it holds
   after `prevLogIdx`, then appends the message's entries, even when it
   holds exactly those. Leaders re-send all the time: a leader advances its
   next index for a follower as it sends, and the acknowledgement of an
   earlier append sets it back to the end of that append, so the next
   append repeats entries. Without any fault that is hundreds of deletions
   a minute, each logged as CRITICAL "truncating already-applied log entries
   ... state machine may have diverged" once the entries were applied. The
   entries put back are the same (same index and term: Raft's log
   matching) and pysyncobj never applies an index twice, so applied state
   does not change. The deletion is still not harmless: when the re-send
   covers fewer entries than the follower holds (an append is cut at
   appendEntriesBatchSizeBytes, the leader's send loop stops after
   appendEntriesPeriod, the link drops between two appends), the follower's
   log shrinks below entries it has acknowledged and that may be
   committed; until they come again it may vote for a candidate that lacks
   them (Raft's safety argument needs acknowledged entries to stay), and
   with fsync="always" the shrunken journal is what reaches the disk. Raft
   (AppendEntries rule 3) deletes only from the first conflicting entry.

2. A follower whose entry at `prevLogIdx` has another term answers "resume
   at prevLogIdx" (one entry back); one whose log ends before `prevLogIdx`
   answers "resume after my last entry". A leader sends its whole tail
   (64 KiB per append) again on every new command, so a round of appends
   draws both answers, the last one wins, and a follower holding entries
   the leader lacks (a deposed leader's unreplicated tail) is sent back and
   forth and never catches up, until the leader compacts its log past it
   and sends a snapshot (measured: bench/raft_faults.py, a master cut off
   for 5 s under load was not back 60 s after the cut healed), while the
   leader spends its time re-sending its tail.

3. A connection declares itself dead when it sends after reading nothing
   for connectionTimeout, and drops what it was sending. Two followers
   never talk to each other while a leader is alive, so when the leader
   fails, the first candidate's vote request to the other follower is
   dropped on its idle link: the other follower times out too, both stand
   in the same term, and the election takes a second round (0.6-1.2 s
   more) or longer.

What this module does instead. pysyncobj has no hook for any of it, so
`RaftAppends` overrides three of its private methods (and adds a tick
callback for the keepalives): the message handler
rewrites the fields of an append (`prevLogIdx`, `prevLogTerm`, `entries`,
`commit_index`) so that pysyncobj's own handler, which also keeps the term,
the leader, the election timer and the role, does the rest; the sender of
acknowledgements and the journal deletion are wrapped. Rules:

- An append from the current leader whose `prevLogIdx`/`prevLogTerm` we
  hold: the leading entries we hold already (same index, term and command)
  are dropped from it; what is left starts at the first entry that
  conflicts (deleted from there on: Raft's rule 3) or after our last. If
  nothing conflicts, entries after the append's last one stay (pysyncobj
  is shown an append after our last entry, and its acknowledgement is
  corrected to the append's last entry). The commit index moves at most to
  the append's last entry (Raft's rule 5: what this append vouches for; a
  kept tail is not vouched for).
- A conflict with an entry already applied means committed entries
  diverged (impossible while Raft's assumptions hold): InvariantError, and
  the node stops (engines/raft/driver.py, _QueueSync._onTick) instead of
  deleting it.
- An append we cannot take is rejected with a resume index: after our last
  entry if the append starts beyond it; else the first entry of our term at
  `prevLogIdx` (a deposed leader's whole tail at once), never below our
  commit index + 1 (committed entries match every later leader's). Until
  an append matches again (same leader and term), the resume index only
  goes down, so every answer to one round of appends says the same.
- On the leader, an acknowledgement never lowers the next index of that
  follower (the appends after it are on their way on the same connection;
  if the link breaks they are rejected and the resume index says so).
- Every node sends a keepalive (a message type pysyncobj ignores) to every
  other node each connectionTimeout / 4, from pysyncobj's tick.

This relies on pysyncobj's private names (pinned: pysyncobj>=0.3.17, and
test_raft_appends.py checks the behaviour on the installed version).
"""

from __future__ import annotations

import collections

import pysyncobj.pickle as _pso_pickle
import pysyncobj.syncobj as _pso
from pysyncobj import SyncObj

from ...errors import InvariantError

__all__ = ["RaftAppends"]

_base_on_message = SyncObj._SyncObj__onMessageReceived
_base_delete_from = SyncObj._SyncObj__deleteEntriesFrom
_base_send_next_index = SyncObj._SyncObj__sendNextNodeIdx

# A term no entry has (pysyncobj's terms start at 0): a rejection is handed
# to pysyncobj as an append whose prevLogTerm cannot match.
_NO_TERM = -1

# A message type pysyncobj's handler does not know, and so ignores.
_KEEPALIVE = {"type": "keepalive"}

# Keepalives per connectionTimeout: a link idle that long is dropped on its
# next send; four leave room for a late tick or two.
_KEEPALIVES_PER_TIMEOUT = 4


class RaftAppends(SyncObj):
    """SyncObj with the append rules of this module's docstring."""

    # pysyncobj's (SyncObj.__recvTransmission): the parts of a large entry
    # received so far, "" between entries.
    _SyncObj__recvTransmission: bytes | str

    def __init__(self, *args, **kwargs) -> None:
        # Set before SyncObj.__init__, so that pysyncobj counts these as
        # its own properties and leaves them out of its default snapshot.
        # (leader node, term, resume index) of the rejections since the
        # last append that matched; the index only goes down within them.
        self._resume: tuple[object, int, int] | None = None
        # While pysyncobj handles an append that conflicts with nothing and
        # ends before our log does: the last index it vouches for, which is
        # what we acknowledge (pysyncobj sees an append after our last
        # entry, so that it deletes nothing).
        self._vouched: int | None = None
        # Entries skipped as held, entries deleted at a conflict, appends
        # rejected (for tests and the curious).
        self.append_counts: collections.Counter = collections.Counter()
        self._next_keepalive = 0.0  # pysyncobj's clock
        super().__init__(*args, **kwargs)
        self.addOnTickCallback(self._keep_links_alive)

    def _keep_links_alive(self) -> None:
        now = _pso.monotonicTime()
        if now < self._next_keepalive:
            return
        self._next_keepalive = now + self.conf.connectionTimeout / _KEEPALIVES_PER_TIMEOUT
        transport = self._SyncObj__transport
        for node in self.otherNodes:
            transport.send(node, _KEEPALIVE)

    # -- pysyncobj's private methods, overridden ------------------------------------

    def _SyncObj__onMessageReceived(self, node, message) -> None:
        kind = message.get("type") if isinstance(message, dict) else None
        if kind == "append_entries":
            message = self._rewrite_append(node, message)
            try:
                _base_on_message(self, node, message)
            finally:
                self._vouched = None
        elif kind == "next_node_idx" and message.get("success") and not message.get("reset"):
            next_index = self._SyncObj__raftNextIndex
            before = next_index.get(node)
            _base_on_message(self, node, message)
            if before is not None and next_index.get(node, before) < before:
                next_index[node] = before
        else:
            _base_on_message(self, node, message)

    def _SyncObj__sendNextNodeIdx(self, node, reset=False, nextNodeIdx=None, success=False) -> None:
        if success and self._vouched is not None:
            nextNodeIdx = self._vouched + 1
        _base_send_next_index(self, node, reset=reset, nextNodeIdx=nextNodeIdx, success=success)

    def _SyncObj__deleteEntriesFrom(self, fromIDx) -> None:
        log = self._SyncObj__raftLog
        if fromIDx <= self.raftLastApplied:
            raise InvariantError(
                f"raft: the leader's entry {fromIDx} conflicts with an entry applied here "
                f"(applied up to {self.raftLastApplied}): committed entries diverged")
        self.append_counts["deleted"] += max(0, log[-1][1] - fromIDx + 1)
        _base_delete_from(self, fromIDx)

    # -- the rules ---------------------------------------------------------------------

    def _rewrite_append(self, node, msg: dict) -> dict:
        """The append pysyncobj's handler should see instead of `msg`."""
        if msg.get("term", -1) < self.raftCurrentTerm:
            return msg  # a deposed leader's: pysyncobj ignores it
        if "prevLogIdx" not in msg:
            self._resume = None  # a snapshot: our log is about to be replaced
            return msg
        transmission = msg.get("transmission")
        if transmission is not None:
            if transmission != "finish":
                return msg  # a part of one large entry: pysyncobj collects it
            assembled = self._assemble(msg)
            if assembled is None:
                return msg
            msg = assembled
        prev, prev_term = msg["prevLogIdx"], msg["prevLogTerm"]
        if prev is None:
            return msg
        log = self._SyncObj__raftLog
        first, last = log[0][1], log[-1][1]
        if prev < first or prev > last or log[prev - first][2] != prev_term:
            return self._reject(node, msg, prev, first, last)
        self._resume = None
        entries = msg.get("entries") or []
        held = 0
        for k, entry in enumerate(entries):
            index = prev + 1 + k
            if entry[1] != index:
                return msg  # not what a leader sends; pysyncobj's own handling
            if index > last:
                break
            mine = log[index - first]
            if mine[2] != entry[2] or mine[0] != entry[0]:
                break
            held += 1
        end = prev + len(entries)  # the last index this append vouches for
        self.append_counts["held"] += held
        out = dict(msg)
        out["commit_index"] = min(msg["commit_index"], end)
        if held == len(entries) and end < last:
            # Nothing conflicts: what follows `end` stays, unacknowledged.
            self._vouched = end
            out["prevLogIdx"], out["prevLogTerm"], out["entries"] = last, log[-1][2], []
            return out
        out["prevLogIdx"] = prev + held
        out["prevLogTerm"] = entries[held - 1][2] if held else prev_term
        out["entries"] = entries[held:]
        return out

    def _reject(self, node, msg: dict, prev: int, first: int, last: int) -> dict:
        """An append that makes pysyncobj answer "resume at <index>"."""
        commit = min(self.raftCommitIndex, last)
        if prev > last:
            resume = last + 1
        elif prev < first:
            resume = commit + 1  # below our snapshot: committed, so it matches
        else:
            log = self._SyncObj__raftLog
            term = log[prev - first][2]
            start, floor = prev, max(first, commit + 1)  # back to the first entry of that term
            while start > floor and log[start - 1 - first][2] == term:
                start -= 1
            resume = min(prev, start)
        run = self._resume
        if run is not None and run[0] == node and run[1] == msg["term"]:
            resume = min(resume, run[2])
        resume = min(max(resume, first + 1), last + 1)
        self._resume = (node, msg["term"], resume)
        self.append_counts["rejected"] += 1
        # pysyncobj answers an append whose prevLogIdx is beyond our log with
        # "resume after the last entry" (= resume here), and one whose
        # prevLogTerm does not match with "resume at prevLogIdx".
        return {"type": "append_entries", "term": msg["term"],
                "commit_index": msg["commit_index"], "prevLogIdx": resume,
                "prevLogTerm": _NO_TERM, "entries": []}

    def _assemble(self, msg: dict) -> dict | None:
        """The last part of a large entry sent in parts, as a plain append
        of that entry; None if the parts do not make one."""
        head = self._SyncObj__recvTransmission
        if not isinstance(head, (bytes, bytearray)):
            return None
        try:
            entry = _pso_pickle.loads(head + msg["data"])
        except Exception:  # pysyncobj's own handling raises it
            return None
        self._SyncObj__recvTransmission = ""
        out = {k: v for k, v in msg.items() if k not in ("transmission", "data")}
        out["entries"] = [entry]
        return out
