"""The request service on a single node (Store + LocalEngine), called
directly with decoded requests and a fixed clock."""

from __future__ import annotations

import pytest

from qserver.config import Config
from qserver.engines import LeaderInfo, LocalEngine
from qserver.service import Service
from qserver.state.log import Log
from qserver.state.store import Store
from qserver.wire.codec import StreamDecoder, encode_response

NOW_MS = 1_700_000_000_000  # a fixed unix time in ms
NOW_S = NOW_MS // 1000

NODE_FIELDS = ("leader_node_id", "node_id", "trans_id")
QUEUE_FIELDS = ("size", "max_id", "wait_status")


class Harness:
    """A node's service wired as node.Node wires it, minus the sockets."""

    def __init__(self, **overrides) -> None:
        overrides.setdefault("node_id", 3)
        overrides.setdefault("host", "127.0.0.9")
        overrides.setdefault("port", 4567)
        self.config = cfg = Config(**overrides)
        self.store = Store(queue_size=cfg.queue_size, virtual_queues=cfg.virtual_queues)
        self.log = Log()
        me = LeaderInfo(node_id=cfg.node_id, host=cfg.host, port=cfg.port)
        self.engine = LocalEngine(store=self.store, log=self.log, me=me, log_size=cfg.log_size)
        self.service = Service(config=cfg, store=self.store, engine=self.engine)

    def __call__(self, obj: object, now_ms: int = NOW_MS) -> dict:
        """One request in, exactly one response out (at once: single node)."""
        responses: list[dict] = []
        self.service.handle(obj, now_ms, responses.append)
        assert len(responses) == 1, responses
        self.store._check()
        resp = responses[0]
        assert resp["code"] in (0, -1, -2)
        encode_response(resp)  # every response is encodable
        return resp

    def produce(self, queue: str, data: str = "x", now_ms: int = NOW_MS, **fields) -> dict:
        resp = self({"action": 1, "queue": queue, "data": data, **fields}, now_ms)
        assert resp["code"] == 0, resp
        return resp


@pytest.fixture
def node() -> Harness:
    return Harness()


def ok(resp: dict) -> dict:
    assert resp["code"] == 0, resp
    assert "reason" not in resp
    return resp


def error(resp: dict, reason: str) -> dict:
    assert resp["code"] == -1, resp
    assert resp["reason"] == reason
    return resp


# -- produce -----------------------------------------------------------------

def test_produce_echoes_request_and_drops_inputs(node):
    req = {"action": 1, "queue": "q", "data": "payload", "delay": 0, "ttl": NOW_S + 60,
           "retry": 5, "seq": 17, "client_tag": "abc"}
    resp = node(req)
    assert resp == {"action": 1, "queue": "q", "seq": 17, "client_tag": "abc", "code": 0,
                    "msg_id": 1}


def test_produce_ids_count_up_per_queue(node):
    assert [node.produce("a")["msg_id"] for _ in range(3)] == [1, 2, 3]
    assert node.produce("b")["msg_id"] == 1
    assert node.produce("a")["msg_id"] == 4


@pytest.mark.parametrize("seq", [0, 1, "s-1", 2**40, None, [1, "x"], {"k": "v"}])
def test_seq_comes_back_unchanged(node, seq):
    for req in ({"action": 1, "queue": "q", "data": "x"}, {"action": 2, "queue": "q"},
                {"action": 3, "queue": "q", "msg_id": 99}, {"action": 4, "queue": "q"},
                {"action": 7}, {"action": 8}, {"action": 5}, {"action": 2},
                {"action": 1000}, {"action": 104}, {"action": 107}):
        resp = node(dict(req, seq=seq))
        assert resp["seq"] == seq, (req, resp)


def test_produce_into_full_queue():
    node = Harness(queue_size=2)
    node.produce("q")
    node.produce("q")
    resp = node({"action": 1, "queue": "q", "data": "third", "seq": 3, "retry": 1})
    assert resp == {"action": 1, "queue": "q", "seq": 3, "code": -1, "reason": "queue full: q"}
    assert len(node.store.get("q")) == 2
    node.produce("other")  # other queues are not affected
    ok(node({"action": 2, "queue": "q"}))  # making room lets the next produce in
    assert node.produce("q")["msg_id"] == 3


@pytest.mark.parametrize("times", [
    {"delay": 100, "ttl": 50},  # relative seconds
    {"delay": NOW_S + 100, "ttl": NOW_S + 50},  # absolute seconds
    {"ttl": NOW_S - 1},  # no delay means now
])
def test_time_error(node, times):
    resp = node({"action": 1, "queue": "q", "data": "x", "seq": 1, **times})
    assert resp == {"action": 1, "queue": "q", "seq": 1, "code": -1, "reason": "time error"}
    assert node.store.get("q") is None


