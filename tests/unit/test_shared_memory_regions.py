"""Registered shared-memory regions (service/inference/shared_memory.py) on real POSIX shared
memory: reads and writes stay inside a region whatever offset and size a request names, an
object shrunk under the server gives an error and no SIGBUS, a region unregistered while a
request holds it stays open until that request is done, only shm_open's names are taken, an
object is used only as far as the caller's uid could open it itself, and a region is known to
the uid that registered it only."""

from __future__ import annotations

import os
import secrets
import struct
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from service.api.shared_memory import local_peer
from service.inference import errors
from service.inference.shared_memory import SHM_DIR, Caller, SharedMemoryRegions

SIZE = 256
ROOT = Caller(0)
NOBODY = Caller(65534, frozenset({65534}))


@pytest.fixture
def key() -> Iterator[str]:
    name = f"pq-test-{secrets.token_hex(4)}"
    path = Path(SHM_DIR) / name
    path.write_bytes(bytes(range(256)) * (SIZE // 256))
    yield "/" + name
    path.unlink(missing_ok=True)


@settings(max_examples=200, deadline=None, derandomize=True)
@given(
    region_offset=st.integers(0, SIZE),
    region_size=st.integers(1, SIZE),
    offset=st.integers(-4, SIZE + 4),
    size=st.integers(0, SIZE + 4),
)
def test_a_read_succeeds_exactly_inside_its_region(
    region_offset: int, region_size: int, offset: int, size: int
) -> None:
    name = f"pq-sweep-{secrets.token_hex(4)}"
    path = Path(SHM_DIR) / name
    path.write_bytes(bytes(i % 251 for i in range(SIZE)))
    regions = SharedMemoryRegions()
    try:
        if region_offset + region_size > SIZE:
            with pytest.raises(errors.ServiceError):
                regions.register(ROOT, "r", "/" + name, region_offset, region_size)
            return
        regions.register(ROOT, "r", "/" + name, region_offset, region_size)
        with regions.using(ROOT, "r") as region:
            if offset >= 0 and offset + size <= region_size:
                start = region_offset + offset
                assert region.read(offset, size) == bytes(
                    i % 251 for i in range(start, start + size)
                )
            else:
                with pytest.raises(errors.ServiceError) as outside:
                    region.read(offset, size)
                assert outside.value.code == grpc.StatusCode.INVALID_ARGUMENT
    finally:
        regions.close_all()
        path.unlink()


def test_a_shrunk_object_is_an_error_not_a_crash(key: str) -> None:
    regions = SharedMemoryRegions()
    regions.register(ROOT, "r", key, 0, SIZE)
    os.truncate(Path(SHM_DIR) / key.lstrip("/"), 16)
    with regions.using(ROOT, "r") as region, pytest.raises(errors.ServiceError) as short:
        region.read(0, SIZE)
    assert "shrank" in short.value.message
    regions.close_all()


def test_unregistered_while_in_use_stays_open_until_done(key: str) -> None:
    regions = SharedMemoryRegions()
    regions.register(ROOT, "r", key, 0, SIZE)
    with regions.using(ROOT, "r") as region:
        regions.unregister(ROOT, "r")
        assert regions.status(ROOT, "") == []
        assert region.read(0, 4) == bytes(range(4))  # its descriptor is still open
        region.write(0, b"abcd")
    assert region.closed
    with pytest.raises(errors.ServiceError), regions.using(ROOT, "r"):
        pass
    assert (Path(SHM_DIR) / key.lstrip("/")).read_bytes()[:4] == b"abcd"


@pytest.mark.parametrize(
    "bad", ["", "../etc/passwd", "/a/b", "//x", "/..", "x" * 300, "/dev/shm/x", "a\x00b"]
)
def test_only_shm_open_names_are_taken(bad: str) -> None:
    with pytest.raises(errors.ServiceError) as refused:
        SharedMemoryRegions().register(ROOT, "r", bad, 0, 4)
    assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT


def test_a_link_in_dev_shm_is_not_followed(key: str) -> None:
    link = Path(SHM_DIR) / f"pq-link-{secrets.token_hex(4)}"
    link.symlink_to(Path(SHM_DIR) / key.lstrip("/"))
    try:
        with pytest.raises(errors.ServiceError) as refused:
            SharedMemoryRegions().register(ROOT, "r", "/" + link.name, 0, 4)
        assert "cannot be opened" in refused.value.message
    finally:
        link.unlink()


def test_registrations_are_bounded_and_names_unique(key: str) -> None:
    regions = SharedMemoryRegions(limit=2)
    regions.register(ROOT, "a", key, 0, 4)
    with pytest.raises(errors.ServiceError) as twice:
        regions.register(ROOT, "a", key, 0, 4)
    assert twice.value.code == grpc.StatusCode.ALREADY_EXISTS
    regions.register(ROOT, "b", key, 4, 4)
    with pytest.raises(errors.ServiceError) as full:
        regions.register(ROOT, "c", key, 8, 4)
    assert full.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    regions.close_all()


@pytest.mark.parametrize(
    ("peer", "local"),
    [
        ("ipv4:127.0.0.1:5000", True),
        ("ipv4:127.8.9.1:5000", True),
        ("ipv6:[::1]:5000", True),
        ("ipv6:%5B::1%5D:5000", True),  # grpcio percent-encodes the brackets
        ("ipv6:[::ffff:127.0.0.1]:5000", True),  # IPv4 on a dual-stack listener
        ("unix:/tmp/socket", False),  # the server listens on no Unix socket
        ("ipv4:10.0.0.2:5000", False),
        ("ipv6:[2001:db8::1]:5000", False),
        ("ipv6:[::ffff:10.0.0.1]:1", False),
        ("", False),
        ("weird", False),
    ],
)
def test_local_callers_are_told_apart(peer: str, local: bool) -> None:
    assert local_peer(peer) is local


def object_of(key: str) -> Path:
    return Path(SHM_DIR) / key.lstrip("/")


@pytest.mark.parametrize(
    ("mode", "readable", "writable"),
    [(0o600, False, False), (0o640, False, False), (0o644, True, False), (0o666, True, True)],
)
def test_an_object_is_used_only_as_far_as_its_caller_could_open_it(
    key: str, mode: int, readable: bool, writable: bool
) -> None:
    """The objects are root's; the server (root) could open them all, the caller (nobody)
    only what their others' bits grant."""
    object_of(key).chmod(mode)
    regions = SharedMemoryRegions()
    if not readable:
        with pytest.raises(errors.ServiceError) as refused:
            regions.register(NOBODY, "r", key, 0, SIZE)
        assert refused.value.code == grpc.StatusCode.PERMISSION_DENIED
        assert "uid 65534, another user, may not read" in refused.value.message
        assert regions.status(NOBODY, "") == []
        return
    regions.register(NOBODY, "r", key, 0, SIZE)
    with regions.using(NOBODY, "r") as region:
        assert region.read(0, 4) == bytes(range(4))
    if writable:
        with regions.using(NOBODY, "r", write=True) as region:
            region.write(0, b"abcd")
        assert object_of(key).read_bytes()[:4] == b"abcd"
    else:
        with pytest.raises(errors.ServiceError) as refused, regions.using(NOBODY, "r", True):
            pass
        assert refused.value.code == grpc.StatusCode.PERMISSION_DENIED
        assert "takes no output" in refused.value.message
        assert object_of(key).read_bytes()[:4] == bytes(range(4))
    regions.close_all()


def test_a_region_is_unknown_to_every_other_uid(key: str) -> None:
    regions = SharedMemoryRegions()
    regions.register(ROOT, "r", key, 0, SIZE)
    unknown = []
    for attempt in (
        lambda: regions.status(NOBODY, "r"),
        lambda: regions.using(NOBODY, "r").__enter__(),
        lambda: regions.status(NOBODY, "never-registered"),
    ):
        with pytest.raises(errors.ServiceError) as refused:
            attempt()
        unknown.append((refused.value.code, refused.value.message.replace("never-registered", "r")))
    assert (
        unknown == [(grpc.StatusCode.NOT_FOUND, "shared-memory region 'r' is not registered")] * 3
    )
    assert regions.status(NOBODY, "") == []
    regions.unregister(NOBODY, "")  # unregisters nobody's regions only: none
    regions.unregister(NOBODY, "r")
    assert [r.name for r in regions.status(ROOT, "")] == ["r"]
    object_of(key).chmod(0o644)
    regions.register(NOBODY, "r", key, 0, 4)  # the same name is nobody's own
    assert len(regions.status(NOBODY, "")) == len(regions.status(ROOT, "")) == 1
    regions.close_all()


def test_the_region_limit_is_per_uid(key: str) -> None:
    object_of(key).chmod(0o644)
    regions = SharedMemoryRegions(limit=1)
    regions.register(NOBODY, "a", key, 0, 4)
    with pytest.raises(errors.ServiceError) as full:
        regions.register(NOBODY, "b", key, 0, 4)
    assert full.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "uid 65534 holds its maximum of 1" in full.value.message
    regions.register(ROOT, "b", key, 0, 4)  # another uid is not held back
    regions.close_all()


def test_an_object_with_an_access_control_list_is_refused(key: str) -> None:
    """An ACL could grant a user more or less than the mode says; the server does not read
    ACLs, so it uses no object that has one (here: root's 0600 object, readable by uid 1000
    through `user:1000:r--`)."""
    entries = [(0x01, 6, -1), (0x02, 4, 1000), (0x04, 0, -1), (0x10, 4, -1), (0x20, 0, -1)]
    acl = struct.pack("<I", 2) + b"".join(struct.pack("<HHi", *entry) for entry in entries)
    os.setxattr(object_of(key), "system.posix_acl_access", acl)
    with pytest.raises(errors.ServiceError) as refused:
        SharedMemoryRegions().register(Caller(1000), "r", key, 0, 4)
    assert refused.value.code == grpc.StatusCode.PERMISSION_DENIED
    assert "access control list" in refused.value.message
