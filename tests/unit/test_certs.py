"""Development certificates: file layout and modes, X.509 contents, reuse and renewal, and real
TLS handshakes over QUIC (aioquic) and HTTP/2 (grpc) with clients that trust only ``ca.pem``."""

from __future__ import annotations

import asyncio
import datetime
import ipaddress
import os
import socket
import stat
from pathlib import Path

import grpc
import grpc.aio
import pytest
from aioquic.asyncio.client import connect
from aioquic.asyncio.server import serve
from aioquic.quic.configuration import QuicConfiguration
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from cryptography.x509.verification import PolicyBuilder, Store
from grpc_health.v1 import _async as health_async
from grpc_health.v1 import health_pb2, health_pb2_grpc

from transport.tls.certs import DevCertificates, describe_trust, ensure_dev_certificates

FILE_NAMES = ["ca-key.pem", "ca.pem", "server-key.pem", "server.pem"]
# Bounds the cases expected to fail, so a regression shows up as a failure rather than a hang.
FAILURE_TIMEOUT_S = 5.0


def _load_cert(path: Path) -> x509.Certificate:
    return x509.load_pem_x509_certificate(path.read_bytes())


def _load_key(path: Path) -> ec.EllipticCurvePrivateKey:
    key = serialization.load_pem_private_key(path.read_bytes(), password=None)
    assert isinstance(key, ec.EllipticCurvePrivateKey)
    return key


def _snapshot(directory: Path) -> dict[str, bytes]:
    return {name: (directory / name).read_bytes() for name in FILE_NAMES}


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


@pytest.fixture
def certs(tmp_path: Path) -> DevCertificates:
    created, is_new = ensure_dev_certificates(tmp_path / "certs")
    assert is_new
    return created


# --- files --------------------------------------------------------------------------------------


def test_creates_the_four_files_with_private_modes(certs: DevCertificates) -> None:
    assert sorted(os.listdir(certs.directory)) == FILE_NAMES  # no temporary files left behind
    assert certs.ca_cert == certs.directory / "ca.pem"
    assert certs.server_cert == certs.directory / "server.pem"
    assert certs.server_key == certs.directory / "server-key.pem"
    assert stat.S_IMODE(certs.directory.stat().st_mode) == 0o700
    for key in (certs.ca_key, certs.server_key):
        assert stat.S_IMODE(key.stat().st_mode) == 0o600
        assert b"ENCRYPTED" not in key.read_bytes()
    for cert in (certs.ca_cert, certs.server_cert):
        assert stat.S_IMODE(cert.stat().st_mode) & 0o022 == 0  # nobody else may replace it


# --- contents -----------------------------------------------------------------------------------


def test_ca_is_a_self_signed_ca(certs: DevCertificates) -> None:
    ca = _load_cert(certs.ca_cert)
    ca_public_key = ca.public_key()
    assert isinstance(ca_public_key, ec.EllipticCurvePublicKey)
    assert isinstance(ca_public_key.curve, ec.SECP256R1)
    assert ca.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == (
        "paddlequic development CA"
    )
    ca.verify_directly_issued_by(ca)
    constraints = ca.extensions.get_extension_for_class(x509.BasicConstraints)
    assert constraints.critical
    assert constraints.value.ca
    assert constraints.value.path_length == 0
    usage = ca.extensions.get_extension_for_class(x509.KeyUsage).value
    assert usage.key_cert_sign
    assert usage.crl_sign
    ski = ca.extensions.get_extension_for_class(x509.SubjectKeyIdentifier).value
    assert ski == x509.SubjectKeyIdentifier.from_public_key(ca.public_key())
    now = _now()
    assert now - datetime.timedelta(days=2) < ca.not_valid_before_utc < now
    assert ca.not_valid_after_utc - now > datetime.timedelta(days=3640)
    assert _load_key(certs.ca_key).public_key() == ca.public_key()


