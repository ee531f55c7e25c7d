"""Real qserver processes on free loopback ports, for integration tests.

Every process started here is tracked and killed at the end of the test that
started it (see the `procs` fixture in conftest.py). Waits are on conditions
with generous deadlines: CI is a shared, noisy 2-core machine.
"""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

# Generous: a cold Python start on a loaded 2-core machine can take seconds.
START_DEADLINE_S = 30.0
IO_TIMEOUT_S = 10.0


def free_port() -> int:
    """A port free for both TCP and UDP on 127.0.0.1 (at the time of asking)."""
    for _ in range(100):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as t:
            t.bind(("127.0.0.1", 0))
            port = t.getsockname()[1]
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as u:
                try:
                    u.bind(("127.0.0.1", port))
                except OSError:
                    continue
            return port
    raise RuntimeError("no free port")


class NodeProcess:
    """A `qserver run` child process."""

    def __init__(self, config_path: Path, port: int, env: dict | None = None) -> None:
        self.config_path = config_path
        self.port = port
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "qserver", "run", "--config", str(config_path)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
        self.stdout_lines: list[str] = []

    def wait_ready(self, deadline_s: float = START_DEADLINE_S) -> None:
        """Wait for the ready line on stdout; raise with stderr if it dies."""
        end = time.monotonic() + deadline_s
        buf = b""
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise RuntimeError(f"qserver exited with {self.proc.returncode}: "
                                   f"{self.proc.stderr.read().decode(errors='replace')}")
            r, _, _ = select.select([self.proc.stdout], [], [], 0.2)
            if r:
                chunk = os.read(self.proc.stdout.fileno(), 4096)
                buf += chunk
                if b"ready on" in buf:
                    self.stdout_lines = buf.decode().splitlines()
                    return
        raise TimeoutError("qserver did not become ready")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 20.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        for f in (self.proc.stdout, self.proc.stderr):
            if f:
                f.close()
        return self.proc.returncode

    def kill(self) -> None:
        self.stop(signal.SIGKILL)


def write_config(path: Path, port: int, extra: str = "", node_id: int = 1) -> Path:
    path.write_text(
        f'<config>\n  <node_info node_id="{node_id}" host="127.0.0.1" port="{port}"/>\n{extra}</config>\n')
    return path


class TcpClient:
    """A minimal blocking TCP client: send requests, read newline-framed answers."""

    def __init__(self, port: int, host: str = "127.0.0.1") -> None:
        self.sock = socket.create_connection((host, port), timeout=IO_TIMEOUT_S)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.buf = b""

    def send_raw(self, data: bytes) -> None:
        self.sock.sendall(data)

    def read(self) -> dict:
        while b"\n" not in self.buf:
            chunk = self.sock.recv(65536)
            if not chunk:
                raise ConnectionError("closed by server")
            self.buf += chunk
        line, self.buf = self.buf.split(b"\n", 1)
        return json.loads(line)

    def closed_by_server(self) -> bool:
        """True if the server closed the connection (EOF) after any buffered answers."""
        try:
            while True:
                chunk = self.sock.recv(65536)
                if not chunk:
                    return True
                self.buf += chunk
        except (socket.timeout, ConnectionResetError):
            return False

    def request(self, **fields) -> dict:
        self.send_raw(json.dumps(fields).encode())
        return self.read()

    def close(self) -> None:
        self.sock.close()


class UdpClient:
    def __init__(self, port: int, host: str = "127.0.0.1") -> None:
        self.addr = (host, port)
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.settimeout(IO_TIMEOUT_S)

    def send_raw(self, data: bytes) -> dict:
        self.sock.sendto(data, self.addr)
        data, _ = self.sock.recvfrom(70000)
        return json.loads(data)

    def request(self, **fields) -> dict:
        return self.send_raw(json.dumps(fields).encode())

    def close(self) -> None:
        self.sock.close()
