"""Snapshot + replay == the whole log (design.md section 3, issue 4).

Hypothesis builds a random history of produce/consume/confirm under moving
time, as the master decides it. For a random snapshot point k, a node's
data directory gets the records and a snapshot of the state after k
(written to real files by DiskStorage, the way a node writes its own);
recovery from that directory (snapshot decoded straight into a store, then
the log after it) must give exactly the state of applying every record.
The same holds through a snapshot received from the master (installed,
then the log after it appended) and through the fork writer's own file
function.
"""

from __future__ import annotations

import tempfile

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from qserver.state.entries import Record
from qserver.state.store import Store
from qserver.storage import DiskStorage, store_wire_iter, write_snapshot_file
from qserver.wire.requests import ConfirmRequest, ConsumeRequest, ProduceRequest

START_MS = 1_700_000_000_000
QUEUES = ("a", "b", "c")
VIRTUAL = {"ab": ("a", "b")}

step = st.one_of(
    st.tuples(st.just("produce"), st.sampled_from(QUEUES + ("ab",)), st.integers(0, 3),
              st.sampled_from([None, 5, 60]), st.sampled_from([0, 0, 2, 30])),
    st.tuples(st.just("consume"), st.sampled_from(QUEUES)),
    st.tuples(st.just("confirm"), st.sampled_from(QUEUES), st.integers(1, 40)),
    st.tuples(st.just("advance"), st.integers(1, 20_000)),
)


def history(steps) -> list[Record]:
    """The records a master would write for `steps` (decided, then applied)."""
    store = Store(queue_size=1000, virtual_queues=VIRTUAL)
    now = START_MS
    records: list[Record] = []
    vote = 1
    for s in steps:
        kind = s[0]
        if kind == "advance":
            now += s[1]
            if s[1] % 7 == 0:
                vote += 1  # an election now and then: records carry their epoch
            continue
        if kind == "produce":
            _, queue, delay, ttl, retry = s
            entry = store.decide_produce(ProduceRequest(
                queue=queue, data=f"d{len(records)}", delay_s=delay, ttl_s=ttl, retry_s=retry), now)
        elif kind == "consume":
            entry = store.decide_consume(ConsumeRequest((s[1],), None, 0, 0, False), now, 1)
        else:
            entry = store.decide_confirm(ConfirmRequest(queue=s[1], msg_id=s[2]))
        if entry is None or isinstance(entry, str):
            continue  # nothing to change: not logged
        store.apply(entry)
        records.append(Record(len(records) + 1, vote, entry))
    return records


def applied(records) -> Store:
    store = Store(queue_size=1000, virtual_queues=VIRTUAL)
    for r in records:
        store.apply(r.entry)
    return store


def recovered(directory: str) -> tuple[Store, int]:
    storage = DiskStorage.open(directory, "off")
    store = Store(queue_size=1000, virtual_queues=VIRTUAL)
    try:
        got = storage.recover(sink_factory=store.snapshot_loader)
        last = 0
        if got.snapshot is not None:
            store.load_wire(got.snapshot[2])
            last = got.snapshot[0]
        for r in got.records:
            assert r.trans_id == last + 1
            store.apply(r.entry)
            last = r.trans_id
    finally:
        storage.close()
    store._check()
    return store, last


SETTINGS = settings(max_examples=60, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@SETTINGS
@given(st.lists(step, min_size=1, max_size=120), st.floats(0, 1))
def test_own_snapshot_plus_log_after_it_equals_the_whole_log(steps, where):
    records = history(steps)
    if not records:
        return
    k = int(where * len(records))
    whole = applied(records).to_wire()
    with tempfile.TemporaryDirectory() as d:
        storage = DiskStorage.open(d, "off")
        storage.recover()
        storage.append(records)
        if k:
            storage.write_snapshot(k, records[k - 1].vote_id, store_wire_iter(applied(records[:k])))
        storage.close()
        store, last = recovered(d)
    assert last == len(records)
    assert store.to_wire() == whole


@SETTINGS
@given(st.lists(step, min_size=1, max_size=120), st.floats(0, 1))
def test_installed_snapshot_plus_later_records_equals_the_whole_log(steps, where):
    """A slave that installs the master's snapshot at k (its own log, here a
    stale one from another epoch, is dropped) and appends what follows."""
    records = history(steps)
    if not records:
        return
    k = max(1, int(where * len(records)))
    whole = applied(records).to_wire()
    with tempfile.TemporaryDirectory() as d:
        storage = DiskStorage.open(d, "off")
        storage.recover()
        stale = [Record(i, 99, r.entry) for i, r in enumerate(records[:k // 2], 1)]
        storage.append(stale)
        storage.install_snapshot(k, records[k - 1].vote_id, applied(records[:k]).to_wire())
        storage.append(records[k:])
        storage.close()
        store, last = recovered(d)
    assert last == len(records)
    assert store.to_wire() == whole


@SETTINGS
@given(st.lists(step, min_size=1, max_size=120), st.floats(0, 1))
def test_the_fork_writers_file_adopted_plus_log_equals_the_whole_log(steps, where):
    """The path a node takes: write_snapshot_file (the forked child), then
    adopt_snapshot (the node), then more records, then a restart."""
    records = history(steps)
    if len(records) < 2:
        return
    k = max(1, int(where * (len(records) - 1)))
    whole = applied(records).to_wire()
    with tempfile.TemporaryDirectory() as d:
        storage = DiskStorage.open(d, "off")
        storage.recover()
        storage.append(records[:k + 1])
        write_snapshot_file(d, k, records[k - 1].vote_id, store_wire_iter(applied(records[:k])))
        assert storage.adopt_snapshot(k)
        storage.append(records[k + 1:])
        storage.close()
        store, last = recovered(d)
    assert last == len(records)
    assert store.to_wire() == whole
