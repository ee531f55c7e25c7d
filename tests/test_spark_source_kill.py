"""The Spark driver process killed with SIGKILL in the middle of a stream
from the qserver source, and a new driver started on the same checkpoint
(issue 18, point 2; tests/test_spark_source.py stops a query with
`query.stop()` inside one JVM, which lets Spark and the source clean up).

The driver is tests/spark_stream_job.py, a real process (local[1], its own
JVM and Python workers, in a session of its own): qserver -> parquet with a
checkpoint, a small maxMessagesPerBatch. Against a real three-node
cluster, with at-least-once messages (produced with a retry):

1. the job runs until a micro-batch after the first is under way (its
   offset in the checkpoint's offset log, not yet in the commit log); then
   every process of the job gets SIGKILL: nothing of Spark or the source
   runs another line;
2. every message of that interrupted batch is still in its queue (none was
   confirmed before its batch committed);
3. a new job on the same checkpoint and output replays the interrupted
   batch and reads the rest until the queue is empty, then stops on SIGTERM;
4. the sink, read through its own commit log (`_spark_metadata`, so files
   of a batch that never committed do not count), holds every produced
   message at least once, each batch only messages its offset names, and
   the interrupted batch whole, in its order (read again by id); nothing is
   left in the queue.

Two cases (some 40 s each here):

- a 60 s lease outlasts the restart: the new driver's confirm of the
  replayed batch finds the first delivery, nothing reaches the sink twice;
- a 3 s lease runs out while no driver is up (the test waits for the
  interrupted batch's messages to be deliverable again), and meanwhile
  another consumer takes those messages and never confirms them: they are
  delivered again. The replay still reads them by id, its confirm finds
  their receipts stale and says so, and once the other consumer's lease
  runs out they reach the sink a second time: exactly the interrupted batch
  is duplicated, nothing is lost.

(A lease that runs out with no other consumer is the second case without
its consumer; run with the parametrization below extended by
`(SHORT_LEASE_S, False)` it passes too, with duplicates allowed there: it
was dropped from the suite for time.)
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

pytest.importorskip("pyspark", reason="pyspark is not installed (the project's 'spark' extra)")
pytest.importorskip("pyarrow", reason="pyarrow is not installed (the project's 'spark' extra)")
if shutil.which("java") is None and not os.environ.get("JAVA_HOME"):
    pytest.skip("java is not installed: Spark needs a JVM", allow_module_level=True)


from procs import Cluster, wait_until
from qserver.client import Client
from qserver_spark import MessageRef
from sparkutil import batch_ids, read_offset, sink_rows, uncommitted

ROOT = Path(__file__).resolve().parent.parent
JOB = ROOT / "tests" / "spark_stream_job.py"
MESSAGES = 1000
PER_BATCH = 100  # some ten batches: the kill lands early in the stream
# Generous: a shared, noisy 2-core machine, where a Spark start alone can
# take 20 s and its first micro-batch several more.
START_DEADLINE_S = 180.0
# Draining waits out a lease too: a kill that lands during a consume
# (the race kill_mid_batch retries) leaves messages leased that no batch names.
DRAIN_DEADLINE_S = 240.0
STOP_DEADLINE_S = 60.0
DEADLINE_S = 60.0
# The short lease, of the query and of the other consumer: it runs out while
# the new driver starts (a Spark start takes longer on any machine).
SHORT_LEASE_S = 3.0

# The source's line for a batch the new driver confirms from the checkpoint
# (qserver_spark/source.py, _confirm_committed).
CHECKPOINT_CONFIRM = re.compile(r"qserver source: the checkpoint's micro-batch of (\d+) messages "
                                r"consumed at .*? is committed: (.*) \([\d.]+ s\)")


# -- the job: a driver process and everything it starts ---------------------


def _stat(pid: int | str) -> list[str] | None:
    """/proc/PID/stat's fields after the command name (state first), or None."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return text[text.rindex(")") + 2:].split()


def session_members(sid: int) -> set[int]:
    """The live (not zombie) processes of session `sid`: a job's driver, its
    JVM, and the JVM's Python workers (pyspark's daemon moves its workers
    to a process group of their own, never to another session)."""
    members = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            fields = _stat(entry)
            if fields is not None and fields[0] != "Z" and int(fields[3]) == sid:
                members.add(int(entry))
    return members


