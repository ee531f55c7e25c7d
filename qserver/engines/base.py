"""The interface between the request service and a replication engine.

The service decides an entry on the master (`Store.decide_*`) and hands it
to `Engine.propose(entry, done)`. The engine appends it to the log under the
current vote_id, applies it to the master's store at once (so that the next
decision sees it), and calls `done(result, None)` when the entry is committed
in the engine's sense (quorum: stored on a majority; async: appended), or
`done(None, reason)` when it never will be (the master lost its role). Until
`done` runs, the client hears nothing: this is what makes an acknowledged
write durable.

This module does no I/O.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from ..state.entries import Entry

__all__ = ["Engine", "EngineStatus", "LeaderInfo", "Done"]

# done(result, error): result is what Store.apply returned; error a reason.
Done = Callable[[object, "str | None"], None]


@dataclass(frozen=True, slots=True, kw_only=True)
class LeaderInfo:
    """Where clients reach the master: its node id and client address."""

    node_id: int
    host: str
    port: int


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineStatus:
    """What monitor reports about replication on this node."""

    role: str  # "master", "slave" or "candidate"
    vote_id: int  # current election epoch
    trans_id: int  # last trans_id in this node's log
    commit_id: int  # last trans_id known committed
    applied_id: int  # last trans_id applied to the store
    log_size: int  # records retained in memory


class Engine(Protocol):
    """A replication engine as the service sees it."""

    @property
    def is_master(self) -> bool: ...

    def leader(self) -> LeaderInfo | None:
        """The current master, or None while none is known."""

    def propose(self, entry: Entry, done: Done) -> None:
        """Replicate `entry` (master only); call `done` when it is decided."""

    def read_index(self, done: Done) -> None:
        """Call `done(None, None)` once everything this master's state holds
        now is committed and it is known to have been master now (Raft's
        read index), `done(None, reason)` if it loses its role first. For
        answers that append no entry (master only)."""

    def status(self) -> EngineStatus: ...

    def forward(self, request: dict, respond: Callable[[dict], None]) -> bool:
        """Relay a client request to the master (slaves only); False when no
        master is reachable, in which case `respond` is never called."""
