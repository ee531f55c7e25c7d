"""A cluster of real `qserver run` processes whose node-to-node links all go
through the proxies of `harness.proxy`, with the faults a nemesis needs.

Theory of operation
-------------------
Ports: each node has a client port, an internal port and, for the raft
engine, the raft port (internal + RAFT_PORT_OFFSET). They are picked below
the kernel's ephemeral range, so that a node killed and restarted finds its
ports free: an outgoing connection (the proxies dial the nodes all the time)
takes its source port from the ephemeral range and could otherwise sit on a
dead node's port.

Links: for every ordered pair (i, j) the proxy process holds `int-i-j`
(node i dialing node j's internal port) and, with the raft engine,
`raft-i-j` (its raft port). Node i's config names node j by j's own
address, with `dial` and `raft_dial` pointing at those proxies. Cutting the
flow of bytes from node a to node b is a matter of two proxies: the `fwd`
direction of a's links to b and the `back` direction of b's links to a
(each pair of native nodes holds two connections, one dialed by each side,
and either may carry messages either way; pysyncobj dials only one way).
`set_cuts` takes the whole set of cut flows at once and sets every link to
match, so healing is `set_cuts(set())`.

Processes: stdout and stderr go to files in the run directory (a pipe that
nobody reads would stall a chatty node), so the logs of every node survive
the run for a post-mortem. A restart appends to the same files; a node is
ready when its stdout holds one more "ready on" line than before. With
`qserver_src`, nodes run that source tree (PYTHONPATH, and a working
directory outside any tree) instead of the installed one.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from .proxy import DROP, PASS, ProxyProcess

__all__ = ["FaultCluster", "NodePorts", "RAFT_PORT_OFFSET"]

# qserver.engines.raft.driver.RAFT_PORT_OFFSET, copied: the tree under test
# may differ from ours.
RAFT_PORT_OFFSET = 1000

# Generous: a cold Python start on a loaded 2-core machine can take seconds,
# and a node replaying a log after kill -9 takes longer.
START_DEADLINE_S = 60.0
ASK_TIMEOUT_S = 2.0

SECRET = "fault-harness-secret"


@dataclass(frozen=True, slots=True, kw_only=True)
class NodePorts:
    node_id: int
    client: int
    internal: int

    @property
    def raft(self) -> int:
        return self.internal + RAFT_PORT_OFFSET


def _bindable(port: int) -> bool:
    for kind in (socket.SOCK_STREAM, socket.SOCK_DGRAM):
        with socket.socket(socket.AF_INET, kind) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                return False
    return True


def _port_range() -> tuple[int, int]:
    """Ports to pick from: below the ephemeral range, above the well-known."""
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    return 10000, max(10000 + 4 * RAFT_PORT_OFFSET, low) - RAFT_PORT_OFFSET - 1


def pick_ports(n: int, rng: random.Random | None = None) -> list[NodePorts]:
    """Client and internal ports for n nodes (and internal + offset free too)."""
    rng = rng or random.SystemRandom()
    lo, hi = _port_range()
    taken: set[int] = set()
    out = []

    def one(extra: int | None = None) -> int:
        for _ in range(10000):
            p = rng.randint(lo, hi)
            group = {p} if extra is None else {p, p + extra}
            if group & taken or not all(_bindable(q) for q in group):
                continue
            taken.update(group)
            return p
        raise RuntimeError("no free port")

    for i in range(1, n + 1):
        out.append(NodePorts(node_id=i, client=one(), internal=one(RAFT_PORT_OFFSET)))
    return out


class _Node:
    """One node's process, its files and its restarts."""

    def __init__(self, node_id: int, config: Path, out: Path, err: Path, env: dict,
                 cwd: Path) -> None:
        self.node_id = node_id
        self.config, self.out, self.err, self.env, self.cwd = config, out, err, env, cwd
        self.proc: subprocess.Popen | None = None
        self.stopped = False  # SIGSTOPped by us

    def _ready_lines(self) -> int:
        try:
            return self.out.read_bytes().count(b" ready on ")
        except OSError:
            return 0

    def start(self, deadline_s: float = START_DEADLINE_S) -> None:
        for attempt in range(3):
            before = self._ready_lines()
            with open(self.out, "ab") as out, open(self.err, "ab") as err:
                self.proc = subprocess.Popen(
                    [sys.executable, "-m", "qserver", "run", "--config", str(self.config)],
                    stdout=out, stderr=err, env=self.env, cwd=self.cwd)
            self.stopped = False
            end = time.monotonic() + deadline_s
            while time.monotonic() < end:
                if self._ready_lines() > before:
                    return
                if self.proc.poll() is not None:
                    break
                time.sleep(0.05)
            else:
                self.kill()
                raise TimeoutError(f"node {self.node_id} not ready within {deadline_s} s")
            tail = self.err.read_bytes()[-2000:].decode(errors="replace")
            if "cannot listen" not in tail or attempt == 2:
                raise RuntimeError(
                    f"node {self.node_id} exited with {self.proc.returncode}: {tail}")
            time.sleep(1.0)  # a port in TIME_WAIT or briefly taken: try again

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def signal(self, sig: int) -> None:
        if self.alive():
            self.proc.send_signal(sig)

    def kill(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.kill()  # works on a stopped process too
        self.proc.wait()
        self.stopped = False

    def terminate(self, timeout_s: float = 20.0) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        if self.stopped:
            self.proc.send_signal(signal.SIGCONT)
        self.proc.terminate()
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()


class FaultCluster:
    """n real nodes (3 by default), every internal link proxied.

    Use as a context manager, or call close(): every process it started
    (nodes and the proxy process) is ended, whatever happened."""

    def __init__(self, workdir: Path, *, engine: str = "native", fsync: str = "always",
                 n: int = 3, mode: str = "quorum", qserver_src: str | None = None,
                 log_level: str = "info", extra: str = "") -> None:
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.engine, self.fsync, self.n, self.mode = engine, fsync, n, mode
        self.qserver_src = qserver_src
        self.log_level = log_level
        self.extra = extra
        self.ports = {p.node_id: p for p in pick_ports(n)}
        self.ids = list(range(1, n + 1))
        self.proxy: ProxyProcess | None = None
        self.nodes: dict[int, _Node] = {}
        self.cuts: frozenset[tuple[int, int]] = frozenset()  # cut flows (from, to)
        self.cut_style = DROP

    # -- setup ----------------------------------------------------------------

    def _links(self, kind: str) -> list[tuple[str, int, int]]:
        return [(f"{kind}-{i}-{j}", i, j) for i in self.ids for j in self.ids if i != j]

    def _config(self, i: int) -> str:
        nodes = []
        for j in self.ids:
            p = self.ports[j]
            attrs = f'id="{j}" host="127.0.0.1" port="{p.internal}"'
            if j != i:
                attrs += f' dial="127.0.0.1:{self.proxy.ports[f"int-{i}-{j}"]}"'
                if self.engine == "raft":
                    attrs += f' raft_dial="127.0.0.1:{self.proxy.ports[f"raft-{i}-{j}"]}"'
            nodes.append(f"    <node {attrs}/>")
        node_list = "\n".join(nodes)
        return (f'<config>\n  <log level="{self.log_level}"/>\n'
                f'  <node_info node_id="{i}" host="127.0.0.1" port="{self.ports[i].client}"/>\n'
                f'  <cluster secret="{SECRET}">\n{node_list}\n  </cluster>\n'
                f'  <replication engine="{self.engine}" mode="{self.mode}"/>\n'
                f'  <storage dir="{self.workdir / f"data{i}"}" fsync="{self.fsync}"/>\n'
                f'{self.extra}</config>\n')

    def _env(self) -> dict:
        env = dict(os.environ)
        if self.qserver_src:
            env["PYTHONPATH"] = os.path.abspath(self.qserver_src) + (
                os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        return env

    def qserver_module_path(self) -> str:
        """The qserver package the nodes import (to check --qserver-src)."""
        out = subprocess.run([sys.executable, "-c", "import qserver; print(qserver.__file__)"],
                             env=self._env(), cwd=self.workdir, capture_output=True, text=True,
                             timeout=60)
        return out.stdout.strip() or out.stderr.strip()

    def source_fingerprint(self) -> str:
        """The qserver package the nodes import, and a hash of its .py files
        (a run compares it at its start and end: a tree changed under a
        running benchmark would mix two versions of the code)."""
        path = Path(self.qserver_module_path()).parent
        h = hashlib.sha256()
        for f in sorted(path.rglob("*.py")):
            h.update(str(f.relative_to(path)).encode() + b"\0" + f.read_bytes())
        return f"{path} (sources sha256 {h.hexdigest()[:12]})"

    def start(self) -> None:
        """Start the proxies and every node; wait until each is ready."""
        self.proxy = ProxyProcess(str(self.workdir / "proxy.log"))
        for name, _, j in self._links("int"):
            self.proxy.add(name, ("127.0.0.1", self.ports[j].internal))
        if self.engine == "raft":
            for name, _, j in self._links("raft"):
                self.proxy.add(name, ("127.0.0.1", self.ports[j].raft))
        env = self._env()
        for i in self.ids:
            cfg = self.workdir / f"node{i}.xml"
            cfg.write_text(self._config(i))
            self.nodes[i] = _Node(i, cfg, self.workdir / f"node{i}.out",
                                  self.workdir / f"node{i}.log", env, self.workdir)
        for i in self.ids:
            self.nodes[i].start()

    def close(self) -> None:
        for node in self.nodes.values():
            try:
                node.kill()
            except Exception:  # keep going: every process must go
                pass
        if self.proxy is not None:
            self.proxy.close()

    def __enter__(self) -> FaultCluster:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- processes ---------------------------------------------------------------

    def kill(self, i: int) -> None:
        """kill -9."""
        self.nodes[i].kill()

    def restart(self, i: int) -> None:
        self.nodes[i].start()

    def pause(self, i: int) -> None:
        """SIGSTOP."""
        self.nodes[i].signal(signal.SIGSTOP)
        self.nodes[i].stopped = True

    def resume(self, i: int) -> None:
        """SIGCONT."""
        self.nodes[i].signal(signal.SIGCONT)
        self.nodes[i].stopped = False

    def alive(self, i: int) -> bool:
        return self.nodes[i].alive()

    def running(self) -> list[int]:
        """Nodes alive and not stopped."""
        return [i for i in self.ids if self.nodes[i].alive() and not self.nodes[i].stopped]

    def log_path(self, i: int) -> Path:
        return self.nodes[i].err

    # -- links ---------------------------------------------------------------------

    def set_cuts(self, cuts: set[tuple[int, int]] | frozenset, style: str = DROP) -> None:
        """Cut exactly the flows in `cuts` ((from, to) node pairs), heal the
        rest. style DROP blackholes the bytes; "close" resets the links of a
        pair cut both ways and refuses new connections on them."""
        cuts = frozenset(cuts)
        kinds = ["int"] + (["raft"] if self.engine == "raft" else [])
        groups: dict[tuple[str, str, bool], list[str]] = {}
        for kind in kinds:
            for name, i, j in self._links(kind):
                fwd_cut, back_cut = (i, j) in cuts, (j, i) in cuts
                refuse = style == "close" and fwd_cut and back_cut
                key = (DROP if fwd_cut else PASS, DROP if back_cut else PASS, refuse)
                groups.setdefault(key, []).append(name)
        for (fwd, back, refuse), names in groups.items():
            self.proxy.set(names, fwd=fwd, back=back, refuse=refuse)
        self.cuts, self.cut_style = cuts, style

    def heal_links(self) -> None:
        self.set_cuts(frozenset())

    def reset_links(self) -> None:
        """Reset every current node-to-node connection once."""
        names = [n for kind in ("int", "raft") for n, _, _ in self._links(kind)
                 if n in self.proxy.ports]
        self.proxy.reset(names)

    # -- asking nodes ------------------------------------------------------------

    def ask(self, i: int, timeout_s: float = ASK_TIMEOUT_S, **fields) -> dict | None:
        """One request to node i over a fresh connection; None if no answer."""
        try:
            with socket.create_connection(("127.0.0.1", self.ports[i].client),
                                          timeout=timeout_s) as s:
                s.settimeout(timeout_s)
                s.sendall(json.dumps(fields).encode())
                buf = b""
                while b"\n" not in buf:
                    chunk = s.recv(65536)
                    if not chunk:
                        return None
                    buf += chunk
                return json.loads(buf.split(b"\n", 1)[0])
        except (OSError, ValueError):
            return None

    def statuses(self, ids: list[int] | None = None, **fields) -> dict[int, dict | None]:
        """Node-local monitor (104) of each running node."""
        ids = self.running() if ids is None else ids
        return {i: self.ask(i, action=104, **fields) for i in ids}

    def master(self) -> int | None:
        """The node that says it is master, in the highest vote_id, among
        the running nodes; None if none does."""
        best = None
        for i, st in self.statuses().items():
            if st and st.get("role") == "master":
                if best is None or st.get("vote_id", 0) > best[1]:
                    best = (i, st.get("vote_id", 0))
        return best[0] if best else None

    def agreed_master(self, ids: list[int] | None = None) -> int | None:
        """The master every given node (default: all) names and that says so."""
        ids = self.ids if ids is None else ids
        st = self.statuses(ids)
        masters = [i for i, s in st.items() if s and s.get("role") == "master"]
        if len(masters) != 1:
            return None
        m = masters[0]
        return m if all(s and s.get("leader_node_id") == m for s in st.values()) else None

    def wait_master(self, deadline_s: float = 60.0, ids: list[int] | None = None) -> int:
        end = time.monotonic() + deadline_s
        while time.monotonic() < end:
            m = self.agreed_master(ids)
            if m is not None:
                return m
            time.sleep(0.1)
        raise TimeoutError(f"no master agreed on within {deadline_s} s")
