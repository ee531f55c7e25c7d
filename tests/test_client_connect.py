"""The client as a new user meets it (issue 18, point 4), against real
nodes where a user would use them: descriptors past 1024, the backoff's
jitter, the start at a random node, `ClientTimeout` as a `TimeoutError`,
`QSERVER_SERVERS` / `QSERVER_TIMEOUT` and the qserver:// URL, `py.typed`.
AsyncClient's pipelining is in test_client_pipeline.py."""

from __future__ import annotations

import asyncio
import os
import random
import re
import resource
import select
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from qserver.client import (
    SERVERS_ENV,
    TIMEOUT_ENV,
    AsyncClient,
    Client,
    Message,
    Target,
    parse_hosts,
    parse_target,
)
from qserver.client.core import (
    BACKOFF_MAX_S,
    BACKOFF_MIN_S,
    DEFAULT_RETRY_FOR_S,
    DEFAULT_TIMEOUT_S,
    LONG_POLL_S,
    _Router,
    client_settings,
)
from qserver.errors import (
    ClientConnectionError,
    ClientTimeout,
    InvalidArgument,
    NoLeader,
    QServerClientError,
    Unauthorized,
)
from tlsutil import make_pki

DEADLINE_S = 30.0  # generous: CI is a shared, noisy 2-core machine
ROOT = Path(__file__).resolve().parent.parent
TOKEN = "connect-admin-token-0123456789"


def host(node) -> str:
    return f"127.0.0.1:{node.port}"


# -- descriptors >= 1024 -------------------------------------------------------------


# select.select() refuses descriptors >= FD_SETSIZE (1024 on Linux); the
# test holds more than that open so that the client's sockets land above.
FD_SETSIZE = 1024
HELD_FDS = 1100