def test_server_certificate_chains_to_the_ca(certs: DevCertificates) -> None:
    ca = _load_cert(certs.ca_cert)
    server = _load_cert(certs.server_cert)
    assert server.issuer == ca.subject
    server.verify_directly_issued_by(ca)
    # The same check spelled out: the CA's public key verifies the server certificate's signature.
    hash_algorithm = server.signature_hash_algorithm
    assert hash_algorithm is not None
    ca_public_key = ca.public_key()
    assert isinstance(ca_public_key, ec.EllipticCurvePublicKey)
    ca_public_key.verify(server.signature, server.tbs_certificate_bytes, ec.ECDSA(hash_algorithm))
    # And a full RFC 5280 path validation, as a TLS client would do it.
    verifier = PolicyBuilder().store(Store([ca])).build_server_verifier(x509.DNSName("localhost"))
    chain = verifier.verify(server, [])
    assert chain == [server, ca]

    aki = server.extensions.get_extension_for_class(x509.AuthorityKeyIdentifier).value
    ca_ski = ca.extensions.get_extension_for_class(x509.SubjectKeyIdentifier).value
    assert aki.key_identifier == ca_ski.digest
    assert _load_key(certs.server_key).public_key() == server.public_key()


def test_server_certificate_is_a_server_leaf(certs: DevCertificates) -> None:
    server = _load_cert(certs.server_cert)
    server_public_key = server.public_key()
    assert isinstance(server_public_key, ec.EllipticCurvePublicKey)
    assert isinstance(server_public_key.curve, ec.SECP256R1)
    assert not server.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    eku = server.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert list(eku) == [ExtendedKeyUsageOID.SERVER_AUTH]
    sans = server.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    dns_names = sans.get_values_for_type(x509.DNSName)
    assert "localhost" in dns_names
    host = socket.gethostname().lower()
    if host and host != "localhost":
        assert host in dns_names
    ips = sans.get_values_for_type(x509.IPAddress)
    assert ipaddress.ip_address("127.0.0.1") in ips
    assert ipaddress.ip_address("::1") in ips
    lifetime = server.not_valid_after_utc - _now()
    assert datetime.timedelta(days=360) < lifetime <= datetime.timedelta(days=366)


# --- reuse and renewal --------------------------------------------------------------------------


def test_reuse_returns_the_same_files(certs: DevCertificates) -> None:
    before = _snapshot(certs.directory)
    again, created = ensure_dev_certificates(certs.directory)
    assert not created
    assert again == certs
    assert _snapshot(certs.directory) == before


def test_force_regenerates_everything(certs: DevCertificates) -> None:
    before = _snapshot(certs.directory)
    _, created = ensure_dev_certificates(certs.directory, force=True)
    assert created
    after = _snapshot(certs.directory)
    assert all(after[name] != before[name] for name in FILE_NAMES)
    _load_cert(certs.server_cert).verify_directly_issued_by(_load_cert(certs.ca_cert))


def test_expiring_server_certificate_is_replaced_and_the_ca_kept(certs: DevCertificates) -> None:
    ca = _load_cert(certs.ca_cert)
    old_server = _load_cert(certs.server_cert)
    now = _now()
    # Same CA, same key, same names: only the expiry (10 days away) is wrong.
    expiring = (
        x509.CertificateBuilder()
        .subject_name(old_server.subject)
        .issuer_name(ca.subject)
        .public_key(old_server.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(days=355))
        .not_valid_after(now + datetime.timedelta(days=10))
        .add_extension(
            old_server.extensions.get_extension_for_class(x509.SubjectAlternativeName).value,
            critical=False,
        )
        .sign(_load_key(certs.ca_key), hashes.SHA256())
    )
    certs.server_cert.write_bytes(expiring.public_bytes(serialization.Encoding.PEM))
    before = _snapshot(certs.directory)

    _, created = ensure_dev_certificates(certs.directory)

    assert created
    after = _snapshot(certs.directory)
    assert after["ca.pem"] == before["ca.pem"]
    assert after["ca-key.pem"] == before["ca-key.pem"]
    assert after["server.pem"] != before["server.pem"]
    renewed = _load_cert(certs.server_cert)
    renewed.verify_directly_issued_by(ca)
    assert renewed.not_valid_after_utc - now > datetime.timedelta(days=360)
    assert _load_key(certs.server_key).public_key() == renewed.public_key()
    _, created = ensure_dev_certificates(certs.directory)
    assert not created


def test_server_certificate_from_another_ca_is_replaced(
    certs: DevCertificates, tmp_path: Path
) -> None:
    other, _ = ensure_dev_certificates(tmp_path / "other")
    certs.server_cert.write_bytes(other.server_cert.read_bytes())
    certs.server_key.write_bytes(other.server_key.read_bytes())
    ca_before = certs.ca_cert.read_bytes()

    _, created = ensure_dev_certificates(certs.directory)

    assert created
    assert certs.ca_cert.read_bytes() == ca_before
    _load_cert(certs.server_cert).verify_directly_issued_by(_load_cert(certs.ca_cert))


