"""What reads model-signing's signatures and keys: the verifiers a server trusts, the check of
one model's signature against them, and the keys and signatures `paddlequic` makes.

The verifiers come from model-signing's internal modules (`model_signing._signing`): its public
API verifies whole directories only, and a version is checked on its own here (signing.py).
The package is pinned for that reason.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

import model_signing
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec
from model_signing import manifest
from model_signing._signing import sign_certificate, sign_ec_key, sign_sigstore_pb
from model_signing._signing.signing import Verifier

from service.lifecycle.signing import SIGNATURE_FILE, SignatureError, TrustError

KEY_SUFFIXES = (".pem", ".pub")


@dataclass(frozen=True)
class Trust:
    """Who may sign: verifiers by the name an operator recognizes (key file or CA file)."""

    verifiers: tuple[tuple[str, Verifier], ...]

    @property
    def names(self) -> list[str]:
        return [name for name, _ in self.verifiers]

    def manifest(self, model_dir: Path, name: str) -> tuple[dict[str, str], str]:
        """The signed file digests (path -> SHA-256 hex) and who signed them, or SignatureError."""
        signature_file = model_dir / SIGNATURE_FILE
        try:
            signature = sign_sigstore_pb.Signature.read(signature_file)
        except FileNotFoundError:
            raise SignatureError(f"model '{name}' is not signed (no {SIGNATURE_FILE})") from None
        except Exception as exc:  # a signature file is untrusted input: any parse error refuses it
            raise SignatureError(f"{signature_file} is not a model-signing bundle: {exc}") from exc
        problems = []
        for signer, verifier in self.verifiers:
            try:
                signed = verifier.verify(signature)
                break
            except Exception as exc:  # whatever a verifier raises, this key did not sign it
                problems.append(f"{signer}: {exc or type(exc).__name__}")
        else:
            trusted = ", ".join(problems) if problems else "no trusted keys configured"
            raise SignatureError(
                f"{signature_file} is not signed by a trusted key{_key_hint(signature)} ({trusted})"
            )
        if signed.model_name != name:
            raise SignatureError(
                f"{signature_file} was signed for model '{signed.model_name}', not '{name}'"
            )
        method = signed.serialization_type
        if method.get("method") != "files" or method.get("hash_type") != "sha256":
            raise SignatureError(
                f"{signature_file}: serialization {method.get('method')}/{method.get('hash_type')} "
                "is not served; sign with the default (files, sha256)"
            )
        return _digests(signed), signer


def load_trust(keys_dir: Path | None, ca_file: Path | None) -> Trust:
    """Every `*.pem` and `*.pub` public key in `keys_dir`, and the CA certificates in
    `ca_file`. A file that is not a usable key stops the server: trust must not shrink
    silently."""
    verifiers: list[tuple[str, Verifier]] = []
    if keys_dir is not None:
        if not keys_dir.is_dir():
            raise TrustError(f"--trusted-keys {keys_dir} is not a directory")
        for file in sorted(p for p in keys_dir.iterdir() if p.suffix in KEY_SUFFIXES):
            try:
                verifiers.append((file.name, sign_ec_key.Verifier(file)))
            except (ValueError, TypeError, OSError) as exc:
                raise TrustError(
                    f"--trusted-keys: {file} is not an ECDSA (P-256, P-384, P-521) public key "
                    f"in PEM: {exc}"
                ) from exc
    if ca_file is not None:
        try:
            verifiers.append((ca_file.name, sign_certificate.Verifier([ca_file])))
        except (ValueError, OSError) as exc:
            raise TrustError(f"--trusted-ca {ca_file}: no PEM certificates ({exc})") from exc
    return Trust(tuple(verifiers))


def generate_keys(private_path: Path, public_path: Path) -> str:
    """A new ECDSA P-256 key pair in PEM; the private key file is created with mode 0600.
    Returns the public key's fingerprint (SHA-256 of its PEM, as the signature records it)."""
    key = ec.generate_private_key(ec.SECP256R1())
    private = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    fd = os.open(private_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as handle:
        handle.write(private)
    public = key.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    public_path.write_bytes(public)
    return hashlib.sha256(public).hexdigest()


def sign(model_dir: Path, private_key: Path) -> Path:
    """Sign a model directory as `model_signing sign key MODEL --private_key KEY --signature
    MODEL/model.sig` does."""
    target = model_dir / SIGNATURE_FILE
    model_signing.signing.Config().use_elliptic_key_signer(
        private_key=private_key
    ).set_hashing_config(
        model_signing.hashing.Config().set_ignored_paths(paths=[SIGNATURE_FILE])
    ).sign(model_dir, target)
    return target


def _digests(signed: manifest.Manifest) -> dict[str, str]:
    return {rd.identifier: rd.digest.digest_hex for rd in signed.resource_descriptors()}


def _key_hint(signature: sign_sigstore_pb.Signature) -> str:
    material = signature.bundle.verification_material
    key = getattr(material, "public_key", None)
    hint = getattr(key, "hint", None)
    return f" (it names key {hint})" if hint else ""
