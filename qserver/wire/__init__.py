"""The client side of the wire: what a client sends and gets back.

- `codec`: JSON objects over a TCP stream or UDP datagrams; `StreamDecoder`
  frames a stream, `encode_response` writes one answer.
- `requests`: a decoded object validated once, where it enters, into one of
  the request types (`parse_request`); everything after trusts the types.

This package does no I/O (tests/test_core_purity.py checks its imports).
Its public API is what it exports below; the modules' other names are
internal.
"""

from .codec import (
    DEFAULT_MAX_REQUEST_SIZE,
    MAX_UDP_PAYLOAD,
    StreamDecoder,
    decode_datagram,
    encode_response,
    error_response,
)
from .requests import (
    MAX_QUEUE_NAME,
    MAX_TIME_S,
    RELATIVE_TIME_LIMIT_S,
    Action,
    ClearRequest,
    ConfirmRequest,
    ConsumeRequest,
    LeaderRequest,
    ListRequest,
    MonitorRequest,
    ProduceBatchRequest,
    ProduceRequest,
    Request,
    parse_request,
)

__all__ = [
    # codec
    "StreamDecoder",
    "decode_datagram",
    "encode_response",
    "error_response",
    "DEFAULT_MAX_REQUEST_SIZE",
    "MAX_UDP_PAYLOAD",
    # requests
    "Action",
    "Request",
    "ProduceRequest",
    "ProduceBatchRequest",
    "ConsumeRequest",
    "ConfirmRequest",
    "ClearRequest",
    "MonitorRequest",
    "ListRequest",
    "LeaderRequest",
    "parse_request",
    "MAX_QUEUE_NAME",
    "MAX_TIME_S",
    "RELATIVE_TIME_LIMIT_S",
]
