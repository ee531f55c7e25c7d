"""Configuration: queue_server's XML format (and its JSON format), validated
into one frozen `Config`.

Every setting has a default; a single node needs only `<node_info>`, and
`Config.default()` (no file at all) is one node on 127.0.0.1:1111. Every
error names the file, the element and what is wrong (`ConfigError`).

XML elements (README, Configuration; cluster.xml.example documents each):

    <log prefix="qserver" level="5"/>
    <node_info node_type="10" node_id="1" host="127.0.0.1" port="1111"/>
    <queue_config queue_size="..." log_size="..." sync_rate="..."/>
    <cluster secret="..."><node id="1" host="127.0.0.1" port="1101"/>...</cluster>
    <virtual_queue name="v"><queue name="a"/><queue name="b"/></virtual_queue>
    <queue name="a" max_size="..." max_deliveries="..." dead_letter="..." dedup_window="..."/>
    <replication engine="native|raft" mode="quorum|async" forward_request="1|0"/>
    <storage dir="PATH" fsync="always|batch|off"/>
    <limits max_request_size="BYTES" max_wait="SECONDS" max_ready_lag="ENTRIES"/>
    <http host="127.0.0.1" port="1121" per_queue="1"/>
    <security client_token="..." client_token_file="PATH">
        <token name="producer" token="..." token_file="PATH" actions="produce,monitor"/>
    </security>
    <tls cert="PATH" key="PATH" ca="PATH" client_cert="none|optional|required"
         udp="0|1" peers="0|1"/>

`<node_info advertise_host>` is the address clients are sent to (redirects,
`leader_host`, status); it defaults to `host`, and a cluster node that binds
every address (0.0.0.0, ::) must give it. `<cluster secret_file>` and the
`*_file` attributes of `<security>` read a secret from a file (its text,
stripped); a relative path is taken from the configuration file's directory.

A top-level `<queue>` (repeatable; not the `<queue>` members inside a
`<virtual_queue>`) gives one real queue static defaults of its settings;
a value set at run time with config (5) wins over them. Only the attributes
given are kept (`Config.queue_defaults`), so an absent one stays the node's
default.
"""

from __future__ import annotations

import enum
import json
import logging
import os
import re
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from typing import Any, Literal, overload

from .errors import ConfigError
from .wire.codec import DEFAULT_MAX_REQUEST_SIZE, MAX_UDP_PAYLOAD
from .wire.requests import MAX_DELIVERIES, MAX_QUEUE_NAME

__all__ = [
    "Config",
    "PeerConfig",
    "Engine",
    "Mode",
    "Fsync",
    "ClientToken",
    "ClientCert",
    "ACTION_NAMES",
    "load_config",
    "parse_xml",
    "parse_json",
    "log_level",
]

# queue_server's example values where it had them; queue_size is larger
# because a production queue should not refuse work at 10,000 messages.
DEFAULT_QUEUE_SIZE = 1_000_000
DEFAULT_LOG_SIZE = 100_000
DEFAULT_SYNC_RATE = 3_000
DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 1111


# Smallest useful request limit: room for a request with a little data.
MIN_REQUEST_SIZE = 256
# Largest: 64 MiB keeps one client from making the node allocate gigabytes.
MAX_REQUEST_SIZE = 64 * 1024 * 1024

# A long poll (consume `wait`) waits at most this long by default: SQS
# allows 20 s, and 30 s stays below the idle timeouts of common proxies.
DEFAULT_MAX_WAIT_S = 30
# ...and at most this, whatever the configuration says: a parked consume
# holds a connection and a slave's forward; an hour is plenty.
MAX_WAIT_S = 3600

# <queue max_size>: the same bound as <queue_config queue_size> (a count of
# messages, far beyond what memory holds, only to keep the number sane).
MAX_QUEUE_MAX_SIZE = 2**40
# <queue dedup_window>: seconds, at most 7 days, as config (5) allows (a
# longer window would keep every dedup id of a busy queue for too long).
MAX_DEDUP_WINDOW_S = 604_800


class Engine(enum.Enum):
    NATIVE = "native"
    RAFT = "raft"


class Mode(enum.Enum):
    QUORUM = "quorum"
    ASYNC = "async"


class Fsync(enum.Enum):
    ALWAYS = "always"
    BATCH = "batch"
    OFF = "off"


# fsync=batch, both engines (and a native master whose slaves make the
# majority): how long written records wait at most before their fsync
# starts ("batch within a few milliseconds": README, Storage).
BATCH_SYNC_MS = 5


