"""Triton's sequence batcher as decisions with explicit time (no asyncio: the driver is
sequence_batcher.py).

A sequence is the requests a caller sends under one correlation id, from one with
`sequence_start` to one with `sequence_end`. Its first request binds it to one instance (and,
under `direct`, to one of that instance's max_batch_size slots): every later request runs
there, one at a time and in arrival order, so the state the model keeps for it, implicit or its
own, is always where the request runs. A batch holds at most one request of each sequence and
only sequences of one instance; `oldest` forms batches oldest request first, with preferred
sizes and a queue delay; `direct` sends as soon as a slot is ready unless
minimum_slot_utilization asks it to wait (up to its delay) for fuller batches.

A sequence belongs to whoever started it (its owner: the identity of the caller's client
certificate, or anyone for a caller without one, to whom the id is a capability). A request
of another caller naming it is refused NOT_FOUND in the words of a sequence that never
started; a start naming it is refused ALREADY_EXISTS (ids are unique among live sequences, so
two never present the same CORRID to the model), and neither changes it.

Bounds: live sequences (direct: its slots; oldest: max_candidate_sequences; beyond:
RESOURCE_EXHAUSTED at the start request), requests waiting per sequence, and the ids of ended
sequences remembered to tell a late caller why its sequence is gone."""

from __future__ import annotations

import itertools
from collections import OrderedDict, deque
from collections.abc import Hashable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc

from service.batching.queue import bucket_of
from service.batching.sequence_tensors import State
from service.inference import errors
from service.inference.identity import ANYONE, Identity
from service.inference.jobs import InferJob
from service.model.shapes import ShapeBuckets

CorrId = int | str
# Requests one sequence may have waiting behind the one running: a sequence runs one request
# at a time, so a caller pipelining more than this gains nothing but memory in the server.
MAX_WAITING_PER_SEQUENCE = 16
# Ended sequences whose ids are remembered (oldest forgotten first) to tell a late request
# that its sequence expired, ended or lost its state, instead of "never started".
ENDED_REMEMBERED = 4096


@dataclass(frozen=True)
class SequencePolicy:
    oldest: bool
    instances: int
    max_batch_size: int  # 0: the model does not batch, every request runs alone
    max_candidates: int  # oldest: live sequences at most (max_candidate_sequences)
    idle_s: float
    preferred_sizes: tuple[int, ...] = ()
    max_queue_delay_s: float = 0.0
    minimum_slot_utilization: float = 0.0
    shapes: ShapeBuckets = field(default_factory=ShapeBuckets)
    name: str = "the model"

    @property
    def batch_limit(self) -> int:
        return max(self.max_batch_size, 1)

    @property
    def live_bound(self) -> int:
        """Live sequences at most: `oldest` keeps max_candidate_sequences, `direct` gives each
        sequence a slot of an instance (max_batch_size per instance)."""
        if self.oldest:
            return self.max_candidates
        return self.batch_limit * max(self.instances, 1)


@dataclass(eq=False)
class Step:
    """One request of a sequence, waiting or running."""

    job: InferJob
    corrid: CorrId
    start: bool
    end: bool
    arrival: float
    expires: float | None  # its queue timeout or deadline, whichever comes first
    deadline: float | None = None
    ticket: Any = None  # what the driver needs to answer it
    trace: Any = None
    bucket: Hashable = None
    owner: Identity = ANYONE  # the caller's identity


@dataclass(eq=False)
class Live:
    corrid: CorrId
    owner: Identity
    instance: int
    slot: int  # direct: its slot in the instance (its row order in a batch); oldest: -1
    last_active: float
    waiting: deque[Step] = field(default_factory=deque)
    running: bool = False
    closing: bool = False  # its end request was admitted: only a new start may follow
    state: State | None = None  # the implicit state its last request left (None: initial)
    worker: int | None = None  # the worker process (pid) its requests ran in, once one ran


@dataclass(frozen=True)
class Ended:
    owner: Identity  # told why only to it
    code: grpc.StatusCode
    why: str


