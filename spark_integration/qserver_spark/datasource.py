"""`QServerDataSource`: the "qserver" sink for Spark's Python data source API.

    spark.dataSource.register(QServerDataSource)
    (df.write.format("qserver")
       .option("hosts", "127.0.0.1:1111,127.0.0.1:1112")
       .option("queue", "orders")
       .mode("append").save())

Theory of operation
-------------------
Spark calls `writer()` (batch) or `streamWriter()` (streaming) on the driver,
in a Python worker, once per write or query. That is where the options are
checked against the DataFrame's schema (`options.parse_options`), so bad
options fail the query before any task starts. The writer, holding only the
checked options, is pickled to the executors.

Each task calls `write()` with its rows as Arrow record batches. A task
opens one TCP connection (`qserver.client.Client`, with every host so it
can fail over), turns its rows into produce items (`rows.batch_items`) and
sends them `batchSize` at a time with `produce_many`, which pipelines a
batch on the connection and waits for every answer before the next batch.
The task returns a `QServerCommitMessage` with its counts; the driver's
`commit()` adds them up and logs the totals.

Delivery: at-least-once. A produce is answered once it is committed by the
cluster; nothing a task wrote can be taken back. When a task fails and Spark
runs it again (or a streaming micro-batch is replayed after a restart), the
rows it had written before failing are written again. The client also
resends the unanswered produces of a batch when a node fails, so a produce
whose answer was lost may be stored twice. The server keeps no
deduplication key; a consumer that must act once deduplicates on a natural
key carried in the data (see spark_integration/README.md).
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field

import pyarrow as pa
from pyspark.sql.datasource import (
    DataSource,
    DataSourceArrowWriter,
    DataSourceStreamArrowWriter,
    WriterCommitMessage,
)
from pyspark.sql.types import StructType

from qserver.client import Client
from qserver.errors import QServerClientError

from .errors import OptionError, WriteError
from .options import SinkOptions, parse_options
from .rows import batch_items

__all__ = [
    "QServerDataSource",
    "QServerWriter",
    "QServerStreamWriter",
    "QServerCommitMessage",
    "WriteSummary",
    "summarize",
    "write_rows",
]

log = logging.getLogger("qserver_spark")

# Produce requests a task keeps in flight on its connection (the client's
# pipelining window), whatever the batch size. Enough to hide the round trip
# to the master and its quorum commit; a larger window only queues more
# requests at the master at once, and on the 2-core machines measured a
# window of 1000 per task gave 0.4 to 0.6 of the rows/s of 200 (the three
# nodes spent more CPU per row as their replication batches grew). See
# bench/spark_bench.py.
PIPELINE_WINDOW = 200

# Addresses a server listens on that a client cannot connect to as such.
_WILDCARD_HOSTS = frozenset({"0.0.0.0", "::", "[::]"})


@dataclass(frozen=True)
class QServerCommitMessage(WriterCommitMessage):
    """What one task wrote (pickled back to the driver)."""

    rows: int  # rows produced, each acknowledged by the cluster
    batches: int  # produce_many calls
    queues: dict[str, int] = field(default_factory=dict)  # rows per queue
    seconds: float = 0.0  # the task's time from its first row to its last answer


@dataclass(frozen=True)
class WriteSummary:
    """The totals of a write (or of one streaming micro-batch)."""

    tasks: int  # tasks that reported
    failed_tasks: int  # tasks without a commit message (failed)
    rows: int
    batches: int
    queues: dict[str, int]

    def describe(self) -> str:
        queues = ", ".join(f"{q}: {n}" for q, n in sorted(self.queues.items())) or "none"
        failed = f", {self.failed_tasks} failed" if self.failed_tasks else ""
        return (f"{self.rows} rows in {self.batches} batches from {self.tasks} tasks{failed} "
                f"(per queue: {queues})")


def summarize(messages: list[WriterCommitMessage | None]) -> WriteSummary:
    """Add up the tasks' commit messages; None stands for a failed task."""
    rows = batches = tasks = failed = 0
    queues: Counter[str] = Counter()
    for m in messages:
        if isinstance(m, QServerCommitMessage):
            tasks += 1
            rows += m.rows
            batches += m.batches
            queues.update(m.queues)
        else:
            failed += 1
    return WriteSummary(tasks=tasks, failed_tasks=failed, rows=rows, batches=batches,
                        queues=dict(queues))


def master_first(opts: SinkOptions) -> list[str]:
    """The hosts with the master's client address first.

    A slave forwards every produce to the master and relays the answer,
    which costs the cluster CPU on two nodes per row; going to the master
    directly saves that (bench/spark_bench.py). The other hosts stay in the
    list for failover. A master that reports a wildcard address (it listens
    on every interface) names no host to connect to: the hosts stay as given.

    Raises:
        QServerClientError when no node answers (after the client's retries).
    """
    hosts = list(opts.hosts)
    with Client(hosts, timeout=opts.timeout_s) as client:
        leader = client.leader()
    host, port = leader.get("leader_host"), leader.get("leader_port")
    if not host or host in _WILDCARD_HOSTS or not port:
        return hosts
    address = f"{host}:{port}"
    return [address] + [h for h in hosts if h != address]


