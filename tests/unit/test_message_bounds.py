"""The largest message a worker may send (service/workers/message_bounds.py): never less than
a legitimate message of what the worker holds (encoded as the worker encodes it), never more
than the most of those, and a header declaring more is refused before its body is read."""

from __future__ import annotations

import struct

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from service.backend.response_flow import Reply
from service.inference.jobs import Timings
from service.workers import protocol
from service.workers.decoupled_loop import encoded
from service.workers.message_bounds import (
    DESCRIPTOR_MAX,
    Holding,
    bls_inline_bytes,
    largest_message,
    result_inline_bytes,
)

KiB = 1 << 10
GiB = 1 << 30
sizes = st.integers(min_value=1, max_value=4 * GiB)
batches = st.lists(st.integers(min_value=1, max_value=1024), max_size=4).map(tuple)
holdings = st.builds(Holding, st.booleans(), st.booleans(), st.booleans(), batches)


def body(message: protocol.Message) -> int:
    return len(protocol.encode(message)) - protocol.header_size()


def refs(names: list[str], nbytes: int) -> tuple[protocol.TensorRef, ...]:
    return tuple(protocol.TensorRef(n, "<f4", (1, nbytes // 4), 0, nbytes) for n in names)


@given(holdings, sizes)
def test_the_bound_is_at_most_the_largest_legitimate_message(
    holding: Holding, max_message: int
) -> None:
    largest = largest_message(holding, max_message)
    assert DESCRIPTOR_MAX <= largest <= protocol.MAX_MESSAGE
    legitimate = [0]
    if holding.loaded and holding.decoupled:
        legitimate.append(max_message)
    if holding.loaded and holding.batches:
        legitimate.append(result_inline_bytes(max(holding.batches), max_message))
        if holding.bls:
            legitimate.append(bls_inline_bytes(max_message))
    assert largest == min(DESCRIPTOR_MAX + max(legitimate), protocol.MAX_MESSAGE)


@given(st.booleans(), st.booleans(), batches, sizes)
def test_a_worker_loading_or_idle_may_send_descriptors_only(
    decoupled: bool, bls: bool, held: tuple[int, ...], max_message: int
) -> None:
    assert largest_message(Holding(False, decoupled, bls, held), max_message) == DESCRIPTOR_MAX
    assert largest_message(Holding(True, False, bls, ()), max_message) == DESCRIPTOR_MAX


@given(st.integers(1, 1024), sizes)
def test_a_batch_may_get_what_its_callers_may_receive(requests: int, max_message: int) -> None:
    inline = result_inline_bytes(requests, max_message)
    assert inline == min(requests * max_message, protocol.MAX_MESSAGE - DESCRIPTOR_MAX)
    assert bls_inline_bytes(max_message) == min(protocol.BLS_MAX_BYTES, max_message)


@settings(deadline=None)  # megabytes encoded per example: slow on a loaded machine
@given(
    st.integers(1, 8),
    st.integers(4, 256 * KiB),
    st.lists(st.text(min_size=1, max_size=64), min_size=1, max_size=32, unique=True),
    st.text(max_size=2000),
)
def test_every_legitimate_message_fits_its_bound(
    requests: int, max_message: int, names: list[str], error: str
) -> None:
    """Encoded as the worker encodes them, at the most tensor bytes each may carry (the
    largest outputs a worker inlines, a BLS call's inputs, a decoupled response)."""
    inline = result_inline_bytes(requests, max_message)
    per_output = inline // len(names)
    result = protocol.Result(
        1, Timings(1, 2, 3), refs(names, per_output), {n: bytes(per_output) for n in names}
    )
    assert body(result) <= largest_message(Holding(True, False, False, (requests,)), max_message)
    data = bytes(bls_inline_bytes(max_message))
    call = protocol.BlsCall(1, 1, "m" * 256, "1", refs(names, len(data)), data, tuple(names), 1)
    assert body(call) <= largest_message(Holding(True, False, True, (1,)), max_message)
    data = bytes(max_message)
    response = protocol.Response(1, refs(names, len(data)), data, True, error)
    assert body(response) <= largest_message(Holding(True, True, False, ()), max_message)
    failed = protocol.Failed(1, error)
    assert body(failed) <= largest_message(Holding(True, False, False, ()), max_message)


@given(st.integers(0, (1 << 32) - 1), st.integers(0, protocol.MAX_MESSAGE))
def test_a_header_declaring_more_than_the_bound_is_refused(size: int, limit: int) -> None:
    header = struct.pack("<I", size)
    if size <= limit:
        assert protocol.body_size(header, limit) == size
        return
    with pytest.raises(protocol.Oversized) as refused:
        protocol.body_size(header, limit)
    assert (refused.value.size, refused.value.limit) == (size, limit)
    assert f"a message of {size} bytes, more than the {limit}" in str(refused.value)


@given(st.integers(1, 64 * KiB), st.integers(0, 128 * KiB), st.booleans())
def test_a_decoupled_response_over_the_limit_becomes_its_error(
    max_message: int, nbytes: int, final: bool
) -> None:
    """The worker never sends a response its caller could not receive: the front-end would
    kill it for the message."""
    message = encoded(Reply(7, {"out": np.zeros(nbytes, np.uint8)}, final), max_message)
    assert len(message) - protocol.header_size() <= largest_message(
        Holding(True, True, False), max_message
    )
    response = protocol.decode(message[protocol.header_size() :])
    assert isinstance(response, protocol.Response)
    assert (response.request_id, response.final) == (7, final)
    if nbytes <= max_message:
        assert response.error is None and len(response.data) == nbytes
        return
    assert (response.outputs, response.data) == ((), b"")
    assert response.error == (
        f"the model's response holds {nbytes} bytes of outputs, more than the {max_message} a "
        "caller may receive (--max-message-bytes)"
    )


def test_a_descriptor_may_take_64_kib() -> None:
    """docs/security.md's bound for a message without tensor bytes."""
    assert 64 * KiB == DESCRIPTOR_MAX
