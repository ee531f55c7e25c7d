"""The `qserver` client commands for the producer and queue controls
(issue 15, point 6): produce --priority/--dedup-id, produce QUEUE - (one
message per stdin line, in batches of up to 1,000), clear, pause, resume,
the new config settings; human and --json output, exit status. Against a
real node; commands run `main()` in process, as test_cli.py."""

from __future__ import annotations

import io
import json
import sys

import pytest

from qserver.cli import _setting, main
from qserver.client import Client
from test_client import VIRTUAL, start_node

DEADLINE_S = 30.0
PRIORITY_REASON = "priority must be an integer from 0 to 2147483647"

# -- arguments (no server) ---------------------------------------------------------------


def test_decimal_settings():
    assert _setting("dedup_window=1.5") == ("dedup_window", 1.5)
    assert _setting("dedup_window=.5") == ("dedup_window", 0.5)
    assert _setting("dedup_window=2.") == ("dedup_window", 2.0)
    assert _setting("dedup_window=-0.5") == ("dedup_window", -0.5)  # the server says why not
    assert _setting("dedup_window=300") == ("dedup_window", 300)
    assert _setting("max_size=0") == ("max_size", 0)
    for text in ("1.5.2", "1e3", "nan", "inf", ".", "\u0663.5"):
        assert _setting(f"x={text}") == ("x", text)
    assert _setting("paused=in") == ("paused", "in")


def test_bad_usage_exits_2_before_asking(capsys, monkeypatch):
    nobody = "127.0.0.1:9"  # nothing is sent: a bad argument is found first
    monkeypatch.setattr(sys, "stdin", io.StringIO("a\nb\n"))
    assert main(["produce", "q", "-", "--dedup-id", "k", "-s", nobody]) == 2
    assert capsys.readouterr().err == "qserver: --dedup-id names one message: not with DATA -\n"
    for argv in (["pause", "q", "sideways"], ["pause"], ["resume"], ["clear"],
                 ["clear", "a", "b"], ["produce", "q", "x", "--priority", "high"],
                 ["produce", "q"]):
        with pytest.raises(SystemExit) as info:  # argparse: usage error
            main([*argv, "-s", nobody])
        assert info.value.code == 2


# -- a real node --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def node(tmp_path_factory):
    n = start_node(tmp_path_factory.mktemp("cli_producer"), VIRTUAL)
    yield n
    n.kill()


@pytest.fixture
def qs(node, capsys, monkeypatch):
    """`qserver ARGS -s <node>` -> (exit status, stdout, stderr); `stdin=`
    what the command reads."""

    def run(*args: str, stdin: str | None = None) -> tuple[int, str, str]:
        if stdin is not None:
            monkeypatch.setattr(sys, "stdin", io.StringIO(stdin))
        status = main([*args, "-s", f"127.0.0.1:{node.port}"])
        out, err = capsys.readouterr()
        return status, out, err

    return run


@pytest.fixture
def client(node):
    with Client([f"127.0.0.1:{node.port}"], timeout=10, retry_for=DEADLINE_S) as c:
        yield c


def qjson(qs, *args: str, stdin: str | None = None):
    status, out, err = qs(*args, "--json", stdin=stdin)
    assert status == 0, err
    return json.loads(out)


@pytest.fixture
def batches(monkeypatch) -> list[int]:
    """The number of items of every `Client.produce_batch` call."""
    sizes: list[int] = []
    real = Client.produce_batch

    def produce_batch(self, queue, items, **kw):
        items = list(items)
        sizes.append(len(items))
        return real(self, queue, items, **kw)

    monkeypatch.setattr(Client, "produce_batch", produce_batch)
    return sizes


def test_produce_with_priority_and_dedup_id(qs, client):
    assert qs("produce", "c_pr", "low", "--priority", "2000") == (
        0, "produced msg_id 1 in c_pr\n", "")
    assert qjson(qs, "produce", "c_pr", "high", "--priority", "0") == {
        "queue": "c_pr", "msg_id": 2, "msg_ids": {"c_pr": 2}}
    assert qs("produce", "c_pr", "mid", "--dedup-id", "m") == (
        0, "produced msg_id 3 in c_pr\n", "")
    assert qs("produce", "c_pr", "mid again", "--dedup-id", "m") == (
        0, "duplicate of msg_id 3 in c_pr (nothing stored)\n", "")
    assert qjson(qs, "produce", "c_pr", "mid", "--dedup-id", "m", "--priority", "5") == {
        "queue": "c_pr", "msg_id": 3, "msg_ids": {"c_pr": 3}, "duplicate": True}
    assert qjson(qs, "produce", "c_pr", "n", "--dedup-id", "n", "--priority", "5",
                 "--retry", "60") == {"queue": "c_pr", "msg_id": 4, "msg_ids": {"c_pr": 4},
                                      "duplicate": False}
    assert client.show("c_pr", 4)["priority"] == 5 and client.show("c_pr", 4)["retry"] == 60
    assert [client.consume("c_pr").data for _ in range(4)] == ["high", "n", "mid", "low"]
    # a virtual queue: every message created, duplicates too
    assert qs("produce", "fan", "x", "--dedup-id", "v") == (
        0, "produced msg_id 1 in fan_a\nproduced msg_id 1 in fan_b\n", "")
    assert qjson(qs, "produce", "fan", "x", "--dedup-id", "v") == {
        "queue": "fan", "msg_id": 1, "msg_ids": {"fan_a": 1, "fan_b": 1}, "duplicate": True}


