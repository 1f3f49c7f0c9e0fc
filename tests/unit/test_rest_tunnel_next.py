"""The parent's side of a REST request passed on by a front-end (`rest_tunnel._Exchange`): a
wait for the app's next answer that is cancelled (the front-end's client left) leaves no task
behind (one waiting on the answers' queue was destroyed pending, logged as an error, in a
chaos run)."""

from __future__ import annotations

import asyncio

from service.frontends.rest_tunnel import _Exchange


def _waiting_gets() -> list[asyncio.Task[object]]:
    return [t for t in asyncio.all_tasks() if "Queue.get" in repr(t.get_coro())]


async def test_a_cancelled_wait_for_the_next_answer_leaves_no_task_behind() -> None:
    exchange = _Exchange(None)
    app = asyncio.get_running_loop().create_future()  # the app, still running
    waiting = asyncio.create_task(exchange.next(app))
    await asyncio.sleep(0)
    assert _waiting_gets()
    waiting.cancel()
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    assert _waiting_gets() == []
    app.cancel()


async def test_an_answer_is_passed_on_once() -> None:
    exchange = _Exchange(None)
    app = asyncio.get_running_loop().create_future()
    waiting = asyncio.create_task(exchange.next(app))
    await asyncio.sleep(0)
    await exchange.send({"type": "http.response.body", "body": b"x"})
    assert await waiting == b"x"
    app.set_result(None)
    assert await exchange.next(app) is None