class Job:
    """One run of tests/spark_stream_job.py, in a session of its own; its
    stdout and stderr go to files (Spark's chatter never fills a pipe)."""

    def __init__(self, directory: Path, run: int, hosts: str, queue: str,
                 lease_s: float) -> None:
        self.stderr_path = directory / f"job{run}.stderr"
        self.stdout_path = directory / f"job{run}.stdout"
        env = dict(os.environ, PYSPARK_PYTHON=sys.executable,
                   PYTHONPATH=os.pathsep.join([str(ROOT / "spark_integration"),
                                               os.environ.get("PYTHONPATH", "")]))
        with open(self.stdout_path, "wb") as out, open(self.stderr_path, "wb") as err:
            self.proc = subprocess.Popen(
                [sys.executable, str(JOB), "--hosts", hosts, "--queue", queue,
                 "--checkpoint", str(directory / "checkpoint"), "--out", str(directory / "out"),
                 "--per-batch", str(PER_BATCH), "--lease", str(lease_s), "--wait", "0.5"],
                stdout=out, stderr=err, env=env, cwd=ROOT, start_new_session=True)

    def exited(self) -> bool:
        """Whether the driver has exited (without reaping it: its pid, the
        session's id, stays ours until `kill` has emptied the session)."""
        fields = _stat(self.proc.pid)
        return self.proc.returncode is not None or fields is None or fields[0] == "Z"

    def stderr(self, tail: int = 4000) -> str:
        return self.stderr_path.read_text(errors="replace")[-tail:]

    def check_running(self) -> None:
        if self.exited():
            raise AssertionError(f"the job exited: {self.stderr()}")

    def kill(self) -> None:
        """SIGKILL every process of the job (its session), until none is left."""
        if self.proc.returncode is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

            def empty() -> bool:
                left = session_members(self.proc.pid)
                for pid in left:
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                return not left

            wait_until(empty, DEADLINE_S, step_s=0.05)
        self.proc.wait(DEADLINE_S)

    def stop(self) -> int:
        """SIGTERM to the driver (it stops the query and Spark); its exit
        status (-9 if it had to be killed). Whatever it leaves is killed."""
        self.proc.send_signal(signal.SIGTERM)
        try:
            wait_until(self.exited, STOP_DEADLINE_S, step_s=0.1)
        except AssertionError:
            pass  # killed below: the exit status says so
        self.kill()
        return self.proc.returncode


def kill_mid_batch(job: Job, checkpoint: Path, after: int) -> int | None:
    """SIGKILL `job` once a micro-batch numbered `after` or later is under
    way; the batch the kill left uncommitted (replayed on restart), or None
    if the batch committed between the look and the kill."""
    def running() -> bool:
        job.check_running()
        return any(b >= after for b in uncommitted(checkpoint))

    wait_until(running, START_DEADLINE_S, step_s=0.005)
    job.kill()
    left = uncommitted(checkpoint)
    assert len(left) <= 1, f"batches {sorted(left)} uncommitted: Spark runs one at a time"
    return max(left) if left else None


def states(client: Client, refs: tuple[MessageRef, ...]) -> dict[str, int]:
    """How many of `refs` are in each state ("gone": no longer in the queue)."""
    counts: dict[str, int] = {}
    for ref in refs:
        view = client.show(ref.queue, ref.msg_id)
        state = "gone" if view is None else view["state"]
        counts[state] = counts.get(state, 0) + 1
    return counts


# -- the test ---------------------------------------------------------------


