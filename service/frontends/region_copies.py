"""System shared-memory regions in front-ends. The parent registers every region (its checks:
the caller's uid, the object's owner and mode) and sends each front-end a copy with the
region's descriptor attached, on the front-end's queues socket (queue_sharing.py): the same
object the parent opened, whatever has since been unlinked or made under its name. A front-
end serves the requests naming regions it holds copies of; one naming a region it does not
hold goes to the parent, which answers it.

A front-end says which of the parent's messages it has applied (numbered, in order): a
register is answered once every front-end holds the region or a moment passed (the requests
of one that does not yet go to the parent); an unregister only once every front-end let go
of it, so that after the answer no process serves a request on the region. A front-end that
does not within UNREGISTER_WAIT_S, leaves more than MAX_QUEUED messages unread, or cannot be
told, is ended (and started again)."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import logging
import os
import socket
from collections.abc import Callable, Sequence
from typing import Any

from service.frontends.link import Questions, received_with_fds
from service.inference.shared_memory import Region, SharedMemoryRegions

log = logging.getLogger("paddlequic.frontends")

REGISTER_WAIT_S = 1.0
UNREGISTER_WAIT_S = 10.0
# The largest message either way: a region (names of at most 128 and 201 characters), or the
# names of a uid's regions dropped at once (at most MAX_REGIONS of them).
MAX_MESSAGE_BYTES = 64 << 10
# Messages waiting for one front-end to read them: every region registered, when it connects,
# then each change. A front-end that leaves more waiting is not reading: it is ended.
MAX_QUEUED = 16384


class FrontendRegions:
    """The parent's end: what the front-ends hold of `regions` (the parent's registry's
    RegionMirror). `end(frontend)`: a front-end that must not go on."""

    def __init__(self, regions: SharedMemoryRegions, end: Callable[[str], None]) -> None:
        self._regions = regions
        self._end = end
        self._told: dict[str, _Told] = {}

    def connected(self, frontend: str, conn: socket.socket) -> None:
        """A front-end's queues connection: it is told of every region registered now."""
        self._lose(frontend)  # its predecessor's, if that one's end was not read yet
        self._told[frontend] = _Told(conn)
        for region in self._regions:
            if self._tell(frontend, _added(region), region) is None:
                return  # ended

    def held(self, frontend: str, number: int) -> None:
        """The front-end applied the messages up to `number`."""
        told = self._told.get(frontend)
        if told is not None:
            told.questions.answered(number)

    def closed(self, conn: socket.socket) -> None:
        for frontend, told in list(self._told.items()):
            if told.conn is conn:
                self._lose(frontend)

    async def registered(self, region: Region) -> None:
        await self._tell_all(_added(region), region, REGISTER_WAIT_S)

    async def unregistered(self, regions: Sequence[Region]) -> None:
        message = {"drop": [[r.owner, r.name] for r in regions]}
        for frontend in await self._tell_all(message, None, UNREGISTER_WAIT_S):
            self._ended(frontend, f"it did not let go of them within {UNREGISTER_WAIT_S:.0f} s")

    async def _tell_all(
        self, message: dict[str, Any], region: Region | None, wait_s: float
    ) -> list[str]:
        """Every front-end told; those that did not say they applied it within `wait_s`."""
        told = {}
        for frontend in list(self._told):
            applied = self._tell(frontend, message, region)
            if applied is not None:
                told[applied] = frontend
        if not told:
            return []
        _, late = await asyncio.wait(told, timeout=wait_s)
        return [told[wait] for wait in late]

    def _tell(
        self, frontend: str, message: dict[str, Any], region: Region | None
    ) -> asyncio.Future[None] | None:
        """The message queued for the front-end and sent as its socket takes it (`region`:
        whose descriptor goes with it); what is done once the front-end applied it (None:
        the front-end is gone, or ended now)."""
        told = self._told.get(frontend)
        if told is None:
            return None
        number, applied = told.questions.ask()
        told.queued.append((json.dumps({**message, "number": number}).encode(), region))
        if len(told.queued) > MAX_QUEUED:
            self._ended(frontend, f"more than {MAX_QUEUED} messages wait for it to read them")
            return None
        self._send(frontend)
        return applied

    def _send(self, frontend: str) -> None:
        """What waits for the front-end, as far as its socket takes it; the rest once it has
        room. A region unregistered meanwhile goes without its descriptor (closed, its
        number perhaps another file's now): the front-end holds no copy of it."""
        told = self._told.get(frontend)
        if told is None:
            return
        loop = asyncio.get_running_loop()
        while told.queued:
            data, region = told.queued[0]
            try:
                if region is None or region.closed:
                    told.conn.send(data)
                else:
                    socket.send_fds(told.conn, [data], [region.fd])
            except BlockingIOError:
                if not told.writing:
                    told.writing = True
                    loop.add_writer(told.conn.fileno(), self._send, frontend)
                return
            except OSError as exc:
                self._ended(frontend, f"its socket failed: {exc.strerror or exc}")
                return
            told.queued.popleft()
        if told.writing:
            told.writing = False
            loop.remove_writer(told.conn.fileno())

    def _ended(self, frontend: str, why: str) -> None:
        log.error("front-end %s is ended: told of shared-memory regions, %s", frontend, why)
        self._lose(frontend)
        self._end(frontend)

    def _lose(self, frontend: str) -> None:
        told = self._told.pop(frontend, None)
        if told is not None:
            if told.writing:
                asyncio.get_running_loop().remove_writer(told.conn.fileno())
            told.questions.none_coming()


