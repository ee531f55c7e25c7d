"""Close unpaid orders, both halves in Spark: the delay-queue use case of
Youzan's delay queue (topic "orderclose", delay 1800 s), with Spark reading
the orders, qserver holding a "close this order" message per order until it
is due, and Spark reading the due messages and closing the orders.

    make run    # in another terminal: the local three-node cluster
    .venv/bin/python spark_integration/examples/close_unpaid_orders.py \\
        --orders spark_integration/examples/orders.csv --out /tmp/closed_orders

1. Schedule: reads a CSV (with a header) or JSON-lines file (.json/.jsonl)
   of orders with order_id, user, amount, order_time ("YYYY-MM-DD
   HH:MM:SS", in the Spark session's time zone, local time by default) and
   produces one message per order into queue `order_close` (the `qserver`
   sink): its data the order as JSON, its delay order_time + --close-after
   minutes, retried every 60 s until a consumer confirms it, kept until a
   day after it is due (a day from now for an order already overdue).
2. Close: a streaming query reads the messages that are due (the `qserver`
   source) and writes the orders it closes as JSON lines into --out, with
   its checkpoint in --out's sibling `<out>.checkpoint`. Each micro-batch's
   messages are confirmed once Spark has committed it: an order is closed
   at least once (a rerun from the checkpoint writes nothing twice in the
   output; see spark_integration/README.md for when a message comes back).
   By default the query reads what is due now and stops
   (Trigger.AvailableNow); with --follow SECONDS it keeps reading messages
   as they come due for that long.

The sample orders are from the past, so their messages are due at once and
one run schedules and closes all twelve. `--replay` shifts every
order_time so that the first order is placed now: the first message comes
out --close-after minutes later and the others follow, spaced as the orders
were placed (the sample's twelve span 52 minutes); `--replay --close-after
0.1 --follow 60` closes the first ones within the minute. --schedule-only
and --close-only run one half.

The data source is found by PySpark's own lookup when the `pyspark_qserver`
module is on its workers' path (a regular install, or
PYTHONPATH=spark_integration); otherwise (the default editable install) the
example registers it.
"""

from __future__ import annotations

import argparse
import os
import pkgutil
import sys

DEFAULT_HOSTS = "127.0.0.1:1111,127.0.0.1:1112,127.0.0.1:1113"

# The order as the schedule half writes it into the message (rowAsJson).
ORDER_SCHEMA = "order_id LONG, user STRING, amount DECIMAL(12,2), order_time TIMESTAMP"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="schedule 'close unpaid order' messages, and "
                                            "close the orders whose message is due")
    p.add_argument("--hosts", default=DEFAULT_HOSTS,
                   help=f"qserver nodes, comma-separated (default {DEFAULT_HOSTS})")
    p.add_argument("--orders", help="orders file: .csv, or .json/.jsonl lines (to schedule)")
    p.add_argument("--out", help="directory the closed orders are written to (to close)")
    p.add_argument("--queue", default="order_close", help="queue (default order_close)")
    p.add_argument("--close-after", type=float, default=30.0, metavar="MINUTES",
                   help="minutes after order_time the order is closed if unpaid (default 30)")
    p.add_argument("--replay", action="store_true",
                   help="shift order times so that the first order is placed now")
    p.add_argument("--follow", type=float, default=0.0, metavar="SECONDS",
                   help="keep closing orders as their messages come due for this long "
                        "(default: close what is due now, then stop)")
    half = p.add_mutually_exclusive_group()
    half.add_argument("--schedule-only", action="store_true", help="only the first half")
    half.add_argument("--close-only", action="store_true", help="only the second half")
    args = p.parse_args(argv)
    if not args.close_only and not args.orders:
        p.error("--orders is required to schedule (or give --close-only)")
    if not args.schedule_only and not args.out:
        p.error("--out is required to close (or give --schedule-only)")

    # Spark's Python workers must run this interpreter (it has qserver_spark).
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    from pyspark.sql import SparkSession

    spark = (SparkSession.builder.master("local[2]").appName("close-unpaid-orders")
             .config("spark.ui.enabled", "false")
             .config("spark.ui.showConsoleProgress", "false")
             .config("spark.sql.shuffle.partitions", "2")
             .getOrCreate())
    spark.sparkContext.setLogLevel("ERROR")
    try:
        find_data_source(spark)
        if not args.close_only:
            schedule(spark, args)
        if not args.schedule_only:
            close(spark, args)
    finally:
        spark.stop()
    return 0


