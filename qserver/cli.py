"""The `qserver` command line.

    qserver run [--config FILE] [--log-level LEVEL] [--log-format text|json]
    qserver local-cluster [--log-format text|json] [CONFIG ...]

Exit status: 0 after an orderly shutdown (SIGINT or SIGTERM), 2 for a bad
configuration or usage, 1 when the node cannot start (the port is taken)
or stopped on a fatal error (a broken invariant, a bug, a failed write or
fsync: one CRITICAL log line names it, and the process ends at once).
A second SIGINT/SIGTERM during shutdown forces the exit.

Client commands, against any node (`-s HOST:PORT`, repeatable; default
127.0.0.1:1111), through `qserver.client.Client`:

    qserver produce QUEUE DATA [--delay S] [--ttl S] [--retry S] [--priority N] [--dedup-id ID]
    qserver produce QUEUE - [--delay S] [--ttl S] [--retry S] [--priority N]
    qserver consume QUEUE [QUEUE ...] [--count N] [--wait S] [--lease S] [--ack]
    qserver confirm QUEUE MSG_ID [--receipt R]
    qserver nack QUEUE MSG_ID [--receipt R] [--delay S]
    qserver touch QUEUE MSG_ID [--receipt R] [--lease S]
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

Output is for people by default, JSON with `--json`. Exit status: 0 on
success (an empty consume or peek included), 1 on a server or connection
error (one line on stderr: a stale receipt, a message not in flight, a show
of a message that is not there), 2 for bad usage. `status` asks every given
node for its own view (action 104) and exits 1 if one of them does not
answer. `health` asks every given node whether it is ready for clients
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
`--receipt` (use `--count 1` for one message and its receipt). `--wait S`
is a long poll, `--lease S` the seconds before an unconfirmed delivery comes
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
import logging
import os
import re
import signal
import sys
from typing import Any

from .config import Config, load_config, log_level
from .errors import ConfigError, InvalidArgument, QServerClientError, ServerError
from .logformat import LOG_FORMATS, configure_logging
from .storage import StorageError

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="qserver", description="qserver: a replicated message queue")
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


def _add_client_commands(sub) -> None:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("-s", "--server", action="append", metavar="HOST:PORT",
                        help=f"a node to ask; repeat for several (default {DEFAULT_SERVER})")
    common.add_argument("--json", action="store_true", help="print JSON (for scripts)")
    common.add_argument("--timeout", type=float, default=5.0, metavar="S",
                        help="seconds a node may stay silent (default 5)")
    common.add_argument("--retry-for", type=float, default=CLI_RETRY_FOR_S, metavar="S",
                        help=f"seconds to retry other nodes or wait for a master "
                             f"(default {CLI_RETRY_FOR_S:g})")
    _add_security_options(common)
    produce = sub.add_parser("produce", parents=[common],
                             help="produce a message (DATA), or one per line of stdin (-)")
    produce.add_argument("queue")
    produce.add_argument("data", help="the message, or - to read one message per line "
                                      "from stdin (sent in batches of up to 1,000)")
    produce.add_argument("--delay", type=float, metavar="S",
                         help="seconds from now (or an absolute unix time) before it is ready")
    produce.add_argument("--ttl", type=float, metavar="S",
                         help="seconds from now (or an absolute unix time) it lives")
    produce.add_argument("--retry", type=float, default=0, metavar="S",
                         help="redeliver S seconds after each consume until confirmed "
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
    consume.add_argument("--wait", type=float, metavar="S",
                         help="wait up to S seconds for a message (a long poll)")
    consume.add_argument("--lease", type=float, metavar="S",
                         help="an unconfirmed delivery comes back after S seconds "
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
    nack.add_argument("--delay", type=float, metavar="S",
                      help="seconds from now (or an absolute unix time) before it is "
                           "deliverable again (default 0)")
    touch = sub.add_parser("touch", parents=[common],
                           help="extend the lease of a consumed message")
    touch.add_argument("queue")
    touch.add_argument("msg_id", type=int)
    touch.add_argument("--receipt", metavar="R", help=receipt_help)
    touch.add_argument("--lease", type=float, metavar="S",
                       help="it comes back S seconds from now unless confirmed "
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
                   help="every node's role, vote_id, trans_id, commit_id and lag")
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


class _Failure(Exception):
    """A command's outcome that exits 1 with this one line on stderr (a show
    of a message that is not there)."""


def _client_main(args) -> int:
    from .client import Client, parse_hosts

    try:
        servers = parse_hosts(args.server or [DEFAULT_SERVER])
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
    import datetime
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
    slaves = info.get("slaves")
    width = max(map(len, info), default=0)
    lines = [f"{key:<{width}}  {value}" for key, value in info.items() if key != "slaves"]
    if args.queue is not None:
        lines.insert(0, f"{'queue':<{width}}  {args.queue}")
    if slaves:
        lines.append("slaves:")
        lines.extend("  " + line for line in _table(
            ["NODE", "MATCH_ID", "LAG", "CONNECTED"],
            [[s.get("node_id"), s.get("match_id"), s.get("lag"),
              "yes" if s.get("connected") else "no"] for s in slaves]))
    return info, "\n".join(lines)


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
    from .client.core import server_error

    response = client.request({"action": 108, "drain": not args.undo})
    where = _describe_node(client)
    if response.get("code") != 0:
        error = server_error(response)
        if response.get("draining"):  # drained, but the master role did not move
            raise _Failure(f"{where} is draining, but is still master: {error.reason}")
        raise error
    if not response.get("draining"):
        return response, f"{where} takes client work again"
    leader = response.get("leader_node_id")
    return response, (f"{where} is draining; master: node {leader}" if leader
                      else f"{where} is draining; no master known")


def _cmd_transfer_leader(client, args) -> tuple[object, str]:
    leader = client.transfer_leader(args.node_id)
    return {"leader_node_id": leader}, f"master: node {leader}"


def _describe_node(client) -> str:
    host, port = client.address
    return f"{host}:{port}"


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
    """Ask every node for its own state (104); with one node given, also
    the master it names (8). The master's `slaves` list adds the lag of each
    node, and the nodes it knows that were not asked (without an address:
    the master does not report slaves' client addresses)."""
    from .client import Client
    from .client.core import server_error
    from .errors import Unauthorized

    options = _client_options(args)

    def ask(address: tuple[str, int], request: dict) -> dict | None:
        try:
            with Client([address], timeout=args.timeout, retry_for=0, **options) as c:
                response = c.request(request)
        except Unauthorized:
            raise  # not "down": the command fails and says why
        except QServerClientError:
            return None
        if response.get("code") == 0:
            return response
        error = server_error(response)
        if isinstance(error, Unauthorized):  # a refused token: not "down" either
            raise error
        return None

    addresses = list(dict.fromkeys(servers))
    views = {address: ask(address, {"action": 104}) for address in addresses}
    if len(addresses) == 1:
        leader = ask(addresses[0], {"action": 8})
        if leader is not None:
            leader_address = (leader["leader_host"], leader["leader_port"])
            if leader_address not in views:
                addresses.append(leader_address)
                views[leader_address] = ask(leader_address, {"action": 104})
    rows: list[dict[str, Any]] = []
    for address in addresses:
        view = views[address]
        row: dict[str, Any] = {"address": f"{address[0]}:{address[1]}",
                               "reachable": view is not None}
        row.update({key: (view or {}).get(key) for key in STATUS_FIELDS})
        if view is None:
            row["role"] = "down"
        rows.append(row)
    masters = [v for a in addresses if (v := views[a]) and v.get("role") == "master"]
    # The master's own view; with several (a stale one after a partition),
    # the one of the highest vote_id.
    master = max(masters, key=lambda v: v.get("vote_id", 0)) if masters else None
    reached = {row["node_id"] for row in rows if row["node_id"] is not None}
    lag_by_node = {}
    if master is not None:
        lag_by_node[master["node_id"]] = 0
        for slave in master.get("slaves", []):
            lag_by_node[slave["node_id"]] = slave.get("lag")
            # Only when one node was given: the others' rows would be
            # duplicates of the given nodes that did not answer.
            if len(servers) == 1 and slave["node_id"] not in reached:
                rows.append({"address": None, "reachable": None, "node_id": slave["node_id"],
                             "role": "slave" if slave.get("connected") else "disconnected",
                             "leader_node_id": master["node_id"], "vote_id": None,
                             "trans_id": None, "commit_id": None})
    newest = max((row["trans_id"] for row in rows if row["trans_id"] is not None), default=None)
    for row in rows:
        lag = lag_by_node.get(row["node_id"])
        if lag is None and row["trans_id"] is not None and newest is not None:
            lag = newest - row["trans_id"]  # no master view: behind the most advanced node
        row["lag"] = lag
    text = "\n".join(_table(
        ["NODE", "ADDRESS", "ROLE", "LEADER", "VOTE_ID", "TRANS_ID", "COMMIT_ID", "LAG"],
        [[r["node_id"], r["address"] or "(not given)", r["role"], r["leader_node_id"],
          r["vote_id"], r["trans_id"], r["commit_id"], r["lag"]] for r in rows]))
    _emit(args, rows, text)
    down = [row["address"] for row in rows if row["reachable"] is False]
    if down:
        print(f"qserver: no answer from {', '.join(down)}", file=sys.stderr)
        return 1
    return 0


HEALTH_FIELDS = ("role", "leader_node_id", "applied_id", "commit_id", "master_commit_id")


def _health(servers: list[tuple[str, int]], args) -> int:
    """Ask every given node whether it is ready for clients (109): 0 when
    every one is, 1 when one is not or does not answer."""
    from .client import Client

    options = _client_options(args)
    results: list[dict[str, Any]] = []
    lines: list[str] = []
    for host, port in dict.fromkeys(servers):
        address = f"{host}:{port}"
        try:
            with Client([(host, port)], timeout=args.timeout, retry_for=args.retry_for,
                        **options) as c:
                health = c.health()
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
    args = _parser().parse_args(argv)
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
        try:
            import uvloop
            return uvloop.run(_run(config))
        except ImportError:  # uvloop is a dependency; this is for odd platforms
            return asyncio.run(_run(config))
    return 2


if __name__ == "__main__":
    sys.exit(main())
