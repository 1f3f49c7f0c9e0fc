"""transport.h3.aioquic refuses to load with any aioquic but the pinned one, whichever of its
modules is imported first (each reaches into aioquic's private internals)."""

from __future__ import annotations

import pkgutil
import subprocess
import sys

import transport.h3.aioquic

# Each module in a fresh interpreter's turn: sys.modules is emptied of the package first.
_PROBE = """
import importlib, importlib.metadata, sys
real = importlib.metadata.version
importlib.metadata.version = lambda name: "1.8.0" if name == "aioquic" else real(name)
for name in sys.argv[1:]:
    for loaded in [m for m in sys.modules if m.startswith("transport.h3.aioquic")]:
        del sys.modules[loaded]
    try:
        importlib.import_module(name)
    except ImportError as exc:
        assert "aioquic==1.7.2 exactly" in str(exc), exc
        print("refused", name)
    else:
        print("loaded", name)
"""


def test_every_module_of_the_package_refuses_another_aioquic() -> None:
    modules = [
        f"transport.h3.aioquic.{info.name}"
        for info in pkgutil.iter_modules(transport.h3.aioquic.__path__)
    ]
    assert len(modules) > 1
    done = subprocess.run(
        [sys.executable, "-c", _PROBE, *modules],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    assert done.stdout.split("\n")[:-1] == [f"refused {name}" for name in modules]
