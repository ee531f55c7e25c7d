"""What the sink and the source tell the user: the `qserver_spark` logger,
made to reach the driver's log.

Theory of operation
-------------------
Spark runs a Python data source's driver-side code (a writer's `commit` and
`abort`, the stream reader's `read` and `commit`) in Python worker
processes that the JVM starts, not in the user's Python process. Those
workers configure no logging: a record at INFO on the `qserver_spark`
logger reached no handler, and Python's last-resort handler shows WARNING
and above only, without a time or a name. What a worker writes to its
stderr, though, the JVM copies to its own stderr: the console of a local or
client-mode driver (where `spark-submit` or the notebook's kernel runs),
the driver's log file in cluster mode; an executor's to that executor's
log.

`logger()` gives the `qserver_spark` logger. The first time in a process
it sets its level to INFO unless one was set, and, where nobody configured
logging (no handler on it, none on the root logger), gives it a handler
that writes to the process's stderr, with a time and the logger's name,
and stops it propagating (so that a handler added to the root later does
not print it twice). A user who
configures logging in the worker (a `sitecustomize`, say) keeps control:
their handlers are left alone.
"""

from __future__ import annotations

import logging
import sys

__all__ = ["logger", "LOGGER_NAME"]

LOGGER_NAME = "qserver_spark"

_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def logger() -> logging.Logger:
    """The `qserver_spark` logger, made to reach stderr (see the module
    docstring). Cheap after the first call."""
    log = logging.getLogger(LOGGER_NAME)
    if _set_up:
        return log
    _set_up.append(True)
    if log.level == logging.NOTSET:
        log.setLevel(logging.INFO)  # the totals are INFO; the root's default is WARNING
    stream = sys.__stderr__  # the worker's own stderr, which the JVM copies
    if log.handlers or logging.getLogger().handlers or stream is None:
        return log
    handler = logging.StreamHandler(stream)
    handler.setFormatter(logging.Formatter(_FORMAT))
    log.addHandler(handler)
    log.propagate = False
    return log


# Non-empty once `logger()` has set the logger up in this process.
_set_up: list[bool] = []
