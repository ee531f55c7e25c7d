"""qserver: a replicated message-queue daemon that speaks queue_server's
JSON protocol.

Layout: `store` (the queue state machine), `entries` and `log` (the
replicated log), `requests` and `protocol` (the client wire codec),
`service` (requests to entries and answers), `replication` (engines),
`server` (asyncio TCP/UDP adapters and the node lifecycle), `config`,
`cli`.
"""

__version__ = "0.1.0"
