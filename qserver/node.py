"""The node's lifecycle: recover from storage, choose the engine, bind the
client port, serve, and shut down in order.

Fail-stop: the node installs an exception handler on its event loop. An
exception that escapes a callback (a timer, a flush, a peer message's step,
a client read) is our bug or a broken invariant: `Node.fatal` logs one
CRITICAL line naming what broke and where, and stops the node at once (the
`qserver` command exits with status 1 without draining anything: records
already written stay in the files, nothing more is answered, and a restart
recovers from the log).
"""

from __future__ import annotations

import asyncio
import ctypes
import gc
import logging
import time
import traceback
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from . import compiled
from .auth import Guard
from .config import Config
from .config import Engine as ConfigEngine
from .engines import Engine, LeaderInfo, LocalEngine
from .server import ClientTcpProtocol, ClientUdpProtocol
from .service import Service
from .state.entries import Record
from .state.log import Log
from .state.store import Store
from .stats import RequestStats
from .tls import server_context

if TYPE_CHECKING:
    from .http_server import HttpServer
    from .storage import DiskStorage

__all__ = ["Node"]

log = logging.getLogger(__name__)

# How long an orderly shutdown waits for in-flight answers before closing.
SHUTDOWN_GRACE_S = 5.0
# A master stopped in order (SIGTERM, `stop()`) first hands its role to its
# most up-to-date slave, as drain (108) does, so that the cluster does not
# wait an election timeout for a new master: for at most this long (a
# transfer's bounds are an election timeout to catch up and one to win).
HAND_OVER_ON_STOP_S = 3.0

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
# Recovery runs under the same thresholds (Node._recover): replaying a log
# of 1,000,000 produces into a node alone took 10.3 s under the default
# ones and 6.2 s so.
GC_THRESHOLDS = (100_000, 2**31 - 1, 2**31 - 1)
GC_FULL_INTERVAL_S = 300.0

# Memory freed after a burst of writes (a pipelined fill's buffers, what a
# fast stream of pushes and answers held) stays in the C heap, counted in
# the node's RSS, until malloc gives it back. Once the log has not moved for
# one check after it did, the node asks glibc to (malloc_trim): measured on
# a three-node cluster's master after a fill of 1,000,000 messages
# (bench/memory_bench.py), 454 -> 422 MB, the slaves 2-5 MB; the call takes
# a few ms (3.7 for a 400 MB heap), on a quiet node. None where the C
# library has no malloc_trim.
TRIM_CHECK_S = 1.0


def _malloc_trim() -> Callable[[int], int] | None:
    try:
        return ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return None


MALLOC_TRIM = _malloc_trim()


