"""The flag byte ahead of each response of a stream's part: every combination of a response
(or none) and its request's end comes back as it went, and what no parent sends is refused."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from protos.inference import grpc_service_pb2 as pb
from service.api import stream_parts


@given(
    request_id=st.text(max_size=64),
    error=st.text(max_size=64),
    last=st.booleans(),
    nothing=st.booleans(),
)
def test_a_part_message_decodes_to_what_was_encoded(
    request_id: str, error: str, last: bool, nothing: bool
) -> None:
    response = None
    if not nothing:
        response = pb.ModelStreamInferResponse(
            error_message=error, infer_response=pb.ModelInferResponse(id=request_id)
        )
    data, decoded_last = stream_parts.decode(stream_parts.encode((response, last)))
    assert decoded_last is last
    if response is None:
        assert data is None
    else:
        assert data is not None and pb.ModelStreamInferResponse.FromString(data) == response


@given(flags=st.integers(min_value=0, max_value=255), body=st.binary(max_size=8))
def test_flags_no_parent_sends_are_refused(flags: int, body: bytes) -> None:
    message = bytes((flags,)) + body
    known = flags & ~(stream_parts.LAST | stream_parts.NOTHING) == 0
    nothing_with_bytes = bool(flags & stream_parts.NOTHING) and bool(body)
    if known and not nothing_with_bytes:
        data, last = stream_parts.decode(message)
        assert last is bool(flags & stream_parts.LAST)
        assert data == (None if flags & stream_parts.NOTHING else body)
    else:
        with pytest.raises(stream_parts.BadPart):
            stream_parts.decode(message)


def test_an_empty_message_is_refused() -> None:
    with pytest.raises(stream_parts.BadPart):
        stream_parts.decode(b"")
