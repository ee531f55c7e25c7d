"""The Spark sink's rows per second with single produces and with batch
produce, and the Spark source's against the client's own consume+confirm
loop, in one run.

    python bench/spark_bench.py [--rows 100000] [--repeat 3] [--partitions 2]
                                [--master local[2]] [--dedup] [--windows 1,2,4,8]
                                [--source-rows 50000] [--per-batch 10000]
                                [--dead-letter-fields]

It starts a three-node cluster of real `qserver run` processes on free
loopback ports (tests/procs.py's Cluster, quorum mode, no storage), waits
for a master, starts a local Spark session, and then, --repeat times,
alternating which side goes first, writes a cached DataFrame of --rows rows
(a 14-character string per row) in --partitions partitions with
`df.write.format("qserver")...save()`:

- single: `batchProduce=false`, the sink before batch produce: one produce
  request per row, pipelined (qserver_spark.datasource.PIPELINE_WINDOW in
  flight per task), 1,000 rows per pipelined group (`batchSize`);
- batch: the default, one batch produce request per 1,000 rows
  (`batchSize`), PIPELINE_REQUESTS in flight per task; each request is one
  log entry.

Rows/s are timed around the write action only (the job, its tasks, the
Arrow hand-over, the row conversion, the produces, the commit). The sink is
given every node and finds the master itself. A warm-up write of each side
first (Spark's Python workers start then, not in a measured run). With
--dedup every row also carries a dedup id (`dedupColumn`, unique per run:
nothing is a duplicate), to see what the server's dedup table costs.

With --windows, it also times the code one sink task runs
(`qserver_spark.datasource.write_rows`, in this process, without Spark) on
the same rows as Arrow record batches of 10,000 rows (Spark's default),
with each number of batch requests in flight (the sink's
PIPELINE_REQUESTS), alternating, --repeat runs each: what chose
PIPELINE_REQUESTS.

The source (--source-rows, 0 to skip it; --rows 0 skips the sink): before
each run the bench fills a queue with --source-rows messages (retry 60 s,
produced with batch produce, not timed), then times until the queue is
empty, every message consumed and confirmed, on two sides, alternating:

- client: the client's own loop on one connection, as a fast consumer
  would write it: `consume(count=1000, lease=60)`, then the confirms of
  those deliveries with their receipts, pipelined (200 in flight, as the
  source's), until a consume comes back empty;
- spark: a streaming query `spark.readStream.format("qserver")` with
  maxMessagesPerBatch=--per-batch into Spark's `noop` sink (the rows are
  produced and dropped), timed from `start()` to the queue being empty (the
  last batch is confirmed at the trigger after it); deadLetterFields off
  unless --dead-letter-fields (then one show per message more).

It prints every run (and whether the master changed during it),
min/median/max rows/s per side, and the ratio batch/single of the medians
(spark/client for the source).
Each side writes into a queue of its own; at the end the queues must hold
every row (fewer: rows were lost, the figures are not valid; more:
produces the client resent after a master change, a timeout or a broken
connection, at-least-once without a dedup id). The machine's load average
is printed at the start and the end: the cluster, the JVM and Spark's
Python workers share its CPUs. Every process it starts is stopped when it
ends, Ctrl-C too.
"""

from __future__ import annotations

import argparse
import os
import shlex
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))

from procs import Cluster  # noqa: E402
from qserver.client import Client  # noqa: E402

# The bench's queues keep every message it writes (warm-up and repeats, both
# sides); qserver's default queue_size (1e6) is far enough for the defaults
# but not for --rows 500000 --repeat 3, so the bench's nodes allow more.
BENCH_QUEUE_SIZE = 100_000_000

# Rows per request (batch) or per pipelined group (single): the sink's default.
BATCH_SIZE = 1000

SIDES = ("single", "batch")
SOURCE_SIDES = ("client", "spark")

# The source's lease in the bench: far longer than a run.
SOURCE_LEASE_S = 60


def _interrupted(signum, frame) -> None:
    raise KeyboardInterrupt(signal.Signals(signum).name)


def start_spark(master: str, partitions: int):
    # Spark's Python workers must run this interpreter (it has qserver and
    # qserver_spark), not whatever "python3" is on the PATH.
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    from pyspark.sql import SparkSession

    import qserver_spark

    spark = (SparkSession.builder.master(master).appName("qserver-spark-bench")
             .config("spark.ui.enabled", "false")
             .config("spark.ui.showConsoleProgress", "false")
             .config("spark.sql.shuffle.partitions", str(partitions))
             .getOrCreate())
    spark.sparkContext.setLogLevel("ERROR")
    spark.dataSource.register(qserver_spark.QServerDataSource)
    return spark


