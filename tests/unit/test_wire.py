"""The gRPC-over-HTTP/3 wire layer: framing, timeouts, metadata, status and header blocks."""

from __future__ import annotations

import contextlib
import itertools
import math
import tracemalloc
from collections.abc import Callable, Sequence

import grpc
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from transport.grpc.errors import ProtocolError
from transport.grpc.framing import DEFAULT_MAX_MESSAGE, HEADER_SIZE, MessageDecoder, encode_message
from transport.grpc.headers import (
    RequestHead,
    ResponseHead,
    Status,
    error_response,
    is_trailers_only,
    parse_request_headers,
    parse_response_headers,
    parse_trailers,
    request_headers,
    response_headers,
    trailers,
    trailers_only,
)
from transport.grpc.metadata import Metadata, decode_metadata, encode_metadata
from transport.grpc.status import (
    H3_CONNECT_ERROR,
    H3_EXCESSIVE_LOAD,
    H3_INTERNAL_ERROR,
    H3_NO_ERROR,
    H3_REQUEST_CANCELLED,
    H3_REQUEST_INCOMPLETE,
    H3_REQUEST_REJECTED,
    H3_VERSION_FALLBACK,
    code_number,
    decode_grpc_message,
    encode_grpc_message,
    status_from_code,
    status_from_h3_error,
    status_from_http,
)
from transport.grpc.timeout import format_timeout, parse_timeout

Headers = list[tuple[bytes, bytes]]

# Deterministic and bounded: the whole module runs in a few seconds.
FUZZ = settings(derandomize=True, max_examples=300, deadline=None)

UNIT_SECONDS = {"n": 1e-9, "u": 1e-6, "m": 1e-3, "S": 1.0, "M": 60.0, "H": 3600.0}


def protocol_error(call: Callable[[], object]) -> ProtocolError:
    with pytest.raises(ProtocolError) as caught:
        call()
    return caught.value


# ---------------------------------------------------------------------------------- framing


def decode_all(chunks: Sequence[bytes], max_message: int = DEFAULT_MAX_MESSAGE) -> list[bytes]:
    decoder = MessageDecoder(max_message)
    messages = [message for chunk in chunks for message in decoder.feed(chunk)]
    decoder.finish()
    return messages


def test_encode_message_prefixes_flag_and_big_endian_length() -> None:
    assert encode_message(b"abc") == b"\x00\x00\x00\x00\x03abc"
    assert encode_message(b"") == b"\x00" * HEADER_SIZE


def test_decoder_returns_messages_completed_by_each_feed() -> None:
    decoder = MessageDecoder()
    wire = encode_message(b"one") + encode_message(b"") + encode_message(b"three")
    assert decoder.feed(wire[:4]) == []
    assert decoder.buffered == 4
    assert decoder.feed(wire[4:10]) == [b"one"]
    assert decoder.buffered == 2
    assert decoder.feed(wire[10:]) == [b"", b"three"]
    assert decoder.buffered == 0
    decoder.finish()


def test_decoder_counts_a_parsed_header_as_buffered() -> None:
    decoder = MessageDecoder()
    assert decoder.feed(encode_message(b"abcdef")[:7]) == []
    assert decoder.buffered == 7


def test_decoder_rejects_compressed_messages_without_an_accepted_encoding() -> None:
    for encoding in ("identity", "snappy"):
        decoder = MessageDecoder(encoding=encoding)
        error = protocol_error(lambda d=decoder: d.feed(b"\x01\x00\x00\x00\x00"))  # type: ignore[misc]
        assert error.status is grpc.StatusCode.UNIMPLEMENTED
        assert f"grpc-encoding {encoding!r}" in error.message
        assert "accepted: identity,deflate,gzip" in error.message
    assert error.http_status is None


def test_decoder_rejects_unknown_flags() -> None:
    error = protocol_error(lambda: MessageDecoder().feed(b"\x02\x00\x00\x00\x00"))
    assert error.status is grpc.StatusCode.INTERNAL


def test_decoder_rejects_oversized_message_from_its_header_alone() -> None:
    error = protocol_error(lambda: MessageDecoder(max_message=10).feed(b"\x00\x00\x00\x00\x0b"))
    assert error.status is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert error.message == "message of 11 bytes exceeds the limit of 10 bytes"
    assert decode_all([encode_message(b"x" * 10)], max_message=10) == [b"x" * 10]


