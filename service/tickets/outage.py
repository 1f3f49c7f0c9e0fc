"""A ticket store's outages: warned once as one starts and once as it ends, not per connection."""

from __future__ import annotations

import logging


class StoreOutage:
    """Whether the store is failing now. The warnings go to the store's own `log`; `failing`
    is a %-format of the error, then of `failed`'s other arguments."""

    def __init__(self, log: logging.Logger, failing: str, working: str) -> None:
        self.log = log
        self.failing_message = failing
        self.working_message = working
        self.failing = False

    def failed(self, exc: Exception, *args: object) -> None:
        if not self.failing:
            self.log.warning(self.failing_message, exc, *args)
            self.failing = True

    def recovered(self) -> None:
        if self.failing:
            self.log.warning(self.working_message)
            self.failing = False
