"""Every field of Triton's ModelConfig parses: fields that only tune Triton's engines are
accepted and named (tuning_fields, the load warning); fields that would change a model's
tensors and are not implemented are refused with a reason. No server, no Paddle."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from google.protobuf import text_format
from hypothesis import given, settings
from hypothesis import strategies as st

from protos.inference import model_config_pb2 as mc
from service.lifecycle.repository import ModelRepository, RepositoryError, read_config
from service.model.tuning import tuning_fields, unserved

# Triton's densenet_onnx config as its users write it, with the tuning fields they add.
TRITON_CONFIG = """
name: "densenet"
platform: "paddle_inference"
max_batch_size: 0
runtime: "libtorch"
input [
  {
    name: "data_0"
    data_type: TYPE_FP32
    format: FORMAT_NCHW
    dims: [ 3, 224, 224 ]
    is_shape_tensor: false
    allow_ragged_batch: true
    optional: false
    is_non_linear_format_io: false
  }
]
output [
  {
    name: "fc6_1"
    data_type: TYPE_FP32
    dims: [ 1000 ]
    label_filename: "densenet_labels.txt"
  }
]
instance_group [
  {
    count: 1
    kind: KIND_CPU
    rate_limiter { resources [ { name: "R1" count: 2 } ] priority: 1 }
    profile: [ "0" ]
    passive: false
    host_policy: "cpu"
  }
]
optimization {
  graph { level: 1 }
  priority: PRIORITY_MAX
  cuda { graphs: true busy_wait_events: true output_copy_stream: true }
  execution_accelerators {
    gpu_execution_accelerator [
      { name: "tensorrt" parameters { key: "precision_mode" value: "FP16" } }
    ]
    cpu_execution_accelerator [ { name: "openvino" } ]
  }
  input_pinned_memory { enable: false }
  output_pinned_memory { enable: false }
  gather_kernel_buffer_threshold: 4
  eager_batching: true
}
default_model_filename: "model.onnx"
cc_model_filenames { key: "7.5" value: "model_75.plan" }
metric_tags { key: "team" value: "vision" }
model_operations { op_library_filename: "libcustom.so" }
model_repository_agents { agents [ { name: "checksum" } ] }
response_cache { enable: true }
model_metrics {
  metric_control [ {
    metric_identifier { family: "nv_inference_request_duration" }
    histogram_options { buckets: [ 1, 10 ] }
  } ]
}
"""

EXPECTED = sorted(
    [
        "runtime",
        "input[0].allow_ragged_batch",
        "instance_group[0].rate_limiter",
        "instance_group[0].profile",
        "instance_group[0].host_policy",
        "optimization",
        "default_model_filename",
        "cc_model_filenames",
        "metric_tags",
        "model_operations",
        "model_repository_agents",
        "response_cache",
        "model_metrics",
    ]
)


def _model(root: Path, config: str, name: str = "densenet") -> Path:
    (root / name / "1").mkdir(parents=True)
    (root / name / "config.pbtxt").write_text(config)
    (root / name / "1" / "inference.json").write_text("{}")
    (root / name / "1" / "inference.pdiparams").write_bytes(b"")
    (root / name / "densenet_labels.txt").write_text("tench\ngoldfish\n")
    return root / name


def test_triton_config_parses_and_keeps_every_field(tmp_path: Path) -> None:
    config = read_config(_model(tmp_path, TRITON_CONFIG), "densenet")
    assert config.input[0].format == mc.ModelInput.FORMAT_NCHW
    assert config.output[0].label_filename == "densenet_labels.txt"
    assert config.response_cache.enable
    assert config.optimization.cuda.graphs
    assert config.default_model_filename == "model.onnx"
    # What ModelConfig answers is this message: the fields come back as written.
    written = mc.ModelConfig()
    text_format.Parse(TRITON_CONFIG, written)
    assert config.optimization == written.optimization
    assert config.instance_group == written.instance_group


def test_tuning_fields_named(tmp_path: Path) -> None:
    assert tuning_fields(read_config(_model(tmp_path, TRITON_CONFIG), "densenet")) == EXPECTED


def test_load_warns_naming_each_tuning_field(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    _model(tmp_path, TRITON_CONFIG)
    with caplog.at_level(logging.WARNING, logger="paddlequic.models"):
        ModelRepository(tmp_path).load("densenet")
    (warning,) = [r.getMessage() for r in caplog.records if "tune Triton" in r.getMessage()]
    assert warning.endswith(": " + ", ".join(EXPECTED))


@pytest.mark.parametrize(
    ("extra", "named"),
    [
        ('batch_input [ { kind: BATCH_ELEMENT_COUNT target_name: "N" } ]', "batch_input"),
        ('batch_output [ { target_name: "fc6_1" } ]', "batch_output"),
    ],
)
def test_unimplemented_tensor_fields_refused(tmp_path: Path, extra: str, named: str) -> None:
    with pytest.raises(RepositoryError, match=f"{named}.*not implemented"):
        read_config(_model(tmp_path, TRITON_CONFIG + extra), "densenet")


@given(fmt=st.sampled_from(["NONE", "NHWC", "NCHW"]), rank=st.integers(1, 5))
def test_an_image_format_needs_three_dims_as_triton_says(fmt: str, rank: int) -> None:
    """NHWC and NCHW inputs are refused unless they have 3 dims, in Triton's words."""
    config = mc.ModelConfig(name="m")
    config.input.add(name="x", format=getattr(mc.ModelInput, f"FORMAT_{fmt}"), dims=[4] * rank)
    refused = unserved(config)
    if fmt == "NONE" or rank == 3:
        assert refused is None
    else:
        assert refused == f"model input NHWC/NCHW require 3 dims (input 'x' has {rank})"


