"""What front-ends hold of a version the parent winds down (`SharedQueues`): their reports
count until each one lets the version go (RELEASED) or is gone; after that nothing they once
reported is waited for. A report taken while calls ran, kept after the release, held a
replaced version's workers for the whole wind-down timeout (60 s), and the server's stop with
it."""

from __future__ import annotations

import json

import pytest

from protos.inference import model_config_pb2 as mc
from service.batching.batcher import policy_from_config
from service.frontends.queue_sharing import SharedQueues
from service.registry.versions import ServedVersion
from service.serving.queue_setup import queue_setup
from service.serving.queued_batcher import QueuedBatcher

TOKEN = 7


def queued_version() -> ServedVersion:
    config = mc.ModelConfig(name="mlp", max_batch_size=8)
    config.input.add(name="x", data_type=mc.TYPE_FP32, dims=[4])
    config.output.add(name="y", data_type=mc.TYPE_FP32, dims=[2])
    served = ServedVersion("mlp", 1, config)
    setup = queue_setup(config, policy_from_config(config, 1), {}, 4)
    served.batcher = QueuedBatcher(config, [], setup, lambda *_: None, "mlp", None)
    return served


def released(queues: SharedQueues, frontend: str) -> None:
    queues.released(frontend, json.dumps({"token": TOKEN}).encode())


@pytest.mark.parametrize("gone", [False, True], ids=["released", "lost"])
def test_a_version_every_front_end_let_go_waits_for_nothing_they_reported(gone: bool) -> None:
    served = queued_version()
    batcher = served.batcher
    assert isinstance(batcher, QueuedBatcher)
    queues = SharedQueues(lambda kind, payload: None)
    queues.view({TOKEN: served})
    for frontend in ("0", "1"):
        queues.connected(frontend)
    queues.held("0", {str(TOKEN): [2, 1, [3]]})
    queues.held("1", {str(TOKEN): [1, 0, [1]]})
    assert (batcher.queued, batcher.in_flight_requests) == (3, 1)
    queues.view({})  # replaced: it winds down once both front-ends let it go
    assert (batcher.queued, served.held_elsewhere) == (3, 2)  # each counts until it says so
    released(queues, "0")
    assert (batcher.queued, batcher.in_flight_requests, served.held_elsewhere) == (1, 0, 1)
    if gone:
        queues.lost("1")
    else:
        released(queues, "1")
    assert (batcher.queued, batcher.in_flight_requests, served.held_elsewhere) == (0, 0, 0)
