"""The deployment files (deploy/: the Dockerfile, the compose file and its
node configurations, the systemd unit; .dockerignore) and `--log-format`.

The files are read, not run: the compose file with a small strict reader of
the block YAML it keeps to (PyYAML is not a dependency), the unit with
configparser, the Dockerfile instruction by instruction. What they say is
checked against each other and against the configurations they mount, which
load with `load_config` and form one cluster. Where tools exist they check
too: `docker compose config` (no daemon needed), `systemd-analyze verify`.
The image is built and started only where Docker works and
QSERVER_DOCKER_TEST=1 says the build may download (the base image and the
daemon's dependencies from PyPI): by default no test touches the network.

`--log-format json` is checked on real processes: `qserver run` and
`qserver local-cluster`, every stderr line one JSON object with the fields
qserver/logformat.py names.
"""

from __future__ import annotations

import argparse
import calendar
import configparser
import json
import logging
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any, NamedTuple

import pytest

from procs import TcpClient, free_port, read_until, stop, wait_until
from qserver.cli import WANTED_OPEN_FILES, _parser
from qserver.config import Config, Engine, Fsync, Mode, load_config
from qserver.logformat import JsonFormatter, iso_utc_ms

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
START_DEADLINE_S = 30.0  # generous: CI is a shared, noisy 2-core machine


# -- a strict reader of the compose file's YAML subset -------------------------
#
# Block mappings and sequences by indentation, scalars plain or quoted, flow
# sequences of scalars (["CMD", "qserver", ...]), comments. Anything else
# (anchors, aliases, merge keys, tags, flow mappings, multi-line strings,
# "- key: value" items, tabs) is an error, not a silent misreading: the
# compose file says it keeps to this subset. Plain scalars stay strings
# ("10s", "3"): the checks compare text.


class YamlSubsetError(ValueError):
    """Raised when the text is outside the subset (or not YAML)."""


class _Line(NamedTuple):
    indent: int
    text: str
    number: int


def _strip_comment(raw: str, number: int) -> str:
    quote = None
    i = 0
    while i < len(raw):
        ch = raw[i]
        if quote == '"' and ch == "\\":
            i += 2
            continue
        if quote:
            if ch == quote:
                quote = None
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or raw[i - 1] in " \t"):
            return raw[:i].rstrip()
        i += 1
    if quote:
        raise YamlSubsetError(f"line {number}: unterminated quote")
    return raw.rstrip()


def _split_flow(inner: str, number: int) -> list[str]:
    items, quote, start, i = [], None, 0, 0
    while i < len(inner):
        ch = inner[i]
        if quote == '"' and ch == "\\":
            i += 2
            continue
        if quote:
            if ch == quote:
                quote = None
        elif ch in "'\"":
            quote = ch
        elif ch in "[]{}":
            raise YamlSubsetError(f"line {number}: nested flow collections are not supported")
        elif ch == ",":
            items.append(inner[start:i].strip())
            start = i + 1
        i += 1
    last = inner[start:].strip()
    if last:
        items.append(last)
    if any(not item for item in items):
        raise YamlSubsetError(f"line {number}: empty item in a flow sequence")
    return items


def _scalar(text: str, number: int) -> Any:
    if text.startswith("["):
        if not text.endswith("]"):
            raise YamlSubsetError(f"line {number}: a flow sequence must end the line")
        return [_scalar(item, number) for item in _split_flow(text[1:-1], number)]
    if text.startswith('"'):
        if len(text) < 2 or not text.endswith('"'):
            raise YamlSubsetError(f"line {number}: text after a quoted scalar")
        try:
            return json.loads(text)  # YAML's double-quoted escapes include JSON's
        except ValueError as exc:
            raise YamlSubsetError(f"line {number}: {exc}") from None
    if text.startswith("'"):
        if len(text) < 2 or not text.endswith("'") or "'" in text[1:-1].replace("''", ""):
            raise YamlSubsetError(f"line {number}: text after a quoted scalar")
        return text[1:-1].replace("''", "'")
    if text[0] in "{&*!|>%@`" or text == "<<":
        raise YamlSubsetError(f"line {number}: {text[0]!r} is outside the supported subset")
    if ": " in text or text.endswith(":"):
        raise YamlSubsetError(f"line {number}: a mapping where a scalar belongs")
    return text


