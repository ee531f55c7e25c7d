"""The concurrent client workload of the fault harness, and the history it
records.

Theory of operation
-------------------
Several worker threads each loop: produce a message (retry=0 or retry=5,
data unique to that produce, to a random queue), or consume one and, for a
retry>0 message, mostly confirm it once it has "worked" on it for up to
2 s (a thread of its own per worker does the confirms, so that they go out
on time while the worker waits for another answer), mostly on the node
that delivered it.
Half of the workers follow the master (asked with action 8, asked again
after a failure), as clients that follow redirects do; the others send each
request to a random node. Requests go over the client protocol (JSON over
TCP), as an outside client's would. A request whose answer does not come
(a timeout drawn from REQUEST_TIMEOUTS_S, or the connection lost after
sending) or whose answer says "outcome unknown" is retried, with the same
data, on the same node or another one, 0.05 to 0.25 s later, up to
MAX_ATTEMPTS times. Every attempt is one `Op` in the history, with its
outcome:

- OK: code 0 (a produce's msg_id, a consume's msg_id and data or nothing,
  a confirm).
- FAIL: definitely not done: the connection could not be made (nothing was
  sent), "no leader", or the request was refused as invalid.
- UNKNOWN: anything else: a timeout, a connection lost after the request
  was sent, an answer naming the outcome unknown ("outcome unknown",
  "forward timeout", "master unreachable"), or an error we cannot classify
  (counted unknown, never as a failure, so that the checker can only miss a
  violation by it, not invent one).

Data encodes the producing operation and its retry (`w3:17:r5`), so that
a delivery tells the checker which produce it came from and whether the
message may legitimately be delivered again.

Timestamps are `time.monotonic()` seconds relative to the run's start,
taken just before sending and just after the answer: the checker orders
operations by them (one process, one clock).
"""

from __future__ import annotations

import enum
import heapq
import json
import random
import socket
import threading
import time
from dataclasses import dataclass

__all__ = ["Outcome", "Op", "History", "Worker", "Confirmer", "Drainer", "NodeClient", "classify",
           "retry_of", "REQUEST_TIMEOUTS_S", "MAX_ATTEMPTS", "RETRY_PAUSE_S"]

# A client's patience per attempt, drawn for each attempt: well under the
# server's forward timeout (10 s) so that workers retry elsewhere while a
# master is cut off, and often short enough that the retry reaches a master
# that has not yet noticed it lost its slaves (issue 12's client gave up and
# retried within about a second).
REQUEST_TIMEOUTS_S = (0.25, 0.5, 1.0, 3.0)
REQUEST_TIMEOUT_S = max(REQUEST_TIMEOUTS_S)
CONNECT_TIMEOUT_S = 2.0
# Attempts per produce or confirm, and the pause between them, drawn for
# each retry (issue 12: the retried confirm came 0.25 s after the first).
MAX_ATTEMPTS = 4
RETRY_PAUSE_S = (0.05, 0.25)
# The share of consumed retry>0 messages confirmed; the rest come back
# after their retry, to be delivered again.
CONFIRM_SHARE = 0.9
# A consumer works on a message for a while before it confirms it (it does
# other requests meanwhile): the confirm of a message delivered by a master
# often reaches that master after a fault began, as in issue 12.
THINK_S = (0.0, 2.0)
RETRY_VALUES = (0, 5)

_UNKNOWN_MARKS = ("outcome unknown", "forward timeout", "master unreachable")
_DEFINITE = ("no leader",)


class Outcome(enum.Enum):
    OK = "ok"
    FAIL = "fail"  # definitely not done
    UNKNOWN = "unknown"


@dataclass(frozen=True, slots=True, kw_only=True)
class Op:
    """One attempt of one client operation, with its outcome."""

    op_id: int  # the logical operation; its attempts share it
    attempt: int  # 1, 2, ...
    worker: str
    kind: str  # "produce" | "consume" | "confirm"
    node: int
    queue: str
    t_invoke: float  # seconds since the run started, before sending
    t_complete: float  # after the answer (or the timeout)
    outcome: Outcome
    data: str | None = None  # produce: sent; consume: delivered
    retry: int | None = None  # produce: the message's retry
    msg_id: int | None = None  # produce: given; consume: delivered; confirm: confirmed
    reason: str = ""
    phase: str = "load"  # "load" (faults running) or "drain"


