"""The `qserver` command line.

    qserver run [--config FILE] [--log-level LEVEL] [--log-format text|json]
    qserver local-cluster [--log-format text|json] [CONFIG ...]

Exit status: 0 after an orderly shutdown (SIGINT or SIGTERM), 2 for a bad
configuration or usage, 1 when the node cannot start (the port is taken)
or stopped on a fatal error (a broken invariant, a bug, a failed write or
fsync: one CRITICAL log line names it, and the process ends at once).
A second SIGINT/SIGTERM during shutdown forces the exit.

Client commands, against any node (`-s HOST:PORT`, repeatable or
comma-separated, or a qserver:// URL; default $QSERVER_SERVERS, else
127.0.0.1:1111), through `qserver.client.Client`:

    qserver produce QUEUE DATA [--delay T] [--ttl T] [--retry D] [--priority N] [--dedup-id ID]
    qserver produce QUEUE - [--delay T] [--ttl T] [--retry D] [--priority N]
    qserver consume QUEUE [QUEUE ...] [--count N] [--wait D] [--lease D] [--ack]
    qserver confirm QUEUE MSG_ID [--receipt R]
    qserver nack QUEUE MSG_ID [--receipt R] [--delay T]
    qserver touch QUEUE MSG_ID [--receipt R] [--lease D]
    qserver show QUEUE MSG_ID
    qserver peek QUEUE [--count N]
    qserver config QUEUE [KEY=VALUE ...]
    qserver pause QUEUE [in|out|all]
    qserver resume QUEUE
    qserver clear QUEUE
    qserver monitor [QUEUE]
    qserver list [PATTERN]
    qserver leader
    qserver status
    qserver health
    qserver drain [--undo]
    qserver transfer-leader NODE_ID

The client options (-s, --json, --timeout, --retry-for, the token and TLS
options) go before the command or after it; the command line wins over a
URL's settings, and they over $QSERVER_TIMEOUT (seconds, as the client
reads it).
A duration D is `30s`, `5m`, `2h`, `1d`, `1.5s`, `250ms`, `1h30m` or plain
seconds; a time T is a duration from now, a plain number as the protocol
takes it (from 1,000,000,000 on an absolute unix time), or an ISO 8601
time with Z or an offset (one without a zone is refused). `qserver
--version` prints the package's version.

Output is for people by default, JSON with `--json`. Exit status: 0 on
success (an empty consume or peek included), 1 on a server or connection
error (one line on stderr: a stale receipt, a message not in flight, a show
of a message that is not there), 2 for bad usage. `status` asks every given
node for its own view (action 104; with one node given, also its master
and the slaves the master gives addresses of) and exits 1 if one of them
does not answer; each node's address is the one its answer gives.
`monitor` prints nested fields as `snapshot.taken` rows and the slaves as
a table. `health` asks every given node whether it is ready for clients
(action 109) and prints why not; it exits 0 when every one is ready, 1 when
one is not or does not answer (a probe for sites without HTTP). `drain`
takes the one node given out of client work (a master first hands its role
to its most up-to-date slave) and `--undo` puts it back; `transfer-leader`
hands the master role to NODE_ID.

`consume` takes from the first listed queue that has a message. Without
`--count` it prints as it always did (`msg_id N: DATA`; JSON: queue,
msg_id, data); with `--count N` it lists up to N messages with their
delivery count and receipt (JSON: a list of {queue, msg_id, data,
deliveries, receipt}), which `confirm`, `nack` and `touch` take with
`--receipt` (use `--count 1` for one message and its receipt). `--wait D`
is a long poll, `--lease D` the time before an unconfirmed delivery comes
back, `--ack` confirms each message with its receipt once printed. `config`
without KEY=VALUE prints the queue's settings; with them it changes them
(values: integers as integers, decimals as numbers, an empty value as none,
and for dead_letter also `none`).

`produce QUEUE -` reads one message per line from stdin (the line without
its end; an empty line is an empty message) and sends them as batch
produces of up to 1,000 lines, one at a time: each batch is stored whole or
not at all, and the msg_ids of the stored ones are printed one per line as
they are (`--json`: the list, at the end). `--dedup-id` goes with one
message only; with it, `produce` says whether the message was a duplicate
(nothing stored; the first produce's msg_id). `pause` stops producers
(`in`), consumers (`out`) or both (`all`, the default) until `resume`.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import faulthandler
import logging
import math
import os
import re
import signal
import sys
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from .config import Config, load_config, log_level
from .errors import ConfigError, InvalidArgument, QServerClientError, ServerError
from .logformat import LOG_FORMATS, configure_logging
from .storage import StorageError

if TYPE_CHECKING:
    from .client.core import Target

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="qserver", description="qserver: a replicated message queue",
        parents=[_client_option_parser(SERVERS_BEFORE)],
        epilog="The client commands' options (-s, --json, --timeout, --retry-for, the token "
               "and TLS options) go before the command or after it. Durations: "
               f"{DURATION_HELP}.")
    p.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    run = sub.add_parser("run", help="run a node")
    run.add_argument("--config", metavar="FILE",
                     help="XML (or queue_server JSON) configuration; "
                          "default: one node on 127.0.0.1:1111")
    run.add_argument("--log-level", metavar="LEVEL",
                     help="debug|info|warning|error or queue_server's 0-7; overrides the config")
    run.add_argument("--log-format", choices=LOG_FORMATS, default=LOG_FORMATS[0],
                     help="text (default) or json: one JSON object per line on stderr "
                          "(ts, level, logger, msg, node_id, exc)")
    demo = sub.add_parser("local-cluster",
                          help="run several nodes as child processes (the local demo cluster)")
    demo.add_argument("configs", nargs="*", metavar="CONFIG",
                      default=["config/node1.xml", "config/node2.xml", "config/node3.xml"],
                      help="one config per node (default: config/node1.xml to node3.xml)")
    demo.add_argument("--log-format", choices=LOG_FORMATS, default=LOG_FORMATS[0],
                      help="the nodes' log format: text (default) or json")
    _add_client_commands(sub)
    return p


def _version() -> str:
    """The installed package's version; qserver.__version__ when run from a
    checkout that is not installed."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("qserver")
    except PackageNotFoundError:
        from . import __version__
        return __version__


def _parse(argv: list[str] | None) -> argparse.Namespace:
    """The command line; the client options are refused before `run` and
    `local-cluster` (their defaults are _apply_client_defaults' to fill in).
    Exits 2 on bad usage, as argparse does."""
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command not in CLIENT_COMMANDS:
        given = sorted(dest for dest in (*CLIENT_DEFAULTS, "timeout", SERVERS_BEFORE)
                       if dest in vars(args))
        if given:
            names = [action.option_strings[-1] for action in parser._actions
                     if action.dest in given]
            parser.error(f"{', '.join(names)}: for the client commands, not {args.command}")
    return args


