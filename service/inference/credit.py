"""A receiver's side of message credit (a worker's decoupled responses, a dispatch
connection's messages of one call): the sender may have `window` messages out that were not
credited; the receiver gives credit back for those its reader took half a window at a time, as
HTTP/2 and QUIC grant flow control, rather than one message per message. The sender never
waits while the reader waits: what was taken and not credited stays under half the window."""

from __future__ import annotations


class ReturnedCredit:
    def __init__(self, window: int) -> None:
        self.window = window
        self._batch = max(window // 2, 1)
        self.owed = 0  # taken by the reader, not credited yet

    def allows(self, unread: int) -> bool:
        """Whether a sender within its credit may have sent one more message while `unread`
        of its messages wait for the reader (False: it broke the protocol)."""
        return unread + self.owed < self.window

    def took(self) -> int:
        """The reader took one more message: the credit to give back now (0: not yet)."""
        self.owed += 1
        if self.owed < self._batch:
            return 0
        owed, self.owed = self.owed, 0
        return owed
