"""The single-node engine: the node is always master, and an entry is
committed as soon as it is appended and applied.

It goes through the same seam as the cluster engines (log append, store
apply, `done` callback), so the service cannot tell it apart from a cluster
master whose followers answer instantly.

This module does no I/O.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..state.entries import Entry
from ..state.log import COMPACT_SLACK, LONE_LOG_RECORDS, Log
from ..state.store import Store
from ..stats import Histogram
from .base import (
    AnswerNow,
    Cancel,
    Done,
    EngineStatus,
    FatalHandler,
    ForwardedHandler,
    JsonObject,
    LeaderInfo,
    Respond,
    Role,
    RoleHandler,
    TransferDone,
)

__all__ = ["LocalEngine"]


class LocalEngine:
    """One node, master forever (vote_id 1)."""

    def __init__(self, *, store: Store, log: Log, me: LeaderInfo, log_size: int,
                 epoch: int = 1) -> None:
        self.store = store
        self.log = log
        self.me = me
        self.log_size = min(log_size, LONE_LOG_RECORDS)  # records kept in memory
        self._compact_above = self.log_size + COMPACT_SLACK  # log length that triggers compact
        self._apply_by_kind = store.apply_by_kind  # Store.apply without its dispatch call
        self.vote_id = 1
        # A plain attribute, not a property: the service reads it on every
        # request. Never changes: one node is master forever.
        self.is_master = True
        # Nothing is forwarded to a lone node, and nothing here can fail.
        self.handle_forwarded: ForwardedHandler | None = None
        self.answer_forwarded_now: AnswerNow | None = None
        self.on_fatal: FatalHandler | None = None
        self.on_role_change: RoleHandler | None = None  # never called: the role never changes
        # Never called: every answer is given in the request's own call.
        self.on_answered: Callable[[], None] | None = None
        # Receipts' epoch. The node passes its start time in ms: a node
        # without storage starts empty and reuses msg_ids, and a receipt
        # from before a restart must not match a new delivery.
        self.epoch = epoch

    async def start(self) -> None:
        pass  # no links, timers or threads

    async def close(self) -> None:
        pass

    def halt(self) -> None:
        pass  # nothing is carried out later: every entry commits as it is proposed

    def leader(self) -> LeaderInfo | None:
        return self.me

    # The service may skip the `done` callback and take the result from
    # `commit_now` directly: this engine commits every entry at once.
    # Such an engine is always master (the service's fast path relies on it).
    commits_at_once = True

    def commit_now(self, entry: Entry) -> Any:
        """Append, apply and commit `entry`; return what apply returned."""
        log = self.log
        record = log.append_entry(entry, self.vote_id)
        try:
            apply = self._apply_by_kind[type(entry)]
        except KeyError:  # not an entry: Store.apply raises the error
            apply = self.store.apply
        result = apply(entry, None)
        if len(log.records) > self._compact_above:
            log.compact(self.log_size, record.trans_id)
        return result

    def propose(self, entry: Entry, done: Done) -> None:
        done(self.commit_now(entry), None)

    def read_index(self, done: Done) -> None:
        done(None, None)  # every entry commits as it is appended

    def forward(self, request: JsonObject, respond: Respond,
                timeout_s: float | None = None) -> Cancel | None:
        return None  # always master: nothing to forward to

    def transfer_leader(self, node_id: int, done: TransferDone) -> None:
        """One node: it is the only member, master forever."""
        if node_id == self.me.node_id:
            done(node_id, None)
        else:
            done(None, "no such node")

    def transfer_target(self) -> int | None:
        return None  # no slave

    def status(self) -> EngineStatus:
        last = self.log.last_trans_id
        return EngineStatus(role=Role.MASTER, vote_id=self.vote_id, trans_id=last,
                            commit_id=last, applied_id=last, log_size=len(self.log))

    def slaves(self) -> list[JsonObject] | None:
        return None  # no replication

    def snapshot_info(self) -> JsonObject | None:
        return None  # no snapshots in memory

    def storage_info(self) -> JsonObject | None:
        return None

    def timings(self) -> dict[str, Histogram]:
        return {}  # no fsync, no snapshots