def run_spark(df, hosts: str, queue: str, side: str, dedup_tag: str | None) -> float:
    """Seconds of one `save()` of `df` into `queue` on `side`."""
    from pyspark.sql import functions as F

    writer_df = df
    if dedup_tag is not None:
        writer_df = df.withColumn("key", F.concat(F.lit(dedup_tag), F.col("data")))
    writer = (writer_df.write.format("qserver").option("hosts", hosts).option("queue", queue)
              .option("batchSize", str(BATCH_SIZE))
              .option("batchProduce", "true" if side == "batch" else "false"))
    if dedup_tag is not None:
        writer = writer.option("dedupColumn", "key")
    start = time.perf_counter()
    writer.mode("append").save()
    return time.perf_counter() - start


def run_task(hosts: str, queue: str, rows: int, window: int) -> float:
    """Seconds of one `write_rows` (one sink task) of `rows` rows into
    `queue` with `window` batch requests in flight."""
    import pyarrow as pa
    from pyspark.sql.types import StringType, StructField, StructType

    from qserver_spark import datasource, parse_options

    schema = StructType([StructField("data", StringType())])
    opts = parse_options({"hosts": hosts, "queue": queue}, schema)
    batches = [pa.record_batch({"data": [f"order-{i:08d}" for i in range(k, min(k + 10_000,
                                                                               rows))]})
               for k in range(0, rows, 10_000)]
    saved = datasource.PIPELINE_REQUESTS
    datasource.PIPELINE_REQUESTS = window
    try:
        start = time.perf_counter()
        datasource.write_rows(iter(batches), opts)
        return time.perf_counter() - start
    finally:
        datasource.PIPELINE_REQUESTS = saved


def fill(hosts: str, queue: str, rows: int) -> None:
    """`rows` at-least-once messages into `queue` (not timed)."""
    with Client(hosts, timeout=60) as client:
        client.produce_batch(queue, (f"order-{i:08d}" for i in range(rows)), retry=60)


def run_source_client(hosts: str, queue: str) -> tuple[float, int]:
    """Seconds to drain `queue` with the client's consume+confirm loop; the
    messages confirmed."""
    from qserver.client.core import confirm_request

    confirmed = 0
    start = time.perf_counter()
    with Client(hosts, timeout=60) as client:
        while True:
            got = client.consume(queue, count=1000, lease=SOURCE_LEASE_S)
            if not got:
                break
            answers = client._exchange([confirm_request(queue, d.msg_id, d.receipt)
                                        for d in got], 200, stop_on_error=True)
            confirmed += sum(1 for a in answers if a is not None and a.get("code") == 0)
    return time.perf_counter() - start, confirmed


def run_source_spark(spark, hosts: str, queue: str, per_batch: int, dead_letter_fields: bool,
                     checkpoint: str) -> tuple[float, int]:
    """Seconds from a streaming query's start to `queue` being empty; the
    rows the query read (its progress reports)."""
    start = time.perf_counter()
    query = (spark.readStream.format("qserver").option("hosts", hosts).option("queue", queue)
             .option("maxMessagesPerBatch", str(per_batch)).option("lease", str(SOURCE_LEASE_S))
             .option("wait", "0.2")
             .option("deadLetterFields", "true" if dead_letter_fields else "false").load()
             .writeStream.format("noop").option("checkpointLocation", checkpoint)
             .trigger(processingTime="0 seconds").start())
    try:
        with Client(hosts, timeout=60) as client:
            while client.monitor(queue)["size"]:
                if query.exception() is not None:
                    raise RuntimeError(f"the query failed: {query.exception()}")
                time.sleep(0.05)
        seconds = time.perf_counter() - start
    finally:
        query.stop()
    return seconds, sum(p["numInputRows"] for p in query.recentProgress)


def vote_id(hosts: str) -> int:
    with Client(hosts) as client:
        return client.monitor()["vote_id"]


