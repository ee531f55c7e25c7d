"""The node-to-node link layer: authenticated, framed msgpack links between
the nodes of a cluster. An asyncio adapter; it holds no replication logic.

Theory of operation
-------------------
Every node listens on its internal port and also dials every other node, so
a pair of live nodes normally holds two TCP connections, one dialed by each
side. Either one is a usable link: messages are delivered from every
authenticated connection, and each node sends over one of them.

Framing. Every message, handshake included, is a frame: a 4-byte big-endian
body length, then a msgpack body. A frame over the limit (`MAX_FRAME_BYTES`;
`MAX_HANDSHAKE_FRAME_BYTES` before authentication) or a body that does not
decode drops the connection at once: nothing the peer sent after it is
delivered.

Handshake (three frames; every field is checked where it enters):

    dialer   -> acceptor  ["qserver-peer/1", "hello",   dialer_id,   dialer_nonce]
    acceptor -> dialer    ["qserver-peer/1", "welcome", acceptor_id, acceptor_nonce, acceptor_proof]
    dialer   -> acceptor  ["qserver-peer/1", "auth",    dialer_proof]

    proof = HMAC-SHA256(secret, label || dialer_nonce || acceptor_nonce
                                || dialer_id || acceptor_id)

with a different label for each direction (so that one side's proof can
never be replayed as the other's) and fresh 16-byte nonces from both sides
(so that no proof can be replayed on another connection). The acceptor
drops a hello from a node id that is not in its peers map; the dialer drops
a welcome from any node but the one it dialed. Each side checks the other's
proof with `hmac.compare_digest` before it delivers any application frame.
Without a secret configured the proofs are nil: node ids are still exchanged
and checked, but anyone who can reach the port can claim to be a peer. A
node with a secret and a node without one refuse each other. A connection
that has not finished the handshake within the timeout is dropped. Every
drop is logged at warning level.

The dialer counts its link as up once it has sent its proof: it has
verified the acceptor, and anything it writes next travels behind the proof
on the same connection, so the acceptor delivers it only after verifying
the proof. The acceptor counts its link as up once it has verified the
proof, by which time the dialer already accepts application frames. Hence a
message sent from inside `on_link(peer, True)`, on either side, is
delivered unless that connection breaks.

Messages are authenticated at the handshake only (no per-message MAC), and
NOT encrypted: whoever sits on the network path can read them, and inject
into or take over an established connection. Use a private network between
the nodes (or a tunnel) if that matters.
A weak secret can be guessed offline from a recorded handshake: use a long
random one.

Sending. Each peer has one current link, the one `send` writes to. It is the
first link that came up, and it is kept until it goes down; then the
outgoing link is preferred over the incoming one. Keeping the current link
instead of switching whenever a "better" one comes up means that messages
to one peer are never spread over two connections while both are alive, so
they arrive in the order sent. A new authenticated connection from a peer
replaces the older one of the same direction (the peer dials again only
when it lost its previous connection, or restarted). Writes are queued and
handed to the transport once per turn of the event loop, as one write.

What the layer above can rely on:
- Messages from one peer are delivered in the order sent, with no gaps or
  duplicates, for as long as that peer's current link lives. `send`
  returning True means queued, not delivered.
- When a link breaks, whatever was queued on it or in flight is lost, and
  may have been partly delivered (a prefix of it). The peer's messages sent
  afterwards travel on another link, and from a link that has just replaced
  a broken one, ordering relative to the old link is not guaranteed. A link
  can be replaced (the peer dialed again) without on_link(peer, False) in
  between, so loss can happen without a down event: the layer above must
  tolerate loss and repair it (retries, pulls), as the replication protocol
  does anyway.
- on_link(peer, True) and on_link(peer, False) alternate, starting with
  True; neither runs inside `send`. An exception raised by a callback is
  the caller's bug, not the peer's: it goes to the event loop's exception
  handler (a node stops there, see node.Node.fatal; the default handler
  logs it) and does not affect the link.

Dialing. One task per peer dials, waits for the connection to end, and
dials again after a pause that doubles from `BACKOFF_MIN_S` to
`BACKOFF_MAX_S`, with jitter from a `random.Random`, and falls back to the
minimum after a link was up.
"""

from __future__ import annotations

import asyncio
import enum
import hashlib
import hmac
import logging
import random
import secrets
import socket
import ssl
from collections.abc import Callable
from typing import cast

