"""The fault-injection harness (tests/harness) in `make test`: a short run
per engine that must find no violation, issue 12's steps on real processes
for both engines, and the harness's own parts (the proxies, the checker, the
`<node dial raft_dial>` settings it wires the proxies in with).

The long run, with figures, is bench/fault_bench.py.
"""

from __future__ import annotations

import socket
import threading
import time

import pytest

from harness import (
    DROP,
    PASS,
    FaultCluster,
    NodeClient,
    Op,
    Outcome,
    ProxyProcess,
    RunConfig,
    check,
    format_report,
    run,
)
from harness.checker import NodeState
from harness.nemesis import Fault
from harness.workload import classify
from procs import wait_until
from qserver.config import parse_xml
from qserver.errors import ConfigError

DEADLINE_S = 60.0  # generous: CI is a shared, noisy 2-core machine


# -- the short run ------------------------------------------------------------------


@pytest.mark.parametrize("engine,fsync", [("native", "always"), ("raft", "batch")])
def test_short_fault_run_finds_no_violation(tmp_path, engine, fsync):
    cfg = RunConfig(engine=engine, fsync=fsync, duration_s=30.0, seed=12)
    report, _ = run(cfg, tmp_path, log=lambda line: None)
    text = format_report(report)
    print(text)  # shown by pytest on failure
    assert report.acked_produces > 0 and report.deliveries > 0
    assert sum(report.faults.values()) >= 3, text
    assert report.counts() == {k: 0 for k in report.counts()}, text


# -- issue 12 on real processes ---------------------------------------------------


def _until_ok(client: NodeClient, nodes: list[int], obj: dict) -> dict:
    """Send obj to each node in turn until one answers code 0."""
    end = time.monotonic() + DEADLINE_S
    k = 0
    while time.monotonic() < end:
        response, _ = client.request(nodes[k % len(nodes)], obj)
        if response is not None and response.get("code") == 0:
            return response
        k += 1
        time.sleep(0.1)
    raise AssertionError(f"{obj} not answered code 0 within {DEADLINE_S} s")


@pytest.mark.parametrize("engine", ["native", "raft"])
def test_confirm_on_a_cut_off_master_is_not_acknowledged_and_not_undone(tmp_path, engine):
    """Issue 12, steps 1-5: a message consumed on master M; M cut off from
    both slaves; the confirm on M cannot commit (the client times out); the
    confirm retried on M a quarter of a second later must not be answered
    code 0 while M is cut off. After healing, the message is delivered again
    (nothing confirmed it), and had any confirm been answered code 0 it must
    not be."""
    with FaultCluster(tmp_path, engine=engine, fsync="always") as c:
        c.start()
        m = c.wait_master(DEADLINE_S)
        slaves = [i for i in c.ids if i != m]
        client = NodeClient({i: c.ports[i].client for i in c.ids})
        try:
            produced = _until_ok(client, [m],
                                 {"action": 1, "queue": "i12", "data": "x", "retry": 5})
            got = _until_ok(client, [m], {"action": 2, "queue": "i12"})
            assert got["data"] == "x" and produced["msg_id"] > 0
            msg_id = got["msg_id"]

            c.set_cuts({(m, s) for s in slaves} | {(s, m) for s in slaves})
            confirm = {"action": 3, "queue": "i12", "msg_id": msg_id}
            # The client gives up quickly, before M can notice it lost its
            # slaves, and retries 0.25 s later, as issue 12's client did.
            first, _ = client.request(m, confirm, timeout_s=0.3)
            time.sleep(0.25)
            second, _ = client.request(m, confirm, timeout_s=3.0)
            acked = [a for a in (first, second) if a is not None and a.get("code") == 0]
            wrong = []  # gathered, so that a failure shows the whole story
            if first is not None and first.get("code") == 0:
                wrong.append(f"a confirm was acknowledged by a master cut off from both "
                             f"slaves: {first}")
            if second is not None and second.get("code") == 0:
                wrong.append(f"the retried confirm was answered code 0 by the cut-off master: "
                             f"{second}")

            # The slaves elect a new master while M is cut off (step 5).
            c.wait_master(DEADLINE_S, ids=slaves)
            c.heal_links()
            new = c.wait_master(DEADLINE_S)
            # Wait until the message is no longer in flight (its retry ran out,
            # or it is gone), then look for it.
            wait_until(lambda: (c.ask(new, action=4, queue="i12") or {}).get("in_flight") == 0,
                       DEADLINE_S, 0.2)
            again = _until_ok(client, c.ids, {"action": 2, "queue": "i12"})
            if acked and again.get("msg_id") == msg_id:
                wrong.append(f"message {msg_id} delivered again after its confirm was "
                             f"acknowledged: {again}")
            if not acked and again.get("msg_id") != msg_id:  # nothing confirmed it
                wrong.append(f"message {msg_id} lost: {again}")
            assert not wrong, "; ".join(wrong)
        finally:
            client.close()