@pytest.mark.parametrize("tail", [b"\x00\x00", encode_message(b"abc")[:-1]])
def test_finish_rejects_a_truncated_message(tail: bytes) -> None:
    decoder = MessageDecoder()
    decoder.feed(encode_message(b"ok") + tail)
    error = protocol_error(decoder.finish)
    assert error.status is grpc.StatusCode.INTERNAL


def test_large_message_in_small_chunks_is_copied_once() -> None:
    """Linear, not quadratic: the chunks are held as they came and joined once, when the
    message is complete. Counted in bytes allocated, not timed."""
    payload = bytes(range(256)) * (32 * 4096)  # 32 MiB
    wire = encode_message(payload)
    chunks = [wire[i : i + 1024] for i in range(0, len(wire), 1024)]
    decoder = MessageDecoder()
    tracemalloc.start()
    try:
        assert all(decoder.feed(chunk) == [] for chunk in chunks[:-1])
        held, _ = tracemalloc.get_traced_memory()
        (message,) = decoder.feed(chunks[-1])
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert message == payload
    assert held < len(payload) // 8  # references to the chunks, no copy of them
    assert peak < len(payload) * 3 // 2  # one copy, the message


def test_many_messages_in_one_chunk() -> None:
    messages = [bytes([i % 256]) * (i % 7) for i in range(5000)]
    assert decode_all([b"".join(map(encode_message, messages))]) == messages


@st.composite
def split(draw: st.DrawFn, data: bytes) -> list[bytes]:
    """`data` cut at arbitrary points (empty pieces included)."""
    cuts = sorted(draw(st.lists(st.integers(0, len(data)), max_size=8)))
    bounds = [0, *cuts, len(data)]
    return [data[a:b] for a, b in itertools.pairwise(bounds)]


def outcome(chunks: Sequence[bytes]) -> tuple[object, ...]:
    try:
        return ("ok", decode_all(chunks, max_message=64))
    except ProtocolError as error:
        return ("error", error.status, error.message)


# Mostly valid frames (some over the 64-byte limit used by `outcome`), sometimes junk.
frames_and_junk = st.lists(
    st.one_of(
        st.binary(max_size=30).map(encode_message),
        st.binary(min_size=60, max_size=70).map(encode_message),
        st.binary(max_size=30).map(lambda payload: b"\x01" + encode_message(payload)[1:]),
        st.binary(max_size=6),
    ),
    max_size=6,
).map(b"".join)


@FUZZ
@given(st.data(), frames_and_junk)
def test_decoder_result_does_not_depend_on_splitting(data: st.DataObject, wire: bytes) -> None:
    assert outcome(data.draw(split(wire))) == outcome([wire])


@FUZZ
@given(st.data(), st.lists(st.binary(max_size=300), max_size=8))
def test_decode_inverts_encode(data: st.DataObject, messages: list[bytes]) -> None:
    wire = b"".join(map(encode_message, messages))
    assert decode_all(data.draw(split(wire))) == messages


# ---------------------------------------------------------------------------------- timeout


@pytest.mark.parametrize(
    ("value", "seconds"),
    [
        ("1S", 1.0),
        ("100m", 0.1),
        ("5M", 300.0),
        ("2H", 7200.0),
        ("7u", 7e-6),
        ("9n", 9e-9),
        ("0n", 0.0),
        ("99999999S", 99999999.0),
    ],
)
def test_parse_timeout(value: str, seconds: float) -> None:
    assert parse_timeout(value) == seconds


@pytest.mark.parametrize(
    "value", ["", "S", "1", "123456789S", "1s", "1.5S", " 1S", "1S\n", "-1S", "\uff11S", "1SS"]
)
def test_parse_timeout_rejects_malformed_values(value: str) -> None:
    error = protocol_error(lambda: parse_timeout(value))
    assert error.status is grpc.StatusCode.INTERNAL
    assert repr(value) in error.message