import msgpack

__all__ = [
    "PeerNetwork",
    "MAX_FRAME_BYTES",
    "MAX_HANDSHAKE_FRAME_BYTES",
    "HANDSHAKE_TIMEOUT_S",
    "PROTOCOL",
]

log = logging.getLogger(__name__)

# The largest message body a peer may send. The largest legitimate messages
# are a pull batch (`sync_rate` entries, each up to max_request_size) and a
# snapshot chunk; 64 MiB holds them with room to spare, while a length prefix
# from a broken or hostile peer cannot make us buffer more than this for one
# frame. The replication engine must split anything bigger (snapshots).
MAX_FRAME_BYTES = 64 * 1024 * 1024

# Messages are encoded with one msgpack Packer kept per network (`encode`):
# msgpack.packb makes and frees a Packer, buffer and all, on every call,
# which cost more than packing a push acknowledgement (635 against 154 ns).
# A Packer's buffer grows to the largest message it packed and stays so; one
# that packed more than this is replaced, so that a node does not hold a
# large push's or a pull batch's worth of memory for good.
PACKER_KEEP_BYTES = 1024 * 1024

# Before authentication only the three small handshake frames are legal;
# bounding them keeps a stranger from pinning MAX_FRAME_BYTES of our memory.
MAX_HANDSHAKE_FRAME_BYTES = 4096

# A connection must finish the handshake within this many seconds: a stranger
# that connects and says nothing, or a peer stuck half-way, is dropped. A few
# seconds is far above a handshake's round trips, even on a loaded machine.
HANDSHAKE_TIMEOUT_S = 5.0

# A dial that has not connected by then is abandoned and retried (an address
# that drops SYNs would otherwise hold the dialer for the OS's two minutes).
CONNECT_TIMEOUT_S = 5.0

# Redial pauses: short enough that a restarted peer is back within a few
# heartbeats, long enough that a dead one costs little.
BACKOFF_MIN_S = 0.05
BACKOFF_MAX_S = 2.0

# If a peer stops reading, writes to it pile up in memory. Past this much
# queued data the link is dropped instead (the engine resynchronises the
# peer once it is back); it is a few frames' worth, so a peer that is merely
# slow to read one large snapshot chunk is not dropped.
MAX_SEND_BUFFER_BYTES = 4 * MAX_FRAME_BYTES

# Connections the kernel queues for us before we accept them (more than a
# cluster's nodes dialing at once), and also the most accepted per wake-up.
LISTEN_BACKLOG = 128

# After accept() fails for lack of descriptors or memory, try again after
# this pause rather than spin on a listener that stays readable.
ACCEPT_RETRY_S = 0.1

# How long `close()` lets each connection flush what is queued before it
# aborts the connection.
CLOSE_GRACE_S = 1.0

# Dead-peer detection for connections that end without a FIN or RST (a peer
# host powered off, a partition): TCP keepalive probes an idle connection,
# and TCP_USER_TIMEOUT bounds how long sent data may stay unacknowledged.
KEEPALIVE_IDLE_S = 10
KEEPALIVE_INTERVAL_S = 5
KEEPALIVE_COUNT = 3
USER_TIMEOUT_MS = 30_000

PROTOCOL = "qserver-peer/1"
NONCE_BYTES = 16
_LABEL_ACCEPTOR = b"qserver-peer/1 acceptor proof"
_LABEL_DIALER = b"qserver-peer/1 dialer proof"
_HEADER_BYTES = 4
_NODE_ID_MAX = 2**63 - 1  # node ids go into the proof as 8 signed bytes


class _Role(enum.Enum):
    DIALER = "dialer"  # we connected to the peer
    ACCEPTOR = "acceptor"  # the peer connected to us


class _State(enum.Enum):
    AWAIT_HELLO = "await hello"  # acceptor, before the dialer's hello
    AWAIT_WELCOME = "await welcome"  # dialer, hello sent
    AWAIT_AUTH = "await auth"  # acceptor, welcome sent
    OPEN = "open"  # authenticated: application frames flow both ways
    CLOSED = "closed"  # closing or closed: nothing is read or written any more


