"""The Spark sink against the client it is built on, in one run.

    python bench/spark_bench.py [--rows 100000] [--repeat 3] [--batch-size 1000]
                                [--partitions 2] [--master local[2]]

It starts a three-node cluster of real `qserver run` processes on free
loopback ports (tests/procs.py's Cluster, quorum mode, no storage), waits
for a master, starts a local Spark session, and then, --repeat times,
alternating which side goes first:

- client: `qserver.client.Client.produce_many` of --rows ready-made items,
  --batch-size per call, on one connection to the master, with the sink's
  pipelining window (qserver_spark.datasource.PIPELINE_WINDOW) and timeout
  (qserver_spark.options.DEFAULT_TIMEOUT_S); rows/s
  from the first call to the last answer. This is what one Python process can push through one
  connection: the ceiling the sink is measured against.
- spark: `df.write.format("qserver")...save()` of a cached DataFrame of
  --rows rows in --partitions partitions on --master; rows/s timed around
  the write action only (the job, its tasks, the Arrow hand-over, the row
  conversion, the produces, the commit). The sink is given every node and
  finds the master itself, as the client side is given it. A warm-up write first (Spark's
  Python workers and the JIT start then, not in a measured run).

Both write the same data (a 14-character string per row) into a queue of
their own and use the same batch size. It prints every run, min/median/max
rows/s per side, and the ratio spark/client of the medians; the goal is a
ratio of at least 0.5. The machine's load average is printed at the start
and the end: the cluster, the JVM, Spark's Python workers and the client
all share its CPUs. Every process it starts is stopped when it ends, Ctrl-C
too.
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
from qserver_spark.datasource import PIPELINE_WINDOW  # noqa: E402
from qserver_spark.options import DEFAULT_TIMEOUT_S  # noqa: E402

# The bench's queues keep every message it writes (warm-up and repeats, both
# sides); qserver's default queue_size (1e6) is far enough for the defaults
# but not for --rows 500000 --repeat 3, so the bench's nodes allow more.
BENCH_QUEUE_SIZE = 100_000_000

# The goal of the issue that asked for this bench.
RATIO_GOAL = 0.5

SIDES = ("client", "spark")


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


def run_client(hosts: str, items: list[dict], batch_size: int) -> float:
    """Seconds to produce `items` with produce_many, batch_size per call."""
    with Client(hosts, timeout=DEFAULT_TIMEOUT_S) as client:
        client.leader()  # connect (not timed)
        start = time.perf_counter()
        for i in range(0, len(items), batch_size):
            client.produce_many(items[i:i + batch_size], window=PIPELINE_WINDOW)
        return time.perf_counter() - start


def run_spark(df, hosts: str, queue: str, batch_size: int) -> float:
    """Seconds of one `save()` of `df` into `queue`."""
    start = time.perf_counter()
    (df.write.format("qserver").option("hosts", hosts).option("queue", queue)
     .option("batchSize", str(batch_size)).mode("append").save())
    return time.perf_counter() - start


def _stats(values: list[float]) -> tuple[float, float, float]:
    return min(values), statistics.median(values), max(values)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="the qserver Spark sink vs produce_many, same run")
    p.add_argument("--rows", type=int, default=100_000, help="rows per run (default 100000)")
    p.add_argument("--repeat", type=int, default=3, help="runs per side (default 3)")
    p.add_argument("--batch-size", type=int, default=1000,
                   help="rows per produce_many, both sides (default 1000)")
    p.add_argument("--partitions", type=int, default=2,
                   help="partitions of the DataFrame, i.e. sink tasks (default 2)")
    p.add_argument("--master", default="local[2]", help="Spark master (default local[2])")
    args = p.parse_args(argv)

    cmdline = [sys.executable, sys.argv[0]] + (sys.argv[1:] if argv is None else argv)
    print("$ " + shlex.join(cmdline))
    print(f"python {sys.version.split()[0]}, {os.cpu_count()} cpus, load average "
          f"{os.getloadavg()[0]:.2f} at start; {args.rows} rows per run, {args.repeat} runs "
          f"per side, batch size {args.batch_size}, {args.partitions} partitions on "
          f"{args.master}", flush=True)
    signal.signal(signal.SIGTERM, _interrupted)
    times: dict[str, list[float]] = {side: [] for side in SIDES}
    spark = None
    with tempfile.TemporaryDirectory(prefix="qserver-spark-bench-") as tmp:
        cluster = Cluster(Path(tmp), extra=f'  <queue_config queue_size="{BENCH_QUEUE_SIZE}"/>\n')
        try:
            cluster.start_all()
            master = cluster.wait_master()
            hosts = ",".join(f"127.0.0.1:{port}" for port in cluster.client_ports)
            # The sink finds the master itself (qserver_spark.datasource.master_first);
            # the client is given it first, so that neither pays for forwarding.
            client_hosts = ",".join(f"127.0.0.1:{port}" for port in sorted(
                cluster.client_ports, key=lambda port: port != cluster.port(master)))
            print(f"cluster: three nodes on {hosts}, node {master} is master", flush=True)

            started = time.perf_counter()
            spark = start_spark(args.master, args.partitions)
            print(f"spark {spark.version} up in {time.perf_counter() - started:.1f} s", flush=True)
            items = [{"queue": "bench_client", "data": f"order-{i:08d}"} for i in range(args.rows)]
            df = (spark.range(args.rows, numPartitions=args.partitions)
                  .selectExpr("format_string('order-%08d', id) AS data").cache())
            df.count()  # materialize the cache: the runs measure the write only
            warm = run_spark(df, hosts, "bench_warmup", args.batch_size)
            run_client(client_hosts, [{"queue": "bench_warmup", "data": item["data"]}
                               for item in items[:args.batch_size * 2]], args.batch_size)
            print(f"warmed up: one spark write ({args.rows / warm:,.0f} rows/s), "
                  f"two client batches", flush=True)

            for i in range(args.repeat):
                for side in (SIDES if i % 2 == 0 else SIDES[::-1]):
                    if side == "client":
                        seconds = run_client(client_hosts, items, args.batch_size)
                    else:
                        seconds = run_spark(df, hosts, "bench_spark", args.batch_size)
                    times[side].append(seconds)
                    print(f"  {side:6} run {i + 1}/{args.repeat}: {args.rows / seconds:>9,.0f} "
                          f"rows/s ({seconds:.2f} s)", flush=True)
            with Client(hosts) as client:
                sizes = {q: client.monitor(q)["size"] for q in ("bench_client", "bench_spark")}
            want = args.rows * args.repeat
            for queue, size in sizes.items():
                if size < want:
                    print(f"{queue} holds {size} messages, expected {want}: rows were lost, "
                          f"the figures are not valid")
                    return 1
                if size > want:
                    # The client resends produces whose outcome it could not
                    # know (a master change, a timeout, a broken connection).
                    print(f"{queue} holds {size - want} duplicates: produces the client sent "
                          f"again after a master change, a timeout or a broken connection "
                          f"(at-least-once)")
        except KeyboardInterrupt:
            print("\ninterrupted; stopping the cluster", file=sys.stderr)
            return 130
        finally:
            signal.signal(signal.SIGINT, signal.SIG_IGN)  # let the cleanup finish
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            if spark is not None:
                spark.stop()
            cluster.stop_all()

    print()
    header = f"{'side':6} {'runs':>4} {'min rows/s':>11} {'median':>9} {'max':>9} {'ratio':>6}"
    print(header)
    print("-" * len(header))
    medians = {}
    for side in SIDES:
        rates = [args.rows / s for s in times[side]]
        lo, med, hi = _stats(rates)
        medians[side] = med
        ratio = f"{med / medians['client']:.2f}" if side == "spark" else ""
        print(f"{side:6} {len(rates):>4} {lo:>11,.0f} {med:>9,.0f} {hi:>9,.0f} {ratio:>6}")
    ratio = medians["spark"] / medians["client"]
    print(f"\nload average {os.getloadavg()[0]:.2f} at the end")
    print(f"goal: spark >= {RATIO_GOAL} x client: {ratio:.2f} "
          f"{'met' if ratio >= RATIO_GOAL else 'NOT met'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
