"""The single-node engine: the node is always master, and an entry is
committed as soon as it is appended and applied.

It goes through the same seam as the cluster engines (log append, store
apply, `done` callback), so the service cannot tell it apart from a cluster
master whose followers answer instantly.

This module does no I/O.
"""

from __future__ import annotations

from ..entries import Entry
from ..log import COMPACT_SLACK, Log
from ..store import Store
from .base import Done, EngineStatus, LeaderInfo

__all__ = ["LocalEngine"]


class LocalEngine:
    """One node, master forever (vote_id 1)."""

    def __init__(self, *, store: Store, log: Log, me: LeaderInfo, log_size: int) -> None:
        self.store = store
        self.log = log
        self.me = me
        self.log_size = log_size  # records kept in memory (queue_server's log_size)
        self.vote_id = 1

    @property
    def is_master(self) -> bool:
        return True

    def leader(self) -> LeaderInfo | None:
        return self.me

    # The service may skip the `done` callback and take the result from
    # `commit_now` directly: this engine commits every entry at once.
    commits_at_once = True

    def commit_now(self, entry: Entry) -> object:
        """Append, apply and commit `entry`; return what apply returned."""
        log = self.log
        record = log.append_entry(entry, self.vote_id)
        result = self.store.apply(entry)
        if len(log.records) > self.log_size + COMPACT_SLACK:
            log.compact(self.log_size, record.trans_id)
        return result

    def propose(self, entry: Entry, done: Done) -> None:
        done(self.commit_now(entry), None)

    def forward(self, request: dict, respond) -> bool:
        return False  # always master: nothing to forward to

    def status(self) -> EngineStatus:
        last = self.log.last_trans_id
        return EngineStatus(role="master", vote_id=self.vote_id, trans_id=last,
                            commit_id=last, applied_id=last, log_size=len(self.log))
