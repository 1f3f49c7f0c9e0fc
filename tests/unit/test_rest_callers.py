"""Who a REST request comes from (service/http/callers.py): its client certificate's identity
by grpcio's rule, as a gRPC call's, whichever HTTP server filled ASGI's TLS extension (the
front-ends' tunnel carries it unchanged); else anyone, counted by its address."""

from __future__ import annotations

from pathlib import Path

from cryptography import x509

from service.frontends.rest_tunnel import decode_head, encode_head
from service.http.callers import rest_client, rest_identity
from service.inference.identity import ANYONE
from transport.asgi import tls_extension
from transport.tls.certs import issue_client_certificate
from transport.tls.peer_auth import PeerAuth


def scope(tls: dict[str, object] | None, client: tuple[str, int] | None) -> dict[str, object]:
    return {
        "type": "http",
        "method": "POST",
        "path": "/v2/models/m/infer",
        "headers": [],
        "client": client,
        "server": ("127.0.0.1", 8000),
        "extensions": {} if tls is None else {"tls": tls},
    }


def test_a_certificate_is_its_identity_through_the_tunnel_too(tmp_path: Path) -> None:
    cert_path, _ = issue_client_certificate(tmp_path, "alice")
    certificate = x509.load_pem_x509_certificate(cert_path.read_bytes())
    auth = PeerAuth(certificate, session_reused=False)
    key, identities = auth.identity_key(), auth.identities()
    assert key is not None and identities is not None
    expected = (key.encode(), *identities)
    sent = scope(tls_extension(certificate, "TLSv1.3"), ("10.0.0.7", 4000))
    assert sent["extensions"]["tls"]["tls_version"] == 0x0304  # type: ignore[index]
    for seen in (sent, decode_head(encode_head(sent))):
        assert rest_identity(seen) == expected
        assert rest_client(seen, expected) == "certificate " + b", ".join(expected).decode()


def test_without_a_certificate_a_caller_is_its_address() -> None:
    for tls in (None, tls_extension(None, "TLSv1.2")):
        plain = scope(tls, ("::ffff:10.0.0.7", 4000))
        assert rest_identity(plain) == rest_identity(decode_head(encode_head(plain))) == ANYONE
        assert rest_client(plain, ANYONE) == "address 10.0.0.7"  # as gRPC names it
    assert rest_client(scope(None, None), ANYONE) == "address unknown"
