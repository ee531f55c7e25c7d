"""Raft's read index in the native core (NativeCore.read_index), on the
simulated network: an answer that appends no entry goes out only once the
master's state it was read from is committed and the master is known to
have led when it was asked (a majority echoed a push round sent after).

The first test is issue 12's reproduction: a confirm appended on a master
cut off from its slaves, then retried there as "confirm of an unknown id",
must not be acknowledged, since the new master undoes the confirm and
delivers the message again.
"""

from __future__ import annotations

from qserver.engines.local import LocalEngine
from qserver.engines.native.core import OUTCOME_UNKNOWN, Role
from qserver.state.entries import Confirm, Consume, Produce
from qserver.wire.requests import ConfirmRequest, ConsumeRequest, ProduceRequest
from sim import Network


def _settled(seed: int = 1, **kw) -> Network:
    net = Network(3, seed, **kw)
    assert net.run_until(net.converged, 10_000)
    return net


def _write(net: Network, entry) -> object:
    m = net.master()
    results: list = []
    net.propose(m, entry, results)
    assert net.run_until(lambda: results, 5_000)
    result, error = results[0]
    assert error is None
    return result


def _read(net: Network, i: int) -> list:
    """Ask node i for a read index; the answers land in the returned list."""
    answers: list = []
    net.core(i).read_index(lambda result, error: answers.append(error))
    net._flush(i)
    return answers


def _in_flight_message(net: Network) -> tuple[int, int]:
    """Produce a retry=5 message and consume it; (master, msg_id)."""
    m = net.master()
    store = net.core(m).store
    targets = _write(net, store.decide_produce(
        ProduceRequest(queue="q", data="job", delay_s=None, ttl_s=None, retry_s=5), net.now))
    msg_id = targets[0][1]
    consume = store.decide_consume(ConsumeRequest(("q",), None, 0, 0, False), net.now, 1)
    assert type(consume) is Consume and consume.msg_id == msg_id
    _write(net, consume)
    assert net.run_until(net.converged, 5_000)
    return net.master(), msg_id


def test_a_retried_confirm_on_a_cut_off_master_is_not_acknowledged():
    net = _settled()
    m, msg_id = _in_flight_message(net)
    net.isolate(m)
    store = net.core(m).store
    # The confirm is appended and applied at once, but cannot commit.
    confirm = store.decide_confirm(ConfirmRequest(queue="q", msg_id=msg_id))
    assert type(confirm) is Confirm
    first: list = []
    net.propose(m, confirm, first)
    net.run_for(50)
    assert first == []
    # The retry finds no such message in the master's (speculative) store:
    # "unknown id", which must wait for the confirm to commit.
    assert store.decide_confirm(ConfirmRequest(queue="q", msg_id=msg_id)) is None
    retried = _read(net, m)
    net.run_for(50)
    assert retried == []
    # The master steps down: both answers are "outcome unknown", never code 0.
    assert net.run_until(lambda: net.core(m).role is not Role.MASTER, 5_000)
    net.run_for(10)
    assert first == [(None, OUTCOME_UNKNOWN)]
    assert retried == [OUTCOME_UNKNOWN]
    # The other two elect a master that still has the message in flight.
    assert net.run_until(lambda: net.master() not in (None, m), 10_000)
    new = net.core(net.master()).store
    assert msg_id in new.get("q").messages


def test_a_stale_master_with_everything_committed_does_not_answer_a_read():
    """A master cut off (or paused) before it knows it lost: its state is
    all committed, but a newer master may exist; the read waits for a
    majority to echo a round and gets "outcome unknown" instead."""
    net = _settled(2)
    m, _msg_id = _in_flight_message(net)
    core = net.core(m)
    assert core.commit_id == core.log.last_trans_id
    net.isolate(m)
    answers = _read(net, m)
    net.run_for(100)
    assert answers == []
    assert net.run_until(lambda: answers, 5_000)
    assert answers == [OUTCOME_UNKNOWN]


def test_a_read_on_a_healthy_master_is_answered_after_one_round():
    net = _settled(3)
    m = net.master()
    sent_before = net.delivered
    answers = _read(net, m)
    assert answers == []  # not before a majority has echoed a new round
    assert net.run_until(lambda: answers, 1_000)
    assert answers == [None]
    assert net.delivered > sent_before


