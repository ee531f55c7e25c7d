import pytest

from procs import Cluster, NodeProcess, clients_closed_at_end, free_port, write_config


@pytest.fixture(autouse=True)
def close_clients():
    """Every procs.TcpClient/UdpClient a test leaves open is closed when it ends."""
    with clients_closed_at_end():
        yield


@pytest.fixture
def procs():
    """Start qserver processes; every one is killed when the test ends."""
    started: list[NodeProcess] = []

    def start(tmp_path, extra: str = "", config_text: str | None = None, name: str = "node.xml"):
        for attempt in range(3):  # a free port can be taken between asking and binding
            port = free_port()
            path = tmp_path / name
            if config_text is None:
                write_config(path, port, extra)
            else:
                path.write_text(config_text.replace("{port}", str(port)))
            node = NodeProcess(path, port)
            started.append(node)
            try:
                node.wait_ready()
                return node
            except RuntimeError as exc:
                if "cannot listen" not in str(exc) or attempt == 2:
                    raise
        raise AssertionError("unreachable")

    yield start
    for node in started:
        node.kill()


@pytest.fixture
def node(procs, tmp_path):
    return procs(tmp_path)


@pytest.fixture
def cluster(tmp_path):
    """Start local clusters of `qserver run` processes (`cluster(engine=...,
    extra=...)` as procs.Cluster takes them, started and waited for); every
    process is killed when the test ends."""
    clusters: list[Cluster] = []

    def make(**kw) -> Cluster:
        c = Cluster(tmp_path, **kw)
        clusters.append(c)
        c.start_all()
        return c

    yield make
    for c in clusters:
        c.stop_all()
