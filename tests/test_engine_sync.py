"""The native engine's syncs off the event loop (qserver.engines.native.driver
and its durability module, with a lone node and real storage), with
KernelSync replaced by a fake that holds every submitted sync until the test
finishes it, with success or an error: when a write is answered, what a
failed sync does, and what close() does with a sync still in flight."""

from __future__ import annotations

import asyncio
import errno
import os
import time

import pytest

from procs import cluster_config, free_port
from qserver.config import parse_xml
from qserver.engines.native import durability
from qserver.engines.native.driver import ClusterEngine
from qserver.state.log import Log
from qserver.state.store import Store
from qserver.storage import DiskStorage, StorageError
from qserver.wire.requests import ProduceRequest

DEADLINE_S = 20.0


class FakeKernelSync:
    """KernelSync's interface; a submitted sync stays in flight until
    `finish` (nothing is synced for real: the tests look at what the node
    does with the outcome)."""

    def __init__(self) -> None:
        self.efd = os.eventfd(0, os.EFD_NONBLOCK)
        self.submitted: list[int] = []
        self.finished: list[tuple[int, int]] = []

    def fileno(self) -> int:
        return self.efd

    @property
    def in_flight(self) -> int:
        return len(self.submitted)

    def submit(self, fd: int, token: int) -> None:
        os.fstat(fd)  # the node keeps the descriptor open until the result
        self.submitted.append(token)

    def finish(self, res: int = 0) -> None:
        self.finished.append((self.submitted.pop(0), res))
        os.eventfd_write(self.efd, 1)

    def reap(self) -> list[tuple[int, int]]:
        try:
            os.eventfd_read(self.efd)
        except BlockingIOError:
            pass
        out, self.finished = self.finished, []
        return out

    def close(self) -> None:
        os.close(self.efd)


def three_engines(extra: str = "") -> list[ClusterEngine]:
    """A three-node cluster's adapters, in memory, for one event loop on
    real loopback links (not started); `extra`: config text."""
    client_ports = [free_port() for _ in range(3)]
    internal_ports = [free_port() for _ in range(3)]
    return [ClusterEngine(config=parse_xml(cluster_config(i, client_ports, internal_ports,
                                                          extra=extra)),
                          store=Store(queue_size=10_000), log_=Log()) for i in (1, 2, 3)]


async def started_master(engines: list[ClusterEngine]) -> ClusterEngine:
    """Start the adapters (three_engines) and wait until one is master: it."""
    for engine in engines:
        await engine.start()
    await until(lambda: sum(e.is_master for e in engines) == 1, "a master")
    return next(e for e in engines if e.is_master)


async def until(predicate, what: str) -> None:
    end = time.monotonic() + DEADLINE_S
    while not predicate():
        if time.monotonic() > end:
            raise AssertionError(f"not within {DEADLINE_S} s: {what}")
        await asyncio.sleep(0.005)


class Lone:
    """A lone node's ClusterEngine on a data directory, with a fake KernelSync."""

    def __init__(self, tmp_path, monkeypatch, mode: str = "quorum") -> None:
        self.fake = FakeKernelSync()
        monkeypatch.setattr(durability.KernelSync, "create",
                            staticmethod(lambda *a, **k: self.fake))
        # A lone node syncs each write at once, never by the batch timer:
        # with the timer out of reach, a sync the tests wait for proves it.
        monkeypatch.setattr(durability, "BATCH_SYNC_MS", 600_000)
        self.data = tmp_path / "data"
        config = parse_xml(
            f'<config><node_info node_id="1" host="127.0.0.1" port="{free_port()}"/>'
            f'<replication mode="{mode}"/><storage dir="{self.data}" fsync="always"/></config>')
        self.storage = DiskStorage.open(str(self.data), "always")
        recovered = self.storage.recover()
        self.store = Store(queue_size=1000)
        self.engine = ClusterEngine(config=config, store=self.store, log_=Log(),
                                    storage=self.storage, vote=recovered.vote)
        self.fatal: list[BaseException] = []
        self.engine.on_fatal = self.fatal.append
        self.answers: list[tuple[str, object, bool]] = []  # data, error, storage dirty then

    async def start(self) -> None:
        await self.engine.start()
        await until(lambda: self.engine.is_master, "the lone node is master")

    def produce(self, data: str) -> None:
        entry = self.store.decide_produce(ProduceRequest(queue="q", data=data, delay_s=None,
                                                         ttl_s=None, retry_s=0),
                                          int(time.time() * 1000))
        self.engine.propose(entry, lambda result, error: self.answers.append(
            (data, error, self.storage.dirty)))

    def segment_bytes(self) -> int:
        return sum(p.stat().st_size for p in self.data.glob("log-*.seg"))


