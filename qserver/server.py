"""The asyncio adapters: TCP and UDP on the client port, and the node's
lifecycle (start, serve, orderly shutdown).

These classes are mechanical, as the house style asks: feed bytes to the
codec, hand each decoded request to the service with the current time, and
write the encoded answers back. One event loop owns the node; nothing else
mutates it.

TCP answers pipelined requests in order, even when a later request is
answered before an earlier one (quorum mode): each request takes a slot in
the connection's queue of answers, and only the filled head of that queue is
written. All answers that a single read produces go out in one write.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import time
from collections import deque

from .config import Config
from .config import Engine as ConfigEngine
from .errors import BadRequest, ProtocolError
from .log import Log
from .protocol import (
    MAX_UDP_PAYLOAD,
    StreamDecoder,
    decode_datagram,
    encode_response,
    error_response,
)
from .replication import LeaderInfo, LocalEngine
from .service import Service
from .store import Store

__all__ = ["Node", "ClientTcpProtocol", "ClientUdpProtocol"]

log = logging.getLogger("qserver.server")

# A client may pipeline this many requests before we stop reading from it
# until answers drain: bounds the memory one connection can pin.
MAX_PIPELINE = 4096

# How long an orderly shutdown waits for in-flight answers before closing.
SHUTDOWN_GRACE_S = 5.0

# Garbage collection. Stored messages are untracked tuples, but the log keeps
# up to log_size records, and CPython's automatic full collections rescan
# them every time the long-lived objects grow by a quarter: measured, that
# cost more per produce than the produce itself, with pauses of 100+ ms
# (bench/). So only the youngest generation is collected automatically, once
# per 100,000 allocations (it finds the short-lived cycles; every write
# allocates a few tracked objects, the log's records among them, and each is
# scanned there once); the older generations only by a full collection on a
# timer (thresholds no count reaches). Against (10,000, 10) this took a UDP
# produce from about 5.5 to 3.7 us of CPU in bench/hotpath.py --prefill.
GC_THRESHOLDS = (100_000, 2**31 - 1, 2**31 - 1)
GC_FULL_INTERVAL_S = 300.0


_time_ns = time.time_ns


def now_ms() -> int:
    return int(time.time() * 1000)


class ClientTcpProtocol(asyncio.Protocol):
    """One client connection: a stream of JSON requests, answered in order."""

    def __init__(self, node: "Node") -> None:
        self.node = node
        self.transport: asyncio.Transport | None = None
        self.decoder = StreamDecoder(node.config.max_request_size)
        self.slots: deque[list] = deque()  # [encoded answer or None], in request order
        self.batching = False  # inside data_received: flush once at its end
        self.closing = False  # close once every slot is written
        self.paused = False  # reading paused (back-pressure)
        self.flush_pending = False  # a flush is scheduled for this loop turn
        self._loop: asyncio.AbstractEventLoop | None = None
        # Bound once: data_received runs per read, and these never change.
        self._feed = self.decoder.feed
        self._answer_now = node.service.answer_now
        self._handle = node.service.handle_general

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self._loop = asyncio.get_running_loop()
        self.node.connections.add(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self.node.connections.discard(self)
        self.transport = None
        self.slots.clear()

    def data_received(self, data: bytes) -> None:
        items = self._feed(data)
        if not items:
            return
        t = _time_ns() // 1_000_000  # now_ms() without the call (runs per read)
        if len(items) == 1 and not self.slots:
            # The common case: one request, nothing owed before it, answered
            # at once. Written straight away, no slot.
            item = items[0]
            if type(item) is dict:
                response = self._answer_now(item, t)
                if response is not None:
                    if self.transport is not None:
                        self.transport.write(encode_response(response))
                    return
        self._general(items, t)

    def _general(self, items: list, t: int) -> None:
        """Every item gets a slot in request order; answers go out in order
        once this read's items are all handled."""
        answer_now = self._answer_now
        handle = self._handle
        slots = self.slots
        self.batching = True
        for item in items:
            slot = [None]
            slots.append(slot)
            kind = type(item)
            if kind is dict:
                response = answer_now(item, t)
                if response is not None:
                    slot[0] = encode_response(response)
                else:
                    handle(item, t, self._responder(slot))
            elif kind is ProtocolError:
                slot[0] = encode_response(error_response(item.reason))
                self.closing = True
                break
            elif kind is BadRequest:
                slot[0] = encode_response(error_response(item.reason))
            else:  # any other JSON value: the service answers it (an error)
                handle(item, t, self._responder(slot))
        self.batching = False
        self._flush()
        if len(slots) > MAX_PIPELINE and not self.paused and self.transport:
            self.paused = True
            self.transport.pause_reading()

    def _responder(self, slot: list):
        def respond(response: dict) -> None:
            slot[0] = encode_response(response)
            if not self.batching and not self.flush_pending:
                # Answers of replicated writes arrive together (one commit
                # answers many): one write for all of them, at the end of
                # this turn, instead of one write(2) each.
                self.flush_pending = True
                self._loop.call_soon(self._deferred_flush)
        return respond

    def _deferred_flush(self) -> None:
        self.flush_pending = False
        self._flush()

    def _flush(self) -> None:
        transport = self.transport
        if transport is None:
            return
        slots = self.slots
        if len(slots) == 1:
            if slots[0][0] is not None:
                transport.write(slots.popleft()[0])
        else:
            out = []
            while slots and slots[0][0] is not None:
                out.append(slots.popleft()[0])
            if out:
                transport.write(b"".join(out))
        if self.closing and not slots:
            transport.close()
        elif self.paused and len(slots) <= MAX_PIPELINE // 2:
            self.paused = False
            transport.resume_reading()

    def pause_writing(self) -> None:
        # The client is not reading its answers: stop reading its requests.
        if self.transport and not self.paused:
            self.paused = True
            self.transport.pause_reading()

    def resume_writing(self) -> None:
        if self.transport and self.paused and len(self.slots) <= MAX_PIPELINE // 2:
            self.paused = False
            self.transport.resume_reading()

    @property
    def idle(self) -> bool:
        return not self.slots