def retry_of(data: str) -> int | None:
    """The retry a workload message was produced with (from its data)."""
    tail = data.rsplit(":", 1)[-1]
    if tail.startswith("r") and tail[1:].isdigit():
        return int(tail[1:])
    return None


def classify(response: dict | None, sent: bool) -> tuple[Outcome, str]:
    """The outcome of one attempt from its answer (None: no answer)."""
    if response is None:
        return (Outcome.UNKNOWN, "no answer") if sent else (Outcome.FAIL, "not sent")
    code = response.get("code")
    reason = str(response.get("reason", ""))
    if code == 0:
        return Outcome.OK, ""
    if any(m in reason for m in _UNKNOWN_MARKS):
        return Outcome.UNKNOWN, reason
    if code == -1 and reason in _DEFINITE:
        return Outcome.FAIL, reason
    return Outcome.UNKNOWN, f"code {code}: {reason}"


class History:
    """Every Op of a run, appended from many threads."""

    def __init__(self, t0: float) -> None:
        self.t0 = t0
        self._ops: list[Op] = []
        self._lock = threading.Lock()
        self._next_id = 0

    def now(self) -> float:
        return time.monotonic() - self.t0

    def new_op_id(self) -> int:
        with self._lock:
            self._next_id += 1
            return self._next_id

    def add(self, op: Op) -> None:
        with self._lock:
            self._ops.append(op)

    def ops(self) -> list[Op]:
        with self._lock:
            return list(self._ops)


class NodeClient:
    """One worker's connections, one per node, dropped after any trouble
    (an answer that comes after its timeout must not be read as the next)."""

    def __init__(self, ports: dict[int, int]) -> None:
        self.ports = ports
        self.socks: dict[int, tuple[socket.socket, bytearray]] = {}

    def close(self) -> None:
        for s, _ in self.socks.values():
            s.close()
        self.socks.clear()

    def _drop(self, node: int) -> None:
        entry = self.socks.pop(node, None)
        if entry:
            entry[0].close()

    def request(self, node: int, obj: dict,
                timeout_s: float = REQUEST_TIMEOUT_S) -> tuple[dict | None, bool]:
        """(answer or None, whether the request was sent)."""
        entry = self.socks.get(node)
        if entry is None:
            try:
                s = socket.create_connection(("127.0.0.1", self.ports[node]),
                                             timeout=CONNECT_TIMEOUT_S)
            except OSError:
                return None, False
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            entry = self.socks[node] = (s, bytearray())
        s, buf = entry
        try:
            s.settimeout(timeout_s)
            s.sendall(json.dumps(obj).encode())
            end = time.monotonic() + timeout_s
            while b"\n" not in buf:
                left = end - time.monotonic()
                if left <= 0:
                    raise TimeoutError()
                s.settimeout(left)
                chunk = s.recv(65536)
                if not chunk:
                    raise ConnectionError("closed")
                buf += chunk
            i = buf.index(b"\n")
            line = bytes(buf[:i])
            del buf[:i + 1]
            return json.loads(line), True
        except (OSError, ConnectionError, ValueError):
            self._drop(node)
            return None, True