def _local_cluster(paths: list[str], log_format: str = LOG_FORMATS[0]) -> int:
    """Start one `qserver run` per config, report the master, stop all on
    SIGINT/SIGTERM."""
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
    children = [subprocess.Popen([sys.executable, "-m", "qserver", "run", "--config", p,
                                  "--log-format", log_format],
                                 stdout=subprocess.DEVNULL) for p in paths]

    def ask(cfg, request: dict) -> dict | None:
        """One request to the node of `cfg`, with the token and TLS its own
        configuration asks clients for (a token allowed the action; its CA,
        and its own certificate where clients must present one)."""
        from .client import Client

        token = next((t.token for t in cfg.client_tokens if t.allows(request["action"])), None)
        host = cfg.client_host if cfg.client_host not in ("0.0.0.0", "::") else "127.0.0.1"
        tls = {}
        if cfg.tls:
            tls = {"tls": True, "tls_ca": cfg.tls_ca, "tls_server_hostname": cfg.client_host}
            if cfg.tls_client_cert.value == "required":
                tls.update(tls_cert=cfg.tls_cert, tls_key=cfg.tls_key)
        try:
            with Client([(host, cfg.port)], timeout=1, retry_for=0, token=token,
                        **tls) as client:
                return client.request(request)
        except (QServerClientError, OSError, ValueError):
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
        print(f"master: node {leader['leader_node_id']} on "
              f"{leader['leader_host']}:{leader['leader_port']}")
        first = configs[0]
        # The command as it was run (make run: .venv/bin/qserver), else the module.
        me = sys.argv[0] if os.path.basename(sys.argv[0]) == "qserver" else (
            f"{os.path.basename(sys.executable)} -m qserver")
        extra = " --token TOKEN" if first.auth_required else ""
        extra += " --tls --tls-ca CA" if first.tls else ""
        last = configs[-1]
        print("try (any node answers; slaves forward to the master):")
        print(f"  {me} produce demo hello -s {first.client_host}:{first.port}{extra}")
        print(f"  {me} consume demo -s {last.client_host}:{last.port}{extra}")
        if first.http_port:  # <http>: metrics and probes
            print(f"  curl http://{first.http_host}:{first.http_port}/metrics   "
                  f"(and /healthz, /readyz; every node with <http>)")
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


# -- client commands -----------------------------------------------------------

DEFAULT_SERVER = "127.0.0.1:1111"

# The command line waits less than a program would (the client's default is
# 10 s): a person wants a quick answer, and a script can pass --retry-for.
CLI_RETRY_FOR_S = 3.0

CLIENT_COMMANDS = ("produce", "consume", "confirm", "nack", "touch", "show", "peek", "config",
                   "pause", "resume", "clear", "monitor", "list", "leader", "status",
                   "health", "drain", "transfer-leader")

# Lines of `produce QUEUE -` per batch produce: the protocol's most messages
# per batch (one request each, sent one after the other, so that what was
# printed is exactly what was stored when a batch is refused).
STDIN_BATCH = 1000


# The environment variables the client commands read, as the client does
# (README, "Python client"): a comma-separated HOST:PORT list, the default
# of -s; the default of --timeout. The command line wins over both.
SERVERS_ENV = "QSERVER_SERVERS"
TIMEOUT_ENV = "QSERVER_TIMEOUT"

# --timeout without the option or QSERVER_TIMEOUT: the client's own default.
CLI_TIMEOUT_S = 5.0

# The client options' values when neither copy of an option was given
# (_client_option_parser: both copies leave a missing option out).
# `server` and `timeout` are filled from the environment first.
CLIENT_DEFAULTS: dict[str, Any] = {
    "json": False, "retry_for": CLI_RETRY_FOR_S, "token": None, "token_file": None,
    "tls": False, "tls_ca": None, "tls_cert": None, "tls_key": None,
    "tls_server_hostname": None}

# Where -s values given before the command collect; those after it collect
# in `server`, and _apply_client_defaults joins the two in order.
SERVERS_BEFORE = "servers_before"

DURATION_HELP = "30s, 5m, 2h, 1d, 1.5s, 250ms, 1h30m, or plain seconds"
WHEN_HELP = ("a duration from now (" + DURATION_HELP + "; a plain number of at least "
             "1000000000 is an absolute unix time), or an ISO 8601 time with Z or an "
             "offset (2026-11-25T08:00:00Z)")


def _client_option_parser(server_dest: str) -> argparse.ArgumentParser:
    """The client commands' own options, as a parent parser: added to the
    main parser (before the command) and to each client command's parser
    (after it). Every option defaults to SUPPRESS, so that a copy not
    given leaves no attribute and cannot overwrite, with its default, what
    the other copy was given (argparse copies a command's namespace over
    the main one); _apply_client_defaults fills in the rest."""
    p = argparse.ArgumentParser(add_help=False, argument_default=argparse.SUPPRESS)
    p.add_argument("-s", "--server", action="append", dest=server_dest, metavar="HOST:PORT",
                   help=f"a node to ask; repeat, or separate with commas, for several; or "
                        f"a qserver:// URL (default ${SERVERS_ENV}, else {DEFAULT_SERVER})")
    p.add_argument("--json", action="store_true", help="print JSON (for scripts)")
    p.add_argument("--timeout", type=_duration, metavar="DURATION",
                   help=f"how long a node may stay silent (default: a URL's timeout, "
                        f"${TIMEOUT_ENV} in seconds, else {CLI_TIMEOUT_S:g}s)")
    p.add_argument("--retry-for", type=_duration, metavar="DURATION",
                   help=f"how long to retry other nodes or wait for a master "
                        f"(default {CLI_RETRY_FOR_S:g}s)")
    _add_security_options(p)
    return p


