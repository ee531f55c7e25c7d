"""The Spark tests' local session, and a streaming query's checkpoint and
its parquet sink read from outside Spark (the Spark source's tests): which
micro-batches the offset and commit logs hold, the source's offset of a
batch, and the sink's rows per batch. Needs pyspark and pyarrow (the tests
that import it skip without the spark extra)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import pyarrow.parquet as pq

from qserver_spark import BatchOffset, QServerDataSource

if TYPE_CHECKING:
    from pyspark.sql import SparkSession


def local_spark(app: str, cores: int, conf: dict[str, str] | None = None) -> SparkSession:
    """A local Spark session with `cores` cores (and as many shuffle
    partitions) for the tests: no UI or progress bar, errors only in its
    log, a 512 MB driver, its Python workers on this interpreter (which has
    qserver_spark, unlike whatever "python3" is on the PATH), `conf` on
    top, and the qserver data source registered (an editable install hides
    pyspark_qserver from PySpark's own lookup)."""
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    from pyspark.sql import SparkSession

    builder = (SparkSession.builder.master(f"local[{cores}]").appName(app)
               .config("spark.ui.enabled", "false")
               .config("spark.ui.showConsoleProgress", "false")
               .config("spark.sql.shuffle.partitions", str(cores))
               .config("spark.driver.memory", "512m"))
    for key, value in (conf or {}).items():
        builder = builder.config(key, value)
    session = builder.getOrCreate()
    session.sparkContext.setLogLevel("ERROR")
    session.dataSource.register(QServerDataSource)
    return session


def batch_ids(directory: Path) -> set[int]:
    """The batch numbers a checkpoint log directory (offsets, commits,
    the sink's _spark_metadata) holds a file for."""
    if not directory.is_dir():
        return set()
    return {int(p.name) for p in directory.iterdir() if p.name.isdigit()}


def uncommitted(checkpoint: Path) -> set[int]:
    """Batches in the offset log and not in the commit log."""
    return batch_ids(checkpoint / "offsets") - batch_ids(checkpoint / "commits")


def read_offset(checkpoint: Path, batch: int) -> BatchOffset:
    """The source's offset of `batch` (the offset log's last line: one
    source, after the version and the metadata lines)."""
    lines = (checkpoint / "offsets" / str(batch)).read_text().splitlines()
    return BatchOffset.from_json(json.loads(lines[-1]))


def sink_rows(out: Path) -> dict[int, list[dict]]:
    """The parquet sink's rows per micro-batch, as its own commit log
    (`_spark_metadata`) lists the files of each batch (files of a batch
    that never committed, a killed driver's, are not in it)."""
    metadata = out / "_spark_metadata"
    compacted = [p.name for p in metadata.iterdir() if "compact" in p.name]
    assert not compacted, "the sink merged batches' entries: batches cannot be told apart"
    rows: dict[int, list[dict]] = {}
    for batch in sorted(batch_ids(metadata)):
        rows[batch] = []
        for line in (metadata / str(batch)).read_text().splitlines()[1:]:
            entry = json.loads(line)
            assert entry["action"] == "add", entry
            rows[batch].extend(pq.read_table(entry["path"].removeprefix("file://")).to_pylist())
    return rows
