"""The client protocols: TCP and UDP on the client port.

These classes are mechanical, as the house style asks: feed bytes to the
codec, hand each decoded request to the service with the current time, and
write the encoded answers back. The node (node.py) owns them and the event
loop; nothing else mutates its state.

TCP answers pipelined requests in order, even when a later request is
answered before an earlier one (quorum mode): each request takes a slot in
the connection's queue of answers, and only the filled head of that queue is
written. All answers that a single read produces go out in one write.

Back-pressure: a connection stops being read while it owes more than
MAX_PIPELINE answers, or while the transport holds more than
WRITE_BUFFER_HIGH bytes of answers the client has not taken (it sends and
never reads); it is read again once both have drained. So what one client
can pin is bounded: its pipelined requests, its unsent answers, and the
kernel's socket buffers, whatever it sends.

Authentication (auth.py): with `<security>` the node has a `Guard`, and
every request is judged by it before the service sees it; a refusal, and
the answer to an action 0, take the request's place in the answers' order
(`_Answered`). Without `<security>` (`node.guard` is None) this costs one
test per read or datagram, nothing per request.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from typing import TYPE_CHECKING

from .auth import AUTH_ACTION, Guard
from .config import ClientToken
from .engines.base import JsonObject, Respond, Session
from .errors import BadRequest, ProtocolError
from .stats import FAST_STRIDE
from .wire.codec import (
    MAX_UDP_PAYLOAD,
    StreamDecoder,
    decode_datagram,
    encode_response,
    error_response,
)

if TYPE_CHECKING:
    from .node import Node

__all__ = ["ClientTcpProtocol", "ClientUdpProtocol"]

log = logging.getLogger(__name__)

# A client may pipeline this many requests before we stop reading from it
# until answers drain: bounds the memory one connection can pin.
MAX_PIPELINE = 4096

# A client that does not read its answers: once this many bytes of answers
# wait in the transport, the connection is no longer read (pause_writing),
# until they drain below WRITE_BUFFER_LOW. A few hundred KB keep a fast
# pipelining client streaming; the kernel's socket buffers come on top.
WRITE_BUFFER_HIGH = 256 * 1024
WRITE_BUFFER_LOW = 64 * 1024

# One read can hold thousands of pipelined requests (uvloop reads up to
# 256 KB): their answers are written every this many, not all at the end,
# because each encoded answer pins about 4 KB of the allocator's memory
# until written (orjson's output buffer, shrunk in place): 10,000 answers
# held at once cost 40-80 MB of RSS.
WRITE_EVERY_ITEMS = 256


_time_ns = time.time_ns
# The general path's latency (stats.RequestStats) is measured from the read
# to the answer: one clock read per read or datagram, one per answer. The
# fast path reads no clock; its answers are counted by one list increment.
_perf_ns = time.perf_counter_ns


class _Answered:
    """A request the guard answered itself (a refusal, an action 0): its
    answer, in the request's place."""

    __slots__ = ("response",)

    def __init__(self, response: JsonObject) -> None:
        self.response = response


def _log_refused(guard: Guard, reason: str, who: object, now_ms: int) -> None:
    """A failed authentication, at WARNING, rate-limited (FailureLog); the
    reason never holds the token."""
    held = guard.failures.note(now_ms)
    if held is not None:
        more = f" ({held} more not logged)" if held else ""
        log.warning("client %s refused: %s%s", who, reason, more)