@dataclass(frozen=True, slots=True, kw_only=True)
class PeerConfig:
    node_id: int
    host: str
    port: int  # internal (node-to-node) port
    # Where the other nodes connect to reach this node, when that is not
    # where it listens (a proxy, NAT or tunnel in between): its internal
    # port, and its raft port (host:port + RAFT_PORT_OFFSET otherwise). The
    # node keeps its identity (raft names a node by host:port + offset);
    # only the address dialed changes. Ignored on a node's own entry.
    dial: tuple[str, int] | None = None
    raft_dial: tuple[str, int] | None = None

    @property
    def dial_address(self) -> tuple[str, int]:
        """The address to connect to for this node's internal port."""
        return self.dial or (self.host, self.port)


class ClientCert(enum.Enum):
    """Whether the client TLS port asks clients for a certificate."""
    NONE = "none"
    OPTIONAL = "optional"
    REQUIRED = "required"


# Action names a token's `actions` may list (numbers are accepted too).
# monitor and list cover their node-local forms (104, 107). auth (0) needs
# no permission: it is how a connection presents its token.
ACTION_NAMES: dict[str, tuple[int, ...]] = {
    "produce": (1,), "consume": (2,), "confirm": (3,), "monitor": (4, 104),
    "config": (5,), "clear": (6,), "list": (7, 107), "leader": (8,), "nack": (9,),
    "touch": (10,), "show": (11,), "peek": (12,), "transfer_leader": (20,),
    "drain": (108,), "health": (109,),
}
# Shorthands: what a consumer, a read-only monitor and an operator need.
_ACTION_GROUPS: dict[str, tuple[str, ...]] = {
    "consumer": ("consume", "confirm", "nack", "touch"),
    "read": ("monitor", "list", "leader", "show", "peek", "health"),
    "admin": ("config", "clear", "transfer_leader", "drain"),
}
ALL_ACTIONS = frozenset(a for actions in ACTION_NAMES.values() for a in actions)
# Tokens shorter than this are refused: a client token guards the whole
# port, and a short one is guessed online.
MIN_TOKEN_LENGTH = 16
# The default bound of /readyz and action 109: a slave more than this many
# entries behind the master's commit is not ready.
DEFAULT_MAX_READY_LAG = 1000


@dataclass(frozen=True, slots=True, kw_only=True)
class ClientToken:
    """One client token of <security>: its name (for logs and metrics), the
    secret text, and the actions it allows."""

    name: str
    token: str = field(repr=False)
    actions: frozenset[int] = ALL_ACTIONS

    def allows(self, action: object) -> bool:
        return action in self.actions


@dataclass(frozen=True, slots=True, kw_only=True)
class Config:
    """Every setting of one node, validated."""

    source: str = "<default>"  # the file it came from, for messages
    log_prefix: str = "qserver"
    log_level: int = logging.INFO
    node_type: int = 10
    node_id: int = 1
    host: str = DEFAULT_HOST  # client port (TCP and UDP) binds here
    port: int = DEFAULT_PORT
    # What clients are told to connect to (redirects, leader_host, status);
    # None: `host`. See `client_host`.
    advertise_host: str | None = None
    queue_size: int = DEFAULT_QUEUE_SIZE
    log_size: int = DEFAULT_LOG_SIZE
    sync_rate: int = DEFAULT_SYNC_RATE
    peers: tuple[PeerConfig, ...] = ()  # every cluster node, this one included
    secret: str | None = None
    virtual_queues: dict[str, tuple[str, ...]] = field(default_factory=dict)
    # Top-level <queue> elements: real queue name -> only the settings given,
    # among max_size (int >= 1), max_deliveries (int), dead_letter (str) and
    # dedup_window_ms (int). Never names a virtual queue.
    queue_defaults: dict[str, dict[str, object]] = field(default_factory=dict)
    engine: Engine = Engine.NATIVE
    mode: Mode = Mode.QUORUM
    forward_request: bool = True
    storage_dir: str | None = None  # None: keep everything in memory
    fsync: Fsync = Fsync.BATCH
    max_request_size: int = DEFAULT_MAX_REQUEST_SIZE
    max_wait_s: int = DEFAULT_MAX_WAIT_S  # the longest long poll (consume `wait`)
    max_ready_lag: int = DEFAULT_MAX_READY_LAG  # entries behind the commit, still ready
    # <http>: metrics and probes; None: no HTTP port.
    http_host: str = DEFAULT_HOST
    http_port: int | None = None
    metrics_per_queue: bool = True  # per-queue series (off for very many queues)
    # <security>: with tokens, every client request must be authenticated.
    client_tokens: tuple[ClientToken, ...] = ()
    # <tls>: the client TCP port speaks TLS when tls_cert is set.
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_ca: str | None = None  # CA bundle for client certificates (and peers)
    tls_client_cert: ClientCert = ClientCert.NONE
    tls_peers: bool = False  # the internal links use TLS too
    # The client UDP port: on unless TLS is on (UDP would carry in the clear
    # what TLS protects) and <tls udp="1"> does not turn it back on.
    udp: bool = True

    @classmethod
    def default(cls) -> Config:
        """One node on 127.0.0.1:1111, everything else at its default."""
        return cls()

    @property
    def max_udp_request_size(self) -> int:
        return min(self.max_request_size, MAX_UDP_PAYLOAD)

    @property
    def client_host(self) -> str:
        """The host clients are given for this node: advertise_host, else host."""
        return self.advertise_host or self.host

    @property
    def auth_required(self) -> bool:
        return bool(self.client_tokens)

    @property
    def tls(self) -> bool:
        return self.tls_cert is not None


