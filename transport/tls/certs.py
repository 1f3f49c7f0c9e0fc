"""Development TLS certificates: a private CA, a server certificate it signs, and on request
client certificates for mutual TLS.

HTTP/3 has no plaintext mode (QUIC always runs TLS 1.3), so the server needs a certificate even on
a laptop. Rather than a bare self-signed server certificate, we create a small CA and sign the
server certificate with it: clients then trust one stable file (``ca.pem``) and the server
certificate can be renewed without touching any client. The CA is kept across runs for that
reason; only the server certificate is replaced when it nears expiry or no longer matches.

Development only: the keys are unencrypted files on disk and the CA is trusted by nothing else.
Production deployments pass real certificates with ``--tls-cert`` / ``--tls-key``.
"""

from __future__ import annotations

import contextlib
import datetime
import ipaddress
import os
import re
import secrets
import socket
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

__all__ = [
    "DevCertificates",
    "describe_trust",
    "ensure_dev_certificates",
    "issue_client_certificate",
]

CA_COMMON_NAME = "paddlequic development CA"
SERVER_COMMON_NAME = "localhost"
CA_VALIDITY = datetime.timedelta(days=3650)
SERVER_VALIDITY = datetime.timedelta(days=365)
# Backdating tolerates clients whose clocks run a little behind the server's.
BACKDATE = datetime.timedelta(days=1)
# A certificate this close to expiry is replaced before it can break a running deployment.
RENEW_BEFORE = datetime.timedelta(days=30)
# The CA is replaced earlier than that: a server certificate never outlives its CA, so a CA this
# close to expiry could only sign server certificates that are already due for renewal.
CA_RENEW_BEFORE = 2 * RENEW_BEFORE

CLIENT_VALIDITY = datetime.timedelta(days=365)
# Server and client certificates: EC keys only sign (the TLS 1.3 handshake signature).
_LEAF_KEY_USAGE = x509.KeyUsage(
    digital_signature=True,
    content_commitment=False,
    key_encipherment=False,
    data_encipherment=False,
    key_agreement=False,
    key_cert_sign=False,
    crl_sign=False,
    encipher_only=False,
    decipher_only=False,
)
# Client names become file names and common names: plain names only.
_CLIENT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")

_FIXED_DNS_NAMES = ("localhost",)
_FIXED_IP_ADDRESSES = (ipaddress.ip_address("127.0.0.1"), ipaddress.ip_address("::1"))


@dataclass(frozen=True)
class DevCertificates:
    """Paths of one set of development certificates (all four files live in ``directory``)."""

    directory: Path
    ca_cert: Path
    server_cert: Path
    server_key: Path

    @property
    def ca_key(self) -> Path:
        """The CA's private key: needed only to sign a new server certificate."""
        return self.directory / "ca-key.pem"

    @classmethod
    def in_directory(cls, directory: Path) -> DevCertificates:
        """The standard file names inside ``directory``."""
        return cls(
            directory=directory,
            ca_cert=directory / "ca.pem",
            server_cert=directory / "server.pem",
            server_key=directory / "server-key.pem",
        )


def ensure_dev_certificates(
    directory: Path, *, force: bool = False
) -> tuple[DevCertificates, bool]:
    """Create development certificates in ``directory``, or reuse the ones already there.

    Returns the paths and whether anything was (re)generated. Reuse keeps the CA whenever it is
    intact, so clients that already trust ``ca.pem`` keep working; the server certificate is
    regenerated when it is missing, expires within 30 days, lacks one of the expected names, or
    does not match its key or the CA. ``force`` regenerates everything, CA included.

    Every file is written through a temporary file and ``os.replace``, and each run checks that
    the files are consistent with each other, so a run interrupted between two replacements is
    repaired by the next one instead of leaving a mismatched set in use.
    """
    certs = DevCertificates.in_directory(directory)
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    now = _now()

    ca = None if force else _load_valid_ca(certs, now)
    if ca is None:
        ca_key = ec.generate_private_key(ec.SECP256R1())
        ca_cert = _make_ca_certificate(ca_key, now)
        server_key = ec.generate_private_key(ec.SECP256R1())
        server_cert = _make_server_certificate(server_key, ca_cert, ca_key, now)
        # CA first: if interrupted afterwards, the old server certificate no longer chains to
        # the new CA and the next run replaces it.
        _write_private_key(certs.ca_key, ca_key)
        _write_certificate(certs.ca_cert, ca_cert)
        _write_private_key(certs.server_key, server_key)
        _write_certificate(certs.server_cert, server_cert)
        return certs, True

    ca_cert, ca_key = ca
    if _server_certificate_usable(certs, ca_cert, now):
        return certs, False

    server_key = ec.generate_private_key(ec.SECP256R1())
    server_cert = _make_server_certificate(server_key, ca_cert, ca_key, now)
    _write_private_key(certs.server_key, server_key)
    _write_certificate(certs.server_cert, server_cert)
    return certs, True


