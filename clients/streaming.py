"""ModelStreamInfer for the numpy client: requests go out as the caller produces them and
responses come back as they arrive, each tagged with its request's id and whether it was that
request's last. A decoupled model (Triton's `model_transaction_policy { decoupled: true }`)
answers one request with many responses; the last carries `triton_final_response: true`."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, AsyncIterable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
import numpy as np

from clients.tensors import Parameter, build_request, parse_response
from protos.inference import grpc_service_pb2 as pb

FINAL_RESPONSE = "triton_final_response"
EMPTY_FINAL_RESPONSE = "triton_enable_empty_final_response"


@dataclass(frozen=True)
class StreamRequest:
    """One request on a stream. `request_id` is what its responses carry back: give each
    request in flight its own. `empty_final` asks for an empty response marking the end when
    the model's last data response did not (Triton's `enable_empty_final_response`)."""

    model: str
    inputs: Mapping[str, np.ndarray[Any, Any]]
    request_id: str = ""
    outputs: Sequence[str] = ()
    version: str = ""
    parameters: Mapping[str, Parameter] = field(default_factory=dict)
    empty_final: bool = False

    def message(self) -> pb.ModelInferRequest:
        parameters = dict(self.parameters)
        if self.empty_final:
            parameters[EMPTY_FINAL_RESPONSE] = True
        return build_request(
            self.model, self.inputs, self.outputs, self.version, self.request_id, parameters
        )


@dataclass(frozen=True)
class StreamResponse:
    """One response: outputs (possibly none, e.g. an empty final response) or the error the
    server or model reported for this request (the stream goes on)."""

    request_id: str
    model: str
    version: str
    outputs: dict[str, np.ndarray[Any, Any]]
    final: bool
    error: str | None = None
    parameters: dict[str, Parameter] = field(default_factory=dict)


def _parameter(value: pb.InferParameter) -> Parameter:
    choice = value.WhichOneof("parameter_choice")
    result: Parameter = getattr(value, choice) if choice else ""
    return result


def is_final(response: pb.ModelInferResponse) -> bool:
    """Whether this was its request's last response. One without `triton_final_response` (a
    model that is not decoupled, on a server that does not mark them) is its only one."""
    marked = response.parameters.get(FINAL_RESPONSE)
    return True if marked is None else bool(marked.bool_param)


def parse_stream_response(message: pb.ModelStreamInferResponse) -> StreamResponse:
    """An error response carries no outputs, only its request's id and the message."""
    infer = message.infer_response
    parameters = {k: _parameter(v) for k, v in infer.parameters.items() if k != FINAL_RESPONSE}
    return StreamResponse(
        request_id=infer.id,
        model=infer.model_name,
        version=infer.model_version,
        outputs={} if message.error_message else parse_response(infer),
        final=is_final(infer),
        error=message.error_message or None,
        parameters=parameters,
    )


async def _write(
    call: Any, requests: Iterable[StreamRequest] | AsyncIterable[StreamRequest]
) -> None:
    """Every request, then a half-close; a call that ended meanwhile (its status is what the
    reader reports) stops the writing quietly."""
    with contextlib.suppress(grpc.RpcError, asyncio.InvalidStateError):
        if isinstance(requests, AsyncIterable):
            async for request in requests:
                await call.write(request.message())
        else:
            for request in requests:
                await call.write(request.message())
        await call.done_writing()


def _failure(writer: asyncio.Future[None]) -> BaseException | None:
    """What the caller's request iterator raised, if it did."""
    return writer.exception() if writer.done() and not writer.cancelled() else None


async def stream_responses(
    call: Any, requests: Iterable[StreamRequest] | AsyncIterable[StreamRequest]
) -> AsyncGenerator[StreamResponse, None]:
    """Drives one ModelStreamInfer call (grpc.aio's or a QuicChannel's): yields each response
    as it arrives until the server ends the stream (after the last request's final response).
    Closing the iterator early cancels the call, which cancels the requests still running; an
    exception from `requests` cancels it too and is raised here."""
    writer = asyncio.ensure_future(_write(call, requests))
    writer.add_done_callback(lambda done: _failure(done) is not None and call.cancel())
    try:
        async for message in call:
            yield parse_stream_response(message)
    except asyncio.CancelledError:
        if (failed := _failure(writer)) is not None:
            raise failed from None
        raise
    finally:
        writer.cancel()
        call.cancel()
    if (failed := _failure(writer)) is not None:
        raise failed
