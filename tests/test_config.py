"""Configuration: queue_server's XML and JSON formats into one Config, and
errors that name the file, the element and the problem."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import pytest

from qserver.config import (
    DEFAULT_MAX_REQUEST_SIZE,
    Config,
    Engine,
    Fsync,
    Mode,
    PeerConfig,
    load_config,
    log_level,
    parse_json,
    parse_xml,
)
from qserver.errors import ConfigError, QServerError
from qserver.wire.codec import MAX_UDP_PAYLOAD
from qserver.wire.requests import MAX_DELIVERIES

ROOT = Path(__file__).resolve().parent.parent

FULL_XML = """<?xml version="1.0" encoding="utf-8"?>
<!-- every element of design.md section 4 -->
<config>
    <log prefix="queue_server" level="7"/>
    <node_info node_type="11" node_id="2" host="10.0.0.2" port="2222"/>
    <queue_config queue_size="5000" log_size="6000" sync_rate="700"/>
    <cluster secret="s3cret">
        <node id="3" host="10.0.0.3" port="1103"/>
        <node id="1" host="10.0.0.1" port="1101"/>
        <!-- a comment among the nodes -->
        <node id="2" host="10.0.0.2" port="1102"/>
    </cluster>
    <replication engine="raft" mode="async" forward_request="0"/>
    <storage dir="/var/lib/qserver/node2" fsync="always"/>
    <limits max_request_size="1024"/>
    <virtual_queue name="test">
        <queue name="test1"/>
        <queue name="test2"/>
    </virtual_queue>
    <virtual_queue name="fan">
        <queue name="a"/>
    </virtual_queue>
    <queue name="a" max_size="500" max_deliveries="5" dead_letter="a.dead" dedup_window="60"/>
    <queue name="test1" dedup_window="0"/>
