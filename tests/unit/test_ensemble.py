"""An ensemble's graph, checked when it is loaded, and its steps run in dependency order;
ensembles that reach themselves through their steps (nested ensembles' cycles) are found, and
where one exists anyway, readiness and requests still end."""

from __future__ import annotations

import asyncio
import functools
import graphlib
import itertools
from pathlib import Path

import grpc
import pytest
from google.protobuf import text_format
from hypothesis import given, settings
from hypothesis import strategies as st

from oip.datatypes import BY_NAME
from protos.inference import model_config_pb2 as mc
from service.inference.errors import ServiceError
from service.inference.jobs import InferJob, InputTensor, OutputTensor
from service.inference.validation import RequestValidator
from service.model.ensemble import (
    MAX_ENSEMBLE_DEPTH,
    EnsembleError,
    Step,
    check_step,
    order,
    plan,
    step_cycle,
)
from service.observability.logs import LineBudget, RequestLog
from service.observability.metrics import Metrics
from service.observability.observer import Observer
from service.placement.topology import cpu_only_topology
from service.registry.versions import ModelRegistry, ServedVersion, VersionState
from service.serving.ensemble import run
from service.serving.requests import RequestRunner
from tests.unit.test_version_failure import failures_counted, lifecycle_over


def ensemble(steps: str) -> mc.ModelConfig:
    return text_format.Parse(
        f"""name: "e" platform: "ensemble" max_batch_size: 4
        input [ {{ name: "a" data_type: TYPE_FP32 dims: [ 1 ] }} ]
        output [ {{ name: "z" data_type: TYPE_FP32 dims: [ 1 ] }} ]
        ensemble_scheduling {{ step [ {steps} ] }}""",
        mc.ModelConfig(),
    )


def step(model: str, inputs: dict[str, str], outputs: dict[str, str]) -> str:
    ins = " ".join(f'input_map {{ key: "{k}" value: "{v}" }}' for k, v in inputs.items())
    outs = " ".join(f'output_map {{ key: "{k}" value: "{v}" }}' for k, v in outputs.items())
    return f'{{ model_name: "{model}" model_version: -1 {ins} {outs} }}'


DIAMOND = ensemble(
    ",".join(
        [
            step("last", {"x": "b", "y": "c"}, {"out": "z"}),
            step("left", {"x": "a"}, {"out": "b"}),
            step("right", {"x": "a"}, {"out": "c"}),
        ]
    )
)


def test_independent_steps_share_a_wave_and_dependents_follow() -> None:
    steps = plan(DIAMOND)
    waves = order(steps, {"a"})
    assert [[s.model for s in wave] for wave in waves] == [["left", "right"], ["last"]]


@pytest.mark.parametrize(
    ("steps", "message"),
    [
        (step("m", {"x": "nowhere"}, {"out": "z"}), "reads tensor 'nowhere'"),
        (step("m", {"x": "a"}, {"out": "other"}), "no step writes the ensemble output 'z'"),
        (
            ",".join([step("m", {"x": "a"}, {"out": "z"}), step("n", {"x": "a"}, {"o": "z"})]),
            "tensor 'z' is written twice",
        ),
        (
            ",".join([step("m", {"x": "b"}, {"out": "z"}), step("n", {"x": "z"}, {"o": "b"})]),
            "cycle",
        ),
        (step("e", {"x": "a"}, {"out": "z"}), "ensemble step cycle: e -> e"),
    ],
)
def test_broken_graphs_are_refused(steps: str, message: str) -> None:
    with pytest.raises(EnsembleError, match=message):
        plan(ensemble(steps))


def test_a_step_model_must_have_the_mapped_names_and_types() -> None:
    model = text_format.Parse(
        """name: "last" max_batch_size: 4
        input [ { name: "x" data_type: TYPE_FP32 dims: [ 1 ] },
                { name: "y" data_type: TYPE_FP32 dims: [ 1 ] } ]
        output [ { name: "out" data_type: TYPE_INT64 dims: [ 1 ] } ]""",
        mc.ModelConfig(),
    )
    last = plan(DIAMOND)[0]
    assert "output 'out' is TYPE_INT64, the ensemble's tensor 'z' TYPE_FP32" in (
        check_step(last, DIAMOND, model) or ""
    )
    model.output[0].data_type = mc.TYPE_FP32
    assert check_step(last, DIAMOND, model) is None
    model.input.add(name="w", data_type=mc.TYPE_FP32, dims=[1])
    assert "leaves the model's input(s) ['w'] unset" in (check_step(last, DIAMOND, model) or "")


async def test_run_passes_tensors_between_steps_and_starts_independent_ones_together() -> None:
    started: list[str] = []
    both_started = asyncio.Event()

    async def run_step(
        s: Step, inputs: tuple[InputTensor, ...], outputs: tuple[str, ...]
    ) -> tuple[OutputTensor, ...]:
        started.append(s.model)
        if s.model in ("left", "right"):
            if {"left", "right"} <= set(started):
                both_started.set()
            await both_started.wait()  # neither finishes before the other started
        total = sum(tensor.data[0] for tensor in inputs)
        data = bytes([total + len(s.model)]) + bytes(3)
        return (OutputTensor("out", BY_NAME["FP32"], (1, 1), data),)

    job = InferJob((InputTensor("a", BY_NAME["FP32"], (1, 1), bytes([1, 0, 0, 0])),), ("z",), 1)
    (z,) = await run("e", plan(DIAMOND), job, run_step)
    # left: 1 + 4, right: 1 + 5, last: 5 + 6 + 4
    assert (z.name, z.shape, z.data[0]) == ("z", (1, 1), 15)
    assert started[2] == "last"


