"""Inputs suspected of crashing a model's worker, remembered for a while so that identical
requests fail at once instead of crashing the worker again.

Bounded in entries and in time, and free of clocks (callers pass `now`) so it can be tested
with explicit times. Fingerprints are only computed once something is on the list, so a model
that never crashes pays nothing for it.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict

from service.inference.jobs import InferJob

POISON_TTL_S = 600.0
MAX_POISON_ENTRIES = 1024


def fingerprint(job: InferJob) -> bytes:
    """Same inputs (names, datatypes, shapes, bytes) and outputs, same fingerprint."""
    digest = hashlib.blake2b(digest_size=20)
    for tensor in job.inputs:
        header = f"{tensor.name}\0{tensor.datatype.name}\0{tensor.shape}\0{len(tensor.data)}\0"
        digest.update(header.encode())
        digest.update(tensor.data)
    digest.update("\0".join(job.outputs).encode())
    return digest.digest()


class PoisonList:
    """Least recently added entries go first when full; entries expire after `ttl_s`."""

    def __init__(self, ttl_s: float = POISON_TTL_S, max_entries: int = MAX_POISON_ENTRIES) -> None:
        self.ttl_s = ttl_s
        self.max_entries = max_entries
        self._expiry: OrderedDict[bytes, float] = OrderedDict()

    def __len__(self) -> int:
        return len(self._expiry)

    def add(self, job: InferJob, now: float) -> None:
        key = fingerprint(job)
        self._expiry.pop(key, None)
        self._expiry[key] = now + self.ttl_s
        while len(self._expiry) > self.max_entries:
            self._expiry.popitem(last=False)

    def holds(self, job: InferJob, now: float) -> bool:
        self._drop_expired(now)
        return bool(self._expiry) and fingerprint(job) in self._expiry

    def _drop_expired(self, now: float) -> None:
        # Insertion order is expiry order: every entry has the same lifetime.
        while self._expiry and next(iter(self._expiry.values())) <= now:
            self._expiry.popitem(last=False)
