"""Consumer controls (issue 14) on real three-node clusters, once per engine:
long polls woken by a produce, a retry, a touch or a delay coming due, a
dead-letter move; parked consumes answered when the master loses its role
and forgotten when their client goes (also through a slave, whose
ForwardCancel reaches the master); UDP long polls; receipts across kill -9
of the master and a full restart from storage; dead letters, also expired
by a new master; every new action forwarded through a slave answering as
the master does.

Nothing here asserts how fast anything is. A parked consume is known to
be parked when the master's node-local monitor (104) counts it in
`waiting`; the only time bounds are the ones the contract states (a parked
consume answered by the master's role loss before its `wait` ends; a
relayed one never later than `wait` plus the forward timeout), each with
tens of seconds of slack. Leases are short (0.3-2 s) so that the file runs
in under a minute.
"""

from __future__ import annotations

import json
import re
import signal
import time
from pathlib import Path

import pytest

from procs import Cluster, TcpClient, UdpClient, wait_until
from qserver.engines.base import FORWARD_TIMEOUT_S

DEADLINE_S = 30.0  # generous: CI is a shared, noisy 2-core machine
ENGINES = ["native", "raft"]

# The wait of a long poll that must be woken by something else: far longer
# than anything the test waits for, so that a consume answered at its
# deadline (not woken) shows up as a failure, never as a pass.
LONG_WAIT_S = 25
# What a parked client allows beyond the wait before it calls the server
# hung: the slave's forward timeout, plus slack for a loaded machine.
ANSWER_SLACK_S = FORWARD_TIMEOUT_S + 10.0

RECEIPT = re.compile(r"^\d+\.\d+\.\d+$")

# The settings issue 15 added to every config answer, as these tests leave them.
REST = {"max_size": 1_000_000, "dedup_window": 300, "paused": "none"}


@pytest.fixture
def cluster(tmp_path):
    """Start a cluster (Cluster's keywords); every one is killed at the end."""
    clusters: list[Cluster] = []

    def make(*, storage: bool = False, **kw) -> Cluster:
        c = Cluster(tmp_path, **kw)
        if storage:
            per_node_storage(c, tmp_path)
        clusters.append(c)
        c.start_all()
        return c

    yield make
    for c in clusters:
        c.stop_all()


def per_node_storage(c: Cluster, tmp_path: Path) -> None:
    """Give each node of `c` its own data directory, fsync="always"."""
    orig = c.config_path

    def config_path(node_id: int) -> Path:
        path = orig(node_id)
        storage = f'  <storage dir="{tmp_path / f"data{node_id}"}" fsync="always"/>\n'
        path.write_text(path.read_text().replace("</config>", storage + "</config>"))
        return path

    c.config_path = config_path


def others(c: Cluster, node_id: int) -> list[int]:
    return [i for i in range(1, c.n + 1) if i != node_id]


def park(port: int, **fields) -> TcpClient:
    """Send a request (a consume with `wait`) on a connection of its own and
    return the client without reading the answer: read it with `answer`."""
    client = TcpClient(port)
    client.send_raw(json.dumps(fields).encode())
    return client


def answer(client: TcpClient, within_s: float) -> dict:
    """The answer to the request `park` sent; fail if none comes in time."""
    client.sock.settimeout(max(within_s, 0.1))
    try:
        return client.read()
    except TimeoutError:
        raise AssertionError(f"no answer within {within_s:.0f}s") from None


def waiting(c: Cluster, node_id: int, queue: str) -> int | None:
    """The consumes parked on `node_id` for `queue` (its own view, 104)."""
    return (c.ask(node_id, action=104, queue=queue) or {}).get("waiting")


def wait_parked(c: Cluster, node_id: int, queue: str, n: int) -> None:
    wait_until(lambda: waiting(c, node_id, queue) == n, DEADLINE_S)


def call(c: Cluster, node_id: int, **fields) -> dict:
    """One request to one node on a fresh connection; its answer. A consume
    with `wait` is given the wait and the forward timeout on top."""
    client = TcpClient(c.port(node_id))
    client.sock.settimeout(DEADLINE_S + fields.get("wait", 0) + ANSWER_SLACK_S)
    try:
        return client.request(**fields)
    finally:
        client.close()


def ok(r: dict) -> dict:
    assert r.get("code") == 0, r
    return r


