"""The `qserver` source: `spark.readStream` consumes and confirms on commit,
`spark.read` peeks.

Theory of operation
-------------------
Where Spark runs what (PySpark 4, `pyspark/sql/datasource_internal.py` and
`pyspark/sql/streaming/python_streaming_source_runner.py`):

- `QServerStreamReader` is a `SimpleDataSourceStreamReader`. Spark wraps
  it (`_SimpleStreamReaderWrapper`) and drives it from one Python worker
  process on the driver that lives as long as the query: every trigger
  calls `read(start)` there (from the wrapper's `latestOffset`), and
  `commit(end)` runs there too. The rows `read` returns are cached in that
  process and handed to the JVM with the batch's plan; no executor talks to
  qserver for them.
- `readBetweenOffsets(start, end)` runs on an executor, as the task of a
  micro-batch whose rows are not in that cache: a batch Spark replays after
  a restart (it is in the checkpoint's offset log, not in its commit log).

One micro-batch, on the driver:

1. `read(start)` consumes up to `maxMessagesPerBatch` messages with
   `lease` (a long poll of `wait` seconds first, then 1,000 per request
   while full ones come back). The end offset names every message consumed
   (queue, msg_id, receipt: `offsets.BatchOffset`); when nothing was
   deliverable it returns `start` again, and Spark runs no batch.
2. Spark writes the end offset to the checkpoint's offset log, runs the
   batch (the sink writes the rows) and writes the batch to its commit log.
3. The batch's messages are confirmed (action 3, with their receipts) by
   whichever comes first:
   - the next trigger's `read(start)`, whose `start` is that batch's end
     offset: Spark's micro-batch loop asks for the batch after `start`
     only once the batch that ended at `start` is in its commit log
     (MicroBatchExecution: `constructNextBatch` runs when no batch is
     constructed, i.e. after `runBatch` and `markMicroBatchEnd`; after a
     restart, an uncommitted last batch is run again first). So a query
     that goes idle confirms its last batch at the next trigger;
   - `commit(end)`, which Spark calls for batch N once it has written batch
     N+1's offsets (`markMicroBatchStart`, then
     `cleanUpLastExecutedMicroBatch`), that is only after batch N is in its
     commit log, and only when batch N+1 has data.
   A confirm is therefore never sent for a batch Spark has not committed:
   at-least-once end to end. Nothing is confirmed twice: a reader
   remembers the batches it confirmed.

After a restart from the checkpoint, the last batch of the offset log, if
it is not in the commit log, is replayed: `readBetweenOffsets` reads its
messages again by id (show, action 11), those the queue still holds, in
the offset's order (delivery order within each queue). Then `read(start)`
(PySpark 4.2 and later pass the checkpoint's offset as `start`; 4.0 and
4.1 the initial offset, and the batch waits for `commit`) confirms them.

A receipt that is stale when confirmed means the lease ran out before the
confirm and the message was (or will be) delivered again: to this query (a
later batch, so the sink gets it twice) or another consumer. The source
counts those (a show tells "delivered again" from "gone") and reports them,
and never confirms by id: it would settle a delivery it does not hold. The
lease must therefore outlast a micro-batch, from its consume to the next
trigger. spark_integration/README.md states the guarantees and limits.

`QServerBatchReader` (`spark.read.format("qserver")`): one partition per
queue, each an executor task that peeks (action 12) up to `count` messages:
what a consume would deliver now, in that order, without consuming.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
from pyspark.sql.datasource import (
    DataSourceReader,
    InputPartition,
    SimpleDataSourceStreamReader,
)

from qserver.client import Client
from qserver.client.core import (
    NO_SUCH_MESSAGE,
    STALE_RECEIPT,
    Message,
    confirm_request,
    show_request,
)
from qserver.errors import QServerClientError

from . import leaders, report
from ._compat import SupportsTriggerAvailableNow
from .errors import SourceError
from .messages import delivered_batch, viewed_batch
from .offsets import EMPTY, BatchOffset, MessageRef
from .options import PIPELINE_WINDOW
from .source_options import SourceOptions

__all__ = ["QServerStreamReader", "QServerBatchReader", "QueuePartition", "CONSUME_COUNT"]

# Messages per consume request: the server's most (qserver.wire.requests
# MAX_COUNT).
CONSUME_COUNT = 1000

# Offsets of confirmed batches a reader remembers, so that Spark's
# commit(end) of a batch that read(start) confirmed sends nothing: Spark
# commits the batch before the last, so a few are plenty.
CONFIRMED_KEYS = 16


def _key(offset: dict[str, Any]) -> bytes:
    """An offset's identity: a digest of its JSON text, as Spark compares
    offsets (an offset of 5,000 messages is some 125 KB of text)."""
    return hashlib.blake2b(json.dumps(offset).encode(), digest_size=16).digest()


def _client(opts: SourceOptions, hosts: Sequence[str]) -> Client:
    return Client(list(hosts), timeout=opts.timeout_s, **opts.client_options)


def _master_first(opts: SourceOptions) -> list[str]:
    def lookup() -> dict:
        with _client(opts, opts.hosts) as client:
            return client.leader()

    try:
        return leaders.master_first(opts.hosts, lookup)
    except QServerClientError as exc:
        raise SourceError(f"qserver source: no node of {list(opts.hosts)} told which node is "
                          f"master: {exc}") from exc


@dataclass
class _Confirmed:
    """What the confirms of one committed batch found."""

    confirmed: int = 0  # deleted with the batch's receipt
    redelivered: int = 0  # stale receipt, the message still held: delivered again since
    gone: int = 0  # stale receipt, no such message any more (confirmed before, expired...)
    at_most_once: int = 0  # no receipt: the consume deleted it
    failed: int = 0  # no answer (the client gave up): retried later, else left to the lease

    def describe(self, from_checkpoint: bool = False) -> str:
        parts = [f"confirmed {self.confirmed}"]
        if self.redelivered:
            parts.append(f"{self.redelivered} had been delivered again before the confirm "
                         f"(their lease ran out: they reach the sink twice, or another "
                         f"consumer got them)")
        if self.gone and from_checkpoint:
            parts.append(f"{self.gone} were gone already (confirmed by the query before it "
                         f"stopped, or by another consumer after their lease ran out)")
        elif self.gone:
            parts.append(f"{self.gone} were gone already (confirmed by a resend after a "
                         f"failover, or by another consumer after their lease ran out)")
        if self.at_most_once:
            parts.append(f"{self.at_most_once} had no receipt (produced with retry 0, or a "
                         f"last delivery before the ttl: deleted when consumed)")
        if self.failed:
            parts.append(f"{self.failed} could not be confirmed now (no node answered): "
                         f"retried at the next trigger")
        return "; ".join(parts)


class QServerStreamReader(SimpleDataSourceStreamReader, SupportsTriggerAvailableNow):
    """`spark.readStream.format("qserver")`: see the module docstring.

    Constructed wherever Spark needs the reader (the driver's source
    process, the planner, pickled into executor tasks for replays): it opens
    no connection until `read`, `commit` or `readBetweenOffsets` runs.
    """

    def __init__(self, opts: SourceOptions) -> None:
        self.opts = opts
        self._conn: Client | None = None
        # The batches this process consumed and has not confirmed, by `_key`
        # of their offsets (as Spark hands offsets back), oldest first: only
        # to tell them from a checkpoint's in the log. What is confirmed is
        # always the offset Spark names, never a batch it has not named.
        self._consumed: dict[bytes, None] = {}
        # The last offset `_key` was taken of, and its key: Spark hands the
        # same object back at every trigger until a batch has data.
        self._last_key: tuple[dict, bytes] | None = None
        # The last batches confirmed (their keys): Spark's commit(end) of a
        # batch that read(start) confirmed already is not sent again.
        self._confirmed: deque[bytes] = deque(maxlen=CONFIRMED_KEYS)
        # Committed batches' messages whose confirms found no node: tried
        # again at the next call.
        self._unconfirmed: list[MessageRef] = []
        # Trigger.AvailableNow: messages still to read (None: no such trigger).
        self._budget: int | None = None

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_conn"] = None  # a connection does not travel
        return state

    # -- Spark's calls ------------------------------------------------------

    def initialOffset(self) -> dict:
        return EMPTY.to_json()

    def prepareForTriggerAvailableNow(self) -> None:
        """Trigger.AvailableNow: read what is deliverable now (the queues'
        `ready` counts) and stop; messages arriving meanwhile wait for the
        next run."""
        client = self._client()
        try:
            self._budget = sum(int(client.monitor(q).get("ready", 0)) for q in self.opts.queues)
        except QServerClientError as exc:
            raise SourceError(f"qserver source: cannot count the ready messages of "
                              f"{list(self.opts.queues)}: {exc}") from exc

    def read(self, start: dict) -> tuple[Iterator[Any], dict]:
        """Confirm the batch that ended at `start` (Spark has committed it),
        then consume the next micro-batch (on the driver). Returns its rows
        (one Arrow record batch, in delivery order) and its end offset, or
        no rows and `start` when nothing was deliverable."""
        client = self._client()
        self._retry_confirms(client)
        # Spark asks for the batch after `start` only once the batch that
        # ended at `start` is in its commit log (see the module docstring).
        self._confirm_committed(client, start)
        messages = self._consume(client)
        if not messages:
            return iter([]), start
        offset = BatchOffset(tuple(MessageRef(m.queue, m.msg_id, m.receipt) for m in messages),
                             time.time())
        end = offset.to_json()
        self._consumed[self._key(end)] = None
        while len(self._consumed) > CONFIRMED_KEYS:  # named by Spark never: leases run out
            del self._consumed[next(iter(self._consumed))]
        batch = delivered_batch(messages, self._dead_letter_views(client, messages))
        # A list's iterator: Spark's wrapper caches it and copies it
        # (copy.copy) to hand the rows to the JVM; a generator cannot be copied.
        return iter([batch]), end

    def readBetweenOffsets(self, start: dict, end: dict) -> Iterator[Any]:
        """A micro-batch again (on an executor, when Spark replays it):
        its messages by id (show), those the queue still holds, in the
        offset's order (delivery order within each queue)."""
        offset = BatchOffset.from_json(end)
        if not offset.messages:
            return iter([])
        log = report.logger()
        requests = [show_request(ref.queue, ref.msg_id) for ref in offset.messages]
        try:
            with _client(self.opts, _master_first(self.opts)) as client:
                answers = client._exchange(requests, PIPELINE_WINDOW, stop_on_error=False)
                leaders.forget(self.opts.hosts, client.address)
        except QServerClientError as exc:
            raise SourceError(f"qserver source: cannot read the {len(offset)} messages of a "
                              f"replayed micro-batch again: {exc}") from exc
        found = []
        missing = 0
        for ref, answer in zip(offset.messages, answers):
            if answer is not None and answer.get("code") == 0 and "message" in answer:
                found.append((ref.queue, answer["message"]))
            elif answer is not None and answer.get("reason") == NO_SUCH_MESSAGE:
                missing += 1
            else:
                raise SourceError(f"qserver source: show of message {ref.msg_id} of queue "
                                  f"{ref.queue!r} (a replayed micro-batch) failed: {answer}")
        log.info("qserver source: replaying a micro-batch consumed at %s: %d of its %d "
                 "messages read again by id%s", _when(offset.at), len(found), len(offset),
                 f"; {missing} are no longer in their queue (confirmed since, expired, "
                 f"dead-lettered, or consumed at most once): not in the replay"
                 if missing else "")
        if not found:
            return iter([])
        return iter([viewed_batch(found, peek_fields=False)])

    def commit(self, end: dict) -> None:
        """Spark has committed the batch that ended at `end` (and every one
        before): confirm its messages with their receipts (on the driver),
        unless `read` did already."""
        client = self._client()
        self._retry_confirms(client)
        self._confirm_committed(client, end)

    # -- the work -----------------------------------------------------------

    def _client(self) -> Client:
        if self._conn is None:
            self._conn = _client(self.opts, _master_first(self.opts))
        return self._conn

    def _key(self, offset: dict) -> bytes:
        """`_key(offset)`, once per offset object."""
        last = self._last_key
        if last is not None and last[0] is offset:
            return last[1]
        key = _key(offset)
        self._last_key = (offset, key)
        return key

    def _confirm_committed(self, client: Client, end: dict) -> None:
        """Confirm the batch that ended at `end`, which Spark has committed
        (its messages, as the offset names them; once per batch)."""
        key = self._key(end)
        if key in self._confirmed:
            return
        self._confirmed.append(key)
        from_checkpoint = key not in self._consumed  # consumed before a restart
        self._consumed.pop(key, None)
        offset = BatchOffset.from_json(end)
        if not offset.messages:
            return
        started = time.monotonic()
        result = self._confirm(client, offset.messages)
        report.logger().info(
            "qserver source: %s of %d messages consumed at %s is committed: %s (%.3f s)",
            "the checkpoint's micro-batch" if from_checkpoint else "micro-batch",
            len(offset), _when(offset.at), result.describe(from_checkpoint),
            time.monotonic() - started)

    def _consume(self, client: Client) -> list[Message]:
        """Up to maxMessagesPerBatch (and the AvailableNow budget) messages,
        1,000 per consume; the first waits up to `wait` seconds."""
        opts = self.opts
        want = opts.max_messages if self._budget is None else min(opts.max_messages,
                                                                   self._budget)
        got: list[Message] = []
        first = True
        queue, queues = (opts.queues[0], None) if len(opts.queues) == 1 else (None, opts.queues)
        while want > 0:
            count = min(CONSUME_COUNT, want)
            wait = opts.wait_s if first and self._budget is None and opts.wait_s > 0 else None
            try:
                delivered = client.consume(queue, queues=queues, count=count, wait=wait,
                                           lease=opts.lease_s)
            except QServerClientError as exc:
                raise SourceError(
                    f"qserver source: a consume from {list(opts.queues)} failed: {exc}. "
                    f"{len(got)} messages consumed by this trigger are not in any batch: "
                    f"they are delivered again when their lease ({opts.lease_s:g} s) runs "
                    f"out, as are those of the batch not yet confirmed") from exc
            got.extend(delivered)
            want -= len(delivered)
            first = False
            if len(delivered) < count:
                break
        if self._budget is not None:
            self._budget = 0 if len(got) < min(opts.max_messages, self._budget) \
                else self._budget - len(got)
        return got

    def _confirm(self, client: Client, refs: Sequence[MessageRef]) -> _Confirmed:
        result = _Confirmed()
        todo = [r for r in refs if r.receipt is not None]
        result.at_most_once = len(refs) - len(todo)
        answers = self._exchange(client, [confirm_request(r.queue, r.msg_id, r.receipt)
                                          for r in todo])
        stale = []
        for ref, answer in zip(todo, answers):
            if answer is None:
                result.failed += 1
                self._unconfirmed.append(ref)
            elif answer.get("code") == 0:
                result.confirmed += 1
            elif answer.get("reason") == STALE_RECEIPT:
                stale.append(ref)
            else:
                raise SourceError(f"qserver source: the confirm of message {ref.msg_id} of "
                                  f"queue {ref.queue!r} was refused: {answer.get('reason')}")
        if stale:
            shown = self._exchange(client, [show_request(r.queue, r.msg_id) for r in stale])
            for answer in shown:
                if answer is not None and answer.get("code") == 0:
                    result.redelivered += 1
                else:
                    result.gone += 1
        return result

    def _retry_confirms(self, client: Client) -> None:
        if self._unconfirmed:
            refs, self._unconfirmed = self._unconfirmed, []
            report.logger().info("qserver source: confirms of committed batches retried: %s",
                                 self._confirm(client, refs).describe())

    def _dead_letter_views(self, client: Client, messages: Sequence[Message]
                           ) -> dict[tuple[str, int], dict]:
        """The views (show, action 11) of `messages`, for the dead-letter
        fields a consume's answer lacks (option deadLetterFields)."""
        if not self.opts.dead_letter_fields:
            return {}
        return self._show(client, messages)

    def _show(self, client: Client, messages: Sequence[Message]
              ) -> dict[tuple[str, int], dict]:
        answers = self._exchange(client, [show_request(m.queue, m.msg_id) for m in messages])
        return {(m.queue, m.msg_id): a["message"] for m, a in zip(messages, answers)
                if a is not None and a.get("code") == 0 and "message" in a}

    def _exchange(self, client: Client, requests: list[dict]) -> list[dict | None]:
        """Send `requests` pipelined; their answers (None: not answered,
        the client gave up). Refusals are answers, not errors."""
        if not requests:
            return []
        try:
            # The client's lower layer, as the sink's: pipelined raw
            # requests, resent to the next master when their outcome is
            # unknown.
            return client._exchange(requests, PIPELINE_WINDOW, stop_on_error=False)
        except QServerClientError as exc:
            report.logger().warning("qserver source: %d requests unanswered: %s",
                                    len(requests), exc)
            return [None] * len(requests)


