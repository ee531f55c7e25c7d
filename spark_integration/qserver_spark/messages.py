"""Messages from the server to the source's rows: no I/O.

Theory of operation
-------------------
The source hands Spark its rows as Arrow record batches (cheaper than a
tuple per row, which Spark would convert value by value). One schema serves
both reads, since a data source has one `schema()`:

- queue (string): the queue the message came from (or was peeked in);
- msg_id (bigint), data (string): the message;
- deliveries (int): streaming, this delivery's count (1 the first time);
  batch, the deliveries so far;
- origin_queue (string), origin_msg_id (bigint), dead_letter_reason
  (string): for a dead letter, where it came from and why (`max_deliveries`
  or `expired`); null for other messages, and in a streaming read for those
  the source did not look up (option deadLetterFields);
- priority, nacks (int), ready_at, expires_at (timestamp): batch reads only
  (null in a streaming read): the priority, the nacks so far, when the
  message became deliverable and when it expires (its ttl).

A consume's answer carries queue, msg_id, data, deliveries and the receipt;
everything else comes from show (action 11) or peek (action 12), which give
a message "view": {msg_id, state, data, priority, ready_at, ttl, retry,
retry_at, deliveries, nacks} and, for a dead letter, origin_queue,
origin_msg_id, dead_letter_reason (times in unix seconds).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import pyarrow as pa
from pyspark.sql.types import (
    IntegerType,
    LongType,
    StringType,
    StructField,
    StructType,
    TimestampType,
)

from qserver.client.core import Message

__all__ = ["SCHEMA", "ARROW_SCHEMA", "COLUMNS", "delivered_batch", "viewed_batch"]

SCHEMA = StructType([
    StructField("queue", StringType()),
    StructField("msg_id", LongType()),
    StructField("data", StringType()),
    StructField("deliveries", IntegerType()),
    StructField("origin_queue", StringType()),
    StructField("origin_msg_id", LongType()),
    StructField("dead_letter_reason", StringType()),
    StructField("priority", IntegerType()),
    StructField("ready_at", TimestampType()),
    StructField("expires_at", TimestampType()),
    StructField("nacks", IntegerType()),
])

# What Spark expects of a record batch for SCHEMA (its to_arrow_schema with
# timestamps in UTC; PySpark 4.3 checks the batches against it).
ARROW_SCHEMA = pa.schema([
    pa.field("queue", pa.string()),
    pa.field("msg_id", pa.int64()),
    pa.field("data", pa.string()),
    pa.field("deliveries", pa.int32()),
    pa.field("origin_queue", pa.string()),
    pa.field("origin_msg_id", pa.int64()),
    pa.field("dead_letter_reason", pa.string()),
    pa.field("priority", pa.int32()),
    pa.field("ready_at", pa.timestamp("us", tz="UTC")),
    pa.field("expires_at", pa.timestamp("us", tz="UTC")),
    pa.field("nacks", pa.int32()),
])

COLUMNS = tuple(SCHEMA.fieldNames())

_DEAD_LETTER = ("origin_queue", "origin_msg_id", "dead_letter_reason")


def _micros(seconds: object) -> int | None:
    """Unix seconds (as the server gives them) as Arrow microseconds."""
    if isinstance(seconds, (int, float)) and not isinstance(seconds, bool) and seconds > 0:
        return round(seconds * 1_000_000)
    return None


def _batch(columns: dict[str, list[Any]]) -> pa.RecordBatch:
    return pa.RecordBatch.from_arrays(
        [pa.array(columns[f.name], f.type) for f in ARROW_SCHEMA], schema=ARROW_SCHEMA)


def delivered_batch(messages: Sequence[Message],
                    shown: Mapping[tuple[str, int], Mapping[str, Any]] | None = None
                    ) -> pa.RecordBatch:
    """The rows of consumed messages, in delivery order; `shown` holds the
    views of those the source looked up (for their dead-letter fields)."""
    shown = shown or {}
    views = [shown.get((m.queue, m.msg_id), {}) for m in messages]
    columns: dict[str, list[Any]] = {
        "queue": [m.queue for m in messages],
        "msg_id": [m.msg_id for m in messages],
        "data": [m.data for m in messages],
        "deliveries": [m.deliveries for m in messages],
    }
    for name in _DEAD_LETTER:
        columns[name] = [v.get(name) for v in views]
    for name in ("priority", "ready_at", "expires_at", "nacks"):
        columns[name] = [None] * len(messages)
    return _batch(columns)


def viewed_batch(items: Iterable[tuple[str, Mapping[str, Any]]], *,
                 peek_fields: bool = True) -> pa.RecordBatch:
    """The rows of message views (show or peek), each with its queue.
    `peek_fields` False: priority, ready_at, expires_at and nacks stay null,
    as in a streaming row (a replayed micro-batch reads its messages with
    show and gives the rows the consume gave)."""
    pairs = list(items)
    views = [v for _, v in pairs]
    columns: dict[str, list[Any]] = {
        "queue": [q for q, _ in pairs],
        "msg_id": [v["msg_id"] for v in views],
        "data": [v["data"] for v in views],
        "deliveries": [v.get("deliveries") for v in views],
    }
    for name in _DEAD_LETTER:
        columns[name] = [v.get(name) for v in views]
    if peek_fields:
        columns["priority"] = [v.get("priority") for v in views]
        columns["ready_at"] = [_micros(v.get("ready_at")) for v in views]
        columns["expires_at"] = [_micros(v.get("ttl")) for v in views]
        columns["nacks"] = [v.get("nacks") for v in views]
    else:
        for name in ("priority", "ready_at", "expires_at", "nacks"):
            columns[name] = [None] * len(views)
    return _batch(columns)