def empty_or_error(got: dict, seq: int) -> None:
    """The answer of a consume parked when its master went: the empty answer
    or an error; like every answer it echoes the request's `seq` (design.md
    section 1: queue_server's clients match answers by it)."""
    assert got.get("seq") == seq, got
    if got.get("code") == 0:
        assert "msg_id" not in got and "data" not in got, got
    else:
        assert got.get("code") == -1 and isinstance(got.get("reason"), str), got


def serving_master(c: Cluster, alive: list[int] | None = None) -> int:
    """The master every live node agrees on, once it has committed a write."""
    m = c.wait_master(DEADLINE_S, alive=alive)
    wait_until(lambda: (c.ask(m, action=1, queue="probe", data="p") or {}).get("code") == 0,
               DEADLINE_S)
    return m


# -- long poll --------------------------------------------------------------

@pytest.mark.parametrize("engine", ENGINES)
def test_long_poll_woken_by_a_produce_on_the_master_and_through_slaves(cluster, engine):
    c = cluster(engine=engine)
    m = c.wait_master(DEADLINE_S)
    s1, s2 = others(c, m)
    master = TcpClient(c.port(m))

    # parked on the master, woken by a produce to the master
    p = park(c.port(m), action=2, queue="lp", wait=LONG_WAIT_S, count=5, seq=1)
    wait_parked(c, m, "lp", 1)
    produced = ok(master.request(action=1, queue="lp", data="x", retry=60))
    got = answer(p, LONG_WAIT_S)
    assert got["code"] == 0 and got["seq"] == 1
    assert [(g["queue"], g["msg_id"], g["data"], g["deliveries"]) for g in got["messages"]] \
        == [("lp", produced["msg_id"], "x", 1)]
    assert RECEIPT.match(got["messages"][0]["receipt"])
    assert waiting(c, m, "lp") == 0

    # parked through slave 1 (the master parks it), woken by a produce to
    # slave 2; an at-most-once message: no receipt, gone once delivered
    p = park(c.port(s1), action=2, queue="lp2", wait=LONG_WAIT_S, seq=2)
    wait_parked(c, m, "lp2", 1)
    assert waiting(c, s1, "lp2") == 0  # the slave relays, it parks nothing
    produced = ok(call(c, s2, action=1, queue="lp2", data="y"))
    got = answer(p, LONG_WAIT_S + ANSWER_SLACK_S)
    assert (got["code"], got["seq"], got["msg_id"], got["data"], got["deliveries"]) \
        == (0, 2, produced["msg_id"], "y", 1)
    assert "receipt" not in got
    assert ok(master.request(action=4, queue="lp2"))["size"] == 0
    assert waiting(c, m, "lp2") == 0

    # several queues: parked on both, woken by a produce to the second
    p = park(c.port(s2), action=2, queues=["lp3a", "lp3b"], wait=LONG_WAIT_S)
    wait_parked(c, m, "lp3b", 1)
    assert waiting(c, m, "lp3a") == 1
    produced = ok(call(c, s1, action=1, queue="lp3b", data="z"))
    got = answer(p, LONG_WAIT_S + ANSWER_SLACK_S)
    assert (got["code"], got["queue"], got["msg_id"], got["data"]) \
        == (0, "lp3b", produced["msg_id"], "z")
    assert waiting(c, m, "lp3a") == waiting(c, m, "lp3b") == 0