class _Actor:
    """What workers and the drainer share: attempts, retries, recording."""

    def __init__(self, name: str, history: History, ports: dict[int, int],
                 rng: random.Random, phase: str) -> None:
        self.name = name
        self.history = history
        self.client = NodeClient(ports)
        self.nodes = sorted(ports)
        self.rng = rng
        self.phase = phase
        self.same_node_p = 0.5  # a retry goes to the same node with this probability

    def pick_node(self) -> int:
        return self.rng.choice(self.nodes)

    def lost_node(self) -> None:
        """An operation did not succeed on the node(s) it was sent to."""

    def attempt(self, op_id: int, attempt: int, kind: str, node: int, queue: str,
                obj: dict, **fields) -> tuple[Op, dict | None]:
        t_invoke = self.history.now()
        response, sent = self.client.request(node, obj, self.rng.choice(REQUEST_TIMEOUTS_S))
        outcome, reason = classify(response, sent)
        t_complete = self.history.now()
        if outcome is Outcome.OK and response is not None:
            if kind == "produce":
                fields["msg_id"] = response.get("msg_id")
            elif kind == "consume" and "msg_id" in response:
                fields["msg_id"] = response.get("msg_id")
                fields["data"] = response.get("data")
        op = Op(op_id=op_id, attempt=attempt, worker=self.name, kind=kind, node=node,
                queue=queue, t_invoke=t_invoke, t_complete=t_complete, outcome=outcome,
                reason=reason, phase=self.phase, **fields)
        self.history.add(op)
        return op, response

    def with_retries(self, kind: str, queue: str, obj: dict, stop: threading.Event | None,
                     node: int | None = None, **fields) -> Op:
        """Attempts until one is OK, up to MAX_ATTEMPTS (fewer once `stop`
        is set): the same request, on the same node or another."""
        op_id = self.history.new_op_id()
        node = self.pick_node() if node is None else node
        op = None
        for attempt in range(1, MAX_ATTEMPTS + 1):
            op, _ = self.attempt(op_id, attempt, kind, node, queue, obj, **fields)
            if op.outcome is Outcome.OK or (stop is not None and stop.is_set()):
                break
            time.sleep(self.rng.uniform(*RETRY_PAUSE_S))  # a client's pause, not synchronisation
            if self.rng.random() >= self.same_node_p:
                node = self.rng.choice([n for n in self.nodes if n != node])
        if op.outcome is not Outcome.OK:
            self.lost_node()
        return op

    def confirm(self, queue: str, msg_id: int, stop: threading.Event | None,
                node: int | None) -> Op:
        return self.with_retries("confirm", queue, {"action": 3, "queue": queue, "msg_id": msg_id},
                                 stop, node=node, msg_id=msg_id)


class Worker(_Actor):
    """A client thread: produces, consumes and confirms until stopped.

    With follow_master, it sends to the master (asked with action 8 of a
    random node; asked again after an operation that did not succeed) and
    retries there first, as a client that follows redirects and keeps its
    connection would; otherwise to random nodes."""

    def __init__(self, name: str, history: History, ports: dict[int, int], rng: random.Random,
                 queues: tuple[str, ...], stop: threading.Event, rate_per_s: float,
                 follow_master: bool = False) -> None:
        super().__init__(name, history, ports, rng, "load")
        self.follow_master = follow_master
        self.home: int | None = None  # the master, as last heard
        if follow_master:
            self.same_node_p = 0.8
        self.queues = queues
        self.stop = stop
        self.period_s = 1.0 / rate_per_s if rate_per_s > 0 else 0.0
        self.count = 0
        self.confirmer = Confirmer(f"{name}c", history, ports, random.Random(rng.random()), stop)
        self.thread = threading.Thread(target=self._run, name=f"harness-{name}", daemon=True)
        self.error: BaseException | None = None

    def start(self) -> None:
        self.confirmer.start()
        self.thread.start()

    def join(self, timeout_s: float) -> None:
        self.thread.join(timeout_s)
        self.confirmer.join(timeout_s)
        self.error = self.error or self.confirmer.error

    def _run(self) -> None:
        try:
            while not self.stop.is_set():
                started = time.monotonic()
                if self.rng.random() < 0.5:
                    self.produce()
                else:
                    self.consume()
                # Pacing: keep the clients from starving the nodes of the 2 cores.
                left = self.period_s - (time.monotonic() - started)
                if left > 0:
                    self.stop.wait(left)
        except BaseException as exc:  # reported by the run, never swallowed
            self.error = exc
        finally:
            self.client.close()

    def pick_node(self) -> int:
        if not self.follow_master:
            return super().pick_node()
        if self.home is None:
            response, _ = self.client.request(super().pick_node(), {"action": 8}, 0.5)
            leader = (response or {}).get("leader_node_id")
            self.home = leader if leader in self.nodes else None
        return self.home if self.home is not None else super().pick_node()

    def lost_node(self) -> None:
        self.home = None

    def produce(self) -> None:
        self.count += 1
        retry = self.rng.choice(RETRY_VALUES)
        queue = self.rng.choice(self.queues)
        data = f"{self.name}:{self.count}:r{retry}"
        self.with_retries("produce", queue, {"action": 1, "queue": queue, "data": data,
                                             "retry": retry},
                          self.stop, data=data, retry=retry)

    def consume(self) -> None:
        queue = self.rng.choice(self.queues)
        node = self.pick_node()
        op, _ = self.attempt(self.history.new_op_id(), 1, "consume", node, queue,
                             {"action": 2, "queue": queue})
        if op.outcome is not Outcome.OK:
            self.lost_node()
        if op.outcome is not Outcome.OK or op.msg_id is None:
            return
        if (retry_of(op.data or "") or 0) > 0 and self.rng.random() < CONFIRM_SHARE:
            self.confirmer.hold(time.monotonic() + self.rng.uniform(*THINK_S), queue, op.msg_id,
                                node)


