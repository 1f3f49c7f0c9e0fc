"""A Triton-style Python model (`backend: "python"`, model.py in the version directory) in a
worker process, restricted before model.py is imported: address space and open files are
capped (CPU time is the watchdog's), the sandbox is entered (python_sandbox.py), and the
front-end started this process with a scrubbed environment and collects its stdout/stderr into
the server's log."""

from __future__ import annotations

import asyncio
import importlib.util
import resource
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
from google.protobuf import json_format

from oip.datatypes import BY_CONFIG_TYPE
from protos.inference import model_config_pb2 as mc
from service.backend import python_sandbox
from service.backend.load import Load
from service.backend.python_runtime import triton_python_backend_utils as pb_utils
from service.inference.jobs import Timings
from service.inference.tensors import TensorSpec
from service.model.config_json import config_json
from service.model.parameters import (
    DEFAULT_PYTHON_MEMORY_MB,
    PYTHON_MEMORY_MB,
    child_processes,
)
from service.model.sequences import sequence_settings, with_sequence_tensors

DEFAULT_OPEN_FILES = 256
# Of one failure's text, per request: a gRPC status message travels in a trailer, which
# clients cap (grpc's default: 8 KiB of metadata in all).
MAX_FAILURE_BYTES = 4096


class ErrorResponse(RuntimeError):
    """execute() answered the request with an error response: its message goes to the caller
    as it is."""


class PythonModel:
    def __init__(self, load: Load) -> None:
        config = mc.ModelConfig()
        config.ParseFromString(load.config)
        _limit(load.parameters)
        model_file = Path(load.model_file)
        # What the host could not confine, for the front-end's warning; None: sandbox off.
        self.unprotected: tuple[str, ...] | None = (
            tuple(
                python_sandbox.enter(model_file.parent.parent, child_processes(load.parameters) > 0)
            )
            if python_sandbox.wanted(load.parameters)
            else None
        )
        sys.modules["triton_python_backend_utils"] = pb_utils
        # No __pycache__ beside model.py: the repository's files (and their fingerprint,
        # which decides reloads) stay as they were deployed.
        sys.dont_write_bytecode = True
        spec = importlib.util.spec_from_file_location(f"model_{load.model_name}", model_file)
        if spec is None or spec.loader is None:
            raise RuntimeError(f"{model_file} cannot be imported")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        model_class = getattr(module, "TritonPythonModel", None)
        if model_class is None:
            raise RuntimeError(f"{model_file} defines no class TritonPythonModel")
        # The config auto_complete_config completed (empty: the model has none), for the
        # front-end, which checks it as it checks config.pbtxt.
        self.completed_config = b""
        if hasattr(model_class, "auto_complete_config"):
            config = _auto_completed(model_class, config)
            self.completed_config = config.SerializeToString()
        batch = (-1,) if config.max_batch_size > 0 else ()
        # What execute() takes and answers: a sequence model's control and state inputs and
        # its state outputs too (the server sets and keeps those; callers never see them).
        settings = sequence_settings(config)
        declared = config if settings is None else with_sequence_tensors(config, settings)
        self.inputs = tuple(_spec(t, batch) for t in declared.input)
        self.outputs = tuple(_spec(t, batch) for t in declared.output)
        self._output_types = {t.name: BY_CONFIG_TYPE[t.data_type] for t in declared.output}
        self.device = "cpu"
        self.name = load.model_name
        # Decoupled: each request is answered through its response sender (decoupled.py).
        self.decoupled = config.model_transaction_policy.decoupled
        self._loop: asyncio.AbstractEventLoop | None = None  # for `async def execute`
        self._model = model_class()
        if hasattr(self._model, "initialize"):
            self._model.initialize(
                {
                    "model_config": config_json(config),
                    "model_instance_kind": "CPU",
                    "model_instance_name": f"{load.model_name}_0",
                    "model_instance_device_id": "0",
                    "model_repository": str(model_file.parent.parent),
                    "model_version": str(load.version),
                    "model_name": load.model_name,
                }
            )

    def run(
        self, inputs: Mapping[str, np.ndarray[Any, Any]], outputs: tuple[str, ...]
    ) -> tuple[dict[str, np.ndarray[Any, Any]], Timings]:
        """The batch is one request to execute(); what it answers is checked against the
        config (a wrong answer fails the batch with a message, never reaches callers). An
        `async def execute` (which awaits BLS calls, async_exec) runs to its end here, on an
        event loop of the worker's, as Triton runs it."""
        t0 = time.perf_counter_ns()
        request = pb_utils.InferenceRequest(
            [pb_utils.Tensor(name, array) for name, array in inputs.items()], outputs
        )
        t1 = time.perf_counter_ns()
        responses = self._model.execute([request])
        if asyncio.iscoroutine(responses):
            if self._loop is None:
                self._loop = asyncio.new_event_loop()
            responses = self._loop.run_until_complete(responses)
        t2 = time.perf_counter_ns()
        if not isinstance(responses, list | tuple) or len(responses) != 1:
            raise RuntimeError("execute() must return one InferenceResponse per request")
        (response,) = responses
        if not isinstance(response, pb_utils.InferenceResponse):
            raise RuntimeError(
                f"execute() returned {type(response).__name__}, not InferenceResponse"
            )
        error = response.error()
        if error is not None:
            raise ErrorResponse(error.message())
        given = {t.name(): t.as_numpy() for t in response.output_tensors()}
        result = {name: self._checked(name, given.get(name)) for name in outputs}
        return result, Timings(t1 - t0, t2 - t1, time.perf_counter_ns() - t2)

    def execute(self, requests: list[pb_utils.InferenceRequest]) -> Any:
        """model.py's execute() as it is (a decoupled model answers through its senders)."""
        return self._model.execute(requests)

    def response_outputs(
        self, response: pb_utils.InferenceResponse, requested: tuple[str, ...]
    ) -> dict[str, np.ndarray[Any, Any]]:
        """A decoupled response's outputs, checked against the config; like Triton, outputs
        the request did not ask for are left out (a response may carry any subset)."""
        outputs = {}
        for tensor in response.output_tensors():
            name = tensor.name()
            if name not in self._output_types:
                raise ValueError(
                    f"the response has output '{name}', which the config does not declare; "
                    f"its outputs are {list(self._output_types)}"
                )
            if name in requested:
                outputs[name] = self._checked(name, tensor.as_numpy())
        return outputs

    def finalize(self) -> None:
        if hasattr(self._model, "finalize"):
            self._model.finalize()

    def _checked(self, name: str, array: np.ndarray[Any, Any] | None) -> np.ndarray[Any, Any]:
        """ValueError for an answer the config does not allow."""
        if array is None:
            raise ValueError(f"execute() returned no output '{name}'")
        datatype = self._output_types[name]
        if datatype.name == "BYTES":
            if array.dtype.kind not in "OSU":
                raise ValueError(f"output '{name}' must hold bytes or str, not {array.dtype}")
            values = [v.encode() if isinstance(v, str) else bytes(v) for v in array.flat]
            encoded = np.empty(len(values), dtype=object)
            encoded[:] = values
            return encoded.reshape(array.shape)
        if array.dtype == datatype.numpy:
            return array
        # Triton's examples answer np.array([0]) (int64) for an INT32 output: numbers that
        # the config's type holds exactly are answered in it.
        if array.dtype.kind in "biuf" and datatype.numpy.kind in "biuf":
            with np.errstate(all="ignore"):
                converted = array.astype(datatype.numpy)
            if np.array_equal(converted, array):
                return converted
        raise ValueError(f"output '{name}' is {array.dtype}, its config says {datatype.name}")


