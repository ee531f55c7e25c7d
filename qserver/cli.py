"""The `qserver` command line.

    qserver run [--config FILE] [--log-level LEVEL]

Exit status: 0 after an orderly shutdown (SIGINT or SIGTERM), 2 for a bad
configuration or usage, 1 when the node cannot start (the port is taken).
A second SIGINT/SIGTERM during shutdown forces the exit.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys

from .config import Config, load_config, log_level
from .errors import ConfigError
from .storage import StorageError

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="qserver", description="qserver: a replicated message queue")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    run = sub.add_parser("run", help="run a node")
    run.add_argument("--config", metavar="FILE",
                     help="XML (or queue_server JSON) configuration; default: one node on 127.0.0.1:1111")
    run.add_argument("--log-level", metavar="LEVEL",
                     help="debug|info|warning|error or queue_server's 0-7; overrides the config")
    demo = sub.add_parser("local-cluster", help="run several nodes as child processes (the local demo cluster)")
    demo.add_argument("configs", nargs="*", metavar="CONFIG",
                      default=["config/node1.xml", "config/node2.xml", "config/node3.xml"],
                      help="one config per node (default: config/node1.xml to node3.xml)")
    return p


def _local_cluster(paths: list[str]) -> int:
    """Start one `qserver run` per config, report the master, stop all on
    SIGINT/SIGTERM."""
    import json
    import socket
    import subprocess
    import time

    configs = []
    for path in paths:
        try:
            configs.append(load_config(path))
        except ConfigError as exc:
            print(f"qserver: config error: {exc}", file=sys.stderr)
            return 2
    stop = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.append(1))
    children = [subprocess.Popen([sys.executable, "-m", "qserver", "run", "--config", p],
                                 stdout=subprocess.DEVNULL) for p in paths]

    def ask(cfg, request: dict) -> dict | None:
        try:
            with socket.create_connection((cfg.host, cfg.port), timeout=1) as s:
                s.sendall(json.dumps(request).encode())
                return json.loads(s.makefile().readline())
        except (OSError, ValueError):
            return None

    try:
        deadline = time.monotonic() + 30
        leader = None
        while not stop and time.monotonic() < deadline and leader is None:
            if any(c.poll() is not None for c in children):
                print("qserver: a node exited; see its log above", file=sys.stderr)
                return 1
            r = ask(configs[0], {"action": 8})
            if r and r.get("code") == 0:
                leader = r
            else:
                time.sleep(0.1)
        if leader is None:
            if not stop:
                print("qserver: no master elected within 30 s", file=sys.stderr)
            return 1 if not stop else 0
        nodes = ", ".join(f"node {c.node_id} on {c.host}:{c.port}" for c in configs)
        print(f"qserver local cluster: {nodes}")
        print(f"master: node {leader['leader_node_id']} on {leader['leader_host']}:{leader['leader_port']}")
        first = configs[0]
        print("try (any node answers; slaves forward to the master):")
        print(f"  echo '{{\"action\":1,\"queue\":\"demo\",\"data\":\"hello\"}}' | nc -q1 {first.host} {first.port}")
        print(f"  echo '{{\"action\":2,\"queue\":\"demo\"}}' | nc -q1 {configs[-1].host} {configs[-1].port}")
        print("Ctrl-C stops all nodes.", flush=True)
        while not stop and all(c.poll() is None for c in children):
            time.sleep(0.2)
        return 0
    finally:
        for c in children:
            if c.poll() is None:
                c.terminate()
        for c in children:
            try:
                c.wait(15)
            except subprocess.TimeoutExpired:
                c.kill()
                c.wait()


async def _run(config: Config) -> int:
    from .server import Node

    try:
        node = Node(config)
    except StorageError as exc:
        logging.getLogger("qserver").error("cannot recover from storage: %s", exc)
        print(f"qserver: storage error: {exc} (see README: Storage, to re-sync this node)",
              file=sys.stderr)
        return 1
    try:
        await node.start()
    except OSError as exc:
        logging.getLogger("qserver").error("cannot listen: %s", exc.strerror or exc)
        return 1
    loop = asyncio.get_running_loop()
    signals = 0

    def on_signal() -> None:
        nonlocal signals
        signals += 1
        if signals == 1:
            logging.getLogger("qserver").info("shutting down (signal again to force)")
            node.stop()
        else:
            os._exit(1)

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal)
    print(f"qserver node {config.node_id} ready on {node.address[0]}:{node.address[1]}",
          flush=True)
    await node.serve()
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "local-cluster":
        return _local_cluster(args.configs)
    if args.command == "run":
        try:
            config = load_config(args.config) if args.config else Config.default()
        except ConfigError as exc:
            print(f"qserver: config error: {exc}", file=sys.stderr)
            return 2
        level = config.log_level
        if args.log_level:
            level = log_level(args.log_level)
            if level is None:
                print(f"qserver: bad --log-level {args.log_level!r}", file=sys.stderr)
                return 2
        logging.basicConfig(level=level, stream=sys.stderr,
                            format=f"%(asctime)s {config.log_prefix}[{config.node_id}] %(levelname)s %(message)s")
        try:
            import uvloop
            return uvloop.run(_run(config))
        except ImportError:  # uvloop is a dependency; this is for odd platforms
            return asyncio.run(_run(config))
    return 2


if __name__ == "__main__":
    sys.exit(main())
