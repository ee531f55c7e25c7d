"""The errors of the qserver Spark sink and source, rooted at qserver's own root.

Errors of the client (a node that refused a produce, no node reachable) are
`qserver.errors.QServerClientError`s; the sink raises them as the cause of a
`WriteError` that says how far the task got.
"""

from __future__ import annotations

from qserver.errors import QServerError

__all__ = ["SinkError", "OptionError", "RowError", "WriteError", "SourceError"]


class SinkError(QServerError):
    """Raised never by itself: the root of every error of the qserver sink."""


class OptionError(SinkError, ValueError):
    """Raised on the driver, before any task runs, when an option of the
    qserver sink is missing, unknown or malformed, or names a column the
    DataFrame lacks or holds in the wrong type; also for a save mode or
    output mode the sink cannot honour, and for an option of the source
    (`where` = "source") that is missing, unknown or out of range. The
    message names the option and what is wrong."""

    def __init__(self, problem: str, where: str = "sink") -> None:
        self.problem = problem
        super().__init__(f"qserver {where}: {problem}")


class RowError(SinkError, ValueError):
    """Raised in a task when a row cannot become a message: a null queue or
    data, data bytes that are not UTF-8. Names the column and the row's
    position in the task's input."""

    def __init__(self, problem: str) -> None:
        self.problem = problem
        super().__init__(f"qserver sink: {problem}")


class WriteError(SinkError):
    """Raised in a task when the client gave up on a batch (a node refused a
    produce, e.g. "queue full", or no node answered for the client's retry
    time). Says how many rows the task had written; those stay in their
    queues (at-least-once). The client's error is the `__cause__`."""


class SourceError(QServerError):
    """Raised by the source (`spark.readStream.format("qserver")`,
    `spark.read`) when it cannot go on: no node answered for the client's
    retry time, a node refused a consume or a peek, or the checkpoint holds
    an offset this version cannot read. The message says what was consumed
    and what happens to it (it comes back after its lease); the client's
    error, if any, is the `__cause__`. Option errors are `OptionError`s."""
