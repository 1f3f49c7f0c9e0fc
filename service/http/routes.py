"""The KServe v2 REST routes, each a conversion between JSON and the data plane's calls (the
same calls gRPC's servicer makes), with Triton's behaviour where the protocol is silent."""

from __future__ import annotations

import base64
import functools
from typing import Any

from protos.inference import grpc_service_pb2 as pb
from service.dataplane.plane import DataPlane, TensorMetadata
from service.http.generate_route import GenerateRoute
from service.http.infer_route import InferRoute
from service.http.json_tensors import parsed
from service.http.openai import Completions
from service.http.reply import OK, Reply
from service.http.textgen import generation_model
from service.inference import errors
from service.inference.errors import echoed
from service.lifecycle.uploads import FILE_PREFIX
from service.model.config_json import config_dict

# Extensions the REST routes serve: the data plane's, less those only gRPC serves so far.
REST_EXTENSIONS = frozenset(
    {
        "classification",
        "sequence",
        "schedule_policy",
        "model_configuration",
        "system_shared_memory",
        "binary_tensor_data",
        "parameters",
        "statistics",
        "model_repository",
    }
)


class Routes:
    def __init__(self, plane: DataPlane, inference: InferRoute) -> None:
        """`inference`: the infer route, over the same plane."""
        self.plane = plane
        self.inference = inference
        self.generation = GenerateRoute(plane)
        self.completions = Completions(plane, functools.partial(generation_model, plane))
        self.shared_memory = inference.shared_memory

    def live(self) -> Reply:
        """Health answers: Triton's status (200, or 400 for false), which tritonclient reads,
        and the Open Inference Protocol's body, which the KServe SDK's client reads."""
        return Reply(200, {"live": True})

    def ready(self) -> Reply:
        ready = self.plane.ready
        return Reply(200 if ready else 400, {"ready": ready})

    def server_metadata(self) -> Reply:
        described = self.plane.server_metadata()
        extensions = [e for e in described.extensions if e in REST_EXTENSIONS]
        return Reply(
            200,
            {"name": described.name, "version": described.version, "extensions": extensions},
        )

    def model_ready(self, model: str, version: str) -> Reply:
        ready = self.plane.model_ready(model, version)
        return Reply(200 if ready else 400, {"name": model, "ready": ready})

    async def model_metadata(self, model: str, version: str) -> Reply:
        await self.plane.in_memory(model, None)
        described = self.plane.model_metadata(model, version)
        return Reply(
            200,
            {
                "name": described.name,
                "versions": list(described.versions),
                "platform": described.platform,
                "inputs": [_tensor(t) for t in described.inputs],
                "outputs": [_tensor(t) for t in described.outputs],
            },
        )

    async def model_config(self, model: str, version: str) -> Reply:
        await self.plane.in_memory(model, None)
        return Reply(200, config_dict(self.plane.model_config(model, version)))

    async def statistics(self, model: str, version: str) -> Reply:
        chosen = await self.plane.statistics(model, version)
        response = pb.ModelStatisticsResponse(
            model_stats=[v.stats.to_proto(v.name, v.version) for v in chosen]
        )
        return Reply(200, config_dict(response))

    async def repository_index(self, body: bytes) -> Reply:
        """Triton's `POST /v2/repository/index`, body `{"ready": bool}` or empty: a JSON array
        of `{"name", "version", "state", "reason"}`."""
        options = parsed(body) if body.strip() else {}
        ready = options.get("ready", False) if isinstance(options, dict) else None
        if not isinstance(ready, bool):
            raise errors.invalid("the body must be a JSON object whose 'ready' is true or false")
        entries = await self.plane.repository_index(ready)
        return Reply(200, [config_dict(e) for e in entries])

    async def load(self, model: str, body: bytes) -> Reply:
        """Triton's `POST /v2/repository/models/NAME/load`, body empty or `{"parameters":
        {"config": "<ModelConfig JSON>", "file:PATH": "<base64>"}}`; 200, empty, once it
        serves."""
        parameters = _parameters(body)
        config = parameters.get("config")
        if config is not None and not isinstance(config, str):
            raise errors.invalid("load parameter 'config' must be a string (the config's JSON)")
        files = {}
        for key, value in parameters.items():
            if key.startswith(FILE_PREFIX):
                try:
                    files[key.removeprefix(FILE_PREFIX)] = base64.b64decode(value, validate=True)
                except (TypeError, ValueError):
                    raise errors.invalid(f"load parameter '{echoed(key)}' must be base64") from None
        await self.plane.load(model, config, files)
        return OK

    async def unload(self, model: str, body: bytes) -> Reply:
        """Triton's `POST /v2/repository/models/NAME/unload`; 200, empty, once it is unloaded."""
        _parameters(body)
        await self.plane.unload(model)
        return OK


def _parameters(body: bytes) -> dict[str, Any]:
    """A repository request's `parameters` (an empty body: none)."""
    document = parsed(body) if body.strip() else {}
    parameters = document.get("parameters", {}) if isinstance(document, dict) else None
    if not isinstance(parameters, dict):
        raise errors.invalid("the body must be a JSON object whose 'parameters' is an object")
    return parameters


def _tensor(tensor: TensorMetadata) -> dict[str, Any]:
    return {"name": tensor.name, "datatype": tensor.datatype, "shape": list(tensor.shape)}
