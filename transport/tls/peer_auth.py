"""The client's identity as a servicer sees it on HTTP/3, in grpcio's shapes (`peer_identities`,
`peer_identity_key`, `auth_context`, with grpcio's property names), so one servicer checks
client certificates the same way on both transports. A resumed connection (session ticket,
0-RTT) shows the certificate of the full handshake that issued its ticket."""

from __future__ import annotations

from dataclasses import dataclass

from cryptography import x509
from cryptography.hazmat.primitives.serialization import Encoding
from cryptography.x509.oid import NameOID

_COMMON_NAME = "x509_common_name"
_SUBJECT_ALTERNATIVE_NAME = "x509_subject_alternative_name"


@dataclass(frozen=True)
class PeerAuth:
    certificate: x509.Certificate | None
    session_reused: bool

    def identity_key(self) -> str | None:
        """grpcio's rule: the subject alternative names if any, else the common name."""
        context = self.auth_context()
        for key in (_SUBJECT_ALTERNATIVE_NAME, _COMMON_NAME):
            if key in context:
                return key
        return None

    def identities(self) -> list[bytes] | None:
        key = self.identity_key()
        return None if key is None else self.auth_context()[key]

    def auth_context(self) -> dict[str, list[bytes]]:
        context = {
            "transport_security_type": [b"ssl"],
            "security_level": [b"TSI_PRIVACY_AND_INTEGRITY"],
            "ssl_session_reused": [b"true" if self.session_reused else b"false"],
            "ssl_tls_version": [b"TLSv1.3"],
        }
        certificate = self.certificate
        if certificate is None:
            return context
        context["x509_subject"] = [certificate.subject.rfc4514_string().encode()]
        names = certificate.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
        if names:
            context[_COMMON_NAME] = [str(names[0].value).encode()]
        alternative = _alternative_names(certificate)
        if alternative:
            context[_SUBJECT_ALTERNATIVE_NAME] = alternative
        context["x509_pem_cert"] = [certificate.public_bytes(Encoding.PEM)]
        return context


def _alternative_names(certificate: x509.Certificate) -> list[bytes]:
    try:
        names = certificate.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return []
    kinds = (x509.DNSName, x509.UniformResourceIdentifier, x509.RFC822Name, x509.IPAddress)
    return [str(value).encode() for kind in kinds for value in names.get_values_for_type(kind)]
