"""The native replication engine: queue_server's design (election, push
then pull, quorum commit), made safe.

- `core`: the deterministic core, `NativeCore`: events in (tick, step,
  propose), a `Ready` out listing what to persist, send and answer, in
  order. No I/O.
- `driver`: its asyncio driver, `ClusterEngine`: peer links, storage, the
  timer, forwarding; it carries out each `Ready`. A lone node with storage
  runs it too.
- `durability`: fsync scheduling: when the log is fsynced, off the event
  loop, and what the core is told.
- `snapshots`: snapshots as files: the forked writer, streaming to a slave,
  receiving from the master.

Nothing is imported here: the driver pulls in asyncio, so import the module
you need (`qserver.engines.native.core` for the pure part).
"""
