"""qserver_spark: the "qserver" sink for PySpark 4's Python data source API.

    import qserver_spark
    spark.dataSource.register(qserver_spark.QServerDataSource)
    df.write.format("qserver").option("hosts", "127.0.0.1:1111").option("queue", "q") \\
        .mode("append").save()

Modules: `options` (the options, checked on the driver), `rows` (Arrow
record batches to produce items), `wire` (produce items to batch produce
requests, answers to counts), `datasource` (the data source, its batch and
streaming writers, the commit message), `errors`.
"""

from .datasource import (
    QServerCommitMessage,
    QServerDataSource,
    QServerStreamWriter,
    QServerWriter,
    WriteSummary,
    summarize,
)
from .errors import OptionError, RowError, SinkError, WriteError
from .options import OPTIONS, SinkOptions, parse_options

__all__ = [
    "QServerDataSource",
    "QServerWriter",
    "QServerStreamWriter",
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