def source_runs(spark, hosts: str, args: argparse.Namespace, tmp: Path,
                times: dict[str, list[float]]) -> None:
    """The source's runs (see the module docstring): a warm-up of each side,
    then --repeat runs per side, alternating; each drains a queue of its own
    filled before it."""
    runs = 0

    def one(side: str, label: str) -> float:
        nonlocal runs
        runs += 1
        queue = f"bench_source_{runs}"
        fill(hosts, queue, args.source_rows)
        epoch = vote_id(hosts)
        if side == "client":
            seconds, got = run_source_client(hosts, queue)
        else:
            seconds, got = run_source_spark(spark, hosts, queue, args.per_batch,
                                            args.dead_letter_fields,
                                            str(tmp / f"source-checkpoint-{runs}"))
        changed = "  (the master changed)" if vote_id(hosts) != epoch else ""
        extra = f", {got - args.source_rows} read twice" if got > args.source_rows else ""
        print(f"  source {side:6} {label}: {args.source_rows / seconds:>9,.0f} rows/s "
              f"({seconds:.2f} s{extra}){changed}", flush=True)
        return seconds

    for side in SOURCE_SIDES:
        one(side, "warm-up")
    for i in range(args.repeat):
        for side in (SOURCE_SIDES if i % 2 == 0 else SOURCE_SIDES[::-1]):
            times[side].append(one(side, f"run {i + 1}/{args.repeat}"))