def test_a_read_waits_for_the_writes_before_it_to_commit():
    net = _settled(4)
    m = net.master()
    store = net.core(m).store
    slaves = [i for i in net.ids if i != m]
    net.cut.update((s, m) for s in slaves)  # replies to the master are lost
    produce = store.decide_produce(
        ProduceRequest(queue="q", data="x", delay_s=None, ttl_s=None, retry_s=0), net.now)
    assert type(produce) is Produce
    results: list = []
    net.propose(m, produce, results)
    answers = _read(net, m)
    net.run_for(200)
    assert results == [] and answers == []
    net.heal()
    assert net.run_until(lambda: answers, 5_000)
    assert answers == [None]
    assert results and results[0][1] is None  # the write committed first


def test_reads_in_one_turn_share_a_round_and_keep_their_order():
    net = _settled(5)
    m = net.master()
    order: list = []
    core = net.core(m)
    for k in range(5):
        core.read_index(lambda result, error, k=k: order.append((k, error)))
    round_before = core.read_round
    net._flush(m)
    assert net.run_until(lambda: len(order) == 5, 1_000)
    assert order == [(k, None) for k in range(5)]
    assert core.read_round == round_before


def test_async_mode_answers_reads_at_once():
    net = _settled(6, async_mode=True)
    m = net.master()
    net.isolate(m)
    answers = _read(net, m)
    assert answers == [None]


def test_a_read_on_a_slave_is_refused():
    net = _settled(7)
    slave = next(i for i in net.ids if i != net.master())
    answers: list = []
    net.core(slave).read_index(lambda result, error: answers.append(error))
    assert answers == ["not master"]


def test_a_lone_master_answers_once_committed():
    net = Network(1, 8)
    assert net.run_until(net.converged, 5_000)
    answers = _read(net, 1)
    assert answers == [None]


# -- the service: which answers wait for the read index ------------------------

class _DeferringEngine(LocalEngine):
    """A master whose reads and writes wait until the test releases them,
    around a LocalEngine's store and log (what a cluster master does)."""

    commits_at_once = False

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.reads: list = []
        self.writes: list = []

    def propose(self, entry, done) -> None:
        result = self.commit_now(entry)
        self.writes.append(lambda: done(result, None))

    def read_index(self, done) -> None:
        self.reads.append(done)


def _service():
    from qserver.config import Config
    from qserver.engines import LeaderInfo
    from qserver.service import Service
    from qserver.state.log import Log
    from qserver.state.store import Store

    cfg = Config()
    store = Store(queue_size=cfg.queue_size, virtual_queues=cfg.virtual_queues)
    engine = _DeferringEngine(store=store, log=Log(), log_size=cfg.log_size,
                              me=LeaderInfo(node_id=1, host="127.0.0.1", port=1111))
    return Service(config=cfg, store=store, engine=engine), engine


NOW = 1_700_000_000_000


def test_service_answers_that_append_no_entry_wait_for_the_read_index():
    service, engine = _service()
    requests = [
        {"action": 2, "queue": "q", "seq": 1},  # empty consume
        {"action": 3, "queue": "q", "msg_id": 9, "seq": 2},  # confirm of an unknown id
        {"action": 4, "queue": "q", "seq": 3},  # monitor
        {"action": 7, "seq": 4},  # list
    ]
    out: list = []
    for req in requests:
        service.handle(req, NOW, out.append)
    assert out == [] and len(engine.reads) == 4
    for done in engine.reads:
        done(None, None)
    assert [r["seq"] for r in out] == [1, 2, 3, 4]
    assert all(r["code"] == 0 for r in out)
    assert "msg_id" not in out[0] and out[2]["size"] == 0 and out[3]["queue_count"] == 0


def test_service_read_that_loses_the_master_is_outcome_unknown():
    service, engine = _service()
    out: list = []
    service.handle({"action": 3, "queue": "q", "msg_id": 9}, NOW, out.append)
    service.handle({"action": 4, "queue": "q"}, NOW, out.append)
    for done in engine.reads:
        done(None, OUTCOME_UNKNOWN)
    assert [(r["code"], r["reason"]) for r in out] == [(-1, OUTCOME_UNKNOWN)] * 2
    assert "size" not in out[1]  # the error echoes the request, not the read