@pytest.mark.parametrize("engine", ENGINES)
def test_long_poll_woken_by_a_retry_and_a_touch_coming_due(cluster, engine):
    c = cluster(engine=engine)
    m = c.wait_master(DEADLINE_S)
    s1, _s2 = others(c, m)
    # two parked consumes, first come first served: the first (on the
    # master) takes the message, the second (through a slave) stays parked
    # and gets the same message once the first one's lease runs out
    first = park(c.port(m), action=2, queue="rt", wait=LONG_WAIT_S, lease=0.5)
    wait_parked(c, m, "rt", 1)
    second = park(c.port(s1), action=2, queue="rt", wait=LONG_WAIT_S, lease=60)
    wait_parked(c, m, "rt", 2)
    msg_id = ok(call(c, m, action=1, queue="rt", data="again", retry=60))["msg_id"]
    one = answer(first, LONG_WAIT_S)
    assert (one["code"], one["msg_id"], one["data"], one["deliveries"]) == (0, msg_id, "again", 1)
    two = answer(second, LONG_WAIT_S + ANSWER_SLACK_S)  # not confirmed: it comes back
    assert (two["code"], two["msg_id"], two["data"], two["deliveries"]) == (0, msg_id, "again", 2)
    assert RECEIPT.match(one["receipt"]) and RECEIPT.match(two["receipt"])
    assert one["receipt"] != two["receipt"]
    # the first consumer overran its lease: its receipt is refused
    r = call(c, m, action=3, queue="rt", msg_id=msg_id, receipt=one["receipt"])
    assert (r["code"], r["reason"]) == (-1, "stale receipt")

    # parked while the message is in flight for 60 s; a touch makes the
    # delivery come back in 0.5 s: the parked consume is woken then
    third = park(c.port(s1), action=2, queue="rt", wait=LONG_WAIT_S)
    wait_parked(c, m, "rt", 1)
    ok(call(c, s1, action=10, queue="rt", msg_id=msg_id, receipt=two["receipt"], lease=0.5))
    three = answer(third, LONG_WAIT_S + ANSWER_SLACK_S)
    assert (three["code"], three["msg_id"], three["deliveries"]) == (0, msg_id, 3)
    assert ok(call(c, m, action=3, queue="rt", msg_id=msg_id,
                    receipt=three["receipt"]))["found"] is True
    assert waiting(c, m, "rt") == 0


@pytest.mark.parametrize("engine", ENGINES)
def test_long_poll_woken_by_a_delay_coming_due(cluster, engine):
    c = cluster(engine=engine)
    m = c.wait_master(DEADLINE_S)
    s1, s2 = others(c, m)
    p = park(c.port(s1), action=2, queue="dl", wait=LONG_WAIT_S, count=3)
    wait_parked(c, m, "dl", 1)
    msg_id = ok(call(c, s2, action=1, queue="dl", data="later", delay=1, retry=60))["msg_id"]
    got = answer(p, LONG_WAIT_S + ANSWER_SLACK_S)
    assert got["code"] == 0
    assert [(g["msg_id"], g["data"]) for g in got["messages"]] == [(msg_id, "later")]
    assert waiting(c, m, "dl") == 0


@pytest.mark.parametrize("engine", ENGINES)
def test_udp_consume_waits_on_the_master_and_through_a_slave(cluster, engine):
    c = cluster(engine=engine)
    m = c.wait_master(DEADLINE_S)
    s1, s2 = others(c, m)
    on_master, via_slave = UdpClient(c.port(m)), UdpClient(c.port(s1))
    on_master.sock.sendto(json.dumps(
        {"action": 2, "queue": "ud", "wait": LONG_WAIT_S, "seq": 1}).encode(), on_master.addr)
    wait_parked(c, m, "ud", 1)
    via_slave.sock.sendto(json.dumps(
        {"action": 2, "queue": "ud", "wait": LONG_WAIT_S, "seq": 2}).encode(), via_slave.addr)
    wait_parked(c, m, "ud", 2)
    first = ok(call(c, s2, action=1, queue="ud", data="u1"))["msg_id"]
    second = ok(call(c, s2, action=1, queue="ud", data="u2"))["msg_id"]
    for client, seq, msg_id, data in ((on_master, 1, first, "u1"),
                                      (via_slave, 2, second, "u2")):
        client.sock.settimeout(LONG_WAIT_S + ANSWER_SLACK_S)
        got = json.loads(client.sock.recvfrom(70000)[0])
        assert (got["code"], got["seq"], got["msg_id"], got["data"]) == (0, seq, msg_id, data)
    assert waiting(c, m, "ud") == 0


@pytest.mark.parametrize("engine", ENGINES)
def test_a_client_that_leaves_while_parked_leaves_no_waiter(cluster, engine):
    c = cluster(engine=engine)
    m = c.wait_master(DEADLINE_S)
    s1, s2 = others(c, m)
    # on the master, then through a slave (its ForwardCancel reaches the master)
    for node in (m, s1):
        gone = park(c.port(node), action=2, queue="gone", wait=LONG_WAIT_S)
        wait_parked(c, m, "gone", 1)
        gone.close()
        wait_parked(c, m, "gone", 0)
    # an at-most-once message produced now is not taken for either of them
    msg_id = ok(call(c, s2, action=1, queue="gone", data="kept"))["msg_id"]
    mon = ok(call(c, m, action=4, queue="gone"))
    assert (mon["size"], mon["ready"], mon["waiting"]) == (1, 1, 0)
    peeked = ok(call(c, s1, action=12, queue="gone"))["messages"]
    assert [(p["msg_id"], p["state"], p["deliveries"]) for p in peeked] == [(msg_id, "ready", 0)]
    got = ok(call(c, s2, action=2, queue="gone"))
    assert (got["msg_id"], got["data"], got["deliveries"]) == (msg_id, "kept", 1)