class QueuePartition(InputPartition):
    """One queue of a batch read (one task)."""

    def __init__(self, queue: str) -> None:
        super().__init__(queue)
        self.queue = queue


class QServerBatchReader(DataSourceReader):
    """`spark.read.format("qserver")`: what peek (action 12) sees in each
    queue, without consuming: up to `count` messages per queue, in the
    order a consume would deliver them now."""

    def __init__(self, opts: SourceOptions) -> None:
        self.opts = opts

    def partitions(self) -> Sequence[InputPartition]:
        return [QueuePartition(q) for q in self.opts.queues]

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        queue = partition.queue if isinstance(partition, QueuePartition) else str(partition.value)
        try:
            with _client(self.opts, _master_first(self.opts)) as client:
                views = client.peek(queue, self.opts.peek_count)
                leaders.forget(self.opts.hosts, client.address)
        except QServerClientError as exc:  # a refusal too (ServerError)
            raise SourceError(f"qserver source: cannot peek queue {queue!r}: {exc}") from exc
        if not views:
            return iter([])
        return iter([viewed_batch((queue, v) for v in views)])


def _when(unix_s: float) -> str:
    if not unix_s:
        return "an unknown time"
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(unix_s)) + \
        f".{int(unix_s * 1000) % 1000:03d}"