class ClientUdpProtocol(asyncio.DatagramProtocol):
    """One JSON request per datagram, one answer datagram to the sender."""

    def __init__(self, node: "Node") -> None:
        self.node = node
        self.transport: asyncio.DatagramTransport | None = None
        self.max_size = node.config.max_udp_request_size
        # Bound once: datagram_received runs per request.
        self._answer_now = node.service.answer_now
        self._handle = node.service.handle_general

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def datagram_received(self, data: bytes, addr) -> None:
        obj = decode_datagram(data, self.max_size)
        if type(obj) is BadRequest:
            self._send(error_response(obj.reason), addr)
            return
        t = _time_ns() // 1_000_000  # now_ms() without the call (runs per request)
        response = self._answer_now(obj, t)
        if response is None:
            self._handle(obj, t, lambda response: self._send(response, addr))
            return
        # _send, inline for the common case: an answer that fits.
        payload = encode_response(response)
        transport = self.transport
        if len(payload) <= MAX_UDP_PAYLOAD and transport is not None:
            transport.sendto(payload, addr)
        else:
            self._send(response, addr)

    def _send(self, response: dict, addr) -> None:
        if self.transport is None:
            return
        payload = encode_response(response)
        if len(payload) > MAX_UDP_PAYLOAD:
            # The write happened; only its answer cannot travel by UDP.
            response.pop("data", None)
            response.update(code=-1, reason="response too large for udp; use tcp")
            payload = encode_response(response)
        self.transport.sendto(payload, addr)

    def error_received(self, exc: Exception) -> None:
        log.debug("udp error: %s", exc)