# queue_server's log levels: 0..7 from least to most verbose (syslog-like,
# 5 = notice in its examples); we map them onto Python's.
_NUMERIC_LEVELS = {0: logging.CRITICAL, 1: logging.CRITICAL, 2: logging.CRITICAL,
                   3: logging.ERROR, 4: logging.WARNING, 5: logging.INFO,
                   6: logging.INFO, 7: logging.DEBUG}
_NAMED_LEVELS = {"critical": logging.CRITICAL, "error": logging.ERROR,
                 "warning": logging.WARNING, "warn": logging.WARNING,
                 "info": logging.INFO, "debug": logging.DEBUG}


def log_level(value: str) -> int | None:
    """A log level from queue_server's number (0-7) or a name; None if bad."""
    value = value.strip().lower()
    if value.isascii() and value.isdigit():  # int() refuses some isdigit() text ("\u00b2")
        return _NUMERIC_LEVELS.get(int(value))
    return _NAMED_LEVELS.get(value)


_SECONDS = re.compile(r"[0-9]+(?:\.[0-9]*)?|\.[0-9]+")


class _Reader:
    """Typed access to one element's attributes, with errors that name it."""

    def __init__(self, file: str, element: str, attrs: dict) -> None:
        self.file, self.element, self.attrs = file, element, dict(attrs)

    def error(self, problem: str) -> ConfigError:
        return ConfigError(self.file, self.element, problem)

    def check_known(self, *names: str) -> None:
        unknown = sorted(set(self.attrs) - set(names))
        if unknown:
            raise self.error(f"unknown attribute {unknown[0]!r} (known: {', '.join(names)})")

    # text, integer and port give `default` when the attribute is absent, or
    # raise if it is `required`: never None when either says so.
    @overload
    def text(self, name: str, default: str, *, required: bool = False) -> str: ...
    @overload
    def text(self, name: str, default: None = None, *, required: Literal[True]) -> str: ...
    @overload
    def text(self, name: str, default: str | None = None, *,
             required: bool = False) -> str | None: ...

    def text(self, name: str, default: str | None = None, *, required: bool = False) -> str | None:
        value = self.attrs.get(name)
        if value is None:
            if required:
                raise self.error(f"missing attribute {name!r}")
            return default
        if not isinstance(value, str):
            value = str(value)
        return value

    @overload
    def integer(self, name: str, default: int, *, lo: int, hi: int,
                required: bool = False) -> int: ...
    @overload
    def integer(self, name: str, default: None = None, *, lo: int, hi: int,
                required: Literal[True]) -> int: ...
    @overload
    def integer(self, name: str, default: int | None = None, *, lo: int, hi: int,
                required: bool = False) -> int | None: ...

    def integer(self, name: str, default: int | None = None, *, lo: int, hi: int,
                required: bool = False) -> int | None:
        raw = self.attrs.get(name)
        if raw is None:
            if required:
                raise self.error(f"missing attribute {name!r}")
            return default
        if isinstance(raw, bool):
            raise self.error(f"{name}={raw!r} is not an integer")
        if isinstance(raw, int):
            value = raw
        else:
            try:
                value = int(str(raw).strip())
            except ValueError:
                raise self.error(f"{name}={raw!r} is not an integer") from None
        if not lo <= value <= hi:
            raise self.error(f"{name}={value} out of range {lo}..{hi}")
        return value

    def milliseconds(self, name: str, *, hi_s: int) -> int | None:
        """An optional number of seconds (0..hi_s, a decimal allowed), in ms
        (rounded); None when absent."""
        raw = self.attrs.get(name)
        if raw is None:
            return None
        if isinstance(raw, bool):
            raise self.error(f"{name}={raw!r} is not a number of seconds")
        text = str(raw).strip()
        # Plain decimals only: float() would also take "nan", "inf", "1e3"
        # and "1_0", none of which an operator means as a window.
        if not _SECONDS.fullmatch(text.removeprefix("-")):
            raise self.error(f"{name}={raw!r} is not a number of seconds")
        seconds = float(text)
        if not 0 <= seconds <= hi_s:
            raise self.error(f"{name}={text} out of range 0..{hi_s} seconds")
        return round(seconds * 1000)

    def choice(self, name: str, enum_type: type[enum.Enum], default: enum.Enum) -> enum.Enum:
        raw = self.attrs.get(name)
        if raw is None:
            return default
        try:
            return enum_type(str(raw).strip().lower())
        except ValueError:
            allowed = "|".join(e.value for e in enum_type)
            raise self.error(f"{name}={raw!r} must be one of {allowed}") from None

    def flag(self, name: str, default: bool) -> bool:
        raw = self.attrs.get(name)
        if raw is None:
            return default
        value = str(raw).strip().lower()
        if value in ("1", "true", "yes", "on"):
            return True
        if value in ("0", "false", "no", "off"):
            return False
        raise self.error(f"{name}={raw!r} must be 1 or 0")

    def host(self, name: str, default: str) -> str:
        value = self.text(name, default)
        if not value or any(c.isspace() for c in value):
            raise self.error(f"{name}={value!r} is not a host name or address")
        return value

    @overload
    def port(self, name: str, default: int, *, required: bool = False) -> int: ...
    @overload
    def port(self, name: str, default: None = None, *, required: Literal[True]) -> int: ...

    def port(self, name: str, default: int | None = None, *, required: bool = False) -> int | None:
        return self.integer(name, default, lo=1, hi=65535, required=required)

    def address(self, name: str) -> tuple[str, int] | None:
        """An optional "host:port" attribute."""
        raw = self.text(name)
        if raw is None:
            return None
        host, sep, port = raw.strip().rpartition(":")
        if not sep or not host or any(c.isspace() for c in host):
            raise self.error(f"{name}={raw!r} is not host:port")
        try:
            number = int(port)
        except ValueError:
            raise self.error(f"{name}={raw!r} is not host:port") from None
        if not 1 <= number <= 65535:
            raise self.error(f"{name}={raw!r}: port out of range 1..65535")
        return host, number


