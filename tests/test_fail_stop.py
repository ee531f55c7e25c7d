"""Fail-stop with real processes: a broken invariant or any unexpected
exception in step, tick, flush, apply or a timer callback stops the node at
once with exit status 1 and one CRITICAL line naming what broke and where;
expected conditions (a peer's malformed message, a closed link) do not.

Failures are injected by tests/inject_fault.py, a wrapper that replaces one
method before `qserver.cli.main` runs and makes it raise once a trigger
file exists (nothing in the qserver package knows of it).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from procs import Cluster, NodeProcess, TcpClient, free_port, wait_until

INJECT = str(Path(__file__).with_name("inject_fault.py"))

# How long a node may take to notice the injected failure and exit: the
# trigger fires at the next call (within a heartbeat or the next request),
# so this is only an upper bound for a loaded machine.
EXIT_DEADLINE_S = 60.0


class InjectedNode(NodeProcess):
    """A `qserver run` process with one method made to fail on demand."""

    def __init__(self, config_path: Path, port: int, target: str, trigger: Path,
                 error: str = "InvariantError") -> None:
        self.config_path = config_path
        self.port = port
        self.trigger = trigger
        self.proc = subprocess.Popen(
            [sys.executable, INJECT, target, str(trigger), error, "--",
             "run", "--config", str(config_path)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        self.stdout_lines: list[str] = []
        self.stderr_text = ""

    def fire(self) -> None:
        self.trigger.write_text("fail now")

    def wait_exit(self) -> int:
        self.proc.wait(EXIT_DEADLINE_S)
        self.stop()  # collects stderr
        return self.proc.returncode


def critical_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if " CRITICAL " in line]


def single_config(tmp_path: Path, port: int, extra: str) -> Path:
    path = tmp_path / "node.xml"
    path.write_text(f'<config><node_info node_id="1" host="127.0.0.1" port="{port}"/>'
                    f'{extra}</config>')
    return path


def produce(port: int, data: str = "x") -> dict | None:
    """One produce on a fresh connection; None if the node is gone."""
    try:
        c = TcpClient(port)
        try:
            return c.request(action=1, queue="q", data=data)
        finally:
            c.close()
    except (OSError, ConnectionError, ValueError):
        return None


# (method, error raised, engine/storage config, what the node must do after
# the trigger for the method to run, words of the CRITICAL line's "where")
SINGLE_NODE_CASES = [
    pytest.param("qserver.engines.native.core:NativeCore.tick", "InvariantError",
                 '<storage dir="{data}" fsync="always"/>', "nothing",
                 "timer ClusterEngine._on_timer",
                 id="native-tick"),
    pytest.param("qserver.engines.native.core:NativeCore.tick", "ZeroDivisionError",
                 '<storage dir="{data}" fsync="always"/>', "nothing",
                 "timer ClusterEngine._on_timer",
                 id="native-tick-any-exception"),
    pytest.param("qserver.engines.native.driver:ClusterEngine._flush", "InvariantError",
                 '<storage dir="{data}" fsync="always"/>', "produce", "ClusterEngine.",
                 id="native-flush"),
    pytest.param("qserver.state.store:Store.apply", "InvariantError",
                 '<storage dir="{data}" fsync="always"/>', "produce", "ClientTcpProtocol",
                 id="native-apply"),
    pytest.param("qserver.engines.native.durability:Durability.batch_sync", "RuntimeError",
                 '<storage dir="{data}" fsync="batch"/>', "produce",
                 "timer Durability.batch_sync", id="native-batch-timer"),
    pytest.param("qserver.engines.raft.driver:RaftEngine._on_committed", "InvariantError",
                 '<replication engine="raft"/>', "produce", "callback RaftEngine._on_committed",
                 id="raft-committed"),
    pytest.param("qserver.state.store:Store.apply", "InvariantError",
                 '<replication engine="raft"/>', "produce", "ClientTcpProtocol",
                 id="raft-apply"),
    # pysyncobj's own thread: its fsync=batch tick callback
    pytest.param("qserver.engines.raft.driver:_QueueSync._batch_sync", "OSError",
                 '<replication engine="raft"/><storage dir="{data}" fsync="batch"/>', "produce",
                 "callback _raised_in_pysyncobj_thread", id="raft-thread"),
]


@pytest.mark.parametrize("target, error, extra, then, where", SINGLE_NODE_CASES)
def test_injected_failure_stops_a_node_with_status_1(tmp_path, target, error, extra, then,
                                                      where):
    port = free_port()
    config = single_config(tmp_path, port, extra.format(data=tmp_path / "data"))
    node = InjectedNode(config, port, target, tmp_path / "trigger", error)
    try:
        node.wait_ready()
        # serves until the failure (a raft node elects itself first)
        wait_until(lambda: (produce(port, "before") or {}).get("code") == 0)
        node.fire()
        if then == "produce":
            produce(port, "after")  # its answer may never come: None is fine
        assert node.wait_exit() == 1
    finally:
        node.kill()
    lines = critical_lines(node.stderr_text)
    method = target.split(":")[1]
    assert len(lines) == 1, node.stderr_text
    assert f"{error}: injected failure in {method}" in lines[0], lines[0]
    assert where in lines[0] and "exit status 1" in lines[0], lines[0]
    if error == "InvariantError":  # the traceback precedes it, for the bug report
        assert "Traceback" in node.stderr_text


def test_failure_in_step_stops_a_cluster_node_and_the_others_serve_on(tmp_path):
    """A slave whose core raises while stepping a peer's message (peers
    hands what on_message raises to the loop's exception handler) exits 1;
    the master and the other slave go on."""
    c = Cluster(tmp_path, extra='  <replication mode="quorum"/>\n')
    try:
        c.start_all()
        master = c.wait_master()
        victim = next(i for i in range(1, 4) if i != master)
        c.nodes[victim].kill()
        node = InjectedNode(c.config_path(victim), c.port(victim),
                            "qserver.engines.native.core:NativeCore.step", tmp_path / "trigger")
        c.nodes[victim] = node
        node.wait_ready()
        wait_until(lambda: c.master() == master)  # it follows the master again
        node.fire()  # the master's next heartbeat
        assert node.wait_exit() == 1
        lines = critical_lines(node.stderr_text)
        assert len(lines) == 1, node.stderr_text
        assert "injected failure in NativeCore.step" in lines[0]
        assert "on_message for a message from node" in lines[0]
        # the two others still make a majority: writes commit
        r = wait_until(lambda: (r := c.ask(master, action=1, queue="q", data="on"))
                       and r.get("code") == 0 and r)
        assert r["msg_id"] >= 1
        alive = [i for i in range(1, 4) if i != victim]
        assert all(c.nodes[i].proc.poll() is None for i in alive)
    finally:
        c.stop_all()
    for i in alive:
        assert critical_lines(c.nodes[i].stderr_text) == []


def test_no_failure_no_trigger_file_runs_as_usual(tmp_path):
    """The wrapper itself changes nothing until the trigger file exists."""
    port = free_port()
    config = single_config(tmp_path, port, f'<storage dir="{tmp_path / "data"}"/>')
    node = InjectedNode(config, port, "qserver.state.store:Store.apply", tmp_path / "trigger")
    try:
        node.wait_ready()
        assert [produce(port, str(i))["msg_id"] for i in range(3)] == [1, 2, 3]
        assert node.stop() == 0  # SIGTERM: the orderly shutdown
    finally:
        node.kill()
    assert critical_lines(node.stderr_text) == []


def test_a_failed_raft_journal_fsync_is_never_retried_into_success(tmp_path, monkeypatch):
    """After a failed fsync the kernel may have dropped the journal's pages:
    a later fsync that succeeds proves nothing, so every later sync raises
    the first error (and pysyncobj's tick hands it to the loop: exit 1)."""
    import errno

    import qserver.engines.raft.driver as raft_engine

    journal = raft_engine.DurableJournal(str(tmp_path / "raft.journal"))
    journal.add(b"command", 1, 1)
    real_fsync = raft_engine._fsync_path

    def failing(path):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(raft_engine, "_fsync_path", failing)
    with pytest.raises(OSError):
        journal.sync()
    monkeypatch.setattr(raft_engine, "_fsync_path", real_fsync)
    try:
        with pytest.raises(OSError):
            journal.sync()
        assert journal.syncs == 0
    finally:
        journal._destroy()  # pysyncobj's close of the journal's mapping and file


def test_the_loop_handler_stops_only_for_exceptions_that_are_ours(caplog):
    """In process: what asyncio reports without an exception (a warning),
    and accept() failing for lack of descriptors (asyncio's own loop
    reports it with the listening socket, and pauses accepting), leave the
    node serving; an exception from a callback stops it, without draining,
    with exit status 1."""
    import asyncio
    import dataclasses
    import socket

    from qserver.config import Config
    from qserver.node import Node

    async def run() -> None:
        loop = asyncio.get_running_loop()
        node = Node(dataclasses.replace(Config.default(), port=0))
        await node.start()
        serving = asyncio.create_task(node.serve())
        try:
            with socket.socket() as listener:
                loop.call_exception_handler({"message": "socket.accept() out of system resource",
                                             "exception": OSError(24, "Too many open files"),
                                             "socket": listener})
            loop.call_exception_handler({"message": "Task was destroyed but it is pending!"})
            assert not node.failed and node.exit_status == 0

            def broken() -> None:
                raise KeyError("lost message")

            loop.call_soon(broken)
            await asyncio.wait_for(serving, 30)
            assert node.failed and node.exit_status == 1
        finally:
            if not serving.done():
                node.stop()
                await serving

    asyncio.run(run())
    critical = [r for r in caplog.records if r.levelname == "CRITICAL"]
    assert len(critical) == 1
    assert "KeyError: 'lost message'; in callback" in critical[0].getMessage()
    assert "broken" in critical[0].getMessage()