class Confirmer(_Actor):
    """A worker's consumer side: confirms each message it is handed once
    the message's work is done (at its due time), on a thread of its own,
    so that a confirm goes out on time even while the worker waits for an
    answer elsewhere (issue 12: the confirm reached a master just cut off)."""

    def __init__(self, name: str, history: History, ports: dict[int, int], rng: random.Random,
                 stop: threading.Event) -> None:
        super().__init__(name, history, ports, rng, "load")
        self.stop = stop
        self.held: list[tuple[float, str, int, int]] = []  # heap: (due, queue, msg_id, node)
        self.cond = threading.Condition()
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name=f"harness-{name}", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def join(self, timeout_s: float) -> None:
        with self.cond:
            self.cond.notify()
        self.thread.join(timeout_s)

    def hold(self, due: float, queue: str, msg_id: int, node: int) -> None:
        with self.cond:
            heapq.heappush(self.held, (due, queue, msg_id, node))
            self.cond.notify()

    def _next(self) -> tuple[str, int, int] | None:
        """The next message due, once it is due; None once stopped."""
        with self.cond:
            while not self.stop.is_set():
                if self.held and self.held[0][0] <= time.monotonic():
                    _, queue, msg_id, node = heapq.heappop(self.held)
                    return queue, msg_id, node
                # Until the next due time, or a new message, or the stop.
                self.cond.wait(self.held[0][0] - time.monotonic() if self.held else 0.5)
        return None

    def _run(self) -> None:
        try:
            while (item := self._next()) is not None:
                queue, msg_id, node = item
                # Mostly on the node that delivered it (issue 12's consumer).
                self.confirm(queue, msg_id, self.stop, node if self.rng.random() < 0.7 else None)
        except BaseException as exc:  # reported by the run, never swallowed
            self.error = exc
        finally:
            self.client.close()


class Drainer(_Actor):
    """After the faults: consume every queue empty, confirming each
    retry>0 delivery, until the master's monitor shows every queue empty."""

    def __init__(self, history: History, ports: dict[int, int], rng: random.Random,
                 queues: tuple[str, ...]) -> None:
        super().__init__("drain", history, ports, rng, "drain")
        self.queues = queues

    def sizes(self) -> dict[str, int] | None:
        """Queue sizes from the master's monitor (4, forwarded); None if unknown."""
        out = {}
        for q in self.queues:
            node = self.rng.choice(self.nodes)
            response, _ = self.client.request(node, {"action": 4, "queue": q})
            if response is None or response.get("code") != 0:
                return None
            out[q] = int(response.get("size", 0))
        return out

    def drain(self, deadline_s: float) -> bool:
        """True once every queue is empty; False at the deadline."""
        end = time.monotonic() + deadline_s
        try:
            while time.monotonic() < end:
                got_any = False
                for q in self.queues:
                    while time.monotonic() < end:
                        node = self.rng.choice(self.nodes)
                        op, _ = self.attempt(self.history.new_op_id(), 1, "consume", node, q,
                                             {"action": 2, "queue": q})
                        if op.outcome is not Outcome.OK or op.msg_id is None:
                            break
                        got_any = True
                        if (retry_of(op.data or "") or 0) > 0:
                            self.confirm(q, op.msg_id, None, node)
                if got_any:
                    continue
                sizes = self.sizes()
                if sizes is not None and not any(sizes.values()):
                    return True
                # In-flight messages come back after their retry: look again soon.
                time.sleep(0.2)
            return False
        finally:
            self.client.close()
