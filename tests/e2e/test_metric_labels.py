"""Label values that come from the network are bounded: random model names, versions and
method names add no series to /metrics, on either transport."""

from __future__ import annotations

import asyncio
import random
import string
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from clients.inference_client import build_request
from clients.quic_channel import QuicChannel
from protos.inference import grpc_service_pb2 as pb
from protos.inference import grpc_service_pb2_grpc as pb_grpc
from tests.servers import METRICS_PORT, ServerProcess, model_repository, running_server

ROUNDS = 100  # per kind of call and transport
Series = set[tuple[str, tuple[tuple[str, str], ...]]]


class Labelled:
    def __init__(self, server: ServerProcess, certs: Path, metrics_port: int) -> None:
        self.server = server
        self.ca_file = str(certs / "ca.pem")
        self.metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"

    def channel(self, transport: str) -> grpc.aio.Channel | QuicChannel:
        if transport == "h2":
            return grpc.aio.insecure_channel(self.server.address)
        return QuicChannel(f"localhost:{self.server.port}", ca_file=self.ca_file)

    def series(self) -> Series:
        with urllib.request.urlopen(self.metrics_url, timeout=10) as response:
            text = response.read().decode()
        return {
            (s.name, tuple(sorted(s.labels.items())))
            for family in text_string_to_metric_families(text)
            for s in family.samples
        }


@pytest.fixture(scope="module")
def labelled(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Labelled]:
    root = tmp_path_factory.mktemp("labels")
    args = ["--certs-dir", str(root / "certs"), "--metrics-port", METRICS_PORT]
    repository = model_repository(root / "models", ["mlp"])
    with running_server(repository, root / "server.log", args) as server:
        yield Labelled(server, root / "certs", server.metrics_port)


def _name(rng: random.Random) -> str:
    return "".join(rng.choices(string.ascii_letters + string.digits, k=60))


async def _calls(labelled: Labelled, transport: str, rng: random.Random, rounds: int) -> None:
    """Unknown models, unknown versions of a served model, unknown methods."""
    good = {"input": np.ones((1, 256), np.float32)}
    async with labelled.channel(transport) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        for _ in range(rounds):
            with pytest.raises(grpc.aio.AioRpcError) as unknown_model:
                await stub.ModelInfer(build_request(_name(rng), good), timeout=10)
            assert unknown_model.value.code() == grpc.StatusCode.NOT_FOUND
            request = build_request("mlp", good)
            request.model_version = str(rng.randrange(2, 10**12))
            with pytest.raises(grpc.aio.AioRpcError) as unknown_version:
                await stub.ModelInfer(request, timeout=10)
            assert unknown_version.value.code() == grpc.StatusCode.NOT_FOUND
            with pytest.raises(grpc.aio.AioRpcError):
                await stub.ModelMetadata(
                    pb.ModelMetadataRequest(name=_name(rng), version=_name(rng)), timeout=10
                )
            method = channel.unary_unary(
                f"/{_name(rng)}.Service/{_name(rng)}",
                request_serializer=None,
                response_deserializer=None,
            )
            with pytest.raises(grpc.aio.AioRpcError) as unknown_method:
                await method(b"", timeout=10)
            assert unknown_method.value.code() == grpc.StatusCode.UNIMPLEMENTED
        assert (await stub.ModelInfer(build_request("mlp", good), timeout=30)).model_version == "1"


async def test_names_from_requests_add_no_series(labelled: Labelled) -> None:
    rng = random.Random(7)

    async def main(rounds: int) -> None:
        await asyncio.gather(*(_calls(labelled, t, rng, rounds) for t in ("h2", "h3")))

    await main(1)  # every series these calls can make exists now
    before = labelled.series()
    await main(ROUNDS)
    after = labelled.series()
    # With --frontends N (PADDLEQUIC_FRONTENDS), a front-end's first call on a transport may
    # come in a later round (each round connects anew): its series are labelled by front-end
    # and transport alone, bounded by the configuration, not by any request.
    assert all(
        {name for name, _ in labels} <= {"frontend", "transport"} for _, labels in after - before
    )
    assert before <= after
    infer = {"rpc": "ModelInfer", "code": "NOT_FOUND", "transport": "h3"}
    assert ("paddlequic_requests_total", _labels(model="_unknown", version="", **infer)) in after
    assert ("paddlequic_requests_total", _labels(model="mlp", version="_unknown", **infer)) in after
    assert not any("Service" in dict(labels).get("rpc", "") for _, labels in after)


def _labels(**labels: str) -> tuple[tuple[str, str], ...]:
    return tuple(sorted(labels.items()))
