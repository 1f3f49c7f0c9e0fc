"""Versions winding down at the server's stop (`Retiring.finish`): the server's grace for its
calls is over by then, so a replaced version that still counts something is stopped at once,
not waited for until its wind-down timeout (60 s, past any supervisor's patience: a test's
harness killed such a server after 30 s)."""

from __future__ import annotations

import asyncio

import pytest

from protos.inference import model_config_pb2 as mc
from service.lifecycle.retiring import RETIRE_TIMEOUT_S, Retiring
from service.registry.versions import ServedVersion, VersionState
from tests.virtual_time import VirtualTimePolicy


@pytest.fixture(scope="module")
def event_loop_policy() -> asyncio.AbstractEventLoopPolicy:
    return VirtualTimePolicy()


def still_busy() -> ServedVersion:
    served = ServedVersion("mlp", 1, mc.ModelConfig(name="mlp"))
    served.state = VersionState.READY
    served.active = 1  # a request it never answers
    return served


async def test_a_retirement_waits_for_what_its_version_holds_until_its_timeout() -> None:
    loop = asyncio.get_running_loop()
    served, started = still_busy(), loop.time()
    await Retiring().retire(served, "replaced")
    assert loop.time() - started >= RETIRE_TIMEOUT_S
    assert (served.state, served.reason) == (VersionState.UNAVAILABLE, "replaced")


async def test_the_servers_stop_ends_every_retirement_at_once() -> None:
    loop = asyncio.get_running_loop()
    retiring, served = Retiring(), still_busy()
    ended: list[str] = []
    retiring.retire_soon([served], "replaced", lambda: ended.append("then"))
    await asyncio.sleep(1.0)
    assert served.state is VersionState.UNLOADING and not ended
    stopping = loop.time()
    await retiring.finish()
    assert loop.time() - stopping < 1.0
    assert (served.state, ended) == (VersionState.UNAVAILABLE, ["then"])