def write_rows(record_batches: Iterator[pa.RecordBatch], opts: SinkOptions
               ) -> QServerCommitMessage:
    """Produce every row of one task over one connection, `batch_size` rows
    per pipelined `produce_many`; returns the task's counts.

    Raises:
        RowError for a row that cannot become a message (nothing of its
            batch is sent).
        WriteError when the client gives up on a batch; rows of earlier
            batches stay written.
    """
    start = time.monotonic()
    size = opts.batch_size
    rows = batches = seen = 0
    queues: Counter[str] = Counter()
    pending: list[dict] = []
    try:
        hosts = master_first(opts)
    except QServerClientError as exc:
        raise WriteError(f"qserver sink: no node of {list(opts.hosts)} told which node is "
                         f"master: {exc}. Nothing was written by this task.") from exc
    with Client(hosts, timeout=opts.timeout_s) as client:

        def send(chunk: list[dict]) -> None:
            nonlocal rows, batches
            try:
                client.produce_many(chunk, window=PIPELINE_WINDOW)
            except QServerClientError as exc:
                raise WriteError(
                    f"qserver sink: this task wrote {rows} rows, then a batch of {len(chunk)} "
                    f"failed: {exc}. The rows written stay in their queues; when Spark "
                    f"retries the task they are written again (at-least-once).") from exc
            rows += len(chunk)
            batches += 1
            if opts.queue is not None:
                queues[opts.queue] += len(chunk)
            else:
                queues.update(item["queue"] for item in chunk)

        for record_batch in record_batches:
            if not record_batch.num_rows:
                continue
            pending.extend(batch_items(record_batch, opts, seen))
            seen += record_batch.num_rows
            while len(pending) >= size:
                send(pending[:size])
                del pending[:size]
        if pending:
            send(pending)
    return QServerCommitMessage(rows=rows, batches=batches, queues=dict(queues),
                                seconds=time.monotonic() - start)


class QServerWriter(DataSourceArrowWriter):
    """The batch writer: `df.write.format("qserver")...save()`."""

    def __init__(self, opts: SinkOptions) -> None:
        self.opts = opts

    def write(self, iterator: Iterator[pa.RecordBatch]) -> QServerCommitMessage:
        return write_rows(iterator, self.opts)

    def commit(self, messages: list[WriterCommitMessage | None]) -> None:
        log.info("qserver sink: wrote %s", summarize(messages).describe())

    def abort(self, messages: list[WriterCommitMessage | None]) -> None:
        log.warning(
            "qserver sink: the write failed after %s. Messages already produced stay in "
            "their queues (a queue cannot take them back); writing the DataFrame again "
            "produces them again (at-least-once).", summarize(messages).describe())


class QServerStreamWriter(DataSourceStreamArrowWriter):
    """The streaming writer: `df.writeStream.format("qserver")...start()`."""

    def __init__(self, opts: SinkOptions) -> None:
        self.opts = opts

    def write(self, iterator: Iterator[pa.RecordBatch]) -> QServerCommitMessage:
        return write_rows(iterator, self.opts)

    def commit(self, messages: list[WriterCommitMessage | None], batchId: int) -> None:
        log.info("qserver sink: micro-batch %d: wrote %s", batchId,
                 summarize(messages).describe())

    def abort(self, messages: list[WriterCommitMessage | None], batchId: int) -> None:
        log.warning(
            "qserver sink: micro-batch %d failed after %s. Messages already produced stay in "
            "their queues; when the query restarts from its checkpoint the micro-batch is "
            "written again (at-least-once).", batchId, summarize(messages).describe())


class QServerDataSource(DataSource):
    """The "qserver" data source: a sink that produces every row as a
    message. Options: see spark_integration/README.md or
    `qserver_spark.options.OPTIONS`."""

    @classmethod
    def name(cls) -> str:
        return "qserver"

    def writer(self, schema: StructType, overwrite: bool) -> QServerWriter:
        if overwrite:
            raise OptionError("save mode 'overwrite' is not supported: a queue cannot be "
                              "overwritten, only appended to (use .mode(\"append\"))")
        return QServerWriter(parse_options(self.options, schema))

    def streamWriter(self, schema: StructType, overwrite: bool) -> QServerStreamWriter:
        if overwrite:
            raise OptionError("output mode 'complete' is not supported: it would send the "
                              "whole result again every micro-batch (use outputMode "
                              "\"append\" or \"update\")")
        return QServerStreamWriter(parse_options(self.options, schema))