def _queue_name(r: _Reader, name: str | None, what: str = "queue name") -> str:
    if not name:
        raise r.error(f"{what} must not be empty")
    if len(name) > MAX_QUEUE_NAME:
        raise r.error(f"{what} longer than {MAX_QUEUE_NAME} characters")
    return name


def _build(file: str, sections: dict[str, _Reader], cluster: _Reader | None,
           nodes: list[_Reader], virtual: list[tuple[_Reader, list[_Reader]]],
           queues: list[_Reader], tokens: list[_Reader] | None = None) -> Config:
    kw: dict[str, Any] = {"source": file}
    _read_sections(kw, sections)
    if cluster:
        cluster.check_known("secret", "secret_file")
        secret = _secret(cluster, "secret", "secret_file")
        if secret is not None and not secret:
            raise cluster.error("secret must not be empty (omit it for no authentication)")
        kw["secret"] = secret
    if "security" in sections:
        kw["client_tokens"] = _client_tokens(sections["security"], tokens or [])
    kw["peers"] = _peers(file, nodes, kw.get("node_id", 1), kw.get("host", DEFAULT_HOST),
                         kw.get("port", DEFAULT_PORT))
    if (len(kw["peers"]) > 1 and kw.get("host", DEFAULT_HOST) in _ANY_ADDRESS
            and not kw.get("advertise_host")):
        # Clients must never be sent to 0.0.0.0. queue_server's own example
        # binds 0.0.0.0: its <cluster> entry names the address the other
        # nodes reach it at, which clients can reach too; without one, refuse.
        me = next(p for p in kw["peers"] if p.node_id == kw.get("node_id", 1))
        if me.host in _ANY_ADDRESS:
            raise ConfigError(file, "node_info",
                              f"host={kw['host']!r} binds every address: a cluster node must "
                              "set advertise_host, the address its clients are sent to")
        kw["advertise_host"] = me.host
    kw["virtual_queues"] = _virtual_queues(file, virtual)
    kw["queue_defaults"] = _queue_defaults(queues, kw["virtual_queues"])
    return Config(**kw)


_ANY_ADDRESS = ("0.0.0.0", "::", "")


def _path(r: _Reader, name: str, *, must_exist: bool = True) -> str | None:
    """An optional file path attribute, relative to the configuration file's
    directory; with `must_exist`, a file that is not there is an error now
    rather than at start-up."""
    raw = r.text(name)
    if raw is None:
        return None
    raw = raw.strip()
    if not raw:
        raise r.error(f"{name} must not be empty")
    path = raw
    if not os.path.isabs(path) and not r.file.startswith("<"):
        path = os.path.join(os.path.dirname(os.path.abspath(r.file)), path)
    if must_exist and not os.path.isfile(path):
        raise r.error(f"{name}={raw!r}: no such file ({path})")
    return path