async def started_with_a_write_in_flight(tmp_path, monkeypatch, data: str) -> Lone:
    """A lone master whose first entry is synced, then one produce of
    `data` whose sync is submitted and held."""
    node = Lone(tmp_path, monkeypatch)
    await node.start()
    await until(lambda: node.fake.in_flight == 1, "a sync of the new master's first entry")
    node.fake.finish()
    await until(lambda: node.engine.core.durable_id == node.engine.core.log.last_trans_id,
                "the first entry is durable")
    node.produce(data)
    await until(lambda: node.fake.in_flight == 1, "a sync of the write is submitted")
    return node


def run(coro) -> None:
    asyncio.run(asyncio.wait_for(coro, 60))


def test_a_lone_master_answers_once_the_kernel_sync_covering_the_write_is_done(
        tmp_path, monkeypatch):
    async def main() -> None:
        node = await started_with_a_write_in_flight(tmp_path, monkeypatch, "a")
        await asyncio.sleep(0.05)
        assert node.answers == []  # on its way to the disk: not answered yet
        node.fake.finish()
        await until(lambda: node.answers, "the answer")
        assert node.answers[0][:2] == ("a", None)
        await node.engine.close()
        assert node.fatal == []
    run(main())


def test_a_failed_kernel_sync_stops_the_node_and_answers_nothing(tmp_path, monkeypatch):
    async def main() -> None:
        node = await started_with_a_write_in_flight(tmp_path, monkeypatch, "a")
        node.fake.finish(-errno.EIO)
        await until(lambda: node.fatal, "the node gives up")
        assert isinstance(node.fatal[0], StorageError) and "fsync" in str(node.fatal[0])
        await asyncio.sleep(0.05)
        assert all(error is not None for _, error, _ in node.answers)  # never a success
        await node.engine.close()
    run(main())


@pytest.mark.parametrize("outcome", [0, -errno.EIO])
def test_close_waits_for_the_sync_in_flight_and_heeds_its_outcome(tmp_path, monkeypatch,
                                                                  outcome):
    async def main() -> None:
        node = await started_with_a_write_in_flight(tmp_path, monkeypatch, "a")
        written = node.storage._segments[-1].size
        closing = asyncio.ensure_future(node.engine.close())
        await asyncio.sleep(0.1)
        assert not closing.done()  # it waits for the sync's outcome
        node.fake.finish(outcome)
        await closing
        if outcome == 0:  # an orderly close: synced, and the zeros ahead trimmed away
            assert node.fatal == [] and node.segment_bytes() == written
        else:  # failed: the log is left as a crash would leave it, no close-time fsync
            assert node.fatal and node.segment_bytes() > written
    run(main())


def test_async_mode_answers_only_what_is_on_its_own_disk(tmp_path, monkeypatch):
    """In async mode the answer does not wait for other nodes, so with
    fsync=always the write is synced (here, on the event loop) before it."""
    async def main() -> None:
        node = Lone(tmp_path, monkeypatch, mode="async")
        await node.start()
        node.produce("a")
        await until(lambda: node.answers, "the answer")
        data, error, dirty = node.answers[0]
        assert (data, error, dirty) == ("a", None, False)
        assert node.fake.in_flight == 0
        await node.engine.close()
    run(main())
