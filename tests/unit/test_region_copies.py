"""The parent's shared-memory regions copied to front-ends (service/frontends/region_copies.py)
over a real SOCK_SEQPACKET pair and real POSIX shared memory: a copy reads the object the
parent registered even once another is made under its name, a front-end connecting later is
given every region (more than its socket holds at once: the rest as it reads), an unregister
returns once the front-end let go of it, and a front-end that does not, leaves too much
unread, or cannot be told, is ended."""

from __future__ import annotations

import asyncio
import json
import secrets
import socket
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from service.dataplane.shared_memory import SharedMemory
from service.frontends import region_copies
from service.frontends.region_copies import FrontendRegions, RegionCopies
from service.inference import errors
from service.inference.shared_memory import MAX_REGIONS, SHM_DIR, Caller, SharedMemoryRegions

ROOT = Caller(0)
SIZE = 64


@pytest.fixture
def key() -> Iterator[str]:
    name = f"pq-copies-{secrets.token_hex(4)}"
    path = Path(SHM_DIR) / name
    path.write_bytes(b"A" * SIZE)
    yield "/" + name
    path.unlink(missing_ok=True)


@dataclass
class Host:
    """The parent's registry and mirror, and one front-end's copies on a socket pair."""

    shared: SharedMemory
    mirror: FrontendRegions
    copies: RegionCopies
    parent_end: socket.socket
    frontend_end: socket.socket
    ended: list[str] = field(default_factory=list)

    def connect(self) -> None:
        """The front-end says hello; the parent reads it as its queues socket does."""
        self.copies.listen(self.frontend_end, 0)
        assert self.parent_end.recv(1024)  # the hello
        self.mirror.connected("0", self.parent_end)

    def held(self) -> None:
        """The front-end's answers read by the parent."""
        asyncio.get_running_loop().add_reader(self.parent_end.fileno(), self._answer)

    def _answer(self) -> None:
        data = self.parent_end.recv(1024)
        if data:
            self.mirror.held("0", int(json.loads(data)["held"]))


@pytest.fixture
async def host() -> AsyncIterator[Host]:
    parent_end, frontend_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    parent_end.setblocking(False)
    shared = SharedMemory("local")
    ended: list[str] = []
    mirror = FrontendRegions(shared.regions, ended.append)
    shared.mirror = mirror
    copies = RegionCopies(SharedMemoryRegions())
    made = Host(shared, mirror, copies, parent_end, frontend_end, ended)
    yield made
    loop = asyncio.get_running_loop()
    for end in (parent_end, frontend_end):
        if end.fileno() != -1:
            loop.remove_reader(end.fileno())
            end.close()
    shared.regions.close_all()
    made.copies.regions.close_all()


async def test_a_copy_reads_the_object_the_parent_registered(host: Host, key: str) -> None:
    host.connect()
    host.held()
    await host.shared.register(ROOT, "r", key, 8, 16)
    copies = host.copies.regions
    assert copies.holds(ROOT, ["r"]) and not copies.holds(ROOT, ["r", "other"])
    # Another object under the same name: the copy's descriptor is the parent's object's.
    path = Path(SHM_DIR) / key.lstrip("/")
    path.unlink()
    path.write_bytes(b"B" * SIZE)
    with copies.using(ROOT, "r", write=True) as region:
        assert (region.offset, region.byte_size, region.key) == (8, 16, key)
        assert region.read(0, 16) == b"A" * 16
        region.write(0, b"written")
    with host.shared.regions.using(ROOT, "r") as region:
        assert region.read(0, 7) == b"written"  # one object
    assert not copies.holds(Caller(65534), ["r"])  # another uid's names are its own


async def test_a_frontend_connecting_later_is_given_every_region(host: Host, key: str) -> None:
    await host.shared.register(ROOT, "a", key, 0, 8)  # no front-end yet: nobody to wait for
    await host.shared.register(ROOT, "b", key, 8, 8)
    host.connect()
    for _ in range(500):  # until the front-end's loop read both (no answer is awaited here)
        if host.copies.regions.holds(ROOT, ["a", "b"]):
            break
        await asyncio.sleep(0.01)
    assert host.copies.regions.holds(ROOT, ["a", "b"])


async def test_an_unregister_returns_once_the_frontend_let_go(host: Host, key: str) -> None:
    host.connect()
    host.held()
    await host.shared.register(ROOT, "a", key, 0, 8)
    await host.shared.register(ROOT, "b", key, 8, 8)
    copies = host.copies.regions
    with copies.using(ROOT, "a") as held:  # a request here holds it meanwhile
        await host.shared.unregister(ROOT, "")
        assert not copies.holds(ROOT, ["a"]) and not copies.holds(ROOT, ["b"])
        assert held.read(0, 8) == b"A" * 8  # the request finishes with it
    assert held.closed
    with pytest.raises(errors.ServiceError, match="'a' is not registered"), copies.using(ROOT, "a"):
        pass
    assert host.ended == []


async def test_a_frontend_that_does_not_let_go_is_ended(
    host: Host, key: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(region_copies, "UNREGISTER_WAIT_S", 0.05)
    monkeypatch.setattr(region_copies, "REGISTER_WAIT_S", 0.05)
    host.connect()  # its answers are never read: it is stuck, as far as the parent knows
    await host.shared.register(ROOT, "a", key, 0, 8)
    assert host.ended == []  # a register does not wait for it long, and ends nobody
    await host.shared.unregister(ROOT, "a")
    assert host.ended == ["0"]
    assert not host.shared.regions.holds(ROOT, ["a"])


async def test_a_frontend_that_cannot_be_told_is_ended(host: Host, key: str) -> None:
    host.connect()
    host.frontend_end.close()
    await host.shared.register(ROOT, "a", key, 0, 8)
    assert host.ended == ["0"]
    await host.shared.register(ROOT, "b", key, 0, 8)  # it is no longer told
    assert host.ended == ["0"]


UIDS = 5  # callers that each register the most regions a uid may hold


async def many_regions(host: Host, key: str) -> list[tuple[Caller, str]]:
    Path(SHM_DIR, key.lstrip("/")).chmod(0o666)  # every uid may open it
    named = []
    for uid in range(UIDS):
        for n in range(MAX_REGIONS):
            await host.shared.register(Caller(uid), f"r{n}", key, 0, 8)
            named.append((Caller(uid), f"r{n}"))
    return named


async def test_a_frontend_slow_to_read_gets_every_region_as_it_reads(host: Host, key: str) -> None:
    """More regions than the socket's buffer holds wait in the parent until the front-end
    reads: none is lost, none ends it."""
    host.parent_end.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    named = await many_regions(host, key)
    host.connect()  # the front-end's loop reads as the socket fills, the parent sends the rest
    host.held()
    for _ in range(1000):
        if all(host.copies.regions.holds(caller, [name]) for caller, name in named):
            break
        await asyncio.sleep(0.01)
    assert all(host.copies.regions.holds(caller, [name]) for caller, name in named)
    assert host.ended == []


async def test_a_frontend_that_leaves_too_much_unread_is_ended(
    host: Host, key: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(region_copies, "MAX_QUEUED", 10)
    host.parent_end.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    await many_regions(host, key)
    host.frontend_end.send(json.dumps({"frontend": 0, "regions": True}).encode())
    assert host.parent_end.recv(1024)
    host.mirror.connected("0", host.parent_end)  # the front-end never reads
    assert host.ended == ["0"]
