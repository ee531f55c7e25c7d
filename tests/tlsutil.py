"""Certificates for tests: a throw-away CA, and server and client
certificates it signs, written as PEM files (the `cryptography` package,
installed with pysyncobj).

    pki = make_pki(tmp_path)       # CA, node cert for 127.0.0.1/localhost, client cert
    pki.ca, pki.server_cert, pki.server_key, pki.client_cert, pki.client_key

Keys are EC P-256 (fast to make); certificates are valid from an hour ago
for a day. Nothing is fetched from the network.
"""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

__all__ = ["Pki", "make_pki", "make_ca", "issue"]


@dataclass(frozen=True)
class Pki:
    """Paths of the PEM files `make_pki` wrote."""

    ca: Path
    ca_key: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _write_key(key: ec.EllipticCurvePrivateKey, path: Path) -> Path:
    path.write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                       serialization.PrivateFormat.PKCS8,
                                       serialization.NoEncryption()))
    return path


def _write_cert(cert: x509.Certificate, path: Path) -> Path:
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return path


def _validity() -> tuple[datetime.datetime, datetime.datetime]:
    now = datetime.datetime.now(datetime.UTC)
    return now - datetime.timedelta(hours=1), now + datetime.timedelta(days=1)


def make_ca(directory: Path, name: str = "qserver test CA"
            ) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey, Path, Path]:
    """A self-signed CA: (certificate, key, certificate path, key path)."""
    key = ec.generate_private_key(ec.SECP256R1())
    not_before, not_after = _validity()
    cert = (x509.CertificateBuilder()
            .subject_name(_name(name)).issuer_name(_name(name))
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(not_before).not_valid_after(not_after)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True,
                                         crl_sign=True, content_commitment=False,
                                         key_encipherment=False, data_encipherment=False,
                                         key_agreement=False, encipher_only=False,
                                         decipher_only=False), critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()),
                           critical=False)
            .sign(key, hashes.SHA256()))
    slug = name.replace(" ", "-")
    return (cert, key, _write_cert(cert, directory / f"{slug}.pem"),
            _write_key(key, directory / f"{slug}.key"))


def issue(directory: Path, stem: str, ca_cert: x509.Certificate,
          ca_key: ec.EllipticCurvePrivateKey, *, common_name: str, server: bool,
          client: bool = False, hosts: tuple[str, ...] = ()) -> tuple[Path, Path]:
    """A certificate signed by the CA, for a server (`hosts`: DNS names or
    IP addresses in its subjectAltName), a client, or both (a node's: its
    peer links use it both ways); returns (cert path, key path), written
    as STEM.pem and STEM.key."""
    usages = ([ExtendedKeyUsageOID.SERVER_AUTH] if server else []) + (
        [ExtendedKeyUsageOID.CLIENT_AUTH] if client else [])
    key = ec.generate_private_key(ec.SECP256R1())
    not_before, not_after = _validity()
    builder = (x509.CertificateBuilder()
               .subject_name(_name(common_name)).issuer_name(ca_cert.subject)
               .public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(not_before).not_valid_after(not_after)
               .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
               .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
               .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(
                   ca_key.public_key()), critical=False))
    if hosts:
        names: list[x509.GeneralName] = []
        for host in hosts:
            try:
                names.append(x509.IPAddress(ipaddress.ip_address(host)))
            except ValueError:
                names.append(x509.DNSName(host))
        builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
    cert = builder.sign(ca_key, hashes.SHA256())
    return _write_cert(cert, directory / f"{stem}.pem"), _write_key(key, directory / f"{stem}.key")


def make_pki(directory: Path, hosts: tuple[str, ...] = ("127.0.0.1", "localhost")) -> Pki:
    """A CA, a node certificate for `hosts` (server and client use: it
    also serves the peer links of <tls peers="1">) and a client
    certificate, all signed by it, as PEM files in `directory`."""
    directory.mkdir(parents=True, exist_ok=True)
    ca_cert, ca_key, ca_path, ca_key_path = make_ca(directory)
    server_cert, server_key = issue(directory, "server", ca_cert, ca_key,
                                    common_name=hosts[0], server=True, client=True,
                                    hosts=hosts)
    client_cert, client_key = issue(directory, "client", ca_cert, ca_key,
                                    common_name="qserver test client", server=False,
                                    client=True)
    return Pki(ca=ca_path, ca_key=ca_key_path, server_cert=server_cert, server_key=server_key,
               client_cert=client_cert, client_key=client_key)
