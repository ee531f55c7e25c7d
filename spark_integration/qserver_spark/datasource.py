"""`QServerDataSource`: the "qserver" sink (and the entry points of the
source) for Spark's Python data source API.

    spark.dataSource.register(QServerDataSource)
    (df.write.format("qserver")
       .option("hosts", "127.0.0.1:1111,127.0.0.1:1112")
       .option("queue", "orders")
       .mode("append").save())

The readers (`spark.readStream` and `spark.read`: `schema()`, `reader()`,
`simpleStreamReader()`) are `source.py`'s; this module is the sink's.

Theory of operation
-------------------
Spark calls `writer()` (batch) or `streamWriter()` (streaming) on the driver,
in a Python worker, once per write or query. That is where the options are
checked against the DataFrame's schema (`options.parse_options`), so bad
options fail the query before any task starts. The writer, holding only the
checked options, is pickled to the executors.

Each task calls `write()` with its rows as Arrow record batches. A task
opens one TCP connection (`qserver.client.Client`, with every host so it
can fail over, the master first), turns its rows into produce items
(`rows.batch_items`) and those into produce requests (`wire`): by default
batch produces, one request per up to `batchSize` rows of one queue (one
log entry on the server), PIPELINE_REQUESTS of them in flight at a time;
with `batchProduce=false` one request per row, PIPELINE_WINDOW in flight,
`batchSize` rows at a time. The requests go through the client's exchange,
which resends a request whose outcome it could not learn (a master change,
a node silent for `timeout`, a broken connection) to the next master. The
task returns a `QServerCommitMessage` with its counts; the driver's
`commit()` adds them up and logs the totals.

Delivery. A produce is answered once it is committed by the cluster;
nothing a task wrote can be taken back. When a task fails and Spark runs it
again (or a streaming micro-batch is replayed after a restart), the rows it
had written before failing are sent again; so is a request the client
resends after a failover although its first copy was committed.
- With a dedup column (`dedupColumn` or `dedupKey`) every message carries
  its row's dedup id, and the server stores nothing for a (queue, dedup_id)
  it accepted within the queue's dedup window (default 300 s): it answers
  the first produce's msg_id and counts the row as a duplicate. The table
  is built from committed entries on every node, so a resend to a new
  master is recognised too: exactly once within the window.
- Without one: at-least-once; a consumer that must act once deduplicates on
  a natural key carried in the data (see spark_integration/README.md).
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field

import pyarrow as pa
from pyspark.sql.datasource import (
    DataSource,
    DataSourceArrowWriter,
    DataSourceStreamWriter,
    WriterCommitMessage,
)
from pyspark.sql.types import StructType

from qserver.client import Client
from qserver.client.core import server_error
from qserver.errors import QServerClientError

from . import leaders, report
from ._compat import HAS_STREAM_ARROW_WRITER, DataSourceStreamArrowWriter, rows_to_batches
from .errors import OptionError, WriteError
from .messages import SCHEMA
from .options import PIPELINE_WINDOW, SinkOptions, parse_options
from .rows import batch_items
from .source import QServerBatchReader, QServerStreamReader
from .source_options import parse_source_options
from .wire import BatchBuilder, count_answers, rows_of, single_requests

__all__ = [
    "QServerDataSource",
    "QServerWriter",
    "QServerStreamWriter",
    "QServerCommitMessage",
    "WriteSummary",
    "summarize",
    "write_rows",
]

# Batch produce requests (up to 1,000 rows each) a task keeps in flight on
# its connection: enough to overlap a request's quorum commit with sending
# the next. `bench/spark_bench.py --windows 1,2,4,8` on the loaded 2-core
# development machine: medians of 62k, 66k, 85k, 57k rows/s for 1, 2, 4, 8
# (noisy; spark_integration/README.md, Performance).
PIPELINE_REQUESTS = 4

# With batchProduce=false: single produce requests a task keeps in flight on
# its connection (the client's pipelining window), whatever the batch size.

# What a node that predates batch produce answers to one (it wants `data`).
OLD_SERVER_REASON = "missing field: data"

@dataclass(frozen=True)
class QServerCommitMessage(WriterCommitMessage):
    """What one task wrote (pickled back to the driver)."""

    rows: int  # rows produced, each acknowledged by the cluster (duplicates included)
    batches: int  # batch produce requests (batchProduce=false: groups of batchSize rows)
    queues: dict[str, int] = field(default_factory=dict)  # rows per queue
    seconds: float = 0.0  # the task's time from its first row to its last answer
    duplicates: int = 0  # rows the server already held (same dedup id within the window)


@dataclass(frozen=True)
class WriteSummary:
    """The totals of a write (or of one streaming micro-batch)."""

    tasks: int  # tasks that reported
    failed_tasks: int  # tasks without a commit message (failed)
    rows: int
    batches: int
    queues: dict[str, int]
    duplicates: int = 0

    def describe(self) -> str:
        queues = ", ".join(f"{q}: {n}" for q, n in sorted(self.queues.items())) or "none"
        failed = f", {self.failed_tasks} failed" if self.failed_tasks else ""
        dups = (f"; {self.duplicates} of them already stored (same dedup id within the "
                f"queue's dedup window): not stored again" if self.duplicates else "")
        return (f"{self.rows} rows in {self.batches} batches from {self.tasks} tasks{failed} "
                f"(per queue: {queues}){dups}")


def summarize(messages: list[WriterCommitMessage | None]) -> WriteSummary:
    """Add up the tasks' commit messages; None stands for a failed task."""
    rows = batches = tasks = failed = duplicates = 0
    queues: Counter[str] = Counter()
    for m in messages:
        if isinstance(m, QServerCommitMessage):
            tasks += 1
            rows += m.rows
            batches += m.batches
            duplicates += m.duplicates
            queues.update(m.queues)
        else:
            failed += 1
    return WriteSummary(tasks=tasks, failed_tasks=failed, rows=rows, batches=batches,
                        queues=dict(queues), duplicates=duplicates)


