"""TCP proxies that break node-to-node links on command, in a process of
their own.

Theory of operation
-------------------
Every directed node-to-node connection of a cluster under test goes through
a proxy: node i dials its proxy for node j (`<node dial=...>` and
`raft_dial=...` in node i's config), and the proxy connects on to node j's
real port. A link is one listening proxy; it carries two directions: `fwd`
(bytes from the dialer to the acceptor) and `back` (the answers).

Modes, per direction:
- `pass`: bytes are copied on.
- `drop`: bytes are read and thrown away; nothing tells either end (a
  blackhole: the sender's TCP sees its bytes acknowledged by the proxy). A
  new connection accepted while both directions drop is held and never
  connected on, as a SYN into a partition would hang.
and per link:
- `refuse`: every connection is reset (RST), existing ones at once and new
  ones as they arrive (a peer that is down, or a firewall that rejects).
- `reset` (a command, not a mode): reset the link's current connections once.

A connection that lost bytes in a direction can no longer carry that
direction's stream (the receiver would read the rest of a frame as the next
one), so when that direction passes again the connection is reset, and the
nodes dial again: after a real partition a TCP connection either delivers
everything late or dies, never a stream with a hole in it. An end closing
its side while its direction drops is not passed on either (the FIN is lost
too); the connection is reset when the cut heals.

Why a process: the proxies must keep moving bytes while the test's own
threads are busy (workload, checker) and while a node is stopped with
SIGSTOP; an asyncio loop in its own process owes nothing to the test's GIL.
It is driven by one JSON command per line on stdin and answers one JSON line
per command on stdout, once the command has taken effect, so a fault is in
place when `ProxyProcess.set` returns. End of stdin (the test died) stops it.
"""

from __future__ import annotations

import asyncio
import json
import os
import select
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable

__all__ = ["ProxyProcess", "PASS", "DROP"]

PASS = "pass"
DROP = "drop"

# A connect to a node that drops SYNs (it is stopped) must not hold a
# connection forever; the dialer retries anyway.
UPSTREAM_CONNECT_TIMEOUT_S = 5.0

# Generous: a cold Python start on a loaded 2-core machine can take seconds.
START_DEADLINE_S = 30.0
COMMAND_DEADLINE_S = 30.0

CHUNK_BYTES = 256 * 1024


# -- the proxy process --------------------------------------------------------


def _rst(writer: asyncio.StreamWriter | None) -> None:
    """Close with a TCP reset (SO_LINGER 0), not a FIN."""
    if writer is None:
        return
    sock = writer.get_extra_info("socket")
    try:
        if sock is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    except OSError:
        pass
    writer.transport.abort()


class _Conn:
    """One proxied connection: the dialer's side and the upstream side."""

    def __init__(self, link: _Link, cr: asyncio.StreamReader, cw: asyncio.StreamWriter) -> None:
        self.link = link
        self.cr, self.cw = cr, cw
        self.uw: asyncio.StreamWriter | None = None  # None: not connected on (held, or connecting)
        self.tainted: set[str] = set()  # directions that lost bytes
        self.tasks: list[asyncio.Task] = []
        self.done = False

    def reset(self) -> None:
        if self.done:
            return
        self.done = True
        self.link.conns.discard(self)
        self.link.stats["reset"] += 1
        _rst(self.cw)
        _rst(self.uw)
        for t in self.tasks:
            if t is not asyncio.current_task():
                t.cancel()

    def close(self) -> None:
        """A normal close, because one end closed while its direction passed."""
        if self.done:
            return
        self.done = True
        self.link.conns.discard(self)
        for w in (self.cw, self.uw):
            if w is not None:
                w.close()
        for t in self.tasks:
            if t is not asyncio.current_task():
                t.cancel()

    async def pump(self, direction: str, reader: asyncio.StreamReader,
                   writer_of: Callable[[], asyncio.StreamWriter | None]) -> None:
        link = self.link
        try:
            while True:
                data = await reader.read(CHUNK_BYTES)
                if not data:
                    break
                writer = writer_of()
                if link.modes[direction] == DROP or writer is None:
                    self.tainted.add(direction)
                    link.stats[f"{direction}_dropped"] += len(data)
                    continue
                writer.write(data)
                link.stats[f"{direction}_passed"] += len(data)
                await writer.drain()
        except (ConnectionError, OSError):
            pass
        except asyncio.CancelledError:
            return
        if self.done:
            return
        if link.modes[direction] == DROP:
            self.tainted.add(direction)  # the close is lost too; reset on heal
            return
        self.close()


class _Link:
    def __init__(self, name: str, target: tuple[str, int]) -> None:
        self.name = name
        self.target = target
        self.modes = {"fwd": PASS, "back": PASS}
        self.refuse = False
        self.conns: set[_Conn] = set()
        self.server: asyncio.AbstractServer | None = None
        self.port = 0
        self.stats = {"accepted": 0, "refused": 0, "reset": 0, "held": 0,
                      "fwd_passed": 0, "fwd_dropped": 0, "back_passed": 0, "back_dropped": 0}

    async def start(self) -> int:
        self.server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        self.port = self.server.sockets[0].getsockname()[1]
        return self.port

    async def _accept(self, cr: asyncio.StreamReader, cw: asyncio.StreamWriter) -> None:
        if self.refuse:
            self.stats["refused"] += 1
            _rst(cw)
            return
        self.stats["accepted"] += 1
        conn = _Conn(self, cr, cw)
        self.conns.add(conn)
        conn.tasks.append(asyncio.current_task())
        if self.modes["fwd"] == DROP and self.modes["back"] == DROP:
            # Blackholed: the dialer's bytes go nowhere, nothing connects on.
            self.stats["held"] += 1
            await conn.pump("fwd", cr, lambda: None)
            return
        try:
            ur, uw = await asyncio.wait_for(asyncio.open_connection(*self.target),
                                            UPSTREAM_CONNECT_TIMEOUT_S)
        except (TimeoutError, OSError):
            conn.reset()  # as the node itself would: refused
            return
        except asyncio.CancelledError:
            return
        if conn.done:
            _rst(uw)
            return
        conn.uw = uw
        conn.tasks.append(asyncio.create_task(conn.pump("back", ur, lambda: conn.cw)))
        await conn.pump("fwd", cr, lambda: conn.uw)

    def apply(self) -> None:
        """After a change of modes: reset what can no longer carry a stream."""
        for conn in list(self.conns):
            if self.refuse:
                conn.reset()
            elif conn.uw is None and PASS in self.modes.values():
                conn.reset()  # held while blackholed
            elif any(self.modes[d] == PASS for d in conn.tainted):
                conn.reset()


