"""Every configuration file the repository ships parses, and says what the
README says it does."""

from pathlib import Path

import pytest

from qserver.config import Config, Engine, Fsync, Mode, load_config, parse_xml

ROOT = Path(__file__).resolve().parent.parent


def test_example_sets_every_setting():
    c = load_config(str(ROOT / "cluster.xml.example"))
    assert (c.node_id, c.host, c.port) == (1, "127.0.0.1", 1111)
    assert [p.port for p in c.peers] == [1101, 1102, 1103]
    assert c.secret and c.engine is Engine.NATIVE and c.mode is Mode.QUORUM
    assert c.forward_request and c.storage_dir == "data/node1" and c.fsync is Fsync.BATCH
    assert c.max_request_size == 1_048_576 and c.virtual_queues == {"test": ("test1", "test2")}
    assert c.queue_defaults == {}  # its <queue> example is commented out
    assert (c.queue_size, c.log_size, c.sync_rate) == (1_000_000, 100_000, 3000)
    assert (c.http_host, c.http_port, c.metrics_per_queue) == ("127.0.0.1", 1121, True)


def test_example_queue_element_in_its_comment_parses():
    # The per-queue <queue> example is commented out; uncommented, it is valid.
    text = (ROOT / "cluster.xml.example").read_text()
    example = text.split("For example:", 1)[1].split("-->", 1)[0]
    c = parse_xml(f"<config>{example}</config>", "cluster.xml.example")
    assert c.queue_defaults == {"orders": {"max_size": 100_000, "max_deliveries": 5,
                                           "dead_letter": "orders.dead",
                                           "dedup_window_ms": 300_000}}


def test_single_matches_the_embedded_default():
    c = load_config(str(ROOT / "config" / "single.xml"))
    d = Config.default()
    assert (c.host, c.port, c.node_id, c.peers) == (d.host, d.port, d.node_id, d.peers)


@pytest.mark.parametrize("i", [1, 2, 3])
def test_local_cluster_nodes(i):
    c = load_config(str(ROOT / "config" / f"node{i}.xml"))
    assert c.node_id == i and c.port == 1110 + i
    assert (c.http_host, c.http_port) == ("127.0.0.1", 1120 + i)  # make run: metrics, probes
    assert [(p.node_id, p.port) for p in c.peers] == [(1, 1101), (2, 1102), (3, 1103)]
