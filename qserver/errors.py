"""The error hierarchy of qserver.

Every exception qserver raises on purpose derives from `QServerError`. A
client's fault (`BadRequest`) is answered on the wire with code -1 and the
reason; our own fault (`InvariantError`) stops the node loudly. Expected
outcomes (an empty consume, a full queue, no leader) are values, not
exceptions: see `qserver.state.store.Reply`.
"""

from __future__ import annotations

__all__ = [
    "QServerError",
    "ConfigError",
    "BadRequest",
    "ProtocolError",
    "InvariantError",
    "QServerClientError",
    "InvalidArgument",
    "ClientConnectionError",
    "ClientTimeout",
    "ServerError",
    "QueueFull",
    "NoLeader",
]


class QServerError(Exception):
    """Raised never by itself: the root of every qserver error."""


class ConfigError(QServerError):
    """Raised when a configuration file cannot be read or holds a bad setting.

    The message names the file, the element and what is wrong, so that an
    operator can fix it without reading the code.
    """

    def __init__(self, file: str, element: str, problem: str) -> None:
        self.file = file
        self.element = element
        self.problem = problem
        super().__init__(f"{file}: <{element}>: {problem}")


class BadRequest(QServerError):
    """Raised when a client request is malformed: not JSON, not an object,
    a missing or wrongly typed field, an unknown action, too large.

    Carries the wire code (-1) and the reason sent back to the client.
    """

    code = -1

    def __init__(self, reason: str) -> None:
        self.reason = reason
        super().__init__(reason)


class ProtocolError(BadRequest):
    """Raised when a client's byte stream cannot be framed any more (garbage
    between requests, a request over the size limit that never ends).

    The connection is answered once with the reason, then closed.
    """


class InvariantError(QServerError):
    """Raised when qserver finds its own state broken (an index that lost a
    message, an entry applied out of order). Our fault, never the client's:
    the node stops and recovers from its log on restart.
    """


# -- raised by the client (qserver.client) and the command line ----------------


class QServerClientError(QServerError):
    """Raised never by itself: the root of every error the client
    (`qserver.client.Client`, `AsyncClient`) and the `qserver` command's
    client commands raise. Catch this to catch them all.
    """


class InvalidArgument(QServerClientError, ValueError):
    """Raised when an argument given to the client cannot become a request
    or an address (data that is not a string, a delay of the wrong type, an
    unknown key in a `produce_many` item, a malformed "host:port"), before
    anything is sent. Also a `ValueError`, as Python's own argument errors.
    """


class ClientConnectionError(QServerClientError):
    """Raised when no node could be reached for the whole retry time: every
    node refused the connection, reset or closed it, or sent something that
    is not a JSON answer. Carries the address tried last.
    """


class ClientTimeout(QServerClientError, TimeoutError):
    """Raised when the node asked last did not answer within the client's
    `timeout`, and no other node did before the retry time ran out. The
    request may or may not have taken effect. Also a `TimeoutError` (so an
    `OSError`), as Python's own timeouts: `except TimeoutError` catches it.
    """


class ServerError(QServerClientError):
    """Raised when a node answered code -1 (or a redirect that cannot be
    followed): the request was understood and refused. Carries the wire
    `code` and `reason`, the whole `response`, and for `produce_many` the
    `index` of the item that failed (None otherwise).
    """

    def __init__(self, code: int, reason: str, response: dict | None = None,
                 index: int | None = None) -> None:
        self.code = code
        self.reason = reason
        self.response = response if response is not None else {}
        self.index = index
        where = f" (item {index})" if index is not None else ""
        super().__init__(f"{reason}{where}")


class QueueFull(ServerError):
    """Raised when a produce was refused because the queue (or, for a
    virtual queue, one of its real queues) holds `queue_size` messages:
    the server's reason "queue full: NAME". Nothing was produced.
    """


class NoLeader(ServerError):
    """Raised when the cluster had no master (the server's reason "no
    leader": an election in progress, or the node is cut off from the
    majority) for the whole retry time.
    """


# -- receipts (protocol v2: confirm, nack, touch) ------------------------------

__all__ += ["StaleReceipt", "NotInFlight"]


class StaleReceipt(ServerError):
    """Raised when a confirm, nack or touch named a receipt that is not the
    message's current delivery (the message was delivered again since, was
    confirmed, or is unknown): the server's reason "stale receipt". Nothing
    changed; the delivery this receipt named is over.
    """


class NotInFlight(ServerError):
    """Raised when a nack or touch named a message that is not delivered and
    unconfirmed with its lease running (an unknown id, a message never
    delivered, or one whose lease ran out): the server's reason "not in
    flight". Nothing changed.
    """


# -- queue controls (protocol v2: config `paused`) -----------------------------

__all__ += ["QueuePaused"]


class QueuePaused(ServerError):
    """Raised when a produce was refused because the queue is paused for
    producers (`paused` is "in" or "all"; for a virtual queue, one of its
    real queues is): the server's reason "queue paused" (or "queue paused:
    NAME"). Nothing was produced; `resume` the queue to produce again.
    """


# -- client authentication (protocol v2: action 0, <security>) -----------------

__all__ += ["Unauthorized"]


class Unauthorized(ServerError):
    """Raised when a node refused a request, or the client's token at
    connection (action 0), as unauthorized: no token, a token the node does
    not know, or a token that does not allow the action (the server's
    reason starts with "unauthorized" and says which). Nothing changed;
    asking again with the same token will not help.
    """
