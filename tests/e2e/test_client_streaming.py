"""The numpy client's streaming call (ModelStreamInfer) against a real server, sync and async,
over both transports: responses come back per request id, each request's last one marked
final, an error reported for its own request while the stream goes on."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from clients.inference_client import AsyncInferenceClient, InferenceClient
from clients.streaming import StreamRequest, StreamResponse
from tests.reference import call_inputs, output_names, run_reference
from tests.servers import ServerProcess, client_args, model_repository, running_server

MODEL = "mlp"
OUTPUT = output_names(MODEL)[0]
PROPERTY = settings(derandomize=True, max_examples=3, deadline=None)
TIMEOUT_S = 60.0


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, certs_dir: Path) -> Iterator[ServerProcess]:
    root = tmp_path_factory.mktemp("streaming")
    repository = model_repository(root / "models", [MODEL])
    with running_server(repository, root / "log", ["--certs-dir", str(certs_dir)]) as process:
        yield process


def request(index: int, bad: bool) -> StreamRequest:
    """Good requests carry inputs of their own; a bad one has the wrong width."""
    inputs = {"input": np.zeros((1, 255), np.float32)} if bad else call_inputs(MODEL, index)
    return StreamRequest(MODEL, inputs, request_id=f"r{index}")


def check(kinds: list[bool], responses: list[StreamResponse]) -> None:
    """One final response per request, each with its own answer or its own error."""
    assert sorted(r.request_id for r in responses) == sorted(f"r{i}" for i in range(len(kinds)))
    for response in responses:
        index = int(response.request_id[1:])
        assert response.final and response.model == MODEL
        if kinds[index]:
            assert response.error is not None and "255" in response.error
            assert response.outputs == {}
            continue
        assert response.error is None
        expected = run_reference(MODEL, call_inputs(MODEL, index))[OUTPUT]
        np.testing.assert_allclose(response.outputs[OUTPUT], expected, rtol=1e-4, atol=1e-5)


async def collect_async(arguments: dict[str, Any], requests: list[StreamRequest]) -> list[Any]:
    async def produced() -> AsyncIterator[StreamRequest]:
        for item in requests:
            yield item

    async with AsyncInferenceClient(**arguments) as client:
        return [r async for r in client.stream_infer(produced(), timeout=TIMEOUT_S)]


@pytest.mark.parametrize("transport", ["h2", "h3"])
@pytest.mark.parametrize("mode", ["sync", "async"])
@PROPERTY
@given(kinds=st.lists(st.booleans(), min_size=1, max_size=12))
def test_every_request_gets_its_own_final_response(
    server: ServerProcess, certs_dir: Path, transport: str, mode: str, kinds: list[bool]
) -> None:
    requests = [request(i, bad) for i, bad in enumerate(kinds)]
    arguments = client_args(server, certs_dir, transport)
    if mode == "async":
        responses = asyncio.run(collect_async(arguments, requests))
    else:
        with InferenceClient(**arguments) as client:
            responses = list(client.stream_infer(requests, timeout=TIMEOUT_S))
    check(kinds, responses)


@pytest.mark.parametrize("transport", ["h2", "h3"])
def test_sync_requests_from_a_blocking_source_are_answered_as_they_come(
    server: ServerProcess, certs_dir: Path, transport: str
) -> None:
    """The request iterator blocks until the previous answer arrived: the stream must deliver
    each response while the next request has not been produced yet."""
    answered = threading.Semaphore(0)
    count = 5

    def produced() -> Iterator[StreamRequest]:
        for index in range(count):
            if index:
                assert answered.acquire(timeout=TIMEOUT_S), "the previous answer never came"
            yield request(index, False)

    responses = []
    with InferenceClient(**client_args(server, certs_dir, transport)) as client:
        for response in client.stream_infer(produced(), timeout=TIMEOUT_S):
            responses.append(response)
            answered.release()
    check([False] * count, responses)


class Broken(Exception):
    pass


@pytest.mark.parametrize("transport", ["h2", "h3"])
async def test_a_failing_request_iterator_ends_the_call_with_its_error(
    server: ServerProcess, certs_dir: Path, transport: str
) -> None:
    async def produced() -> AsyncIterator[StreamRequest]:
        yield request(0, False)
        raise Broken("no more requests")

    async with AsyncInferenceClient(**client_args(server, certs_dir, transport)) as client:
        with pytest.raises(Broken):
            async for _ in client.stream_infer(produced(), timeout=TIMEOUT_S):
                pass
        # The client is still usable for the next call.
        assert [r.error async for r in client.stream_infer([request(1, False)])] == [None]
