"""Produce items to wire requests, and answers to counts: no I/O.

Theory of operation
-------------------
`rows.batch_items` gives one dict per row ({queue, data} and, where set,
delay, ttl, retry, priority, dedup_id). This module turns them into the
produce requests (action 1) a task sends:

- batch produce (the default): `BatchBuilder` keeps the rows of each queue
  in row order and cuts a request `{"action": 1, "queue": Q, "messages":
  [...]}` whenever a queue holds `batch_size` rows (at most
  MAX_BATCH_MESSAGES, the server's limit) or the next message would take the
  request's encoded size past MAX_REQUEST_BYTES (under the server's
  default max_request_size of 1 MiB, with room for the envelope and the
  client's seq); `flush()` cuts what is left. A request holds one queue's
  rows: the server takes one queue per produce.
- single produces (`batchProduce=false`): `single_requests` gives one
  request per row, in row order.

Times are made absolute here (`qserver.client.produce_request`, the client's
rule: relative seconds count from the time the request is built, rounded up
to whole seconds), so that a request the client resends after a failover
asks for the same instants as the first time.

`count_answers` reads the answers of the requests: how many rows they
carried and how many of those the server recognised as duplicates of a
produce within the queue's dedup window (stored nothing, answered the first
produce's msg_id).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import orjson

from qserver.client import produce_request

from .options import MAX_BATCH_MESSAGES

__all__ = ["BatchBuilder", "single_requests", "count_answers", "rows_of", "MAX_REQUEST_BYTES"]

# The largest encoded batch request: the server's default max_request_size
# is 1 MiB (README, Configuration); 900 KB leaves room for the envelope, the seq, and a
# node configured a little lower.
MAX_REQUEST_BYTES = 900_000

# What a request costs beyond its messages: {"action":1,"queue":...,
# "messages":[...],"seq":N} and a queue name of up to 255 characters.
_ENVELOPE_BYTES = 400


def _message(item: dict[str, Any], now_s: float) -> dict[str, Any]:
    """One item as a message of a batch: data, absolute delay and ttl,
    retry, priority, dedup_id (each only when set)."""
    if len(item) == 2:  # queue and data only: the common case, fast
        return {"data": item["data"]}
    obj = produce_request(item["queue"], item["data"], item.get("delay"), item.get("ttl"),
                          item.get("retry", 0), now_s)
    del obj["action"], obj["queue"]
    priority = item.get("priority")
    if priority is not None:
        obj["priority"] = priority
    dedup_id = item.get("dedup_id")
    if dedup_id is not None:
        obj["dedup_id"] = dedup_id
    return obj


def single_requests(items: Iterable[dict[str, Any]], now_s: float) -> list[dict[str, Any]]:
    """One produce request per item, in order."""
    out = []
    for item in items:
        obj = _message(item, now_s)
        out.append({"action": 1, "queue": item["queue"], **obj})
    return out


class BatchBuilder:
    """Items in, batch produce requests out (see the module docstring).

    `add(items, now_s)` returns the requests that filled up; `flush(now_s)`
    the rest. Rows of one queue keep their order across requests.
    """

    def __init__(self, batch_size: int) -> None:
        self.batch_size = min(batch_size, MAX_BATCH_MESSAGES)
        # Per queue: the messages of its next request and their encoded size
        # so far (envelope included).
        self._open: dict[str, tuple[list[dict[str, Any]], list[int]]] = {}

    def add(self, items: Iterable[dict[str, Any]], now_s: float) -> list[dict[str, Any]]:
        ready: list[dict[str, Any]] = []
        open_ = self._open
        for item in items:
            queue = item["queue"]
            message = _message(item, now_s)
            size = len(orjson.dumps(message)) + 1  # and its comma
            entry = open_.get(queue)
            if entry is None:
                entry = open_[queue] = ([], [_ENVELOPE_BYTES + len(queue)])
            messages, total = entry
            if messages and total[0] + size > MAX_REQUEST_BYTES:
                ready.append(_request(queue, messages))
                messages = []
                entry = open_[queue] = (messages, [_ENVELOPE_BYTES + len(queue)])
                total = entry[1]
            messages.append(message)
            total[0] += size
            if len(messages) >= self.batch_size:
                ready.append(_request(queue, messages))
                del open_[queue]
        return ready

    def flush(self) -> list[dict[str, Any]]:
        ready = [_request(queue, messages) for queue, (messages, _) in self._open.items()
                 if messages]
        self._open.clear()
        return ready

    @property
    def pending(self) -> int:
        """Rows held for requests not cut yet."""
        return sum(len(messages) for messages, _ in self._open.values())


def _request(queue: str, messages: list[dict[str, Any]]) -> dict[str, Any]:
    return {"action": 1, "queue": queue, "messages": messages}


def rows_of(request: dict[str, Any]) -> int:
    """The rows one request carries."""
    messages = request.get("messages")
    return len(messages) if messages is not None else 1


def count_answers(requests: Sequence[dict[str, Any]], answers: Sequence[dict[str, Any] | None]
                  ) -> tuple[int, int]:
    """(rows, duplicates) of requests answered with code 0: the rows they
    carried, and those the server answered as duplicates (`duplicates` of a
    batch, `duplicate: true` of a single produce)."""
    rows = duplicates = 0
    for request, answer in zip(requests, answers):
        if answer is None or answer.get("code") != 0:
            continue
        rows += rows_of(request)
        if "messages" in request:
            duplicates += len(answer.get("duplicates") or ())
        elif answer.get("duplicate") is True:
            duplicates += 1
    return rows, duplicates