@pytest.mark.parametrize("engine", ENGINES)
def test_messages_produced_as_parked_clients_leave_are_not_lost(cluster, engine):
    # Clients parked on the master and through a slave leave while messages
    # are produced: whichever way each race goes (the master learns of the
    # leaving first, or serves the gone client first), every at-least-once
    # message is delivered to a live consumer in the end, the ones taken for
    # a gone client once their lease runs out.
    c = cluster(engine=engine)
    m = c.wait_master(DEADLINE_S)
    s1, s2 = others(c, m)
    parked = [park(c.port(node), action=2, queue="race", wait=LONG_WAIT_S, lease=0.5)
              for node in (m, s1) * 4]
    wait_parked(c, m, "race", len(parked))
    producer = TcpClient(c.port(s2))
    produced = set()
    for i, client in enumerate(parked):
        client.close()
        produced.add(ok(producer.request(action=1, queue="race", data=f"r{i}", retry=60))
                     ["msg_id"])
    drained: set[int] = set()
    consumer = TcpClient(c.port(s1))
    consumer.sock.settimeout(DEADLINE_S + ANSWER_SLACK_S)
    end = time.monotonic() + DEADLINE_S
    while drained != produced and time.monotonic() < end:
        got = ok(consumer.request(action=2, queue="race", wait=5, count=10))
        for g in got["messages"]:
            drained.add(g["msg_id"])
            assert ok(consumer.request(action=3, queue="race", msg_id=g["msg_id"],
                                       receipt=g["receipt"]))["found"] is True
    assert drained == produced
    wait_parked(c, m, "race", 0)
    assert ok(call(c, m, action=4, queue="race"))["size"] == 0


@pytest.mark.parametrize("engine", ENGINES)
def test_parked_consumes_are_answered_when_the_master_loses_its_role(cluster, engine):
    # SIGSTOP, not kill -9: the stopped master keeps its connections, and
    # once resumed finds a newer master and steps down; a killed one could
    # answer nobody. wait=60 (max_wait raised for it): an empty answer at
    # the deadline cannot pass for one given at the role change.
    wait_s = 60
    c = cluster(engine=engine, extra=f'  <limits max_wait="{wait_s}"/>\n')
    m = c.wait_master(DEADLINE_S)
    s1, s2 = others(c, m)
    direct_at = time.monotonic()
    direct = park(c.port(m), action=2, queue="role", wait=wait_s, count=2, seq=6)
    wait_parked(c, m, "role", 1)
    relayed_at = time.monotonic()
    relayed = park(c.port(s1), action=2, queue="role", wait=wait_s, seq=7)
    wait_parked(c, m, "role", 2)
    old = c.nodes[m].proc
    old.send_signal(signal.SIGSTOP)
    try:
        new = c.wait_master(DEADLINE_S, alive=[s1, s2])
    finally:
        old.send_signal(signal.SIGCONT)
    # the old master answers its own client with the empty answer, before
    # the wait ends
    got = answer(direct, direct_at + wait_s - 5 - time.monotonic())
    assert (got["code"], got["seq"], got["messages"]) == (0, 6, [])
    # the relayed one gets an answer too: empty, or an error (never a hang
    # past the wait plus the forward timeout)
    got = answer(relayed, relayed_at + wait_s + FORWARD_TIMEOUT_S + 5 - time.monotonic())
    empty_or_error(got, 7)
    # every node agrees on a master again (the old one, resumed, follows
    # `new`, unless a later election chose otherwise); it parks nothing
    new = c.wait_master(DEADLINE_S)
    assert waiting(c, m, "role") == 0
    # nothing was taken for them: a message produced now is served to the
    # next consumer, here one that parks through the old master
    p = park(c.port(m), action=2, queue="role", wait=LONG_WAIT_S)
    wait_parked(c, new, "role", 1)
    msg_id = ok(call(c, new, action=1, queue="role", data="after", retry=60))["msg_id"]
    got = answer(p, LONG_WAIT_S + ANSWER_SLACK_S)
    assert (got["code"], got["msg_id"], got["data"]) == (0, msg_id, "after")


