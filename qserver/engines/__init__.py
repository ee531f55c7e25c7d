"""Replication engines: how a proposed entry reaches the log of every node
and when it counts as committed.

Every engine offers the same small interface to the service (`Engine` in
`base`): `propose(entry, done)`, `is_master`, `leader()`, `status()`. The
single-node engine commits at once; the cluster engines (later issues) wrap
the same store and log.
"""

from .base import Engine, EngineStatus, LeaderInfo
from .local import LocalEngine

__all__ = ["Engine", "EngineStatus", "LeaderInfo", "LocalEngine"]