NAMES = "abcdef"  # ensembles; "m" below is a model that runs
GRAPHS = st.dictionaries(
    st.sampled_from(NAMES),
    st.sets(st.sampled_from(NAMES + "m"), max_size=3),
    max_size=len(NAMES),
)


def reachable(start: str, steps: dict[str, set[str]]) -> set[str]:
    """What `start`'s steps lead to, one or more steps on (a fixed point, unlike the search
    under test)."""
    seen = set(steps.get(start, ()))
    while True:
        more = seen | {t for node in seen for t in steps.get(node, ())}
        if more == seen:
            return seen
        seen = more


@settings(max_examples=300, deadline=None, derandomize=True, database=None)
@given(GRAPHS)
def test_a_cycle_is_found_through_an_ensemble_iff_it_reaches_itself(
    steps: dict[str, set[str]],
) -> None:
    for name in NAMES:
        cycle = step_cycle(name, steps)
        assert (cycle is not None) == (name in reachable(name, steps))
        if cycle is not None:  # a real path of steps, each ensemble on it once
            assert cycle[0] == cycle[-1] == name
            assert all(b in steps[a] for a, b in itertools.pairwise(cycle))
            assert len(set(cycle)) == len(cycle) - 1


@settings(max_examples=300, deadline=None, derandomize=True, database=None)
@given(GRAPHS)
def test_some_ensemble_is_on_a_cycle_iff_the_graph_has_one(steps: dict[str, set[str]]) -> None:
    """Against the standard library's topological sort, which refuses any cycle."""
    try:
        graphlib.TopologicalSorter(steps).prepare()
        cyclic = False
    except graphlib.CycleError:
        cyclic = True
    assert cyclic == any(step_cycle(name, steps) for name in steps)


def test_the_shortest_cycle_is_named() -> None:
    steps = {"a": {"b", "m"}, "b": {"c", "a"}, "c": {"a"}}
    assert step_cycle("a", steps) == ("a", "b", "a")
    assert step_cycle("c", steps) == ("c", "a", "b", "c")
    assert step_cycle("a", {"a": {"m"}, "b": {"a"}}) is None  # b reaches a, not a itself


def passthrough_config(name: str, step_model: str) -> str:
    """An ensemble of one step on `step_model` (x -> y)."""
    return f"""name: "{name}" platform: "ensemble" max_batch_size: 4
        input [ {{ name: "x" data_type: TYPE_FP32 dims: [ 1 ] }} ]
        output [ {{ name: "y" data_type: TYPE_FP32 dims: [ 1 ] }} ]
        ensemble_scheduling {{ step [ {step(step_model, {"x": "x"}, {"y": "y"})} ] }}"""


def passthrough(name: str, step_model: str) -> ServedVersion:
    """A READY ensemble of one step on `step_model` (x -> y), as the lifecycle leaves it."""
    config = text_format.Parse(passthrough_config(name, step_model), mc.ModelConfig())
    served = ServedVersion(name, 1, config, state=VersionState.READY)
    served.steps = plan(config)
    served.validator = RequestValidator(config)
    return served


def cyclic_registry() -> ModelRegistry:
    """a -> b -> a, both READY: a cycle the check after loading has not refused yet."""
    registry = ModelRegistry(lambda: None)
    for name, other in (("a", "b"), ("b", "a")):
        served = passthrough(name, other)
        served.steps_ready = functools.partial(registry.ensemble_ready, served)
        registry.publish(name, {1: served})
    return registry


def test_a_step_cycle_is_not_ready_and_asking_ends() -> None:
    registry = cyclic_registry()
    assert not registry.resolve("a", "").ready
    assert not registry.all_ready


async def test_a_request_into_a_step_cycle_ends_at_the_depth_limit() -> None:
    registry = cyclic_registry()
    metrics = Metrics(registry, cpu_only_topology())
    observer = Observer(metrics, RequestLog(1e9, 0.0, None, LineBudget(10, 1.0)), None)
    x = InputTensor("x", BY_NAME["FP32"], (1, 1), bytes(4))
    with pytest.raises(ServiceError) as refused:
        await RequestRunner(registry, observer).infer(
            registry.resolve("a", ""), InferJob((x,), ("y",), 1), None
        )
    assert refused.value.code is grpc.StatusCode.FAILED_PRECONDITION
    message = refused.value.message
    assert message.startswith("ensemble 'a' step 1 (model 'b') failed: ensemble 'b' step 1")
    assert message.count("failed: ") == MAX_ENSEMBLE_DEPTH
    assert f"runs inside {MAX_ENSEMBLE_DEPTH} ensembles" in message


async def test_a_reload_that_closes_a_step_cycle_fails_the_ensembles_on_it(tmp_path: Path) -> None:
    """b names a, a names a model not loaded; a reloaded to name b closes a -> b -> a."""
    for name, other in (("a", "m"), ("b", "a")):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.pbtxt").write_text(passthrough_config(name, other))
    registry = ModelRegistry(lambda: None)
    lifecycle, metrics = lifecycle_over(registry, tmp_path)
    await lifecycle.load_all()
    assert [(m.name, m.state) for m in registry.index()] == [("a", "READY"), ("b", "READY")]
    assert not registry.resolve("b", "").ready  # m is not there

    (tmp_path / "a" / "config.pbtxt").write_text(passthrough_config("a", "b"))
    await lifecycle.load_model("a")
    assert [(m.name, m.state, m.reason) for m in registry.index()] == [
        ("a", "UNAVAILABLE", "ensemble step cycle: a -> b -> a"),
        ("b", "UNAVAILABLE", "ensemble step cycle: b -> a -> b"),
    ]
    assert [failures_counted(metrics, name) for name in "ab"] == [{"ensemble": 1.0}] * 2
