"""TLS on the client TCP port (`<tls cert key ca client_cert>`), with the
standard `ssl` module.

`server_context(config)` builds the node's `ssl.SSLContext` once, at
start-up (Node.start passes it to `create_server`): TLS 1.2 or later, the
node's certificate chain and key, and, with `ca`, the CA bundle that client
certificates are checked against (`client_cert`: none, optional, required).
Every file is read here, so a missing, unreadable or wrong file stops the
start with a `ConfigError` that names the file, before any port is bound;
a certificate that does not go with its key likewise.

UDP carries what TLS would protect in the clear, and the standard library
has no DTLS: with TLS on, the node binds no UDP port unless `<tls udp="1">`
asks for it (`Config.udp`).

`peer_contexts(config)`: with `<tls peers="1">` the internal links between
nodes (engines/peers.py) use TLS too, with the same certificate and key,
both ways checked against `ca` (mutual TLS: a node's certificate serves as
server and as client certificate, so it needs both extended key usages,
or none). Host names are not checked on these links: a node proves who it
is by the cluster secret's handshake, which runs inside TLS as before;
TLS adds encryption and keeps out whoever holds no certificate of the
cluster's CA, and the certificates need not name the addresses nodes
dial (`<node dial>`, proxies).
"""

from __future__ import annotations

import ssl

from .config import ClientCert, Config
from .errors import ConfigError

__all__ = ["server_context", "peer_contexts"]


def _problem(exc: Exception) -> str:
    """An ssl or OS error in a few words."""
    if isinstance(exc, ssl.SSLError) and exc.reason:
        return f"{exc.reason.lower().replace('_', ' ')} ({exc.library or 'ssl'})"
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    return str(exc) or type(exc).__name__


def _read_pem(config: Config, attribute: str, path: str, marker: str) -> None:
    """Check that `path` can be read and holds a PEM block of `marker`
    (CERTIFICATE, PRIVATE KEY): the ssl module's own errors do not say
    which of cert and key was wrong."""
    try:
        with open(path, "rb") as f:
            text = f.read()
    except OSError as exc:
        raise ConfigError(config.source, "tls", f"{attribute}={path!r}: cannot read: "
                                                f"{_problem(exc)}") from None
    if b"-----BEGIN " not in text or marker.encode() + b"-----" not in text:
        raise ConfigError(config.source, "tls", f"{attribute}={path!r}: no PEM {marker} "
                                                "in it")


def server_context(config: Config) -> ssl.SSLContext | None:
    """The client port's TLS context, or None without `<tls>`.

    Raises:
        ConfigError: a file cannot be read or is not what it should be (the
            message names the attribute and the file).
    """
    if config.tls_cert is None or config.tls_key is None:
        return None
    _read_pem(config, "cert", config.tls_cert, "CERTIFICATE")
    _read_pem(config, "key", config.tls_key, "PRIVATE KEY")
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        ctx.load_cert_chain(config.tls_cert, config.tls_key)
    except (ssl.SSLError, OSError, ValueError) as exc:
        raise ConfigError(config.source, "tls",
                          f"cert={config.tls_cert!r} with key={config.tls_key!r}: "
                          f"{_problem(exc)} (a key that does not go with the certificate, "
                          "an encrypted key, or a damaged file)") from None
    if config.tls_ca is not None:
        _read_pem(config, "ca", config.tls_ca, "CERTIFICATE")
        try:
            ctx.load_verify_locations(cafile=config.tls_ca)
        except (ssl.SSLError, OSError) as exc:
            raise ConfigError(config.source, "tls",
                              f"ca={config.tls_ca!r}: {_problem(exc)}") from None
    ctx.verify_mode = {ClientCert.NONE: ssl.CERT_NONE, ClientCert.OPTIONAL: ssl.CERT_OPTIONAL,
                       ClientCert.REQUIRED: ssl.CERT_REQUIRED}[config.tls_client_cert]
    return ctx


def peer_contexts(config: Config) -> tuple[ssl.SSLContext, ssl.SSLContext] | None:
    """(accepting, dialing) contexts of the internal links, or None without
    `<tls peers="1">` (see the module docstring). Raises ConfigError as
    `server_context`."""
    if not config.tls_peers or config.tls_ca is None:
        return None
    accepting = server_context(config)
    assert accepting is not None  # peers="1" comes with cert, key and ca (config.py)
    accepting.verify_mode = ssl.CERT_REQUIRED  # only nodes with the cluster CA's certificates
    dialing = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    dialing.minimum_version = ssl.TLSVersion.TLSv1_2
    dialing.check_hostname = False  # see the module docstring; the chain is still checked
    dialing.verify_mode = ssl.CERT_REQUIRED
    dialing.load_cert_chain(config.tls_cert or "", config.tls_key)  # checked just above
    dialing.load_verify_locations(cafile=config.tls_ca)
    return accepting, dialing