@pytest.mark.parametrize(
    ("seconds", "value"),
    [
        (1.0, "1000000u"),
        (0.1, "100000u"),
        (0.3, "300000u"),
        (0.05, "50000000n"),
        (30.0, "30000000u"),
        (1e-10, "1n"),
        (0.0, "1n"),
        (-5.0, "1n"),
        (3e11, "83333334H"),
        (1e12, "99999999H"),
        (math.inf, "99999999H"),
    ],
)
def test_format_timeout(seconds: float, value: str) -> None:
    assert format_timeout(seconds) == value


def test_format_timeout_rejects_nan() -> None:
    with pytest.raises(ValueError, match="NaN"):
        format_timeout(math.nan)


@FUZZ
@given(st.floats(min_value=1e-12, max_value=3.5e11, allow_nan=False))
def test_timeout_round_trip_never_shortens(seconds: float) -> None:
    value = format_timeout(seconds)
    assert len(value) <= 9
    parsed = parse_timeout(value)
    assert parsed >= seconds
    assert parsed - seconds <= UNIT_SECONDS[value[-1]] * (1 + 1e-9)


# --------------------------------------------------------------------------------- metadata


def test_encode_metadata_lowercases_and_base64s_binary_values_without_padding() -> None:
    assert encode_metadata([("X-Key", "value"), ("trace-bin", b"\x00\xff"), ("t-bin", "a")]) == [
        (b"x-key", b"value"),
        (b"trace-bin", b"AP8"),
        (b"t-bin", b"YQ"),
    ]


def test_encode_metadata_allows_grpc_runtime_keys_and_user_agent() -> None:
    fields = encode_metadata(
        [("grpc-trace-bin", b"t"), ("grpc-status-details-bin", b"d"), ("user-agent", "me")]
    )
    assert [name for name, _ in fields] == [
        b"grpc-trace-bin",
        b"grpc-status-details-bin",
        b"user-agent",
    ]


@pytest.mark.parametrize(
    "key",
    [
        "",
        ":path",
        "bad key",
        "a/b",
        "caf\u00e9",
        "content-type",
        "te",
        "grpc-status",
        "grpc-timeout",
        "grpc-foo",
        "connection",
        "Content-Length",
    ],
)
def test_encode_metadata_rejects_invalid_or_reserved_keys(key: str) -> None:
    with pytest.raises(ValueError, match="metadata key"):
        encode_metadata([(key, "v")])


@pytest.mark.parametrize("value", ["a\nb", "caf\u00e9", "\x7f", b"\x00"])
def test_encode_metadata_rejects_non_printable_values(value: str | bytes) -> None:
    with pytest.raises(ValueError, match="printable ASCII"):
        encode_metadata([("key", value)])


def test_decode_metadata_skips_pseudo_and_transport_headers() -> None:
    headers = [
        (b":path", b"/a/b"),
        (b"content-type", b"application/grpc"),
        (b"te", b"trailers"),
        (b"grpc-timeout", b"1S"),
        (b"grpc-status", b"0"),
        (b"grpc-message", b"x"),
        (b"grpc-encoding", b"identity"),
        (b"grpc-accept-encoding", b"gzip"),
        (b"content-length", b"5"),
        (b"user-agent", b"grpc-python"),
        (b"x-key", b"value"),
    ]
    assert decode_metadata(headers) == (("user-agent", "grpc-python"), ("x-key", "value"))


def test_decode_metadata_accepts_padded_unpadded_and_comma_joined_binary_values() -> None:
    headers = [(b"a-bin", b"YQ"), (b"a-bin", b"YQ=="), (b"b-bin", b"YQ, YWI=,"), (b"c-bin", b"")]
    assert decode_metadata(headers) == (
        ("a-bin", b"a"),
        ("a-bin", b"a"),
        ("b-bin", b"a"),
        ("b-bin", b"ab"),
        ("b-bin", b""),
        ("c-bin", b""),
    )


@pytest.mark.parametrize("value", [b"Y", b"Y*Q=", b"YQ===", b"\xff"])
def test_decode_metadata_rejects_invalid_base64(value: bytes) -> None:
    error = protocol_error(lambda: decode_metadata([(b"k-bin", value)]))
    assert error.status is grpc.StatusCode.INTERNAL


def test_decode_metadata_drops_non_printable_values_and_rejects_bad_keys() -> None:
    assert decode_metadata([(b"k", b"caf\xc3\xa9"), (b"k", b"a\x00")]) == ()
    error = protocol_error(lambda: decode_metadata([(b"Bad Key", b"v")]))
    assert error.status is grpc.StatusCode.INTERNAL


