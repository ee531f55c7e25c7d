"""Leader transfer in the native core (NativeCore.transfer_leader, Raft's
TimeoutNow), without I/O: on single cores stepped by hand, and on small
clusters of the simulated network (tests/sim.py), whose Checker verifies
design.md's invariants 1 to 4 after every delivery. Virtual time: every
duration asserted here is the simulation's, not a machine's."""

from __future__ import annotations

import importlib.util
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from qserver.engines.base import LeaderInfo
from qserver.engines.messages import (
    Push,
    PushReply,
    TimeoutNow,
    VoteReply,
    VoteRequest,
    message_from_peer,
    message_from_wire,
    message_to_wire,
)
from qserver.engines.native.core import NativeCore, Role, Timing
from qserver.errors import InvariantError
from qserver.state.entries import Produce
from qserver.state.log import Log
from qserver.state.store import Store
from qserver.wire.requests import ProduceRequest
from sim import Network, run_schedule

NOW = 1_700_000_000_000
E = 300  # the sim's election_ms (Timing(heartbeat_ms=50, election_ms=300, pull_retry_ms=100))
REPO = Path(__file__).resolve().parent.parent
# The last commit before leader transfer: its messages.py is the previous
# release's decoder.
PREVIOUS_RELEASE = "74bfb49"


# -- helpers ---------------------------------------------------------------------


def entry(c: NativeCore, data: str) -> Produce:
    produced = c.store.decide_produce(ProduceRequest(queue="q", data=data, delay_s=None,
                                                     ttl_s=None, retry_s=0), NOW)
    assert isinstance(produced, Produce)
    return produced


def lone_core(node_id: int, peers: list[int], **kwargs) -> NativeCore:
    return NativeCore(node_id=node_id, peer_ids=peers, store=Store(queue_size=10_000), log=Log(),
                      me=LeaderInfo(node_id=node_id, host="127.0.0.1", port=1000 + node_id),
                      rng=random.Random(node_id), now_ms=NOW, **kwargs)


def master_of_three(**kwargs) -> NativeCore:
    m = lone_core(1, [1, 2, 3], **kwargs)
    m.vote_id = 1
    m._become_master(NOW)  # as if elected (elections are tested in test_sim_*)
    m.take_ready(NOW)  # the Noop, written and pushed
    return m


def cluster(n: int = 3, seed: int = 1, **kwargs) -> tuple[Network, int]:
    net = Network(n, seed, **kwargs)
    assert net.run_until(net.converged, 10_000)
    return net, net.master()


def produce(net: Network, node: int, data: str) -> list:
    """A client produce on master `node`, as service.py does it; its answer
    goes into the returned list."""
    core = net.core(node)
    results: list = []
    net.propose(node, entry(core, data), results)
    return results


def produce_all(net: Network, node: int, count: int, prefix: str = "m") -> list[list]:
    out = [produce(net, node, f"{prefix}{k}") for k in range(count)]
    assert net.run_until(lambda: all(out), 5_000)
    assert all(r == [(r[0][0], None)] for r in out), out
    return out


def stored(net: Network, node: int) -> set[str]:
    q = net.core(node).store.queues.get("q")
    if q is None:
        return set()
    return {(m[0] if type(m) is tuple else m.data) for m in q.messages.values()}


def transfer(net: Network, master: int, target: int, max_ms: int = 5_000) -> tuple[list, int]:
    """Ask `master` to hand its role to `target`; run until it answers.
    Returns (the answers, virtual ms it took)."""
    results: list = []
    start = net.now
    net.transfer(master, target, results)
    assert net.run_until(lambda: bool(results), max_ms), "the transfer never ended"
    return results, net.now - start


# -- the messages ------------------------------------------------------------------


