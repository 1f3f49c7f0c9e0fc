"""Signed models in the OpenSSF model-signing format (the `model-signing` package): an in-toto
statement in a Sigstore bundle, `models/NAME/model.sig`, covering config.pbtxt and every
version directory, its subject name the model's name.

The server checks one version at a time: the signature verifies with a trusted key (or a
certificate chaining to the trusted CA), the subject is the model, and config.pbtxt plus every
file of the version match the signed manifest exactly. An ensemble is checked the same way: its
config.pbtxt (the steps) is what it has to sign. The files are read once, through
descriptors opened without following symlinks, and the bytes hashed are the bytes written to a
private copy that the workers load, so nothing changed on disk after the check is ever run.

What reads signatures and keys (model-signing itself) is in `signatures.py`: importing it
takes about a third of a second, which only a server that checks signatures pays.
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
from typing import IO, Protocol

SIGNATURE_FILE = "model.sig"
CONFIG_FILE = "config.pbtxt"
log = logging.getLogger("paddlequic.signing")
_CHUNK = 1 << 20
_OPEN_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_OPEN_FILE = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC


class SignatureError(Exception):
    """The version is refused; the message names the file or the key."""


class TrustError(ValueError):
    """The trusted keys or CA given to the server cannot be used."""


class Trust(Protocol):
    """Who may sign (`signatures.Trust`, made by `signatures.load_trust`)."""

    def manifest(self, model_dir: Path, name: str) -> tuple[dict[str, str], str]:
        """The signed file digests (path -> SHA-256 hex) and who signed them, or
        SignatureError."""
        ...


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
    signed, signer = trust.manifest(model_dir, name)
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
