"""TLS on the client port (issue 17, point 5) on real nodes, with a CA, a
server certificate for 127.0.0.1/localhost and a client certificate made
by the test (tests/tlsutil.py): the Python clients (blocking and asyncio)
and the command line produce and consume over TLS; a client without TLS,
with an untrusted CA, or without a certificate the node requires fails
cleanly and the node serves on; UDP is off unless asked for; a bad
certificate or key stops the start with an error naming the file; TLS and
tokens together, on a cluster, through a slave.
"""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import ssl
import subprocess
import sys
from pathlib import Path

import pytest

from procs import (
    IO_TIMEOUT_S,
    Cluster,
    NodeProcess,
    free_port,
    sockets_to,
    write_config,
)
from qserver.client import AsyncClient, Client
from qserver.errors import ClientConnectionError, ClientTimeout, InvalidArgument, Unauthorized
from tlsutil import Pki, make_ca, make_pki

TOKEN = "tls-admin-token-0123456789"


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


def tls_xml(pki: Pki, client_cert: str = "none", udp: str | None = None,
            peers: bool = False) -> str:
    ca = f' ca="{pki.ca}"' if client_cert != "none" or peers else ""
    udp_attr = f' udp="{udp}"' if udp is not None else ""
    peers_attr = ' peers="1"' if peers else ""
    return (f'  <tls cert="{pki.server_cert}" key="{pki.server_key}"{ca} '
            f'client_cert="{client_cert}"{udp_attr}{peers_attr}/>\n')


def hosts(node: NodeProcess) -> str:
    return f"127.0.0.1:{node.port}"


def plain_request(port: int, request: dict) -> bytes:
    """One request over plain TCP: what comes back before the node closes."""
    with socket.create_connection(("127.0.0.1", port), timeout=IO_TIMEOUT_S) as sock:
        sock.sendall(json.dumps(request).encode())
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
        return data


def tls_request(port: int, request: dict, pki: Pki, cert: bool = False) -> dict:
    context = ssl.create_default_context(cafile=str(pki.ca))
    if cert:
        context.load_cert_chain(str(pki.client_cert), str(pki.client_key))
    with socket.create_connection(("127.0.0.1", port), timeout=IO_TIMEOUT_S) as raw, \
            context.wrap_socket(raw, server_hostname="127.0.0.1") as sock:
        sock.sendall(json.dumps(request).encode())
        data = b""
        while b"\n" not in data:
            chunk = sock.recv(65536)
            if not chunk:
                raise ConnectionError("closed")
            data += chunk
        return json.loads(data)


