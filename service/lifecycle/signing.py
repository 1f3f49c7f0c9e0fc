"""Signed models in the OpenSSF model-signing format (the `model-signing` package): an in-toto
statement in a Sigstore bundle, `models/NAME/model.sig`, covering config.pbtxt and every
version directory, its subject name the model's name.

The server checks one version at a time: the signature verifies with a trusted key (or a
certificate chaining to the trusted CA), the subject is the model, and config.pbtxt plus every
file of the version match the signed manifest exactly. An ensemble is checked the same way: its
config.pbtxt (the steps) is what it has to sign. The files are read once, through
descriptors opened without following symlinks, and the bytes hashed are the bytes written to a
private copy that the workers load, so nothing changed on disk after the check is ever run.

The verifiers come from model-signing's internal modules (`model_signing._signing`): its public
API verifies whole directories only, and a version is checked on its own here. The package is
pinned for that reason.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import stat
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import model_signing
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec
from model_signing import manifest
from model_signing._signing import sign_certificate, sign_ec_key, sign_sigstore_pb
from model_signing._signing.signing import Verifier

SIGNATURE_FILE = "model.sig"
CONFIG_FILE = "config.pbtxt"
KEY_SUFFIXES = (".pem", ".pub")
log = logging.getLogger("paddlequic.signing")
_CHUNK = 1 << 20
_OPEN_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_OPEN_FILE = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC


class SignatureError(Exception):
    """The version is refused; the message names the file or the key."""


class TrustError(ValueError):
    """The trusted keys or CA given to the server cannot be used."""


@dataclass(frozen=True)
class Trust:
    """Who may sign: verifiers by the name an operator recognizes (key file or CA file)."""

    verifiers: tuple[tuple[str, Verifier], ...]

    @property
    def names(self) -> list[str]:
        return [name for name, _ in self.verifiers]


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


def signed_manifest(model_dir: Path, name: str, trust: Trust) -> tuple[dict[str, str], str]:
    """The signed file digests (path -> SHA-256 hex) and who signed them, or SignatureError."""
    signature_file = model_dir / SIGNATURE_FILE
    try:
        signature = sign_sigstore_pb.Signature.read(signature_file)
    except FileNotFoundError:
        raise SignatureError(f"model '{name}' is not signed (no {SIGNATURE_FILE})") from None
    except Exception as exc:  # a signature file is untrusted input: any parse error refuses it
        raise SignatureError(f"{signature_file} is not a model-signing bundle: {exc}") from exc
    problems = []
    for signer, verifier in trust.verifiers:
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


def _digests(signed: manifest.Manifest) -> dict[str, str]:
    return {rd.identifier: rd.digest.digest_hex for rd in signed.resource_descriptors()}


def _key_hint(signature: sign_sigstore_pb.Signature) -> str:
    material = signature.bundle.verification_material
    key = getattr(material, "public_key", None)
    hint = getattr(key, "hint", None)
    return f" (it names key {hint})" if hint else ""


def check_version(
    model_dir: Path,
    name: str,
    version: int,
    trust: Trust,
    copy_to: Path | None,
    *,
    ensemble: bool = False,
    served_files: Sequence[str] = (),
) -> str:
    """Verify config.pbtxt and version `version` of a signed model, and `served_files` (files
    of the model's directory the server reads, such as label files); with `copy_to`, the bytes
    checked are written there (config.pbtxt, VERSION/..., the served files) for the workers
    and the server to load. Returns who signed it. An `ensemble` has no files of its own: its
    config.pbtxt (the steps) is what is signed, and its version directory, which may be absent
    or empty, holds nothing unsigned."""
    signed, signer = signed_manifest(model_dir, name, trust)
    prefix = f"{version}/"
    extra = set(served_files)
    wanted = {
        p: d for p, d in signed.items() if p == CONFIG_FILE or p.startswith(prefix) or p in extra
    }
    if not ensemble and not any(p.startswith(prefix) for p in wanted):
        raise SignatureError(
            f"model '{name}' version {version} is not in the signed manifest "
            f"({model_dir / SIGNATURE_FILE}); sign the model again to serve it"
        )
    found = _read_version(model_dir, version, copy_to, optional=ensemble, served_files=extra)
    for path in sorted(set(wanted) | set(found)):
        where = f"{name}/{path}"
        if path not in found:
            raise SignatureError(f"{where}: signed file was removed")
        if path not in wanted:
            raise SignatureError(f"{where} was added after signing")
        if wanted[path] != found[path]:
            raise SignatureError(f"{where} was modified after signing")
    return signer


def _read_version(
    model_dir: Path,
    version: int,
    copy_to: Path | None,
    optional: bool,
    served_files: Iterable[str] = (),
) -> dict[str, str]:
    """SHA-256 of config.pbtxt, of the served files beside it and of every file under
    VERSION/ (which may be missing when `optional`), each read once; symlinks and anything but
    regular files and directories are refused."""
    digests: dict[str, str] = {}
    root = _open_dir(model_dir, None, model_dir.name)
    try:
        for entry in sorted({CONFIG_FILE, *served_files}):
            if Path(entry).name != entry:  # beside config.pbtxt only (read_labels says so)
                continue
            with contextlib.suppress(FileNotFoundError):
                digests[entry] = _copy_file(root, entry, entry, copy_to)
        if not optional or _lexists(str(version), root):
            _copy_tree(root, str(version), copy_to, digests)
    finally:
        os.close(root)
    return digests


def _copy_tree(parent: int, relative: str, copy_to: Path | None, digests: dict[str, str]) -> None:
    directory = _open_dir(relative.rsplit("/", 1)[-1], parent, relative)
    try:
        if copy_to is not None:
            (copy_to / relative).mkdir(mode=0o700)
        for entry in sorted(os.listdir(directory)):
            path = f"{relative}/{entry}"
            mode = os.stat(entry, dir_fd=directory, follow_symlinks=False).st_mode
            if stat.S_ISDIR(mode):
                _copy_tree(directory, path, copy_to, digests)
            elif stat.S_ISREG(mode):
                digests[path] = _copy_file(directory, entry, path, copy_to)
            else:
                raise SignatureError(f"{path} is {_kind(mode)}; only regular files are served")
    finally:
        os.close(directory)


def _open_dir(path: Path | str, parent: int | None, shown: str) -> int:
    try:
        return os.open(path, _OPEN_DIR, dir_fd=parent)
    except OSError as exc:
        if _is_symlink(path, parent):
            raise SignatureError(f"{shown} is a symlink; symlinks are refused") from None
        raise SignatureError(f"{shown} cannot be read: {exc.strerror or exc}") from None


def _copy_file(directory: int, entry: str, relative: str, copy_to: Path | None) -> str:
    try:
        fd = os.open(entry, _OPEN_FILE, dir_fd=directory)
    except OSError as exc:
        if isinstance(exc, FileNotFoundError):
            raise
        if _is_symlink(entry, directory):
            raise SignatureError(f"{relative} is a symlink; symlinks are refused") from None
        raise SignatureError(f"{relative} cannot be read: {exc.strerror or exc}") from None
    digest = hashlib.sha256()
    with os.fdopen(fd, "rb") as source:
        mode = os.fstat(source.fileno()).st_mode
        if not stat.S_ISREG(mode):
            raise SignatureError(f"{relative} is {_kind(mode)}; only regular files are served")
        target = _create(copy_to / relative) if copy_to is not None else None
        try:
            while chunk := source.read(_CHUNK):
                digest.update(chunk)
                if target is not None:
                    target.write(chunk)
        finally:
            if target is not None:
                target.close()
    return digest.hexdigest()


def _create(path: Path) -> IO[bytes]:
    """A new read-only file only this user can read."""
    return os.fdopen(
        os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o400), "wb"
    )


def _lexists(path: str, parent: int) -> bool:
    try:
        os.stat(path, dir_fd=parent, follow_symlinks=False)
    except FileNotFoundError:
        return False
    return True


def _is_symlink(path: Path | str, parent: int | None) -> bool:
    try:
        return stat.S_ISLNK(os.stat(path, dir_fd=parent, follow_symlinks=False).st_mode)
    except OSError:
        return False


def _kind(mode: int) -> str:
    return "a symlink" if stat.S_ISLNK(mode) else "not a regular file"


@dataclass(frozen=True)
class SigningPolicy:
    """With trust configured, a bad signature is always refused; an unsigned model is refused
    only when `required`, and otherwise loads from the repository with a warning."""

    trust: Trust
    required: bool

    def check(
        self,
        model_dir: Path,
        name: str,
        version: int,
        copy_to: Path,
        *,
        ensemble: bool = False,
        served_files: Sequence[str] = (),
    ) -> bool:
        """True: verified, and the checked bytes are in `copy_to`. False: unsigned, allowed."""
        if not self.required and not os.path.lexists(model_dir / SIGNATURE_FILE):
            log.warning(
                "model %s is not signed (no %s); loading it (use --require-signed to refuse)",
                name,
                SIGNATURE_FILE,
            )
            return False
        check_version(
            model_dir,
            name,
            version,
            self.trust,
            copy_to,
            ensemble=ensemble,
            served_files=served_files,
        )
        return True
