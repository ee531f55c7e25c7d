"""Configuration: queue_server's XML format (and its JSON format), validated
into one frozen `Config`.

Every setting has a default; a single node needs only `<node_info>`, and
`Config.default()` (no file at all) is one node on 127.0.0.1:1111. Every
error names the file, the element and what is wrong (`ConfigError`).

XML elements (design.md section 4; cluster.xml.example documents each):

    <log prefix="qserver" level="5"/>
    <node_info node_type="10" node_id="1" host="127.0.0.1" port="1111"/>
    <queue_config queue_size="..." log_size="..." sync_rate="..."/>
    <cluster secret="..."><node id="1" host="127.0.0.1" port="1101"/>...</cluster>
    <virtual_queue name="v"><queue name="a"/><queue name="b"/></virtual_queue>
    <queue name="a" max_size="..." max_deliveries="..." dead_letter="..." dedup_window="..."/>
    <replication engine="native|raft" mode="quorum|async" forward_request="1|0"/>
    <storage dir="PATH" fsync="always|batch|off"/>
    <limits max_request_size="BYTES" max_wait="SECONDS"/>

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
# starts (design.md: "batch within a few milliseconds").
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

    @classmethod
    def default(cls) -> Config:
        """One node on 127.0.0.1:1111, everything else at its default."""
        return cls()

    @property
    def max_udp_request_size(self) -> int:
        return min(self.max_request_size, MAX_UDP_PAYLOAD)


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
           queues: list[_Reader]) -> Config:
    kw: dict[str, Any] = {"source": file}
    _read_sections(kw, sections)
    if cluster:
        cluster.check_known("secret")
        secret = cluster.text("secret")
        if secret is not None and not secret:
            raise cluster.error("secret must not be empty (omit it for no authentication)")
        kw["secret"] = secret
    kw["peers"] = _peers(file, nodes, kw.get("node_id", 1), kw.get("host", DEFAULT_HOST),
                         kw.get("port", DEFAULT_PORT))
    kw["virtual_queues"] = _virtual_queues(file, virtual)
    kw["queue_defaults"] = _queue_defaults(queues, kw["virtual_queues"])
    return Config(**kw)


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
        r.check_known("node_type", "node_id", "host", "port")
        kw["node_type"] = r.integer("node_type", 10, lo=0, hi=2**31 - 1)
        kw["node_id"] = r.integer("node_id", 1, lo=1, hi=2**31 - 1)
        kw["host"] = r.host("host", DEFAULT_HOST)
        kw["port"] = r.port("port", DEFAULT_PORT)
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
        r.check_known("max_request_size", "max_wait")
        kw["max_request_size"] = r.integer("max_request_size", DEFAULT_MAX_REQUEST_SIZE,
                                           lo=MIN_REQUEST_SIZE, hi=MAX_REQUEST_SIZE)
        kw["max_wait_s"] = r.integer("max_wait", DEFAULT_MAX_WAIT_S, lo=0, hi=MAX_WAIT_S)


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


_SECTIONS = ("log", "node_info", "queue_config", "replication", "storage", "limits")


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
    for el in root:
        if not isinstance(el.tag, str):
            continue  # comments, processing instructions
        if el.tag in _SECTIONS:
            if el.tag in sections:
                raise ConfigError(file, el.tag, "given twice")
            sections[el.tag] = _Reader(file, el.tag, el.attrib)
        elif el.tag == "cluster":
            if cluster is not None:
                raise ConfigError(file, "cluster", "given twice")
            cluster = _Reader(file, "cluster", el.attrib)
            for n in el:
                if not isinstance(n.tag, str):
                    continue
                if n.tag != "node":
                    raise ConfigError(file, f"cluster/{n.tag}", "unknown element (expected <node>)")
                nodes.append(_Reader(file, "cluster/node", n.attrib))
        elif el.tag == "virtual_queue":
            members = []
            for q in el:
                if not isinstance(q.tag, str):
                    continue
                if q.tag != "queue":
                    raise ConfigError(file, f"virtual_queue/{q.tag}",
                                      "unknown element (expected <queue>)")
                members.append(_Reader(file, "virtual_queue/queue", q.attrib))
            virtual.append((_Reader(file, "virtual_queue", el.attrib), members))
        elif el.tag == "queue":
            for child in el:
                if isinstance(child.tag, str):
                    raise ConfigError(file, f"queue/{child.tag}",
                                      "unknown element (<queue> takes only attributes)")
            queues.append(_Reader(file, "queue", el.attrib))
        else:
            raise ConfigError(file, el.tag, "unknown element")
    return _build(file, sections, cluster, nodes, virtual, queues)


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
    "secret": ("cluster", "secret"),
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
    return _build(file, sections, cluster, nodes, virtual, [])


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