def master_first(opts: SinkOptions) -> list[str]:
    """The hosts with the master's client address first.

    A slave forwards every produce to the master and relays the answer,
    which costs the cluster CPU on two nodes per row; going to the master
    directly saves that (bench/spark_bench.py). The other hosts stay in the
    list for failover. A master that reports a wildcard address (it listens
    on every interface) names no host to connect to: the hosts stay as given.
    Looked up once per Python worker process (`leaders`): Spark reuses its
    workers for task after task.

    Raises:
        QServerClientError when no node answers (after the client's retries).
    """
    def lookup() -> dict:
        with Client(list(opts.hosts), timeout=opts.timeout_s, **opts.client_options) as client:
            return client.leader()

    # Once per worker process (qserver_spark.leaders), not once per task.
    return leaders.master_first(opts.hosts, lookup)


def write_rows(record_batches: Iterator[pa.RecordBatch], opts: SinkOptions
               ) -> QServerCommitMessage:
    """Produce every row of one task over one connection; returns the
    task's counts. Batch produce: a request per up to `batch_size` rows of
    one queue, PIPELINE_REQUESTS in flight; else `batch_size` single
    produces at a time, PIPELINE_WINDOW in flight.

    Raises:
        RowError for a row that cannot become a message (nothing of its
            record batch is sent).
        WriteError when a produce is refused or the client gives up; rows
            answered before stay written.
    """
    start = time.monotonic()
    seen = 0
    counts = _Counts()
    try:
        hosts = master_first(opts)
    except QServerClientError as exc:
        raise WriteError(f"qserver sink: no node of {list(opts.hosts)} told which node is "
                         f"master: {exc}. Nothing was written by this task.") from exc
    with Client(hosts, timeout=opts.timeout_s, **opts.client_options) as client:
        if opts.batch_produce:
            builder = BatchBuilder(opts.batch_size)
            ready: list[dict] = []
            for record_batch in record_batches:
                if not record_batch.num_rows:
                    continue
                items = batch_items(record_batch, opts, seen)
                seen += record_batch.num_rows
                ready.extend(builder.add(items, time.time()))
                if len(ready) >= PIPELINE_REQUESTS:
                    _send(client, ready, PIPELINE_REQUESTS, opts, counts)
                    counts.batches += len(ready)
                    ready = []
            ready.extend(builder.flush())
            if ready:
                _send(client, ready, PIPELINE_REQUESTS, opts, counts)
                counts.batches += len(ready)
        else:
            size = opts.batch_size
            pending: list[dict] = []
            for record_batch in record_batches:
                if not record_batch.num_rows:
                    continue
                pending.extend(batch_items(record_batch, opts, seen))
                seen += record_batch.num_rows
                while len(pending) >= size:
                    _send(client, single_requests(pending[:size], time.time()),
                          PIPELINE_WINDOW, opts, counts)
                    counts.batches += 1
                    del pending[:size]
            if pending:
                _send(client, single_requests(pending, time.time()), PIPELINE_WINDOW, opts,
                      counts)
                counts.batches += 1
    # The master changed under this task: the next task looks it up again.
    leaders.forget(opts.hosts, client.address)
    return QServerCommitMessage(rows=counts.rows, batches=counts.batches,
                                queues=dict(counts.queues), duplicates=counts.duplicates,
                                seconds=time.monotonic() - start)


