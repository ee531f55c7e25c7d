"""The sink's options: parsed and checked once, on the driver.

Theory of operation
-------------------
Spark hands a data source its options as a case-insensitive map of strings
(`.option("hosts", ...)`). `parse_options(options, schema)` runs on the
driver when Spark asks `QServerDataSource` for a writer, before any task
starts: every option is turned into a typed value and every column it names
is looked up in the DataFrame's schema, so that a typo or a column of the
wrong type fails the query at once with a message that names the option,
instead of failing every task later. The result, a frozen `SinkOptions`, is
pickled to the executors with the writer.

Rules, in the style of Spark's Kafka sink:
- `hosts` is required: "host:port" list, comma-separated.
- The queue is the `queue` option if given (it overrides a queue column, as
  Kafka's `topic` option overrides a `topic` column), else the string
  column named by `queueColumn` (default "queue").
- The message body is the `dataColumn` column (default "data"); without
  such a column, or with `rowAsJson=true`, it is the row as a JSON object,
  without the columns the sink reads the queue and the times from.
- `delay`, `ttl`, `retry`, `priority` are each either a constant (the
  option) or a per-row column (`delayColumn`, ...), never both. A null in a
  column means "not set" for that row (delay: now; ttl: the server's
  default; retry: 0; priority: the server's default, 1024).
- The dedup id of a row is the string column `dedupColumn`, or the values
  of the columns `dedupKey` lists, joined with ':'. Only columns: the data
  source API hands `writer()` the schema and the options, not the DataFrame,
  so the sink cannot evaluate a SQL expression; an expression becomes a
  column first (`df.withColumn("dedup_id", F.expr(...))`). Dedup columns stay
  in the row's JSON (a consumer usually needs the key); the queue, time and
  priority columns do not.
- `batchProduce` (default true): one produce request per up to `batchSize`
  rows of one queue (`messages`); false: one request per row, pipelined
  (for a server without batch produce, and as the bench's baseline).
- `token`, `tls`, `tlsCa`: the client's token (nodes with `<security>`) and
  TLS (nodes with `<tls>`), passed to `qserver.client.Client` on every
  executor; `tlsCa` (a PEM file that must exist where the tasks run)
  implies `tls`. Spark redacts options named like "token" in its UI.

No I/O here: this module only reads its arguments.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from pyspark.sql.types import (
    DataType,
    DecimalType,
    DoubleType,
    FloatType,
    IntegralType,
    StringType,
    StructType,
    TimestampNTZType,
    TimestampType,
)

from .errors import OptionError

__all__ = [
    "SinkOptions",
    "PIPELINE_WINDOW",
    "connection_options",
    "TimeSource",
    "parse_options",
    "DEFAULT_BATCH_SIZE",
    "DEFAULT_TIMEOUT_S",
    "MAX_BATCH_SIZE",
    "MAX_BATCH_MESSAGES",
    "MAX_DEDUP_ID",
    "MAX_PRIORITY",
    "OPTIONS",
]

# Rows per batch produce request (or, with batchProduce=false, per pipelined
# `produce_many` call): the most one request may carry, so that a task sends
# as few requests, and the master appends as few log entries, as it can.
DEFAULT_BATCH_SIZE = 1000

# The server's limit on the messages of one batch produce (README, Batch produce: a
# `messages` list holds 1 to 1000).
MAX_BATCH_MESSAGES = 1000

# With batchProduce=false: more gains nothing (the pipeline is full long
# before) and costs memory.
MAX_BATCH_SIZE = 100_000

# The server's bounds (README, Protocol): a priority is 0 .. 2^31-1, a dedup_id 1 to
# 128 characters.
MAX_PRIORITY = 2**31 - 1
MAX_DEDUP_ID = 128

# Seconds one node may stay silent before the task's client resends its
# unanswered produces to another node: the client's own default.
DEFAULT_TIMEOUT_S = 5.0

# Queue names the server accepts (qserver.wire.requests.MAX_QUEUE_NAME).
MAX_QUEUE_NAME = 255

# Every option the sink reads, with what it means (for the error on an
# unknown one). Spark's option map is case-insensitive: keys are compared
# lower-case.
OPTIONS = {
    "hosts": "host:port list, comma-separated (required)",
    "queue": "the queue of every row",
    "queueColumn": "the string column holding each row's queue (default: queue)",
    "dataColumn": "the column holding each row's message (default: data)",
    "rowAsJson": "true: the message is the row as JSON (default: false)",
    "delay": "seconds (relative, or absolute unix time) for every row",
    "delayColumn": "the column holding each row's delay (number or timestamp)",
    "ttl": "seconds (relative, or absolute unix time) for every row",
    "ttlColumn": "the column holding each row's ttl (number or timestamp)",
    "retry": "retry seconds for every row (0: at-most-once)",
    "retryColumn": "the column holding each row's retry seconds",
    "priority": f"the priority of every row, 0 to {MAX_PRIORITY}, lower first (default 1024)",
    "priorityColumn": "the integer column holding each row's priority",
    "dedupColumn": "the string (or integer) column holding each row's dedup id",
    "dedupKey": "columns, comma-separated, whose values joined with ':' make the dedup id",
    "batchProduce": "false: one produce request per row instead of batches (default: true)",
    "batchSize": f"rows per produce request (default {DEFAULT_BATCH_SIZE})",
    "timeout": f"seconds a node may stay silent (default {DEFAULT_TIMEOUT_S:g})",
    "token": "the client token, for nodes with <security>",
    "tls": "true: connect with TLS (default: false; implied by tlsCa)",
    "tlsCa": "CA bundle (PEM file on every executor) the nodes' certificates are checked "
             "against (default: the system's)",
}

# Options Spark itself may put in the map; they mean nothing to the sink.
_SPARK_OPTIONS = frozenset({"path", "checkpointlocation"})

_KNOWN = frozenset(k.lower() for k in OPTIONS) | _SPARK_OPTIONS

_TRUE = frozenset({"true", "1", "yes"})
_FALSE = frozenset({"false", "0", "no"})


# Requests a sink task or the source keeps in flight on its connection
# (produces; confirms and shows). Enough to hide the round trip to the
# master and its quorum commit; a larger window only queues more requests
# at the master at once, and on the
# 2-core machines measured a window of 1000 per task gave 0.4 to 0.6 of the
# rows/s of 200 (the three nodes spent more CPU per row as their replication
# batches grew). See bench/spark_bench.py.
PIPELINE_WINDOW = 200

@dataclass(frozen=True, slots=True, kw_only=True)
class TimeSource:
    """Where one of delay/ttl/retry comes from: a constant, or a column."""

    constant: float | None = None  # seconds, as given (None: not set)
    column: str | None = None  # the column holding it per row
    is_timestamp: bool = False  # the column is a Spark timestamp (absolute time)


@dataclass(frozen=True, slots=True, kw_only=True)
class SinkOptions:
    """The checked options of one write (see the module docstring)."""

    hosts: tuple[str, ...]
    queue: str | None  # the constant queue, or None: queue_column holds it
    queue_column: str | None
    data_column: str | None  # None: the row as JSON
    json_columns: tuple[str, ...]  # the row's columns that go into the JSON
    delay: TimeSource
    ttl: TimeSource
    retry: TimeSource
    priority: int | None = None  # every row's priority (None: the server's default)
    priority_column: str | None = None  # the column holding it per row
    dedup_columns: tuple[str, ...] = ()  # their values joined with ':' (empty: no dedup id)
    batch_produce: bool = True  # False: one produce request per row
    batch_size: int
    timeout_s: float
    token: str | None = field(default=None, repr=False)  # a secret: not in reprs or logs
    tls: bool = False
    tls_ca: str | None = None

    @property
    def client_options(self) -> dict[str, Any]:
        """The token and TLS keyword arguments of `qserver.client.Client`."""
        return {"token": self.token, "tls": self.tls, "tls_ca": self.tls_ca}

    @property
    def columns(self) -> tuple[str, ...]:
        """Every column the writer reads, in a fixed order."""
        used = [self.queue_column, self.data_column, self.delay.column, self.ttl.column,
                self.retry.column, self.priority_column, *self.dedup_columns]
        return tuple(dict.fromkeys([c for c in used if c] + list(self.json_columns)))


def parse_options(options: Mapping[str, str], schema: StructType) -> SinkOptions:
    """Check the sink's options against the DataFrame's schema.

    Args:
        options: Spark's option map (keys compared lower-case).
        schema: the schema of the rows to be written.
    Returns:
        the typed options.
    Raises:
        OptionError naming the option and the problem.
    """
    opts = {str(k).lower(): v for k, v in options.items()}
    unknown = sorted(k for k in opts if k not in _KNOWN)
    if unknown:
        known = ", ".join(f"{k} ({v})" for k, v in OPTIONS.items())
        raise OptionError(f"unknown option(s) {unknown}; the options are: {known}")
    types = {f.name: f.dataType for f in schema.fields}

    hosts = _hosts(opts.get("hosts"))

    queue = opts.get("queue")
    queue_column = None
    if queue is not None:
        if not queue or len(queue) > MAX_QUEUE_NAME:
            raise OptionError(f"option 'queue' must be 1 to {MAX_QUEUE_NAME} characters")
    else:
        queue_column = opts.get("queuecolumn", "queue")
        if queue_column not in types:
            raise OptionError(
                f"no queue: set option 'queue', or give the rows a string column "
                f"'{queue_column}' (option 'queueColumn' names another); columns: "
                f"{sorted(types)}")
        if not isinstance(types[queue_column], StringType):
            raise OptionError(f"queue column '{queue_column}' must be a string, not "
                              f"{types[queue_column].simpleString()}")

    delay = _time_source(opts, "delay", types, timestamps=True)
    ttl = _time_source(opts, "ttl", types, timestamps=True)
    retry = _time_source(opts, "retry", types, timestamps=False)
    priority, priority_column = _priority(opts, types)
    dedup_columns = _dedup_columns(opts, types)

    row_as_json = _bool(opts, "rowasjson", "rowAsJson", False)
    data_column = opts.get("datacolumn")
    if data_column is not None and data_column not in types:
        raise OptionError(f"option 'dataColumn': no column '{data_column}'; columns: "
                          f"{sorted(types)}")
    if data_column is None and not row_as_json and "data" in types:
        data_column = "data"
    if row_as_json:
        data_column = None
    json_columns: tuple[str, ...] = ()
    if data_column is None:
        control = {queue_column, delay.column, ttl.column, retry.column, priority_column}
        json_columns = tuple(f.name for f in schema.fields if f.name not in control)
        if not json_columns:
            raise OptionError("the message would be an empty JSON object: the rows have no "
                              "column besides the queue, time and priority columns")

    batch_produce = _bool(opts, "batchproduce", "batchProduce", True)
    batch_size = _number(opts, "batchsize", "batchSize", DEFAULT_BATCH_SIZE, integer=True)
    if batch_produce and not 1 <= batch_size <= MAX_BATCH_MESSAGES:
        raise OptionError(f"option 'batchSize' must be 1 to {MAX_BATCH_MESSAGES} (rows per "
                          f"batch produce request: the server takes at most "
                          f"{MAX_BATCH_MESSAGES} messages in one), not {batch_size}")
    if not 1 <= batch_size <= MAX_BATCH_SIZE:
        raise OptionError(f"option 'batchSize' must be 1 to {MAX_BATCH_SIZE}, not {batch_size}")
    return SinkOptions(hosts=hosts, queue=queue, queue_column=queue_column,
                       data_column=data_column, json_columns=json_columns, delay=delay,
                       ttl=ttl, retry=retry, priority=priority, priority_column=priority_column,
                       dedup_columns=dedup_columns, batch_produce=batch_produce,
                       batch_size=int(batch_size), **connection_options(opts))


def connection_options(opts: dict[str, str]) -> dict[str, Any]:
    """The options of the connections to qserver, the sink's and the
    source's (`opts` with lower-case keys), checked: the `timeout_s`,
    `token`, `tls` and `tls_ca` fields of their options. Raises
    OptionError."""
    timeout_s = _number(opts, "timeout", "timeout", DEFAULT_TIMEOUT_S)
    if timeout_s <= 0:
        raise OptionError(f"option 'timeout' must be positive, not {timeout_s:g}")
    token = opts.get("token")
    if token is not None and (not token or any(c.isspace() for c in token)):
        raise OptionError("option 'token' must be a non-empty string without white space")
    tls_ca = opts.get("tlsca")
    if tls_ca is not None and not tls_ca.strip():
        raise OptionError("option 'tlsCa' must be a file path")
    tls = _bool(opts, "tls", "tls", False) or tls_ca is not None
    return {"timeout_s": timeout_s, "token": token, "tls": tls, "tls_ca": tls_ca}


def _hosts(value: str | None) -> tuple[str, ...]:
    if value is None or not value.strip():
        raise OptionError("option 'hosts' is required: the cluster's client addresses, "
                          "e.g. .option(\"hosts\", \"127.0.0.1:1111,127.0.0.1:1112\")")
    hosts = []
    for part in value.split(","):
        part = part.strip()
        host, sep, port = part.rpartition(":")
        if not sep or not host or not port.isascii() or not port.isdigit() \
                or not 0 < int(port) < 65536:
            raise OptionError(f"option 'hosts': {part!r} is not host:port "
                              f"(port 1 to 65535)")
        hosts.append(f"{host}:{int(port)}")
    return tuple(hosts)


def _bool(opts: dict, key: str, name: str, default: bool) -> bool:
    value = opts.get(key)
    if value is None:
        return default
    text = str(value).strip().lower()
    if text in _TRUE:
        return True
    if text in _FALSE:
        return False
    raise OptionError(f"option '{name}' must be true or false, not {value!r}")


def _number(opts: dict, key: str, name: str, default: float, integer: bool = False) -> float:
    value = opts.get(key)
    if value is None:
        return default
    try:
        number = int(value) if integer else float(value)
    except (TypeError, ValueError):
        kind = "an integer" if integer else "a number"
        raise OptionError(f"option '{name}' must be {kind}, not {value!r}") from None
    if not math.isfinite(number):
        raise OptionError(f"option '{name}' must be finite, not {value!r}")
    return number


def _time_source(opts: dict, key: str, types: dict[str, DataType], timestamps: bool) -> TimeSource:
    column_key = f"{key}column"
    if key in opts and column_key in opts:
        raise OptionError(f"give option '{key}' (one value for every row) or "
                          f"'{key}Column' (a column), not both")
    if key in opts:
        value = _number(opts, key, key, 0.0)
        if value < 0:
            raise OptionError(f"option '{key}' must not be negative, not {value:g}")
        return TimeSource(constant=value)
    column = opts.get(column_key)
    if column is None:
        return TimeSource()
    if column not in types:
        raise OptionError(f"option '{key}Column': no column '{column}'; columns: {sorted(types)}")
    dtype = types[column]
    if isinstance(dtype, (IntegralType, FloatType, DoubleType, DecimalType)):
        return TimeSource(column=column)
    if timestamps and isinstance(dtype, TimestampType):
        return TimeSource(column=column, is_timestamp=True)
    if timestamps and isinstance(dtype, TimestampNTZType):
        raise OptionError(f"{key} column '{column}' is a timestamp without time zone, which "
                          f"names no instant; cast it to timestamp")
    kinds = "a number of seconds or a timestamp" if timestamps else "a number of seconds"
    raise OptionError(f"{key} column '{column}' must be {kinds}, not {dtype.simpleString()}")



def _priority(opts: dict, types: dict[str, DataType]) -> tuple[int | None, str | None]:
    """The `priority` constant or the `priorityColumn` column (not both)."""
    if "priority" in opts and "prioritycolumn" in opts:
        raise OptionError("give option 'priority' (one value for every row) or "
                          "'priorityColumn' (a column), not both")
    if "priority" in opts:
        value = opts["priority"]
        try:
            priority = int(str(value).strip())
        except ValueError:
            priority = -1
        if not 0 <= priority <= MAX_PRIORITY:
            raise OptionError(f"option 'priority' must be an integer from 0 to {MAX_PRIORITY} "
                              f"(lower is delivered first), not {value!r}")
        return priority, None
    column = opts.get("prioritycolumn")
    if column is None:
        return None, None
    if column not in types:
        raise OptionError(f"option 'priorityColumn': no column '{column}'; columns: "
                          f"{sorted(types)}")
    if not isinstance(types[column], IntegralType):
        raise OptionError(f"priority column '{column}' must be an integer, not "
                          f"{types[column].simpleString()}")
    return None, column


def _dedup_columns(opts: dict, types: dict[str, DataType]) -> tuple[str, ...]:
    """The columns a row's dedup id is made of: `dedupColumn`, or the
    comma-separated `dedupKey` (not both); each a string or an integer."""
    if "dedupcolumn" in opts and "dedupkey" in opts:
        raise OptionError("give option 'dedupColumn' (a column holding the dedup id) or "
                          "'dedupKey' (columns making it), not both")
    if "dedupcolumn" in opts:
        name, columns = "dedupColumn", [opts["dedupcolumn"]]
    elif "dedupkey" in opts:
        name, columns = "dedupKey", [c.strip() for c in str(opts["dedupkey"]).split(",")]
    else:
        return ()
    for column in columns:
        if column not in types:
            hint = ""
            if name == "dedupKey":
                hint = (" (dedupKey takes column names separated by commas, whose values are "
                        "joined with ':'. The sink sees the schema, not the DataFrame, so it "
                        "cannot evaluate an expression: add it as a column first, e.g. "
                        "df.withColumn(\"dedup_id\", F.expr(\"concat(order_id, ':', "
                        "version)\")), and set option 'dedupColumn')")
            raise OptionError(f"option '{name}': no column {column!r}; columns: "
                              f"{sorted(types)}{hint}")
        dtype = types[column]
        if not isinstance(dtype, (StringType, IntegralType)):
            raise OptionError(f"dedup column '{column}' must be a string or an integer, not "
                              f"{dtype.simpleString()}; cast it (or format it) to a string "
                              f"column first")
    if len(set(columns)) != len(columns):
        raise OptionError(f"option '{name}' names a column twice: {columns}")
    return tuple(columns)
