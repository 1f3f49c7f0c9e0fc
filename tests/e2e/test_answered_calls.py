"""Every call counted and logged, whoever answered it, and answered the same on both
transports: request messages that fail to parse (INVALID_ARGUMENT naming the message, within
the request log's budget, no traceback), calls the HTTP/3 transport answers itself, and
deadlines that race the handler's answer."""

from __future__ import annotations

import asyncio
import struct
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from clients.quic_channel import QuicChannel
from protos.paddlequic.v1 import testing_pb2, testing_pb2_grpc
from tests.servers import METRICS_PORT, ServerProcess, model_repository, running_server
from transport.grpc import headers as wire

TRANSPORTS = ("h2", "h3")
MODEL_INFER = "/inference.GRPCInferenceService/ModelInfer"
MODEL_STREAM_INFER = "/inference.GRPCInferenceService/ModelStreamInfer"
# Field 1 (model_name) announcing 2 GiB of a string that never comes: not a message.
GARBAGE = b"\x0a\xff\xff\xff\xff\x07abc"
FLOOD = 30  # malformed requests per transport
BURST = 3  # --log-failure-burst; the rate is so low that no line comes back within the test
Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


class Served:
    def __init__(self, server: ServerProcess, certs: Path, metrics_port: int) -> None:
        self.server = server
        self.certs = certs
        self.metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"

    def channel(self, transport: str) -> grpc.aio.Channel | QuicChannel:
        if transport == "h2":
            return grpc.aio.insecure_channel(self.server.address)
        return QuicChannel(f"localhost:{self.server.port}", ca_file=str(self.certs / "ca.pem"))

    def scrape(self) -> Samples:
        with urllib.request.urlopen(self.metrics_url, timeout=10) as response:
            text = response.read().decode()
        return {
            (s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text)
            for s in family.samples
        }

    def requests(self, samples: Samples, transport: str, rpc: str, code: str) -> float:
        labels = {"model": "", "version": "", "transport": transport, "rpc": rpc, "code": code}
        return samples.get(("paddlequic_requests_total", tuple(sorted(labels.items()))), 0.0)

    def log_lines(self) -> list[str]:
        return self.server.log_text().splitlines()

    def request_lines(self, **fields: str) -> list[dict[str, Any]]:
        return [
            obj
            for obj in self.server.log_objects()
            if obj.get("event") == "request" and all(obj.get(k) == v for k, v in fields.items())
        ]


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    root = tmp_path_factory.mktemp("answered")
    args = [
        *("--certs-dir", str(root / "certs"), "--metrics-port", METRICS_PORT),
        *("--log-sample-ratio", "0", "--testing-service"),
        *("--log-failure-burst", str(BURST), "--log-failure-rate", "0.0001"),
    ]
    repository = model_repository(root / "models", ["mlp"])
    with running_server(repository, root / "server.log", args) as server:
        yield Served(server, root / "certs", server.metrics_port)


async def until_counted(served: Served, check: Any) -> Samples:
    """The server records a call once its handler finished: poll, a bounded number of times."""
    for _ in range(100):
        samples = served.scrape()
        if check(samples):
            return samples
        await asyncio.sleep(0.1)
    return samples


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_a_flood_of_unparsable_requests_is_invalid_argument_counted_and_barely_logged(
    served: Served, transport: str
) -> None:
    before = served.scrape()
    async with served.channel(transport) as channel:
        infer = channel.unary_unary(MODEL_INFER, None, None)
        for _ in range(FLOOD):
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await infer(GARBAGE, timeout=30)
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert (refused.value.details() or "").startswith(
                "failed to parse inference.ModelInferRequest: "
            )
        stream = channel.stream_stream(MODEL_STREAM_INFER, None, None)(iter([GARBAGE]), timeout=30)
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            async for _ in stream:
                pass
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "failed to parse inference.ModelInferRequest" in (refused.value.details() or "")

    def counted(samples: Samples) -> bool:
        return all(
            served.requests(samples, transport, rpc, "INVALID_ARGUMENT")
            - served.requests(before, transport, rpc, "INVALID_ARGUMENT")
            == count
            for rpc, count in (("ModelInfer", FLOOD), ("ModelStreamInfer", 1))
        )

    assert counted(await until_counted(served, counted))
    lines = served.request_lines(transport=transport, rpc="ModelInfer", status="INVALID_ARGUMENT")
    assert len(lines) == BURST
    assert all("failed to parse inference.ModelInferRequest" in line["error"] for line in lines)
    # grpcio logged each at ERROR with a traceback ("Exception deserializing request!").
    assert not [line for line in served.log_lines() if '"level": "error"' in line]


async def h3_raw_call(
    served: Served, block: list[tuple[bytes, bytes]], body: bytes, end: bool = False
) -> bytes:
    """A hand-written HTTP/3 request (its upload stays open unless `end`); the grpc-status
    answered."""
    async with served.channel("h3") as channel:
        assert isinstance(channel, QuicChannel)
        stream = (await channel.connection()).open_stream()
        stream.send_headers(block)
        await stream.send_data(body, end=end)
        answer = dict(await asyncio.wait_for(stream.wait_headers(), 30))
        return answer[b"grpc-status"]


