"""The asyncio adapter of the native engine: one NativeCore, its peer links,
its storage, its timer, and request forwarding.

Mechanical by design: a peer message is decoded and stepped into the core; a
proposal is handed to the core; once per event-loop turn the core's `Ready`
is carried out in order (persist vote, persist log, send, answer); one timer
is armed for the core's next deadline. Nothing else mutates the core.

Storage (when configured): the vote is saved (always fsynced) before any
message goes out; log changes are written before anything is sent or
answered; with fsync=always they are also fsynced then, once per turn (group
commit); with fsync=batch a timer fsyncs every BATCH_SYNC_MS; with off, the
OS decides. A node configured alone but with storage runs this engine too,
with no peers: it elects itself at once and commits on its own.

Forwarding: a slave relays a client request to the master as a `Forward`
message over the internal link and relays the `ForwardReply` back; if the
master is unknown or unreachable the client hears "no leader" at once, and
if the master does not answer within FORWARD_TIMEOUT_S, "forward timeout".
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Callable

from .config import Config
from .entries import Entry
from .log import Log
from .peers import PeerNetwork
from .replication.base import Done, EngineStatus, LeaderInfo
from .replication.messages import (
    Forward,
    ForwardReply,
    message_from_wire,
    message_to_wire,
)
from .replication.native import NativeCore, Timing
from .storage import DiskStorage
from .store import Store

__all__ = ["ClusterEngine", "FORWARD_TIMEOUT_S", "DEFAULT_TIMING"]

log = logging.getLogger("qserver.cluster")

# A forwarded request that the master has not answered in this time is
# answered "forward timeout" (the write may or may not have happened).
FORWARD_TIMEOUT_S = 10.0

# fsync=batch: how often written-but-unsynced log records are fsynced.
BATCH_SYNC_MS = 5

# Heartbeats every 100 ms; a master silent for 600-1200 ms is replaced, so a
# failover completes in well under 2 s, while a briefly busy event loop on a
# loaded machine does not trigger elections.
DEFAULT_TIMING = Timing(heartbeat_ms=100, election_ms=600, pull_retry_ms=300)


def now_ms() -> int:
    return int(time.time() * 1000)


class ClusterEngine:
    """The native engine on real sockets; the service's `Engine`."""

    def __init__(self, *, config: Config, store: Store, log_: Log,
                 storage: DiskStorage | None = None, vote: tuple[int, int] = (0, 0),
                 timing: Timing = DEFAULT_TIMING) -> None:
        self.config = config
        self.storage = storage
        peers = [p for p in config.peers if p.node_id != config.node_id]
        self.core = NativeCore(
            node_id=config.node_id, peer_ids=[p.node_id for p in peers], store=store,
            log=log_, me=LeaderInfo(node_id=config.node_id, host=config.host, port=config.port),
            rng=random.Random(), now_ms=now_ms(), timing=timing,
            async_mode=config.mode.value == "async", sync_rate=config.sync_rate,
            log_size=config.log_size, vote_id=vote[0], voted_for=vote[1])
        self.net: PeerNetwork | None = None
        if peers:
            me = next(p for p in config.peers if p.node_id == config.node_id)
            self.net = PeerNetwork(
                node_id=config.node_id, listen=(me.host, me.port),
                peers={p.node_id: (p.host, p.port) for p in peers},
                secret=config.secret, on_message=self._on_message, on_link=self._on_link)
        self._batch_timer: asyncio.TimerHandle | None = None
        self.handle_forwarded: Callable[[dict, int, Callable[[dict], None]], None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = 0
        self._flush_scheduled = False
        self._forwards: dict[int, tuple[Callable[[dict], None], asyncio.TimerHandle, int]] = {}
        self._next_forward = 1
        self._last_role = None

    # -- Engine interface ----------------------------------------------------

    @property
    def is_master(self) -> bool:
        return self.core.is_master

    def leader(self) -> LeaderInfo | None:
        return self.core.leader()

    def status(self) -> EngineStatus:
        return self.core.status()

    def slaves(self) -> list[dict]:
        connected = self.net.connected_ids() if self.net else set()
        out = self.core.slaves()
        for s in out:
            s["connected"] = s["node_id"] in connected
        return out

    def propose(self, entry: Entry, done: Done) -> None:
        self.core.propose(entry, done)
        self._schedule_flush()

    def forward(self, request: dict, respond: Callable[[dict], None]) -> bool:
        """Relay a client request to the master; False if none is reachable."""
        leader_id = self.core.leader_id
        if (not leader_id or leader_id == self.config.node_id or self.net is None
                or not self.net.connected(leader_id)):
            return False
        request_id = self._next_forward
        self._next_forward += 1
        msg = Forward(vote_id=self.core.vote_id, node_id=self.config.node_id,
                      request_id=request_id, request=request)
        if not self.net.send(leader_id, message_to_wire(msg)):
            return False
        timer = self._loop.call_later(FORWARD_TIMEOUT_S, self._forward_timeout, request_id)
        self._forwards[request_id] = (respond, timer, leader_id)
        return True

    # -- lifecycle -------------------------------------------------------------

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        if self.net is not None:
            await self.net.start()
            log.info("node %d: cluster of %d, internal port %s, mode %s", self.config.node_id,
                     len(self.config.peers), self.net.address[1], self.config.mode.value)
        self._arm_timer()

    async def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        if self._batch_timer is not None:
            self._batch_timer.cancel()
        for request_id in list(self._forwards):
            self._fail_forward(request_id, "node shutting down")
        if self.net is not None:
            await self.net.close()
        if self.storage is not None:
            self.storage.close()

    # -- events ----------------------------------------------------------------

    def _on_message(self, peer_id: int, obj: object) -> None:
        try:
            msg = message_from_wire(obj)
        except ValueError as exc:
            log.warning("node %d: bad message from node %d: %s", self.config.node_id, peer_id, exc)
            return
        if msg.node_id != peer_id:
            log.warning("node %d: node %d sent a message as node %d; dropped",
                        self.config.node_id, peer_id, msg.node_id)
            return
        t = type(msg)
        if t is Forward:
            self._serve_forward(peer_id, msg)
            return
        if t is ForwardReply:
            pending = self._forwards.pop(msg.request_id, None)
            if pending is not None:
                pending[1].cancel()
                pending[0](msg.response)
            return
        self.core.step(msg, now_ms())
        self._schedule_flush()

    def _on_link(self, peer_id: int, up: bool) -> None:
        if up:
            self.core.link_up(peer_id)
            self._schedule_flush()
        else:
            for request_id, (_, _, target) in list(self._forwards.items()):
                if target == peer_id:
                    self._fail_forward(request_id, "master unreachable; outcome unknown")

    def _serve_forward(self, peer_id: int, msg: Forward) -> None:
        def respond(response: dict) -> None:
            reply = ForwardReply(vote_id=self.core.vote_id, node_id=self.config.node_id,
                                 request_id=msg.request_id, response=response)
            self.net.send(peer_id, message_to_wire(reply))

        if self.handle_forwarded is None:
            respond({"code": -1, "reason": "no leader"})
            return
        self.handle_forwarded(msg.request, now_ms(), respond)

    def _forward_timeout(self, request_id: int) -> None:
        self._fail_forward(request_id, "forward timeout; outcome unknown")

    def _fail_forward(self, request_id: int, reason: str) -> None:
        pending = self._forwards.pop(request_id, None)
        if pending is not None:
            pending[1].cancel()
            pending[0]({"code": -1, "reason": reason})

    # -- carrying out the core's Ready ----------------------------------------

    def _schedule_flush(self) -> None:
        if not self._flush_scheduled:
            self._flush_scheduled = True
            self._loop.call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_scheduled = False
        ready = self.core.take_ready()
        storage = self.storage
        if storage is not None:
            self._persist(storage, ready)
        if self.net is not None:
            encoded: dict[int, object] = {}
            send = self.net.send
            for peer_id, msg in ready.messages:
                wire = encoded.get(id(msg))
                if wire is None:
                    wire = encoded[id(msg)] = message_to_wire(msg)
                send(peer_id, wire)
        for answer in ready.answers:
            answer()
        role = self.core.role
        if role is not self._last_role:
            self._last_role = role
            log.info("node %d: %s in vote %d (leader %s)", self.config.node_id, role.value,
                     self.core.vote_id, self.core.leader_id or "unknown")
        self._arm_timer()

    def _persist(self, storage: DiskStorage, ready) -> None:
        """Vote, snapshot, truncation, records: on disk before anything of
        this turn is sent or answered. A StorageError propagates: the node
        must stop and recover from disk."""
        if ready.vote is not None:
            storage.save_vote(*ready.vote)
        if ready.snapshot is not None:
            storage.install_snapshot(*ready.snapshot)
        if ready.truncate_after is not None:
            storage.truncate_after(ready.truncate_after)
        if ready.records:
            storage.append(ready.records)
        if storage.dirty:
            policy = self.config.fsync.value
            if policy == "always":
                storage.sync()
            elif policy == "batch" and self._batch_timer is None:
                self._batch_timer = self._loop.call_later(BATCH_SYNC_MS / 1000, self._batch_sync)

    def _batch_sync(self) -> None:
        self._batch_timer = None
        if self.storage is not None and self.storage.dirty:
            self.storage.sync()

    def _arm_timer(self) -> None:
        deadline = self.core.next_deadline()
        if self._timer is not None:
            if self._timer_at == deadline:
                return
            self._timer.cancel()
        self._timer_at = deadline
        delay = max(0.0, (deadline - now_ms()) / 1000.0)
        self._timer = self._loop.call_later(delay, self._on_timer)

    def _on_timer(self) -> None:
        self._timer = None
        self.core.tick(now_ms())
        self._flush()