def test_default_ttl_follows_delay(node):
    # no ttl means delay + 3600 s, however far away the delay is
    ok(node({"action": 1, "queue": "q", "data": "x", "delay": NOW_S + 7200}))


def test_ttl_equal_to_delay_is_accepted(node):
    ok(node({"action": 1, "queue": "q", "data": "x", "delay": NOW_S + 10, "ttl": NOW_S + 10}))


def test_delay_in_the_past_means_now(node):
    node.produce("q", "old", delay=NOW_S - 3600)
    resp = ok(node({"action": 2, "queue": "q"}))
    assert resp["data"] == "old"


@pytest.mark.parametrize("delay", [30, NOW_S + 30])  # relative and absolute
def test_delay(node, delay):
    node.produce("q", "later", delay=delay)
    assert "msg_id" not in ok(node({"action": 2, "queue": "q"}, NOW_MS + 29_999))
    resp = ok(node({"action": 2, "queue": "q"}, NOW_MS + 30_000))
    assert (resp["msg_id"], resp["data"]) == (1, "later")


# -- virtual queues ----------------------------------------------------------

def test_virtual_queue_produce_names_every_message():
    node = Harness(virtual_queues={"v": ("a", "b", "c")})
    node.produce("a")
    node.produce("a")
    node.produce("c")
    resp = node({"action": 1, "queue": "v", "data": "fan", "seq": 8, "retry": 3})
    assert resp == {"action": 1, "queue": "v", "seq": 8, "code": 0,
                    "msg_id": 3, "msg_ids": {"a": 3, "b": 1, "c": 2}}
    for name, msg_id in resp["msg_ids"].items():
        queue = node.store.get(name)
        assert queue.messages[msg_id][0] == "fan"  # (data, ready_ms, ttl_ms, retry_ms, retry_at_ms)
    assert node.store.get("v") is None  # the virtual name is not a real queue


def test_virtual_queue_is_all_or_nothing_when_a_member_is_full():
    node = Harness(queue_size=1, virtual_queues={"v": ("a", "b")})
    node.produce("b")
    error(node({"action": 1, "queue": "v", "data": "x"}), "queue full: b")
    assert node.store.get("a") is None
    assert len(node.store.get("b")) == 1


@pytest.mark.parametrize("req", [{"action": 2, "queue": "v"},
                                 {"action": 3, "queue": "v", "msg_id": 1}])
def test_virtual_queue_only_takes_produce(req):
    node = Harness(virtual_queues={"v": ("a", "b")})
    node.produce("v")
    resp = error(node(dict(req, seq=1)), "virtual queue only takes produce")
    assert resp["seq"] == 1


def test_plain_produce_has_no_msg_ids():
    node = Harness(virtual_queues={"v": ("a", "b")})
    assert "msg_ids" not in node.produce("a")


# -- consume and confirm -----------------------------------------------------

def test_consume_delivers_in_order_then_empty(node):
    node.produce("q", "one")
    node.produce("q", "two")
    r1 = ok(node({"action": 2, "queue": "q", "seq": "c1"}))
    # At-most-once: deleted as delivered, so no receipt; its first delivery.
    assert r1 == {"action": 2, "queue": "q", "seq": "c1", "code": 0, "msg_id": 1, "data": "one",
                  "deliveries": 1}
    r2 = ok(node({"action": 2, "queue": "q"}))
    assert (r2["msg_id"], r2["data"]) == (2, "two")
    empty = node({"action": 2, "queue": "q", "seq": 5})
    assert empty == {"action": 2, "queue": "q", "seq": 5, "code": 0}


def test_consume_unknown_queue_is_empty_and_creates_nothing(node):
    assert node({"action": 2, "queue": "nope"}) == {"action": 2, "queue": "nope", "code": 0}
    assert node.store.get("nope") is None


def test_at_most_once_is_deleted_by_consume(node):
    node.produce("q", retry=0)
    ok(node({"action": 2, "queue": "q"}))
    assert len(node.store.get("q")) == 0
    assert "msg_id" not in node({"action": 2, "queue": "q"}, NOW_MS + 10**9)


