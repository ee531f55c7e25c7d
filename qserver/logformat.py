"""The log formats of `qserver run` and `qserver local-cluster`:
`--log-format text` (the default, for people) and `--log-format json` (for
log collectors: journald, Docker's json-file and Loki parse it field by
field).

JSON: one object per line on stderr, one line per record, with the fields

    ts       when, ISO 8601 in UTC with milliseconds: "2025-05-30T12:34:56.789Z"
    level    DEBUG, INFO, WARNING, ERROR or CRITICAL
    logger   the logger's name ("qserver.node", "qserver.engines.peers", ...)
    msg      the message, formatted with its arguments
    node_id  this node's id (absent where no node is known)
    exc      the formatted traceback, when the record carries exc_info
    stack    the formatted stack, when the record carries stack_info

A message or traceback is one JSON string whatever newlines it holds, so a
record never spans lines. Only records that go through `logging` are
formatted: the command line's own one-line errors (a bad configuration,
bad usage: before logging is set up, or instead of it) stay plain text on
stderr, and the ready line goes to stdout as in text format.
"""

from __future__ import annotations

import logging
import sys
import time

import orjson

__all__ = ["LOG_FORMATS", "JsonFormatter", "configure_logging", "iso_utc_ms", "text_format"]

# The values of --log-format; the first is the default.
LOG_FORMATS = ("text", "json")


def iso_utc_ms(created_s: float) -> str:
    """`created_s` (a Unix time in seconds) as ISO 8601 in UTC with
    milliseconds and a Z: what log collectors parse without a layout."""
    secs, ms = divmod(int(created_s * 1000), 1000)
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(secs)) + f".{ms:03d}Z"


class JsonFormatter(logging.Formatter):
    """One JSON object per record, on one line (see the module docstring)."""

    def __init__(self, node_id: int | None = None) -> None:
        super().__init__()
        self.node_id = node_id

    def format(self, record: logging.LogRecord) -> str:
        fields: dict[str, object] = {
            "ts": iso_utc_ms(record.created),
            "level": record.levelname,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        if self.node_id is not None:
            fields["node_id"] = self.node_id
        if record.exc_info:
            fields["exc"] = self.formatException(record.exc_info)
        elif record.exc_text:  # a record formatted before, or built by hand
            fields["exc"] = record.exc_text
        if record.stack_info:
            fields["stack"] = self.formatStack(record.stack_info)
        try:
            return orjson.dumps(fields).decode()
        except orjson.JSONEncodeError:
            # A lone surrogate (bytes decoded with surrogateescape, e.g. a
            # file name) is not UTF-8: escape it rather than lose the record.
            return orjson.dumps({
                k: v.encode("utf-8", "backslashreplace").decode("utf-8")
                if isinstance(v, str) else v
                for k, v in fields.items()}).decode()


def text_format(prefix: str, node_id: int) -> str:
    """The text format's `logging` format string, as it always was:
    time, `<log prefix>[node_id]`, level, message."""
    prefix = prefix.replace("%", "%%")  # a prefix is text, not a format
    return f"%(asctime)s {prefix}[{node_id}] %(levelname)s %(message)s"


def configure_logging(log_format: str, level: int, *, node_id: int, prefix: str) -> None:
    """Send the root logger's records to stderr in `log_format` (one of
    LOG_FORMATS) from `level` up. Raises ValueError for another format."""
    handler = logging.StreamHandler(sys.stderr)
    if log_format == "json":
        handler.setFormatter(JsonFormatter(node_id))
    elif log_format == "text":
        handler.setFormatter(logging.Formatter(text_format(prefix, node_id)))
    else:
        raise ValueError(f"log format {log_format!r}: expected one of {', '.join(LOG_FORMATS)}")
    logging.basicConfig(level=level, handlers=[handler])
