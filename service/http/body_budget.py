"""What the REST requests may hold of their bodies while they are read, inflated and parsed,
per client address and in all (--http-receive-budget-per-address, --http-receive-budget), for
the host: with --frontends N each front-end counts against it what the others hold (their
tally, as HTTP/3's receive budget). --http-max-input-size bounds one body; this bounds how many
of them a peer's connections make the server hold at once: without it, 16 connections sending 60 MiB
each of a body they never finished grew the server by 965 MB, and 4 JSON bodies of 60 MiB by
2.9 GB while they were parsed (--max-concurrent-rpcs lets 1024 requests in at once).

A JSON body is charged JSON_HOLD_FACTOR times its bytes: its bytes, their copy when whole, and
what parsing it holds at its peak (orjson builds a document of its own, then Python's objects:
with the bytes and their copy, 15 to 40 times the body's bytes, measured with tracemalloc over
documents dense in strings, numbers, lists and objects; `tests/unit/test_body_budget.py`
holds the factor above what each takes). Binary tensor data after the JSON (Triton's
extension) and a compressed body are charged twice their bytes (the bytes and their copy), and
what a compressed body inflates to as JSON.

A body whose length is declared is charged whole before any of it is read, waiting (within
--http-body-timeout) for others to give back; a chunked body as its chunks come and an
inflated body once inflated, each refused at once when there is no room: a request that holds
part of the budget never waits for more, so the requests waiting cannot deadlock (one waiting
while other front-ends hold part looks again every ELSEWHERE_RETRY_S: their releases wake
nobody here). One that could never fit is refused 413 before anything is read.

An answer holds the same budget until its client has taken it (bounds.hold_answer)."""

from __future__ import annotations

import asyncio

from transport.h3.admission import COLUMNS, RECEIVED_COLUMN
from transport.h3.receive_budget import ReceiveBudget, SharedReceiveBudget
from transport.host_tally import ScopedTally

JSON_HOLD_FACTOR = 48
BINARY_HOLD_FACTOR = 2

DEFAULT_TOTAL = 1 << 30
DEFAULT_PER_ADDRESS = 256 << 20


def held_for(size: int, json_bytes: int | None) -> int:
    """What a body of `size` bytes holds, its first `json_bytes` JSON (None: all of it)."""
    json_part = size if json_bytes is None else min(size, json_bytes)
    return JSON_HOLD_FACTOR * json_part + BINARY_HOLD_FACTOR * (size - json_part)


class BodyBudget:
    """The budget for a process's REST requests' bodies; with `host` (--frontends N: the
    front-ends' tally, transport/host_tally.py) the host's, every front-end's bodies counted
    against it, as HTTP/3's receive budget is."""

    def __init__(self, total: int, per_address: int, host: ScopedTally | None = None) -> None:
        budget = ReceiveBudget(total, per_address)
        self.shared = SharedReceiveBudget(
            budget, None if host is None else _Elsewhere(host, budget)
        )

    def charge(self, address: str) -> BodyCharge:
        return BodyCharge(self.shared, address)


class BodyCharge:
    """What one request holds of the budget, given back all at once when it ends."""

    def __init__(self, shared: SharedReceiveBudget, address: str) -> None:
        self._shared = shared
        self.address = address
        self.held = 0

    @property
    def per_address(self) -> int:
        return self._shared.budget.per_address

    @property
    def total(self) -> int:
        return self._shared.budget.total

    def could_fit(self, size: int) -> bool:
        """Whether `size` more could ever be granted, were every other request to end."""
        return self.held + size <= min(self.per_address, self.total)

    def take(self, size: int) -> bool:
        """`size` more now, or nothing (False)."""
        if size <= 0:
            return True
        if not self._shared.reserve(self.address, size):
            return False
        self.held += size
        return True

    async def wait_for(self, size: int) -> None:
        """`size` more, waiting for others to give back; the caller bounds the wait (and must
        hold nothing yet: a holder that waits could wait for itself)."""
        while not self.take(size):
            woken = asyncio.Event()
            self._shared.wait(self, woken.set)
            try:
                await woken.wait()
            finally:
                self._shared.stop_waiting(self)

    def release(self) -> None:
        held, self.held = self.held, 0
        self._shared.release(self.address, held)


# Where a front-end says what its REST bodies hold: the counter of its tally (all addresses),
# and each address's entry's column for received bytes (its entries laid out as HTTP/3's).
HELD_COUNTER = 0


class _Elsewhere:
    """The other front-ends' REST bodies, and this process's where they read them."""

    def __init__(self, host: ScopedTally, budget: ReceiveBudget) -> None:
        self._host = host
        self._budget = budget

    def held(self, address: str) -> tuple[int, int]:
        return self._host.others_at(address)[RECEIVED_COLUMN], self._host.others(HELD_COUNTER)

    def publish(self, address: str) -> None:
        self._host.set(HELD_COUNTER, self._budget.reserved_total)
        # The table holds an entry for every address with bodies in flight (tally_layout sizes
        # it by --http-max-connections); were it full, the total would still be the host's.
        values = [0] * COLUMNS
        values[RECEIVED_COLUMN] = self._budget.held(address)
        self._host.set_at(address, tuple(values))