key_body = st.from_regex(r"[0-9a-z_.\-]{0,12}", fullmatch=True)
ascii_entry = st.tuples(
    key_body.map("x-{}".format).filter(lambda key: not key.endswith("-bin")),
    st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=20),
)
binary_entry = st.tuples(key_body.map("x-{}-bin".format), st.binary(max_size=40))


@FUZZ
@given(st.lists(st.one_of(ascii_entry, binary_entry), max_size=6))
def test_metadata_round_trip(entries: list[tuple[str, str | bytes]]) -> None:
    assert decode_metadata(encode_metadata(entries)) == tuple(entries)


# ----------------------------------------------------------------------------------- status


@pytest.mark.parametrize(
    ("text", "encoded"),
    [
        ("hello world", "hello world"),
        ("100%", "100%25"),
        ("a\nb", "a%0Ab"),
        ("\u00e9", "%C3%A9"),
        ("\ud800", "?"),
    ],
)
def test_encode_grpc_message(text: str, encoded: str) -> None:
    assert encode_grpc_message(text) == encoded


@pytest.mark.parametrize(
    ("value", "text"),
    [
        ("%", "%"),
        ("%zz", "%zz"),
        ("%4", "%4"),
        ("%41%4a", "AJ"),
        ("%C3", "\ufffd"),
        ("%C3%A9", "\u00e9"),
        ("\u00e9", "\u00e9"),
        ("%2541", "%41"),
        ("\ud800", "?"),
    ],
)
def test_decode_grpc_message_is_lenient(value: str, text: str) -> None:
    assert decode_grpc_message(value) == text


@FUZZ
@given(st.text(st.characters(exclude_categories=["Cs"]), max_size=60))
def test_grpc_message_round_trip(text: str) -> None:
    encoded = encode_grpc_message(text)
    assert all(0x20 <= ord(char) <= 0x7E for char in encoded)
    assert decode_grpc_message(encoded) == text


def test_status_codes_round_trip_through_their_numbers() -> None:
    for code in grpc.StatusCode:
        assert status_from_code(str(code_number(code))) is code
    assert code_number(grpc.StatusCode.UNAUTHENTICATED) == 16


@pytest.mark.parametrize("value", ["17", "", "abc", "-1", " 0", "0x1", "1" * 5000, "\u0661"])
def test_unknown_grpc_status_is_unknown(value: str) -> None:
    assert status_from_code(value) is grpc.StatusCode.UNKNOWN


@pytest.mark.parametrize(
    ("http_status", "code"),
    [
        (400, "INTERNAL"),
        (401, "UNAUTHENTICATED"),
        (403, "PERMISSION_DENIED"),
        (404, "UNIMPLEMENTED"),
        (429, "UNAVAILABLE"),
        (502, "UNAVAILABLE"),
        (503, "UNAVAILABLE"),
        (504, "UNAVAILABLE"),
        (500, "UNKNOWN"),
        (200, "UNKNOWN"),
    ],
)
def test_status_from_http(http_status: int, code: str) -> None:
    assert status_from_http(http_status) is grpc.StatusCode[code]


def test_status_from_h3_error_follows_g2() -> None:
    assert (H3_NO_ERROR, H3_INTERNAL_ERROR, H3_VERSION_FALLBACK) == (0x100, 0x102, 0x110)
    assert status_from_h3_error(H3_REQUEST_REJECTED) is grpc.StatusCode.UNAVAILABLE
    assert status_from_h3_error(H3_REQUEST_CANCELLED) is grpc.StatusCode.CANCELLED
    assert status_from_h3_error(H3_EXCESSIVE_LOAD) is grpc.StatusCode.RESOURCE_EXHAUSTED
    for code in (H3_NO_ERROR, H3_INTERNAL_ERROR, H3_REQUEST_INCOMPLETE, H3_CONNECT_ERROR, 0):
        assert status_from_h3_error(code) is grpc.StatusCode.INTERNAL
    assert H3_REQUEST_CANCELLED == 0x10C


# ---------------------------------------------------------------------------------- headers


