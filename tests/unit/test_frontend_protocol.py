"""The dispatch protocol between front-ends and the parent, the --frontends count and the
summing of the front-ends' HTTP/3 counters."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path
from unittest import mock

import grpc
import pytest
from hypothesis import given
from hypothesis import strategies as st

from service.frontends.protocol import (
    HEADER,
    FrameDecoder,
    Kind,
    Open,
    ProtocolViolation,
    Status,
    auth_of,
    decode_count,
    decode_metadata,
    decode_open,
    decode_status,
    encode_count,
    encode_metadata,
    encode_open,
    encode_status,
    frame,
)
from service.frontends.runtime import read_settings, shared_tickets, write_settings
from service.frontends.stats import FrontendStats, Report
from service.settings import MAX_AUTO_FRONTENDS, ServerSettings, frontend_count, parse
from transport.h3.server_state import H3ServerStats
from transport.tls.session_tickets import TicketCounters

METADATA = (("x-key", "value"), ("trace-bin", b"\x00\xff"), ("empty", ""))


def test_a_call_opening_survives_the_round_trip() -> None:
    opened = Open(
        "/inference.GRPCInferenceService/ModelInfer", "h3", "ipv4:1.2.3.4:5", 2.5, METADATA
    )
    with frozen_clock(0.0):
        assert decode_open(encode_open(opened)) == opened
    endless = Open("/a/b", "h2", "", None, ())
    assert decode_open(encode_open(endless)) == endless
    # The client certificate's identity, which sequences are bound to.
    certified = Open("/a/b", "h3", "", None, (), (b"x509_common_name", b"alice", b"\x00"))
    assert decode_open(encode_open(certified)) == certified


@given(
    st.lists(
        st.tuples(st.text(max_size=40), st.lists(st.binary(max_size=3000), max_size=4)),
        max_size=8,
    )
)
def test_an_auth_context_survives_the_round_trip(properties: list[tuple[str, list[bytes]]]) -> None:
    """The transport's auth context (a stream passed on: PeerAuth reads it in the parent)."""
    auth = auth_of(dict(properties))
    opened = Open("/a/b", "h3", "", None, (), (b"x509_common_name", b"alice"), auth)
    assert decode_open(encode_open(opened)) == opened


def test_the_time_a_call_spent_on_its_way_is_taken_off_its_time_left() -> None:
    """The deadline crosses as a point in time: a frame read 0.3 s after it was written
    gives the call 0.3 s less at the parent, and one read past its deadline none."""
    opened = Open("/a/b", "h2", "", 1.0, ())
    with frozen_clock(100.0):
        encoded = encode_open(opened)
    with frozen_clock(100.3):
        assert decode_open(encoded).timeout == pytest.approx(0.7)
    with frozen_clock(102.0):
        assert decode_open(encoded).timeout == 0.0


@contextlib.contextmanager
def frozen_clock(now: float) -> Iterator[None]:
    """CLOCK_MONOTONIC as the dispatch protocol reads it, held at `now`."""
    with mock.patch("service.frontends.protocol.time.monotonic", return_value=now):
        yield


def test_status_and_metadata_survive_the_round_trip() -> None:
    status = Status(grpc.StatusCode.RESOURCE_EXHAUSTED, "too big: é", METADATA)
    assert decode_status(encode_status(status)) == status
    assert decode_metadata(encode_metadata(METADATA)) == METADATA
    assert decode_count(encode_count(7)) == 7


def test_frames_split_anywhere_are_put_back_together() -> None:
    data = frame(Kind.MESSAGE, 3, b"x" * 100) + frame(Kind.HALF_CLOSE, 3) + frame(Kind.CANCEL, 9)
    decoder = FrameDecoder(max_payload=1000)
    received = [f for i in range(0, len(data), 7) for f in decoder.feed(data[i : i + 7])]
    assert [(f.kind, f.call_id, len(f.payload)) for f in received] == [
        (Kind.MESSAGE, 3, 100),
        (Kind.HALF_CLOSE, 3, 0),
        (Kind.CANCEL, 9, 0),
    ]


def test_what_is_not_the_protocol_is_refused() -> None:
    with pytest.raises(ProtocolViolation, match="over"):
        FrameDecoder(max_payload=10).feed(HEADER.pack(11, Kind.MESSAGE, 1))
    with pytest.raises(ProtocolViolation, match="unknown frame kind"):
        FrameDecoder(max_payload=10).feed(HEADER.pack(0, 99, 1))
    with pytest.raises(ProtocolViolation, match="ends early"):
        decode_open(encode_open(Open("/a/b", "h2", "", None, METADATA))[:-1])
    with pytest.raises(ProtocolViolation, match="after the payload"):
        decode_metadata(encode_metadata(METADATA) + b"!")
    with pytest.raises(ProtocolViolation, match="status code"):
        decode_status(b"\x00\x63" + bytes(6))


def test_frontend_count() -> None:
    assert frontend_count("1") == 1
    assert frontend_count("auto", usable_cores=1) == 1
    assert frontend_count("auto", usable_cores=6) == 3
    assert frontend_count("auto", usable_cores=128) == MAX_AUTO_FRONTENDS
    for bad in ("0", "65", "many"):
        with pytest.raises(ValueError, match="--frontends"):
            frontend_count(bad)
    with pytest.raises(SystemExit):
        parse(["--frontends", "0"])


def test_frontends_get_a_shared_ticket_store_and_the_parents_settings(tmp_path: Path) -> None:
    settings = parse(["--frontends", "2", "--restricted-protocol", "health:k=v"])
    shared = shared_tickets(settings, tmp_path)
    assert shared.ticket_store == f"sqlite://{tmp_path / 'tickets.sqlite'}"
    key = Path(shared.ticket_key_file)
    assert len(key.read_bytes()) == 32 and key.stat().st_mode & 0o777 == 0o600
    write_settings(shared, tmp_path)
    assert read_settings(tmp_path) == shared
    redis = ServerSettings(ticket_store="redis://r:6379/0", ticket_key_file="/k")
    assert shared_tickets(redis, tmp_path) is redis


def _report(connections: int, full: int, issued: int, blocked: int) -> Report:
    """As the parent reads it from a front-end's JSON."""
    stats = H3ServerStats(connections=connections, handshakes={"full": full})
    sent = Report(stats, TicketCounters(issued=issued), 10 * connections, blocked).to_json()
    return Report.from_json(json.loads(json.dumps(sent)))


def test_frontend_counters_add_up_and_never_go_down_when_one_is_restarted() -> None:
    total = FrontendStats()
    first, second, restarted = object(), object(), object()
    total.report(first, _report(3, 3, 3, 1))
    total.report(second, _report(2, 2, 2, 1))
    assert total.stats.connections == 5 and total.stats.handshakes == {"full": 5}
    assert total.tickets.counters.issued == 5 and total.blocked_writers() == 2
    assert total.peak_send_buffered() == 30
    total.retire(first)
    total.report(restarted, _report(1, 1, 1, 0))
    assert total.stats.connections == 6 and total.tickets.counters.issued == 6
    assert total.blocked_writers() == 1  # a gauge: only live front-ends count