def udp_answers(port: int) -> bool:
    """Whether a UDP request to the port gets an answer within a second."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.settimeout(1.0)
        sock.connect(("127.0.0.1", port))
        try:
            sock.send(b'{"action":104}')
            return bool(sock.recv(65536))
        except (TimeoutError, ConnectionRefusedError):
            return False


def test_client_produces_and_consumes_over_tls(procs, tmp_path, pki):
    node = procs(tmp_path, tls_xml(pki))
    with Client(hosts(node), tls=True, tls_ca=str(pki.ca)) as c:
        ids = c.produce_batch("tq", [f"m{i}" for i in range(2000)])
        assert len(ids) == 2000
        assert c.produce("tq", "x" * 100_000) == 2001  # several TLS records per answer
        got = c.consume("tq", count=1000)
        assert [d.data for d in got] == [f"m{i}" for i in range(1000)]
        assert c.monitor("tq")["size"] == 1001

    async def main() -> None:
        errors: list[dict] = []  # what the event loop would log: an error in a callback
        asyncio.get_running_loop().set_exception_handler(lambda _, context: errors.append(context))
        async with AsyncClient(hosts(node), tls_ca=str(pki.ca)) as ac:  # the CA implies TLS
            assert await ac.produce("tq", "async") == 2002
            assert len(await ac.consume("tq", count=1000)) == 1000
            big = await ac.consume("tq")
            assert big is not None and big.data == "x" * 100_000
        # closed once close() returns, the close_notify exchanged (not left
        # to the garbage collector after the loop: a ResourceWarning)
        assert sockets_to(node.port) == 0
        assert errors == []

    asyncio.run(main())
    # the name in the certificate, by tls_server_hostname, and by an ssl_context
    with Client(f"localhost:{node.port}", tls_ca=str(pki.ca)) as c:
        assert c.monitor("tq")["size"] == 1
    context = ssl.create_default_context(cafile=str(pki.ca))
    with Client(hosts(node), ssl_context=context, tls_server_hostname="localhost") as c:
        assert c.consume("tq").data == "async"


def test_closing_does_not_wait_for_a_node_that_does_not_answer(procs, tmp_path, pki):
    """A stopped node never answers the close_notify: close() aborts the
    connection (after CLOSE_WAIT_S) rather than wait for it, and returns
    with the socket closed."""
    node = procs(tmp_path, tls_xml(pki))

    async def main() -> None:
        ac = AsyncClient(hosts(node), tls_ca=str(pki.ca))
        assert await ac.produce("tq", "a") == 1
        node.proc.send_signal(signal.SIGSTOP)
        try:
            await asyncio.wait_for(ac.close(), 60)  # asyncio alone: 30 s, then a warning
            assert sockets_to(node.port) == 0
        finally:
            node.proc.send_signal(signal.SIGCONT)

    asyncio.run(main())


def test_a_client_closed_after_a_timeout_leaves_no_socket_behind(procs, tmp_path, pki):
    """A connection that timed out is dropped at once (the silent node would
    not answer a close_notify), and close() leaves no socket open."""
    node = procs(tmp_path, tls_xml(pki))

    async def main() -> None:
        ac = AsyncClient(hosts(node), tls_ca=str(pki.ca), timeout=0.5, retry_for=0)
        assert await ac.produce("tq", "a") == 1
        node.proc.send_signal(signal.SIGSTOP)
        try:
            with pytest.raises(ClientTimeout):
                await ac.produce("tq", "b")
            await asyncio.wait_for(ac.close(), 60)
            assert sockets_to(node.port) == 0
        finally:
            node.proc.send_signal(signal.SIGCONT)

    asyncio.run(main())


def test_a_cancelled_long_poll_leaves_no_socket_behind(procs, tmp_path, pki):
    """Its connection is let go at once (answers due on it are of no use),
    not after a close_notify exchange a loop ending soon would cut short."""
    node = procs(tmp_path, tls_xml(pki))

    async def main() -> None:
        async with AsyncClient(hosts(node), tls_ca=str(pki.ca)) as ac:
            poll = asyncio.create_task(ac.consume("tq_wait", wait=30))

            async def parked() -> bool:
                return (await ac.monitor("tq_wait"))["waiting"] == 1

            for _ in range(300):  # (on the shared connection: a second socket)
                if await parked():
                    break
                await asyncio.sleep(0.1)
            else:
                raise AssertionError("the long poll was not parked within 30 s")
            assert sockets_to(node.port) == 2
            poll.cancel()
            with pytest.raises(asyncio.CancelledError):
                await poll
            assert sockets_to(node.port) == 1  # the poll's is gone

    asyncio.run(main())


def test_a_client_without_tls_fails_cleanly(procs, tmp_path, pki):
    node = procs(tmp_path, tls_xml(pki))
    assert plain_request(node.port, {"action": 104}) == b""  # closed, nothing answered
    with Client(hosts(node), retry_for=0.5) as c, pytest.raises(ClientConnectionError):
        c.monitor()
    # the node serves on
    assert tls_request(node.port, {"action": 104}, pki)["code"] == 0


def test_an_untrusted_node_fails_at_once(procs, tmp_path, pki):
    node = procs(tmp_path, tls_xml(pki))
    _, _, other_ca, _ = make_ca(tmp_path, "another CA")
    with Client(hosts(node), tls_ca=str(other_ca), retry_for=30) as c, \
            pytest.raises(ClientConnectionError, match="not trusted"):
        c.monitor()  # retry_for=30, yet at once: every node would say the same
    with Client(hosts(node), tls=True, retry_for=30) as c, \
            pytest.raises(ClientConnectionError, match="not trusted"):
        c.monitor()  # the system's CAs do not know the test CA
    with Client(hosts(node), tls_ca=str(pki.ca), tls_server_hostname="elsewhere.example",
                retry_for=30) as c, pytest.raises(ClientConnectionError, match="not trusted"):
        c.monitor()


def test_client_certificate_required(procs, tmp_path, pki):
    node = procs(tmp_path, tls_xml(pki, "required"))
    with Client(hosts(node), tls_ca=str(pki.ca), retry_for=0.5) as c, \
            pytest.raises(ClientConnectionError):
        c.monitor()
    with pytest.raises((ssl.SSLError, ConnectionError)):
        tls_request(node.port, {"action": 104}, pki)
    with Client(hosts(node), tls_ca=str(pki.ca), tls_cert=str(pki.client_cert),
                tls_key=str(pki.client_key)) as c:
        assert c.produce("certq", "x") == 1
    assert tls_request(node.port, {"action": 4, "queue": "certq"}, pki, cert=True)["size"] == 1


def test_client_certificate_optional(procs, tmp_path, pki):
    node = procs(tmp_path, tls_xml(pki, "optional"))
    assert tls_request(node.port, {"action": 104}, pki)["code"] == 0
    assert tls_request(node.port, {"action": 104}, pki, cert=True)["code"] == 0


def test_udp_is_off_with_tls_unless_asked_for(procs, tmp_path, pki):
    node = procs(tmp_path, tls_xml(pki))
    assert not udp_answers(node.port)
    node.stop()
    assert "(tls)" in node.stderr_text  # "serving on ... (tls)": no +udp
    other = tmp_path / "udp"
    other.mkdir()
    node = procs(other, tls_xml(pki, udp="1"))
    assert udp_answers(node.port)


def test_cli_over_tls(procs, tmp_path, pki):
    node = procs(tmp_path, tls_xml(pki, "optional") + f'  <security client_token="{TOKEN}"/>\n')
    server = ["-s", hosts(node), "--retry-for", "0"]

    def cli(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "qserver", *args, *server],
                              capture_output=True, text=True, timeout=60)

    done = cli("produce", "cliq", "hello", "--tls", "--tls-ca", str(pki.ca), "--token", TOKEN)
    assert done.returncode == 0, done.stderr
    done = cli("consume", "cliq", "--json", "--tls-ca", str(pki.ca), "--tls-cert",
               str(pki.client_cert), "--tls-key", str(pki.client_key), "--token", TOKEN)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["data"] == "hello"
    done = cli("monitor", "--tls-ca", str(pki.ca))  # no token
    assert done.returncode == 1 and "Unauthorized" in done.stderr
    done = cli("monitor", "--token", TOKEN)  # no TLS
    assert done.returncode == 1 and "ClientConnectionError" in done.stderr
    done = cli("monitor", "--tls-ca", str(tmp_path / "nope.pem"), "--token", TOKEN)
    assert done.returncode == 2 and "nope.pem" in done.stderr


def test_client_arguments_are_checked(pki, tmp_path):
    with pytest.raises(InvalidArgument, match="nope.pem"):
        Client("127.0.0.1:1", tls_ca=str(tmp_path / "nope.pem"))
    with pytest.raises(InvalidArgument, match="tls_key without tls_cert"):
        Client("127.0.0.1:1", tls=True, tls_key=str(pki.client_key))
    with pytest.raises(InvalidArgument, match="tls_cert="):
        Client("127.0.0.1:1", tls_cert=str(pki.client_cert), tls_key=str(pki.server_key))
    with pytest.raises(InvalidArgument, match="not both"):
        Client("127.0.0.1:1", ssl_context=ssl.create_default_context(), tls_ca=str(pki.ca))
    with pytest.raises(InvalidArgument, match="token"):
        Client("127.0.0.1:1", token="")
    with pytest.raises(InvalidArgument, match="without TLS"):
        AsyncClient("127.0.0.1:1", tls_server_hostname="x")


# -- start-up errors ---------------------------------------------------------------


def start_fails(tmp_path: Path, extra: str) -> str:
    """Start a node that must refuse to start; its stderr."""
    port = free_port()
    node = NodeProcess(write_config(tmp_path / "node.xml", port, extra), port)
    try:
        code = node.proc.wait(60)
        stderr = node.proc.stderr.read().decode()
    finally:
        node.kill()
    assert code == 2, stderr
    return stderr


def test_bad_certificate_or_key_stops_the_start(tmp_path, pki):
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("not a certificate\n")
    stderr = start_fails(tmp_path, f'<tls cert="{garbage}" key="{pki.server_key}"/>')
    assert "config error" in stderr and f"cert={str(garbage)!r}" in stderr
    assert "CERTIFICATE" in stderr
    stderr = start_fails(tmp_path, f'<tls cert="{pki.server_cert}" key="{garbage}"/>')
    assert f"key={str(garbage)!r}" in stderr and "PRIVATE KEY" in stderr
    # a key that does not go with the certificate: both files named
    stderr = start_fails(tmp_path, f'<tls cert="{pki.server_cert}" key="{pki.client_key}"/>')
    assert str(pki.server_cert) in stderr and str(pki.client_key) in stderr
    assert "does not go with" in stderr
    # a key where the CA bundle should be
    stderr = start_fails(tmp_path, f'<tls cert="{pki.server_cert}" key="{pki.server_key}" '
                                   f'ca="{pki.server_key}" client_cert="required"/>')
    assert f"ca={str(pki.server_key)!r}" in stderr


# -- a cluster: TLS and tokens, through a slave; peer links over TLS ----------------------


class TokenCluster(Cluster):
    """procs.Cluster over TLS with a token: its own checks (master election)
    speak TLS too."""

    pki: Pki

    def ask(self, node_id: int, **fields) -> dict | None:
        try:
            return tls_request(self.port(node_id), dict(fields, token=TOKEN), self.pki)
        except (OSError, ValueError):
            return None


def internal_port_speaks_tls(port: int, pki: Pki) -> bool:
    """A plain hello gets the connection closed, unanswered; a TLS client
    with a certificate of the cluster's CA completes the handshake."""
    with socket.create_connection(("127.0.0.1", port), timeout=IO_TIMEOUT_S) as sock:
        sock.sendall(b"\x00\x00\x00\x10" + b"\x94" + b"x" * 15)  # a frame, not TLS
        if sock.recv(65536) != b"":
            return False
    context = ssl.create_default_context(cafile=str(pki.ca))
    context.check_hostname = False
    context.load_cert_chain(str(pki.client_cert), str(pki.client_key))
    with socket.create_connection(("127.0.0.1", port), timeout=IO_TIMEOUT_S) as raw, \
            context.wrap_socket(raw) as tls:
        return tls.version() is not None


