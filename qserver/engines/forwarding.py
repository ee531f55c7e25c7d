"""Forwarding: a slave relays a client request to the master over the
node-to-node links, and relays the answer back. Both engines use it.

Slave side: `forward(leader_id, request, respond)` sends a `Forward` and
keeps `respond` until the master's `ForwardReply` comes back. The client
hears exactly one answer: the master's, or a failure that says the write's
outcome is unknown (the master did not answer within the timeout, its link
went down, or the node is shutting down). The timeout is FORWARD_TIMEOUT_S
unless the caller passes another (`timeout_s`: for a consume that the
master may park, say).

Master side: `serve(peer_id, msg, handler)` hands the request to the
node's service (the engine's `handle_forwarded`, set by the node) and sends
its answer back to the slave that asked.

Batches. The requests a slave relays in one loop turn go to the master as
one `ForwardBatch`, and the answers the master gives in one turn to the
requests of a batch go back as one `ForwardReplies`: a message, a frame
and a write per turn and direction instead of one per request. A slave
batches only for a master whose `Features` (sent by each side when a link
comes up) say it takes them; a node of an earlier release sends none, so
it gets and answers single `Forward`s as before. A batch holds at most
BATCH_MAX_REQUESTS requests, about BATCH_MAX_BYTES of their data, and a
consume that may wait goes alone (it may be cancelled). A batch that
cannot go as one frame (over the size limit) goes as single forwards; one
whose link is gone by the end of the turn fails with "no leader" (the
master never saw it).

A request that may wait on the master (a consume with `wait`) gets a
`Session` there, as a client connection has: if the slave's client goes,
the slave's `forward` returns a cancel that sends a `ForwardCancel`, and
the master closes that session, so no message is taken for a consumer that
is gone; if the link to the slave breaks, the master closes the sessions of
every request of that slave.
"""

from __future__ import annotations

import asyncio
import heapq
import time
from collections import deque
from collections.abc import Callable

from ..wire.codec import error_response
from .base import FORWARD_TIMEOUT_S, AnswerNow, Cancel, ForwardedHandler, Respond, Session
from .messages import (
    FEATURE_FORWARD_BATCH,
    FEATURES,
    Features,
    Forward,
    ForwardBatch,
    ForwardCancel,
    ForwardReplies,
    ForwardReply,
    message_to_wire,
)
from .peers import PeerNetwork

__all__ = ["Forwarder", "FORWARD_TIMEOUT_S", "wall_ms", "BATCH_MAX_REQUESTS",
           "BATCH_MAX_BYTES"]

# A ForwardBatch goes once it holds this many requests, or this many bytes
# of their `data` strings (a rough measure of the frame, well under the
# link's MAX_FRAME_BYTES), if the loop turn has not ended first.
BATCH_MAX_REQUESTS = 64
BATCH_MAX_BYTES = 1024 * 1024

def wall_ms() -> int:
    """Unix time in ms: what the store's decisions (ready times, ttls) are
    made with, as the client protocols hand it to the service. Never the
    engines' monotonic timer clock."""
    return time.time_ns() // 1_000_000


# What the client of a forwarded request hears when no answer will come.
TIMED_OUT = "forward timeout; outcome unknown"
MASTER_UNREACHABLE = "master unreachable; outcome unknown"
SHUTTING_DOWN = "node shutting down"
NO_LEADER = "no leader"