class Node:
    """One qserver node: its state, its engine and its client servers."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self.store = Store(queue_size=config.queue_size, virtual_queues=config.virtual_queues,
                           queue_defaults=config.queue_defaults)
        self.log = Log()
        self.storage: DiskStorage | None = None
        self.engine: Engine
        vote = (0, 0)
        # (trans_id, vote_id) of the newest snapshot when the log was applied
        # as it was read back (a node alone; see _recover); None otherwise.
        self._snapshot_at: tuple[int, int] | None = None
        if config.storage_dir and config.engine is not ConfigEngine.RAFT:
            vote = self._recover(config, config.storage_dir)
        if config.engine is ConfigEngine.RAFT:
            # pysyncobj keeps its own journal and snapshot in the data
            # directory and recovers from them itself (engines/raft/driver.py).
            from .engines.raft.driver import RaftEngine

            self.engine = RaftEngine(config=config, store=self.store)
        elif len(config.peers) > 1 or self.storage is not None:
            from .engines.native.driver import ClusterEngine

            self.engine = ClusterEngine(config=config, store=self.store, log_=self.log,
                                        storage=self.storage, vote=vote,
                                        snapshot=self._snapshot_at)
        else:
            me = LeaderInfo(node_id=config.node_id, host=config.client_host, port=config.port)
            # Receipts' epoch: the start time in ms (see LocalEngine).
            self.engine = LocalEngine(store=self.store, log=self.log, me=me,
                                      log_size=config.log_size,
                                      epoch=time.time_ns() // 1_000_000)
        self.service = Service(config=config, store=self.store, engine=self.engine)
        # <security>: the client tokens the protocols check every request
        # against (server.py); None: the port is open, as queue_server's.
        self.guard = Guard(config.client_tokens) if config.auth_required else None
        handle = self.service.handle
        self.engine.handle_forwarded = lambda obj, t, respond, session: handle(
            obj, t, respond, forwarded=True, session=session)
        # What `handle` tries first for a forwarded request, without the
        # handler's and the answer's closures (the master's side of a relay).
        self.engine.answer_forwarded_now = self.service.answer_now
        self.engine.on_fatal = self._engine_failed
        self.engine.on_role_change = self.service.role_changed
        self.engine.on_answered = self._flush_connections
        self.service.schedule = self._schedule_tick
        # The service's timer (long polls, leases): one, at its earliest deadline.
        self._tick_timer: asyncio.TimerHandle | None = None
        self._tick_at = 0  # unix ms it fires at
        self.exit_status = 0  # what `qserver run` exits with after serve()
        # Set by the `qserver` command: ends the process at once with the
        # status given. Without it (a node inside a test or another
        # program), a fatal error stops the node without draining.
        self.halt: Callable[[int], None] | None = None
        self.failed = False  # a fatal error happened: nothing more is answered
        # The loop's exception handler before start(), put back at shutdown.
        self._previous_handler: Callable[[asyncio.AbstractEventLoop, dict[str, Any]],
                                         object] | None = None
        self.connections: set[ClientTcpProtocol] = set()
        # Connections with answers to write at the end of this loop turn
        # (answered outside their own read: replicated writes, relayed
        # answers), flushed by one callback for all of them.
        self._to_flush: list[ClientTcpProtocol] = []
        self._tcp: asyncio.base_events.Server | None = None
        self._udp: asyncio.DatagramTransport | None = None
        self._stopped = asyncio.Event()
        # Set during shutdown while connections owe answers: set once none
        # owes any (connection_idle, which the protocols call only while
        # this is not None); None otherwise.
        self.drained: asyncio.Event | None = None
        self._gc_timer: asyncio.TimerHandle | None = None
        self._trim_timer: asyncio.TimerHandle | None = None
        self._trim_seen = -1  # the log's last trans_id at the previous check
        self._trim_owed = False  # it moved since the last trim
        # The client answers and their latency, by action and code: the
        # client protocols count, the metrics read (stats.py, metrics.py).
        self.request_stats = RequestStats()
        # <http>: metrics and probes (http_server.py); None without it.
        self.http: HttpServer | None = None

    def _recover(self, config: Config, directory: str) -> tuple[int, int]:
        """Open the data directory and load the newest valid snapshot and the
        log after it. Raises StorageError (file and offset) on corruption
        before the log's tail. Returns the persisted (vote_id, voted_for).

        A node alone applies the log's records to its store as they are
        read (each is committed: it is the only member), so that the
        restart never holds the log it replays; its in-memory log then
        starts after the last (`_snapshot_at` keeps where its snapshot is).
        A cluster node keeps them in its log: a new master may cut them."""
        from .storage import DiskStorage

        self.storage = storage = DiskStorage.open(directory, config.fsync)
        alone = all(p.node_id == config.node_id for p in config.peers)
        store = self.store
        applied = 0

        def replay(snapshot: tuple[int, int, Any] | None) -> Callable[[list[Record]], None]:
            if snapshot is not None:
                store.load_wire(snapshot[2])

            def apply(records: list[Record]) -> None:
                nonlocal applied
                for record in records:
                    store.apply(record.entry)
                applied += len(records)
            return apply

        thresholds = gc.get_threshold()
        gc.set_threshold(*GC_THRESHOLDS)  # (the default ones rescan the growing store)
        try:
            recovered = storage.recover(sink_factory=store.snapshot_loader,
                                        replay=replay if alone else None)
        except BaseException:
            storage.abandon()
            raise
        finally:
            gc.set_threshold(*thresholds)
        for report in recovered.reports:
            log.warning("recovery: %s", report)
        if recovered.snapshot is not None:
            trans_id, vote_id, state = recovered.snapshot
            if not alone:  # (replay loaded it)
                store.load_wire(state)
            self.log = Log(base_trans_id=trans_id, base_vote_id=vote_id)
        if recovered.applied_to is not None:
            self._snapshot_at = (self.log.base_trans_id, self.log.base_vote_id)
            self.log = Log(base_trans_id=recovered.applied_to[0],
                           base_vote_id=recovered.applied_to[1])
        for record in recovered.records:
            self.log.append(record)
        log.info("recovered %s: snapshot at %d, %d log records after it (%d applied as read), "
                 "vote %s", config.storage_dir,
                 self.log.base_trans_id if self._snapshot_at is None else self._snapshot_at[0],
                 applied + len(self.log), applied, recovered.vote)
        return recovered.vote

    @property
    def address(self) -> tuple[str, int]:
        """The bound client address (the real port when configured as 0)."""
        assert self._tcp is not None and self._tcp.sockets
        host, port = self._tcp.sockets[0].getsockname()[:2]
        return host, port

    async def start(self) -> None:
        """Bind the client port (TCP, with TLS if configured, and UDP unless
        TLS turned it off). Raises OSError if it is taken, ConfigError if a
        TLS file is bad (tls.server_context)."""
        loop = asyncio.get_running_loop()
        cfg = self.config
        ssl_context = server_context(cfg)  # before binding anything: it may refuse
        self._previous_handler = loop.get_exception_handler()
        loop.set_exception_handler(self._on_loop_exception)
        self._tcp = await loop.create_server(lambda: ClientTcpProtocol(self), cfg.host, cfg.port,
                                             reuse_address=True, backlog=1024, ssl=ssl_context)
        host, port = self.address
        # UDP is off when TLS is on (Config.udp), unless <tls udp="1">: a
        # datagram would carry in the clear what TLS protects on TCP (tokens
        # and messages), and the standard library has no DTLS.
        if cfg.udp:
            try:
                self._udp, _ = await loop.create_datagram_endpoint(
                    lambda: ClientUdpProtocol(self), local_addr=(host, port))
            except OSError:
                self._tcp.close()
                raise
        if cfg.http_port is not None:
            try:
                await self._start_http(cfg.http_host, cfg.http_port)
            except OSError:
                self._tcp.close()
                if self._udp is not None:
                    self._udp.close()
                raise
        gc.set_threshold(*GC_THRESHOLDS)
        gc.freeze()  # what start-up allocated lives as long as the process
        try:
            await self.engine.start()
        except OSError:
            self._tcp.close()
            if self._udp is not None:
                self._udp.close()
            if self.http is not None:
                self.http.close()
            raise
        # Once started: a start that failed leaves no timer behind.
        self._gc_timer = loop.call_later(GC_FULL_INTERVAL_S, self._full_gc)
        if MALLOC_TRIM is not None:
            self._trim_timer = loop.call_later(TRIM_CHECK_S, self._trim_once_quiet)
        protocols = ("tls" if ssl_context is not None else "tcp") + ("+udp" if self._udp else "")
        if self.guard is not None:
            protocols += f", {len(cfg.client_tokens)} client token(s)"
        log.info("qserver node %d serving on %s:%d (%s), %s", cfg.node_id, host, port, protocols,
                 f"cluster of {len(cfg.peers)}, mode {cfg.mode.value}" if len(cfg.peers) > 1
                 else "single node")
        # what runs the hot path: compiled, or Python and why (qserver/compiled.py)
        log.log(logging.WARNING if compiled.stale() else logging.INFO, "node %d: hot path %s",
                cfg.node_id, compiled.status())

    async def _start_http(self, host: str, port: int) -> None:
        """Bind the HTTP port: metrics and probes. Raises OSError."""
        # Imported here: prometheus_client is loaded only by nodes with <http>.
        from .http_server import HttpServer
        from .metrics import NodeMetrics

        metrics = NodeMetrics(self)
        self.http = HttpServer(metrics=metrics.render, health=self.service.health)
        await self.http.start(host, port)
        bound_host, bound_port = self.http.address
        log.info("qserver node %d: http on %s:%d (/metrics, /healthz, /readyz)",
                 self.config.node_id, bound_host, bound_port)

    @property
    def http_address(self) -> tuple[str, int] | None:
        """The bound HTTP address (the real port when configured as 0);
        None without <http>."""
        return self.http.address if self.http is not None else None

    def _schedule_tick(self, at_ms: int) -> None:
        """Call the service's `tick` at `at_ms` (unix ms), unless the timer
        armed already fires earlier."""
        timer = self._tick_timer
        if timer is not None:
            if self._tick_at <= at_ms:
                return
            timer.cancel()
        self._tick_at = at_ms
        delay_s = max(0.0, at_ms / 1000 - time.time())
        self._tick_timer = asyncio.get_running_loop().call_later(delay_s, self._tick)

    def _tick(self) -> None:
        self._tick_timer = None
        if not self.failed:
            self.service.tick(time.time_ns() // 1_000_000)

    def _full_gc(self) -> None:
        gc.collect()
        self._gc_timer = asyncio.get_running_loop().call_later(GC_FULL_INTERVAL_S, self._full_gc)

    def _trim_once_quiet(self) -> None:
        """Every TRIM_CHECK_S: give the C heap's free memory back to the
        system once the log stops moving after it moved (see TRIM_CHECK_S)."""
        last = self.engine.status().trans_id
        if last != self._trim_seen:
            self._trim_seen = last
            self._trim_owed = True
        elif self._trim_owed and MALLOC_TRIM is not None:
            self._trim_owed = False
            MALLOC_TRIM(0)
        self._trim_timer = asyncio.get_running_loop().call_later(
            TRIM_CHECK_S, self._trim_once_quiet)

    async def serve(self) -> None:
        """Run until `stop()`; then shut down in order."""
        await self._stopped.wait()
        await self.shutdown()

    def stop(self) -> None:
        self._stopped.set()

    def flush_at_turn_end(self, connection: ClientTcpProtocol) -> None:
        """Write `connection`'s ready answers at the end of this loop turn,
        with those of every other connection answered in it: one callback
        a turn, not one per connection (a relayed batch or a commit answers
        many clients at once)."""
        to_flush = self._to_flush
        if not to_flush:
            asyncio.get_running_loop().call_soon(self._flush_connections)
        to_flush.append(connection)

    def _flush_connections(self) -> None:
        to_flush = self._to_flush
        self._to_flush = []
        for connection in to_flush:
            connection.deferred_flush()

    def connection_idle(self) -> None:
        """A connection owes no answers any more (or closed): during
        shutdown, the drain ends once every connection is idle."""
        drained = self.drained
        if drained is not None and all(c.idle for c in self.connections):
            drained.set()

    # -- fail-stop -------------------------------------------------------------

    def _engine_failed(self, exc: BaseException) -> None:
        """The engine cannot go on (a write or fsync failed)."""
        self.fatal(exc, "the storage")

    def _on_loop_exception(self, loop: asyncio.AbstractEventLoop, context: dict) -> None:
        """The event loop's exception handler: an exception that escaped a
        callback (timer, flush, a peer's message, a client's read) means
        our state may be broken: stop at once."""
        exc = context.get("exception")
        if exc is None:  # a warning (e.g. a task destroyed while pending)
            loop.default_exception_handler(context)
            return
        if (isinstance(exc, OSError) and "socket" in context and "handle" not in context
                and "protocol" not in context):
            # accept() out of descriptors or memory: the OS's condition, not
            # our bug; the loop pauses accepting and tries again.
            log.error("node %d: %s: %s", self.config.node_id, context.get("message"), exc)
            return
        self.fatal(exc, _where(context))

    def fatal(self, exc: BaseException, where: str) -> None:
        """Stop at once after our own fault (a broken invariant, a bug, a
        failed write): one CRITICAL line names it, the traceback precedes
        it at ERROR. With `halt` set (the `qserver` command) the process
        ends here with status 1: nothing drains, nothing more is sent or
        answered, and what the storage wrote stays in its files (a restart
        recovers from them, as after kill -9). Otherwise the node aborts
        every client connection and stops without draining."""
        if self.failed:
            return
        self.failed = True
        self.exit_status = 1
        origin = ""
        frames = traceback.extract_tb(exc.__traceback__) if exc.__traceback__ else None
        if frames:
            last = frames[-1]
            origin = f", raised at {_short_path(last.filename)}:{last.lineno} in {last.name}"
            log.error("node %d: traceback of the fatal error below", self.config.node_id,
                      exc_info=exc)
        what = " ".join(f"{type(exc).__name__}: {exc}".split())  # one line
        log.critical("node %d: fatal: %s; in %s%s; stopping now (exit status 1)",
                     self.config.node_id, what, where, origin)
        if self.halt is not None:
            self.halt(1)
            return
        self.engine.halt()
        for c in list(self.connections):
            if c.transport is not None:
                c.transport.abort()
        self.stop()

    async def shutdown(self) -> None:
        """Stop accepting, finish in-flight answers, close every connection
        (after a fatal error: abort them, without waiting). A master first
        hands its role over (`_hand_over`)."""
        await self._hand_over()
        if self._gc_timer is not None:
            self._gc_timer.cancel()
        if self._trim_timer is not None:
            self._trim_timer.cancel()
        if self._tick_timer is not None:
            self._tick_timer.cancel()
        if self.http is not None:
            self.http.close()  # probes see the node go at once
        if not self.failed:
            self.service.release_parked()  # they owe answers: empty ones, now
        if self._tcp is not None:
            self._tcp.close()
        if self._udp is not None:
            self._udp.close()
        loop = asyncio.get_running_loop()
        if not self.failed and any(not c.idle for c in self.connections):
            self.drained = asyncio.Event()
            try:
                await asyncio.wait_for(self.drained.wait(), SHUTDOWN_GRACE_S)
            except TimeoutError:
                log.warning("node %d: answers still owed after %g s; closing anyway",
                            self.config.node_id, SHUTDOWN_GRACE_S)
            self.drained = None
        for c in list(self.connections):
            if c.transport is not None:
                if self.failed:
                    c.transport.abort()
                else:
                    c.transport.close()
        await self.engine.close()
        if self._tcp is not None:
            await self._tcp.wait_closed()
        if self.http is not None:
            await self.http.wait_closed()
        loop.set_exception_handler(self._previous_handler)
        log.info("qserver node %d stopped", self.config.node_id)

    async def _hand_over(self) -> None:
        """A cluster's master that stops in order drains first: its role
        goes to its most up-to-date slave (leader transfer), new client
        requests are redirected meanwhile; what it owes is answered after,
        as ever. Gives up after HAND_OVER_ON_STOP_S: the others then elect
        a master once their election timeout runs out, as after a crash."""
        if self.failed or len(self.config.peers) <= 1 or not self.engine.is_master:
            return
        node_id = self.config.node_id
        answer: asyncio.Future[dict] = asyncio.get_running_loop().create_future()

        def respond(response: dict) -> None:
            if not answer.done():
                answer.set_result(response)

        self.service.handle({"action": 108}, time.time_ns() // 1_000_000, respond)
        try:
            response = await asyncio.wait_for(answer, HAND_OVER_ON_STOP_S)
        except TimeoutError:
            log.warning("node %d: the master role was not handed over within %g s; "
                        "stopping anyway", node_id, HAND_OVER_ON_STOP_S)
            return
        if response.get("code") == 0:
            log.info("node %d: handed the master role to node %s before stopping",
                     node_id, response.get("leader_node_id"))
        else:
            log.warning("node %d: could not hand the master role over before stopping: %s",
                        node_id, response.get("reason"))


def _where(context: dict) -> str:
    """Where an exception the event loop caught came from, in a few words."""
    handle = context.get("handle")
    if handle is not None:
        callback = getattr(handle, "_callback", None)  # asyncio's handles
        name = getattr(callback, "__qualname__", None)
        if name is None:  # uvloop's: "<TimerHandle Class.method>"
            name = repr(handle).strip("<>").split()[-1]
        kind = "timer" if "Timer" in type(handle).__name__ else "callback"
        return f"{kind} {name}"
    protocol = context.get("protocol")
    if protocol is not None:
        return f"{type(protocol).__name__} (a connection's callback)"
    return str(context.get("message") or "an event loop callback")


def _short_path(path: str) -> str:
    """A source path from the package (or tests) down, not the whole path."""
    for marker in ("/qserver/", "/tests/", "/site-packages/"):
        at = path.rfind(marker)
        if at >= 0:
            return path[at + 1:]
    return path
