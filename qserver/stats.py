"""What a node counts for its metrics, at the least cost per event.

Theory of operation
-------------------
Counting happens on the event loop where events happen (an answer written,
an fsync ended, a snapshot forked); reading happens at scrape time, when
the Prometheus collector (metrics.py) turns these plain numbers into
metric families. So an event costs an int increment or two, never a
prometheus_client call (its Histogram.observe takes a lock: 0.70 us
against 0.09-0.14 us for `Histogram.observe_ns` here, timeit, same run).

- `Histogram`: bucket counts of durations in integer nanoseconds, one
  bucket per event (not cumulative; the collector accumulates), and their
  sum. Bounds are fixed at construction.
- `RequestStats`: the client answers by (action, code), and the latency
  of those the general path answers. The fast path (Service.answer_now:
  a produce, consume or confirm answered in the call that read it) costs
  one list increment per answer, inlined in the client protocols
  (`fast[action - FAST_STRIDE * code]`) and not timed: no clock is read
  for it. Every other answer goes through `answered`: a dict increment,
  and for one of the general path (Service.handle_general: replicated
  writes, reads behind the read index, long polls, forwarded requests)
  its time from the read to the answer, into its action's `Histogram`.
  Answers to what never reached the service (a request the codec or the
  guard refused) are counted, not timed. Actions outside
  0..MAX_ACTION_LABEL (or not ints: an answer to garbage) share the key
  ACTION_INVALID, so that no client can make the table, or the metric's
  label set, grow without bound.

Several nodes may live in one process (tests): nothing here is global.

This module does no I/O.
"""

from __future__ import annotations

from bisect import bisect_left
from typing import Any

__all__ = ["Histogram", "RequestStats", "LATENCY_BUCKETS_S", "FSYNC_BUCKETS_S",
           "PAUSE_BUCKETS_S", "ACTION_INVALID", "MAX_ACTION_LABEL", "FAST_STRIDE"]

# Bucket bounds, in seconds (Prometheus' `le`), of a client request's time
# from its read to its answer: 50 us (a fast-path answer) to 60 s (a long
# poll waits up to <limits max_wait>, 30 s by default).
LATENCY_BUCKETS_S = (0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025,
                     0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
# ...of a log fsync, from its start to its end: tmpfs and NVMe answer in
# microseconds, a spinning disk or a busy cloud volume in tens of ms.
FSYNC_BUCKETS_S = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1,
                   0.25, 0.5, 1.0, 2.5, 5.0)
# ...of the event loop's pause to start a snapshot (a fork: a few ms per GB).
PAUSE_BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
                   2.5, 5.0, 10.0)

# Actions are small ints (the protocol's numbers run to 109); anything
# else an answer echoes is counted under ACTION_INVALID.
MAX_ACTION_LABEL = 255
ACTION_INVALID = -1
# The fast path answers actions below this (1, 2, 3); see RequestStats.fast.
FAST_STRIDE = 16


class Histogram:
    """Durations in ns by bucket (see the module docstring). `observe_ns`
    is O(1) for the first bucket, O(log b) otherwise."""

    __slots__ = ("bounds_ns", "counts", "sum_ns", "_first")

    def __init__(self, bounds_s: tuple[float, ...]) -> None:
        self.bounds_ns = tuple(round(b * 1e9) for b in bounds_s)  # ascending upper bounds
        # counts[i]: durations in (bounds_ns[i-1], bounds_ns[i]]; the last, above all bounds
        self.counts = [0] * (len(bounds_s) + 1)
        self.sum_ns = 0  # of every duration observed
        self._first = self.bounds_ns[0]

    def observe_ns(self, ns: int) -> None:
        if ns <= self._first:  # the common case for answers and fsyncs on fast disks
            self.counts[0] += 1
        else:
            self.counts[bisect_left(self.bounds_ns, ns)] += 1
        self.sum_ns += ns

    @property
    def count(self) -> int:
        return sum(self.counts)


class RequestStats:
    """The client answers of one node (see the module docstring)."""

    __slots__ = ("fast", "counts", "durations")

    def __init__(self) -> None:
        # Answers of the fast path at index action - FAST_STRIDE * code
        # (actions 1..3 below the stride; code 0 or -1, room for -2).
        self.fast = [0] * (3 * FAST_STRIDE)
        # (action, code) -> every other answer; action in 0..MAX_ACTION_LABEL
        # or ACTION_INVALID, code -2..0 (anything else counts as -1)
        self.counts: dict[tuple[int, int], int] = {}
        self.durations: dict[int, Histogram] = {}  # action -> the general path's latency

    def answered(self, response: dict[str, Any], ns: int | None) -> None:
        """Any answer but the fast path's (an error to a request that was
        not even an object included), `ns` after its request was read
        (None: not timed)."""
        action = response.get("action")
        if type(action) is not int or not 0 <= action <= MAX_ACTION_LABEL:
            action = ACTION_INVALID
        code = response.get("code")
        if type(code) is not int or not -2 <= code <= 0:
            code = -1  # not one of ours (a relayed answer is a master's: it is)
        key = (action, code)
        counts = self.counts
        counts[key] = counts.get(key, 0) + 1
        if ns is not None:
            hist = self.durations.get(action)
            if hist is None:
                hist = self.durations[action] = Histogram(LATENCY_BUCKETS_S)
            hist.observe_ns(ns)

    def totals(self) -> dict[tuple[int, int], int]:
        """Every answer so far by (action, code), the fast path's included."""
        out = dict(self.counts)
        for index, n in enumerate(self.fast):
            if n:
                key = (index % FAST_STRIDE, -(index // FAST_STRIDE))
                out[key] = out.get(key, 0) + n
        return out
