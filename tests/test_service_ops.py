"""The service's operations actions (issue 17, protocol-v2 "Operations and
security"): health (109), drain (108) and leader transfer (20), called
directly with decoded requests, on a lone node (LocalEngine) and on a fake
cluster engine whose role, master, status and transfers the test sets.

What is checked: health's readiness and the words of each reason; a
draining node's answers (redirects, "no leader", what it still answers
itself, forwarded requests served), the parked consumes it answers, that the
fast path does not bypass draining, the undo; drain of a master through
Engine.transfer_leader; action 20 on a master and on a slave; and every bad
input of the new fields (code -1, a clear reason).

No sockets, no sleeps: `now` is an argument.
"""

from __future__ import annotations

from typing import Any

import pytest

from qserver.config import Config, PeerConfig
from qserver.engines import LeaderInfo, LocalEngine
from qserver.engines.base import FORWARD_TIMEOUT_S, EngineStatus, Role
from qserver.errors import BadRequest
from qserver.service import Service
from qserver.state.log import Log
from qserver.state.store import Store
from qserver.wire.codec import encode_response
from qserver.wire.requests import (
    DrainRequest,
    HealthRequest,
    TransferLeaderRequest,
    parse_request,
)

NOW = 1_700_000_000_000  # unix ms
ME = 2  # this node's id in the fake cluster
PEERS = tuple(PeerConfig(node_id=i, host="127.0.0.1", port=9000 + i) for i in (1, 2, 3))
MASTER = LeaderInfo(node_id=1, host="10.0.0.1", port=1111)


