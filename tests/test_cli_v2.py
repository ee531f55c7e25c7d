"""The `qserver` client commands for the consumer controls (issue 14,
point 5): consume --count/--wait/--lease/--ack and several queues, confirm
--receipt, nack, touch, show, peek and config, human and --json output, exit
status. The output shapes are checked against a scripted node (FakeNode,
from test_client_v2), the behaviour against a real one. Commands run
`main()` in process, as test_cli.py."""

from __future__ import annotations

import json
import re
import time

import pytest

from qserver.cli import _setting, _when, main
from qserver.errors import InvalidArgument
from test_client import start_node
from test_client_v2 import EARLY_S, fake_node  # noqa: F401 (fake_node: a fixture)

# -- arguments (no server) ---------------------------------------------------------------


def test_settings_from_key_value():
    assert _setting("max_deliveries=3") == ("max_deliveries", 3)
    assert _setting("max_deliveries=-1") == ("max_deliveries", -1)  # the server says why not
    assert _setting("dead_letter=failed") == ("dead_letter", "failed")
    assert _setting("dead_letter=none") == ("dead_letter", None)
    assert _setting("dead_letter=None") == ("dead_letter", None)
    assert _setting("dead_letter=") == ("dead_letter", None)
    assert _setting("paused=none") == ("paused", "none")  # "none" is a value of paused
    assert _setting("x=a=b") == ("x", "a=b")
    assert _setting("n=\u0663") == ("n", "\u0663")  # not an ASCII integer: a string
    for bad in ("max_deliveries", "=3", ""):
        with pytest.raises(InvalidArgument):
            _setting(bad)


def test_bad_usage_exits_2_before_asking(capsys):
    nobody = "127.0.0.1:9"  # nothing is sent: a bad argument is found first
    assert main(["config", "q", "max_deliveries", "-s", nobody]) == 2
    assert capsys.readouterr().err == "qserver: setting 'max_deliveries' is not KEY=VALUE\n"
    assert main(["config", "q", "max_deliveries=1", "max_deliveries=2", "-s", nobody]) == 2
    assert capsys.readouterr().err == "qserver: setting max_deliveries given twice\n"
    assert main(["consume", "q", "--count", "0", "-s", nobody]) == 2
    assert "count must be a positive integer" in capsys.readouterr().err
    assert main(["consume", "q", "--lease", "0", "-s", nobody]) == 2
    for argv in (["consume"], ["nack", "q"], ["touch", "q", "x"], ["show", "q"],
                 ["peek", "q", "--count", "many"]):
        with pytest.raises(SystemExit) as info:  # argparse: usage error
            main(argv)
        assert info.value.code == 2


def test_times_for_people():
    now = time.time()
    assert _when(0) == "-"
    assert re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{3} \(in (59|60)\.\d s\)",
                        _when(now + 60))
    assert _when(now - 5).endswith(" s ago)")


# -- output shapes, against a scripted node ------------------------------------------------

SHOWN = {"msg_id": 4, "state": "in_flight", "data": "the data", "priority": 1024,
         "retry": 60, "deliveries": 2, "nacks": 1}
TIMES = {"ready_at": -10, "ttl": 3600, "retry_at": 50}  # seconds from now


def shown(now: float) -> dict:
    return {**SHOWN, **{key: now + delta for key, delta in TIMES.items()}}


def same_times(got: dict, now: float) -> dict:
    """`got` without its times, once they are checked (within 5 s of `now`
    and TIMES)."""
    for key, delta in TIMES.items():
        assert abs(got.pop(key) - (now + delta)) < 5
    return got


