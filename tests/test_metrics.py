"""The HTTP port (`<http>`): Prometheus metrics, /healthz and /readyz.

Real nodes on loopback (procs): a known workload, then a real scrape of
/metrics (urllib) whose values must match what monitor reports and the
counts of what was done, on one node (the fast path) and on three-node
clusters of both engines (the general path); per_queue="0"; the fsync and
snapshot histograms of a node with storage; /readyz on a healthy cluster,
on a slave cut off from the majority (the others stopped with SIGSTOP) and
after they resume; bad HTTP. The HTTP parser, the histograms and the
request counts are also checked in process.
"""

from __future__ import annotations

import asyncio
import json
import re
import signal
import socket
import urllib.error
import urllib.request

import pytest
from prometheus_client.openmetrics.parser import (
    text_string_to_metric_families as openmetrics_families,
)
from prometheus_client.parser import text_string_to_metric_families

from procs import IO_TIMEOUT_S, Cluster, NodeProcess, TcpClient, wait_until
from qserver.http_server import MAX_HEAD_BYTES, HttpServer, Request, parse_head
from qserver.stats import ACTION_INVALID, FAST_STRIDE, Histogram, RequestStats

DEADLINE_S = 60.0  # generous: CI is a shared, noisy 2-core machine
ENGINES = ["native", "raft"]
HTTP = '  <http host="127.0.0.1" port="0"/>\n'  # port 0: read back from the ready line
RETRY_S = 600  # leases outlast any slow test: in-flight counts stay put


# -- helpers -------------------------------------------------------------------

def http_port(node: NodeProcess) -> int:
    """The HTTP port a node bound, from its ready line."""
    for line in node.stdout_lines:
        m = re.search(r"\(http [^ ]+:(\d+)\)", line)
        if m:
            return int(m.group(1))
    raise AssertionError(f"no http address on the ready line: {node.stdout_lines}")


def http_get(port: int, path: str, headers: dict | None = None) -> tuple[int, dict, bytes]:
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=IO_TIMEOUT_S) as r:
            return r.status, dict(r.headers), r.read()
    except urllib.error.HTTPError as e:
        with e:
            return e.code, dict(e.headers), e.read()


def raw_http(port: int, data: bytes) -> bytes:
    """Send raw bytes, read until the server closes."""
    with socket.create_connection(("127.0.0.1", port), timeout=IO_TIMEOUT_S) as sock:
        sock.sendall(data)
        out = b""
        while chunk := sock.recv(65536):
            out += chunk
        return out


def scrape(port: int) -> dict[tuple[str, frozenset], float]:
    """GET /metrics, parsed by prometheus_client's own parser: sample
    (name, labels) -> value."""
    status, headers, body = http_get(port, "/metrics")
    assert status == 200 and headers["Content-Type"].startswith("text/plain")
    samples = {}
    for family in text_string_to_metric_families(body.decode()):
        for s in family.samples:
            samples[s.name, frozenset(s.labels.items())] = s.value
    return samples


def value(samples: dict, name: str, **labels) -> float:
    return samples[name, frozenset(labels.items())]


def ok(answer: dict) -> dict:
    assert answer.get("code") == 0, answer
    return answer


def workload(c: TcpClient) -> dict[str, int]:
    """A known mix on one node; returns the counters it must leave."""
    for i in range(6):
        ok(c.request(action=1, queue="m", data=f"m{i}", retry=RETRY_S))
    ok(c.request(action=1, queue="m", data="later", delay=3600, retry=RETRY_S))  # delayed
    got = [ok(c.request(action=2, queue="m")) for _ in range(4)]
    for g in got[:2]:
        assert ok(c.request(action=3, queue="m", msg_id=g["msg_id"]))["found"] is True
    # a nack and the redelivery it makes
    ok(c.request(action=1, queue="r", data="again", retry=RETRY_S))
    first = ok(c.request(action=2, queue="r"))
    ok(c.request(action=9, queue="r", msg_id=first["msg_id"], receipt=first["receipt"]))
    second = ok(c.request(action=2, queue="r"))
    assert (second["msg_id"], second["deliveries"]) == (first["msg_id"], 2)
    # a dead letter: the nack of a message at its max_deliveries moves it
    ok(c.request(action=5, queue="d", set={"max_deliveries": 1, "dead_letter": "d.dead"}))
    ok(c.request(action=1, queue="d", data="doomed", retry=RETRY_S))
    doomed = ok(c.request(action=2, queue="d"))
    moved = ok(c.request(action=9, queue="d", msg_id=doomed["msg_id"]))
    assert moved["dead_lettered"] is True
    empty = ok(c.request(action=2, queue="nothing-here"))
    assert "msg_id" not in empty
    assert c.request(action=99)["code"] == -1
    return {"produced": 9, "delivered": 7, "redelivered": 1, "confirmed": 2, "nacked": 1,
            "consume_empty": 1, "dead_lettered": 1,
            # (action, code) -> requests
            "requests": {(1, 0): 9, (2, 0): 8, (3, 0): 2, (9, 0): 2, (5, 0): 1, (99, -1): 1}}


