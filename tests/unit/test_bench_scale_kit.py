"""`make bench-scale-kit` picks the wheels a bare host needs: the server's runtime with every
dependency its markers keep for that Python, the host's own packages left out."""

from __future__ import annotations

import pytest
from packaging.utils import canonicalize_name

from scripts.bench_scale_kit import ROOTS, closure


def test_the_closure_holds_the_transports_and_their_dependencies() -> None:
    found = closure(ROOTS, "3.12")
    for name in ("grpcio", "protobuf", "aioquic", "pylsqpack", "cryptography", "model-signing"):
        assert canonicalize_name(name) in found
    # aioquic's own needs, reached only through it.
    assert {"service-identity", "pyopenssl", "certifi"} <= set(found)
    assert all(found.values())


def test_markers_for_older_pythons_are_not_followed() -> None:
    # async-timeout is redis's only on Python < 3.11.3.
    assert "async-timeout" not in closure(("redis",), "3.12")


def test_a_need_not_installed_here_is_named() -> None:
    # On Python 3.10 redis needs async-timeout, which this environment (3.11) lacks.
    with pytest.raises(SystemExit, match=r"async-timeout is needed on Python 3\.10"):
        closure(("redis",), "3.10")
