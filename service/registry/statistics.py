"""Per model-version counters and durations, reported in ModelStatistics' own fields."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from protos.inference import grpc_service_pb2 as pb
from service.inference.jobs import Timings


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


@dataclass
class _BatchStats:
    compute_input: _Duration = field(default_factory=_Duration)
    compute_infer: _Duration = field(default_factory=_Duration)
    compute_output: _Duration = field(default_factory=_Duration)


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