class SequenceQueue:
    def __init__(self, policy: SequencePolicy) -> None:
        self.policy = policy
        self._live: dict[CorrId, Live] = {}
        self._ended: OrderedDict[CorrId, Ended] = OrderedDict()
        self._order: Iterator[int] = itertools.count()

    @property
    def live(self) -> int:
        return len(self._live)

    @property
    def queued(self) -> int:
        """Read by /metrics from its own thread too: over a copy of the live sequences made
        in one step, so the loop starting or ending one meanwhile changes nothing it sums."""
        return sum(len(s.waiting) for s in list(self._live.values()))

    def holds(self, corrid: CorrId, owner: Identity) -> bool:
        return self.sequence(corrid, owner) is not None

    def sequence(self, corrid: CorrId, owner: Identity) -> Live | None:
        """`owner`'s live sequence of that id (another's is none of its business)."""
        live = self._live.get(corrid)
        return live if live is not None and live.owner == owner else None

    def push(self, step: Step, now: float) -> bool:
        """Queue a request behind its sequence's others; True when it started a sequence.
        ServiceError when it cannot be taken (no such sequence of its caller, an id another
        caller's live sequence holds, too many, too many waiting)."""
        live = self._live.get(step.corrid)
        started = False
        if live is not None and live.owner != step.owner:
            if step.start:
                raise errors.ServiceError(
                    grpc.StatusCode.ALREADY_EXISTS,
                    f"sequence id {step.corrid!r} of {self.policy.name} is held by another "
                    "caller's live sequence; start yours with another id (a random 63-bit "
                    "integer, as the clients pick)",
                )
            raise self._unknown(step.corrid, step.owner)
        if live is None:
            if not step.start:
                raise self._unknown(step.corrid, step.owner)
            live = self._open(step.corrid, step.owner, now)
            started = True
        elif live.closing and not step.start:
            raise errors.invalid(
                f"sequence {step.corrid!r} of {self.policy.name} has ended (a request with "
                "sequence_end was sent); start a new one with sequence_start"
            )
        if len(live.waiting) >= MAX_WAITING_PER_SEQUENCE:
            raise errors.ServiceError(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"sequence {step.corrid!r} of {self.policy.name} already has "
                f"{MAX_WAITING_PER_SEQUENCE} requests waiting; wait for their responses",
            )
        step.bucket = bucket_of(step.job, self.policy.shapes)
        live.waiting.append(step)
        live.closing = step.end
        live.last_active = now
        return started

    def remove(self, step: Step) -> None:
        """A waiting request whose caller went away (or whose time ran out)."""
        live = self.sequence(step.corrid, step.owner)
        if live is not None and step in live.waiting:
            live.waiting.remove(step)

    def next_batch(self, now: float, free: Sequence[bool]) -> tuple[int, list[Step]] | float | None:
        """A batch to run now on an instance that can take one (`free`, by instance), or the
        time to look again, or None when nothing waits for a free instance."""
        wake: float | None = None
        for instance, can_run in enumerate(free):
            if not can_run:
                continue
            heads = [
                s
                for s in self._live.values()
                if s.instance == instance and not s.running and s.waiting
            ]
            if not heads:
                continue
            decision = self._decide(heads, now)
            if isinstance(decision, float):
                wake = decision if wake is None else min(wake, decision)
                continue
            for live in decision:
                live.running = True
            return instance, [live.waiting.popleft() for live in decision]
        return wake

    def finish(
        self, step: Step, now: float, state: State | None, worker: int | None = None
    ) -> bool:
        """The request ran (in `worker`); `state` is what it left (None: it failed, the state
        stays as it was). True when that ended its sequence."""
        live = self.sequence(step.corrid, step.owner)
        if live is None:
            return False
        live.running = False
        live.last_active = now
        if state is not None:
            live.state, live.worker = state, worker
        if step.end and not live.waiting:
            self._close(live, Ended(live.owner, grpc.StatusCode.INVALID_ARGUMENT, "has ended"))
            return True
        return False

    def drop(self, step: Step, code: grpc.StatusCode, why: str) -> list[Step]:
        """End the step's sequence now (its state is gone or wrong); its waiting requests,
        to fail."""
        live = self.sequence(step.corrid, step.owner)
        if live is None:
            return []
        return self._dropped(live, code, why)

    def _dropped(self, live: Live, code: grpc.StatusCode, why: str) -> list[Step]:
        self._close(live, Ended(live.owner, code, why))
        return list(live.waiting)

    def lose(self, instance: int, why: str) -> tuple[list[Step], int]:
        """Every sequence bound to an instance whose worker died: the state it held is gone.
        Their waiting requests (to fail), and how many sequences were lost."""
        lost = [s for s in self._live.values() if s.instance == instance]
        steps: list[Step] = []
        for live in lost:
            steps += self._dropped(live, grpc.StatusCode.UNAVAILABLE, why)
        return steps, len(lost)

    def expire(self, now: float) -> tuple[list[Step], int]:
        """Requests whose time ran out (they never run), and how many idle sequences were
        released (max_sequence_idle_microseconds)."""
        expired: list[Step] = []
        idle: list[Live] = []
        for live in self._live.values():
            late = [s for s in live.waiting if s.expires is not None and s.expires <= now]
            for step in late:
                live.waiting.remove(step)
            expired += late
            if (
                not live.running
                and not live.waiting
                and now - live.last_active >= self.policy.idle_s
            ):
                idle.append(live)
        for live in idle:
            self._close(
                live,
                Ended(
                    live.owner,
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"expired after {self.policy.idle_s:g} s without a request "
                    "(max_sequence_idle_microseconds)",
                ),
            )
        return expired, len(idle)

    def next_expiry(self) -> float | None:
        """When a request's time or an idle sequence's runs out next."""
        times = [
            s.last_active + self.policy.idle_s
            for s in self._live.values()
            if not s.running and not s.waiting
        ]
        times += [
            step.expires
            for s in self._live.values()
            for step in s.waiting
            if step.expires is not None
        ]
        return min(times, default=None)

    def close_all(self) -> list[Step]:
        """At stop: every waiting request, to fail."""
        steps = [step for s in self._live.values() for step in s.waiting]
        self._live.clear()
        return steps

    def _open(self, corrid: CorrId, owner: Identity, now: float) -> Live:
        policy = self.policy
        if len(self._live) >= policy.live_bound:
            how = (
                "max_candidate_sequences"
                if policy.oldest
                else f"direct: max_batch_size {policy.batch_limit} x {policy.instances} instance(s)"
            )
            raise errors.ServiceError(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"{policy.name} holds its maximum of {policy.live_bound} live sequences ({how}); "
                f"end one (sequence_end) or let it expire ({policy.idle_s:g} s idle)",
            )
        taken: dict[int, set[int]] = {i: set() for i in range(max(policy.instances, 1))}
        for live in self._live.values():
            taken[live.instance].add(live.slot)
        instance = min(taken, key=lambda i: (len(taken[i]), i))
        slot = -1
        if not policy.oldest:
            slot = next(i for i in range(policy.batch_limit) if i not in taken[instance])
        self._ended.pop(corrid, None)
        live = Live(corrid, owner, instance, slot, now)
        self._live[corrid] = live
        return live

    def _close(self, live: Live, ended: Ended) -> None:
        self._live.pop(live.corrid, None)
        self._ended[live.corrid] = ended
        self._ended.move_to_end(live.corrid)
        while len(self._ended) > ENDED_REMEMBERED:
            self._ended.popitem(last=False)

    def _unknown(self, corrid: CorrId, owner: Identity) -> errors.ServiceError:
        """Why the caller has no live sequence of that id: the same words whether none ever
        started or another caller's is live, or ended."""
        ended = self._ended.get(corrid)
        if ended is not None and ended.owner == owner:
            return errors.ServiceError(
                ended.code,
                f"sequence {corrid!r} of {self.policy.name} {ended.why}; start it again with "
                "sequence_start",
            )
        return errors.not_found(
            f"inference request for sequence {corrid!r} to {self.policy.name} must specify the "
            "sequence_start flag on the first request of the sequence"
        )

    def _decide(self, heads: list[Live], now: float) -> list[Live] | float:
        """Which of one instance's ready sequences run together now, or when to look again."""
        policy = self.policy
        heads.sort(key=lambda s: s.waiting[0].arrival)
        bucket = heads[0].waiting[0].bucket
        same = [s for s in heads if s.waiting[0].bucket == bucket][: policy.batch_limit]
        if not policy.oldest:
            same.sort(key=lambda s: s.slot)
        if len(same) >= policy.batch_limit or policy.max_batch_size == 0:
            return same
        window_end = heads[0].waiting[0].arrival + policy.max_queue_delay_s
        if policy.oldest:
            preferred = [n for n in policy.preferred_sizes if n <= len(same)]
            if preferred:
                return same[: max(preferred)]
            return same if now >= window_end else window_end
        utilization = policy.minimum_slot_utilization
        if utilization <= 0 or len(same) / policy.batch_limit >= utilization or now >= window_end:
            return same
        return window_end
