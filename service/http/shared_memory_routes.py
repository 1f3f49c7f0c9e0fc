"""Triton's shared-memory routes (`/v2/systemsharedmemory/...`, `/v2/cudasharedmemory/...`)
over the regions gRPC's calls register too (service/dataplane/shared_memory.py): the same
modes, owners and bounds, a REST caller known by the uid that owns its connection's socket."""

from __future__ import annotations

import ipaddress
from typing import Any

from service.dataplane.shared_memory import Peer, Placement, SharedMemory
from service.http.json_tensors import RegionReader, parsed
from service.http.status import Restricted
from service.inference import errors
from service.inference.shared_memory import Caller
from service.inference.socket_owners import Address


def rest_peer(
    client: tuple[str, int] | None, server: tuple[str, int] | None, http_version: str
) -> Peer:
    """A REST request's peer, from its ASGI scope: the connection's two ends (the server's
    own end makes the owner's lookup exact)."""
    datagram = http_version == "3"
    text = f"{client[0]}:{client[1]}" if client else "unknown"
    return Peer(
        _socket(client),
        text,
        "UDP (HTTP/3)" if datagram else "TCP",
        datagram,
        None if datagram else _socket(server),
    )


class SharedMemoryRoutes:
    def __init__(self, shared: SharedMemory) -> None:
        self.shared = shared

    async def status(self, peer: Peer, name: str) -> list[dict[str, Any]]:
        """`GET .../status`: `[{"name", "key", "offset", "byte_size"}]`, the caller's
        regions (one named: NOT_FOUND unless it is registered)."""
        caller = await self.shared.caller(peer)
        return [
            {"name": r.name, "key": r.key, "offset": r.offset, "byte_size": r.byte_size}
            for r in self.shared.regions.status(caller, name)
        ]

    async def register(self, peer: Peer, name: str, body: bytes) -> None:
        """`POST .../region/NAME/register`, body `{"key", "offset"?, "byte_size"}`."""
        document = parsed(body) if body.strip() else None
        if not isinstance(document, dict):
            raise errors.invalid("the body must be a JSON object: {key, offset, byte_size}")
        key = document.get("key")
        offset = document.get("offset", 0)
        byte_size = document.get("byte_size")
        if not isinstance(key, str):
            raise errors.invalid("register: 'key' must be a string")
        for field, value in (("offset", offset), ("byte_size", byte_size)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise errors.invalid(f"register: '{field}' must be a non-negative integer")
        assert isinstance(byte_size, int)  # checked above
        caller = await self.shared.caller(peer)
        await self.shared.register(caller, name, key, offset, byte_size)

    async def unregister(self, peer: Peer, name: str) -> None:
        """`POST .../region/NAME/unregister`, or `.../unregister` for every region."""
        await self.shared.unregister(await self.shared.caller(peer), name)

    async def tensor_caller(self, peer: Peer, refusal: str | None) -> Caller:
        """The caller of an infer request whose tensors name regions, unless the
        `shared-memory` restricted category refuses it (`refusal`: the header it lacks)."""
        if refusal is not None:
            raise Restricted(refusal, "this request's tensors name shared-memory regions")
        return await self.shared.caller(peer)

    def reader(self, caller: Caller | None, max_bytes: int) -> RegionReader | None:
        """How an input is read from `caller`'s region, at most `max_bytes` (what a body may
        carry, --http-max-input-size); None without a caller."""
        if caller is None:
            return None
        holder, limit = caller, (max_bytes, "--http-max-input-size")

        def read(where: Placement, name: str, datatype: str, shape: tuple[int, ...]) -> bytes:
            return self.shared.read_input(holder, where, name, datatype, shape, limit)

        return read

    def cuda_status(self, peer: Peer, name: str) -> list[dict[str, Any]]:
        self.shared.cuda_status(peer, name)
        return []

    def cuda_register(self, peer: Peer, name: str) -> None:
        self.shared.cuda_register(peer, name)

    def cuda_unregister(self, peer: Peer) -> None:
        """Nothing is registered, so nothing is left registered (Triton's answer)."""
        self.shared.check_mode(peer)


def _socket(end: tuple[str, int] | None) -> tuple[Address, int] | None:
    if not end:
        return None
    try:
        return ipaddress.ip_address(end[0].strip("[]")), int(end[1])
    except (ValueError, TypeError):
        return None  # a Unix socket's path