def test_partial_sets_are_repaired(certs: DevCertificates) -> None:
    """What an interrupted run could leave behind: a missing server key keeps the CA, a CA key
    that does not match the CA certificate replaces the whole set."""
    ca_before = certs.ca_cert.read_bytes()
    certs.server_key.unlink()
    _, created = ensure_dev_certificates(certs.directory)
    assert created
    assert certs.ca_cert.read_bytes() == ca_before
    assert _load_key(certs.server_key).public_key() == _load_cert(certs.server_cert).public_key()

    stray_key = ec.generate_private_key(ec.SECP256R1()).private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    certs.ca_key.write_bytes(stray_key)
    _, created = ensure_dev_certificates(certs.directory)
    assert created
    ca = _load_cert(certs.ca_cert)
    assert _load_key(certs.ca_key).public_key() == ca.public_key()
    _load_cert(certs.server_cert).verify_directly_issued_by(ca)


def test_describe_trust_names_the_ca_file_and_the_clients(certs: DevCertificates) -> None:
    text = describe_trust(certs)
    ca = str(certs.ca_cert)
    assert f"--ca-file {ca}" in text
    assert f'load_verify_locations(cafile="{ca}")' in text
    assert "grpc.ssl_channel_credentials(root_certificates=" in text
    assert f"-cacert {ca}" in text
    assert "--tls-cert" in text
    assert len(text.splitlines()) > 3


# --- real handshakes ----------------------------------------------------------------------------


def _quic_client(server_name: str, cafile: Path | None) -> QuicConfiguration:
    configuration = QuicConfiguration(
        is_client=True, alpn_protocols=["h3"], server_name=server_name
    )
    if cafile is not None:
        configuration.load_verify_locations(cafile=str(cafile))
    return configuration


async def _quic_connect(port: int, configuration: QuicConfiguration) -> None:
    """Completes a handshake, then proves the connection carries traffic with a PING."""
    async with connect("127.0.0.1", port, configuration=configuration) as protocol:
        await protocol.ping()


async def test_quic_handshake_trusts_only_the_dev_ca(certs: DevCertificates) -> None:
    configuration = QuicConfiguration(is_client=False, alpn_protocols=["h3"])
    configuration.load_cert_chain(certs.server_cert, certs.server_key)
    server = await serve("127.0.0.1", 0, configuration=configuration)
    try:
        # serve() has no public way to report the port the OS chose.
        assert server._transport is not None
        port = server._transport.get_extra_info("sockname")[1]
        for server_name in ("localhost", "127.0.0.1", "::1"):
            client = _quic_client(server_name, certs.ca_cert)
            await asyncio.wait_for(_quic_connect(port, client), FAILURE_TIMEOUT_S)
        # Default roots (certifi) do not include the development CA; a name that is not in
        # the certificate fails even with the CA. aioquic reports both as ConnectionError.
        for server_name, cafile in (("localhost", None), ("example.com", certs.ca_cert)):
            with pytest.raises(ConnectionError):
                client = _quic_client(server_name, cafile)
                await asyncio.wait_for(_quic_connect(port, client), FAILURE_TIMEOUT_S)
    finally:
        server.close()


async def test_grpc_tls_handshake_trusts_only_the_dev_ca(certs: DevCertificates) -> None:
    async def check(port: int, credentials: grpc.ChannelCredentials) -> None:
        async with grpc.aio.secure_channel(f"localhost:{port}", credentials) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            response = await stub.Check(health_pb2.HealthCheckRequest(), timeout=FAILURE_TIMEOUT_S)
            assert response.status == health_pb2.HealthCheckResponse.SERVING

    server = grpc.aio.server()
    health_pb2_grpc.add_HealthServicer_to_server(health_async.HealthServicer(), server)
    server_credentials = grpc.ssl_server_credentials(
        [(certs.server_key.read_bytes(), certs.server_cert.read_bytes())]
    )
    port = server.add_secure_port("127.0.0.1:0", server_credentials)
    await server.start()
    try:
        trusted = grpc.ssl_channel_credentials(root_certificates=certs.ca_cert.read_bytes())
        await check(port, trusted)
        with pytest.raises(grpc.aio.AioRpcError) as failure:
            await check(port, grpc.ssl_channel_credentials())
        assert failure.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        await server.stop(grace=None)
