"""The master's client address, looked up once per Python worker process.

Theory of operation
-------------------
A task that writes or reads goes to the master directly: a slave would
forward every request to it and relay the answer, which costs the cluster
CPU on two nodes. Finding the master is a connection and a request (action
8). Spark runs task after task in the same Python worker process (it reuses
its workers, `spark.python.worker.reuse`, on by default), so the answer is
kept here, per list of hosts, for the life of the process: one lookup per
worker process, not one per task.

The cached answer may go stale when the master changes. The tasks' clients
do not depend on it (they follow the cluster's redirects and fail over
among every host); a task that ends on another node than the cached master
calls `forget`, and the next task looks again.

A master that reports a wildcard address (it listens on every interface)
names no host to connect to: the hosts stay as given.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

__all__ = ["master_first", "forget", "cached"]

# Addresses a server listens on that a client cannot connect to as such.
_WILDCARD_HOSTS = frozenset({"0.0.0.0", "::", "[::]"})

# hosts (as given) -> the master's "host:port" (absent: not looked up, or forgotten)
_masters: dict[tuple[str, ...], str] = {}
_lock = threading.Lock()  # tasks of one worker run one at a time; a thread may still look


def master_first(hosts: Sequence[str], lookup: Callable[[], dict]) -> list[str]:
    """`hosts` with the master's client address first (the others after
    it, for failover), from this process's cache or, the first time,
    `lookup()` (a client's `leader()`: {leader_host, leader_port, ...}).

    Raises:
        whatever `lookup` raises (QServerClientError when no node answers).
    """
    key = tuple(hosts)
    with _lock:
        address = _masters.get(key)
    if address is None:
        leader = lookup()
        host, port = leader.get("leader_host"), leader.get("leader_port")
        if not host or host in _WILDCARD_HOSTS or not port:
            return list(hosts)
        address = f"{host}:{port}"
        with _lock:
            _masters[key] = address
    return [address] + [h for h in hosts if h != address]


def forget(hosts: Sequence[str], ended_at: tuple[str, int] | None = None) -> None:
    """Drop the cached master of `hosts` if a client of them ended on
    another node (`ended_at`, its (host, port)), or unconditionally."""
    key = tuple(hosts)
    with _lock:
        address = _masters.get(key)
        if address is None:
            return
        if ended_at is None or f"{ended_at[0]}:{ended_at[1]}" != address:
            del _masters[key]


def cached(hosts: Sequence[str]) -> str | None:
    """The cached master of `hosts`, if any (for tests)."""
    with _lock:
        return _masters.get(tuple(hosts))