class _Told:
    """One front-end's queues connection, as region messages go on it."""

    def __init__(self, conn: socket.socket) -> None:
        self.conn = conn
        self.questions = Questions()
        self.queued: collections.deque[tuple[bytes, Region | None]] = collections.deque()
        self.writing = False  # waiting for the socket to take more


def _added(region: Region) -> dict[str, Any]:
    added = {
        "owner": region.owner,
        "name": region.name,
        "key": region.key,
        "offset": region.offset,
        "byte_size": region.byte_size,
        "read_only": region.read_only,
    }
    return {"add": added}


class RegionCopies:
    """A front-end's end: its copies of the parent's regions, in `regions`."""

    def __init__(self, regions: SharedMemoryRegions) -> None:
        self.regions = regions

    def listen(self, conn: socket.socket, frontend: int) -> None:
        """Take the parent's messages on this front-end's queues connection."""
        conn.send(json.dumps({"frontend": frontend, "regions": True}).encode())
        asyncio.get_running_loop().add_reader(conn.fileno(), self._received, conn, frontend)

    def _received(self, conn: socket.socket, frontend: int) -> None:
        received = received_with_fds(conn, MAX_MESSAGE_BYTES, 1)
        if received is None:
            return
        data, fds = received
        if not data:  # the parent is gone
            asyncio.get_running_loop().remove_reader(conn.fileno())
            return
        number = self.apply(data, fds)
        with contextlib.suppress(OSError):
            conn.send(json.dumps({"frontend": frontend, "held": number}).encode())

    def apply(self, data: bytes, fds: list[int]) -> int:
        """One of the parent's messages (the descriptor attached to it, if any, is this
        object's to keep or close); its number."""
        try:
            message = json.loads(data)
            number = int(message["number"])
            for owner, name in message.get("drop", ()):
                self.regions.forget(int(owner), str(name))
            added = message.get("add")
            if added is not None:
                owner, name = int(added["owner"]), str(added["name"])
                self.regions.forget(owner, name)  # an older registration under the name
                read_only = added["read_only"]
                if len(fds) == 1:
                    region = Region(
                        name,
                        str(added["key"]),
                        int(added["offset"]),
                        int(added["byte_size"]),
                        fds.pop(),
                        owner,
                        None if read_only is None else str(read_only),
                    )
                    self.regions.adopt(region)
            return number
        finally:
            for fd in fds:
                os.close(fd)