def test_service_node_local_reads_and_writes_do_not_take_the_read_index():
    service, engine = _service()
    out: list = []
    service.handle({"action": 104, "queue": "q"}, NOW, out.append)
    service.handle({"action": 107}, NOW, out.append)
    service.handle({"action": 8}, NOW, out.append)
    assert len(out) == 3 and engine.reads == []
    service.handle({"action": 1, "queue": "q", "data": "x"}, NOW, out.append)
    assert len(out) == 3 and engine.reads == [] and len(engine.writes) == 1


def test_service_new_answers_that_append_no_entry_wait_for_the_read_index():
    # Issue 14: show, peek, a config read, an empty consume in the new forms,
    # `stale receipt`, `not in flight` and `no such message` rest on
    # committed state only.
    service, engine = _service()
    out: list = []
    service.handle({"action": 1, "queue": "q", "data": "x", "retry": 30}, NOW, out.append)
    service.handle({"action": 2, "queue": "q"}, NOW, out.append)  # in flight now
    for write in engine.writes:
        write()
    assert [r["code"] for r in out] == [0, 0] and out[1]["receipt"] == "1.1.1"
    out.clear()
    requests = [
        ({"action": 2, "queue": "q", "count": 5, "seq": 1}, 0),  # empty: `messages: []`
        ({"action": 2, "queues": ["q", "r"], "seq": 2}, 0),
        ({"action": 11, "queue": "q", "msg_id": 1, "seq": 3}, 0),  # show
        ({"action": 12, "queue": "q", "seq": 4}, 0),  # peek: nothing due
        ({"action": 5, "queue": "q", "seq": 5}, 0),  # config read
        ({"action": 3, "queue": "q", "msg_id": 1, "receipt": "1.1.9", "seq": 6}, -1),
        ({"action": 9, "queue": "q", "msg_id": 1, "receipt": "1.1.9", "seq": 7}, -1),
        ({"action": 10, "queue": "q", "msg_id": 1, "receipt": "9.1.1", "seq": 8}, -1),
        ({"action": 9, "queue": "q", "msg_id": 2, "seq": 9}, -1),  # not in flight
        ({"action": 10, "queue": "q", "msg_id": 2, "seq": 10}, -1),
        ({"action": 11, "queue": "q", "msg_id": 2, "seq": 11}, -1),  # no such message
    ]
    for req, _code in requests:
        service.handle(req, NOW + 1000, out.append)
    assert out == [] and len(engine.reads) == len(requests)
    log_length = engine.log.last_trans_id
    for done in engine.reads:
        done(None, None)
    assert engine.log.last_trans_id == log_length  # nothing appended
    assert [(r["seq"], r["code"]) for r in out] == [(req["seq"], code) for req, code in requests]
    assert out[0]["messages"] == [] and "msg_id" not in out[1]
    assert out[2]["message"]["state"] == "in_flight" and out[3]["messages"] == []
    assert out[4]["config"] == {"max_deliveries": 0, "dead_letter": None,
        "max_size": 1000000, "dedup_window": 300, "paused": "none"}
    assert [r["reason"] for r in out[5:]] == ["stale receipt"] * 3 + ["not in flight"] * 2 + [
        "no such message"]


def test_service_new_reads_that_lose_the_master_echo_the_request_not_the_read():
    # As monitor's (above): an "outcome unknown" error carries the request's
    # fields only, never what was read (a client must not act on it).
    service, engine = _service()
    out: list = []
    service.handle({"action": 1, "queue": "q", "data": "x"}, NOW, out.append)
    engine.writes.pop()()
    out.clear()
    requests = [
        {"action": 11, "queue": "q", "msg_id": 1},  # show of a message that exists
        {"action": 11, "queue": "q", "msg_id": 2},  # no such message
        {"action": 12, "queue": "q"},  # peek
        {"action": 5, "queue": "q"},  # config read
        {"action": 9, "queue": "q", "msg_id": 1},  # not in flight
        {"action": 3, "queue": "q", "msg_id": 1, "receipt": "1.1.1"},  # stale receipt
        {"action": 3, "queue": "q", "msg_id": 7},  # unknown id
        {"action": 2, "queue": "r", "count": 2},  # empty consume, list form
    ]
    for req in requests:
        service.handle(dict(req), NOW, out.append)
    assert out == [] and len(engine.reads) == len(requests)
    for done in engine.reads:
        done(None, OUTCOME_UNKNOWN)
    assert out == [dict(req, code=-1, reason=OUTCOME_UNKNOWN) for req in requests]
