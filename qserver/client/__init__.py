"""The Python client of qserver: `Client` (blocking) and `AsyncClient`
(asyncio), with the same methods.

    with Client(["127.0.0.1:1111", "127.0.0.1:1112"]) as c:
        msg_id = c.produce("orders", "close order 42", delay=30, retry=60)
        ids = c.produce_many({"queue": "orders", "data": f"o{i}"} for i in range(5000))
        ids = c.produce_batch("orders", ["a", "b", {"data": "c", "priority": 0}])
        c.produce("orders", "charge 42", dedup_id="charge-42")  # stored once per window
        with c.process("orders") as msg:       # confirmed if the block succeeds
            if msg is not None:
                handle(msg.data)
        for d in c.messages("orders", lease=30):   # long polls, no sleeping
            try:
                handle(d.data)                 # d.touch(lease=30) for more time
            except Busy:
                d.nack(delay=60)               # back in a minute
            else:
                d.confirm()                    # StaleReceipt if the lease ran out

Methods: `produce` (returns the msg_id; `priority=` lower first, `dedup_id=`
stored once per dedup window), `produce_ids` (returns {real queue: msg_id},
the way to see every message a virtual queue created), `produce_batch` (one
queue, batch produces of up to 1,000 messages: one log entry each, all or
nothing; `produce_batch_result` also says which were duplicates),
`produce_many` (any queues; consecutive items of one queue go as batches),
`consume` (a `Delivery` or None; with `count=N` a list of
up to N; `queues=[...]` takes from the first of several queues with a
message; `wait=S` is a long poll, `lease=S` the time before an unconfirmed
delivery comes back), `confirm` (by id, or with a `receipt`; returns
whether a message was deleted), `nack`, `touch`, `show` (a message's state,
or None), `peek`, `config`, `set_config`, `pause` and `resume` (a produce
into a queue paused for producers raises `QueuePaused`), `clear` (returns
how many messages it removed), `monitor`, `list`, `leader`, `health` (is the
node ready, and why not), `drain` (take the node out of client work;
`undo=True` puts it back), `transfer_leader(node_id)`, and `request`
for a raw request. Consumer helpers: `process(queue)` (one
message, confirmed when the `with` block succeeds, left to the server's
retry when it raises) and `messages(queue)` (an iterator of `Delivery`
objects that work the same way, fetched with long polls).

Where to connect
----------------
`hosts` is "host:port" strings, (host, port) tuples, one comma-separated
string, or a URL that also carries settings:

    Client("qserver://10.0.0.1:1111,10.0.0.2:1111/?timeout=5&retry_for=30")
    Client("qservers://q1.example:1111/?token=...&tls_ca=/etc/qserver/ca.pem")

`qservers://` speaks TLS; the query may set `timeout`, `retry_for`,
`long_poll`, `token`, `tls_ca`, `tls_cert`, `tls_key`,
`tls_server_hostname` (percent-encoded); arguments given to the client win
over the URL's. Without `hosts`, the client takes them from
`$QSERVER_SERVERS` (either form); without `timeout`, from the URL, else
`$QSERVER_TIMEOUT` (seconds), else 5 s. A bad address, URL part or variable
raises `InvalidArgument` naming it (never the token). `parse_target` reads
the same forms (`parse_hosts`: the addresses only).

Each client starts at a node of the list picked at random (the list is
shuffled once per client), so that many clients given the same list spread
over the nodes instead of all landing on the first; `shuffle=False` keeps
the order given (a preferred node first, or a test that wants to know).

Deliveries and receipts
-----------------------
A `Delivery` is a `Message` (queue, msg_id, data, deliveries, receipt) with
`confirm()`, `nack(delay=)` and `touch(lease=)`, which send its receipt:
they act on this delivery only. Once its lease (or the message's retry) has
run out and the message was delivered again, they raise `StaleReceipt`
instead of settling someone else's delivery; `nack` and `touch` of a
message that is not in flight raise `NotInFlight`. A message delivered
without a receipt (at-most-once, retry=0, or its last delivery before its
ttl) is already gone from the server; its confirm by id finds nothing.
Messages compare equal by queue, msg_id and data (a delivery equals the
`Message` of the same message). `AsyncDelivery` is the same with
coroutines.

Long polls
----------
A consume with `wait` is held by the node until a message is deliverable
(then answered at once) or `wait` seconds pass (then empty); the client
allows `timeout` + `wait` for the answer. A long poll runs on a connection
of its own (kept for the next long poll), so that a thread or task waiting
for messages does not hold up the client's other calls. `messages()` and
`process(wait=...)` repeat long polls of `long_poll` seconds (20 by
default; halved while a node answers "wait out of range"); an empty answer
that comes back early (a master that lost its role, a server without long
polls) is followed by a new poll at once, then by pauses that double up to
0.5 s, so that against an older server the helpers poll as before.

Authentication and TLS
----------------------
    Client(hosts, token="...", tls=True, tls_ca="ca.pem")

Against nodes with `<security>`, `token=` is sent as `{"action": 0,
"token": ...}` first thing on every connection the client opens (ahead of
the first requests, without waiting for its answer: no extra round trip); a node without
`<security>` answers it code 0, so a client with a token works against an
open node too. A refused token, or a token that does not allow the
request's action, raises `Unauthorized` (a `ServerError`, never retried).
`tls=True` wraps every connection in TLS 1.2 or later and checks the
node's certificate: against `tls_ca` (a PEM bundle; default the system's
CAs), for `tls_server_hostname` (default the host dialed); `tls_cert` and
`tls_key` are the client's own certificate for nodes that require one
(`<tls client_cert="required">`); `ssl_context=` replaces them all. A CA
or a certificate given implies `tls=True`. A node whose certificate is not
trusted fails at once with `ClientConnectionError` (the next node would
say the same); other connection failures are retried as usual. The client
speaks TCP only: a UDP request carries its `token` field itself
(README: Authentication and TLS).

Theory of operation
-------------------
A client holds one TCP connection at a time for its calls (long polls
aside), to one node of its list, and keeps it between calls (opened on
first use). Every call goes through one pipelined exchange: requests are
written while earlier answers are still coming, at most `window` in
flight, each tagged with a `seq` the node echoes; answers come back in
order and are matched by position (and checked by `seq`). A single request
is an exchange of one. An `AsyncClient` runs the exchanges of all its
tasks on that connection at once, interleaved: each answer goes to the
exchange that sent the request (see `aio`).

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
progress (every node is tried at least once, whatever `retry_for`). Within
a round of the node list the next node is asked at once; after each round
the client pauses for a time drawn at random between 0 and a ceiling that
doubles from 50 ms to 1 s (exponential backoff with full jitter: clients
that failed together do not come back together). Then the last error is
raised: `NoLeader`, `ClientConnectionError`, `ClientTimeout` (also a
`TimeoutError`), or `ServerError`. Errors are in `qserver.errors`, rooted
at `QServerClientError`.

Delivery guarantees of the resends: a request whose answer was lost may have
taken effect. A produce sent again may therefore be stored twice
(at-least-once: the caller sees one msg_id, the other message is delivered
too), unless it carries a `dedup_id`: within the queue's dedup window the
server stores it once and answers the first msg_id, across failovers too.
A consume sent again may have delivered a message to the lost connection,
which then comes back after its `retry` seconds (retry > 0) or is gone
(retry = 0, at-most-once). Confirms by id are idempotent; a confirm
or nack with a receipt, sent again after its answer was lost, may find its
own first sending done and raise `StaleReceipt` (a touch is simply done
again). A long poll sent again waits again, on the next node. A `produce_many`
or `produce_batch` whose connection dies midway sends every unanswered
request again on another node: each item is stored at least once (exactly
once with a `dedup_id`, within the window), and the returned msg_ids are
those of the answers received.

Time: `delay` and `ttl` take seconds relative to now (int or float), an
absolute unix time (a number >= 1,000,000,000, as on the wire), a
`datetime` (naive = local time) or a `timedelta`; the client sends whole
absolute unix seconds (README: Time and delivery), rounded up so that a message is
never ready before the time asked for. A delay that is already past is left
out (ready now). `ttl` counts from now, not from the delay. `retry` takes
seconds or a `timedelta`.

A `Client` may be shared by threads (calls are serialized on its
connection); an `AsyncClient` by tasks of one event loop, whose calls go
out at once, pipelined on its connection, whatever the other tasks have in
flight (a task cancelled mid-call leaves its answers to be dropped). For
the most throughput from one thread use `produce_many`/`produce_batch`;
from many threads, one `Client` per thread.

Sockets: the blocking client waits with `selectors` (epoll, kqueue or
poll), so descriptors past 1024 (a process with many files open: a Spark
executor, a web server) work; `select.select` refused them.

Layout: `core` (the sans-I/O part: constants, `Message`, `parse_hosts`
and `parse_target`, the settings from arguments, URL and environment,
request builders, time conversion, the reading of answers, the long-poll
policy, the exchange and the retry policy), `sync` (`Client`, `Delivery`),
`aio` (`AsyncClient` and its shared connection, `AsyncDelivery`). The
public API is what this package exports.
"""