class Node:
    """One qserver node: its state, its engine and its client servers."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self.store = Store(queue_size=config.queue_size, virtual_queues=config.virtual_queues)
        self.log = Log()
        self.storage = None
        vote = (0, 0)
        if config.storage_dir and config.engine is not ConfigEngine.RAFT:
            vote = self._recover(config)
        if config.engine is ConfigEngine.RAFT:
            # pysyncobj keeps its own journal and snapshot in the data
            # directory and recovers from them itself (raft_engine).
            from .raft_engine import RaftEngine

            self.engine = RaftEngine(config=config, store=self.store)
        elif len(config.peers) > 1 or self.storage is not None:
            from .cluster import ClusterEngine

            self.engine = ClusterEngine(config=config, store=self.store, log_=self.log,
                                        storage=self.storage, vote=vote)
        else:
            me = LeaderInfo(node_id=config.node_id, host=config.host, port=config.port)
            self.engine = LocalEngine(store=self.store, log=self.log, me=me,
                                      log_size=config.log_size)
        self.service = Service(config=config, store=self.store, engine=self.engine)
        if hasattr(self.engine, "handle_forwarded"):
            handle = self.service.handle
            self.engine.handle_forwarded = lambda obj, t, respond: handle(obj, t, respond,
                                                                          forwarded=True)
        if hasattr(self.engine, "on_fatal"):
            self.engine.on_fatal = self._fatal
        self.exit_status = 0  # what `qserver run` exits with after serve()
        self.connections: set[ClientTcpProtocol] = set()
        self._tcp: asyncio.base_events.Server | None = None
        self._udp: asyncio.DatagramTransport | None = None
        self._stopped = asyncio.Event()
        self._gc_timer: asyncio.TimerHandle | None = None

    def _recover(self, config: Config) -> tuple[int, int]:
        """Open the data directory and load the newest valid snapshot and the
        log after it. Raises StorageError (file and offset) on corruption
        before the log's tail. Returns the persisted (vote_id, voted_for)."""
        from .storage import DiskStorage

        self.storage = DiskStorage.open(config.storage_dir, config.fsync)
        try:
            recovered = self.storage.recover(sink_factory=self.store.snapshot_loader)
        except BaseException:
            self.storage.abandon()
            raise
        for report in recovered.reports:
            log.warning("recovery: %s", report)
        if recovered.snapshot is not None:
            trans_id, vote_id, state = recovered.snapshot
            self.store.load_wire(state)
            self.log = Log(base_trans_id=trans_id, base_vote_id=vote_id)
        for record in recovered.records:
            self.log.append(record)
        log.info("recovered %s: snapshot at %d, %d log records after it, vote %s",
                 config.storage_dir, self.log.base_trans_id, len(self.log), recovered.vote)
        return recovered.vote

    @property
    def address(self) -> tuple[str, int]:
        """The bound client address (the real port when configured as 0)."""
        assert self._tcp is not None and self._tcp.sockets
        host, port = self._tcp.sockets[0].getsockname()[:2]
        return host, port

    async def start(self) -> None:
        """Bind the client port (TCP and UDP). Raises OSError if it is taken."""
        loop = asyncio.get_running_loop()
        cfg = self.config
        self._tcp = await loop.create_server(lambda: ClientTcpProtocol(self), cfg.host, cfg.port,
                                             reuse_address=True, backlog=1024)
        host, port = self.address
        try:
            self._udp, _ = await loop.create_datagram_endpoint(lambda: ClientUdpProtocol(self),
                                                               local_addr=(host, port))
        except OSError:
            self._tcp.close()
            raise
        gc.set_threshold(*GC_THRESHOLDS)
        gc.freeze()  # what start-up allocated lives as long as the process
        self._gc_timer = loop.call_later(GC_FULL_INTERVAL_S, self._full_gc)
        if hasattr(self.engine, "start"):
            try:
                await self.engine.start()
            except OSError:
                self._tcp.close()
                self._udp.close()
                raise
        log.info("qserver node %d serving on %s:%d (tcp+udp), %s", cfg.node_id, host, port,
                 f"cluster of {len(cfg.peers)}, mode {cfg.mode.value}" if len(cfg.peers) > 1
                 else "single node")

    def _full_gc(self) -> None:
        gc.collect()
        self._gc_timer = asyncio.get_running_loop().call_later(GC_FULL_INTERVAL_S, self._full_gc)

    async def serve(self) -> None:
        """Run until `stop()`; then shut down in order."""
        await self._stopped.wait()
        await self.shutdown()

    def stop(self) -> None:
        self._stopped.set()

    def _fatal(self, exc: BaseException) -> None:
        """The engine cannot go on (a failed write or fsync): stop in order
        and exit 1; a restart recovers from what is on disk."""
        self.exit_status = 1
        self.stop()

    async def shutdown(self) -> None:
        """Stop accepting, finish in-flight answers, close every connection."""
        if self._gc_timer is not None:
            self._gc_timer.cancel()
        if self._tcp is not None:
            self._tcp.close()
        if self._udp is not None:
            self._udp.close()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + SHUTDOWN_GRACE_S
        while any(not c.idle for c in self.connections) and loop.time() < deadline:
            await asyncio.sleep(0.01)
        for c in list(self.connections):
            if c.transport is not None:
                c.transport.close()
        if hasattr(self.engine, "close"):
            await self.engine.close()
        if self._tcp is not None:
            await self._tcp.wait_closed()
        log.info("qserver node %d stopped", self.config.node_id)
