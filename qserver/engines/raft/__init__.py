"""The raft engine (`<replication engine="raft">`): qserver's state machine
replicated by pysyncobj, behind the same `Engine` interface.

- `machine`: which committed entries count (epochs opened by barriers) and
  the master's speculatively applied entries. No I/O.
- `driver`: the pysyncobj adapter: its thread handed over to the event
  loop, the journal made durable, the password always set.
- `appends`: pysyncobj's log replication held to Raft's append rules, and
  keepalives on its idle links.

Nothing is imported here: the driver pulls in pysyncobj, which must stay a
lazy import for nodes that run the native engine.
"""
