"""The `qserver` client commands against real nodes: each command, human and
--json output, the status table of a cluster, exit status and stderr on
errors. Most run `main()` in process (the same code the entry point runs,
without a Python start per command); one runs the installed command."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from procs import Cluster, free_port, wait_until
from qserver.cli import main
from test_client import VIRTUAL, start_node

DEADLINE_S = 30.0  # generous: CI is a shared, noisy 2-core machine


@pytest.fixture(scope="module")
def node(tmp_path_factory):
    n = start_node(tmp_path_factory.mktemp("cli"), VIRTUAL)
    yield n
    n.kill()


@pytest.fixture
def qs(node, capsys):
    """Run `qserver ARGS -s <node>`; returns (exit status, stdout, stderr)."""

    def run(*args: str, server: bool = True) -> tuple[int, str, str]:
        argv = list(args) + (["-s", f"127.0.0.1:{node.port}"] if server else [])
        status = main(argv)
        out, err = capsys.readouterr()
        return status, out, err

    return run


def qjson(qs, *args: str):
    status, out, err = qs(*args, "--json")
    assert status == 0, err
    return json.loads(out)


def test_produce_consume_confirm(qs):
    assert qs("produce", "cli_q", "hello world", "--retry", "60") == (
        0, "produced msg_id 1 in cli_q\n", "")
    assert qs("consume", "cli_q") == (0, "msg_id 1: hello world\n", "")
    assert qs("consume", "cli_q") == (0, "no message ready in cli_q\n", "")
    assert qs("confirm", "cli_q", "1") == (0, "confirmed msg_id 1 in cli_q\n", "")
    assert qjson(qs, "monitor", "cli_q")["size"] == 0


def test_json_output(qs):
    assert qjson(qs, "produce", "cli_j", "x") == {"queue": "cli_j", "msg_id": 1,
                                                 "msg_ids": {"cli_j": 1}}
    assert qjson(qs, "produce", "fan", "both")["msg_ids"] == {"fan_a": 1, "fan_b": 1}
    assert qjson(qs, "consume", "cli_j") == {"queue": "cli_j", "msg_id": 1, "data": "x"}
    assert qjson(qs, "consume", "cli_j") == {"queue": "cli_j", "msg_id": None, "data": None}
    assert qjson(qs, "confirm", "cli_j", "1")["confirmed"] is True
    assert [q["name"] for q in qjson(qs, "list", "fan_")] == ["fan_a", "fan_b"]
    leader = qjson(qs, "leader")
    assert leader["leader_node_id"] == 1 and leader["leader_host"] == "127.0.0.1"
    node_view = qjson(qs, "monitor")
    assert node_view["role"] == "master" and "size" not in node_view
    rows = qjson(qs, "status")
    assert [(r["node_id"], r["role"], r["lag"]) for r in rows] == [(1, "master", 0)]


def test_times_and_human_tables(qs, node):
    qs("produce", "cli_t", "later", "--delay", "60", "--ttl", "3600", "--retry", "5")
    qs("produce", "cli_t", "now")
    status, out, _ = qs("monitor", "cli_t")
    assert status == 0
    fields = dict(line.split(None, 1) for line in out.splitlines())
    assert (fields["queue"], fields["size"], fields["delayed"], fields["ready"]) == (
        "cli_t", "2", "1", "1")
    status, out, _ = qs("list", "cli_t")
    assert out.splitlines() == ["QUEUE  SIZE  WAIT_STATUS", "cli_t  2     0", "1 queue"]
    status, out, _ = qs("leader")
    assert out.startswith("master: node 1 at 127.0.0.1:")
    status, out, _ = qs("status")
    header, row = out.splitlines()
    assert header.split() == ["NODE", "ADDRESS", "ROLE", "LEADER", "VOTE_ID", "TRANS_ID",
                              "COMMIT_ID", "LAG"]
    assert row.split()[:3] == ["1", f"127.0.0.1:{node.port}", "master"]


def test_errors_exit_1_with_one_line(qs):
    status, out, err = qs("consume", "")
    assert (status, out) == (1, "")
    assert err == "qserver: ServerError: queue must not be empty\n"
    status, out, err = qs("produce", "cli_e", "x", "--delay", "60", "--ttl", "30")
    assert (status, err) == (1, "qserver: ServerError: time error\n")
    status, _, err = qs("leader", "-s", "not-an-address", server=False)
    assert status == 2 and err.count("\n") == 1
    with pytest.raises(SystemExit) as info:  # argparse: usage error
        main(["confirm", "cli_e", "not-a-number"])
    assert info.value.code == 2


def test_down_node_exits_1(tmp_path):
    """The installed entry point, against a port nobody listens on."""
    down = f"127.0.0.1:{free_port()}"
    for args in (["produce", "q", "x"], ["status"]):
        r = subprocess.run([sys.executable, "-m", "qserver", *args, "-s", down,
                            "--retry-for", "0.5"],
                           capture_output=True, text=True, timeout=DEADLINE_S)
        assert r.returncode == 1, r
        assert len(r.stderr.splitlines()) == 1 and r.stderr.startswith("qserver: ")


def test_status_table_on_a_cluster(tmp_path, capsys):
    c = Cluster(tmp_path)
    try:
        c.start_all()
        m = c.wait_master()
        servers = [arg for i in range(1, 4) for arg in ("-s", f"127.0.0.1:{c.port(i)}")]
        assert main(["produce", "st", "x", *servers]) == 0
        # every node has applied the write: commit_id agrees, lag 0
        def settled():
            capsys.readouterr()
            assert main(["status", "--json", *servers]) == 0
            rows = json.loads(capsys.readouterr().out)
            return rows if len({r["commit_id"] for r in rows}) == 1 and \
                all(r["lag"] == 0 for r in rows) else None
        rows = wait_until(settled, DEADLINE_S)
        assert sorted(r["node_id"] for r in rows) == [1, 2, 3]
        assert [r["node_id"] for r in rows if r["role"] == "master"] == [m]
        assert all(r["leader_node_id"] == m and r["trans_id"] >= 1 for r in rows)

        assert main(["status", *servers]) == 0
        lines = capsys.readouterr().out.splitlines()
        assert len(lines) == 4 and lines[0].startswith("NODE")
        assert sorted(line.split()[2] for line in lines[1:]) == ["master", "slave", "slave"]

        # one node given: the others are learnt from the master
        slave = next(i for i in range(1, 4) if i != m)
        assert main(["status", "--json", "-s", f"127.0.0.1:{c.port(slave)}"]) == 0
        rows = json.loads(capsys.readouterr().out)
        assert sorted(r["node_id"] for r in rows) == [1, 2, 3]
        by_id = {r["node_id"]: r for r in rows}
        assert by_id[m]["address"] == f"127.0.0.1:{c.port(m)}" and by_id[m]["role"] == "master"

        # a node down: its row says so, and the exit status is 1
        c.kill(slave)
        assert main(["status", *servers]) == 1
        out, err = capsys.readouterr()
        assert f"127.0.0.1:{c.port(slave)}  down" in out
        assert err == f"qserver: no answer from 127.0.0.1:{c.port(slave)}\n"
        # any live node still serves the other commands
        other = next(i for i in range(1, 4) if i not in (m, slave))
        assert main(["consume", "st", "-s", f"127.0.0.1:{c.port(other)}"]) == 0
        assert capsys.readouterr().out == "msg_id 1: x\n"
    finally:
        c.stop_all()
