"""The request service: one decoded client request in, one response out.

Theory of operation
-------------------
`Service.handle(obj, now_ms, respond)` validates the request, answers reads
(monitor, list, leader) from the node's state, and turns writes into entries:
`Store.decide_*` on the master, then `Engine.propose`, whose `done` callback
builds the response once the entry is committed. `respond(dict)` may run
before `handle` returns (single node, async mode) or later (quorum mode).

`handle` first tries `answer_now(obj, now_ms)`, the hot path of a single
node: a produce, consume or confirm of the usual shape, validated, decided,
committed (`LocalEngine.commit_now`, no callback) and answered in one call,
with the same answer and the same entry as the general path. The client
adapters call `answer_now` themselves and fall back to `handle_general`.

The response is the request object itself with fields added, as queue_server
does: its clients match `seq` and read back their own fields. A produce
response drops `data`, `delay`, `ttl` and `retry`.

Reads: an answer that appends no entry (an empty consume, a confirm of an
unknown id, monitor and list) is computed from the master's store, which
holds its uncommitted entries too. It goes out only once `Engine.read_index`
says it rests on committed state (design.md: Raft's read index), so that a
master cut off from its slaves never acknowledges what a new master undoes;
if the master loses its role first, the client hears "outcome unknown".
Node-local reads (104, 107) and leader (8) answer from the node's own state
at once.

Rules
- Every outcome answers exactly once: a bad request (code -1 and the
  reason), a refused write ("queue full", "time error"), an empty consume
  (code 0, no msg_id), a committed write, or a write that failed to commit.
- Nothing here reads a clock or touches a socket: `now_ms` comes in.

This module does no I/O.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

from .config import Config
from .engines.base import Engine, JsonObject, Respond, Role
from .errors import BadRequest
from .state.entries import Confirm, Consume
from .state.store import Store
from .wire.codec import error_response
from .wire.requests import (
    MAX_QUEUE_NAME,
    MAX_TIME_S,
    ConfirmRequest,
    ConsumeRequest,
    LeaderRequest,
    ListRequest,
    MonitorRequest,
    ProduceRequest,
    UnsupportedRequest,
    parse_request,
)

__all__ = ["Service", "Respond"]

# Adds a committed write's result to its answer (a consume's message).
Fill = Callable[[JsonObject, Any], None]
# Builds the answer of a monitor or list request.
ReadAnswer = Callable[[JsonObject, Any, int], JsonObject]


def _consumed(obj: JsonObject, result: tuple[int, str]) -> None:
    obj["msg_id"], obj["data"] = result


class Service:
    """Answers client requests for one node."""

    def __init__(self, *, config: Config, store: Store, engine: Engine) -> None:
        self.config = config
        self.store = store
        self.engine = engine
        self._commits_at_once = engine.commits_at_once

    def handle(self, obj: object, now_ms: int, respond: Respond, *,
               forwarded: bool = False) -> None:
        """Answer one decoded request (any JSON value) through `respond`.

        `forwarded`: the request came from a slave; if this node is not the
        master either, it is answered "no leader" rather than relayed again.
        """
        if not forwarded:
            response = self.answer_now(obj, now_ms)
            if response is not None:
                respond(response)
                return
        self.handle_general(obj, now_ms, respond, forwarded=forwarded)

    def answer_now(self, obj: object, now_ms: int) -> JsonObject | None:
        """The fast path: answer a produce, consume or confirm of the usual
        shape at once, when the engine commits at once (a single node).

        Returns the response, exactly what `handle` would have passed to
        `respond`; or None, having changed nothing, for every other request
        (another action or shape, a cluster engine), which the caller then
        passes to `handle_general`.

        Why a second path: it does in one call what parse_request, the
        dispatch, the request tuple, the decide wrapper and the `done`
        callback do in a dozen, about a third of qserver's own cost per
        request (bench/hotpath.py). It accepts only what parse_request
        accepts, and gives the same answer and the same entry; anything
        else (a float time, an id sent as a string, a missing or ill-typed
        field, a bool) takes the general path, which also words the
        reasons. Cost: that of the store's decide and apply.
        """
        if not self._commits_at_once or not isinstance(obj, dict):
            return None
        get = obj.get
        action = get("action")
        if type(action) is not int:
            return None
        queue = get("queue")
        if type(queue) is not str or not 0 < len(queue) <= MAX_QUEUE_NAME:
            return None
        if action == 1:
            return self._produce_now(obj, queue, now_ms)
        if action == 2:
            return self._consume_now(obj, queue, now_ms)
        if action == 3:
            return self._confirm_now(obj, queue)
        return None

    # The fast path's three actions: each returns the answer, or None having
    # changed nothing (an unusual shape: the general path words the reason).

    def _produce_now(self, obj: JsonObject, queue: str, now_ms: int) -> JsonObject | None:
        get = obj.get
        data = get("data")
        delay = get("delay")
        ttl = get("ttl")
        retry = get("retry")
        if type(data) is not str:
            return None
        # The answer drops the produce's inputs (see the module docstring).
        if type(delay) is int and type(ttl) is int and type(retry) is int:
            # The shape nearly every client sends: all three times given.
            if not (0 <= delay <= MAX_TIME_S and 0 <= ttl <= MAX_TIME_S
                    and 0 <= retry <= MAX_TIME_S):
                return None
            del obj["data"], obj["delay"], obj["ttl"], obj["retry"]
        else:
            if not ((delay is None or (type(delay) is int and 0 <= delay <= MAX_TIME_S))
                    and (ttl is None or (type(ttl) is int and 0 <= ttl <= MAX_TIME_S))
                    and (retry is None or (type(retry) is int and 0 <= retry <= MAX_TIME_S))):
                return None
            del obj["data"]
            pop = obj.pop
            pop("delay", None)
            pop("ttl", None)
            pop("retry", None)
            if retry is None:
                retry = 0
        store = self.store
        produced = store.decide_produce_values(queue, data, delay, ttl, retry, now_ms)
        if isinstance(produced, str):
            return error_response(produced, obj)
        targets = self.engine.commit_now(produced)
        obj["code"] = 0
        obj["msg_id"] = targets[0][1]
        if queue in store.virtual_queues:
            obj["msg_ids"] = {name: msg_id for name, msg_id in targets}
        return obj

    def _consume_now(self, obj: JsonObject, queue: str, now_ms: int) -> JsonObject | None:
        # A client's own msg_id/data must not read back as a delivery.
        pop = obj.pop
        pop("msg_id", None)
        pop("data", None)
        consumed = self.store.decide_consume_values(queue, now_ms)
        if consumed is None:
            obj["code"] = 0
            return obj
        if isinstance(consumed, str):
            return error_response(consumed, obj)
        obj["code"] = 0
        obj["msg_id"], obj["data"] = self.engine.commit_now(consumed)
        return obj

    def _confirm_now(self, obj: JsonObject, queue: str) -> JsonObject | None:
        msg_id = obj.get("msg_id")
        if type(msg_id) is not int or msg_id < 1:
            return None
        confirmed = self.store.decide_confirm_values(queue, msg_id)
        if confirmed is not None:
            if isinstance(confirmed, str):
                return error_response(confirmed, obj)
            self.engine.commit_now(confirmed)
        # An unknown id decides to None: code 0, not an error (queue_server).
        obj["code"] = 0
        return obj

    def handle_general(self, obj: object, now_ms: int, respond: Respond, *,
                       forwarded: bool = False) -> None:
        """`handle` without the fast path: for a request `answer_now` left
        alone (it returned None)."""
        try:
            req = parse_request(obj)
        except BadRequest as exc:
            respond(error_response(exc.reason, obj))
            return
        request = cast(JsonObject, obj)  # parse_request accepts JSON objects only
        if not self.engine.is_master and not (
                isinstance(req, LeaderRequest)
                or (isinstance(req, (MonitorRequest, ListRequest)) and req.local)):
            self._not_master(request, respond, forwarded)
            return
        if isinstance(req, ProduceRequest):
            self._produce(request, req, now_ms, respond)
        elif isinstance(req, ConsumeRequest):
            self._consume(request, req, now_ms, respond)
        elif isinstance(req, ConfirmRequest):
            self._confirm(request, req, respond)
        elif isinstance(req, MonitorRequest):
            self._read(request, req.local, self._monitor, req, now_ms, respond)
        elif isinstance(req, ListRequest):
            self._read(request, req.local, self._list, req, now_ms, respond)
        elif isinstance(req, LeaderRequest):
            respond(self._leader(request))
        elif isinstance(req, UnsupportedRequest):
            respond(error_response("not support", request))
        else:  # parse_request returns only the types above
            respond(error_response("invalid action", request))

    def _not_master(self, obj: JsonObject, respond: Respond, forwarded: bool) -> None:
        """A request for the master reached a slave: relay it, or redirect."""
        if forwarded:
            respond(error_response("no leader", obj))
        elif self.config.forward_request:
            if not self.engine.forward(obj, respond):
                respond(error_response("no leader", obj))
        else:
            leader = self.engine.leader()
            if leader is None:
                respond(error_response("no leader", obj))
                return
            obj.pop("data", None)
            # leader_* are ours; master_* are what queue_server's clients read.
            obj.update(code=-2, reason="redirect", leader_node_id=leader.node_id,
                       leader_host=leader.host, leader_port=leader.port,
                       master_host=leader.host, master_port=leader.port)
            respond(obj)

    # -- writes ------------------------------------------------------------

    def _produce(self, obj: JsonObject, req: ProduceRequest, now_ms: int, respond: Respond) -> None:
        pop = obj.pop
        pop("data", None)
        pop("delay", None)
        pop("ttl", None)
        pop("retry", None)
        outcome = self.store.decide_produce(req, now_ms)
        if isinstance(outcome, str):
            respond(error_response(outcome, obj))
            return
        virtual = req.queue in self.store.virtual_queues

        def done(targets: list[tuple[str, int]], error: str | None) -> None:
            if error is not None:
                respond(error_response(error, obj))
                return
            obj["code"] = 0
            obj["msg_id"] = targets[0][1]
            if virtual:
                obj["msg_ids"] = {name: msg_id for name, msg_id in targets}
            respond(obj)

        if self._commits_at_once:  # single node: no callback on the hot path
            done(self.engine.commit_now(outcome), None)
        else:
            self.engine.propose(outcome, done)

    def _consume(self, obj: JsonObject, req: ConsumeRequest, now_ms: int, respond: Respond) -> None:
        # A client's own msg_id/data must not read back as a delivery.
        obj.pop("msg_id", None)
        obj.pop("data", None)
        self._write(obj, self.store.decide_consume(req, now_ms), respond, _consumed)

    def _confirm(self, obj: JsonObject, req: ConfirmRequest, respond: Respond) -> None:
        # An unknown id decides to None: code 0, not an error (queue_server).
        self._write(obj, self.store.decide_confirm(req), respond, None)

    def _write(self, obj: JsonObject, outcome: Consume | Confirm | str | None, respond: Respond,
               fill: Fill | None) -> None:
        """Answer a consume or confirm decision: None (nothing to change:
        code 0), a reason (code -1), or an entry to replicate; once it
        commits, `fill(obj, result)` adds the result's fields."""
        if outcome is None:
            obj["code"] = 0
            self._after_read_index(obj, obj, respond)
            return
        if isinstance(outcome, str):
            respond(error_response(outcome, obj))
            return

        def done(result: Any, error: str | None) -> None:
            if error is not None:
                respond(error_response(error, obj))
                return
            obj["code"] = 0
            if fill is not None:
                fill(obj, result)
            respond(obj)

        self.engine.propose(outcome, done)

    # -- reads -------------------------------------------------------------

    def _read(self, obj: JsonObject, local: bool, answer: ReadAnswer,
              req: MonitorRequest | ListRequest, now_ms: int, respond: Respond) -> None:
        """Answer a monitor or list request: at once from this node's own
        state when it is node-local (104, 107), else once the master's
        state it was read from is committed."""
        if local:
            respond(answer(obj, req, now_ms))
            return
        request = dict(obj)  # answer() fills obj in; an error echoes the request
        self._after_read_index(answer(obj, req, now_ms), request, respond)

    def _after_read_index(self, response: JsonObject, request: JsonObject,
                          respond: Respond) -> None:
        """Send `response`, computed from the master's state now, once that
        state rests on committed entries only (Engine.read_index); if the
        master loses its role first, answer `request` with the error."""
        if self._commits_at_once:  # a lone node in memory: its state is committed
            respond(response)
            return

        def done(_result: object, error: str | None) -> None:
            if error is None:
                respond(response)
            else:
                respond(error_response(error, request))

        self.engine.read_index(done)

    def node_info(self) -> JsonObject:
        """This node's replication state, as monitor reports it."""
        status = self.engine.status()
        leader = self.engine.leader()
        leader_id = leader.node_id if leader else 0
        info: JsonObject = {
            "node_id": self.config.node_id,
            "leader_node_id": leader_id,
            "leader_id": leader_id,  # queue_server's name for the same field
            "role": status.role.value,
            "vote_id": status.vote_id,
            "trans_id": status.trans_id,
            "commit_id": status.commit_id,
            "applied_id": status.applied_id,
            "log_size": status.log_size,
            "max_log_size": self.config.log_size,
            "queue_count": len(self.store.queues),
        }
        if status.role is Role.MASTER:
            slaves = self.engine.slaves()
            if slaves is not None:
                info["slaves"] = slaves
        snapshot = self.engine.snapshot_info()
        if snapshot is not None:
            info["snapshot"] = snapshot
        storage = self.engine.storage_info()
        if storage is not None:
            info["storage"] = storage
        return info

    def _monitor(self, obj: JsonObject, req: MonitorRequest, now_ms: int) -> JsonObject:
        obj.update(self.node_info())
        if req.queue is not None:
            obj["max_size"] = self.config.queue_size
            queue = self.store.get(req.queue)
            if queue is None:
                obj.update(size=0, max_id=0, wait_status=0, ready=0, delayed=0, in_flight=0)
            else:
                ready, delayed, in_flight = queue.counts(now_ms)
                obj.update(size=len(queue), max_id=queue.max_id,
                           wait_status=queue.wait_status(now_ms), ready=ready,
                           delayed=delayed, in_flight=in_flight)
        obj["code"] = 0
        return obj

    def _list(self, obj: JsonObject, req: ListRequest, now_ms: int) -> JsonObject:
        pattern = req.pattern
        items = [{"name": name, "size": len(q), "wait_status": q.wait_status(now_ms)}
                 for name, q in sorted(self.store.queues.items()) if pattern in name]
        obj["queue_list"] = items
        obj["queue_count"] = len(items)
        obj["node_id"] = self.config.node_id
        obj["code"] = 0
        return obj

    def _leader(self, obj: JsonObject) -> JsonObject:
        leader = self.engine.leader()
        if leader is None:
            return error_response("no leader", obj)
        obj.update(code=0, leader_node_id=leader.node_id, leader_host=leader.host,
                   leader_port=leader.port)
        return obj
