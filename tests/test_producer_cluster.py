"""Producer and queue controls (issue 15) on real three-node clusters, once
per engine: a produce with a dedup_id (single and batch) acknowledged,
then resent after kill -9 of the master and after a full restart from the
data directories (every node killed at once, the log compacted so that the
dedup table comes back from a snapshot): `duplicate: true`, the first
produce's msg_id, exactly one message stored; the queue settings
(paused, max_size, dedup_window) surviving the same failover and restart;
and every new request (batch produce, dedup, priorities, pause, clear,
config, the XML queue defaults, their bad values) sent to a slave
answering exactly as on the master.

Requests are raw JSON over TCP (procs.TcpClient), one connection per
request, so that a node that dies takes no client with it. Nothing here
asserts how fast anything is; waits are on conditions with deadlines of
tens of seconds (CI is a shared, noisy 2-core machine).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from procs import Cluster, TcpClient, wait_until

DEADLINE_S = 30.0
ENGINES = ["native", "raft"]

# A small log: both engines compact it (a snapshot of the store, dedup
# tables included) after a few dozen entries.
SMALL_LOG = '  <queue_config log_size="20"/>\n'


@pytest.fixture
def cluster(tmp_path):
    """Start a cluster (Cluster's keywords); every one is killed at the end."""
    clusters: list[Cluster] = []

    def make(*, storage: bool = False, **kw: Any) -> Cluster:
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

    c.config_path = config_path  # type: ignore[method-assign]


def others(c: Cluster, node_id: int) -> list[int]:
    return [i for i in range(1, c.n + 1) if i != node_id]


def call(c: Cluster, node_id: int, **fields: Any) -> dict:
    """One request to one node on a fresh connection; its answer."""
    client = TcpClient(c.port(node_id))
    client.sock.settimeout(DEADLINE_S)
    try:
        return client.request(**fields)
    finally:
        client.close()


def ok(r: dict) -> dict:
    assert r.get("code") == 0 and "reason" not in r, r
    return r


def resend(c: Cluster, node_id: int, **fields: Any) -> dict:
    """A producer's retry loop: send until the answer is code 0 (a node
    that has just restarted may answer "no leader" or "outcome unknown"
    for a moment; resending a dedup produce is always safe)."""
    answers: list[dict] = []

    def answered() -> dict | None:
        got = c.ask(node_id, **fields)
        if got is not None:
            answers.append(got)
        return got if got is not None and got.get("code") == 0 else None

    try:
        return wait_until(answered, DEADLINE_S, step_s=0.2)
    except AssertionError:
        raise AssertionError(f"no code 0 before the deadline: {answers[-3:]}") from None


def serving_master(c: Cluster, alive: list[int] | None = None) -> int:
    """The master every live node agrees on, once it has committed a write."""
    m = c.wait_master(DEADLINE_S, alive=alive)
    wait_until(lambda: (c.ask(m, action=1, queue="probe", data="p") or {}).get("code") == 0,
               DEADLINE_S)
    return m


def local(c: Cluster, node_id: int, queue: str) -> dict:
    """A node's own view of a queue (104): {} while it does not answer."""
    return c.ask(node_id, action=104, queue=queue) or {}


def data_of(c: Cluster, node_id: int, queue: str) -> list[tuple[int, str]]:
    """(msg_id, data) of every message a consume could deliver now, by peek."""
    got = ok(call(c, node_id, action=12, queue=queue, count=1000))["messages"]
    return sorted((m["msg_id"], m["data"]) for m in got)


def compacted(c: Cluster, node_id: int, engine: str, trans_id: int) -> bool:
    """Whether the node's log no longer holds entry `trans_id` alone: the
    native engine took a snapshot at or past it; PySyncObj (which reports
    no snapshot) keeps fewer entries than were appended since."""
    info = c.ask(node_id, action=104) or {}
    if engine == "native":
        return (info.get("snapshot") or {}).get("snapshot_id", 0) >= trans_id
    return 0 < info.get("log_size", 0) < info.get("trans_id", 0) - trans_id


# -- dedup and settings across kill -9 of the master and a full restart ------------

SINGLE = {"action": 1, "queue": "dd", "data": "order one", "dedup_id": "order-1", "retry": 60}
BATCH = {"action": 1, "queue": "dd", "messages": [
    {"data": "b1", "dedup_id": "batch-1"}, {"data": "b2", "dedup_id": "batch-2"},
    {"data": "b3", "dedup_id": "batch-3", "priority": 5}]}
HELD = {"max_deliveries": 0, "dead_letter": None, "max_size": 3, "dedup_window": 120,
        "paused": "out"}
SHUT = {"max_deliveries": 0, "dead_letter": None, "max_size": 1_000_000, "dedup_window": 0.5,
        "paused": "in"}


def check_after_failure(c: Cluster, master: int, via: list[int], ids: dict[str, Any]) -> None:
    """The dedup produces, resent through each node of `via`, are
    duplicates of what was stored once; the settings are in force."""
    for node in via:
        got = resend(c, node, **SINGLE, seq=node)
        assert got == {"action": 1, "queue": "dd", "dedup_id": "order-1", "seq": node,
                       "code": 0, "msg_id": ids["single"], "duplicate": True}, got
        got = resend(c, node, **BATCH)
        assert (got["msg_ids"], got["duplicates"]) == (ids["batch"], [0, 1, 2]), got
    expected = sorted([(ids["single"], "order one")]
                      + list(zip(ids["batch"], ("b1", "b2", "b3"), strict=True)))
    assert data_of(c, master, "dd") == expected
    assert ok(call(c, master, action=4, queue="dd"))["size"] == 4
    # the settings: read back, and in force
    assert ok(call(c, via[0], action=5, queue="held"))["config"] == HELD
    assert ok(call(c, via[-1], action=5, queue="shut"))["config"] == SHUT
    got = call(c, via[0], action=2, queue="held")
    assert (got["code"], "msg_id" in got) == (0, False), got  # paused out
    got = call(c, via[-1], action=1, queue="shut", data="x")
    assert (got["code"], got.get("reason")) == (-1, "queue paused"), got
    # every node holds the same (its own view, 104)
    for node in range(1, c.n + 1):
        if c.nodes[node].proc.poll() is None:
            wait_until(lambda n=node: (local(c, n, "dd").get("size"),
                                       local(c, n, "held").get("paused"),
                                       local(c, n, "held").get("max_size"),
                                       local(c, n, "shut").get("paused"))
                       == (4, "out", 3, "in"), DEADLINE_S)


@pytest.mark.parametrize("engine", ENGINES)
def test_dedup_and_settings_survive_kill_of_the_master_and_a_full_restart(cluster, engine):
    c = cluster(engine=engine, storage=True, extra=SMALL_LOG)
    m = serving_master(c)
    s1, s2 = others(c, m)

    # settings: "held" takes produces up to 3 but delivers nothing; "shut"
    # takes no produce
    assert ok(call(c, s1, action=5, queue="held",
                   set={"max_size": 3, "dedup_window": 120, "paused": "out"}))["config"] == HELD
    assert ok(call(c, m, action=5, queue="shut",
                   set={"dedup_window": 0.5, "paused": "in"}))["config"] == SHUT
    held = [ok(call(c, m, action=1, queue="held", data=f"h{i}"))["msg_id"] for i in range(2)]
    assert held == [1, 2]

    # the acknowledged produces with dedup ids (through a slave, and on the master)
    first = ok(call(c, s2, **SINGLE, seq="first"))
    assert (first["duplicate"], first["seq"]) == (False, "first")
    batch = ok(call(c, m, **BATCH))
    assert batch["duplicates"] == []
    ids = {"single": first["msg_id"], "batch": batch["msg_ids"]}
    assert len({ids["single"], *ids["batch"]}) == 4
    # every node compacts its log past them: what follows starts from a snapshot
    mark = ok(call(c, m, action=104))["trans_id"]
    for i in range(60):
        ok(call(c, m, action=1, queue="filler", data=f"f{i}"))
    for node in (m, s1, s2):
        wait_until(lambda n=node: compacted(c, n, engine, mark), DEADLINE_S)

    # kill -9 of the master: the new one recognises every resend
    c.kill(m)
    m2 = serving_master(c, alive=[s1, s2])
    slave = s1 if m2 == s2 else s2
    check_after_failure(c, m2, [slave, m2], ids)
    # max_size in force on the new master: one more fits
    assert ok(call(c, slave, action=1, queue="held", data="h2"))["msg_id"] == 3
    got = call(c, m2, action=1, queue="held", data="h3")
    assert (got["code"], got.get("reason")) == (-1, "queue full: held"), got

    # a full restart from the data directories: every node killed at once
    for node in c.nodes.values():
        node.proc.kill()
    for node in c.nodes.values():
        node.stop()
    c.start_all()
    m3 = serving_master(c)
    check_after_failure(c, m3, others(c, m3) + [m3], ids)
    got = call(c, m3, action=1, queue="held", data="h3")
    assert (got["code"], got.get("reason")) == (-1, "queue full: held"), got
    # resumed: the held messages come out in order, and the queue takes more
    assert ok(call(c, others(c, m3)[0], action=5, queue="held", set={"paused": "none"})
              )["config"] == dict(HELD, paused="none")
    got = ok(call(c, m3, action=2, queue="held", count=10))["messages"]
    assert [(g["msg_id"], g["data"]) for g in got] == [(1, "h0"), (2, "h1"), (3, "h2")]
    assert ok(call(c, m3, action=1, queue="held", data="h4"))["msg_id"] == 4
    # a dedup id still recognised after all that, and new ones are not
    got = ok(call(c, m3, action=1, queue="dd", data="new", dedup_id="order-2"))
    assert (got["msg_id"], got["duplicate"]) == (max(ids["batch"]) + 1, False)


# -- forwarding: a slave answers as the master does ----------------------------------

_TIMES = ("ready_at", "retry_at", "ttl")


def _normal(value: Any, queue: str) -> Any:
    """An answer with the queue's name made "Q" (in keys too: a virtual
    queue's msg_ids) and times checked to be numbers then made equal."""
    if isinstance(value, dict):
        out = {}
        for k, v in value.items():
            if k in _TIMES:
                assert isinstance(v, int | float) and not isinstance(v, bool), (k, v)
                out[k] = "T" if v else 0
            else:
                out[k.replace(queue, "Q")] = _normal(v, queue)
        return out
    if isinstance(value, list):
        return [_normal(v, queue) for v in value]
    if isinstance(value, str):
        return value.replace(queue, "Q")
    return value


def _named(value: Any, queue: str) -> Any:
    """`value` with "@" in its strings (and keys) replaced by `queue`."""
    if isinstance(value, dict):
        return {k.replace("@", queue): _named(v, queue) for k, v in value.items()}
    if isinstance(value, list):
        return [_named(v, queue) for v in value]
    return value.replace("@", queue) if isinstance(value, str) else value


# Each side has its own queues: "fm..." asked of the master, "fs..." of a
# slave; a virtual queue and XML defaults for each.
FORWARD_EXTRA = "".join(
    f'  <virtual_queue name="{s}-v"><queue name="{s}-va"/><queue name="{s}-vb"/>'
    f'</virtual_queue>\n'
    f'  <queue name="{s}-d" max_size="4" dedup_window="60" max_deliveries="2"/>\n'
    for s in ("fm", "fs"))


@pytest.mark.parametrize("engine", ENGINES)
def test_producer_controls_through_a_slave_answer_as_on_the_master(cluster, engine):
    c = cluster(engine=engine, extra=FORWARD_EXTRA)
    m = c.wait_master(DEADLINE_S)
    s1, _s2 = others(c, m)
    master, slave = TcpClient(c.port(m)), TcpClient(c.port(s1))
    master.sock.settimeout(DEADLINE_S)
    slave.sock.settimeout(DEADLINE_S)

    def both(**fields: Any) -> dict:
        """The same request (queue "@" unless given) on "fm" to the master
        and on "fs" to a slave: the answers must agree. Returns the
        master's, with "fm" as "Q"."""
        fields.setdefault("queue", "@")
        on_master = master.request(**_named(fields, "fm"))
        on_slave = slave.request(**_named(fields, "fs"))
        assert _normal(on_slave, "fs") == _normal(on_master, "fm"), (fields, on_master,
                                                                     on_slave)
        return _normal(on_master, "fm")

    # single produce with priority and dedup_id, and the resend
    assert both(action=1, data="low", priority=9, seq=1) == {
        "action": 1, "queue": "Q", "priority": 9, "seq": 1, "code": 0, "msg_id": 1}
    assert both(action=1, data="d", dedup_id="k", seq=2) == {
        "action": 1, "queue": "Q", "dedup_id": "k", "seq": 2, "code": 0, "msg_id": 2,
        "duplicate": False}
    assert both(action=1, data="d", dedup_id="k", seq=3)["duplicate"] is True
    # batch produce: ids in input order, duplicates (of the table and in the batch)
    got = both(action=1, seq=4, retry=30, messages=[
        {"data": "urgent", "priority": 0}, {"data": "dup", "dedup_id": "k"},
        {"data": "x", "dedup_id": "z"}, {"data": "x2", "dedup_id": "z"}, {"data": "plain"}])
    assert got == {"action": 1, "queue": "Q", "seq": 4, "code": 0,
                   "msg_ids": [3, 2, 4, 4, 5], "duplicates": [1, 3]}
    assert both(action=1, messages=[{"data": "again", "dedup_id": "z"}])["duplicates"] == [0]
    # priorities: lowest first, then in order
    got = both(action=2, count=10)["messages"]
    assert [(g["msg_id"], g["data"]) for g in got] == [
        (3, "urgent"), (1, "low"), (2, "d"), (4, "x"), (5, "plain")]

    # virtual queues: every created message named
    got = both(action=1, queue="@-v", messages=[{"data": "v1"}, {"data": "v2",
                                                                  "dedup_id": "vk"}])
    assert (got["msg_ids"], got["duplicates"]) == (
        [{"Q-va": 1, "Q-vb": 1}, {"Q-va": 2, "Q-vb": 2}], [])
    got = both(action=1, queue="@-v", data="v2", dedup_id="vk")
    assert (got["msg_id"], got["msg_ids"], got["duplicate"]) == (2, {"Q-va": 2, "Q-vb": 2},
                                                                 True)

    # config: set and read; the XML defaults; bad values
    settings = {"max_deliveries": 0, "dead_letter": None, "max_size": 1_000_000,
                "dedup_window": 300, "paused": "none"}
    assert both(action=5)["config"] == settings
    assert both(action=5, queue="@-d")["config"] == dict(settings, max_size=4, dedup_window=60,
                                                         max_deliveries=2)
    assert both(action=5, queue="@-d", set={"max_size": 6, "paused": "out"})["config"] == dict(
        settings, max_size=6, dedup_window=60, max_deliveries=2, paused="out")
    assert both(action=5, set={"max_size": 2, "dedup_window": 1.5, "paused": "in"})[
        "config"] == dict(settings, max_size=2, dedup_window=1.5, paused="in")
    assert both(action=5)["config"]["paused"] == "in"
    assert both(action=5, set={"paused": "sideways"})["reason"] == (
        "bad value for paused: must be one of none, in, out, all")
    assert both(action=5, set={"max_size": -1})["reason"].startswith("bad value for max_size")
    assert both(action=5, set={"dedup_window": 10**7})["reason"].startswith(
        "bad value for dedup_window")
    assert both(action=5, set={"pause": "in"})["reason"] == "unknown setting: pause"
    assert both(action=5, queue="@-v", set={"paused": "in"})["reason"] == (
        "virtual queue only takes produce")
    assert both(action=5)["config"] == dict(settings, max_size=2, dedup_window=1.5, paused="in")

    # paused in: every form of produce refused; out: nothing delivered
    for fields in ({"data": "x"}, {"data": "x", "dedup_id": "p"},
                   {"messages": [{"data": "x"}]}):
        got = both(action=1, seq=5, **fields)
        assert (got["code"], got["reason"], got["seq"]) == (-1, "queue paused", 5)
    assert both(action=1, queue="@-d", data="kept")["msg_id"] == 1
    assert both(action=2, queue="@-d") == {"action": 2, "queue": "Q-d", "code": 0}
    assert both(action=12, queue="@-d")["messages"] == []
    # monitor (its node fields differ from one request to the next: not compared)
    for client, name in ((master, "fm-d"), (slave, "fs-d")):
        mon = ok(client.request(action=4, queue=name))
        assert (mon["paused"], mon["max_size"], mon["size"]) == ("out", 6, 1)
    assert ok(slave.request(action=104, queue="fs-d"))["paused"] == "out"

    # clear
    assert both(action=6, queue="@-d", seq=7) == {"action": 6, "queue": "Q-d", "seq": 7,
                                                   "code": 0, "cleared": 1}
    assert both(action=6, queue="@-none") == {"action": 6, "queue": "Q-none", "code": 0,
                                               "cleared": 0}
    assert both(action=6, queue="@-v")["reason"] == "virtual queue only takes produce"
    assert both(action=6, queue="@-va")["cleared"] == 2
    got = both(action=1, queue="@-v", data="v2", dedup_id="vk")  # the table stays
    assert (got["msg_ids"], got["duplicate"]) == ({"Q-va": 2, "Q-vb": 2}, True)
    assert both(action=1, queue="@-va", data="next")["msg_id"] == 3  # ids never repeat

    # bad inputs of the new fields, through the slave too
    for fields, reason in (
            ({"data": "x", "priority": -1}, "priority must be an integer from 0 to 2147483647"),
            ({"data": "x", "dedup_id": ""}, "dedup_id must be a string of 1 to 128 characters"),
            ({"messages": []}, "messages must be a list of 1 to 1000 messages"),
            ({"messages": [{"data": "a"}, 5]}, "messages[1]: must be an object"),
            ({"messages": [{"data": "a", "priority": 1.5}]},
             "messages[0]: priority must be an integer from 0 to 2147483647"),
            ({"messages": [{"data": "a"}], "dedup_id": "k"},
             "dedup_id goes on each message of a batch"),
            ({"messages": [{"data": "a", "delay": 100, "ttl": 50}]}, "messages[0]: time error")):
        got = both(action=1, queue="@-va", seq=8, **fields)
        assert (got["code"], got["reason"], got["seq"]) == (-1, reason, 8), got
    assert [m["msg_id"] for m in both(action=12, queue="@-va", count=10)["messages"]] == [3]
    master.close()
    slave.close()
