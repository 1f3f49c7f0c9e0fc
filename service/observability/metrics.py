"""Prometheus metrics on a registry of our own, served on the metrics port (exposition.py).
Counters and histograms are updated as things happen; state the server already keeps
(queues, restarts, HTTP/3 counters, GPU memory) is read when Prometheus scrapes
(state_metrics.py)."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    ProcessCollector,
)
from prometheus_client.core import Metric

from service.inference.jobs import Timings
from service.observability.children import Children
from service.observability.exposition import metrics_app, serve
from service.observability.scrape_bounds import ScrapeLimits
from service.observability.state_metrics import StateCollector
from service.observability.summed import ReportedMetrics, Summed
from service.placement.topology import Topology
from service.registry.versions import ModelRegistry
from service.workers.model_metrics import SERVER_METRICS

log = logging.getLogger("paddlequic.metrics")

SECONDS_BUCKETS = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05,
    0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
)  # fmt: skip
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
UNKNOWN = "_unknown"  # the label value of every name from a request the server does not serve


class MetricsUnavailable(Exception):
    """The metrics port could not be bound."""


class Metrics:
    """Every metric the server exports."""

    def __init__(self, models: ModelRegistry, topology: Topology, process: bool = True) -> None:
        """`process`: with the process collector's families (process_*, this process's)."""
        self.child = Children()
        self.registry = CollectorRegistry()
        # What front-end processes report of the calls they serve, added on each scrape;
        # `refresh` (blocking, set with front-ends) asks each for its latest first.
        self.reported = ReportedMetrics()
        self.refresh: Callable[[], None] | None = None
        r = self.registry
        if process:
            ProcessCollector(registry=r)
        self.requests = Counter(
            "paddlequic_requests",
            "RPCs finished, by final status code",
            ["model", "version", "transport", "rpc", "code"],
            registry=r,
        )
        self.request_duration = Histogram(
            "paddlequic_request_duration_seconds",
            "RPC duration in the server, from the handler's start to its last response",
            ["model", "transport", "rpc"],
            buckets=SECONDS_BUCKETS,
            registry=r,
        )
        self.queue_duration = Histogram(
            "paddlequic_queue_duration_seconds",
            "wait of an inference request in the batch queue and for a worker slot",
            ["model"],
            buckets=SECONDS_BUCKETS,
            registry=r,
        )
        self.compute_duration = Histogram(
            "paddlequic_compute_duration_seconds",
            "predictor run time of one batch in its worker",
            ["model"],
            buckets=SECONDS_BUCKETS,
            registry=r,
        )
        self.batch_size = Histogram(
            "paddlequic_batch_size",
            "rows in each batch run by a worker",
            ["model"],
            buckets=BATCH_BUCKETS,
            registry=r,
        )
        self.inflight = Gauge(
            "paddlequic_inflight_requests", "RPCs being handled", ["transport"], registry=r
        )
        # Its model label needs no bounding: the lifecycle reports failures only for
        # directories of the repository (RepositoryModelLoad refuses other names first).
        self.load_failures = Counter(
            "paddlequic_model_load_failures",
            "models or versions that failed to load, by stage",
            ["model", "reason"],
            registry=r,
        )
        # Both labels are served model names (the manager only falls back to a served model).
        self.fallbacks = Counter(
            "paddlequic_fallbacks",
            "requests answered by the fallback model while their model's breaker was open",
            ["model", "fallback"],
            registry=r,
        )
        self.stream_stalls = Counter(
            "paddlequic_stream_stalls",
            "ModelStreamInfer streams ended because their caller took no response for "
            "--stream-stall-timeout while one waited",
            registry=r,
        )
        # A decoupled model's responses (model labels: served names only, from the registry).
        self.time_to_first_token = Histogram(
            "paddlequic_time_to_first_token_seconds",
            "a decoupled model's request: from reaching its model (waiting for a place included) "
            "to its first response taken",
            ["model"],
            buckets=SECONDS_BUCKETS,
            registry=r,
        )
        self.inter_token = Histogram(
            "paddlequic_inter_token_seconds",
            "between two consecutive responses of one decoupled request, as they were taken",
            ["model"],
            buckets=SECONDS_BUCKETS,
            registry=r,
        )
        self.generated_tokens = Counter(
            "paddlequic_generated_tokens",
            "data responses decoupled models sent (delivered or not: a cancelled request's "
            "stop growing once its model stops)",
            ["model"],
            registry=r,
        )
        self.active_generations = Gauge(
            "paddlequic_active_generations",
            "requests of decoupled models running in their model",
            ["model"],
            registry=r,
        )
        self.sequences = Counter(
            "paddlequic_sequences",
            "sequences of sequence-batched models, by what happened to them: start, end (its "
            "sequence_end ran, or its model failed it), expire (idle past "
            "max_sequence_idle_microseconds), lost (its worker died)",
            ["model", "event"],
            registry=r,
        )
        # --model-memory-budget (service/lifecycle/budget.py). Model labels: repository
        # directories only (a request loads only a model the registry offers).
        self.model_loads = Counter(
            "paddlequic_model_loads",
            "model loads under --model-memory-budget, by trigger: request (on demand), "
            "explicit (RepositoryModelLoad) or reload (a rescan)",
            ["model", "trigger"],
            registry=r,
        )
        self.model_evictions = Counter(
            "paddlequic_model_evictions",
            "models unloaded to make room within --model-memory-budget",
            ["model"],
            registry=r,
        )
        self.model_load_waits = Counter(
            "paddlequic_model_load_waits",
            "requests that waited for their model to load on demand",
            ["model"],
            registry=r,
        )
        self.model_memory = Gauge(
            "paddlequic_model_memory_bytes",
            "what each model in memory is charged against --model-memory-budget",
            ["model"],
            registry=r,
        )
        self.state = StateCollector(models, topology)
        r.register(self.state)
        self.names = ServedNames(lambda: ((v.name, str(v.version)) for v in models.all_versions()))

    @classmethod
    def frontend(cls, served: Callable[[], Iterable[tuple[str, str]]]) -> Metrics:
        """A front-end process's own, for the calls it serves itself, reported to the parent
        (summed.py): the same families, labelled with the versions it serves (`served`:
        (model, version number) pairs), none of the parent's state and no process_* families
        (the parent's describe the parent)."""
        metrics = cls(ModelRegistry(lambda: None), _NO_TOPOLOGY, process=False)
        metrics.names = ServedNames(served)
        return metrics

    def serve(self, host: str, port: int, limits: ScrapeLimits) -> Any:
        """Start the HTTP server in its own thread; returns it (`server_port`, `shutdown()`)."""
        try:
            app = metrics_app(
                Summed(self.registry, self.reported),
                SERVER_METRICS.families,
                _custom_families,
                self._refresh,
            )
            server = serve(host, port, app, limits)
        except OSError as exc:
            raise MetricsUnavailable(
                f"cannot serve metrics on {host}:{port}: {exc.strerror} "
                "(choose another --metrics-port, 0 for any, or --no-metrics)"
            ) from None
        return server

    def calls_seen(self) -> tuple[float, float]:
        """(RPCs finished, RPCs being handled): changes whenever a call may have moved any
        family of this registry but the process collector's."""
        finished = being_handled = 0.0
        for family in self.requests.collect():
            finished += sum(s.value for s in family.samples if s.name.endswith("_total"))
        for family in self.inflight.collect():
            being_handled += sum(s.value for s in family.samples)
        return finished, being_handled

    def observe_batch(self, model: str, rows: int, timings: Timings) -> None:
        self.child(self.batch_size, model).observe(rows)
        self.child(self.compute_duration, model).observe(timings.infer_ns / 1e9)

    def _refresh(self) -> None:
        if self.refresh is not None:
            self.refresh()


class ServedNames:
    """Label values for model names and versions taken from requests. Each distinct label
    value makes a new series for as long as the server runs, so only the models and versions
    the registry holds (from the repository) get their own; any other is `UNKNOWN`."""

    def __init__(self, served: Callable[[], Iterable[tuple[str, str]]]) -> None:
        """`served`: the (model, version number) pairs served now."""
        self._versions = served
        self._served: set[tuple[str, str]] = set()  # (model, "") and (model, version)

    def labels(self, model: str, version: str) -> tuple[str, str]:
        """("", "") stay as they are: calls that name no model or no version."""
        if model and not self._is_served(model, ""):
            return UNKNOWN, UNKNOWN if version else ""
        if version and not self._is_served(model, version):
            return model, UNKNOWN
        return model, version

    def _is_served(self, model: str, version: str) -> bool:
        key = (model, version)
        if key in self._served:
            return True
        found = any(name == model and version in ("", number) for name, number in self._versions())
        if found:
            self._served.add(key)
        return found


_NO_TOPOLOGY = Topology((), (), (), False, {})


def _custom_families() -> Iterator[Metric]:
    """Python models' own families (pb_utils.MetricFamily), named as the models named them,
    for the OpenMetrics writer (the text format writes them itself, exposition.py)."""
    for family in SERVER_METRICS.families():
        metric = Metric(family.name, family.description, family.kind)
        metric.name = family.name  # a counter keeps its name as given (Triton's)
        for labels, series in family.series.items():
            names = dict(labels)
            if family.kind != "histogram":
                metric.add_sample(family.name, names, series.value)
                continue
            cumulative = 0
            for bound, count in zip((*series.buckets, math.inf), series.counts, strict=True):
                cumulative += count
                le = "+Inf" if bound == math.inf else str(bound)
                metric.add_sample(f"{family.name}_bucket", {**names, "le": le}, cumulative)
            metric.add_sample(f"{family.name}_count", names, series.count)
            metric.add_sample(f"{family.name}_sum", names, series.value)
        yield metric
