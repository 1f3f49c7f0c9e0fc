"""Numeric model parameters are checked when the model is read, and a shared-memory slot that
cannot grow fails only the request that needed it."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest

from service.inference.errors import ServiceError
from service.lifecycle.repository import ModelRepository, RepositoryError
from service.workers.shm import Segment
from service.workers.slots import grown
from tests.unit.test_repository import MLP_CONFIG, add_model


def parameter(key: str, value: str) -> str:
    return f'parameters {{ key: "{key}" value: {{ string_value: "{value}" }} }}\n'


@pytest.mark.parametrize(
    ("key", "value", "expected"),
    [
        ("cpu_math_threads", "abc", "parameter cpu_math_threads must be an integer, not 'abc'"),
        ("gpu_memory_mb", "1.5", "parameter gpu_memory_mb must be an integer, not '1.5'"),
        ("execution_timeout_ms", "0", "parameter execution_timeout_ms must be >= 1, not 0"),
        ("max_input_elements", "-4", "parameter max_input_elements must be >= 1, not -4"),
        ("testing_crash_on", "x", "parameter testing_crash_on must be a number, not 'x'"),
    ],
)
def test_bad_parameter_values_fail_the_model_with_a_reason(
    tmp_path: Path, key: str, value: str, expected: str
) -> None:
    add_model(tmp_path, "mlp", MLP_CONFIG + parameter(key, value))
    with pytest.raises(RepositoryError) as info:
        ModelRepository(tmp_path).load("mlp")
    assert expected in str(info.value)
    assert "config.pbtxt" in str(info.value)


def test_good_parameter_values_load(tmp_path: Path) -> None:
    config = MLP_CONFIG + parameter("execution_timeout_ms", "2500")
    add_model(tmp_path, "mlp", config + parameter("max_input_elements", " 64 "))
    loaded = ModelRepository(tmp_path).load("mlp").config
    assert loaded.parameters["execution_timeout_ms"].string_value == "2500"


def test_a_segment_that_cannot_grow_fails_the_request_and_stays_usable() -> None:
    segment = Segment(0)
    try:
        segment.buf[:4] = b"keep"
        with pytest.raises(ServiceError) as info:
            grown(segment, 1 << 50)  # more than any /dev/shm can hold
        assert info.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "no shared memory for a request of" in info.value.message
        assert bytes(segment.buf[:4]) == b"keep"
        assert grown(segment, 10) is segment
        bigger = grown(segment, segment.size + 1)
        segment = bigger
        assert bigger.size > 1 << 20
    finally:
        segment.release()
