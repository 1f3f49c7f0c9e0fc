"""The REST receive budget against a real server: what the bodies of one address's requests
hold at once is bounded (--http-receive-budget-per-address), so connections that send most of
a body and stall grow the server by at most that, another address is still served, and each
stalled request ends 408 or 429, and a chunked body that finds no room 429 naming the
budget; a JSON body whose parse would hold more
than an address may is refused 413 unread, naming the binary extension, which carries the same
tensor."""

from __future__ import annotations

import asyncio
import json
import subprocess
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from service.http.body_budget import BINARY_HOLD_FACTOR, JSON_HOLD_FACTOR
from tests.servers import HTTP_PORT, ServerProcess, model_repository, running_server

pytestmark = pytest.mark.e2e

MiB = 1 << 20
PER_ADDRESS = 24 * MiB  # --http-receive-budget-per-address
TOTAL = 48 * MiB  # --http-receive-budget
MAX_INPUT = 8 * MiB  # --http-max-input-size
BODY_TIMEOUT_S = 4.0  # --http-body-timeout
JSON_PART = 64  # bytes of JSON a stalled request's body declares before its binary data
STALLED_BODY = 5 * MiB  # each charged twice as binary data: two fit an address's budget
STALLED = 10  # connections of one address that send all but a byte of such a body
# A stalled request is answered at the body timeout, its connection closed at most the lingering
# close's 5 s later: far within this, on a loaded machine too.
CLOSED_WITHIN_S = 60.0
WAITERS_AFTER_S = 1.0  # the first two are admitted (and read) before the others come
OTHER_ADDRESS = "127.0.0.2"
# What the server may grow by beyond the two admitted bodies' bytes: the event loop's and
# the ASGI server's buffers (a connection's read is 64 KiB), and the allocator's rounding.
SLACK = 12 * MiB
ROWS = np.linspace(-1.0, 1.0, 256, dtype=np.float32).reshape(1, 256)


def budgeted(root: Path, frontends: int) -> Iterator[ServerProcess]:
    repository = model_repository(root / "models", ["mlp"])
    args = (
        *("--frontends", str(frontends)),
        *("--http-port", HTTP_PORT),
        *("--http-max-input-size", str(MAX_INPUT)),
        *("--http-body-timeout", str(BODY_TIMEOUT_S)),
        *("--http-receive-budget", str(TOTAL)),
        *("--http-receive-budget-per-address", str(PER_ADDRESS)),
    )
    with running_server(repository, root / "server.log", args) as process:
        yield process


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """One process, whatever PADDLEQUIC_FRONTENDS says: the RSS read is that process's."""
    yield from budgeted(tmp_path_factory.mktemp("receive_budget"), 1)


@pytest.fixture(scope="module")
def frontends(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    yield from budgeted(tmp_path_factory.mktemp("receive_budget_frontends"), 2)


def rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) << 10
    raise AssertionError("no VmRSS")


def head(length: int, json_part: int | None) -> bytes:
    binary = "" if json_part is None else f"Inference-Header-Content-Length: {json_part}\r\n"
    return (
        "POST /v2/models/mlp/infer HTTP/1.1\r\nHost: budget\r\n"
        f"Content-Type: application/octet-stream\r\nContent-Length: {length}\r\n{binary}\r\n"
    ).encode()


def binary_request(rows: np.ndarray) -> tuple[bytes, int]:
    """mlp's input as Triton's binary tensor data: the body and its JSON's length."""
    document = {
        "inputs": [
            {
                "name": "input",
                "datatype": "FP32",
                "shape": list(rows.shape),
                "parameters": {"binary_data_size": rows.nbytes},
            }
        ]
    }
    encoded = json.dumps(document).encode()
    return encoded + rows.tobytes(), len(encoded)


async def stalled(port: int, sent: list[int]) -> str:
    """Sends all but the last byte of a body, then reads the server's answer until the server
    closes the connection (a refused request's is closed, its unread body dropped: a server that
    never closes it fails this within CLOSED_WITHIN_S rather than holding the test)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        async with asyncio.timeout(CLOSED_WITHIN_S):
            writer.write(head(STALLED_BODY, JSON_PART))
            chunk = b"\0" * MiB
            left = STALLED_BODY - 1
            while left:
                piece = chunk[: min(left, MiB)]
                writer.write(piece)
                await writer.drain()
                left -= len(piece)
                sent[0] += len(piece)
            return (await reader.read()).decode(errors="replace")
    except ConnectionError as exc:  # closed while still sending: its answer came first
        return f"closed: {exc}"
    finally:
        writer.close()


async def answered(port: int, body: bytes, json_part: int, host: str) -> str:
    reader, writer = await asyncio.open_connection("127.0.0.1", port, local_addr=(host, 0))
    try:
        writer.write(head(len(body), json_part) + body)
        await writer.drain()
        return (await asyncio.wait_for(reader.read(1 << 16), 60)).decode(errors="replace")
    finally:
        writer.close()


def status(answer: str) -> str:
    return answer.split(" ", 2)[1] if answer.startswith("HTTP/1.1 ") else answer


async def chunked(port: int, chunk_bytes: int) -> str:
    """A chunked JSON body's first chunk, then its answer (it sends no more)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(
            b"POST /v2/models/mlp/infer HTTP/1.1\r\nHost: budget\r\n"
            b"Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
            + f"{chunk_bytes:x}\r\n".encode()
            + b" " * chunk_bytes
            + b"\r\n"
        )
        await writer.drain()
        # Refused, the connection closes after the answer: read it all.
        return (await asyncio.wait_for(reader.read(), 60)).decode(errors="replace")
    finally:
        writer.close()