def test_reshape_of_equal_elements_accepted(tmp_path: Path) -> None:
    config = TRITON_CONFIG.replace(
        "dims: [ 1000 ]", "dims: [ 1000 ] reshape { shape: [ 1, 1000 ] }"
    )
    assert list(read_config(_model(tmp_path, config), "densenet").output[0].reshape.shape) == [
        1,
        1000,
    ]


@pytest.mark.parametrize(
    ("reshape", "extra", "why"),
    [
        ("[ 999 ]", "", "holds 999 elements but dims \\[1000\\] hold 1000"),
        ("[ -1 ]", "", "needs fixed dims and shape"),
        ("[ 1000 ]", 'backend: "python"', "Paddle models only"),
    ],
)
def test_reshape_that_cannot_be_served_refused(
    tmp_path: Path, reshape: str, extra: str, why: str
) -> None:
    config = TRITON_CONFIG.replace(
        "dims: [ 1000 ]", f"dims: [ 1000 ] reshape {{ shape: {reshape} }}"
    ).replace('platform: "paddle_inference"', extra)
    with pytest.raises(RepositoryError, match=f"'fc6_1': reshape.*{why}|'fc6_1': {why}"):
        read_config(_model(tmp_path, config), "densenet")


_FLAGS = st.fixed_dictionaries(
    {
        "input[0].is_shape_tensor": st.booleans(),
        "input[0].allow_ragged_batch": st.booleans(),
        "input[0].is_non_linear_format_io": st.booleans(),
        "output[0].is_shape_tensor": st.booleans(),
        "output[0].is_non_linear_format_io": st.booleans(),
        "instance_group[0].passive": st.booleans(),
        "response_cache": st.booleans(),
        "default_model_filename": st.booleans(),
    }
)


@settings(max_examples=60, deadline=None)
@given(flags=_FLAGS, optional=st.booleans(), fmt=st.sampled_from(["NONE", "NHWC", "NCHW"]))
def test_named_fields_are_exactly_those_set(
    flags: dict[str, bool], optional: bool, fmt: str
) -> None:
    """Any mix of tuning fields parses and each set one is named; fields paddlequic serves
    (optional, format) are never named."""
    config = mc.ModelConfig(name="m")
    entry = config.input.add(
        name="x", optional=optional, format=getattr(mc.ModelInput, f"FORMAT_{fmt}")
    )
    out = config.output.add(name="y")
    group = config.instance_group.add()
    entry.is_shape_tensor = flags["input[0].is_shape_tensor"]
    entry.allow_ragged_batch = flags["input[0].allow_ragged_batch"]
    entry.is_non_linear_format_io = flags["input[0].is_non_linear_format_io"]
    out.is_shape_tensor = flags["output[0].is_shape_tensor"]
    out.is_non_linear_format_io = flags["output[0].is_non_linear_format_io"]
    group.passive = flags["instance_group[0].passive"]
    if flags["response_cache"]:
        config.response_cache.enable = False  # present, even at its default
    if flags["default_model_filename"]:
        config.default_model_filename = "model.onnx"
    parsed = mc.ModelConfig()
    text_format.Parse(text_format.MessageToString(config), parsed)
    assert sorted(tuning_fields(parsed)) == sorted(k for k, on in flags.items() if on)