QUEUES = ("m", "r", "d", "d.dead")


def check_against_monitor(c: TcpClient, port: int, expected: dict, *, fast: bool) -> dict:
    """Monitor (4) of every queue, then a scrape: the same state, and the
    counters of the workload. `fast`: the node answered produce, consume
    and confirm by the fast path (not timed)."""
    monitors = {q: ok(c.request(action=4, queue=q)) for q in QUEUES}
    local = ok(c.request(action=104))
    s = scrape(port)
    for q, mon in monitors.items():
        assert value(s, "qserver_queue_messages", queue=q) == mon["size"], q
        assert value(s, "qserver_queue_ready", queue=q) == mon["ready"], q
        assert value(s, "qserver_queue_delayed", queue=q) == mon["delayed"], q
        assert value(s, "qserver_queue_inflight", queue=q) == mon["in_flight"], q
        assert value(s, "qserver_queue_dead_lettered_total", queue=q) == mon["dead_lettered"], q
        assert value(s, "qserver_queue_consumers_waiting", queue=q) == mon["waiting"] == 0, q
        age = value(s, "qserver_queue_oldest_ready_age_seconds", queue=q)
        assert mon["oldest_ready_age"] <= age <= mon["oldest_ready_age"] + 10, q
    # what the workload left, as the monitor says it
    assert [monitors["m"][k] for k in ("size", "ready", "delayed", "in_flight")] == [5, 2, 1, 2]
    assert [monitors["r"][k] for k in ("size", "ready", "in_flight")] == [1, 0, 1]
    assert monitors["d"]["dead_lettered"] == 1 and monitors["d.dead"]["size"] == 1
    # totals over every queue
    assert value(s, "qserver_queues") == 4
    for total, field in (("qserver_messages", "size"), ("qserver_messages_ready", "ready"),
                         ("qserver_messages_delayed", "delayed"),
                         ("qserver_messages_inflight", "in_flight"),
                         ("qserver_messages_dead_lettered_total", "dead_lettered")):
        assert value(s, total) == sum(m[field] for m in monitors.values()), total
    assert value(s, "qserver_consumers_waiting") == 0
    # node counters
    for name in ("produced", "delivered", "redelivered", "confirmed", "nacked"):
        assert value(s, f"qserver_messages_{name}_total") == expected[name], name
    assert value(s, "qserver_consume_empty_total") == expected["consume_empty"]
    requests = dict(expected["requests"])
    requests[4, 0] = len(QUEUES)  # the monitors above
    got = {(int(dict(labels)["action"]), int(dict(labels)["code"])): v
           for (name, labels), v in s.items() if name == "qserver_requests_total"}
    requests[104, 0] = got.get((104, 0), 0)  # the one above, and those waiting for a master
    assert requests[104, 0] >= 1 and got == requests
    # latency: every answer of the general path, none of the fast path's
    for (action, _code), n in requests.items():
        timed = 0 if fast and action in (1, 2, 3) else n
        assert s.get(("qserver_request_duration_seconds_count",
                      frozenset({("action", str(action))})), 0) == timed, action
    # replication, as monitor (104) says it
    assert value(s, "qserver_is_master") == (local["role"] == "master") == 1
    for name in ("vote_id", "trans_id", "commit_id", "applied_id"):
        assert value(s, f"qserver_{name}") >= local[name], name  # later than the monitor
    assert value(s, "qserver_leader_node_id") == local["leader_node_id"]
    return s


# -- real nodes ------------------------------------------------------------------

