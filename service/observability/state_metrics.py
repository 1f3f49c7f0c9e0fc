"""The metrics of state the server already keeps (queues, sequences, breakers, worker
restarts, kills and CPU, HTTP/3 counters, GPU memory), read when Prometheus scrapes rather than
counted as things happen."""

from __future__ import annotations

import importlib
from collections.abc import Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from service.placement.topology import Topology
from service.registry.versions import ModelRegistry
from service.resilience.breaker import BreakerState
from service.workers.watchdog import process_cpu_s
from transport.h3.server_state import H3State


class StateCollector(Collector):
    """Read on scrape, in the HTTP server's thread: only plain reads of asyncio-owned state,
    copied before iterating."""

    def __init__(self, models: ModelRegistry, topology: Topology) -> None:
        self.models = models
        self.h3: H3State | None = None
        gpus = [g.index for g in topology.gpus] if not topology.simulated else []
        self._gpus = _NvmlMemory(gpus) if gpus else None

    def describe(self) -> Iterator[Metric]:
        """Every family collect() may yield, including those only a server with HTTP/3 or
        GPUs has (what dashboards and alerts may name)."""
        yield _queue_depth()
        yield _live_sequences()
        yield _breaker_state()
        yield _worker_restarts()
        yield _worker_breaches()
        yield _output_dropped()
        yield _worker_limit_kills()
        yield _worker_cpu()
        yield _h3_connections(0)
        yield _h3_handshakes()
        yield _gpu_memory()

    def collect(self) -> Iterator[Metric]:
        versions = list(self.models.all_versions())
        depth = _queue_depth()
        live = _live_sequences()
        restarts: dict[str, int] = {}
        breaches: dict[str, int] = {}
        dropped: dict[str, int] = {}
        limit_kills: dict[tuple[str, str], int] = {}
        for v in versions:
            queue = v.queue()
            depth.add_metric([v.name, str(v.version)], queue.queued if queue else 0)
            if v.sequences is not None:
                live.add_metric([v.name, str(v.version)], v.sequences.live)
            instances = list(v.instances)
            restarts[v.name] = restarts.get(v.name, 0) + sum(i.restarts for i in instances)
            breaches[v.name] = breaches.get(v.name, 0) + sum(i.refused_messages for i in instances)
            # The version's instances share one budget.
            outputs = {id(i.output): i.output for i in instances}
            dropped[v.name] = dropped.get(v.name, 0) + sum(o.dropped for o in outputs.values())
            for instance in instances:
                # A copy made in one step: the loop adds a limit at a worker's kill.
                for limit, count in dict(instance.limit_kills).items():
                    key = (v.name, limit)
                    limit_kills[key] = limit_kills.get(key, 0) + count
        yield depth
        yield live
        breakers = _breaker_state()
        for v in versions:
            current, _ = v.shown_breaker()
            for state in BreakerState:
                breakers.add_metric([v.name, str(v.version), state.value], state is current)
        yield breakers
        worker_restarts = _worker_restarts()
        for name, count in sorted(restarts.items()):
            worker_restarts.add_metric([name], count)
        yield worker_restarts
        worker_breaches = _worker_breaches()
        for name, count in sorted(breaches.items()):
            worker_breaches.add_metric([name], count)
        yield worker_breaches
        output_dropped = _output_dropped()
        for name, count in sorted(dropped.items()):
            output_dropped.add_metric([name], count)
        yield output_dropped
        kills = _worker_limit_kills()
        for labels, count in sorted(limit_kills.items()):
            kills.add_metric(list(labels), count)
        yield kills
        cpu = _worker_cpu()
        for v in versions:
            for instance in list(v.instances):
                if instance.pid:
                    named = [v.name, str(v.version), instance.spec.instance_name]
                    cpu.add_metric(named, process_cpu_s(instance.pid))
        yield cpu
        if self.h3 is not None:
            stats = self.h3.stats
            yield _h3_connections(stats.connections)
            handshakes = _h3_handshakes()
            for kind, count in sorted(dict(stats.handshakes).items()):
                handshakes.add_metric([kind], count)
            yield handshakes
        if self._gpus is not None:
            yield self._gpus.collect()


class _NvmlMemory:
    """GPU memory in use, by GPU index, through NVML (only built when GPUs were found)."""

    def __init__(self, indices: list[int]) -> None:
        self._nvml: Any = importlib.import_module("pynvml")
        self._nvml.nvmlInit()
        self._handles = {i: self._nvml.nvmlDeviceGetHandleByIndex(i) for i in indices}

    def collect(self) -> Metric:
        family = _gpu_memory()
        for index, handle in self._handles.items():
            family.add_metric([str(index)], self._nvml.nvmlDeviceGetMemoryInfo(handle).used)
        return family


def _queue_depth() -> GaugeMetricFamily:
    return GaugeMetricFamily(
        "paddlequic_queue_depth", "requests waiting in the batch queue", labels=["model", "version"]
    )


def _live_sequences() -> GaugeMetricFamily:
    return GaugeMetricFamily(
        "paddlequic_live_sequences",
        "sequences started and not yet ended, expired or lost, of each sequence-batched version",
        labels=["model", "version"],
    )


def _breaker_state() -> GaugeMetricFamily:
    return GaugeMetricFamily(
        "paddlequic_breaker_state",
        "circuit breaker of each model version: 1 for its current state (CLOSED, OPEN, HALF_OPEN)",
        labels=["model", "version", "state"],
    )


def _worker_restarts() -> CounterMetricFamily:
    return CounterMetricFamily(
        "paddlequic_worker_restarts", "worker processes restarted after dying", labels=["model"]
    )


def _worker_breaches() -> CounterMetricFamily:
    return CounterMetricFamily(
        "paddlequic_worker_protocol_breaches",
        "worker processes killed for breaking the worker protocol (a message larger than it "
        "may send, one the front-end cannot read); their requests failed, not retried",
        labels=["model"],
    )


def _output_dropped() -> CounterMetricFamily:
    return CounterMetricFamily(
        "paddlequic_model_output_dropped_lines",
        "lines a Python model printed beyond its budget (--model-output-lines, "
        "--model-output-bytes), dropped from the log",
        labels=["model"],
    )


def _worker_limit_kills() -> CounterMetricFamily:
    return CounterMetricFamily(
        "paddlequic_worker_limit_kills",
        "workers killed for going past a limit of their model's: memory (its cgroup's "
        "memory.max) or processes (python_child_processes); their requests failed with "
        "RESOURCE_EXHAUSTED, not retried",
        labels=["model", "limit"],
    )


def _worker_cpu() -> CounterMetricFamily:
    return CounterMetricFamily(
        "paddlequic_worker_cpu_seconds",
        "CPU time (user and system) of each instance's worker process, its children aside; "
        "it starts again from 0 when the worker is restarted, as a restarted process's does",
        labels=["model", "version", "instance"],
    )


def _h3_connections(count: int) -> CounterMetricFamily:
    return CounterMetricFamily(
        "paddlequic_h3_connections", "HTTP/3 connections accepted", value=count
    )


def _h3_handshakes() -> CounterMetricFamily:
    return CounterMetricFamily(
        "paddlequic_h3_handshakes",
        "HTTP/3 handshakes by kind (full, resumed, 0rtt_accepted), early requests held, and "
        "NEW_TOKEN address tokens issued and presented (new_token_*)",
        labels=["kind"],
    )


def _gpu_memory() -> GaugeMetricFamily:
    return GaugeMetricFamily(
        "paddlequic_gpu_memory_used_bytes", "GPU memory in use (all processes)", labels=["gpu"]
    )
