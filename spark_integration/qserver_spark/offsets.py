"""A micro-batch's offset: the messages it consumed, named one by one.

Theory of operation
-------------------
A queue has no position a reader could write down: consumers take
messages, and what one takes the next does not see. So the streaming
source's offset is not a position but the list of what one micro-batch
consumed: every message's (queue, msg_id, receipt), in delivery order
within its queue (the JSON groups them by queue), and when the consume
happened. Spark writes it to the checkpoint's offset log
before the batch runs; that is what lets the source

- confirm exactly the messages of a batch once Spark has committed it
  (`commit(end)` receives the batch's offset: the receipts are in it), in
  the process that consumed them or in a later one after a restart;
- read a batch again when Spark replays it after a restart: each message is
  looked up by id (show, action 11), as long as the queue still holds it.

Offsets are not cumulative: a batch's offset names that batch's messages
only, and the next batch's start is the previous batch's end. Two offsets
are never equal unless they are the same batch's: every delivery has a new
receipt. The empty offset (no message) is the initial one.

Format (JSON, as Spark stores it; messages grouped by queue, about 25 bytes
per message):

    {"v": 1, "at": 1795548373.159, "queues": {"orders": [[17, "3.17.1"], ...]}}

A receipt is null for a message the consume deleted as it delivered it (an
at-most-once message, retry 0, or a last delivery before its ttl): such a
message cannot be confirmed nor read again.

No I/O here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .errors import SourceError

__all__ = ["MessageRef", "BatchOffset", "EMPTY", "OFFSET_VERSION"]

OFFSET_VERSION = 1


@dataclass(frozen=True, slots=True)
class MessageRef:
    """One delivery a batch holds: message `msg_id` of `queue`, delivered
    with `receipt` (None: deleted by the consume, at most once)."""

    queue: str
    msg_id: int
    receipt: str | None


@dataclass(frozen=True, slots=True)
class BatchOffset:
    """The messages of one micro-batch, in delivery order (read back from
    JSON: grouped by queue, in delivery order within each); `at`: when they
    were consumed (unix seconds, 0 for the empty offset)."""

    messages: tuple[MessageRef, ...]
    at: float = 0.0

    def to_json(self) -> dict[str, Any]:
        queues: dict[str, list[list[Any]]] = {}
        for ref in self.messages:
            queues.setdefault(ref.queue, []).append([ref.msg_id, ref.receipt])
        return {"v": OFFSET_VERSION, "at": round(self.at, 3), "queues": queues}

    @classmethod
    def from_json(cls, obj: object) -> BatchOffset:
        """An offset as Spark hands it back (from its offset log).

        Raises:
            SourceError when `obj` is not an offset this source wrote (a
            checkpoint of another source, or of a newer version).
        """
        if not isinstance(obj, dict) or obj.get("v") != OFFSET_VERSION \
                or not isinstance(obj.get("queues"), dict):
            raise SourceError(f"qserver source: the checkpoint holds an offset this version "
                              f"cannot read ({str(obj)[:200]}); was the checkpoint written by "
                              f"another source or a newer qserver_spark?")
        at = obj.get("at", 0.0)
        refs = []
        for queue, items in obj["queues"].items():
            for item in items:
                if not (isinstance(item, list) and len(item) == 2
                        and isinstance(item[0], int) and (item[1] is None
                                                          or isinstance(item[1], str))):
                    raise SourceError(f"qserver source: a malformed message in an offset of "
                                      f"queue {queue!r}: {item!r}")
                refs.append(MessageRef(queue, item[0], item[1]))
        return cls(tuple(refs), float(at) if isinstance(at, (int, float)) else 0.0)

    def __len__(self) -> int:
        return len(self.messages)


EMPTY = BatchOffset(())
