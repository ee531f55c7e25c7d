"""The Python client of qserver: `Client` (blocking) and `AsyncClient`
(asyncio), with the same methods.

    with Client(["127.0.0.1:1111", "127.0.0.1:1112"]) as c:
        msg_id = c.produce("orders", "close order 42", delay=30, retry=60)
        ids = c.produce_many({"queue": "orders", "data": f"o{i}"} for i in range(5000))
        with c.process("orders") as msg:       # confirmed if the block succeeds
            if msg is not None:
                handle(msg.data)

Methods: `produce` (returns the msg_id), `produce_ids` (returns {real queue:
msg_id}, the way to see every message a virtual queue created),
`produce_many`, `consume` (a `Message` or None), `confirm`, `monitor`,
`list`, `leader`, and `request` for a raw request. Consumer helpers:
`process(queue)` (one message, confirmed when the `with` block succeeds,
left to the server's retry when it raises) and `messages(queue)` (an
iterator of `Delivery` objects that work the same way).

Theory of operation
-------------------
A client holds one TCP connection at a time, to one node of the list it was
given, and keeps it between calls (opened on first use). Every call goes
through one pipelined exchange: requests are written while earlier answers
are still coming, at most `window` in flight, each tagged with a `seq` the
node echoes; answers come back in order and are matched by position (and
checked by `seq`). A single request is an exchange of one.

What happens to an answer:
- code 0, or code -1 for a reason that will not change by asking again
  (bad input, "queue full", "time error"): the final answer.
- code -2 (the node is a slave with `forward_request="0"`): the request is
  sent again to `leader_host:leader_port`, and the client stays with that
  node for later calls.
- code -1 "no leader" (an election in progress) or "...; outcome unknown"
  (the master went away while a slave forwarded the request): the request
  is sent again, to the next node, after a short backoff.
- no answer (connection refused, reset, closed, or silent for `timeout`
  seconds): the unanswered requests are sent again to the next node.

Retries go on for `retry_for` seconds after the first failure without
progress (every node is tried at least once, whatever `retry_for`), with a
backoff that doubles from 50 ms to 1 s after each round of the node list;
then the last error is raised: `NoLeader`, `ClientConnectionError`,
`ClientTimeout`, or `ServerError`. Errors are in `qserver.errors`, rooted at
`QServerClientError`.

Delivery guarantees of the resends: a request whose answer was lost may have
taken effect. A produce sent again may therefore be stored twice
(at-least-once: the caller sees one msg_id, the other message is delivered
too); a consume sent again may have delivered a message to the lost
connection, which then comes back after its `retry` seconds (retry > 0) or
is gone (retry = 0, at-most-once). Confirms are idempotent. A `produce_many`
whose connection dies mid-batch sends every unanswered item again on another
node: each item is stored at least once, and the returned msg_ids are those
of the answers received.

Time: `delay` and `ttl` take seconds relative to now (int or float), an
absolute unix time (a number >= 1,000,000,000, as on the wire), a
`datetime` (naive = local time) or a `timedelta`; the client sends whole
absolute unix seconds (design.md, section 1), rounded up so that a message is
never ready before the time asked for. A delay that is already past is left
out (ready now). `ttl` counts from now, not from the delay. `retry` takes
seconds or a `timedelta`.

A `Client` may be shared by threads (calls are serialized); an `AsyncClient`
by tasks of one event loop (likewise). For parallel throughput use
`produce_many` or one client per thread or task.

Layout: `core` (the sans-I/O part: constants, `Message`, `parse_hosts`,
request builders, time conversion, the exchange and the retry policy),
`sync` (`Client`, `Delivery`), `aio` (`AsyncClient`, `AsyncDelivery`). The
public API is what this package exports.
"""

from __future__ import annotations

from .aio import AsyncClient, AsyncDelivery
from .core import (
    DEFAULT_RETRY_FOR_S,
    DEFAULT_TIMEOUT_S,
    DEFAULT_WINDOW,
    Message,
    parse_hosts,
    produce_request,
)
from .sync import Client, Delivery

__all__ = [
    "Client",
    "AsyncClient",
    "Message",
    "Delivery",
    "AsyncDelivery",
    "parse_hosts",
    "produce_request",
    "DEFAULT_TIMEOUT_S",
    "DEFAULT_RETRY_FOR_S",
    "DEFAULT_WINDOW",
]
