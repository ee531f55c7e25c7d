"""Schedule a "close unpaid order" message for every order, due 30 minutes
after the order was placed: the delay-queue use case of Youzan's delay queue
(topic "orderclose", delay 1800 s), with Spark reading the orders and qserver
holding the messages until they are due.

    make run    # in another terminal: the local three-node cluster
    .venv/bin/python spark_integration/examples/close_unpaid_orders.py \\
        --hosts 127.0.0.1:1111 --orders spark_integration/examples/orders.csv

Input: a CSV (with a header) or JSON-lines file (.json/.jsonl) of orders with
order_id, user, amount, order_time ("YYYY-MM-DD HH:MM:SS", in the Spark
session's time zone, local time by default). Output: one message per order
in queue `order_close`, its data the order as JSON, its delay order_time +
--close-after minutes, retried every 60 s until a consumer confirms it, and
kept until a day after it was due. A consumer checks whether the order was
paid and closes it if not (spark_integration/README.md has one).

The sample orders are from the past, so their messages are due at once.
`--replay` shifts every order_time by the same amount so that the first
order is placed now: the first message then comes out --close-after
minutes from now and the others follow, spaced as the orders were placed
(the sample's twelve orders span 52 minutes).
"""

from __future__ import annotations

import argparse
import os
import sys

DEFAULT_HOSTS = "127.0.0.1:1111,127.0.0.1:1112,127.0.0.1:1113"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="schedule 'close unpaid order' messages")
    p.add_argument("--hosts", default=DEFAULT_HOSTS,
                   help=f"qserver nodes, comma-separated (default {DEFAULT_HOSTS})")
    p.add_argument("--orders", required=True, help="orders file: .csv, or .json/.jsonl lines")
    p.add_argument("--queue", default="order_close", help="queue (default order_close)")
    p.add_argument("--close-after", type=float, default=30.0, metavar="MINUTES",
                   help="minutes after order_time the order is closed if unpaid (default 30)")
    p.add_argument("--replay", action="store_true",
                   help="shift order times so that the first order is placed now")
    args = p.parse_args(argv)

    # Spark's Python workers must run this interpreter (it has qserver_spark).
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    from pyspark.sql import SparkSession
    from pyspark.sql import functions as F

    import qserver_spark

    spark = (SparkSession.builder.master("local[2]").appName("close-unpaid-orders")
             .config("spark.ui.enabled", "false")
             .config("spark.ui.showConsoleProgress", "false")
             .config("spark.sql.shuffle.partitions", "2")
             .getOrCreate())
    spark.sparkContext.setLogLevel("ERROR")
    spark.dataSource.register(qserver_spark.QServerDataSource)
    try:
        schema = "order_id LONG, user STRING, amount DECIMAL(12,2), order_time TIMESTAMP"
        reader = spark.read.schema(schema).option("timestampFormat", "yyyy-MM-dd HH:mm:ss")
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
                    .withColumn("expire_at", F.col("close_at") + F.expr("INTERVAL 1 DAY"))
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
        print(f"scheduled {n} 'close unpaid order' messages in queue {args.queue!r} "
              f"on {args.hosts}, due from {first} to {last}")
    finally:
        spark.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