def issue_client_certificate(directory: Path, name: str) -> tuple[Path, Path]:
    """A client certificate for mutual TLS (common name ``name``, client-auth usage only),
    signed by the development CA in ``directory`` (made if missing). Returns the certificate
    and key paths, ``client-NAME.pem`` and ``client-NAME-key.pem``; an existing pair is
    replaced."""
    if not _CLIENT_NAME.fullmatch(name):
        raise ValueError(
            f"client name {name!r}: letters, digits, '.', '_', '-' (at most 64, not first)"
        )
    certs, _ = ensure_dev_certificates(directory)
    ca = _load_valid_ca(certs, _now())
    assert ca is not None  # ensure_dev_certificates just made or checked it
    ca_cert, ca_key = ca
    key = ec.generate_private_key(ec.SECP256R1())
    cert_path = directory / f"client-{name}.pem"
    key_path = directory / f"client-{name}-key.pem"
    _write_private_key(key_path, key)
    _write_certificate(cert_path, _make_client_certificate(name, key, ca_cert, ca_key, _now()))
    return cert_path, key_path


def describe_trust(certs: DevCertificates) -> str:
    """Log text telling an operator where the development CA is and how clients trust it."""
    ca = certs.ca_cert
    names = ", ".join(_expected_dns_names() + [str(ip) for ip in _FIXED_IP_ADDRESSES])
    return "\n".join(
        [
            f"TLS: development certificates in {certs.directory} (not for production: "
            "use --tls-cert/--tls-key)",
            f"  server certificate names: {names}",
            f"  clients must trust the development CA {ca}:",
            f"    paddlequic CLI: paddlequic infer --ca-file {ca} ...",
            f'    Python aioquic: QuicConfiguration(...).load_verify_locations(cafile="{ca}")',
            "    Python grpc:    grpc.ssl_channel_credentials("
            f'root_certificates=open("{ca}", "rb").read())',
            f"    grpcurl:        grpcurl -cacert {ca} localhost:PORT list",
        ]
    )


# --- creation -----------------------------------------------------------------------------------


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


def _make_ca_certificate(
    key: ec.EllipticCurvePrivateKey, now: datetime.datetime
) -> x509.Certificate:
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, CA_COMMON_NAME)])
    return (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - BACKDATE)
        .not_valid_after(now + CA_VALIDITY)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=False,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )


def _make_server_certificate(
    key: ec.EllipticCurvePrivateKey,
    ca_cert: x509.Certificate,
    ca_key: ec.EllipticCurvePrivateKey,
    now: datetime.datetime,
) -> x509.Certificate:
    sans: list[x509.GeneralName] = [x509.DNSName(name) for name in _expected_dns_names()]
    sans += [x509.IPAddress(ip) for ip in _FIXED_IP_ADDRESSES]
    # Never outlive the issuer: verifiers may reject a certificate valid past its CA.
    not_after = min(now + SERVER_VALIDITY, ca_cert.not_valid_after_utc)
    return (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, SERVER_COMMON_NAME)]))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - BACKDATE)
        .not_valid_after(not_after)
        .add_extension(x509.SubjectAlternativeName(sans), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(_LEAF_KEY_USAGE, critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()),
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())
    )


