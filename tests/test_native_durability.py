"""The native engine's fsync scheduling (qserver.engines.native.durability)
against its contract, on a real data directory with real fdatasync: what
each policy does with the Ready's own_sync (BEFORE_SEND at once on the
loop, NOW off the loop at once, MAY_WAIT by the batch timer), one sync at a
time, epochs, and close. A sync off the loop runs both ways it can (Linux
AIO, or the worker thread); where a test must hold a sync in flight, or
make it fail, the worker thread's fdatasync waits behind a gate (and then
runs for real, or raises the error)."""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import threading
import time

import pytest

from qserver.config import Fsync
from qserver.engines.native import durability
from qserver.engines.native.core import OwnSync
from qserver.engines.native.durability import Durability
from qserver.state.entries import Produce, Record
from qserver.storage import DiskStorage, KernelSync, StorageError

DEADLINE_S = 20.0


def record(trans_id: int, vote_id: int = 1) -> Record:
    return Record(trans_id, vote_id, Produce(targets=(("q", trans_id),), data="d" * 20,
                                             ready_ms=1, ttl_ms=2, retry_ms=0))


class Node:
    """A Durability on a data directory, started on the running loop, with
    what it tells the core (`synced`) and the driver (`failures`,
    `flushes`) recorded."""

    def __init__(self, tmp_path, policy: Fsync = Fsync.ALWAYS) -> None:
        self.directory = tmp_path / "data"
        self.storage = DiskStorage.open(str(self.directory), policy)
        self.storage.recover()
        self.synced: list[int] = []
        self.failures: list[BaseException] = []
        self.flushes = 0
        self.durability = Durability(storage=self.storage, policy=policy, node_id=1,
                                     synced=self.synced.append, fail=self.failures.append,
                                     schedule_flush=self._schedule_flush)
        self.durability.start(asyncio.get_running_loop())

    def _schedule_flush(self) -> None:
        self.flushes += 1

    def write(self, last: int, vote_id: int = 1) -> None:
        """Append records up to `last`, as the driver does with a Ready's."""
        first = self.storage.next_trans_id
        self.storage.append([record(t, vote_id) for t in range(first, last + 1)])

    def written_bytes(self) -> int:
        return self.storage._segments[-1].size

    def segment_bytes(self) -> int:
        return sum(p.stat().st_size for p in self.directory.glob("log-*.seg"))


class Gate:
    """Sends every sync off the loop to the worker thread, where fdatasync
    waits until `open()` (then runs for real) or `fail()` (then raises)."""

    def __init__(self, monkeypatch) -> None:
        self._go = threading.Event()
        self._error: OSError | None = None
        self.arrived = 0  # syncs that reached the gate
        real = durability._fsync_and_close

        def held(fd: int) -> None:
            self.arrived += 1
            self._go.wait(DEADLINE_S)
            if self._error is not None:
                os.close(fd)
                raise self._error
            real(fd)

        monkeypatch.setattr(durability.KernelSync, "create", staticmethod(lambda *a, **k: None))
        monkeypatch.setattr(durability, "_fsync_and_close", held)

    def open(self) -> None:
        self._go.set()

    def fail(self, error: OSError) -> None:
        self._error = error
        self._go.set()


@pytest.fixture(params=["kernel", "thread"])
def sync_off_loop(request, monkeypatch) -> str:
    """Each way a sync runs off the event loop."""
    if request.param == "kernel":
        probe = KernelSync.create()
        if probe is None:
            pytest.skip("Linux AIO fdatasync is not available here")
        probe.close()
    else:
        monkeypatch.setattr(durability.KernelSync, "create", staticmethod(lambda *a, **k: None))
    return request.param


async def until(predicate, what: str) -> None:
    end = time.monotonic() + DEADLINE_S
    while not predicate():
        if time.monotonic() > end:
            raise AssertionError(f"not within {DEADLINE_S} s: {what}")
        await asyncio.sleep(0.002)


async def still_pending(task: asyncio.Future) -> bool:
    """`task` has not finished after the loop ran a while (0.1 s)."""
    await asyncio.wait({task}, timeout=0.1)
    return not task.done()