def test_single_node_metrics_match_monitor_and_the_workload(tmp_path, procs):
    node = procs(tmp_path, extra=HTTP)
    port = http_port(node)
    c = TcpClient(node.port)
    expected = workload(c)
    s = check_against_monitor(c, port, expected, fast=True)
    assert value(s, "qserver_trans_id") == ok(c.request(action=104))["trans_id"]  # idle
    assert value(s, "qserver_ready") == 1
    assert ("qserver_replication_lag_entries", frozenset()) not in s  # no slaves: no samples
    assert value(s, "process_resident_memory_bytes") > 0  # the process collector
    # OpenMetrics when the scraper asks for it (Prometheus does)
    status, headers, body = http_get(
        port, "/metrics", {"Accept": "application/openmetrics-text; version=1.0.0"})
    assert status == 200 and headers["Content-Type"].startswith("application/openmetrics-text")
    names = {f.name for f in openmetrics_families(body.decode())}
    assert {"qserver_messages_produced", "qserver_queue_ready", "qserver_requests"} <= names


def test_per_queue_off_keeps_only_the_totals(tmp_path, procs):
    node = procs(tmp_path, extra='  <http host="127.0.0.1" port="0" per_queue="0"/>\n')
    c = TcpClient(node.port)
    expected = workload(c)
    s = scrape(http_port(node))
    assert not [k for k in s if k[0].startswith("qserver_queue_")]
    assert not [k for k in s if ("queue", "m") in k[1]]
    assert value(s, "qserver_queues") == 4
    assert value(s, "qserver_messages") == 7 and value(s, "qserver_messages_inflight") == 3
    assert value(s, "qserver_messages_produced_total") == expected["produced"]


@pytest.mark.parametrize("engine", ENGINES)
def test_cluster_master_metrics_match_monitor(tmp_path, engine):
    c = Cluster(tmp_path, engine=engine, extra=HTTP)
    try:
        c.start_all()
        m = c.wait_master(DEADLINE_S)
        client = TcpClient(c.port(m))
        expected = workload(client)
        s = check_against_monitor(client, http_port(c.nodes[m]), expected, fast=False)
        slaves = [i for i in c.nodes if i != m]
        lags = {dict(labels)["peer"]: v for (name, labels), v in s.items()
                if name == "qserver_replication_lag_entries"}
        assert set(lags) == {str(i) for i in slaves} and all(v >= 0 for v in lags.values())

        def caught_up():  # every slave applies the same entries: the same counters
            for i in slaves:
                t = scrape(http_port(c.nodes[i]))
                if value(t, "qserver_messages_produced_total") != expected["produced"]:
                    return False
                assert value(t, "qserver_is_master") == 0
                assert value(t, "qserver_leader_node_id") == m
                assert value(t, "qserver_messages") == 7
                assert value(t, "qserver_messages_confirmed_total") == expected["confirmed"]
                assert not [k for k in t if k[0] == "qserver_replication_lag_entries"]
            return True
        wait_until(caught_up, DEADLINE_S)
    finally:
        c.stop_all()


@pytest.mark.parametrize("engine", ENGINES)
def test_fsync_histogram_of_a_node_with_storage(tmp_path, procs, engine):
    extra = (HTTP + f'  <storage dir="{tmp_path / "data"}" fsync="always"/>\n'
             f'  <replication engine="{engine}"/>\n  <queue_config log_size="50"/>\n')
    node = procs(tmp_path, extra=extra)
    port = http_port(node)
    c = TcpClient(node.port)
    wait_until(lambda: c.request(action=104)["role"] == "master", DEADLINE_S)  # raft elects itself
    # native: more entries than log_size, for a snapshot; raft fsyncs each
    # of its entries on its own (some 50 ms here): a few make the histogram.
    for i in range(200 if engine == "native" else 20):
        ok(c.request(action=1, queue="f", data=f"x{i}"))
    s = scrape(port)
    count = value(s, "qserver_fsync_seconds_count")
    assert count >= 1 and value(s, "qserver_fsync_seconds_sum") > 0
    assert value(s, "qserver_fsync_seconds_bucket", le="+Inf") == count
    if engine == "native":  # 200 entries, log_size 50: a snapshot forked
        wait_until(lambda: value(scrape(port), "qserver_snapshot_pause_seconds_count") >= 1,
                   DEADLINE_S)


def ready(port: int) -> tuple[int, dict]:
    status, headers, body = http_get(port, "/readyz")
    assert headers["Content-Type"] == "application/json"
    return status, json.loads(body)