def _add_client_commands(sub) -> None:
    common = _client_option_parser("server")
    produce = sub.add_parser("produce", parents=[common],
                             help="produce a message (DATA), or one per line of stdin (-)")
    produce.add_argument("queue")
    produce.add_argument("data", help="the message, or - to read one message per line "
                                      "from stdin (sent in batches of up to 1,000)")
    produce.add_argument("--delay", type=_when_arg, metavar="WHEN",
                         help=f"when it becomes ready: {WHEN_HELP}")
    produce.add_argument("--ttl", type=_when_arg, metavar="WHEN",
                         help="when it stops living (default: delay + 1h); the same forms")
    produce.add_argument("--retry", type=_duration, default=0, metavar="DURATION",
                         help="redeliver this long after each consume until confirmed "
                              "(default 0: at most once)")
    produce.add_argument("--priority", type=int, metavar="N",
                         help="0 to 2147483647, lower first (default 1024)")
    produce.add_argument("--dedup-id", metavar="ID",
                         help="stored once: a produce with the same ID within the queue's "
                              "dedup_window (default 300 s) stores nothing")
    consume = sub.add_parser("consume", parents=[common],
                             help="consume the next ready message(s)")
    consume.add_argument("queues", nargs="+", metavar="QUEUE",
                         help="a queue, or several: the first one that has a message")
    consume.add_argument("--count", type=int, metavar="N",
                         help="up to N messages, listed with their receipts")
    consume.add_argument("--wait", type=_duration, metavar="DURATION",
                         help="wait up to this long for a message (a long poll)")
    consume.add_argument("--lease", type=_duration, metavar="DURATION",
                         help="an unconfirmed delivery comes back after this long "
                              "(default: the message's retry)")
    consume.add_argument("--ack", action="store_true",
                         help="confirm each message, with its receipt, once printed")
    receipt_help = ("the receipt of the delivery (consume --count or --json prints it): "
                    "act on that delivery only")
    confirm = sub.add_parser("confirm", parents=[common], help="confirm a consumed message")
    confirm.add_argument("queue")
    confirm.add_argument("msg_id", type=int)
    confirm.add_argument("--receipt", metavar="R", help=receipt_help)
    nack = sub.add_parser("nack", parents=[common],
                          help="give a consumed message back, deliverable again after --delay")
    nack.add_argument("queue")
    nack.add_argument("msg_id", type=int)
    nack.add_argument("--receipt", metavar="R", help=receipt_help)
    nack.add_argument("--delay", type=_when_arg, metavar="WHEN",
                      help=f"when it is deliverable again (default now): {WHEN_HELP}")
    touch = sub.add_parser("touch", parents=[common],
                           help="extend the lease of a consumed message")
    touch.add_argument("queue")
    touch.add_argument("msg_id", type=int)
    touch.add_argument("--receipt", metavar="R", help=receipt_help)
    touch.add_argument("--lease", type=_duration, metavar="DURATION",
                       help="it comes back this long from now unless confirmed "
                            "(default: the message's retry)")
    show = sub.add_parser("show", parents=[common], help="a message's state, data and counts")
    show.add_argument("queue")
    show.add_argument("msg_id", type=int)
    peek = sub.add_parser("peek", parents=[common],
                          help="the next messages a consume would deliver (changes nothing)")
    peek.add_argument("queue")
    peek.add_argument("--count", type=int, default=1, metavar="N",
                      help="how many (default 1)")
    config = sub.add_parser("config", parents=[common],
                            help="a queue's settings; KEY=VALUE changes them")
    config.add_argument("queue")
    config.add_argument("settings", nargs="*", metavar="KEY=VALUE",
                        help="max_deliveries=N (0: unlimited), dead_letter=QUEUE (none: none), "
                             "max_size=N (0: the node's queue_size), dedup_window=S (0: off), "
                             "paused=none|in|out|all")
    pause = sub.add_parser("pause", parents=[common],
                           help="stop producers (in), consumers (out) or both (all) of a queue")
    pause.add_argument("queue")
    pause.add_argument("what", nargs="?", default="all", choices=("in", "out", "all"),
                       help="in: produce refused; out: nothing delivered; all (default): both")
    resume = sub.add_parser("resume", parents=[common], help="undo pause")
    resume.add_argument("queue")
    clear = sub.add_parser("clear", parents=[common],
                           help="remove every message of a queue (in flight included)")
    clear.add_argument("queue")
    monitor = sub.add_parser("monitor", parents=[common],
                             help="the master's view of the cluster and of a queue")
    monitor.add_argument("queue", nargs="?")
    listing = sub.add_parser("list", parents=[common], help="queues whose names contain PATTERN")
    listing.add_argument("pattern", nargs="?", default="")
    sub.add_parser("leader", parents=[common], help="the master's node id and address")
    sub.add_parser("status", parents=[common],
                   help="every node's address, role, vote_id, trans_id, commit_id and lag")
    sub.add_parser("health", parents=[common],
                   help="whether each node is ready for clients, and why not "
                        "(exit status 0 when all are)")
    drain = sub.add_parser("drain", parents=[common],
                           help="take the node out of client work (a master first hands "
                                "its role over)")
    drain.add_argument("--undo", action="store_true", help="take client work again")
    transfer = sub.add_parser("transfer-leader", parents=[common],
                              help="hand the master role to node NODE_ID")
    transfer.add_argument("node_id", type=int, metavar="NODE_ID")


def _add_security_options(parser: argparse.ArgumentParser) -> None:
    """The client commands' token and TLS options (nodes with <security>
    and <tls>)."""
    group = parser.add_argument_group("authentication and TLS")
    group.add_argument("--token", metavar="TOKEN",
                       help=f"client token, sent as action 0 (other users can see a command "
                            f"line: prefer --token-file or ${TOKEN_ENV})")
    group.add_argument("--token-file", metavar="FILE",
                       help="read the client token from FILE (its text, stripped)")
    group.add_argument("--tls", action="store_true",
                       help="speak TLS (implied by --tls-ca and --tls-cert)")
    group.add_argument("--tls-ca", metavar="FILE",
                       help="CA bundle (PEM) that signed the nodes' certificates "
                            "(default: the system's)")
    group.add_argument("--tls-cert", metavar="FILE",
                       help="client certificate (PEM), for nodes that require one")
    group.add_argument("--tls-key", metavar="FILE", help="the client certificate's key (PEM)")
    group.add_argument("--tls-server-hostname", metavar="NAME",
                       help="the name the nodes' certificates carry (default: the host dialed)")


# The environment variable the client commands take the token from when
# neither --token nor --token-file is given.
TOKEN_ENV = "QSERVER_TOKEN"