def request(**replace: bytes | None) -> Headers:
    """A valid request block with some fields replaced (None removes them)."""
    fields: dict[str, bytes | None] = {
        ":method": b"POST",
        ":scheme": b"https",
        ":path": b"/pkg.Service/Method",
        ":authority": b"localhost:8443",
        "content-type": b"application/grpc",
        "te": b"trailers",
    }
    fields.update({name.replace("_", "-"): value for name, value in replace.items()})
    return [(name.encode(), value) for name, value in fields.items() if value is not None]


def test_request_headers_layout() -> None:
    headers = request_headers(
        "host:1", "/a.B/C", 1.5, [("user-agent", "app/1"), ("x-k", "v")], user_agent="pq/0"
    )
    assert headers == [
        (b":method", b"POST"),
        (b":scheme", b"https"),
        (b":path", b"/a.B/C"),
        (b":authority", b"host:1"),
        (b"te", b"trailers"),
        (b"grpc-timeout", b"1500000u"),
        (b"content-type", b"application/grpc"),
        (b"user-agent", b"app/1 pq/0"),
        (b"x-k", b"v"),
    ]
    assert (b"grpc-timeout", b"1500000u") not in request_headers("h", "/a/b", None)


def test_request_headers_round_trip() -> None:
    metadata: Metadata = (("x-k", "v"), ("x-bin", b"\x00\x01"))
    head = parse_request_headers(request_headers("host:1", "/a.B/C", 0.25, metadata))
    assert head == RequestHead(
        method_path="/a.B/C",
        authority="host:1",
        timeout=0.25,
        metadata=(("user-agent", "paddlequic-h3"), *metadata),
    )


@pytest.mark.parametrize(
    "content_type",
    [b"application/grpc+proto", b"application/grpc;charset=utf-8", b"Application/GRPC"],
)
def test_parse_request_accepts_grpc_content_types_and_missing_te(content_type: bytes) -> None:
    head = parse_request_headers(request(content_type=content_type, te=None))
    assert (head.method_path, head.timeout, head.metadata) == ("/pkg.Service/Method", None, ())


def test_parse_request_accepts_identity_encoding() -> None:
    assert parse_request_headers(request(grpc_encoding=b"identity")).metadata == ()


@pytest.mark.parametrize(
    ("headers", "http_status"),
    [
        (request(**{":method": b"GET"}), 405),
        (request(**{":method": None}), 400),
        (request(content_type=b"text/html"), 415),
        (request(content_type=b"application/grpcx"), 415),
        (request(content_type=None), 415),
        (request(**{":authority": None}), 400),
        (request(**{":path": None}), 400),
        (request(**{":scheme": None}), 400),
        ([*request(), (b":path", b"/a/b")], 400),
        ([*request(), (b":status", b"200")], 400),
    ],
)
def test_parse_request_refuses_non_grpc_requests_with_http_status(
    headers: Headers, http_status: int
) -> None:
    assert protocol_error(lambda: parse_request_headers(headers)).http_status == http_status


@pytest.mark.parametrize(
    ("headers", "code"),
    [
        (request(**{":path": b"/Method"}), "UNIMPLEMENTED"),
        (request(**{":path": b"/a/b/c"}), "UNIMPLEMENTED"),
        (request(grpc_encoding=b"snappy"), "UNIMPLEMENTED"),
        (request(grpc_timeout=b"soon"), "INTERNAL"),
        (request(x_bin=b"***"), "INTERNAL"),
    ],
)
def test_parse_request_fails_bad_calls_with_grpc_status(headers: Headers, code: str) -> None:
    error = protocol_error(lambda: parse_request_headers(headers))
    assert (error.status, error.http_status) == (grpc.StatusCode[code], None)


def test_response_blocks() -> None:
    assert response_headers([("x-k", "v")]) == [
        (b":status", b"200"),
        (b"content-type", b"application/grpc"),
        (b"grpc-accept-encoding", b"identity,deflate,gzip"),
        (b"x-k", b"v"),
    ]
    assert trailers(grpc.StatusCode.OK) == [(b"grpc-status", b"0")]
    assert trailers(grpc.StatusCode.NOT_FOUND, "no 100%", [("x-k", "v")]) == [
        (b"grpc-status", b"5"),
        (b"grpc-message", b"no 100%25"),
        (b"x-k", b"v"),
    ]
    block = trailers_only(grpc.StatusCode.UNAVAILABLE, "busy")
    assert block == response_headers() + trailers(grpc.StatusCode.UNAVAILABLE, "busy")
    assert is_trailers_only(block)
    assert not is_trailers_only(response_headers())
    assert error_response(415) == [(b":status", b"415")]


