"""What differs between PySpark 4.0, 4.1, 4.2 and later: imported here so
that `import qserver_spark` works on every PySpark 4 release.

- `DataSourceStreamArrowWriter` (PySpark 4.1): a streaming writer that gets
  Arrow record batches. On 4.0 the streaming sink is a row writer
  (`DataSourceStreamWriter`, which gets `Row`s); `rows_to_batches` turns
  its rows into the record batches the sink's code takes. The batch writer
  (`DataSourceArrowWriter`) is in 4.0 already.
- `SupportsTriggerAvailableNow` (PySpark 4.2): a source that bounds what
  `Trigger.AvailableNow` reads. Before 4.2, an empty stand-in: Spark then
  wraps the source in its generic AvailableNow wrapper (it asks for one
  batch and stops).
- `latestOffset(start, limit)` (PySpark 4.2): before, the simple stream
  reader's wrapper passes its own last end offset (the initial offset after
  a restart) as `read`'s start; the source does not depend on `start`.

No I/O here.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterable, Iterator
from typing import Any

import pyarrow as pa
from pyspark.sql.types import (
    ArrayType,
    BinaryType,
    BooleanType,
    ByteType,
    DataType,
    DateType,
    DecimalType,
    DoubleType,
    FloatType,
    IntegerType,
    LongType,
    MapType,
    NullType,
    ShortType,
    StringType,
    StructType,
    TimestampNTZType,
    TimestampType,
)

from .errors import RowError

__all__ = ["DataSourceStreamArrowWriter", "HAS_STREAM_ARROW_WRITER",
           "SupportsTriggerAvailableNow", "rows_to_batches", "arrow_type"]

try:
    from pyspark.sql.datasource import DataSourceStreamArrowWriter
    HAS_STREAM_ARROW_WRITER = True
except ImportError:  # PySpark 4.0
    from pyspark.sql.datasource import (  # type: ignore[assignment]
        DataSourceStreamWriter as DataSourceStreamArrowWriter,
    )
    HAS_STREAM_ARROW_WRITER = False

try:
    from pyspark.sql.streaming.datasource import SupportsTriggerAvailableNow
except ImportError:  # PySpark 4.0, 4.1
    class SupportsTriggerAvailableNow:  # type: ignore[no-redef]
        """Stand-in: Trigger.AvailableNow support for sources is PySpark 4.2's."""

# Rows per record batch built from a row writer's rows (Spark's default
# spark.sql.execution.arrow.maxRecordsPerBatch).
ROWS_PER_BATCH = 10_000

_SIMPLE: dict[type, pa.DataType] = {
    StringType: pa.string(), BinaryType: pa.binary(), BooleanType: pa.bool_(),
    ByteType: pa.int8(), ShortType: pa.int16(), IntegerType: pa.int32(),
    LongType: pa.int64(), FloatType: pa.float32(), DoubleType: pa.float64(),
    DateType: pa.date32(), TimestampType: pa.timestamp("us", tz="UTC"),
    TimestampNTZType: pa.timestamp("us"), NullType: pa.null(),
}


def arrow_type(dtype: DataType) -> pa.DataType:
    """The Arrow type Spark gives a column of `dtype` (timestamps in UTC).

    Raises:
        RowError for a type the sink's row path does not take.
    """
    simple = _SIMPLE.get(type(dtype))
    if simple is not None:
        return simple
    if isinstance(dtype, DecimalType):
        return pa.decimal128(dtype.precision, dtype.scale)
    if isinstance(dtype, ArrayType):
        return pa.list_(arrow_type(dtype.elementType))
    if isinstance(dtype, MapType):
        return pa.map_(arrow_type(dtype.keyType), arrow_type(dtype.valueType))
    if isinstance(dtype, StructType):
        return pa.struct([pa.field(f.name, arrow_type(f.dataType)) for f in dtype.fields])
    raise RowError(f"a column of type {dtype.simpleString()} cannot be written by a streaming "
                   f"query on PySpark 4.0 (the row writer); cast it, or use PySpark 4.1 or "
                   f"later")


def _value(value: Any, dtype: DataType) -> Any:
    """A Row's value as pyarrow takes it for `arrow_type(dtype)`."""
    if value is None:
        return None
    if isinstance(dtype, TimestampType):
        # Spark gives a naive datetime in the worker's local time.
        return value.astimezone(dt.UTC) if value.tzinfo is None else value
    if isinstance(dtype, ArrayType):
        return [_value(v, dtype.elementType) for v in value]
    if isinstance(dtype, MapType):
        return [(_value(k, dtype.keyType), _value(v, dtype.valueType)) for k, v in value.items()]
    if isinstance(dtype, StructType):
        return {f.name: _value(v, f.dataType) for f, v in zip(dtype.fields, value)}
    return value


def rows_to_batches(rows: Iterable[Any], schema: StructType,
                    size: int = ROWS_PER_BATCH) -> Iterator[pa.RecordBatch]:
    """A row writer's rows (`Row`s, in `schema`'s column order) as Arrow
    record batches of up to `size` rows: what an Arrow writer would get."""
    fields = list(schema.fields)
    types = [arrow_type(f.dataType) for f in fields]
    arrow_schema = pa.schema([pa.field(f.name, t) for f, t in zip(fields, types)])
    chunk: list[Any] = []

    def batch() -> pa.RecordBatch:
        columns = [pa.array([_value(row[i], f.dataType) for row in chunk], t)
                   for i, (f, t) in enumerate(zip(fields, types))]
        return pa.RecordBatch.from_arrays(columns, schema=arrow_schema)

    for row in rows:
        chunk.append(row)
        if len(chunk) >= size:
            yield batch()
            chunk = []
    if chunk:
        yield batch()