@pytest.mark.parametrize("engine", ENGINES)
def test_a_consume_parked_through_a_slave_is_answered_when_the_master_is_killed(
        cluster, engine):
    c = cluster(engine=engine)
    m = c.wait_master(DEADLINE_S)
    s1, s2 = others(c, m)
    relayed_at = time.monotonic()
    relayed = park(c.port(s1), action=2, queue="idle", wait=LONG_WAIT_S, seq=8)
    wait_parked(c, m, "idle", 1)
    c.kill(m)
    got = answer(relayed, relayed_at + LONG_WAIT_S + FORWARD_TIMEOUT_S + 5 - time.monotonic())
    empty_or_error(got, 8)
    # the slave relays the next long poll to the new master
    new = serving_master(c, alive=[s1, s2])
    relayed.send_raw(json.dumps({"action": 2, "queue": "idle", "wait": LONG_WAIT_S,
                                 "seq": 9}).encode())
    wait_parked(c, new, "idle", 1)
    msg_id = ok(call(c, new, action=1, queue="idle", data="next"))["msg_id"]
    got = answer(relayed, LONG_WAIT_S + ANSWER_SLACK_S)
    assert (got["code"], got["seq"], got["msg_id"], got["data"]) == (0, 9, msg_id, "next")


# -- receipts and dead letters across failures -------------------------------

