"""fdatasync handed to the kernel: Linux AIO (IOCB_CMD_FDSYNC, Linux 4.18+),
its completion signalled on an eventfd that the event loop watches.

Why not a worker thread: a thread coming back from fdatasync must take the
GIL from the event loop's thread. While it waits for it, every system call
the loop makes (a send, a recv, epoll) wakes it to try again, for up to
the switch interval. bench/durability_bench.py measured that tax at about
a third more CPU per write with fsync=batch (a sync every 5 ms), and it grew
with `sys.setswitchinterval`. Here the loop's thread submits the sync and
later reads its result; no other Python thread is involved, and the kernel
does the sync in its own worker.

Only the native engine's fsync scheduling (qserver.engines.native.durability)
uses this; `KernelSync.create()` returns None where it is not available (not
Linux on x86_64 or aarch64, a kernel without AIO, a seccomp filter that
refuses io_setup), and it then falls back to a worker thread.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import platform

__all__ = ["KernelSync"]

log = logging.getLogger(__name__)

# System call numbers: x86_64's own, and the generic table (aarch64).
_SYSCALLS = {
    "x86_64": {"io_setup": 206, "io_destroy": 207, "io_getevents": 208, "io_submit": 209},
    "aarch64": {"io_setup": 0, "io_destroy": 1, "io_submit": 2, "io_getevents": 4},
}
_IOCB_CMD_FDSYNC = 3
_IOCB_FLAG_RESFD = 1


class _Iocb(ctypes.Structure):
    """struct iocb of linux/aio_abi.h (little-endian layout, 64 bytes)."""

    _fields_ = [("aio_data", ctypes.c_uint64), ("aio_key", ctypes.c_uint32),
                ("aio_rw_flags", ctypes.c_int32), ("aio_lio_opcode", ctypes.c_uint16),
                ("aio_reqprio", ctypes.c_int16), ("aio_fildes", ctypes.c_uint32),
                ("aio_buf", ctypes.c_uint64), ("aio_nbytes", ctypes.c_uint64),
                ("aio_offset", ctypes.c_int64), ("aio_reserved2", ctypes.c_uint64),
                ("aio_flags", ctypes.c_uint32), ("aio_resfd", ctypes.c_uint32)]


class _IoEvent(ctypes.Structure):
    _fields_ = [("data", ctypes.c_uint64), ("obj", ctypes.c_uint64),
                ("res", ctypes.c_int64), ("res2", ctypes.c_int64)]


class KernelSync:
    """Submit fdatasync(fd) without blocking; collect results when
    `fileno()` is readable. Not thread-safe: one event loop owns it."""

    def __init__(self, libc: ctypes.CDLL, numbers: dict[str, int], ctx: ctypes.c_ulong,
                 efd: int, max_in_flight: int) -> None:
        self._libc = libc
        self._nr = numbers
        self._ctx = ctx
        self._efd = efd
        self._max = max_in_flight
        self._in_flight: dict[int, _Iocb] = {}  # token -> its iocb, kept alive until done
        self._events = (_IoEvent * max_in_flight)()

    @classmethod
    def create(cls, max_in_flight: int = 16) -> KernelSync | None:
        """A KernelSync, or None where Linux AIO cannot be used here, or
        where the environment variable QSERVER_FSYNC_THREAD is set to 1 (to
        rule this path out when looking into a problem)."""
        if os.environ.get("QSERVER_FSYNC_THREAD") == "1":
            return None
        numbers = _SYSCALLS.get(platform.machine())
        if numbers is None or not hasattr(os, "eventfd") or ctypes.sizeof(ctypes.c_void_p) != 8:
            return None  # (a 32-bit Python on a 64-bit kernel has other numbers)
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.syscall.restype = ctypes.c_long
        except (OSError, AttributeError):
            return None
        ctx = ctypes.c_ulong(0)
        if libc.syscall(ctypes.c_long(numbers["io_setup"]), ctypes.c_long(max_in_flight),
                        ctypes.byref(ctx)) != 0:
            log.info("storage: no kernel AIO (io_setup: %s); fsync runs in a thread",
                     os.strerror(ctypes.get_errno()))
            return None
        try:
            efd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        except OSError as exc:
            libc.syscall(ctypes.c_long(numbers["io_destroy"]), ctx)
            log.info("storage: no eventfd (%s); fsync runs in a thread", exc.strerror or exc)
            return None
        return cls(libc, numbers, ctx, efd, max_in_flight)

    def fileno(self) -> int:
        """Readable when a submitted sync has finished."""
        return self._efd

    @property
    def in_flight(self) -> int:
        return len(self._in_flight)

    def submit(self, fd: int, token: int) -> None:
        """Start fdatasync(fd); `token` comes back from `reap`. The caller
        keeps fd open until then. Raises OSError if the kernel refuses
        (EINVAL: this file cannot be synced this way)."""
        if len(self._in_flight) >= self._max:
            raise OSError(errno.EAGAIN, "too many syncs in flight")
        iocb = _Iocb(aio_data=token, aio_lio_opcode=_IOCB_CMD_FDSYNC, aio_fildes=fd,
                     aio_flags=_IOCB_FLAG_RESFD, aio_resfd=self._efd)
        array = (ctypes.POINTER(_Iocb) * 1)(ctypes.pointer(iocb))
        done = self._libc.syscall(ctypes.c_long(self._nr["io_submit"]), self._ctx,
                                  ctypes.c_long(1), array)
        if done != 1:
            err = ctypes.get_errno() if done < 0 else errno.EAGAIN
            raise OSError(err, f"io_submit: {os.strerror(err)}")
        self._in_flight[token] = iocb

    def reap(self) -> list[tuple[int, int]]:
        """The syncs that finished: (token, 0) or (token, -errno)."""
        try:
            os.eventfd_read(self._efd)
        except BlockingIOError:
            pass
        if not self._in_flight:
            return []
        got = self._libc.syscall(ctypes.c_long(self._nr["io_getevents"]), self._ctx,
                                 ctypes.c_long(0), ctypes.c_long(self._max), self._events, None)
        if got < 0:
            err = ctypes.get_errno()
            if err == errno.EINTR:
                return []
            raise OSError(err, f"io_getevents: {os.strerror(err)}")
        out = []
        for i in range(got):
            event = self._events[i]
            token = event.data
            self._in_flight.pop(token, None)
            out.append((token, event.res))
        return out

    def close(self) -> None:
        """Wait for what is in flight (io_destroy does) and release it all."""
        if self._ctx.value:
            self._libc.syscall(ctypes.c_long(self._nr["io_destroy"]), self._ctx)
            self._ctx = ctypes.c_ulong(0)
        if self._efd >= 0:
            os.close(self._efd)
            self._efd = -1
        self._in_flight.clear()
