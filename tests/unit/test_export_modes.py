"""`make models` exports a repository other users can read: the container image runs the server
as uid 10001 over a read-only mount of it (`docker run -v $PWD/models:/models:ro`)."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

from tests.servers import REPO_ROOT


def _export(out: Path) -> None:
    subprocess.run(
        [
            sys.executable,
            "scripts/export_models.py",
            "--out",
            str(out),
            "--only",
            "mlp",
            "tokenizer",
        ],
        cwd=REPO_ROOT,
        capture_output=True,
        check=True,
        timeout=300,
        preexec_fn=lambda: os.umask(0o077),  # the strictest umask: modes must not follow it
    )


def _modes(root: Path) -> dict[str, int]:
    return {str(p.relative_to(root)): stat.S_IMODE(p.stat().st_mode) for p in root.rglob("*")}


def test_exported_models_are_readable_by_everyone(tmp_path: Path) -> None:
    _export(tmp_path)
    modes = _modes(tmp_path)
    assert {"mlp/config.pbtxt", "mlp/1/inference.pdiparams", "tokenizer/config.pbtxt"} <= set(modes)
    for name, mode in modes.items():
        assert mode == (0o755 if (tmp_path / name).is_dir() else 0o644), name
    # A model exported before this rule (mkdtemp's 0700) is fixed by the next export.
    (tmp_path / "mlp").chmod(0o700)
    (tmp_path / "mlp" / "config.pbtxt").chmod(0o600)
    _export(tmp_path)
    assert _modes(tmp_path) == modes