@pytest.fixture
def many_descriptors():
    """Hold descriptors 0..~HELD_FDS open (the soft RLIMIT_NOFILE raised
    within the hard one), so that every socket opened meanwhile is >= 1024."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = HELD_FDS + 200
    if hard != resource.RLIM_INFINITY and hard < want:
        pytest.skip(f"RLIMIT_NOFILE hard limit {hard} < {want}: cannot open > 1024 descriptors")
    if soft != resource.RLIM_INFINITY and soft < want:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    held: list[int] = []
    try:
        while not held or held[-1] < HELD_FDS:
            held.append(os.open(os.devnull, os.O_RDONLY))
        yield held[-1]
    finally:
        for fd in held:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_the_blocking_client_works_with_descriptors_above_1024(node, many_descriptors):
    with socket.socket() as probe:  # what the client's sockets get: the next free
        assert probe.fileno() >= FD_SETSIZE
        with pytest.raises(ValueError):  # what the client met before selectors
            select.select([probe], [], [], 0)
    with Client(host(node), timeout=10, retry_for=DEADLINE_S) as c:
        msg_id = c.produce("fds", "past 1024", retry=60)
        ids = c.produce_many([{"queue": "fds", "data": str(i)} for i in range(2000)])
        assert len(ids) == 2000
        # a long poll, on a connection of its own (also past 1024), served
        # by a produce from another thread
        def produce_late() -> None:
            with Client(host(node)) as other:
                other.produce("fds_wait", "late", retry=60)

        timer = threading.Timer(0.3, produce_late)
        timer.start()
        try:
            got = c.consume("fds_wait", wait=DEADLINE_S)
        finally:
            timer.join()
        assert got is not None and got.data == "late"
        assert c.confirm("fds_wait", got.msg_id, receipt=got.receipt)
        first = c.consume("fds", lease=30)
        assert first == Message(queue="fds", msg_id=msg_id, data="past 1024")
        assert first.confirm()

    async def main() -> None:  # asyncio's loop (epoll) too, shared connection and long poll
        async with AsyncClient(host(node), timeout=10, retry_for=DEADLINE_S) as ac:
            poll = asyncio.create_task(ac.consume("fds_async", wait=DEADLINE_S))
            assert await ac.produce("fds_async", "a") == 1
            got = await poll
            assert got is not None and got.data == "a"

    asyncio.run(main())


@pytest.fixture
def tls_node(procs, tmp_path):
    """A node with TLS (no client certificates), and its PKI."""
    pki = make_pki(tmp_path / "pki")
    node = procs(tmp_path, f'  <tls cert="{pki.server_cert}" key="{pki.server_key}" '
                           f'client_cert="none"/>\n')
    return node, pki


def test_the_blocking_client_over_tls_with_descriptors_above_1024(tls_node, many_descriptors):
    # (the node started first: tests/procs.py waits for it with select.select)
    node, pki = tls_node
    with Client(host(node), tls_ca=str(pki.ca), timeout=10, retry_for=DEADLINE_S) as c:
        assert c.produce_batch("tls_fds", [f"m{i}" for i in range(3000)])[-1] == 3000
        assert len(c.consume("tls_fds", count=1000)) == 1000


# -- backoff with jitter (the router: no I/O, a seeded random source) --------------


ADDRESSES = [("a", 1), ("b", 2), ("c", 3)]


def pauses(seed: int, rounds: int) -> list[float]:
    """The pause after each full round of failures of a router seeded so."""
    router = _Router(ADDRESSES, 3600.0, rng=random.Random(seed))
    out = []
    for _ in range(rounds):
        within = [router.failed(ClientConnectionError("x"), 0.0) for _ in range(2)]
        assert within == [0.0, 0.0]  # another node may serve at once
        out.append(router.failed(ClientConnectionError("x"), 0.0))
    return out


def test_backoff_is_full_jitter_under_a_doubling_capped_ceiling():
    for seed in range(50):
        got = pauses(seed, 8)
        ceilings = [min(BACKOFF_MIN_S * 2 ** k, BACKOFF_MAX_S) for k in range(8)]
        assert all(0.0 <= p <= c for p, c in zip(got, ceilings)), (seed, got)
    # drawn, not fixed: two seeds disagree, one seed repeats itself
    assert pauses(1, 8) != pauses(2, 8)
    # the cap: late pauses spread over (0, BACKOFF_MAX_S), not pinned at it
    late = [pauses(seed, 10)[-1] for seed in range(200)]
    assert max(late) <= BACKOFF_MAX_S and min(late) < BACKOFF_MAX_S / 4
    assert max(late) > BACKOFF_MAX_S * 3 / 4


def test_backoff_never_passes_the_deadline_and_every_node_is_tried():
    router = _Router(ADDRESSES, 0.5, rng=random.Random(3))
    error = NoLeader(-1, "no leader")
    # time is past the deadline, but not every node was tried: no raise
    assert router.failed(error, 0.0) == 0.0
    assert router.failed(error, 10.0) == 0.0
    with pytest.raises(NoLeader):
        router.failed(error, 10.0)  # third node, past the deadline
    router = _Router(ADDRESSES, 0.5, rng=random.Random(3))
    for _ in range(2):
        router.failed(error, 0.0)
    assert router.failed(error, 0.49) <= 0.01 + 1e-9  # what is left of the retry time


def test_a_client_retries_with_jitter_for_retry_for_then_raises():
    dead = [f"127.0.0.1:{free_tcp_port()}" for _ in range(2)]
    for retry_for in (0.0, 1.0):
        with Client(dead, retry_for=retry_for) as c:
            start = time.monotonic()
            with pytest.raises(ClientConnectionError):
                c.produce("q", "x")
            took = time.monotonic() - start
        # retried until retry_for (the pauses are cut at the deadline), not
        # much past it: a pause is at most BACKOFF_MAX_S
        assert retry_for <= took < retry_for + BACKOFF_MAX_S + 5.0, took


def free_tcp_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- the start node -------------------------------------------------------------------


def test_clients_start_at_a_random_node_unless_shuffle_is_off(cluster):
    c = cluster()
    c.wait_master(DEADLINE_S)
    ids = sorted(c.nodes)
    hosts = [f"127.0.0.1:{c.port(i)}" for i in ids]
    starts = set()
    for i in range(12):
        with Client(hosts, retry_for=DEADLINE_S) as client:
            before = client.address
            assert client.produce("spread", str(i)) >= 1  # slaves forward: it stays there
            assert client.address == before
            starts.add(before)
    # 12 clients on one node of 3 by chance: 3 * (1/3)^12, about 1 in 177,000
    assert len(starts) >= 2, starts
    for _ in range(5):
        with Client(hosts, retry_for=DEADLINE_S, shuffle=False) as client:
            assert client.address == ("127.0.0.1", c.port(ids[0]))
            client.produce("spread", "ordered")
            assert client.address == ("127.0.0.1", c.port(ids[0]))

    async def async_start() -> tuple[tuple[str, int], set[tuple[str, int]]]:
        async with AsyncClient(hosts, retry_for=DEADLINE_S, shuffle=False) as ordered:
            await ordered.produce("spread", "a")
            first = ordered.address
        starts = set()
        for i in range(12):
            async with AsyncClient(hosts, retry_for=DEADLINE_S) as shuffled:
                before = shuffled.address
                await shuffled.produce("spread", f"b{i}")
                assert shuffled.address == before
                starts.add(before)
        return first, starts

    first, async_starts = asyncio.run(async_start())
    assert first == ("127.0.0.1", c.port(ids[0]))
    assert len(async_starts) >= 2, async_starts  # as above: about 1 in 177,000 by chance


def test_shuffle_keeps_every_address_once():
    hosts = [f"h{i}:{1000 + i}" for i in range(10)]
    with Client(hosts) as c:
        assert sorted(c._main.router.addresses) == sorted(parse_hosts(hosts))
    with Client(hosts, shuffle=False) as c:
        assert c._main.router.addresses == parse_hosts(hosts)


# -- ClientTimeout is a TimeoutError --------------------------------------------------


@pytest.fixture
def silent_node():
    """A TCP port that accepts connections and never answers."""
    server = socket.create_server(("127.0.0.1", 0))
    accepted: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        server.settimeout(0.1)
        while not stop.is_set():
            try:
                accepted.append(server.accept()[0])
            except TimeoutError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield f"127.0.0.1:{server.getsockname()[1]}"
    stop.set()
    thread.join(DEADLINE_S)
    for conn in accepted:
        conn.close()
    server.close()


def test_client_timeout_is_a_timeout_error_and_a_client_error(silent_node):
    assert issubclass(ClientTimeout, TimeoutError) and issubclass(ClientTimeout, OSError)
    assert issubclass(ClientTimeout, QServerClientError)
    assert not issubclass(ClientTimeout, ConnectionError)  # not "connection refused"
    with Client(silent_node, timeout=0.3, retry_for=0) as c:
        try:
            c.produce("q", "x")
        except TimeoutError as exc:  # as Python's own timeouts
            assert isinstance(exc, ClientTimeout)
            assert "no answer within 0.3 s" in str(exc)
        else:
            raise AssertionError("no timeout")
        with pytest.raises(QServerClientError):  # existing handlers still catch it
            c.produce("q", "x")

    async def main() -> None:
        async with AsyncClient(silent_node, timeout=0.3, retry_for=0) as ac:
            with pytest.raises(TimeoutError) as info:
                await ac.produce("q", "x")
            assert isinstance(info.value, ClientTimeout)

    asyncio.run(main())


def test_the_cli_still_reports_a_timeout_as_a_client_error(silent_node):
    done = subprocess.run([sys.executable, "-m", "qserver", "produce", "q", "x",
                           "-s", silent_node, "--timeout", "0.3", "--retry-for", "0"],
                          capture_output=True, text=True, timeout=DEADLINE_S)
    assert done.returncode == 1, done
    assert "ClientTimeout" in done.stderr


# -- QSERVER_SERVERS, QSERVER_TIMEOUT and the URL form ------------------------------


def test_parse_target_reads_addresses_and_urls():
    assert parse_target("a:1, b:2") == Target([("a", 1), ("b", 2)], {})
    assert parse_target(["a:1", ("b", 2)]) == Target([("a", 1), ("b", 2)], {})
    url = "qserver://a:1,[::1]:2/?timeout=2.5&retry_for=0&long_poll=5&token=t%2Bk"
    assert parse_target(url) == Target([("a", 1), ("::1", 2)], {
        "timeout": 2.5, "retry_for": 0.0, "long_poll": 5.0, "token": "t+k"})
    assert parse_target(["qservers://a:1"]) == Target([("a", 1)], {"tls": True})
    assert parse_target("qservers://n:1/?tls_ca=/etc/ca.pem&tls_server_hostname=n.example") \
        == Target([("n", 1)], {"tls": True, "tls_ca": "/etc/ca.pem",
                               "tls_server_hostname": "n.example"})
    assert parse_target("qserver://a:1/") == Target([("a", 1)], {})
    assert parse_hosts("qserver://a:1,b:2") == [("a", 1), ("b", 2)]
    # a '+' is a plus (base64 tokens have them), not a space as in a form
    assert parse_target("qserver://a:1/?token=ab+cd/ef==").options == {"token": "ab+cd/ef=="}
    assert parse_target("qserver://a:1/?tls_ca=/my%20certs/ca.pem").options == {
        "tls_ca": "/my certs/ca.pem"}
    with Client("qserver://a:1/?token=ab+cd") as c:
        assert c._security is not None and c._security.token == "ab+cd"


def test_reprs_never_show_the_token():
    target = parse_target("qserver://a:1/?token=s3cret&timeout=2")
    settings = client_settings("qserver://a:1/?token=s3cret", {})
    for shown in (repr(target), repr(settings), repr(settings.security)):
        assert "s3cret" not in shown, shown
    assert repr(target) == "Target(addresses=[('a', 1)], options={'token': '...', 'timeout': 2.0})"


@pytest.mark.parametrize("url, says", [
    ("http://a:1", "scheme 'http' is not one of qserver://, qservers://"),
    ("qserver://", "no host:port after qserver://"),
    ("qserver://a", "address 'a' is not host:port"),
    ("qserver://a:99999", "port out of range"),
    ("qserver://a:1/queue", "path '/queue'"),
    ("qserver://a:1/?timeout=soon", "query timeout='soon' is not seconds > 0"),
    ("qserver://a:1/?timeout=0", "query timeout='0' is not seconds > 0"),
    ("qserver://a:1/?retry_for=-1", "query retry_for='-1' is not seconds >= 0"),
    ("qserver://a:1/?timeout=1&timeout=2", "query 'timeout' given twice"),
    ("qserver://a:1/?tiemout=1", "unknown query 'tiemout'"),
    ("qserver://a:1/?token=", "query 'token' is empty"),
    ("qserver://a:1/?timeout", "not name=value"),
    ("qserver://user@a:1", "user information"),
    ("qserver://a:1#x", "no #fragment"),
])
def test_a_bad_url_names_the_part(url, says):
    with pytest.raises(InvalidArgument, match="^URL: .*" + _re(says)):
        Client(url)


def _re(text: str) -> str:
    return re.escape(text)


def test_url_errors_never_show_the_token():
    with pytest.raises(InvalidArgument) as info:
        Client("qserver://a:1/?token=s3cret&timeout=x")
    assert "s3cret" not in str(info.value)
    with pytest.raises(InvalidArgument) as info:
        parse_hosts("qserver://a:1/?token=s3cret")  # settings a list would lose
    assert "s3cret" not in str(info.value) and "token" in str(info.value)
    with pytest.raises(InvalidArgument, match="whole of the hosts"):
        parse_target(["qserver://a:1", "b:2"])


def test_settings_come_from_arguments_then_the_url_then_the_environment():
    env = {SERVERS_ENV: "e:1,f:2", TIMEOUT_ENV: "7"}
    s = client_settings(None, env)
    assert (s.addresses, s.timeout_s) == ([("e", 1), ("f", 2)], 7.0)
    assert (s.retry_for_s, s.long_poll_s, s.security) == (DEFAULT_RETRY_FOR_S, LONG_POLL_S, None)
    s = client_settings("a:1", env)  # hosts given: QSERVER_SERVERS unused; the timeout still
    assert (s.addresses, s.timeout_s) == ([("a", 1)], 7.0)
    s = client_settings("qserver://a:1/?timeout=3", env)  # the URL's beats the variable
    assert s.timeout_s == 3.0
    s = client_settings("qserver://a:1/?timeout=3&token=u", env, timeout=1, token="arg")
    assert s.timeout_s == 1.0 and s.security is not None and s.security.token == "arg"
    s = client_settings(None, {SERVERS_ENV: "qservers://g:3/?token=from-env&retry_for=2"})
    assert s.addresses == [("g", 3)] and s.timeout_s == DEFAULT_TIMEOUT_S
    assert s.retry_for_s == 2.0 and s.security is not None
    assert s.security.token == "from-env" and s.security.ssl_context is not None
    s = client_settings("a:1", {TIMEOUT_ENV: "  "})  # blank: not set
    assert s.timeout_s == DEFAULT_TIMEOUT_S


@pytest.mark.parametrize("env, says", [
    ({}, f"no server address given: pass the hosts, or set {SERVERS_ENV}"),
    ({SERVERS_ENV: " "}, f"no server address given: pass the hosts, or set {SERVERS_ENV}"),
    ({SERVERS_ENV: "a:1,b"}, f"{SERVERS_ENV}='a:1,b': address 'b' is not host:port"),
    ({SERVERS_ENV: "qserver://a:1/?timeout=x"},
     f"{SERVERS_ENV} (a URL): query timeout='x' is not seconds > 0"),
    ({SERVERS_ENV: "a:1", TIMEOUT_ENV: "soon"}, f"{TIMEOUT_ENV}='soon': not a number"),
    ({SERVERS_ENV: "a:1", TIMEOUT_ENV: "0"}, f"{TIMEOUT_ENV}='0': not a number of seconds > 0"),
    ({SERVERS_ENV: "a:1", TIMEOUT_ENV: "nan"}, f"{TIMEOUT_ENV}='nan'"),
])
def test_bad_environment_variables_are_named(monkeypatch, env, says):
    for name in (SERVERS_ENV, TIMEOUT_ENV):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(InvalidArgument, match="^" + _re(says)):
        Client()
    with pytest.raises(InvalidArgument, match="^" + _re(says)):
        AsyncClient()


def test_bad_arguments_are_named():
    for kwargs, says in (({"timeout": 0}, "timeout must be seconds > 0"),
                         ({"timeout": "5"}, "timeout must be seconds >= 0"),
                         ({"retry_for": -1}, "retry_for must be seconds >= 0"),
                         ({"long_poll": float("inf")}, "long_poll must be seconds >= 0")):
        with pytest.raises(InvalidArgument, match=_re(says)):
            Client("a:1", **kwargs)


def test_the_environment_gives_the_servers_and_the_timeout(node, monkeypatch):
    monkeypatch.setenv(SERVERS_ENV, f"127.0.0.1:{free_tcp_port()},{host(node)}")
    monkeypatch.setenv(TIMEOUT_ENV, "8.5")
    with Client() as c:
        assert c.timeout == 8.5
        assert c.produce("from_env", "x") >= 1
        assert c.address == ("127.0.0.1", node.port)

    async def main() -> None:
        async with AsyncClient(retry_for=DEADLINE_S) as ac:
            assert ac.timeout == 8.5
            assert (await ac.consume("from_env")).data == "x"

    asyncio.run(main())
    monkeypatch.setenv(SERVERS_ENV, f"qserver://{host(node)}/?timeout=3")
    with Client() as c:  # a URL in the variable; its timeout beats QSERVER_TIMEOUT's
        assert c.timeout == 3.0
        assert c.monitor("from_env")["size"] == 0


def test_a_qservers_url_with_a_token_against_a_node_with_tls_and_security(procs, tmp_path):
    pki = make_pki(tmp_path / "pki")
    node = procs(tmp_path, f'  <tls cert="{pki.server_cert}" key="{pki.server_key}" '
                           f'client_cert="none"/>\n'
                           f'  <security><token name="admin" token="{TOKEN}"/></security>\n')
    url = f"qservers://127.0.0.1:{node.port}/?token={TOKEN}&tls_ca={pki.ca}&timeout=10"
    with Client(url) as c:
        assert c.timeout == 10.0
        assert c.produce("url_q", "over tls") == 1

    async def main() -> None:
        async with AsyncClient(url) as ac:
            assert (await ac.consume("url_q")).data == "over tls"

    asyncio.run(main())
    with Client(url.replace(TOKEN, "not-the-token"), retry_for=0) as c:
        with pytest.raises(Unauthorized):
            c.produce("url_q", "refused")
    # qserver:// without a CA (which would imply TLS) against the TLS node: refused
    plain = f"qserver://127.0.0.1:{node.port}/?token={TOKEN}&timeout=3"
    with Client(plain, retry_for=0) as c:
        with pytest.raises(QServerClientError):
            c.produce("url_q", "plain")


# -- py.typed ---------------------------------------------------------------------------


def test_the_package_ships_py_typed(tmp_path):
    assert (ROOT / "qserver" / "py.typed").is_file()
    # what setuptools puts in a wheel or an install, from a copy of the tree
    for part in ("qserver", "spark_integration", "pyproject.toml", "README.md"):
        source = ROOT / part
        if source.is_dir():
            shutil.copytree(source, tmp_path / part,
                            ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy(source, tmp_path / part)
    done = subprocess.run(
        [sys.executable, "-W", "ignore", "-c", "from setuptools import setup; setup()",
         "-q", "build_py", "--build-lib", str(tmp_path / "out")],
        cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "out" / "qserver" / "py.typed").is_file()
    assert (tmp_path / "out" / "qserver" / "client" / "core.py").is_file()