def _make_client_certificate(
    name: str,
    key: ec.EllipticCurvePrivateKey,
    ca_cert: x509.Certificate,
    ca_key: ec.EllipticCurvePrivateKey,
    now: datetime.datetime,
) -> x509.Certificate:
    return (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - BACKDATE)
        .not_valid_after(min(now + CLIENT_VALIDITY, ca_cert.not_valid_after_utc))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(_LEAF_KEY_USAGE, critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()),
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())
    )


def _expected_dns_names() -> list[str]:
    """localhost plus this machine's host name, so clients on the LAN can verify by name."""
    names = list(_FIXED_DNS_NAMES)
    host = socket.gethostname().strip().rstrip(".").lower()
    # A host name that is empty, an IP literal, or not plain ASCII cannot be a DNS SAN as is.
    if host and host.isascii() and host not in names and not _is_ip(host):
        names.append(host)
    return names


def _is_ip(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
    except ValueError:
        return False
    return True


# --- reuse checks -------------------------------------------------------------------------------


def _load_valid_ca(
    certs: DevCertificates, now: datetime.datetime
) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey] | None:
    """The existing CA and its key, or None when it must be recreated (missing, unreadable,
    mismatched, or expiring: a CA that expires takes every server certificate with it)."""
    try:
        cert = x509.load_pem_x509_certificate(certs.ca_cert.read_bytes())
        key = serialization.load_pem_private_key(certs.ca_key.read_bytes(), password=None)
    except (OSError, ValueError, TypeError):
        return None
    if not isinstance(key, ec.EllipticCurvePrivateKey) or key.public_key() != cert.public_key():
        return None
    try:
        cert.verify_directly_issued_by(cert)  # self-signed, and the signature is intact
    except (ValueError, TypeError, InvalidSignature):
        return None
    try:
        constraints = cert.extensions.get_extension_for_class(x509.BasicConstraints).value
    except x509.ExtensionNotFound:
        return None
    if not constraints.ca or cert.not_valid_after_utc - now < CA_RENEW_BEFORE:
        return None
    return cert, key


def _server_certificate_usable(
    certs: DevCertificates, ca_cert: x509.Certificate, now: datetime.datetime
) -> bool:
    try:
        cert = x509.load_pem_x509_certificate(certs.server_cert.read_bytes())
        key = serialization.load_pem_private_key(certs.server_key.read_bytes(), password=None)
        cert.verify_directly_issued_by(ca_cert)
        sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except (OSError, ValueError, TypeError, InvalidSignature, x509.ExtensionNotFound):
        return False
    if key.public_key() != cert.public_key():
        return False
    if cert.not_valid_before_utc > now or cert.not_valid_after_utc - now < RENEW_BEFORE:
        return False
    dns_names = set(sans.get_values_for_type(x509.DNSName))
    ip_addresses = set(sans.get_values_for_type(x509.IPAddress))
    return set(_expected_dns_names()) <= dns_names and set(_FIXED_IP_ADDRESSES) <= ip_addresses


# --- atomic writes ------------------------------------------------------------------------------


def _write_private_key(path: Path, key: ec.EllipticCurvePrivateKey) -> None:
    data = key.private_bytes(
        encoding=serialization.Encoding.PEM,
        format=serialization.PrivateFormat.PKCS8,
        encryption_algorithm=serialization.NoEncryption(),
    )
    _write_atomically(path, data, mode=0o600)


def _write_certificate(path: Path, cert: x509.Certificate) -> None:
    _write_atomically(path, cert.public_bytes(serialization.Encoding.PEM), mode=0o644)


def _write_atomically(path: Path, data: bytes, *, mode: int) -> None:
    """Write ``data`` to ``path`` so that readers see the old file or the new one, never a part.

    The temporary file is created with its final mode, so a private key is never readable by
    others, not even for an instant; it is flushed to disk before the rename so a crash cannot
    leave an empty file behind the new name.
    """
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(8)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), mode)
    try:
        with os.fdopen(fd, "wb") as file:
            file.write(data)
            file.flush()
            os.fsync(file.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        raise
    _fsync_directory(path.parent)


def _fsync_directory(directory: Path) -> None:
    """Make the rename itself durable (best effort: not every platform can open directories)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    with contextlib.suppress(OSError):
        os.fsync(fd)
    os.close(fd)