@pytest.mark.parametrize("engine", ENGINES)
def test_receipts_and_dead_letters_survive_kill_of_the_master_and_a_full_restart(
        cluster, engine):
    c = cluster(engine=engine, storage=True)
    m = serving_master(c)
    s1, s2 = others(c, m)
    master = TcpClient(c.port(m))
    master.sock.settimeout(DEADLINE_S + LONG_WAIT_S + ANSWER_SLACK_S)

    def req(**fields) -> dict:
        return master.request(**fields)

    kept = ok(req(action=1, queue="rc", data="kept", retry=60))["msg_id"]
    redo = ok(req(action=1, queue="rc", data="redo", retry=60))["msg_id"]
    kept_r = ok(req(action=2, queue="rc"))
    assert kept_r["msg_id"] == kept
    redo_r = ok(req(action=2, queue="rc", lease=0.3))
    assert redo_r["msg_id"] == redo
    # a queue whose messages go to "dlq" after two deliveries; the second
    # (final) lease is still running when the master dies
    assert ok(req(action=5, queue="poison", set={"max_deliveries": 2, "dead_letter": "dlq"})
              )["config"] == {"max_deliveries": 2, "dead_letter": "dlq", **REST}
    poison = ok(req(action=1, queue="poison", data="bad", retry=60))["msg_id"]
    assert ok(req(action=2, queue="poison", lease=0.3))["deliveries"] == 1
    final = ok(req(action=2, queue="poison", wait=LONG_WAIT_S, lease=2))
    assert (final["msg_id"], final["deliveries"]) == (poison, 2)

    master.close()
    c.kill(m)
    m2 = serving_master(c, alive=[s1, s2])

    # the delivery that was not redelivered: its receipt still touches and
    # confirms it
    r = ok(call(c, m2, action=10, queue="rc", msg_id=kept, receipt=kept_r["receipt"], lease=60))
    assert r["retry_at"] > time.time()
    shown = ok(call(c, s1, action=11, queue="rc", msg_id=kept))["message"]
    assert (shown["state"], shown["deliveries"]) == ("in_flight", 1)
    assert ok(call(c, m2, action=3, queue="rc", msg_id=kept,
                    receipt=kept_r["receipt"]))["found"] is True
    # the one redelivered by the new master: the old receipt is stale
    again = ok(call(c, m2, action=2, queue="rc", wait=LONG_WAIT_S, lease=60))
    assert (again["msg_id"], again["deliveries"]) == (redo, 2)
    assert again["receipt"] != redo_r["receipt"]
    for action in (3, 9, 10):
        r = call(c, m2, action=action, queue="rc", msg_id=redo, receipt=redo_r["receipt"])
        assert (r["code"], r["reason"]) == (-1, "stale receipt"), r
    # the new master moved the poison message out when its final lease ran out
    dead = ok(call(c, s2, action=2, queue="dlq", wait=LONG_WAIT_S, lease=60))
    assert (dead["data"], dead["deliveries"]) == ("bad", 1)
    shown = ok(call(c, m2, action=11, queue="dlq", msg_id=dead["msg_id"]))["message"]
    assert (shown["origin_queue"], shown["origin_msg_id"], shown["dead_letter_reason"]) \
        == ("poison", poison, "max_deliveries")
    r = call(c, m2, action=11, queue="poison", msg_id=poison)
    assert (r["code"], r["reason"]) == (-1, "no such message")
    assert ok(call(c, s1, action=4, queue="poison"))["dead_lettered"] == 1
    r = call(c, m2, action=3, queue="poison", msg_id=poison, receipt=final["receipt"])
    assert (r["code"], r["reason"]) == (-1, "stale receipt")

    # a full restart from the data directories (kill -9 of every node)
    late = ok(call(c, m2, action=1, queue="rc", data="late", retry=60))["msg_id"]
    late_r = ok(call(c, m2, action=2, queue="rc"))
    assert late_r["msg_id"] == late
    for node in c.nodes.values():
        node.proc.kill()
    for node in c.nodes.values():
        node.stop()
    c.start_all()
    m3 = serving_master(c)
    # `again` (lease 60) and `late` are still in flight with their receipts
    for msg_id, deliveries in ((redo, 2), (late, 1)):
        shown = ok(call(c, m3, action=11, queue="rc", msg_id=msg_id))["message"]
        assert (shown["state"], shown["deliveries"]) == ("in_flight", deliveries)
    r = call(c, m3, action=3, queue="rc", msg_id=redo, receipt=redo_r["receipt"])
    assert (r["code"], r["reason"]) == (-1, "stale receipt")
    assert ok(call(c, m3, action=3, queue="rc", msg_id=redo,
                    receipt=again["receipt"]))["found"] is True
    assert ok(call(c, m3, action=9, queue="rc", msg_id=late, receipt=late_r["receipt"]))["ready_at"]
    # nacked: its next delivery has a new receipt, the old one is stale
    redelivered = ok(call(c, m3, action=2, queue="rc"))
    assert (redelivered["msg_id"], redelivered["deliveries"]) == (late, 2)
    r = call(c, m3, action=3, queue="rc", msg_id=late, receipt=late_r["receipt"])
    assert (r["code"], r["reason"]) == (-1, "stale receipt")
    assert ok(call(c, m3, action=3, queue="rc", msg_id=late,
                    receipt=redelivered["receipt"]))["found"] is True
    # the dead letter, its origin, the counter and the settings too
    shown = ok(call(c, m3, action=11, queue="dlq", msg_id=dead["msg_id"]))["message"]
    assert (shown["origin_queue"], shown["origin_msg_id"], shown["dead_letter_reason"],
            shown["state"]) == ("poison", poison, "max_deliveries", "in_flight")
    assert ok(call(c, m3, action=3, queue="dlq", msg_id=dead["msg_id"],
                    receipt=dead["receipt"]))["found"] is True
    assert ok(call(c, m3, action=4, queue="poison"))["dead_lettered"] == 1
    assert ok(call(c, m3, action=5, queue="poison"))["config"] \
        == {"max_deliveries": 2, "dead_letter": "dlq", **REST}
    for node in range(1, 4):  # every node holds the same
        wait_until(lambda n=node: (c.ask(n, action=104, queue="poison") or {})
                   .get("dead_lettered") == 1, DEADLINE_S)