class ClientTcpProtocol(asyncio.Protocol):
    """One client connection: a stream of JSON requests, answered in order."""

    def __init__(self, node: Node) -> None:
        self.node = node
        self.transport: asyncio.Transport | None = None
        self.decoder = StreamDecoder(node.config.max_request_size)
        # [encoded answer or None] per request, in request order
        self.slots: deque[list[bytes | None]] = deque()
        self.batching = False  # inside data_received: flush once at its end
        self.closing = False  # close once every slot is written
        # Reading is paused while either holds (back-pressure); `paused`
        # says whether it is paused now.
        self.paused = False
        self.too_many_slots = False  # more than MAX_PIPELINE answers owed
        self.writes_blocked = False  # the transport's buffer is over its high mark
        self.flush_pending = False  # a flush is scheduled for this loop turn
        # Bound once: data_received runs per read, and these never change.
        self._feed = self.decoder.feed
        self._answer_now = node.service.answer_now
        self._handle = node.service.handle_general
        # The answers' counts (metrics): the fast path's, and any other.
        self._fast = node.request_stats.fast
        self._count = node.request_stats.answered
        # What this client has waiting (parked consumes): dropped when it goes.
        self.session = Session()
        # <security>: the node's guard (None: every request is allowed), and
        # the token this connection authenticated with by action 0.
        self._guard: Guard | None = node.guard
        self.token: ClientToken | None = None
        self.peer: object = None  # the client's address, for the log

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        transport.set_write_buffer_limits(high=WRITE_BUFFER_HIGH,  # type: ignore[attr-defined]
                                          low=WRITE_BUFFER_LOW)
        self.node.connections.add(self)
        if self._guard is not None:
            self.peer = _address(transport.get_extra_info("peername"))

    def connection_lost(self, exc: Exception | None) -> None:
        self.node.connections.discard(self)
        self.transport = None
        self.slots.clear()
        self.session.close()
        self.node.connection_idle()

    def data_received(self, data: bytes) -> None:
        items = self._feed(data)
        if not items:
            return
        t = _time_ns() // 1_000_000  # now_ms() without the call (runs per read)
        if self._guard is not None:
            self._judge(items, t)
        if len(items) == 1 and not self.slots:
            # The common case: one request, nothing owed before it, answered
            # at once. Written straight away, no slot.
            item = items[0]
            if type(item) is dict:
                response = self._answer_now(item, t)
                if response is not None:
                    self._fast[response["action"] - FAST_STRIDE * response["code"]] += 1
                    if self.transport is not None:
                        self.transport.write(encode_response(response))
                    return
        self._general(items, t)

    def _judge(self, items: list, t: int) -> None:
        """<security>: each request the guard refuses, and each action 0,
        becomes its answer (`_Answered`) in place; the others lose their
        `token` field and go on."""
        guard = self._guard
        assert guard is not None  # called only with one
        for i, item in enumerate(items):
            if type(item) is not dict:
                continue  # framing errors, non-objects: the codec's or the service's error
            action = item.get("action")
            if type(action) is int and action == AUTH_ACTION:
                self.token, reason = guard.authenticate(item)
            else:
                reason = guard.authorize(item, self.token)
                if reason is None:
                    continue
            items[i] = _Answered(item)
            if reason is not None:
                _log_refused(guard, reason, self.peer, t)

    def _general(self, items: list, t: int) -> None:
        """Every item gets a slot in request order; answers go out in order,
        every WRITE_EVERY_ITEMS items and once this read's items are all
        handled."""
        started = _perf_ns()  # the read's time, for the general path's latency
        answer_now = self._answer_now
        handle = self._handle
        count = self._count
        fast = self._fast
        slots = self.slots
        self.batching = True
        countdown = WRITE_EVERY_ITEMS
        for item in items:
            countdown -= 1
            if not countdown:  # a long read: what is answered goes out now
                countdown = WRITE_EVERY_ITEMS
                self._write_head()
            slot: list[bytes | None] = [None]
            slots.append(slot)
            kind = type(item)
            if kind is dict:
                response = answer_now(item, t)
                if response is not None:
                    fast[response["action"] - FAST_STRIDE * response["code"]] += 1
                    slot[0] = encode_response(response)
                else:
                    handle(item, t, self._responder(slot, started), session=self.session)
            elif kind is ProtocolError:
                response = error_response(item.reason)
                count(response, None)
                slot[0] = encode_response(response)
                self.closing = True
                break
            elif kind is BadRequest:
                response = error_response(item.reason)
                count(response, None)
                slot[0] = encode_response(response)
            elif kind is _Answered:
                count(item.response, None)
                slot[0] = encode_response(item.response)
            else:  # any other JSON value: the service answers it (an error)
                handle(item, t, self._responder(slot, started))
        self.batching = False
        self._flush()
        if len(slots) > MAX_PIPELINE and not self.too_many_slots:
            self.too_many_slots = True
            self._update_reading()

    def _responder(self, slot: list[bytes | None], started: int) -> Respond:
        count = self._count

        def respond(response: JsonObject) -> None:
            count(response, _perf_ns() - started)
            slot[0] = encode_response(response)
            if not self.batching and not self.flush_pending:
                # Answers of replicated writes arrive together (one commit
                # answers many): one write for all of them, at the end of
                # this turn, instead of one write(2) each; and one callback
                # for every connection answered in the turn.
                self.node.flush_at_turn_end(self)
                self.flush_pending = True
        return respond

    def deferred_flush(self) -> None:
        """The end of the turn this connection was answered in (the node's
        flush_at_turn_end)."""
        self.flush_pending = False
        self._flush()

    def _flush(self) -> None:
        transport = self.transport
        if transport is None:
            return
        self._write_head()
        if not self.slots:
            self.node.connection_idle()
        if self.closing and not self.slots:
            transport.close()
        elif self.too_many_slots and len(self.slots) <= MAX_PIPELINE // 2:
            self.too_many_slots = False
            self._update_reading()

    def _write_head(self) -> None:
        """Write the answers at the head of the queue that are ready."""
        transport = self.transport
        if transport is None:
            return
        slots = self.slots
        if len(slots) == 1:
            answer = slots[0][0]
            if answer is not None:
                slots.popleft()
                transport.write(answer)
        else:
            out: list[bytes] = []
            while slots:
                answer = slots[0][0]
                if answer is None:
                    break
                slots.popleft()
                out.append(answer)
            if out:
                transport.write(b"".join(out))

    def pause_writing(self) -> None:
        # The client is not reading its answers: stop reading its requests.
        self.writes_blocked = True
        self._update_reading()

    def resume_writing(self) -> None:
        self.writes_blocked = False
        self._update_reading()

    def _update_reading(self) -> None:
        """Read from the client iff neither back-pressure condition holds."""
        transport = self.transport
        if transport is None:
            return
        pause = self.too_many_slots or self.writes_blocked
        if pause and not self.paused:
            self.paused = True
            transport.pause_reading()
        elif not pause and self.paused and not self.closing:
            self.paused = False
            transport.resume_reading()

    @property
    def idle(self) -> bool:
        return not self.slots