def _auto_completed(model_class: Any, config: mc.ModelConfig) -> mc.ModelConfig:
    """Triton's auto_complete_config(auto_complete_model_config), a static method of the
    model's class, run before its instance is made; what it answers is the config."""
    answered = model_class.auto_complete_config(pb_utils.ModelConfig(config_json(config)))
    if not isinstance(answered, pb_utils.ModelConfig):
        raise RuntimeError("auto_complete_config must return the pb_utils.ModelConfig it was given")
    try:
        return json_format.ParseDict(answered.as_dict(), mc.ModelConfig())
    except json_format.ParseError as exc:
        raise RuntimeError(
            f"the config auto_complete_config answered does not parse: {exc}"
        ) from None


def _spec(tensor: mc.ModelInput | mc.ModelOutput, batch: tuple[int, ...]) -> TensorSpec:
    datatype = BY_CONFIG_TYPE.get(tensor.data_type)
    if datatype is None:
        raise ValueError(f"tensor {tensor.name!r} has no data_type paddlequic serves")
    return TensorSpec(tensor.name, datatype.name, batch + tuple(tensor.dims))


def failure_text(exc: BaseException) -> str:
    """The whole message of what failed in model.py (not only its first line, as Triton
    passes it on), cut at MAX_FAILURE_BYTES, saying so."""
    text = str(exc) if isinstance(exc, ErrorResponse) else f"{type(exc).__name__}: {exc}"
    encoded = text.encode(errors="replace")
    if len(encoded) <= MAX_FAILURE_BYTES:
        return text
    kept = encoded[: MAX_FAILURE_BYTES - 64].decode(errors="ignore")
    return f"{kept} ... ({len(encoded) - len(kept.encode())} more bytes)"


def _limit(parameters: Mapping[str, str]) -> None:
    """Soft and hard limits both, so model.py cannot raise them again."""
    memory = int(parameters.get(PYTHON_MEMORY_MB, DEFAULT_PYTHON_MEMORY_MB)) << 20
    files = int(parameters.get("python_open_files", DEFAULT_OPEN_FILES))
    for limit, value in ((resource.RLIMIT_AS, memory), (resource.RLIMIT_NOFILE, files)):
        _, hard = resource.getrlimit(limit)
        bounded = value if hard == resource.RLIM_INFINITY else min(value, hard)
        resource.setrlimit(limit, (bounded, bounded))