# -- the harness's parts --------------------------------------------------------------


@pytest.fixture
def echo_server():
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen()
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            try:
                conn, _ = srv.accept()
            except OSError:
                return
            threading.Thread(target=echo, args=(conn,), daemon=True).start()

    def echo(conn: socket.socket) -> None:
        with conn:
            try:
                while data := conn.recv(4096):
                    conn.sendall(data)
            except OSError:
                pass

    threading.Thread(target=serve, daemon=True).start()
    yield srv.getsockname()
    stop.set()
    srv.close()


def _connect_to(port: int) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    s.settimeout(10)
    return s


def _closed_by_proxy(s: socket.socket) -> bool:
    try:
        return s.recv(16) == b""
    except ConnectionResetError:
        return True


def _refused(port: int) -> bool:
    """A new connection is reset by the proxy: at once (its connect may see
    the reset on a loaded machine) or at the first read."""
    try:
        s = _connect_to(port)
    except ConnectionResetError:
        return True
    try:
        return _closed_by_proxy(s)
    finally:
        s.close()


def test_proxy_passes_drops_and_resets(echo_server):
    proxy = ProxyProcess()
    opened: list[socket.socket] = []

    def _connect(port: int) -> socket.socket:  # closed at the end, whatever happens
        s = _connect_to(port)
        opened.append(s)
        return s

    try:
        port = proxy.add("l", echo_server)
        a = _connect(port)
        a.sendall(b"one")
        assert a.recv(16) == b"one"

        proxy.set(["l"], fwd=DROP)  # the dialer's bytes vanish; the connection stays
        a.sendall(b"lost")
        wait_until(lambda: proxy.stats()["l"]["fwd_dropped"] == 4)
        # healed: a stream with a hole in it is reset, never passed on
        proxy.set(["l"], fwd=PASS)
        assert _closed_by_proxy(a)
        b = _connect(port)
        b.sendall(b"two")
        assert b.recv(16) == b"two"

        proxy.set(["l"], back=DROP)  # one way: the request arrives, the answer does not
        b.sendall(b"three")
        wait_until(lambda: proxy.stats()["l"]["back_dropped"] == 5)
        # (the counters of both directions are updated by separate tasks)
        wait_until(lambda: proxy.stats()["l"]["fwd_passed"] == len(b"onetwothree"))

        proxy.set(["l"], back=PASS, refuse=True)  # reset existing and new connections
        assert _closed_by_proxy(b)
        assert _refused(port)

        proxy.set(["l"], refuse=False, fwd=DROP, back=DROP)  # a new connection is held
        c = _connect(port)
        c.sendall(b"held")
        wait_until(lambda: proxy.stats()["l"]["held"] == 1 and
                   proxy.stats()["l"]["fwd_dropped"] == 8)
        proxy.set(["l"], fwd=PASS, back=PASS)
        assert _closed_by_proxy(c)
        d = _connect(port)
        d.sendall(b"four")
        assert d.recv(16) == b"four"
    finally:
        for s in opened:
            s.close()
        proxy.close()
    assert proxy.proc.returncode == 0


def _op(**kw) -> Op:
    base = dict(op_id=1, attempt=1, worker="w", node=1, queue="q", t_invoke=0.0,
                t_complete=0.1, outcome=Outcome.OK)
    base.update(kw)
    return Op(**base)


def _same_states() -> list[NodeState]:
    st = {"commit_id": 9, "applied_id": 9}
    return [NodeState(node_id=i, when="drained", status=st, queues={"q": {"size": 0, "max_id": 3}})
            for i in (1, 2, 3)]


def _check(ops, states=None, drained=True):
    return check(ops, [Fault(kind="split", t_start=0.5, t_end=1.0, nodes=(1,), detail="",
                             recovered_s=0.1)],
                 _same_states() if states is None else states,
                 engine="native", fsync="always", seed=0, duration_s=1.0, drained=drained)


