"""The `parameters` of a model's config.pbtxt, checked when the model is read.

A value that is not a number in range, not a boolean, or not one of the listed choices fails the
model at load time with a reason in RepositoryIndex (the other models keep serving), instead of
failing later in placement, in a worker, or per request.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from protos.inference import model_config_pb2 as mc

# How many processes a Python model's code may run beside its worker at once (seccomp refuses
# any when 0, the default; its launcher kills the worker past the count).
PYTHON_CHILD_PROCESSES = "python_child_processes"
MEMORY_MB = "memory_mb"
PYTHON_MEMORY_MB = "python_memory_mb"
DEFAULT_PYTHON_MEMORY_MB = 4096
MAX_CHILD_PROCESSES = 64
# name -> smallest accepted value
_INTEGERS = {
    "cpu_math_threads": 1,
    "gpu_memory_mb": 1,
    "gpus_per_instance": 1,
    "execution_timeout_ms": 1,
    "max_input_elements": 1,
    "max_input_bytes": 1,
    "onednn_cache_capacity": 1,
    "tensorrt_workspace_mb": 1,
    "tensorrt_min_subgraph_size": 1,
    "breaker_min_requests": 1,
    "python_memory_mb": 256,
    # All of a worker's memory, its processes' together (its cgroup's memory.max).
    MEMORY_MB: 64,
    "python_open_files": 32,
    # Processes a Python model may start (Paddle's CPU check runs three: sh, cat, grep).
    PYTHON_CHILD_PROCESSES: 0,
    # A decoupled model's (service/model/decoupled.py).
    "max_concurrent_requests": 1,
    "max_queued_requests": 0,
}
# name -> (smallest, largest) accepted value, both included
_FLOATS = {
    "breaker_failure_ratio": (0.01, 1.0),
    "breaker_window_s": (0.1, 3600.0),
    "breaker_open_s": (0.1, 3600.0),
}
# Another model that answers this one's requests while its circuit breaker is open.
FALLBACK_MODEL = "fallback_model"
_TRUE = ("true", "1", "yes", "on")
_FALSE = ("false", "0", "no", "off")
PRECISIONS = ("fp32", "fp16", "bf16")
# A Python model's sandbox; only a model whose code is trusted says "off", explicitly.
PYTHON_SANDBOX = "python_sandbox"
PYTHON_SANDBOX_CHOICES = ("on", "off")
# Whether a Python model's requests go straight to its instances' queues as a Paddle model's
# do (service/serving/queue_setup.py), its BLS calls refused there: a BLS call must go back
# through the process holding the request. Unset: when no file of its code names a BLS call
# (service/model/python_code.py).
PYTHON_INSTANCE_QUEUES = "python_instance_queues"
# Test-only: a worker aborts when any input element equals this number. Honoured only
# when the server runs with --testing-service; otherwise it never reaches the worker.
TESTING_CRASH_ON = "testing_crash_on"
# Test-only, as testing_crash_on: a worker serving from its instance queues scribbles random
# bytes over all of their shared memory when an input element equals this number, then hangs.
TESTING_SCRIBBLE_ON = "testing_scribble_on"
TESTING_PARAMETERS = (TESTING_CRASH_ON, TESTING_SCRIBBLE_ON)


class ParameterError(ValueError):
    pass


@dataclass(frozen=True)
class ModelLimits:
    execution_timeout_s: float | None  # None: derived from the warm-up batch time
    max_input_elements: int | None  # None: derived from the model's dims (validation.py)
    max_input_bytes: int | None  # None: no bound but the elements' and the message's
    breaker: BreakerPolicy
    fallback_model: str | None


@dataclass(frozen=True)
class EngineOptions:
    """How a worker configures its Paddle predictor (docs/configuration.md, "Model
    parameters")."""

    onednn: bool = True
    onednn_cache_capacity: int | None = None  # None: one entry per shape bucket
    cpu_math_threads: int = 1
    ir_optim: bool = True
    memory_optim: bool = False
    precision: str = "fp32"
    gpu_memory_mb: int = 1024
    tensorrt: bool = False
    tensorrt_workspace_mb: int = 1024
    tensorrt_min_subgraph_size: int = 3


def string_parameters(config: mc.ModelConfig) -> dict[str, str]:
    return {key: value.string_value for key, value in config.parameters.items()}


def check_parameters(config: mc.ModelConfig) -> ModelLimits:
    """Raises ParameterError naming the first bad value."""
    params = string_parameters(config)
    numbers = _integers(params)
    engine_options(params)
    for testing in TESTING_PARAMETERS:
        if testing not in params:
            continue
        try:
            float(params[testing])
        except ValueError:
            raise ParameterError(
                f"parameter {testing} must be a number, not {params[testing]!r}"
            ) from None
    if numbers.get(PYTHON_CHILD_PROCESSES, 0) > MAX_CHILD_PROCESSES:
        raise ParameterError(
            f"parameter {PYTHON_CHILD_PROCESSES} must be <= {MAX_CHILD_PROCESSES}, "
            f"not {numbers[PYTHON_CHILD_PROCESSES]}"
        )
    python_instance_queues(params)
    sandbox = params.get(PYTHON_SANDBOX, "on")
    if sandbox not in PYTHON_SANDBOX_CHOICES:
        raise ParameterError(f"parameter {PYTHON_SANDBOX} must be on or off, not {sandbox!r}")
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
        numbers.get("max_input_bytes"),
        breaker,
        fallback,
    )