@pytest.mark.parametrize("lease_s, other_consumer", [
    (60.0, False), (SHORT_LEASE_S, True),
], ids=["lease-outlasts-restart", "another-consumer-takes-them"])
def test_driver_killed_mid_stream_and_restarted_from_its_checkpoint(cluster, tmp_path, lease_s,
                                                                    other_consumer):
    c: Cluster = cluster()
    master = c.wait_master(DEADLINE_S)
    hosts = ",".join(f"127.0.0.1:{p}" for p in c.client_ports)
    queue = "src_kill_driver"
    want = [f"m{i}" for i in range(MESSAGES)]
    directory = tmp_path / "job"
    directory.mkdir()
    checkpoint = directory / "checkpoint"
    jobs: list[Job] = []
    # Shows and the other consumer ask the master: the state a consume or a
    # lease changed.
    with Client(hosts, timeout=30, retry_for=60) as client, \
            Client(f"127.0.0.1:{c.port(master)}", timeout=30) as on_master:
        try:
            client.produce_batch(queue, want, retry=60)  # at-least-once messages
            started = time.monotonic()
            interrupted = None
            for run in range(3):  # a kill that raced its batch's commit: again
                jobs.append(Job(directory, run, hosts, queue, lease_s))
                after = max(batch_ids(checkpoint / "offsets"), default=0) + 1
                interrupted = kill_mid_batch(jobs[-1], checkpoint, after)
                if interrupted is not None:
                    break
            assert interrupted is not None, "no kill landed in the middle of a batch"
            killed_at = time.monotonic()
            named = read_offset(checkpoint, interrupted).messages
            assert len(named) == PER_BATCH  # the queue held plenty
            # None confirmed: its batch never committed. Still leased, or
            # (the short lease, on a slow day) deliverable again already.
            seen = states(on_master, named)
            if lease_s >= 30:
                assert seen == {"in_flight": len(named)}, seen
            else:
                assert seen.get("gone", 0) == 0, seen
                wait_until(lambda: states(on_master, named) == {"ready": len(named)},
                           lease_s + DEADLINE_S, step_s=0.2)
            left_at_kill = client.monitor(queue)["size"]
            taken = 0
            if other_consumer:
                # A consume delivers the messages never delivered first, then
                # those whose lease ran out: take until the batch's are taken.
                wanted = {(r.queue, r.msg_id) for r in named}
                while wanted:
                    delivered = on_master.consume(queue, count=1000, lease=SHORT_LEASE_S)
                    assert delivered, f"{len(wanted)} of the batch's messages not delivered"
                    taken += len(delivered)
                    wanted -= {(m.queue, m.msg_id) for m in delivered}

            job = Job(directory, len(jobs), hosts, queue, lease_s)
            jobs.append(job)

            def drained() -> bool:
                job.check_running()
                return client.monitor(queue)["size"] == 0 and not uncommitted(checkpoint)

            wait_until(drained, DRAIN_DEADLINE_S, step_s=0.2)
            drained_at = time.monotonic()
            status = job.stop()
            assert status == 0, f"the job exited with {status}: {job.stderr()}"
        finally:
            for j in jobs:
                j.kill()
        mon = client.monitor(queue)

    rows = sink_rows(directory / "out")
    got = [r["data"] for batch in rows.values() for r in batch]
    twice = sorted(d for d, n in Counter(got).items() if n > 1)
    confirms = CHECKPOINT_CONFIRM.findall(job.stderr(tail=10**7))
    summary = (f"lease {lease_s:g} s: batch {interrupted} interrupted ({left_at_kill} "
               f"messages still queued), {taken} taken by another consumer, {len(rows)} "
               f"batches in the sink, {len(got)} rows for {len(want)} messages "
               f"({len(got) - len(set(got))} duplicates: {twice[:5]}...); the new driver "
               f"confirmed the checkpoint's batch: {confirms}; kill after "
               f"{killed_at - started:.1f} s, drained {drained_at - killed_at:.1f} s later")
    print(summary)
    assert left_at_kill > MESSAGES // 2, f"the kill came late in the stream: {summary}"
    assert set(got) == set(want), (f"missing {sorted(set(want) - set(got))[:10]}, "
                                   f"foreign {sorted(set(got) - set(want))[:10]}; {summary}")
    for batch, batch_rows in rows.items():
        named_ids = {(r.queue, r.msg_id) for r in read_offset(checkpoint, batch).messages}
        assert {(r["queue"], r["msg_id"]) for r in batch_rows} <= named_ids, \
            f"batch {batch} holds messages its offset does not name; {summary}"
    # The interrupted batch was replayed whole, in its order: read by id
    # (delivered again or not, the queue still held every message).
    replayed = rows[interrupted]
    assert [(r["queue"], r["msg_id"]) for r in replayed] == [
        (r.queue, r.msg_id) for r in named], summary
    assert (mon["size"], mon["in_flight"]) == (0, 0), f"{mon}; {summary}"
    if lease_s >= 30:
        # Restarted within the lease: the replay's confirm found the first
        # delivery, nothing came back, nothing reached the sink twice.
        assert twice == [], summary
        assert confirms == [(str(len(named)), f"confirmed {len(named)}")], summary
    if other_consumer:
        # Delivered again before the confirm: the confirm says so, and the
        # batch's messages (those only) reach the sink a second time.
        assert len(confirms) == 1 and confirms[0][1].startswith(
            f"confirmed 0; {len(named)} had been delivered again before the confirm"), summary
        assert twice == sorted(r["data"] for r in replayed), summary
        assert len(got) == len(want) + len(named), summary
