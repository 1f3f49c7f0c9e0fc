"""The REST body budget (service/http/body_budget.py): what a JSON body is charged covers what
parsing it holds, and a request's body is charged as it is read (bounds.read_body, decoded),
waiting for room only before it holds any."""

from __future__ import annotations

import asyncio
import gzip
import tracemalloc
from collections.abc import Iterator
from typing import Any

import orjson
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from service.http.asgi import Message
from service.http.body_budget import (
    BINARY_HOLD_FACTOR,
    JSON_HOLD_FACTOR,
    BodyBudget,
    BodyCharge,
    held_for,
)
from service.http.bounds import (
    HEADER_LENGTH,
    SEND_PIECE,
    Refused,
    RequestLimits,
    answer_held,
    decoded,
    hold_answer,
    read_body,
)

# What parsing a document holds beyond its share per byte, whatever its size: orjson's smallest
# pool (4 KiB, measured for a one-byte document) and a little more.
PARSE_FIXED_BYTES = 8 << 10
MiB = 1 << 20

_SCALARS = (
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**63 - 1)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=8)
)
_DOCUMENTS = st.recursive(
    _SCALARS,
    lambda children: (
        st.lists(children, max_size=6) | st.dictionaries(st.text(max_size=6), children, max_size=6)
    ),
    max_leaves=24,
)


def parse_peak(body: bytes) -> int:
    """The most parsing `body` held at once (Python's allocator, which orjson allocates with)."""
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        document = orjson.loads(body)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    del document
    return peak


@settings(max_examples=60, deadline=None)
@given(element=_DOCUMENTS, copies=st.integers(1, 20_000))
@example(element=[], copies=20_000)
@example(element={}, copies=20_000)
@example(element={"a": 1}, copies=20_000)
@example(element=[[]], copies=20_000)
@example(element="", copies=20_000)
@example(element=0.5, copies=20_000)
@example(element="x" * 100_000, copies=1)
def test_a_json_body_is_charged_more_than_its_parse_holds(element: Any, copies: int) -> None:
    """Its bytes, their copy once whole, and the parse's peak, for documents dense in what
    costs most per byte (empty lists and objects, one-key objects, short strings, numbers):
    measured 17 to 40 times the bytes (lists of one empty list the most), against the 48
    charged."""
    body = orjson.dumps([element] * copies)
    held = 2 * len(body) + parse_peak(body)
    assert held <= JSON_HOLD_FACTOR * len(body) + PARSE_FIXED_BYTES


def test_what_a_body_is_charged() -> None:
    assert held_for(100, None) == JSON_HOLD_FACTOR * 100
    assert held_for(100, 10) == JSON_HOLD_FACTOR * 10 + BINARY_HOLD_FACTOR * 90
    assert held_for(5, 10) == JSON_HOLD_FACTOR * 5
    assert held_for(100, 0) == BINARY_HOLD_FACTOR * 100


def limits(timeout_s: float = 5.0) -> RequestLimits:
    return RequestLimits(
        max_header_bytes=16 << 10,
        max_body_bytes=8 * MiB,
        body_timeout_s=timeout_s,
        max_requests=64,
        stall_s=5.0,
        receive_budget=32 * MiB,
        receive_budget_per_address=16 * MiB,
    )


def scope(length: int | None, *headers: tuple[bytes, bytes]) -> dict[str, Any]:
    sent = [(b"content-length", str(length).encode())] if length is not None else []
    return {"headers": sent + list(headers)}


class Body:
    """A request's body as the ASGI server hands it over: `chunks`, then the end; what the
    route has taken is counted, so a test sees whether a body was read before it was charged."""

    def __init__(self, chunks: list[bytes]) -> None:
        self._chunks: Iterator[bytes] = iter(chunks)
        self._left = len(chunks)
        self.taken = 0

    async def __call__(self) -> Message:
        chunk = next(self._chunks)
        self._left -= 1
        self.taken += 1
        return {"type": "http.request", "body": chunk, "more_body": self._left > 0}


BINARY = (HEADER_LENGTH, b"16")


async def test_a_declared_body_is_charged_whole_before_it_is_read() -> None:
    budget = BodyBudget(32 * MiB, 16 * MiB)
    charge = budget.charge("10.0.0.1")
    body = Body([b"x" * MiB] * 4)
    assert await read_body(scope(4 * MiB, BINARY), body, limits(), charge, binary=True)
    assert charge.held == held_for(4 * MiB, 16)
    charge.release()
    assert budget.shared.budget.reserved_total == 0


async def test_a_declared_body_waits_for_room_then_is_read() -> None:
    """Two bodies of 6 MiB (12 MiB held each, as binary data) from one address: the second
    waits, unread, until the first request ends, then is read whole."""
    budget = BodyBudget(32 * MiB, 16 * MiB)
    first, second = budget.charge("10.0.0.1"), budget.charge("10.0.0.1")
    await read_body(scope(6 * MiB, BINARY), Body([b"x" * 6 * MiB]), limits(), first, binary=True)
    waiting = Body([b"y" * 6 * MiB])
    reading = asyncio.create_task(
        read_body(scope(6 * MiB, BINARY), waiting, limits(), second, binary=True)
    )
    await asyncio.sleep(0.05)
    assert not reading.done() and waiting.taken == 0
    # Another address has room of its own (the total's other half).
    other = budget.charge("10.0.0.2")
    await read_body(scope(6 * MiB, BINARY), Body([b"z" * 6 * MiB]), limits(), other, binary=True)
    first.release()
    assert len(await reading) == 6 * MiB