def scripted(request: dict):
    """Answers as a node implementing issue 14 would, for the CLI's requests."""
    action = request["action"]
    now = time.time()
    if request.get("receipt") == "old":
        return {"code": -1, "reason": "stale receipt"}
    if action == 2:
        if "count" not in request:
            return {"queue": "b", "msg_id": 3, "data": "one", "deliveries": 1,
                    "receipt": "1.3.1"}
        return {"messages": [
            {"queue": "b", "msg_id": 3, "data": "one", "deliveries": 1, "receipt": "1.3.1"},
            {"queue": "b", "msg_id": 5, "data": "two words", "deliveries": 4}]}
    if action == 3:
        return {"found": request["msg_id"] != 404}
    if action == 9:
        if request["msg_id"] == 6:
            return {"dead_lettered": True, "dead_letter": "dlq"}
        if request["msg_id"] == 7:
            return {"deleted": True}
        return {"ready_at": now + request.get("delay", 0)}
    if action == 10:
        return {"retry_at": now + request.get("lease", 60)}
    if action == 11:
        if request["msg_id"] == 404:
            return {"code": -1, "reason": "no such message"}
        return {"message": shown(now)}
    if action == 12:
        return {"messages": [dict(shown(now), queue=request["queue"])][:request["count"]]}
    if action == 5:
        config = {"max_deliveries": 0, "dead_letter": None}
        config.update(request.get("set", {}))
        return {"config": config}
    return {"code": -1, "reason": "invalid action"}


def _run(capsys, port: int, *args: str) -> tuple[int, str, str]:
    status = main([*args, "-s", f"127.0.0.1:{port}"])
    out, err = capsys.readouterr()
    return status, out, err


@pytest.fixture
def fake(fake_node, capsys):  # noqa: F811 (the fixture imported above)
    """`qserver ARGS -s <scripted node>` -> (exit status, stdout, stderr);
    `fake.node` is the node (its requests)."""
    node = fake_node(scripted)

    def run(*args: str) -> tuple[int, str, str]:
        return _run(capsys, node.port, *args)

    run.node = node
    return run


def test_consume_forms(fake):
    # without --count: today's output, whatever the node adds
    assert fake("consume", "q") == (0, "msg_id 3: one\n", "")
    status, out, _ = fake("consume", "q", "--json")
    assert json.loads(out) == {"queue": "b", "msg_id": 3, "data": "one"}
    # several queues: the line says which queue
    assert fake("consume", "a", "b", "--wait", "5", "--lease", "30") == (
        0, "msg_id 3 in b: one\n", "")
    assert fake.node.requests[-1] == {"action": 2, "queues": ["a", "b"], "wait": 5.0,
                                      "lease": 30.0, "seq": fake.node.requests[-1]["seq"]}
    # --count: every field, receipts included
    status, out, _ = fake("consume", "b", "--count", "2")
    assert out.splitlines() == ["QUEUE  MSG_ID  DELIVERIES  RECEIPT  DATA",
                                "b      3       1           1.3.1    one",
                                "b      5       4           -        two words"]
    status, out, _ = fake("consume", "b", "--count", "2", "--json")
    assert json.loads(out) == [
        {"queue": "b", "msg_id": 3, "data": "one", "deliveries": 1, "receipt": "1.3.1"},
        {"queue": "b", "msg_id": 5, "data": "two words", "deliveries": 4, "receipt": None}]
    # --ack: printed, then confirmed with each receipt
    del fake.node.requests[:]
    status, out, _ = fake("consume", "b", "--count", "2", "--ack", "--json")
    assert status == 0 and len(json.loads(out)) == 2
    confirms = [r for r in fake.node.requests if r["action"] == 3]
    assert [(r["msg_id"], r.get("receipt")) for r in confirms] == [(3, "1.3.1"), (5, None)]


