"""`qserver local-cluster` on configurations with <security> and <tls>: it
finds the master with the token and CA its nodes' own configuration names
(a bare socket would be refused), and its banner shows `qserver produce`
and `consume` commands with the options those nodes need."""

from __future__ import annotations

import subprocess
import sys

from procs import free_port, read_until, stop
from tlsutil import make_pki

TOKEN = "local-cluster-test-token-0123456789"


def test_local_cluster_with_tokens_and_tls(tmp_path):
    pki = make_pki(tmp_path / "pki")
    clients = [free_port() for _ in range(3)]
    internal = [free_port() for _ in range(3)]
    nodes = "".join(f'<node id="{i + 1}" host="127.0.0.1" port="{internal[i]}"/>'
                    for i in range(3))
    paths = []
    for i in range(3):
        path = tmp_path / f"node{i + 1}.xml"
        path.write_text(
            f'<config><node_info node_id="{i + 1}" host="127.0.0.1" port="{clients[i]}"/>'
            f'<cluster secret="local-cluster-test">{nodes}</cluster>'
            f'<security><token name="monitor" token="{TOKEN}" actions="read"/></security>'
            f'<tls cert="{pki.server_cert}" key="{pki.server_key}" ca="{pki.ca}" '
            f'client_cert="required"/></config>')
        paths.append(str(path))
    proc = subprocess.Popen([sys.executable, "-m", "qserver", "local-cluster", *paths],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        out = read_until(proc, b"Ctrl-C stops all nodes.", deadline_s=90).decode()
        status, err = stop(proc)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert "master: node " in out, out
    assert f"produce demo hello -s 127.0.0.1:{clients[0]} --token TOKEN --tls --tls-ca CA" in out
    assert f"consume demo -s 127.0.0.1:{clients[2]} --token TOKEN --tls --tls-ca CA" in out
    assert "nc -q1" not in out
    assert status == 0, err
