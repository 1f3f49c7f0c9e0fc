"""The KServe v2 REST infer route (`POST /v2/models/NAME[/versions/V]/infer`): the JSON
document and Triton's binary data converted to the tensors the version's validator checks, run
on an inference plane, and its answer converted back. The parent runs it on its data plane; a
front-end on the versions it serves itself (service/frontends/rest_here.py), with one
conversion for both."""

from __future__ import annotations

import contextlib
from typing import Any

import grpc

from service.dataplane.plane import InferencePlane
from service.dataplane.sequence_callers import SequenceCallers
from service.dataplane.shared_memory import Peer
from service.http.json_outputs import output_json
from service.http.json_tensors import infer_request, input_tensor, parsed, split
from service.http.raw_binary import RAW_REQUEST, raw_input
from service.http.reply import Reply
from service.http.shared_memory_routes import SharedMemoryRoutes
from service.inference import errors
from service.inference.identity import Identity
from service.inference.jobs import InputTensor
from service.inference.validation import Decoding
from service.registry.versions import ServedVersion


class PassedOn(Exception):
    """The request is not this process's to serve (its version is served elsewhere, its
    tensors name regions registered elsewhere): raised before anything of it was run or
    counted, so the process that serves it can take it whole. `body`: the request's body as
    it came, once it was read here (None: not read)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.body: bytes | None = None


class InferRoute:
    def __init__(
        self, plane: InferencePlane, sequence_callers: SequenceCallers, max_input_bytes: int
    ) -> None:
        """`sequence_callers`: whose a sequence is (a REST caller's certificate's, if any);
        `max_input_bytes`: the most one input may take from a shared-memory region (what a body
        may carry, --http-max-input-size)."""
        self.plane = plane
        self.sequence_callers = sequence_callers
        self.max_input_bytes = max_input_bytes
        self.shared_memory = SharedMemoryRoutes(plane.shared_memory)

    async def infer(
        self,
        model: str,
        version: str,
        body: bytes,
        header_length: str | None,
        peer: Peer,
        identity: Identity,
        shared_memory_refusal: str | None = None,
    ) -> Reply:
        """`header_length`: Inference-Header-Content-Length, where the body's JSON ends and its
        binary data begins (None: all JSON; 0: none, a raw binary request). Tensors that name
        shared-memory regions are read from and written to the regions of `peer`'s uid, unless
        the `shared-memory` restricted category refuses the request (`shared_memory_refusal`:
        the header it lacks). `identity`: the caller's client certificate's, whose a sequence
        is."""
        async with self.plane.serving(model, version, None) as served:
            return await self._infer(
                served, body, header_length, peer, identity, shared_memory_refusal
            )

    async def _infer(
        self,
        served: ServedVersion,
        body: bytes,
        header_length: str | None,
        peer: Peer,
        identity: Identity,
        shared_memory_refusal: str | None,
    ) -> Reply:
        if served.decoupled:
            raise errors.ServiceError(
                grpc.StatusCode.UNIMPLEMENTED,
                f"/infer doesn't support models with decoupled transaction policy: model "
                f"'{served.name}' answers with a stream of responses; call gRPC's "
                "ModelStreamInfer",
            )
        document_bytes, binary = split(body, header_length)
        raw = document_bytes is None
        request = RAW_REQUEST if document_bytes is None else infer_request(parsed(document_bytes))
        validator = served.validator
        assert validator is not None  # a resolved version serves
        shared = self.plane.shared_memory
        caller = (
            await self.shared_memory.tensor_caller(peer, shared_memory_refusal)
            if request.names_regions
            else None
        )
        if caller is not None and not self.plane.holds_regions(caller, request.regions):
            raise PassedOn(f"model '{served.name}': a shared-memory region not held here")
        region = self.shared_memory.reader(caller, self.max_input_bytes)

        def admit() -> Decoding:
            if raw:
                return validator.check((raw_input(body, validator),), ())
            inputs: list[InputTensor] = []
            names: set[str] = set()
            for entry in request.inputs:
                tensor = input_tensor(entry, validator, binary, names, region)
                inputs.append(tensor)
                names.add(tensor.name)
            binary.check_used()
            return validator.check(
                inputs, request.outputs, request.priority, request.timeout_s, request.sequence
            )

        targets = request.output_regions if caller is not None else {}
        with shared.held(caller, targets) if caller is not None else contextlib.nullcontext():
            job = await self.plane.admitted(served, admit)
            if served.sequences is not None:
                job = self.sequence_callers.owned(served.name, job, identity)
            inferred = await self.plane.infer(served, job, None, request.class_counts)
            sizes = {t.name: len(t.data) for t in inferred.outputs}
            outputs = shared.write_outputs(inferred.outputs, targets, caller)
        answered = inferred.answered
        binaries = [request.answers_binary(t.name) and t.name not in targets for t in outputs]
        placed = [(targets[t.name], sizes[t.name]) if t.name in targets else None for t in outputs]
        with self.plane.runner.encode_span():  # as the gRPC servicer's: its outputs as JSON
            described = [
                output_json(t, b, p) for t, b, p in zip(outputs, binaries, placed, strict=True)
            ]
        document: dict[str, Any] = {
            "model_name": answered.name,
            "model_version": str(answered.version),
            "id": request.id,
            "outputs": described,
        }
        if inferred.fallback:
            # Answered by the fallback model while the one asked is open-circuited.
            document["parameters"] = {"fallback": True}
        attached = tuple(t.data for t, b in zip(outputs, binaries, strict=True) if b)
        return Reply(200, document, attached, request.id, str(answered.version))
