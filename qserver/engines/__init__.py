"""Replication engines: how a proposed entry reaches the log of every node
and when it counts as committed.

Every engine offers the same interface to the node and the service
(`Engine` in `base`: start/close/halt, propose, read_index, forward,
status and what monitor shows).
`local` is one node without storage: it commits at once. `native/` (the
native engine: a no-I/O core and its asyncio driver) and `raft/` (the same
state machine on pysyncobj) replicate the same store and log; both use
`messages` (node-to-node messages), `peers` (authenticated links) and
`forwarding` (the slave -> master relay). Import those subpackages by name:
this package exports only the interface and the local engine.
"""

from .base import Engine, EngineStatus, LeaderInfo
from .local import LocalEngine

__all__ = ["Engine", "EngineStatus", "LeaderInfo", "LocalEngine"]
