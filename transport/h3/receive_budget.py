"""How many bytes the HTTP/3 peers of one server process may make it hold (received, not yet
consumed): per address and in all, shared by every connection of the process.

Receive credit (aioquic/credit.py) bounds what one connection holds; an address may open many
connections. Here each request stream reserves, from its peer's address and from the whole,
the credit it may still use: its stream window when it is admitted, a whole large message when
that message's turn comes. `ReceiveBudget` is the accounting alone (no I/O, no clock);
`SharedReceiveBudget` adds the connections waiting for a release, and, with `--frontends N`,
what the other processes on the port hold (transport/host_tally.py): the budget is then the
host's."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

# Defaults: a quarter of a GiB from one address (an open request stream reserves its 1 MiB
# window, so 256 open streams, or a few messages near the 64 MiB maximum); 1 GiB in all.
DEFAULT_PER_ADDRESS = 256 << 20
DEFAULT_TOTAL = 1 << 30
# While a reservation waits and other processes hold part of the budget, it is tried again this
# often: their releases wake nobody here.
ELSEWHERE_RETRY_S = 0.05


class Elsewhere(Protocol):
    """What the other processes on the port hold (their bytes for an address, and in all),
    and where this one says what it holds: a ScopedTally's received-bytes counter and column."""

    def held(self, address: str) -> tuple[int, int]: ...

    def publish(self, address: str) -> None:
        """What this process holds for `address` and in all changed."""
        ...


@dataclass
class ReceiveBudget:
    """Bytes reserved per address and in total, each within its limit.

    A reservation is granted whole or not at all: nobody holds part of what it needs while
    waiting for the rest, which is what keeps streams waiting on the budget from deadlocking
    (the holders need nothing more to finish, and release when they do)."""

    total: int = DEFAULT_TOTAL
    per_address: int = DEFAULT_PER_ADDRESS
    reserved_total: int = 0
    reserved: dict[str, int] = field(default_factory=dict)

    def reserve(
        self, address: str, size: int, share: float = 1.0, elsewhere: tuple[int, int] = (0, 0)
    ) -> bool:
        """Reserve `size` bytes for `address`; False (nothing reserved) past either limit, or
        past that `share` of it (what may be reserved for the asking: the rest is kept for
        smaller requests). `elsewhere`: what other processes hold, for the address and in
        all, counted against the limits too."""
        held = self.reserved.get(address, 0)
        if (
            held + elsewhere[0] + size > self.per_address * share
            or self.reserved_total + elsewhere[1] + size > self.total * share
        ):
            return False
        if size:
            self.reserved[address] = held + size
            self.reserved_total += size
        return True

    def release(self, address: str, size: int) -> None:
        """Give back `size` bytes reserved for `address` (never more than it holds)."""
        held = self.reserved.get(address, 0)
        size = min(size, held)
        if held == size:
            self.reserved.pop(address, None)
        else:
            self.reserved[address] = held - size
        self.reserved_total -= size

    def held(self, address: str) -> int:
        return self.reserved.get(address, 0)


class SharedReceiveBudget:
    """The process's budget and whoever waits for part of it: each release retries the
    waiters, oldest first (a waiter that still cannot reserve waits again)."""

    def __init__(self, budget: ReceiveBudget, elsewhere: Elsewhere | None = None) -> None:
        self.budget = budget
        self.peak_total = 0
        self._elsewhere = elsewhere
        self._waiting: dict[object, Callable[[], None]] = {}
        self._waking = False
        self._retry: asyncio.TimerHandle | None = None

    def reserve(self, address: str, size: int, share: float = 1.0) -> bool:
        if self._elsewhere is None:
            granted = self.budget.reserve(address, size, share)
        else:
            granted = self.budget.reserve(address, size, share, self._elsewhere.held(address))
            if granted and size:
                self._publish(address)
                granted = self._still_within(self._elsewhere, address, size, share)
        self.peak_total = max(self.peak_total, self.budget.reserved_total)
        return granted

    def _still_within(self, elsewhere: Elsewhere, address: str, size: int, share: float) -> bool:
        """Another process may have reserved at the same instant, each missing the other's
        reservation. Both published before looking again, so at least one of them sees the
        other's now: whoever finds the sum past the limit gives its part back (both may, which
        only refuses). Without this, two streams' full windows took all of an address's
        budget, which WIDE_SHARE keeps half of for narrow ones (CI at 5cd5999)."""
        if self.budget.reserve(address, 0, share, elsewhere.held(address)):
            return True
        self.budget.release(address, size)
        elsewhere.publish(address)
        return False

    def _publish(self, address: str) -> None:
        if self._elsewhere is not None:
            self._elsewhere.publish(address)

    def release(self, address: str, size: int) -> None:
        if size <= 0:
            return
        self.budget.release(address, size)
        self._publish(address)
        self._wake()

    def _wake(self) -> None:
        if self._retry is not None:
            self._retry.cancel()
            self._retry = None
        if self._waiting and not self._waking:
            self._waking = True
            try:
                waiting, self._waiting = self._waiting, {}
                for retry in waiting.values():
                    retry()
            finally:
                self._waking = False

    def wait(self, key: object, retry: Callable[[], None]) -> None:
        """Call `retry` after the next release (once); with other processes on the port,
        within ELSEWHERE_RETRY_S at the latest (their releases wake nobody here)."""
        self._waiting[key] = retry
        if self._elsewhere is not None and self._retry is None:
            self._retry = asyncio.get_running_loop().call_later(ELSEWHERE_RETRY_S, self._wake)

    def stop_waiting(self, key: object) -> None:
        self._waiting.pop(key, None)


@dataclass
class AddressShare:
    """What one connection uses of the shared budget: reservations for its peer's address."""

    shared: SharedReceiveBudget
    address: str

    def reserve(self, size: int, share: float = 1.0) -> bool:
        return self.shared.reserve(self.address, size, share)

    def release(self, size: int) -> None:
        self.shared.release(self.address, size)

    def wait(self, key: object, retry: Callable[[], None]) -> None:
        self.shared.wait(key, retry)

    def stop_waiting(self, key: object) -> None:
        self.shared.stop_waiting(key)

    @property
    def per_address(self) -> int:
        return self.shared.budget.per_address

    @property
    def total(self) -> int:
        return self.shared.budget.total
