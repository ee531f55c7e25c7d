"""The "qserver" Spark sink (spark_integration/qserver_spark) on a real local
Spark (local[2]) against a real three-node cluster: batch and streaming
writes drained with consume+confirm, per-row queue/time columns, the row as
JSON, and the errors of bad options. The option parser and the row
converter are also tested on their own, without the JVM.

One Spark session (one JVM) and one cluster serve the whole module; every
test writes to queues of its own.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import decimal
import json
import os
import shutil
import sys
import time

import pytest

pytest.importorskip("pyspark", reason="pyspark is not installed (the project's 'spark' extra)")
pytest.importorskip("pyarrow", reason="pyarrow is not installed (the project's 'spark' extra)")
if shutil.which("java") is None and not os.environ.get("JAVA_HOME"):
    pytest.skip("java is not installed: Spark needs a JVM", allow_module_level=True)

import pyarrow as pa
from pyspark.errors import PySparkException
from pyspark.sql import SparkSession
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

import qserver_spark
from procs import Cluster, TcpClient
from qserver.client import Client
from qserver_spark import OptionError, RowError, parse_options, summarize
from qserver_spark.datasource import QServerCommitMessage
from qserver_spark.rows import batch_items

DEADLINE_S = 60.0  # generous: CI is a shared, noisy 2-core machine

# The sink's client resends a produce a node leaves unanswered for `timeout`
# seconds (at-least-once), which may store it twice. The tests count
# messages exactly, so they give a busy machine far longer than the default.
TIMEOUT = "60"

# Consumes (then confirms) in flight at a time while draining a queue.
PIPELINE = 200


@pytest.fixture(scope="session")
def spark():
    # Spark's Python workers must run this interpreter (it has qserver_spark),
    # not whatever "python3" is on the PATH.
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    session = (SparkSession.builder.master("local[2]")
               .appName("qserver-tests")
               .config("spark.ui.enabled", "false")
               .config("spark.ui.showConsoleProgress", "false")
               .config("spark.sql.shuffle.partitions", "2")
               .config("spark.driver.memory", "512m")
               .getOrCreate())
    session.sparkContext.setLogLevel("ERROR")
    session.dataSource.register(qserver_spark.QServerDataSource)
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
    ({"batchSize": "0"}, "'batchSize' must be 1 to 100000"),
    ({"timeout": "0"}, "'timeout' must be positive"),
    ({"hostz": "h:1"}, r"unknown option\(s\) \['hostz'\]"),
])
def test_bad_options(options, message):
    with pytest.raises(OptionError, match=message):
        parse(**options)


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