@dataclass
class _Counts:
    """A task's running counts (what its commit message reports)."""

    rows: int = 0
    batches: int = 0
    duplicates: int = 0
    queues: Counter[str] = field(default_factory=Counter)


def _send(client: Client, requests: list[dict], window: int, opts: SinkOptions,
          counts: _Counts) -> None:
    """Send `requests` pipelined, `window` in flight, and wait for every
    answer; add what was written to `counts`.

    The client's exchange (the layer under `produce_many` and
    `produce_batch`) takes raw requests, batch produces included, and
    resends those whose outcome it could not learn to the next master; a
    refusal stops it (what was sent with the refused request is still
    answered). The sink uses it rather than `produce_batch`, which takes
    one queue per call, cuts requests at 1,000 messages only (not at
    `batchSize`) and reports no counts of what was refused: here requests
    of several queues share the pipeline, and single produces
    (`batchProduce=false`) go the same way.

    Raises:
        WriteError on a refusal or when the client gives up.
    """
    if opts.dedup_columns:
        again = ("when Spark retries the task, the rows already written are recognised by "
                 "their dedup ids within the queue's dedup window and not stored again")
    else:
        again = ("when Spark retries the task they are written again (at-least-once; give "
                 "option 'dedupColumn' for exactly once within the dedup window)")
    try:
        # The exchange is the client's lower layer (Client.produce_many's).
        answers = client._exchange(requests, window, stop_on_error=True)
    except QServerClientError as exc:
        raise WriteError(
            f"qserver sink: this task wrote {counts.rows} rows, then the client gave up on "
            f"{sum(map(rows_of, requests))} more: {exc}. Rows written stay in their queues; "
            f"{again}.") from exc
    for request, answer in zip(requests, answers):
        if answer is not None and answer.get("code") == 0:
            counts.queues[request["queue"]] += rows_of(request)
    rows, duplicates = count_answers(requests, answers)
    counts.rows += rows
    counts.duplicates += duplicates
    for index, answer in enumerate(answers):
        if answer is not None and answer.get("code") != 0:
            request = requests[index]
            hint = ""
            if "messages" in request and answer.get("reason") == OLD_SERVER_REASON:
                hint = (" (a node that predates batch produce: set option 'batchProduce' to "
                        "false)")
            raise WriteError(
                f"qserver sink: this task wrote {counts.rows} rows; a produce of "
                f"{rows_of(request)} rows to queue '{request['queue']}' was refused: "
                f"{answer.get('reason')}{hint}. Rows written stay in their queues; "
                f"{again}.") from server_error(answer, index)


class QServerWriter(DataSourceArrowWriter):
    """The batch writer: `df.write.format("qserver")...save()`."""

    def __init__(self, opts: SinkOptions) -> None:
        self.opts = opts

    def write(self, iterator: Iterator[pa.RecordBatch]) -> QServerCommitMessage:
        return write_rows(iterator, self.opts)

    def commit(self, messages: list[WriterCommitMessage | None]) -> None:
        report.logger().info("qserver sink: wrote %s", summarize(messages).describe())

    def abort(self, messages: list[WriterCommitMessage | None]) -> None:
        report.logger().warning(
            "qserver sink: the write failed after %s. Messages already produced stay in "
            "their queues (a queue cannot take them back); writing the DataFrame again "
            "produces them again (at-least-once), unless a dedup column gives each row its "
            "dedup id (then none is stored twice within the queue's dedup window).",
            summarize(messages).describe())


