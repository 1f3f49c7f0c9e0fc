"""A model's files sent with RepositoryModelLoad (Triton's `file:<path>` parameters): as
untrusted as any caller's bytes, so their names and sizes are checked before anything is
written (`plan_upload`, a pure decision), then written into a fresh private directory that
nothing else writes to (`write_upload`), which becomes the model's directory for that load."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from service.lifecycle.signing import CONFIG_FILE

FILE_PREFIX = "file:"
MAX_PATH_CHARS = 1024  # one uploaded path, in characters
MAX_PART_CHARS = 255  # one component of it (a file or directory name)
MAX_DEPTH = 16  # directories above an uploaded file, at most


@dataclass(frozen=True)
class UploadLimits:
    """--max-upload-files and --max-upload-bytes: per load request."""

    max_files: int = 64
    max_bytes: int = 32 << 20


@dataclass(frozen=True)
class Refused:
    """Why an upload is refused; `too_large` tells a bound passed (the count, the size, or a
    name longer than a file system holds: Triton fails writing it and answers INTERNAL) from a
    bad path."""

    reason: str
    too_large: bool = False


Layout = tuple[PurePosixPath, ...]  # the accepted paths, relative to the model's directory


def plan_upload(sizes: Mapping[str, int], limits: UploadLimits) -> Layout | Refused:
    """The paths to write (given each uploaded path and its size in bytes), or why none is:
    every path relative, plain and inside the model's directory, no file where another
    needs a directory, within the count and total size bounds."""
    if len(sizes) > limits.max_files:
        return Refused(
            f"{len(sizes)} files uploaded; at most {limits.max_files} per load "
            "(--max-upload-files)",
            too_large=True,
        )
    total = sum(sizes.values())
    if total > limits.max_bytes:
        return Refused(
            f"{total} bytes of files uploaded; at most {limits.max_bytes} per load "
            "(--max-upload-bytes)",
            too_large=True,
        )
    paths = []
    for name in sorted(sizes):
        problem = _path_problem(name)
        if problem is not None:
            return Refused(f"uploaded path {name!r} refused: {problem}")
        if any(len(part) > MAX_PART_CHARS for part in name.split("/")):
            return Refused(
                f"uploaded path {name!r} refused: a component is longer than {MAX_PART_CHARS} "
                "characters (NAME_MAX)",
                too_large=True,
            )
        paths.append(PurePosixPath(name))
    files = set(paths)
    for path in paths:
        clash = next((parent for parent in path.parents if parent in files), None)
        if clash is not None:
            return Refused(f"uploaded path {str(path)!r} needs {str(clash)!r} as a directory")
    return tuple(paths)


def _path_problem(name: str) -> str | None:
    if not name:
        return "empty"
    if len(name) > MAX_PATH_CHARS:
        return f"longer than {MAX_PATH_CHARS} characters"
    if not (name.isascii() and name.isprintable()) or "\\" in name:
        return "only printable ASCII characters without backslashes are allowed"
    if name.startswith("/"):
        return "absolute"
    parts = name.split("/")
    if any(part in ("", ".", "..") for part in parts):
        return "empty, '.' and '..' components are not allowed"
    if len(parts) > MAX_DEPTH + 1:
        return f"deeper than {MAX_DEPTH} directories"
    if name == CONFIG_FILE:
        return f"the {CONFIG_FILE} of an upload comes from the `config` parameter"
    return None


def write_upload(
    name: str, layout: Layout, contents: Mapping[str, bytes], config_text: str
) -> Path:
    """A fresh private directory (0700) holding NAME/, the model's directory: the uploaded
    files and config.pbtxt. Files are created exclusively and never through a link, in a
    directory only this process writes; the caller removes it (`remove_upload`)."""
    root = Path(tempfile.mkdtemp(prefix="paddlequic-upload-"))
    try:
        model_dir = root / name
        model_dir.mkdir(mode=0o700)
        for path in layout:
            _write(model_dir, path, contents[str(path)])
        _write(model_dir, PurePosixPath(CONFIG_FILE), config_text.encode())
    except BaseException:
        remove_upload(root)
        raise
    return root


def _write(model_dir: Path, path: PurePosixPath, data: bytes) -> None:
    target = model_dir.joinpath(*path.parts)
    target.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    descriptor = os.open(target, flags, 0o600)
    with os.fdopen(descriptor, "wb") as file:
        file.write(data)


def remove_upload(root: Path) -> None:
    shutil.rmtree(root, ignore_errors=True)
