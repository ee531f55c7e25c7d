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

Long poll: a consume with `wait` that finds nothing deliverable is
parked: it waits in a per-queue list, first come first served, and costs
nothing while it waits. A write that makes a message deliverable at once (a
produce, a nack, a dead letter) serves the parked consumes of its queues in
the same call; a message that becomes deliverable later (a delay, a retry
or a lease coming due), a parked consume's own deadline, and a final lease
that runs out (its message leaves by the dead-letter rules) are deadlines:
the service tells the node the earliest one it learns of (`schedule`), and
the node calls `tick(now_ms)` then. A parked consume whose client goes (its
`Session` closes) is dropped unanswered; a master that loses its role
answers every parked consume at once with the empty answer.

Drain (action 108) takes a node out of client work, to stop or restart it
without its clients noticing: `draining` is set, parked consumes are
answered empty at once, and a master hands its role to its most up-to-date
slave (Engine.transfer_leader), answering the drain once that is done; a
draining node elected master again (an election raced or followed the
hand-over) hands the role over again, from the next tick.
While draining, a client's request gets a redirect to the master (code -2),
or "no leader" when there is none or this node still is it (a failed
transfer): either way its client goes elsewhere. Still answered here: health
(109), drain and its undo (108), leader (8), a leader transfer (20),
node-local monitor and list (104, 107) and action 0: what an operator
needs to watch and steer the drain. Requests other nodes forward are served
as before (a draining node that is still master keeps the cluster
writable). The fast path (`answer_now`) stands aside while draining.
Health (109, `health`) says not ready while draining.

Rules
- Every outcome answers exactly once: a bad request (code -1 and the
  reason), a refused write ("queue full", "time error"), an empty consume
  (code 0, no msg_id), a committed write, or a write that failed to commit.
  A parked consume is answered once too: served, timed out, dropped with
  its client (no answer), or emptied by the loss of the master's role.
- Nothing here reads a clock or touches a socket: `now_ms` comes in.

This module does no I/O.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from typing import Any, cast

from .config import Config
from .engines.base import (
    FORWARD_TIMEOUT_S,
    Engine,
    JsonObject,
    Respond,
    Role,
    Session,
    TransferDone,
)
from .errors import BadRequest
from .state.entries import Configure, Confirm, Consume, ConsumeMany, DeadLetter, Produce
from .state.store import (
    DEFAULT_PRIORITY,
    DELIVERIES,
    RETRY_MS,
    Queue,
    Store,
    message_view,
    receipt_text,
)
from .wire.codec import error_response
from .wire.requests import (
    MAX_QUEUE_NAME,
    MAX_TIME_S,
    RELATIVE_TIME_LIMIT_S,
    AuthRequest,
    ClearRequest,
    ConfigRequest,
    ConfirmRequest,
    ConsumeRequest,
    DrainRequest,
    HealthRequest,
    LeaderRequest,
    ListRequest,
    MonitorRequest,
    NackRequest,
    PeekRequest,
    ProduceBatchRequest,
    ProduceRequest,
    ShowRequest,
    TouchRequest,
    TransferLeaderRequest,
    parse_receipt,
    parse_request,
)

__all__ = ["Service", "Respond", "Session"]

# Final leases that ran out are moved out by at most this many entries per
# tick, so that a backlog of them does not hold the event loop; the next
# tick comes at once for the rest.
EXPIRE_BATCH = 256

# A move of an expired final lease that the engine refused (a full disk) is
# tried again this much later.
EXPIRE_RETRY_MS = 1000

# A draining master that is elected again right after handing its role
# over (an election raced the hand-over) hands it over again, this many
# times in all for one drain or one election before it answers with what
# happened: a node that keeps winning is worth an operator's look.
HAND_OVER_TRIES = 3

# What a draining node still answers itself (with 104 and 107, node-local
# monitor and list; "Drain" in the module docstring): what an operator
# needs to watch and steer a drain (health, drain and its undo, where the
# master is, a leader transfer) and action 0. Everything else is client
# work, sent elsewhere.
_WHILE_DRAINING = (HealthRequest, DrainRequest, LeaderRequest, TransferLeaderRequest,
                   AuthRequest)

# The answers that say a receipt or an in-flight state did not match: they
# append no entry, so they rest on committed state (read index).
_READ_ERRORS = frozenset({"stale receipt", "not in flight"})
# ...and the produce refusals that rest on the queue's state (its size, a
# pause set by an entry): a cut-off master must not refuse on a state that
# never commits.
_STATE_REFUSALS = ("queue full", "queue paused")


class _Waiter:
    """A parked consume."""

    __slots__ = ("key", "obj", "req", "respond", "deadline_ms", "session", "session_key")

    def __init__(self, key: int, obj: JsonObject, req: ConsumeRequest, respond: Respond,
                 deadline_ms: int, session: Session | None) -> None:
        self.key = key  # the order of arrival: lower is served first
        self.obj = obj
        self.req = req
        self.respond = respond
        self.deadline_ms = deadline_ms  # answered empty then
        self.session = session
        self.session_key = 0  # in `session`, to discard once answered

# Adds a committed write's result to its answer.
Fill = Callable[[JsonObject, Any], None]
# Builds the answer of a monitor or list request.
ReadAnswer = Callable[[JsonObject, Any, int], JsonObject]


def _found(obj: JsonObject, result: bool) -> None:
    obj["found"] = result


def _ready_at(obj: JsonObject, ready_ms: int) -> None:
    obj["ready_at"] = ready_ms / 1000


