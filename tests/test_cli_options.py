"""The `qserver` command line as a new user expects it (issue 18, point 5):
the client options before or after the command, QSERVER_SERVERS and
QSERVER_TIMEOUT, durations and ISO 8601 times, --version, monitor's nested
fields as rows, and every node's address in `status`. Against real nodes,
the command run as `python -m qserver` (and, where a time is measured or a
node is scripted, `main()` in process)."""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
import time
from importlib.metadata import version

import pytest

import qserver
from procs import Cluster, free_port, wait_until
from qserver import cli
from qserver.cli import (
    _apply_client_defaults,
    _field_lines,
    _parser,
    main,
    parse_duration,
    parse_when,
)
from qserver.errors import InvalidArgument
from test_client import start_node
from test_client_v2 import FakeNode, fake_node  # noqa: F401 (fake_node: a fixture)

DEADLINE_S = 60.0  # generous: CI is a shared, noisy 2-core machine
# Slack for times computed here and by a node: the command's start-up on a
# loaded machine comes between the two clocks.
CLOCK_SLACK_S = 15.0
ENV = {"QSERVER_SERVERS", "QSERVER_TIMEOUT", "QSERVER_TOKEN"}


def qserver_cmd(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """`python -m qserver ARGS` with the environment's QSERVER_* variables
    replaced by `env`."""
    base = {k: v for k, v in os.environ.items() if k not in ENV}
    return subprocess.run([sys.executable, "-m", "qserver", *args], capture_output=True,
                          text=True, timeout=DEADLINE_S, env={**base, **(env or {})})


@pytest.fixture(autouse=True)
def no_qserver_env(monkeypatch):
    """In-process commands see only the QSERVER_* variables a test sets."""
    for name in ENV:
        monkeypatch.delenv(name, raising=False)


# -- durations and times (no server) --------------------------------------------------


def test_durations():
    assert parse_duration("30s") == 30
    assert parse_duration("5m") == 300
    assert parse_duration("2h") == 7200
    assert parse_duration("1d") == 86400
    assert parse_duration("1.5s") == 1.5
    assert parse_duration(".5s") == 0.5
    assert parse_duration("250ms") == 0.25
    assert parse_duration("1h30m") == 5400
    assert parse_duration("90") == 90  # plain seconds, as before
    assert parse_duration("2.5") == 2.5
    assert parse_duration("-1") == -1  # as float() reads it: the client says why not
    for bad in ("", "s", "5x", "5 s", "5S", "-5s", "1e999", "nan", "inf", "5m 3s", "m5"):
        with pytest.raises(ValueError):
            parse_duration(bad)


def test_times_for_delay_and_ttl():
    assert parse_when("30") == 30.0  # the protocol's relative seconds, sent as given
    assert parse_when("1750000000") == 1750000000.0  # the protocol's absolute form
    assert parse_when("30s") == datetime.timedelta(seconds=30)  # from now: the client adds
    assert parse_when("1d") == datetime.timedelta(days=1)
    utc = parse_when("2026-11-25T08:00:00Z")
    assert isinstance(utc, datetime.datetime)
    assert utc.timestamp() == datetime.datetime(2026, 11, 25, 8, tzinfo=datetime.UTC).timestamp()
    offset = parse_when("2026-11-25T09:30:00+01:30")
    assert isinstance(offset, datetime.datetime) and offset.timestamp() == utc.timestamp()
    assert parse_when("2026-11-25 08:00:00.250Z").timestamp() == utc.timestamp() + 0.25
    with pytest.raises(ValueError, match="no time zone"):  # naive: refused, not guessed
        parse_when("2026-11-25T08:00:00")
    with pytest.raises(ValueError, match="no time zone"):
        parse_when("2026-11-25")
    with pytest.raises(ValueError, match="before 2001"):  # the protocol would read it relative
        parse_when("1999-01-01T00:00:00Z")
    with pytest.raises(ValueError, match="too far"):  # a duration the protocol would misread
        parse_when("20000d")
    for bad in ("2026-13-01T00:00:00Z", "tomorrow", "5x", "nan"):
        with pytest.raises(ValueError):
            parse_when(bad)


BAD_VALUES = [  # (argv without -s, the option named in the error)
    (["produce", "q", "x", "--delay", "soon"], "--delay"),
    (["produce", "q", "x", "--delay", "2026-11-25T08:00:00"], "--delay"),  # naive
    (["produce", "q", "x", "--ttl", "5y"], "--ttl"),
    (["produce", "q", "x", "--retry", "often"], "--retry"),
    (["nack", "q", "1", "--delay", "1999-01-01T00:00:00Z"], "--delay"),
    (["consume", "q", "--wait", "1e999"], "--wait"),
    (["consume", "q", "--lease", "1 h"], "--lease"),
    (["touch", "q", "1", "--lease", "forever"], "--lease"),
    (["produce", "q", "x", "--timeout", "5sec"], "--timeout"),
    (["--timeout", "5sec", "produce", "q", "x"], "--timeout"),
    (["--retry-for", "x", "leader"], "--retry-for"),
    (["leader", "--retry-for", "x"], "--retry-for"),
]


@pytest.mark.parametrize(("argv", "option"), BAD_VALUES)
def test_bad_values_are_usage_errors_naming_the_option(argv, option, capsys):
    with pytest.raises(SystemExit) as info:
        main([*argv, "-s", "127.0.0.1:9"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert f"error: argument {option}: " in err, err


def test_client_options_before_run_are_refused(capsys):
    for argv in (["--json", "run"], ["-s", "127.0.0.1:1", "local-cluster"],
                 ["--timeout", "1s", "run", "--config", "x.xml"]):
        with pytest.raises(SystemExit) as info:
            main(argv)
        assert info.value.code == 2
        assert "for the client commands, not" in capsys.readouterr().err
    # what deploy/ and local-cluster run still parses
    args = _parser().parse_args(["run", "--config", "c.xml", "--log-format", "json"])
    assert (args.command, args.config, args.log_format) == ("run", "c.xml", "json")


def test_version():
    r = qserver_cmd("--version")
    assert (r.returncode, r.stdout, r.stderr) == (0, f"qserver {version('qserver')}\n", "")


def test_version_of_a_checkout_that_is_not_installed(monkeypatch):
    import importlib.metadata

    def not_installed(name: str) -> str:
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", not_installed)
    assert cli._version() == qserver.__version__


# -- options before or after the command, and the environment (no server) --------------


def parsed(argv: list[str], environ: dict[str, str] | None = None):
    args = _parser().parse_args(argv)
    _apply_client_defaults(args, environ or {})
    return args


def test_options_before_and_after_the_command():
    before = parsed(["-s", "h1:1", "--json", "--timeout", "2m", "--retry-for", "1s",
                     "--token", "t", "--tls", "produce", "q", "x"])
    after = parsed(["produce", "q", "x", "-s", "h1:1", "--json", "--timeout", "2m",
                    "--retry-for", "1s", "--token", "t", "--tls"])
    for args in (before, after):
        assert args.addresses == [("h1", 1)]
        assert (args.json, args.timeout, args.retry_for, args.token, args.tls) == (
            True, 120.0, 1.0, "t", True)
    # one given before and another after: neither lost to the other's default
    args = parsed(["--json", "leader", "--timeout", "7"])
    assert (args.json, args.timeout) == (True, 7.0)
    args = parsed(["--timeout", "7", "leader", "--json"])
    assert (args.json, args.timeout) == (True, 7.0)
    # the same option on both sides: the one after the command wins, as a
    # later option does; -s collects both, in order, commas splitting
    assert parsed(["--timeout", "7", "leader", "--timeout", "9"]).timeout == 9.0
    assert parsed(["-s", "h1:1", "leader", "-s", "h2:2,h3:3"]).addresses == [
        ("h1", 1), ("h2", 2), ("h3", 3)]
    defaults = parsed(["leader"])
    assert defaults.addresses == [("127.0.0.1", 1111)]
    assert (defaults.json, defaults.timeout, defaults.retry_for, defaults.token,
            defaults.tls, defaults.tls_ca) == (False, 5.0, cli.CLI_RETRY_FOR_S, None, False,
                                               None)


def test_environment_variables():
    env = {"QSERVER_SERVERS": "h1:1, h2:2", "QSERVER_TIMEOUT": "90"}
    args = parsed(["leader"], env)
    assert (args.addresses, args.timeout) == ([("h1", 1), ("h2", 2)], 90.0)
    args = parsed(["leader", "-s", "h3:3", "--timeout", "4"], env)  # the command line wins
    assert (args.addresses, args.timeout) == ([("h3", 3)], 4.0)
    args = parsed(["-s", "h3:3", "leader"], {"QSERVER_SERVERS": "", "QSERVER_TIMEOUT": " "})
    assert (args.addresses, args.timeout) == ([("h3", 3)], 5.0)  # empty: as if unset
    assert parsed(["leader", "--timeout", "4"], {"QSERVER_TIMEOUT": "bad"}).timeout == 4.0
    for bad in ("soon", "30s", "0", "-1", "inf"):  # seconds, as the client reads it
        with pytest.raises(InvalidArgument, match=r"^\$QSERVER_TIMEOUT="):
            parsed(["leader"], {"QSERVER_TIMEOUT": bad})
    with pytest.raises(InvalidArgument, match=r"^\$QSERVER_SERVERS: "):
        parsed(["leader"], {"QSERVER_SERVERS": "nohost"})
    with pytest.raises(InvalidArgument, match=r"^-s: "):
        parsed(["leader", "-s", "h1:x"])
    with pytest.raises(InvalidArgument, match=r"^-s: no HOST:PORT"):
        parsed(["leader", "-s", ","])


def test_a_url_in_the_environment_or_in_s():
    url = "qserver://h1:1,h2:2/?timeout=7&retry_for=1&token=tk"
    args = parsed(["leader"], {"QSERVER_SERVERS": url, "QSERVER_TIMEOUT": "9"})
    assert args.addresses == [("h1", 1), ("h2", 2)]
    assert (args.timeout, args.retry_for, args.token, args.tls) == (7.0, 1.0, "tk", False)
    # the command line wins over the URL's settings, the URL over $QSERVER_TIMEOUT
    args = parsed(["leader", "--timeout", "3", "--retry-for", "2s", "--token", "mine"],
                  {"QSERVER_SERVERS": url, "QSERVER_TIMEOUT": "9"})
    assert (args.timeout, args.retry_for, args.token) == (3.0, 2.0, "mine")
    args = parsed(["leader", "--token-file", "f"], {"QSERVER_SERVERS": url})
    assert (args.token, args.token_file) == (None, "f")  # the file's token, not the URL's
    args = parsed(["leader"], {"QSERVER_SERVERS": "qserver://h1:1", "QSERVER_TIMEOUT": "9"})
    assert (args.timeout, args.retry_for, args.token) == (9.0, cli.CLI_RETRY_FOR_S, None)
    # -s wins over the variable, settings and all; a URL in -s; qservers:// is TLS
    args = parsed(["-s", "qservers://h3:3/?tls_ca=ca.pem", "leader"], {"QSERVER_SERVERS": url})
    assert (args.addresses, args.tls, args.tls_ca, args.token, args.timeout) == (
        [("h3", 3)], True, "ca.pem", None, 5.0)
    with pytest.raises(InvalidArgument, match=r"^-s: a qserver:// URL names every node"):
        parsed(["-s", "qserver://h1:1", "leader", "-s", "h2:2"])
    for bad in ("qserver://h1:1/?token=s3cret&nope=1", "http://h1:1/?token=s3cret",
                "qserver://h1/?token=s3cret"):
        with pytest.raises(InvalidArgument, match=r"^\$QSERVER_SERVERS: ") as info:
            parsed(["leader"], {"QSERVER_SERVERS": bad})
        assert "s3cret" not in str(info.value)


# -- monitor's rows (no server) --------------------------------------------------------


def test_nested_fields_as_rows_and_tables():
    info = {"node_id": 1, "role": "master", "leader_node_id": 1,
            "slaves": [{"node_id": 2, "host": "10.0.0.2", "port": 1112, "match_id": 7,
                        "lag": 0, "connected": True},
                       {"node_id": 3, "match_id": 5, "lag": 2, "connected": False}],
            "snapshot": {"taken": 12, "last_pause_ms": None, "writing": False,
                         "streaming_to": [2, 3]},
            "storage": {"fsync": "batch", "disk_full": False, "deep": {"x": []}},
            "size": 4}
    assert _field_lines(info) == [
        "node_id                 1",
        "role                    master",
        "leader_node_id          1",
        "size                    4",
        "snapshot.taken          12",
        "snapshot.last_pause_ms  -",
        "snapshot.writing        no",
        "snapshot.streaming_to   2, 3",
        "storage.fsync           batch",
        "storage.disk_full       no",
        "storage.deep.x          -",
        "slaves:",
        "  NODE  ADDRESS        MATCH_ID  LAG  CONNECTED",
        "  2     10.0.0.2:1112  7         0    yes",
        "  3     -              5         2    no",
    ]
    # without addresses (a slave whose link has not come up since the master started)
    lines = _field_lines({"slaves": [{"node_id": 2, "match_id": 1, "lag": 0,
                                      "connected": True}]})
    assert lines == ["slaves:", "  NODE  MATCH_ID  LAG  CONNECTED", "  2     1         0    yes"]


# -- real nodes ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def stored_node(tmp_path_factory):
    """One node with storage: monitor shows `storage` (and `snapshot`)."""
    tmp = tmp_path_factory.mktemp("cli_options")
    n = start_node(tmp, f'  <storage dir="{tmp / "data"}" fsync="batch"/>\n')
    yield n
    n.kill()


def test_options_before_or_after_against_a_node(stored_node):
    at = f"127.0.0.1:{stored_node.port}"
    r = qserver_cmd("-s", at, "produce", "opt_q", "one")
    assert (r.returncode, r.stdout) == (0, "produced msg_id 1 in opt_q\n"), r.stderr
    r = qserver_cmd("produce", "opt_q", "two", "-s", at)
    assert (r.returncode, r.stdout) == (0, "produced msg_id 2 in opt_q\n"), r.stderr
    r = qserver_cmd("--json", "-s", at, "--timeout", "30s", "consume", "opt_q", "--wait", "2s")
    assert r.returncode == 0 and json.loads(r.stdout) == {"queue": "opt_q", "msg_id": 1,
                                                          "data": "one"}, r.stderr
    # a node that is down before the command, a live one after it: both are asked
    down = f"127.0.0.1:{free_port()}"
    r = qserver_cmd("-s", down, "--retry-for", "30s", "consume", "opt_q", "-s", at)
    assert (r.returncode, r.stdout) == (0, "msg_id 2: two\n"), r.stderr


def test_environment_against_a_node(stored_node):
    at = f"127.0.0.1:{stored_node.port}"
    nobody = f"127.0.0.1:{free_port()}"
    r = qserver_cmd("produce", "env_q", "x", env={"QSERVER_SERVERS": f"{nobody},{at}",
                                                  "QSERVER_TIMEOUT": "20"})
    assert (r.returncode, r.stdout) == (0, "produced msg_id 1 in env_q\n"), r.stderr
    # -s wins over the variable (which names nobody here)
    r = qserver_cmd("consume", "env_q", "-s", at, "--retry-for", "0",
                    env={"QSERVER_SERVERS": nobody})
    assert (r.returncode, r.stdout) == (0, "msg_id 1: x\n"), r.stderr
    r = qserver_cmd("leader", env={"QSERVER_SERVERS": at, "QSERVER_TIMEOUT": "a while"})
    assert r.returncode == 2 and r.stderr == (
        "qserver: $QSERVER_TIMEOUT='a while': not a number of seconds > 0\n")
    r = qserver_cmd("leader", env={"QSERVER_SERVERS": "localhost"})
    assert r.returncode == 2 and r.stderr.startswith("qserver: $QSERVER_SERVERS: ")


def test_a_url_against_nodes(stored_node, fake_node, capsys, monkeypatch):  # noqa: F811
    at = f"127.0.0.1:{stored_node.port}"
    r = qserver_cmd("produce", "url_q", "x",
                    env={"QSERVER_SERVERS": f"qserver://{at}/?timeout=20&retry_for=20"})
    assert (r.returncode, r.stdout) == (0, "produced msg_id 1 in url_q\n"), r.stderr
    r = qserver_cmd("-s", f"qserver://{at}", "consume", "url_q")
    assert (r.returncode, r.stdout) == (0, "msg_id 1: x\n"), r.stderr
    # the URL's token goes as action 0, ahead of the request; --token wins
    node = fake_node(lambda request: {"msg_id": 5} if request["action"] == 1 else {})
    monkeypatch.setenv("QSERVER_SERVERS", f"qserver://127.0.0.1:{node.port}/?token=from-url")
    assert main(["produce", "q", "x"]) == 0
    assert main(["produce", "q", "y", "--token", "from-option"]) == 0
    assert capsys.readouterr().out == "produced msg_id 5 in q\n" * 2
    tokens = [r["token"] for r in node.requests if r["action"] == 0]
    assert tokens == ["from-url", "from-option"]


def hold_produces(request: dict):
    """A node that never answers a produce (and answers the rest)."""
    return FakeNode.HOLD if request["action"] == 1 else {}


@pytest.mark.parametrize(("argv", "env"), [
    ([], {"QSERVER_TIMEOUT": "0.3"}),  # the variable
    (["--timeout", "300ms"], {"QSERVER_TIMEOUT": "60"}),  # the option wins over it
])
def test_the_timeout_from_the_environment_or_the_option(fake_node, capsys,  # noqa: F811
                                                        monkeypatch, argv, env):
    node = fake_node(hold_produces)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    started = time.monotonic()
    status = main(["produce", "q", "x", "-s", f"127.0.0.1:{node.port}", "--retry-for", "0",
                   *argv])
    took = time.monotonic() - started
    assert status == 1 and "ClientTimeout" in capsys.readouterr().err
    assert took < 4.0  # 0.3 s, not the default 5 s nor the variable's 60 s
    node.release.set()


def test_durations_and_times_against_a_node(stored_node):
    at = f"127.0.0.1:{stored_node.port}"

    def show(msg_id: int) -> dict:
        r = qserver_cmd("show", "dur_q", str(msg_id), "--json", "-s", at)
        assert r.returncode == 0, r.stderr
        return json.loads(r.stdout)

    now = time.time()
    r = qserver_cmd("produce", "dur_q", "later", "--delay", "30m", "--ttl", "2h",
                    "--retry", "1m", "-s", at)
    assert r.returncode == 0, r.stderr
    m = show(1)
    assert abs(m["ready_at"] - (now + 1800)) < CLOCK_SLACK_S
    assert abs(m["ttl"] - (now + 7200)) < CLOCK_SLACK_S
    assert m["retry"] == 60 and m["state"] == "delayed"
    at_utc = "2030-01-02T03:04:05Z"
    r = qserver_cmd("produce", "dur_q", "dated", "--delay", at_utc,
                    "--ttl", "2030-01-02T05:04:05+02:00", "-s", at)  # the same instant
    assert r.returncode == 0, r.stderr
    m = show(2)
    expected = datetime.datetime(2030, 1, 2, 3, 4, 5, tzinfo=datetime.UTC).timestamp()
    assert (m["ready_at"], m["ttl"]) == (expected, expected)
    r = qserver_cmd("produce", "dur_q", "soon", "--delay", "0.1", "--retry", "1h",
                    "--ttl", "1d", "-s", at)
    assert r.returncode == 0, r.stderr
    r = qserver_cmd("consume", "dur_q", "--count", "1", "--wait", "20s", "--lease", "90s",
                    "--json", "-s", at)
    assert r.returncode == 0, r.stderr
    [got] = json.loads(r.stdout)
    assert (got["msg_id"], got["data"]) == (3, "soon")
    now = time.time()
    assert abs(show(3)["retry_at"] - (now + 90)) < CLOCK_SLACK_S
    r = qserver_cmd("touch", "dur_q", "3", "--lease", "1h30m", "--receipt", got["receipt"],
                    "-s", at)
    assert r.returncode == 0, r.stderr
    assert abs(show(3)["retry_at"] - (time.time() + 5400)) < CLOCK_SLACK_S
    r = qserver_cmd("nack", "dur_q", "3", "--delay", "5m", "--receipt", got["receipt"],
                    "-s", at)
    assert r.returncode == 0, r.stderr
    m = show(3)
    assert m["state"] == "delayed" and abs(m["ready_at"] - (time.time() + 300)) < CLOCK_SLACK_S
    r = qserver_cmd("produce", "dur_q", "x", "--delay", "2030-01-02T03:04:05", "-s", at)
    assert r.returncode == 2 and "argument --delay: " in r.stderr and "no time zone" in r.stderr


def test_monitor_prints_nested_fields_as_rows(stored_node):
    at = f"127.0.0.1:{stored_node.port}"
    r = qserver_cmd("monitor", "mon_q", "-s", at)
    assert r.returncode == 0, r.stderr
    assert "{" not in r.stdout and "[" not in r.stdout
    rows = dict(line.split(None, 1) for line in r.stdout.splitlines())
    assert rows["queue"] == "mon_q" and rows["size"] == "0"
    assert rows["host"] == "127.0.0.1" and rows["port"] == str(stored_node.port)
    assert rows["storage.fsync"] == "batch" and rows["storage.disk_full"] == "no"
    r = qserver_cmd("monitor", "--json", "-s", at)  # JSON as it was: nested
    info = json.loads(r.stdout)
    assert info["storage"]["fsync"] == "batch" and info["storage"]["disk_full"] is False


@pytest.mark.parametrize("engine", ["native", "raft"])
def test_status_and_monitor_on_a_cluster(cluster, engine):
    c: Cluster = cluster(engine=engine)
    m = c.wait_master()
    addresses = {i: f"127.0.0.1:{c.port(i)}" for i in range(1, 4)}
    slave = next(i for i in range(1, 4) if i != m)

    def status(*servers: str) -> list[dict]:
        args = [a for s in servers for a in ("-s", s)]
        r = qserver_cmd("status", "--json", *args)
        assert r.returncode == 0, r.stderr
        return json.loads(r.stdout)

    def settled() -> list[dict] | None:
        rows = status(*addresses.values())
        return rows if all(r["lag"] == 0 for r in rows) else None

    # every node asked: each row has the node's own address
    rows = wait_until(settled, DEADLINE_S)
    assert {r["node_id"]: r["address"] for r in rows} == addresses
    assert all(r["asked"] == r["address"] for r in rows)
    # one node asked: it, the master it names, and the slaves the master
    # gives the addresses of (every one, once their links are up) are asked
    rows = status(addresses[slave])
    by_id = {r["node_id"]: r for r in rows}
    assert set(by_id) == {1, 2, 3}
    assert by_id[m]["role"] == "master"
    assert {i: (r["address"], r["asked"]) for i, r in by_id.items()} == {
        i: (a, a) for i, a in addresses.items()}
    r = qserver_cmd("status", "-s", addresses[slave])
    lines = r.stdout.splitlines()
    assert lines[0].split()[:3] == ["NODE", "ADDRESS", "ROLE"] and len(lines) == 4
    assert {int(line.split()[0]): line.split()[1] for line in lines[1:]} == addresses
    # monitor through a slave: the master's view, slaves as a table with addresses
    r = qserver_cmd("monitor", "-s", addresses[slave])
    assert r.returncode == 0 and "{" not in r.stdout, r.stderr
    lines = r.stdout.splitlines()
    table = lines[lines.index("slaves:") + 1:]
    assert table[0].split()[:2] == ["NODE", "ADDRESS"] and "CONNECTED" in table[0].split()
    assert {int(line.split()[0]): line.split()[1] for line in table[1:]} == {
        i: a for i, a in addresses.items() if i != m}


def test_status_asks_the_slaves_the_master_gives_addresses_of(fake_node, capsys):  # noqa: F811
    """A master whose `slaves` carry host and port (where the engine knows
    them): status with one node given asks them too; a slave listed with
    an address that does not answer is down (exit 1), one without an
    address is "(not asked)"."""
    dead_port = free_port()

    def leader(request: dict) -> dict | None:
        if request["action"] != 8:
            return None
        return {"leader_node_id": 1, "leader_host": "127.0.0.1", "leader_port": master.port}

    slave = fake_node(lambda r: leader(r) or {
        "node_id": 2, "role": "slave", "leader_node_id": 1, "host": "127.0.0.1",
        "port": slave.port, "vote_id": 4, "trans_id": 10, "commit_id": 10})

    def master_answers(request: dict) -> dict:
        return leader(request) or {
                "node_id": 1, "role": "master", "leader_node_id": 1, "host": "127.0.0.1",
                "port": master.port, "vote_id": 4, "trans_id": 10, "commit_id": 10,
                "slaves": [
                    {"node_id": 2, "host": "127.0.0.1", "port": slave.port, "match_id": 10,
                     "lag": 0, "connected": True},
                    {"node_id": 3, "host": "127.0.0.1", "port": dead_port, "match_id": 8,
                     "lag": 2, "connected": False},
                    {"node_id": 4, "match_id": 10, "lag": 0, "connected": True}]}

    master = fake_node(master_answers)
    assert main(["status", "--json", "-s", f"127.0.0.1:{slave.port}", "--timeout", "5s",
                 "--retry-for", "0"]) == 1
    out, err = capsys.readouterr()
    rows = {r["node_id"]: r for r in json.loads(out)}
    assert set(rows) == {1, 2, 3, 4}
    assert (rows[1]["address"], rows[1]["role"]) == (f"127.0.0.1:{master.port}", "master")
    assert (rows[2]["address"], rows[2]["role"]) == (f"127.0.0.1:{slave.port}", "slave")
    assert (rows[3]["address"], rows[3]["role"], rows[3]["lag"]) == (
        f"127.0.0.1:{dead_port}", "down", 2)
    assert (rows[4]["address"], rows[4]["reachable"]) == (None, None)
    assert err == f"qserver: no answer from 127.0.0.1:{dead_port}\n"
    assert main(["status", "-s", f"127.0.0.1:{slave.port}", "--retry-for", "0"]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert lines[-1].split()[:3] == ["4", "(not", "asked)"]
