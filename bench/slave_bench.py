"""What a slave spends per replicated record, in process: decoding a push,
appending it to the log, applying what it commits, acknowledging it.

    python bench/slave_bench.py [--records 48000] [--per-push 24,4]
                                [--repeat 7] [--instructions]
                                [--qserver-src DIR]

An async master's core (NativeCore, no driver, no sockets) produces
`--records` 100-byte produces, `--per-push` of them between two of its
Readys, and its pushes to one slave are encoded as the peer link sends
them (msgpack of message_to_wire). The other slave acknowledges each push
at once, so the master's commit moves with every push, as in a cluster
under load, and the slave applies what each push commits. Then, timed, a
fresh slave core takes every push as its driver does: the frame decoded
(msgpack), the message checked (message_from_peer: record_from_wire per
record), `step`, `take_ready`, and its PushReply encoded. Its log and
store are the slave's; nothing is written to disk (the native engine's
storage is measured by bench/hotpath.py --storage and durability_bench).

Prints CPU microseconds per record (process time: min and median over
`--repeat` fresh slaves) for each push size; how many records a push
carries depends on the load (a quorum master pushes every turn's records,
about 2 to 7 with 8 to 32 clients; an async master every 2 ms, 24 to 60).

`--instructions` runs the measurement under `valgrind --tool=callgrind`
(it must be installed) instead, once with the slave's work and once
without, and prints the difference in instructions per record: the same
figure on every run, where the CPU time moves by a fifth on a shared
machine. `--qserver-src DIR` measures another tree (`git archive REV |
tar -x -C DIR`), for before/after figures.
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO_DIR = Path(__file__).resolve().parent.parent
NOW_MS = 1_700_000_000_000


def _import(src: str | None):
    sys.path.insert(0, str(Path(src).resolve() if src else REPO_DIR))
    import msgpack

    from qserver.engines.base import LeaderInfo
    from qserver.engines.messages import Push, PushReply, message_from_peer, message_to_wire
    from qserver.engines.native.core import NativeCore
    from qserver.node import GC_THRESHOLDS
    from qserver.state.log import Log
    from qserver.state.store import Store
    return (msgpack, LeaderInfo, Push, PushReply, message_from_peer, message_to_wire, NativeCore,
            GC_THRESHOLDS, Log, Store)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--records", type=int, default=48_000)
    p.add_argument("--per-push", default="24,4", help="records per push, a list (24,4)")
    p.add_argument("--repeat", type=int, default=7)
    p.add_argument("--instructions", action="store_true",
                   help="count instructions under valgrind's callgrind instead of timing")
    p.add_argument("--qserver-src", default=None, help="measure this tree instead")
    p.add_argument("--measure-only", type=int, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    sizes = [int(x) for x in args.per_push.split(",") if x]
    if args.instructions:
        return _instructions(args, sizes)
    (msgpack, LeaderInfo, Push, PushReply, message_from_peer, message_to_wire, NativeCore,
     GC_THRESHOLDS, Log, Store) = _import(args.qserver_src)
    gc.set_threshold(*GC_THRESHOLDS)

    def core(node_id: int, *, master: bool):
        c = NativeCore(node_id=node_id, peer_ids=[1, 2, 3], store=Store(queue_size=10_000_000),
                       log=Log(), me=LeaderInfo(node_id=node_id, host="127.0.0.1",
                                                port=1000 + node_id),
                       rng=random.Random(node_id), now_ms=NOW_MS, async_mode=True,
                       push_interval_ms=2 if master else 0)
        if master:
            c.vote_id = 1
            c._become_master(NOW_MS)  # as if elected (elections: tests/test_sim_*)
        return c

    def pushes(per_push: int) -> list[bytes]:
        """The encoded pushes to node 2 of a master that appends
        `args.records` produces, `per_push` between two Readys."""
        m = core(1, master=True)
        frames = [msgpack.packb(message_to_wire(msg)) for to, msg in m.take_ready(NOW_MS).messages
                  if to == 2 and type(msg) is Push]
        now, done, last = NOW_MS, 0, 1
        while done < args.records:
            for _ in range(per_push):
                entry = m.store.decide_produce_values("bench", "x" * 100, None, None, 30, now)
                m.append_entry_now(entry)
            done += per_push
            now += 3  # past the push interval
            # node 3 holds what was pushed before: the commit moves
            m.step(PushReply(vote_id=1, node_id=3, match_id=last, read_round=0), now)
            for to, msg in m.take_ready(now).messages:
                if to == 2 and type(msg) is Push:
                    frames.append(msgpack.packb(message_to_wire(msg)))
                    last = msg.prev_trans_id + len(msg.records)
        return frames

    def slave_takes(frames: list[bytes], work: bool) -> float:
        """CPU seconds for a fresh slave to take every push (without
        `work`: nothing, the baseline of --instructions)."""
        s = core(2, master=False)
        unpackb = msgpack.unpackb
        t0 = time.process_time()
        if work:
            for body in frames:
                msg = message_from_peer(1, unpackb(body, raw=False, strict_map_key=False))
                if isinstance(msg, str):
                    raise SystemExit(msg)
                s.step(msg, NOW_MS)
                for _, reply in s.take_ready(NOW_MS).messages:
                    msgpack.packb(message_to_wire(reply))
            if s.applied_id < args.records - max(sizes):
                raise SystemExit(f"the slave applied only {s.applied_id} records")
        return time.process_time() - t0

    if args.measure_only is not None:  # one run, for _instructions: with work or without
        slave_takes(pushes(sizes[0]), bool(args.measure_only))
        return 0
    print(f"{args.records} records, {args.repeat} fresh slaves each; CPU us per record")
    for per_push in sizes:
        frames = pushes(per_push)
        times = sorted(slave_takes(frames, True) / args.records * 1e6 for _ in range(args.repeat))
        print(f"  {per_push:3d} records a push ({len(frames)} pushes): min {times[0]:.2f}  "
              f"median {statistics.median(times):.2f}")
    return 0


def _instructions(args: argparse.Namespace, sizes: list[int]) -> int:
    print(f"{args.records} records; instructions per record under callgrind "
          f"(with the slave's work minus without)")
    for per_push in sizes:
        counts = []
        for work in (1, 0):
            cmd = ["valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null",
                   sys.executable, __file__, "--records", str(args.records),
                   "--per-push", str(per_push), "--measure-only", str(work)]
            if args.qserver_src:
                cmd += ["--qserver-src", args.qserver_src]
            out = subprocess.run(cmd, capture_output=True, text=True, env=os.environ)
            found = re.search(r"refs:\s+([\d,]+)", out.stderr)
            if out.returncode != 0 or found is None:
                raise SystemExit(f"valgrind failed ({out.returncode}): {out.stderr[-400:]}")
            counts.append(int(found.group(1).replace(",", "")))
        print(f"  {per_push:3d} records a push: {(counts[0] - counts[1]) / args.records:,.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
