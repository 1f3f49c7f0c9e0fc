"""The breakers front-ends keep of the versions they serve, as the parent shows them
(`SharedQueues.breakers`): each version the worst of the parent's and every front-end's last
report; a report the parent cannot read changes nothing; a front-end that is gone, or whose
breaker closed (left out of its next report), counts no more."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from protos.inference import model_config_pb2 as mc
from service.frontends.queue_sharing import SharedQueues
from service.registry.versions import ServedVersion
from service.resilience.breaker import BreakerState

OPEN, HALF_OPEN, CLOSED = BreakerState.OPEN, BreakerState.HALF_OPEN, BreakerState.CLOSED


def sharing(*names: str) -> tuple[SharedQueues, dict[int, ServedVersion]]:
    versions = {
        token: ServedVersion(name, 1, mc.ModelConfig(name=name)) for token, name in enumerate(names)
    }
    queues = SharedQueues(lambda kind, payload: None)
    queues.view(versions)
    return queues, versions


def test_each_version_shows_the_worst_of_every_process() -> None:
    queues, versions = sharing("a", "b")
    queues.breakers("0", {"0": ["HALF_OPEN", 0.0]})
    queues.breakers("1", {"0": ["OPEN", 2.5], "1": ["HALF_OPEN", 0.0]})
    assert versions[0].shown_breaker() == (OPEN, 2.5)
    assert versions[1].shown_breaker() == (HALF_OPEN, 0.0)
    queues.breakers("1", {})  # its breakers closed
    assert versions[0].shown_breaker() == (HALF_OPEN, 0.0)
    assert versions[1].shown_breaker() == (CLOSED, 0.0)
    queues.lost("0")
    assert versions[0].shown_breaker() == (CLOSED, 0.0)


def test_the_parents_own_breaker_counts_too() -> None:
    queues, versions = sharing("a")
    versions[0].breaker.trip()
    queues.breakers("0", {"0": ["HALF_OPEN", 0.0]})
    assert versions[0].shown_breaker()[0] is OPEN


@pytest.mark.parametrize(
    "report",
    [
        [["0", "OPEN", 1.0]],
        {"0": ["AJAR", 1.0]},
        {"0": ["OPEN"]},
        {"0": ["OPEN", "soon"]},
        {"0": ["OPEN", float("nan")]},
        {"zero": ["OPEN", 1.0]},
    ],
)
def test_a_report_the_parent_cannot_read_changes_nothing(
    report: Any, caplog: pytest.LogCaptureFixture
) -> None:
    queues, versions = sharing("a")
    queues.breakers("0", {"0": ["HALF_OPEN", 0.0]})
    with caplog.at_level(logging.ERROR):
        queues.breakers("0", report)
    assert "cannot read" in caplog.text
    assert versions[0].shown_breaker() == (HALF_OPEN, 0.0)
