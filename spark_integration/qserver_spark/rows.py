"""Arrow record batches to produce items: the per-row work of the sink.

Theory of operation
-------------------
Spark hands a Python data source's writer the rows of a task as Arrow
record batches (the Arrow writer API). `batch_items(batch, opts)` turns one
record batch into a list of dicts, one per row: {"queue", "data"} and, where
set, "delay", "ttl", "retry", "priority", "dedup_id" (the produce items of
`qserver.client.Client.produce_many`). It works a
column at a time (one `to_pylist` per column, arithmetic on timestamps in
Arrow), then zips the columns into dicts: that costs a fraction of what
building a Spark `Row` per row would.

Values:
- queue: the constant, or the row's string; a null queue is an error.
- data: a string column as is; a binary column decoded as UTF-8; any other
  column type as JSON (a struct becomes an object); a null is an error.
  Without a data column, the row's other columns as one JSON object.
- delay, ttl: numbers as given (seconds relative to now below 1e9, absolute
  unix seconds above, the protocol's rule); a timestamp column as absolute
  unix seconds. retry: seconds. priority: an integer 0 .. 2^31-1. A null
  leaves the field out for that row.
- dedup_id: the dedup column's string (an integer in decimal), or the dedup
  key's columns joined with ':'; a null, an empty id or one over 128
  characters is an error (a row without its id would lose the guarantee the
  option was given for).
- JSON: timestamps in RFC 3339 with their offset, dates as YYYY-MM-DD,
  decimals as strings (no precision lost), binary as base64, maps as
  objects.

No I/O here.
"""

from __future__ import annotations

import base64
import datetime as dt
import decimal
from typing import Any

import orjson
import pyarrow as pa
import pyarrow.compute as pc

from .errors import RowError
from .options import MAX_DEDUP_ID, MAX_PRIORITY, SinkOptions, TimeSource

__all__ = ["batch_items", "row_json"]

# Arrow timestamp units per second.
_PER_SECOND = {"s": 1, "ms": 1_000, "us": 1_000_000, "ns": 1_000_000_000}

_JSON_OPTIONS = orjson.OPT_NON_STR_KEYS


def _json_default(value: object) -> object:
    if isinstance(value, decimal.Decimal):
        return str(value)
    if isinstance(value, (bytes, bytearray, memoryview)):
        return base64.b64encode(bytes(value)).decode("ascii")
    if isinstance(value, dt.timedelta):
        return value.total_seconds()
    raise TypeError(f"cannot encode {type(value).__name__} as JSON")


def row_json(value: object) -> str:
    """One value (a row as a dict, a struct, a number...) as JSON text."""
    return orjson.dumps(value, default=_json_default, option=_JSON_OPTIONS).decode()


def _seconds(column: pa.Array | pa.ChunkedArray, source: TimeSource) -> list:
    """A delay/ttl/retry column as a list of seconds (None for nulls)."""
    if source.is_timestamp:
        per_second = _PER_SECOND[column.type.unit]
        column = pc.divide(column.cast(pa.int64()).cast(pa.float64()), float(per_second))
    elif pa.types.is_decimal(column.type):
        column = column.cast(pa.float64())
    return column.to_pylist()


def _data(batch: pa.RecordBatch, opts: SinkOptions, first_row: int) -> list[str]:
    if opts.data_column is None:
        rows = batch.select(list(opts.json_columns)).to_pylist(maps_as_pydicts="lossy")
        return [row_json(row) for row in rows]
    column = batch.column(opts.data_column)
    name = opts.data_column
    kind = column.type
    values = column.to_pylist(maps_as_pydicts="lossy") if pa.types.is_map(kind) \
        else column.to_pylist()
    if column.null_count:
        at = values.index(None)
        raise RowError(f"row {first_row + at}: data column '{name}' is null")
    if pa.types.is_string(kind) or pa.types.is_large_string(kind):
        return values
    if pa.types.is_binary(kind) or pa.types.is_large_binary(kind):
        out = []
        for i, v in enumerate(values):
            try:
                out.append(v.decode("utf-8"))
            except UnicodeDecodeError:
                raise RowError(f"row {first_row + i}: data column '{name}' is not "
                               f"UTF-8 text") from None
        return out
    return [row_json(v) for v in values]