def test_receipt_commands(fake):
    assert fake("confirm", "q", "3", "--receipt", "1.3.1") == (
        0, "confirmed msg_id 3 in q\n", "")
    assert fake("confirm", "q", "404") == (
        0, "confirmed msg_id 404 in q (no such message: nothing was deleted)\n", "")
    status, out, _ = fake("confirm", "q", "404", "--json")
    assert json.loads(out) == {"queue": "q", "msg_id": 404, "confirmed": True, "found": False}
    # a stale receipt is an error: exit 1, one line, the typed error's name
    assert fake("confirm", "q", "3", "--receipt", "old") == (
        1, "", "qserver: StaleReceipt: stale receipt\n")
    assert fake("nack", "q", "3", "--receipt", "old")[0] == 1
    status, out, _ = fake("nack", "q", "3", "--receipt", "1.3.1", "--delay", "30")
    assert re.fullmatch(r"nacked msg_id 3 in q: deliverable again at .* \(in \d+\.\d s\)\n", out)
    assert fake.node.requests[-1]["delay"] == 30.0
    status, out, _ = fake("nack", "q", "3", "--json")
    got = json.loads(out)
    assert abs(got.pop("ready_at") - time.time()) < 5
    assert got == {"queue": "q", "msg_id": 3}
    assert fake("nack", "q", "6")[1] == "nacked msg_id 6 in q: moved to the dead-letter queue dlq\n"
    status, out, _ = fake("nack", "q", "6", "--json")
    assert json.loads(out) == {"queue": "q", "msg_id": 6, "dead_lettered": True,
                               "dead_letter": "dlq"}
    assert fake("nack", "q", "7")[1] == (
        "nacked msg_id 7 in q: deleted (no more deliveries, and no dead-letter queue)\n")
    status, out, _ = fake("touch", "q", "3", "--receipt", "1.3.1", "--lease", "120")
    assert re.fullmatch(r"touched msg_id 3 in q: comes back at .* \(in 1[12]\d\.\d s\) "
                        r"unless confirmed\n", out)
    status, out, _ = fake("touch", "q", "3", "--json")
    got = json.loads(out)
    assert abs(got.pop("retry_at") - (time.time() + 60)) < 5
    assert got == {"queue": "q", "msg_id": 3}


def test_show_peek_config(fake):
    status, out, _ = fake("show", "q", "4")
    lines = out.splitlines()
    assert lines[0].split() == ["queue", "q"] and lines[-1] == "data        the data"
    fields = dict(line.split(None, 1) for line in lines)
    assert fields["state"] == "in_flight" and fields["deliveries"] == "2"
    assert re.fullmatch(r"\d{4}-.* \(in (4\d|50)\.\d s\)", fields["retry_at"])
    status, out, _ = fake("show", "q", "4", "--json")
    assert same_times(json.loads(out), time.time()) == {"queue": "q", **SHOWN}
    # a message that is not there: exit 1, nothing on stdout
    assert fake("show", "q", "404") == (1, "", "qserver: no such message: msg_id 404 in q\n")
    assert fake("show", "q", "404", "--json") == (
        1, "", "qserver: no such message: msg_id 404 in q\n")
    status, out, _ = fake("peek", "q", "--count", "3")
    header, row = out.splitlines()
    assert header.split() == ["MSG_ID", "STATE", "PRIORITY", "DELIVERIES", "READY_AT", "DATA"]
    assert row.startswith("4       in_flight  1024      2           ") and \
        row.endswith(" s ago)  the data")
    assert fake.node.requests[-1]["count"] == 3
    status, out, _ = fake("peek", "q", "--json")
    [peeked] = json.loads(out)
    assert same_times(peeked, time.time()) == {"queue": "q", **SHOWN}
    assert fake("config", "q") == (
        0, "queue           q\nmax_deliveries  0\ndead_letter     none\n", "")
    status, out, _ = fake("config", "q", "max_deliveries=3", "dead_letter=dlq", "--json")
    assert json.loads(out) == {"max_deliveries": 3, "dead_letter": "dlq"}
    assert fake.node.requests[-1]["set"] == {"max_deliveries": 3, "dead_letter": "dlq"}
    fake("config", "q", "dead_letter=none")
    assert fake.node.requests[-1]["set"] == {"dead_letter": None}


# -- a real node --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def node(tmp_path_factory):
    n = start_node(tmp_path_factory.mktemp("cli_v2"))
    yield n
    n.kill()


