"""A Paddle Inference predictor for one model version, and what its program declares."""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from oip.datatypes import PADDLE_NAMES
from protos.inference import model_config_pb2 as mc
from service.backend.engine import Call, config_calls
from service.backend.load import Load
from service.inference.jobs import Timings
from service.inference.tensors import TensorSpec
from service.model.parameters import engine_options
from service.model.reshape import reshaped

os.environ.setdefault("GLOG_minloglevel", "2")
os.environ.setdefault("GLOG_v", "0")

import warnings

warnings.filterwarnings("ignore", message="No ccache found")
import paddle  # noqa: E402
from paddle import inference  # noqa: E402

# Paddle's executor frees each intermediate tensor as soon as its last reader ran, through a
# thread pool: on CPU that is a futex wake-up and a second thread per freed tensor, which cost
# `mlp` 104 us of CPU per run at batch 1 against 58 us with frees gathered until 100 KB of
# garbage (resnet18's memory at batch 32: unchanged). The operator's own setting wins.
GARBAGE_BATCH_GB = 0.0001
GARBAGE_FLAG = "FLAGS_eager_delete_tensor_gb"


def gather_frees() -> None:
    """Gather frees before any predictor is made (Paddle reads the flag then)."""
    if GARBAGE_FLAG not in os.environ:
        paddle.set_flags({GARBAGE_FLAG: GARBAGE_BATCH_GB})


class PaddleModel:
    def __init__(self, load: Load) -> None:
        model_file, params_file = Path(load.model_file), Path(load.params_file)
        major = int(paddle.version.full_version.split(".")[0])
        if model_file.suffix == ".json" and 0 < major < 3:
            raise RuntimeError(
                f"{model_file} is a Paddle 3 program but this worker runs paddle "
                f"{paddle.version.full_version}; export the model in the legacy .pdmodel format"
            )
        self.inputs, self.outputs = introspect(model_file)
        config = inference.Config(str(model_file), str(params_file))
        config.disable_glog_info()
        gather_frees()
        calls = config_calls(
            engine_options(load.parameters),
            "gpu" if load.device.startswith("gpu") else "cpu",
            model_file.suffix,
            self.inputs,
            load.shapes,
            bool(paddle.base.core.supports_bfloat16()),
        )
        apply(config, calls)
        self.device = "gpu" if config.use_gpu() else "cpu"
        self.predictor = inference.create_predictor(config)
        names = list(self.predictor.get_output_names())
        if self.outputs and [o.name for o in self.outputs] != names:
            self.outputs = tuple(
                TensorSpec(n, o.datatype, o.shape) for n, o in zip(names, self.outputs, strict=True)
            )
        self._in_shapes, self._out_shapes = _reshapes(mc.ModelConfig.FromString(load.config), names)
        # A handle names its variable in the predictor's scope, valid while the predictor is:
        # taken once, not per run (getting both of `mlp`'s cost 20 us of its 150 per batch).
        self._in_handles = {
            name: self.predictor.get_input_handle(name) for name in self.predictor.get_input_names()
        }
        self._out_handles = {name: self.predictor.get_output_handle(name) for name in names}

    def run(
        self, inputs: Mapping[str, np.ndarray[Any, Any]], outputs: tuple[str, ...]
    ) -> tuple[dict[str, np.ndarray[Any, Any]], Timings]:
        """Set every input (an unset one would silently reuse the last caller's data), run,
        and copy the requested outputs out."""
        t0 = time.perf_counter_ns()
        for name, array in inputs.items():
            if name in self._in_shapes:
                array = reshaped(array, *self._in_shapes[name])
            # copy_from_cpu takes the array's shape itself (Paddle's binding reshapes the
            # tensor first): a reshape before it cost `mlp` another 20 us at batch 32.
            self._in_handles[name].copy_from_cpu(array)
        t1 = time.perf_counter_ns()
        self.predictor.run()
        t2 = time.perf_counter_ns()
        result = {name: self._out_handles[name].copy_to_cpu() for name in outputs}
        for name, (have, want) in self._out_shapes.items():
            if name in result:
                result[name] = reshaped(result[name], have, want)
        t3 = time.perf_counter_ns()
        return result, Timings(t1 - t0, t2 - t1, t3 - t2)


def apply(config: inference.Config, calls: list[Call]) -> None:
    for call in calls:
        args = list(call.args)
        if call.precision_arg is not None:
            args[call.precision_arg] = getattr(inference.PrecisionType, args[call.precision_arg])
        getattr(config, call.method)(*args)


def introspect(model_file: Path) -> tuple[tuple[TensorSpec, ...], tuple[TensorSpec, ...]]:
    """Declared inputs and outputs, read from the program: no predictor API reports them."""
    paddle.enable_static()
    try:
        executor = paddle.static.Executor(paddle.CPUPlace())
        prefix = str(model_file.with_suffix(""))
        if model_file.suffix == ".json":
            program, _, _ = paddle.static.load_inference_model(prefix, executor)
            return _pir_io(program)
        with paddle.pir_utils.OldIrGuard():
            program, feeds, fetches = paddle.static.load_inference_model(prefix, executor)
            block = program.global_block()
            inputs = tuple(_spec(n, block.var(n).shape, block.var(n).dtype) for n in feeds)
            outputs = tuple(_spec(v.name, v.shape, v.dtype) for v in fetches)
            return inputs, outputs
    finally:
        paddle.disable_static()


def _pir_io(program: Any) -> tuple[tuple[TensorSpec, ...], tuple[TensorSpec, ...]]:
    inputs, outputs = [], []
    for op in program.global_block().ops:
        if op.name() == "pd_op.data":
            result = op.result(0)
            inputs.append(_spec(op.attrs()["name"], result.shape, result.dtype))
        elif op.name() == "pd_op.fetch":
            source = op.operand_source(0)
            outputs.append(
                (op.attrs()["col"], _spec(op.attrs()["name"], source.shape, source.dtype))
            )
    return tuple(inputs), tuple(spec for _, spec in sorted(outputs, key=lambda x: x[0]))


def _spec(name: str, shape: Any, dtype: Any) -> TensorSpec:
    paddle_name = str(dtype).removeprefix("paddle.").lower()
    for prefix in ("datatype.", "vartype."):
        paddle_name = paddle_name.removeprefix(prefix)
    aliases = {"fp32": "float32", "fp64": "float64", "fp16": "float16", "bf16": "bfloat16"}
    paddle_name = aliases.get(paddle_name, paddle_name)
    if paddle_name not in PADDLE_NAMES:
        raise RuntimeError(f"tensor {name!r} has dtype {dtype}, which paddlequic cannot serve")
    return TensorSpec(name, PADDLE_NAMES[paddle_name], tuple(int(d) for d in shape))


Shapes = dict[str, tuple[tuple[int, ...], tuple[int, ...]]]


def _reshapes(config: mc.ModelConfig, fetch_names: list[str]) -> tuple[Shapes, Shapes]:
    """Input name -> (dims as sent, shape the model sees); fetch name -> (shape the model
    produces, dims as answered). Renamed outputs map to the program's in order."""
    inputs = {
        e.name: (tuple(e.dims), tuple(e.reshape.shape))
        for e in config.input
        if e.HasField("reshape")
    }
    renamed = any(e.name not in fetch_names for e in config.output)
    outputs = {
        (fetch_names[i] if renamed else e.name): (tuple(e.reshape.shape), tuple(e.dims))
        for i, e in enumerate(config.output)
        if e.HasField("reshape") and i < len(fetch_names)
    }
    return inputs, outputs
