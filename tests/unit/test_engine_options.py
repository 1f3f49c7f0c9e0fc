"""Engine options per model: parameters checked when the model is read, the Paddle config calls
they make (GPU and TensorRT ones compared, as the CPU build cannot enable them), and a real
predictor built with them."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from service.backend.engine import Call, EngineOptionError, config_calls, trt_shapes
from service.backend.load import Load
from service.inference.tensors import TensorSpec
from service.lifecycle.repository import ModelRepository, RepositoryError
from service.model.parameters import EngineOptions, ParameterError, engine_options
from service.model.shapes import ShapeBuckets
from tests.servers import EXAMPLE_MODELS
from tests.unit.test_model_limits import parameter
from tests.unit.test_repository import MLP_CONFIG, add_model

IMAGE = (TensorSpec("image", "FP32", (-1, 3, 224, 224)),)
TOKENS = (TensorSpec("token_ids", "INT64", (-1, -1)),)
BUCKETS = ShapeBuckets(batch=(1, 2, 4, 8, 16))


@pytest.mark.parametrize(
    ("key", "value", "expected"),
    [
        ("onednn", "maybe", "parameter onednn must be true or false, not 'maybe'"),
        ("ir_optim", "2", "parameter ir_optim must be true or false, not '2'"),
        ("precision", "int4", "parameter precision must be one of fp32, fp16, bf16, not 'int4'"),
        ("onednn_cache_capacity", "0", "parameter onednn_cache_capacity must be >= 1, not 0"),
        ("tensorrt_workspace_mb", "x", "parameter tensorrt_workspace_mb must be an integer"),
    ],
)
def test_bad_engine_options_fail_the_model_when_it_is_read(
    tmp_path: Path, key: str, value: str, expected: str
) -> None:
    add_model(tmp_path, "mlp", MLP_CONFIG + parameter(key, value))
    with pytest.raises(RepositoryError, match=expected):
        ModelRepository(tmp_path).load("mlp")


def test_engine_options_read_from_parameters() -> None:
    params = {"onednn": "off", "precision": " BF16 ", "memory_optim": "yes", "tensorrt": "1"}
    options = engine_options(params)
    assert (options.onednn, options.precision, options.memory_optim) == (False, "bf16", True)
    assert options.tensorrt and options.gpu_memory_mb == 1024 and options.ir_optim
    with pytest.raises(ParameterError):
        engine_options({"memory_optim": "sometimes"})


def test_cpu_calls_size_the_onednn_cache_to_the_buckets() -> None:
    calls = config_calls(EngineOptions(), "cpu", ".json", IMAGE, BUCKETS, bf16_supported=False)
    assert calls == [
        Call("switch_ir_optim", (True,)),
        Call("disable_gpu"),
        Call("set_cpu_math_library_num_threads", (1,)),
        Call("enable_mkldnn"),
        Call("set_mkldnn_cache_capacity", (5,)),
    ]
    # Sequence buckets multiply the shapes of an input with a variable dimension.
    buckets = ShapeBuckets(batch=(1, 2, 4), sequence=(16, 32))
    calls = config_calls(EngineOptions(), "cpu", ".json", TOKENS, buckets, False)
    assert Call("set_mkldnn_cache_capacity", (6,)) in calls
    options = EngineOptions(onednn_cache_capacity=40, cpu_math_threads=3)
    calls = config_calls(options, "cpu", ".json", TOKENS, buckets, False)
    assert Call("set_mkldnn_cache_capacity", (40,)) in calls
    assert Call("set_cpu_math_library_num_threads", (3,)) in calls


def test_gpu_calls_and_tensorrt_shapes_from_the_buckets() -> None:
    options = EngineOptions(gpu_memory_mb=2048, precision="fp16")
    assert config_calls(options, "gpu", ".pdmodel", IMAGE, BUCKETS, False) == [
        Call("switch_ir_optim", (True,)),
        Call("enable_use_gpu", (2048, 0, "Half"), precision_arg=2),
    ]
    options = EngineOptions(tensorrt=True, tensorrt_workspace_mb=256, memory_optim=True)
    calls = config_calls(options, "gpu", ".pdmodel", IMAGE, BUCKETS, False)
    low, high = {"image": [1, 3, 224, 224]}, {"image": [16, 3, 224, 224]}
    assert calls == [
        Call("switch_ir_optim", (True,)),
        Call("enable_memory_optim"),
        Call("enable_use_gpu", (1024, 0)),
        Call("enable_tensorrt_engine", (256 << 20, 16, 3, "Float32", False, False), 3),
        Call("set_trt_dynamic_shape_info", (low, high, high)),
    ]
    tokens = trt_shapes(TOKENS, ShapeBuckets(batch=(1, 8), sequence=(32, 128)))
    assert tokens == ({"token_ids": [1, 32]}, {"token_ids": [8, 128]})


@pytest.mark.parametrize(
    ("options", "device", "suffix", "inputs", "supported", "reason"),
    [
        (EngineOptions(memory_optim=True), "cpu", ".json", IMAGE, True, "memory_optim is not"),
        (EngineOptions(precision="bf16"), "cpu", ".json", IMAGE, False, "AVX-512 BF16"),
        (EngineOptions(precision="bf16", onednn=False), "cpu", ".json", IMAGE, True, "oneDNN"),
        (EngineOptions(precision="fp16"), "cpu", ".json", IMAGE, True, "needs a GPU"),
        (EngineOptions(tensorrt=True), "cpu", ".pdmodel", IMAGE, True, "needs a GPU"),
        (EngineOptions(tensorrt=True), "gpu", ".pdmodel", TOKENS, True, "sequence_buckets"),
    ],
)
def test_combinations_that_cannot_run_are_refused_with_the_reason(
    options: EngineOptions,
    device: str,
    suffix: str,
    inputs: tuple[TensorSpec, ...],
    supported: bool,
    reason: str,
) -> None:
    with pytest.raises(EngineOptionError, match=reason):
        config_calls(options, device, suffix, inputs, BUCKETS, supported)


def test_calls_apply_to_a_real_paddle_config() -> None:
    """Every method the GPU and TensorRT calls name exists on the Paddle config; the CPU ones
    and the TensorRT shape range take effect."""
    from paddle import inference

    from service.backend.paddle_model import apply

    model = EXAMPLE_MODELS / "resnet18" / "1"
    config = inference.Config(str(model / "inference.json"), str(model / "inference.pdiparams"))
    options = EngineOptions(tensorrt=True, precision="bf16")
    for call in config_calls(options, "gpu", ".pdmodel", IMAGE, BUCKETS, True):
        assert callable(getattr(config, call.method)), call.method
    shapes = config_calls(options, "gpu", ".pdmodel", IMAGE, BUCKETS, True)[-1]
    cpu = config_calls(EngineOptions(ir_optim=False), "cpu", ".json", IMAGE, BUCKETS, False)
    apply(config, [*cpu, shapes])
    assert config.mkldnn_enabled() and not config.ir_optim() and not config.use_gpu()
    assert "| mkldnn_cache_capacity        | 5 " in config.summary()


def test_a_worker_predictor_runs_in_bf16_or_says_why_not() -> None:
    import paddle

    from service.backend.paddle_model import PaddleModel

    model = EXAMPLE_MODELS / "mlp" / "1"
    files = (str(model / "inference.json"), str(model / "inference.pdiparams"))
    with pytest.raises(EngineOptionError, match="memory_optim"):
        PaddleModel(Load("mlp", 1, *files, {"memory_optim": "true"}, "cpu", BUCKETS))
    load = Load("mlp", 1, *files, {"precision": "bf16"}, "cpu", BUCKETS)
    if not paddle.base.core.supports_bfloat16():
        with pytest.raises(EngineOptionError, match="bf16"):
            PaddleModel(load)
        return
    outputs, _ = PaddleModel(load).run({"input": np.ones((2, 256), np.float32)}, ("fetch_name_0",))
    (probabilities,) = outputs.values()
    assert probabilities.dtype == np.float32 and probabilities.shape == (2, 10)
    np.testing.assert_allclose(probabilities.sum(axis=1), 1.0, atol=0.02)


def test_a_worker_predictor_gathers_its_frees_unless_the_operator_says_otherwise() -> None:
    """Freed intermediates are gathered (paddle_model.GARBAGE_BATCH_GB): freeing each one
    through Paddle's thread pool doubled a small model's CPU per run."""
    import paddle

    from service.backend.paddle_model import GARBAGE_BATCH_GB, GARBAGE_FLAG, PaddleModel

    model = EXAMPLE_MODELS / "mlp" / "1"
    files = (str(model / "inference.json"), str(model / "inference.pdiparams"))
    script = (
        "import paddle\n"
        "from service.backend.load import Load\n"
        "from service.backend.paddle_model import PaddleModel\n"
        "from tests.unit.test_engine_options import BUCKETS\n"
        f"PaddleModel(Load('mlp', 1, {files[0]!r}, {files[1]!r}, {{}}, 'cpu', BUCKETS))\n"
        f"print(paddle.get_flags({GARBAGE_FLAG!r})[{GARBAGE_FLAG!r}])\n"
    )
    env = {**os.environ, GARBAGE_FLAG: "0.5"}
    chosen = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True
    )
    assert float(chosen.stdout.split()[-1]) == 0.5
    if GARBAGE_FLAG in os.environ:
        pytest.skip(f"{GARBAGE_FLAG} is set in this test's environment")
    PaddleModel(Load("mlp", 1, *files, {}, "cpu", BUCKETS))
    assert paddle.get_flags(GARBAGE_FLAG)[GARBAGE_FLAG] == pytest.approx(GARBAGE_BATCH_GB)
