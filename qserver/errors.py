"""The error hierarchy of qserver.

Every exception qserver raises on purpose derives from `QServerError`. A
client's fault (`BadRequest`) is answered on the wire with code -1 and the
reason; our own fault (`InvariantError`) stops the node loudly. Expected
outcomes (an empty consume, a full queue, no leader) are values, not
exceptions: see `qserver.store.Reply`.
"""

from __future__ import annotations

__all__ = [
    "QServerError",
    "ConfigError",
    "BadRequest",
    "ProtocolError",
    "InvariantError",
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
