"""A server with front-ends binds its sockets in its runtime directory: under a $TMPDIR too
long for a socket's path (108 bytes at most), the directory goes under /tmp instead, and a
socket binds there."""

from __future__ import annotations

import shutil
import socket
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from service.frontends.runtime import DISPATCH_SOCKET, MAX_SOCKET_PATH, make_runtime_dir


@settings(max_examples=20, deadline=None, derandomize=True, database=None)
@given(extra=st.integers(0, 120))
def test_the_dispatch_socket_binds_whatever_tmpdir_is(extra: int) -> None:
    base = Path("/tmp") / ("d" * max(extra, 1))
    base.mkdir(exist_ok=True)
    try:
        runtime = make_runtime_dir(str(base))
        try:
            path = runtime / DISPATCH_SOCKET
            assert len(str(path)) <= MAX_SOCKET_PATH
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
                sock.bind(str(path))
            if len(str(base / "paddlequic-12345678" / DISPATCH_SOCKET)) <= MAX_SOCKET_PATH:
                assert runtime.parent == base  # $TMPDIR kept where it fits
        finally:
            shutil.rmtree(runtime)
    finally:
        base.rmdir()
