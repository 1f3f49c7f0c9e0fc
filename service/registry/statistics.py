"""Per model-version counters and durations, reported in ModelStatistics' own fields; as JSON
and summed too, for the counts front-end processes keep of the calls they serve themselves."""

from __future__ import annotations

import time
from dataclasses import dataclass, field, fields
from typing import Any

from protos.inference import grpc_service_pb2 as pb
from service.inference.jobs import Timings

_DURATIONS = ("success", "fail", "queue", "compute_input", "compute_infer", "compute_output")
_COUNTS = ("inference_count", "execution_count", "last_inference_ms")
_BATCH_DURATIONS = ("compute_input", "compute_infer", "compute_output")


class StatsError(ValueError):
    """JSON that is not a ModelStats: what is wrong and where."""


@dataclass
class _Duration:
    count: int = 0
    ns: int = 0

    def add(self, ns: int, count: int = 1) -> None:
        self.count += count
        self.ns += ns

    def into(self, target: pb.StatisticDuration) -> None:
        target.count = self.count
        target.ns = self.ns

    def to_json(self) -> dict[str, int]:
        return {"count": self.count, "ns": self.ns}

    @classmethod
    def from_json(cls, data: object, where: str) -> _Duration:
        found = _object(data, ("count", "ns"), where)
        return cls(_count(found["count"], f"{where}.count"), _count(found["ns"], f"{where}.ns"))


@dataclass
class _BatchStats:
    compute_input: _Duration = field(default_factory=_Duration)
    compute_infer: _Duration = field(default_factory=_Duration)
    compute_output: _Duration = field(default_factory=_Duration)

    def add(self, other: _BatchStats) -> None:
        for name in _BATCH_DURATIONS:
            theirs: _Duration = getattr(other, name)
            getattr(self, name).add(theirs.ns, theirs.count)


@dataclass
class ModelStats:
    success: _Duration = field(default_factory=_Duration)
    fail: _Duration = field(default_factory=_Duration)
    queue: _Duration = field(default_factory=_Duration)
    compute_input: _Duration = field(default_factory=_Duration)
    compute_infer: _Duration = field(default_factory=_Duration)
    compute_output: _Duration = field(default_factory=_Duration)
    inference_count: int = 0
    execution_count: int = 0
    last_inference_ms: int = 0
    batches: dict[int, _BatchStats] = field(default_factory=dict)

    def record_success(self, rows: int, total_ns: int, queue_ns: int, t: Timings) -> None:
        """One request answered; compute durations are its batch's, as Triton reports them."""
        self.success.add(total_ns)
        self.queue.add(queue_ns)
        self.compute_input.add(t.input_ns)
        self.compute_infer.add(t.infer_ns)
        self.compute_output.add(t.output_ns)
        self.inference_count += rows
        self.last_inference_ms = time.time_ns() // 1_000_000

    def record_batch(self, rows: int, t: Timings) -> None:
        """One execution on a worker, of `rows` rows from one or more requests."""
        self.execution_count += 1
        batch = self.batches.setdefault(rows, _BatchStats())
        batch.compute_input.add(t.input_ns)
        batch.compute_infer.add(t.infer_ns)
        batch.compute_output.add(t.output_ns)

    def record_failure(self, total_ns: int) -> None:
        self.fail.add(total_ns)
        self.last_inference_ms = time.time_ns() // 1_000_000

    def add(self, other: ModelStats) -> None:
        """`other`'s counts added to these (another process's, for the same version): every
        duration and count summed, batch sizes each summed, the later last inference kept."""
        for name in _DURATIONS:
            theirs: _Duration = getattr(other, name)
            getattr(self, name).add(theirs.ns, theirs.count)
        self.inference_count += other.inference_count
        self.execution_count += other.execution_count
        self.last_inference_ms = max(self.last_inference_ms, other.last_inference_ms)
        for size, batch in other.batches.items():
            self.batches.setdefault(size, _BatchStats()).add(batch)

    def take(self) -> ModelStats:
        """What was counted so far; counting starts again from nothing, in place (whoever
        holds this object keeps recording into it)."""
        taken = ModelStats()
        taken.add(self)
        fresh = ModelStats()
        for name in (f.name for f in fields(self)):
            setattr(self, name, getattr(fresh, name))
        return taken

    def to_json(self) -> dict[str, Any]:
        """Plain JSON types only (batch sizes in a list: JSON keys are strings)."""
        data: dict[str, Any] = {name: getattr(self, name).to_json() for name in _DURATIONS}
        data.update({name: getattr(self, name) for name in _COUNTS})
        data["batches"] = [
            {"size": size, **{name: getattr(batch, name).to_json() for name in _BATCH_DURATIONS}}
            for size, batch in sorted(self.batches.items())
        ]
        return data

    @classmethod
    def from_json(cls, data: object) -> ModelStats:
        """What to_json wrote, or StatsError: every field there, every number an int >= 0,
        each batch size once."""
        found = _object(data, (*_DURATIONS, *_COUNTS, "batches"), "stats")
        stats = cls()
        for name in _DURATIONS:
            setattr(stats, name, _Duration.from_json(found[name], name))
        for name in _COUNTS:
            setattr(stats, name, _count(found[name], name))
        if not isinstance(found["batches"], list):
            raise StatsError("batches: not a list")
        for index, entry in enumerate(found["batches"]):
            where = f"batches[{index}]"
            batch = _object(entry, ("size", *_BATCH_DURATIONS), where)
            size = _count(batch["size"], f"{where}.size")
            if size in stats.batches:
                raise StatsError(f"{where}.size: batch size {size} twice")
            sized = stats.batches[size] = _BatchStats()
            for name in _BATCH_DURATIONS:
                setattr(sized, name, _Duration.from_json(batch[name], f"{where}.{name}"))
        return stats

    def to_proto(self, name: str, version: int) -> pb.ModelStatistics:
        out = pb.ModelStatistics(
            name=name,
            version=str(version),
            last_inference=self.last_inference_ms,
            inference_count=self.inference_count,
            execution_count=self.execution_count,
        )
        stats = out.inference_stats
        self.success.into(stats.success)
        self.fail.into(stats.fail)
        self.queue.into(stats.queue)
        self.compute_input.into(stats.compute_input)
        self.compute_infer.into(stats.compute_infer)
        self.compute_output.into(stats.compute_output)
        for size in sorted(self.batches):
            batch = self.batches[size]
            entry = out.batch_stats.add(batch_size=size)
            batch.compute_input.into(entry.compute_input)
            batch.compute_infer.into(entry.compute_infer)
            batch.compute_output.into(entry.compute_output)
        return out


def _object(data: object, keys: tuple[str, ...], where: str) -> dict[str, Any]:
    """`data` as a JSON object with exactly `keys`."""
    if not isinstance(data, dict):
        raise StatsError(f"{where}: not an object")
    if set(data) != set(keys):
        raise StatsError(f"{where}: keys {sorted(data)}, expected {sorted(keys)}")
    return data


def _count(value: object, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise StatsError(f"{where}: {value!r} is not an integer >= 0")
    return value
