"""Compressed request messages (gRPC's gzip and deflate): inflated exactly, and never past the
message limit, whatever the compressed size."""

from __future__ import annotations

import gzip
import tracemalloc
import zlib
from collections.abc import Callable

import grpc
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from transport.grpc.errors import ProtocolError
from transport.grpc.framing import INFLATE_CHUNK, MessageDecoder, encode_message
from transport.grpc.headers import parse_request_headers
from transport.h3.stream_state import StreamState

FUZZ = settings(derandomize=True, max_examples=60, deadline=None)
LIMIT = 3 * INFLATE_CHUNK + 17  # not a multiple of the chunk: the boundary is swept inside one
COMPRESS: dict[str, Callable[[bytes], bytes]] = {"gzip": gzip.compress, "deflate": zlib.compress}


def decode(wire: bytes, encoding: str, limit: int, piece: int) -> list[bytes]:
    decoder = MessageDecoder(limit, encoding)
    messages = [m for i in range(0, len(wire), piece) for m in decoder.feed(wire[i : i + piece])]
    decoder.finish()
    return messages


@FUZZ
@given(
    encoding=st.sampled_from(sorted(COMPRESS)),
    size=st.integers(LIMIT - 2 * INFLATE_CHUNK, LIMIT + 2 * INFLATE_CHUNK),
    seed=st.binary(min_size=1, max_size=64),
    piece=st.integers(1, 1 << 16),
)
def test_a_compressed_message_inflates_exactly_up_to_the_limit_and_is_refused_past_it(
    encoding: str, size: int, seed: bytes, piece: int
) -> None:
    payload = (seed * (size // len(seed) + 1))[:size]
    wire = encode_message(COMPRESS[encoding](payload), compressed=True)
    if size <= LIMIT:
        assert decode(wire, encoding, LIMIT, piece) == [payload]
    else:
        with pytest.raises(ProtocolError) as refused:
            decode(wire, encoding, LIMIT, piece)
        assert refused.value.status is grpc.StatusCode.RESOURCE_EXHAUSTED
        assert f"limit of {LIMIT} bytes" in refused.value.message


def test_a_decompression_bomb_is_refused_without_being_inflated() -> None:
    """64 MiB of zeros in some 64 KiB of gzip, against a 32 MiB limit: the memory allocated
    while refusing it is a few copies of the input and inflate chunks, not 32 MiB."""
    compressor = zlib.compressobj(9, zlib.DEFLATED, 16 + zlib.MAX_WBITS)
    zeros = bytes(1 << 20)
    bomb = b"".join(compressor.compress(zeros) for _ in range(64)) + compressor.flush()
    assert len(bomb) < 128 << 10
    wire = encode_message(bomb, compressed=True)
    tracemalloc.start()
    try:
        with pytest.raises(ProtocolError) as refused:
            MessageDecoder(32 << 20, "gzip").feed(wire)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert refused.value.status is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert peak < 1 << 20


@pytest.mark.parametrize("encoding", sorted(COMPRESS))
def test_broken_compressed_data_is_internal(encoding: str) -> None:
    good = COMPRESS[encoding](b"hello" * 100)
    for broken in (b"not compressed at all", good[:-6], good + b"junk"):
        with pytest.raises(ProtocolError) as refused:
            MessageDecoder(1 << 20, encoding).feed(encode_message(broken, compressed=True))
        assert refused.value.status is grpc.StatusCode.INTERNAL
        assert f"invalid {encoding} message" in refused.value.message


def test_an_uncompressed_message_of_a_compressing_call_is_taken_as_it_is() -> None:
    """grpc-encoding names what a message uses only when its flag is 1 (gRPC allows a sender
    to leave any message uncompressed)."""
    assert MessageDecoder(1 << 20, "gzip").feed(encode_message(b"plain")) == [b"plain"]


def request_block(encoding: bytes) -> list[tuple[bytes, bytes]]:
    return [
        (b":method", b"POST"),
        (b":scheme", b"https"),
        (b":authority", b"h"),
        (b":path", b"/a/b"),
        (b"content-type", b"application/grpc"),
        (b"grpc-encoding", encoding),
    ]


def test_a_stream_decodes_in_the_encoding_its_headers_name_and_holds_the_wire_size() -> None:
    """Receive credit follows the bytes the peer sent, not what they inflate to."""
    state = StreamState(max_message=1 << 20)
    state.headers_received(request_block(b"GZIP"), ended=False)
    wire = encode_message(gzip.compress(bytes(500_000)), compressed=True)
    assert state.data_received(wire, ended=False)
    assert state.held == len(wire)
    assert state.take_message() == bytes(500_000)
    assert state.held == 0


@pytest.mark.parametrize("encoding", [b"identity", b"gzip", b"Deflate "])
def test_accepted_encodings_are_accepted(encoding: bytes) -> None:
    assert parse_request_headers(request_block(encoding)).method_path == "/a/b"


def test_another_encoding_is_unimplemented_naming_the_accepted_ones() -> None:
    with pytest.raises(ProtocolError) as refused:
        parse_request_headers(request_block(b"snappy"))
    assert refused.value.status is grpc.StatusCode.UNIMPLEMENTED
    assert "accepted: identity,deflate,gzip" in refused.value.message
