"""How long a node's full garbage collection stalls it, by store and log size.

    python bench/gc_bench.py [--messages 1000000,2500000] [--log-sizes 500,100000]
                             [--repeat 5]

A node collects its young objects as it goes and runs a full collection
every 300 s (node.GC_THRESHOLDS, GC_FULL_INTERVAL_S): the whole process
stops for it. This fills, in this process and with the node's collector
settings, a Store with `--messages` produces of 40-byte messages and a Log
that keeps the newest `log_size` records (as a cluster node's log does:
compaction in bulk, NativeCore._maybe_compact), for each combination, then
times `--repeat` full collections (gc.collect()) and prints min/median/max
milliseconds and how many objects the collector tracks.

No sockets, no other load: a node under load on a shared machine stalls
longer (the README's "Stalls" saw up to 770 ms with 2,500,000 messages).
What it shows is which part of the state the time goes to: the stored
messages are plain tuples the collector stops tracking, but the log's
records and their entries are named tuples, which it scans every time.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from qserver.node import GC_THRESHOLDS
from qserver.state.log import COMPACT_SLACK, Log
from qserver.state.store import Store


def measure(messages: int, log_size: int, repeat: int) -> tuple[list[float], int, int]:
    """Full-collection times (ms) over a Store of `messages` and a Log of
    at most `log_size` records; also the log's length and the number of
    objects the collector tracks."""
    store = Store(queue_size=messages + 1)
    log = Log()
    now_ms = int(time.time() * 1000)
    for i in range(messages):
        entry = store.decide_produce_values("bench", f"{i:040d}", None, None, 30, now_ms)
        if isinstance(entry, str):
            raise SystemExit(f"produce {i} refused: {entry}")
        log.append_entry(entry, 1)
        store.apply(entry)
        if len(log.records) > log_size + COMPACT_SLACK:
            log.compact(log_size, log.last_trans_id)
    gc.collect()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        gc.collect()
        times.append((time.perf_counter() - t0) * 1000)
    tracked = len(gc.get_objects())
    out = times, len(log.records), tracked
    del store, log
    gc.collect()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--messages", default="1000000,2500000",
                   help="stored messages, comma-separated")
    p.add_argument("--log-sizes", default="500,100000",
                   help="in-memory log records (log_size), comma-separated")
    p.add_argument("--repeat", type=int, default=5)
    args = p.parse_args()
    gc.set_threshold(*GC_THRESHOLDS)
    gc.freeze()  # as a node does after start-up: the modules are not scanned
    print(f"{'messages':>10} {'log':>8} | full collection ms: min median max | tracked objects")
    for messages in (int(x) for x in args.messages.split(",")):
        for log_size in (int(x) for x in args.log_sizes.split(",")):
            times, kept, tracked = measure(messages, log_size, args.repeat)
            print(f"{messages:>10,} {kept:>8,} | {min(times):8.1f} "
                  f"{statistics.median(times):8.1f} {max(times):8.1f} | {tracked:>10,}",
                  flush=True)


if __name__ == "__main__":
    main()
