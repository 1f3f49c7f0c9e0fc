"""Lifecycle.fail, the one way a version fails: UNAVAILABLE with the reason for every caller,
counted at its stage (or not), its verified copy gone, the change signalled."""

from __future__ import annotations

import shutil
from pathlib import Path

import grpc
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from protos.inference import model_config_pb2 as mc
from service.inference.errors import ServiceError
from service.lifecycle.lifecycle import Lifecycle, LifecycleOptions
from service.lifecycle.repository import ModelRepository, RepositoryError
from service.observability.logs import LineBudget, RequestLog
from service.observability.metrics import Metrics
from service.observability.observer import Observer
from service.placement.topology import cpu_only_topology
from service.registry.versions import ModelRegistry, ServedVersion, VersionState
from service.serving.requests import RequestRunner
from tests.servers import EXAMPLE_MODELS

OPTIONS = LifecycleOptions(
    model_control_mode="explicit", poll_repository=0.0, load_model="", testing_service=False
)


def failures_counted(metrics: Metrics, model: str) -> dict[str, float]:
    """paddlequic_model_load_failures_total by reason, for `model`."""
    return {
        s.labels["reason"]: s.value
        for family in metrics.registry.collect()
        for s in family.samples
        if s.name == "paddlequic_model_load_failures_total" and s.labels["model"] == model
    }


def lifecycle_over(registry: ModelRegistry, root: Path) -> tuple[Lifecycle, Metrics]:
    """A Lifecycle on the repository at `root`, CPU only, and the metrics it counts into."""
    topology = cpu_only_topology()
    metrics = Metrics(registry, topology)
    observer = Observer(metrics, RequestLog(1e9, 0.0, None, LineBudget(10, 1.0)), None)
    lifecycle = Lifecycle(
        registry,
        RequestRunner(registry, observer),
        ModelRepository(root),
        topology,
        OPTIONS,
        observer,
    )
    return lifecycle, metrics


@pytest.mark.parametrize("stage", ["load", "placement", "signature", "fallback", None])
async def test_a_failed_version_is_refused_counted_and_its_copy_is_gone(
    tmp_path: Path, stage: str | None
) -> None:
    changes: list[None] = []
    registry = ModelRegistry(lambda: changes.append(None))
    lifecycle, metrics = lifecycle_over(registry, tmp_path)
    served = ServedVersion("m", 1, mc.ModelConfig(name="m"), state=VersionState.READY)
    served.copy = tmp_path / "verified-copy"
    served.copy.mkdir()
    (served.copy / "model.pdmodel").write_bytes(b"checked bytes")
    registry.publish("m", {1: served})
    assert registry.resolve("m", "1") is served
    published = len(changes)

    await lifecycle.fail(served, "loading failed: the worker exited", stage)

    assert (served.state, served.reason) == (
        VersionState.UNAVAILABLE,
        "loading failed: the worker exited",
    )
    with pytest.raises(ServiceError) as refused:
        registry.resolve("m", "1")
    assert refused.value.code is grpc.StatusCode.UNAVAILABLE
    assert "loading failed: the worker exited" in refused.value.message
    assert failures_counted(metrics, "m") == ({} if stage is None else {stage: 1.0})
    assert served.copy is None and not (tmp_path / "verified-copy").exists()
    assert len(changes) == published + 1


@settings(max_examples=25, deadline=None, derandomize=True, database=None)
@given(st.text(max_size=12).filter(lambda m: m not in ("none", "poll", "explicit")))
def test_an_unknown_model_control_mode_is_refused(mode: str) -> None:
    with pytest.raises(RepositoryError, match="must be none, poll or explicit"):
        LifecycleOptions(
            model_control_mode=mode, poll_repository=0.0, load_model="", testing_service=False
        )


async def test_a_reload_that_cannot_be_placed_is_counted_as_a_placement_failure(
    tmp_path: Path,
) -> None:
    """As the first load's placement failures are: an operator alerting on the counter sees a
    reload that asks for devices the host lacks."""
    model = tmp_path / "mlp"
    shutil.copytree(EXAMPLE_MODELS / "mlp", model)
    config = model / "config.pbtxt"
    config.write_text(config.read_text().replace("KIND_CPU", "KIND_GPU"))
    lifecycle, metrics = lifecycle_over(ModelRegistry(lambda: None), tmp_path)
    with pytest.raises(ServiceError, match="GPU"):
        await lifecycle.load_model("mlp")
    assert failures_counted(metrics, "mlp") == {"placement": 1.0}
