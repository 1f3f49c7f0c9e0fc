"""Whether a front-end takes a batchstream (rest_here.FrontendPlane): only when it serves every
generation model the parent serves, since no line of it can be passed on; and what a line's
model resolves to there."""

from __future__ import annotations

from typing import cast

import grpc
import pytest
from google.protobuf import text_format

from protos.inference import model_config_pb2 as mc
from service.dataplane.shared_memory import SharedMemory
from service.frontends.descriptors import ViewEntry
from service.frontends.model_view import ModelView
from service.frontends.rest_here import FrontendPlane
from service.frontends.shared_versions import SharedVersions
from service.inference import errors
from service.registry.versions import ServedVersion, VersionState
from service.serving.requests import RequestRunner
from tests.servers import EXAMPLE_MODELS

GENERATE = text_format.Parse(
    (EXAMPLE_MODELS / "generate" / "config.pbtxt").read_text(), mc.ModelConfig()
)
PLAIN = mc.ModelConfig(name="plain", max_batch_size=4)


class _Held:
    """The versions this process serves itself, by token (SharedVersions.serving)."""

    def __init__(self) -> None:
        self.versions: dict[int, ServedVersion] = {}

    def serving(self, token: int) -> ServedVersion | None:
        return self.versions.get(token)


def _plane(batchstreams: bool = True) -> tuple[FrontendPlane, ModelView, _Held]:
    view, held = ModelView(), _Held()
    plane = FrontendPlane(
        cast(RequestRunner, None),
        view,
        cast(SharedVersions, held),
        cast(SharedMemory, None),
        batchstreams,
    )
    return plane, view, held


def _show(view: ModelView, generation: tuple[str, ...], *configs: mc.ModelConfig) -> None:
    entries = [
        ViewEntry(c.name, version, token, c.SerializeToString())
        for token, c in enumerate(configs, 1)
        for version in ("", "1")
    ]
    view.update(entries, generation)


def _serve(held: _Held, token: int, config: mc.ModelConfig) -> ServedVersion:
    served = ServedVersion(config.name, 1, config, VersionState.READY)
    held.versions[token] = served
    return served


def _config(name: str) -> mc.ModelConfig:
    config = mc.ModelConfig()
    config.CopyFrom(GENERATE)
    config.name = name
    return config


async def test_a_batchstream_is_taken_only_where_every_generation_model_is_served() -> None:
    plane, view, held = _plane()
    first, second = _config("first"), _config("second")
    assert not plane.serves_batchstream()  # no generation model at all: the parent says so
    _show(view, ("first", "second"), first, second, PLAIN)
    _serve(held, 3, PLAIN)
    served = _serve(held, 1, first)
    assert not plane.serves_batchstream()  # "second" is the parent's alone
    with pytest.raises(errors.ServiceError) as refused:
        await plane.streamed_generation_model("second")
    assert refused.value.code is grpc.StatusCode.UNAVAILABLE
    _serve(held, 2, second)
    assert plane.serves_batchstream()
    assert plane.generation_names() == ("first", "second")
    assert await plane.streamed_generation_model("first") is served
    for name, words in (("plain", "GET /v1/models"), ("nothing", "'first', 'second'")):
        with pytest.raises(errors.ServiceError) as refused:
            await plane.streamed_generation_model(name)
        assert refused.value.code is grpc.StatusCode.NOT_FOUND
        assert f"model '{name}' is not a generation model" in refused.value.message
        assert words in refused.value.message


def test_under_a_memory_budget_every_batchstream_goes_to_the_parent() -> None:
    """A line may name a model the parent would load first: no front-end can."""
    plane, view, held = _plane(batchstreams=False)
    only = _config("only")
    _show(view, ("only",), only)
    _serve(held, 1, only)
    assert not plane.serves_batchstream()