def _retry_at(obj: JsonObject, retry_at_ms: int) -> None:
    obj["retry_at"] = retry_at_ms / 1000


def _configured(obj: JsonObject, settings: JsonObject) -> None:
    obj["config"] = settings


def _cleared(obj: JsonObject, count: int) -> None:
    obj["cleared"] = count


def _view(queue: Queue, msg_id: int, now_ms: int) -> JsonObject:
    """What show and peek answer for a message of `queue`."""
    priorities = queue.priorities
    return message_view(msg_id, queue.messages[msg_id], now_ms,
                        priorities.get(msg_id, DEFAULT_PRIORITY) if priorities else
                        DEFAULT_PRIORITY)


def _ref_answer(ref: Any) -> Any:
    """A dedup table's ref as an answer names it: the msg_id, or for a
    virtual queue {real queue: msg_id}."""
    return ref if type(ref) is int else dict(ref)


class Service:
    """Answers client requests for one node."""

    def __init__(self, *, config: Config, store: Store, engine: Engine) -> None:
        self.config = config
        self.store = store
        self.engine = engine
        self.max_wait_ms = config.max_wait_s * 1000
        # queue name -> its parked consumes by key, oldest first; a consume
        # of several queues is in the list of each. No empty lists.
        self.waiting: dict[str, OrderedDict[int, _Waiter]] = {}
        self._waiters: dict[int, _Waiter] = {}  # every parked consume, by key
        self._timeouts: list[tuple[int, int]] = []  # (deadline_ms, key): a heap; stale ones stay
        self._next_key = 0
        # Set by the node: arm a timer that calls `tick` at this unix ms (an
        # earlier one than the timer armed wins; a late call is harmless).
        self.schedule: Callable[[int], None] | None = None
        # Consumes answered empty by this service since it started (the
        # forwarded ones a master answers included; metrics.py). Only grows.
        self.consume_empty = 0
        # Set by drain (action 108): this node takes no new client work
        # (see `drain`); health says not ready while it is set.
        self.draining = False
        # A draining master's hand-over (Engine.transfer_leader): under way;
        # due at the next tick (elected again while draining); the drains
        # waiting for its end; the tries left before a re-election is
        # reported as the outcome.
        self._handing_over = False
        self._hand_over_due = False
        self._drain_answers: list[TransferDone] = []
        self._hand_over_tries = 0

    @property
    def parked(self) -> int:
        """Consumes parked on this node."""
        return len(self._waiters)

    def handle(self, obj: object, now_ms: int, respond: Respond, *,
               forwarded: bool = False, session: Session | None = None) -> None:
        """Answer one decoded request (any JSON value) through `respond`.

        `forwarded`: the request came from a slave; if this node is not the
        master either, it is answered "no leader" rather than relayed again.
        `session`: the client's (see `Session`); None for UDP.
        """
        if not forwarded or self.engine.commits_at_once:  # (then this node is master)
            response = self.answer_now(obj, now_ms)
            if response is not None:
                respond(response)
                return
        self.handle_general(obj, now_ms, respond, forwarded=forwarded, session=session)

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
        # `draining` only once the engine commits at once: nothing more on
        # a quorum cluster's path, one attribute on a lone node's.
        if not self.engine.commits_at_once or self.draining or not isinstance(obj, dict):
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
        produced = self._decide_produce_now(obj, queue, now_ms)
        if produced is None:
            return None
        if isinstance(produced, str):
            return error_response(produced, obj)
        targets = self.engine.commit_now(produced)
        obj["code"] = 0
        obj["msg_id"] = targets[0][1]
        if queue in self.store.virtual_queues:
            obj["msg_ids"] = {name: msg_id for name, msg_id in targets}
        if self.waiting:
            self._written([name for name, _ in targets], now_ms)
        return obj

    def _decide_produce_now(self, obj: JsonObject, queue: str,
                            now_ms: int) -> Produce | str | None:
        """A produce of the usual shape, checked as parse_request would:
        its entry, or the reason the store refuses it, having removed the
        produce's inputs from `obj` (the answer drops them); None, having
        changed nothing, for any other shape."""
        get = obj.get
        data = get("data")
        delay = get("delay")
        ttl = get("ttl")
        retry = get("retry")
        if type(data) is not str or "priority" in obj or "dedup_id" in obj or "messages" in obj:
            return None  # the new fields: the general path
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
        return self.store.decide_produce_values(queue, data, delay, ttl, retry, now_ms)

    def propose_now(self, obj: object, now_ms: int, respond: Respond) -> bool:
        """The fast path's produce on a master whose engine does not commit
        at once (quorum mode): a produce of the usual shape checked and
        decided as `answer_now` does, and proposed; `respond` gets its
        answer once it commits, exactly what the general path would give.
        False, having changed nothing, for every other request (or when
        this node is not such a master), which then takes the general path.

        It saves what answer_now saves but the callback: parse_request, the
        dispatch and the request tuple."""
        engine = self.engine
        if (type(obj) is not dict or engine.commits_at_once or not engine.is_master
                or self.draining):
            return False
        action = obj.get("action")
        if type(action) is not int or action != 1:
            return False
        queue = obj.get("queue")
        if type(queue) is not str or not 0 < len(queue) <= MAX_QUEUE_NAME:
            return False
        produced = self._decide_produce_now(obj, queue, now_ms)
        if produced is None:
            return False
        if isinstance(produced, str):
            self._refuse(obj, produced, respond)
        else:
            self._propose_produce(obj, produced, queue in self.store.virtual_queues, now_ms,
                                  respond)
        return True

    def _consume_now(self, obj: JsonObject, queue: str, now_ms: int) -> JsonObject | None:
        if len(obj) > 2 and (obj.get("count") is not None or obj.get("wait") is not None
                             or obj.get("lease") is not None or obj.get("queues") is not None):
            return None  # the new fields: the general path
        consumed = self.store.decide_consume_values(queue, now_ms, self.engine.epoch)
        if isinstance(consumed, DeadLetter):
            return None  # over max_deliveries: the general path moves it first
        # A client's own msg_id/data must not read back as a delivery.
        pop = obj.pop
        pop("msg_id", None)
        pop("data", None)
        if consumed is None:
            self.consume_empty += 1
            obj["code"] = 0
            return obj
        if isinstance(consumed, str):
            return error_response(consumed, obj)
        obj["code"] = 0
        msg_id, data, deliveries = self.engine.commit_now(consumed)
        obj["msg_id"] = msg_id
        obj["data"] = data
        obj["deliveries"] = deliveries
        retry_at_ms = consumed[2]
        if retry_at_ms:
            obj["receipt"] = f"{consumed[3]}.{msg_id}.{deliveries}"  # receipt_text, inline
            if consumed[4] or self.waiting:
                self._delivered_later(queue, retry_at_ms)
        return obj

    def _confirm_now(self, obj: JsonObject, queue: str) -> JsonObject | None:
        get = obj.get
        msg_id = get("msg_id")
        if type(msg_id) is not int or msg_id < 1:
            return None
        store = self.store
        receipt = get("receipt")
        if receipt is not None:
            # A worker's confirm of its delivery: parsed as parse_request
            # would (anything unusual takes the general path, which words
            # the reason), checked as Service._confirm does.
            if type(receipt) is not str or queue in store.virtual_queues:
                return None
            parsed = parse_receipt(receipt)
            if parsed is None:
                return None
            if not store.check_receipt(queue, msg_id, parsed):
                return error_response("stale receipt", obj)
        confirmed = store.decide_confirm_values(queue, msg_id)
        if confirmed is not None:
            if isinstance(confirmed, str):
                return error_response(confirmed, obj)
            self.engine.commit_now(confirmed)
        # An unknown id decides to None: code 0, not an error (queue_server).
        obj["code"] = 0
        obj["found"] = confirmed is not None
        return obj

    def handle_general(self, obj: object, now_ms: int, respond: Respond, *,
                       forwarded: bool = False, session: Session | None = None) -> None:
        """`handle` without the fast path: for a request `answer_now` left
        alone (it returned None)."""
        if not forwarded and type(obj) is dict and not self.engine.is_master and \
                self._relay_now(obj, respond):
            return
        if self.propose_now(obj, now_ms, respond):
            return
        self.handle_parsed(obj, now_ms, respond, forwarded=forwarded, session=session)

    def handle_parsed(self, obj: object, now_ms: int, respond: Respond, *,
                      forwarded: bool = False, session: Session | None = None) -> None:
        """The general path proper, for what neither fast path took: the
        request parsed and handed to its action's handler."""
        try:
            req = parse_request(obj)
        except BadRequest as exc:
            respond(error_response(exc.reason, obj))
            return
        request = cast(JsonObject, obj)  # parse_request accepts JSON objects only
        if isinstance(req, ConsumeRequest) and req.wait_ms > self.max_wait_ms:
            respond(error_response("wait out of range", request))
            return
        if self.draining and not forwarded and not isinstance(req, _WHILE_DRAINING) and not (
                isinstance(req, (MonitorRequest, ListRequest)) and req.local):
            self._redirect(request, respond, draining=True)
            return
        if not self.engine.is_master and not (
                isinstance(req, (LeaderRequest, AuthRequest, HealthRequest, DrainRequest))
                or (isinstance(req, (MonitorRequest, ListRequest)) and req.local)):
            wait_ms = req.wait_ms if isinstance(req, ConsumeRequest) else 0
            self._not_master(request, respond, forwarded, session, wait_ms)
            return
        if isinstance(req, ProduceRequest):
            self._produce(request, req, now_ms, respond)
        elif isinstance(req, ProduceBatchRequest):
            self._produce_batch(request, req, now_ms, respond)
        elif isinstance(req, ConsumeRequest):
            self._consume(request, req, now_ms, respond, session)
        elif isinstance(req, ConfirmRequest):
            self._confirm(request, req, respond)
        elif isinstance(req, NackRequest):
            self._nack(request, req, now_ms, respond)
        elif isinstance(req, TouchRequest):
            self._touch(request, req, now_ms, respond)
        elif isinstance(req, ShowRequest):
            self._show(request, req, now_ms, respond)
        elif isinstance(req, PeekRequest):
            self._peek(request, req, now_ms, respond)
        elif isinstance(req, ConfigRequest):
            self._config(request, req, now_ms, respond)
        elif isinstance(req, ClearRequest):
            self._clear(request, req, respond)
        elif isinstance(req, MonitorRequest):
            self._read(request, req.local, self._monitor, req, now_ms, respond)
        elif isinstance(req, ListRequest):
            self._read(request, req.local, self._list, req, now_ms, respond)
        elif isinstance(req, LeaderRequest):
            respond(self._leader(request))
        elif isinstance(req, HealthRequest):
            request.update(self.health())
            request["code"] = 0
            respond(request)
        elif isinstance(req, DrainRequest):
            self._drain(request, req, respond)
        elif isinstance(req, TransferLeaderRequest):
            self._transfer_leader(request, req, respond)
        elif isinstance(req, AuthRequest):
            # No <security> here (with it the client protocols answer action
            # 0 themselves): nothing to do, so that a client configured with
            # a token works against an open node too. The token goes.
            request.pop("token", None)
            request["code"] = 0
            respond(request)
        else:  # parse_request returns only the types above
            respond(error_response("invalid action", request))

    def _relay_now(self, obj: JsonObject, respond: Respond) -> bool:
        """A slave's fast relay: a produce, consume or confirm that cannot
        wait on the master goes to it as it came, unparsed (the master
        parses it, and words any error in the same terms); True if it went
        (or was answered "no leader"). False for anything else, which the
        general path parses first: a consume with `wait` (relayed with its
        wait on top of the timeout, and a cancel), a draining node's
        requests (redirected), and every request when forward_request is
        off (redirected). Saves a slave the parse and the dispatch of each
        relayed request, about a sixth of its Python work per request."""
        action = obj.get("action")
        if (type(action) is not int or not 1 <= action <= 3 or self.draining
                or not self.config.forward_request or obj.get("wait") is not None):
            return False
        if not self.engine.forward(obj, respond):
            respond(error_response("no leader", obj))
        return True

    def _not_master(self, obj: JsonObject, respond: Respond, forwarded: bool,
                    session: Session | None, wait_ms: int) -> None:
        """A request for the master reached a slave: relay it, or redirect.
        A consume that may wait on the master is relayed with its wait on
        top of the forward timeout, and cancelled there if its client goes."""
        if forwarded:
            respond(error_response("no leader", obj))
        elif self.config.forward_request:
            if not wait_ms:
                if not self.engine.forward(obj, respond):
                    respond(error_response("no leader", obj))
                return
            key = 0

            def relayed(response: JsonObject) -> None:
                if session is not None:
                    session.discard(key)
                respond(response)

            cancel = self.engine.forward(obj, relayed, FORWARD_TIMEOUT_S + wait_ms / 1000)
            if cancel is None:
                respond(error_response("no leader", obj))
            elif session is not None:
                key = session.add(cancel)
        else:
            self._redirect(obj, respond)

    def _redirect(self, obj: JsonObject, respond: Respond, *, draining: bool = False) -> None:
        """Send the client to the master (code -2), or "no leader" when no
        other node is master (a draining node may be master itself: its
        clients retry elsewhere, and the other nodes forward to it)."""
        leader = self.engine.leader()
        if leader is None or (draining and leader.node_id == self.config.node_id):
            response = error_response("no leader", obj)
            if draining:
                response["draining"] = True
            respond(response)
            return
        obj.pop("data", None)
        # leader_* are ours; master_* are what queue_server's clients read.
        obj.update(code=-2, reason="redirect", leader_node_id=leader.node_id,
                   leader_host=leader.host, leader_port=leader.port,
                   master_host=leader.host, master_port=leader.port)
        if draining:
            obj["draining"] = True
        respond(obj)

    # -- operations --------------------------------------------------------

    def _drain(self, obj: JsonObject, req: DrainRequest, respond: Respond) -> None:
        """Action 108: stop taking new client work (see "Drain" in the
        module docstring), or take it again (`drain` false). A master hands
        its role to its most up-to-date slave first and answers once that
        is done: `leader_node_id` the new master; or code -1 with the reason
        the transfer failed (the node stays master, and draining)."""
        if not req.drain:
            self.draining = False
            obj.update(code=0, draining=False)
            respond(obj)
            return
        self.draining = True
        self.release_parked()  # their clients come back to a node that takes them
        engine = self.engine
        if not engine.is_master or len(self.config.peers) <= 1:
            # A slave, or a lone node (nobody to hand the role to): drained now.
            leader = engine.leader()
            obj.update(code=0, draining=True,
                       leader_node_id=leader.node_id if leader is not None else 0)
            respond(obj)
            return

        def done(leader_id: int | None, reason: str | None) -> None:
            if reason is not None:
                response = error_response(reason, obj)
                response["draining"] = self.draining
                respond(response)
                return
            obj.update(code=0, draining=self.draining, leader_node_id=leader_id)
            respond(obj)

        self._drain_answers.append(done)
        if not self._handing_over:
            self._hand_over_tries = HAND_OVER_TRIES
            self._hand_over()

    def _hand_over(self) -> None:
        """A draining master: hand the role to the most up-to-date slave."""
        target = self.engine.transfer_target()
        if target is None:
            self._handed_over(None, "no slave to take over")
            return
        self._handing_over = True
        self.engine.transfer_leader(target, self._handed_over)

    def _handed_over(self, leader_id: int | None, reason: str | None) -> None:
        """How a drain's hand-over ended: tell the drains that wait for it,
        unless this node was elected again meanwhile (an election raced
        the hand-over) and may try again (from the timer: the engine may be
        in the middle of its turn)."""
        self._handing_over = False
        if (reason is None and leader_id == self.config.node_id and self.draining
                and self._hand_over_tries > 1):
            self._hand_over_tries -= 1
            self._hand_over_due = True
            self._arm(0)  # at once
            return
        answers, self._drain_answers = self._drain_answers, []
        for answer in answers:
            answer(leader_id, reason)

    def _transfer_leader(self, obj: JsonObject, req: TransferLeaderRequest,
                         respond: Respond) -> None:
        """Action 20 on the master: answer `leader_node_id` once the new
        master has taken over, or the engine's reason it did not."""

        def done(leader_id: int | None, reason: str | None) -> None:
            if reason is not None:
                respond(error_response(reason, obj))
                return
            obj.update(code=0, leader_node_id=leader_id)
            respond(obj)

        self.engine.transfer_leader(req.node_id, done)

    # -- writes ------------------------------------------------------------

    def _produce(self, obj: JsonObject, req: ProduceRequest, now_ms: int, respond: Respond) -> None:
        pop = obj.pop
        pop("data", None)
        pop("delay", None)
        pop("ttl", None)
        pop("retry", None)
        outcome = self.store.decide_produce(req, now_ms)
        if isinstance(outcome, str):
            self._refuse(obj, outcome, respond)
            return
        self._propose_produce(obj, outcome, req.queue in self.store.virtual_queues, now_ms,
                              respond)

    def _propose_produce(self, obj: JsonObject, entry: Produce, virtual: bool, now_ms: int,
                         respond: Respond) -> None:
        """Replicate a decided produce; answer `obj` once it commits."""

        def done(targets: Sequence[tuple[str, int]], error: str | None) -> None:
            if error is not None:
                respond(error_response(error, obj))
                return
            obj["code"] = 0
            obj["msg_id"] = targets[0][1]
            if virtual:
                obj["msg_ids"] = {name: msg_id for name, msg_id in targets}
            respond(obj)

        if self.engine.commits_at_once:  # answered at once: no callback on the hot path
            done(self.engine.commit_now(entry), None)
        else:
            self.engine.propose(entry, done)
        if self.waiting:
            self._written([name for name, _ in entry.targets], now_ms)

    def _produce_batch(self, obj: JsonObject, req: ProduceBatchRequest, now_ms: int,
                       respond: Respond) -> None:
        """A produce with `messages`, a `priority` or a `dedup_id`: one
        entry for the items that are not duplicates; an answer of
        duplicates only rests on committed state (read index)."""
        pop = obj.pop
        for name in ("data", "delay", "ttl", "retry", "messages"):
            pop(name, None)
        outcome = self.store.decide_produce_batch(req, now_ms)
        if isinstance(outcome, str):
            self._refuse(obj, outcome, respond)
            return
        entry, plan = outcome
        virtual = req.queue in self.store.virtual_queues

        def fill(response: JsonObject, targets: tuple[tuple[str, int], ...]) -> None:
            ids = []
            duplicates = []
            for index, step in enumerate(plan):
                if type(step) is int:
                    k = step
                elif step[0] == "same":
                    k = step[1]
                    duplicates.append(index)
                else:
                    ids.append(_ref_answer(step[1]))
                    duplicates.append(index)
                    continue
                ids.append({name: first + k for name, first in targets} if virtual
                           else targets[0][1] + k)
            if req.batch:
                response["msg_ids"] = ids
                response["duplicates"] = duplicates
                return
            if virtual:
                response["msg_ids"] = ids[0]
                response["msg_id"] = next(iter(ids[0].values()))
            else:
                response["msg_id"] = ids[0]
            if req.items[0].dedup_id:
                response["duplicate"] = bool(duplicates)

        if entry is None:  # duplicates only: acknowledged once their produce commits
            request = dict(obj)
            obj["code"] = 0
            fill(obj, ())
            self._after_read_index(obj, request, respond)
            return
        self._write(obj, entry, respond, fill)
        if self.waiting:
            self._written([name for name, _ in entry.targets], now_ms)

    def _clear(self, obj: JsonObject, req: ClearRequest, respond: Respond) -> None:
        outcome = self.store.decide_clear(req.queue)
        if outcome is None:  # nothing to remove: rests on committed state
            request = dict(obj)
            obj["code"] = 0
            obj["cleared"] = 0
            self._after_read_index(obj, request, respond)
            return
        self._write(obj, outcome, respond, _cleared)

    def _consume(self, obj: JsonObject, req: ConsumeRequest, now_ms: int, respond: Respond,
                 session: Session | None) -> None:
        # A client's own msg_id/data must not read back as a delivery.
        obj.pop("msg_id", None)
        obj.pop("data", None)
        outcome = self._decide_consume(req, now_ms)
        if outcome is None:
            if req.wait_ms and (session is None or not session.closed):
                self._park(obj, req, now_ms, respond, session)
            else:
                self._answer_empty(obj, req, respond, read_index=True)
        elif isinstance(outcome, str):
            respond(error_response(outcome, obj))
        else:
            self._deliver(obj, req, outcome, respond)

    def _decide_consume(self, req: ConsumeRequest,
                        now_ms: int) -> Consume | ConsumeMany | str | None:
        """The store's decision; a message over its queue's max_deliveries
        (lowered since it was delivered) is moved out first."""
        epoch = self.engine.epoch
        while True:
            outcome = self.store.decide_consume(req, now_ms, epoch)
            if type(outcome) is not DeadLetter:
                return outcome  # type: ignore[return-value]
            error = self._move(outcome, now_ms)
            if error is not None:
                return error

    def _move(self, move: DeadLetter, now_ms: int) -> str | None:
        """Append a dead-letter move that no client waits for. Returns the
        reason if the engine refused it at once (a full disk, no longer
        master): then nothing changed, and deciding again gives the same
        move, so the caller must stop."""
        refused: list[str] = []

        def done(_result: object, error: str | None) -> None:
            if error is not None:
                refused.append(error)

        self.engine.propose(move, done)
        if refused:
            return refused[0]
        if self.waiting and move.targets:
            self._written([name for name, _ in move.targets], now_ms)
        return None

    def _deliver(self, obj: JsonObject, req: ConsumeRequest, entry: Consume | ConsumeMany,
                 respond: Respond) -> None:
        """Replicate a delivery; answer with the message(s) once committed."""
        if type(entry) is Consume:
            many = req.many

            def done(result: Any, error: str | None) -> None:
                if error is not None:
                    respond(error_response(error, obj))
                    return
                msg_id, data, deliveries = result
                obj["code"] = 0
                if many:
                    obj["queue"] = entry.queue
                obj["msg_id"] = msg_id
                obj["data"] = data
                obj["deliveries"] = deliveries
                if entry.retry_at_ms:
                    obj["receipt"] = receipt_text(entry.epoch, msg_id, deliveries)
                respond(obj)

            self.engine.propose(entry, done)
            if entry.retry_at_ms and (entry.final or self.waiting):
                self._delivered_later(entry.queue, entry.retry_at_ms)
            return
        many_entry = cast(ConsumeMany, entry)
        epoch = many_entry.epoch
        retry_at = {(q, i): r for q, i, r, _final in many_entry.items}

        def done_many(result: Any, error: str | None) -> None:
            if error is not None:
                respond(error_response(error, obj))
                return
            messages = []
            for queue, msg_id, data, deliveries in result:
                item: JsonObject = {"queue": queue, "msg_id": msg_id, "data": data,
                                    "deliveries": deliveries}
                if retry_at[queue, msg_id]:
                    item["receipt"] = receipt_text(epoch, msg_id, deliveries)
                messages.append(item)
            obj["code"] = 0
            if req.batch is None:  # several queues, one message: today's form
                obj.update(messages[0])
            else:
                obj["messages"] = messages
            respond(obj)

        self.engine.propose(many_entry, done_many)
        for queue, _msg_id, retry_at_ms, final in many_entry.items:
            if retry_at_ms and (final or self.waiting):
                self._delivered_later(queue, retry_at_ms)

    def _answer_empty(self, obj: JsonObject, req: ConsumeRequest, respond: Respond, *,
                      read_index: bool) -> None:
        """Nothing to deliver: code 0 without a message (`messages: []`
        with `count`), once the state it was read from is committed."""
        request = dict(obj) if read_index else obj  # what an error echoes
        self.consume_empty += 1
        obj["code"] = 0
        if req.batch is not None:
            obj["messages"] = []
        if read_index:
            self._after_read_index(obj, request, respond)
        else:
            respond(obj)

    def _confirm(self, obj: JsonObject, req: ConfirmRequest, respond: Respond) -> None:
        if req.receipt is not None and req.queue not in self.store.virtual_queues \
                and not self.store.check_receipt(req.queue, req.msg_id, req.receipt):
            self._refuse_read(obj, "stale receipt", respond)
            return
        outcome = self.store.decide_confirm(req)
        if outcome is None:  # an unknown id: code 0, not an error (queue_server)
            request = dict(obj)
            obj["code"] = 0
            obj["found"] = False
            self._after_read_index(obj, request, respond)
            return
        self._write(obj, outcome, respond, _found)

    def _nack(self, obj: JsonObject, req: NackRequest, now_ms: int, respond: Respond) -> None:
        delay_s = req.delay_s
        if delay_s < RELATIVE_TIME_LIMIT_S:
            ready_ms = now_ms + round(delay_s * 1000)
        else:
            ready_ms = round(delay_s * 1000)
        outcome = self.store.decide_nack(req.queue, req.msg_id, req.receipt, ready_ms, now_ms)
        if isinstance(outcome, str):
            self._refuse(obj, outcome, respond)
            return
        if type(outcome) is DeadLetter:
            self._write(obj, outcome, respond, self._moved_fill(outcome))
            if self.waiting and outcome.targets:
                self._written([name for name, _ in outcome.targets], now_ms)
            return
        self._write(obj, outcome, respond, _ready_at)
        if self.waiting:
            self._written([req.queue], now_ms)

    def _moved_fill(self, move: DeadLetter) -> Fill:
        target = self.store.queues[move.queue].dead_letter

        def fill(obj: JsonObject, _result: Any) -> None:
            if move.targets:
                obj["dead_lettered"] = True
                obj["dead_letter"] = target
            else:
                obj["deleted"] = True
        return fill

    def _touch(self, obj: JsonObject, req: TouchRequest, now_ms: int, respond: Respond) -> None:
        outcome = self.store.decide_touch(req.queue, req.msg_id, req.receipt, req.lease_ms,
                                          now_ms)
        if isinstance(outcome, str):
            self._refuse(obj, outcome, respond)
            return
        self._write(obj, outcome, respond, _retry_at)
        if outcome.final or self.waiting:
            self._delivered_later(req.queue, outcome.retry_at_ms)

    def _config(self, obj: JsonObject, req: ConfigRequest, now_ms: int,
                respond: Respond) -> None:
        if req.queue in self.store.virtual_queues:
            respond(error_response("virtual queue only takes produce", obj))
            return
        if not req.settings:  # a read
            request = dict(obj)
            obj["code"] = 0
            obj["config"] = self.store.view(req.queue).settings()
            self._after_read_index(obj, request, respond)
            return
        outcome = self.store.decide_configure(req.queue, req.settings)
        if isinstance(outcome, str):
            respond(error_response(outcome, obj))
            return
        self._write(obj, outcome, respond, _configured)
        if self.waiting:  # resumed: its parked consumes may be served now
            self._written([req.queue], now_ms)

    def _refuse(self, obj: JsonObject, reason: str, respond: Respond) -> None:
        """A refusal: one that rests on the state (a receipt that does not
        match, a message not in flight, a full or paused queue) waits for
        the read index."""
        if reason in _READ_ERRORS or reason.startswith(_STATE_REFUSALS):
            self._refuse_read(obj, reason, respond)
        else:
            respond(error_response(reason, obj))

    def _refuse_read(self, obj: JsonObject, reason: str, respond: Respond) -> None:
        request = dict(obj)
        self._after_read_index(error_response(reason, obj), request, respond)

    def _write(self, obj: JsonObject,
               outcome: Confirm | Configure | DeadLetter | Any | str | None,
               respond: Respond, fill: Fill | None) -> None:
        """Answer a decision: None (nothing to change: code 0), a reason
        (code -1), or an entry to replicate; once it commits, `fill(obj,
        result)` adds the result's fields."""
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

    # -- long poll -----------------------------------------------------------

    def _park(self, obj: JsonObject, req: ConsumeRequest, now_ms: int, respond: Respond,
              session: Session | None) -> None:
        """Hold a consume until something is deliverable or its wait ends."""
        self._next_key += 1
        key = self._next_key
        deadline_ms = now_ms + req.wait_ms
        waiter = _Waiter(key, obj, req, respond, deadline_ms, session)
        self._waiters[key] = waiter
        for name in req.queues:
            waiters = self.waiting.get(name)
            if waiters is None:
                waiters = self.waiting[name] = OrderedDict()
            waiters[key] = waiter
        heapq.heappush(self._timeouts, (deadline_ms, key))
        if session is not None:
            waiter.session_key = session.add(lambda: self._drop(key))
        self._arm(deadline_ms)
        for name in req.queues:
            self._arm_queue(name)

    def _unpark(self, waiter: _Waiter) -> None:
        del self._waiters[waiter.key]
        for name in waiter.req.queues:
            waiters = self.waiting.get(name)
            if waiters is not None:
                waiters.pop(waiter.key, None)
                if not waiters:
                    del self.waiting[name]
        if waiter.session is not None:
            waiter.session.discard(waiter.session_key)
        timeouts = self._timeouts
        if len(timeouts) > 2 * len(self._waiters) + 64:
            # Served and dropped waiters leave their deadlines behind; many
            # short long polls would pile them up for `wait` seconds each.
            # Rebuilt from the parked ones when most are stale: amortised O(1).
            self._timeouts = [(w.deadline_ms, w.key) for w in self._waiters.values()]
            heapq.heapify(self._timeouts)

    def _drop(self, key: int) -> None:
        """The client of a parked consume went: forget it, answer nothing."""
        waiter = self._waiters.get(key)
        if waiter is not None:
            self._unpark(waiter)

    def _written(self, names: Iterable[str], now_ms: int) -> None:
        """Entries changed these queues (the master applied them): serve
        their parked consumes if a message is deliverable now, else make
        sure a timer comes when one will be."""
        for name in names:
            if name in self.waiting:
                self._serve(name, now_ms)

    def _serve(self, name: str, now_ms: int) -> None:
        """Serve the parked consumes of queue `name`, oldest first, while it
        has deliverable messages."""
        queue = self.store.get(name)
        if queue is None or not self.engine.is_master:
            return
        while True:
            waiters = self.waiting.get(name)
            if not waiters or queue.next_due(now_ms) is None:
                break
            waiter = next(iter(waiters.values()))
            outcome = self._decide_consume(waiter.req, now_ms)
            if outcome is None:  # what was due was moved out (max_deliveries): wait on
                break
            self._unpark(waiter)
            if isinstance(outcome, str):  # the engine refused the move (a full disk)
                waiter.respond(error_response(outcome, waiter.obj))
            else:
                self._deliver(waiter.obj, waiter.req, outcome, waiter.respond)
        if name in self.waiting:
            self._arm_queue(name)

    def _delivered_later(self, name: str, at_ms: int) -> None:
        """Something of queue `name` comes due at `at_ms` (a lease, a final
        lease): a timer then, if anyone is parked on it or it is final."""
        self._arm(at_ms)

    def _arm_queue(self, name: str) -> None:
        queue = self.store.get(name)
        if queue is not None:
            at_ms = queue.next_ready_ms()
            if at_ms is not None:
                self._arm(at_ms)

    def _arm(self, at_ms: int) -> None:
        if self.schedule is not None:
            self.schedule(at_ms)

    def tick(self, now_ms: int) -> None:
        """The node's timer: answer parked consumes whose wait ended, serve
        those whose queues have something due, move out final deliveries
        whose lease ran out (master only), and arm the next timer; a
        draining master due to hand its role over starts that."""
        if self._hand_over_due:
            self._hand_over_due = False
            if self._handing_over:
                pass  # one is under way already: the drains wait for it
            elif self.draining and self.engine.is_master:
                self._hand_over()
            elif self._drain_answers:  # undrained, or the role went elsewhere meanwhile
                leader = self.engine.leader()
                if leader is None:
                    self._handed_over(None, "no leader")
                else:
                    self._handed_over(leader.node_id, None)
        while self._timeouts and self._timeouts[0][0] <= now_ms:
            _deadline, key = heapq.heappop(self._timeouts)
            waiter = self._waiters.get(key)
            if waiter is not None:
                self._unpark(waiter)  # (may rebuild self._timeouts)
                self._answer_empty(waiter.obj, waiter.req, waiter.respond, read_index=True)
        if self.engine.is_master:
            for name in list(self.waiting):
                self._serve(name, now_ms)
            store = self.store
            final_ms = store.next_final_ms()
            for _ in range(EXPIRE_BATCH):
                moves = store.decide_expired(now_ms, 1)
                if not moves:
                    final_ms = store.next_final_ms()
                    break
                if self._move(moves[0], now_ms) is not None:
                    final_ms = now_ms + EXPIRE_RETRY_MS  # refused: not in a busy loop
                    break
            if final_ms is not None:
                self._arm(final_ms)
        if self._timeouts:
            self._arm(self._timeouts[0][0])

    def role_changed(self, master: bool) -> None:
        """The engine's role changed: a new master moves out final leases
        that ran out while no master was; a master that lost its role
        answers every parked consume at once with the empty answer."""
        if master:
            final_ms = self.store.next_final_ms()
            if final_ms is not None:
                self._arm(final_ms)
            if self.draining and len(self.config.peers) > 1:
                # Elected although draining (an election after its hand-over):
                # hand the role over again, from the timer (the engine is in
                # the middle of its turn now).
                self._hand_over_tries = HAND_OVER_TRIES
                self._hand_over_due = True
                self._arm(0)  # at once
            return
        self.release_parked()

    def release_parked(self) -> None:
        """Answer every parked consume with the empty answer, now (the node
        stops being master, or shuts down)."""
        for waiter in list(self._waiters.values()):
            self._unpark(waiter)
            self._answer_empty(waiter.obj, waiter.req, waiter.respond, read_index=False)
        self._timeouts.clear()

    # -- reads -------------------------------------------------------------

    def _show(self, obj: JsonObject, req: ShowRequest, now_ms: int, respond: Respond) -> None:
        queue = self.store.get(req.queue)
        if queue is None or req.msg_id not in queue.messages:
            self._refuse_read(obj, "no such message", respond)
            return
        request = dict(obj)
        obj["code"] = 0
        obj["message"] = _view(queue, req.msg_id, now_ms)
        self._after_read_index(obj, request, respond)

    def _peek(self, obj: JsonObject, req: PeekRequest, now_ms: int, respond: Respond) -> None:
        queue = self.store.get(req.queue)
        messages: list[JsonObject] = []
        if queue is not None:
            held = queue.messages
            limit = queue.max_deliveries
            for msg_id in queue.due(now_ms):
                msg = held[msg_id]
                if limit and msg[RETRY_MS] and len(msg) > 5 and msg[DELIVERIES] >= limit:
                    continue  # over a lowered max_deliveries: a consume moves it out
                view = _view(queue, msg_id, now_ms)
                view["queue"] = req.queue
                messages.append(view)
                if len(messages) == req.limit:
                    break
        request = dict(obj)
        obj["code"] = 0
        obj["messages"] = messages
        self._after_read_index(obj, request, respond)

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
        if self.engine.commits_at_once:  # the engine waits for nobody (Engine.commits_at_once)
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
            # where clients reach this node (advertise_host, else host)
            "host": self.config.client_host,
            "port": self.config.port,
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

    def health(self) -> JsonObject:
        """Whether clients should be sent to this node (action 109, /readyz):
        `ready` when it knows a master, sees a working cluster (a master
        hears from a majority, a slave from its master, within an election
        timeout: EngineStatus.in_contact), has applied within
        `config.max_ready_lag` entries of what the master has committed,
        and is not draining; `reasons` words each condition that fails.
        Also `role`, `leader_node_id` (0: none), `applied_id`, `commit_id`
        (this node's), `master_commit_id` (the master's, as last heard),
        `node_id`. Cost: O(peers) (the engine's status)."""
        engine = self.engine
        status = engine.status()
        leader = engine.leader()
        reasons: list[str] = []
        if leader is None:
            reasons.append("no master known")
        elif not status.in_contact:
            reasons.append("master cut off from the majority (heard from too few nodes within"
                           " the election timeout)" if status.role is Role.MASTER else
                           f"master {leader.node_id} not heard from within the election timeout")
        committed = status.commit_id
        if status.master_commit_id is not None and status.master_commit_id > committed:
            committed = status.master_commit_id
        behind = committed - status.applied_id
        bound = self.config.max_ready_lag
        if behind > bound:
            reasons.append(f"applied {behind} entries behind the commit (bound {bound})")
        if self.draining:
            reasons.append("draining")
        return {"ready": not reasons, "reasons": reasons, "role": status.role.value,
                "leader_node_id": leader.node_id if leader is not None else 0,
                "node_id": self.config.node_id, "applied_id": status.applied_id,
                "commit_id": status.commit_id, "master_commit_id": committed}

    def _monitor(self, obj: JsonObject, req: MonitorRequest, now_ms: int) -> JsonObject:
        obj.update(self.node_info())
        if req.queue is not None:
            view = self.store.view(req.queue)
            obj["max_size"] = view.max_size
            obj["paused"] = view.paused
            queue = self.store.get(req.queue)
            waiting = len(self.waiting.get(req.queue, ()))
            if queue is None:
                obj.update(size=0, max_id=0, wait_status=0, ready=0, delayed=0, in_flight=0,
                           dead_lettered=0, waiting=waiting, oldest_ready_age=0)
            else:
                ready, delayed, in_flight = queue.counts(now_ms)
                since = queue.oldest_ready_ms(now_ms)
                obj.update(size=len(queue), max_id=queue.max_id,
                           wait_status=queue.wait_status(now_ms), ready=ready,
                           delayed=delayed, in_flight=in_flight,
                           dead_lettered=queue.dead_lettered, waiting=waiting,
                           oldest_ready_age=0 if since is None else (now_ms - since) / 1000)
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
