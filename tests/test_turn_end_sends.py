"""A quorum write's steps leave in the loop turn that made them: the native
engine's adapter (ClusterEngine._flush, which runs at the end of a turn)
hands its pushes and acknowledgements to the links' transports before it
returns, and tells the node (on_answered) once it ran a commit's answers,
so that the answered connections are written in that same callback.
Before, each of those waited for one more turn of the loop, which first
handled whatever else it had polled: at every step of a quorum write (the
master's push, the slave's acknowledgement, the master's answer).

Three adapters in one event loop on real loopback links, in memory."""

from __future__ import annotations

import asyncio
import time

from qserver.engines.native.driver import ClusterEngine
from qserver.wire.requests import ProduceRequest
from test_engine_sync import started_master, three_engines, until


def _queued(engine: ClusterEngine) -> int:
    """Frames queued on the engine's links that no transport has yet."""
    assert engine.net is not None
    return sum(len(link.pending) + (link.flush_handle is not None)
               for link in engine.net._current.values())


def _watch(engines: list[ClusterEngine], flushes: list[tuple[int, int, list[str]]],
           events: list[str]) -> None:
    """Record, for each flush of the engines: its node id, the frames still
    queued when it returned, and the events it caused. The flushes are the
    callback `_schedule_flush` hands the loop and the timer's (`_on_timer`
    ends with one); they are watched at the loop, not by replacing the
    method: a compiled ClusterEngine (qserver.compiled) has methods that
    cannot be replaced."""
    loop = asyncio.get_running_loop()

    def watching(callback):  # type: ignore[no-untyped-def]
        owner = getattr(callback, "__self__", None)
        if getattr(callback, "__name__", "") not in ("_flush", "_on_timer") or not any(
                owner is engine for engine in engines):
            return callback

        def watched(*args) -> None:  # type: ignore[no-untyped-def]
            before = len(events)
            callback(*args)
            flushes.append((owner.config.node_id, _queued(owner), events[before:]))
        return watched

    call_soon, call_later = loop.call_soon, loop.call_later
    loop.call_soon = lambda callback, *args, context=None: call_soon(  # type: ignore[method-assign]
        watching(callback), *args, context=context)
    loop.call_later = lambda delay, callback, *args, context=None: call_later(  # type: ignore[method-assign]
        delay, watching(callback), *args, context=context)


def test_pushes_acknowledgements_and_answers_leave_in_the_flush_that_made_them():
    async def main() -> None:
        engines = three_engines('  <replication mode="quorum"/>\n')
        try:
            master = await started_master(engines)
            assert master.net is not None
            await until(lambda: len(master.net.connected_ids()) == 2, "both slaves linked")
            events: list[str] = []
            flushes: list[tuple[int, int, list[str]]] = []
            sent: list[int] = []
            _watch(engines, flushes, events)
            for engine in engines:
                assert engine.net is not None
                send_encoded = engine.net.send_encoded

                def counted(peer_id: int, body: bytes, node_id=engine.config.node_id,
                            send_encoded=send_encoded) -> bool:
                    sent.append(node_id)
                    return send_encoded(peer_id, body)
                engine.net.send_encoded = counted  # type: ignore[method-assign]
            master.on_answered = lambda: events.append("connections written")

            for i in range(3):
                entry = master.core.store.decide_produce(
                    ProduceRequest(queue="q", data=f"d{i}", delay_s=None, ttl_s=None, retry_s=0),
                    int(time.time() * 1000))
                master.propose(entry, lambda result, error: events.append(f"answered {error}"))
                await until(lambda i=i: events.count("connections written") == i + 1,
                            f"write {i} committed and answered")
        finally:
            for engine in engines:
                await engine.close()
        # every write: its answer, then the node told, in one flush
        assert [e for _, _, caused in flushes for e in caused] == [
            "answered None", "connections written"] * 3
        assert all(caused in ([], ["answered None", "connections written"])
                   for _, _, caused in flushes)
        # the master pushed and a slave acknowledged, each from a flush that
        # left nothing queued for a later turn
        master_id = master.config.node_id
        assert master_id in sent and any(node_id != master_id for node_id in sent)
        assert [queued for _, queued, _ in flushes if queued] == []

    asyncio.run(main())
