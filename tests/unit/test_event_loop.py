"""Which event loop the server runs on: uvloop where installed, asyncio's otherwise or when
asked, and a clear refusal when uvloop is asked for but missing."""

from __future__ import annotations

import asyncio
import sys

import pytest

from service.event_loop import EventLoopUnavailable, loop_factory


def test_asyncio_is_used_when_asked() -> None:
    assert loop_factory("asyncio") == ("asyncio", None)


def test_without_uvloop_auto_falls_back_and_uvloop_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "uvloop", None)  # as if not installed
    assert loop_factory("auto") == ("asyncio", None)
    with pytest.raises(EventLoopUnavailable, match="uvloop is not installed"):
        loop_factory("uvloop")


def test_auto_runs_on_uvloop_where_installed() -> None:
    uvloop = pytest.importorskip("uvloop")
    name, factory = loop_factory("auto")
    assert name == "uvloop" and factory is not None

    async def which() -> type[asyncio.AbstractEventLoop]:
        return type(asyncio.get_running_loop())

    with asyncio.Runner(loop_factory=factory) as runner:
        assert runner.run(which()) is uvloop.Loop