@pytest.mark.parametrize("engine", ["native", "raft"])
def test_cluster_with_tls_and_tokens_through_a_slave(tmp_path, pki, engine):
    """The client port and the peer links (<tls peers="1">) over TLS: a
    master is elected and a slave forwards over the TLS links."""
    cluster = TokenCluster(tmp_path, 3, engine=engine,
                           extra=tls_xml(pki, peers=True)
                           + f'  <security client_token="{TOKEN}"/>\n')
    cluster.pki = pki
    try:
        cluster.start_all()
        master = cluster.wait_master(60)
        slave = next(i for i in range(1, 4) if i != master)
        slave_hosts = f"127.0.0.1:{cluster.port(slave)}"
        with Client(slave_hosts, token=TOKEN, tls_ca=str(pki.ca)) as c:
            assert len(c.produce_batch("clq", ["a", "b", "c"])) == 3
            assert c.consume("clq").data == "a"
            assert c.monitor("clq")["size"] == 2
        with Client(slave_hosts, tls_ca=str(pki.ca), retry_for=0) as c, \
                pytest.raises(Unauthorized):
            c.produce("clq", "d")
        assert not udp_answers(cluster.port(slave))
        all_hosts = ",".join(f"127.0.0.1:{cluster.port(i)}" for i in range(1, 4))
        with Client(all_hosts, token=TOKEN, tls_ca=str(pki.ca)) as c:
            assert c.monitor("clq")["size"] == 2
        assert internal_port_speaks_tls(cluster.internal_ports[slave - 1], pki)
    finally:
        cluster.stop_all()


