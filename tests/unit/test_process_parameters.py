"""The parameters that bound a worker's processes and memory: python_child_processes from 0 to
MAX_CHILD_PROCESSES (a bound, not a wish), memory_mb, and what each worker's cgroup gets."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from protos.inference import model_config_pb2 as mc
from service.model.parameters import (
    MAX_CHILD_PROCESSES,
    ParameterError,
    check_parameters,
    child_processes,
    worker_memory_mb,
)
from tests.unit.test_validation import property_settings


def config(**parameters: str) -> mc.ModelConfig:
    model = mc.ModelConfig(name="m", backend="python")
    for key, value in parameters.items():
        model.parameters[key].string_value = value
    return model


@given(count=st.integers(-1000, 1000))
@property_settings(200)
def test_child_processes_are_bounded(count: int) -> None:
    model = config(python_child_processes=str(count))
    if 0 <= count <= MAX_CHILD_PROCESSES:
        check_parameters(model)
        assert child_processes({"python_child_processes": str(count)}) == count
    else:
        with pytest.raises(ParameterError, match="parameter python_child_processes must be"):
            check_parameters(model)


def test_no_child_process_unless_asked() -> None:
    assert child_processes({}) == 0


def test_a_workers_memory() -> None:
    assert worker_memory_mb({}, python=False) is None
    assert worker_memory_mb({}, python=True) == 4096
    assert worker_memory_mb({"python_memory_mb": "1024"}, python=True) == 1024
    assert worker_memory_mb({"memory_mb": "2048", "python_memory_mb": "1024"}, True) == 2048
    assert worker_memory_mb({"memory_mb": "512"}, python=False) == 512
    with pytest.raises(ParameterError, match="parameter memory_mb must be >= 64"):
        check_parameters(config(memory_mb="10"))
