"""The native engine's adapter (ClusterEngine) in async mode, three of them
in one event loop on real loopback links, in memory: a master's writes on
the fast path (commit_now) within a push interval need no flush each; the
adapter's timer pushes them when the core says (NativeCore.push_at), and
the slaves receive them.

The adapter's clock (driver.now_ms) is frozen once the cluster is up, so
that what is pushed when depends on the test alone, not on how fast the
machine runs the loop."""

from __future__ import annotations

import asyncio
import time

from qserver.engines.native import driver
from qserver.engines.native.driver import ClusterEngine
from qserver.wire.requests import ProduceRequest
from test_engine_sync import started_master, three_engines, until

DEADLINE_S = 60.0


def produce(engine: ClusterEngine, data: str) -> bool:
    """One write on the fast path; whether it scheduled a flush."""
    entry = engine.core.store.decide_produce(
        ProduceRequest(queue="q", data=data, delay_s=None, ttl_s=None, retry_s=0),
        int(time.time() * 1000))
    assert engine.commits_at_once
    before = engine._flush_scheduled
    engine.commit_now(entry)
    return engine._flush_scheduled and not before


async def writes_in_turns(monkeypatch) -> None:
    engines = three_engines('  <replication mode="async"/>\n')
    try:
        master = await started_master(engines)
        slaves = [e for e in engines if e is not master]
        await until(lambda: master.commits_at_once and all(
            s.core.log.last_trans_id == master.core.log.last_trans_id for s in slaves),
            "the slaves hold the master's first entry")

        clock = [driver.now_ms() + 10]  # past any push due before the freeze
        monkeypatch.setattr(driver, "now_ms", lambda: clock[0])
        produce(master, "first")  # a push due at once (a flush, or the timer if due first)
        first = master.core.log.last_trans_id
        await until(lambda: all(s.core.log.last_trans_id == first for s in slaves),
                    "the first write is pushed at once")

        scheduled = 0
        for turn in range(20):  # writes in 20 loop turns within the push interval
            scheduled += sum(produce(master, f"{turn}.{k}") for k in range(5))
            await asyncio.sleep(0)
        # At most one flush, the first write's: it armed the timer for the
        # push (none if the timer was due before the push anyway: a
        # heartbeat). Each turn's writes used to schedule one (20), which
        # found the push not due yet.
        assert scheduled <= 1
        await asyncio.sleep(0.05)  # the timer fires (real time), the clock has not moved
        assert all(s.core.log.last_trans_id == first for s in slaves)  # held: coalesced
        assert master.core.log.last_trans_id == first + 100

        clock[0] = master.core.push_at()  # the push is due: the timer sends it
        await until(lambda: all(s.core.log.last_trans_id == first + 100 for s in slaves),
                    "the slaves receive the coalesced push")
    finally:
        for engine in engines:
            await engine.close()


def test_fast_path_writes_are_pushed_by_the_timer_without_a_flush_each(monkeypatch):
    asyncio.run(asyncio.wait_for(writes_in_turns(monkeypatch), 2 * DEADLINE_S))