def _client_options(args) -> dict[str, Any]:
    """The `Client` keyword arguments of the token and TLS options: for
    every command that makes a client. Raises InvalidArgument."""
    token = args.token
    if args.token_file is not None:
        if token is not None:
            raise InvalidArgument("give --token or --token-file, not both")
        try:
            with open(args.token_file, encoding="utf-8") as f:
                token = f.read().strip()
        except (OSError, UnicodeDecodeError) as exc:
            problem = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
            raise InvalidArgument(f"--token-file {args.token_file}: {problem}") from None
        if not token:
            raise InvalidArgument(f"--token-file {args.token_file} is empty")
    if token is None:
        token = os.environ.get(TOKEN_ENV) or None
    return {"token": token, "tls": args.tls, "tls_ca": args.tls_ca, "tls_cert": args.tls_cert,
            "tls_key": args.tls_key, "tls_server_hostname": args.tls_server_hostname}


def _apply_client_defaults(args: argparse.Namespace, environ: Mapping[str, str]) -> None:
    """Fill in the client options neither copy was given (_client_option_parser).
    Sets `addresses`: the -s values, before the command then after it (each
    split at commas, or one qserver:// URL), else $QSERVER_SERVERS (the
    same forms), else DEFAULT_SERVER. A URL's settings (timeout, retry_for,
    token, tls_*; qservers:// for TLS) count where the option was not
    given; then `timeout` comes from $QSERVER_TIMEOUT (seconds, as the
    client reads it), and the rest from CLI_TIMEOUT_S and CLIENT_DEFAULTS.
    The URL's long_poll means nothing to these commands. Raises
    InvalidArgument naming the option or variable."""
    given = [*getattr(args, SERVERS_BEFORE, ()), *getattr(args, "server", ())]
    source = "-s"
    if not given and environ.get(SERVERS_ENV, "").strip():
        given, source = [environ[SERVERS_ENV]], f"${SERVERS_ENV}"
    target = _target(given or [DEFAULT_SERVER], source)
    args.addresses = target.addresses
    url = target.options
    for dest in ("timeout", "retry_for", "tls_ca", "tls_cert", "tls_key", "tls_server_hostname"):
        if not hasattr(args, dest) and dest in url:
            setattr(args, dest, url[dest])
    if "token" in url and not hasattr(args, "token") and not hasattr(args, "token_file"):
        args.token = url["token"]  # before $QSERVER_TOKEN (_client_options): more particular
    if url.get("tls"):
        args.tls = True
    if not hasattr(args, "timeout"):
        # Read as the client reads it (plain seconds): one value works for
        # both, where "30s" would break the programs that share it.
        text = environ.get(TIMEOUT_ENV, "").strip()
        args.timeout = CLI_TIMEOUT_S
        if text:
            try:
                args.timeout = float(text)
            except ValueError:
                args.timeout = math.nan
            if not math.isfinite(args.timeout) or args.timeout <= 0:
                raise InvalidArgument(f"${TIMEOUT_ENV}={text!r}: not a number of seconds > 0")
    for dest, value in CLIENT_DEFAULTS.items():
        if not hasattr(args, dest):
            setattr(args, dest, value)


def _target(values: list[str], source: str) -> Target:
    """The addresses, and a URL's settings, of -s or $QSERVER_SERVERS
    (`source`): HOST:PORT lists, or one qserver:// URL. Raises
    InvalidArgument naming `source` (never a URL's token)."""
    from .client.core import parse_target

    if any("://" in value for value in values):
        if len(values) > 1:
            raise InvalidArgument(f"{source}: a qserver:// URL names every node: give it alone")
        spec: str | list[str] = values[0].strip()
    else:
        spec = [item.strip() for value in values for item in value.split(",") if item.strip()]
        if not spec:
            raise InvalidArgument(f"{source}: no HOST:PORT in {', '.join(map(repr, values))}")
    try:
        return parse_target(spec)
    except InvalidArgument as exc:
        raise InvalidArgument(f"{source}: {exc}") from None


# -- durations and times -----------------------------------------------------------

# Seconds in a unit of a duration's text: 30s, 5m, 2h, 1d, 250ms, 1h30m.
_UNIT_S = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
_DURATION_PART = r"(\d+(?:\.\d*)?|\.\d+)(ms|s|m|h|d)"
_DURATION = re.compile(f"(?:{_DURATION_PART})+", re.ASCII)
# A value that starts with a date is read as an ISO 8601 time.
_ISO_DATE = re.compile(r"\d{4}-\d\d-\d\d", re.ASCII)
# The protocol's boundary (README, "Time and delivery"): delay and ttl
# below it are seconds from now, from it on absolute unix times. As
# qserver.client.core.ABSOLUTE_TIME_FROM, not imported: `run` does not load
# the client.
ABSOLUTE_TIME_FROM_S = 1_000_000_000


def parse_duration(text: str) -> float:
    """Seconds from a duration: a number with units (`30s`, `5m`, `2h`,
    `1d`, `1.5s`, `250ms`, `1h30m`: lower case, no sign) or a plain number
    of seconds (`90`, `1.5`, `-1`: as float() reads it, but finite).
    Raises ValueError saying what is accepted."""
    text = text.strip()
    if _DURATION.fullmatch(text):
        return sum(float(n) * _UNIT_S[unit]
                   for n, unit in re.findall(_DURATION_PART, text, re.ASCII))
    try:
        seconds = float(text)
    except ValueError:
        raise ValueError(f"{text!r} is not a duration ({DURATION_HELP})") from None
    if not math.isfinite(seconds):
        raise ValueError(f"{text!r} is not a finite number of seconds")
    return seconds


def parse_when(text: str) -> float | datetime.timedelta | datetime.datetime:
    """--delay and --ttl: a plain number as the protocol takes it (seconds
    from now below 1,000,000,000, an absolute unix time from there on); a
    duration with units, from now (a timedelta, which the client adds to
    its clock); or an ISO 8601 time, `2026-11-25T08:00:00Z` or with an
    offset (`+01:00`), as an aware datetime. A time without a zone is
    refused rather than guessed: read as local or as UTC, a guess would be
    hours wrong for someone. Raises ValueError."""
    text = text.strip()
    if _ISO_DATE.match(text):
        try:
            when = datetime.datetime.fromisoformat(text)
        except ValueError:
            raise ValueError(f"{text!r} is not an ISO 8601 time "
                             f"(2026-11-25T08:00:00Z, or +01:00 for an offset)") from None
        if when.tzinfo is None or when.utcoffset() is None:
            raise ValueError(f"{text!r} has no time zone: add Z for UTC or an offset "
                             f"such as +01:00")
        if when.timestamp() < ABSOLUTE_TIME_FROM_S:
            raise ValueError(f"{text!r} is before 2001-09-09T01:46:40Z, which the protocol "
                             f"cannot take as a time")
        return when
    if _DURATION.fullmatch(text):
        seconds = parse_duration(text)
        if seconds >= ABSOLUTE_TIME_FROM_S:
            raise ValueError(f"{text!r} is too far ahead (more than 31 years): "
                             f"give an ISO 8601 time")
        return datetime.timedelta(seconds=seconds)
    try:
        return parse_duration(text)
    except ValueError:
        raise ValueError(f"{text!r} is neither a duration ({DURATION_HELP}) nor an ISO "
                         f"8601 time (2026-11-25T08:00:00Z)") from None


