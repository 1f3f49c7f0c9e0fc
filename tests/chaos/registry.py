"""Every attack of the suite, in the order it runs, with the outcomes that count as answered;
the rows marked so run against a second server with two front-end processes (`--frontends 2`),
and against a third whose batches the server forms, not its workers (`--no-instance-queues`)."""

from __future__ import annotations

from tests.chaos import (
    floods,
    frontends,
    generations,
    large_messages,
    malformed,
    messages,
    partial_messages,
    regions,
    rest,
    sequences,
    streams,
    workers,
)
from tests.chaos.harness import REFUSED, AttackSpec


def _both(*outcomes: str) -> frozenset[str]:
    return frozenset(f"{t} {o}" for t in ("h2", "h3") for o in outcomes)


# A stream may take every request (the server answered them; its memory is bounded by the RSS
# goal) or hold the writer back.
STREAM_HELD = (
    "wrote all, never read",
    "writes held back by flow control",
    "RESOURCE_EXHAUSTED",
    "CANCELLED",
)
REPLIES = frozenset(
    f"server replied {kind}" for kind in (*floods.LONG_HEADER_TYPES, "short header")
)

ATTACKS = (
    AttackSpec(
        "random model names",
        floods.random_names,
        frozenset({"NOT_FOUND"}),
    ),
    AttackSpec("never-reading streams", streams.never_reading_streams, _both(*STREAM_HELD)),
    AttackSpec(
        "oversized messages",
        messages.oversized_messages,
        _both("RESOURCE_EXHAUSTED", REFUSED),
    ),
    AttackSpec(
        "metadata bombs",
        messages.metadata_bombs,
        _both("RESOURCE_EXHAUSTED", "INVALID_ARGUMENT", "INTERNAL", REFUSED),
    ),
    AttackSpec("gzip bomb", malformed.gzip_bombs, _both("RESOURCE_EXHAUSTED")),
    AttackSpec("malformed protobuf flood", malformed.malformed_flood, _both("INVALID_ARGUMENT")),
    AttackSpec(
        "BYTES element bomb",
        messages.bytes_element_bombs,
        _both("INVALID_ARGUMENT"),
    ),
    AttackSpec(
        "large HTTP/3 messages in many DATA frames",
        large_messages.many_data_frames,
        frozenset({"h3 OK"}),
    ),
    AttackSpec(
        "many-connection partial messages (HTTP/3)",
        partial_messages.many_connection_partial_messages,
        frozenset({"h3 RESOURCE_EXHAUSTED", "h3 held, unfinished"}),
    ),
    AttackSpec(
        "HTTP/3 Initial flood",
        floods.initial_flood,
        REPLIES | {REFUSED},
    ),
    AttackSpec(
        "idle connections",
        floods.idle_connections,
        _both("connected", REFUSED, "UNAVAILABLE", "no answer"),
    ),
    AttackSpec(
        "/metrics connections held",
        floods.metrics_connections,
        frozenset({floods.METRICS_CLOSED_AT_ONCE, floods.METRICS_CLOSED_IN_TIME}),
    ),
    AttackSpec(
        "slow-reading HTTP/3 client",
        streams.slow_reader,
        frozenset({"read slowly, then cancelled", "RESOURCE_EXHAUSTED", "DEADLINE_EXCEEDED"}),
    ),
    AttackSpec(
        "worker SIGKILL under load",
        workers.worker_sigkill,
        frozenset({"killed", "replaced"}),
        under_load=True,
    ),
    AttackSpec(
        "model template SIGKILL under load",
        workers.template_sigkill,
        frozenset({"killed", "replaced"}),
        under_load=True,
    ),
    AttackSpec(
        "worker SIGSTOP under load",
        workers.worker_sigstop,
        frozenset({"stopped", "replaced"}),
        under_load=True,
    ),
    AttackSpec(
        "poison input",
        workers.poison_input,
        frozenset({"UNAVAILABLE", "INTERNAL", "INVALID_ARGUMENT"}),
    ),
    AttackSpec("hot reload under load", workers.hot_reload, frozenset({"OK"}), under_load=True),
    AttackSpec(
        "hot reload under load (--frontends 2)",
        workers.hot_reload,
        frozenset({"OK"}),
        frontends=2,
        under_load=True,
    ),
    AttackSpec(
        "preloaded launcher SIGKILL while a model loads",
        workers.launcher_sigkill,
        frozenset({"killed", "reload OK", "reload INTERNAL", "reload UNAVAILABLE"}),
    ),
    AttackSpec("fork bomb", workers.fork_bomb, frozenset({"RESOURCE_EXHAUSTED"})),
    AttackSpec(
        "memfd bomb",
        workers.memfd_bomb,
        frozenset({f"stopped at {workers.MEMFD_BOUND_MB} MiB"}),
    ),
    AttackSpec(
        "orphaned child",
        workers.orphaned_child,
        frozenset({"orphaned", "worker killed", "orphan ended with its worker"}),
    ),
    AttackSpec(
        "oversized worker message",
        workers.oversized_worker_message,
        frozenset({"INTERNAL", "replaced"}),
    ),
    AttackSpec("model output flood", workers.model_output_flood, frozenset({"OK"})),
    AttackSpec(
        "cancelled-stream storm (generation)",
        generations.cancelled_stream_storm,
        _both("cancelled after a token", "RESOURCE_EXHAUSTED"),
    ),
    AttackSpec(
        "stalled generation reader",
        generations.never_reading_generations,
        _both("held, never read", "good generation OK"),
    ),
    AttackSpec(
        "large-id amplification",
        generations.large_id_amplification,
        _both("INVALID_ARGUMENT"),
    ),
    AttackSpec(
        "generation worker SIGKILL mid-generation",
        generations.generation_worker_kill,
        frozenset({"killed", "replaced", "after restart OK"}) | _both("UNAVAILABLE"),
    ),
    AttackSpec(
        "abandoned sequences beyond the live bound",
        sequences.abandoned_sequences,
        # NOT_FOUND: a request naming a sequence that expired (or never started).
        frozenset({"OK", "RESOURCE_EXHAUSTED", "INVALID_ARGUMENT", "NOT_FOUND"}),
    ),
    AttackSpec(
        "region misuse",
        regions.region_misuse,
        _both("PERMISSION_DENIED", "NOT_FOUND", "unregistered nothing"),
    ),
    AttackSpec(
        "sequence hijack",
        sequences.sequence_hijack,
        frozenset({"NOT_FOUND", "ALREADY_EXISTS"}),
    ),
    AttackSpec(
        "REST slow clients (headers, bodies trickled)",
        rest.slow_clients,
        frozenset({rest.HEADERS_CUT, rest.BODY_408}),
        rest=True,
    ),
    AttackSpec(
        "REST oversized bodies (declared, streamed)",
        rest.oversized_bodies,
        frozenset({rest.DECLARED_400, rest.STREAMED_400}),
        rest=True,
    ),
    AttackSpec(
        "REST bodies holding the receive budget (stalled, JSON, chunked)",
        rest.held_bodies,
        rest.HELD,
        rest=True,
    ),
    AttackSpec("REST answers never read", rest.unread_answers, rest.UNREAD, rest=True),
    AttackSpec(
        "REST disconnect storm (infer, generate_stream)",
        rest.disconnect_storm,
        frozenset({*rest.VANISHED, rest.RESET}),
        rest=True,
    ),
    AttackSpec(
        "front-end SIGKILL under load (--frontends 2)",
        frontends.frontend_sigkill,
        frozenset({"killed", "replaced"}),
        frontends=2,
        retry_unavailable=True,
        under_load=True,
    ),
    AttackSpec(
        "random model names (--frontends 2)",
        floods.random_names,
        frozenset({"NOT_FOUND"}),
        frontends=2,
    ),
    AttackSpec(
        "oversized messages (--frontends 2)",
        messages.oversized_messages,
        _both("RESOURCE_EXHAUSTED", REFUSED),
        frontends=2,
    ),
    AttackSpec(
        "BYTES element bomb (--frontends 2)",
        messages.bytes_element_bombs,
        _both("INVALID_ARGUMENT"),
        frontends=2,
    ),
    AttackSpec(
        "never-reading streams (--frontends 2)",
        streams.never_reading_streams,
        _both(*STREAM_HELD),
        frontends=2,
    ),
    AttackSpec(
        "stalled generation reader (--frontends 2)",
        generations.never_reading_generations,
        _both("held, never read", "good generation OK"),
        frontends=2,
    ),
    AttackSpec(
        "generation worker SIGKILL mid-generation (--frontends 2)",
        generations.generation_worker_kill,
        frozenset({"killed", "replaced", "after restart OK"}) | _both("UNAVAILABLE"),
        frontends=2,
    ),
    AttackSpec(
        "region misuse (--frontends 2)",
        regions.region_misuse,
        _both("PERMISSION_DENIED", "NOT_FOUND", "unregistered nothing"),
        frontends=2,
    ),
    AttackSpec(
        "region churn (--frontends 2)",
        regions.region_churn,
        _both("Register OK", "Unregister OK"),
        frontends=2,
    ),
    AttackSpec(
        "sequence hijack (--frontends 2)",
        sequences.sequence_hijack,
        frozenset({"NOT_FOUND", "ALREADY_EXISTS"}),
        frontends=2,
    ),
    AttackSpec(
        "REST slow clients (headers, bodies trickled) (--frontends 2)",
        rest.slow_clients,
        frozenset({rest.HEADERS_CUT, rest.BODY_408}),
        frontends=2,
        rest=True,
    ),
    AttackSpec(
        "REST oversized bodies (declared, streamed) (--frontends 2)",
        rest.oversized_bodies,
        frozenset({rest.DECLARED_400, rest.STREAMED_400}),
        frontends=2,
        rest=True,
    ),
    AttackSpec(
        "REST bodies holding the receive budget (stalled, JSON, chunked) (--frontends 2)",
        rest.held_bodies,
        rest.HELD,
        frontends=2,
        rest=True,
    ),
    AttackSpec(
        "REST answers never read (--frontends 2)",
        rest.unread_answers,
        rest.UNREAD,
        frontends=2,
        rest=True,
    ),
    AttackSpec(
        "REST disconnect storm (infer, generate_stream) (--frontends 2)",
        rest.disconnect_storm,
        frozenset({*rest.VANISHED, rest.RESET}),
        frontends=2,
        rest=True,
    ),
    AttackSpec(
        "worker scribbles over its queues",
        workers.scribbled_queues,
        frozenset({"INTERNAL", "replaced"}),
    ),
    AttackSpec(
        "worker SIGKILL under load (--frontends 2)",
        workers.worker_sigkill,
        frozenset({"killed", "replaced"}),
        frontends=2,
        under_load=True,
    ),
    AttackSpec(
        "worker scribbles over its queues (--frontends 2)",
        workers.scribbled_queues,
        frozenset({"INTERNAL", "replaced"}),
        frontends=2,
    ),
    AttackSpec(
        "worker SIGKILL under load (--no-instance-queues)",
        workers.worker_sigkill,
        frozenset({"killed", "replaced"}),
        batcher=True,
        under_load=True,
    ),
)
