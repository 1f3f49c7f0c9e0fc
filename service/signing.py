"""Signed model versions: an Ed25519 signature over a manifest of every file in a version
directory (relative path, size, SHA-256).

`paddlequic sign` writes `paddlequic.sig` into the version directory; the server, given trusted
public keys, checks it before any file reaches Paddle: an unknown key, a bad signature, or a
file modified, added or removed since signing refuses the version, naming the file.
"""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

SIGNATURE_FILE = "paddlequic.sig"
log = logging.getLogger("paddlequic.signing")
_CHUNK = 1 << 20


class SignatureError(Exception):
    """The version's signature does not hold; the message says which file or key."""


@dataclass(frozen=True)
class Entry:
    path: str  # relative, with "/" separators
    size: int
    sha256: str


def manifest(version_dir: Path) -> list[Entry]:
    """Every regular file below the version directory but the signature, each read once."""
    entries = []
    for file in sorted(p for p in version_dir.rglob("*") if p.is_file()):
        relative = file.relative_to(version_dir).as_posix()
        if relative == SIGNATURE_FILE:
            continue
        digest, size = hashlib.sha256(), 0
        with file.open("rb") as handle:
            while chunk := handle.read(_CHUNK):
                digest.update(chunk)
                size += len(chunk)
        entries.append(Entry(relative, size, digest.hexdigest()))
    return entries


def _canonical(entries: list[Entry]) -> bytes:
    return json.dumps([[e.path, e.size, e.sha256] for e in entries], separators=(",", ":")).encode()


def key_id(public_key: Ed25519PublicKey) -> str:
    raw = public_key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return hashlib.sha256(raw).hexdigest()[:16]


def generate_keys(private_path: Path, public_path: Path) -> str:
    """A new key pair; the private key file is created with mode 0600. Returns the key id."""
    key = Ed25519PrivateKey.generate()
    private = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    fd = os.open(private_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as handle:
        handle.write(private)
    public_path.write_bytes(
        key.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )
    )
    return key_id(key.public_key())


def sign(version_dir: Path, private_key_path: Path) -> Path:
    key = serialization.load_pem_private_key(private_key_path.read_bytes(), password=None)
    if not isinstance(key, Ed25519PrivateKey):
        raise SignatureError(f"{private_key_path} is not an Ed25519 private key")
    entries = manifest(version_dir)
    document = {
        "key_id": key_id(key.public_key()),
        "files": [[e.path, e.size, e.sha256] for e in entries],
        "signature": base64.b64encode(key.sign(_canonical(entries))).decode(),
    }
    target = version_dir / SIGNATURE_FILE
    target.write_text(json.dumps(document, indent=1) + "\n")
    return target


def load_trusted_keys(directory: Path) -> dict[str, Ed25519PublicKey]:
    """Every `*.pub` Ed25519 public key in the directory, by key id."""
    keys = {}
    for file in sorted(directory.glob("*.pub")):
        key = serialization.load_pem_public_key(file.read_bytes())
        if isinstance(key, Ed25519PublicKey):
            keys[key_id(key)] = key
    return keys


def verify(version_dir: Path, trusted: dict[str, Ed25519PublicKey]) -> str:
    """The signing key's id, or SignatureError saying what does not hold."""
    signature_file = version_dir / SIGNATURE_FILE
    if not signature_file.is_file():
        raise SignatureError(f"{version_dir} is not signed (no {SIGNATURE_FILE})")
    try:
        document = json.loads(signature_file.read_text())
        signed = [Entry(str(p), int(s), str(h)) for p, s, h in document["files"]]
        signature = base64.b64decode(document["signature"])
        signer = str(document["key_id"])
    except (ValueError, KeyError, TypeError) as exc:
        raise SignatureError(f"{signature_file} is malformed: {exc}") from exc
    key = trusted.get(signer)
    if key is None:
        raise SignatureError(f"{version_dir} is signed by unknown key {signer}")
    try:
        key.verify(signature, _canonical(signed))
    except InvalidSignature:
        raise SignatureError(
            f"{signature_file}: the signature does not match its manifest"
        ) from None
    _compare(version_dir, signed, manifest(version_dir))
    return signer


def _compare(version_dir: Path, signed: list[Entry], actual: list[Entry]) -> None:
    expected = {e.path: e for e in signed}
    found = {e.path: e for e in actual}
    for path in sorted(set(expected) | set(found)):
        if path not in found:
            raise SignatureError(f"{version_dir}: signed file {path} was removed")
        if path not in expected:
            raise SignatureError(f"{version_dir}: file {path} was added after signing")
        if expected[path] != found[path]:
            raise SignatureError(f"{version_dir}: file {path} was modified after signing")


@dataclass(frozen=True)
class SigningPolicy:
    """With trusted keys, bad signatures are always refused; unsigned versions are refused
    only when `required`, and otherwise load with a warning."""

    trusted: dict[str, Ed25519PublicKey]
    required: bool

    def check(self, version_dir: Path) -> None:
        if not (version_dir / SIGNATURE_FILE).is_file() and not self.required:
            log.warning(
                "%s is not signed; loading it (use --require-signed to refuse)", version_dir
            )
            return
        verify(version_dir, self.trusted)
