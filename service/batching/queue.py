"""The batching decisions, kept free of asyncio and clocks so they can be tested with explicit
times: which requests leave the queue together, and when to look again.

Triton's rules: requests are taken in arrival order (higher priority first); only requests whose
non-batch shapes and requested outputs match share a batch; the largest preferred batch size that
can be formed goes at once, as does a full batch; otherwise the batcher waits while the oldest
request has waited less than max_queue_delay, then sends what it has.

Requests whose batch was running when its worker died go back to the front of the queue (their
original place), each to run alone: the one that crashed the worker is then found without
crashing it once per request of the batch.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Hashable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from service.inference.jobs import InferJob
from service.model.shapes import ShapeBuckets

DEFAULT_MIN_QUEUE_SIZE = 64
QUEUED_BATCHES_PER_INSTANCE = 8


class QueueFull(Exception):
    pass


def default_queue_size(max_batch_size: int, instances: int) -> int:
    """The bound when config.pbtxt sets none: enough for several full batches per instance."""
    return max(
        DEFAULT_MIN_QUEUE_SIZE,
        QUEUED_BATCHES_PER_INSTANCE * max(max_batch_size, 1) * max(instances, 1),
    )


@dataclass(frozen=True)
class BatchPolicy:
    max_batch_size: int  # 0: no batching, every request runs alone
    preferred_sizes: tuple[int, ...] = ()
    max_queue_delay_s: float = 0.0
    max_queue_size: int = 0  # 0: unbounded (policy_from_config always sets a bound)
    priority_levels: int = 0  # 0: one level
    default_priority: int = 0
    default_timeout_s: float | None = None
    allow_timeout_override: bool = False
    shapes: ShapeBuckets = field(default_factory=ShapeBuckets)  # what batches are padded to

    def priority_of(self, requested: int | None) -> int:
        """1 is the highest level; out-of-range or absent means the default level."""
        levels = max(self.priority_levels, 1)
        default = self.default_priority if 1 <= self.default_priority <= levels else levels
        if requested is None or not 1 <= requested <= levels:
            return default
        return requested

    def timeout_of(self, requested_s: float | None) -> float | None:
        if requested_s is not None and self.allow_timeout_override:
            return requested_s
        return self.default_timeout_s


def bucket_of(job: InferJob, shapes: ShapeBuckets) -> Hashable:
    """Requests batch together only with the same non-batch shapes (after padding to the
    sequence buckets) and requested outputs."""
    return bucket_key([(t.name, t.shape) for t in job.inputs], job.outputs, shapes)


def bucket_key(
    inputs: Sequence[tuple[str, tuple[int, ...]]], outputs: tuple[str, ...], shapes: ShapeBuckets
) -> Hashable:
    """bucket_of's, from each input's (name, shape)."""
    return (tuple((name, shapes.padded_shape(name, shape)[1:]) for name, shape in inputs), outputs)


@dataclass(eq=False)
class Pending:
    job: InferJob
    arrival: float
    expires: float | None  # the request's queue timeout or deadline, whichever comes first
    priority: int = 1
    deadline: float | None = None  # the caller's own; what is left after a crash
    crashes: int = 0  # batches it was running in when their worker died
    alone: bool = False  # runs in a batch of its own (set after a crash)
    bucket: Hashable = None
    ticket: Any = None  # what the driver needs to answer this request
    trace: Any = None  # the request's span context, for linking the batch span to it
    order: int = 0

    @property
    def rows(self) -> int:
        return self.job.rows


@dataclass
class BatchQueue:
    policy: BatchPolicy
    _pending: list[Pending] = field(default_factory=list)
    _order: Iterator[int] = field(default_factory=itertools.count)

    def __len__(self) -> int:
        return len(self._pending)

    def push(self, item: Pending) -> None:
        limit = self.policy.max_queue_size
        if limit and len(self._pending) >= limit:
            raise QueueFull(f"the queue holds its maximum of {limit} requests")
        item.order = next(self._order)
        if item.bucket is None:
            item.bucket = bucket_of(item.job, self.policy.shapes)
        self._insert(item)

    def requeue(self, item: Pending, alone: bool) -> None:
        """Back in at its original place after its worker died (`alone`: to run in a batch of
        its own), bounded by the caller's deadline only (its queue timeout was for the first
        wait). Not counted against max_queue_size: it was admitted already."""
        item.alone = item.alone or alone
        item.expires = item.deadline
        self._insert(item)

    def _insert(self, item: Pending) -> None:
        """In (priority, arrival order): a new request of the last one's priority or lower
        (the usual case: one priority level) goes at the end without a sort."""
        pending = self._pending
        if not pending or (pending[-1].priority, pending[-1].order) <= (item.priority, item.order):
            pending.append(item)
        else:
            bisect.insort(pending, item, key=_place)

    def expire(self, now: float) -> list[Pending]:
        """Remove and return the requests whose time ran out: they never reach a worker."""
        expired = [p for p in self._pending if p.expires is not None and p.expires <= now]
        if expired:
            self._pending = [p for p in self._pending if p not in expired]
        return expired

    def remove(self, item: Pending) -> None:
        """Take out a request whose caller went away (found by identity: comparing requests
        field by field costs more than the search)."""
        for index, pending in enumerate(self._pending):
            if pending is item:
                del self._pending[index]
                return

    def next_batch(self, now: float, only_full: bool = False) -> list[Pending] | float | None:
        """A batch to run now, or the time to look again, or None when the queue is empty.
        `only_full`: no instance is idle (each runs a batch), so only a full batch (or one of
        the largest preferred size formed) goes now to wait in one; anything less keeps
        gathering rows until an instance is idle, as Triton's batcher waits for a free instance
        (sending a lone request behind a running batch made 86% of `mlp`'s batches one row)."""
        if not self._pending:
            return None
        head = self._pending[0]
        policy = self.policy
        if policy.max_batch_size == 0 or head.alone:
            return self._take([head])
        candidates, rows = [], 0
        full = False
        for item in self._pending:
            if item.bucket != head.bucket or item.alone:
                continue
            if rows + item.rows > policy.max_batch_size:
                full = True
                break
            candidates.append(item)
            rows += item.rows
        full = full or rows == policy.max_batch_size
        if full:
            return self._take(candidates)
        preferred = self._largest_preferred_prefix(candidates)
        if preferred:
            return self._take(candidates[:preferred])
        if only_full:
            return self.next_expiry()
        window_end = head.arrival + policy.max_queue_delay_s
        if now < window_end:
            expiries = [p.expires for p in self._pending if p.expires is not None]
            return min([window_end, *expiries])
        return self._take(candidates)

    def next_expiry(self) -> float | None:
        expiries = [p.expires for p in self._pending if p.expires is not None]
        return min(expiries, default=None)

    def _largest_preferred_prefix(self, candidates: list[Pending]) -> int:
        """How many candidates make up the largest preferred batch size; 0 if none does."""
        sizes = set(self.policy.preferred_sizes)
        best, rows = 0, 0
        for count, item in enumerate(candidates, start=1):
            rows += item.rows
            if rows in sizes:
                best = count
        return best

    def _take(self, batch: list[Pending]) -> list[Pending]:
        taken = set(map(id, batch))
        self._pending = [p for p in self._pending if id(p) not in taken]
        return batch


def _place(item: Pending) -> tuple[int, int]:
    return item.priority, item.order