def _duration(text: str) -> float:
    """argparse's type for a duration option (its error names the option)."""
    try:
        return parse_duration(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _when_arg(text: str) -> float | datetime.timedelta | datetime.datetime:
    """argparse's type for --delay and --ttl."""
    try:
        return parse_when(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


class _Failure(Exception):
    """A command's outcome that exits 1 with this one line on stderr (a show
    of a message that is not there)."""


def _client_main(args) -> int:
    from .client import Client

    try:
        _apply_client_defaults(args, os.environ)
        servers = args.addresses
        if args.command == "status":
            return _status(servers, args)
        if args.command == "health":
            return _health(servers, args)
        if args.command == "drain" and len(set(servers)) > 1:
            raise InvalidArgument("drain acts on one node: give -s once")
        with Client(servers, timeout=args.timeout, retry_for=args.retry_for,
                    **_client_options(args)) as client:
            result, text, *then = _COMMANDS[args.command](client, args)
            _emit(args, result, text)
            for step in then:  # what comes after the output (consume --ack)
                sys.stdout.flush()
                step()
    except InvalidArgument as exc:
        print(f"qserver: {exc}", file=sys.stderr)
        return 2
    except QServerClientError as exc:
        print(f"qserver: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    except _Failure as exc:
        print(f"qserver: {exc}", file=sys.stderr)
        return 1
    return 0


def _emit(args, result: object, text: str | None) -> None:
    """Print the result: JSON with --json, else `text` (None: printed
    already)."""
    if args.json:
        import orjson
        sys.stdout.write(orjson.dumps(result, option=orjson.OPT_APPEND_NEWLINE).decode())
    elif text is not None:
        print(text)


def _cmd_produce(client, args) -> tuple[object, str | None]:
    options = {"delay": args.delay, "ttl": args.ttl, "retry": args.retry,
               "priority": args.priority}
    if args.data == "-":
        if args.dedup_id is not None:
            raise InvalidArgument("--dedup-id names one message: not with DATA -")
        return _produce_stdin(client, args, options)
    if args.dedup_id is None:
        ids = client.produce_ids(args.queue, args.data, **options)
        result: dict[str, Any] = {"queue": args.queue, "msg_id": next(iter(ids.values())),
                                  "msg_ids": ids}
        return result, "\n".join(f"produced msg_id {i} in {q}" for q, i in ids.items())
    # The single produce, read whole: its answer says whether it was a
    # duplicate (`produce` and `produce_ids` give the ids only).
    from .client import produce_request
    from .client.core import server_error

    response = client.request(produce_request(args.queue, args.data, dedup_id=args.dedup_id,
                                              **options))
    if response.get("code") != 0:
        raise server_error(response)
    ids = response.get("msg_ids")
    if not isinstance(ids, dict):
        ids = {args.queue: response["msg_id"]}
    duplicate = response.get("duplicate") is True
    result = {"queue": args.queue, "msg_id": response["msg_id"], "msg_ids": ids,
              "duplicate": duplicate}
    verb = "duplicate of" if duplicate else "produced"
    tail = " (nothing stored)" if duplicate else ""
    return result, "\n".join(f"{verb} msg_id {i} in {q}{tail}" for q, i in ids.items())


def _produce_stdin(client, args, options: dict) -> tuple[object, None]:
    """`produce QUEUE -`: one batch produce per STDIN_BATCH lines; the ids
    printed as each batch is stored (one per line; for a virtual queue,
    QUEUE:ID of every message created)."""
    import itertools

    lines = (line[:-2] if line.endswith("\r\n") else line.rstrip("\n")
             for line in sys.stdin)
    ids: list = []
    while chunk := list(itertools.islice(lines, STDIN_BATCH)):
        try:
            got = client.produce_batch(args.queue, chunk, **options)
        except ServerError as exc:  # its index: of the whole input, not of this batch
            index = None if exc.index is None else len(ids) + exc.index
            raise type(exc)(exc.code, exc.reason, exc.response, index) from None
        ids.extend(got)
        if not args.json:
            for msg_id in got:
                print(" ".join(f"{q}:{i}" for q, i in msg_id.items())
                      if isinstance(msg_id, dict) else msg_id)
            sys.stdout.flush()
    return ids, None


def _cmd_pause(client, args) -> tuple[object, str]:
    config = client.pause(args.queue, args.what)
    what = {"in": "produce refused", "out": "nothing delivered",
            "all": "produce refused, nothing delivered"}[args.what]
    return config, f"paused {args.queue} ({args.what}: {what})"


def _cmd_resume(client, args) -> tuple[object, str]:
    return client.resume(args.queue), f"resumed {args.queue}"


def _cmd_clear(client, args) -> tuple[object, str]:
    cleared = client.clear(args.queue)
    return ({"queue": args.queue, "cleared": cleared},
            f"cleared {cleared} message{'s' if cleared != 1 else ''} from {args.queue}")


def _cmd_consume(client, args) -> tuple:
    names = args.queues
    where: dict[str, Any] = {"queue": names[0]} if len(names) == 1 else {"queues": names}
    got = client.consume(**where, count=args.count, wait=args.wait, lease=args.lease)
    if args.count is None:
        deliveries = [] if got is None else [got]
    else:
        deliveries = got
    then = [lambda: [d.confirm() for d in deliveries]] if args.ack else []
    nothing = f"no message ready in {', '.join(names)}"
    if args.count is not None:
        # The list form, as on the wire: every field of each delivery.
        result: object = [{"queue": d.queue, "msg_id": d.msg_id, "data": d.data,
                           "deliveries": d.deliveries, "receipt": d.receipt}
                          for d in deliveries]
        text = "\n".join(_table(["QUEUE", "MSG_ID", "DELIVERIES", "RECEIPT", "DATA"],
                                [[d.queue, d.msg_id, d.deliveries, d.receipt, d.data]
                                 for d in deliveries])) if deliveries else nothing
        return (result, text, *then)
    # Today's single form (scripts read it): queue, msg_id, data.
    if not deliveries:
        return ({"queue": names[0] if len(names) == 1 else None, "msg_id": None, "data": None},
                nothing, *then)
    msg = deliveries[0]
    where_text = f" in {msg.queue}" if len(names) > 1 else ""
    return ({"queue": msg.queue, "msg_id": msg.msg_id, "data": msg.data},
            f"msg_id {msg.msg_id}{where_text}: {msg.data}", *then)


def _cmd_confirm(client, args) -> tuple[object, str]:
    found = client.confirm(args.queue, args.msg_id, receipt=args.receipt)
    gone = "" if found else " (no such message: nothing was deleted)"
    return ({"queue": args.queue, "msg_id": args.msg_id, "confirmed": True, "found": found},
            f"confirmed msg_id {args.msg_id} in {args.queue}{gone}")


def _when(unix_s: float) -> str:
    """A unix time for people: local date and time, and how far from now."""
    import time

    if not unix_s:
        return "-"
    delta = unix_s - time.time()
    rel = f"in {delta:.1f} s" if delta >= 0 else f"{-delta:.1f} s ago"
    stamp = datetime.datetime.fromtimestamp(unix_s).isoformat(sep=" ", timespec="milliseconds")
    return f"{stamp} ({rel})"


def _cmd_nack(client, args) -> tuple[object, str]:
    result = client.nack(args.queue, args.msg_id, receipt=args.receipt, delay=args.delay)
    head = f"nacked msg_id {args.msg_id} in {args.queue}"
    if result.get("dead_lettered"):
        text = f"{head}: moved to the dead-letter queue {result.get('dead_letter')}"
    elif result.get("deleted"):
        text = f"{head}: deleted (no more deliveries, and no dead-letter queue)"
    else:
        text = f"{head}: deliverable again at {_when(result.get('ready_at', 0))}"
    return {"queue": args.queue, "msg_id": args.msg_id, **result}, text


def _cmd_touch(client, args) -> tuple[object, str]:
    retry_at = client.touch(args.queue, args.msg_id, receipt=args.receipt, lease=args.lease)
    text = (f"touched msg_id {args.msg_id} in {args.queue}: "
            f"comes back at {_when(retry_at)} unless confirmed")
    return {"queue": args.queue, "msg_id": args.msg_id, "retry_at": retry_at}, text


# Fields of show and peek that are unix times (0: none).
_TIME_FIELDS = ("ready_at", "ttl", "retry_at")


def _cmd_show(client, args) -> tuple[object, str]:
    message = client.show(args.queue, args.msg_id)
    if message is None:
        raise _Failure(f"no such message: msg_id {args.msg_id} in {args.queue}")
    result = {"queue": args.queue, **message}
    width = max(map(len, result))
    lines = [f"{key:<{width}}  {_when(value) if key in _TIME_FIELDS else value}"
             for key, value in result.items() if key != "data"]
    lines.append(f"{'data':<{width}}  {result.get('data')}")  # last: it may be long
    return result, "\n".join(lines)


def _cmd_peek(client, args) -> tuple[object, str]:
    messages = client.peek(args.queue, args.count)
    if not messages:
        return messages, f"no message ready in {args.queue}"
    return messages, "\n".join(_table(
        ["MSG_ID", "STATE", "PRIORITY", "DELIVERIES", "READY_AT", "DATA"],
        [[m.get("msg_id"), m.get("state"), m.get("priority"), m.get("deliveries"),
          _when(m.get("ready_at") or 0), m.get("data")] for m in messages]))


def _setting(text: str) -> tuple[str, object]:
    """KEY=VALUE as a setting: an integer as an integer, a decimal (1.5) as
    a float, an empty value as None, and for dead_letter "none" as None too
    (a queue called "none" cannot be named there from the command line);
    else the string."""
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise InvalidArgument(f"setting {text!r} is not KEY=VALUE")
    if value == "" or (key == "dead_letter" and value.lower() == "none"):
        return key, None
    if value.lstrip("-").isdigit() and value.isascii():
        return key, int(value)
    if re.fullmatch(r"-?(\d+\.\d*|\.\d+)", value, re.ASCII):
        return key, float(value)
    return key, value


def _cmd_config(client, args) -> tuple[object, str]:
    settings: dict[str, object] = {}
    for text in args.settings:
        key, value = _setting(text)
        if key in settings:
            raise InvalidArgument(f"setting {key} given twice")
        settings[key] = value
    config = (client.set_config(args.queue, **settings) if settings
              else client.config(args.queue))
    width = max(map(len, ["queue", *config]))
    lines = [f"{'queue':<{width}}  {args.queue}"]
    lines.extend(f"{key:<{width}}  {'none' if value is None else value}"
                 for key, value in config.items())
    return config, "\n".join(lines)


def _cmd_monitor(client, args) -> tuple[object, str]:
    info = client.monitor(args.queue)
    head = {"queue": args.queue} if args.queue is not None else {}
    return info, "\n".join(_field_lines({**head, **info}))


def _field_lines(info: dict) -> list[str]:
    """A JSON object for people: one `key  value` row per scalar; then a
    nested object's fields as `key.field` rows (`snapshot.taken  12`); then
    each list of objects as a table (`slaves:`; a slave's address where
    the master gives it). None prints as -, booleans as yes/no, a list of
    scalars joined with commas (- when empty)."""
    rows: list[tuple[str, str]] = []
    nested: list[tuple[str, str]] = []
    tables: list[str] = []

    def walk(prefix: str, obj: dict, out: list[tuple[str, str]]) -> None:
        for key, value in obj.items():
            name = f"{prefix}{key}"
            if isinstance(value, dict):
                walk(f"{name}.", value, nested)
            elif isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
                tables.append(f"{name}:")
                tables.extend("  " + line for line in _object_table(name, value))
            else:
                out.append((name, _cell(value)))

    walk("", info, rows)
    rows += nested
    width = max((len(name) for name, _ in rows), default=0)
    return [f"{name:<{width}}  {value}".rstrip() for name, value in rows] + tables


def _cell(value: object) -> str:
    """One value of a row or a table's cell, for people."""
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, list):
        return ", ".join(map(_cell, value)) or "-"
    if isinstance(value, dict):  # inside a table's row: key=value pairs
        return " ".join(f"{k}={_cell(v)}" for k, v in value.items()) or "-"
    return str(value)


def _object_table(name: str, items: list[dict]) -> list[str]:
    """A table of objects: their keys, in the order first seen, as the
    columns. The master's `slaves` begin with NODE and, where its entries
    carry host and port, ADDRESS."""
    columns = list(dict.fromkeys(key for item in items for key in item))
    cells = [{**item} for item in items]
    if name == "slaves":
        for item in cells:
            if "host" in item or "port" in item:
                item["address"] = _address_text(item.pop("host", None), item.pop("port", None))
        columns = [c for c in columns if c not in ("host", "port")]
        if any("address" in item for item in cells):
            columns.insert(1 if "node_id" in columns else 0, "address")
    headers = ["NODE" if c == "node_id" else c.upper() for c in columns]
    return _table(headers, [[_cell(item.get(c)) if c in item else None for c in columns]
                            for item in cells])


def _address_text(host: object, port: object) -> str | None:
    """host:port ([host]:port for an IPv6 literal); None if either is missing."""
    if host is None or port is None:
        return None
    host = str(host)
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _cmd_list(client, args) -> tuple[object, str]:
    queues = client.list(args.pattern)
    lines = _table(["QUEUE", "SIZE", "WAIT_STATUS"],
                   [[q["name"], q["size"], q["wait_status"]] for q in queues])
    lines.append(f"{len(queues)} queue{'s' if len(queues) != 1 else ''}")
    return queues, "\n".join(lines)


def _cmd_leader(client, args) -> tuple[object, str]:
    leader = client.leader()
    return leader, (f"master: node {leader['leader_node_id']} at "
                    f"{leader['leader_host']}:{leader['leader_port']}")


def _cmd_drain(client, args) -> tuple[object, str]:
    where = _address_text(*client.address)
    try:
        response = client.drain(undo=args.undo)
    except ServerError as exc:
        if exc.response.get("draining"):  # drained, but the master role did not move
            raise _Failure(f"{where} is draining, but is still master: {exc.reason}") from None
        raise
    if not response.get("draining"):
        return response, f"{where} takes client work again"
    leader = response.get("leader_node_id")
    return response, (f"{where} is draining; master: node {leader}" if leader
                      else f"{where} is draining; no master known")


def _cmd_transfer_leader(client, args) -> tuple[object, str]:
    leader = client.transfer_leader(args.node_id)
    return {"leader_node_id": leader}, f"master: node {leader}"


_COMMANDS = {"produce": _cmd_produce, "consume": _cmd_consume, "confirm": _cmd_confirm,
             "nack": _cmd_nack, "touch": _cmd_touch, "show": _cmd_show, "peek": _cmd_peek,
             "config": _cmd_config, "pause": _cmd_pause, "resume": _cmd_resume,
             "clear": _cmd_clear, "monitor": _cmd_monitor, "list": _cmd_list,
             "leader": _cmd_leader, "drain": _cmd_drain,
             "transfer-leader": _cmd_transfer_leader}


def _table(headers: list[str], rows: list[list]) -> list[str]:
    """Left-aligned columns, two spaces apart."""
    cells = [headers] + [["-" if v is None else str(v) for v in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    return ["  ".join(v.ljust(w) for v, w in zip(row, widths)).rstrip() for row in cells]


STATUS_FIELDS = ("node_id", "role", "leader_node_id", "vote_id", "trans_id", "commit_id")


def _status(servers: list[tuple[str, int]], args) -> int:
    """Ask every given node for its own state (104). With one node given,
    also the master it names (8) and every slave the master lists with an
    address (its `slaves` entries carry host and port where the engine
    knows them); the slaves it lists without one get a row from its view,
    "(not asked)". A row's address is where clients reach the node, from
    its own answer (host and port; `asked`: the address dialed, shown
    after "via" where it differs); a node that did not answer keeps the
    address it was asked at, and one that answers nothing makes the exit
    status 1. The lag is the master's view."""
    from .client import Client
    from .client.core import server_error
    from .errors import Unauthorized

    options = _client_options(args)

    def ask(address: tuple[str, int], request: dict) -> dict | None:
        try:
            with Client([address], timeout=args.timeout, retry_for=0, **options) as c:
                response = c.request(request)
        except (Unauthorized, InvalidArgument):
            raise  # not "down" (a refused token, a TLS file): the command fails and says why
        except QServerClientError:
            return None
        if response.get("code") == 0:
            return response
        error = server_error(response)
        if isinstance(error, Unauthorized):  # a refused token: not "down" either
            raise error
        return None

    views: dict[tuple[str, int], dict | None] = {}

    def visit(address: tuple[str, int]) -> None:
        if address not in views:
            views[address] = ask(address, {"action": 104})

    given = list(dict.fromkeys(servers))
    for address in given:
        visit(address)
    learn = len(given) == 1  # one node given: the others are learnt from the master
    if learn:
        leader = ask(given[0], {"action": 8}) or {}
        host, port = leader.get("leader_host"), leader.get("leader_port")
        if isinstance(host, str) and isinstance(port, int):
            visit((host, port))
        master = _master_view(views)
        if master is not None:
            reached = {v.get("node_id") for v in views.values() if v is not None}
            for slave in master.get("slaves", []):
                if (slave.get("node_id") not in reached and isinstance(slave.get("host"), str)
                        and isinstance(slave.get("port"), int)):
                    visit((slave["host"], slave["port"]))
    master = _master_view(views)

    rows: list[dict[str, Any]] = []
    reached_ids: set[object] = set()
    for address, view in views.items():
        asked = _address_text(*address)
        if view is not None:
            if view.get("node_id") in reached_ids:  # the same node under two addresses
                continue
            reached_ids.add(view.get("node_id"))
        row: dict[str, Any] = {
            "address": (view and _address_text(view.get("host"), view.get("port"))) or asked,
            "asked": asked, "reachable": view is not None}
        row.update({key: (view or {}).get(key) for key in STATUS_FIELDS})
        if view is None:
            row["role"] = "down"
        rows.append(row)
    lag_by_node = {}
    if master is not None:
        lag_by_node[master["node_id"]] = 0
        silent = {row["address"]: row for row in rows if row["reachable"] is False}
        for slave in master.get("slaves", []):
            lag_by_node[slave["node_id"]] = slave.get("lag")
            if slave["node_id"] in reached_ids:
                continue
            listed = _address_text(slave.get("host"), slave.get("port"))
            if listed in silent:  # asked and silent: the master says which node it is
                silent[listed]["node_id"] = slave["node_id"]
            elif learn and listed is None:
                # Only when one node was given: with several, a row here
                # would duplicate a given node that did not answer.
                rows.append({"address": None, "asked": None, "reachable": None,
                             "node_id": slave["node_id"],
                             "role": "slave" if slave.get("connected") else "disconnected",
                             "leader_node_id": master["node_id"], "vote_id": None,
                             "trans_id": None, "commit_id": None})
    newest = max((row["trans_id"] for row in rows if row["trans_id"] is not None), default=None)
    for row in rows:
        lag = lag_by_node.get(row["node_id"])
        if lag is None and row["trans_id"] is not None and newest is not None:
            lag = newest - row["trans_id"]  # no master view: behind the most advanced node
        row["lag"] = lag

    def where(row: dict) -> str:
        if row["address"] is None:
            return "(not asked)"
        if row["asked"] not in (None, row["address"]):
            return f"{row['address']} via {row['asked']}"
        return row["address"]

    text = "\n".join(_table(
        ["NODE", "ADDRESS", "ROLE", "LEADER", "VOTE_ID", "TRANS_ID", "COMMIT_ID", "LAG"],
        [[r["node_id"], where(r), r["role"], r["leader_node_id"],
          r["vote_id"], r["trans_id"], r["commit_id"], r["lag"]] for r in rows]))
    _emit(args, rows, text)
    down = [row["asked"] for row in rows if row["reachable"] is False]
    if down:
        print(f"qserver: no answer from {', '.join(down)}", file=sys.stderr)
        return 1
    return 0


def _master_view(views: dict[tuple[str, int], dict | None]) -> dict | None:
    """The master's own view among the answers; with several (a stale one
    after a partition), the one of the highest vote_id."""
    masters = [v for v in views.values() if v is not None and v.get("role") == "master"]
    return max(masters, key=lambda v: v.get("vote_id", 0)) if masters else None


HEALTH_FIELDS = ("role", "leader_node_id", "applied_id", "commit_id", "master_commit_id")


def _health(servers: list[tuple[str, int]], args) -> int:
    """Ask every given node whether it is ready for clients (109): 0 when
    every one is, 1 when one is not or does not answer."""
    from .client import Client
    from .errors import Unauthorized

    options = _client_options(args)
    results: list[dict[str, Any]] = []
    lines: list[str] = []
    for host, port in dict.fromkeys(servers):
        address = f"{host}:{port}"
        try:
            with Client([(host, port)], timeout=args.timeout, retry_for=args.retry_for,
                        **options) as c:
                health = c.health()
        except (Unauthorized, InvalidArgument):
            raise  # not "no answer" (a refused token, a TLS file): as _status
        except QServerClientError as exc:
            health = {"ready": False, "reasons": [f"no answer: {type(exc).__name__}: {exc}"]}
        health = {"address": address, **health}
        results.append(health)
        node = f"node {health['node_id']} ({address})" if "node_id" in health else address
        lines.append(f"{node}: {'ready' if health.get('ready') else 'NOT READY'}")
        lines.extend(f"  - {reason}" for reason in health.get("reasons") or ())
        lines.extend(f"  {key:<16} {health[key]}" for key in HEALTH_FIELDS if key in health)
    _emit(args, results[0] if len(results) == 1 else results, "\n".join(lines))
    return 0 if all(r.get("ready") is True for r in results) else 1


def _halt(status: int) -> None:
    """End the process at once (Node.fatal): no drain, no cleanup that
    could act on broken state. What the storage wrote is in the files
    already; the log lines are flushed first."""
    logging.shutdown()
    os._exit(status)


# Open-file limit to ask for at start, within the hard limit: every client
# connection is a descriptor, and the usual soft limit of 1024 would refuse
# the 1,000th idle client.
WANTED_OPEN_FILES = 65536
# Below this many after raising, the start-up log warns.
FEW_OPEN_FILES = 4096


def _raise_open_file_limit() -> None:
    """Raise RLIMIT_NOFILE's soft limit towards the hard one, and log it."""
    try:
        import resource
    except ImportError:  # not a POSIX system
        return
    qlog = logging.getLogger("qserver")
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = WANTED_OPEN_FILES if hard == resource.RLIM_INFINITY else min(hard, WANTED_OPEN_FILES)
    if soft != resource.RLIM_INFINITY and soft < want:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
        except (ValueError, OSError) as exc:
            qlog.warning("open-file limit %d (hard %d): could not raise it: %s", soft, hard, exc)
            return
        qlog.info("raised the open-file limit from %d to %d (hard limit %s)", soft, want,
                  "unlimited" if hard == resource.RLIM_INFINITY else hard)
        soft = want
    if soft != resource.RLIM_INFINITY and soft < FEW_OPEN_FILES:
        qlog.warning("open-file limit %d: about that many client connections at most "
                     "(raise the hard limit, e.g. LimitNOFILE= or ulimit -Hn)", soft)


async def _run(config: Config) -> int:
    from .node import Node

    _raise_open_file_limit()
    try:
        node = Node(config)
    except ConfigError as exc:  # a TLS file of the peer links that cannot be used
        print(f"qserver: config error: {exc}", file=sys.stderr)
        return 2
    except StorageError as exc:
        logging.getLogger("qserver").error("cannot recover from storage: %s", exc)
        print(f"qserver: storage error: {exc} (see README: Storage, to re-sync this node)",
              file=sys.stderr)
        return 1
    try:
        await node.start()
    except ConfigError as exc:  # a TLS file that cannot be used (qserver.tls)
        print(f"qserver: config error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        logging.getLogger("qserver").error("cannot listen: %s", exc.strerror or exc)
        return 1
    node.halt = _halt
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
    http = node.http_address  # <http port="0">: the port bound shows here
    print(f"qserver node {config.node_id} ready on {node.address[0]}:{node.address[1]}"
          + (f" (http {http[0]}:{http[1]})" if http is not None else ""), flush=True)
    await node.serve()
    return node.exit_status


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    if args.command in CLIENT_COMMANDS:
        return _client_main(args)
    if args.command == "local-cluster":
        return _local_cluster(args.configs, args.log_format)
    if args.command == "run":
        try:
            config = load_config(args.config) if args.config else Config.default()
        except ConfigError as exc:
            print(f"qserver: config error: {exc}", file=sys.stderr)
            return 2
        level = config.log_level
        if args.log_level:
            asked = log_level(args.log_level)
            if asked is None:
                print(f"qserver: bad --log-level {args.log_level!r}", file=sys.stderr)
                return 2
            level = asked
        configure_logging(args.log_format, level, node_id=config.node_id,
                          prefix=config.log_prefix)
        # A fatal signal prints the Python stack before the process dies: a
        # SIGBUS is how a disk error reaches a write into the log's mapping
        # (storage.disk, "Writing").
        faulthandler.enable()
        try:
            import uvloop
            return uvloop.run(_run(config))
        except ImportError:  # uvloop is a dependency; this is for odd platforms
            return asyncio.run(_run(config))
    return 2


if __name__ == "__main__":
    sys.exit(main())