</config>
"""


def test_full_xml():
    cfg = parse_xml(FULL_XML, "full.xml")
    assert cfg == Config(
        source="full.xml",
        log_prefix="queue_server",
        log_level=logging.DEBUG,
        node_type=11,
        node_id=2,
        host="10.0.0.2",
        port=2222,
        queue_size=5000,
        log_size=6000,
        sync_rate=700,
        peers=(PeerConfig(node_id=1, host="10.0.0.1", port=1101),
               PeerConfig(node_id=2, host="10.0.0.2", port=1102),
               PeerConfig(node_id=3, host="10.0.0.3", port=1103)),
        secret="s3cret",
        virtual_queues={"test": ("test1", "test2"), "fan": ("a",)},
        queue_defaults={"a": {"max_size": 500, "max_deliveries": 5, "dead_letter": "a.dead",
                              "dedup_window_ms": 60_000},
                        "test1": {"dedup_window_ms": 0}},
        engine=Engine.RAFT,
        mode=Mode.ASYNC,
        forward_request=False,
        storage_dir="/var/lib/qserver/node2",
        fsync=Fsync.ALWAYS,
        max_request_size=1024,
    )
    assert cfg.max_udp_request_size == 1024


def test_full_xml_as_bytes():
    assert parse_xml(FULL_XML.encode(), "full.xml") == parse_xml(FULL_XML, "full.xml")


def test_queue_server_example_sections():
    # queue_server's README, verbatim (host 0.0.0.0, its own port numbers).
    text = """<config>
    <log prefix="queue_server" level="5" />
    <node_info node_type="10" node_id="1" host="0.0.0.0" port="1111" />
    <queue_config queue_size="10000"  log_size="100000"  sync_rate="3000" />
     <cluster>
         <node id="1" host="127.0.0.1" port="1101" />
         <node id="2" host="127.0.0.1" port="1102" />
         <node id="3" host="127.0.0.1" port="1103" />
     </cluster>
    <virtual_queue name="test">
        <queue name="test1" />
        <queue name="test2" />
    </virtual_queue>
    </config>"""
    cfg = parse_xml(text, "qs.xml")
    assert (cfg.host, cfg.port, cfg.node_id, cfg.queue_size) == ("0.0.0.0", 1111, 1, 10000)
    assert cfg.log_level == logging.INFO
    assert [p.port for p in cfg.peers] == [1101, 1102, 1103]
    assert cfg.secret is None
    assert cfg.virtual_queues == {"test": ("test1", "test2")}


def test_default():
    cfg = Config.default()
    assert cfg.source == "<default>"
    assert (cfg.node_id, cfg.host, cfg.port) == (1, "127.0.0.1", 1111)
    assert cfg.log_prefix == "qserver" and cfg.log_level == logging.INFO
    assert cfg.peers == () and cfg.secret is None and cfg.virtual_queues == {}
    assert cfg.queue_defaults == {}
    assert (cfg.engine, cfg.mode, cfg.forward_request) == (Engine.NATIVE, Mode.QUORUM, True)
    assert (cfg.storage_dir, cfg.fsync) == (None, Fsync.BATCH)
    assert cfg.max_request_size == DEFAULT_MAX_REQUEST_SIZE == 1024 * 1024  # a 1,000-message batch
    assert cfg.max_udp_request_size == MAX_UDP_PAYLOAD  # UDP: bounded by the datagram
    assert cfg.queue_size > 0 and cfg.log_size > 0 and cfg.sync_rate > 0
    assert cfg.max_wait_s == 30  # protocol-v2: <limits max_wait>, default 30 s


@pytest.mark.parametrize("value", [0, 1, 30, 3600])
def test_max_wait(value):
    cfg = parse_xml(f'<config><limits max_wait="{value}"/></config>', "w.xml")
    assert cfg == Config(source="w.xml", max_wait_s=value)
    assert parse_json(json.dumps({"max_wait": value}), "w.json").max_wait_s == value
    assert parse_json(json.dumps({"max_wait": str(value)}), "w.json").max_wait_s == value


@pytest.mark.parametrize("value,problem", [
    ("-1", "max_wait=-1 out of range 0..3600"),
    ("3601", "max_wait=3601 out of range 0..3600"),
    ("x", "max_wait='x' is not an integer"),
    ("1.5", "max_wait='1.5' is not an integer"),
])
def test_bad_max_wait(value, problem):
    xml_error(f'<limits max_wait="{value}"/>', "limits", problem)


def test_limits_without_max_request_size_keeps_the_default():
    cfg = parse_xml('<config><limits max_wait="5"/></config>')
    assert cfg.max_request_size == DEFAULT_MAX_REQUEST_SIZE == 1_048_576
    assert parse_xml('<config><limits max_request_size="65536"/></config>').max_request_size \
        == 65536


# -- top-level <queue>: static per-queue defaults ------------------------------

def queue_defaults(body: str) -> dict:
    return parse_xml(f"<config>{body}</config>", "q.xml").queue_defaults


def test_queue_defaults_keep_only_the_attributes_given():
    assert queue_defaults('<queue name="a" max_size="10"/><queue name="b" max_deliveries="3"/>'
                          '<queue name="c" dead_letter="c-dlq"/><queue name="d"/>') == {
        "a": {"max_size": 10}, "b": {"max_deliveries": 3}, "c": {"dead_letter": "c-dlq"},
        "d": {}}


def test_queue_defaults_types():
    got = queue_defaults('<queue name="a" max_size=" 7 " max_deliveries="0" dead_letter="b"'
                         ' dedup_window="300"/>')["a"]
    assert got == {"max_size": 7, "max_deliveries": 0, "dead_letter": "b",
                   "dedup_window_ms": 300_000}
    assert [type(got[k]) for k in ("max_size", "max_deliveries", "dead_letter",
                                   "dedup_window_ms")] == [int, int, str, int]


@pytest.mark.parametrize("value,ms", [
    ("0", 0), ("1", 1000), ("1.5", 1500), (" 2.25 ", 2250), ("0.001", 1), ("0.0004", 0),
    ("0.0016", 2), (".5", 500), ("3.", 3000), ("604800", 604_800_000), ("604800.0", 604_800_000),
])
def test_queue_dedup_window_in_seconds_stored_in_ms(value, ms):
    assert queue_defaults(f'<queue name="a" dedup_window="{value}"/>') == {
        "a": {"dedup_window_ms": ms}}


def test_queue_bounds_accepted():
    assert queue_defaults(f'<queue name="a" max_size="1"/>'
                          f'<queue name="b" max_size="{2**40}" max_deliveries="{MAX_DELIVERIES}"/>'
                          f'<queue name="{"q" * 255}" dead_letter="{"d" * 255}"/>') == {
        "a": {"max_size": 1}, "b": {"max_size": 2**40, "max_deliveries": 1_000_000},
        "q" * 255: {"dead_letter": "d" * 255}}


def test_queue_beside_virtual_queues():
    # A real member of a virtual queue takes settings; the top-level <queue>
    # and the <queue> inside <virtual_queue> are different elements.
    cfg = parse_xml('<config><queue name="a" max_size="5"/>'
                    '<virtual_queue name="v"><queue name="a"/><queue name="b"/></virtual_queue>'
                    '<queue name="b" dead_letter="v2"/>'
                    '<virtual_queue name="v2"><queue name="c"/></virtual_queue></config>')
    assert cfg.virtual_queues == {"v": ("a", "b"), "v2": ("c",)}
    assert cfg.queue_defaults == {"a": {"max_size": 5}, "b": {"dead_letter": "v2"}}


@pytest.mark.parametrize("body,problem", [
    ("<queue/>", "missing attribute 'name'"),
    ('<queue max_size="5"/>', "missing attribute 'name'"),
    ('<queue name=""/>', "queue name must not be empty"),
    (f'<queue name="{"q" * 256}"/>', "queue name longer than 255 characters"),
    ('<queue name="a" size="5"/>', "unknown attribute 'size'"),
    ('<queue name="a" dedup_window_ms="5"/>', "unknown attribute 'dedup_window_ms'"),
    ('<queue name="a" paused="in"/>', "unknown attribute 'paused'"),
    ('<queue name="a"/><queue name="a" max_size="5"/>', "queue 'a' given twice"),
    ('<virtual_queue name="v"><queue name="a"/></virtual_queue><queue name="v" max_size="5"/>',
     "'v' is a virtual queue: virtual queues take no settings"),
    ('<queue name="v"/><virtual_queue name="v"><queue name="a"/></virtual_queue>',
     "'v' is a virtual queue: virtual queues take no settings"),
    ('<queue name="a" max_size="0"/>', f"max_size=0 out of range 1..{2**40}"),
    (f'<queue name="a" max_size="{2**40 + 1}"/>', f"max_size={2**40 + 1} out of range"),
    ('<queue name="a" max_size="-1"/>', "max_size=-1 out of range"),
    ('<queue name="a" max_size="ten"/>', "max_size='ten' is not an integer"),
    ('<queue name="a" max_size="1.5"/>', "max_size='1.5' is not an integer"),
    ('<queue name="a" max_size=""/>', "max_size='' is not an integer"),
    ('<queue name="a" max_deliveries="-1"/>', "max_deliveries=-1 out of range 0..1000000"),
    ('<queue name="a" max_deliveries="1000001"/>',
     "max_deliveries=1000001 out of range 0..1000000"),
    ('<queue name="a" max_deliveries="x"/>', "max_deliveries='x' is not an integer"),
    ('<queue name="a" dead_letter=""/>', "dead_letter must not be empty"),
    (f'<queue name="a" dead_letter="{"d" * 256}"/>', "dead_letter longer than 255 characters"),
    ('<queue name="a" dead_letter="a"/>',
     "dead_letter='a': a queue cannot be its own dead-letter queue"),
    (('<virtual_queue name="v"><queue name="b"/><queue name="a"/></virtual_queue>'
      '<queue name="a" dead_letter="v"/>'),
     "dead_letter='v': virtual queue 'v' includes 'a' itself"),
    ('<queue name="a" dedup_window="-1"/>', "dedup_window=-1 out of range 0..604800 seconds"),
    ('<queue name="a" dedup_window="604800.5"/>',
     "dedup_window=604800.5 out of range 0..604800 seconds"),
    ('<queue name="a" dedup_window="1000000"/>', "dedup_window=1000000 out of range"),
    ('<queue name="a" dedup_window=""/>', "dedup_window='' is not a number of seconds"),
    ('<queue name="a" dedup_window="5m"/>', "dedup_window='5m' is not a number of seconds"),
    ('<queue name="a" dedup_window="nan"/>', "dedup_window='nan' is not a number of seconds"),
    ('<queue name="a" dedup_window="inf"/>', "dedup_window='inf' is not a number of seconds"),
    ('<queue name="a" dedup_window="1e3"/>', "dedup_window='1e3' is not a number of seconds"),
    ('<queue name="a" dedup_window="1_0"/>', "dedup_window='1_0' is not a number of seconds"),
    ('<queue name="a" dedup_window="."/>', "dedup_window='.' is not a number of seconds"),
    ('<queue name="a" dedup_window="\u0663"/>',
     "dedup_window='\u0663' is not a number of seconds"),
])
def test_bad_queue(body, problem):
    xml_error(body, "queue", problem)


def test_queue_takes_no_child_elements():
    xml_error('<queue name="a"><dead_letter name="b"/></queue>', "queue/dead_letter",
              "unknown element (<queue> takes only attributes)")
    assert queue_defaults('<queue name="a"><!-- a comment --></queue>') == {"a": {}}


def test_queue_errors_name_the_file(tmp_path):
    path = tmp_path / "node.xml"
    path.write_text('<config><queue name="a" max_deliveries="many"/></config>')
    assert_error(lambda: load_config(str(path)), str(path), "queue",
                 "max_deliveries='many' is not an integer")


def test_only_node_info_gives_defaults():
    cfg = parse_xml('<config><node_info node_id="1" host="127.0.0.1" port="4321"/></config>',
                    "one.xml")
    assert cfg == Config(source="one.xml", port=4321)


def test_empty_config_element_gives_defaults():
    assert parse_xml("<config/>", "empty.xml") == Config(source="empty.xml")
    assert parse_json("{}", "empty.json") == Config(source="empty.json")


def test_single_node_needs_no_cluster_and_any_node_id():
    cfg = parse_xml('<config><node_info node_id="7" port="1200"/></config>')
    assert cfg.node_id == 7 and cfg.peers == ()


def test_one_node_cluster():
    cfg = parse_xml('<config><node_info node_id="1" port="1111"/>'
                    '<cluster><node id="1" port="1101"/></cluster></config>')
    assert cfg.peers == (PeerConfig(node_id=1, host="127.0.0.1", port=1101),)


def test_attribute_values_are_trimmed_and_case_insensitive():
    cfg = parse_xml('<config><node_info port=" 1200 "/>'
                    '<replication engine=" RAFT " mode="Async" forward_request="true"/>'
                    '<storage fsync="OFF"/></config>')
    assert (cfg.port, cfg.engine, cfg.mode, cfg.forward_request, cfg.fsync) == (
        1200, Engine.RAFT, Mode.ASYNC, True, Fsync.OFF)


@pytest.mark.parametrize("value,level", [
    ("0", logging.CRITICAL), ("3", logging.ERROR), ("4", logging.WARNING), ("5", logging.INFO),
    ("6", logging.INFO), ("7", logging.DEBUG), ("debug", logging.DEBUG),
    (" Warning ", logging.WARNING), ("warn", logging.WARNING), ("error", logging.ERROR),
    ("critical", logging.CRITICAL), ("info", logging.INFO),
])
def test_log_levels(value, level):
    assert log_level(value) == level
    assert parse_xml(f'<config><log level="{value}"/></config>').log_level == level


@pytest.mark.parametrize("value", ["8", "-1", "verbose", "", "5.0", "\u00b2", "\u0663"])
def test_bad_log_level(value):
    assert log_level(value) is None
    assert_error(lambda: parse_xml(f'<config><log level="{value}"/></config>', "f.xml"),
                 "f.xml", "log", "must be 0-7")


# -- queue_server's JSON format -------------------------------------------------

QS_JSON = {
    "log_prefix": "queue_server",
    "log_level": 5,
    "node_type": 10,
    "node_id": 2,
    "host": "0.0.0.0",
    "port": 1112,
    "queue_size": 10000,
    "queue_log_size": 100000,
    "queue_data_blocks": 1024,
    "queue_data_dir": "data/node2",
    "queue_sync_rate": 3000,
    "cluster_node_list": [
        {"node_id": 1, "host": "127.0.0.1", "port": 1101},
        {"node_id": 2, "host": "127.0.0.1", "port": 1102},
        {"node_id": 3, "host": "127.0.0.1", "port": 1103},
    ],
    "virtual_queue_list": [
        {"name": "test", "queue_list": ["test1", "test2"]},
    ],
}


def test_queue_server_json():
    cfg = parse_json(json.dumps(QS_JSON), "config.json")
    assert cfg == Config(
        source="config.json", log_prefix="queue_server", log_level=logging.INFO, node_type=10,
        node_id=2, host="0.0.0.0", port=1112, queue_size=10000, log_size=100000, sync_rate=3000,
        storage_dir="data/node2",
        # host 0.0.0.0: clients are sent to the node's own cluster address
        advertise_host="127.0.0.1",
        peers=(PeerConfig(node_id=1, host="127.0.0.1", port=1101),
               PeerConfig(node_id=2, host="127.0.0.1", port=1102),
               PeerConfig(node_id=3, host="127.0.0.1", port=1103)),
        virtual_queues={"test": ("test1", "test2")},
    )


def test_json_accepts_qserver_settings_and_string_numbers():
    doc = {"node_id": "1", "port": "1300", "engine": "raft", "mode": "async", "forward_request": 0,
           "fsync": "off", "max_request_size": 4096, "secret": "x", "log_level": "debug",
           "cluster_node_list": [{"node_id": 1, "port": 1301}]}
    cfg = parse_json(json.dumps(doc).encode(), "c.json")
    assert (cfg.node_id, cfg.port, cfg.engine, cfg.mode, cfg.forward_request, cfg.fsync) == (
        1, 1300, Engine.RAFT, Mode.ASYNC, False, Fsync.OFF)
    assert (cfg.max_request_size, cfg.secret, cfg.log_level) == (4096, "x", logging.DEBUG)
    assert cfg.peers == (PeerConfig(node_id=1, host="127.0.0.1", port=1301),)


def test_load_config_xml_and_json(tmp_path):
    xml_path = tmp_path / "node.xml"
    xml_path.write_text(FULL_XML)
    assert load_config(str(xml_path)) == parse_xml(FULL_XML, str(xml_path))
    json_path = tmp_path / "config.json"
    json_path.write_text("\n  " + json.dumps(QS_JSON, indent=2))  # sniffed by its first '{'
    assert load_config(str(json_path)) == parse_json(json.dumps(QS_JSON), str(json_path))


SHIPPED = sorted([*(ROOT / "config").glob("*.xml"), ROOT / "cluster.xml.example"])


@pytest.mark.parametrize("path", [p for p in SHIPPED if p.exists()], ids=lambda p: p.name)
def test_shipped_configs_load(path):
    cfg = load_config(str(path))
    assert cfg.source == str(path)
    assert not cfg.peers or len(cfg.peers) % 2 == 1


# -- errors ------------------------------------------------------------------

def assert_error(fn, file: str, element: str, problem: str) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        fn()
    exc = info.value
    assert isinstance(exc, QServerError)
    assert exc.file == file
    assert exc.element == element
    assert problem in exc.problem
    text = str(exc)
    assert file in text and element in text and problem in text
    return exc


def xml_error(body: str, element: str, problem: str, file: str = "node.xml") -> ConfigError:
    return assert_error(lambda: parse_xml(f"<config>{body}</config>", file), file, element, problem)


def json_error(doc: dict | str, element: str, problem: str,
               file: str = "config.json") -> ConfigError:
    text = doc if isinstance(doc, str) else json.dumps(doc)
    return assert_error(lambda: parse_json(text, file), file, element, problem)


CLUSTER3 = ('<cluster><node id="1" port="1101"/><node id="2" port="1102"/>'
            '<node id="3" port="1103"/></cluster>')


@pytest.mark.parametrize("text", ["", "<config>", "<config></conf>", "not xml",
                                  "<config><a></config>", "<config/><config/>"])
def test_malformed_xml(text):
    assert_error(lambda: parse_xml(text, "bad.xml"), "bad.xml", "xml", "not well-formed XML")


@pytest.mark.parametrize("body,element", [
    ("<nodeinfo/>", "nodeinfo"),
    ("<queues/>", "queues"),
    ("<cluster><peer id='1'/></cluster>", "cluster/peer"),
    ("<virtual_queue name='v'><q name='a'/></virtual_queue>", "virtual_queue/q"),
])
def test_unknown_element(body, element):
    xml_error(body, element, "unknown element")


@pytest.mark.parametrize("body,element,attr", [
    ('<log prefix="x" lvl="5"/>', "log", "lvl"),
    ('<node_info nodeid="1"/>', "node_info", "nodeid"),
    ('<queue_config queue_sz="1"/>', "queue_config", "queue_sz"),
    ('<replication engine="raft" quorum="1"/>', "replication", "quorum"),
    ('<storage path="/x"/>', "storage", "path"),
    ('<limits max_size="1000"/>', "limits", "max_size"),
    ('<cluster key="x"><node id="1" port="1101"/></cluster>', "cluster", "key"),
    ('<cluster><node id="1" port="1101" weight="2"/></cluster>', "cluster/node", "weight"),
    ('<virtual_queue name="v" kind="x"><queue name="a"/></virtual_queue>', "virtual_queue", "kind"),
    ('<virtual_queue name="v"><queue name="a" w="1"/></virtual_queue>', "virtual_queue/queue", "w"),
])
def test_unknown_attribute(body, element, attr):
    xml_error(body, element, f"unknown attribute {attr!r}")


@pytest.mark.parametrize("value", ["abc", "", "11.5", "0x10", "1111a"])
def test_non_integer_port(value):
    xml_error(f'<node_info port="{value}"/>', "node_info", f"port={value!r} is not an integer")
    xml_error(f'<cluster><node id="1" port="{value}"/></cluster>', "cluster/node",
              f"port={value!r} is not an integer")


@pytest.mark.parametrize("value", ["0", "-1", "65536", "100000"])
def test_port_out_of_range(value):
    xml_error(f'<node_info port="{value}"/>', "node_info",
              f"port={int(value)} out of range 1..65535")
    xml_error(f'<cluster><node id="1" port="{value}"/></cluster>', "cluster/node",
              "out of range 1..65535")


def test_port_bounds_accepted():
    assert parse_xml('<config><node_info port="1"/></config>').port == 1
    assert parse_xml('<config><node_info port="65535"/></config>').port == 65535


@pytest.mark.parametrize("body,element,problem", [
    ('<replication engine="paxos"/>', "replication", "engine='paxos' must be one of native|raft"),
    ('<replication mode="sync"/>', "replication", "mode='sync' must be one of quorum|async"),
    ('<storage fsync="sometimes"/>', "storage",
     "fsync='sometimes' must be one of always|batch|off"),
    ('<replication engine=""/>', "replication", "must be one of native|raft"),
])
def test_bad_enum(body, element, problem):
    xml_error(body, element, problem)


@pytest.mark.parametrize("value", ["2", "-1", "maybe", ""])
def test_bad_forward_request(value):
    xml_error(f'<replication forward_request="{value}"/>', "replication",
              f"forward_request={value!r} must be 1 or 0")


def test_duplicate_node_id():
    xml_error('<cluster><node id="1" port="1101"/><node id="2" port="1102"/>'
              '<node id="2" port="1103"/></cluster>', "cluster/node", "duplicate node id 2")


def test_duplicate_node_address():
    xml_error('<cluster><node id="1" port="1101"/><node id="2" port="1101"/>'
              '<node id="3" port="1103"/></cluster>', "cluster/node",
              "duplicate address 127.0.0.1:1101")


@pytest.mark.parametrize("n", [2, 4])
def test_even_number_of_nodes(n):
    nodes = "".join(f'<node id="{i}" port="{1100 + i}"/>' for i in range(1, n + 1))
    xml_error(f"<cluster>{nodes}</cluster>", "cluster",
              f"{n} nodes: a cluster needs an odd number of nodes")


def test_node_id_not_in_cluster():
    xml_error('<node_info node_id="4"/>' + CLUSTER3, "cluster",
              "node_info node_id=4 is not one of the cluster's nodes")
    # the default node id (1) must be in the cluster too
    xml_error('<cluster><node id="2" port="1102"/><node id="3" port="1103"/>'
              '<node id="4" port="1104"/></cluster>', "cluster", "node_id=1 is not one of")


def test_internal_port_equal_to_client_port():
    xml_error('<node_info node_id="1" port="1101"/>' + CLUSTER3, "cluster",
              "node 1's internal port 1101 is its client port")


def test_missing_required_node_attributes():
    xml_error('<cluster><node port="1101"/></cluster>', "cluster/node", "missing attribute 'id'")
    xml_error('<cluster><node id="1"/></cluster>', "cluster/node", "missing attribute 'port'")


def test_empty_virtual_queue():
    xml_error('<virtual_queue name="v"></virtual_queue>', "virtual_queue",
              "virtual queue 'v' has no <queue> members")
    xml_error('<virtual_queue name="v"><!-- none --></virtual_queue>', "virtual_queue",
              "has no <queue> members")


def test_virtual_queue_listing_a_virtual_queue():
    xml_error('<virtual_queue name="v"><queue name="a"/></virtual_queue>'
              '<virtual_queue name="w"><queue name="v"/><queue name="b"/></virtual_queue>',
              "virtual_queue", "virtual queue 'w' lists virtual queue 'v'")


def test_virtual_queue_listing_itself():
    xml_error('<virtual_queue name="v"><queue name="v"/></virtual_queue>', "virtual_queue",
              "virtual queue 'v' lists virtual queue 'v'")


def test_virtual_queue_name_problems():
    xml_error('<virtual_queue><queue name="a"/></virtual_queue>', "virtual_queue",
              "missing attribute 'name'")
    xml_error('<virtual_queue name=""><queue name="a"/></virtual_queue>', "virtual_queue",
              "queue name must not be empty")
    xml_error('<virtual_queue name="v"><queue name=""/></virtual_queue>', "virtual_queue/queue",
              "queue name must not be empty")
    long_name = "v" * 256
    xml_error(f'<virtual_queue name="{long_name}"><queue name="a"/></virtual_queue>',
              "virtual_queue",
              "queue name longer than 255 characters")
    xml_error('<virtual_queue name="v"><queue name="a"/></virtual_queue>'
              '<virtual_queue name="v"><queue name="b"/></virtual_queue>', "virtual_queue",
              "duplicate virtual queue 'v'")
    xml_error('<virtual_queue name="v"><queue name="a"/><queue name="a"/></virtual_queue>',
              "virtual_queue/queue", "queue 'a' listed twice in virtual queue 'v'")


def test_empty_secret():
    xml_error('<cluster secret=""><node id="1" port="1101"/></cluster>', "cluster",
              "secret must not be empty")


@pytest.mark.parametrize("tag", ["log", "node_info", "queue_config", "replication", "storage",
                                 "limits", "cluster"])
def test_section_given_twice(tag):
    xml_error(f"<{tag}/><{tag}/>", tag, "given twice")


@pytest.mark.parametrize("body,element,problem", [
    ('<node_info node_id="0"/>', "node_info", "node_id=0 out of range"),
    ('<node_info host="my host"/>', "node_info", "is not a host name or address"),
    ('<node_info host=""/>', "node_info", "is not a host name or address"),
    ('<queue_config queue_size="0"/>', "queue_config", "queue_size=0 out of range"),
    ('<queue_config log_size="-5"/>', "queue_config", "log_size=-5 out of range"),
    ('<queue_config sync_rate="fast"/>', "queue_config", "sync_rate='fast' is not an integer"),
    ('<storage dir=" "/>', "storage", "dir must not be empty"),
    ('<limits max_request_size="10"/>', "limits", "max_request_size=10 out of range"),
    ('<limits max_request_size="1000000000"/>', "limits",
     "max_request_size=1000000000 out of range"),
])
def test_other_bad_values(body, element, problem):
    xml_error(body, element, problem)


def test_unreadable_file(tmp_path):
    missing = str(tmp_path / "nope.xml")
    assert_error(lambda: load_config(missing), missing, "file", "cannot read")
    directory = str(tmp_path)
    assert_error(lambda: load_config(directory), directory, "file", "cannot read")


@pytest.mark.skipif(os.name != "posix" or os.geteuid() == 0, reason="root reads any file")
def test_unreadable_file_permissions(tmp_path):
    path = tmp_path / "secret.xml"
    path.write_text("<config/>")
    path.chmod(0)
    try:
        assert_error(lambda: load_config(str(path)), str(path), "file", "cannot read")
    finally:
        path.chmod(0o600)


def test_load_config_errors_name_the_path(tmp_path):
    path = tmp_path / "node.xml"
    path.write_text('<config><node_info port="x"/></config>')
    assert_error(lambda: load_config(str(path)), str(path), "node_info", "is not an integer")
    jpath = tmp_path / "config.json"
    jpath.write_text('{"port": 0}')
    assert_error(lambda: load_config(str(jpath)), str(jpath), "node_info", "port=0 out of range")
    bad = tmp_path / "bad.xml"
    bad.write_bytes(b"<config>\xff</config>")
    assert_error(lambda: load_config(str(bad)), str(bad), "xml", "not well-formed XML")


# -- JSON errors ---------------------------------------------------------------

@pytest.mark.parametrize("text", ["", "{", "{'a': 1}", '{"port": 1,}'])
def test_json_malformed(text):
    json_error(text, "json", "not valid JSON")


@pytest.mark.parametrize("text", ["[]", "1", '"x"', "null"])
def test_json_top_level_not_an_object(text):
    json_error(text, "json", "the top level must be an object")


def test_json_errors():
    json_error({"prot": 1111}, "prot", "unknown setting")
    json_error({"port": "abc"}, "node_info", "port='abc' is not an integer")
    json_error({"port": 70000}, "node_info", "port=70000 out of range 1..65535")
    json_error({"port": True}, "node_info", "port=True is not an integer")
    json_error({"port": 1.5}, "node_info", "is not an integer")
    json_error({"port": [1]}, "port", "must be a number or a string")
    json_error({"engine": "paxos"}, "replication", "must be one of native|raft")
    json_error({"fsync": "never"}, "storage", "must be one of always|batch|off")
    json_error({"max_wait": 99999}, "limits", "max_wait=99999 out of range 0..3600")
    json_error({"max_wait": True}, "limits", "max_wait=True is not an integer")
    json_error({"forward_request": 2}, "replication", "forward_request=2 must be 1 or 0")
    json_error({"secret": ""}, "cluster", "secret must not be empty")
    json_error({"cluster_node_list": {}}, "cluster_node_list", "must be a list")
    json_error({"cluster_node_list": [1]}, "cluster_node_list", "each node must be an object")
    json_error({"cluster_node_list": [{"node_id": 1, "port": 1101, "weight": 1}]},
               "cluster_node_list", "unknown attribute 'weight'")
    json_error({"cluster_node_list": [{"node_id": 1, "port": 1101}, {"node_id": 1, "port": 1102},
                                      {"node_id": 3, "port": 1103}]},
               "cluster_node_list", "duplicate node id 1")
    json_error({"cluster_node_list": [{"node_id": 1, "port": 1101}, {"node_id": 2, "port": 1102}]},
               "cluster", "2 nodes: a cluster needs an odd number of nodes")
    json_error({"node_id": 5, "cluster_node_list": [{"node_id": 1, "port": 1101}]},
               "cluster", "node_id=5 is not one of the cluster's nodes")
    json_error({"virtual_queue_list": {}}, "virtual_queue_list", "must be a list")
    json_error({"virtual_queue_list": [{"name": "v", "queue_list": "a"}]}, "virtual_queue_list",
               "each entry must be {name, queue_list: [...]}")
    json_error({"virtual_queue_list": [{"name": "v", "queue_list": []}]}, "virtual_queue_list",
               "virtual queue 'v' has no <queue> members")
    json_error({"virtual_queue_list": [{"name": "v"}]}, "virtual_queue_list",
               "has no <queue> members")
    json_error({"virtual_queue_list": [{"name": "v", "queue_list": ["a"]},
                                       {"name": "w", "queue_list": ["v"]}]},
               "virtual_queue", "virtual queue 'w' lists virtual queue 'v'")


def test_json_ignores_queue_data_blocks_only():
    assert parse_json('{"queue_data_blocks": 99}', "c.json") == Config(source="c.json")