def test_parse_response_headers_and_trailers() -> None:
    metadata: Metadata = (("x-k", "v"), ("grpc-status-details-bin", b"\x08\x05"))
    assert parse_response_headers(response_headers(metadata)) == ResponseHead(metadata)
    status = Status(grpc.StatusCode.INTERNAL, "caf\u00e9 100%\nbroke", metadata)
    assert parse_trailers(trailers(status.code, status.message, metadata)) == status
    assert parse_response_headers(trailers_only(status.code, status.message)) == Status(
        status.code, status.message
    )


@pytest.mark.parametrize(
    ("headers", "code"),
    [
        ([(b":status", b"503")], "UNAVAILABLE"),
        ([(b":status", b"404"), (b"content-type", b"text/html")], "UNIMPLEMENTED"),
        ([(b":status", b"200"), (b"content-type", b"text/html")], "UNKNOWN"),
        ([(b":status", b"200")], "UNKNOWN"),
        ([(b"content-type", b"application/grpc")], "INTERNAL"),
        ([(b":status", b"2000")], "INTERNAL"),
        ([(b":status", b"503"), (b"grpc-status", b"8")], "RESOURCE_EXHAUSTED"),
    ],
)
def test_parse_response_headers_synthesizes_status_for_broken_responses(
    headers: Headers, code: str
) -> None:
    status = parse_response_headers(headers)
    assert isinstance(status, Status)
    assert status.code is grpc.StatusCode[code]


def test_parse_trailers_without_status_or_with_raw_utf8() -> None:
    assert parse_trailers([(b"x-k", b"v")]) == Status(
        grpc.StatusCode.INTERNAL, "missing grpc-status"
    )
    raw = parse_trailers([(b"grpc-status", b"2"), (b"grpc-message", "caf\u00e9".encode())])
    assert raw == Status(grpc.StatusCode.UNKNOWN, "caf\u00e9")
    broken = parse_trailers([(b"grpc-status", b"2"), (b"grpc-message", b"%zz\xff")])
    assert broken.message == "%zz\ufffd"


# -------------------------------------------------------------- parsers never fail otherwise

field_names = st.one_of(
    st.sampled_from(
        [
            b":method",
            b":path",
            b":scheme",
            b":authority",
            b":status",
            b"content-type",
            b"te",
            b"grpc-status",
            b"grpc-message",
            b"grpc-timeout",
            b"grpc-encoding",
            b"x-k",
            b"x-bin",
        ]
    ),
    st.binary(max_size=10),
)
field_values = st.one_of(
    st.sampled_from([b"POST", b"/a/b", b"https", b"h", b"200", b"application/grpc", b"1S", b"YQ"]),
    st.binary(max_size=20),
)
header_blocks = st.lists(st.tuples(field_names, field_values), max_size=10)
any_text = st.text(st.characters(exclude_categories=[]), max_size=30)


@FUZZ
@given(header_blocks)
def test_header_parsers_raise_only_protocol_errors(headers: Headers) -> None:
    parsers: list[Callable[[Headers], object]] = [
        parse_request_headers,
        parse_response_headers,
        parse_trailers,
        decode_metadata,
        is_trailers_only,
    ]
    for parse in parsers:
        with contextlib.suppress(ProtocolError):
            parse(headers)


@FUZZ
@given(any_text)
def test_text_parsers_raise_only_protocol_errors(value: str) -> None:
    assert isinstance(decode_grpc_message(value), str)
    assert isinstance(status_from_code(value), grpc.StatusCode)
    try:
        assert parse_timeout(value) >= 0
    except ProtocolError as error:
        assert error.status is grpc.StatusCode.INTERNAL


def test_protocol_error_carries_status_and_http_status() -> None:
    error = ProtocolError(grpc.StatusCode.INTERNAL, "bad", http_status=400)
    assert (str(error), error.message, error.status, error.http_status) == (
        "bad",
        "bad",
        grpc.StatusCode.INTERNAL,
        400,
    )
