"""The source's options: parsed and checked once, on the driver.

Theory of operation
-------------------
`spark.readStream.format("qserver")` and `spark.read.format("qserver")`
hand the data source its options as strings; `parse_source_options(options,
streaming)` runs when Spark asks `QServerDataSource` for a reader (on the
driver, before any message is consumed) and turns them into a frozen
`SourceOptions`, which the reader carries to wherever Spark runs it. A typo
or a value out of range fails the query at once, naming the option.

Rules:
- `hosts` is required, as for the sink.
- `queue` (one name) or `queues` (1 to 16 names, comma-separated, in the
  order a consume takes them), not both.
- Streaming only: `maxMessagesPerBatch` (the most messages one micro-batch
  consumes), `lease` (seconds a consumed message stays invisible to other
  consumers before it is delivered again unless the source confirms it),
  `wait` (seconds one consume may wait for a message when none is
  deliverable: a long poll), `deadLetterFields` (whether to ask the server
  for the dead-letter fields, which a consume's answer lacks: one show per
  message).
- Batch (`spark.read`) only: `count`, the messages peeked per queue (the
  server gives at most 1,000 per peek).
- `token`, `tls`, `tlsCa`, `timeout`: the client's, as for the sink.

No I/O here: this module only reads its arguments.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from .errors import OptionError
from .options import DEFAULT_TIMEOUT_S, MAX_QUEUE_NAME, _bool, _hosts, _number, connection_options

__all__ = [
    "SourceOptions",
    "parse_source_options",
    "SOURCE_OPTIONS",
    "DEFAULT_MAX_MESSAGES",
    "DEFAULT_LEASE_S",
    "DEFAULT_WAIT_S",
    "MAX_PEEK",
]

# Messages one micro-batch takes at most. Every message is named in the
# batch's offset (about 25 bytes of JSON each, written to the checkpoint's
# offset log, which keeps 100 batches by default), and a batch is one Spark
# job: 5,000 keeps the offset files near 125 KB while amortising the job's
# fixed cost (a few hundred ms on a small machine).
DEFAULT_MAX_MESSAGES = 5000

# The most a user may ask for: the driver holds a batch's messages in memory
# until Spark commits it.
MAX_MESSAGES = 1_000_000

# Seconds a consumed message stays leased. It must outlast one micro-batch
# (from the consume to the confirm after Spark commits the batch, see
# spark_integration/README.md); two minutes covers a slow first batch
# (executor start, JIT) on a loaded machine, and bounds how long messages of
# a query that stops for good stay invisible to other consumers.
DEFAULT_LEASE_S = 120.0

# Seconds one consume waits when nothing is deliverable. Spark asks the
# source for new data again 10 ms after an empty answer; a one-second long
# poll answers at once when a message arrives and keeps an idle query to one
# request a second. The query's stop() waits for the poll to end.
DEFAULT_WAIT_S = 1.0

# The server's limits: 1,000 messages per consume or peek, 16 queues per
# consume (qserver.wire.requests MAX_COUNT, MAX_QUEUES).
MAX_PEEK = 1000
MAX_QUEUES = 16

# Every option the source reads (keys compared lower-case).
SOURCE_OPTIONS = {
    "hosts": "host:port list, comma-separated (required)",
    "queue": "the queue to read",
    "queues": "queues to read, comma-separated (1 to 16), taken in that order",
    "maxMessagesPerBatch": f"streaming: the most messages per micro-batch "
                           f"(default {DEFAULT_MAX_MESSAGES})",
    "lease": f"streaming: seconds a consumed message stays leased before it is delivered "
             f"again unless confirmed; must outlast a micro-batch "
             f"(default {DEFAULT_LEASE_S:g})",
    "wait": f"streaming: seconds a consume waits for a message when none is deliverable "
            f"(default {DEFAULT_WAIT_S:g})",
    "deadLetterFields": "streaming: false: leave origin_queue, origin_msg_id and "
                        "dead_letter_reason null instead of looking each message up (show) "
                        "for them (default true)",
    "count": f"batch read: messages peeked per queue, 1 to {MAX_PEEK} (default {MAX_PEEK})",
    "timeout": f"seconds a node may stay silent (default {DEFAULT_TIMEOUT_S:g})",
    "token": "the client token, for nodes with <security>",
    "tls": "true: connect with TLS (default: false; implied by tlsCa)",
    "tlsCa": "CA bundle (PEM file where the driver and executors run) the nodes' "
             "certificates are checked against (default: the system's)",
}

_KNOWN = frozenset(k.lower() for k in SOURCE_OPTIONS)
_STREAMING_ONLY = frozenset({"maxmessagesperbatch", "lease", "wait", "deadletterfields"})
_BATCH_ONLY = frozenset({"count"})


@dataclass(frozen=True, slots=True, kw_only=True)
class SourceOptions:
    """The checked options of one read (see the module docstring)."""

    hosts: tuple[str, ...]
    queues: tuple[str, ...]  # 1 to 16, in consume order
    streaming: bool
    max_messages: int = DEFAULT_MAX_MESSAGES  # per micro-batch
    lease_s: float = DEFAULT_LEASE_S
    wait_s: float = DEFAULT_WAIT_S
    dead_letter_fields: bool = True  # show each consumed message for its dead-letter fields
    peek_count: int = MAX_PEEK  # per queue, batch reads
    timeout_s: float = DEFAULT_TIMEOUT_S
    token: str | None = field(default=None, repr=False)  # a secret: not in reprs or logs
    tls: bool = False
    tls_ca: str | None = None

    @property
    def client_options(self) -> dict[str, Any]:
        """The token and TLS keyword arguments of `qserver.client.Client`."""
        return {"token": self.token, "tls": self.tls, "tls_ca": self.tls_ca}


def parse_source_options(options: Mapping[str, str], streaming: bool) -> SourceOptions:
    """Check the source's options.

    Args:
        options: Spark's option map (keys compared lower-case).
        streaming: True for `spark.readStream`, False for `spark.read`.
    Returns:
        the typed options.
    Raises:
        OptionError naming the option and the problem.
    """
    try:
        return _parse(options, streaming)
    except OptionError as exc:  # options.py's helpers speak for the sink
        raise OptionError(exc.problem, "source") from None


def _parse(options: Mapping[str, str], streaming: bool) -> SourceOptions:
    opts = {str(k).lower(): v for k, v in options.items()}
    unknown = sorted(k for k in opts if k not in _KNOWN)
    if unknown:
        known = ", ".join(f"{k} ({v})" for k, v in SOURCE_OPTIONS.items())
        raise OptionError(f"unknown option(s) {unknown} for reading; the options are: {known}")
    misplaced = sorted(opts.keys() & (_BATCH_ONLY if streaming else _STREAMING_ONLY))
    if misplaced:
        name = {k.lower(): k for k in SOURCE_OPTIONS}
        where = ("spark.read (a peek)" if streaming else
                 "spark.readStream (consumes and confirms)")
        raise OptionError(f"option(s) {[name[k] for k in misplaced]} are for {where} only")

    hosts = _hosts(opts.get("hosts"))
    queues = _queues(opts)
    client = connection_options(opts)  # as the sink's
    if not streaming:
        count = _number(opts, "count", "count", MAX_PEEK, integer=True)
        if not 1 <= count <= MAX_PEEK:
            raise OptionError(f"option 'count' must be 1 to {MAX_PEEK} (a peek returns at "
                              f"most {MAX_PEEK} messages), not {count}")
        return SourceOptions(hosts=hosts, queues=queues, streaming=False,
                             peek_count=int(count), **client)

    max_messages = _number(opts, "maxmessagesperbatch", "maxMessagesPerBatch",
                           DEFAULT_MAX_MESSAGES, integer=True)
    if not 1 <= max_messages <= MAX_MESSAGES:
        raise OptionError(f"option 'maxMessagesPerBatch' must be 1 to {MAX_MESSAGES:,}, "
                          f"not {max_messages}")
    lease_s = _number(opts, "lease", "lease", DEFAULT_LEASE_S)
    if lease_s <= 0:
        raise OptionError(f"option 'lease' must be positive (seconds), not {lease_s:g}")
    wait_s = _number(opts, "wait", "wait", DEFAULT_WAIT_S)
    if wait_s < 0:
        raise OptionError(f"option 'wait' must not be negative, not {wait_s:g}")
    dead_letter_fields = _bool(opts, "deadletterfields", "deadLetterFields", True)
    return SourceOptions(hosts=hosts, queues=queues, streaming=True,
                         max_messages=int(max_messages), lease_s=lease_s, wait_s=wait_s,
                         dead_letter_fields=dead_letter_fields, **client)


def _queues(opts: dict) -> tuple[str, ...]:
    if "queue" in opts and "queues" in opts:
        raise OptionError("give option 'queue' (one queue) or 'queues' (several, "
                          "comma-separated), not both")
    if "queue" in opts:
        names = [str(opts["queue"])]
    elif "queues" in opts:
        names = [q.strip() for q in str(opts["queues"]).split(",")]
    else:
        raise OptionError("option 'queue' (or 'queues') is required: the queue to read, "
                          "e.g. .option(\"queue\", \"orders\")")
    for name in names:
        if not name or len(name) > MAX_QUEUE_NAME:
            raise OptionError(f"a queue name must be 1 to {MAX_QUEUE_NAME} characters, not "
                              f"{name!r}")
    if not 1 <= len(names) <= MAX_QUEUES:
        raise OptionError(f"option 'queues' names {len(names)} queues; a consume takes 1 to "
                          f"{MAX_QUEUES}")
    if len(set(names)) != len(names):
        raise OptionError(f"option 'queues' names a queue twice: {names}")
    return tuple(names)
