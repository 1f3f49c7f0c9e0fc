"""The numeric `parameters` of a model's config.pbtxt, checked when the model is read.

A value that is not a number in range fails the model at load time with a reason in
RepositoryIndex (the other models keep serving), instead of failing later in placement, in a
worker, or per request.
"""

from __future__ import annotations

from dataclasses import dataclass

from protos.inference import model_config_pb2 as mc

# name -> smallest accepted value
_INTEGERS = {
    "cpu_math_threads": 1,
    "gpu_memory_mb": 1,
    "gpus_per_instance": 1,
    "execution_timeout_ms": 1,
    "max_input_elements": 1,
}
# Test-only: a worker aborts when any input element equals this number. Honoured only
# when the server runs with --testing-service; otherwise it never reaches the worker.
TESTING_CRASH_ON = "testing_crash_on"


class ParameterError(ValueError):
    pass


@dataclass(frozen=True)
class ModelLimits:
    execution_timeout_s: float | None  # None: derived from the warm-up batch time
    max_input_elements: int | None  # None: derived from the model's dims (validation.py)


def string_parameters(config: mc.ModelConfig) -> dict[str, str]:
    return {key: value.string_value for key, value in config.parameters.items()}


def check_parameters(config: mc.ModelConfig) -> ModelLimits:
    """Raises ParameterError naming the first bad value."""
    params = string_parameters(config)
    numbers: dict[str, int] = {}
    for name, minimum in _INTEGERS.items():
        if name in params:
            numbers[name] = _integer(name, params[name], minimum)
    if TESTING_CRASH_ON in params:
        try:
            float(params[TESTING_CRASH_ON])
        except ValueError:
            raise ParameterError(
                f"parameter {TESTING_CRASH_ON} must be a number, not {params[TESTING_CRASH_ON]!r}"
            ) from None
    timeout_ms = numbers.get("execution_timeout_ms")
    return ModelLimits(
        None if timeout_ms is None else timeout_ms / 1000, numbers.get("max_input_elements")
    )


def _integer(name: str, text: str, minimum: int) -> int:
    try:
        value = int(text.strip())
    except ValueError:
        raise ParameterError(f"parameter {name} must be an integer, not {text!r}") from None
    if value < minimum:
        raise ParameterError(f"parameter {name} must be >= {minimum}, not {value}")
    return value