def _dedup_ids(batch: pa.RecordBatch, opts: SinkOptions, first_row: int) -> list[str]:
    parts = []
    for name in opts.dedup_columns:
        column = batch.column(name)
        if column.null_count:
            at = column.is_null().to_pylist().index(True)
            raise RowError(f"row {first_row + at}: dedup column '{name}' is null (every row "
                           f"needs its dedup id)")
        parts.append(column if pa.types.is_string(column.type) else column.cast(pa.string()))
    joined = parts[0] if len(parts) == 1 else pc.binary_join_element_wise(*parts, ":")
    lengths = pc.utf8_length(joined)
    if pc.max(lengths).as_py() > MAX_DEDUP_ID or pc.min(lengths).as_py() < 1:
        bad = pc.or_(pc.greater(lengths, MAX_DEDUP_ID), pc.less(lengths, 1))
        at = bad.to_pylist().index(True)
        what = "column '" + opts.dedup_columns[0] + "'" if len(parts) == 1 \
            else f"columns {list(opts.dedup_columns)}"
        raise RowError(f"row {first_row + at}: the dedup id from {what} is "
                       f"{lengths[at].as_py()} characters; the server takes 1 to "
                       f"{MAX_DEDUP_ID} (hash a long key into a column, e.g. with sha2, "
                       f"64 characters)")
    return joined.to_pylist()


def _priorities(batch: pa.RecordBatch, column: str, first_row: int) -> list[int | None]:
    values = batch.column(column).to_pylist()
    for i, value in enumerate(values):
        if value is not None and not 0 <= value <= MAX_PRIORITY:
            raise RowError(f"row {first_row + i}: priority column '{column}' holds {value}; "
                           f"a priority is 0 to {MAX_PRIORITY}")
    return values


def batch_items(batch: pa.RecordBatch, opts: SinkOptions, first_row: int = 0) -> list[dict]:
    """The produce items of one record batch, in row order.

    Args:
        batch: rows from Spark, with every column `opts` names.
        opts: the checked sink options.
        first_row: the batch's first row's position in the task (for errors).
    Returns:
        one dict per row: the produce items of `Client.produce_many`.
    Raises:
        RowError for a row that cannot become a message.
    """
    data = _data(batch, opts, first_row)
    items: list[dict[str, Any]]
    if opts.queue is not None:
        queue = opts.queue
        items = [{"queue": queue, "data": d} for d in data]
    else:
        column = batch.column(opts.queue_column)
        if column.null_count:
            at = column.to_pylist().index(None)
            raise RowError(f"row {first_row + at}: queue column '{opts.queue_column}' is null")
        items = [{"queue": q, "data": d} for q, d in zip(column.to_pylist(), data)]
    for key, source in (("delay", opts.delay), ("ttl", opts.ttl), ("retry", opts.retry)):
        if source.constant is not None:
            value = source.constant
            for item in items:
                item[key] = value
        elif source.column is not None:
            values = _seconds(batch.column(source.column), source)
            for item, value in zip(items, values):
                if value is not None:
                    item[key] = value
    if opts.priority is not None:
        for item in items:
            item["priority"] = opts.priority
    elif opts.priority_column is not None:
        priorities = _priorities(batch, opts.priority_column, first_row)
        for item, priority in zip(items, priorities):
            if priority is not None:
                item["priority"] = priority
    if opts.dedup_columns:
        for item, dedup_id in zip(items, _dedup_ids(batch, opts, first_row)):
            item["dedup_id"] = dedup_id
    return items
