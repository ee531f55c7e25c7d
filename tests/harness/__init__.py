"""A fault-injection harness on real processes (issue 12, point 4).

Theory of operation
-------------------
A three-node cluster of real `qserver run` processes on loopback, every
node-to-node link (the internal port, and with the raft engine the raft
port) behind a TCP proxy that can pass, drop one or both directions, or
reset (`proxy`, a process of its own, so that a stopped node or a busy test
never stalls it; `nodes.FaultCluster` wires it in with `<node dial
raft_dial>`). Client threads (`workload`) produce (retry=0 and retry=5),
consume and confirm against random nodes, retrying what they got no answer
for, and record every attempt with its outcome (ok, definite failure,
unknown). A nemesis (`nemesis`) kills, pauses and cuts on a seeded schedule.
After healing and draining, `checker` holds the history and the nodes'
final states against design.md's invariants and reports every violation
and availability per fault kind. `run.run` does all of it; the short run
is tests/test_fault_harness.py, the long one bench/fault_bench.py.
"""

from .checker import VIOLATION_KINDS, NodeState, Report, check, format_report
from .nemesis import FAULT_KINDS, Fault, Nemesis
from .nodes import FaultCluster
from .proxy import DROP, PASS, ProxyProcess
from .run import RunConfig, run
from .workload import History, NodeClient, Op, Outcome

__all__ = ["FAULT_KINDS", "VIOLATION_KINDS", "DROP", "PASS", "Fault", "FaultCluster", "History",
           "Nemesis", "NodeClient", "NodeState", "Op", "Outcome", "ProxyProcess", "Report",
           "RunConfig", "check", "format_report", "run"]