async def never(predicate) -> bool:
    """`predicate` stayed false while the loop ran a while (0.1 s)."""
    end = time.monotonic() + 0.1
    while time.monotonic() < end:
        if predicate():
            return False
        await asyncio.sleep(0.002)
    return not predicate()


def run(coro) -> None:
    asyncio.run(asyncio.wait_for(coro, 60))


def test_before_send_syncs_on_the_loop_before_after_write_returns(tmp_path):
    async def main() -> None:
        node = Node(tmp_path)
        node.write(3)
        syncs = node.storage.syncs
        node.durability.after_write(OwnSync.BEFORE_SEND)
        assert node.synced == [3] and not node.storage.dirty
        assert node.storage.syncs == syncs + 1 and not node.durability.in_flight
        await node.durability.close()
    run(main())


def test_now_starts_a_sync_off_the_loop_at_once(tmp_path, sync_off_loop):
    async def main() -> None:
        node = Node(tmp_path)
        node.write(3)
        node.durability.after_write(OwnSync.NOW)
        assert node.durability.in_flight and node.synced == []  # the core hears when it ends
        await until(lambda: node.synced == [3], "the sync is reported")
        assert node.flushes >= 1 and not node.storage.dirty and not node.durability.in_flight
        await node.durability.close()
        assert node.failures == []
    run(main())


def test_may_wait_leaves_the_sync_to_the_batch_timer(tmp_path, monkeypatch):
    monkeypatch.setattr(durability, "BATCH_SYNC_MS", 600_000)  # out of reach

    async def main() -> None:
        node = Node(tmp_path)
        node.write(2)
        node.durability.after_write(OwnSync.MAY_WAIT)
        assert await never(lambda: node.synced or node.durability.in_flight)
        assert node.storage.dirty
        node.write(4)
        node.durability.after_write(OwnSync.NOW)  # urgency does not wait for the timer
        await until(lambda: node.synced == [4], "the urgent sync")
        await node.durability.close()
    run(main())


def test_the_batch_timer_syncs_every_write_since_it_was_armed_at_once(tmp_path, monkeypatch):
    monkeypatch.setattr(durability, "BATCH_SYNC_MS", 20)

    async def main() -> None:
        node = Node(tmp_path)
        syncs = node.storage.syncs
        node.write(2)
        node.durability.after_write(OwnSync.MAY_WAIT)
        node.write(4)
        node.durability.after_write(OwnSync.MAY_WAIT)
        await until(lambda: node.synced == [4], "the timed sync")
        assert node.storage.syncs == syncs + 1 and not node.storage.dirty
        await node.durability.close()
    run(main())


@pytest.mark.parametrize("own_sync", list(OwnSync))
def test_fsync_batch_syncs_by_its_timer_whatever_the_ready_says(tmp_path, monkeypatch,
                                                                own_sync):
    monkeypatch.setattr(durability, "BATCH_SYNC_MS", 20)

    async def main() -> None:
        node = Node(tmp_path, Fsync.BATCH)
        node.write(2)
        node.durability.after_write(own_sync)
        assert node.synced == [] and not node.durability.in_flight
        await until(lambda: node.synced == [2], "the timed sync")
        await node.durability.close()
    run(main())


@pytest.mark.parametrize("own_sync", list(OwnSync))
def test_fsync_off_leaves_it_to_the_os(tmp_path, own_sync):
    async def main() -> None:
        node = Node(tmp_path, Fsync.OFF)
        node.write(2)
        syncs = node.storage.syncs
        node.durability.after_write(own_sync)
        assert await never(lambda: node.synced or node.durability.in_flight)
        assert node.storage.syncs == syncs and node.storage.dirty
        await node.durability.close()  # an orderly close syncs whatever the policy
        assert not node.failures
    run(main())