async def test_stalled_bodies_hold_at_most_an_addresses_budget(server: ServerProcess) -> None:
    """Two connections send 5 MiB less a byte each and are admitted (10 MiB charged each of
    the address's 24); eight more wait unread, so the server grows by about two bodies, not
    ten (50 MiB). Meanwhile the address's chunked JSON body is refused 429 at a chunk that
    finds no room, naming the budget, and another address is served. The first two end 408 at
    the body timeout, and the waiting each 408 (given room as others ended) or 429."""
    charged = JSON_HOLD_FACTOR * JSON_PART + BINARY_HOLD_FACTOR * (STALLED_BODY - JSON_PART)
    assert PER_ADDRESS // charged == 2
    pid = server.process.pid
    before = rss(pid)
    sent = [0]
    holders = [asyncio.create_task(stalled(server.http_port, sent)) for _ in range(2)]
    await asyncio.sleep(WAITERS_AFTER_S)
    waiters = [asyncio.create_task(stalled(server.http_port, sent)) for _ in range(STALLED - 2)]
    await asyncio.sleep(WAITERS_AFTER_S)
    grown = rss(pid) - before
    room = PER_ADDRESS - 2 * charged
    refused = await chunked(server.http_port, room // JSON_HOLD_FACTOR + 1)
    assert status(refused) == "429", refused
    assert "--http-receive-budget-per-address" in refused and "retry-after" in refused.lower()
    body, json_part = binary_request(ROWS)
    other = await answered(server.http_port, body, json_part, OTHER_ADDRESS)
    assert status(other) == "200", other
    assert grown < 2 * STALLED_BODY + SLACK, (grown, sent[0])
    assert [status(answer) for answer in await asyncio.gather(*holders)] == ["408"] * 2
    waited = [status(answer) for answer in await asyncio.gather(*waiters)]
    assert set(waited) <= {"408", "429"}, waited


def curl_infer(server: ServerProcess, body: bytes, *headers: str) -> tuple[int, bytes]:
    command = ["curl", "-s", "-w", "\n%{http_code}", "--data-binary", "@-"]
    for value in headers:
        command += ["-H", value]
    command.append(f"http://127.0.0.1:{server.http_port}/v2/models/mlp/infer")
    done = subprocess.run(command, input=body, capture_output=True, timeout=60, check=True)
    payload, _, code = done.stdout.rpartition(b"\n")
    return int(code), payload


def test_a_json_body_too_large_to_parse_is_refused_413_and_binary_data_is_served(
    server: ServerProcess,
) -> None:
    """mlp's 32 rows as JSON, spaced out to 600 KB: parsing it would hold 48 times that, more
    than an address's 24 MiB, so it is refused before it is read, naming the fix; the same
    rows as binary data are answered (curl, its own process)."""
    rows = np.tile(ROWS, (32, 1))
    values = ",".join(f"{v:.6f}" + " " * 64 for v in rows.ravel())
    document = (
        '{"inputs":[{"name":"input","datatype":"FP32","shape":[32,256],"data":[' + values + "]}]}"
    ).encode()
    assert JSON_HOLD_FACTOR * len(document) > PER_ADDRESS
    code, payload = curl_infer(server, document, "Content-Type: application/json")
    assert code == 413, payload
    assert "binary tensor data" in json.loads(payload)["error"]
    body, json_part = binary_request(rows)
    code, payload = curl_infer(
        server,
        body,
        "Content-Type: application/octet-stream",
        f"Inference-Header-Content-Length: {json_part}",
    )
    assert code == 200, payload


async def test_the_budget_is_the_hosts_with_front_ends(frontends: ServerProcess) -> None:
    """With --frontends 2 the kernel spreads one address's connections over both front-ends,
    and the address's budget holds for the host: once two stalled bodies hold 20 of its 24
    MiB, a chunked JSON body that needs more than the rest is refused 429 whichever front-end
    takes it (each front-end counted alone would have room for it, and read it until the body
    timeout)."""
    sent = [0]
    holders = [asyncio.create_task(stalled(frontends.http_port, sent)) for _ in range(2)]
    await asyncio.sleep(WAITERS_AFTER_S)
    charged = JSON_HOLD_FACTOR * JSON_PART + BINARY_HOLD_FACTOR * (STALLED_BODY - JSON_PART)
    room = PER_ADDRESS - 2 * charged
    refused = await asyncio.gather(
        *(chunked(frontends.http_port, room // JSON_HOLD_FACTOR + 1) for _ in range(6))
    )
    assert [status(answer) for answer in refused] == ["429"] * 6, refused
    assert [status(answer) for answer in await asyncio.gather(*holders)] == ["408"] * 2