class _ProxyServer:
    def __init__(self) -> None:
        self.links: dict[str, _Link] = {}

    async def handle(self, cmd: dict) -> dict:
        op = cmd["op"]
        if op == "add":
            link = _Link(cmd["name"], (cmd["target"][0], int(cmd["target"][1])))
            self.links[link.name] = link
            return {"ok": True, "port": await link.start()}
        if op == "set":
            for name in cmd["names"]:
                link = self.links[name]
                link.modes["fwd"] = cmd.get("fwd", link.modes["fwd"])
                link.modes["back"] = cmd.get("back", link.modes["back"])
                link.refuse = bool(cmd.get("refuse", link.refuse))
                link.apply()
            return {"ok": True}
        if op == "reset":
            for name in cmd["names"]:
                for conn in list(self.links[name].conns):
                    conn.reset()
            return {"ok": True}
        if op == "stats":
            return {"ok": True, "stats": {n: dict(link.stats, conns=len(link.conns))
                                          for n, link in self.links.items()}}
        if op == "quit":
            return {"ok": True, "quit": True}
        return {"ok": False, "error": f"unknown op {op!r}"}

    async def main(self) -> None:
        loop = asyncio.get_running_loop()
        reader = asyncio.StreamReader()
        await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
        out = sys.stdout
        out.write(json.dumps({"ready": True, "pid": os.getpid()}) + "\n")
        out.flush()
        while True:
            line = await reader.readline()
            if not line:
                break  # the test went away
            try:
                answer = await self.handle(json.loads(line))
            except Exception as exc:  # reported to the caller, who raises
                answer = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
            out.write(json.dumps(answer) + "\n")
            out.flush()
            if answer.get("quit"):
                break
        for link in self.links.values():
            if link.server is not None:
                link.server.close()
            for conn in list(link.conns):
                conn.reset()


# -- the test's side ----------------------------------------------------------------


class ProxyProcess:
    """Starts the proxy process and sends it commands (thread-safe)."""

    def __init__(self, log_path: str | None = None) -> None:
        self._lock = threading.Lock()
        err = open(log_path, "ab") if log_path else subprocess.DEVNULL
        self.proc = subprocess.Popen([sys.executable, os.path.abspath(__file__)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err)
        if log_path:
            err.close()
        self._buf = b""
        first = self._read_line(START_DEADLINE_S)
        if not first.get("ready"):
            self.close()
            raise RuntimeError(f"proxy process did not start: {first}")
        self.ports: dict[str, int] = {}

    def _read_line(self, deadline_s: float) -> dict:
        end = time.monotonic() + deadline_s
        fd = self.proc.stdout.fileno()
        while b"\n" not in self._buf:
            left = end - time.monotonic()
            if left <= 0:
                raise TimeoutError("proxy process did not answer")
            r, _, _ = select.select([fd], [], [], min(left, 0.5))
            if r:
                chunk = os.read(fd, 65536)
                if not chunk:
                    raise RuntimeError(f"proxy process exited ({self.proc.poll()})")
                self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        return json.loads(line)

    def command(self, **cmd) -> dict:
        with self._lock:
            self.proc.stdin.write((json.dumps(cmd) + "\n").encode())
            self.proc.stdin.flush()
            answer = self._read_line(COMMAND_DEADLINE_S)
        if not answer.get("ok"):
            raise RuntimeError(f"proxy command {cmd} failed: {answer.get('error')}")
        return answer

    def add(self, name: str, target: tuple[str, int]) -> int:
        """A new link to `target`; returns the port to dial."""
        port = self.command(op="add", name=name, target=list(target))["port"]
        self.ports[name] = port
        return port

    def set(self, names: list[str], *, fwd: str | None = None, back: str | None = None,
            refuse: bool | None = None) -> None:
        cmd: dict = {"op": "set", "names": list(names)}
        if fwd is not None:
            cmd["fwd"] = fwd
        if back is not None:
            cmd["back"] = back
        if refuse is not None:
            cmd["refuse"] = refuse
        self.command(**cmd)

    def reset(self, names: list[str]) -> None:
        self.command(op="reset", names=list(names))

    def stats(self) -> dict:
        return self.command(op="stats")["stats"]

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                with self._lock:
                    self.proc.stdin.write(b'{"op": "quit"}\n')
                    self.proc.stdin.flush()
            except (OSError, ValueError):
                pass
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        for f in (self.proc.stdin, self.proc.stdout):
            try:
                f.close()
            except OSError:
                pass


if __name__ == "__main__":
    try:
        asyncio.run(_ProxyServer().main())
    except KeyboardInterrupt:
        pass