@pytest.mark.parametrize("engine", ENGINES)
def test_dead_letters_after_unconfirmed_leases_and_after_the_ttl(cluster, engine):
    c = cluster(engine=engine)
    m = c.wait_master(DEADLINE_S)
    s1, s2 = others(c, m)
    assert ok(call(c, s1, action=5, queue="dq", set={"max_deliveries": 2, "dead_letter": "dq-dead"})
              )["config"] == {"max_deliveries": 2, "dead_letter": "dq-dead", **REST}
    # parked on the dead-letter queue: a dead-letter move wakes it
    watcher = park(c.port(s2), action=2, queue="dq-dead", wait=LONG_WAIT_S, count=5, lease=60)
    wait_parked(c, m, "dq-dead", 1)
    msg_id = ok(call(c, s1, action=1, queue="dq", data="poison", retry=60))["msg_id"]
    one = ok(call(c, s1, action=2, queue="dq", lease=0.3))
    assert (one["msg_id"], one["deliveries"]) == (msg_id, 1)
    two = ok(call(c, s2, action=2, queue="dq", wait=LONG_WAIT_S, lease=0.3))
    assert (two["msg_id"], two["deliveries"]) == (msg_id, 2)
    assert RECEIPT.match(two["receipt"])  # a final delivery is still confirmable
    got = answer(watcher, LONG_WAIT_S + ANSWER_SLACK_S)
    assert [(g["queue"], g["data"], g["deliveries"]) for g in got["messages"]] \
        == [("dq-dead", "poison", 1)]
    dead_id = got["messages"][0]["msg_id"]
    for node in (m, s1):
        shown = ok(call(c, node, action=11, queue="dq-dead", msg_id=dead_id))["message"]
        assert (shown["origin_queue"], shown["origin_msg_id"], shown["dead_letter_reason"],
                shown["data"], shown["retry"]) == ("dq", msg_id, "max_deliveries", "poison", 60)
    r = call(c, m, action=11, queue="dq", msg_id=msg_id)
    assert (r["code"], r["reason"]) == (-1, "no such message")
    mon = ok(call(c, s1, action=4, queue="dq"))
    assert (mon["dead_lettered"], mon["size"], mon["waiting"]) == (1, 0, 0)
    assert ok(call(c, m, action=4, queue="dq-dead"))["dead_lettered"] == 0
    # a nack whose delay reaches past the ttl ends the retries: "expired"
    msg_id = ok(call(c, s1, action=1, queue="dq", data="old", ttl=600, retry=60))["msg_id"]
    delivery = ok(call(c, s2, action=2, queue="dq"))
    assert (delivery["msg_id"], delivery["deliveries"]) == (msg_id, 1)
    moved = ok(call(c, s2, action=9, queue="dq", msg_id=msg_id, receipt=delivery["receipt"],
                    delay=900))
    assert (moved.get("dead_lettered"), moved.get("dead_letter")) == (True, "dq-dead")
    peeked = ok(call(c, s1, action=12, queue="dq-dead", count=5))["messages"]
    assert [(p["data"], p["origin_queue"], p["origin_msg_id"], p["dead_letter_reason"])
            for p in peeked] == [("old", "dq", msg_id, "expired")]
    assert ok(call(c, s2, action=4, queue="dq"))["dead_lettered"] == 2
    for node in range(1, 4):  # replicated: every node counts the same
        wait_until(lambda n=node: (c.ask(n, action=104, queue="dq") or {})
                   .get("dead_lettered") == 2, DEADLINE_S)


# -- forwarding -------------------------------------------------------------

_TIMES = ("ready_at", "retry_at", "ttl")


def _normal(answer_: dict, queue: str) -> dict:
    """An answer with what differs between two runs on two queues made
    equal: the queue's name, times (checked to be numbers) and the epoch of
    receipts (checked to be receipts)."""
    def walk(value):
        if isinstance(value, dict):
            out = {}
            for k, v in value.items():
                if k in _TIMES:
                    assert isinstance(v, int | float) and not isinstance(v, bool), (k, v)
                    out[k] = "T" if v else 0
                elif k == "receipt":
                    assert isinstance(v, str) and RECEIPT.match(v), v
                    out[k] = "E." + v.split(".", 1)[1]
                else:
                    out[k] = walk(v)
            return out
        if isinstance(value, list):
            return [walk(v) for v in value]
        if isinstance(value, str):
            return value.replace(queue, "Q")
        return value
    return walk(answer_)