def _stats(values: list[float]) -> tuple[float, float, float]:
    return min(values), statistics.median(values), max(values)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="the qserver Spark sink: single produces against "
                                            "batch produce, same run")
    p.add_argument("--rows", type=int, default=100_000, help="rows per run (default 100000)")
    p.add_argument("--repeat", type=int, default=3, help="runs per side (default 3)")
    p.add_argument("--partitions", type=int, default=2,
                   help="partitions of the DataFrame, i.e. sink tasks (default 2)")
    p.add_argument("--master", default="local[2]", help="Spark master (default local[2])")
    p.add_argument("--dedup", action="store_true",
                   help="every row carries a dedup id (dedupColumn), unique per run")
    p.add_argument("--windows", default="",
                   help="also time one task's write_rows with each of these numbers of batch "
                        "requests in flight, e.g. 1,2,4,8")
    p.add_argument("--source-rows", type=int, default=50_000,
                   help="messages per source run (default 50000; 0: no source runs)")
    p.add_argument("--per-batch", type=int, default=10_000,
                   help="the source's maxMessagesPerBatch (default 10000)")
    p.add_argument("--dead-letter-fields", action="store_true",
                   help="the source looks each message up for its dead-letter fields")
    args = p.parse_args(argv)
    windows = [int(w) for w in args.windows.split(",") if w.strip()]

    cmdline = [sys.executable, sys.argv[0]] + (sys.argv[1:] if argv is None else argv)
    print("$ " + shlex.join(cmdline))
    print(f"python {sys.version.split()[0]}, {os.cpu_count()} cpus, load average "
          f"{os.getloadavg()[0]:.2f} at start; {args.rows} rows per run, {args.repeat} runs "
          f"per side, {BATCH_SIZE} rows per request or group, {args.partitions} partitions on "
          f"{args.master}{', dedup ids' if args.dedup else ''}", flush=True)
    signal.signal(signal.SIGTERM, _interrupted)
    times: dict[str, list[float]] = {side: [] for side in SIDES}
    source_times: dict[str, list[float]] = {side: [] for side in SOURCE_SIDES}
    spark = None
    runs = 0
    with tempfile.TemporaryDirectory(prefix="qserver-spark-bench-") as tmp:
        cluster = Cluster(Path(tmp), extra=f'  <queue_config queue_size="{BENCH_QUEUE_SIZE}"/>\n')
        try:
            cluster.start_all()
            master = cluster.wait_master()
            hosts = ",".join(f"127.0.0.1:{port}" for port in cluster.client_ports)
            print(f"cluster: three nodes on {hosts}, node {master} is master", flush=True)

            started = time.perf_counter()
            spark = start_spark(args.master, args.partitions)
            print(f"spark {spark.version} up in {time.perf_counter() - started:.1f} s", flush=True)
            df = (spark.range(args.rows, numPartitions=args.partitions)
                  .selectExpr("format_string('order-%08d', id) AS data").cache())
            df.count()  # materialize the cache: the runs measure the write only

            def tag() -> str | None:
                nonlocal runs
                runs += 1
                return f"run{runs}-" if args.dedup else None

            if args.rows:
                warm = {side: run_spark(df, hosts, "bench_warmup", side, tag())
                        for side in SIDES}
                print("warmed up: " + ", ".join(f"{side} {args.rows / s:,.0f} rows/s"
                                                for side, s in warm.items()), flush=True)

            for i in range(args.repeat if args.rows else 0):
                for side in (SIDES if i % 2 == 0 else SIDES[::-1]):
                    epoch = vote_id(hosts)
                    seconds = run_spark(df, hosts, f"bench_{side}", side, tag())
                    times[side].append(seconds)
                    changed = "  (the master changed)" if vote_id(hosts) != epoch else ""
                    print(f"  {side:6} run {i + 1}/{args.repeat}: {args.rows / seconds:>9,.0f} "
                          f"rows/s ({seconds:.2f} s){changed}", flush=True)
            task_times: dict[int, list[float]] = {w: [] for w in windows}
            if windows:
                print(f"one task's write_rows, {args.rows} rows, by batch requests in flight:",
                      flush=True)
                run_task(hosts, "bench_warmup", args.rows, windows[0])
            for i in range(args.repeat if windows else 0):
                for w in (windows if i % 2 == 0 else windows[::-1]):
                    epoch = vote_id(hosts)
                    seconds = run_task(hosts, f"bench_task_{w}", args.rows, w)
                    task_times[w].append(seconds)
                    changed = "  (the master changed)" if vote_id(hosts) != epoch else ""
                    print(f"  {w:>2} in flight, run {i + 1}/{args.repeat}: "
                          f"{args.rows / seconds:>9,.0f} rows/s ({seconds:.2f} s){changed}",
                          flush=True)
            if args.source_rows:
                source_runs(spark, hosts, args, Path(tmp), source_times)
            with Client(hosts) as client:
                sizes = {side: client.monitor(f"bench_{side}")["size"] for side in SIDES}
            want = args.rows * args.repeat
            for side, size in sizes.items() if args.rows else ():
                if size < want:
                    print(f"bench_{side} holds {size} messages, expected {want}: rows were "
                          f"lost, the figures are not valid")
                    return 1
                if size > want:
                    print(f"bench_{side} holds {size - want} duplicates: produces the client "
                          f"sent again after a master change, a timeout or a broken connection "
                          f"(at-least-once{'' if args.dedup else ': no dedup ids'})")
        except KeyboardInterrupt:
            print("\ninterrupted; stopping the cluster", file=sys.stderr)
            return 130
        finally:
            signal.signal(signal.SIGINT, signal.SIG_IGN)  # let the cleanup finish
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            if spark is not None:
                spark.stop()
            cluster.stop_all()

    header = f"{'side':6} {'runs':>4} {'min rows/s':>11} {'median':>9} {'max':>9} {'ratio':>6}"
    if args.rows:
        print("\nthe sink: rows written per second")
        print(header)
        print("-" * len(header))
        medians = {}
        for side in SIDES:
            rates = [args.rows / s for s in times[side]]
            lo, med, hi = _stats(rates)
            medians[side] = med
            ratio = f"{med / medians['single']:.2f}" if side == "batch" else ""
            print(f"{side:6} {len(rates):>4} {lo:>11,.0f} {med:>9,.0f} {hi:>9,.0f} {ratio:>6}")
        print(f"\nbatch / single (medians): {medians['batch'] / medians['single']:.2f}")
    if args.source_rows:
        print(f"\nthe source: messages read and confirmed per second ({args.source_rows} per "
              f"run, {args.per_batch} per micro-batch)")
        print(header)
        print("-" * len(header))
        medians = {}
        for side in SOURCE_SIDES:
            rates = [args.source_rows / s for s in source_times[side]]
            lo, med, hi = _stats(rates)
            medians[side] = med
            ratio = f"{med / medians['client']:.2f}" if side == "spark" else ""
            print(f"{side:6} {len(rates):>4} {lo:>11,.0f} {med:>9,.0f} {hi:>9,.0f} {ratio:>6}")
        print(f"\nspark / client (medians): {medians['spark'] / medians['client']:.2f}")
    if windows:
        print(f"\n{'in flight':>9} {'runs':>4} {'min rows/s':>11} {'median':>9} {'max':>9}")
        for w in windows:
            lo, med, hi = _stats([args.rows / s for s in task_times[w]])
            print(f"{w:>9} {len(task_times[w]):>4} {lo:>11,.0f} {med:>9,.0f} {hi:>9,.0f}")
    print(f"load average {os.getloadavg()[0]:.2f} at the end")
    return 0


if __name__ == "__main__":
    sys.exit(main())