def _secret(r: _Reader, name: str, file_name: str) -> str | None:
    """A secret given inline (`name`) or in a file (`file_name`: its text,
    stripped of surrounding white space); not both."""
    inline = r.text(name)
    path = _path(r, file_name, must_exist=False)
    if path is None:
        return inline
    if inline is not None:
        raise r.error(f"give {name} or {file_name}, not both")
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read().strip()
    except (OSError, UnicodeDecodeError) as exc:
        problem = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
        raise r.error(f"{file_name}={path!r}: cannot read: {problem}") from None
    if not text:
        raise r.error(f"{file_name}={path!r} is empty")
    return text


def _actions(r: _Reader) -> frozenset[int]:
    """A token's `actions`: names, groups or numbers, comma-separated;
    absent or "all": every action."""
    raw = r.text("actions")
    if raw is None or raw.strip().lower() in ("all", "*"):
        return ALL_ACTIONS
    out: set[int] = set()
    for part in raw.split(","):
        word = part.strip().lower()
        if not word:
            continue
        if word in ACTION_NAMES:
            out.update(ACTION_NAMES[word])
        elif word in _ACTION_GROUPS:
            for name in _ACTION_GROUPS[word]:
                out.update(ACTION_NAMES[name])
        elif word.isascii() and word.isdigit() and int(word) in ALL_ACTIONS:
            out.add(int(word))
        else:
            known = ", ".join([*ACTION_NAMES, *_ACTION_GROUPS])
            raise r.error(f"actions: unknown action {part.strip()!r} (known: {known}, "
                          "all, or action numbers)")
    if not out:
        raise r.error("actions must name at least one action")
    return frozenset(out)


def _token_text(r: _Reader, name: str, file_name: str) -> str | None:
    token = _secret(r, name, file_name)
    if token is None:
        return None
    if len(token) < MIN_TOKEN_LENGTH or any(c.isspace() for c in token):
        raise r.error(f"{name}: a token must be at least {MIN_TOKEN_LENGTH} characters "
                      "without white space")
    return token


def _client_tokens(security: _Reader, tokens: list[_Reader]) -> tuple[ClientToken, ...]:
    """<security client_token|client_token_file> (one token for every
    action, named "default") and its <token name token|token_file actions>
    children."""
    security.check_known("client_token", "client_token_file")
    out: list[ClientToken] = []
    default = _token_text(security, "client_token", "client_token_file")
    if default is not None:
        out.append(ClientToken(name="default", token=default))
    for t in tokens:
        t.check_known("name", "token", "token_file", "actions")
        name = t.text("name", required=True).strip()
        if not name or len(name) > 64 or any(c.isspace() for c in name):
            raise t.error(f"name={name!r} must be 1-64 characters without white space")
        token = _token_text(t, "token", "token_file")
        if token is None:
            raise t.error("missing attribute 'token' (or 'token_file')")
        if any(o.name == name for o in out):
            raise t.error(f"duplicate token name {name!r}")
        twin = next((o.name for o in out if o.token == token), None)
        if twin is not None:
            raise t.error(f"token {name!r} has the same secret as token {twin!r}")
        out.append(ClientToken(name=name, token=token, actions=_actions(t)))
    if not out:
        raise security.error("no client token: give client_token, client_token_file or "
                             "<token> elements (omit <security> for no authentication)")
    return tuple(out)


