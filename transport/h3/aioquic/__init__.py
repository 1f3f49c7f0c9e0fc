"""Every use of aioquic's private internals, in one package.

aioquic offers no hooks for what gRPC over HTTP/3 needs on an untrusted network: receive
credit that follows what the application consumed, GOAWAY, a bound on header blocks,
connection admission (limits, Retry on demand), refusing early data per connection; nor for
what saves packets on small calls: ACKs riding with stream data, QPACK without a dynamic table.
So its modules replace or read private methods and attributes, read from aioquic 1.7.2, and
the package refuses to load with any other version (here, which every submodule's import
runs first): a silent mismatch would corrupt flow control.

Besides these, subclasses of aioquic's `QuicConnectionProtocol` use its `_quic`, `_loop`,
`_process_events`, `_transmit_soon` and `_transmit_task` members, as aioquic's own examples
do (`quiet_receive` also re-arms its timer).
"""

from __future__ import annotations

import importlib.metadata

PINNED_VERSION = "1.7.2"


def check_version(installed: str) -> None:
    """Raise unless `installed` is the aioquic version this package was written against."""
    if installed != PINNED_VERSION:
        raise ImportError(
            f"paddlequic's HTTP/3 transport needs aioquic=={PINNED_VERSION} exactly (it relies "
            f"on that version's internals); aioquic {installed} is installed"
        )


check_version(importlib.metadata.version("aioquic"))