from __future__ import annotations

from ..errors import (
    ClientConnectionError,
    ClientTimeout,
    InvalidArgument,
    NoLeader,
    NotInFlight,
    QServerClientError,
    QueueFull,
    QueuePaused,
    ServerError,
    StaleReceipt,
    Unauthorized,
)
from .aio import AsyncClient, AsyncDelivery
from .core import (
    BATCH_MAX_BYTES,
    BATCH_WINDOW,
    DEFAULT_RETRY_FOR_S,
    DEFAULT_TIMEOUT_S,
    DEFAULT_WINDOW,
    LONG_POLL_S,
    MAX_BATCH,
    SERVERS_ENV,
    TIMEOUT_ENV,
    BatchResult,
    Message,
    Target,
    consume_request,
    parse_hosts,
    parse_target,
    produce_request,
)
from .sync import Client, Delivery

__all__ = [
    "Client",
    "AsyncClient",
    "Message",
    "BatchResult",
    "Delivery",
    "AsyncDelivery",
    "parse_hosts",
    "parse_target",
    "Target",
    "SERVERS_ENV",
    "TIMEOUT_ENV",
    "produce_request",
    "consume_request",
    "DEFAULT_TIMEOUT_S",
    "DEFAULT_RETRY_FOR_S",
    "DEFAULT_WINDOW",
    "LONG_POLL_S",
    "MAX_BATCH",
    "BATCH_MAX_BYTES",
    "BATCH_WINDOW",
    # the errors the client raises (also in qserver.errors)
    "QServerClientError",
    "InvalidArgument",
    "ClientConnectionError",
    "ClientTimeout",
    "ServerError",
    "QueueFull",
    "NoLeader",
    "StaleReceipt",
    "NotInFlight",
    "QueuePaused",
    "Unauthorized",
]