def _read_sections(kw: dict[str, Any], sections: dict[str, _Reader]) -> None:
    """The single-element sections (log, node_info, ...), into `kw`."""
    r = sections.get("log")
    if r:
        r.check_known("prefix", "level")
        kw["log_prefix"] = r.text("prefix", "qserver")
        raw = r.text("level")
        if raw is not None:
            level = log_level(raw)
            if level is None:
                raise r.error(f"level={raw!r} must be 0-7 or debug|info|warning|error|critical")
            kw["log_level"] = level
    r = sections.get("node_info")
    if r:
        r.check_known("node_type", "node_id", "host", "port", "advertise_host")
        kw["node_type"] = r.integer("node_type", 10, lo=0, hi=2**31 - 1)
        kw["node_id"] = r.integer("node_id", 1, lo=1, hi=2**31 - 1)
        kw["host"] = r.host("host", DEFAULT_HOST)
        kw["port"] = r.port("port", DEFAULT_PORT)
        if "advertise_host" in r.attrs:
            advertise = r.host("advertise_host", DEFAULT_HOST)
            if advertise in _ANY_ADDRESS:
                raise r.error(f"advertise_host={advertise!r}: clients cannot connect to it; "
                              "give the address they reach this node at")
            kw["advertise_host"] = advertise
    r = sections.get("queue_config")
    if r:
        r.check_known("queue_size", "log_size", "sync_rate")
        kw["queue_size"] = r.integer("queue_size", DEFAULT_QUEUE_SIZE, lo=1, hi=2**40)
        kw["log_size"] = r.integer("log_size", DEFAULT_LOG_SIZE, lo=1, hi=2**40)
        kw["sync_rate"] = r.integer("sync_rate", DEFAULT_SYNC_RATE, lo=1, hi=2**31 - 1)
    r = sections.get("replication")
    if r:
        r.check_known("engine", "mode", "forward_request")
        kw["engine"] = r.choice("engine", Engine, Engine.NATIVE)
        kw["mode"] = r.choice("mode", Mode, Mode.QUORUM)
        kw["forward_request"] = r.flag("forward_request", True)
    r = sections.get("storage")
    if r:
        r.check_known("dir", "fsync")
        d = r.text("dir")
        if d is not None and not d.strip():
            raise r.error("dir must not be empty")
        kw["storage_dir"] = d
        kw["fsync"] = r.choice("fsync", Fsync, Fsync.BATCH)
    r = sections.get("limits")
    if r:
        r.check_known("max_request_size", "max_wait", "max_ready_lag")
        kw["max_request_size"] = r.integer("max_request_size", DEFAULT_MAX_REQUEST_SIZE,
                                           lo=MIN_REQUEST_SIZE, hi=MAX_REQUEST_SIZE)
        kw["max_wait_s"] = r.integer("max_wait", DEFAULT_MAX_WAIT_S, lo=0, hi=MAX_WAIT_S)
        kw["max_ready_lag"] = r.integer("max_ready_lag", DEFAULT_MAX_READY_LAG, lo=0,
                                        hi=2**40)
    r = sections.get("http")
    if r:
        r.check_known("host", "port", "per_queue")
        kw["http_host"] = r.host("host", DEFAULT_HOST)
        # port 0: any free port (tests); the node logs the one it bound.
        kw["http_port"] = r.integer("port", lo=0, hi=65535, required=True)
        kw["metrics_per_queue"] = r.flag("per_queue", True)
    r = sections.get("tls")
    if r:
        r.check_known("cert", "key", "ca", "client_cert", "udp", "peers")
        cert = _path(r, "cert")
        key = _path(r, "key")
        if cert is None or key is None:
            raise r.error("cert and key are both required (PEM files)")
        kw["tls_cert"], kw["tls_key"] = cert, key
        kw["tls_ca"] = _path(r, "ca")
        client_cert = r.choice("client_cert", ClientCert, ClientCert.NONE)
        if client_cert is not ClientCert.NONE and kw["tls_ca"] is None:
            raise r.error(f"client_cert={client_cert.value!r} needs ca, the CA that signs "
                          "client certificates")
        kw["tls_client_cert"] = client_cert
        kw["udp"] = r.flag("udp", False)
        kw["tls_peers"] = r.flag("peers", False)
        if kw["tls_peers"] and kw["tls_ca"] is None:
            raise r.error("peers=1 needs ca, the CA that signs the nodes' certificates")


def _peers(file: str, nodes: list[_Reader], node_id: int, host: str,
           port: int) -> tuple[PeerConfig, ...]:
    """The cluster's <node> elements, checked against each other and against
    this node's node_id, host and port; sorted by node id."""
    peers: list[PeerConfig] = []
    for n in nodes:
        n.check_known("id", "host", "port", "dial", "raft_dial")
        peer = PeerConfig(node_id=n.integer("id", lo=1, hi=2**31 - 1, required=True),
                          host=n.host("host", DEFAULT_HOST), port=n.port("port", required=True),
                          dial=n.address("dial"), raft_dial=n.address("raft_dial"))
        if any(p.node_id == peer.node_id for p in peers):
            raise n.error(f"duplicate node id {peer.node_id}")
        if any((p.host, p.port) == (peer.host, peer.port) for p in peers):
            raise n.error(f"duplicate address {peer.host}:{peer.port}")
        peers.append(peer)
    if peers:
        if not any(p.node_id == node_id for p in peers):
            raise ConfigError(file, "cluster",
                              f"node_info node_id={node_id} is not one of the cluster's nodes")
        if len(peers) % 2 == 0:
            raise ConfigError(file, "cluster",
                              f"{len(peers)} nodes: a cluster needs an odd number of nodes")
        me = next(p for p in peers if p.node_id == node_id)
        if me.port == port and me.host in (host, "0.0.0.0"):
            raise ConfigError(file, "cluster",
                              f"node {node_id}'s internal port {me.port} is its client port")
    return tuple(sorted(peers, key=lambda p: p.node_id))


def _virtual_queues(file: str,
                    virtual: list[tuple[_Reader, list[_Reader]]]) -> dict[str, tuple[str, ...]]:
    """The <virtual_queue> elements: name -> its real member queues."""
    vqs: dict[str, tuple[str, ...]] = {}
    for vr, members in virtual:
        vr.check_known("name")
        name = _queue_name(vr, vr.text("name", required=True))
        if name in vqs:
            raise vr.error(f"duplicate virtual queue {name!r}")
        reals = []
        for m in members:
            m.check_known("name")
            real = _queue_name(m, m.text("name", required=True))
            if real in reals:
                raise m.error(f"queue {real!r} listed twice in virtual queue {name!r}")
            reals.append(real)
        if not reals:
            raise vr.error(f"virtual queue {name!r} has no <queue> members")
        vqs[name] = tuple(reals)
    for name, listed in vqs.items():
        for real in listed:
            if real in vqs:
                raise ConfigError(file, "virtual_queue",
                                  f"virtual queue {name!r} lists virtual queue {real!r}; "
                                  "members must be real queues")
    return vqs