class Forwarder:
    """The forwards of one node: those it sent (waiting for the master's
    answer) and those it serves as master."""

    def __init__(self, *, node_id: int, net: PeerNetwork, vote_id: Callable[[], int]) -> None:
        self.node_id = node_id
        self.net = net
        self._vote_id = vote_id  # the engine's current epoch, stamped on each message
        # request_id -> (respond, master's node id, the request); an entry
        # exists exactly while its client has not been answered. A failure
        # echoes the request, as every answer does.
        self._pending: dict[int, tuple[Respond, int, dict]] = {}
        self._next_id = 1
        # Timeouts without a timer per request (arming and cancelling one
        # per forward cost more than the relay's own work): (monotonic
        # deadline, request_id) in the order sent, for the default timeout
        # (so deadlines never decrease along it), and a heap for the others;
        # one timer, at the earliest deadline. Entries of answered requests
        # stay until their deadline or until they reach the head.
        self._deadlines: deque[tuple[float, int]] = deque()
        self._other_deadlines: list[tuple[float, int]] = []
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = 0.0
        # (slave, its request_id) -> the session of a request served here
        # that may wait (a consume with `wait`), until it is answered
        self._served: dict[tuple[int, int], Session] = {}
        # Batches (see the module docstring). The peers whose Features say
        # they take a ForwardBatch; this turn's batch for each master, not
        # yet sent: [first request_id, requests, bytes of their data]; this
        # turn's answers for each slave that sent batches, not yet sent:
        # [request_id, response, request_id, response, ...].
        self._batching: set[int] = set()
        self._outbox: dict[int, list] = {}
        self._replies: dict[int, list] = {}
        self._flush_handle: asyncio.Handle | None = None

    # -- what each side takes ----------------------------------------------------

    def link_up(self, peer_id: int) -> None:
        """A link to `peer_id` came up: tell it what we take, and send it
        nothing new until it has told us the same."""
        self._batching.discard(peer_id)
        self.net.send(peer_id, message_to_wire(Features(
            vote_id=self._vote_id(), node_id=self.node_id, features=FEATURES)))

    def on_features(self, peer_id: int, msg: Features) -> None:
        """The peer told us what it takes."""
        if msg.features & FEATURE_FORWARD_BATCH:
            self._batching.add(peer_id)
        else:
            self._batching.discard(peer_id)

    # -- slave side ----------------------------------------------------------

    def forward(self, leader_id: int, request: dict, respond: Respond,
                timeout_s: float | None = None) -> Cancel | None:
        """Send `request` to the master `leader_id`; `respond` gets its
        answer, or a failure after `timeout_s` (FORWARD_TIMEOUT_S if None).
        Returns what cancels it (see the module docstring); None, without
        calling `respond`, if the link to the master is down."""
        if not self.net.connected(leader_id):
            return None
        default_timeout = timeout_s is None or timeout_s == FORWARD_TIMEOUT_S
        box = self._outbox.get(leader_id)
        if default_timeout and leader_id in self._batching:
            request_id = self._next_id
            self._next_id += 1
            if box is None:
                box = self._outbox[leader_id] = [request_id, [request], 0]
                self._flush_at_turn_end()
            else:
                box[1].append(request)
            data = request.get("data")
            if type(data) is str:
                box[2] += len(data)
            full = len(box[1]) >= BATCH_MAX_REQUESTS or box[2] >= BATCH_MAX_BYTES
        else:
            full = False
            if box is not None:  # what was relayed before it goes first
                self._send_batch(leader_id)
            request_id = self._next_id
            self._next_id += 1
            if not self._send_forward(leader_id, self._vote_id(), request_id, request):
                return None
        pending = self._pending
        pending[request_id] = (respond, leader_id, request)
        if default_timeout:
            deadlines = self._deadlines
            while deadlines and deadlines[0][1] not in pending:  # answered: drop
                deadlines.popleft()
            deadline = time.monotonic() + FORWARD_TIMEOUT_S
            deadlines.append((deadline, request_id))
        else:
            assert timeout_s is not None  # not default_timeout
            deadline = time.monotonic() + timeout_s
            heapq.heappush(self._other_deadlines, (deadline, request_id))
        if self._timer is None or deadline < self._timer_at:
            self._arm(deadline)
        if full:  # it goes now, this request with it
            self._send_batch(leader_id)

        def cancel() -> None:
            if self._pending.pop(request_id, None) is not None:
                if leader_id in self._outbox:  # the request first, then its cancel
                    self._send_batch(leader_id)
                self.net.send(leader_id, message_to_wire(ForwardCancel(
                    vote_id=self._vote_id(), node_id=self.node_id, request_id=request_id)))
        return cancel

    def _flush_at_turn_end(self) -> None:
        if self._flush_handle is None:
            self._flush_handle = asyncio.get_running_loop().call_soon(self._flush)

    def flush_now(self) -> None:
        """Send the turn's batches and answers now, not in the callback
        `_flush_at_turn_end` scheduled: for a caller that itself runs at the
        end of the turn (the engine, once it ran a commit's answers)."""
        handle = self._flush_handle
        if handle is not None:
            handle.cancel()
            self._flush()

    def _flush(self) -> None:
        """The end of the loop turn: send its batches and its answers."""
        self._flush_handle = None
        flush = self.net.flush
        for leader_id in list(self._outbox):
            self._send_batch(leader_id)
            flush(leader_id)
        for slave_id in list(self._replies):
            self._send_replies(slave_id)
            flush(slave_id)

    def _send_batch(self, leader_id: int) -> None:
        first, requests, _ = self._outbox.pop(leader_id)
        net = self.net
        vote_id = self._vote_id()
        if len(requests) == 1:
            if not self._send_forward(leader_id, vote_id, first, requests[0]):
                self._fail(first, NO_LEADER)  # the master never saw it
            return
        if net.send(leader_id, message_to_wire(ForwardBatch(
                vote_id=vote_id, node_id=self.node_id, first_id=first,
                requests=tuple(requests)))):
            return
        for i, request in enumerate(requests):
            # Over the frame limit together (the link is still up): one by
            # one. Otherwise the master never saw them.
            if not net.connected(leader_id) or not self._send_forward(
                    leader_id, vote_id, first + i, request):
                self._fail(first + i, NO_LEADER)

    def _send_forward(self, leader_id: int, vote_id: int, request_id: int,
                      request: dict) -> bool:
        return self.net.send(leader_id, message_to_wire(Forward(
            vote_id=vote_id, node_id=self.node_id, request_id=request_id, request=request)))

    def _arm(self, deadline: float) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer_at = deadline
        self._timer = asyncio.get_running_loop().call_later(
            max(0.0, deadline - time.monotonic()), self._expire)

    def _expire(self) -> None:
        """The timer: fail every request past its deadline still waiting;
        arm again at the next deadline of one that may be."""
        self._timer = None
        now = time.monotonic()
        pending = self._pending
        deadlines = self._deadlines
        others = self._other_deadlines
        while deadlines and (deadlines[0][0] <= now or deadlines[0][1] not in pending):
            _, request_id = deadlines.popleft()
            self._fail(request_id, TIMED_OUT)
        while others and (others[0][0] <= now or others[0][1] not in pending):
            _, request_id = heapq.heappop(others)
            self._fail(request_id, TIMED_OUT)
        heads = [q[0][0] for q in (deadlines, others) if q]
        if heads:
            self._arm(min(heads))

    def on_reply(self, msg: ForwardReply) -> None:
        """The master answered a request we forwarded."""
        pending = self._pending.pop(msg.request_id, None)
        if pending is not None:
            pending[0](msg.response)

    def on_replies(self, msg: ForwardReplies) -> None:
        """The master answered requests of our batches."""
        pop = self._pending.pop
        for request_id, response in msg.replies:
            pending = pop(request_id, None)
            if pending is not None:
                pending[0](response)

    # -- master side ---------------------------------------------------------

    def serve(self, peer_id: int, msg: Forward, handler: ForwardedHandler | None,
              answer_now: AnswerNow | None = None) -> None:
        """A slave forwarded a client request to us: answer it through
        `answer_now` (the service's fast path) or else `handler` (the
        service; None before the node set it), and send the answer back."""
        now = wall_ms()
        request = msg.request
        if isinstance(request, str):  # refused as it came in: answered so
            self._send_reply(peer_id, self._vote_id(), msg.request_id,
                             {"code": -1, "reason": request})
            return
        if answer_now is not None:
            response = answer_now(request, now)
            if response is not None:
                self._send_reply(peer_id, self._vote_id(), msg.request_id, response)
                return

        def reply(request_id: int, response: dict) -> None:
            self._send_reply(peer_id, self._vote_id(), request_id, response)
        self._serve_one(peer_id, msg.request_id, request, handler, reply, now)

    def serve_batch(self, peer_id: int, msg: ForwardBatch, handler: ForwardedHandler | None,
                    answer_now: AnswerNow | None = None) -> None:
        """A slave forwarded a batch: as `serve` for each request; the
        answers of a turn go back together, as one ForwardReplies. Those
        `answer_now` gives (most, on an async master) go into the turn's
        answers straight away, without a closure each; a request refused as
        it came in (not a map JSON can carry) is answered code -1 alone."""
        replies = self._replies

        def reply(request_id: int, response: dict) -> None:
            out = replies.get(peer_id)
            if out is None:
                out = replies[peer_id] = []
                self._flush_at_turn_end()
            out.append(request_id)
            out.append(response)
            if len(out) >= 2 * BATCH_MAX_REQUESTS:
                self._send_replies(peer_id)

        now = wall_ms()
        request_id = msg.first_id
        for request in msg.requests:
            if isinstance(request, str):  # refused as it came in: the others go on
                reply(request_id, {"code": -1, "reason": request})
            else:
                response = None if answer_now is None else answer_now(request, now)
                if response is None:
                    self._serve_one(peer_id, request_id, request, handler, reply, now)
                else:
                    reply(request_id, response)
            request_id += 1

    def _serve_one(self, peer_id: int, request_id: int, request: dict,
                   handler: ForwardedHandler | None,
                   reply: Callable[[int, dict], None], now: int) -> None:
        session: Session | None = None
        key = (peer_id, request_id)
        if request.get("wait"):  # it may park: the slave may cancel it
            session = self._served[key] = Session()

        def respond(response: dict) -> None:
            if session is not None:
                self._served.pop(key, None)
            reply(request_id, response)

        if handler is None:
            respond({"code": -1, "reason": NO_LEADER})
            return
        handler(request, now, respond, session)

    def _send_replies(self, slave_id: int) -> None:
        flat = self._replies.pop(slave_id)
        net = self.net
        vote_id = self._vote_id()
        it = iter(flat)
        pairs = tuple(zip(it, it))
        if net.send(slave_id, message_to_wire(ForwardReplies(
                vote_id=vote_id, node_id=self.node_id, replies=pairs))):
            return
        if len(pairs) > 1 and net.connected(slave_id):  # over the frame limit together
            for request_id, response in pairs:
                self._send_reply(slave_id, vote_id, request_id, response)
        # otherwise the link is gone: the slave fails them (link_down, timeout)

    def _send_reply(self, slave_id: int, vote_id: int, request_id: int,
                    response: dict) -> None:
        self.net.send(slave_id, message_to_wire(ForwardReply(
            vote_id=vote_id, node_id=self.node_id, request_id=request_id, response=response)))

    def on_cancel(self, peer_id: int, msg: ForwardCancel) -> None:
        """The slave's client went: drop what its request waits for."""
        session = self._served.pop((peer_id, msg.request_id), None)
        if session is not None:
            session.close()

    def link_down(self, peer_id: int) -> None:
        """The link to `peer_id` broke: the requests forwarded to it will not
        be answered."""
        self._batching.discard(peer_id)
        box = self._outbox.pop(peer_id, None)
        if box is not None:  # never sent: the master never saw them
            for request_id in range(box[0], box[0] + len(box[1])):
                self._fail(request_id, NO_LEADER)
        self._replies.pop(peer_id, None)  # cannot reach the slave: it fails them
        for request_id, (_, target, _) in list(self._pending.items()):
            if target == peer_id:
                self._fail(request_id, MASTER_UNREACHABLE)
        for key in [key for key in self._served if key[0] == peer_id]:
            self._served.pop(key).close()  # its answer could not reach the slave

    def close(self) -> None:
        """The node is stopping: answer every request still waiting."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._flush_handle is not None:
            self._flush_handle.cancel()
            self._flush_handle = None
        self._outbox.clear()  # their requests fail just below
        self._replies.clear()
        for request_id in list(self._pending):
            self._fail(request_id, SHUTTING_DOWN)
        served = list(self._served.values())
        self._served.clear()
        for session in served:
            session.close()

    @property
    def waiting(self) -> int:
        """Forwarded requests not yet answered."""
        return len(self._pending)

    def _fail(self, request_id: int, reason: str) -> None:
        pending = self._pending.pop(request_id, None)
        if pending is not None:
            pending[0](error_response(reason, pending[2]))