def test_a_sync_begun_before_a_truncation_does_not_vouch_for_records_after_it(
        tmp_path, sync_off_loop):
    async def main() -> None:
        node = Node(tmp_path)
        node.write(3)
        node.durability.after_write(OwnSync.NOW)  # covers 1..3 of vote 1
        node.storage.truncate_after(1)  # a new master's log replaces 2..3
        node.durability.bump_epoch()
        node.write(3, vote_id=2)
        await until(lambda: not node.durability.in_flight, "the first sync ends")
        assert node.synced == [] and node.storage.dirty  # its 3 is not the 3 we hold now
        assert node.flushes >= 1
        node.durability.after_write(OwnSync.NOW)
        await until(lambda: node.synced == [3], "a sync of the new records")
        await node.durability.close()
    run(main())


def test_one_sync_at_a_time_and_one_more_for_what_came_meanwhile(tmp_path, monkeypatch):
    gate = Gate(monkeypatch)

    async def main() -> None:
        node = Node(tmp_path)
        try:
            node.write(2)
            node.durability.after_write(OwnSync.NOW)
            await until(lambda: gate.arrived == 1, "the first sync is in the thread")
            node.write(4)
            node.durability.after_write(OwnSync.NOW)
            node.write(5)
            node.durability.after_write(OwnSync.NOW)
            assert gate.arrived == 1  # the others wait for it
            gate.open()
            await until(lambda: node.synced == [2, 5], "both syncs are reported")
            assert gate.arrived == 2 and not node.storage.dirty
        finally:
            gate.open()
        await node.durability.close()
    run(main())


def test_close_waits_for_the_sync_in_flight(tmp_path, monkeypatch):
    gate = Gate(monkeypatch)

    async def main() -> None:
        node = Node(tmp_path)
        try:
            node.write(3)
            node.durability.after_write(OwnSync.NOW)
            closing = asyncio.ensure_future(node.durability.close())
            assert await still_pending(closing)
            gate.open()
            await closing
        finally:
            gate.open()
        # an orderly close: synced, and the zeros ahead of the records trimmed
        assert node.failures == [] and node.segment_bytes() == node.written_bytes()
    run(main())


def test_close_after_a_failed_sync_leaves_the_log_as_a_crash_would(tmp_path, monkeypatch):
    gate = Gate(monkeypatch)

    async def main() -> None:
        node = Node(tmp_path)
        node.write(3)
        node.durability.after_write(OwnSync.NOW)
        closing = asyncio.ensure_future(node.durability.close())
        assert await still_pending(closing)
        gate.fail(OSError(errno.EIO, "Input/output error"))
        await closing
        assert len(node.failures) == 1 and isinstance(node.failures[0], StorageError)
        assert "fsync" in str(node.failures[0]) and node.synced == []
        # abandoned: no close-time fsync, the zeros ahead are still there
        assert node.segment_bytes() > node.written_bytes()
    run(main())


def test_close_gives_up_on_a_sync_that_never_ends(tmp_path, monkeypatch, caplog):
    gate = Gate(monkeypatch)
    monkeypatch.setattr(durability, "CLOSE_SYNC_WAIT_S", 0.2)

    async def main() -> None:
        node = Node(tmp_path)
        try:
            node.write(3)
            node.durability.after_write(OwnSync.NOW)
            with caplog.at_level(logging.ERROR, logger=durability.__name__):
                await node.durability.close()
        finally:
            gate.open()
        assert "did not finish" in caplog.text
        assert node.segment_bytes() > node.written_bytes()  # left as a crash would
    run(main())


def test_after_a_halt_close_does_not_wait_and_abandons(tmp_path, monkeypatch):
    gate = Gate(monkeypatch)

    async def main() -> None:
        node = Node(tmp_path)
        try:
            node.write(3)
            node.durability.after_write(OwnSync.NOW)
            node.durability.halt()  # a fatal error elsewhere in the node
            await asyncio.wait_for(node.durability.close(), DEADLINE_S / 2)
            assert node.segment_bytes() > node.written_bytes()
        finally:
            gate.open()
        await until(lambda: not node.durability.in_flight, "the held sync ends")
        assert node.synced == [] and node.failures == []  # nothing reported after a halt
    run(main())