def _queue_defaults(queues: list[_Reader],
                    virtual_queues: dict[str, tuple[str, ...]]) -> dict[str, dict[str, object]]:
    """The top-level <queue> elements: real queue name -> the settings given
    (max_size, max_deliveries, dead_letter, dedup_window_ms), checked as
    config (5) checks them at run time."""
    out: dict[str, dict[str, object]] = {}
    for r in queues:
        r.check_known("name", "max_size", "max_deliveries", "dead_letter", "dedup_window")
        name = _queue_name(r, r.text("name", required=True))
        if name in out:
            raise r.error(f"queue {name!r} given twice")
        if name in virtual_queues:
            raise r.error(f"{name!r} is a virtual queue: virtual queues take no settings")
        settings: dict[str, object] = {}
        max_size = r.integer("max_size", lo=1, hi=MAX_QUEUE_MAX_SIZE)
        if max_size is not None:
            settings["max_size"] = max_size
        max_deliveries = r.integer("max_deliveries", lo=0, hi=MAX_DELIVERIES)
        if max_deliveries is not None:
            settings["max_deliveries"] = max_deliveries
        dead_letter = r.text("dead_letter")
        if dead_letter is not None:
            dead_letter = _queue_name(r, dead_letter, "dead_letter")
            # The store's rules for config (5): no queue is its own
            # dead-letter queue, not even through a virtual queue.
            if dead_letter == name:
                raise r.error(f"dead_letter={dead_letter!r}: a queue cannot be its own "
                              "dead-letter queue")
            if name in virtual_queues.get(dead_letter, ()):
                raise r.error(f"dead_letter={dead_letter!r}: virtual queue {dead_letter!r} "
                              f"includes {name!r} itself")
            settings["dead_letter"] = dead_letter
        window_ms = r.milliseconds("dedup_window", hi_s=MAX_DEDUP_WINDOW_S)
        if window_ms is not None:
            settings["dedup_window_ms"] = window_ms
        out[name] = settings
    return out


_SECTIONS = ("log", "node_info", "queue_config", "replication", "storage", "limits",
             "http", "tls")


def _children(file: str, el: ET.Element, path: str, tag: str) -> list[_Reader]:
    """The <tag> children of `el` (at `path`), comments skipped; any other
    element is a ConfigError naming it."""
    out = []
    for child in el:
        if not isinstance(child.tag, str):
            continue  # comments, processing instructions
        if child.tag != tag:
            raise ConfigError(file, f"{path}/{child.tag}", f"unknown element (expected <{tag}>)")
        out.append(_Reader(file, f"{path}/{tag}", child.attrib))
    return out


def parse_xml(text: str | bytes, file: str = "<string>") -> Config:
    """Parse queue_server's XML configuration. Raises ConfigError."""
    try:
        root = ET.fromstring(text)
    except ET.ParseError as exc:
        raise ConfigError(file, "xml", f"not well-formed XML: {exc}") from None
    sections: dict[str, _Reader] = {}
    cluster = None
    nodes: list[_Reader] = []
    virtual: list[tuple[_Reader, list[_Reader]]] = []
    queues: list[_Reader] = []
    tokens: list[_Reader] = []
    for el in root:
        if not isinstance(el.tag, str):
            continue  # comments, processing instructions
        if el.tag == "security":
            if "security" in sections:
                raise ConfigError(file, el.tag, "given twice")
            sections["security"] = _Reader(file, "security", el.attrib)
            tokens.extend(_children(file, el, "security", "token"))
        elif el.tag in _SECTIONS:
            if el.tag in sections:
                raise ConfigError(file, el.tag, "given twice")
            sections[el.tag] = _Reader(file, el.tag, el.attrib)
        elif el.tag == "cluster":
            if cluster is not None:
                raise ConfigError(file, "cluster", "given twice")
            cluster = _Reader(file, "cluster", el.attrib)
            nodes.extend(_children(file, el, "cluster", "node"))
        elif el.tag == "virtual_queue":
            virtual.append((_Reader(file, "virtual_queue", el.attrib),
                            _children(file, el, "virtual_queue", "queue")))
        elif el.tag == "queue":
            for child in el:
                if isinstance(child.tag, str):
                    raise ConfigError(file, f"queue/{child.tag}",
                                      "unknown element (<queue> takes only attributes)")
            queues.append(_Reader(file, "queue", el.attrib))
        else:
            raise ConfigError(file, el.tag, "unknown element")
    return _build(file, sections, cluster, nodes, virtual, queues, tokens)


