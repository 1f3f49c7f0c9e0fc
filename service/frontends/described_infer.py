"""The parent's side of descriptors: the view of served versions it pushes to the front-ends,
and ModelInfer for the calls they describe, registered (observed, access-checked) under
ModelInfer's own name, so metrics, logs and traces cannot tell the two paths apart."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import grpc

from service.api.inference import call_deadline
from service.frontends.descriptors import (
    DescribedAnswer,
    DescribedRequest,
    ViewEntry,
    encode_answer,
    encode_view,
)
from service.inference import errors
from service.inference.errors import ServicerContext
from service.inference.jobs import InferJob
from service.inference.validation import decoded
from service.model.decoupled import is_decoupled
from service.registry.versions import ModelRegistry, ServedVersion
from service.serving.requests import RequestRunner


class StaleView(Exception):
    """The front-end's view no longer holds for this call: it passes the call on as bytes."""


@dataclass(frozen=True)
class Admitted:
    """A described call whose version still is the one the front-end validated against
    (`model_name`, `model_version`, `id`: what observers read from a request)."""

    request: DescribedRequest
    served: ServedVersion
    model_name: str
    model_version: str
    id: str


class DescribedInfer:
    def __init__(self, models: ModelRegistry, runner: RequestRunner) -> None:
        self._models = models
        self._runner = runner
        self._described: dict[int, ServedVersion] = {}  # token -> version
        self._next_token = 1

    def view(self) -> bytes:
        """The versions front-ends may describe calls for (MODELS), as requests name them.
        A version keeps its token while it serves, so calls in flight stay valid."""
        tokens = {id(served): token for token, served in self._described.items()}
        described: dict[int, ServedVersion] = {}
        entries: list[ViewEntry] = []
        for name in self._models.loaded_names():
            numbers = sorted(self._models.serving(name))
            for key in ("", *map(str, numbers)):
                try:
                    served = self._models.resolve(name, key)
                except errors.ServiceError:
                    continue
                if not describable(served):
                    continue
                token = tokens.get(id(served))
                if token is None:
                    token = tokens[id(served)] = self._next_token
                    self._next_token += 1
                described[token] = served
                entries.append(ViewEntry(name, key, token, served.config.SerializeToString()))
        self._described = described
        return encode_view(entries)

    def admit(self, request: DescribedRequest) -> Admitted:
        """The call with the version it names, or StaleView when that is not the one the
        front-end validated it against (reloaded, unloaded, no longer ready or newest)."""
        served = self._described.get(request.token)
        try:
            resolved = self._models.resolve(request.model_name, request.model_version)
        except errors.ServiceError:
            raise StaleView from None
        if resolved is not served:
            raise StaleView
        return Admitted(request, served, request.model_name, request.model_version, request.id)

    def handler(self) -> grpc.RpcMethodHandler[Any, Any]:
        """ModelInfer for admitted calls; the answer goes back described (MESSAGE)."""
        return grpc.unary_unary_rpc_method_handler(
            self.ModelInfer, response_serializer=encode_answer
        )

    @errors.reports_errors
    async def ModelInfer(self, call: Admitted, context: ServicerContext) -> DescribedAnswer:
        served = call.served
        job = await _job(served, call.request)
        answered, result = await self._runner.infer(served, job, call_deadline(context))
        with self._runner.encode_span():  # the response's contents, as the servicer's span
            return DescribedAnswer(
                answered.name,
                str(answered.version),
                call.id,
                result.outputs,
                answered is not served,
            )


def describable(served: ServedVersion) -> bool:
    """Versions whose ModelInfer calls front-ends may describe: those served by their own
    batcher and workers (decoupled, sequence and ensemble models' calls go on as bytes)."""
    config = served.config
    return (
        served.validator is not None
        and not served.steps
        and not is_decoupled(config)
        and not config.HasField("sequence_batching")
    )


async def _job(served: ServedVersion, request: DescribedRequest) -> InferJob:
    """The job, checked again with the version's own validator (what the front-end sent must
    be what it validated); a refusal counts as one of the version's failures, as the
    servicer's does."""
    started = time.perf_counter_ns()
    try:
        assert served.validator is not None
        decoding = served.validator.check(
            request.inputs, request.outputs, request.priority, request.timeout_s
        )
        return await decoded(decoding)
    except errors.ServiceError:
        served.stats.record_failure(time.perf_counter_ns() - started)
        raise