def _block(lines: list[_Line], i: int, indent: int) -> tuple[Any, int]:
    if lines[i].text == "-" or lines[i].text.startswith("- "):
        items = []
        while i < len(lines) and lines[i].indent == indent:
            line = lines[i]
            if not line.text.startswith("- "):
                raise YamlSubsetError(f"line {line.number}: a sequence item expected")
            items.append(_scalar(line.text[2:].strip(), line.number))
            i += 1
        return items, i
    mapping: dict[str, Any] = {}
    while i < len(lines) and lines[i].indent == indent:
        line = lines[i]
        key_text, colon, rest = line.text.partition(":")
        if not colon or (rest and not rest.startswith(" ")) or line.text.startswith("- "):
            raise YamlSubsetError(f"line {line.number}: a 'key: value' line expected")
        key = _scalar(key_text.strip(), line.number)
        if not isinstance(key, str) or key in mapping:
            raise YamlSubsetError(f"line {line.number}: bad or duplicate key {key!r}")
        i += 1
        if rest.strip():
            mapping[key] = _scalar(rest.strip(), line.number)
        elif i < len(lines) and lines[i].indent > indent:
            mapping[key], i = _block(lines, i, lines[i].indent)
        else:
            mapping[key] = None
    return mapping, i


def read_yaml_subset(text: str) -> Any:
    """The value of `text`, in the subset above. Raises YamlSubsetError."""
    lines = []
    for number, raw in enumerate(text.splitlines(), 1):
        body = _strip_comment(raw, number)
        stripped = body.lstrip(" ")
        if stripped.startswith("\t"):
            raise YamlSubsetError(f"line {number}: a tab in the indentation")
        if stripped:
            lines.append(_Line(len(body) - len(stripped), stripped, number))
    if not lines:
        return None
    value, i = _block(lines, 0, lines[0].indent)
    if i != len(lines):
        raise YamlSubsetError(f"line {lines[i].number}: unexpected indentation")
    return value


def test_the_yaml_reader_is_strict():
    text = 'a:\n  b: "x # y"  # comment\n  c: [\'it\'\'s\', 2]\n  d:\n    - one\n    - "t:w"\n'
    assert read_yaml_subset(text) == {"a": {"b": "x # y", "c": ["it's", "2"],
                                            "d": ["one", "t:w"]}}
    assert read_yaml_subset("volumes:\n  v1:\n  v2:\n") == {"volumes": {"v1": None, "v2": None}}
    for bad in ["a: &x 1\n", "a: *x\n", "<<: *x\n", "a: {b: 1}\n", "a: |\n  t\n",
                "a:\n  - b: 1\n", "a: 1\na: 2\n", "a:\n  b: 1\n   c: 2\n", "a:\n\t- x\n",
                "a: [[1]]\n", 'a: "x\n', "a: b: c\n"]:
        with pytest.raises(YamlSubsetError):
            read_yaml_subset(bad)


# -- the compose file and the configurations it mounts -------------------------

COMPOSE = DEPLOY / "docker-compose.yml"


@pytest.fixture(scope="module")
def compose() -> dict:
    return read_yaml_subset(COMPOSE.read_text())


def mounts(service: dict) -> list[tuple[str, str, str]]:
    """A service's volumes (short syntax): (source, target, options)."""
    out = []
    for spec in service.get("volumes") or []:
        source, target, *options = spec.split(":")
        assert len(options) <= 1, spec
        out.append((source, target, options[0] if options else ""))
    return out


def config_of(name: str, service: dict) -> tuple[Config, Path]:
    """The configuration a service runs: the file its command's --config
    names, mounted from the repository."""
    command = service["command"]
    target = command[command.index("--config") + 1]
    sources = [s for s, t, _ in mounts(service) if t == target]
    assert len(sources) == 1, f"{name}: {target} is mounted {len(sources)} times"
    path = (COMPOSE.parent / sources[0]).resolve()
    assert path.is_file(), f"{name} mounts {sources[0]}, which is not in the repository"
    return load_config(str(path)), path


def published(service: dict) -> dict[tuple[int, str], tuple[str, int]]:
    """(container port, protocol) -> (host address, host port)."""
    out = {}
    for spec in service["ports"]:
        address, host_port, rest = spec.split(":")
        container_port, _, protocol = rest.partition("/")
        out[(int(container_port), protocol or "tcp")] = (address, int(host_port))
    return out