def test_retry_redelivers_until_confirmed(node):
    node.produce("q", "job", retry=10)
    first = ok(node({"action": 2, "queue": "q"}))
    assert first == {"action": 2, "queue": "q", "code": 0, "msg_id": 1, "data": "job",
                     "deliveries": 1, "receipt": "1.1.1"}
    assert "msg_id" not in node({"action": 2, "queue": "q"}, NOW_MS + 9_999)
    again = ok(node({"action": 2, "queue": "q"}, NOW_MS + 10_000))
    assert again == {"action": 2, "queue": "q", "code": 0, "msg_id": 1, "data": "job",
                     "deliveries": 2, "receipt": "1.1.2"}
    conf = node({"action": 3, "queue": "q", "msg_id": 1, "seq": 4})
    assert conf == {"action": 3, "queue": "q", "msg_id": 1, "seq": 4, "code": 0, "found": True}
    assert "msg_id" not in node({"action": 2, "queue": "q"}, NOW_MS + 60_000)
    assert len(node.store.get("q")) == 0


def test_confirm_accepts_string_msg_id(node):
    node.produce("q", retry=10)
    ok(node({"action": 2, "queue": "q"}))
    ok(node({"action": 3, "queue": "q", "msg_id": "1"}))
    assert len(node.store.get("q")) == 0


@pytest.mark.parametrize("req", [
    {"action": 3, "queue": "q", "msg_id": 12345},  # unknown id in a known queue
    {"action": 3, "queue": "nope", "msg_id": 1},  # unknown queue
])
def test_confirm_unknown_is_ok(node, req):
    node.produce("q")
    before = node.log.last_trans_id
    resp = node(dict(req, seq=2))
    assert resp == dict(req, seq=2, code=0, found=False)
    assert node.log.last_trans_id == before  # nothing logged
    assert node.store.get("nope") is None


def test_confirm_twice(node):
    node.produce("q", retry=10)
    ok(node({"action": 2, "queue": "q"}))
    assert ok(node({"action": 3, "queue": "q", "msg_id": 1}))["found"] is True
    assert ok(node({"action": 3, "queue": "q", "msg_id": 1}))["found"] is False


# -- monitor, list, leader ---------------------------------------------------

@pytest.mark.parametrize("action", [4, 104])
def test_monitor_queue(node, action):
    node.produce("q", "a")
    node.produce("q", "b", delay=60)
    node.produce("q", "c", retry=30)
    ok(node({"action": 2, "queue": "q"}))  # delivers "a" (at-most-once: deleted)
    resp = ok(node({"action": action, "queue": "q", "seq": 1}, NOW_MS + 5_000))
    for f in QUEUE_FIELDS + NODE_FIELDS:
        assert f in resp, f
    assert resp["action"] == action and resp["queue"] == "q" and resp["seq"] == 1
    assert resp["size"] == 2
    assert resp["max_id"] == 3
    assert resp["wait_status"] == 5  # "c" has waited 5 s
    assert resp["node_id"] == 3 and resp["leader_node_id"] == 3
    assert resp["trans_id"] == 4  # three produces and a consume
    assert (resp["ready"], resp["delayed"], resp["in_flight"]) == (1, 1, 0)
    assert resp["max_size"] == node.config.queue_size


def test_monitor_unknown_queue(node):
    resp = ok(node({"action": 4, "queue": "nope"}))
    assert (resp["size"], resp["max_id"], resp["wait_status"]) == (0, 0, 0)
    for f in NODE_FIELDS:
        assert f in resp
    assert node.store.get("nope") is None


@pytest.mark.parametrize("action", [4, 104])
def test_monitor_without_queue(node, action):
    node.produce("q")
    resp = ok(node({"action": action, "seq": 9}))
    assert resp["seq"] == 9
    assert resp["node_id"] == 3 and resp["leader_node_id"] == 3
    assert resp["trans_id"] == 1
    assert resp["queue_count"] == 1


def test_wait_status_is_capped(node):
    node.produce("q")
    resp = ok(node({"action": 4, "queue": "q"}, NOW_MS + 3600_000))
    assert resp["wait_status"] == 255


@pytest.mark.parametrize("action", [7, 107])
def test_list(node, action):
    for name in ("beta", "alphabet", "alpha", "gamma"):
        node.produce(name)
    node.produce("alpha")
    resp = ok(node({"action": action, "pattern": "alpha", "seq": 1}, NOW_MS + 2_000))
    assert resp["seq"] == 1 and resp["pattern"] == "alpha"
    assert resp["queue_count"] == 2
    assert resp["queue_list"] == [{"name": "alpha", "size": 2, "wait_status": 4},
                                  {"name": "alphabet", "size": 1, "wait_status": 2}]
    every = ok(node({"action": action}))
    assert [q["name"] for q in every["queue_list"]] == ["alpha", "alphabet", "beta", "gamma"]
    assert every["queue_count"] == 4
    none = ok(node({"action": action, "pattern": "zzz"}))
    assert none["queue_list"] == [] and none["queue_count"] == 0