def test_produce_lines_from_stdin(qs, client, batches):
    lines = [f"line {i}" for i in range(2500)]
    status, out, err = qs("produce", "c_in", "-", stdin="\n".join(lines) + "\n")
    assert (status, err) == (0, "")
    assert out.splitlines() == [str(i) for i in range(1, 2501)]
    assert batches == [1000, 1000, 500]
    got = [d.data for d in client.messages("c_in", count=1000, stop_when_empty=True)]
    assert got == lines
    # --json: the list; options for every line; the line without its end
    del batches[:]
    ids = qjson(qs, "produce", "c_in", "-", "--priority", "9", "--retry", "60",
                stdin="a\r\n\nlast without newline")
    assert ids == [2501, 2502, 2503] and batches == [3]
    assert [(m["data"], m["priority"], m["retry"]) for m in client.peek("c_in", 5)] == [
        ("a", 9, 60), ("", 9, 60), ("last without newline", 9, 60)]
    assert qjson(qs, "produce", "c_in", "-", stdin="") == []
    assert batches == [3]  # nothing to send
    # a virtual queue: QUEUE:ID of every message created
    status, out, _ = qs("produce", "fan", "-", stdin="x\ny\n")
    first = client.monitor("fan_a")["max_id"] - 1
    assert out == f"fan_a:{first} fan_b:{first}\nfan_a:{first + 1} fan_b:{first + 1}\n"


def test_a_refused_batch_from_stdin_stops_after_what_was_printed(qs, client):
    assert qjson(qs, "config", "c_full", "max_size=1500")["max_size"] == 1500
    status, out, err = qs("produce", "c_full", "-",
                          stdin="".join(f"{i}\n" for i in range(2500)))
    assert status == 1
    assert out.splitlines() == [str(i) for i in range(1, 1001)]  # exactly what was stored
    assert err == "qserver: QueueFull: queue full: c_full (item 1000)\n"
    assert client.monitor("c_full")["size"] == 1000
    # a bad value: the server's reason, nothing stored
    assert qs("produce", "c_bad", "-", "--priority", "3000000000", stdin="x\n") == (
        1, "", f"qserver: ServerError: {PRIORITY_REASON} (item 0)\n")
    assert qs("produce", "c_bad", "x", "--priority", "-1") == (
        1, "", f"qserver: ServerError: {PRIORITY_REASON}\n")
    assert qs("produce", "c_bad", "x", "--dedup-id", "") == (
        1, "", "qserver: ServerError: dedup_id must be a string of 1 to 128 characters\n")
    assert client.monitor("c_bad")["size"] == 0


def test_clear(qs, client):
    client.produce_batch("c_cl", ["a", "b", "c"], retry=60)
    client.consume("c_cl")  # in flight: cleared too
    assert qs("clear", "c_cl") == (0, "cleared 3 messages from c_cl\n", "")
    assert client.monitor("c_cl")["size"] == 0
    client.produce("c_cl", "d")
    assert qs("clear", "c_cl") == (0, "cleared 1 message from c_cl\n", "")
    assert qjson(qs, "clear", "c_cl") == {"queue": "c_cl", "cleared": 0}
    assert qs("clear", "fan") == (
        1, "", "qserver: ServerError: virtual queue only takes produce\n")


def test_pause_and_resume(qs, client):
    client.produce("c_pz", "waiting")
    assert qs("pause", "c_pz", "in") == (0, "paused c_pz (in: produce refused)\n", "")
    assert qs("produce", "c_pz", "x") == (1, "", "qserver: QueuePaused: queue paused\n")
    assert qs("produce", "c_pz", "-", stdin="x\n") == (
        1, "", "qserver: QueuePaused: queue paused (item 0)\n")
    assert qs("consume", "c_pz") == (0, "msg_id 1: waiting\n", "")  # consumers go on
    config = qjson(qs, "pause", "c_pz", "out")
    assert config["paused"] == "out" and config == client.config("c_pz")
    assert qs("produce", "c_pz", "y") == (0, "produced msg_id 2 in c_pz\n", "")
    assert qs("consume", "c_pz") == (0, "no message ready in c_pz\n", "")
    assert qs("resume", "c_pz") == (0, "resumed c_pz\n", "")
    assert qs("consume", "c_pz") == (0, "msg_id 2: y\n", "")
    assert qs("pause", "c_pz") == (
        0, "paused c_pz (all: produce refused, nothing delivered)\n", "")
    assert qjson(qs, "monitor", "c_pz")["paused"] == "all"
    assert qjson(qs, "resume", "c_pz")["paused"] == "none"
    assert qs("produce", "c_pz", "z")[0] == 0


def test_config_with_the_new_settings(qs):
    config = qjson(qs, "config", "c_cfg")
    assert set(config) == {"max_deliveries", "dead_letter", "max_size", "dedup_window",
                           "paused"}
    assert qjson(qs, "config", "c_cfg", "max_size=5", "dedup_window=1.5", "paused=in") == dict(
        config, max_size=5, dedup_window=1.5, paused="in")
    status, out, _ = qs("config", "c_cfg", "max_size=0", "paused=none")
    assert status == 0
    assert out.splitlines() == [
        "queue           c_cfg", "max_deliveries  0", "dead_letter     none",
        f"max_size        {config['max_size']}", "dedup_window    1.5", "paused          none"]
    status, _, err = qs("config", "c_cfg", "dedup_window=604801")
    assert status == 1 and err.startswith("qserver: ServerError: bad value for dedup_window: ")