def test_timeout_now_and_the_transfer_vote_request_on_the_wire():
    t = TimeoutNow(vote_id=4, node_id=1, last_vote_id=4, last_trans_id=17)
    assert message_to_wire(t) == [14, 4, 1, 4, 17]
    assert message_from_wire(message_to_wire(t)) == t
    v = VoteRequest(vote_id=5, node_id=2, last_vote_id=4, last_trans_id=17, pre=False,
                    transfer=True)
    assert len(message_to_wire(v)) == 7 and message_from_wire(message_to_wire(v)) == v
    # every other vote request keeps the previous release's six fields
    plain = VoteRequest(vote_id=5, node_id=2, last_vote_id=4, last_trans_id=17, pre=True)
    assert message_to_wire(plain) == [3, 5, 2, 4, 17, True]
    assert message_from_wire([3, 5, 2, 4, 17, True]) == plain
    for bad in ([14, 4, 1, 4], [14, 4, 1, 4, 17, 0], [14, 4, 1, -1, 17],
                [3, 5, 2, 4, 17, False, 1]):
        with pytest.raises(ValueError):
            message_from_wire(bad)


def previous_release_messages():
    """qserver/engines/messages.py as the previous release shipped it
    (from git), loaded as a module; skips where there is no git history."""
    git = shutil.which("git")
    if git is None or not (REPO / ".git").exists():
        pytest.skip("no git history to take the previous release from")
    proc = subprocess.run([git, "-C", str(REPO), "show",
                           f"{PREVIOUS_RELEASE}:qserver/engines/messages.py"],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        pytest.skip(f"commit {PREVIOUS_RELEASE} not in this history")
    name = "qserver.engines._messages_previous_release"
    spec = importlib.util.spec_from_loader(name, loader=None)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    module.__package__ = "qserver.engines"  # its relative imports resolve to ours
    sys.modules[name] = module
    try:
        exec(compile(proc.stdout, f"{PREVIOUS_RELEASE}:messages.py", "exec"), module.__dict__)
    finally:
        del sys.modules[name]
    return module


def test_a_node_of_the_previous_release_drops_the_new_messages_politely():
    """It decodes neither TimeoutNow nor a transfer's vote request: its
    message_from_peer gives a reason (its adapters log it and drop the
    message; the link stays up), never an exception; the vote requests of
    ordinary elections still reach it unchanged."""
    old = previous_release_messages()
    for msg in (TimeoutNow(vote_id=4, node_id=2, last_vote_id=4, last_trans_id=17),
                VoteRequest(vote_id=5, node_id=2, last_vote_id=4, last_trans_id=17, pre=False,
                            transfer=True)):
        reason = old.message_from_peer(2, message_to_wire(msg))
        assert isinstance(reason, str) and "unknown message tag" in reason
    plain = VoteRequest(vote_id=5, node_id=2, last_vote_id=4, last_trans_id=17, pre=False)
    decoded = old.message_from_peer(2, message_to_wire(plain))
    assert not isinstance(decoded, str) and decoded.vote_id == 5 and not decoded.pre
    # and ours still reads what it sends
    assert message_from_peer(2, message_to_wire(plain)) == plain


# -- one core, stepped by hand ---------------------------------------------------------


def test_asked_of_a_slave_of_itself_or_of_a_stranger():
    answers: list = []

    def done(leader, reason):
        answers.append((leader, reason))

    s = lone_core(2, [1, 2, 3])
    s.transfer_leader(3, done, NOW)
    m = master_of_three()
    m.transfer_leader(1, done, NOW)
    m.transfer_leader(7, done, NOW)
    for c in (s, m):
        for answer in c.take_ready(NOW).answers:
            answer()
    assert answers == [(None, "not master"), (1, None), (None, "no such node")]
    assert m.transfer is None and not m.transferring  # nothing under way: writes go on
    m.propose(entry(m, "a"), done)
    assert m.log.last_trans_id == 2


def test_writes_are_refused_at_once_during_a_transfer_and_reads_go_on():
    m = master_of_three()
    m.transfer_leader(2, lambda *a: None, NOW)
    assert m.transferring
    refused: list = []
    m.propose(entry(m, "a"), lambda result, error: refused.append((result, error)))
    assert refused == [(None, "no leader")]  # at once: Service._move relies on it
    assert m.log.last_trans_id == 1 and not m.take_ready(NOW).records
    read: list = []
    m.read_index(lambda result, error: read.append(error))
    m.step(PushReply(vote_id=1, node_id=2, match_id=1, read_round=m.read_round), NOW)
    for answer in m.take_ready(NOW).answers:
        answer()
    assert read == [None]


def test_append_now_is_off_during_a_transfer():
    m = master_of_three(async_mode=True)
    m.append_now(entry(m, "a"))
    m.take_ready(NOW)
    m.transfer_leader(2, lambda *a: None, NOW)
    with pytest.raises(InvariantError):
        m.append_now(entry(m, "b"))


def test_timeout_now_goes_once_the_target_holds_everything_committed():
    m = master_of_three()
    m.propose(entry(m, "a"), lambda *a: None)
    m.take_ready(NOW)  # trans_id 2 pushed
    ended: list = []
    m.transfer_leader(2, lambda *a: ended.append(a), NOW)
    ready = m.take_ready(NOW)
    assert [type(msg) for to, msg in ready.messages if to == 2] == [Push]  # where we are
    m.step(PushReply(vote_id=1, node_id=3, match_id=2), NOW + 1)  # 3 commits it, 2 lags
    assert m.commit_id == 2
    assert not [msg for _, msg in m.take_ready(NOW + 1).messages if type(msg) is TimeoutNow]
    m.step(PushReply(vote_id=1, node_id=2, match_id=2), NOW + 2)
    sent = [(to, msg) for to, msg in m.take_ready(NOW + 2).messages if type(msg) is TimeoutNow]
    assert sent == [(2, TimeoutNow(vote_id=1, node_id=1, last_vote_id=1, last_trans_id=2))]
    # sent again with the heartbeats, in case it was lost
    m.tick(NOW + 200)
    assert [to for to, msg in m.take_ready(NOW + 200).messages if type(msg) is TimeoutNow] == [2]
    # the target's election (a transfer's) deposes the master, which votes
    m.step(VoteRequest(vote_id=2, node_id=2, last_vote_id=1, last_trans_id=2, pre=False,
                       transfer=True), NOW + 201)
    assert m.role is Role.SLAVE and m.voted_for == 2
    assert VoteReply(vote_id=2, node_id=1, granted=True, pre=False) in [
        msg for _, msg in m.take_ready(NOW + 201).messages]
    assert not ended  # not before the new master shows itself
    m.step(Push(vote_id=2, node_id=2, prev_vote_id=1, prev_trans_id=2, records=(), commit_id=2,
                last_trans_id=3), NOW + 203)
    for answer in m.take_ready(NOW + 203).answers:
        answer()
    assert ended == [(2, None)] and m.transfer is None


def test_a_transfer_election_is_answered_by_voters_that_hear_a_live_master():
    s = lone_core(3, [1, 2, 3])
    s.step(Push(vote_id=1, node_id=1, prev_vote_id=0, prev_trans_id=0, records=(), commit_id=0,
                last_trans_id=0), NOW)
    s.take_ready(NOW)
    plain = VoteRequest(vote_id=2, node_id=2, last_vote_id=0, last_trans_id=0, pre=False)
    s.step(plain, NOW + 10)
    assert s.vote_id == 1 and s.leader_id == 1  # refused: it hears its master
    s.step(VoteRequest(vote_id=2, node_id=2, last_vote_id=0, last_trans_id=0, pre=False,
                       transfer=True), NOW + 11)
    assert s.vote_id == 2 and s.voted_for == 2


def test_the_target_elects_itself_at_once_without_pre_vote():
    s = lone_core(2, [1, 2, 3])
    s.step(Push(vote_id=1, node_id=1, prev_vote_id=0, prev_trans_id=0, records=(), commit_id=0,
                last_trans_id=0), NOW)
    s.take_ready(NOW)
    s.step(TimeoutNow(vote_id=1, node_id=1, last_vote_id=0, last_trans_id=0), NOW + 5)
    assert s.role is Role.CANDIDATE and s.vote_id == 2 and s.voted_for == 2
    reqs = [msg for _, msg in s.take_ready(NOW + 5).messages if type(msg) is VoteRequest]
    assert len(reqs) == 2 and all(r.transfer and not r.pre and r.vote_id == 2 for r in reqs)


@pytest.mark.parametrize("case", ["stale vote", "not its master", "log behind"])
def test_a_timeout_now_it_cannot_act_on_is_ignored(case):
    s = lone_core(2, [1, 2, 3])
    s.step(Push(vote_id=3, node_id=1, prev_vote_id=0, prev_trans_id=0, records=(), commit_id=0,
                last_trans_id=0), NOW)
    s.take_ready(NOW)
    msg = {"stale vote": TimeoutNow(vote_id=2, node_id=1, last_vote_id=0, last_trans_id=0),
           "not its master": TimeoutNow(vote_id=3, node_id=3, last_vote_id=0, last_trans_id=0),
           "log behind": TimeoutNow(vote_id=3, node_id=1, last_vote_id=3, last_trans_id=5)}[case]
    s.step(msg, NOW + 5)
    assert s.role is Role.SLAVE and s.vote_id == 3 and s.leader_id == 1
    assert not [m for _, m in s.take_ready(NOW + 5).messages if type(m) is VoteRequest]


def test_a_second_request_joins_the_first_and_one_to_another_node_is_refused():
    m = master_of_three()
    answers: list = []
    m.transfer_leader(2, lambda *a: answers.append(("first", *a)), NOW)
    m.transfer_leader(2, lambda *a: answers.append(("second", *a)), NOW)
    m.transfer_leader(3, lambda *a: answers.append(("third", *a)), NOW)
    for answer in m.take_ready(NOW).answers:
        answer()
    assert answers == [("third", None, "transfer in progress")]
    m.tick(NOW + E * 4)  # never caught up (no reply at all)
    for answer in m.take_ready(NOW + E * 4).answers:
        answer()
    assert answers[1:] == [("first", None, "node not caught up"),
                           ("second", None, "node not caught up")]


def test_the_deadline_is_a_timer_of_the_core():
    m = master_of_three(timing=Timing(heartbeat_ms=100, election_ms=1000))
    m.transfer_leader(2, lambda *a: None, NOW + 10)
    assert m.next_deadline() <= NOW + 10 + 1000


# -- small simulated clusters -------------------------------------------------------------


@pytest.mark.parametrize("async_mode", [False, True])
@pytest.mark.parametrize("production", [False, True])
@pytest.mark.parametrize("n", [3, 5])
def test_transfer_to_a_caught_up_slave(n, production, async_mode):
    net, m = cluster(n, seed=n, async_mode=async_mode, external_snapshots=production,
                     deferred_sync=production)
    produce_all(net, m, 5)
    target = next(i for i in net.ids if i != m)
    vote = net.core(m).vote_id
    results, took = transfer(net, m, target)
    assert results == [(target, None)]
    assert net.core(target).role is Role.MASTER and net.core(target).vote_id == vote + 1
    assert took < E  # no election timeout was waited for
    assert net.core(m).role is Role.SLAVE and net.core(m).leader_id == target
    assert max(net.masters_by_vote) == vote + 1  # one election, the target's
    m2 = net.master()
    assert m2 == target
    produce_all(net, target, 3, prefix="after")
    assert net.run_until(net.converged, 5_000)
    net.checker.final_check()
    assert all(stored(net, i) == {f"m{k}" for k in range(5)} | {f"after{k}" for k in range(3)}
               for i in net.ids)


@pytest.mark.parametrize("async_mode", [False, True])
def test_transfer_to_a_lagging_slave_catches_it_up_first(async_mode):
    net, m = cluster(3, seed=7, async_mode=async_mode)
    target, other = (i for i in net.ids if i != m)
    net.cut.add((m, target))  # the target misses what follows
    produce_all(net, m, 20)
    lag = net.core(m).log.last_trans_id - net.core(target).log.last_trans_id
    assert lag >= 20
    net.heal()
    net.sent = []
    results, took = transfer(net, m, target)
    assert results == [(target, None)]
    timeout_nows = [(t, msg) for t, src, dst, msg in net.sent if type(msg) is TimeoutNow]
    assert timeout_nows, "no TimeoutNow was sent"
    # it named the old master's last entry, which the new master's Noop follows
    assert {msg.last_trans_id for _, msg in timeout_nows} == {
        net.core(target).log.last_trans_id - 1}
    assert took < 2 * E
    assert stored(net, target) >= {f"m{k}" for k in range(20)}
    net.run_until(net.converged, 5_000)
    net.checker.final_check()


def test_writes_during_a_transfer_are_refused_then_go_to_the_new_master():
    net, m = cluster(3, seed=3)
    produce_all(net, m, 3)
    target = next(i for i in net.ids if i != m)
    results: list = []
    net.transfer(m, target, results)
    refused = produce(net, m, "during")
    assert refused == [(None, "no leader")]
    assert net.run_until(lambda: bool(results), 5_000) and results == [(target, None)]
    assert produce(net, m, "late") == [(None, "not master")]
    produce_all(net, target, 1, prefix="after")
    net.run_until(net.converged, 5_000)
    assert "during" not in stored(net, target) and "after0" in stored(net, target)


def test_target_unreachable_not_caught_up_the_old_master_resumes():
    net, m = cluster(3, seed=4)
    target = next(i for i in net.ids if i != m)
    net.isolate(target)
    produce_all(net, m, 2)  # the other slave makes the majority
    results, took = transfer(net, m, target)
    assert results == [(None, "node not caught up")] and E <= took <= E + 60
    assert net.core(m).role is Role.MASTER and not net.core(m).transferring
    produce_all(net, m, 2, prefix="resumed")  # writes are taken again
    net.heal()
    assert net.run_until(net.converged, 5_000)
    net.checker.final_check()


def test_timeout_now_lost_the_transfer_times_out_and_the_old_master_resumes():
    net, m = cluster(3, seed=5)
    produce_all(net, m, 2)
    target = next(i for i in net.ids if i != m)
    net.drop_if = lambda src, dst, msg: type(msg) is TimeoutNow  # a partition, for it alone
    vote = net.core(m).vote_id
    results, took = transfer(net, m, target)
    assert results == [(None, "transfer timed out")] and took <= E + 60
    assert net.core(m).role is Role.MASTER and net.core(m).vote_id == vote
    assert net.core(target).vote_id == vote  # it never stood
    produce_all(net, m, 2, prefix="resumed")
    net.drop_if = None
    results, _ = transfer(net, m, target)  # and a later transfer works
    assert results == [(target, None)]
    net.run_until(net.converged, 5_000)
    net.checker.final_check()


def test_partition_after_the_hand_over_an_election_settles_it():
    """The target stands and the network splits at once: whoever wins, a
    majority elects one master and nothing acknowledged is lost."""
    net, m = cluster(5, seed=6)
    acked = produce_all(net, m, 4)
    target = next(i for i in net.ids if i != m)
    results: list = []
    net.transfer(m, target, results)
    net.hold_if = lambda src, dst, msg: type(msg) is VoteRequest and msg.transfer and dst != m
    assert net.run_until(lambda: bool(net.held), 2_000)
    net.partition({m, target})  # the target has only the old master's vote
    net.hold_if = None
    net.release()
    assert net.run_until(lambda: bool(results), 5_000)
    assert results[0][1] in (None, "transfer timed out")
    net.heal()
    assert net.run_until(net.converged, 10_000)
    net.checker.final_check()
    assert all(stored(net, i) >= {f"m{k}" for k in range(4)} for i in net.ids), acked


def test_a_target_of_the_previous_release_the_transfer_times_out():
    """It drops TimeoutNow as an unknown message (its decoder: see
    test_a_node_of_the_previous_release_drops_the_new_messages_politely):
    the transfer times out, the old master keeps its role and its writes."""
    net, m = cluster(3, seed=8)
    old = next(i for i in net.ids if i != m)
    net.drop_if = lambda src, dst, msg: dst == old and (
        type(msg) is TimeoutNow or (type(msg) is VoteRequest and msg.transfer))
    results, _ = transfer(net, m, old)
    assert results == [(None, "transfer timed out")]
    assert net.core(m).role is Role.MASTER
    produce_all(net, m, 2)


def test_a_voter_of_the_previous_release_does_not_stop_the_transfer():
    """Three nodes, the third of the previous release: it drops the
    transfer's vote request, and the target wins with the old master's
    vote."""
    net, m = cluster(3, seed=9)
    target, old = (i for i in net.ids if i != m)
    net.drop_if = lambda src, dst, msg: dst == old and (
        type(msg) is TimeoutNow or (type(msg) is VoteRequest and msg.transfer))
    results, _ = transfer(net, m, target)
    assert results == [(target, None)]
    net.drop_if = None
    assert net.run_until(net.converged, 5_000) and net.master() == target
    net.checker.final_check()


def test_a_crashed_target_an_election_settles_it():
    net, m = cluster(3, seed=10)
    produce_all(net, m, 3)
    target = next(i for i in net.ids if i != m)
    results: list = []
    net.transfer(m, target, results)
    net.crash(target)
    assert net.run_until(lambda: bool(results), 5_000)
    assert results[0][1] in (None, "transfer timed out", "node not caught up")
    assert net.run_until(lambda: net.master() is not None, 5_000)
    net.start(target)
    assert net.run_until(net.converged, 10_000)
    net.checker.final_check()
    assert stored(net, net.master()) >= {f"m{k}" for k in range(3)}


@pytest.mark.parametrize("async_mode", [False, True])
def test_round_robin_transfers_under_load(async_mode):
    """Twenty transfers in turn to each other node while clients write:
    each hands the role over within an election timeout (virtual time),
    and every acknowledged produce is on every node at the end."""
    net, m = cluster(3, seed=11, async_mode=async_mode)
    acked: set[str] = set()
    pending: dict[str, list] = {}
    counter = 0
    for k in range(20):
        m = net.master()
        for _ in range(5):
            counter += 1
            data = f"w{counter}"
            pending[data] = produce(net, m, data)
        target = net.ids[(net.ids.index(m) + 1) % len(net.ids)]
        results, took = transfer(net, m, target)
        assert results == [(target, None)], (k, results)
        assert took < E, (k, took)
        for data, res in list(pending.items()):
            if res:
                if res[0][1] is None:
                    acked.add(data)
                del pending[data]
    assert net.run_until(net.converged, 5_000)
    net.checker.final_check()
    assert len(acked) >= 80
    for i in net.ids:
        assert stored(net, i) >= acked


def test_random_schedules_with_transfers_pass():
    """A few seeds of the randomized schedules with transfers forced on
    (test_sim_cluster runs thousands); Transfers checks each answer."""
    outcomes: dict = {}
    for seed in range(12):
        for n, async_mode in ((3, False), (3, True), (5, False)):
            stats = run_schedule(seed, n=n, async_mode=async_mode, transfers=True)
            for key, value in stats.counters.items():
                if key.startswith("transfers_"):
                    outcomes[key] = outcomes.get(key, 0) + value
    assert outcomes.get("transfers_to_target", 0) > 0