class FakeClusterEngine(LocalEngine):
    """A cluster node as the service sees it: the test sets its role, the
    master it knows, its status, and answers its forwards and transfers.
    Writes commit at once (LocalEngine's store and log) but through
    `propose`, as a cluster master's do."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.commits_at_once = False
        self.is_master = False
        self.known: LeaderInfo | None = MASTER
        self.role = Role.SLAVE
        self.commit_id = 0
        self.applied_id = 0
        self.in_contact = True
        self.master_commit_id: int | None = None
        self.forwarded: list[dict] = []
        self.forward_timeouts: list[float | None] = []  # each forward's timeout_s
        self.link_up = True  # False: forward finds no link to the master
        self.transfers: list[tuple[int, Any]] = []  # (node_id, done), in call order
        self.target: int | None = 3

    def become_master(self) -> None:
        self.is_master = True
        self.role = Role.MASTER
        self.known = self.me

    def leader(self) -> LeaderInfo | None:
        return self.known

    def status(self) -> EngineStatus:
        return EngineStatus(role=self.role, vote_id=4, trans_id=self.commit_id,
                            commit_id=self.commit_id, applied_id=self.applied_id, log_size=0,
                            in_contact=self.in_contact, master_commit_id=self.master_commit_id)

    def forward(self, request, respond, timeout_s=None):
        if not self.link_up:
            return None
        self.forwarded.append(dict(request))
        self.forward_timeouts.append(timeout_s)
        return lambda: None

    def transfer_leader(self, node_id, done) -> None:
        self.transfers.append((node_id, done))

    def transfer_target(self) -> int | None:
        return self.target if self.is_master else None


class Node:
    """A service wired as node.Node wires it, minus the sockets."""

    def __init__(self, *, cluster: bool = True, **overrides: Any) -> None:
        overrides.setdefault("node_id", ME if cluster else 3)
        overrides.setdefault("host", "127.0.0.9")
        overrides.setdefault("port", 4567)
        if cluster:
            overrides.setdefault("peers", PEERS)
        self.config = cfg = Config(**overrides)
        self.store = Store(queue_size=cfg.queue_size, virtual_queues=cfg.virtual_queues)
        me = LeaderInfo(node_id=cfg.node_id, host=cfg.host, port=cfg.port)
        engine_type = FakeClusterEngine if cluster else LocalEngine
        self.engine = engine_type(store=self.store, log=Log(), me=me, log_size=cfg.log_size)
        self.service = Service(config=cfg, store=self.store, engine=self.engine)
        self.service.schedule = lambda at_ms: None

    @property
    def fake(self) -> FakeClusterEngine:
        assert isinstance(self.engine, FakeClusterEngine)
        return self.engine

    def send(self, obj: object, *, forwarded: bool = False) -> list[dict]:
        """Every answer the request gets now (none while it waits)."""
        out: list[dict] = []
        self.service.handle(obj, NOW, out.append, forwarded=forwarded)
        self.store._check()
        for resp in out:
            encode_response(resp)
        return out

    def __call__(self, obj: object, *, forwarded: bool = False) -> dict:
        out = self.send(obj, forwarded=forwarded)
        assert len(out) == 1, out
        return out[0]


def ok(resp: dict) -> dict:
    assert resp["code"] == 0 and "reason" not in resp, resp
    return resp


def error(resp: dict, reason: str) -> dict:
    assert resp["code"] == -1 and resp["reason"] == reason, resp
    return resp


def redirected(resp: dict) -> dict:
    assert resp["code"] == -2 and resp["reason"] == "redirect", resp
    assert (resp["leader_node_id"], resp["leader_host"], resp["leader_port"]) == (1, "10.0.0.1",
                                                                                  1111)
    assert (resp["master_host"], resp["master_port"]) == ("10.0.0.1", 1111)
    assert resp["draining"] is True
    return resp


# -- health -----------------------------------------------------------------------------


def test_a_lone_node_is_ready():
    node = Node(cluster=False)
    ok(node({"action": 1, "queue": "q", "data": "x"}))
    assert node.service.health() == {
        "ready": True, "reasons": [], "role": "master", "leader_node_id": 3, "node_id": 3,
        "applied_id": 1, "commit_id": 1, "master_commit_id": 1}


def test_health_on_a_slave_in_step_is_ready():
    node = Node()
    node.fake.commit_id = node.fake.applied_id = 50
    health = node.service.health()
    assert health["ready"] is True and health["reasons"] == []
    assert (health["role"], health["leader_node_id"], health["node_id"]) == ("slave", 1, ME)


def test_no_master_known():
    node = Node()
    node.fake.known = None
    health = node.service.health()
    assert health["ready"] is False
    assert health["reasons"] == ["no master known"]
    assert health["leader_node_id"] == 0


def test_a_slave_that_does_not_hear_its_master_is_not_ready():
    # Its link to a stopped master stays up: the engine still names the master.
    node = Node()
    node.fake.in_contact = False
    assert node.service.health()["reasons"] == [
        "master 1 not heard from within the election timeout"]


def test_a_master_cut_off_from_the_majority_is_not_ready():
    node = Node()
    node.fake.become_master()
    node.fake.in_contact = False
    health = node.service.health()
    assert health["ready"] is False and health["role"] == "master"
    assert health["reasons"] == [("master cut off from the majority (heard from too few "
                                  "nodes within the election timeout)")]


@pytest.mark.parametrize("commit, master_commit, applied, behind", [
    (220, None, 100, 120),  # applied behind its own commit
    (100, 220, 100, 120),  # its log ends before the master's commit
    (100, 90, 100, 0),  # a stale master_commit_id never counts below commit_id
    (200, 200, 100, 100),  # exactly the bound: ready
])
def test_lag_against_the_bound(commit, master_commit, applied, behind):
    node = Node(max_ready_lag=100)
    node.fake.commit_id, node.fake.master_commit_id = commit, master_commit
    node.fake.applied_id = applied
    health = node.service.health()
    if behind > 100:
        assert health["reasons"] == [f"applied {behind} entries behind the commit (bound 100)"]
        assert health["ready"] is False
    else:
        assert health["ready"] is True, health
    assert (health["applied_id"], health["commit_id"]) == (applied, commit)
    assert health["master_commit_id"] == max(commit, master_commit or 0)


def test_every_failing_condition_is_named_in_order():
    node = Node(max_ready_lag=0)
    node.fake.known = None
    node.fake.commit_id, node.fake.applied_id = 5, 3
    node.service.draining = True
    assert node.service.health()["reasons"] == [
        "no master known", "applied 2 entries behind the commit (bound 0)", "draining"]


def test_action_109_is_answered_by_the_node_itself():
    node = Node()
    node.fake.known = None
    resp = ok(node({"action": 109, "seq": 7, "queue": "ignored"}))
    assert resp["seq"] == 7 and resp["action"] == 109
    assert resp["ready"] is False and resp["reasons"] == ["no master known"]
    assert resp["role"] == "slave" and node.fake.forwarded == []


# -- drain ------------------------------------------------------------------------------


def test_drain_of_a_slave_redirects_client_work_to_the_master():
    node = Node()  # forward_request=1 (the default): it would forward otherwise
    assert ok(node({"action": 108, "seq": 1})) == {
        "action": 108, "seq": 1, "code": 0, "draining": True, "leader_node_id": 1}
    assert node.service.draining
    for req in ({"action": 1, "queue": "q", "data": "x"}, {"action": 2, "queue": "q"},
                {"action": 2, "queue": "q", "wait": 5}, {"action": 3, "queue": "q", "msg_id": 1},
                {"action": 4, "queue": "q"}, {"action": 7}, {"action": 5, "queue": "q"},
                {"action": 11, "queue": "q", "msg_id": 1}):
        resp = redirected(node(dict(req, seq=9)))
        assert resp["seq"] == 9 and "data" not in resp
    assert node.fake.forwarded == []
    health = ok(node({"action": 109}))
    assert health["ready"] is False and health["reasons"] == ["draining"]


def test_a_draining_node_still_answers_what_an_operator_needs():
    node = Node()
    ok(node({"action": 108}))
    ok(node({"action": 104}))  # its own state
    ok(node({"action": 107}))
    assert ok(node({"action": 8}))["leader_node_id"] == 1
    ok(node({"action": 109}))
    ok(node({"action": 0}))
    assert node.send({"action": 20, "node_id": 3}) == []  # sent on to the master
    assert node.fake.forwarded == [{"action": 20, "node_id": 3}]


RELAYED_AS_THEY_CAME = [
    {"action": 1, "queue": "q", "data": "x", "seq": 1},
    {"action": 2, "queue": "q", "seq": 2},
    {"action": 3, "queue": "q", "msg_id": 7, "seq": 3},
    {"action": 1, "queue": "q", "messages": [{"data": "a"}, {"data": "b"}]},
    {"action": 2, "queue": "q", "count": 3, "lease": 5},
    {"action": 2, "queue": "q", "wait": None},  # no wait after all
    # Bad ones too: the master parses them and words the error as we would.
    {"action": 1, "queue": "q"},
    {"action": 3, "queue": "", "msg_id": "x"},
]


def test_a_slave_relays_produce_consume_and_confirm_as_they_came():
    node = Node()
    for request in RELAYED_AS_THEY_CAME:
        assert node.send(dict(request)) == []  # the master's answer comes later
    assert node.fake.forwarded == RELAYED_AS_THEY_CAME
    assert node.fake.forward_timeouts == [None] * len(RELAYED_AS_THEY_CAME)  # the default


def test_a_slave_parses_what_it_does_not_relay_as_it_came():
    node = Node()
    # A consume that may wait goes with its wait on top of the timeout.
    assert node.send({"action": 2, "queue": "q", "wait": 2}) == []
    assert node.fake.forward_timeouts == [FORWARD_TIMEOUT_S + 2]
    error(node({"action": 2, "queue": "q", "wait": "soon"}), "wait must be a number of seconds")
    # Another node's forward is not relayed again; nor is anything without
    # a link to the master.
    error(node({"action": 1, "queue": "q", "data": "x"}, forwarded=True), "no leader")
    node.fake.link_up = False
    assert error(node({"action": 1, "queue": "q", "data": "x", "seq": 4}), "no leader")["seq"] == 4
    assert len(node.fake.forwarded) == 1
    # Without forward_request, a redirect; while draining, a redirect that says so.
    off = Node(forward_request=False)
    resp = off({"action": 3, "queue": "q", "msg_id": 1})
    assert (resp["code"], resp["leader_node_id"]) == (-2, 1) and "draining" not in resp
    node.fake.link_up = True
    ok(node({"action": 108}))
    redirected(node({"action": 1, "queue": "q", "data": "x"}))
    assert len(node.fake.forwarded) == 1


def test_undo_takes_client_work_again():
    node = Node()
    ok(node({"action": 108}))
    assert ok(node({"action": 108, "drain": False})) == {
        "action": 108, "drain": False, "code": 0, "draining": False}
    assert not node.service.draining
    assert node.send({"action": 1, "queue": "q", "data": "x"}) == []  # forwarded again
    assert node.fake.forwarded == [{"action": 1, "queue": "q", "data": "x"}]
    assert node.service.health()["ready"] is True
    ok(node({"action": 108, "drain": False}))  # an undo of nothing: no change
    assert not node.service.draining


def test_a_draining_node_without_a_master_answers_no_leader():
    node = Node()
    ok(node({"action": 108}))
    node.fake.known = None
    resp = error(node({"action": 1, "queue": "q", "data": "x"}), "no leader")
    assert resp["draining"] is True


def test_drain_of_a_master_hands_its_role_over_first():
    node = Node()
    node.fake.become_master()
    node.fake.target = 3
    assert node.send({"action": 108, "seq": 4}) == []  # not until the transfer ends
    assert node.service.draining  # at once: no new client work meanwhile
    (target, done), = node.fake.transfers
    assert target == 3
    out = node.send({"action": 1, "queue": "q", "data": "x"})
    assert len(out) == 1 and error(out[0], "no leader")["draining"] is True
    answers: list[dict] = []
    node.service.handle({"action": 108, "seq": 5}, NOW, answers.append)
    assert len(node.fake.transfers) == 1  # joins the hand-over under way
    node.fake.is_master, node.fake.role, node.fake.known = False, Role.SLAVE, LeaderInfo(
        node_id=3, host="10.0.0.3", port=1113)
    done(3, None)
    assert answers == [{"action": 108, "seq": 5, "code": 0, "draining": True,
                        "leader_node_id": 3}]
    resp = node({"action": 2, "queue": "q"})
    assert resp["code"] == -2 and resp["leader_node_id"] == 3


def test_drain_answers_once_the_transfer_is_done():
    node = Node()
    node.fake.become_master()
    answers: list[dict] = []
    node.service.handle({"action": 108, "seq": 4}, NOW, answers.append)
    assert answers == []
    node.fake.transfers[0][1](3, None)
    assert answers == [{"action": 108, "seq": 4, "code": 0, "draining": True,
                        "leader_node_id": 3}]


@pytest.mark.parametrize("reason", ["node not caught up", "transfer timed out",
                                    "transfer in progress", "not master"])
def test_a_failed_transfer_is_answered_with_its_reason_and_the_node_stays_draining(reason):
    node = Node()
    node.fake.become_master()
    answers: list[dict] = []
    node.service.handle({"action": 108}, NOW, answers.append)
    node.fake.transfers[0][1](None, reason)
    assert answers == [{"action": 108, "code": -1, "reason": reason, "draining": True}]
    assert node.service.draining and node.service.health()["reasons"] == ["draining"]
    # Still master: its own clients go elsewhere, and what slaves forward is served.
    error(node({"action": 1, "queue": "q", "data": "x"}), "no leader")
    assert ok(node({"action": 1, "queue": "q", "data": "x"}, forwarded=True))["msg_id"] == 1
    assert ok(node({"action": 2, "queue": "q"}, forwarded=True))["msg_id"] == 1


def test_a_draining_node_elected_again_hands_its_role_over_again():
    node = Node()
    node.fake.become_master()
    armed: list[int] = []
    node.service.schedule = armed.append
    answers: list[dict] = []
    node.service.handle({"action": 108}, NOW, answers.append)
    # The election raced the hand-over: the engine names this node.
    node.fake.transfers[0][1](ME, None)
    assert answers == [] and armed == [0]  # again, from the timer
    node.service.tick(NOW)
    assert len(node.fake.transfers) == 2
    node.fake.transfers[1][1](ME, None)
    node.service.tick(NOW)
    node.fake.transfers[2][1](ME, None)  # the last try: answered with what happened
    assert answers == [{"action": 108, "code": 0, "draining": True, "leader_node_id": ME}]
    node.service.tick(NOW)
    assert len(node.fake.transfers) == 3
    # Later elected again, by an election of its own: it hands over again.
    armed.clear()
    node.service.role_changed(True)
    assert armed == [0] and len(node.fake.transfers) == 3
    node.service.tick(NOW)
    assert node.fake.transfers[3][0] == 3
    node.fake.transfers[3][1](3, None)  # nobody waits for this one's answer
    assert len(answers) == 1


@pytest.mark.parametrize("meanwhile", ["deposed", "undrained", "no master"])
def test_a_drain_waiting_for_another_try_is_answered_when_there_is_none(meanwhile):
    node = Node()
    node.fake.become_master()
    answers: list[dict] = []
    node.service.handle({"action": 108}, NOW, answers.append)
    node.fake.transfers[0][1](ME, None)  # elected again: another try is due
    if meanwhile == "undrained":
        ok(node({"action": 108, "drain": False}))
    else:
        node.fake.is_master, node.fake.role = False, Role.SLAVE
        node.fake.known = MASTER if meanwhile == "deposed" else None
    node.service.tick(NOW)
    assert len(node.fake.transfers) == 1
    expected = {"deposed": (0, 1), "undrained": (0, ME), "no master": (-1, None)}[meanwhile]
    (answer,) = answers
    assert answer["code"] == expected[0]
    if expected[1] is None:
        assert answer["reason"] == "no leader"
    else:
        assert answer["leader_node_id"] == expected[1]


def test_no_second_hand_over_once_undrained_or_not_master():
    node = Node()
    node.fake.become_master()
    node.service.draining = True
    node.service.role_changed(True)
    node.service.draining = False
    node.service.tick(NOW)
    assert node.fake.transfers == []
    node.service.draining = True
    node.service.role_changed(True)
    node.fake.is_master = False
    node.service.tick(NOW)
    assert node.fake.transfers == []


def test_drain_of_a_master_without_a_slave_to_take_over():
    node = Node()
    node.fake.become_master()
    node.fake.target = None
    resp = error(node({"action": 108}), "no slave to take over")
    assert resp["draining"] is True and node.service.draining
    assert node.fake.transfers == []


def test_undo_while_the_transfer_is_under_way():
    node = Node()
    node.fake.become_master()
    answers: list[dict] = []
    node.service.handle({"action": 108, "seq": 1}, NOW, answers.append)
    ok(node({"action": 108, "drain": False}))
    node.fake.transfers[0][1](3, None)  # the role moved anyway
    assert answers == [{"action": 108, "seq": 1, "code": 0, "draining": False,
                        "leader_node_id": 3}]


def test_drain_answers_parked_consumes_at_once():
    node = Node(cluster=False)
    parked: list[dict] = []
    for seq in (1, 2):
        node.service.handle({"action": 2, "queue": "q", "wait": 10, "seq": seq}, NOW,
                            parked.append)
    node.service.handle({"action": 2, "queues": ["a", "b"], "wait": 10, "count": 3, "seq": 3},
                        NOW, parked.append)
    assert parked == [] and node.service.parked == 3
    resp = ok(node({"action": 108}))
    assert resp["draining"] is True and resp["leader_node_id"] == 3  # alone: nobody to hand to
    assert node.service.parked == 0 and not node.service.waiting
    assert [r["seq"] for r in parked] == [1, 2, 3]
    assert all(r["code"] == 0 and "msg_id" not in r for r in parked[:2])
    assert parked[2]["messages"] == []


def test_drain_of_a_master_answers_its_parked_consumes_before_the_transfer():
    node = Node()
    node.fake.become_master()
    parked: list[dict] = []
    node.service.handle({"action": 2, "queue": "q", "wait": 10}, NOW, parked.append,
                        forwarded=True)
    assert parked == [] and node.service.parked == 1
    assert node.send({"action": 108}) == []
    assert len(parked) == 1 and parked[0]["code"] == 0 and "msg_id" not in parked[0]


def test_the_fast_path_does_not_bypass_draining():
    node = Node(cluster=False)
    service = node.service
    produce = {"action": 1, "queue": "q", "data": "x", "delay": 0, "ttl": 0, "retry": 0}
    assert service.answer_now(dict(produce), NOW) is not None
    ok(node({"action": 108}))
    for req in (produce, {"action": 2, "queue": "q"}, {"action": 3, "queue": "q", "msg_id": 1}):
        assert service.answer_now(dict(req), NOW) is None  # changed nothing
        resp = error(node(dict(req)), "no leader")  # alone, it is master itself
        assert resp["draining"] is True
    assert len(node.store.get("q")) == 1
    # A request another node forwarded is served (the fast path's own entry).
    assert ok(node(dict(produce), forwarded=True))["msg_id"] == 2
    ok(node({"action": 108, "drain": False}))
    assert service.answer_now({"action": 2, "queue": "q"}, NOW)["msg_id"] == 1


# -- transfer leader (20) ---------------------------------------------------------------


def test_transfer_leader_on_the_master_answers_once_done():
    node = Node()
    node.fake.become_master()
    answers: list[dict] = []
    node.service.handle({"action": 20, "node_id": 3, "seq": 8}, NOW, answers.append)
    (target, done), = node.fake.transfers
    assert target == 3 and answers == []
    done(3, None)
    assert answers == [{"action": 20, "node_id": 3, "seq": 8, "code": 0, "leader_node_id": 3}]


@pytest.mark.parametrize("reason", ["no such node", "node not caught up", "not master",
                                    "transfer timed out"])
def test_transfer_leader_refused(reason):
    node = Node()
    node.fake.become_master()
    answers: list[dict] = []
    node.service.handle({"action": 20, "node_id": 9}, NOW, answers.append)
    node.fake.transfers[0][1](None, reason)
    assert answers == [{"action": 20, "node_id": 9, "code": -1, "reason": reason}]


def test_transfer_leader_to_itself_on_a_lone_node():
    node = Node(cluster=False)
    assert ok(node({"action": 20, "node_id": 3}))["leader_node_id"] == 3
    error(node({"action": 20, "node_id": 4}), "no such node")


def test_transfer_leader_on_a_slave_is_forwarded_to_the_master():
    node = Node()
    assert node.send({"action": 20, "node_id": 2}) == []
    assert node.fake.forwarded == [{"action": 20, "node_id": 2}] and node.fake.transfers == []


def test_transfer_leader_on_a_slave_with_forwarding_off_redirects():
    node = Node(forward_request=False)
    resp = node({"action": 20, "node_id": 2})
    assert resp["code"] == -2 and resp["leader_node_id"] == 1 and "draining" not in resp


# -- requests -------------------------------------------------------------------------


def test_parse_the_new_actions():
    assert parse_request({"action": 109}) == HealthRequest()
    assert parse_request({"action": 108}) == DrainRequest(True)
    assert parse_request({"action": 108, "drain": None}) == DrainRequest(True)
    assert parse_request({"action": 108, "drain": True}) == DrainRequest(True)
    assert parse_request({"action": 108, "drain": False}) == DrainRequest(False)
    assert parse_request({"action": 20, "node_id": 3}) == TransferLeaderRequest(3)
    assert parse_request({"action": 20, "node_id": 2**31 - 1}) == TransferLeaderRequest(2**31 - 1)


NODE_ID_REASON = "node_id must be a positive integer (a node id of the cluster)"
DRAIN_REASON = "drain must be true (drain) or false (undo a drain)"


@pytest.mark.parametrize("req, reason", [
    ({"action": 20}, "missing field: node_id"),
    ({"action": 20, "node_id": None}, "missing field: node_id"),
    ({"action": 20, "node_id": 0}, NODE_ID_REASON),
    ({"action": 20, "node_id": -1}, NODE_ID_REASON),
    ({"action": 20, "node_id": "2"}, NODE_ID_REASON),
    ({"action": 20, "node_id": 2.0}, NODE_ID_REASON),
    ({"action": 20, "node_id": True}, NODE_ID_REASON),
    ({"action": 20, "node_id": [2]}, NODE_ID_REASON),
    ({"action": 20, "node_id": 2**31}, NODE_ID_REASON),
    ({"action": 108, "drain": 1}, DRAIN_REASON),
    ({"action": 108, "drain": 0}, DRAIN_REASON),
    ({"action": 108, "drain": "false"}, DRAIN_REASON),
    ({"action": 108, "drain": []}, DRAIN_REASON),
])
def test_bad_input_is_refused_with_its_reason(req, reason):
    with pytest.raises(BadRequest) as info:
        parse_request(req)
    assert info.value.reason == reason
    for node in (Node(), Node(cluster=False)):
        resp = error(node(dict(req, seq=3)), reason)
        assert resp["seq"] == 3
        assert not node.service.draining
        if isinstance(node.engine, FakeClusterEngine):
            assert node.engine.forwarded == [] and node.engine.transfers == []


def test_a_bad_request_on_a_draining_node_gets_its_reason():
    # Validation comes first: a client learns what is wrong with its request.
    node = Node()
    ok(node({"action": 108}))
    error(node({"action": 1, "queue": "q"}), "missing field: data")
