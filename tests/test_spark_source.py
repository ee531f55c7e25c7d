"""The "qserver" source (spark_integration/qserver_spark/source.py) on a real
local Spark (local[2]) against a real three-node cluster, and the pieces
around it: the auto-registration module, the PySpark 4.0 row writer, the
log that reaches the driver's stderr, the leader cache.

The streaming tests check the source's promise from outside it:

- every produced message reaches the parquet sink (read through the sink's
  own commit log, `_spark_metadata`), none is left in the queue;
- nothing is confirmed before its micro-batch is committed: a watcher
  thread reads the checkpoint while the query runs and, for every batch in
  the offset log and not yet in the commit log, asks the server (show) for
  each message the batch's offset names, then looks at the commit log
  again; if the batch is still uncommitted, every one of those messages
  must still be in its queue (a confirmed message is gone). And a batch
  that was interrupted (the query stopped in its middle) is replayed after
  the restart with every one of its messages, read back by id: one
  confirmed early would be missing.

One Spark session (one JVM) serves the module; if test_spark.py's session
is up it is reused. One cluster serves the module; the kill -9 test starts
its own. Every test reads and writes queues of its own.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

pytest.importorskip("pyspark", reason="pyspark is not installed (the project's 'spark' extra)")
pytest.importorskip("pyarrow", reason="pyarrow is not installed (the project's 'spark' extra)")
if shutil.which("java") is None and not os.environ.get("JAVA_HOME"):
    pytest.skip("java is not installed: Spark needs a JVM", allow_module_level=True)

from pyspark.errors import PySparkException
from pyspark.sql import SparkSession
from pyspark.sql.pandas.types import to_arrow_schema

import qserver_spark
from procs import Cluster, wait_until
from qserver.client import Client
from qserver.client.core import Message
from qserver_spark import (
    SCHEMA,
    BatchOffset,
    MessageRef,
    OptionError,
    QServerDataSource,
    QServerStreamRowWriter,
    SourceError,
    leaders,
    parse_source_options,
    report,
)
from qserver_spark._compat import rows_to_batches
from qserver_spark.messages import ARROW_SCHEMA, delivered_batch, viewed_batch
from qserver_spark.offsets import EMPTY
from sparkutil import batch_ids, local_spark, read_offset, sink_rows, uncommitted

ROOT = Path(__file__).resolve().parent.parent
DEADLINE_S = 120.0  # generous: CI is a shared, noisy 2-core machine


@pytest.fixture(scope="module")
def spark():
    existing = SparkSession.getActiveSession()
    # (local_spark registers the data source: the default editable install
    # hides pyspark_qserver from PySpark's lookup, see
    # test_the_example_pipeline_runs_with_auto_registration.)
    session = local_spark("qserver-source-tests", 2)
    # The file sink's commit log names each batch's files in a file of its
    # own (sink_rows reads them), not merged every 10 batches.
    session.conf.set("spark.sql.streaming.fileSink.log.compactInterval", "1000000")
    yield session
    if existing is None:
        session.stop()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = Cluster(tmp_path_factory.mktemp("spark-source-cluster"))
    c.start_all()
    try:
        c.wait_master()
        yield c
    finally:
        c.stop_all()


def hosts_of(cluster: Cluster) -> str:
    return ",".join(f"127.0.0.1:{p}" for p in cluster.client_ports)


@pytest.fixture(scope="module")
def hosts(cluster) -> str:
    return hosts_of(cluster)


def produce(hosts: str, queue: str, n: int, prefix: str = "m", retry: int = 60) -> list[str]:
    data = [f"{prefix}{i}" for i in range(n)]
    with Client(hosts, timeout=30) as client:
        client.produce_batch(queue, data, retry=retry)
    return data


def monitor(hosts: str, queue: str) -> dict:
    with Client(hosts, timeout=30, retry_for=60) as client:
        return client.monitor(queue)


class ConfirmWatcher(threading.Thread):
    """Checks, while a query runs, that no message of an uncommitted
    micro-batch is confirmed (see the module docstring). `checked`: the
    batches checked whole while uncommitted; `violations`: messages found
    gone."""

    def __init__(self, hosts: str, checkpoint: Path) -> None:
        super().__init__(name="confirm-watcher", daemon=True)
        self.hosts = hosts
        self.checkpoint = checkpoint
        self.checked: set[int] = set()
        self.violations: list[tuple[int, MessageRef]] = []
        self.errors: list[str] = []
        self._done = threading.Event()

    def run(self) -> None:
        with Client(self.hosts, timeout=30, retry_for=60) as client:
            while not self._done.is_set():
                try:
                    self._check(client)
                except Exception as exc:  # a failover: ask again
                    self.errors.append(repr(exc))
                    time.sleep(0.1)
                time.sleep(0.005)

    def _check(self, client: Client) -> None:
        committed = batch_ids(self.checkpoint / "commits")
        for batch in sorted(batch_ids(self.checkpoint / "offsets") - committed):
            offset = read_offset(self.checkpoint, batch)
            if not offset.messages:
                continue
            requests = [{"action": 11, "queue": r.queue, "msg_id": r.msg_id}
                        for r in offset.messages]
            answers = client._exchange(requests, 200, stop_on_error=False)
            if batch in batch_ids(self.checkpoint / "commits"):
                continue  # committed meanwhile: the answers prove nothing
            self.checked.add(batch)
            for ref, answer in zip(offset.messages, answers):
                if answer is None or answer.get("code") != 0:
                    self.violations.append((batch, ref))

    def stop(self) -> None:
        self._done.set()
        self.join(DEADLINE_S)


def start_stream(spark, hosts: str, queue: str, tmp: Path, **options):
    reader = (spark.readStream.format("qserver").option("hosts", hosts)
              .option("queue", queue).option("timeout", "30"))
    for key, value in options.items():
        reader = reader.option(key, str(value))
    return (reader.load().writeStream.format("parquet")
            .option("path", str(tmp / "out"))
            .option("checkpointLocation", str(tmp / "checkpoint"))
            .trigger(processingTime="0 seconds").start())


def stop_mid_batch(query, checkpoint: Path, after: int) -> int | None:
    """Stop `query` while a micro-batch (at least the `after`-th) is
    running: returns its id if the stop left it uncommitted (it is replayed
    on restart), None if the batch committed first."""
    def running() -> int | None:
        if query.exception() is not None:
            raise AssertionError(f"the query failed: {query.exception()}")
        pending = [b for b in uncommitted(checkpoint) if b >= after]
        return pending[0] if pending else None

    batch = wait_until(running, DEADLINE_S, step_s=0.002)
    query.stop()
    return batch if batch in uncommitted(checkpoint) else None


def wait_drained(hosts: str, queue: str, query, checkpoint: Path,
                 deadline_s: float = DEADLINE_S) -> None:
    """Until the queue holds nothing (every message consumed and confirmed)
    and every batch of the offset log is committed."""
    def drained() -> bool:
        if query.exception() is not None:
            raise AssertionError(f"the query failed: {query.exception()}")
        return monitor(hosts, queue)["size"] == 0 and not uncommitted(checkpoint)

    wait_until(drained, deadline_s, step_s=0.2)


def check_sink(out: Path, checkpoint: Path, want: list[str]) -> dict[int, list[dict]]:
    """Every produced message in the sink at least once; each batch's rows
    are messages its offset names."""
    rows = sink_rows(out)
    got = [r["data"] for batch in rows.values() for r in batch]
    assert set(got) == set(want), (f"missing {sorted(set(want) - set(got))[:10]}, "
                                   f"foreign {sorted(set(got) - set(want))[:10]}")
    for batch, batch_rows in rows.items():
        named = [(r.queue, r.msg_id) for r in read_offset(checkpoint, batch).messages]
        read = [(r["queue"], r["msg_id"]) for r in batch_rows]
        assert set(read) <= set(named), f"batch {batch} holds messages its offset does not name"
    return rows


# -- streaming: stopped mid-batch and restarted, kill -9 of the master ------


def test_a_stream_stopped_mid_batch_and_restarted_delivers_every_message_once(
        spark, hosts, tmp_path):
    queue = "src_restart"
    want = produce(hosts, queue, 3000)
    checkpoint = tmp_path / "checkpoint"
    watcher = ConfirmWatcher(hosts, checkpoint)
    watcher.start()
    try:
        options = {"maxMessagesPerBatch": 200, "lease": 60, "wait": 0.5}
        query = start_stream(spark, hosts, queue, tmp_path, **options)
        interrupted = stop_mid_batch(query, checkpoint, after=2)
        for _ in range(3):  # the stop raced the batch's commit: run and stop again
            if interrupted is not None:
                break
            query = start_stream(spark, hosts, queue, tmp_path, **options)
            interrupted = stop_mid_batch(query, checkpoint, after=max(batch_ids(checkpoint /
                                                                                "offsets")) + 1)
        assert interrupted is not None, "no stop landed in the middle of a batch"
        # The interrupted batch's messages are still held (leased), none confirmed.
        named = read_offset(checkpoint, interrupted).messages
        with Client(hosts) as client:
            assert all(client.show(r.queue, r.msg_id)["state"] == "in_flight" for r in named)

        query = start_stream(spark, hosts, queue, tmp_path, **options)
        wait_drained(hosts, queue, query, checkpoint)
        query.stop()
    finally:
        watcher.stop()

    rows = check_sink(tmp_path / "out", checkpoint, want)
    got = [r["data"] for batch in rows.values() for r in batch]
    # Restarted within the lease: the replay's confirms found their
    # deliveries, nothing came back, nothing reached the sink twice.
    assert len(got) == len(want)
    # The interrupted batch was replayed whole: read again by id.
    assert [(r["queue"], r["msg_id"]) for r in rows[interrupted]] == [
        (r.queue, r.msg_id) for r in named]
    # several batches checked while they ran (not only one left uncommitted
    # by a stop, which stays so between the runs)
    assert len(watcher.checked) >= 3 and watcher.violations == [], watcher.checked
    mon = monitor(hosts, queue)
    assert (mon["size"], mon["in_flight"]) == (0, 0)


def test_kill_9_of_the_master_during_the_stream_loses_no_message(spark, tmp_path):
    (tmp_path / "cluster").mkdir()
    c = Cluster(tmp_path / "cluster")
    c.start_all()
    watcher = None
    try:
        master = c.wait_master()
        hosts = hosts_of(c)
        queue = "src_failover"
        want = produce(hosts, queue, 2000)
        checkpoint = tmp_path / "checkpoint"
        watcher = ConfirmWatcher(hosts, checkpoint)
        watcher.start()
        # A short lease: consumes whose answers the kill lost come back soon.
        options = {"maxMessagesPerBatch": 150, "lease": 15, "wait": 0.5}
        query = start_stream(spark, hosts, queue, tmp_path, **options)
        wait_until(lambda: len(batch_ids(checkpoint / "commits")) >= 2, DEADLINE_S)
        left = monitor(hosts, queue)["size"]
        committed = len(batch_ids(checkpoint / "commits"))
        c.kill(master)
        assert c.wait_master(DEADLINE_S) != master
        restarts = 0
        end = time.monotonic() + DEADLINE_S
        while True:
            try:
                wait_drained(hosts, queue, query, checkpoint, max(1.0, end - time.monotonic()))
                break
            except AssertionError as exc:
                # The source fails its query when no node answers for the
                # client's retry time: restarted from the checkpoint, as a
                # user (or a job scheduler) would.
                if "the query failed" not in str(exc) or restarts:
                    raise
                restarts += 1
                query = start_stream(spark, hosts, queue, tmp_path, **options)
        query.stop()
        watcher.stop()
        check_sink(tmp_path / "out", checkpoint, want)
        # several batches checked while they ran
        assert len(watcher.checked) >= 3 and watcher.violations == [], watcher.checked
        # (At least once, check_sink: a batch whose confirm the kill lost
        # is delivered again once its lease runs out.)
        # The kill came in the middle of the stream: most of it was read after.
        assert left > len(want) // 2
        assert len(batch_ids(checkpoint / "commits")) > committed + 3
        mon = monitor(hosts, queue)
        assert (mon["size"], mon["in_flight"]) == (0, 0)
    finally:
        if watcher is not None and watcher.is_alive():
            watcher.stop()
        c.stop_all()


# -- batch reads (peek) and dead letters ------------------------------------


def test_a_batch_read_returns_what_peek_sees_and_consumes_nothing(spark, hosts):
    queue = "src_peek"
    with Client(hosts) as client:
        client.produce(queue, "late", priority=2000)
        client.produce(queue, "urgent", priority=0)
        client.produce(queue, "normal")
        client.produce(queue, "delayed", delay=3600)
        before = client.monitor(queue)
        peeked = client.peek(queue, 10)
    df = (spark.read.format("qserver").option("hosts", hosts).option("queue", queue).load())
    assert df.schema == SCHEMA
    rows = df.collect()
    assert [r.data for r in rows] == [m["data"] for m in peeked] == ["urgent", "normal", "late"]
    assert [(r.priority, r.deliveries, r.nacks) for r in rows] == [(0, 0, 0), (1024, 0, 0),
                                                                  (2000, 0, 0)]
    assert all(r.expires_at > r.ready_at for r in rows)
    after = monitor(hosts, queue)
    assert (after["size"], after["ready"], after["in_flight"]) == (
        before["size"], before["ready"], 0)
    # one task per queue; `count` bounds each
    two = (spark.read.format("qserver").option("hosts", hosts)
           .option("queues", f"{queue},src_peek_empty").option("count", "2").load())
    assert two.rdd.getNumPartitions() == 2
    assert [r.data for r in two.collect()] == ["urgent", "normal"]


def test_dead_letters_carry_their_fields_in_batch_and_streaming_reads(spark, hosts, tmp_path):
    queue, dlq = "src_dl", "src_dl_dead"
    with Client(hosts) as client:
        client.set_config(queue, max_deliveries=1, dead_letter=dlq)
        msg_id = client.produce(queue, "poison", retry=60)
        client.produce(dlq, "plain")  # produced into the dead-letter queue directly
        # delivered once, never confirmed: its lease runs out, it leaves for dlq
        assert client.consume(queue, lease=0.2).msg_id == msg_id
        wait_until(lambda: client.monitor(dlq)["size"] == 2, DEADLINE_S)
    peeked = {r.data: r for r in spark.read.format("qserver").option("hosts", hosts)
              .option("queue", dlq).load().collect()}
    assert (peeked["poison"].origin_queue, peeked["poison"].origin_msg_id,
            peeked["poison"].dead_letter_reason) == (queue, msg_id, "max_deliveries")
    assert peeked["plain"].origin_queue is None

    # streaming: each consumed message is looked up (show) for its fields
    query = (spark.readStream.format("qserver").option("hosts", hosts).option("queue", dlq)
             .option("wait", "0").load().writeStream.format("memory")
             .queryName("src_dl_rows").option("checkpointLocation", str(tmp_path / "cp"))
             .trigger(availableNow=True).start())
    assert query.awaitTermination(DEADLINE_S)
    streamed = {r.data: r for r in spark.sql("SELECT * FROM src_dl_rows").collect()}
    assert (streamed["poison"].origin_queue, streamed["poison"].origin_msg_id,
            streamed["poison"].dead_letter_reason) == (queue, msg_id, "max_deliveries")
    assert streamed["poison"].deliveries == 1 and streamed["poison"].priority is None
    assert streamed["plain"].origin_queue is None
    wait_until(lambda: monitor(hosts, dlq)["size"] == 0, DEADLINE_S)  # confirmed


@pytest.mark.parametrize("build, message", [
    (lambda r: r.option("hosts", "127.0.0.1:1").load(), "option 'queue' .* is required"),
    (lambda r: r.option("hosts", "127.0.0.1:1").option("queue", "q").option("lease", "0")
     .load(), "option 'lease' must be positive"),
    (lambda r: r.option("hosts", "127.0.0.1:1").option("queue", "q").option("count", "5")
     .load(), r"option\(s\) \['count'\] are for spark.read"),
    (lambda r: r.option("hosts", "127.0.0.1:1").option("queue", "q").option("queuez", "x")
     .load(), r"unknown option\(s\) \['queuez'\]"),
    (lambda r: r.schema("data STRING").option("hosts", "127.0.0.1:1").option("queue", "q")
     .load(), "a read gives the schema"),
])
def test_bad_stream_options_fail_the_query_with_a_clear_error(spark, tmp_path, build, message):
    with pytest.raises(PySparkException, match=message):
        query = (build(spark.readStream.format("qserver")).writeStream.format("memory")
                 .queryName("src_bad").option("checkpointLocation", str(tmp_path / "cp"))
                 .start())
        try:
            query.awaitTermination(DEADLINE_S)
        finally:
            query.stop()


def test_bad_batch_read_options_fail_with_a_clear_error(spark):
    reader = spark.read.format("qserver").option("hosts", "127.0.0.1:1").option("queue", "q")
    with pytest.raises(PySparkException, match=r"\['lease'\] are for spark.readStream"):
        reader.option("lease", "5").load().collect()


# -- the example, auto-registration, the PySpark 4.0 writer, the log -------


def test_the_example_pipeline_runs_with_auto_registration(hosts, tmp_path):
    """Both halves of examples/close_unpaid_orders.py in one command, in a
    Python of its own (a JVM of its own: PySpark looks data sources up once
    per JVM) whose path holds spark_integration/, where PySpark's lookup
    finds pyspark_qserver: the example registers nothing then. Its stderr
    is the driver's console."""
    env = dict(os.environ, PYSPARK_PYTHON=sys.executable,
               PYTHONPATH=os.pathsep.join([str(ROOT / "spark_integration"),
                                           os.environ.get("PYTHONPATH", "")]))
    out = tmp_path / "closed"
    done = subprocess.run(
        [sys.executable, str(ROOT / "spark_integration/examples/close_unpaid_orders.py"),
         "--hosts", hosts, "--orders", str(ROOT / "spark_integration/examples/orders.csv"),
         "--queue", "src_example", "--out", str(out)],
        env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "found by PySpark's data source lookup" in done.stdout
    assert "scheduled 12 'close unpaid order' messages" in done.stdout
    assert "closed 12 unpaid orders" in done.stdout
    # The sink's and the source's totals reach the driver's stderr (they
    # are logged in Spark's Python workers, whose stderr the JVM copies).
    assert "INFO qserver_spark: qserver sink: wrote 12 rows" in done.stderr
    assert "INFO qserver_spark: qserver source: micro-batch of 12 messages consumed at" \
        in done.stderr
    assert "is committed: confirmed 12" in done.stderr
    closed = [json.loads(line) for p in sorted(out.glob("part-*.json"))
              for line in p.read_text().splitlines()]
    assert sorted(o["order_id"] for o in closed) == list(range(1001, 1013))
    assert monitor(hosts, "src_example")["size"] == 0


def test_the_pyspark_4_0_row_writer_writes_what_the_arrow_writer_writes(spark, hosts, tmp_path):
    """On PySpark 4.0 (no Arrow streaming writer) the sink's streaming
    writer gets Rows; here that writer runs on this PySpark, in a real
    streaming query, and its messages are the Arrow writer's."""

    class RowsOnly(QServerDataSource):
        @classmethod
        def name(cls) -> str:
            return "qserver_rows"

        def streamWriter(self, schema, overwrite):
            return QServerStreamRowWriter(qserver_spark.parse_options(self.options, schema),
                                          schema)

    spark.dataSource.register(RowsOnly)
    source = tmp_path / "in"
    source.mkdir()
    lines = [json.dumps({"order_id": i, "amount": f"{i}.25", "at": "2030-01-01T08:00:00Z",
                         "tags": [f"t{i}"]}) for i in range(50)]
    (source / "part-0.json").write_text("\n".join(lines) + "\n")
    schema = "order_id LONG, amount DECIMAL(10,2), at TIMESTAMP, tags ARRAY<STRING>"
    got = {}
    for fmt, queue in (("qserver", "src_rows_arrow"), ("qserver_rows", "src_rows_rows")):
        stream = spark.readStream.schema(schema).json(str(source))
        query = (stream.writeStream.format(fmt).option("hosts", hosts).option("queue", queue)
                 .option("checkpointLocation", str(tmp_path / f"cp-{fmt}"))
                 .trigger(availableNow=True).start())
        assert query.awaitTermination(DEADLINE_S)
        with Client(hosts) as client:
            got[fmt] = sorted(m["data"] for m in client.peek(queue, 100))
    assert len(got["qserver"]) == 50
    assert got["qserver_rows"] == got["qserver"]
    assert json.loads(got["qserver"][0])["at"] == "2030-01-01T08:00:00+00:00"


def test_rows_to_batches_matches_spark_arrow_conversion(spark):
    df = spark.sql("""SELECT 'a' AS s, CAST(1 AS BIGINT) AS l, CAST(2.5 AS DECIMAL(10,2)) AS d,
        TIMESTAMP'2030-01-01 08:00:00+00:00' AS t, DATE'2030-01-02' AS dd, X'00FF' AS b,
        array(1, 2) AS a, map('k', 1) AS m,
        named_struct('x', 1.5, 'y', TIMESTAMP'2030-01-01 00:00:00+00:00') AS st,
        CAST(NULL AS STRING) AS n""")
    rows = df.collect() * 3
    batches = list(rows_to_batches(rows, df.schema, size=2))
    assert [b.num_rows for b in batches] == [2, 1]
    assert [r for b in batches for r in b.to_pylist()] == df.toArrow().to_pylist() * 3


def test_the_report_logger_writes_info_to_stderr_in_an_unconfigured_process():
    code = ("from qserver_spark import report; "
            "report.logger().info('totals %d', 7); report.logger().info('again')")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    lines = done.stderr.splitlines()
    assert len(lines) == 2 and lines[0].endswith("INFO qserver_spark: totals 7")


def test_the_report_logger_leaves_configured_logging_alone(caplog):
    with caplog.at_level(logging.INFO, logger="qserver_spark"):
        report.logger().info("through the root's handlers")
    assert "through the root's handlers" in caplog.text


# -- no JVM: options, offsets, rows, the leader cache -----------------------


def test_source_options_defaults_and_overrides():
    o = parse_source_options({"hosts": "h:1", "queue": "q"}, streaming=True)
    assert (o.hosts, o.queues, o.max_messages, o.lease_s, o.wait_s) == (
        ("h:1",), ("q",), 5000, 120.0, 1.0)
    assert o.dead_letter_fields is True and o.client_options == {
        "token": None, "tls": False, "tls_ca": None}
    o = parse_source_options({"HOSTS": "h:1,g:2", "queues": "a, b", "maxMessagesPerBatch": "7",
                              "lease": "2.5", "wait": "0", "deadLetterFields": "false",
                              "tlsCa": "/ca.pem", "token": "s3cret"}, streaming=True)
    assert (o.hosts, o.queues, o.max_messages, o.lease_s, o.wait_s) == (
        ("h:1", "g:2"), ("a", "b"), 7, 2.5, 0.0)
    assert o.dead_letter_fields is False
    assert o.client_options == {"token": "s3cret", "tls": True, "tls_ca": "/ca.pem"}
    assert "s3cret" not in repr(o)  # a secret: not in reprs
    o = parse_source_options({"hosts": "h:1", "queue": "q", "count": "3"}, streaming=False)
    assert (o.streaming, o.peek_count) == (False, 3)


@pytest.mark.parametrize("options, streaming, message", [
    ({}, True, "option 'hosts' is required"),
    ({"hosts": "h:1"}, True, r"option 'queue' \(or 'queues'\) is required"),
    ({"hosts": "h:1", "queue": "a", "queues": "b"}, True, "not both"),
    ({"hosts": "h:1", "queues": "a,,b"}, True, "a queue name must be 1 to 255"),
    ({"hosts": "h:1", "queues": "a,a"}, True, "names a queue twice"),
    ({"hosts": "h:1", "queues": ",".join(f"q{i}" for i in range(17))}, True, "1 to 16"),
    ({"hosts": "h:1", "queue": "q", "maxMessagesPerBatch": "0"}, True, "1 to 1,000,000"),
    ({"hosts": "h:1", "queue": "q", "maxMessagesPerBatch": "x"}, True, "must be an integer"),
    ({"hosts": "h:1", "queue": "q", "lease": "-1"}, True, "'lease' must be positive"),
    ({"hosts": "h:1", "queue": "q", "wait": "-1"}, True, "'wait' must not be negative"),
    ({"hosts": "h:1", "queue": "q", "deadLetterFields": "maybe"}, True, "true or false"),
    ({"hosts": "h:1", "queue": "q", "count": "5"}, True, "are for spark.read"),
    ({"hosts": "h:1", "queue": "q", "wait": "5"}, False, "are for spark.readStream"),
    ({"hosts": "h:1", "queue": "q", "count": "1001"}, False, "'count' must be 1 to 1000"),
    ({"hosts": "h:1", "queue": "q", "token": "a b"}, False, "'token' must be"),
    ({"hosts": "h:1", "queue": "q", "path": "/x"}, True, r"unknown option\(s\) \['path'\]"),
])
def test_bad_source_options(options, streaming, message):
    with pytest.raises(OptionError, match=f"^qserver source: .*{message}"):
        parse_source_options(options, streaming)


def test_offsets_round_trip_and_refuse_foreign_ones():
    offset = BatchOffset((MessageRef("a", 1, "3.1.1"), MessageRef("b", 7, None),
                          MessageRef("a", 2, "3.2.1")), 1795548373.1594)
    obj = offset.to_json()
    assert obj == {"v": 1, "at": 1795548373.159,
                   "queues": {"a": [[1, "3.1.1"], [2, "3.2.1"]], "b": [[7, None]]}}
    back = BatchOffset.from_json(json.loads(json.dumps(obj)))
    # grouped by queue: a's messages, then b's
    assert [(r.queue, r.msg_id) for r in back.messages] == [("a", 1), ("a", 2), ("b", 7)]
    assert [r.receipt for r in back.messages] == ["3.1.1", "3.2.1", None]
    assert BatchOffset.from_json(EMPTY.to_json()) == EMPTY and len(EMPTY) == 0
    for bad in ({"index": 3}, {"v": 2, "queues": {}}, {"v": 1, "queues": {"a": [[1]]}},
                {"v": 1, "queues": {"a": [["x", "r"]]}}, [1, 2]):
        with pytest.raises(SourceError, match="qserver source:"):
            BatchOffset.from_json(bad)


def test_rows_have_the_arrow_schema_spark_expects():
    assert ARROW_SCHEMA.equals(to_arrow_schema(SCHEMA, timezone="UTC"))
    batch = delivered_batch([Message(queue="q", msg_id=5, data="d", deliveries=2, receipt="r"),
                             Message(queue="q", msg_id=6, data="e", deliveries=1)],
                            {("q", 5): {"origin_queue": "o", "origin_msg_id": 9,
                                        "dead_letter_reason": "expired"}})
    assert batch.schema.equals(ARROW_SCHEMA)
    assert batch.to_pylist()[0] == {
        "queue": "q", "msg_id": 5, "data": "d", "deliveries": 2, "origin_queue": "o",
        "origin_msg_id": 9, "dead_letter_reason": "expired", "priority": None,
        "ready_at": None, "expires_at": None, "nacks": None}
    view = {"msg_id": 3, "state": "ready", "data": "x", "priority": 7, "ready_at": 1.5,
            "ttl": 3601.5, "retry": 0, "retry_at": 0, "deliveries": 0, "nacks": 1}
    [row] = viewed_batch([("q", view)]).to_pylist()
    assert (row["priority"], row["nacks"], row["ready_at"].timestamp(),
            row["expires_at"].timestamp()) == (7, 1, 1.5, 3601.5)
    [row] = viewed_batch([("q", view)], peek_fields=False).to_pylist()
    assert (row["priority"], row["ready_at"], row["data"]) == (None, None, "x")


def test_the_master_is_looked_up_once_per_process_until_a_client_ends_elsewhere():
    hosts = ("h1:1", "h2:2", "h3:3")
    calls = []

    def lookup() -> dict:
        calls.append(1)
        return {"leader_host": "h2", "leader_port": 2}

    leaders.forget(hosts)
    try:
        for _ in range(5):  # five tasks in one worker process
            assert leaders.master_first(hosts, lookup) == ["h2:2", "h1:1", "h3:3"]
        assert len(calls) == 1
        leaders.forget(hosts, ("h2", 2))  # the task ended on the master: kept
        assert leaders.cached(hosts) == "h2:2"
        leaders.forget(hosts, ("h3", 3))  # it failed over: looked up again next time
        assert leaders.cached(hosts) is None
        leaders.master_first(hosts, lookup)
        assert len(calls) == 2
        leaders.forget(hosts)
        assert leaders.master_first(hosts, lambda: {"leader_host": "0.0.0.0",
                                                    "leader_port": 2}) == list(hosts)
        assert leaders.cached(hosts) is None  # a wildcard address names no host: not kept
    finally:
        leaders.forget(hosts)
