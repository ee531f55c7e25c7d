"""The "qserver" Spark sink (spark_integration/qserver_spark) on a real local
Spark (local[2]) against a real three-node cluster: batch and streaming
writes drained with consume+confirm, per-row queue/time columns, the row as
JSON, and the errors of bad options; dedup columns (a DataFrame written
twice, a task written twice, a kill -9 of the master during a write: every
row stored exactly once) and priorities. The option parser, the row
converter and the request builder are also tested on their own, without the
JVM.

One Spark session (one JVM) and one cluster serve the whole module (the
kill -9 test starts a cluster of its own); every test writes to queues of
its own.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import decimal
import json
import os
import shutil
import threading
import time

import pytest

pytest.importorskip("pyspark", reason="pyspark is not installed (the project's 'spark' extra)")
pytest.importorskip("pyarrow", reason="pyarrow is not installed (the project's 'spark' extra)")
if shutil.which("java") is None and not os.environ.get("JAVA_HOME"):
    pytest.skip("java is not installed: Spark needs a JVM", allow_module_level=True)

import pyarrow as pa
from pyspark.errors import PySparkException
from pyspark.sql import functions as F
from pyspark.sql.types import (
    DoubleType,
    LongType,
    StringType,
    StructField,
    StructType,
    TimestampNTZType,
    TimestampType,
)

from procs import Cluster, TcpClient
from qserver.client import Client
from qserver_spark import OptionError, RowError, parse_options, summarize
from qserver_spark.datasource import QServerCommitMessage, write_rows
from qserver_spark.rows import batch_items
from qserver_spark.wire import MAX_REQUEST_BYTES, BatchBuilder, count_answers, single_requests
from sparkutil import local_spark

DEADLINE_S = 60.0  # generous: CI is a shared, noisy 2-core machine

# The sink's client resends a produce a node leaves unanswered for `timeout`
# seconds (at-least-once), which may store it twice. The tests count
# messages exactly, so they give a busy machine far longer than the default.
TIMEOUT = "60"

# Consumes (then confirms) in flight at a time while draining a queue.
PIPELINE = 200


@pytest.fixture(scope="session")
def spark():
    session = local_spark("qserver-tests", 2)
    yield session
    session.stop()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = Cluster(tmp_path_factory.mktemp("spark-cluster"))
    c.start_all()
    try:
        c.wait_master()
        yield c
    finally:
        c.stop_all()


@pytest.fixture(scope="module")
def hosts(cluster) -> str:
    return ",".join(f"127.0.0.1:{p}" for p in cluster.client_ports)


def drain(cluster: Cluster, queue: str, check_in_flight: bool = False) -> list[str]:
    """Every message ready in `queue`: consumed and confirmed on the master,
    PIPELINE consumes, then their confirms, at a time."""
    master = cluster.wait_master()
    got = []
    if check_in_flight:
        with Client(f"127.0.0.1:{cluster.port(master)}", timeout=float(TIMEOUT)) as client:
            message = client.consume(queue)
            assert message is not None
            # retry > 0 keeps a consumed message in flight until confirmed
            assert client.monitor(queue)["in_flight"] == 1
            client.confirm(queue, message.msg_id)
            got.append(message.data)
    conn = TcpClient(cluster.port(master))
    try:
        while True:
            conn.send_raw(json.dumps({"action": 2, "queue": queue}).encode() * PIPELINE)
            answers = [conn.read() for _ in range(PIPELINE)]
            assert all(a["code"] == 0 for a in answers), answers
            delivered = [a for a in answers if "msg_id" in a]
            conn.send_raw(b"".join(
                json.dumps({"action": 3, "queue": queue, "msg_id": a["msg_id"]}).encode()
                for a in delivered))
            assert all(conn.read()["code"] == 0 for _ in delivered)
            got.extend(a["data"] for a in delivered)
            if len(delivered) < PIPELINE:  # the queue ran dry (nothing else produces)
                return got
    finally:
        conn.close()


# -- against the cluster ------------------------------------------------------


def vote_id(cluster: Cluster) -> int:
    with Client(f"127.0.0.1:{cluster.port(cluster.wait_master())}") as client:
        return client.monitor()["vote_id"]


def check_drained(got: list[str], want: list[str], master_changed: bool) -> None:
    """Nothing lost, nothing foreign; nothing twice unless the master changed
    during the write (then the client resends produces whose outcome was
    unknown, and at-least-once allows duplicates)."""
    assert sorted(set(got)) == sorted(want)
    if not master_changed:
        assert len(got) == len(want)


def test_batch_write_of_10000_rows_over_two_queues(spark, cluster, hosts):
    n = 10_000
    epoch = vote_id(cluster)
    df = spark.range(n).select(
        F.concat(F.lit("order-"), F.col("id").cast("string")).alias("data"),
        F.when(F.col("id") % 3 == 0, F.lit("spark_a")).otherwise(F.lit("spark_b")).alias("queue"),
    ).repartition(4)
    (df.write.format("qserver").option("hosts", hosts).option("retry", "60")
     .option("timeout", TIMEOUT).option("batchSize", "700").mode("append").save())

    a = drain(cluster, "spark_a", check_in_flight=True)
    b = drain(cluster, "spark_b")
    changed = vote_id(cluster) != epoch
    check_drained(a, [f"order-{i}" for i in range(n) if i % 3 == 0], changed)
    check_drained(b, [f"order-{i}" for i in range(n) if i % 3 != 0], changed)
    with Client(hosts) as client:
        assert client.monitor("spark_a")["size"] == 0
        assert client.monitor("spark_b")["size"] == 0


def test_row_as_json_with_per_row_delay_ttl_and_retry_columns(spark, cluster, hosts):
    now = time.time()
    past = dt.datetime.fromtimestamp(now - 60, dt.UTC)
    future = dt.datetime.fromtimestamp(now + 3600, dt.UTC)
    schema = StructType([
        StructField("order_id", LongType()), StructField("user", StringType()),
        StructField("amount", StringType()), StructField("close_at", TimestampType()),
        StructField("keep_s", LongType()), StructField("retry_s", LongType()),
    ])
    rows = [(i, f"u{i}", f"{i}.50", future if i % 2 else past, 7200, 30 if i < 10 else None)
            for i in range(20)]
    df = (spark.createDataFrame(rows, schema)
          .withColumn("amount", F.col("amount").cast("decimal(10,2)")))
    (df.write.format("qserver").option("hosts", hosts).option("queue", "spark_json")
     .option("timeout", TIMEOUT)
     .option("delayColumn", "close_at").option("ttlColumn", "keep_s")
     .option("retryColumn", "retry_s").mode("append").save())

    with Client(hosts) as client:
        mon = client.monitor("spark_json")
        assert (mon["size"], mon["delayed"]) == (20, 10)  # the future half waits
    got = [json.loads(d) for d in drain(cluster, "spark_json")]
    # the delay, ttl and retry columns are not part of the message
    assert sorted(got, key=lambda r: r["order_id"]) == [
        {"order_id": i, "user": f"u{i}", "amount": f"{i}.50"} for i in range(0, 20, 2)]


def test_streaming_write_from_a_directory_of_json_files(spark, cluster, hosts, tmp_path):
    source = tmp_path / "in"
    source.mkdir()
    expect = []
    for f in range(3):
        lines = []
        for i in range(100):
            key = f"{f}-{i}"
            expect.append((f"spark_s{i % 2}", key))
            lines.append(json.dumps({"key": key, "queue": f"spark_s{i % 2}", "n": i}))
        (source / f"part-{f}.json").write_text("\n".join(lines) + "\n")
    schema = "key STRING, queue STRING, n LONG"
    epoch = vote_id(cluster)
    stream = (spark.readStream.schema(schema).option("maxFilesPerTrigger", 1)
              .json(str(source)))
    query = (stream.select("queue", F.col("key").alias("data"))
             .writeStream.format("qserver").option("hosts", hosts).option("retry", "30")
             .option("timeout", TIMEOUT)
             .option("checkpointLocation", str(tmp_path / "checkpoint"))
             .trigger(availableNow=True).start())
    assert query.awaitTermination(DEADLINE_S)
    assert query.exception() is None
    assert len(query.recentProgress) >= 3  # one micro-batch per file

    changed = vote_id(cluster) != epoch
    for q in ("spark_s0", "spark_s1"):
        check_drained(drain(cluster, q), [key for queue, key in expect if queue == q], changed)


def test_a_dataframe_written_twice_with_a_dedup_column_is_stored_once(spark, cluster, hosts):
    n = 3000
    df = spark.range(n, numPartitions=2).select(
        F.format_string("order-%05d", "id").alias("data"),
        F.format_string("o%d", "id").alias("order_key"))
    for _ in range(2):
        (df.write.format("qserver").option("hosts", hosts).option("queue", "spark_dedup")
         .option("dedupColumn", "order_key").option("batchSize", "400")
         .option("timeout", TIMEOUT).mode("append").save())
    assert sorted(drain(cluster, "spark_dedup")) == [f"order-{i:05d}" for i in range(n)]


def test_a_dedup_key_of_two_columns_per_queue_with_the_row_as_json(spark, cluster, hosts):
    # order 0..99, each in versions 1 and 2, into two queues; the same
    # (order, version) in both queues is two messages (a table per queue)
    rows = [(q, order, version, f"o{order}v{version}")
            for q in ("spark_key_a", "spark_key_b") for order in range(100) for version in (1, 2)]
    df = spark.createDataFrame(rows, "queue STRING, order_id LONG, version INT, note STRING")
    for _ in range(2):
        (df.write.format("qserver").option("hosts", hosts).option("dedupKey", "order_id,version")
         .option("timeout", TIMEOUT).mode("append").save())
    for q in ("spark_key_a", "spark_key_b"):
        got = [json.loads(d) for d in drain(cluster, q)]
        # the dedup key's columns stay in the message; the queue column does not
        assert sorted(got, key=lambda r: (r["order_id"], r["version"])) == [
            {"order_id": order, "version": version, "note": f"o{order}v{version}"}
            for order in range(100) for version in (1, 2)]


def test_a_priority_column_orders_delivery(spark, cluster, hosts):
    priorities = [5, None, 0, 5, 2000, 1, None]
    df = spark.createDataFrame([(f"m{i}", p) for i, p in enumerate(priorities)],
                               "data STRING, pri INT").coalesce(1)
    # (a dedup column: a master change under the load of other tests resends nothing twice)
    (df.write.format("qserver").option("hosts", hosts).option("queue", "spark_priority")
     .option("priorityColumn", "pri").option("dedupColumn", "data").option("timeout", TIMEOUT)
     .mode("append").save())
    # lower first, then produce order; a null is the default priority, 1024
    order = sorted(range(len(priorities)),
                   key=lambda i: (1024 if priorities[i] is None else priorities[i], i))
    assert drain(cluster, "spark_priority") == [f"m{i}" for i in order]


@pytest.mark.parametrize("batch_produce", ["true", "false"])
def test_a_task_written_again_is_answered_as_duplicates(cluster, hosts, batch_produce):
    """A task's rows sent twice (as a retried task sends them): the second
    time every row is a duplicate, nothing is stored again. `write_rows`
    is what a Spark task runs; here it runs without the JVM."""
    queue = f"spark_again_{batch_produce}"
    schema = StructType([StructField("data", StringType()), StructField("key", LongType())])
    opts = parse_options({"hosts": hosts, "queue": queue, "dedupColumn": "key",
                          "batchProduce": batch_produce, "batchSize": "300",
                          "timeout": TIMEOUT}, schema)
    batches = [pa.record_batch({"data": [f"d{i}" for i in range(k, k + 500)],
                                "key": pa.array(range(k, k + 500), pa.int64())})
               for k in (0, 500)]
    first = write_rows(iter(batches), opts)
    # 1,000 rows, 300 per batch: 4 requests (or 4 pipelined groups of single produces)
    assert (first.rows, first.duplicates, first.batches, first.queues) == (
        1000, 0, 4, {queue: 1000})
    again = write_rows(iter(batches), opts)
    assert (again.rows, again.duplicates) == (1000, 1000)
    assert sorted(drain(cluster, queue)) == sorted(f"d{i}" for i in range(1000))


def test_kill_9_of_the_master_during_a_write_with_a_dedup_column_stores_every_row_once(
        spark, tmp_path):
    """THE test of exactly once within the window: the master dies (kill -9)
    while the tasks' batches are in flight; the tasks' clients fail over
    and resend the batches whose answers they lost, the new master answers
    those already committed as duplicates; the write completes and the
    queue holds every row exactly once."""
    n = 60_000
    queue = "spark_failover"
    c = Cluster(tmp_path)
    c.start_all()
    try:
        master = c.wait_master()
        hosts = ",".join(f"127.0.0.1:{p}" for p in c.client_ports)
        df = (spark.range(n, numPartitions=2)
              .select(F.format_string("row-%06d", "id").alias("data"), F.col("id").alias("key"))
              .cache())
        df.count()  # the write below is the sink's work only
        # The write runs on this thread (a data source registered with the
        # session is not found from a thread py4j maps to a new JVM thread);
        # a killer thread watches the queue and kills the master once a few
        # batches are committed, the write still under way.
        written = threading.Event()
        killed: list[int] = []  # the rows stored when the master was killed

        def kill_during_the_write() -> None:
            end = time.monotonic() + DEADLINE_S
            while not written.is_set() and time.monotonic() < end:
                size = (c.ask(master, action=4, queue=queue) or {}).get("size", 0)
                if size >= 2000:
                    c.kill(master)
                    if not written.is_set():
                        killed.append(size)
                    return
                time.sleep(0.01)

        killer = threading.Thread(target=kill_during_the_write, name="killer")
        killer.start()
        try:
            (df.write.format("qserver").option("hosts", hosts).option("queue", queue)
             .option("dedupColumn", "key").option("timeout", "10").mode("append").save())
        finally:
            written.set()
            killer.join(DEADLINE_S)
        assert killed, "the master was not killed during the write: the test proves nothing"
        assert killed[0] < n
        assert c.wait_master(DEADLINE_S) != master
        got = drain(c, queue)
        assert len(got) == n, f"{len(got) - n:+} rows against {n} written"
        assert sorted(got) == [f"row-{i:06d}" for i in range(n)]
        df.unpersist()
    finally:
        c.stop_all()


@pytest.mark.parametrize("options, message", [
    ({"queue": "x"}, "option 'hosts' is required"),
    ({"hosts": "127.0.0.1:1111"}, "no queue: set option 'queue'"),
    ({"hosts": "127.0.0.1:1111", "queue": "x", "batchSize": "many"},
     "option 'batchSize' must be an integer"),
    ({"hosts": "127.0.0.1:1111", "queue": "x", "delay": "-5"},
     "option 'delay' must not be negative"),
    ({"hosts": "127.0.0.1:1111", "queue": "x", "delaySeconds": "5"},
     "unknown option"),
])
def test_bad_options_fail_the_write_with_a_clear_error(spark, options, message):
    df = spark.range(3).selectExpr("CAST(id AS STRING) AS data")
    writer = df.write.format("qserver").mode("append")
    for k, v in options.items():
        writer = writer.option(k, v)
    with pytest.raises(PySparkException, match=message):
        writer.save()


def test_overwrite_and_complete_modes_are_refused(spark, hosts, tmp_path):
    df = spark.range(3).selectExpr("CAST(id AS STRING) AS data")
    with pytest.raises(PySparkException, match="'overwrite' is not supported"):
        df.write.format("qserver").option("hosts", hosts).option("queue", "x") \
            .mode("overwrite").save()
    counts = (spark.readStream.format("rate").option("rowsPerSecond", 1).load()
              .groupBy().count().selectExpr("CAST(count AS STRING) AS data"))
    with pytest.raises(PySparkException, match="'complete' is not supported"):
        query = (counts.writeStream.format("qserver").option("hosts", hosts)
                 .option("queue", "x").outputMode("complete")
                 .option("checkpointLocation", str(tmp_path / "cp")).start())
        try:
            query.awaitTermination(DEADLINE_S)
        finally:
            query.stop()


def test_a_null_queue_fails_the_task_naming_the_column(spark, hosts):
    df = spark.createDataFrame([("a", "spark_nulls"), ("b", None)], "data STRING, queue STRING")
    with pytest.raises(PySparkException, match="queue column 'queue' is null"):
        df.coalesce(1).write.format("qserver").option("hosts", hosts).mode("append").save()
    # rows before the bad one in its batch were not sent
    with Client(hosts) as client:
        assert client.monitor("spark_nulls")["size"] == 0


# -- the option parser and the row converter, without the JVM ----------------


SCHEMA = StructType([
    StructField("data", StringType()), StructField("queue", StringType()),
    StructField("at", TimestampType()), StructField("local_at", TimestampNTZType()),
    StructField("secs", DoubleType()), StructField("n", LongType()),
])


def parse(**options):
    return parse_options({"hosts": "h:1", **options}, SCHEMA)


def test_options_defaults_and_overrides():
    o = parse()
    assert o.hosts == ("h:1",)
    assert (o.queue, o.queue_column, o.data_column) == (None, "queue", "data")
    assert (o.batch_size, o.timeout_s) == (1000, 5.0)
    o = parse(queue="q", delay="30", retryColumn="n", ttlColumn="at", BATCHSIZE="10")
    assert (o.queue, o.queue_column) == ("q", None)  # the option overrides the column
    assert o.delay.constant == 30 and o.retry.column == "n" and o.ttl.is_timestamp
    assert o.batch_size == 10  # option names are case-insensitive
    o = parse(rowAsJson="true", delayColumn="at")
    assert o.data_column is None
    assert o.json_columns == ("data", "local_at", "secs", "n")  # not queue, not at
    o = parse_options({"hosts": " a:1 , b:2 ", "queue": "q"},
                      StructType([StructField("x", LongType())]))
    assert o.hosts == ("a:1", "b:2") and o.data_column is None  # no data column: JSON
    assert o.json_columns == ("x",)


@pytest.mark.parametrize("options, message", [
    ({"hosts": ""}, "'hosts' is required"),
    ({"hosts": "h"}, "'h' is not host:port"),
    ({"hosts": "h:0"}, "is not host:port"),
    ({"queue": ""}, "'queue' must be 1 to 255"),
    ({"queueColumn": "nope"}, "no queue"),
    ({"queueColumn": "n"}, "queue column 'n' must be a string, not bigint"),
    ({"dataColumn": "nope"}, "'dataColumn': no column 'nope'"),
    ({"rowAsJson": "maybe"}, "'rowAsJson' must be true or false"),
    ({"delay": "5", "delayColumn": "n"}, "not both"),
    ({"delay": "soon"}, "'delay' must be a number"),
    ({"ttl": "inf"}, "'ttl' must be finite"),
    ({"retryColumn": "at"}, "retry column 'at' must be a number of seconds, not timestamp"),
    ({"delayColumn": "data"}, "must be a number of seconds or a timestamp, not string"),
    ({"delayColumn": "local_at"}, "timestamp without time zone"),
    ({"batchSize": "0"}, r"'batchSize' must be 1 to 1000 \(rows per batch produce request"),
    ({"batchSize": "1001"}, r"'batchSize' must be 1 to 1000 \(rows per batch produce request"),
    ({"batchSize": "100001", "batchProduce": "false"}, "'batchSize' must be 1 to 100000"),
    ({"batchProduce": "sometimes"}, "'batchProduce' must be true or false"),
    ({"priority": "high"}, "'priority' must be an integer from 0 to 2147483647"),
    ({"priority": "-1"}, "'priority' must be an integer from 0 to 2147483647"),
    ({"priority": "2147483648"}, "'priority' must be an integer from 0 to 2147483647"),
    ({"priority": "1", "priorityColumn": "n"}, "'priority' .* or 'priorityColumn' .*not both"),
    ({"priorityColumn": "nope"}, "'priorityColumn': no column 'nope'"),
    ({"priorityColumn": "secs"}, "priority column 'secs' must be an integer, not double"),
    ({"dedupColumn": "nope"}, "option 'dedupColumn': no column 'nope'"),
    ({"dedupColumn": "secs"}, "dedup column 'secs' must be a string or an integer, not double"),
    ({"dedupColumn": "n", "dedupKey": "n"}, "'dedupColumn' .* or 'dedupKey' .*not both"),
    ({"dedupKey": "concat(data, ':', n)"},
     r"option 'dedupKey': no column 'concat\(data'.*add it as a column first"),
    ({"dedupKey": "data,at"}, "dedup column 'at' must be a string or an integer, not timestamp"),
    ({"dedupKey": "n, n"}, "'dedupKey' names a column twice"),
    ({"timeout": "0"}, "'timeout' must be positive"),
    ({"hostz": "h:1"}, r"unknown option\(s\) \['hostz'\]"),
])
def test_bad_options(options, message):
    with pytest.raises(OptionError, match=message):
        parse(**options)


def test_new_options_priority_dedup_and_batch_produce():
    o = parse()
    assert (o.priority, o.priority_column, o.dedup_columns, o.batch_produce) == (
        None, None, (), True)
    o = parse(priority="0", dedupColumn="data", batchProduce="false", batchSize="5000")
    assert (o.priority, o.dedup_columns, o.batch_produce, o.batch_size) == (
        0, ("data",), False, 5000)
    o = parse(priorityColumn="n", dedupKey=" data , n ", rowAsJson="true")
    assert (o.priority_column, o.dedup_columns) == ("n", ("data", "n"))
    # the priority column is not part of the message; the dedup columns are
    assert o.json_columns == ("data", "at", "local_at", "secs")


def test_rows_with_priority_and_dedup_ids():
    opts = parse(priorityColumn="n", dedupKey="data,n")
    batch = pa.record_batch({
        "data": ["a", "b"], "queue": ["q", "q"],
        "at": pa.array([None, None], pa.timestamp("us", tz="UTC")),
        "local_at": pa.array([None, None], pa.timestamp("us")),
        "secs": [1.0, 2.0], "n": pa.array([7, None], pa.int64()),
    })
    with pytest.raises(RowError, match="row 1: dedup column 'n' is null"):
        batch_items(batch, opts)
    batch = batch.set_column(5, "n", pa.array([7, 2**31 - 1], pa.int64()))
    assert batch_items(batch, opts) == [
        {"queue": "q", "data": "a", "priority": 7, "dedup_id": "a:7"},
        {"queue": "q", "data": "b", "priority": 2**31 - 1, "dedup_id": "b:2147483647"},
    ]
    opts = parse(priority="5", dedupColumn="data")
    assert batch_items(batch, opts) == [
        {"queue": "q", "data": "a", "priority": 5, "dedup_id": "a"},
        {"queue": "q", "data": "b", "priority": 5, "dedup_id": "b"},
    ]
    bad = batch.set_column(5, "n", pa.array([1, 2**31], pa.int64()))
    with pytest.raises(RowError, match="row 11: priority column 'n' holds 2147483648"):
        batch_items(bad, parse(priorityColumn="n"), first_row=10)
    long = batch.set_column(0, "data", pa.array(["a", "x" * 129]))
    with pytest.raises(RowError, match="row 1: the dedup id from column 'data' is 129 characters"):
        batch_items(long, parse(dedupColumn="data"))
    empty = batch.set_column(0, "data", pa.array(["", "b"]))
    with pytest.raises(RowError, match="row 0: the dedup id from column 'data' is 0 characters"):
        batch_items(empty, parse(dedupColumn="data"))


def test_batch_builder_cuts_requests_per_queue_by_rows_and_bytes():
    builder = BatchBuilder(batch_size=3)
    items = [{"queue": "a" if i % 2 else "b", "data": f"m{i}"} for i in range(8)]
    ready = builder.add(items, now_s=1e9)
    # b holds 0, 2, 4 (cut), then 6; a holds 1, 3, 5 (cut), then 7
    assert [(r["queue"], [m["data"] for m in r["messages"]]) for r in ready] == [
        ("b", ["m0", "m2", "m4"]), ("a", ["m1", "m3", "m5"])]
    assert builder.pending == 2
    rest = builder.flush()
    assert sorted((r["queue"], [m["data"] for m in r["messages"]]) for r in rest) == [
        ("a", ["m7"]), ("b", ["m6"])]
    assert builder.pending == 0 and builder.flush() == []
    assert all(r["action"] == 1 and "data" not in r for r in ready + rest)

    # at most 1,000 messages per request whatever the batch size asked
    assert BatchBuilder(5000).batch_size == 1000
    # and under MAX_REQUEST_BYTES encoded
    big = "x" * 100_000
    builder = BatchBuilder(1000)
    ready = builder.add(({"queue": "q", "data": big} for _ in range(20)), now_s=1e9)
    ready += builder.flush()
    assert [len(r["messages"]) for r in ready] == [8, 8, 4]
    assert all(len(json.dumps(r)) < MAX_REQUEST_BYTES for r in ready)
    # times absolute, rounded up; only what is set
    now = 1_700_000_000.5
    [request] = BatchBuilder(2).add([
        {"queue": "q", "data": "a", "delay": 10, "ttl": 3600, "retry": 1.5, "priority": 3,
         "dedup_id": "k"},
        {"queue": "q", "data": "b", "delay": now - 5}], now)
    assert request["messages"] == [
        {"data": "a", "delay": 1_700_000_011, "ttl": 1_700_003_601, "retry": 2, "priority": 3,
         "dedup_id": "k"},
        {"data": "b"},  # a past delay: ready now
    ]


def test_single_requests_and_answer_counts():
    items = [{"queue": "q", "data": "a", "priority": 1, "dedup_id": "k1"},
             {"queue": "r", "data": "b"}]
    singles = single_requests(items, now_s=1e9)
    assert singles == [
        {"action": 1, "queue": "q", "data": "a", "priority": 1, "dedup_id": "k1"},
        {"action": 1, "queue": "r", "data": "b"}]
    assert count_answers(singles, [{"code": 0, "msg_id": 1, "duplicate": True},
                                   {"code": 0, "msg_id": 2}]) == (2, 1)
    batch = {"action": 1, "queue": "q", "messages": [{"data": "a"}, {"data": "b"}]}
    assert count_answers([batch, batch, batch], [
        {"code": 0, "msg_ids": [1, 2], "duplicates": [1]},
        {"code": -1, "reason": "queue full: q"}, None]) == (2, 1)


def test_rows_become_produce_items():
    opts = parse(delayColumn="at", ttl="3600", retryColumn="n")
    at = dt.datetime(2030, 1, 1, tzinfo=dt.UTC)
    batch = pa.record_batch({
        "data": ["a", "b"], "queue": ["q1", "q2"],
        "at": pa.array([at, None], pa.timestamp("us", tz="UTC")),
        "local_at": pa.array([None, None], pa.timestamp("us")),
        "secs": [1.0, 2.0], "n": pa.array([60, None], pa.int64()),
    })
    assert batch_items(batch, opts) == [
        {"queue": "q1", "data": "a", "delay": at.timestamp(), "ttl": 3600.0, "retry": 60},
        {"queue": "q2", "data": "b", "ttl": 3600.0},  # nulls leave the field out
    ]


def test_row_json_encodes_spark_types():
    schema = StructType([StructField("x", LongType())])
    opts = parse_options({"hosts": "h:1", "queue": "q"}, schema)
    opts = dataclasses.replace(
        opts, json_columns=("id", "amount", "at", "day", "raw", "tags", "pos"))
    batch = pa.record_batch({
        "id": [1], "amount": pa.array([decimal.Decimal("12.50")], pa.decimal128(10, 2)),
        "at": pa.array([dt.datetime(2030, 1, 1, 8, 0, tzinfo=dt.UTC)],
                       pa.timestamp("us", tz="UTC")),
        "day": pa.array([dt.date(2030, 1, 2)]), "raw": pa.array([b"\x00\xff"]),
        "tags": pa.array([[("k", 1)]], pa.map_(pa.string(), pa.int64())),
        "pos": pa.array([{"lat": 1.5, "lon": None}]),
    })
    [item] = batch_items(batch, opts)
    assert json.loads(item["data"]) == {
        "id": 1, "amount": "12.50", "at": "2030-01-01T08:00:00+00:00", "day": "2030-01-02",
        "raw": "AP8=", "tags": {"k": 1}, "pos": {"lat": 1.5, "lon": None}}


def test_bad_rows_name_the_row_and_column():
    opts = parse()
    batch = pa.record_batch({"data": ["a", None], "queue": ["q", "q"]})
    with pytest.raises(RowError, match="row 11: data column 'data' is null"):
        batch_items(batch, opts, first_row=10)
    schema = StructType([StructField("data", StringType())])
    opts = parse_options({"hosts": "h:1", "queue": "q"}, schema)
    batch = pa.record_batch({"data": pa.array([b"\xff"], pa.binary())})
    with pytest.raises(RowError, match="row 0: data column 'data' is not UTF-8"):
        batch_items(batch, opts)


def test_commit_messages_add_up():
    s = summarize([QServerCommitMessage(rows=3, batches=1, queues={"a": 2, "b": 1}),
                   None, QServerCommitMessage(rows=2, batches=2, queues={"a": 2})])
    assert (s.tasks, s.failed_tasks, s.rows, s.batches) == (2, 1, 5, 3)
    assert s.queues == {"a": 4, "b": 1}
    assert s.describe() == "5 rows in 3 batches from 2 tasks, 1 failed (per queue: a: 4, b: 1)"
    s = summarize([QServerCommitMessage(rows=3, batches=1, queues={"a": 3}, duplicates=2)])
    assert s.duplicates == 2
    assert s.describe().endswith("; 2 of them already stored (same dedup id within the queue's "
                                 "dedup window): not stored again")
