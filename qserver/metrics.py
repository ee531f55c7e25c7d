"""Prometheus metrics of one node, computed at scrape time.

Theory of operation
-------------------
`NodeCollector.collect()` runs when `GET /metrics` is answered (on the
event loop, like every other reader of the node's state) and builds every
metric family afresh from what the node holds anyway:

- queue depths from the store as this node applied it (`Queue.counts`,
  `oldest_ready_ms`, as monitor (4, 104) computes them): a slave shows its
  own applied state, which may trail the master's by what it has not
  applied yet;
- message counters from plain ints the store's apply and the service
  increment (`Store.produced` ...; `Service.consume_empty`), and the
  client answers and their latency from `stats.RequestStats`, which the
  client protocols fill;
- replication from `Engine.status()`, `slaves()` (a master's view of each
  slave's lag) and `timings()` (fsync and snapshot pause histograms).

So the client path pays nothing for gauges, an int increment for each
counter, and one histogram bucket per answer; a scrape pays O(q log n) for
q queues of n messages (the FIFO's bisect dominates: about 0.5 ms per
million messages).

Names follow RabbitMQ's and NATS's exporters: the prefix `qserver_`,
counters end in `_total`, units in names (`_seconds`, `_entries`).
Counters are node-local and start from zero with the process (Prometheus
takes a reset in its stride); the store's count every entry this node
applies, so every node of a cluster reports the cluster's produces once
it has applied them (and a restart's replay of its log again).

Every node has its own `CollectorRegistry` (several nodes may run in one
process: the tests do), holding this collector and the process collector
(CPU, memory, file descriptors of the process).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.exposition import choose_encoder
from prometheus_client.process_collector import ProcessCollector
from prometheus_client.registry import Collector, CollectorRegistry
from prometheus_client.utils import floatToGoString

from .engines.base import Role
from .stats import ACTION_INVALID, FSYNC_BUCKETS_S, PAUSE_BUCKETS_S, Histogram

if TYPE_CHECKING:
    from .node import Node

__all__ = ["NodeCollector", "NodeMetrics"]


def _label(action: int) -> str:
    return "invalid" if action == ACTION_INVALID else str(action)


def _buckets(hist: Histogram) -> list[tuple[str, float]]:
    """Cumulative (le, count) pairs in seconds, +Inf last."""
    out: list[tuple[str, float]] = []
    total = 0
    for bound_ns, n in zip(hist.bounds_ns, hist.counts):
        total += n
        out.append((floatToGoString(bound_ns / 1e9), total))
    out.append(("+Inf", total + hist.counts[-1]))
    return out


def _histogram(name: str, doc: str, hist: Histogram) -> HistogramMetricFamily:
    return HistogramMetricFamily(name, doc, buckets=_buckets(hist), sum_value=hist.sum_ns / 1e9)


class NodeCollector(Collector):
    """Every qserver_* family of one node (see the module docstring)."""

    def __init__(self, node: Node, clock_ms: Callable[[], int] | None = None) -> None:
        self.node = node
        self._clock_ms = clock_ms or (lambda: time.time_ns() // 1_000_000)

    def collect(self) -> Iterator[Metric]:
        yield from self._queues()
        yield from self._totals()
        yield from self._replication()

    def _queues(self) -> Iterator[Metric]:
        node = self.node
        now_ms = self._clock_ms()
        per_queue = node.config.metrics_per_queue
        waiting = node.service.waiting
        labels = ["queue"]
        q_messages = GaugeMetricFamily(
            "qserver_queue_messages", "Messages held in the queue (ready, delayed, in flight).",
            labels=labels)
        q_ready = GaugeMetricFamily("qserver_queue_ready", "Messages deliverable now.",
                                    labels=labels)
        q_delayed = GaugeMetricFamily(
            "qserver_queue_delayed", "Never-delivered messages waiting for their delay.",
            labels=labels)
        q_inflight = GaugeMetricFamily(
            "qserver_queue_inflight", "Messages delivered and not confirmed, lease running.",
            labels=labels)
        q_dead = CounterMetricFamily(
            "qserver_queue_dead_lettered_total",
            "Messages that left the queue by its dead-letter rules.", labels=labels)
        q_age = GaugeMetricFamily(
            "qserver_queue_oldest_ready_age_seconds",
            "How long the longest-waiting deliverable message has been deliverable.",
            labels=labels)
        q_waiting = GaugeMetricFamily(
            "qserver_queue_consumers_waiting",
            "Consumes parked on this node waiting for the queue (long poll).", labels=labels)
        messages = ready = delayed = inflight = dead = 0
        oldest_age_s = 0.0
        for name, queue in node.store.queues.items():
            size = len(queue)
            r, d, i = queue.counts(now_ms)
            since = queue.oldest_ready_ms(now_ms)
            age_s = 0.0 if since is None else max(0, now_ms - since) / 1000
            messages += size
            ready += r
            delayed += d
            inflight += i
            dead += queue.dead_lettered
            oldest_age_s = max(oldest_age_s, age_s)
            if per_queue:
                value = [name]
                q_messages.add_metric(value, size)
                q_ready.add_metric(value, r)
                q_delayed.add_metric(value, d)
                q_inflight.add_metric(value, i)
                q_dead.add_metric(value, queue.dead_lettered)
                q_age.add_metric(value, age_s)
                q_waiting.add_metric(value, len(waiting.get(name, ())))
        if per_queue:
            yield from (q_messages, q_ready, q_delayed, q_inflight, q_dead, q_age, q_waiting)
        yield GaugeMetricFamily("qserver_queues", "Queues on this node.",
                                value=len(node.store.queues))
        yield GaugeMetricFamily("qserver_messages", "Messages held in every queue.",
                                value=messages)
        yield GaugeMetricFamily("qserver_messages_ready", "Messages deliverable now, every queue.",
                                value=ready)
        yield GaugeMetricFamily("qserver_messages_delayed",
                                "Messages waiting for their delay, every queue.", value=delayed)
        yield GaugeMetricFamily("qserver_messages_inflight",
                                "Messages delivered and not confirmed, every queue.",
                                value=inflight)
        yield CounterMetricFamily(
            "qserver_messages_dead_lettered_total",
            "Messages that left their queue by its dead-letter rules, every queue.", value=dead)
        yield GaugeMetricFamily(
            "qserver_oldest_ready_age_seconds",
            "The longest any deliverable message has been deliverable, every queue.",
            value=oldest_age_s)
        yield GaugeMetricFamily("qserver_consumers_waiting",
                                "Consumes parked on this node (long poll).",
                                value=node.service.parked)

    def _totals(self) -> Iterator[Metric]:
        node = self.node
        store = node.store
        counters = (
            ("produced", store.produced,
             "Messages stored by produce entries applied (one per real queue)."),
            ("delivered", store.delivered, "Messages delivered by consume entries applied."),
            ("confirmed", store.confirmed, "Messages deleted by confirm entries applied."),
            ("redelivered", store.redelivered,
             "Deliveries of a message delivered before (lease ran out, nack)."),
            ("nacked", store.nacked, "Messages given back by nack entries applied."))
        for name, value, doc in counters:
            yield CounterMetricFamily(f"qserver_messages_{name}_total", doc, value=value)
        yield CounterMetricFamily("qserver_consume_empty_total",
                                  "Consumes this node's service answered without a message.",
                                  value=node.service.consume_empty)
        requests = CounterMetricFamily(
            "qserver_requests_total",
            "Client requests answered by this node, by action and code (0 ok, -1 error, "
            "-2 redirect).", labels=["action", "code"])
        stats = node.request_stats
        for (action, code), n in sorted(stats.totals().items()):
            requests.add_metric([_label(action), str(code)], n)
        yield requests
        durations = HistogramMetricFamily(
            "qserver_request_duration_seconds",
            "Time from a request's read to its answer, of the requests the general path "
            "answered (not the fast path's produce, consume and confirm).", labels=["action"])
        for action, hist in sorted(stats.durations.items()):
            durations.add_metric([_label(action)], _buckets(hist), hist.sum_ns / 1e9)
        yield durations

    def _replication(self) -> Iterator[Metric]:
        engine = self.node.engine
        status = engine.status()
        master = status.role is Role.MASTER
        leader = engine.leader()
        yield GaugeMetricFamily("qserver_is_master", "1 if this node is the master.",
                                value=int(master))
        yield GaugeMetricFamily("qserver_leader_node_id",
                                "The master this node knows of (0: none).",
                                value=leader.node_id if leader is not None else 0)
        yield GaugeMetricFamily("qserver_vote_id", "The current election epoch.",
                                value=status.vote_id)
        yield GaugeMetricFamily("qserver_trans_id", "The last trans_id in this node's log.",
                                value=status.trans_id)
        yield GaugeMetricFamily("qserver_commit_id", "The last trans_id known committed.",
                                value=status.commit_id)
        yield GaugeMetricFamily("qserver_applied_id", "The last trans_id applied to the store.",
                                value=status.applied_id)
        lag = GaugeMetricFamily(
            "qserver_replication_lag_entries",
            "On the master: entries of its log each slave does not hold yet.", labels=["peer"])
        if master:
            for slave in engine.slaves() or ():
                lag.add_metric([str(slave["node_id"])], slave["lag"])
        yield lag
        timings = engine.timings()
        yield _histogram("qserver_fsync_seconds", "Log fsyncs, from their start to their end.",
                         timings.get("fsync") or Histogram(FSYNC_BUCKETS_S))
        yield _histogram("qserver_snapshot_pause_seconds",
                         "The event loop's pause to start a snapshot.",
                         timings.get("snapshot_pause") or Histogram(PAUSE_BUCKETS_S))
        health = self.node.service.health()
        yield GaugeMetricFamily("qserver_ready", "1 if this node is ready (GET /readyz: 200).",
                                value=int(bool(health.get("ready"))))


class NodeMetrics:
    """One node's registry: `render(accept)` is the body and content type
    of `GET /metrics` (the text format, or OpenMetrics if the scraper's
    Accept header asks for it)."""

    def __init__(self, node: Node) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(NodeCollector(node))
        ProcessCollector(registry=self.registry)

    def render(self, accept: str) -> tuple[bytes, str]:
        encoder, content_type = choose_encoder(accept)
        return encoder(self.registry), content_type