class QServerStreamWriter(DataSourceStreamArrowWriter):
    """The streaming writer: `df.writeStream.format("qserver")...start()`."""

    def __init__(self, opts: SinkOptions) -> None:
        self.opts = opts

    def write(self, iterator: Iterator[pa.RecordBatch]) -> QServerCommitMessage:
        return write_rows(iterator, self.opts)

    def commit(self, messages: list[WriterCommitMessage | None], batchId: int) -> None:
        report.logger().info("qserver sink: micro-batch %d: wrote %s", batchId,
                             summarize(messages).describe())

    def abort(self, messages: list[WriterCommitMessage | None], batchId: int) -> None:
        report.logger().warning(
            "qserver sink: micro-batch %d failed after %s. Messages already produced stay in "
            "their queues; when the query restarts from its checkpoint the micro-batch is "
            "written again (at-least-once), unless a dedup column gives each row its dedup "
            "id (then none is stored twice within the queue's dedup window).", batchId,
            summarize(messages).describe())


class QServerStreamRowWriter(DataSourceStreamWriter):
    """The streaming writer on PySpark 4.0, which has no Arrow streaming
    writer: its rows become the Arrow record batches `write_rows` takes
    (`_compat.rows_to_batches`). The batch and micro-batch commit and abort
    are the Arrow writer's."""

    def __init__(self, opts: SinkOptions, schema: StructType) -> None:
        self.opts = opts
        self.schema = schema

    def write(self, iterator: Iterator) -> QServerCommitMessage:
        return write_rows(rows_to_batches(iterator, self.schema), self.opts)

    commit = QServerStreamWriter.commit
    abort = QServerStreamWriter.abort


class QServerDataSource(DataSource):
    """The "qserver" data source: a sink that produces every row as a
    message, and a source that reads messages (`spark.readStream`: consumes
    and confirms once Spark commits each micro-batch; `spark.read`: peeks).
    Options: see spark_integration/README.md, `qserver_spark.options.OPTIONS`
    and `qserver_spark.source_options.SOURCE_OPTIONS`."""

    @classmethod
    def name(cls) -> str:
        return "qserver"

    def writer(self, schema: StructType, overwrite: bool) -> QServerWriter:
        if overwrite:
            raise OptionError("save mode 'overwrite' is not supported: a queue cannot be "
                              "overwritten, only appended to (use .mode(\"append\"))")
        return QServerWriter(parse_options(self.options, schema))

    def streamWriter(self, schema: StructType, overwrite: bool
                     ) -> QServerStreamWriter | QServerStreamRowWriter:
        if overwrite:
            raise OptionError("output mode 'complete' is not supported: it would send the "
                              "whole result again every micro-batch (use outputMode "
                              "\"append\" or \"update\")")
        if not HAS_STREAM_ARROW_WRITER:
            return QServerStreamRowWriter(parse_options(self.options, schema), schema)
        return QServerStreamWriter(parse_options(self.options, schema))

    def schema(self) -> StructType:
        """The rows of a read (qserver_spark.messages: queue, msg_id, data,
        deliveries, the dead-letter fields; priority, ready_at, expires_at,
        nacks from a batch read)."""
        return SCHEMA

    def reader(self, schema: StructType) -> QServerBatchReader:
        _check_schema(schema)
        return QServerBatchReader(parse_source_options(self.options, streaming=False))

    def simpleStreamReader(self, schema: StructType) -> QServerStreamReader:
        _check_schema(schema)
        return QServerStreamReader(parse_source_options(self.options, streaming=True))


def _check_schema(schema: StructType) -> None:
    if schema != SCHEMA:
        raise OptionError(f"a read gives the schema {SCHEMA.simpleString()}, not "
                          f"{schema.simpleString()} (leave out .schema(...), select and cast "
                          f"afterwards)", "source")
