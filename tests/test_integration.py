"""A real `qserver run` process, spoken to over TCP and UDP on loopback."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time

import pytest

from procs import TcpClient, UdpClient, wait_until

# Slack for the retry scenario: time moves on between requests on a busy box.
RETRY_S = 2


def test_produce_consume_confirm_over_tcp(node):
    c = TcpClient(node.port)
    r = c.request(action=1, queue="q", data="hello", seq=42)
    assert r["code"] == 0 and r["msg_id"] == 1 and r["seq"] == 42
    assert "data" not in r
    r = c.request(action=2, queue="q", seq=43)
    # at-most-once (no retry): deleted as delivered, no receipt
    assert r == {"action": 2, "queue": "q", "seq": 43, "code": 0, "msg_id": 1, "data": "hello",
                 "deliveries": 1}
    assert c.request(action=2, queue="q") == {"action": 2, "queue": "q", "code": 0}
    assert c.request(action=3, queue="q", msg_id=1) == {"action": 3, "queue": "q", "msg_id": 1,
                                                        "code": 0, "found": False}
    mon = c.request(action=4, queue="q")
    assert mon["size"] == 0 and mon["max_id"] == 1 and mon["trans_id"] == 2
    assert mon["node_id"] == 1 and mon["leader_node_id"] == 1


def test_produce_consume_confirm_over_udp(node):
    u = UdpClient(node.port)
    r = u.request(action=1, queue="uq", data="x" * 1000, retry=30, seq=1)
    assert r["code"] == 0 and r["msg_id"] == 1 and r["seq"] == 1
    r = u.request(action=2, queue="uq", seq=2)
    assert r["msg_id"] == 1 and r["data"] == "x" * 1000
    assert u.request(action=3, queue="uq", msg_id=1)["code"] == 0
    assert u.request(action=4, queue="uq")["size"] == 0
    lst = u.request(action=7, pattern="u")
    assert lst["queue_count"] == 1 and lst["queue_list"][0]["name"] == "uq"
    leader = u.request(action=8)
    assert leader["leader_node_id"] == 1 and leader["leader_port"] == node.port


def test_queue_server_client_scenario(node):
    """queue_server's PHP client flow: produce with retry 2 s and ttl 10 s;
    consume gets it; at once nothing; after the retry it comes back; confirm;
    nothing after."""
    c = TcpClient(node.port)
    now = int(time.time())
    r = c.request(action=1, queue="order", data='{"title":"order"}', delay=now,
                  retry=RETRY_S, ttl=now + 10)
    msg_id = r["msg_id"]
    first = c.request(action=2, queue="order")
    consumed_at = time.monotonic()
    assert first["msg_id"] == msg_id and first["data"] == '{"title":"order"}'
    assert "msg_id" not in c.request(action=2, queue="order")
    again = wait_until(lambda: c.request(action=2, queue="order").get("msg_id"))
    assert again == msg_id
    assert time.monotonic() - consumed_at >= RETRY_S - 0.05
    assert c.request(action=3, queue="order", msg_id=msg_id)["code"] == 0
    time.sleep(RETRY_S + 0.5)  # past the next retry deadline: still nothing
    assert "msg_id" not in c.request(action=2, queue="order")
    assert c.request(action=4, queue="order")["size"] == 0


def test_pipelined_requests_answered_in_order(node):
    c = TcpClient(node.port)
    reqs = [{"action": 1, "queue": "p", "data": str(i), "seq": i} for i in range(200)]
    c.send_raw(b"".join(json.dumps(r).encode() for r in reqs))  # no separators at all
    answers = [c.read() for _ in reqs]
    assert [a["seq"] for a in answers] == list(range(200))
    assert [a["msg_id"] for a in answers] == list(range(1, 201))
    # consume them all in one write, newline separated
    c.send_raw(b"\n".join(json.dumps({"action": 2, "queue": "p", "seq": i}).encode()
                          for i in range(200)) + b"\n")
    got = [c.read() for _ in range(200)]
    assert [g["data"] for g in got] == [str(i) for i in range(200)]


def test_request_split_across_writes(node):
    c = TcpClient(node.port)
    raw = json.dumps({"action": 1, "queue": "split", "data": "a\"}{b", "seq": 5}).encode()
    for i in range(len(raw)):
        c.send_raw(raw[i:i + 1])
    r = c.read()
    assert r["code"] == 0 and r["seq"] == 5
    assert c.request(action=2, queue="split")["data"] == "a\"}{b"


def test_virtual_queue_names_every_message(procs, tmp_path):
    extra = '<virtual_queue name="fan"><queue name="a"/><queue name="b"/></virtual_queue>\n'
    node = procs(tmp_path, extra)
    c = TcpClient(node.port)
    c.request(action=1, queue="b", data="pre")  # b's ids run ahead of a's
    r = c.request(action=1, queue="fan", data="both")
    assert r["code"] == 0
    assert r["msg_ids"] == {"a": 1, "b": 2}
    assert r["msg_id"] == 1
    assert c.request(action=2, queue="a")["data"] == "both"
    assert c.request(action=2, queue="b")["data"] == "pre"
    assert c.request(action=2, queue="b")["data"] == "both"
    assert c.request(action=2, queue="fan")["reason"] == "virtual queue only takes produce"


BAD_REQUESTS = [
    (b'{"action":1,"queue":"bad","data":5}', "data must be a string"),
    (b'[1,2,3]', "request must be a JSON object"),
    (b'{"queue":"bad"}', "missing field: action"),
    (b'{"action":"1","queue":"bad"}', "action must be an integer"),
    (b'{"action":77}', "invalid action"),
    (b'{"action":1,"queue":"","data":"x"}', "queue must not be empty"),
    (b'{"action":1,"queue":"bad","data":"x","retry":-1}', "retry must not be negative"),
    (b'{"action":1,"queue":"bad","data":"x","delay":100,"ttl":50}', "time error"),
    (b'{"action":2}', "missing field: queue"),
    (b'{"action":3,"queue":"bad","msg_id":"x"}', "msg_id must be an integer"),
    (b'{"action":5,"queue":"bad","set":{"colour":1}}', "unknown setting: colour"),
    (b'{"action":5,"queue":"bad","set":{"dead_letter":"bad"}}',
     "bad value for dead_letter: a queue cannot be its own dead-letter queue"),
    (b'{"action":6}', "missing field: queue"),
    (b'{"action":2,"queue":"bad","count":0}', "count must be an integer from 1 to 1000"),
    (b'{"action":2,"queue":"bad","wait":31}', "wait out of range"),  # max_wait 30 s
    (b'{"action":2,"queue":"bad","lease":0}', "lease must be positive"),
    (b'{"action":2,"queues":["bad","bad"]}', "queues names a queue twice"),
    (b'{"action":3,"queue":"bad","msg_id":1,"receipt":"1.1.1"}', "stale receipt"),
    (b'{"action":9,"queue":"bad","msg_id":1}', "not in flight"),
    (b'{"action":10,"queue":"bad","msg_id":1,"lease":-1}', "lease must be positive"),
    (b'{"action":11,"queue":"bad","msg_id":1}', "no such message"),
    (b'{"action":1,,}', "invalid json"),
    # deeper than an answer (which echoes the fields) can be written: refused
    # before it is carried out, not stored with an answer that cannot go
    (b'{"action":1,"queue":"bad","data":"x","seq":' + b"[" * 300 + b"]" * 300 + b"}",
     "request nests deeper than 253 levels"),
]


@pytest.mark.parametrize("proto", ["tcp", "udp"])
def test_bad_requests_get_reasons_and_nothing_is_lost(node, proto):
    keeper = TcpClient(node.port)
    kept = keeper.request(action=1, queue="keep", data="precious", retry=60)
    client = TcpClient(node.port) if proto == "tcp" else UdpClient(node.port)
    for raw, reason in BAD_REQUESTS:
        if proto == "tcp":
            client.send_raw(raw)
            r = client.read()
        else:
            r = client.send_raw(raw)
        assert r["code"] == -1, raw
        assert r["reason"] == reason, raw
    # the same connection (TCP) keeps working after request-level errors
    assert client.request(action=1, queue="ok", data="y")["code"] == 0
    # nothing stored was disturbed, nothing was created by the bad requests
    assert keeper.request(action=4, queue="keep")["size"] == 1
    names = [q["name"] for q in keeper.request(action=7)["queue_list"]]
    assert "bad" not in names
    got = keeper.request(action=2, queue="keep")
    assert got["msg_id"] == kept["msg_id"] and got["data"] == "precious"


def test_garbage_stream_answered_then_closed(node):
    other = TcpClient(node.port)
    other.request(action=1, queue="g", data="survives")
    c = TcpClient(node.port)
    c.send_raw(b"this is not json")
    r = c.read()
    assert r == {"code": -1, "reason": "invalid json"}
    assert c.closed_by_server()
    assert other.request(action=2, queue="g")["data"] == "survives"


def test_udp_garbage_and_oversized(node):
    u = UdpClient(node.port)
    assert u.send_raw(b"\xff\xfe garbage")["reason"] == "invalid json"
    assert u.send_raw(b"")["reason"] == "invalid json"
    assert u.request(action=1, queue="u", data="fine")["code"] == 0


def test_oversized_tcp_request(procs, tmp_path):
    node = procs(tmp_path, '<limits max_request_size="1024"/>\n')
    c = TcpClient(node.port)
    big = json.dumps({"action": 1, "queue": "big", "data": "x" * 2000}).encode()
    c.send_raw(big)
    assert c.read()["reason"] == "request too large"
    # the request's end was seen, so the stream goes on
    assert c.request(action=1, queue="big", data="small")["msg_id"] == 1
    # an unfinished request past the limit: answered, then closed
    d = TcpClient(node.port)
    d.send_raw(b'{"action":1,"queue":"big","data":"' + b"y" * 4000)
    assert d.read()["reason"] == "request too large"
    assert d.closed_by_server()
    u = UdpClient(node.port)
    assert u.send_raw(big)["reason"] == "request too large"
    assert c.request(action=4, queue="big")["size"] == 1


def test_client_disconnects_mid_request(node):
    for _ in range(20):
        s = socket.create_connection(("127.0.0.1", node.port))
        s.sendall(b'{"action":1,"queue":"half","data":"never fini')
        s.close()
    s = socket.create_connection(("127.0.0.1", node.port))
    s.sendall(b'{"action":1,"queue":"half","data":"whole"}' * 50)
    s.close()  # gone before reading its answers
    c = TcpClient(node.port)
    size = wait_until(lambda: c.request(action=4, queue="half")["size"] == 50)
    assert size
    assert c.request(action=2, queue="half")["data"] == "whole"


def test_json_config_accepted(procs, tmp_path):
    text = ('{"node_id": 1, "host": "127.0.0.1", "port": {port}, "queue_size": 2, '
            '"virtual_queue_list": [{"name": "v", "queue_list": ["v1", "v2"]}]}')
    node = procs(tmp_path, config_text=text, name="config.json")
    c = TcpClient(node.port)
    assert c.request(action=1, queue="v", data="a")["msg_ids"] == {"v1": 1, "v2": 1}
    assert c.request(action=1, queue="v1", data="b")["code"] == 0
    full = c.request(action=1, queue="v", data="c")
    assert full["code"] == -1 and full["reason"] == "queue full: v1"
    assert c.request(action=4, queue="v2")["size"] == 1  # all or nothing


def _run_cli(*args, timeout=60):
    return subprocess.run([sys.executable, "-m", "qserver", *args], capture_output=True,
                          text=True, timeout=timeout)


def test_bad_config_exits_2_with_one_line(tmp_path):
    path = tmp_path / "bad.xml"
    path.write_text('<config><node_info node_id="1" port="notaport"/></config>')
    r = _run_cli("run", "--config", str(path))
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1
    assert str(path) in lines[0] and "node_info" in lines[0] and "port" in lines[0]
    r = _run_cli("run", "--config", str(tmp_path / "missing.xml"))
    assert r.returncode == 2 and "missing.xml" in r.stderr


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_clean_shutdown_on_signal(node, sig):
    c = TcpClient(node.port)
    assert c.request(action=1, queue="s", data="x")["code"] == 0
    assert node.stop(sig) == 0
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", node.port), timeout=2)


def test_port_in_use_is_an_error(procs, tmp_path):
    node = procs(tmp_path)
    path = tmp_path / "second.xml"
    path.write_text('<config><node_info node_id="1" host="127.0.0.1" '
                    f'port="{node.port}"/></config>')
    r = _run_cli("run", "--config", str(path))
    assert r.returncode == 1 and "cannot listen" in r.stderr


def test_embedded_default_needs_no_config():
    """`qserver run` with no config serves on 127.0.0.1:1111 (skipped if the
    port is taken on this machine)."""
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", 1111))
        except OSError:
            pytest.skip("port 1111 is in use here")
    # `with`: the pipes are closed at the end (the process is waited for).
    with subprocess.Popen([sys.executable, "-m", "qserver", "run"], stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True) as p:
        try:
            line = p.stdout.readline()
            assert "ready on 127.0.0.1:1111" in line
            c = TcpClient(1111)
            assert c.request(action=8)["leader_port"] == 1111
            c.close()
            p.send_signal(signal.SIGINT)
            assert p.wait(20) == 0
        finally:
            p.kill()
            p.wait()


# -- consumer controls on a real node (issue 14) ----------------------------------


def test_receipts_over_tcp(node):
    c = TcpClient(node.port)
    c.request(action=1, queue="r", data="job", retry=60)
    got = c.request(action=2, queue="r", seq=1)
    assert got["deliveries"] == 1 and got["receipt"].endswith(".1.1")
    stale = c.request(action=3, queue="r", msg_id=1, receipt=got["receipt"][:-1] + "2")
    assert (stale["code"], stale["reason"]) == (-1, "stale receipt")
    nacked = c.request(action=9, queue="r", msg_id=1, receipt=got["receipt"])
    assert nacked["code"] == 0 and nacked["ready_at"] > 1_600_000_000
    again = c.request(action=2, queue="r")
    assert again["deliveries"] == 2 and again["receipt"] != got["receipt"]
    touched = c.request(action=10, queue="r", msg_id=1, receipt=again["receipt"], lease=120)
    assert touched["code"] == 0 and touched["retry_at"] > nacked["ready_at"]
    assert c.request(action=11, queue="r", msg_id=1)["message"]["nacks"] == 1
    done = c.request(action=3, queue="r", msg_id=1, receipt=again["receipt"])
    assert (done["code"], done["found"]) == (0, True)


def _waiting(c: TcpClient, queue: str) -> int:
    return c.request(action=4, queue=queue)["waiting"]


def test_long_poll_over_tcp_is_woken_by_a_produce(node):
    waiter = TcpClient(node.port)  # its read times out (10 s) long before the wait (30 s)
    waiter.send_raw(json.dumps({"action": 2, "queue": "lp", "wait": 30, "seq": "w"}).encode())
    other = TcpClient(node.port)
    assert wait_until(lambda: _waiting(other, "lp") == 1)
    # the waiting connection's client is not blocked for others
    assert other.request(action=1, queue="lp", data="wake", seq="p")["seq"] == "p"
    got = waiter.read()
    assert (got["seq"], got["code"], got["msg_id"], got["data"]) == ("w", 0, 1, "wake")
    assert _waiting(other, "lp") == 0
    # the same connection goes on after its long poll
    assert waiter.request(action=8)["code"] == 0


def test_long_poll_over_udp(node):
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.settimeout(10)
    try:
        sock.sendto(json.dumps({"action": 2, "queue": "ulp", "wait": 30,
                                "count": 2}).encode(), ("127.0.0.1", node.port))
        other = TcpClient(node.port)
        assert wait_until(lambda: _waiting(other, "ulp") == 1)
        other.request(action=1, queue="ulp", data="for udp")
        got = json.loads(sock.recvfrom(70000)[0])
        assert got["messages"] == [{"queue": "ulp", "msg_id": 1, "data": "for udp",
                                    "deliveries": 1}]
    finally:
        sock.close()


def test_a_long_poll_whose_client_goes_takes_nothing(node):
    waiter = TcpClient(node.port)
    waiter.send_raw(json.dumps({"action": 2, "queue": "gone", "wait": 30}).encode())
    other = TcpClient(node.port)
    assert wait_until(lambda: _waiting(other, "gone") == 1)
    waiter.close()
    assert wait_until(lambda: _waiting(other, "gone") == 0)
    other.request(action=1, queue="gone", data="keep me")  # at-most-once
    assert other.request(action=4, queue="gone")["size"] == 1
    assert other.request(action=2, queue="gone")["data"] == "keep me"


def test_a_long_poll_times_out_with_the_empty_answer(node):
    c = TcpClient(node.port)
    started = time.monotonic()
    resp = c.request(action=2, queue="idle", wait=0.3, seq=4)
    assert resp == {"action": 2, "queue": "idle", "wait": 0.3, "seq": 4, "code": 0}
    assert time.monotonic() - started >= 0.25  # it did wait (answered by the node's timer)
