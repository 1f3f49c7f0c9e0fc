"""REST answers a client does not read, against a real server: each holds the REST budget of
its client's address until it is taken (--http-receive-budget-per-address), so what the
server holds for clients that never read is bounded, the answers past the budget are refused
429 naming it, another address is still served; a connection whose client takes nothing of an
answer for --http-send-timeout is closed (HTTP/1.1 and HTTP/2; over HTTP/3 its stream is
reset), and what it held is given back. The answers come from `simple_identity`, which sends
its BYTES input back: a NUL byte is six bytes of JSON (`\\u0000`), so a small request gets a
large answer."""

from __future__ import annotations

import asyncio
import http.client
import json
import select
import shutil
import socket
import struct
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import h2.config
import h2.connection
import h2.events
import h2.settings
import pytest

from service.http.bounds import answer_held
from tests.servers import HTTP_PORT, ServerProcess, running_server
from transport.h3.client import H3ClientConnection, client_configuration
from transport.h3.settings import H3Settings
from transport.h3.stream_state import StreamClosed

pytestmark = pytest.mark.e2e

MiB = 1 << 20
FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "simple_identity"
ELEMENT = 3 * MiB // 2  # NUL bytes in a request's one element: its answer is 9 MiB of JSON
PER_ADDRESS = 40 * MiB  # --http-receive-budget-per-address: three such answers, not four
TOTAL = 96 * MiB  # --http-receive-budget
SEND_TIMEOUT_S = 2.0  # --http-send-timeout
UNREAD = 10  # connections of one address that never read their answers
OTHER_ADDRESS = "127.0.0.2"
# Bounds on waits that end well within them on a loaded machine too: the server answering
# every request (logged), and closing a connection that takes nothing.
ANSWERED_WITHIN_S = 60.0
CLOSED_WITHIN_S = 60.0
# What the server may grow by beyond the answers it holds: the event loop's and the ASGI
# server's buffers, the worker's reply, and the allocator's rounding.
SLACK = 16 * MiB


def echoing(root: Path, *extra: str) -> Iterator[ServerProcess]:
    model = root / "models" / "simple_identity"
    (model / "1").mkdir(parents=True)
    shutil.copy(FIXTURE / "config.pbtxt", model / "config.pbtxt")
    shutil.copy(FIXTURE / "model.py", model / "1" / "model.py")
    args = (
        *("--http-port", HTTP_PORT),
        *("--http-send-timeout", str(SEND_TIMEOUT_S)),
        *("--http-receive-budget", str(TOTAL)),
        *("--http-receive-budget-per-address", str(PER_ADDRESS)),
        *extra,
    )
    with running_server(root / "models", root / "server.log", args) as process:
        process.wait_loaded()
        yield process


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """One process, whatever PADDLEQUIC_FRONTENDS says: the RSS read is that process's."""
    yield from echoing(tmp_path_factory.mktemp("unread_answers"), "--frontends", "1")


@pytest.fixture(scope="module")
def tls_server(
    tmp_path_factory: pytest.TempPathFactory, certs_dir: Path
) -> Iterator[ServerProcess]:
    """REST over TLS, and so over HTTP/3 on the same port number."""
    root = tmp_path_factory.mktemp("unread_answers_h3")
    yield from echoing(root, "--http-tls", "--certs-dir", str(certs_dir))


def request() -> tuple[bytes, bytes]:
    """The head and body of an infer request with one BYTES element of ELEMENT NUL bytes, as
    Triton's binary tensor data."""
    element = struct.pack("<I", ELEMENT) + b"\0" * ELEMENT
    tensor = {"name": "INPUT0", "datatype": "BYTES", "shape": [1, 1]}
    document = json.dumps(
        {"inputs": [{**tensor, "parameters": {"binary_data_size": len(element)}}]}
    ).encode()
    head = (
        "POST /v2/models/simple_identity/infer HTTP/1.1\r\nHost: unread\r\n"
        "Content-Type: application/octet-stream\r\n"
        f"Inference-Header-Content-Length: {len(document)}\r\n"
        f"Content-Length: {len(document) + len(element)}\r\n\r\n"
    )
    return head.encode(), document + element


def rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) << 10
    raise AssertionError("no VmRSS")


def answered_calls(server: ServerProcess) -> float:
    """The model's REST calls counted: each is, once answered, before its answer is sent."""
    return sum(
        sample.value
        for sample in server.metrics()
        if sample.name == "paddlequic_requests_total"
        and sample.labels.get("model") == "simple_identity"
        and sample.labels.get("transport") == "http"
    )


def wait_until(done: Callable[[], bool], limit_s: float, what: str) -> None:
    deadline = time.monotonic() + limit_s
    while not done():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def closed_by_server(sock: socket.socket) -> bool:
    """The server ended the connection (its reset or end seen), nothing read."""
    poller = select.poll()
    poller.register(sock, select.POLLRDHUP | select.POLLHUP | select.POLLERR)
    return bool(poller.poll(0))


def read_all(sock: socket.socket) -> bytes:
    """What the connection holds, to its end (a reset after its data ends it too)."""
    sock.settimeout(10)
    got = bytearray()
    while True:
        try:
            data = sock.recv(1 << 20)
        except ConnectionResetError:
            break
        if not data:
            break
        got += data
    return bytes(got)


def split(answer: bytes) -> tuple[int, dict[str, str], bytes]:
    head, _, body = answer.partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    headers = dict(line.lower().split(": ", 1) for line in lines[1:])
    return int(lines[0].split(" ")[1]), headers, body


def served_whole(server: ServerProcess, address: str) -> int:
    """An answer read as it comes, from `address`: its status once all of it arrived."""
    head, body = request()
    connection = http.client.HTTPConnection(
        "127.0.0.1", server.http_port, timeout=60, source_address=(address, 0)
    )
    try:
        headers = dict(line.split(": ", 1) for line in head.decode().split("\r\n")[1:] if line)
        connection.request("POST", "/v2/models/simple_identity/infer", body, headers)
        response = connection.getresponse()
        data = response.read()
        assert len(data) == int(response.getheader("content-length") or -1)
        return response.status
    finally:
        connection.close()


def test_answers_not_read_hold_the_addresses_budget_until_their_connections_close(
    server: ServerProcess,
) -> None:
    """Ten connections of one address send a request each and read nothing: three answers
    (9 MiB each) fit the address's 40 MiB, the other seven are refused 429 naming the budget,
    and the server grows by about the three, not ten. Another address is served meanwhile. The
    three connections are closed once they have taken nothing for --http-send-timeout, their
    answers cut short, and the address is served again."""
    held = answer_held(6 * ELEMENT)  # at least: the JSON has its document around the element
    assert PER_ADDRESS // held == 3
    socket_holds = int(Path("/proc/sys/net/ipv4/tcp_wmem").read_text().split()[2])
    if socket_holds >= 6 * ELEMENT:
        pytest.skip(f"a socket here holds a whole answer (tcp_wmem {socket_holds}): none stalls")
    pid = server.process.pid
    before_calls = answered_calls(server)
    before = rss(pid)
    head, body = request()
    unread = []
    for _ in range(UNREAD):
        sock = socket.create_connection(("127.0.0.1", server.http_port))
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.sendall(head + body)
        unread.append(sock)
    try:
        wait_until(
            lambda: answered_calls(server) >= before_calls + UNREAD,
            ANSWERED_WITHIN_S,
            "the server did not answer every request",
        )
        grown = rss(pid) - before
        assert served_whole(server, OTHER_ADDRESS) == 200
        assert grown < 3 * answer_held(6 * ELEMENT + 4 * 1024) + SLACK, grown
        wait_until(
            lambda: all(closed_by_server(sock) for sock in unread),
            CLOSED_WITHIN_S,
            "a connection whose client read nothing was not closed",
        )
        answers = [split(read_all(sock)) for sock in unread]
    finally:
        for sock in unread:
            sock.close()
    statuses = sorted(status for status, _, _ in answers)
    assert statuses == [200] * 3 + [429] * 7, statuses
    for status, headers, got in answers:
        if status == 200:
            assert len(got) < int(headers["content-length"])  # cut short: never taken
        else:
            assert b"--http-receive-budget-per-address" in got and "retry-after" in headers
    assert served_whole(server, "127.0.0.1") == 200