@pytest.mark.parametrize("engine", ENGINES)
def test_readyz_on_a_slave_cut_off_from_the_majority(tmp_path, engine):
    c = Cluster(tmp_path, engine=engine, extra=HTTP)
    stopped: list[int] = []
    try:
        c.start_all()
        m = c.wait_master(DEADLINE_S)
        ports = {i: http_port(n) for i, n in c.nodes.items()}
        for port in ports.values():
            assert http_get(port, "/healthz")[:1] == (200,)
            wait_until(lambda port=port: ready(port)[0] == 200, DEADLINE_S)
        status, body = ready(ports[m])
        assert body["ready"] is True and body["reasons"] == [] and body["role"] == "master"
        slave = next(i for i in c.nodes if i != m)
        for i in c.nodes:
            if i != slave:
                c.nodes[i].proc.send_signal(signal.SIGSTOP)
                stopped.append(i)

        def not_ready():
            status, body = ready(ports[slave])
            return status == 503 and body
        body = wait_until(not_ready, DEADLINE_S)
        assert body["ready"] is False and body["reasons"], body
        assert http_get(ports[slave], "/healthz")[0] == 200  # its loop still answers
        assert value(scrape(ports[slave]), "qserver_ready") == 0
        for i in stopped:
            c.nodes[i].proc.send_signal(signal.SIGCONT)
        stopped.clear()
        wait_until(lambda: ready(ports[slave])[0] == 200, DEADLINE_S)
    finally:
        for i in stopped:
            c.nodes[i].proc.send_signal(signal.SIGCONT)
        c.stop_all()


def test_bad_http_requests(tmp_path, procs):
    node = procs(tmp_path, extra=HTTP)
    port = http_port(node)
    assert http_get(port, "/nope")[0] == 404
    assert http_get(port, "/metrics/")[0] == 404
    assert http_get(port, "/healthz?verbose=1")[:1] == (200,)  # a query is ignored
    assert raw_http(port, b"GARBAGE\r\n\r\n").startswith(b"HTTP/1.1 400 ")
    assert raw_http(port, b"GET /healthz HTTP/2.0\r\n\r\n").startswith(b"HTTP/1.1 400 ")
    assert raw_http(port, b"GET /healthz HTTP/1.1\r\nno colon\r\n\r\n").startswith(
        b"HTTP/1.1 400 ")
    assert raw_http(port, b"GET /" + b"x" * (MAX_HEAD_BYTES + 10)).startswith(
        b"HTTP/1.1 400 ")
    post = raw_http(port, b"POST /metrics HTTP/1.1\r\nContent-Length: 2\r\n\r\nhi")
    assert post.startswith(b"HTTP/1.1 405 ") and b"Allow: GET, HEAD" in post
    head = raw_http(port, b"HEAD /healthz HTTP/1.0\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200 ") and head.endswith(b"\r\n\r\n")  # no body
    assert raw_http(port, b"GET /healthz HTTP/1.1\n\n").endswith(b"\r\n\r\nok\n")  # bare LF
    # the client port is unaffected, and the node still answers HTTP
    assert ok(TcpClient(node.port).request(action=104))["role"] == "master"
    assert http_get(port, "/healthz")[2] == b"ok\n"


# -- in process ---------------------------------------------------------------------

@pytest.mark.parametrize("head, expected", [
    (b"GET /metrics HTTP/1.1\r\nHost: x\r\nAccept: text/plain", ("GET", "/metrics", "text/plain")),
    (b"GET /readyz?x=1 HTTP/1.0", ("GET", "/readyz", None)),
    (b"HEAD / HTTP/1.1\nACCEPT:  a/b ", ("HEAD", "/", "a/b")),
    (b"GET /metrics HTTP/1.1 extra", "malformed request line"),
    (b"GET metrics HTTP/1.1", "malformed target"),
    (b"GET /a\x7fb HTTP/1.1", "malformed target"),
    (b"G(T / HTTP/1.1", "malformed method"),
    (b"GET / HTTP/1.2", "unsupported HTTP version"),
    (b"GET / HTTP/1.1\r\n: empty name", "malformed header"),
    (b"GET / HTTP/1.1\r\nbad name: x", "malformed header"),
    (b"", "malformed request line"),
])
def test_parse_head(head, expected):
    got = parse_head(head)
    if isinstance(expected, str):
        assert got == expected
    else:
        assert isinstance(got, Request)
        assert (got.method, got.path, got.headers.get("accept")) == expected


