"""The numeric `parameters` of a model's config.pbtxt, checked when the model is read.

A value that is not a number in range fails the model at load time with a reason in
RepositoryIndex (the other models keep serving), instead of failing later in placement, in a
worker, or per request.
"""

from __future__ import annotations

from dataclasses import dataclass

from protos.inference import model_config_pb2 as mc
from service.breaker import BreakerPolicy

# name -> smallest accepted value
_INTEGERS = {
    "cpu_math_threads": 1,
    "gpu_memory_mb": 1,
    "gpus_per_instance": 1,
    "execution_timeout_ms": 1,
    "max_input_elements": 1,
    "breaker_min_requests": 1,
    "python_memory_mb": 256,
    "python_open_files": 32,
}
# name -> (smallest, largest) accepted value, both included
_FLOATS = {
    "breaker_failure_ratio": (0.01, 1.0),
    "breaker_window_s": (0.1, 3600.0),
    "breaker_open_s": (0.1, 3600.0),
}
# Another model that answers this one's requests while its circuit breaker is open.
FALLBACK_MODEL = "fallback_model"
# Test-only: a worker aborts when any input element equals this number. Honoured only
# when the server runs with --testing-service; otherwise it never reaches the worker.
TESTING_CRASH_ON = "testing_crash_on"


class ParameterError(ValueError):
    pass


@dataclass(frozen=True)
class ModelLimits:
    execution_timeout_s: float | None  # None: derived from the warm-up batch time
    max_input_elements: int | None  # None: derived from the model's dims (validation.py)
    breaker: BreakerPolicy
    fallback_model: str | None


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
    reals = {
        name: _real(name, params[name], *bounds)
        for name, bounds in _FLOATS.items()
        if name in params
    }
    default = BreakerPolicy()
    breaker = BreakerPolicy(
        failure_ratio=reals.get("breaker_failure_ratio", default.failure_ratio),
        min_requests=numbers.get("breaker_min_requests", default.min_requests),
        window_s=reals.get("breaker_window_s", default.window_s),
        open_s=reals.get("breaker_open_s", default.open_s),
    )
    fallback = params.get(FALLBACK_MODEL, "").strip() or None
    if fallback == config.name:
        raise ParameterError(f"parameter {FALLBACK_MODEL} must name another model")
    timeout_ms = numbers.get("execution_timeout_ms")
    return ModelLimits(
        None if timeout_ms is None else timeout_ms / 1000,
        numbers.get("max_input_elements"),
        breaker,
        fallback,
    )


def _integer(name: str, text: str, minimum: int) -> int:
    try:
        value = int(text.strip())
    except ValueError:
        raise ParameterError(f"parameter {name} must be an integer, not {text!r}") from None
    if value < minimum:
        raise ParameterError(f"parameter {name} must be >= {minimum}, not {value}")
    return value


def _real(name: str, text: str, low: float, high: float) -> float:
    try:
        value = float(text.strip())
    except ValueError:
        raise ParameterError(f"parameter {name} must be a number, not {text!r}") from None
    if not low <= value <= high:  # also refuses nan
        raise ParameterError(f"parameter {name} must be within [{low}, {high}], not {text!r}")
    return value