# -- the Spark sink -------------------------------------------------------------------


def test_spark_sink_with_token_and_tls(procs, tmp_path, pki):
    """A task of the sink (`write_rows`, what a Spark task runs; no JVM
    needed) with the options token and tlsCa."""
    pytest.importorskip("pyspark", reason="pyspark is not installed (the 'spark' extra)")
    pa = pytest.importorskip("pyarrow", reason="pyarrow is not installed (the 'spark' extra)")
    from pyspark.sql.types import StringType, StructField, StructType

    from qserver_spark import OptionError, parse_options
    from qserver_spark.datasource import write_rows
    from qserver_spark.errors import WriteError

    node = procs(tmp_path, tls_xml(pki) + f'  <security client_token="{TOKEN}"/>\n')
    schema = StructType([StructField("data", StringType())])
    base = {"hosts": hosts(node), "queue": "sparkq", "timeout": "30"}
    opts = parse_options({**base, "token": TOKEN, "tlsCa": str(pki.ca)}, schema)
    assert opts.tls and opts.tls_ca == str(pki.ca) and TOKEN not in repr(opts)
    rows = [pa.record_batch({"data": [f"r{i}" for i in range(2500)]})]
    done = write_rows(iter(rows), opts)
    assert done.rows == 2500
    with Client(hosts(node), token=TOKEN, tls_ca=str(pki.ca)) as c:
        assert c.monitor("sparkq")["size"] == 2500
    no_token = parse_options({**base, "tls": "true", "tlsCa": str(pki.ca)}, schema)
    with pytest.raises(WriteError, match="unauthorized"):
        write_rows(iter(rows), no_token)
    with pytest.raises(OptionError, match="token"):
        parse_options({**base, "token": "two words"}, schema)
    with pytest.raises(OptionError, match="tls"):
        parse_options({**base, "tls": "maybe"}, schema)
