"""Two servers sharing one Redis ticket store, as two replicas behind one address: a ticket one
issued is redeemed once by the other and refused everywhere after; with Redis unreachable the
server still serves, with full handshakes."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from pathlib import Path

import pytest
from aioquic.tls import SessionTicket

from clients.tickets import SessionTicketCache
from tests.e2e.test_zero_rtt import infer_once, stats
from tests.redis_server import running_redis
from tests.servers import ServerProcess, free_port, model_repository, running_server

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def shared(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, list[str]]]:
    root = tmp_path_factory.mktemp("shared-tickets")
    (root / "ticket.key").write_bytes(bytes(range(32)))
    (root / "ticket.key").chmod(0o600)
    with running_redis(root / "redis") as url:
        yield root, ["--ticket-store", url, "--ticket-key-file", str(root / "ticket.key")]


@pytest.fixture(scope="module")
def replicas(
    shared: tuple[Path, list[str]], certs_dir: Path
) -> Iterator[tuple[ServerProcess, ServerProcess]]:
    root, args = shared
    args = [*args, "--certs-dir", str(certs_dir)]
    repo = model_repository(root / "models", ["mlp"])
    with (
        running_server(repo, root / "a.log", args) as a,
        running_server(repo, root / "b.log", args) as b,
    ):
        yield a, b


async def ticket_from(server: ServerProcess, certs_dir: Path) -> SessionTicket:
    cache = SessionTicketCache()
    assert await infer_once(server, certs_dir, cache) == "full"
    ticket = cache.take(SessionTicketCache.key("localhost", "localhost", server.port))
    assert ticket is not None
    return ticket


def aimed_at(ticket: SessionTicket, server: ServerProcess) -> SessionTicketCache:
    """A client cache holding a copy of `ticket` for `server`."""
    cache = SessionTicketCache()
    cache.add(SessionTicketCache.key("localhost", "localhost", server.port), copy.deepcopy(ticket))
    return cache


async def test_a_ticket_from_replica_a_is_accepted_once_by_b_then_refused_everywhere(
    replicas: tuple[ServerProcess, ServerProcess], certs_dir: Path
) -> None:
    a, b = replicas
    issued = await ticket_from(a, certs_dir)
    assert await infer_once(b, certs_dir, aimed_at(issued, b)) == "0rtt-accepted"
    assert await infer_once(a, certs_dir, aimed_at(issued, a)) == "0rtt-rejected"
    assert await infer_once(b, certs_dir, aimed_at(issued, b)) == "0rtt-rejected"
    assert stats(b).h3_tickets["redeemed"] >= 1


async def test_unreachable_redis_leaves_full_handshakes_working(
    shared: tuple[Path, list[str]], certs_dir: Path
) -> None:
    root, _ = shared
    args = ["--certs-dir", str(certs_dir), "--ticket-key-file", str(root / "ticket.key")]
    args += ["--ticket-store", f"redis://127.0.0.1:{free_port()}/0"]
    repo = model_repository(root / "models-down", ["mlp"])
    with running_server(repo, root / "down.log", args) as server:
        cache = SessionTicketCache()
        assert await infer_once(server, certs_dir, cache) == "full"
        assert await infer_once(server, certs_dir, cache) == "0rtt-rejected"
    assert "ticket store unreachable" in (root / "down.log").read_text()


@pytest.mark.parametrize(
    ("key_mode", "store_dir_mode", "message"),
    [
        (0o644, 0o700, "ticket.key has mode 0644: other users can read or replace it"),
        (0o600, 0o777, "lets other users replace the ticket store"),
    ],
    ids=["key-0644", "store-directory-0777"],
)
def test_a_ticket_store_others_can_read_or_write_stops_the_server(
    tmp_path: Path, certs_dir: Path, key_mode: int, store_dir_mode: int, message: str
) -> None:
    key = tmp_path / "ticket.key"
    key.write_bytes(bytes(range(32)))
    key.chmod(key_mode)
    store_dir = tmp_path / "store"
    store_dir.mkdir()
    store_dir.chmod(store_dir_mode)
    store = f"sqlite://{store_dir / 'tickets.db'}"
    args = ["--ticket-store", store, "--ticket-key-file", str(key), "--certs-dir", str(certs_dir)]
    server = ServerProcess(model_repository(tmp_path / "models", []), tmp_path / "log", args)
    try:
        assert server.process.wait(120) == 1
    finally:
        server.stop()
    assert message in server.log_text()
