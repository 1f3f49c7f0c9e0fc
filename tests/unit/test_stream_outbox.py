"""A ModelStreamInfer stream's outbox (bounded in count and bytes) and its stall watch, on an
event loop with a virtual clock; who a caller is, for the fair share of places; the options
that set both bounds."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from service import settings as server_settings
from service.api.callers import client_of, peer_host
from service.api.stream_outbox import Outbox, StallWatch
from tests.virtual_time import VirtualTimePolicy


@pytest.fixture(scope="module")
def event_loop_policy() -> asyncio.AbstractEventLoopPolicy:
    return VirtualTimePolicy()


def _held_bytes_peak(sizes: list[list[int]], count: int, max_bytes: int) -> int:
    """Producers put items of these sizes (room first, as the servicer does) while a consumer
    takes one per tick: the most bytes the outbox ever held."""

    async def run() -> int:
        outbox: Outbox[int | None] = Outbox(count, max_bytes, lambda item: item or 0)
        peak = 0

        async def produce(items: list[int]) -> None:
            nonlocal peak
            for size in items:
                await outbox.room()
                outbox.put(size)
                peak = max(peak, outbox.bytes)
                assert len(outbox) <= count

        producers = asyncio.gather(*(produce(items) for items in sizes))
        taken = 0
        while taken < sum(map(len, sizes)):
            await outbox.get()
            taken += 1
            await asyncio.sleep(0.01)
        await producers
        return peak

    with asyncio.Runner(loop_factory=VirtualTimePolicy().new_event_loop) as runner:
        return runner.run(run())


@settings(max_examples=60, deadline=None, derandomize=True, database=None)
@given(
    sizes=st.lists(st.lists(st.integers(0, 5000), max_size=12), min_size=1, max_size=6),
    count=st.integers(1, 8),
    max_bytes=st.integers(1, 8000),
)
def test_the_outbox_holds_at_most_its_bytes_plus_one_item(
    sizes: list[list[int]], count: int, max_bytes: int
) -> None:
    largest = max((size for items in sizes for size in items), default=0)
    assert _held_bytes_peak(sizes, count, max_bytes) < max_bytes + largest


def test_many_large_responses_wait_for_room_instead_of_piling_up() -> None:
    """64 requests each with a 1 MiB response (a large id repeated): at most the bound plus
    one is ever held, not 64 MiB."""
    peak = _held_bytes_peak([[1 << 20] * 3 for _ in range(64)], 65, 4 << 20)
    assert peak < 5 << 20


async def test_a_cancelled_waiter_passes_its_room_on() -> None:
    outbox: Outbox[int] = Outbox(1, 100, lambda item: item)
    outbox.put(10)
    first = asyncio.create_task(outbox.room())
    second = asyncio.create_task(outbox.room())
    await asyncio.sleep(0)
    assert await outbox.get() == 10  # room for one: the first waiter is given it
    first.cancel()
    await asyncio.sleep(0)
    await asyncio.wait_for(second, 1)  # the second got the room the first left


async def test_a_waiter_cancelled_before_the_room_came_is_passed_over() -> None:
    """Cancelled (its stream stalled, its caller left) and room made before its task ran
    again: the room goes to the next waiter, and the cancelled one only ends cancelled (it
    raised ValueError, 'not in deque', in a task nobody awaited, in a chaos run)."""
    outbox: Outbox[int] = Outbox(1, 100, lambda item: item)
    outbox.put(10)
    first = asyncio.create_task(outbox.room())
    second = asyncio.create_task(outbox.room())
    await asyncio.sleep(0)
    first.cancel()  # its wait is cancelled now; its task runs later
    assert await outbox.get() == 10
    await asyncio.wait_for(second, 1)
    with pytest.raises(asyncio.CancelledError):
        await first


async def test_a_send_that_waits_stall_s_is_a_stall_and_sends_that_move_are_not() -> None:
    loop = asyncio.get_running_loop()
    stalls: list[float] = []
    watch = StallWatch(5.0, lambda: stalls.append(loop.time()))
    start = loop.time()
    for _ in range(20):  # 20 s of sends each taken within 1 s: no stall
        watch.sending()
        await asyncio.sleep(1.0)
        watch.sent()
    await asyncio.sleep(30.0)  # idle, nothing to send: no stall
    assert not stalls and not watch.stalled
    watch.sending()
    began = loop.time()
    await asyncio.sleep(60.0)
    assert stalls == [began + 5.0] and watch.stalled
    assert began - start >= 50.0
    watch.close()


@pytest.mark.parametrize(
    ("peer", "host"),
    [
        ("ipv4:10.1.2.3:5555", "10.1.2.3"),
        ("ipv4:10.1.2.3:6666", "10.1.2.3"),
        ("ipv6:[::1]:5555", "::1"),
        ("ipv6:%5B::1%5D:5555", "::1"),
        ("ipv6:[::ffff:10.1.2.3]:5555", "10.1.2.3"),  # dual-stack: the same IPv4 client
        ("ipv6:[2001:db8::0:1]:5555", "2001:db8::1"),
        ("unix:/tmp/socket", "unix:/tmp/socket"),
    ],
)
def test_every_connection_from_one_address_is_one_client(peer: str, host: str) -> None:
    assert peer_host(peer) == host


class _Context:
    """What client_of reads of a servicer context."""

    def __init__(self, peer: str, identities: list[bytes] | None) -> None:
        self._peer, self._identities = peer, identities

    def peer(self) -> str:
        return self._peer

    def peer_identities(self) -> list[bytes] | None:
        return self._identities

    def peer_identity_key(self) -> str | None:
        return "x509_subject_alternative_name" if self._identities else None


def test_one_certificate_is_one_client_from_any_address() -> None:
    alice = [b"alice.example", b"alice"]
    clients = {
        client_of(_Context(peer, identities))  # type: ignore[arg-type]
        for peer, identities in [
            ("ipv4:10.1.2.3:5555", alice),
            ("ipv6:[2001:db8::7]:443", alice),
            ("ipv4:10.9.9.9:1", alice),
        ]
    }
    assert clients == {"certificate x509_subject_alternative_name, alice.example, alice"}
    bob = client_of(_Context("ipv4:10.1.2.3:5555", [b"bob"]))  # type: ignore[arg-type]
    anonymous = client_of(_Context("ipv4:10.1.2.3:6666", None))  # type: ignore[arg-type]
    assert len({*clients, bob, anonymous}) == 3
    assert anonymous == "address 10.1.2.3"


def test_stream_bounds_options(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    defaults = server_settings.parse([])
    assert 0 < defaults.stream_stall_timeout <= 30.0
    assert defaults.stream_buffer_bytes == 4 << 20
    monkeypatch.setenv("PADDLEQUIC_STREAM_STALL_TIMEOUT", "2.5")
    monkeypatch.setenv("PADDLEQUIC_STREAM_BUFFER_BYTES", "65536")
    chosen = server_settings.parse([])
    assert (chosen.stream_stall_timeout, chosen.stream_buffer_bytes) == (2.5, 65536)
    assert server_settings.parse(["--stream-stall-timeout", "1"]).stream_stall_timeout == 1.0
    for bad in ("0", "-1", "nan", "inf"):
        with pytest.raises(SystemExit):
            server_settings.parse(["--stream-stall-timeout", bad])
        assert "--stream-stall-timeout must be above 0" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        server_settings.parse(["--stream-buffer-bytes", "0"])


async def test_put_now_takes_only_room_nobody_waits_for() -> None:
    """An answer put from a callback goes in at once only where a producer waiting with
    `room()` would not have been passed over; else it waits its turn too."""
    outbox: Outbox[int | None] = Outbox(1, 100, lambda item: item or 0)
    assert outbox.put_now(1)
    assert not outbox.put_now(2)  # full
    waiter = asyncio.create_task(outbox.room())
    await asyncio.sleep(0)
    assert await outbox.get() == 1  # room again, and it is the waiter's
    assert not outbox.put_now(3)
    await waiter
    outbox.put(4)
    assert await outbox.get() == 4
    assert outbox.put_now(5)
