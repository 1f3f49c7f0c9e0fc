"""A front-end's side of descriptors. Its view of the versions the parent described (MODELS):
the ModelInfer calls on them that it decodes and validates itself, with the parent's own
checks (wire limits, protobuf, RequestValidator), and passes on as descriptors, or answers
with the validator's refusal (the parent's, word for word, recorded by the parent once). Any
call it is not sure of goes on as bytes, and the parent answers it as it always did."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from google.protobuf.message import DecodeError

from protos.inference import grpc_service_pb2 as pb
from protos.inference import model_config_pb2 as mc
from service.api import stream_responses
from service.api.shared_memory import names_regions
from service.api.wire_limits import request_problem
from service.frontends.descriptors import (
    DescribedAnswer,
    DescribedRequest,
    Refusal,
    ViewEntry,
    decode_answer,
    fits,
)
from service.frontends.placed_here import PLACEMENT_PARAMETERS, PlacedTensors
from service.frontends.protocol import Status
from service.inference import classification
from service.inference.errors import ServiceError
from service.inference.validation import RequestValidator, decoded
from service.model.decoupled import is_decoupled

# Request parameters a described call may carry: those the validator turns into the job's.
SCHEDULING_PARAMETERS = frozenset(("priority", "timeout"))


@dataclass(frozen=True)
class _Version:
    token: int
    validator: RequestValidator
    decoupled: bool  # its requests' parameters are the model's (pb_utils' parameters())


class ModelView:
    def __init__(self) -> None:
        self._versions: dict[tuple[str, str], _Version] = {}
        self.generation: tuple[str, ...] = ()  # every generation model the parent serves

    def update(self, entries: Sequence[ViewEntry], generation: Sequence[str] = ()) -> None:
        """The parent's latest view replaces this one (one validator per version)."""
        self.generation = tuple(generation)
        described: dict[int, _Version] = {}
        versions: dict[tuple[str, str], _Version] = {}
        for entry in entries:
            version = described.get(entry.token)
            if version is None:
                config = mc.ModelConfig.FromString(entry.config)
                version = _Version(entry.token, RequestValidator(config), is_decoupled(config))
                described[entry.token] = version
            versions[entry.model, entry.version] = version
        self._versions = versions

    def token(self, model: str, version: str) -> int | None:
        """The token of the version a request naming `model` and `version` ("": the
        model's policy's) reaches, if the view describes it."""
        described = self._versions.get((model, version))
        return None if described is None else described.token

    def served(self) -> list[tuple[str, str]]:
        """The (model, version number) pairs of the view (metrics' labels name only these)."""
        return [(model, version) for model, version in self._versions if version]

    async def describe(
        self, message: bytes, placed: PlacedTensors | None = None
    ) -> DescribedRequest | Refusal | None:
        """The ModelInferRequest in `message` as a descriptor, or as the refusal of its
        version's validator (the parent's words: its validator is the same); None: pass it on
        as bytes (over the wire limits, unparsable, not on a described version, carrying
        parameters only the parent handles). `placed`: where tensors that name shared-memory
        regions are read from and written to (None: such requests are the parent's; so are a
        decoupled model's)."""
        if not self._versions or request_problem(message)[0]:
            return None
        try:
            request = pb.ModelInferRequest.FromString(message)
        except DecodeError:
            return None
        version = self._versions.get((request.model_name, request.model_version))
        if version is None:
            return None
        placing = placed if not version.decoupled else None
        if not _plain(request, version.decoupled, placing is not None):
            return None
        if not fits(request.id, None):
            return None
        try:
            classes = tuple(classification.class_counts(request).items())
        except ServiceError:  # refused by the parent, before the request is decoded
            return None
        raw = None
        if placing is not None and names_regions(request):
            try:
                raw = await placing.read(request)
            except ServiceError:  # the parent answers it, in its words
                return None
        try:
            job = await decoded(version.validator.admit(request, raw))
        except ServiceError as exc:
            status = Status(exc.code, exc.message, ())
            return Refusal(
                version.token, request.model_name, request.model_version, request.id, status
            )
        if not fits(request.id, job.priority):
            return None
        return DescribedRequest(
            version.token,
            request.model_name,
            request.model_version,
            request.id,
            job.inputs,
            job.outputs,
            job.priority,
            job.timeout_s,
            classes,
            job,
            request,
        )


def _plain(request: pb.ModelInferRequest, decoupled: bool, placed: bool) -> bool:
    """No parameters but the scheduling ones (a decoupled model's request: any, which its
    model reads) and none on its tensors but classification on an output and, where `placed`,
    shared-memory placements: sequences and the like are the parent's."""
    inputs = PLACEMENT_PARAMETERS if placed else frozenset()
    outputs = inputs | {classification.CLASSIFICATION}
    return (
        (decoupled or set(request.parameters) <= SCHEDULING_PARAMETERS)
        and all(set(tensor.parameters) <= inputs for tensor in request.inputs)
        and all(set(tensor.parameters) <= outputs for tensor in request.outputs)
    )


def answer_message(payload: bytes) -> bytes:
    """The ModelInferResponse for a described answer, serialized, as the servicer builds it."""
    return response_message(decode_answer(payload))


def response_message(answer: DescribedAnswer) -> bytes:
    return response_of(answer).SerializeToString()


def response_of(answer: DescribedAnswer) -> pb.ModelInferResponse:
    response = stream_responses.infer_response(
        answer.model_name, answer.model_version, answer.id, answer.outputs
    )
    if answer.fallback:
        response.parameters["fallback"].bool_param = True
    return response