# queue_server's config.json keys -> (section, attribute).
_JSON_KEYS = {
    "log_prefix": ("log", "prefix"), "log_level": ("log", "level"),
    "node_type": ("node_info", "node_type"), "node_id": ("node_info", "node_id"),
    "host": ("node_info", "host"), "port": ("node_info", "port"),
    "queue_size": ("queue_config", "queue_size"), "queue_log_size": ("queue_config", "log_size"),
    "queue_sync_rate": ("queue_config", "sync_rate"),
    "queue_data_dir": ("storage", "dir"), "fsync": ("storage", "fsync"),
    "engine": ("replication", "engine"), "mode": ("replication", "mode"),
    "forward_request": ("replication", "forward_request"),
    "max_request_size": ("limits", "max_request_size"),
    "max_wait": ("limits", "max_wait"),
    "secret": ("cluster", "secret"), "secret_file": ("cluster", "secret_file"),
    "advertise_host": ("node_info", "advertise_host"),
    "max_ready_lag": ("limits", "max_ready_lag"),
    "http_host": ("http", "host"), "http_port": ("http", "port"),
    "metrics_per_queue": ("http", "per_queue"),
    "client_token": ("security", "client_token"),
    "client_token_file": ("security", "client_token_file"),
    "tls_cert": ("tls", "cert"), "tls_key": ("tls", "key"), "tls_ca": ("tls", "ca"),
    "tls_client_cert": ("tls", "client_cert"), "tls_udp": ("tls", "udp"),
    "tls_peers": ("tls", "peers"),
}
# Accepted and ignored: queue_server's on-disk block count has no meaning here.
_JSON_IGNORED = {"queue_data_blocks"}


def parse_json(text: str | bytes, file: str = "<string>") -> Config:
    """Parse queue_server's later JSON configuration. Raises ConfigError."""
    try:
        doc = json.loads(text)
    except ValueError as exc:
        raise ConfigError(file, "json", f"not valid JSON: {exc}") from None
    if not isinstance(doc, dict):
        raise ConfigError(file, "json", "the top level must be an object")
    attrs: dict[str, dict] = {}
    nodes: list[_Reader] = []
    virtual: list[tuple[_Reader, list[_Reader]]] = []
    tokens: list[_Reader] = []
    for key, value in doc.items():
        if key in _JSON_KEYS:
            section, attr = _JSON_KEYS[key]
            if isinstance(value, (dict, list)):
                raise ConfigError(file, key, "must be a number or a string")
            attrs.setdefault(section, {})[attr] = value
        elif key in _JSON_IGNORED:
            continue
        elif key == "cluster_node_list":
            if not isinstance(value, list):
                raise ConfigError(file, key, "must be a list")
            for item in value:
                if not isinstance(item, dict):
                    raise ConfigError(file, key, "each node must be an object")
                a = {("id" if k == "node_id" else k): v for k, v in item.items()}
                nodes.append(_Reader(file, "cluster_node_list", a))
        elif key == "client_tokens":  # [{name, token | token_file, actions}]
            if not isinstance(value, list) or not all(isinstance(t, dict) for t in value):
                raise ConfigError(file, key, "must be a list of {name, token, actions} objects")
            tokens.extend(_Reader(file, "client_tokens", t) for t in value)
            attrs.setdefault("security", {})
        elif key == "virtual_queue_list":
            if not isinstance(value, list):
                raise ConfigError(file, key, "must be a list")
            for item in value:
                if not isinstance(item, dict) or not isinstance(item.get("queue_list", []), list):
                    raise ConfigError(file, key, "each entry must be {name, queue_list: [...]}")
                members = [_Reader(file, "virtual_queue_list.queue_list", {"name": q})
                           for q in item.get("queue_list", [])]
                head = {k: v for k, v in item.items() if k != "queue_list"}
                virtual.append((_Reader(file, "virtual_queue_list", head), members))
        else:
            raise ConfigError(file, key, "unknown setting")
    sections = {s: _Reader(file, s, a) for s, a in attrs.items() if s != "cluster"}
    cluster = _Reader(file, "cluster", attrs["cluster"]) if "cluster" in attrs else None
    return _build(file, sections, cluster, nodes, virtual, [], tokens)


def load_config(path: str) -> Config:
    """Read and parse a configuration file (XML, or JSON if it starts with
    '{'). Raises ConfigError, also for a file that cannot be read."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as exc:
        raise ConfigError(path, "file", f"cannot read: {exc.strerror or exc}") from None
    if data.lstrip()[:1] == b"{":
        return parse_json(data, path)
    return parse_xml(data, path)