class ClientUdpProtocol(asyncio.DatagramProtocol):
    """One JSON request per datagram, one answer datagram to the sender."""

    def __init__(self, node: Node) -> None:
        self.node = node
        self.transport: asyncio.DatagramTransport | None = None
        self.max_size = node.config.max_udp_request_size
        # Bound once: datagram_received runs per request.
        self._answer_now = node.service.answer_now
        self._handle = node.service.handle_general
        # The answers' counts (metrics): the fast path's, and any other.
        self._fast = node.request_stats.fast
        self._count = node.request_stats.answered
        self._guard: Guard | None = node.guard  # <security>; None: all allowed

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def datagram_received(self, data: bytes, addr) -> None:
        obj = decode_datagram(data, self.max_size)
        if type(obj) is BadRequest:
            self._send(error_response(obj.reason), addr)
            return
        t = _time_ns() // 1_000_000  # now_ms() without the call (runs per request)
        if self._guard is not None and type(obj) is dict and not self._admit(obj, t, addr):
            return
        response = self._answer_now(obj, t)
        if response is None:
            started = _perf_ns()  # for the general path's latency
            self._handle(obj, t, lambda response: self._send(response, addr, started))
            return
        # _send, inline for the common case: an answer that fits.
        payload = encode_response(response)
        transport = self.transport
        if len(payload) <= MAX_UDP_PAYLOAD and transport is not None:
            self._fast[response["action"] - FAST_STRIDE * response["code"]] += 1
            transport.sendto(payload, addr)
        else:
            self._send(response, addr)

    def _admit(self, obj: JsonObject, t: int, addr) -> bool:
        """<security>: True if the request may go on (its `token` field
        gone); else its answer is sent (a refusal, or an action 0's: over
        UDP it only checks the token, there is no connection to keep it)."""
        guard = self._guard
        assert guard is not None  # called only with one
        action = obj.get("action")
        if type(action) is int and action == AUTH_ACTION:
            _, reason = guard.authenticate(obj)
        else:
            reason = guard.authorize(obj, None)
            if reason is None:
                return True
        if reason is not None:
            _log_refused(guard, reason, _address(addr), t)
        self._send(obj, addr)
        return False

    def _send(self, response: dict, addr, started: int | None = None) -> None:
        """Send an answer. `started`: perf_counter_ns() when the general
        path took its request; None: not timed (the codec's, the guard's
        or a fast-path answer too large)."""
        if self.transport is None:
            return
        payload = encode_response(response)
        if len(payload) > MAX_UDP_PAYLOAD:
            # The write happened; only its answer cannot travel by UDP.
            response.pop("data", None)
            response.update(code=-1, reason="response too large for udp; use tcp")
            payload = encode_response(response)
        self._count(response, None if started is None else _perf_ns() - started)
        self.transport.sendto(payload, addr)

    def error_received(self, exc: Exception) -> None:
        log.debug("udp error: %s", exc)


def _address(addr: object) -> object:
    """A peer address as "host:port" for the log (as given otherwise)."""
    if isinstance(addr, tuple) and len(addr) >= 2:
        return f"{addr[0]}:{addr[1]}"
    return addr
