"""qserver_spark: the "qserver" sink and source for PySpark 4's Python data
source API.

    import qserver_spark
    spark.dataSource.register(qserver_spark.QServerDataSource)  # unless found (below)
    df.write.format("qserver").option("hosts", "127.0.0.1:1111").option("queue", "q") \\
        .mode("append").save()
    stream = (spark.readStream.format("qserver").option("hosts", "127.0.0.1:1111")
              .option("queue", "q").load())        # consumed, confirmed on commit
    peeked = spark.read.format("qserver").option("hosts", "127.0.0.1:1111") \\
        .option("queue", "q").load()               # what peek sees, nothing consumed

PySpark finds the source without `register` when the `pyspark_qserver`
module (installed with this package) is on the Python path of Spark's
workers: it imports every top-level `pyspark_*` module with a
`DefaultSource`.

Modules: `options` (the sink's options, checked on the driver), `rows`
(Arrow record batches to produce items), `wire` (produce items to batch
produce requests, answers to counts), `datasource` (the data source, its
batch and streaming writers, the commit message), `source` (the streaming
and batch readers), `source_options`, `offsets` (a micro-batch's offset:
the messages it consumed), `messages` (messages to Arrow rows), `leaders`
(the master, looked up once per worker process), `report` (the log that
reaches the driver's stderr), `errors`.
"""

from .datasource import (
    QServerCommitMessage,
    QServerDataSource,
    QServerStreamRowWriter,
    QServerStreamWriter,
    QServerWriter,
    WriteSummary,
    summarize,
)
from .errors import OptionError, RowError, SinkError, SourceError, WriteError
from .messages import SCHEMA
from .offsets import BatchOffset, MessageRef
from .options import OPTIONS, SinkOptions, parse_options
from .source import QServerBatchReader, QServerStreamReader
from .source_options import SOURCE_OPTIONS, SourceOptions, parse_source_options

__all__ = [
    "QServerDataSource",
    "QServerWriter",
    "QServerStreamWriter",
    "QServerStreamRowWriter",
    "QServerStreamReader",
    "QServerBatchReader",
    "SCHEMA",
    "BatchOffset",
    "MessageRef",
    "SourceOptions",
    "parse_source_options",
    "SOURCE_OPTIONS",
    "SourceError",
    "QServerCommitMessage",
    "WriteSummary",
    "summarize",
    "SinkOptions",
    "parse_options",
    "OPTIONS",
    "SinkError",
    "OptionError",
    "RowError",
    "WriteError",
]