async def test_calls_the_http3_transport_answers_itself_are_counted_and_logged(
    served: Served,
) -> None:
    """Unknown method, refused encoding, a deadline that passes during the upload: no handler
    runs, and the call still reaches the metrics and the request log (any path but a
    registered method's under `_unknown`: the rpc label stays bounded)."""
    before = served.scrape()
    authority = f"localhost:{served.server.port}"
    unary = "/paddlequic.v1.Testing/Unary"
    half_message = struct.pack(">BI", 0, 64)
    cases = [
        (wire.request_headers(authority, "/no.such.Service/Method", None), b"", b"12"),
        (
            [*wire.request_headers(authority, unary, None), (b"grpc-encoding", b"snappy")],
            b"",
            b"12",
        ),
        (
            [
                *wire.request_headers(authority, "/random.Service/Z3f9", None),
                (b"grpc-encoding", b"snappy"),
            ],
            b"",
            b"12",
        ),
        (wire.request_headers(authority, unary, 1.0), half_message, b"4"),
    ]
    for block, body, status in cases:
        assert await h3_raw_call(served, block, body) == status
    expected = {("_unknown", "UNIMPLEMENTED"): 2, ("Unary", "UNIMPLEMENTED"): 1}
    expected[("Unary", "DEADLINE_EXCEEDED")] = 1

    def counted(samples: Samples) -> bool:
        return all(
            served.requests(samples, "h3", rpc, code) - served.requests(before, "h3", rpc, code)
            == count
            for (rpc, code), count in expected.items()
        )

    assert counted(await until_counted(served, counted))
    assert served.request_lines(transport="h3", rpc="_unknown", status="UNIMPLEMENTED")
    deadline_lines = served.request_lines(transport="h3", rpc="Unary", status="DEADLINE_EXCEEDED")
    assert deadline_lines


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_a_deadline_that_races_the_answer_is_recorded_as_deadline_exceeded(
    served: Served, transport: str
) -> None:
    """The handler outlives its deadline and then answers (as a batch that ran past it): the
    client gets DEADLINE_EXCEEDED, and so do the metrics, not the late answer's status or
    UNKNOWN (grpcio raised ExecuteBatchError). Over HTTP/3 the request is written by hand
    with only the server's deadline, so it is the server's that passes and its answer that
    is checked; grpcio's client gives up at its own deadline, just before the server's."""
    before = served.scrape()
    late = testing_pb2.EchoRequest(
        sleep_seconds=60, outlive_cancel=True, status_code=grpc.StatusCode.NOT_FOUND.value[0]
    )
    if transport == "h3":
        authority = f"localhost:{served.server.port}"
        block = wire.request_headers(authority, "/paddlequic.v1.Testing/Unary", 0.5)
        message = late.SerializeToString()
        body = struct.pack(">BI", 0, len(message)) + message
        assert await h3_raw_call(served, block, body, end=True) == b"4"
    else:
        async with served.channel(transport) as channel:
            with pytest.raises(grpc.aio.AioRpcError) as failed:
                await testing_pb2_grpc.TestingStub(channel).Unary(late, timeout=0.5)
            assert failed.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED

    # Over HTTP/2 the client's cancel at its deadline counts as the deadline when it comes
    # within the margin of the server's (tests/unit/test_observed_calls.py); on a host loaded
    # enough that the headers waited longer to be read, as CANCELLED. Once, either way.
    ended = ("DEADLINE_EXCEEDED",) if transport == "h3" else ("DEADLINE_EXCEEDED", "CANCELLED")

    def counted(samples: Samples) -> bool:
        return (
            sum(
                served.requests(samples, transport, "Unary", code)
                - served.requests(before, transport, "Unary", code)
                for code in ended
            )
            == 1
        )

    after = await until_counted(served, counted)
    assert counted(after)
    for code in ("UNKNOWN", "NOT_FOUND"):
        assert served.requests(after, transport, "Unary", code) == served.requests(
            before, transport, "Unary", code
        )


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_unknown_methods_are_counted_and_logged_under_one_label(
    served: Served, transport: str
) -> None:
    """grpcio answers an unknown method itself, unseen; the server answers it the same and
    counts it, under `_unknown` whatever the path."""
    before = served.scrape()
    async with served.channel(transport) as channel:
        for index in range(2):
            method = channel.unary_unary(f"/no.such.Service{index}/Method{index}", None, None)
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await method(b"", timeout=30)
            assert refused.value.code() == grpc.StatusCode.UNIMPLEMENTED

    def counted(samples: Samples) -> bool:
        return (
            served.requests(samples, transport, "_unknown", "UNIMPLEMENTED")
            - served.requests(before, transport, "_unknown", "UNIMPLEMENTED")
            == 2
        )

    assert counted(await until_counted(served, counted))
    assert served.request_lines(transport=transport, rpc="_unknown", status="UNIMPLEMENTED")