async def test_a_body_that_finds_no_room_in_time_is_refused_429() -> None:
    budget = BodyBudget(32 * MiB, 16 * MiB)
    holder = budget.charge("10.0.0.1")
    assert holder.take(10 * MiB)
    with pytest.raises(Refused) as refused:
        await read_body(
            scope(4 * MiB, BINARY), Body([b"x"]), limits(0.2), budget.charge("10.0.0.1"), True
        )
    assert refused.value.status == 429 and refused.value.close
    assert "--http-receive-budget-per-address 16777216" in refused.value.message
    assert budget.shared.budget.reserved_total == 10 * MiB  # the refused one holds nothing


async def test_a_json_body_that_could_never_fit_is_refused_413_unread() -> None:
    """A JSON body of 1 MiB would hold 48 MiB while parsed, more than an address's 16: refused
    at once, naming the binary extension; the same bytes as binary data are read."""
    budget = BodyBudget(32 * MiB, 16 * MiB)
    body = Body([b"[" + b"0," * (MiB // 2 - 1) + b"0]"])
    with pytest.raises(Refused) as refused:
        await read_body(scope(MiB), body, limits(), budget.charge("10.0.0.1"))
    assert refused.value.status == 413 and body.taken == 0
    assert "binary tensor data" in refused.value.message
    binary = Body([b"x" * MiB])
    await read_body(scope(MiB, BINARY), binary, limits(), budget.charge("10.0.0.1"), True)


async def test_a_chunked_body_is_refused_once_it_outgrows_the_room() -> None:
    """No length declared: charged as its chunks come (JSON, 40 times), refused 429 at the
    chunk that finds no room, never waiting while it holds part of the budget."""
    budget = BodyBudget(32 * MiB, 16 * MiB)
    holder = budget.charge("10.0.0.1")
    assert holder.take(12 * MiB)
    charge = budget.charge("10.0.0.1")
    body = Body([b" " * (64 << 10)] * 4)
    with pytest.raises(Refused) as refused:
        await read_body(scope(None), body, limits(), charge)
    assert refused.value.status == 429
    assert body.taken == 2  # 64 KiB of JSON holds 3 MiB: the second chunk passes the 4 left
    assert charge.held == held_for(64 << 10, None)


async def test_what_a_compressed_body_inflates_to_is_charged_before_it_is_built() -> None:
    budget = BodyBudget(32 * MiB, 16 * MiB)
    inflated = b"[" + b"0," * (256 << 10) + b"0]"  # 512 KiB of JSON: 24 MiB once parsed
    sent = gzip.compress(inflated)
    gzipped = scope(len(sent), (b"content-encoding", b"gzip"))
    charge = budget.charge("10.0.0.1")
    body = await read_body(gzipped, Body([sent]), limits(), charge, binary=True)
    assert charge.held == BINARY_HOLD_FACTOR * len(sent)
    with pytest.raises(Refused) as refused:
        await decoded(gzipped, body, 8 * MiB, charge)
    assert refused.value.status == 413
    small = b"[" + b"0," * (32 << 10) + b"0]"
    assert await decoded(gzipped, gzip.compress(small), 8 * MiB, charge) == small
    assert charge.held == BINARY_HOLD_FACTOR * len(sent) + held_for(len(small), None)


async def test_a_waiter_that_leaves_waits_no_more() -> None:
    """A request that goes away while it waits (its task cancelled) leaves no waiter behind."""
    budget = BodyBudget(32 * MiB, 16 * MiB)
    holder = budget.charge("10.0.0.1")
    assert holder.take(16 * MiB)
    waiter = asyncio.create_task(budget.charge("10.0.0.1").wait_for(MiB))
    await asyncio.sleep(0.01)
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert not budget.shared._waiting
    holder.release()
    assert budget.shared.budget.reserved_total == 0


def test_a_charge_released_twice_gives_back_once() -> None:
    budget = BodyBudget(32 * MiB, 16 * MiB)
    one, two = budget.charge("a"), budget.charge("a")
    assert one.take(MiB) and two.take(2 * MiB)
    one.release()
    one.release()
    assert budget.shared.budget.held("a") == 2 * MiB
    assert isinstance(one, BodyCharge)


@given(size=st.integers(0, 12 * MiB), others=st.integers(0, 16 * MiB))
@example(size=16 * MiB - 2 * SEND_PIECE, others=0)
@example(size=16 * MiB - 2 * SEND_PIECE + 1, others=0)
def test_an_answer_holds_the_budget_until_sent_or_is_refused(size: int, others: int) -> None:
    """An answer is charged its bytes and two pieces' copies (answer_held): granted when the
    address has room, 429 when it has not now, 400 naming binary outputs when it never could;
    a refused one holds nothing."""
    budget = BodyBudget(32 * MiB, 16 * MiB)
    if others:
        assert budget.charge("10.0.0.1").take(others)
    charge = budget.charge("10.0.0.1")
    held = answer_held(size)
    if held + others <= 16 * MiB:
        hold_answer(charge, size)
        assert charge.held == held
        return
    with pytest.raises(Refused) as refused:
        hold_answer(charge, size)
    if held > 16 * MiB:
        assert refused.value.status == 400 and "binary_data_output" in refused.value.message
    else:
        assert refused.value.status == 429 and "have not read" in refused.value.message
    assert charge.held == 0