def test_an_http2_stream_whose_window_stays_shut_closes_its_connection(
    server: ServerProcess,
) -> None:
    """An HTTP/2 client that opens no window for its stream's answer (SETTINGS_INITIAL_WINDOW_
    SIZE 0) gets the answer's headers and nothing of its body, and its connection is closed
    once --http-send-timeout passes without a byte taken."""
    head, body = request()
    headers = dict(line.split(": ", 1) for line in head.decode().split("\r\n")[1:] if line)
    sock = socket.create_connection(("127.0.0.1", server.http_port))
    connection = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    connection.local_settings = h2.settings.Settings(
        client=True, initial_values={h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: 0}
    )
    connection.initiate_connection()
    stream = connection.get_next_available_stream_id()
    connection.send_headers(
        stream,
        [
            (":method", "POST"),
            (":scheme", "http"),
            (":authority", "unread"),
            (":path", "/v2/models/simple_identity/infer"),
            *((name.lower(), value) for name, value in headers.items() if name != "Host"),
        ],
    )
    sock.sendall(connection.data_to_send())
    status = ""
    data = 0
    sock.settimeout(1.0)
    deadline = time.monotonic() + CLOSED_WITHIN_S
    try:
        sent = 0
        ended = False
        while time.monotonic() < deadline and not ended:
            window = min(connection.local_flow_control_window(stream), 1 << 14)
            if sent < len(body) and window > 0:
                piece = body[sent : sent + window]
                sent += len(piece)
                connection.send_data(stream, piece, end_stream=sent == len(body))
                sock.sendall(connection.data_to_send())
                continue
            try:
                received = sock.recv(1 << 16)
            except TimeoutError:
                continue
            except ConnectionResetError:
                break
            if not received:
                break
            for event in connection.receive_data(received):
                if isinstance(event, h2.events.ResponseReceived):
                    status = dict(event.headers)[b":status"].decode()
                elif isinstance(event, h2.events.DataReceived):
                    data += len(event.data)
                elif isinstance(event, h2.events.StreamEnded | h2.events.ConnectionTerminated):
                    ended = True
            sock.sendall(connection.data_to_send())
        assert time.monotonic() < deadline, "the connection was not closed"
    finally:
        sock.close()
    assert status == "200" and data == 0 and not ended, (status, data, ended)


def h3_head(method: str, path: str) -> list[tuple[bytes, bytes]]:
    return [
        (b":method", method.encode()),
        (b":scheme", b"https"),
        (b":path", path.encode()),
        (b":authority", b"localhost"),
    ]


async def test_an_http3_stream_not_read_is_reset(
    tls_server: ServerProcess, certs_dir: Path
) -> None:
    """An HTTP/3 client that reads nothing of its answer (a stream window of 64 KiB, never
    extended) gets its headers, and its stream reset once --http-send-timeout passes without a
    byte taken; the connection serves on."""
    head, body = request()
    fields = [
        (name.lower().encode(), value.encode())
        for name, value in (line.split(": ", 1) for line in head.decode().split("\r\n")[1:] if line)
        if name != "Host"
    ]
    configuration = client_configuration(
        "localhost", str(certs_dir / "ca.pem"), settings=H3Settings(stream_window=64 << 10)
    )
    connection = await H3ClientConnection.connect("127.0.0.1", tls_server.http_port, configuration)
    try:
        async with asyncio.timeout(CLOSED_WITHIN_S):
            await connection.wait_connected()
            stream = connection.open_stream()
            stream.send_headers([*h3_head("POST", "/v2/models/simple_identity/infer"), *fields])
            await stream.send_data(body, end=True)
            headers = await stream.wait_headers()
            assert dict(headers)[b":status"] == b"200"
            failed = await stream.wait_failed()
        assert isinstance(failed, StreamClosed)
        ready = connection.open_stream()
        ready.send_headers(h3_head("GET", "/v2/health/ready"), end=True)
        async with asyncio.timeout(CLOSED_WITHIN_S):
            assert dict(await ready.wait_headers())[b":status"] == b"200"
    finally:
        await connection.close()