def engine_options(params: Mapping[str, str]) -> EngineOptions:
    """The predictor options the parameters ask for; what needs the machine or the program to
    judge (bf16 support, a GPU build, the program format) is checked by the worker at load."""
    numbers = _integers(params)
    default = EngineOptions()
    precision = params.get("precision", default.precision).strip().lower()
    if precision not in PRECISIONS:
        raise ParameterError(
            f"parameter precision must be one of {', '.join(PRECISIONS)}, not {precision!r}"
        )
    return EngineOptions(
        onednn=boolean(params, "onednn", default.onednn),
        onednn_cache_capacity=numbers.get("onednn_cache_capacity"),
        cpu_math_threads=numbers.get("cpu_math_threads", default.cpu_math_threads),
        ir_optim=boolean(params, "ir_optim", default.ir_optim),
        memory_optim=boolean(params, "memory_optim", default.memory_optim),
        precision=precision,
        gpu_memory_mb=numbers.get("gpu_memory_mb", default.gpu_memory_mb),
        tensorrt=boolean(params, "tensorrt", default.tensorrt),
        tensorrt_workspace_mb=numbers.get("tensorrt_workspace_mb", default.tensorrt_workspace_mb),
        tensorrt_min_subgraph_size=numbers.get(
            "tensorrt_min_subgraph_size", default.tensorrt_min_subgraph_size
        ),
    )


def python_instance_queues(params: Mapping[str, str]) -> bool | None:
    """What a Python model's config says of its instance queues (PYTHON_INSTANCE_QUEUES);
    None: nothing, the server reads its code."""
    if PYTHON_INSTANCE_QUEUES not in params:
        return None
    return boolean(params, PYTHON_INSTANCE_QUEUES, False)


def child_processes(params: Mapping[str, str]) -> int:
    """The processes a Python model may run beside its worker (checked by check_parameters)."""
    return int(params.get(PYTHON_CHILD_PROCESSES, "0"))


def worker_memory_mb(params: Mapping[str, str], python: bool) -> int | None:
    """What one worker may hold in total (with a cgroup): memory_mb, else a Python model's
    python_memory_mb; None: a Paddle model that names no limit."""
    if MEMORY_MB in params:
        return int(params[MEMORY_MB])
    if python:
        return int(params.get(PYTHON_MEMORY_MB, DEFAULT_PYTHON_MEMORY_MB))
    return None


def boolean(params: Mapping[str, str], name: str, default: bool) -> bool:
    if name not in params:
        return default
    text = params[name].strip().lower()
    if text in _TRUE:
        return True
    if text in _FALSE:
        return False
    raise ParameterError(f"parameter {name} must be true or false, not {params[name]!r}")


def integer(name: str, text: str, minimum: int) -> int:
    try:
        value = int(text.strip())
    except ValueError:
        raise ParameterError(f"parameter {name} must be an integer, not {text!r}") from None
    if value < minimum:
        raise ParameterError(f"parameter {name} must be >= {minimum}, not {value}")
    return value


def _integers(params: Mapping[str, str]) -> dict[str, int]:
    return {
        name: integer(name, params[name], minimum)
        for name, minimum in _INTEGERS.items()
        if name in params
    }


def _real(name: str, text: str, low: float, high: float) -> float:
    try:
        value = float(text.strip())
    except ValueError:
        raise ParameterError(f"parameter {name} must be a number, not {text!r}") from None
    if not low <= value <= high:  # also refuses nan
        raise ParameterError(f"parameter {name} must be within [{low}, {high}], not {text!r}")
    return value


@dataclass(frozen=True)
class BreakerPolicy:
    failure_ratio: float = 0.5  # opens when failures / requests in the window reach this
    min_requests: int = 10  # ... and the window holds at least this many
    window_s: float = 30.0
    open_s: float = 5.0  # the cool-down before half-open probes
