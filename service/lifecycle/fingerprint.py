"""What tells a version's files changed without reading them, so a reload starts only the
versions whose files did."""

from __future__ import annotations

from pathlib import Path

from service.lifecycle.signing import CONFIG_FILE, SIGNATURE_FILE

Fingerprint = tuple[tuple[str, int, int], ...]


def fingerprint(directory: Path) -> Fingerprint:
    """What identifies a version's files without reading them: path, size, mtime; with the
    model's config.pbtxt and signature, which it is loaded (and checked) with."""
    entries = []
    model_files = [directory.parent / CONFIG_FILE, directory.parent / SIGNATURE_FILE]
    for file in [p for p in model_files if p.is_file()] + sorted(
        p for p in directory.rglob("*") if p.is_file()
    ):
        stat = file.stat()
        entries.append(
            (file.relative_to(directory.parent).as_posix(), stat.st_size, stat.st_mtime_ns)
        )
    return tuple(entries)