def find_data_source(spark) -> None:
    """Register the data source unless PySpark's lookup finds it: the
    lookup imports the top-level `pyspark_*` modules that
    `pkgutil.iter_modules()` lists, as here."""
    if any(m.name == "pyspark_qserver" for m in pkgutil.iter_modules()):
        print("the qserver data source: found by PySpark's data source lookup "
              "(pyspark_qserver)")
        return
    import qserver_spark

    spark.dataSource.register(qserver_spark.QServerDataSource)
    print("the qserver data source: registered (pyspark_qserver is not on the path: an "
          "editable install)")


def schedule(spark, args: argparse.Namespace) -> None:
    """The first half: one delayed message per order."""
    from pyspark.sql import functions as F

    reader = spark.read.schema(ORDER_SCHEMA).option("timestampFormat", "yyyy-MM-dd HH:mm:ss")
    if args.orders.endswith((".json", ".jsonl")):
        orders = reader.json(args.orders)
    else:
        orders = reader.option("header", True).csv(args.orders)
    if args.replay:
        earliest = orders.agg(F.min("order_time")).first()[0]
        shift = F.current_timestamp().cast("double") - F.lit(earliest).cast("double")
        orders = orders.withColumn(
            "order_time", (F.col("order_time").cast("double") + shift).cast("timestamp"))
    close_at = (F.col("order_time").cast("double") + args.close_after * 60).cast("timestamp")
    messages = (orders
                .withColumn("close_at", close_at)
                # a day after it is due, or from now for an order already overdue
                # (a ttl in the past is refused: "time error")
                .withColumn("expire_at", F.greatest("close_at", F.current_timestamp())
                            + F.expr("INTERVAL 1 DAY"))
                .cache())
    n = messages.count()
    first, last = messages.agg(F.min("close_at"), F.max("close_at")).first()

    # The message is the order (order_id, user, amount, order_time) as
    # JSON: close_at and expire_at are read as the delay and the ttl.
    (messages.write.format("qserver")
     .option("hosts", args.hosts)
     .option("queue", args.queue)
     .option("rowAsJson", "true")
     .option("delayColumn", "close_at")
     .option("ttlColumn", "expire_at")
     .option("retry", "60")
     .mode("append").save())
    messages.unpersist()
    print(f"scheduled {n} 'close unpaid order' messages in queue {args.queue!r} "
          f"on {args.hosts}, due from {first} to {last}", flush=True)


def close(spark, args: argparse.Namespace) -> None:
    """The second half: the due messages, read by a streaming query, become
    closed orders in --out."""
    from pyspark.sql import functions as F

    due = (spark.readStream.format("qserver")
           .option("hosts", args.hosts)
           .option("queue", args.queue)
           .option("lease", "300")           # far longer than a micro-batch here
           .option("deadLetterFields", "false")
           .load())
    order = F.from_json("data", ORDER_SCHEMA)
    # close_if_unpaid(order) would go here (a foreachBatch, or a service
    # the rows are sent to); it must be idempotent: a message whose batch
    # was not confirmed in time comes back. The example writes the orders
    # it closes, with the message that closed them.
    closed = (due.select(order.alias("o"), "msg_id", "deliveries")
              .select("o.*", "msg_id", "deliveries",
                      F.current_timestamp().alias("closed_at")))
    writer = (closed.writeStream.format("json")
              .option("path", args.out)
              .option("checkpointLocation", args.out.rstrip("/") + ".checkpoint"))
    if args.follow > 0:
        query = writer.trigger(processingTime="1 second").start()
        query.awaitTermination(args.follow)
        query.stop()
    else:
        query = writer.trigger(availableNow=True).start()
        query.awaitTermination()
    if query.exception() is not None:
        raise query.exception()
    n = sum(p["numInputRows"] for p in query.recentProgress)
    print(f"closed {n} unpaid orders from queue {args.queue!r} into {args.out} (JSON lines: "
          f"order_id, user, amount, order_time, msg_id, deliveries, closed_at)", flush=True)


if __name__ == "__main__":
    sys.exit(main())