def _proof(secret: bytes | None, label: bytes, dialer_id: int, dialer_nonce: bytes,
           acceptor_id: int, acceptor_nonce: bytes) -> bytes | None:
    if secret is None:
        return None
    msg = b"".join((label, dialer_nonce, acceptor_nonce,
                    dialer_id.to_bytes(8, "big", signed=True),
                    acceptor_id.to_bytes(8, "big", signed=True)))
    return hmac.new(secret, msg, hashlib.sha256).digest()


def _decode(body) -> object:
    return msgpack.unpackb(body, raw=False, strict_map_key=False)


def _set_keepalive(sock) -> None:
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        if hasattr(socket, "TCP_KEEPIDLE"):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, KEEPALIVE_IDLE_S)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, KEEPALIVE_INTERVAL_S)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, KEEPALIVE_COUNT)
        if hasattr(socket, "TCP_USER_TIMEOUT"):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, USER_TIMEOUT_MS)
    except (OSError, AttributeError):  # not a TCP socket, or an option the OS lacks
        pass


class _PeerLink(asyncio.Protocol):
    """One TCP connection to another node, from connect to close."""

    def __init__(self, net: PeerNetwork, role: _Role, peer_id: int | None = None) -> None:
        self.net = net
        self.role = role
        # The peer's node id: the dialed one for a dialer; for an acceptor
        # None until a valid hello names it.
        self.peer_id = peer_id
        self.state = _State.AWAIT_WELCOME if role is _Role.DIALER else _State.AWAIT_HELLO
        self.transport: asyncio.Transport | None = None  # None before connect and after close
        self.peername = None
        self.buf = bytearray()  # received bytes of an incomplete frame
        self.pending: list[bytes] = []  # frames (header, body, ...) not yet given to the transport
        self.pending_bytes = 0  # total length of `pending`
        self.flush_handle: asyncio.Handle | None = None  # set iff a flush is scheduled
        self.timer: asyncio.TimerHandle | None = None  # the handshake deadline, until OPEN
        self.nonce = secrets.token_bytes(NONCE_BYTES)
        self.peer_nonce: bytes | None = None  # set once the peer's hello/welcome is checked
        self.registered = False  # in the network's tables (OPEN and not yet detached)
        self.was_open = False  # reached OPEN at some point
        self.overflowed = False  # too much queued: refuses writes, dropped next turn
        # Resolved (with was_open) by connection_lost; never cancelled.
        self.closed: asyncio.Future[bool] = net._loop.create_future()

    # asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # asyncio's Protocol API names a BaseTransport; a TCP connection's is a Transport.
        tcp = cast(asyncio.Transport, transport)
        self.transport = tcp
        self.peername = tcp.get_extra_info("peername")
        self.net._links.add(self)
        if self.net._closing:
            self.state = _State.CLOSED
            tcp.abort()
            return
        sock = tcp.get_extra_info("socket")
        if sock is not None:
            _set_keepalive(sock)
        self.timer = self.net._loop.call_later(self.net._handshake_timeout_s,
                                               self._handshake_timeout)
        if self.role is _Role.DIALER:
            self._write(msgpack.packb([PROTOCOL, "hello", self.net.node_id, self.nonce]))

    def connection_lost(self, exc: Exception | None) -> None:
        was_state = self.state
        self._stop()
        self.transport = None
        self.net._links.discard(self)
        if self.was_open and was_state is not _State.CLOSED and not self.net._closing:
            log.info("node %d: link to node %s (%s, %s) lost: %s", self.net.node_id,
                     self.peer_id, self.role.value, self._where(), exc or "closed by peer")
        elif not self.was_open and was_state is not _State.CLOSED:
            log.info("node %d: %s connection %s closed during the handshake: %s",
                     self.net.node_id, self.role.value, self._where(), exc or "closed by peer")
        if not self.closed.done():
            self.closed.set_result(self.was_open)

    def data_received(self, data: bytes) -> None:
        if self.state is _State.CLOSED:
            return
        # The unparsed tail is replaced, never resized in place: a view of
        # it may outlive the parse (in an exception), and a bytearray with a
        # view cannot be resized. Only a tail after a whole frame is copied.
        buf = self.buf
        if buf:
            buf += data
            with memoryview(buf) as view:
                used = self._feed(view)
            if used and self.state is not _State.CLOSED:
                self.buf = buf[used:]
        else:
            with memoryview(data) as view:
                used = self._feed(view)
            if used < len(data) and self.state is not _State.CLOSED:
                self.buf = bytearray(data[used:])

    def eof_received(self) -> bool | None:
        return None  # close our side too

    # Incoming frames

    def _feed(self, view: memoryview) -> int:
        """Handle every whole frame in `view`; return the bytes consumed."""
        pos = 0
        end_of_data = len(view)
        deliver = self.net._deliver
        while end_of_data - pos >= _HEADER_BYTES:
            size = int.from_bytes(view[pos:pos + _HEADER_BYTES], "big")
            limit = MAX_FRAME_BYTES if self.state is _State.OPEN else MAX_HANDSHAKE_FRAME_BYTES
            if size > limit:
                self._drop(f"frame of {size} bytes over the limit of {limit}")
                return pos
            end = pos + _HEADER_BYTES + size
            if end > end_of_data:
                break
            try:
                obj = _decode(view[pos + _HEADER_BYTES:end])
            except Exception as exc:  # any bad input: msgpack raises several kinds
                self._drop(f"undecodable frame ({type(exc).__name__}: {exc})")
                return pos
            pos = end
            if self.state is _State.OPEN:
                deliver(self.peer_id, obj)  # type: ignore[arg-type]  # OPEN: peer_id is set
            else:
                self._handshake(obj)
            if self.state is _State.CLOSED:  # dropped, or closed by a callback
                break
        return pos

    def _handshake(self, obj: object) -> None:
        net = self.net
        if self.state is _State.AWAIT_HELLO:
            if not (type(obj) is list and len(obj) == 4 and obj[0] == PROTOCOL
                    and obj[1] == "hello"):
                self._drop("not a qserver peer hello")
                return
            _, _, peer_id, nonce = obj
            if type(peer_id) is not int or peer_id not in net.peers:
                self._drop(f"hello from unknown node id {peer_id!r}")
                return
            if type(nonce) is not bytes or len(nonce) != NONCE_BYTES:
                self._drop("bad nonce in hello")
                return
            self.peer_id = peer_id
            self.peer_nonce = nonce
            proof = _proof(net._secret, _LABEL_ACCEPTOR, peer_id, nonce, net.node_id, self.nonce)
            self._write(msgpack.packb([PROTOCOL, "welcome", net.node_id, self.nonce, proof]))
            self.state = _State.AWAIT_AUTH
        elif self.state is _State.AWAIT_WELCOME:
            if not (type(obj) is list and len(obj) == 5 and obj[0] == PROTOCOL
                    and obj[1] == "welcome"):
                self._drop("not a qserver peer welcome")
                return
            _, _, peer_id, nonce, proof = obj
            if type(peer_id) is not int or peer_id != self.peer_id:
                self._drop(f"answered as node id {peer_id!r}, expected node {self.peer_id}")
                return
            if type(nonce) is not bytes or len(nonce) != NONCE_BYTES:
                self._drop("bad nonce in welcome")
                return
            expected = _proof(net._secret, _LABEL_ACCEPTOR, net.node_id, self.nonce,
                              peer_id, nonce)
            if not self._maybe_accept_proof(proof, expected):
                return
            self.peer_nonce = nonce
            mine = _proof(net._secret, _LABEL_DIALER, net.node_id, self.nonce, peer_id, nonce)
            self._write(msgpack.packb([PROTOCOL, "auth", mine]))
            self._open()
        elif self.state is _State.AWAIT_AUTH:
            if not (type(obj) is list and len(obj) == 3 and obj[0] == PROTOCOL
                    and obj[1] == "auth"):
                self._drop("not a qserver peer auth")
                return
            # AWAIT_AUTH follows a valid hello, which set both.
            assert self.peer_id is not None and self.peer_nonce is not None
            expected = _proof(net._secret, _LABEL_DIALER, self.peer_id, self.peer_nonce,
                              net.node_id, self.nonce)
            if self._maybe_accept_proof(obj[2], expected):
                self._open()

    def _maybe_accept_proof(self, got: object, expected: bytes | None) -> bool:
        """Check the peer's proof; drop the connection and return False if bad."""
        if expected is None:
            if got is not None:
                self._drop("peer has a cluster secret and this node has none")
                return False
            return True
        if got is None:
            self._drop("peer has no cluster secret and this node has one")
            return False
        if type(got) is not bytes or not hmac.compare_digest(got, expected):
            self._drop("authentication failed (wrong cluster secret?)")
            return False
        return True

    def _open(self) -> None:
        self.state = _State.OPEN
        self.was_open = True
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        log.info("node %d: link to node %d up (%s, %s)", self.net.node_id, self.peer_id,
                 self.role.value, self._where())
        self.net._register(self)

    def _handshake_timeout(self) -> None:
        self.timer = None
        if self.state is not _State.OPEN and self.state is not _State.CLOSED:
            self._drop(f"handshake not finished within {self.net._handshake_timeout_s:g} s")

    # Outgoing frames

    def write_frame(self, body: bytes) -> bool:
        """Queue one encoded message; False if this connection cannot take it."""
        if self.state is not _State.OPEN or self.overflowed:
            return False
        transport = self.transport
        queued = self.pending_bytes + (transport.get_write_buffer_size() if transport else 0)
        if queued + _HEADER_BYTES + len(body) > MAX_SEND_BUFFER_BYTES:
            # Dropped on the next turn, so that on_link(peer, False) never
            # runs inside the caller's send(); refuse everything until then.
            self.overflowed = True
            self.net._loop.call_soon(
                self._drop, f"peer is not reading: {queued} bytes queued for it")
            return False
        self._write(body)
        return True

    def _write(self, body: bytes) -> None:
        self.pending.append(len(body).to_bytes(_HEADER_BYTES, "big"))
        self.pending.append(body)
        self.pending_bytes += _HEADER_BYTES + len(body)
        if self.flush_handle is None:
            self.flush_handle = self.net._loop.call_soon(self._flush)

    def _flush(self) -> None:
        self.flush_handle = None
        if self.pending and self.transport is not None and self.state is not _State.CLOSED:
            self.transport.writelines(self.pending)
        self.pending = []
        self.pending_bytes = 0

    # Closing

    def _stop(self) -> None:
        """Stop reading and writing and leave the network's tables."""
        self.state = _State.CLOSED
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        if self.flush_handle is not None:
            self.flush_handle.cancel()
            self.flush_handle = None
        self.pending = []
        self.pending_bytes = 0
        self.buf = bytearray()
        self.net._unregister(self)

    def _drop(self, reason: str) -> None:
        """The peer broke the protocol (or must go): warn, discard, abort."""
        if self.state is _State.CLOSED:
            return
        log.warning("node %d: dropping %s connection %s (node %s): %s", self.net.node_id,
                    self.role.value, self._where(),
                    self.peer_id if self.peer_id is not None else "unknown", reason)
        self._stop()
        if self.transport is not None:
            self.transport.abort()

    def close(self) -> None:
        """Orderly close: flush what is queued, then close."""
        if self.state is not _State.CLOSED and self.pending:
            if self.flush_handle is not None:
                self.flush_handle.cancel()
            self._flush()
        self._stop()
        if self.transport is not None:
            self.transport.close()

    def abort(self) -> None:
        self._stop()
        if self.transport is not None:
            self.transport.abort()

    def _where(self) -> str:
        if isinstance(self.peername, tuple) and len(self.peername) >= 2:
            return f"{self.peername[0]}:{self.peername[1]}"
        return str(self.peername)


