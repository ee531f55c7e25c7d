"""A streaming query from the qserver source into a parquet sink, as a
Spark driver process of its own (local[1]): tests/test_spark_source_kill.py
kills it with SIGKILL in the middle of the stream and starts it again on
the same checkpoint and output directory.

    python tests/spark_stream_job.py --hosts H:P,... --queue Q \\
        --checkpoint DIR --out DIR [--per-batch N] [--lease S] [--wait S]

It runs until SIGTERM, then stops the query and Spark and exits 0; if the
query fails it exits 1 with the query's exception on stderr. The source's
log lines (its Python workers' stderr, which the JVM copies) reach this
process's stderr. `qserver_spark` must be importable (spark_integration/ on
PYTHONPATH); the source is registered by hand, as the other tests do.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="qserver -> parquet streaming query until SIGTERM")
    p.add_argument("--hosts", required=True, help="qserver nodes, comma-separated")
    p.add_argument("--queue", required=True)
    p.add_argument("--checkpoint", required=True, help="the query's checkpoint directory")
    p.add_argument("--out", required=True, help="the parquet sink's directory")
    p.add_argument("--per-batch", type=int, default=100, help="maxMessagesPerBatch")
    p.add_argument("--lease", type=float, default=60.0, help="the source's lease (seconds)")
    p.add_argument("--wait", type=float, default=0.5, help="the source's long poll (seconds)")
    args = p.parse_args(argv)

    # Set before anything slow: a SIGTERM during Spark's start stops the job
    # as soon as the query is up (and the query is never started then).
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda _sig, _frame: stop.set())

    from sparkutil import local_spark  # (this file's directory is on sys.path)

    # The file sink's commit log names each batch's files in a file of its
    # own (the test reads the rows per batch), never merged.
    spark = local_spark("qserver-source-kill-job", 1, {
        "spark.sql.streaming.fileSink.log.compactInterval": "1000000"})
    failure: list[BaseException] = []
    try:
        if stop.is_set():
            return 0
        query = (spark.readStream.format("qserver")
                 .option("hosts", args.hosts).option("queue", args.queue)
                 .option("maxMessagesPerBatch", str(args.per_batch))
                 .option("lease", str(args.lease)).option("wait", str(args.wait))
                 .option("timeout", "30")
                 .load().writeStream.format("parquet")
                 .option("path", args.out).option("checkpointLocation", args.checkpoint)
                 .trigger(processingTime="0 seconds").start())
        print(f"started query {query.id}", flush=True)

        def watch() -> None:
            try:
                query.awaitTermination()
            except BaseException as exc:  # the query's failure: reported below
                failure.append(exc)
            finally:
                stop.set()

        threading.Thread(target=watch, name="query-watch", daemon=True).start()
        stop.wait()  # SIGTERM, or the query ended
        if not failure:
            query.stop()
            exc = query.exception()
            if exc is not None:
                failure.append(exc)
    finally:
        spark.stop()
    if failure:
        print(f"the query failed: {failure[0]}", file=sys.stderr, flush=True)
        return 1
    print("stopped", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
