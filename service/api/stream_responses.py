"""How a decoupled model's answers become ModelStreamInfer responses, with Triton's conventions
(src/grpc/stream_infer_handler.cc): every response says whether it is its request's last
(`triton_final_response`), an error is an `error_message` with the request's id and model, and a
final response that only says it is final is sent, empty, only when the request asked for it
(`triton_enable_empty_final_response`). Pure, so the mapping is tested over every sequence."""

from __future__ import annotations

import json
from typing import Protocol

from protos.inference import grpc_service_pb2 as pb
from service.inference import errors
from service.inference.jobs import OutputTensor, StreamAnswer

FINAL_RESPONSE = "triton_final_response"
EMPTY_FINAL = "triton_enable_empty_final_response"


def decoupled(
    model: str,
    version: str,
    request: pb.ModelInferRequest,
    answer: StreamAnswer,
    empty_final: bool,
) -> pb.ModelStreamInferResponse | None:
    """The response for one answer (of the version `model`/`version`), or None: nothing to
    send (a flags-only final nobody asked to see; the request just ends)."""
    if answer.error is not None:
        response = error(request, f"{answer.status}: model '{model}': {answer.error}")
    elif answer.outputs or not answer.final:
        response = pb.ModelStreamInferResponse(
            infer_response=infer_response(model, version, request.id, answer.outputs)
        )
    elif empty_final:
        response = pb.ModelStreamInferResponse(
            infer_response=pb.ModelInferResponse(
                model_name=request.model_name, model_version=request.model_version, id=request.id
            )
        )
    else:
        return None
    mark_final(response, answer.final)
    return response


def infer_response(
    model: str, version: str, request_id: str, outputs: tuple[OutputTensor, ...]
) -> pb.ModelInferResponse:
    response = pb.ModelInferResponse(model_name=model, model_version=version, id=request_id)
    for tensor in outputs:
        response.outputs.add(name=tensor.name, datatype=tensor.datatype.name, shape=tensor.shape)
        response.raw_output_contents.append(tensor.data)
    return response


class Named(Protocol):
    """What an error response repeats of its request (a message, or a front-end's
    descriptor of one)."""

    @property
    def model_name(self) -> str: ...

    @property
    def model_version(self) -> str: ...

    @property
    def id(self) -> str: ...


def error(request: Named, message: str) -> pb.ModelStreamInferResponse:
    return pb.ModelStreamInferResponse(
        error_message=message,
        infer_response=pb.ModelInferResponse(
            model_name=request.model_name, model_version=request.model_version, id=request.id
        ),
    )


def failed(
    request: Named, exc: errors.ServiceError, decoupled: bool
) -> pb.ModelStreamInferResponse:
    """The error response of a request that failed with `exc` ("CODE: message"); a decoupled
    model's says it is the request's last."""
    response = error(request, f"{exc.code.name}: {exc.message}")
    if decoupled:
        mark_final(response, True)
    return response


def mark_final(response: pb.ModelStreamInferResponse, final: bool) -> None:
    response.infer_response.parameters[FINAL_RESPONSE].bool_param = final


def empty_final_wanted(request: pb.ModelInferRequest) -> bool:
    """Triton's request parameter: a flags-only final response is sent (empty) instead of
    ending the request silently."""
    parameter = request.parameters.get(EMPTY_FINAL)
    if parameter is None:
        return False
    if parameter.WhichOneof("parameter_choice") != "bool_param":
        raise errors.invalid(
            f"invalid value type for '{EMPTY_FINAL}' parameter, expected bool_param."
        )
    return parameter.bool_param


def parameters(request: pb.ModelInferRequest) -> str:
    """The request's parameters as JSON, as pb_utils' request.parameters() returns them."""
    values = {}
    for key, parameter in request.parameters.items():
        kind = parameter.WhichOneof("parameter_choice")
        if kind is not None:
            values[key] = getattr(parameter, kind)
    return json.dumps(values)