def test_checker_finds_each_kind_of_violation():
    ok = [
        _op(kind="produce", data="w:1:r5", retry=5, msg_id=1, t_invoke=0.0, t_complete=0.1),
        _op(kind="consume", data="w:1:r5", msg_id=1, t_invoke=0.2, t_complete=0.3),
        _op(kind="confirm", msg_id=1, t_invoke=0.4, t_complete=0.5),
    ]
    r = _check(ok)
    assert r.ok, format_report(r)

    lost = [_op(kind="produce", data="w:2:r5", retry=5, msg_id=2)]
    assert _check(lost).counts()["lost"] == 1
    # retry=0, and a consume whose answer was lost came after it: maybe taken
    maybe = [_op(kind="produce", data="w:2:r0", retry=0, msg_id=2, t_invoke=0.0),
             _op(kind="consume", outcome=Outcome.UNKNOWN, t_invoke=1.0, t_complete=4.0)]
    r = _check(maybe)
    assert r.counts()["lost"] == 0 and r.unverifiable == 1

    dup = [_op(kind="produce", data="w:3:r0", retry=0, msg_id=3),
           _op(kind="consume", data="w:3:r0", msg_id=3, t_invoke=1.0),
           _op(kind="consume", data="w:3:r0", msg_id=3, t_invoke=2.0)]
    assert _check(dup).counts()["dup_retry0"] == 1

    after = ok + [_op(kind="consume", data="w:1:r5", msg_id=1, t_invoke=0.6, t_complete=0.7)]
    assert _check(after).counts()["delivered_after_confirm"] == 1
    concurrent = ok + [_op(kind="consume", data="w:1:r5", msg_id=1, t_invoke=0.45, t_complete=0.7)]
    assert _check(concurrent).counts()["delivered_after_confirm"] == 0

    phantom = [_op(kind="consume", data="never sent", msg_id=7)]
    assert _check(phantom).counts()["phantom"] == 1

    conflict = ok + [_op(kind="consume", data="w:9:r5", msg_id=1, t_invoke=0.3),
                     _op(kind="produce", data="w:9:r5", retry=5, outcome=Outcome.UNKNOWN)]
    assert _check(conflict).counts()["id_conflict"] == 2  # vs the produce, and two data

    failed = [_op(kind="produce", data="w:4:r0", retry=0, outcome=Outcome.FAIL, reason="no leader"),
              _op(kind="consume", data="w:4:r0", msg_id=4, t_invoke=1.0)]
    assert _check(failed).counts()["failed_applied"] == 1

    diverged = _same_states()
    diverged[2] = NodeState(node_id=3, when="drained", status={"commit_id": 8, "applied_id": 8},
                            queues={"q": {"size": 1, "max_id": 3}})
    assert _check(ok, diverged).counts()["divergence"] == 2
    assert _check(ok, drained=False).counts()["drain_incomplete"] == 1


def test_checker_measures_the_longest_write_gap_of_each_fault_kind():
    ops = [_op(kind="produce", data=f"w:{k}:r0", retry=0, msg_id=k, t_invoke=t - 0.01,
               t_complete=t) for k, t in enumerate([0.1, 0.2, 0.3, 2.0, 2.1], start=1)]
    ops += [_op(kind="consume", data=f"w:{k}:r0", msg_id=k, t_invoke=3.0 + k, phase="drain")
            for k in range(1, 6)]
    r = _check(ops)
    gaps = {a.kind: a.max_gap_s for a in r.availability}
    # the split (0.5 to 1.0): no write from 0.5 until 2.0, the first after it healed
    assert gaps["split"] == pytest.approx(1.5)
    assert r.ok, format_report(r)


def test_answers_are_classified_conservatively():
    assert classify({"code": 0}, True)[0] is Outcome.OK
    assert classify({"code": -1, "reason": "no leader"}, True)[0] is Outcome.FAIL
    assert classify(None, False)[0] is Outcome.FAIL  # never sent
    assert classify(None, True)[0] is Outcome.UNKNOWN  # sent, no answer
    for reason in ("forward timeout; outcome unknown", "master unreachable; outcome unknown",
                   "master changed before the write committed; outcome unknown", "anything else"):
        assert classify({"code": -1, "reason": reason}, True)[0] is Outcome.UNKNOWN


# -- the settings the harness wires the proxies in with ---------------------------------


def _cluster_xml(node2_attrs: str) -> str:
    return ('<config><node_info node_id="1" port="2000"/><cluster>'
            '<node id="1" port="3001"/>'
            f'<node id="2" port="3002" {node2_attrs}/>'
            '<node id="3" port="3003"/></cluster></config>')


def test_dial_and_raft_dial_name_where_a_node_is_reached():
    cfg = parse_xml(_cluster_xml('dial="127.0.0.1:4002" raft_dial="10.0.0.2:5002"'), "n.xml")
    two = cfg.peers[1]
    assert (two.host, two.port) == ("127.0.0.1", 3002)  # its identity is unchanged
    assert two.dial_address == ("127.0.0.1", 4002)
    assert two.raft_dial == ("10.0.0.2", 5002)
    assert cfg.peers[0].dial_address == ("127.0.0.1", 3001)  # default: where it listens
    assert cfg.peers[0].raft_dial is None


@pytest.mark.parametrize("value", ["x", "127.0.0.1:", ":80", "a b:1", "h:port", "h:70000"])
def test_a_bad_dial_address_is_named(value):
    for attr in ("dial", "raft_dial"):
        with pytest.raises(ConfigError) as exc:
            parse_xml(_cluster_xml(f'{attr}="{value}"'), "n.xml")
        text = str(exc.value)
        assert "n.xml" in text and "<cluster/node>" in text and attr in text