class PeerNetwork:
    """Authenticated message links from this node to every other node.

    Args:
        node_id: this node's id.
        listen: the internal (host, port) to accept peers on; port 0 binds a
            free port (see `address`).
        peers: the OTHER nodes' ids and internal (host, port) addresses. Only
            these ids are accepted, and each is dialed.
        secret: the shared cluster secret, or None for no authentication
            (node ids are still exchanged). Messages are never encrypted.
        on_message: called as on_message(peer_id, obj) for every message from
            an authenticated peer, in the order that peer sent them on that
            connection. Runs inside the event loop; must not block. It drops
            a malformed message itself; whatever it raises is our bug and
            goes to the event loop's exception handler.
        on_link: called as on_link(peer_id, True) when the first
            authenticated link to a peer comes up, and on_link(peer_id, False)
            when its last one goes down. Not called once `close()` started.
        loop: the event loop; by default the running one at `start()`.
        rng: the source of the redial jitter; by default a fresh Random.
        handshake_timeout_s: drop connections that have not authenticated
            within this many seconds.
        tls: (accepting, dialing) SSL contexts: every link speaks TLS, and
            the secret's handshake runs inside it (qserver.tls.peer_contexts);
            None: plain TCP.

    Raises:
        ValueError: node_id is among the peers, or an id is not an int.
    """

    def __init__(self, *, node_id: int, listen: tuple[str, int],
                 peers: dict[int, tuple[str, int]], secret: str | None,
                 on_message: Callable[[int, object], None],
                 on_link: Callable[[int, bool], None] | None = None,
                 loop: asyncio.AbstractEventLoop | None = None,
                 rng: random.Random | None = None,
                 handshake_timeout_s: float = HANDSHAKE_TIMEOUT_S,
                 tls: tuple[ssl.SSLContext, ssl.SSLContext] | None = None) -> None:
        for nid in (node_id, *peers):
            if type(nid) is not int or not 0 <= nid <= _NODE_ID_MAX:
                raise ValueError(f"node id {nid!r} is not a non-negative 64-bit int")
        if node_id in peers:
            raise ValueError(f"node {node_id} lists itself among its peers")
        self.node_id = node_id
        self.listen = listen
        self.peers = dict(peers)
        self._secret = secret.encode() if secret is not None else None
        self._on_message = on_message
        self._on_link = on_link
        self._loop: asyncio.AbstractEventLoop = loop  # type: ignore[assignment]  # set by start()
        self._rng = rng if rng is not None else random.Random()
        self._handshake_timeout_s = handshake_timeout_s
        self._tls = tls
        self._listener: socket.socket | None = None  # listening, between start and close
        self._accept_retry: asyncio.TimerHandle | None = None  # set while accepting is paused
        self._adopting: set[asyncio.Task] = set()  # accepted sockets becoming transports
        self._dialers: dict[int, asyncio.Task] = {}  # one per peer, between start and close
        self._links: set[_PeerLink] = set()  # every connection with a live transport
        self._out: dict[int, _PeerLink] = {}  # peer -> authenticated connection we dialed
        self._in: dict[int, _PeerLink] = {}  # peer -> authenticated connection it dialed
        # peer -> the link `send` uses; a key iff _out or _in holds that peer.
        self._current: dict[int, _PeerLink] = {}
        self._pack = msgpack.Packer().pack  # see PACKER_KEEP_BYTES
        self._started = False
        self._closing = False  # close() began: no callbacks, no new connections

    # Lifecycle

    @property
    def address(self) -> tuple[str, int]:
        """The bound internal address (the real port when listen's is 0)."""
        if self._listener is None:
            raise RuntimeError("PeerNetwork is not started")
        host, port = self._listener.getsockname()[:2]
        return host, port

    async def start(self) -> None:
        """Bind the internal port and start dialing every peer.

        Raises:
            OSError: the port cannot be bound (taken, or a bad address).
            RuntimeError: started twice.
        """
        if self._started:
            raise RuntimeError("PeerNetwork.start() called twice")
        self._started = True
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
        self._listener = await self._bind(*self.listen)
        self._loop.add_reader(self._listener.fileno(), self._on_acceptable)
        for peer_id, addr in sorted(self.peers.items()):
            self._dialers[peer_id] = self._loop.create_task(
                self._dial_forever(peer_id, addr), name=f"qserver-peer-dial-{peer_id}")
        log.info("node %d listening for peers on %s:%d", self.node_id, *self.address)

    async def close(self) -> None:
        """Stop listening and dialing, flush and close every connection.

        Returns once every task has ended and every transport is closed.
        No callback runs after this is called.
        """
        if self._closing:
            return
        self._closing = True
        self._stop_accepting()
        if self._adopting:  # short: each ends once its link's connection_made ran (and aborted)
            await asyncio.wait(self._adopting, timeout=CLOSE_GRACE_S)
        for task in self._dialers.values():
            task.cancel()
        # Close the links before awaiting the dialers: a dialer whose cancel
        # was lost (on 3.11 a connect that completes at the moment of the
        # cancel swallows it) waits for its link to close, then sees _closing.
        await self._close_links()
        if self._dialers:
            await asyncio.gather(*self._dialers.values(), return_exceptions=True)
        self._dialers.clear()
        await self._close_links()  # any dial that completed meanwhile (aborted at once)
        self._out.clear()
        self._in.clear()
        self._current.clear()

    # Accepting. asyncio's Server is not used: on 3.11, closing it while a
    # connection accepted in the same loop turn still waits for its transport
    # leaks that connection's socket. Here every accepted socket is owned by
    # a task until it is a transport, and close() waits for those tasks.

    async def _bind(self, host: str, port: int) -> socket.socket:
        try:  # a numeric address needs no resolver thread
            infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                       flags=socket.AI_PASSIVE | socket.AI_NUMERICHOST)
        except socket.gaierror:
            infos = await self._loop.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                 flags=socket.AI_PASSIVE)
        family, type_, proto, _, sockaddr = infos[0]
        sock = socket.socket(family, type_, proto)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(sockaddr)
            sock.listen(LISTEN_BACKLOG)
            sock.setblocking(False)
        except BaseException:
            sock.close()
            raise
        return sock

    def _on_acceptable(self) -> None:
        listener = self._listener
        if listener is None:
            return
        for _ in range(LISTEN_BACKLOG):
            try:
                conn, _ = listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except ConnectionAbortedError:
                continue
            except OSError as exc:
                # Out of descriptors or memory: pause instead of spinning.
                log.error("node %d: accepting peers failed: %s; pausing %g s",
                          self.node_id, exc, ACCEPT_RETRY_S)
                self._loop.remove_reader(listener.fileno())
                self._accept_retry = self._loop.call_later(ACCEPT_RETRY_S, self._resume_accepting)
                return
            task = self._loop.create_task(self._adopt(conn))
            self._adopting.add(task)
            task.add_done_callback(self._adopting.discard)

    def _resume_accepting(self) -> None:
        self._accept_retry = None
        if self._listener is not None and not self._closing:
            self._loop.add_reader(self._listener.fileno(), self._on_acceptable)

    async def _adopt(self, conn: socket.socket) -> None:
        try:
            conn.setblocking(False)
            await self._loop.connect_accepted_socket(
                lambda: _PeerLink(self, _Role.ACCEPTOR), sock=conn,
                ssl=self._tls[0] if self._tls is not None else None,
                ssl_handshake_timeout=self._handshake_timeout_s if self._tls else None)
        except OSError as exc:
            conn.close()
            log.debug("node %d: an accepted connection failed at once: %s", self.node_id, exc)
        except BaseException:
            conn.close()
            raise

    def _stop_accepting(self) -> None:
        if self._accept_retry is not None:
            self._accept_retry.cancel()
            self._accept_retry = None
        if self._listener is not None:
            self._loop.remove_reader(self._listener.fileno())
            self._listener.close()
            self._listener = None

    async def _close_links(self) -> None:
        for link in list(self._links):
            link.close()
        await self._wait_links_closed()
        for link in list(self._links):
            link.abort()
        await self._wait_links_closed()

    async def _wait_links_closed(self) -> None:
        waiting = [link.closed for link in self._links]
        if waiting:
            await asyncio.wait(waiting, timeout=CLOSE_GRACE_S)

    async def _dial_forever(self, peer_id: int, addr: tuple[str, int]) -> None:
        loop = self._loop
        host, port = addr
        delay_s = BACKOFF_MIN_S
        while not self._closing:
            link: _PeerLink | None = None
            try:
                async with asyncio.timeout(CONNECT_TIMEOUT_S):
                    _, link = await loop.create_connection(
                        lambda: _PeerLink(self, _Role.DIALER, peer_id), host, port,
                        ssl=self._tls[1] if self._tls is not None else None)
            except ssl.SSLError as exc:  # <tls peers="1">: certificates that do not fit
                log.warning("node %d: TLS with node %d at %s:%d failed: %s",
                            self.node_id, peer_id, host, port, exc)
            except OSError as exc:  # refused, unreachable, timed out (TimeoutError is one)
                log.debug("node %d: dialing node %d at %s:%d failed: %s",
                          self.node_id, peer_id, host, port, exc)
            if link is not None:
                # shield: cancelling this task must not cancel the link's future.
                if await asyncio.shield(link.closed):
                    delay_s = BACKOFF_MIN_S
            if self._closing:
                return
            await asyncio.sleep(delay_s * (0.5 + self._rng.random()))
            delay_s = min(delay_s * 2, BACKOFF_MAX_S)

    # Link tables

    def _register(self, link: _PeerLink) -> None:
        """An authenticated connection joins; it replaces an older one of
        the same direction from the same peer."""
        peer_id = link.peer_id
        assert peer_id is not None
        table = self._out if link.role is _Role.DIALER else self._in
        old = table.get(peer_id)
        was_up = peer_id in self._current
        table[peer_id] = link
        link.registered = True
        if not was_up:
            self._current[peer_id] = link
        if old is not None and old is not link:
            log.info("node %d: a new %s connection replaces the old one to node %d",
                     self.node_id, link.role.value, peer_id)
            old.registered = False  # table already points at the new link
            if self._current.get(peer_id) is old:
                self._current[peer_id] = self._out.get(peer_id) or self._in[peer_id]
            old.abort()
        if not was_up:
            self._notify_link(peer_id, True)

    def _unregister(self, link: _PeerLink) -> None:
        if not link.registered:
            return
        link.registered = False
        peer_id = link.peer_id
        assert peer_id is not None  # a link is registered once it is OPEN, with its peer's id
        table = self._out if link.role is _Role.DIALER else self._in
        if table.get(peer_id) is link:
            del table[peer_id]
        if self._current.get(peer_id) is link:
            other = self._out.get(peer_id) or self._in.get(peer_id)
            if other is not None:
                self._current[peer_id] = other
            else:
                del self._current[peer_id]
                self._notify_link(peer_id, False)

    # Callbacks

    def _deliver(self, peer_id: int, obj: object) -> None:
        if self._closing:
            return
        try:
            self._on_message(peer_id, obj)
        except Exception as exc:
            # Our fault, not the peer's (a malformed message is on_message's
            # to drop, not to raise on): handed to the event loop's
            # exception handler, which stops a node (node.Node.fatal).
            self._callback_failed(exc, f"on_message for a message from node {peer_id}")

    def _notify_link(self, peer_id: int, up: bool) -> None:
        if self._on_link is None or self._closing:
            return
        try:
            self._on_link(peer_id, up)
        except Exception as exc:
            self._callback_failed(exc, f"on_link({peer_id}, {up})")

    def _callback_failed(self, exc: Exception, where: str) -> None:
        self._loop.call_exception_handler({"message": where, "exception": exc})

    # Sending

    def send(self, peer_id: int, obj: object) -> bool:
        """Queue `obj` (msgpack-encodable) for `peer_id`; never blocks or raises.

        Returns True if it was queued on a link, False if it was dropped: no
        link to that peer is up, it cannot be encoded, or it is over
        MAX_FRAME_BYTES (the last two are logged as errors). True does not
        mean delivered: the link may still break before it arrives.
        Cost: one msgpack encoding; the write happens later in this loop turn.
        """
        link = self._current.get(peer_id)
        if link is None:
            return False
        body = self.encode(obj)
        if body is None:
            return False
        return link.write_frame(body)

    def send_encoded(self, peer_id: int, body: bytes) -> bool:
        """As `send`, for a message encoded once (`encode`) and sent to
        several peers."""
        link = self._current.get(peer_id)
        return link is not None and link.write_frame(body)

    def flush(self, peer_id: int) -> None:
        """Hand what is queued for `peer_id` to its transport now, not at
        the end of the turn: for a caller that itself runs at the end of
        the turn (a callback of call_soon), whose sends would otherwise
        wait for one more turn of the loop."""
        link = self._current.get(peer_id)
        if link is not None and link.flush_handle is not None:
            link.flush_handle.cancel()
            link._flush()

    def flush_all(self) -> None:
        """As `flush`, for every peer with something queued."""
        for link in self._current.values():
            if link.flush_handle is not None:
                link.flush_handle.cancel()
                link._flush()

    def connected(self, peer_id: int) -> bool:
        """Whether an authenticated link to `peer_id` is up."""
        return peer_id in self._current

    def connected_ids(self) -> set[int]:
        """The ids of every peer with an authenticated link up."""
        return set(self._current)

    def encode(self, obj: object) -> bytes | None:
        """`obj`'s frame body, None (logged as an error) if it cannot be
        encoded or is over MAX_FRAME_BYTES."""
        try:
            body = self._pack(obj)  # (a Packer clears its buffer when packing fails)
        except Exception:
            log.error("cannot encode a peer message of type %s", type(obj).__name__,
                      exc_info=True)
            return None
        if len(body) > PACKER_KEEP_BYTES:  # its buffer grew as large: let it go
            self._pack = msgpack.Packer().pack
        if len(body) > MAX_FRAME_BYTES:
            log.error("peer message of %d bytes is over the limit of %d; not sent",
                      len(body), MAX_FRAME_BYTES)
            return None
        return body
