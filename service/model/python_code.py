"""Whether a Python model's own code may make BLS calls, for a model whose config does not say
(python_instance_queues): its requests go straight to its instances' queues, where a worker
cannot make BLS calls, only when no file of the model's directory names
`pb_utils.InferenceRequest`, through which every BLS call is made.

Any doubt keeps the model off the queues, where BLS calls work as they always did: code the
server cannot read (compiled modules, archives), a file it cannot open, a linked directory, or
a directory larger than it reads. Code outside the directory (an installed package; any
module at all for a model without its sandbox) is not read: a model whose BLS calls are made
there says `python_instance_queues` false, and until it does its calls are refused with an
error naming that parameter. Model code is untrusted, but a model that hides its calls from
this reading only has its own calls refused."""

from __future__ import annotations

import os
import stat
from pathlib import Path

BLS_NAME = b"InferenceRequest"
MAX_ENTRIES = 4096  # files and directories under the model's directory
MAX_BYTES = 16 << 20  # of Python source read, in all
# Importable code the server does not read: compiled modules, bytecode, archives.
UNREAD = (".so", ".pyd", ".pyc", ".pyo", ".zip", ".egg", ".whl")
# Bytecode of the source beside it, which Python imports only in its source's place.
CACHE = "__pycache__"


def bls_reason(directory: Path) -> str | None:
    """Why the model in `directory` may make BLS calls, for the log; None: no file of its
    code names one."""
    try:
        return _read(directory)
    except OSError as exc:
        return f"its directory cannot be read ({exc.strerror})"


def _read(directory: Path) -> str | None:
    entries = total = 0
    for root, dirs, names in os.walk(directory, onerror=_raise):
        entries += len(dirs) + len(names)
        if entries > MAX_ENTRIES:
            return (
                f"its directory holds more than {MAX_ENTRIES} entries, more than the server reads"
            )
        if Path(root).name == CACHE:
            continue
        for name in dirs:  # os.walk does not go into linked ones
            if (linked := Path(root, name)).is_symlink():
                return f"{linked.relative_to(directory)} is a link the server does not follow"
        for name in sorted(names):
            path = Path(root, name)
            shown = path.relative_to(directory)
            if name.endswith(UNREAD):
                return f"{shown} is code the server cannot read"
            if name.endswith(".py"):
                if not stat.S_ISREG(path.stat().st_mode):
                    return f"{shown} is not a file the server reads"
                with path.open("rb") as source:
                    text = source.read(MAX_BYTES - total + 1)
                total += len(text)
                if total > MAX_BYTES:
                    return f"its Python files hold more than the {MAX_BYTES} bytes the server reads"
                if BLS_NAME in text:
                    return f"{shown} names pb_utils.InferenceRequest (BLS calls)"
    return None


def _raise(error: OSError) -> None:
    raise error