@pytest.fixture
def qs(node, capsys):
    """`qserver ARGS -s <node>` -> (exit status, stdout, stderr)."""

    def run(*args: str) -> tuple[int, str, str]:
        return _run(capsys, node.port, *args)

    return run


def qjson(qs, *args: str):
    status, out, err = qs(*args, "--json")
    assert status == 0, err
    return json.loads(out)


def test_a_worker_from_the_shell(qs):
    assert qs("produce", "cv_q", "job", "--retry", "60")[0] == 0
    [d] = qjson(qs, "consume", "cv_q", "--count", "1", "--lease", "60")
    assert (d["queue"], d["msg_id"], d["data"], d["deliveries"]) == ("cv_q", 1, "job", 1)
    receipt = d["receipt"]
    shown = qjson(qs, "show", "cv_q", "1")
    assert shown["state"] == "in_flight" and shown["queue"] == "cv_q"
    retry_at = qjson(qs, "touch", "cv_q", "1", "--receipt", receipt, "--lease", "300")[
        "retry_at"]
    assert retry_at > time.time() + 290
    assert "ready_at" in qjson(qs, "nack", "cv_q", "1", "--receipt", receipt)
    assert qs("touch", "cv_q", "1") == (1, "", "qserver: NotInFlight: not in flight\n")
    # delivered again, printed, then confirmed with its new receipt
    status, out, _ = qs("consume", "cv_q", "--count", "5", "--ack")
    assert out.splitlines()[0].split() == ["QUEUE", "MSG_ID", "DELIVERIES", "RECEIPT", "DATA"]
    assert out.splitlines()[1].split()[:3] == ["cv_q", "1", "2"]
    assert qjson(qs, "monitor", "cv_q")["size"] == 0
    # the first delivery's receipt is stale: an error, exit 1
    assert qs("confirm", "cv_q", "1", "--receipt", receipt) == (
        1, "", "qserver: StaleReceipt: stale receipt\n")
    assert qs("show", "cv_q", "1") == (1, "", "qserver: no such message: msg_id 1 in cv_q\n")


def test_consume_waits_and_takes_from_several_queues(qs):
    start = time.monotonic()
    assert qs("consume", "cv_a", "cv_b", "--wait", "0.5") == (
        0, "no message ready in cv_a, cv_b\n", "")
    assert time.monotonic() - start >= 0.5 - EARLY_S
    assert qjson(qs, "consume", "cv_a", "--count", "3", "--wait", "0.2") == []
    qs("produce", "cv_b", "bee")
    assert qs("consume", "cv_a", "cv_b", "--wait", "5") == (0, "msg_id 1 in cv_b: bee\n", "")
    assert qs("consume", "cv_a", "--wait", "31")[2] == "qserver: ServerError: wait out of range\n"


def test_peek_and_config(qs):
    for i in range(3):
        qs("produce", "cv_p", f"m{i}")
    assert [m["data"] for m in qjson(qs, "peek", "cv_p", "--count", "2")] == ["m0", "m1"]
    status, out, _ = qs("peek", "cv_p")
    assert out.splitlines()[1].split()[:2] == ["1", "ready"]
    assert qjson(qs, "monitor", "cv_p")["size"] == 3  # peek changes nothing
    rest = {"max_size": 1_000_000, "dedup_window": 300, "paused": "none"}  # issue 15's
    assert qjson(qs, "config", "cv_p") == {"max_deliveries": 0, "dead_letter": None, **rest}
    assert qjson(qs, "config", "cv_p", "max_deliveries=2", "dead_letter=cv_dead") == {
        "max_deliveries": 2, "dead_letter": "cv_dead", **rest}
    assert qs("config", "cv_p", "dead_letter=none") == (
        0, ("queue           cv_p\nmax_deliveries  2\ndead_letter     none\n"
           "max_size        1000000\ndedup_window    300\npaused          none\n"), "")
    assert qs("config", "cv_p", "colour=blue") == (
        1, "", "qserver: ServerError: unknown setting: colour\n")
