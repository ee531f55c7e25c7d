"""KernelSync: fdatasync submitted to the kernel (Linux AIO), its result
read back when the eventfd is readable."""

from __future__ import annotations

import errno
import os
import select

import pytest

from qserver.storage import KernelSync


@pytest.fixture
def ksync():
    ks = KernelSync.create()
    if ks is None:
        pytest.skip("no Linux AIO on this machine (the adapter falls back to a thread)")
    yield ks
    ks.close()


def wait_reaped(ks: KernelSync, want: int, timeout_s: float = 30.0) -> list[tuple[int, int]]:
    got: list[tuple[int, int]] = []
    while len(got) < want:
        readable, _, _ = select.select([ks.fileno()], [], [], timeout_s)
        assert readable, "no completion within the deadline"
        got += ks.reap()
    return got


def test_a_sync_completes_with_its_token(ksync, tmp_path):
    fd = os.open(tmp_path / "f", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        os.write(fd, b"x" * 1000)
        ksync.submit(fd, 7)
        assert ksync.in_flight == 1
        assert wait_reaped(ksync, 1) == [(7, 0)]
        assert ksync.in_flight == 0
        assert ksync.reap() == []  # nothing more
    finally:
        os.close(fd)


def test_several_syncs_in_flight_all_come_back(ksync, tmp_path):
    fds = [os.open(tmp_path / f"f{i}", os.O_RDWR | os.O_CREAT, 0o644) for i in range(3)]
    try:
        for i, fd in enumerate(fds):
            os.write(fd, b"y" * 100)
            ksync.submit(fd, 100 + i)
        assert sorted(wait_reaped(ksync, 3)) == [(100, 0), (101, 0), (102, 0)]
    finally:
        for fd in fds:
            os.close(fd)


def test_a_bad_descriptor_is_an_error_not_a_success(ksync, tmp_path):
    fd = os.open(tmp_path / "f", os.O_RDWR | os.O_CREAT, 0o644)
    os.close(fd)  # now a closed descriptor
    try:
        ksync.submit(fd, 1)
    except OSError as exc:
        assert exc.errno == errno.EBADF
    else:
        (token, res), = wait_reaped(ksync, 1)
        assert token == 1 and res < 0


def test_the_environment_can_rule_it_out(monkeypatch):
    monkeypatch.setenv("QSERVER_FSYNC_THREAD", "1")
    assert KernelSync.create() is None