def test_http_server_in_process_split_reads_and_errors():
    async def main() -> None:
        calls = []

        def metrics(accept: str) -> tuple[bytes, str]:
            calls.append(accept)
            if accept == "boom":
                raise RuntimeError("collector bug")
            return b"m 1\n", "text/plain"

        health = {"ready": False, "reasons": ["no master known"]}
        server = HttpServer(metrics=metrics, health=lambda: health)
        await server.start("127.0.0.1", 0)
        host, port = server.address

        async def ask(*parts: bytes) -> bytes:
            reader, writer = await asyncio.open_connection(host, port)
            for part in parts:  # one byte at a time is a split request too
                writer.write(part)
                await writer.drain()
                await asyncio.sleep(0)
            data = await reader.read()
            writer.close()
            await writer.wait_closed()
            return data

        whole = await ask(b"GET /metrics HTTP/1.1\r\nAccept: x\r\n\r\n")
        one_by_one = await ask(*[bytes([b]) for b in b"GET /metrics HTTP/1.1\r\nAccept: x\r\n\r\n"])
        assert whole == one_by_one and whole.endswith(b"\r\n\r\nm 1\n") and calls == ["x", "x"]
        assert b"Content-Length: 4\r\n" in whole and b"Connection: close\r\n" in whole
        # trailing data after the head (a body, a second request) is never read
        trailing = await ask(b"GET /healthz HTTP/1.1\r\n\r\nGET /nope HTTP/1.1\r\n\r\n")
        assert trailing.count(b"HTTP/1.1") == 1 and trailing.endswith(b"ok\n")
        not_ready = await ask(b"GET /readyz HTTP/1.1\r\n\r\n")
        assert not_ready.startswith(b"HTTP/1.1 503 ")
        assert json.loads(not_ready.split(b"\r\n\r\n", 1)[1]) == health
        health["ready"] = True
        assert (await ask(b"GET /readyz HTTP/1.1\r\n\r\n")).startswith(b"HTTP/1.1 200 ")
        failed = await ask(b"GET /metrics HTTP/1.1\r\nAccept: boom\r\n\r\n")
        assert failed.startswith(b"HTTP/1.1 500 ")
        assert (await ask(b"GET /healthz HTTP/1.1\r\n\r\n")).startswith(b"HTTP/1.1 200 ")
        # a client that goes before its head is whole: dropped quietly
        _, writer = await asyncio.open_connection(host, port)
        writer.write(b"GET /hea")
        writer.close()
        await writer.wait_closed()
        server.close()
        await server.wait_closed()
        for _ in range(10):  # the aborted connections' connection_lost
            await asyncio.sleep(0)
        assert not server.connections

    asyncio.run(main())


def test_histogram_buckets_are_inclusive_upper_bounds():
    h = Histogram((0.001, 0.01))
    for ns in (1, 1_000_000, 1_000_001, 10_000_000, 10_000_001, 5 * 10**9):
        h.observe_ns(ns)
    assert h.counts == [2, 2, 2] and h.count == 6
    assert h.sum_ns == 1 + 1_000_000 + 1_000_001 + 10_000_000 + 10_000_001 + 5 * 10**9


def test_request_stats_bound_their_keys():
    stats = RequestStats()
    for response in ({"action": 1, "code": 0}, {"action": 1, "code": 0},
                     {"action": 2, "code": -1}):
        stats.fast[response["action"] - FAST_STRIDE * response["code"]] += 1
    stats.answered({"action": 1, "code": 0}, None)  # e.g. a produce too large for UDP
    stats.answered({"action": 4, "code": 0}, 2_000)
    stats.answered({"action": 4, "code": -2}, 3_000)
    for garbage in ("x", 10**9, -5, 256, True, None, [1]):
        stats.answered({"action": garbage, "code": -1}, None)
    stats.answered({"code": "strange"}, None)
    stats.answered({"action": 7, "code": 3}, None)  # not one of ours: counted as -1
    assert stats.totals() == {(1, 0): 3, (2, -1): 1, (4, 0): 1, (4, -2): 1,
                              (ACTION_INVALID, -1): 8, (7, -1): 1}
    assert set(stats.durations) == {4} and stats.durations[4].count == 2
