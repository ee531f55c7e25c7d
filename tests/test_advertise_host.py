"""<node_info advertise_host>: the address clients are sent to (redirects,
leader_host, the leader action), never 0.0.0.0; and the parsing of <http>
and <limits max_ready_lag>."""

from __future__ import annotations

import pytest

from procs import Cluster, cluster_config, wait_until
from qserver.config import DEFAULT_MAX_READY_LAG, parse_xml
from qserver.errors import ConfigError

NODES = """<cluster secret="s">
  <node id="1" host="{h1}" port="1101"/>
  <node id="2" host="10.0.0.2" port="1102"/>
  <node id="3" host="10.0.0.3" port="1103"/>
</cluster>"""


def _cluster(node_info: str, h1: str = "10.0.0.1") -> str:
    return f"<config>{node_info}{NODES.format(h1=h1)}</config>"


def test_advertise_host_given():
    cfg = parse_xml(_cluster('<node_info node_id="1" host="0.0.0.0" port="1111" '
                             'advertise_host="q1.example.net"/>'))
    assert (cfg.host, cfg.advertise_host, cfg.client_host) == (
        "0.0.0.0", "q1.example.net", "q1.example.net")


def test_default_is_host():
    cfg = parse_xml(_cluster('<node_info node_id="1" host="10.0.0.1" port="1111"/>'))
    assert cfg.advertise_host is None
    assert cfg.client_host == "10.0.0.1"


@pytest.mark.parametrize("bind", ["0.0.0.0", "::"])
def test_any_address_in_a_cluster_advertises_the_cluster_entry(bind):
    # queue_server's own example binds 0.0.0.0: its <cluster> entry is the
    # address the other nodes (and clients) reach it at.
    cfg = parse_xml(_cluster(f'<node_info node_id="1" host="{bind}" port="1111"/>'))
    assert cfg.client_host == "10.0.0.1"


def test_any_address_everywhere_is_refused():
    with pytest.raises(ConfigError) as err:
        parse_xml(_cluster('<node_info node_id="1" host="0.0.0.0" port="1111"/>',
                           h1="0.0.0.0"), "n1.xml")
    text = str(err.value)
    assert "n1.xml" in text and "node_info" in text and "advertise_host" in text


@pytest.mark.parametrize("value", ["0.0.0.0", "::", "", "a b"])
def test_bad_advertise_host(value):
    with pytest.raises(ConfigError) as err:
        parse_xml(f'<config><node_info host="127.0.0.1" advertise_host="{value}"/></config>',
                  "n.xml")
    assert "advertise_host" in str(err.value) and "n.xml" in str(err.value)


def test_single_node_may_bind_every_address():
    cfg = parse_xml('<config><node_info host="0.0.0.0" port="1111"/></config>')
    assert cfg.client_host == "0.0.0.0"  # nothing is redirected on a single node


def test_http_and_ready_lag():
    cfg = parse_xml('<config><http host="0.0.0.0" port="1121" per_queue="0"/>'
                    '<limits max_ready_lag="50"/></config>')
    assert (cfg.http_host, cfg.http_port, cfg.metrics_per_queue, cfg.max_ready_lag) == (
        "0.0.0.0", 1121, False, 50)
    default = parse_xml("<config/>")
    assert (default.http_port, default.metrics_per_queue, default.max_ready_lag) == (
        None, True, DEFAULT_MAX_READY_LAG)


@pytest.mark.parametrize("element, problem", [
    ('<http host="127.0.0.1"/>', "missing attribute 'port'"),
    ('<http port="70000"/>', "out of range"),
    ('<http port="1121" path="/x"/>', "unknown attribute 'path'"),
    ('<limits max_ready_lag="-1"/>', "out of range"),
])
def test_http_errors(element, problem):
    with pytest.raises(ConfigError) as err:
        parse_xml(f"<config>{element}</config>", "h.xml")
    assert problem in str(err.value) and "h.xml" in str(err.value)


@pytest.mark.parametrize("engine", ["native", "raft"])
def test_clients_are_sent_to_the_advertised_host(tmp_path, engine):
    """Nodes bind every address and advertise "localhost": a slave's
    redirect and the leader action name localhost, never 0.0.0.0."""
    cluster = Cluster(tmp_path, engine=engine,
                      extra='  <replication forward_request="0"/>\n')

    def config_path(node_id: int):
        text = cluster_config(node_id, cluster.client_ports, cluster.internal_ports,
                              "test-secret", cluster.extra)
        port = cluster.port(node_id)
        text = text.replace(f'host="127.0.0.1" port="{port}"/>',
                            f'host="0.0.0.0" port="{port}" advertise_host="localhost"/>', 1)
        assert "advertise_host" in text
        path = tmp_path / f"node{node_id}.xml"
        path.write_text(text)
        return path

    cluster.config_path = config_path  # type: ignore[method-assign]
    try:
        cluster.start_all()
        master = cluster.wait_master()
        slave = next(i for i in (1, 2, 3) if i != master)
        leader = cluster.ask(slave, action=8)
        assert leader is not None
        assert (leader["code"], leader["leader_node_id"], leader["leader_host"],
                leader["leader_port"]) == (0, master, "localhost", cluster.port(master))
        redirect = cluster.ask(slave, action=1, queue="q", data="x")
        assert redirect is not None
        assert (redirect["code"], redirect["reason"]) == (-2, "redirect")
        assert redirect["leader_host"] == redirect["master_host"] == "localhost"
        assert redirect["leader_port"] == cluster.port(master)
        # monitor: each node's own address, and the master's slaves' (status
        # lists every node from them)
        for i in (1, 2, 3):
            view = cluster.ask(i, action=104)
            assert view is not None and (view["host"], view["port"]) == (
                "localhost", cluster.port(i))

        def slaves_known():
            view = cluster.ask(master, action=104)
            return {s["node_id"]: (s.get("host"), s.get("port"))
                    for s in (view or {}).get("slaves", [])}

        wait_until(lambda: all(slaves_known().get(i, (None,))[0] for i in (1, 2, 3)
                               if i != master), 30)
        assert slaves_known() == {i: ("localhost", cluster.port(i))
                                  for i in (1, 2, 3) if i != master}
    finally:
        cluster.stop_all()
