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

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="qserver", description="qserver: a replicated message queue")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    run = sub.add_parser("run", help="run a node")
    run.add_argument("--config", metavar="FILE",
                     help="XML (or queue_server JSON) configuration; default: one node on 127.0.0.1:1111")
    run.add_argument("--log-level", metavar="LEVEL",
                     help="debug|info|warning|error or queue_server's 0-7; overrides the config")
    return p


async def _run(config: Config) -> int:
    from .server import Node

    if config.storage_dir:
        logging.getLogger("qserver").warning(
            "%s: <storage dir=%s>: persistence is not implemented yet; "
            "this node keeps everything in memory", config.source, config.storage_dir)
    node = Node(config)
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