@pytest.mark.parametrize("engine", ENGINES)
def test_new_actions_through_a_slave_answer_as_on_the_master(cluster, engine):
    c = cluster(engine=engine)
    m = c.wait_master(DEADLINE_S)
    s1, _s2 = others(c, m)
    master, slave = TcpClient(c.port(m)), TcpClient(c.port(s1))

    def named(value, queue: str):
        """`value` with "@" in its strings replaced by the queue's name."""
        if isinstance(value, dict):
            return {k: named(v, queue) for k, v in value.items()}
        return value.replace("@", queue) if isinstance(value, str) else value

    def both(**fields) -> dict:
        """The same request on queue "fm" to the master and on "fs" to a
        slave: the answers must agree. Returns the master's."""
        on_master = master.request(**named({**fields, "queue": "@"}, "fm"))
        on_slave = slave.request(**named({**fields, "queue": "@"}, "fs"))
        assert _normal(on_slave, "fs") == _normal(on_master, "fm"), (fields, on_master)
        return on_master

    def receipt_of(delivery: dict, deliveries: int) -> str:
        return delivery["receipt"].rsplit(".", 1)[0] + f".{deliveries}"

    assert both(action=2, wait=31)["reason"] == "wait out of range"  # max_wait: 30
    assert both(action=5, seq=1)["config"] == {"max_deliveries": 0, "dead_letter": None, **REST}
    assert both(action=5, set={"max_deliveries": 3, "dead_letter": "@-dead"})["config"] \
        == {"max_deliveries": 3, "dead_letter": "fm-dead", **REST}
    assert both(action=5, set={"nope": 1})["reason"] == "unknown setting: nope"
    assert both(action=5, set={"max_deliveries": -1})["reason"].startswith(
        "bad value for max_deliveries")
    assert both(action=5)["config"] == {"max_deliveries": 3, "dead_letter": "fm-dead", **REST}
    assert both(action=1, data="one", retry=60)["msg_id"] == 1
    assert both(action=1, data="two", retry=60)["msg_id"] == 2
    peeked = both(action=12, count=5)["messages"]
    assert [(p["msg_id"], p["state"], p["data"]) for p in peeked] \
        == [(1, "ready", "one"), (2, "ready", "two")]
    assert both(action=11, msg_id=1)["message"]["state"] == "ready"
    assert both(action=11, msg_id=99)["reason"] == "no such message"
    assert both(action=10, msg_id=1)["reason"] == "not in flight"
    assert both(action=9, msg_id=1)["reason"] == "not in flight"

    first = both(action=2, lease=30)
    assert (first["msg_id"], first["deliveries"]) == (1, 1)
    assert both(action=10, msg_id=1, receipt=first["receipt"], lease=60)["retry_at"] \
        > time.time() + 30
    assert both(action=10, msg_id=1, receipt=receipt_of(first, 9))["reason"] == "stale receipt"
    assert both(action=10, msg_id=2, lease=5)["reason"] == "not in flight"
    assert both(action=11, msg_id=1)["message"]["state"] == "in_flight"
    # nacked with a long delay: delayed, not delivered again
    assert both(action=9, msg_id=1, receipt=first["receipt"], delay=1000)["ready_at"] \
        > time.time() + 500
    shown = both(action=11, msg_id=1)["message"]
    assert (shown["state"], shown["deliveries"], shown["nacks"]) == ("delayed", 1, 1)
    assert both(action=9, msg_id=1, receipt=first["receipt"])["reason"] in (
        "not in flight", "stale receipt")

    # message 2 delivered up to its max_deliveries (3), nacked at the limit:
    # it goes to the dead-letter queue at once
    for n in (1, 2, 3):
        delivery = both(action=2, count=1)["messages"][0]
        assert (delivery["msg_id"], delivery["deliveries"]) == (2, n)
        if n < 3:
            assert both(action=9, msg_id=2, receipt=delivery["receipt"])["ready_at"]
    moved = both(action=9, msg_id=2, receipt=delivery["receipt"])
    assert (moved.get("dead_lettered"), moved.get("dead_letter")) == (True, "fm-dead")
    assert "ready_at" not in moved
    assert both(action=11, msg_id=2)["reason"] == "no such message"
    dead = master.request(action=12, queue="fm-dead")["messages"]
    assert [(d["data"], d["origin_queue"], d["origin_msg_id"], d["dead_letter_reason"])
            for d in dead] == [("two", "fm", 2, "max_deliveries")]
    on_slave = slave.request(action=11, queue="fs-dead", msg_id=dead[0]["msg_id"])
    assert _normal(on_slave, "fs") == _normal(
        master.request(action=11, queue="fm-dead", msg_id=dead[0]["msg_id"]), "fm")
    assert ok(master.request(action=4, queue="fm"))["dead_lettered"] == 1
    assert ok(slave.request(action=4, queue="fs"))["dead_lettered"] == 1

    # confirm with a receipt, and by id
    assert both(action=9, msg_id=1, delay=0)["reason"] == "not in flight"  # still delayed
    assert both(action=3, msg_id=1)["found"] is True
    assert both(action=3, msg_id=1)["found"] is False
    assert both(action=12)["messages"] == []