def test_compose_services(compose):
    services = compose["services"]
    assert sorted(services) == ["qserver1", "qserver2", "qserver3"]
    declared = compose["volumes"]
    data_volumes = set()
    for name, service in services.items():
        assert service["build"] == {"context": "..", "dockerfile": "deploy/Dockerfile"}
        assert (COMPOSE.parent / service["build"]["context"]).resolve() == ROOT
        assert (ROOT / service["build"]["dockerfile"]).is_file()
        assert service["command"][:1] == ["run"] and "--config" in service["command"]
        assert service["command"][-2:] == ["--log-format", "json"]
        # One named volume on /data per node; the config mounted read-only.
        named = [(s, t) for s, t, _ in mounts(service) if not s.startswith((".", "/"))]
        assert [t for _, t in named] == ["/data"], name
        assert named[0][0] in declared
        data_volumes.add(named[0][0])
        assert all(opt == "ro" for s, _, opt in mounts(service) if s.startswith("."))
        check = service["healthcheck"]
        assert check["test"][:4] == ["CMD", "qserver", "health", "-s"], name
        assert {"interval", "timeout", "retries", "start_period"} <= set(check)
        assert service["restart"] in ("unless-stopped", "always", "on-failure")
        assert service["stop_signal"] == "SIGTERM"
        # Longer than the node takes to stop in order (Docker's default is 10 s).
        assert int(service["stop_grace_period"].rstrip("s")) >= 20
        assert int(service["ulimits"]["nofile"]["soft"]) >= WANTED_OPEN_FILES
    assert len(data_volumes) == 3  # one each, none shared


def test_compose_nodes_form_one_cluster(compose):
    services = compose["services"]
    configs = {}
    for name, service in services.items():
        cfg, path = config_of(name, service)
        configs[name] = cfg
        assert path.parent == DEPLOY / "config"
        # Binds every address of its container; clients are sent to the
        # service name, which the other containers resolve.
        assert cfg.host == "0.0.0.0" and cfg.advertise_host == name == cfg.client_host
        assert (cfg.engine, cfg.mode, cfg.fsync) == (Engine.NATIVE, Mode.QUORUM, Fsync.BATCH)
        assert cfg.forward_request  # any published port answers any request
        # Its data on its volume, its metrics on every address.
        data = next(t for s, t, _ in mounts(service) if not s.startswith("."))
        assert cfg.storage_dir is not None
        assert Path(cfg.storage_dir) == Path(data) or Path(data) in Path(cfg.storage_dir).parents
        assert (cfg.http_host, cfg.http_port) == ("0.0.0.0", 8080)
        # The health check asks this node's client port, from inside.
        assert service["healthcheck"]["test"][4:] == [f"127.0.0.1:{cfg.port}"]
        ports = published(service)
        assert {(cfg.port, "tcp"), (cfg.port, "udp"), (cfg.http_port, "tcp")} <= set(ports)
        # No authentication on either port: loopback of the host only.
        assert all(address == "127.0.0.1" for address, _ in ports.values())
        me = next(p for p in cfg.peers if p.node_id == cfg.node_id)
        assert me.host == name  # the others dial the service name
    assert sorted(c.node_id for c in configs.values()) == [1, 2, 3]
    first = next(iter(configs.values()))
    assert len(first.peers) == 3
    assert all(c.peers == first.peers for c in configs.values())
    assert {p.host for p in first.peers} == set(services)
    assert first.secret and all(c.secret == first.secret for c in configs.values())
    host_ports = [(*host, protocol) for s in services.values()
                  for (_, protocol), host in published(s).items()]
    assert len(set(host_ports)) == len(host_ports)  # no host port published twice


def skip_without_health_command() -> None:
    commands = next(a.choices for a in _parser()._actions
                    if isinstance(a, argparse._SubParsersAction))
    if "health" not in commands:
        pytest.skip("`qserver health` (action 109) is not in the command line yet")


def test_compose_health_check_is_a_cli_command(compose):
    skip_without_health_command()
    for service in compose["services"].values():
        args = _parser().parse_args(service["healthcheck"]["test"][2:])
        assert args.command == "health"


