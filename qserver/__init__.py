"""qserver: a replicated message-queue daemon that speaks queue_server's
JSON protocol.

Layout (README.md, "Layout"): `wire/` (the client codec and request
validation) and `state/` (store, entries, log) do no I/O; `service`
turns requests into entries and answers; `engines/` replicate the log
(`base`: the Engine protocol; `native/`, `raft/`, `local`); `server` holds
the client TCP and UDP protocols, `node` the node's lifecycle; `storage/`
keeps the log on disk; `client/` is the Python client; `config`, `errors`,
`cli`.
"""

__version__ = "0.1.0"

# The hot path's compiled modules, when built and matching the source
# (qserver/compiled.py); before any of them is imported.
from . import compiled as _compiled

_compiled.install()