def test_list_empty_node(node):
    resp = ok(node({"action": 7}))
    assert resp["queue_list"] == [] and resp["queue_count"] == 0


def test_leader(node):
    resp = ok(node({"action": 8, "seq": "L"}))
    assert resp == {"action": 8, "seq": "L", "code": 0, "leader_node_id": 3,
                    "leader_host": "127.0.0.9", "leader_port": 4567}


# -- unsupported and bad requests --------------------------------------------

def test_clear_removes_every_message_and_answers_how_many(node):
    # Action 6 was "not support" (queue_server); it is clear now (protocol-v2).
    node.produce("q")
    node.produce("q")
    resp = node({"action": 6, "queue": "q", "seq": 1})
    assert resp == {"action": 6, "queue": "q", "seq": 1, "code": 0, "cleared": 2}
    assert len(node.store.get("q")) == 0


def test_config_without_set_reads_the_settings_and_changes_nothing(node):
    # Action 5 was "not support" (queue_server); it is config now (protocol-v2).
    node.produce("q")
    before = node.log.last_trans_id
    resp = node({"action": 5, "queue": "q", "seq": 1})
    assert resp == {"action": 5, "queue": "q", "seq": 1, "code": 0,
                    "config": {"max_deliveries": 0, "dead_letter": None,
        "max_size": 1000000, "dedup_window": 300, "paused": "none"}}
    assert node.log.last_trans_id == before  # a read logs nothing
    assert len(node.store.get("q")) == 1


@pytest.mark.parametrize("req,reason", [
    ({"action": 1, "data": "x", "seq": 1}, "missing field: queue"),
    ({"action": 1, "queue": "q", "seq": 1}, "missing field: data"),
    ({"action": 1, "queue": "q", "data": 5, "seq": 1}, "data must be a string"),
    ({"action": 1, "queue": "q", "data": "x", "delay": "soon", "seq": 1}, "delay must be a number"),
    ({"action": 1, "queue": "q", "data": "x", "ttl": -1, "seq": 1}, "ttl must not be negative"),
    ({"action": 1, "queue": "q", "data": "x", "retry": -1, "seq": 1}, "retry must not be negative"),
    ({"action": 2, "queue": "", "seq": 1}, "queue must not be empty"),
    ({"action": 3, "queue": "q", "seq": 1}, "missing field: msg_id"),
    ({"action": 3, "queue": "q", "msg_id": 0, "seq": 1}, "msg_id must be positive"),
    ({"action": 7, "pattern": 1, "seq": 1}, "pattern must be a string"),
    ({"action": 99, "seq": 1}, "invalid action"),
    ({"action": True, "seq": 1}, "action must be an integer"),
    ({"seq": 1}, "missing field: action"),
])
def test_bad_request_echoes_fields_with_reason(node, req, reason):
    resp = error(node(dict(req)), reason)
    assert resp["seq"] == 1
    assert "data" not in resp  # never echo a payload back in an error
    assert node.log.last_trans_id == 0  # nothing logged


@pytest.mark.parametrize("obj", [None, 1, "x", [1, 2], [{"action": 8}]])
def test_non_object_request(node, obj):
    assert node(obj) == {"code": -1, "reason": "request must be a JSON object"}


# -- through the codec -------------------------------------------------------

def test_pipelined_stream_through_codec_and_service(node):
    stream = (b'{"action":1,"queue":"q","data":"d1","seq":1}'
              b'{"action":1,"queue":"q","data":"d2","seq":2}\n'
              b'{"action":2,"queue":"q","seq":3} {"action":4,"queue":"q","seq":4}\n'
              b'{"action":42,"seq":5}')
    responses: list[dict] = []
    decoder = StreamDecoder()
    for i in range(0, len(stream), 7):  # arbitrary reads
        for item in decoder.feed(stream[i:i + 7]):
            node.service.handle(item, NOW_MS, responses.append)
    out = b"".join(encode_response(r) for r in responses)
    back = StreamDecoder().feed(out)
    assert [r["seq"] for r in back] == [1, 2, 3, 4, 5]
    assert [r["code"] for r in back] == [0, 0, 0, 0, -1]
    assert back[2]["data"] == "d1"
    assert back[3]["size"] == 1
    assert back[4] == {"action": 42, "seq": 5, "code": -1, "reason": "invalid action"}