@pytest.mark.skipif(shutil.which("docker") is None, reason="no docker command")
def test_docker_compose_reads_it_as_we_do(compose):
    version = subprocess.run(["docker", "compose", "version"], capture_output=True, timeout=30)
    if version.returncode != 0:
        pytest.skip("no docker compose plugin")
    result = subprocess.run(["docker", "compose", "-f", str(COMPOSE), "config", "--format",
                             "json"], capture_output=True, text=True, timeout=60, check=True)
    theirs = json.loads(result.stdout)
    assert set(theirs["services"]) == set(compose["services"])
    for name, service in theirs["services"].items():
        assert service["healthcheck"]["test"] == compose["services"][name]["healthcheck"]["test"]
        assert service["command"] == compose["services"][name]["command"]
        assert sorted(v["target"] for v in service["volumes"]) == sorted(
            t for _, t, _ in mounts(compose["services"][name]))


# -- the Dockerfile and .dockerignore ------------------------------------------


def dockerfile() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments), continuation lines joined, comments and the
    parser directive left out."""
    out: list[tuple[str, str]] = []
    pending = ""
    for raw in (DEPLOY / "Dockerfile").read_text().splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        line = pending + line
        pending = ""
        instruction, _, args = line.partition(" ")
        out.append((instruction.upper(), args.strip()))
    assert not pending, "the Dockerfile ends in a continuation"
    return out


def test_dockerfile():
    steps = dockerfile()
    by = {}
    for instruction, args in steps:
        by.setdefault(instruction, []).append(args)
    # A slim Python base; the last stage is the image.
    base = dict(a.split("=", 1) for a in by["ARG"])["PYTHON_IMAGE"]
    assert re.fullmatch(r"python:3\.1[1-9]-slim(-\w+)?", base)
    assert by["FROM"][-1] == "${PYTHON_IMAGE}"
    # The daemon only: no extras (no pyspark, pyarrow, pytest).
    pip = [command for a in by["RUN"] for command in a.split("&&")
           if re.search(r"\bpip (install|wheel)\b", command)]
    assert len(pip) == 2
    assert not any(re.search(r"(\.|qserver)\[|pyspark|pyarrow", a) for a in pip), pip
    assert "--no-index" in pip[1]  # the image installs the build stage's wheels only
    # What the build copies is in the repository and not ignored.
    ignored = {p.strip("/") for p in dockerignore()}
    for args in by["COPY"]:
        *sources, _ = args.split()
        for source in sources:
            if not source.startswith("--"):
                assert (ROOT / source).exists(), source
                assert source.strip("./").split("/")[0] not in ignored, source
    # Not root; storage on the volume; the ports of the default config.
    user = by["USER"][-1].split(":")[0]
    assert user not in ("root", "0")
    assert json.loads(by["VOLUME"][-1]) == ["/data"]
    exposed = set(" ".join(by["EXPOSE"]).split())
    command = json.loads(by["CMD"][-1])
    assert json.loads(by["ENTRYPOINT"][-1]) == ["qserver"]
    assert command[0] == "run" and command[-2:] == ["--log-format", "json"]
    config_path = command[command.index("--config") + 1]
    copies = {a.split()[-1]: a.split()[-2] for a in by["COPY"]}
    cfg = load_config(str(ROOT / copies[config_path]))
    assert cfg.host == "0.0.0.0" and not cfg.peers
    assert cfg.storage_dir == "/data"
    assert {f"{cfg.port}/tcp", f"{cfg.port}/udp", f"{cfg.http_port}/tcp"} <= exposed
    # The health check asks the node, from inside the container.
    health = by["HEALTHCHECK"][-1]
    options, _, check = health.partition("CMD ")
    assert "--start-period=" in options and "--timeout=" in options
    assert json.loads(check) == ["qserver", "health", "-s", f"127.0.0.1:{cfg.port}"]
    assert by["STOPSIGNAL"] == ["SIGTERM"]
    # The compose nodes use the image's ports: one health check, one EXPOSE.
    for i in (1, 2, 3):
        node = load_config(str(DEPLOY / "config" / f"node{i}.xml"))
        assert {f"{node.port}/tcp", f"{node.http_port}/tcp"} <= exposed
        assert {f"{p.port}/tcp" for p in node.peers} <= exposed


def test_the_image_config_runs_and_its_health_check_passes(procs, tmp_path):
    """The image's default configuration as a real node (its ports free
    ones, its /data a temporary directory): the HEALTHCHECK's command exits
    0 while it serves and 1 once it is gone."""
    skip_without_health_command()
    last = dict(dockerfile())  # each instruction's last occurrence
    text = (DEPLOY / "config" / "single.xml").read_text()
    assert text.count('port="1111"') == 1 and text.count('dir="/data"') == 1
    text = (text.replace('port="1111"', 'port="{port}"').replace('port="8080"', 'port="0"')
            .replace('dir="/data"', f'dir="{tmp_path / "data"}"'))
    node = procs(tmp_path, config_text=text)
    check = json.loads(last["HEALTHCHECK"].partition("CMD ")[2])
    assert check[0] == "qserver" and check[-1] == "127.0.0.1:1111"
    argv = [sys.executable, "-m", "qserver", *check[1:-1], f"127.0.0.1:{node.port}"]

    def health() -> int:
        return subprocess.run(argv, capture_output=True, timeout=60).returncode

    wait_until(lambda: health() == 0, START_DEADLINE_S, step_s=0.2)
    assert (tmp_path / "data").is_dir()  # its storage where the config says
    assert node.stop() == 0
    assert health() == 1


def dockerignore() -> list[str]:
    text = (ROOT / ".dockerignore").read_text()
    return [line.strip() for line in text.splitlines()
            if line.strip() and not line.startswith("#")]


def test_dockerignore_keeps_the_machine_out():
    patterns = set(dockerignore())
    assert {".git", ".venv", ".pytest_cache", ".hypothesis", ".mypy_cache", ".ruff_cache",
            "data", "**/__pycache__"} <= patterns
    assert any(p.startswith("bench/") for p in patterns)
    assert not any(p.startswith("!") for p in patterns)


# -- the systemd unit -----------------------------------------------------------

UNIT = DEPLOY / "qserver.service"


def unit() -> configparser.ConfigParser:
    # interpolation=None: systemd's % specifiers are not configparser's;
    # optionxform=str: its keys are case-sensitive.
    parser = configparser.ConfigParser(strict=False, interpolation=None)
    parser.optionxform = str
    parser.read_string(UNIT.read_text(), source=str(UNIT))
    return parser


def test_systemd_unit():
    u = unit()
    assert set(u.sections()) == {"Unit", "Service", "Install"}
    s = u["Service"]
    argv = shlex.split(s["ExecStart"])
    assert argv[0].startswith("/") and Path(argv[0]).name == "qserver"
    assert argv[1] == "run"
    assert argv[argv.index("--config") + 1] == "/etc/qserver/node.xml"
    assert argv[argv.index("--log-format") + 1] == "json"
    assert _parser().parse_args(argv[1:]).log_format == "json"
    assert s["Type"] in ("simple", "exec")
    assert s["KillSignal"] == "SIGTERM"
    # One signal, to qserver: a second one forces the exit.
    assert s["KillMode"] == "mixed"
    assert 10 <= int(s["TimeoutStopSec"]) <= 120
    assert s["Restart"] == "on-failure"
    assert s["RestartPreventExitStatus"] == "2"  # a bad config does not get better
    assert s["User"] == "qserver" and s["StateDirectory"] == "qserver"
    assert int(s["LimitNOFILE"]) >= WANTED_OPEN_FILES
    assert s["NoNewPrivileges"] == "yes" and s["ProtectSystem"] == "strict"
    assert s["PrivateTmp"] == "yes"
    assert "/var/lib/qserver" in s["ReadWritePaths"].split()
    assert s["WorkingDirectory"] == "/var/lib/qserver"
    assert u["Install"]["WantedBy"] == "multi-user.target"
    assert "StartLimitBurst" in u["Unit"]  # [Unit]'s key: in [Service] systemd ignores it


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="no systemd-analyze")
def test_systemd_analyze_verifies_the_unit(tmp_path):
    # verify checks that ExecStart's program exists: point it at this
    # environment's qserver; everything else as shipped.
    qserver = Path(sys.executable).parent / "qserver"
    if not qserver.exists():
        pytest.skip("no qserver script next to this Python")
    copy = tmp_path / "qserver.service"
    copy.write_text(UNIT.read_text().replace("/usr/local/bin/qserver", str(qserver)))
    result = subprocess.run(["systemd-analyze", "verify", str(copy)], capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0 and not result.stderr.strip(), result.stderr


# -- --log-format ---------------------------------------------------------------

TS = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z")
FIELDS = {"ts", "level", "logger", "msg", "node_id", "exc", "stack"}
LEVELS = {"DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"}


def record(msg: str, *args: object, exc_info: Any = None) -> logging.LogRecord:
    return logging.LogRecord("qserver.test", logging.WARNING, __file__, 1, msg, args, exc_info)


def test_json_formatter_fields():
    r = record("node %d: %s", 3, "two\nlines")
    line = JsonFormatter(node_id=3).format(r)
    assert "\n" not in line
    assert json.loads(line) == {"ts": iso_utc_ms(r.created), "level": "WARNING",
                                "logger": "qserver.test", "msg": "node 3: two\nlines",
                                "node_id": 3}
    assert "node_id" not in json.loads(JsonFormatter().format(r))  # no node known


def test_json_formatter_traceback():
    try:
        raise RuntimeError("boom")
    except RuntimeError:
        r = record("failed", exc_info=sys.exc_info())
    fields = json.loads(JsonFormatter(node_id=1).format(r))
    assert fields["msg"] == "failed"
    assert fields["exc"].startswith("Traceback") and fields["exc"].endswith("RuntimeError: boom")


def test_json_formatter_surrogates_are_escaped_not_lost():
    name = b"caf\xe9".decode("utf-8", "surrogateescape")
    fields = json.loads(JsonFormatter().format(record("file %s", name)))
    assert fields["msg"] == "file caf\\udce9"


def test_iso_utc_ms():
    assert iso_utc_ms(0) == "1970-01-01T00:00:00.000Z"
    assert iso_utc_ms(1_700_000_000.1239) == "2023-11-14T22:13:20.123Z"


def test_bad_log_format_is_a_usage_error(capsys):
    for argv in (["run", "--log-format", "xml"], ["local-cluster", "--log-format", "yaml"]):
        with pytest.raises(SystemExit) as stop:
            _parser().parse_args(argv)
        assert stop.value.code == 2
        assert "invalid choice" in capsys.readouterr().err
    assert _parser().parse_args(["run"]).log_format == "text"  # the default


def check_json_lines(stderr: str, node_ids: set[int]) -> list[dict]:
    """Every line of `stderr` a JSON log record of one of `node_ids`."""
    lines = stderr.splitlines()
    assert lines, "no log records"
    records = []
    now = time.time()
    for line in lines:
        fields = json.loads(line)  # a line that is not JSON fails here
        assert {"ts", "level", "logger", "msg", "node_id"} <= set(fields) <= FIELDS, fields
        assert TS.fullmatch(fields["ts"]) and fields["level"] in LEVELS
        ts = calendar.timegm(time.strptime(fields["ts"][:19], "%Y-%m-%dT%H:%M:%S"))
        assert ts == pytest.approx(now, abs=300)  # UTC, not local time
        assert isinstance(fields["logger"], str) and fields["logger"], fields
        assert fields["node_id"] in node_ids
        records.append(fields)
    return records


@pytest.mark.parametrize("log_format", ["json", "text"])
def test_run_log_format(tmp_path, log_format):
    port = free_port()
    path = tmp_path / "node.xml"
    path.write_text(f'<config><node_info node_id="7" host="127.0.0.1" port="{port}"/>'
                    f'<log prefix="qtest"/></config>')
    argv = [sys.executable, "-m", "qserver", "run", "--config", str(path), "--log-level", "debug"]
    if log_format == "json":
        argv += ["--log-format", "json"]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        read_until(proc, b"ready on")
        client = TcpClient(port)  # some work between start and stop
        assert client.request(action=1, queue="logs", data="x")["code"] == 0
        client.close()
        status, err = stop(proc)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert status == 0, err
    if log_format == "text":
        lines = err.splitlines()
        assert lines and all(re.match(r"\d{4}-\d\d-\d\d [\d:,]+ qtest\[7\] [A-Z]+ ", line)
                             for line in lines), err
        return
    records = check_json_lines(err, {7})
    messages = [r["msg"] for r in records]
    assert any("serving on" in m for m in messages), messages
    assert any("stopped" in m for m in messages), messages  # the orderly shutdown, logged


def test_local_cluster_log_format_json(tmp_path):
    clients = [free_port() for _ in range(3)]
    internal = [free_port() for _ in range(3)]
    nodes = "".join(f'<node id="{i + 1}" host="127.0.0.1" port="{internal[i]}"/>'
                    for i in range(3))
    paths = []
    for i in range(3):
        path = tmp_path / f"node{i + 1}.xml"
        path.write_text(f'<config><node_info node_id="{i + 1}" host="127.0.0.1" '
                        f'port="{clients[i]}"/><cluster secret="log-format-test">{nodes}'
                        f'</cluster></config>')
        paths.append(str(path))
    proc = subprocess.Popen([sys.executable, "-m", "qserver", "local-cluster",
                             "--log-format", "json", *paths],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        read_until(proc, b"Ctrl-C stops all nodes.", deadline_s=60)
        status, err = stop(proc)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert status == 0, err
    records = check_json_lines(err, {1, 2, 3})
    assert {r["node_id"] for r in records} == {1, 2, 3}  # each child logs in JSON


# -- the image, where Docker works ----------------------------------------------


def docker_works() -> str | None:
    """None if Docker can build and run here, else why not."""
    if shutil.which("docker") is None:
        return "no docker command"
    try:
        info = subprocess.run(["docker", "info"], capture_output=True, timeout=30)
    except subprocess.TimeoutExpired:
        return "docker info does not answer"
    if info.returncode != 0:
        return "docker info fails (no daemon?)"
    return None


def docker(*args: str, timeout: float = 60, check: bool = True) -> str:
    result = subprocess.run(["docker", *args], capture_output=True, text=True, timeout=timeout)
    if check and result.returncode != 0:
        raise AssertionError(f"docker {' '.join(args)}: {result.stderr}")
    return result.stdout.strip()


def test_the_image_runs_a_node():
    """Build the image, run it with its default single-node configuration:
    it becomes healthy, answers on the published port, runs as uid 10001
    without pyspark, logs JSON and stops in order on `docker stop`."""
    why = docker_works()
    if why is not None:
        pytest.skip(why)
    if os.environ.get("QSERVER_DOCKER_TEST") != "1":
        pytest.skip("set QSERVER_DOCKER_TEST=1 to build the image: the build downloads "
                    "the base image and the daemon's dependencies")
    tag = f"qserver-test:{uuid.uuid4().hex[:12]}"
    volume = f"qserver-test-{uuid.uuid4().hex[:12]}"
    container = None
    try:
        docker("build", "-f", str(DEPLOY / "Dockerfile"), "-t", tag, str(ROOT), timeout=1200)
        assert docker("run", "--rm", "--entrypoint", "id", tag, "-u") == "10001"
        probe = subprocess.run(["docker", "run", "--rm", "--entrypoint", "python", tag, "-c",
                                "import pyspark"], capture_output=True, text=True, timeout=60)
        assert probe.returncode != 0 and "ModuleNotFoundError" in probe.stderr
        container = docker("run", "-d", "-p", "127.0.0.1::1111", "-v", f"{volume}:/data", tag)

        def health() -> str:
            return docker("inspect", "--format", "{{.State.Health.Status}}", container)

        assert wait_until(lambda: health() in ("healthy", "unhealthy"), 120.0,
                          step_s=1.0) and health() == "healthy", docker("logs", container)
        host_port = int(docker("port", container, "1111/tcp").splitlines()[0].rsplit(":", 1)[1])
        client = TcpClient(host_port)
        assert client.request(action=1, queue="img", data="hello")["code"] == 0
        assert client.request(action=2, queue="img")["data"] == "hello"
        client.close()
        docker("stop", "-t", "30", container, timeout=60)
        assert docker("inspect", "--format", "{{.State.ExitCode}}", container) == "0"
        logs = subprocess.run(["docker", "logs", container], capture_output=True, text=True,
                              timeout=60)
        check_json_lines(logs.stderr, {1})
    finally:
        if container:
            docker("rm", "-f", container, check=False)
        docker("volume", "rm", "-f", volume, check=False)
        docker("rmi", "-f", tag, check=False)
