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
from .base import FORWARD_TIMEOUT_S, Cancel, ForwardedHandler, Respond, Session
from .messages import Forward, ForwardCancel, ForwardReply, message_to_wire
from .peers import PeerNetwork

__all__ = ["Forwarder", "FORWARD_TIMEOUT_S", "wall_ms"]




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

    def forward(self, leader_id: int, request: dict, respond: Respond,
                timeout_s: float | None = None) -> Cancel | None:
        """Send `request` to the master `leader_id`; `respond` gets its
        answer, or a failure after `timeout_s` (FORWARD_TIMEOUT_S if None).
        Returns what cancels it (see the module docstring); None, without
        calling `respond`, if the link to the master is down."""
        if not self.net.connected(leader_id):
            return None
        request_id = self._next_id
        self._next_id += 1
        msg = Forward(vote_id=self._vote_id(), node_id=self.node_id, request_id=request_id,
                      request=request)
        if not self.net.send(leader_id, message_to_wire(msg)):
            return None
        pending = self._pending
        pending[request_id] = (respond, leader_id, request)
        if timeout_s is None or timeout_s == FORWARD_TIMEOUT_S:
            deadlines = self._deadlines
            while deadlines and deadlines[0][1] not in pending:  # answered: drop
                deadlines.popleft()
            deadline = time.monotonic() + FORWARD_TIMEOUT_S
            deadlines.append((deadline, request_id))
        else:
            deadline = time.monotonic() + timeout_s
            heapq.heappush(self._other_deadlines, (deadline, request_id))
        if self._timer is None or deadline < self._timer_at:
            self._arm(deadline)

        def cancel() -> None:
            if self._pending.pop(request_id, None) is not None:
                self.net.send(leader_id, message_to_wire(ForwardCancel(
                    vote_id=self._vote_id(), node_id=self.node_id, request_id=request_id)))
        return cancel

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

    def serve(self, peer_id: int, msg: Forward, handler: ForwardedHandler | None) -> None:
        """A slave forwarded a client request to us: answer it through
        `handler` (the service; None before the node set it), and send the
        answer back."""
        session: Session | None = None
        key = (peer_id, msg.request_id)
        if msg.request.get("wait"):  # it may park: the slave may cancel it
            session = self._served[key] = Session()

        def respond(response: dict) -> None:
            if session is not None:
                self._served.pop(key, None)
            reply = ForwardReply(vote_id=self._vote_id(), node_id=self.node_id,
                                 request_id=msg.request_id, response=response)
            self.net.send(peer_id, message_to_wire(reply))

        if handler is None:
            respond({"code": -1, "reason": NO_LEADER})
            return
        handler(msg.request, wall_ms(), respond, session)

    def on_cancel(self, peer_id: int, msg: ForwardCancel) -> None:
        """The slave's client went: drop what its request waits for."""
        session = self._served.pop((peer_id, msg.request_id), None)
        if session is not None:
            session.close()

    def link_down(self, peer_id: int) -> None:
        """The link to `peer_id` broke: the requests forwarded to it will not
        be answered."""
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
